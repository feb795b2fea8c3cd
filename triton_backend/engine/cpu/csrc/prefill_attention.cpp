// Prefill attention over the paged KV cache, read in place: causal, GQA, for chunks of two query
// rows or more (a prompt's first chunk, a chunk deep in a prompt or after a prefix-cache hit, a
// decode with its draft tokens).
//
// Same contract as paged_attention (attention.cpp): packed queries, sequence b owns rows
// [query_start[b], query_start[b+1]), its keys are the first seq_lens[b] entries named by its block
// table (the new tokens' keys already written), and a row sees the keys up to its own position.
// The paged kernel reads every key once per row and splits a row's keys over threads, which suits
// decodes; here the rows of a chunk share each key, so the work is blocked like a GEMM instead:
// a work item is a block of query rows of one kv head (prefill_item.h), its rows times the query
// heads of that kv head make the lanes (position-major, so a lane tile spans few positions and
// the causal edge skips whole tiles), and keys stream past in blocks of kKeyBlock with an online
// softmax (flash attention). Q.K^T and P.V run on the GEMM's instructions: AMX tiles where the
// build has AMX-BF16, the process was granted the tile state, the activations are bf16 and the
// head dim a multiple of 32 (prefill_tiles_amx.h); else vdpbf16ps where the build has AVX-512
// BF16 and the activations are bf16 (prefill_tiles_dot.h), 8-lane FMAs otherwise
// (prefill_tiles.h).
//
// A local layer's rows (`window` > 0) see only their last `window` keys: an item starts at the key
// block holding its first row's first key, and a lane tile skips the blocks before its window.
//
// A row's result depends only on its own query and keys: the key blocks sit at multiples of
// kKeyBlock for every row, a block past a row's position or before its window changes nothing of
// it (its probabilities are exactly 0 and its alpha exactly 1, or, before any key it sees, its
// state stays the initial one), and every sum of a lane runs in one order. So a row gives the
// same values whatever chunk, step or item it is computed in.
//
// A one-byte cache (int8, FP8 e4m3) is widened as it is read (exactly, to bf16 on the dot path),
// the key scale folded into the scores' scale and the value scale applied to the output.
#include "ops.h"
#include "prefill_item.h"
#include "step.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <type_traits>
#include <vector>

namespace llm_forge {
namespace {

using prefill::Call;
using prefill::ceil_div;
using prefill::WidenTiles;
using prefill::WorkItem;
using step::Geometry;
using step::PrefillWork;
constexpr int64_t kItemLanes = 96;   // lanes an item aims for (rows x query heads of a kv head)
constexpr int64_t kMinItemLanes = 16;
constexpr int64_t kMaxHeadDim = 512;

// One sequence's rows in blocks of `rows` per kv head, costed by lanes x keys.
void add_work(std::vector<PrefillWork>& work, int64_t seq, int64_t n_q, int64_t seq_len,
              int64_t rows, int64_t num_kv_heads, int64_t window) {
  for (int64_t r0 = 0; r0 < n_q; r0 += rows) {
    const int64_t r1 = std::min(n_q, r0 + rows);
    int64_t keys = seq_len - n_q + r1;  // the block's last row sees keys up to this one
    if (window > 0) keys = std::min(keys, window + r1 - r0);
    for (int64_t h = 0; h < num_kv_heads; ++h) work.push_back({seq, h, r0, r1, (r1 - r0) * keys});
  }
}

// The rows per item: about kItemLanes lanes, fewer while the step would give the threads under
// four items each (a short chunk deep in a prompt is then still spread over every thread).
int64_t rows_per_item(const Geometry& g, const int32_t* starts, int64_t num_seqs, int64_t threads) {
  const int64_t G = g.group();
  int64_t rows = ceil_div(kItemLanes, G);
  const int64_t least = ceil_div(kMinItemLanes, G);
  for (;;) {
    int64_t items = 0;
    for (int64_t b = 0; b < num_seqs; ++b) items += ceil_div(starts[b + 1] - starts[b], rows);
    if (rows <= least || items * g.num_kv_heads >= 4 * threads) return rows;
    rows = std::max(least, ceil_div(rows, 2));
  }
}

// Every sequence's rows, keys and block-table entries within bounds (TORCH_CHECK, naming them).
void check_sequences(const int32_t* tables, const int32_t* seq_lens, const int32_t* starts,
                     int64_t num_seqs, int64_t max_blocks, int64_t tokens_per_block,
                     int64_t num_slots, int64_t num_rows) {
  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] == num_rows, "query_start must run from 0 to ",
              num_rows, " (q's rows), got ", starts[0], " .. ", starts[num_seqs]);
  const int64_t num_blocks = num_slots / tokens_per_block;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t n_q = starts[b + 1] - starts[b];
    TORCH_CHECK(n_q >= 0 && n_q <= seq_lens[b], "sequence ", b, ": ", n_q,
                " query rows must be at least 0 and at most seq_lens[b] = ", seq_lens[b]);
    TORCH_CHECK(seq_lens[b] <= max_blocks * tokens_per_block, "sequence ", b, ": seq_lens ",
                seq_lens[b], " is over its block table's ", max_blocks * tokens_per_block, " keys");
    if (n_q == 0) continue;
    for (int64_t i = 0; i < ceil_div(seq_lens[b], tokens_per_block); ++i) {
      const int32_t block = tables[b * max_blocks + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "sequence ", b, ": block_tables entry ", i,
                  " is ", block, ", outside the cache's ", num_blocks, " blocks");
    }
  }
}

}  // namespace

namespace step {

PrefillPlan plan_prefill(const Geometry& g, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, const at::Tensor& query_start,
                         int64_t num_slots, int64_t num_rows, int64_t threads, int64_t window) {
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous() &&
                  query_start.is_contiguous(),
              "block_tables [B, max_blocks], seq_lens and query_start must be contiguous int32");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(query_start.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs,
              "query_start must have B + 1 entries and block_tables B rows, B = ", num_seqs);
  TORCH_CHECK(g.tokens_per_block >= 1, "tokens_per_block must be at least 1");
  TORCH_CHECK(g.D >= 1 && g.D <= kMaxHeadDim, "head_dim must be 1 .. ", kMaxHeadDim, ", got ",
              g.D);
  TORCH_CHECK(g.num_kv_heads >= 1 && g.num_q_heads % g.num_kv_heads == 0, "query heads (",
              g.num_q_heads, ") must be a multiple of kv heads (", g.num_kv_heads, ")");
  TORCH_CHECK(window >= 0, "window must be 0 (every key) or more, got ", window);
  PrefillPlan plan{g, block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                   query_start.data_ptr<int32_t>(), {}, window};
  check_sequences(plan.tables, plan.seq_lens, plan.starts, num_seqs, g.max_blocks,
                  g.tokens_per_block, num_slots, num_rows);
  const int64_t rows = rows_per_item(g, plan.starts, num_seqs, threads);
  for (int64_t b = 0; b < num_seqs; ++b)
    add_work(plan.work, b, plan.starts[b + 1] - plan.starts[b], plan.seq_lens[b], rows,
             g.num_kv_heads, window);
  // The dearest first, so the cheap ones fill in at the end of the region.
  std::stable_sort(plan.work.begin(), plan.work.end(),
                   [](const PrefillWork& a, const PrefillWork& b) { return a.cost > b.cost; });
  return plan;
}

template <typename T, typename C>
void prefill_work(const PrefillPlan& plan, const T* q, const C* k_cache, const C* v_cache,
                  T* out, int64_t i, float k_scale, float v_scale) {
  thread_local std::vector<float> buf;
  const Call<T, C> call{q, k_cache, v_cache, out, plan.tables, plan.seq_lens, plan.starts,
                        k_scale, v_scale};
#ifdef LLM_FORGE_PREFILL_AMX
  if constexpr (std::is_same<T, bf16>::value) {
    if (plan.g.D % 32 == 0 && bf16_amx_available()) {
      static const prefill::AmxTiles::Config config;
      _tile_loadconfig(&config);
      WorkItem<prefill::AmxTiles, T, C>(plan.g, call, plan.work[i], plan.window, buf).run();
      _tile_release();
      return;
    }
  }
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (std::is_same<T, bf16>::value) {
    if (plan.g.D % 2 == 0)
      return WorkItem<prefill::DotTiles, T, C>(plan.g, call, plan.work[i], plan.window, buf)
          .run();
  }
#endif
  WorkItem<WidenTiles, T, C>(plan.g, call, plan.work[i], plan.window, buf).run();
}
#define LLM_FORGE_PREFILL_WORK(T, C)                                                            \
  template void prefill_work(const PrefillPlan&, const T*, const C*, const C*, T*, int64_t, \
                             float, float);
LLM_FORGE_PREFILL_WORK(float, float)
LLM_FORGE_PREFILL_WORK(float, int8_t)
LLM_FORGE_PREFILL_WORK(float, fp8)
LLM_FORGE_PREFILL_WORK(bf16, bf16)
LLM_FORGE_PREFILL_WORK(bf16, int8_t)
LLM_FORGE_PREFILL_WORK(bf16, fp8)
#undef LLM_FORGE_PREFILL_WORK

}  // namespace step

void prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& block_tables,
                       const at::Tensor& seq_lens, const at::Tensor& query_start,
                       int64_t tokens_per_block, double scale, double k_scale, double v_scale,
                       int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, Hq, D] with unit last stride");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat,
              "q must be bf16 or fp32, got ", q.scalar_type());
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() &&
                  out.is_contiguous(),
              "out must be a contiguous tensor of q's shape and dtype");
  const int64_t D = q.size(2);
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(2) == D && k_cache.stride(2) == 1 &&
                  k_cache.stride(1) == D && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.strides() == k_cache.strides(),
              "k_cache and v_cache must be [slots, Hkv, D] alike, each slot's heads contiguous");
  const Geometry g{q.size(1), k_cache.size(1), D, tokens_per_block, block_tables.size(1),
                   q.stride(0), q.stride(1), k_cache.stride(0), static_cast<float>(scale)};
  const step::PrefillPlan plan =
      step::plan_prefill(g, block_tables, seq_lens, query_start, k_cache.size(0), q.size(0),
                         at::get_num_threads(), window);
  auto run = [&](auto* activations) {
    using T = std::remove_pointer_t<decltype(activations)>;
    step::with_cache_type<T>(k_cache, v_cache, [&](auto* tag) {
      using C = std::remove_pointer_t<decltype(tag)>;
      const auto* kp = static_cast<const C*>(k_cache.data_ptr());
      const auto* vp = static_cast<const C*>(v_cache.data_ptr());
      parallel_chunks(static_cast<int64_t>(plan.work.size()), 1, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i)
          step::prefill_work(plan, q.data_ptr<T>(), kp, vp, out.data_ptr<T>(), i,
                             static_cast<float>(k_scale), static_cast<float>(v_scale));
      });
    });
  };
  if (q.scalar_type() == at::kFloat) run(static_cast<float*>(nullptr));
  else run(static_cast<bf16*>(nullptr));
}

}  // namespace llm_forge
