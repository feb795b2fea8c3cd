// Fused per-layer ops of the decoder: RMSNorm (with the residual add folded in), SiLU(gate) * up
// and GELU-tanh(gate) * up, and rotary embedding with the KV-cache write folded in.
//
// Each replaces several torch ops (and their per-op dispatch cost) with one pass over the rows,
// and rounds where the torch ops round (an intermediate stored as bf16 is rounded as bf16 here
// too), so a bf16 engine computes what its pure-torch path computes, up to fp32 summation order.
#include "layer_rows.h"
#include "step.h"
#include "vec.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <type_traits>

namespace llm_forge {
namespace {

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, double eps) {
  const int64_t H = x.size(-1), rows = x.numel() / H;
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      layer_row::rms_norm(xp + r * H, wp, op + r * H, H, (float)eps);
  });
}

// Each query and key head of each row normed in place (QK-norm: Qwen3, Gemma 3): no split of
// q / k out of the fused projection, no copy back.
template <typename T>
void qk_norm_impl(at::Tensor& qkv, const at::Tensor& qw, const at::Tensor& kw, int64_t Hq,
                  int64_t Hkv, double eps) {
  const int64_t D = qw.size(0), rows = qkv.size(0), width = qkv.size(1), heads = Hq + Hkv;
  T* p = qkv.data_ptr<T>();
  const T* qwp = qw.data_ptr<T>();
  const T* kwp = kw.data_ptr<T>();
  at::parallel_for(0, rows * heads, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t r = i / heads, h = i % heads;
      T* x = p + r * width + h * D;
      layer_row::rms_norm(x, h < Hq ? qwp : kwp, x, D, (float)eps);
    }
  });
}

template <typename T>
void add_rms_norm_impl(const at::Tensor& x, at::Tensor& residual, const at::Tensor& w,
                       at::Tensor& out, double eps) {
  const int64_t H = x.size(-1), rows = x.numel() / H;
  const T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      layer_row::add_rms_norm(xp + r * H, rp + r * H, wp, op + r * H, H, (float)eps);
  });
}

template <typename T, bool Gelu>
void gated_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t I = out.size(-1), rows = out.numel() / I;
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      if constexpr (Gelu) layer_row::gelu_tanh_mul(gp + r * 2 * I, op + r * I, I);
      else layer_row::silu_mul(gp + r * 2 * I, op + r * I, I);
    }
  });
}


// Rotate q and k of each token in place (rotate-half form, as Llama) and write k and v into the
// layer's cache at the token's slot (quantized with the layer's scales for a one-byte cache).
// cos/sin rows are fp32 [max_positions, D] with both halves equal; torch casts them to the
// activation dtype first, and so do we.
template <typename T>
void rope_write_cache_impl(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                           const at::Tensor& sin, int64_t num_q_heads, int64_t num_kv_heads,
                           at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                           float k_scale, float v_scale) {
  const int64_t T_ = qkv.size(0), D = cos.size(1);
  const int64_t row = qkv.stride(0);
  T* base = qkv.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t kv_stride = num_kv_heads * D;
  step::with_cache_type<T>(k_cache, v_cache, [&](auto* tag) {
    using C = std::remove_pointer_t<decltype(tag)>;
    C* kc = static_cast<C*>(k_cache.data_ptr());
    C* vc = static_cast<C*>(v_cache.data_ptr());
    at::parallel_for(0, T_, 4, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t)
        layer_row::rope_write(base + t * row, cp + pos[t] * D, sp + pos[t] * D, num_q_heads,
                              num_kv_heads, D, kc + slot[t] * kv_stride, vc + slot[t] * kv_stride,
                              k_scale, v_scale);
    });
  });
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              name, " must be bf16 or fp32");
}

template <bool Gelu>
at::Tensor gated_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  auto sizes = gate_up.sizes().vec();
  TORCH_CHECK(sizes.back() % 2 == 0, "gate_up must have an even last dimension");
  sizes.back() /= 2;
  at::Tensor out = at::empty(sizes, gate_up.options());
  if (gate_up.scalar_type() == at::kBFloat16) gated_mul_impl<at::BFloat16, Gelu>(gate_up, out);
  else gated_mul_impl<float, Gelu>(gate_up, out);
  return out;
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous(),
              "weight must match x");
  at::Tensor out = at::empty_like(x);
  if (x.scalar_type() == at::kBFloat16) rms_norm_impl<at::BFloat16>(x, weight, out, eps);
  else rms_norm_impl<float>(x, weight, out, eps);
  return out;
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight,
                        double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && residual.scalar_type() == x.scalar_type(),
              "x, residual and weight must share a dtype");
  at::Tensor out = at::empty_like(x);
  if (x.scalar_type() == at::kBFloat16) add_rms_norm_impl<at::BFloat16>(x, residual, weight, out, eps);
  else add_rms_norm_impl<float>(x, residual, weight, out, eps);
  return out;
}

void qk_norm_(at::Tensor qkv, const at::Tensor& q_weight, const at::Tensor& k_weight,
              int64_t num_q_heads, int64_t num_kv_heads, double eps) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(qkv.dim() == 2 && q_weight.is_contiguous() && k_weight.is_contiguous() &&
                  q_weight.scalar_type() == qkv.scalar_type() &&
                  k_weight.scalar_type() == qkv.scalar_type() &&
                  q_weight.numel() == k_weight.numel() &&
                  qkv.size(1) == (num_q_heads + 2 * num_kv_heads) * q_weight.numel(),
              "qk_norm_: qkv [T, (Hq + 2 Hkv) D] and weights [D] of its dtype");
  if (qkv.scalar_type() == at::kBFloat16)
    qk_norm_impl<at::BFloat16>(qkv, q_weight, k_weight, num_q_heads, num_kv_heads, eps);
  else
    qk_norm_impl<float>(qkv, q_weight, k_weight, num_q_heads, num_kv_heads, eps);
}

at::Tensor silu_mul(const at::Tensor& gate_up) { return gated_mul<false>(gate_up); }

at::Tensor gelu_tanh_mul(const at::Tensor& gate_up) { return gated_mul<true>(gate_up); }

void rope_write_cache(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& sin, int64_t num_q_heads, int64_t num_kv_heads,
                      at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                      double k_scale, double v_scale) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous(), "cos/sin must be contiguous fp32");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong,
              "positions and slot_mapping must be int64");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the cache must be contiguous");
  TORCH_CHECK(qkv.size(1) == (num_q_heads + 2 * num_kv_heads) * cos.size(1), "qkv width");
  if (qkv.scalar_type() == at::kBFloat16)
    rope_write_cache_impl<at::BFloat16>(qkv, positions, cos, sin, num_q_heads, num_kv_heads,
                                        k_cache, v_cache, slot_mapping, k_scale, v_scale);
  else
    rope_write_cache_impl<float>(qkv, positions, cos, sin, num_q_heads, num_kv_heads, k_cache,
                                 v_cache, slot_mapping, k_scale, v_scale);
}

}  // namespace llm_forge
