// The kernels' pieces that decode_forward's single parallel region (forward.cpp) runs itself:
// each works on the calling thread only, over the range it is given, on buffers the caller owns.
// The op entry points (linear_int4_packed, linear_bf16_packed, paged_attention) run the same
// pieces under their own parallel loops, so both paths compute the same values.
#pragma once

#include "vec.h"

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <vector>

namespace llm_forge {
namespace step {

// ---- INT4 weights, int8 activations (gemm_int4_dot.cpp) ----

// Rows of activations quantized per block, with their per-group sums: [M, K] int8, [M, K / block]
// scales, [M, K / group] sums.
struct Int4Rows {
  const int8_t* q;
  const float* a;
  const float* x_sums;
  int64_t K, blocks, groups;
};
int64_t int4_block(int64_t group);  // the activations' block for a weight group size
// One row of x (fp32 or bf16) quantized: q[K], a[K / block], x_sums[K / group].
template <typename T>
void int4_quantize_row(const T* x, int64_t K, int64_t group, int8_t* q, float* a, float* x_sums);
// Panels [p_begin, p_end) (32 output columns each) of y[M, N] = x . W^T + bias.
template <typename T>
void int4_panels(const Int4Rows& x, int64_t M, const uint8_t* packed, const at::Half* scale_offsets,
                 int64_t group, int64_t N, const float* bias, T* out, int64_t p_begin,
                 int64_t p_end);
int64_t int4_chunk(int64_t panels, int64_t threads);  // panels a thread claims at a time
// The layout checks linear_int4_packed makes (TORCH_CHECK).
void int4_check_layout(const at::Tensor& packed, const at::Tensor& scale_offsets,
                       int64_t group_size, int64_t N);

// ---- bf16 weights in tiles of 16 columns (gemm.cpp) ----

// Tiles [t_begin, t_end) of y[M, N] = x . W^T + bias, x as fp32 rows [M, K].
template <typename T>
void bf16_tiles(const float* x, int64_t M, int64_t K, const at::BFloat16* packed,
                int64_t num_tiles, int64_t N, const float* bias, T* out, int64_t t_begin,
                int64_t t_end);
int64_t bf16_chunk(int64_t tiles, int64_t threads);  // tiles a thread claims at a time
// The layout checks linear_bf16_packed makes for [tiles, K, 16] weights (TORCH_CHECK).
void bf16_check_layout(const at::Tensor& packed, int64_t N);
// Every packed bf16 layout's last check: its tiles of 16 columns hold exactly N outputs.
inline void bf16_check_tiles_fit(int64_t tiles, int64_t N) {
  TORCH_CHECK(N > (tiles - 1) * 16 && N <= tiles * 16, "N does not fit the tiles");
}
// One row as fp32, times the AWQ scale when given, rounded as torch rounds x * prequant.
template <typename T, typename P>
void widen_row(const T* x, const P* prequant, int64_t K, float* out);

// ---- bf16 weights in pairs ([tiles, K / 2, 16, 2]: gemm_bf16_dot.cpp, AVX-512 BF16) and on
// AMX tiles ([tiles, K / 32, 16, 16, 2]: gemm_bf16_amx.cpp), x as bf16 rows [M, K] ----

// The layout checks linear_bf16_pairs / linear_bf16_amx make (TORCH_CHECK): a contiguous bf16
// [tiles, K / 2, 16, 2] or [tiles, K / 32, 16, 16, 2] weight whose tiles fit N outputs. Return K.
int64_t bf16_pairs_check_layout(const at::Tensor& packed, int64_t N);
int64_t bf16_amx_check_layout(const at::Tensor& packed, int64_t N);
// Units of work: the pairs kernel's 4-tile groups and then its last tiles one by one; AMX's
// groups of up to 4 tiles. A chunk: the units a thread claims at a time.
int64_t bf16_pairs_units(int64_t num_tiles);
int64_t bf16_pairs_chunk(int64_t num_tiles, int64_t threads);
int64_t bf16_amx_units(int64_t num_tiles);
int64_t bf16_amx_chunk(int64_t groups, int64_t threads);
// Units [u_begin, u_end) of y[M, N] = x . W^T + bias (AMX: the tile state loaded and released
// on the calling thread).
template <typename T>
void bf16_pairs_range(const at::BFloat16* x, int64_t M, int64_t K, const at::BFloat16* packed,
                      int64_t num_tiles, int64_t N, const float* bias, T* out, int64_t u_begin,
                      int64_t u_end);
template <typename T>
void bf16_amx_range(const at::BFloat16* x, int64_t M, int64_t K, const at::BFloat16* packed,
                    int64_t num_tiles, int64_t N, const float* bias, T* out, int64_t u_begin,
                    int64_t u_end);

// ---- the KV cache ----

// Runs body(static_cast<C*>(nullptr)) with C the element type of the k and v caches, for
// activations of type T: T itself, or a one-byte cache (quant/kv_cache.py) holding int8 values
// (int8 tensors) or FP8 e4m3 bit patterns (uint8 tensors: torch's CPU index_copy_ has no float8
// kernel). Anything else is an error.
template <typename T, typename F>
void with_cache_type(const at::Tensor& k_cache, const at::Tensor& v_cache, const F& body) {
  const at::ScalarType type = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == type, "the k and v caches must share a dtype");
  if (type == at::kChar) {
    body(static_cast<int8_t*>(nullptr));
  } else if (type == at::kByte) {
    body(static_cast<fp8*>(nullptr));
  } else {
    TORCH_CHECK(type == c10::CppTypeToScalarType<T>::value, "the cache holds ", type,
                ": it must hold the activations' dtype (", c10::CppTypeToScalarType<T>::value,
                "), int8 or FP8 e4m3 (as uint8)");
    body(static_cast<T*>(nullptr));
  }
}

// ---- paged attention (attention.cpp) ----

struct Geometry {
  int64_t num_q_heads, num_kv_heads, D, tokens_per_block, max_blocks;
  int64_t q_row_stride, q_head_stride, kv_slot_stride;
  float scale;
  int64_t group() const { return num_q_heads / num_kv_heads; }
  int64_t partial_size() const { return group() * (2 + D); }  // per item: m, l, acc[D] per head
};

struct Item {
  int64_t row, kv_begin, kv_end, key_begin, key_end, seq;
  int64_t partial, head_stride;  // the first head's partial (in partials), the next's (floats)
};

// A step's attention work: which items (row, kv heads, part of the keys) there are and where
// their partial results go. It depends on the step's sequences only, so every layer shares it.
struct AttentionPlan {
  Geometry g;
  const int32_t* tables;  // the step's block tables, one row of max_blocks per sequence
  std::vector<Item> items;
  std::vector<int64_t> first;  // a (row, kv head)'s partials: first[i] .. first[i + 1]
  std::vector<float> parts;
  int64_t groups() const { return static_cast<int64_t>(first.size()) - 1; }
};
// Checks the tables' dtypes and shapes, the head geometry and every row's key count against its
// block table (TORCH_CHECK). `window` > 0: each row attends only its last `window` keys (a
// local attention layer).
AttentionPlan plan_attention(const Geometry& g, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, const at::Tensor& query_start,
                             int64_t threads, int64_t window = 0);
// Item i of the plan over a cache of C (see with_cache_type); a one-byte cache's values are
// stored / scale, its layer's k_scale and v_scale (1 for a cache in the activations' dtype).
template <typename T, typename C>
void attend_item(AttentionPlan& plan, const T* q, const C* k_cache, const C* v_cache, int64_t i,
                 float k_scale, float v_scale);
// Merge (row, kv head) group gi's parts and write its query heads' outputs into out [T, Hq, D].
template <typename T>
void merge_group(const AttentionPlan& plan, int64_t gi, T* out);

// ---- prefill attention (prefill_attention.cpp) ----

// A block of a sequence's query rows (relative to its first), for one kv head.
struct PrefillWork {
  int64_t seq, kv_head, row_begin, row_end;
  int64_t cost;  // lanes x keys, to hand out the dearest first
};
// A step's prefill chunks: sequence b owns rows [starts[b], starts[b+1]) of q and out, its keys
// are the first seq_lens[b] named by its block table. Depends on the chunks only, so every layer
// shares it.
struct PrefillPlan {
  Geometry g;
  const int32_t* tables;
  const int32_t* seq_lens;
  const int32_t* starts;
  std::vector<PrefillWork> work;
  int64_t window = 0;  // > 0: each row attends only its last `window` keys (a local layer)
};
// Checks the tables' dtypes and shapes, the head geometry, every chunk's rows and keys against
// its block table and every block against the cache's num_slots (TORCH_CHECK, naming them).
// `window` > 0: each row attends only its last `window` keys, its own included.
PrefillPlan plan_prefill(const Geometry& g, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, const at::Tensor& query_start,
                         int64_t num_slots, int64_t num_rows, int64_t threads,
                         int64_t window = 0);
// Work i of the plan: its rows' outputs written into out [rows, Hq, D] (contiguous), q and out
// from the plan's first row; a one-byte cache's k_scale and v_scale (else 1).
template <typename T, typename C>
void prefill_work(const PrefillPlan& plan, const T* q, const C* k_cache, const C* v_cache,
                  T* out, int64_t i, float k_scale, float v_scale);

}  // namespace step
}  // namespace llm_forge
