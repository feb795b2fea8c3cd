// The torch operator library `llm_forge`: torch.ops.llm_forge.<name> once the library is loaded.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(llm_forge, m) {
  m.def("linear_bf16_packed(Tensor x, Tensor packed, Tensor? bias, int n, bool fp32_out=False) "
        "-> Tensor",
        &llm_forge::linear_bf16_packed);
  m.def("bf16_dot_available() -> bool", &llm_forge::bf16_dot_available);
  m.def("bf16_amx_available() -> bool", &llm_forge::bf16_amx_available);
  m.def("linear_int4_packed(Tensor x, Tensor packed, Tensor scale_offsets, Tensor? prequant, "
        "Tensor? bias, int group_size, int n) -> Tensor", &llm_forge::linear_int4_packed);
  m.def("linear_int8_packed(Tensor x, Tensor packed, Tensor scales, int n, bool fp32_out=False) "
        "-> Tensor", &llm_forge::linear_int8_packed);
  m.def("dequantize_int4_packed(Tensor packed, Tensor scale_offsets, int group_size, int n) "
        "-> Tensor",
        &llm_forge::dequantize_int4_packed);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &llm_forge::rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor",
        &llm_forge::add_rms_norm);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &llm_forge::silu_mul);
  m.def("gelu_tanh_mul(Tensor gate_up) -> Tensor", &llm_forge::gelu_tanh_mul);
  m.def("qk_norm_(Tensor(a!) qkv, Tensor q_weight, Tensor k_weight, int num_q_heads, "
        "int num_kv_heads, float eps) -> ()", &llm_forge::qk_norm_);
  m.def("rope_write_cache(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, "
        "int num_q_heads, int num_kv_heads, Tensor(b!) k_cache, Tensor(c!) v_cache, "
        "Tensor slot_mapping, float k_scale=1.0, float v_scale=1.0) -> ()",
        &llm_forge::rope_write_cache);
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start, int tokens_per_block, float scale, "
        "float k_scale=1.0, float v_scale=1.0, int window=0) -> Tensor",
        &llm_forge::paged_attention);
  m.def("prefill_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start, int tokens_per_block, "
        "float scale, float k_scale=1.0, float v_scale=1.0, int window=0) -> ()",
        &llm_forge::prefill_attention);
  m.def("greedy_pick(Tensor logits, int[] masked_rows, int[] masked_ids) -> (Tensor, Tensor)",
        &llm_forge::greedy_pick);
  m.def("lora_add_rows(Tensor(a!) out, Tensor x, Tensor a, Tensor b) -> ()",
        &llm_forge::lora_add_rows);
  m.def("moe_experts(Tensor x, Tensor expert_ids, Tensor expert_weights, Tensor gate_up, "
        "Tensor down, int intermediate) -> Tensor", &llm_forge::moe_experts);
  m.def("moe_pairs_available() -> bool", &llm_forge::moe_pairs_available);
  m.def("decode_region_supported(Tensor?[] weights, int[] kinds, ScalarType activations) -> bool",
        &llm_forge::decode_region_supported);
  m.def("decode_forward(Tensor hidden, Tensor positions, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start, Tensor cos, Tensor sin, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor?[] weights, int[] kinds, "
        "int[] out_features, int[] group_sizes, int num_heads, int num_kv_heads, int head_dim, "
        "int tokens_per_block, float eps, float scale, Tensor?[] lora, int[] lora_runs, "
        "Tensor?[] layer_extras, int[] routing, bool single_region=True, "
        "Tensor? kv_scales=None, Tensor? prefill_block_tables=None, "
        "Tensor? prefill_seq_lens=None, Tensor? prefill_query_start=None, "
        "Tensor? local_cos=None, Tensor? local_sin=None, int[] windows=[], bool gelu=False) "
        "-> Tensor",
        &llm_forge::decode_forward);
}
