// y[M, N] = x[M, K] . W[N, K]^T (+ bias) for bf16 weights kept compact in memory (INT4 weights:
// gemm_int4_dot.cpp).
//
// Why: decoding reads every weight once per step, so bytes in memory bound it, while CPUs
// without bf16 dot-product instructions (AVX2-only x86, for one) run torch's bf16 GEMM an
// order of magnitude below its fp32 GEMM. Here each weight is widened to fp32 in registers right
// before its FMAs: compact in memory, fp32 FMA speed in the arithmetic.
//
// Layout (packed once at load): output columns in tiles of 16: [tiles, K, 16], the 16 values of
// one k side by side. The micro-kernel reads two 8-lane vectors of weights per k and broadcasts
// one x value per row: MR rows x 16 columns of accumulators (x NT tiles for tiny M). Every output
// element is summed over k in the same order whatever M is, so a row's result does not depend on
// the rows batched with it.
#include "ops.h"
#include "step.h"
#include "vec.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

namespace llm_forge {
namespace {

constexpr int kTile = 16;
constexpr int64_t kRowBlock = 96;  // rows of x kept hot in L2 while the tiles stream past
constexpr int64_t kPrefetch = 32;  // k steps ahead of the reads

struct Bf16Tiles {
  const uint16_t* data;
  int64_t K;
  const uint16_t* tile(int64_t t) const { return data + t * K * kTile; }
  void prefetch(const uint16_t* tile, int64_t k) const {
    if (k % 2 == 0) __builtin_prefetch(tile + (k + kPrefetch) * kTile);  // never faults
  }
  void load(const uint16_t* tile, int64_t k, vf& w0, vf& w1) const {
    w0 = load_bits(tile + k * kTile);
    w1 = load_bits(tile + k * kTile + kLanes);
  }
};

// MR rows x NT tiles, sums in registers over all of K.
template <int MR, int NT, typename W, typename T>
void micro_kernel(const float* x, int64_t K, const W& w, int64_t tile0, int64_t num_tiles,
                  int64_t N, const float* bias, T* out) {
  vf acc[MR][NT][2];
  decltype(w.tile(0)) tiles[NT];
  for (int t = 0; t < NT; ++t) tiles[t] = w.tile(tile0 + t);
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t][0] = acc[m][t][1] = splat(0.f);
  for (int64_t k = 0; k < K; ++k) {
    vf w0[NT], w1[NT];
    for (int t = 0; t < NT; ++t) {
      w.prefetch(tiles[t], k);
      w.load(tiles[t], k, w0[t], w1[t]);
    }
    for (int m = 0; m < MR; ++m) {
      const vf xb = splat(x[m * K + k]);
      for (int t = 0; t < NT; ++t) {
        acc[m][t][0] = fmadd(xb, w0[t], acc[m][t][0]);
        acc[m][t][1] = fmadd(xb, w1[t], acc[m][t][1]);
      }
    }
  }
  for (int t = 0; t < NT && tile0 + t < num_tiles; ++t) {
    const int64_t n0 = (tile0 + t) * kTile;
    const int64_t n_valid = std::min<int64_t>(kTile, N - n0);
    for (int m = 0; m < MR; ++m) {
      float values[kTile];
      store(values, acc[m][t][0]);
      store(values + kLanes, acc[m][t][1]);
      store_row(out + m * N, values, bias, n0, n_valid);
    }
  }
}

template <int MR, typename W, typename T>
inline void one_tile(const float* x, int64_t K, const W& w, int64_t t, int64_t num_tiles,
                     int64_t N, const float* bias, T* out) {
  micro_kernel<MR, 1>(x, K, w, t, num_tiles, N, bias, out);
}

// Rows [0, rows) of x against tiles [t_begin, t_end). Up to 3 rows: one pass, several tiles at a
// time (enough independent sums to hide the FMA latency). More rows: tile by tile, every 6-row
// chunk against the tile while it is in L1, so weights stream from memory once per row block.
template <typename W, typename T>
void gemm_block(const float* x, int64_t rows, int64_t K, const W& w, int64_t t_begin,
                int64_t t_end, int64_t num_tiles, int64_t N, const float* bias, T* out) {
  if (rows <= 3) {
    constexpr int kGroup[4] = {1, 4, 3, 2};  // tiles per pass for 1, 2, 3 rows
    const int group = kGroup[rows];
    int64_t t = t_begin;
    for (; t + group <= t_end; t += group) {
      if (rows == 1) micro_kernel<1, 4>(x, K, w, t, num_tiles, N, bias, out);
      else if (rows == 2) micro_kernel<2, 3>(x, K, w, t, num_tiles, N, bias, out);
      else micro_kernel<3, 2>(x, K, w, t, num_tiles, N, bias, out);
    }
    for (; t < t_end; ++t) {
      if (rows == 1) one_tile<1>(x, K, w, t, num_tiles, N, bias, out);
      else if (rows == 2) one_tile<2>(x, K, w, t, num_tiles, N, bias, out);
      else one_tile<3>(x, K, w, t, num_tiles, N, bias, out);
    }
    return;
  }
  for (int64_t t = t_begin; t < t_end; ++t) {
    int64_t m = 0;
    for (; m + 6 <= rows; m += 6) one_tile<6>(x + m * K, K, w, t, num_tiles, N, bias, out + m * N);
    const float* xr = x + m * K;
    T* o = out + m * N;
    switch (rows - m) {
      case 5: one_tile<5>(xr, K, w, t, num_tiles, N, bias, o); break;
      case 4: one_tile<4>(xr, K, w, t, num_tiles, N, bias, o); break;
      case 3: one_tile<3>(xr, K, w, t, num_tiles, N, bias, o); break;
      case 2: one_tile<2>(xr, K, w, t, num_tiles, N, bias, o); break;
      case 1: one_tile<1>(xr, K, w, t, num_tiles, N, bias, o); break;
      default: break;
    }
  }
}

// Tiles [t_begin, t_end) against every row, in blocks of kRowBlock rows.
template <typename W, typename T>
void tile_range(const float* x, int64_t M, int64_t K, const W& w, int64_t t_begin, int64_t t_end,
                int64_t num_tiles, int64_t N, const float* bias, T* out) {
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, M - m0);
    gemm_block(x + m0 * K, rows, K, w, t_begin, t_end, num_tiles, N, bias, out + m0 * N);
  }
}

// About 8 chunks per thread, in whole groups of the small-M kernels' 4-tile passes.
int64_t tile_chunk(int64_t num_tiles, int64_t threads) {
  const int64_t chunk = std::max<int64_t>(4, num_tiles / (8 * std::max<int64_t>(1, threads)));
  return (chunk + 3) / 4 * 4;
}

template <typename W, typename T>
void run_gemm(const float* x, int64_t M, int64_t K, const W& w, int64_t num_tiles, int64_t N,
              const float* bias, T* out) {
  // Threads claim chunks of tiles (each streams its own weights); rows are blocked so a block of
  // x stays in cache while a chunk's tiles stream past it.
  parallel_chunks(num_tiles, tile_chunk(num_tiles, at::get_num_threads()),
                  [&](int64_t t_begin, int64_t t_end) {
                    tile_range(x, M, K, w, t_begin, t_end, num_tiles, N, bias, out);
                  });
}

// One row of x as fp32, times the per-input `prequant` scale when given (AWQ smoothing, rounded
// like torch's `x * prequant.to(x.dtype)`: the scale rounded to x's dtype, the product computed
// in fp32 and rounded to x's dtype).
template <typename T, typename P>
void widen_one_row(const T* row, const P* prequant, int64_t K, float* dst) {
  if (prequant == nullptr) {
    for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<float>(row[k]);
  } else {
    for (int64_t k = 0; k < K; ++k)
      dst[k] = round_to<T>(static_cast<float>(row[k]) *
                           round_to<T>(static_cast<float>(prequant[k])));
  }
}

// All rows (widen_one_row). One pass in C++: a decode step calls this for every projection of
// every layer, where a chain of ATen ops cost more than the product itself.
template <typename T, typename P>
void widen_rows_into(const T* x, const P* prequant, int64_t M, int64_t K, float* out) {
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1));
  at::parallel_for(0, M, grain, [&](int64_t m_begin, int64_t m_end) {
    for (int64_t m = m_begin; m < m_end; ++m) widen_one_row(x + m * K, prequant, K, out + m * K);
  });
}

}  // namespace

at::Tensor widen_rows(const at::Tensor& x2, const c10::optional<at::Tensor>& prequant) {
  if (!prequant.has_value() && x2.scalar_type() == at::kFloat && x2.is_contiguous()) return x2;
  const at::Tensor xc = x2.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  at::Tensor pc;
  if (prequant.has_value()) {
    pc = prequant->contiguous();
    TORCH_CHECK(pc.numel() == K, "prequant has ", pc.numel(), " scales for ", K, " features");
    if (pc.scalar_type() != at::kFloat && pc.scalar_type() != at::kBFloat16)
      pc = pc.to(at::kFloat);
  }
  at::Tensor out = at::empty({M, K}, xc.options().dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  auto with_x = [&](auto* x) {
    if (!pc.defined()) widen_rows_into(x, static_cast<const float*>(nullptr), M, K, dst);
    else if (pc.scalar_type() == at::kFloat) widen_rows_into(x, pc.data_ptr<float>(), M, K, dst);
    else widen_rows_into(x, pc.data_ptr<at::BFloat16>(), M, K, dst);
  };
  if (xc.scalar_type() == at::kBFloat16) with_x(xc.data_ptr<at::BFloat16>());
  else if (xc.scalar_type() == at::kFloat) with_x(xc.data_ptr<float>());
  else return widen_rows(xc.to(at::kFloat), prequant);
  return out;
}

namespace {

template <typename W>
at::Tensor gemm(const at::Tensor& x, const W& w, int64_t K, int64_t num_tiles, int64_t N,
                const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& prequant,
                bool fp32_out = false) {
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "x must be bf16 or fp32");
  auto x2 = x.reshape({-1, K});
  const int64_t M = x2.size(0);
  at::Tensor xf = widen_rows(x2, prequant);
  GemmOutput o(x, bias, M, N, fp32_out);
  if (M > 0) {
    if (o.out.scalar_type() == at::kBFloat16)
      run_gemm(xf.data_ptr<float>(), M, K, w, num_tiles, N, o.bias(), o.out.data_ptr<at::BFloat16>());
    else
      run_gemm(xf.data_ptr<float>(), M, K, w, num_tiles, N, o.bias(), o.out.data_ptr<float>());
  }
  return o.result();
}

}  // namespace

namespace step {

template <typename T>
void bf16_tiles(const float* x, int64_t M, int64_t K, const at::BFloat16* packed,
                int64_t num_tiles, int64_t N, const float* bias, T* out, int64_t t_begin,
                int64_t t_end) {
  const Bf16Tiles w{reinterpret_cast<const uint16_t*>(packed), K};
  tile_range(x, M, K, w, t_begin, t_end, num_tiles, N, bias, out);
}
template void bf16_tiles(const float*, int64_t, int64_t, const at::BFloat16*, int64_t, int64_t,
                         const float*, float*, int64_t, int64_t);
template void bf16_tiles(const float*, int64_t, int64_t, const at::BFloat16*, int64_t, int64_t,
                         const float*, at::BFloat16*, int64_t, int64_t);

int64_t bf16_chunk(int64_t tiles, int64_t threads) { return tile_chunk(tiles, threads); }

void bf16_check_layout(const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 3 &&
                  packed.size(2) == kTile && packed.is_contiguous(),
              "packed weight must be a contiguous bf16 [tiles, K, 16] tensor");
  bf16_check_tiles_fit(packed.size(0), N);
}

template <typename T, typename P>
void widen_row(const T* x, const P* prequant, int64_t K, float* out) {
  widen_one_row(x, prequant, K, out);
}
template void widen_row(const float*, const float*, int64_t, float*);
template void widen_row(const at::BFloat16*, const float*, int64_t, float*);
template void widen_row(const float*, const at::BFloat16*, int64_t, float*);
template void widen_row(const at::BFloat16*, const at::BFloat16*, int64_t, float*);

}  // namespace step

at::Tensor linear_bf16_packed(const at::Tensor& x, const at::Tensor& packed,
                              const c10::optional<at::Tensor>& bias, int64_t N, bool fp32_out) {
  if (packed.dim() == 5) return linear_bf16_amx(x, packed, bias, N, fp32_out);
  if (packed.dim() == 4) return linear_bf16_pairs(x, packed, bias, N, fp32_out);
  step::bf16_check_layout(packed, N);
  const Bf16Tiles w{reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
                    packed.size(1)};
  return gemm(x, w, packed.size(1), packed.size(0), N, bias, c10::nullopt, fp32_out);
}

}  // namespace llm_forge
