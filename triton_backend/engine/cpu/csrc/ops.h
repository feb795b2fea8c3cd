// The operators of the `llm_forge` library, as the C++ functions other kernels call directly.
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <vector>

namespace llm_forge {

// What every GEMM entry point prepares around its kernel: the bias widened to fp32 (or none),
// the [M, N] output (in x's dtype, or fp32 when asked) and the shape to view it as (x's, with N).
struct GemmOutput {
  at::Tensor bias_f, out;
  std::vector<int64_t> sizes;
  GemmOutput(const at::Tensor& x, const c10::optional<at::Tensor>& bias, int64_t M, int64_t N,
             bool fp32_out)
      : out(at::empty({M, N}, fp32_out ? x.options().dtype(at::kFloat) : x.options())),
        sizes(x.sizes().vec()) {
    if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();
    sizes.back() = N;
  }
  const float* bias() const { return bias_f.defined() ? bias_f.data_ptr<float>() : nullptr; }
  at::Tensor result() const { return out.view(sizes); }
};

// Columns [n0, n0 + n_valid) of one output row: the kernel's fp32 sums plus the bias, in T.
template <typename T>
inline void store_row(T* out, const float* values, const float* bias, int64_t n0,
                      int64_t n_valid) {
  for (int64_t j = 0; j < n_valid; ++j)
    out[n0 + j] = static_cast<T>(values[j] + (bias ? bias[n0 + j] : 0.f));
}

// fp32_out: the sums as they are, not rounded to x's dtype (logits that sampling compares).
at::Tensor linear_bf16_packed(const at::Tensor& x, const at::Tensor& packed,
                              const c10::optional<at::Tensor>& bias, int64_t N,
                              bool fp32_out = false);
// [tiles, K / 2, 16, 2] weights on bf16 dot-product instructions; linear_bf16_packed sends
// 4-D packed weights here.
at::Tensor linear_bf16_pairs(const at::Tensor& x, const at::Tensor& packed,
                             const c10::optional<at::Tensor>& bias, int64_t N, bool fp32_out);
bool bf16_dot_available();
// [tiles, K / 32, 16, 16, 2] weights (the pairs viewed as AMX B tiles) on AMX-BF16 tiles;
// linear_bf16_packed sends 5-D packed weights here.
at::Tensor linear_bf16_amx(const at::Tensor& x, const at::Tensor& packed,
                           const c10::optional<at::Tensor>& bias, int64_t N, bool fp32_out);
bool bf16_amx_available();
// x as fp32 rows [M, K], times the AWQ `prequant` scale when given (rounded as torch would).
at::Tensor widen_rows(const at::Tensor& x2, const c10::optional<at::Tensor>& prequant);
// INT4 weights in gemm_int4_dot.cpp's layout, int8 activations: [tiles, K / 8, 32] uint8 and fp16
// scales and offsets [tiles, K / group_size, 16].
at::Tensor linear_int4_packed(const at::Tensor& x, const at::Tensor& packed,
                              const at::Tensor& scale_offsets,
                              const c10::optional<at::Tensor>& prequant,
                              const c10::optional<at::Tensor>& bias, int64_t group_size, int64_t N);
// int8 weights per column and block of 32 inputs, int8 activations: [panels, K / 4, 128] uint8
// (the int8 values) and fp16 scales [panels, K / 32, 32].
at::Tensor linear_int8_packed(const at::Tensor& x, const at::Tensor& packed,
                              const at::Tensor& scales, int64_t N, bool fp32_out);
at::Tensor dequantize_int4_packed(const at::Tensor& packed, const at::Tensor& scale_offsets,
                                  int64_t group_size, int64_t N);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight,
                        double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
// The cache: in the activations' dtype, or one byte per element (int8, or FP8 e4m3 in uint8)
// stored as value / scale with the layer's k_scale and v_scale.
void rope_write_cache(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& sin, int64_t num_q_heads, int64_t num_kv_heads,
                      at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                      double k_scale = 1.0, double v_scale = 1.0);
at::Tensor gelu_tanh_mul(const at::Tensor& gate_up);
void qk_norm_(at::Tensor qkv, const at::Tensor& q_weight, const at::Tensor& k_weight,
              int64_t num_q_heads, int64_t num_kv_heads, double eps);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start,
                           int64_t tokens_per_block, double scale, double k_scale = 1.0,
                           double v_scale = 1.0, int64_t window = 0);
// The same contract for chunks of many query rows, blocked like a GEMM (prefill_attention.cpp),
// written into `out` (q's shape); `window` as paged_attention's.
void prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& block_tables,
                       const at::Tensor& seq_lens, const at::Tensor& query_start,
                       int64_t tokens_per_block, double scale, double k_scale = 1.0,
                       double v_scale = 1.0, int64_t window = 0);

// Each row's first maximal logit and its log probability; masked (row, id) pairs count as -inf.
std::tuple<at::Tensor, at::Tensor> greedy_pick(const at::Tensor& logits,
                                               at::IntArrayRef masked_rows,
                                               at::IntArrayRef masked_ids);

// out[i] += (x[i] @ a) @ b in place on a few rows (a LoRA delta: a = A^T, b = B^T, float32).
void lora_add_rows(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b);

// A mixture of experts' MLPs over the step's rows (moe.cpp): x [T, H], each row's top_k expert
// ids [T, top_k] (int64) and routing weights (x's dtype), every expert's gate_up and down stacked
// in one packed layout; returns [T, H], each row its experts' weighted sum.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& expert_ids,
                       const at::Tensor& expert_weights, const at::Tensor& gate_up,
                       const at::Tensor& down, int64_t intermediate);
bool moe_pairs_available();

// Whether decode_forward runs a step of these projections in its one parallel region (without
// LoRA rows or experts), for activations of that dtype; else it runs op by op.
bool decode_region_supported(const c10::List<c10::optional<at::Tensor>>& weights,
                             at::IntArrayRef kinds, at::ScalarType activations);
at::Tensor decode_forward(const at::Tensor& hidden, const at::Tensor& positions,
                          const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                          const at::Tensor& seq_lens, const at::Tensor& query_start,
                          const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                          const at::Tensor& v_cache,
                          const c10::List<c10::optional<at::Tensor>>& weights,
                          at::IntArrayRef kinds, at::IntArrayRef out_features,
                          at::IntArrayRef group_sizes, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, int64_t tokens_per_block, double eps, double scale,
                          const c10::List<c10::optional<at::Tensor>>& lora,
                          at::IntArrayRef lora_runs,
                          const c10::List<c10::optional<at::Tensor>>& layer_extras,
                          at::IntArrayRef routing, bool single_region,
                          const c10::optional<at::Tensor>& kv_scales,
                          const c10::optional<at::Tensor>& prefill_block_tables,
                          const c10::optional<at::Tensor>& prefill_seq_lens,
                          const c10::optional<at::Tensor>& prefill_query_start,
                          const c10::optional<at::Tensor>& local_cos,
                          const c10::optional<at::Tensor>& local_sin, at::IntArrayRef windows,
                          bool gelu);

}  // namespace llm_forge
