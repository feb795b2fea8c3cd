// All decoder layers of a decode step in one call: the same kernels the Python model calls one by
// one (norms, projections, rotary + KV write, paged attention, SiLU * up), without a Python
// round trip per op. It covers steps whose every row is attended by the paged kernel (decodes
// and short chunks) over a cache in the activation dtype, with projections of four kinds:
// packed bf16, packed INT4 (ours, or torch's int4pack where the plan measured it faster), or a
// dense weight in the activation dtype. LoRA adapters of the step's rows are added after each
// projection, as `lora/batch.py` adds them in the Python model, with the same kernels. Everything
// else takes the Python model (`model.py`), which stays the reference: tests hold the two to
// each other.
#include "ops.h"

namespace llm_forge {

namespace {

enum LinearKind : int64_t { kPackedBf16 = 0, kPackedInt4 = 1, kDense = 2, kTorchInt4 = 3 };
// weights: per layer [input norm, post norm, then per projection (qkv, dense, gate_up, proj):
// weight, scales, prequant, bias], then the final norm.
constexpr int64_t kSlotsPerLinear = 4;
constexpr int64_t kSlotsPerLayer = 2 + 4 * kSlotsPerLinear;

// LoRA: per layer, projection and run of rows, four slots: A^T [in, r] and B^T [r, out] in
// float32, then A and B packed for the bf16 kernel when the run takes it (else empty). An empty
// first slot: the run's adapter leaves that projection alone.
constexpr int64_t kLoraSlotsPerRun = 4;
// Runs below this many rows take lora_add_rows (lora/batch.py's PACKED_MIN_ROWS: the same choice).
constexpr int64_t kLoraFewRows = 4;

using Weights = c10::List<c10::optional<at::Tensor>>;

at::Tensor required(const Weights& weights, int64_t index) {
  c10::optional<at::Tensor> t = weights.get(index);
  TORCH_CHECK(t.has_value(), "decode_forward: weight slot ", index, " is empty");
  return *t;
}

at::Tensor project(const at::Tensor& x, const Weights& weights, int64_t slot, int64_t kind,
                   int64_t out_features, int64_t group_size) {
  const at::Tensor weight = required(weights, slot);
  const c10::optional<at::Tensor> bias = weights.get(slot + 3);
  switch (kind) {
    case kPackedBf16:
      return linear_bf16_packed(x, weight, bias, out_features, false);
    case kPackedInt4:
      return linear_int4_packed(x, weight, required(weights, slot + 1), weights.get(slot + 2),
                                bias, group_size, out_features);
    case kDense:
      return at::linear(x, weight, bias);
    case kTorchInt4: {
      // As Int4WeightOnlyLinear does it: AWQ scale in the activation dtype, torch's kernel in
      // bf16, the bias added in the activation dtype.
      const c10::optional<at::Tensor> prequant = weights.get(slot + 2);
      at::Tensor in = prequant.has_value() ? x * prequant->to(x.scalar_type()) : x;
      at::Tensor y = at::_weight_int4pack_mm_for_cpu(in.to(at::kBFloat16).contiguous(), weight,
                                                     group_size, required(weights, slot + 1))
                         .to(x.scalar_type());
      return bias.has_value() ? y + bias->to(y.scalar_type()) : y;
    }
    default:
      TORCH_CHECK(false, "decode_forward: unknown projection kind ", kind);
  }
}

// out[rows of each run] += in[rows] @ A^T @ B^T, in place.
void add_lora(const at::Tensor& in, at::Tensor& out, const Weights& lora, at::IntArrayRef runs,
              int64_t projection) {
  const int64_t num_runs = static_cast<int64_t>(runs.size()) / 2;
  for (int64_t r = 0; r < num_runs; ++r) {
    const int64_t slot = (projection * num_runs + r) * kLoraSlotsPerRun;
    const c10::optional<at::Tensor> a = lora.get(slot);
    if (!a.has_value()) continue;
    const int64_t start = runs[2 * r], rows = runs[2 * r + 1] - start;
    const at::Tensor xs = rows == in.size(0) ? in : in.narrow(0, start, rows);
    const c10::optional<at::Tensor> a_packed = lora.get(slot + 2);
    at::Tensor target = rows == out.size(0) ? out : out.narrow(0, start, rows);
    if (!a_packed.has_value() && rows < kLoraFewRows) {
      lora_add_rows(target, xs, *a, required(lora, slot + 1));
      continue;
    }
    at::Tensor delta;
    if (a_packed.has_value()) {
      const at::Tensor y = linear_bf16_packed(xs, *a_packed, c10::nullopt, a->size(1), false);
      delta = linear_bf16_packed(y, required(lora, slot + 3), c10::nullopt, out.size(1), false);
    } else {
      delta = at::mm(at::mm(xs.to(at::kFloat), *a), required(lora, slot + 1));
    }
    target.add_(delta.scalar_type() == out.scalar_type() ? delta : delta.to(out.scalar_type()));
  }
}

}  // namespace

at::Tensor decode_forward(const at::Tensor& hidden, const at::Tensor& positions,
                          const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                          const at::Tensor& seq_lens, const at::Tensor& query_start,
                          const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const Weights& weights,
                          at::IntArrayRef kinds, at::IntArrayRef out_features,
                          at::IntArrayRef group_sizes, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, int64_t tokens_per_block, double eps, double scale,
                          const Weights& lora, at::IntArrayRef lora_runs) {
  const int64_t layers = k_cache.size(0);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kSlotsPerLayer + 1 &&
                  static_cast<int64_t>(kinds.size()) == 4 * layers &&
                  out_features.size() == kinds.size() && group_sizes.size() == kinds.size(),
              "decode_forward: weights for ", layers, " layers expected");
  TORCH_CHECK(lora_runs.size() % 2 == 0 &&
                  static_cast<int64_t>(lora.size()) ==
                      4 * layers * static_cast<int64_t>(lora_runs.size() / 2) * kLoraSlotsPerRun,
              "decode_forward: LoRA slots for ", layers, " layers and ", lora_runs.size() / 2,
              " runs expected");
  const int64_t q_size = num_heads * head_dim;
  at::Tensor x = hidden.contiguous();  // this step's own buffer: the residual stream lives in it
  at::Tensor residual = x;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const int64_t base = layer * kSlotsPerLayer;
    auto proj = [&](int64_t i, const at::Tensor& in) {
      const int64_t p = 4 * layer + i;
      at::Tensor out = project(in, weights, base + 2 + i * kSlotsPerLinear, kinds[p],
                               out_features[p], group_sizes[p]);
      if (!lora_runs.empty()) {
        out = out.contiguous();
        add_lora(in, out, lora, lora_runs, p);
      }
      return out;
    };
    at::Tensor h = layer == 0 ? rms_norm(x, required(weights, base), eps)
                              : add_rms_norm(x, residual, required(weights, base), eps);
    at::Tensor qkv = proj(0, h).contiguous();
    at::Tensor k_layer = k_cache.select(0, layer), v_layer = v_cache.select(0, layer);
    rope_write_cache(qkv, positions, cos, sin, num_heads, num_kv_heads, k_layer, v_layer,
                     slot_mapping);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({-1, num_heads, head_dim});
    at::Tensor o = paged_attention(q, k_layer, v_layer, block_tables, seq_lens, query_start,
                                   tokens_per_block, scale);
    h = add_rms_norm(proj(1, o.view({-1, q_size})), residual, required(weights, base + 1), eps);
    x = proj(3, silu_mul(proj(2, h)));
  }
  return add_rms_norm(x, residual, required(weights, layers * kSlotsPerLayer), eps);
}

}  // namespace llm_forge
