// All decoder layers of a decode step in one call: the same kernels the Python model calls one by
// one (norms, projections, rotary + KV write, attention, SiLU * up), without a Python
// round trip per op. It covers steps whose rows are attended by the paged kernel (decodes) and,
// after them, by the prefill kernel (chunks of several rows: verify steps, a prompt's chunks),
// over a cache in the activation dtype or of one byte per element (int8, FP8),
// with projections of four kinds:
// packed bf16, packed INT4 (ours, or torch's int4pack where the plan measured it faster), or a
// dense weight in the activation dtype. A layer may norm each query and key head first
// (QK-norm: Qwen3), may attend a window of its last keys with a rotary table of its own and norm
// the attention's and the MLP's outputs before each residual add, with a GELU-tanh gate
// (Gemma 3), and may be a mixture of experts (Qwen3-MoE, Mixtral): its router is projected
// like the MLP's gate_up, routed as `engine/moe.py` routes, and its experts run in
// `moe_experts` (moe.cpp) over stacks packed at load. LoRA adapters of the step's rows are added
// after each projection, as `lora/batch.py` adds them in the Python model, with the same
// kernels. Everything else takes the Python model (`model.py`), which stays the reference: tests
// hold the two to each other.
#include "layer_rows.h"
#include "ops.h"
#include "step.h"

#include <linux/futex.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <memory>
#include <type_traits>
#include <vector>

namespace llm_forge {

namespace {

enum LinearKind : int64_t { kPackedBf16 = 0, kPackedInt4 = 1, kDense = 2, kTorchInt4 = 3 };
// weights: per layer [input norm, post norm, then per projection (qkv, dense, gate_up, proj):
// weight, scales, prequant, bias], then the final norm.
constexpr int64_t kSlotsPerLinear = 4;
constexpr int64_t kSlotsPerLayer = 2 + 4 * kSlotsPerLinear;
// layer_extras (empty, or per layer): the q and k head norms (QK-norm), a mixture of experts'
// gate_up and down stacks, then the norms of the attention's and of the MLP's outputs (Gemma's
// post-attention and post-feedforward norms, applied before the residual add); empty slots where
// the layer has none. A mixture-of-experts layer's gate_up projection slot holds its router
// (out_features: the experts), its proj slot is empty; routing: [top_k, renormalise,
// intermediate]. windows (empty, or per layer): the keys a local layer attends, its own included
// (0: every key); a local layer rotates with local_cos / local_sin where given.
constexpr int64_t kExtrasPerLayer = 6;
constexpr int64_t kAttentionOutNorm = 4, kMlpOutNorm = 5;

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

// A mixture of experts' output for the rows h from their router logits: softmax in fp32, the
// top_k kept, renormalised when asked, in h's dtype (engine/moe.py's `route`, op for op), then
// every routed expert in one call.
at::Tensor sparse_moe(const at::Tensor& h, const at::Tensor& logits, at::IntArrayRef routing,
                      const at::Tensor& gate_up, const at::Tensor& down) {
  TORCH_CHECK(routing.size() == 3,
              "decode_forward: routing is [top_k, renormalise, intermediate]");
  const at::Tensor probs = at::softmax(logits, -1, at::kFloat);
  auto [weights, experts] = at::topk(probs, routing[0], -1);
  if (routing[1]) weights = weights / weights.sum(-1, true);
  return moe_experts(h.contiguous(), experts.contiguous(),
                     weights.to(h.scalar_type()).contiguous(), gate_up, down, routing[2]);
}

// ---- The whole step in one parallel region ----
//
// At a few rows a step is ~120 projections of a few hundred KB each and a dozen small ops per
// layer; called op by op, each pays an allocation, a fork and join of the thread team and the
// main thread's dispatch while the other threads spin. Here the team is forked once per step:
// row-sized work (norms, rotary, a projection's input quantized or widened, the attention's
// merge) runs on thread 0, or on each thread's share of the rows when there are enough rows; the
// projections and the attention are claimed in chunks by every thread; barriers separate the
// phases (a waiter spins briefly, then sleeps), and a thread waiting at one asks for the next
// projection's weights (into L2) before it spins. The same kernels on the same chunks of output columns, in the same
// order of arithmetic: the values are those of the op-by-op path (a test holds them equal).

constexpr int64_t kRowsSplitMin = 8;          // fewer rows: row-sized phases run on thread 0
constexpr int64_t kPrefetchChunk = 4096;      // bytes a waiting thread asks for at a time
// How long a thread waiting at a barrier spins before it sleeps. Longer than a quiet phase
// gap (a few us), short enough that a core shared with another process or throttled by a CPU
// quota is given up instead of burnt while the teammate it waits for queues for a core.
constexpr int64_t kSpinNanos = 50000;

// A barrier for a fixed team. A waiting thread runs `idle()` while it returns true, spins for
// kSpinNanos, then sleeps on a futex until the last thread to arrive changes the generation and
// wakes the sleepers. Sleeping matters beyond the core it frees: a core gone idle pulls a
// runnable thread from a busy core's queue at once, so a teammate the OS preempted (for a busy
// neighbour) moves to the waiter's core instead of waiting there for the neighbour's time slice.
// (Spinning, even with sched_yield, keeps the waiter's core busy and the teammate queued.)
class TeamBarrier {
 public:
  explicit TeamBarrier(int n) : n_(n) {}
  template <typename Idle>
  void wait(const Idle& idle) {
    const uint32_t gen = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_seq_cst);
      // Seen by a sleeper's increment or not: then that sleeper sees the new generation.
      if (sleepers_.load(std::memory_order_seq_cst) > 0) futex(FUTEX_WAKE_PRIVATE, INT_MAX);
      return;
    }
    bool working = true;
    int64_t spins = 0, deadline = 0;
    while (generation_.load(std::memory_order_acquire) == gen) {
      if (working && idle()) continue;
      if (working) deadline = now_ns() + kSpinNanos;
      working = false;
      if ((++spins & 63) != 0 || now_ns() < deadline) {
#if defined(__x86_64__)
        _mm_pause();
#endif
        continue;
      }
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      if (generation_.load(std::memory_order_seq_cst) == gen)
        futex(FUTEX_WAIT_PRIVATE, static_cast<int>(gen));  // returns at once if it moved on
      sleepers_.fetch_sub(1, std::memory_order_relaxed);
    }
  }

 private:
  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  long futex(int op, int value) {
    return syscall(SYS_futex, reinterpret_cast<uint32_t*>(&generation_), op, value, nullptr,
                   nullptr, 0);
  }
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "a futex word is 32 bits");
  const int n_;
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<uint32_t> generation_{0};
  alignas(64) std::atomic<int> sleepers_{0};
};

// A packed bf16 weight's layout, by its dims: tiles of 16 columns over fp32-widened rows
// ([tiles, K, 16]), the dot-product kernel's pairs ([tiles, K / 2, 16, 2]) or AMX's
// ([tiles, K / 32, 16, 16, 2]); the last two read bf16 rows in place.
enum Bf16Layout : int64_t { kTiles = 3, kPairs = 4, kAmx = 5 };

// One projection as the region runs it: raw pointers into weights the caller holds.
struct RegionLinear {
  int64_t kind, K, N, group, units;  // units: INT4 panels of 32 columns, bf16 tiles or groups
  int64_t layout;                    // a packed bf16 weight's Bf16Layout
  int64_t tiles;                     // a packed bf16 weight's tiles of 16 columns
  const void* packed;
  int64_t packed_bytes;
  const at::Half* scale_offsets;
  const void* prequant;
  bool prequant_bf16;
  const float* bias;
  int64_t chunk(int64_t team) const {
    if (kind == kPackedInt4) return step::int4_chunk(units, team);
    if (layout == kPairs) return step::bf16_pairs_chunk(tiles, team);
    if (layout == kAmx) return step::bf16_amx_chunk(units, team);
    return step::bf16_chunk(units, team);
  }
};

// Whether the region runs these projections: packed INT4 or packed bf16 (tiles; pairs and AMX
// for bf16 activations, with no AWQ scale), AWQ scales in fp32 or bf16.
bool region_supports(const Weights& weights, at::IntArrayRef kinds, int64_t layers,
                     at::ScalarType activations) {
  for (int64_t p = 0; p < 4 * layers; ++p) {
    const int64_t slot = (p / 4) * kSlotsPerLayer + 2 + (p % 4) * kSlotsPerLinear;
    const c10::optional<at::Tensor> w = weights.get(slot);
    if (!w.has_value() || (kinds[p] != kPackedInt4 && kinds[p] != kPackedBf16)) return false;
    const bool in_place = kinds[p] == kPackedBf16 && (w->dim() == kPairs || w->dim() == kAmx);
    if (kinds[p] == kPackedBf16 && w->dim() != kTiles && !in_place) return false;
    if (in_place && (activations != at::kBFloat16 || weights.get(slot + 2).has_value()))
      return false;
    const c10::optional<at::Tensor> pre = weights.get(slot + 2);
    if (pre.has_value() && (!pre->is_contiguous() || (pre->scalar_type() != at::kFloat &&
                                                      pre->scalar_type() != at::kBFloat16)))
      return false;
  }
  return true;
}

RegionLinear region_linear(const Weights& weights, int64_t slot, int64_t kind, int64_t N,
                           int64_t group, std::vector<at::Tensor>& keep) {
  const at::Tensor w = required(weights, slot);
  RegionLinear l{kind, 0, N, group, w.size(0), w.dim(), w.size(0), w.data_ptr(),
                 static_cast<int64_t>(w.nbytes()), nullptr, nullptr, false, nullptr};
  if (kind == kPackedInt4) {
    const at::Tensor so = required(weights, slot + 1);
    step::int4_check_layout(w, so, group, N);
    l.K = w.size(1) * 8;
    l.scale_offsets = so.data_ptr<at::Half>();
  } else if (l.layout == kPairs) {
    l.K = step::bf16_pairs_check_layout(w, N);
    l.units = step::bf16_pairs_units(l.tiles);
  } else if (l.layout == kAmx) {
    l.K = step::bf16_amx_check_layout(w, N);
    l.units = step::bf16_amx_units(l.tiles);
  } else {
    step::bf16_check_layout(w, N);
    l.K = w.size(1);
  }
  const c10::optional<at::Tensor> pre = weights.get(slot + 2);
  if (pre.has_value()) {
    TORCH_CHECK(pre->numel() == l.K, "prequant has ", pre->numel(), " scales for ", l.K,
                " features");
    l.prequant = pre->data_ptr();
    l.prequant_bf16 = pre->scalar_type() == at::kBFloat16;
  }
  const c10::optional<at::Tensor> bias = weights.get(slot + 3);
  if (bias.has_value()) {
    keep.push_back(bias->to(at::kFloat).contiguous());
    TORCH_CHECK(keep.back().numel() == N, "bias has ", keep.back().numel(), " values for ", N,
                " outputs");
    l.bias = keep.back().data_ptr<float>();
  }
  return l;
}

// decode_forward's arguments besides the hidden states and LoRA.
// The step's rows after the paged kernel's (a verify step's drafts, chunks of a few rows): their
// block tables, key counts and row offsets from the first of them, for the prefill kernel.
struct PrefillRows {
  c10::optional<at::Tensor> block_tables, seq_lens, query_start;
  bool any() const { return block_tables.has_value(); }
};

// Rows [0, paged rows) of the step: the paged kernel's (query_start's last entry).
int64_t paged_rows(const at::Tensor& seq_lens, const at::Tensor& query_start) {
  TORCH_CHECK(query_start.scalar_type() == at::kInt && query_start.is_contiguous() &&
                  query_start.numel() == seq_lens.numel() + 1,
              "query_start must be int32 with B + 1 entries");
  return query_start.data_ptr<int32_t>()[seq_lens.numel()];
}

struct StepArgs {
  const at::Tensor &positions, &slot_mapping, &block_tables, &seq_lens, &query_start, &cos, &sin,
      &k_cache, &v_cache;
  const PrefillRows& prefill;
  const Weights& weights;
  at::IntArrayRef kinds, out_features, group_sizes;
  int64_t num_heads, num_kv_heads, D, tokens_per_block;
  double eps, scale;
  const float* k_scales;  // per layer, for a one-byte cache (else null: scales of 1)
  const float* v_scales;
  const Weights& extras;  // layer_extras: QK-norm and output norms reach the region
  const c10::optional<at::Tensor>&local_cos, &local_sin;
  at::IntArrayRef windows;
  bool gelu;  // the MLP's gate: GELU-tanh, else SiLU
};

// Layer `layer`'s window (0: global) and its rotary tables.
int64_t window_of(at::IntArrayRef windows, int64_t layer) {
  return windows.empty() ? 0 : windows[layer];
}
std::pair<const at::Tensor*, const at::Tensor*> rotary_of(
    at::IntArrayRef windows, int64_t layer, const at::Tensor& cos, const at::Tensor& sin,
    const c10::optional<at::Tensor>& local_cos, const c10::optional<at::Tensor>& local_sin) {
  if (window_of(windows, layer) > 0 && local_cos.has_value()) return {&*local_cos, &*local_sin};
  return {&cos, &sin};
}

// T: the activations' dtype; C: the cache's (T, or a one-byte cache's int8 / fp8).
template <typename T, typename C>
at::Tensor region_forward(const at::Tensor& x_in, const StepArgs& args) {
  const at::Tensor &positions = args.positions, &slot_mapping = args.slot_mapping,
                   &block_tables = args.block_tables, &seq_lens = args.seq_lens,
                   &query_start = args.query_start, &cos = args.cos, &sin = args.sin,
                   &k_cache = args.k_cache, &v_cache = args.v_cache;
  const Weights& weights = args.weights;
  const int64_t num_heads = args.num_heads, num_kv_heads = args.num_kv_heads, D = args.D;
  const double eps = args.eps;
  const int64_t layers = k_cache.size(0), M = x_in.size(0), H = x_in.size(1);
  const int64_t q_size = num_heads * D, kv_width = num_kv_heads * D;
  const float feps = static_cast<float>(eps);
  // Raw pointers to every weight, with the checks the op-by-op kernels make, before the region.
  std::vector<RegionLinear> lin;
  std::vector<at::Tensor> keep;  // fp32 biases
  std::vector<const T*> norms;
  std::vector<const T*> head_norms;  // per layer q, k: null without QK-norm
  std::vector<const T*> out_norms;   // per layer the attention's, the MLP's output: null if none
  int64_t k_max = 0;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const int64_t base = layer * kSlotsPerLayer;
    for (int64_t j = 0; j < 2; ++j) {
      const at::Tensor w = required(weights, base + j);
      TORCH_CHECK(w.scalar_type() == x_in.scalar_type() && w.is_contiguous() && w.numel() == H,
                  "decode_forward: norm weights must match the hidden size and dtype");
      norms.push_back(w.data_ptr<T>());
      const c10::optional<at::Tensor> head =
          args.extras.empty() ? c10::nullopt : args.extras.get(layer * kExtrasPerLayer + j);
      TORCH_CHECK(!head.has_value() || (head->scalar_type() == x_in.scalar_type() &&
                                        head->is_contiguous() && head->numel() == D),
                  "decode_forward: QK-norm weights must match head_dim and the dtype");
      head_norms.push_back(head.has_value() ? head->data_ptr<T>() : nullptr);
    }
    for (const int64_t j : {kAttentionOutNorm, kMlpOutNorm}) {
      const c10::optional<at::Tensor> w =
          args.extras.empty() ? c10::nullopt : args.extras.get(layer * kExtrasPerLayer + j);
      TORCH_CHECK(!w.has_value() || (w->scalar_type() == x_in.scalar_type() &&
                                     w->is_contiguous() && w->numel() == H),
                  "decode_forward: output norm weights must match the hidden size and dtype");
      out_norms.push_back(w.has_value() ? w->data_ptr<T>() : nullptr);
    }
    for (int64_t i = 0; i < 4; ++i) {
      const int64_t p = 4 * layer + i;
      lin.push_back(region_linear(weights, base + 2 + i * kSlotsPerLinear, args.kinds[p],
                                  args.out_features[p], args.group_sizes[p], keep));
      k_max = std::max(k_max, lin.back().K);
    }
    const RegionLinear* L = lin.data() + 4 * layer;
    TORCH_CHECK(L[0].K == H && L[0].N == q_size + 2 * kv_width && L[1].K == q_size &&
                    L[1].N == H && L[2].K == H && L[3].K * 2 == L[2].N && L[3].N == H,
                "decode_forward: the projections' shapes do not fit the layer");
  }
  const at::Tensor final_norm = required(weights, layers * kSlotsPerLayer);
  for (const at::Tensor* t : {&cos, &sin, args.local_cos ? &*args.local_cos : &cos,
                              args.local_sin ? &*args.local_sin : &sin})
    TORCH_CHECK(t->size(1) == D && t->is_contiguous() && t->scalar_type() == at::kFloat,
                "cos/sin must be contiguous fp32 rows of head_dim");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.size(2) == num_kv_heads && k_cache.size(3) == D,
              "the cache must be contiguous [layers, slots, Hkv, D]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  positions.is_contiguous() && slot_mapping.is_contiguous() &&
                  positions.numel() == M && slot_mapping.numel() == M,
              "positions and slot_mapping must be int64, one per row");

  // The step's buffers, allocated once; the residual stream lives in x_in, as op by op.
  const auto opts = x_in.options();
  T* residual = x_in.data_ptr<T>();
  at::Tensor h_t = at::empty({M, H}, opts), qkv_t = at::empty({M, lin[0].N}, opts);
  at::Tensor o_t = at::empty({M, q_size}, opts), d_t = at::empty({M, H}, opts);
  at::Tensor gu_t = at::empty({M, lin[2].N}, opts), act_t = at::empty({M, lin[3].K}, opts);
  at::Tensor x_t = at::empty({M, H}, opts);
  T* hb = h_t.data_ptr<T>();
  T* qkv = qkv_t.data_ptr<T>();
  T* ob = o_t.data_ptr<T>();
  T* db = d_t.data_ptr<T>();
  T* gu = gu_t.data_ptr<T>();
  T* act = act_t.data_ptr<T>();
  T* xb = x_t.data_ptr<T>();
  std::vector<float> widened(M * k_max), block_scales(M * k_max), group_sums(M * k_max);
  std::vector<int8_t> q8(M * k_max);

  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const step::Geometry g{num_heads, num_kv_heads, D, args.tokens_per_block, block_tables.size(1),
                         qkv_t.stride(0), D, kv_width, static_cast<float>(args.scale)};
  // Rows past the paged kernel's: the prefill kernel's works, claimed after its items.
  const int64_t first_prefill = paged_rows(seq_lens, query_start);
  TORCH_CHECK(args.prefill.any() || first_prefill == M, "decode_forward: query_start covers ",
              first_prefill, " of the step's ", M, " rows");
  // One attention plan (and prefill plan) per window the layers use, shared by its layers.
  std::vector<int64_t> windows, plan_of(layers);
  std::vector<step::AttentionPlan> plans;
  std::vector<step::PrefillPlan> prefills;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const int64_t window = window_of(args.windows, layer);
    auto known = std::find(windows.begin(), windows.end(), window);
    plan_of[layer] = known - windows.begin();
    if (known != windows.end()) continue;
    windows.push_back(window);
    plans.push_back(step::plan_attention(g, block_tables, seq_lens, query_start, threads, window));
    prefills.emplace_back();
    if (args.prefill.any())
      prefills.back() = step::plan_prefill(
          {num_heads, num_kv_heads, D, args.tokens_per_block, args.prefill.block_tables->size(1),
           qkv_t.stride(0), D, kv_width, static_cast<float>(args.scale)},
          *args.prefill.block_tables, *args.prefill.seq_lens, *args.prefill.query_start,
          k_cache.size(1), M - first_prefill, threads, window);
  }
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  C* kc = static_cast<C*>(k_cache.data_ptr());
  C* vc = static_cast<C*>(v_cache.data_ptr());
  const int64_t layer_stride = k_cache.stride(0);

  // Per layer: the 4 projections and the attention claim work from counters 0-4, threads
  // waiting at a barrier ask for projection i's weights from counter 5 + i.
  constexpr int64_t kCounters = 9;
  std::unique_ptr<std::atomic<int64_t>[]> counters(new std::atomic<int64_t>[layers * kCounters]);
  for (int64_t i = 0; i < layers * kCounters; ++i) counters[i].store(0);

  // Row m of a projection's input, quantized (INT4) or widened (bf16) into the shared buffers.
  auto prepare = [&](const RegionLinear& l, const T* in, int64_t m) {
    const T* row = in + m * l.K;
    float* wide = widened.data() + m * l.K;
    if (l.kind == kPackedBf16 && l.layout != kTiles) return;  // read in place
    if (l.prequant == nullptr && l.kind == kPackedBf16)
      step::widen_row(row, static_cast<const float*>(nullptr), l.K, wide);
    else if (l.prequant != nullptr && l.prequant_bf16)
      step::widen_row(row, static_cast<const at::BFloat16*>(l.prequant), l.K, wide);
    else if (l.prequant != nullptr)
      step::widen_row(row, static_cast<const float*>(l.prequant), l.K, wide);
    if (l.kind != kPackedInt4) return;
    const int64_t blocks = l.K / step::int4_block(l.group), groups = l.K / l.group;
    int8_t* q = q8.data() + m * l.K;
    float* a = block_scales.data() + m * blocks;
    float* sums = group_sums.data() + m * groups;
    if (l.prequant != nullptr)
      step::int4_quantize_row(static_cast<const float*>(wide), l.K, l.group, q, a, sums);
    else
      step::int4_quantize_row(row, l.K, l.group, q, a, sums);
  };
  auto project = [&](const RegionLinear& l, const T* in, T* out, int64_t u_begin,
                     int64_t u_end) {
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      const auto* w = static_cast<const at::BFloat16*>(l.packed);
      if (l.kind == kPackedBf16 && l.layout == kPairs)
        return step::bf16_pairs_range(in, M, l.K, w, l.tiles, l.N, l.bias, out, u_begin, u_end);
      if (l.kind == kPackedBf16 && l.layout == kAmx)
        return step::bf16_amx_range(in, M, l.K, w, l.tiles, l.N, l.bias, out, u_begin, u_end);
    }
    if (l.kind == kPackedInt4) {
      const step::Int4Rows x{q8.data(), block_scales.data(), group_sums.data(), l.K,
                             l.K / step::int4_block(l.group), l.K / l.group};
      step::int4_panels(x, M, static_cast<const uint8_t*>(l.packed), l.scale_offsets, l.group,
                        l.N, l.bias, out, u_begin, u_end);
    } else {
      step::bf16_tiles(widened.data(), M, l.K, static_cast<const at::BFloat16*>(l.packed),
                       l.units, l.N, l.bias, out, u_begin, u_end);
    }
  };

  std::unique_ptr<TeamBarrier> barrier;
#pragma omp parallel num_threads(threads)
  {
#pragma omp single
    barrier.reset(new TeamBarrier(omp_get_num_threads()));  // single's own barrier follows
    const int64_t tid = omp_get_thread_num(), team = omp_get_num_threads();
    const bool split = M >= kRowsSplitMin;
    const int64_t r_begin = split ? tid * M / team : (tid == 0 ? 0 : M);
    const int64_t r_end = split ? (tid + 1) * M / team : M;
    // Wait for the team; meanwhile ask for projection l's weights (its prefetch counter).
    auto wait_fetching = [&](const RegionLinear* l, std::atomic<int64_t>* counter) {
      barrier->wait([&] {
        if (l == nullptr) return false;
        const int64_t off = counter->fetch_add(kPrefetchChunk, std::memory_order_relaxed);
        if (off >= l->packed_bytes) return false;
        const char* p = static_cast<const char*>(l->packed) + off;
        const int64_t n = std::min(kPrefetchChunk, l->packed_bytes - off);
        for (int64_t b = 0; b < n; b += 64) __builtin_prefetch(p + b, 0, 2);
        return true;
      });
    };
    auto claim = [](std::atomic<int64_t>* counter, int64_t n, int64_t chunk, const auto& body) {
      for (;;) {
        const int64_t begin = counter->fetch_add(chunk, std::memory_order_relaxed);
        if (begin >= n) return;
        body(begin, std::min(n, begin + chunk));
      }
    };
    for (int64_t layer = 0; layer < layers; ++layer) {
      const RegionLinear* L = lin.data() + 4 * layer;
      std::atomic<int64_t>* c = counters.get() + layer * kCounters;
      C* kl = kc + layer * layer_stride;
      C* vl = vc + layer * layer_stride;
      const float k_scale = args.k_scales ? args.k_scales[layer] : 1.f;
      const float v_scale = args.v_scales ? args.v_scales[layer] : 1.f;
      step::AttentionPlan& plan = plans[plan_of[layer]];
      const step::PrefillPlan& prefill = prefills[plan_of[layer]];
      const int64_t n_items = static_cast<int64_t>(plan.items.size());
      const int64_t n_works = static_cast<int64_t>(prefill.work.size());
      const auto [layer_cos, layer_sin] =
          rotary_of(args.windows, layer, cos, sin, args.local_cos, args.local_sin);
      const float* cp = layer_cos->data_ptr<float>();
      const float* sp = layer_sin->data_ptr<float>();
      const T* mlp_out_norm = layer == 0 ? nullptr : out_norms[2 * layer - 1];
      for (int64_t m = r_begin; m < r_end; ++m) {  // the previous layer's output joins the stream
        if (layer == 0) {
          layer_row::rms_norm(residual + m * H, norms[0], hb + m * H, H, feps);
        } else {
          if (mlp_out_norm != nullptr)
            layer_row::rms_norm(xb + m * H, mlp_out_norm, xb + m * H, H, feps);
          layer_row::add_rms_norm(xb + m * H, residual + m * H, norms[2 * layer], hb + m * H, H,
                                  feps);
        }
        prepare(L[0], hb, m);
      }
      wait_fetching(&L[0], c + 5);
      claim(c + 0, L[0].units, L[0].chunk(team),
            [&](int64_t b, int64_t e) { project(L[0], hb, qkv, b, e); });
      wait_fetching(&L[1], c + 6);
      const T* q_norm = head_norms[2 * layer];
      const T* k_norm = head_norms[2 * layer + 1];
      for (int64_t m = r_begin; m < r_end; ++m) {
        T* row = qkv + m * L[0].N;
        for (int64_t hd = 0; q_norm != nullptr && hd < num_heads + num_kv_heads; ++hd)
          layer_row::rms_norm(row + hd * D, hd < num_heads ? q_norm : k_norm, row + hd * D, D,
                              feps);
        layer_row::rope_write(row, cp + pos[m] * D, sp + pos[m] * D, num_heads, num_kv_heads, D,
                              kl + slots[m] * kv_width, vl + slots[m] * kv_width, k_scale,
                              v_scale);
      }
      wait_fetching(&L[1], c + 6);
      claim(c + 4, n_items + n_works, 1, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          if (i < n_items)
            step::attend_item(plan, static_cast<const T*>(qkv), static_cast<const C*>(kl),
                              static_cast<const C*>(vl), i, k_scale, v_scale);
          else
            step::prefill_work(prefill, static_cast<const T*>(qkv) + first_prefill * L[0].N,
                               static_cast<const C*>(kl), static_cast<const C*>(vl),
                               ob + first_prefill * q_size, i - n_items, k_scale, v_scale);
        }
      });
      wait_fetching(&L[1], c + 6);
      for (int64_t m = r_begin; m < r_end; ++m) {
        for (int64_t kvh = 0; m < first_prefill && kvh < num_kv_heads; ++kvh)
          step::merge_group(plan, m * num_kv_heads + kvh, ob);
        prepare(L[1], ob, m);
      }
      wait_fetching(&L[1], c + 6);
      claim(c + 1, L[1].units, L[1].chunk(team),
            [&](int64_t b, int64_t e) { project(L[1], ob, db, b, e); });
      wait_fetching(&L[2], c + 7);
      for (int64_t m = r_begin; m < r_end; ++m) {
        if (out_norms[2 * layer] != nullptr)
          layer_row::rms_norm(db + m * H, out_norms[2 * layer], db + m * H, H, feps);
        layer_row::add_rms_norm(db + m * H, residual + m * H, norms[2 * layer + 1], hb + m * H,
                                H, feps);
        prepare(L[2], hb, m);
      }
      wait_fetching(&L[2], c + 7);
      claim(c + 2, L[2].units, L[2].chunk(team),
            [&](int64_t b, int64_t e) { project(L[2], hb, gu, b, e); });
      wait_fetching(&L[3], c + 8);
      for (int64_t m = r_begin; m < r_end; ++m) {
        if (args.gelu)
          layer_row::gelu_tanh_mul(gu + m * L[2].N, act + m * L[3].K, L[3].K);
        else
          layer_row::silu_mul(gu + m * L[2].N, act + m * L[3].K, L[3].K);
        prepare(L[3], act, m);
      }
      wait_fetching(&L[3], c + 8);
      claim(c + 3, L[3].units, L[3].chunk(team),
            [&](int64_t b, int64_t e) { project(L[3], act, xb, b, e); });
      const bool last = layer + 1 == layers;
      wait_fetching(last ? nullptr : &L[4], last ? nullptr : c + kCounters + 5);
    }
  }
  const T* last_norm = out_norms.back();
  if (last_norm != nullptr) x_t = rms_norm(x_t, *args.extras.get((layers - 1) * kExtrasPerLayer +
                                                                  kMlpOutNorm), eps);
  return add_rms_norm(x_t, x_in, final_norm, eps);
}

}  // namespace

bool decode_region_supported(const Weights& weights, at::IntArrayRef kinds,
                             at::ScalarType activations) {
  const int64_t layers = static_cast<int64_t>(kinds.size()) / 4;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kSlotsPerLayer + 1,
              "decode_region_supported: weights for ", layers, " layers expected");
  return region_supports(weights, kinds, layers, activations);
}

at::Tensor decode_forward(const at::Tensor& hidden, const at::Tensor& positions,
                          const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                          const at::Tensor& seq_lens, const at::Tensor& query_start,
                          const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const Weights& weights,
                          at::IntArrayRef kinds, at::IntArrayRef out_features,
                          at::IntArrayRef group_sizes, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, int64_t tokens_per_block, double eps, double scale,
                          const Weights& lora, at::IntArrayRef lora_runs,
                          const Weights& layer_extras, at::IntArrayRef routing,
                          bool single_region, const c10::optional<at::Tensor>& kv_scales,
                          const c10::optional<at::Tensor>& prefill_block_tables,
                          const c10::optional<at::Tensor>& prefill_seq_lens,
                          const c10::optional<at::Tensor>& prefill_query_start,
                          const c10::optional<at::Tensor>& local_cos,
                          const c10::optional<at::Tensor>& local_sin, at::IntArrayRef windows,
                          bool gelu) {
  const PrefillRows prefill{prefill_block_tables, prefill_seq_lens, prefill_query_start};
  TORCH_CHECK(prefill_block_tables.has_value() == prefill_seq_lens.has_value() &&
                  prefill_seq_lens.has_value() == prefill_query_start.has_value(),
              "decode_forward: the prefill rows need block tables, seq_lens and query_start");
  const int64_t layers = k_cache.size(0);
  // A one-byte cache comes with its scales: [2, layers] fp32, keys' then values'.
  const bool one_byte = k_cache.element_size() == 1;
  TORCH_CHECK(!one_byte || (kv_scales.has_value() && kv_scales->scalar_type() == at::kFloat &&
                            kv_scales->is_contiguous() && kv_scales->dim() == 2 &&
                            kv_scales->size(0) == 2 && kv_scales->size(1) == layers),
              "decode_forward: a one-byte cache needs kv_scales, [2, ", layers, "] fp32");
  const float* k_scales = one_byte ? kv_scales->data_ptr<float>() : nullptr;
  const float* v_scales = one_byte ? k_scales + layers : nullptr;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kSlotsPerLayer + 1 &&
                  static_cast<int64_t>(kinds.size()) == 4 * layers &&
                  out_features.size() == kinds.size() && group_sizes.size() == kinds.size(),
              "decode_forward: weights for ", layers, " layers expected");
  TORCH_CHECK(lora_runs.size() % 2 == 0 &&
                  static_cast<int64_t>(lora.size()) ==
                      4 * layers * static_cast<int64_t>(lora_runs.size() / 2) * kLoraSlotsPerRun,
              "decode_forward: LoRA slots for ", layers, " layers and ", lora_runs.size() / 2,
              " runs expected");
  TORCH_CHECK(layer_extras.empty() ||
                  static_cast<int64_t>(layer_extras.size()) == layers * kExtrasPerLayer,
              "decode_forward: layer_extras for ", layers, " layers expected (or none)");
  TORCH_CHECK(windows.empty() || static_cast<int64_t>(windows.size()) == layers,
              "decode_forward: windows for ", layers, " layers expected (or none)");
  for (const int64_t w : windows)
    TORCH_CHECK(w >= 0, "decode_forward: a window is 0 (every key) or more, got ", w);
  TORCH_CHECK(local_cos.has_value() == local_sin.has_value(),
              "decode_forward: local_cos and local_sin come together");
  auto extra = [&](int64_t layer, int64_t i) -> c10::optional<at::Tensor> {
    return layer_extras.empty() ? c10::nullopt : layer_extras.get(layer * kExtrasPerLayer + i);
  };
  bool any_experts = false;
  for (int64_t layer = 0; layer < layers; ++layer) any_experts |= extra(layer, 2).has_value();
  // The region computes attention (with QK-norm) and dense MLPs: experts take the ops below.
  if (single_region && lora_runs.empty() && !any_experts && hidden.dim() == 2 &&
      k_cache.dim() == 4 && region_supports(weights, kinds, layers, hidden.scalar_type())) {
    const at::Tensor x_in = hidden.contiguous();
    const StepArgs args{positions, slot_mapping, block_tables, seq_lens, query_start, cos, sin,
                        k_cache, v_cache, prefill, weights, kinds, out_features, group_sizes,
                        num_heads, num_kv_heads, head_dim, tokens_per_block, eps, scale,
                        k_scales, v_scales, layer_extras, local_cos, local_sin, windows, gelu};
    at::Tensor out;
    auto run = [&](auto* activations) {
      using T = std::remove_pointer_t<decltype(activations)>;
      step::with_cache_type<T>(k_cache, v_cache, [&](auto* tag) {
        out = region_forward<T, std::remove_pointer_t<decltype(tag)>>(x_in, args);
      });
    };
    if (x_in.scalar_type() == at::kBFloat16) run(static_cast<at::BFloat16*>(nullptr));
    else if (x_in.scalar_type() == at::kFloat) run(static_cast<float*>(nullptr));
    if (out.defined()) return out;
  }
  const int64_t q_size = num_heads * head_dim;
  // The paged kernel's rows, then the prefill kernel's, written into one output.
  const int64_t first_prefill = paged_rows(seq_lens, query_start);
  auto attend = [&](const at::Tensor& q, const at::Tensor& k_layer, const at::Tensor& v_layer,
                    double k_scale, double v_scale, int64_t window) {
    if (!prefill.any())
      return paged_attention(q, k_layer, v_layer, block_tables, seq_lens, query_start,
                             tokens_per_block, scale, k_scale, v_scale, window);
    at::Tensor o = at::empty({q.size(0), num_heads, head_dim}, q.options());
    if (first_prefill > 0)
      o.narrow(0, 0, first_prefill)
          .copy_(paged_attention(q.narrow(0, 0, first_prefill), k_layer, v_layer, block_tables,
                                 seq_lens, query_start, tokens_per_block, scale, k_scale,
                                 v_scale, window));
    const int64_t rest = q.size(0) - first_prefill;
    prefill_attention(o.narrow(0, first_prefill, rest), q.narrow(0, first_prefill, rest), k_layer,
                      v_layer, *prefill.block_tables, *prefill.seq_lens, *prefill.query_start,
                      tokens_per_block, scale, k_scale, v_scale, window);
    return o;
  };
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
    const c10::optional<at::Tensor> q_norm = extra(layer, 0);
    if (q_norm.has_value()) {
      const c10::optional<at::Tensor> k_norm = extra(layer, 1);
      TORCH_CHECK(k_norm.has_value(), "decode_forward: QK-norm needs a k norm too");
      qk_norm_(qkv, *q_norm, *k_norm, num_heads, num_kv_heads, eps);
    }
    at::Tensor k_layer = k_cache.select(0, layer), v_layer = v_cache.select(0, layer);
    const double k_scale = one_byte ? k_scales[layer] : 1.0;
    const double v_scale = one_byte ? v_scales[layer] : 1.0;
    const auto [layer_cos, layer_sin] = rotary_of(windows, layer, cos, sin, local_cos, local_sin);
    rope_write_cache(qkv, positions, *layer_cos, *layer_sin, num_heads, num_kv_heads, k_layer,
                     v_layer, slot_mapping, k_scale, v_scale);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({-1, num_heads, head_dim});
    at::Tensor o = attend(q, k_layer, v_layer, k_scale, v_scale, window_of(windows, layer));
    at::Tensor attention_out = proj(1, o.view({-1, q_size}));
    const c10::optional<at::Tensor> attention_norm = extra(layer, kAttentionOutNorm);
    if (attention_norm.has_value()) attention_out = rms_norm(attention_out, *attention_norm, eps);
    h = add_rms_norm(attention_out, residual, required(weights, base + 1), eps);
    const c10::optional<at::Tensor> gate_up_stack = extra(layer, 2);
    if (gate_up_stack.has_value()) {  // the router in the gate_up slot; no adapters on it
      const int64_t p = 4 * layer + 2;
      const at::Tensor logits = project(h, weights, base + 2 + 2 * kSlotsPerLinear, kinds[p],
                                        out_features[p], group_sizes[p]);
      const c10::optional<at::Tensor> down_stack = extra(layer, 3);
      TORCH_CHECK(down_stack.has_value(), "decode_forward: experts need a down stack too");
      x = sparse_moe(h, logits, routing, *gate_up_stack, *down_stack);
    } else {
      const at::Tensor gate_up = proj(2, h);
      x = proj(3, gelu ? gelu_tanh_mul(gate_up) : silu_mul(gate_up));
    }
    const c10::optional<at::Tensor> mlp_norm = extra(layer, kMlpOutNorm);
    if (mlp_norm.has_value()) x = rms_norm(x, *mlp_norm, eps);
  }
  return add_rms_norm(x, residual, required(weights, layers * kSlotsPerLayer), eps);
}

}  // namespace llm_forge
