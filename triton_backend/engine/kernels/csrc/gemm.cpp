// y[M, N] = x[M, K] . W[N, K]^T (+ bias) with W in bf16, packed, and fp32 accumulation.
//
// Why: on CPUs without bf16 dot-product instructions (AVX2-only x86, for one) torch's bf16 GEMM
// runs an order of magnitude below its fp32 GEMM. Here each weight is widened to fp32 in registers
// (a 16-bit shift) right before its FMAs, so the weights stay bf16 in memory (half the bytes of
// fp32, which is what bounds decoding) while the arithmetic runs at fp32 FMA speed.
//
// Layout: W is packed once at load as [ceil(N/16), K, 16]: tile t holds output columns
// [16t, 16t+16) with the 16 values of one k next to each other, so the micro-kernel reads two
// 8-lane vectors per k and broadcasts one x value per row: MR rows x 16 columns of accumulators.
// Each output element is accumulated over k in the same order whatever M is, so a row's result
// does not depend on the rows batched with it.
#include "vec.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

namespace llm_forge {
namespace {

constexpr int kTile = 16;
constexpr int64_t kRowBlock = 96;  // rows of x kept hot in L2 while the tiles stream past
constexpr int64_t kPrefetch = 32;  // k steps (1 KiB of a tile) ahead

template <typename T>
inline void store_row(T* out, const vf* acc, const float* bias, int64_t n0, int64_t n_valid) {
  float tmp[kTile];
  store(tmp, acc[0]);
  store(tmp + kLanes, acc[1]);
  for (int64_t j = 0; j < n_valid; ++j) {
    float v = tmp[j] + (bias ? bias[n0 + j] : 0.f);
    out[n0 + j] = static_cast<T>(v);
  }
}

// MR rows x NT tiles: MR * NT * 2 accumulators. NT > 1 only for tiny M, where one tile's two
// accumulator chains per row could not hide the FMA latency.
template <int MR, int NT, typename T>
inline void micro_kernel(const float* x, int64_t K, const uint16_t* w, int64_t tile0,
                         int64_t num_tiles, int64_t N, const float* bias, T* out) {
  vf acc[MR][NT][2];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t][0] = acc[m][t][1] = splat(0.f);
  const uint16_t* wt[NT];
  for (int t = 0; t < NT; ++t) wt[t] = w + (tile0 + t) * K * kTile;
  for (int64_t k = 0; k < K; ++k) {
    vf w0[NT], w1[NT];
    // Ahead of the hardware prefetcher on these interleaved streams (a prefetch never faults,
    // so running past a tile's end is harmless).
    if (k % 2 == 0)
      for (int t = 0; t < NT; ++t) __builtin_prefetch(wt[t] + (k + kPrefetch) * kTile);
    for (int t = 0; t < NT; ++t) {
      w0[t] = load_bits(wt[t] + k * kTile);
      w1[t] = load_bits(wt[t] + k * kTile + kLanes);
    }
    for (int m = 0; m < MR; ++m) {
      vf xb = splat(x[m * K + k]);
      for (int t = 0; t < NT; ++t) {
        acc[m][t][0] = fmadd(xb, w0[t], acc[m][t][0]);
        acc[m][t][1] = fmadd(xb, w1[t], acc[m][t][1]);
      }
    }
  }
  for (int t = 0; t < NT && tile0 + t < num_tiles; ++t) {
    int64_t n0 = (tile0 + t) * kTile;
    int64_t n_valid = std::min<int64_t>(kTile, N - n0);
    for (int m = 0; m < MR; ++m) store_row(out + m * N, acc[m][t], bias, n0, n_valid);
  }
}

template <int MR, typename T>
inline void one_tile(const float* x, int64_t K, const uint16_t* w, int64_t t, int64_t num_tiles,
                     int64_t N, const float* bias, T* out) {
  micro_kernel<MR, 1>(x, K, w, t, num_tiles, N, bias, out);
}

// Rows [0, rows) of x against tiles [t_begin, t_end). Up to 3 rows: one pass, several tiles at a
// time. More rows: tile by tile, every 6-row chunk against the tile while it is in L1, so the
// weights stream from memory once per row block, not once per chunk.
template <typename T>
void gemm_block(const float* x, int64_t rows, int64_t K, const uint16_t* w, int64_t t_begin,
                int64_t t_end, int64_t num_tiles, int64_t N, const float* bias, T* out) {
  if (rows <= 3) {
    constexpr int kGroup[4] = {1, 4, 3, 2};  // tiles per pass for 1, 2, 3 rows
    int64_t t = t_begin;
    const int group = kGroup[rows];
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

template <typename T>
void run_gemm(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t num_tiles,
              int64_t N, const float* bias, T* out) {
  // Threads split the tiles (each streams its own share of the weights); rows are blocked so a
  // block of x stays in cache while a thread's tiles stream past it.
  int64_t grain = M <= 4 ? 4 : 1;
  at::parallel_for(0, num_tiles, grain, [&](int64_t t_begin, int64_t t_end) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
      int64_t rows = std::min(kRowBlock, M - m0);
      gemm_block(x + m0 * K, rows, K, w, t_begin, t_end, num_tiles, N, bias, out + m0 * N);
    }
  });
}

// x as contiguous fp32 rows (a copy only when it is bf16 or strided).
at::Tensor widen_rows(const at::Tensor& x2) {
  if (x2.scalar_type() == at::kFloat && x2.is_contiguous()) return x2;
  if (x2.scalar_type() != at::kBFloat16 || !x2.is_contiguous()) return x2.to(at::kFloat).contiguous();
  at::Tensor xf = at::empty(x2.sizes(), x2.options().dtype(at::kFloat));
  const auto* src = reinterpret_cast<const uint16_t*>(x2.data_ptr<at::BFloat16>());
  float* dst = xf.data_ptr<float>();
  const int64_t n = x2.numel();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(dst + i, load_bits(src + i));
  for (; i < n; ++i) dst[i] = static_cast<float>(x2.data_ptr<at::BFloat16>()[i]);
  return xf;
}

}  // namespace

at::Tensor linear_bf16_packed(const at::Tensor& x, const at::Tensor& packed,
                              const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 3 &&
                  packed.size(2) == kTile && packed.is_contiguous(),
              "packed weight must be a contiguous bf16 [tiles, K, 16] tensor");
  const int64_t K = packed.size(1), num_tiles = packed.size(0);
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(N > (num_tiles - 1) * kTile && N <= num_tiles * kTile, "N does not fit the tiles");
  auto x2 = x.reshape({-1, K});
  const int64_t M = x2.size(0);
  at::Tensor xf = widen_rows(x2);
  at::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();
  const float* bias_ptr = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor out = at::empty({M, N}, x.options());
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  if (M > 0) {
    if (x.scalar_type() == at::kBFloat16) {
      run_gemm(xf.data_ptr<float>(), M, K, w, num_tiles, N, bias_ptr, out.data_ptr<at::BFloat16>());
    } else {
      TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be bf16 or fp32");
      run_gemm(xf.data_ptr<float>(), M, K, w, num_tiles, N, bias_ptr, out.data_ptr<float>());
    }
  }
  return out.view(sizes);
}

}  // namespace llm_forge
