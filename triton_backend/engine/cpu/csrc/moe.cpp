// A mixture-of-experts MLP in one call: every routed expert's gated MLP over its rows, and each
// row's weighted sum of its experts, for the step's rows x [T, H] (moe.py routes them).
//
// Why: the per-expert path (engine/moe.py) runs six or so torch ops per active expert per layer;
// at one token a step those dispatches cost more than the 3 MiB each expert's weights take to
// stream. Here a layer is two parallel loops: gate_up with SiLU-and-multiply, then down with the
// weighted sum, each over all the active experts at once.
//
// Weights (packed once at load, cpu/moe.py): every expert's gate_up [2I, H] and down [H, I]
// stacked in the layouts of the packed bf16 GEMMs, with the expert first: `tiles` (gemm.cpp, bf16
// widened to fp32 in registers: [E, tiles, K, 16]), `pairs` (gemm_bf16_dot.cpp, AVX-512 BF16 dot
// products, bf16 activations: [E, tiles, K / 2, 16, 2]), or `tiles` of fp32 weights for an fp32
// engine. I must be a multiple of 16, so gate tile j and up tile I / 16 + j cover the same columns
// and a thread applies SiLU to the tiles it just summed.
//
// Rounding follows the per-expert path with the same packed kernel: gate_up rounded to x's dtype,
// silu_mul as layer_row's, down rounded, times the routing weight rounded, and a row's experts
// added in ascending expert id, each sum rounded (index_add_ in x's dtype). Every output is summed
// over k in one fixed order whatever the rows batched with it, so a row's result does not depend
// on the step's row count.
#include "layer_rows.h"
#include "ops.h"
#include "vec.h"

#include <ATen/ATen.h>

#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define LLM_FORGE_MOE_DOT 1
#include <immintrin.h>
#endif

namespace llm_forge {
namespace {

constexpr int kTile = 16;
constexpr int kMaxRows = 4;  // rows of one expert summed together while its tiles are in cache
constexpr int kMaxTiles = 4;

// The experts' rows, grouped: expert e owns pairs [start[g], start[g + 1]) of the group g it is,
// groups in ascending expert id; pair p is (row[p], its routing weight).
struct Groups {
  std::vector<int64_t> expert, start, row, slot;  // slot: the (row, k) index of pair p
};

Groups group_rows(const int64_t* ids, int64_t T, int64_t top_k, int64_t E) {
  std::vector<int64_t> count(E, 0);
  for (int64_t i = 0; i < T * top_k; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < E, "expert id ", ids[i], " out of [0, ", E, ")");
    ++count[ids[i]];
  }
  Groups g;
  std::vector<int64_t> first(E, 0);
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) {
    first[e] = total;
    if (count[e]) {
      g.expert.push_back(e);
      g.start.push_back(total);
    }
    total += count[e];
  }
  g.start.push_back(total);
  g.row.resize(total);
  g.slot.resize(total);
  for (int64_t i = 0; i < T * top_k; ++i) {  // rows ascending within an expert
    const int64_t p = first[ids[i]]++;
    g.row[p] = i / top_k;
    g.slot[p] = i;
  }
  return g;
}

// Weights of one projection of every expert: tile t of expert e starts at base + (e * tiles + t)
// * K * 16 elements, whichever layout.
template <typename W>
struct Stack {
  const W* base;
  int64_t tiles, K;
  const W* tile(int64_t e, int64_t t) const { return base + (e * tiles + t) * K * kTile; }
};

inline vf load_weights(const uint16_t* p) { return load_bits(p); }
inline vf load_weights(const float* p) { return load(p); }

// sums[m][t * 16 + j] = x row m . column j of tile t, over all of K in order (tiles layout: x as
// fp32 rows; the per-element order of gemm.cpp's micro-kernel).
template <int MR, int NT, typename W>
void tile_sums(const float* x, int64_t K, const W* const* tiles, float* sums) {
  vf acc[MR][NT][2];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t][0] = acc[m][t][1] = splat(0.f);
  for (int64_t k = 0; k < K; ++k) {
    vf w0[NT], w1[NT];
    for (int t = 0; t < NT; ++t) {
      w0[t] = load_weights(tiles[t] + k * kTile);
      w1[t] = load_weights(tiles[t] + k * kTile + kLanes);
    }
    for (int m = 0; m < MR; ++m) {
      const vf xb = splat(x[m * K + k]);
      for (int t = 0; t < NT; ++t) {
        acc[m][t][0] = fmadd(xb, w0[t], acc[m][t][0]);
        acc[m][t][1] = fmadd(xb, w1[t], acc[m][t][1]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) {
      store(sums + (m * NT + t) * kTile, acc[m][t][0]);
      store(sums + (m * NT + t) * kTile + kLanes, acc[m][t][1]);
    }
}

#ifdef LLM_FORGE_MOE_DOT
// The same over the pairs layout with bf16 dot products (gemm_bf16_dot.cpp's per-element order:
// one vdpbf16ps per pair of k, in order).
template <int MR, int NT>
void pair_sums(const uint16_t* x, int64_t K, const uint16_t* const* tiles, float* sums) {
  const int64_t pairs = K / 2;
  __m512 acc[MR][NT];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[NT];
    for (int t = 0; t < NT; ++t) {
      const uint16_t* at = tiles[t] + p * 2 * kTile;
      _mm_prefetch(reinterpret_cast<const char*>(at + 16 * 2 * kTile), _MM_HINT_T0);
      wv[t] = (__m512bh)_mm512_loadu_si512(at);
    }
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * K + 2 * p, sizeof pair);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_dpbf16_ps(acc[m][t], xb, wv[t]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(sums + (m * NT + t) * kTile, acc[m][t]);
}
#endif

// sums [rows][NT * 16] of `rows` (<= kMaxRows) consecutive input rows against NT tiles.
template <bool Pairs, int NT, typename W>
void block_sums(const float* xf, const uint16_t* xb, int64_t rows, int64_t K,
                const W* const* tiles, float* sums) {
#ifdef LLM_FORGE_MOE_DOT
  if constexpr (Pairs) {
    const uint16_t* const* t16 = reinterpret_cast<const uint16_t* const*>(tiles);
    switch (rows) {
      case 4: pair_sums<4, NT>(xb, K, t16, sums); break;
      case 3: pair_sums<3, NT>(xb, K, t16, sums); break;
      case 2: pair_sums<2, NT>(xb, K, t16, sums); break;
      default: pair_sums<1, NT>(xb, K, t16, sums); break;
    }
    return;
  }
#endif
  (void)xb;
  switch (rows) {
    case 4: tile_sums<4, NT>(xf, K, tiles, sums); break;
    case 3: tile_sums<3, NT>(xf, K, tiles, sums); break;
    case 2: tile_sums<2, NT>(xf, K, tiles, sums); break;
    default: tile_sums<1, NT>(xf, K, tiles, sums); break;
  }
}

// Rows of activations in both forms the kernels read (fp32 only where a tiles kernel reads them).
template <typename T>
struct Rows {
  std::vector<T> values;      // [pairs, width]
  std::vector<float> widened;  // [pairs, width] for the tiles kernels, else empty
  int64_t width;
  const float* f32(int64_t p) const { return widened.empty() ? nullptr : &widened[p * width]; }
  const uint16_t* bits(int64_t p) const {
    return reinterpret_cast<const uint16_t*>(&values[p * width]);
  }
};

template <typename T, typename W, bool Pairs>
struct MoeStep {
  const Groups& g;
  Stack<W> gate_up, down;
  int64_t H, I;
  Rows<T> xs, act;
  const T* route_weights;  // [T * top_k]
  T* out;                  // [T, H], zeroed

  // Gate tiles [j, j + n) and their up tiles of group gi: act = silu(gate) * up, in T.
  template <int N>
  void gate_up_item(int64_t gi, int64_t j) {
    const int64_t e = g.expert[gi], up = I / kTile;
    const W* tiles[2 * N];
    for (int t = 0; t < N; ++t) {
      tiles[t] = gate_up.tile(e, j + t);
      tiles[N + t] = gate_up.tile(e, up + j + t);
    }
    float sums[kMaxRows * 2 * N * kTile];
    for (int64_t p = g.start[gi]; p < g.start[gi + 1]; p += kMaxRows) {
      const int64_t rows = std::min<int64_t>(kMaxRows, g.start[gi + 1] - p);
      block_sums<Pairs, 2 * N>(xs.f32(p), xs.bits(p), rows, H, tiles, sums);
      for (int64_t m = 0; m < rows; ++m) {
        T both[2 * N * kTile];  // [gate | up] of these columns, rounded as the GEMM's output
        for (int i = 0; i < 2 * N * kTile; ++i)
          both[i] = static_cast<T>(sums[m * 2 * N * kTile + i] + 0.f);
        layer_row::silu_mul(both, &act.values[(p + m) * I + j * kTile], N * kTile);
      }
    }
  }

  // Output tiles [t0, t0 + N): every group's down rows in ascending expert id, each row's
  // result times its weight added to its output row.
  template <int N>
  void down_item(int64_t t0) {
    float sums[kMaxRows * N * kTile];
    for (size_t gi = 0; gi + 1 < g.start.size(); ++gi) {
      const int64_t e = g.expert[gi];
      const W* tiles[N];
      for (int t = 0; t < N; ++t) tiles[t] = down.tile(e, t0 + t);
      for (int64_t p = g.start[gi]; p < g.start[gi + 1]; p += kMaxRows) {
        const int64_t rows = std::min<int64_t>(kMaxRows, g.start[gi + 1] - p);
        block_sums<Pairs, N>(act.f32(p), act.bits(p), rows, I, tiles, sums);
        for (int64_t m = 0; m < rows; ++m) add_row(p + m, t0, N, sums + m * N * kTile);
      }
    }
  }

  void add_row(int64_t p, int64_t t0, int n, const float* sums) {
    const float w = static_cast<float>(route_weights[g.slot[p]]);
    T* o = out + g.row[p] * H;
    const int64_t n0 = t0 * kTile, n_valid = std::min<int64_t>(n * kTile, H - n0);
    for (int64_t j = 0; j < n_valid; ++j) {
      const float y = static_cast<float>(static_cast<T>(sums[j] + 0.f));  // as stored
      const float weighted = static_cast<float>(static_cast<T>(y * w));
      o[n0 + j] = static_cast<T>(static_cast<float>(o[n0 + j]) + weighted);
    }
  }

  void run() {
    const int64_t groups = static_cast<int64_t>(g.expert.size());
    const int64_t gate_tiles = I / kTile, pairs_per_group = gate_tiles / 2;
    const int64_t odd = gate_tiles % 2;
    // Items of two gate tiles (and their up tiles): four tiles of sums, as the GEMMs' 4-tile
    // passes; a last odd tile alone.
    const int64_t per_group = pairs_per_group + odd;
    parallel_chunks(groups * per_group, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t gi = i / per_group, k = i % per_group;
        if (k < pairs_per_group) gate_up_item<2>(gi, 2 * k);
        else gate_up_item<1>(gi, 2 * k);
      }
    });
    widen(act);
    const int64_t out_tiles = (H + kTile - 1) / kTile;
    const int64_t quads = out_tiles / kMaxTiles, rest = out_tiles % kMaxTiles;
    parallel_chunks(quads + rest, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        if (i < quads) down_item<kMaxTiles>(i * kMaxTiles);
        else down_item<1>(quads * kMaxTiles + (i - quads));
      }
    });
  }

  static void widen(Rows<T>& rows) {
    if (Pairs) return;
    rows.widened.resize(rows.values.size());
    for (size_t i = 0; i < rows.values.size(); ++i)
      rows.widened[i] = static_cast<float>(rows.values[i]);
  }
};

template <typename T, typename W, bool Pairs>
void run_moe(const at::Tensor& x, const Groups& g, const at::Tensor& weights,
             const at::Tensor& gate_up, const at::Tensor& down, int64_t I, at::Tensor& out) {
  const int64_t H = x.size(1);
  const auto* gw = reinterpret_cast<const W*>(gate_up.data_ptr());
  const auto* dw = reinterpret_cast<const W*>(down.data_ptr());
  MoeStep<T, W, Pairs> s{g, {gw, gate_up.size(1), H}, {dw, down.size(1), I}, H, I, {}, {},
                         weights.data_ptr<T>(), out.data_ptr<T>()};
  const int64_t pairs = static_cast<int64_t>(g.row.size());
  const T* xp = x.data_ptr<T>();
  s.xs.width = H;
  s.xs.values.resize(pairs * H);
  for (int64_t p = 0; p < pairs; ++p)
    std::memcpy(&s.xs.values[p * H], xp + g.row[p] * H, H * sizeof(T));
  MoeStep<T, W, Pairs>::widen(s.xs);
  s.act.width = I;
  s.act.values.resize(pairs * I);
  s.run();
}

}  // namespace

bool moe_pairs_available() {
#ifdef LLM_FORGE_MOE_DOT
  return true;
#else
  return false;
#endif
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& expert_ids,
                       const at::Tensor& expert_weights, const at::Tensor& gate_up,
                       const at::Tensor& down, int64_t intermediate) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [T, hidden]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "x must be bf16 or fp32");
  TORCH_CHECK(expert_ids.scalar_type() == at::kLong && expert_ids.dim() == 2 &&
                  expert_ids.size(0) == x.size(0) && expert_ids.is_contiguous(),
              "expert_ids must be contiguous int64 [T, top_k]");
  TORCH_CHECK(expert_weights.scalar_type() == x.scalar_type() &&
                  expert_weights.sizes() == expert_ids.sizes() && expert_weights.is_contiguous(),
              "expert_weights must be contiguous [T, top_k] in x's dtype");
  const int64_t H = x.size(1), I = intermediate, E = gate_up.size(0);
  TORCH_CHECK(I > 0 && I % kTile == 0, "the intermediate size must be a multiple of 16");
  const bool pairs = gate_up.dim() == 5;
  const int64_t tile_dims = pairs ? 5 : 4;
  TORCH_CHECK(gate_up.dim() == tile_dims && down.dim() == tile_dims && gate_up.is_contiguous() &&
                  down.is_contiguous() && down.size(0) == E,
              "gate_up and down must be contiguous stacks of one packed layout");
  TORCH_CHECK(gate_up.size(1) == 2 * I / kTile && down.size(1) == (H + kTile - 1) / kTile,
              "the stacks' tiles do not fit 2 x intermediate and hidden columns");
  TORCH_CHECK(gate_up.size(-1) == (pairs ? 2 : kTile) && down.size(-1) == (pairs ? 2 : kTile),
              "the stacks' last dimension does not match their layout");
  if (pairs) {
    TORCH_CHECK(gate_up.size(2) * 2 == H && down.size(2) * 2 == I, "pairs: K does not match");
  } else {
    TORCH_CHECK(gate_up.size(2) == H && down.size(2) == I, "tiles: K does not match");
  }
  TORCH_CHECK(gate_up.scalar_type() == down.scalar_type(), "gate_up and down share a dtype");
  at::Tensor out = at::zeros_like(x);
  if (x.size(0) == 0) return out;
  const Groups g = group_rows(expert_ids.data_ptr<int64_t>(), x.size(0), expert_ids.size(1), E);
  const at::ScalarType wt = gate_up.scalar_type();
  if (x.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(wt == at::kBFloat16, "bf16 activations take bf16 expert weights");
    if (pairs) {
#ifdef LLM_FORGE_MOE_DOT
      run_moe<bf16, uint16_t, true>(x, g, expert_weights, gate_up, down, I, out);
#else
      TORCH_CHECK(false, "this build of the kernels has no bf16 dot products (pairs layout)");
#endif
    } else {
      run_moe<bf16, uint16_t, false>(x, g, expert_weights, gate_up, down, I, out);
    }
  } else {
    TORCH_CHECK(!pairs, "the pairs layout multiplies bf16 activations only");
    if (wt == at::kFloat) run_moe<float, float, false>(x, g, expert_weights, gate_up, down, I, out);
    else run_moe<float, uint16_t, false>(x, g, expert_weights, gate_up, down, I, out);
  }
  return out;
}

}  // namespace llm_forge
