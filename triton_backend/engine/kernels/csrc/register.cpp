// The torch operator library `llm_forge`: torch.ops.llm_forge.<name> once the library is loaded.
#include <ATen/ATen.h>
#include <torch/library.h>

namespace llm_forge {

at::Tensor linear_bf16_packed(const at::Tensor& x, const at::Tensor& packed,
                              const c10::optional<at::Tensor>& bias, int64_t N);
at::Tensor linear_int4_packed(const at::Tensor& x, const at::Tensor& packed,
                              const at::Tensor& scales, const c10::optional<at::Tensor>& prequant,
                              const c10::optional<at::Tensor>& bias, int64_t group_size, int64_t N);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight,
                        double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
void rope_write_cache(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& sin, int64_t num_q_heads, int64_t num_kv_heads,
                      at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start,
                           int64_t tokens_per_block, double scale);

at::Tensor decode_forward(const at::Tensor& hidden, const at::Tensor& positions,
                          const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                          const at::Tensor& seq_lens, const at::Tensor& query_start,
                          const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                          const at::Tensor& v_cache,
                          const c10::List<c10::optional<at::Tensor>>& weights,
                          at::IntArrayRef kinds, at::IntArrayRef out_features,
                          at::IntArrayRef group_sizes, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, int64_t tokens_per_block, double eps, double scale);

}  // namespace llm_forge

TORCH_LIBRARY(llm_forge, m) {
  m.def("linear_bf16_packed(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor",
        &llm_forge::linear_bf16_packed);
  m.def("linear_int4_packed(Tensor x, Tensor packed, Tensor scales, Tensor? prequant, "
        "Tensor? bias, int group_size, int n) -> Tensor", &llm_forge::linear_int4_packed);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &llm_forge::rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor",
        &llm_forge::add_rms_norm);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &llm_forge::silu_mul);
  m.def("rope_write_cache(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, "
        "int num_q_heads, int num_kv_heads, Tensor(b!) k_cache, Tensor(c!) v_cache, "
        "Tensor slot_mapping) -> ()", &llm_forge::rope_write_cache);
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start, int tokens_per_block, float scale) -> Tensor",
        &llm_forge::paged_attention);
  m.def("decode_forward(Tensor hidden, Tensor positions, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start, Tensor cos, Tensor sin, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor?[] weights, int[] kinds, "
        "int[] out_features, int[] group_sizes, int num_heads, int num_kv_heads, int head_dim, "
        "int tokens_per_block, float eps, float scale) -> Tensor", &llm_forge::decode_forward);
}
