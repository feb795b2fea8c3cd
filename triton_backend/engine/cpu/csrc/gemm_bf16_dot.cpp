// y[M, N] = x[M, K] . W[N, K]^T (+ bias) with bf16 dot-product instructions (AVX-512 BF16:
// vdpbf16ps), for bf16 activations and weights.
//
// Why: a decode step of a small batch reads every weight once, so it is bound by memory and by
// the instructions spent per weight byte. Widening bf16 to fp32 before each FMA (gemm.cpp) costs
// four instructions per 16 weights; vdpbf16ps multiplies 32 bf16 pairs and adds them into 16 fp32
// sums in one. torch's oneDNN GEMM uses the same instruction but at decode-sized M it pays per
// call and streams cold weights at a fraction of the machine's bandwidth.
//
// Layout (packed once at load): output columns in tiles of 16, input features in pairs:
// [tiles, K / 2, 16, 2], so one 64-byte load holds 16 columns x 2 consecutive k. Each x row is
// read as (x[2p], x[2p+1]) pairs broadcast to all 16 lanes. Every output element is summed over
// the pairs in the same order whatever M is and whichever micro-kernel runs it, so a row's result
// does not depend on the rows batched with it.
//
// Compiled only where the compiler targets AVX-512 BF16 (`-march=native` on such a CPU); elsewhere
// `bf16_dot_available()` is false and the Python side keeps the widening kernel.
#include "ops.h"
#include "step.h"
#include "vec.h"

#include <ATen/ATen.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define LLM_FORGE_BF16_DOT 1
#include <immintrin.h>
#endif

namespace llm_forge {

bool bf16_dot_available() {
#ifdef LLM_FORGE_BF16_DOT
  return true;
#else
  return false;
#endif
}

#ifdef LLM_FORGE_BF16_DOT
namespace {

constexpr int kTile = 16;
constexpr int64_t kPairPrefetch = 16;  // pair steps (64 bytes each) ahead of the reads

template <typename T>
inline void store_tile_row(T* out, const __m512& sums, const float* bias, int64_t n0,
                           int64_t n_valid) {
  float values[kTile];
  _mm512_storeu_ps(values, sums);
  for (int64_t j = 0; j < n_valid; ++j)
    out[n0 + j] = static_cast<T>(values[j] + (bias ? bias[n0 + j] : 0.f));
}

// MR rows x NT tiles, all K: MR * NT sums in registers.
template <int MR, int NT, typename T>
void dot_micro_kernel(const uint16_t* x, int64_t K, const uint16_t* w, int64_t tile0,
                      int64_t N, const float* bias, T* out) {
  const int64_t pairs = K / 2;
  __m512 acc[MR][NT];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_setzero_ps();
  const uint16_t* tiles[NT];
  for (int t = 0; t < NT; ++t) tiles[t] = w + (tile0 + t) * pairs * 2 * kTile;
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[NT];
    for (int t = 0; t < NT; ++t) {
      const uint16_t* at = tiles[t] + p * 2 * kTile;
      _mm_prefetch(reinterpret_cast<const char*>(at + kPairPrefetch * 2 * kTile), _MM_HINT_T0);
      wv[t] = (__m512bh)_mm512_loadu_si512(at);
    }
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * K + 2 * p, sizeof pair);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_dpbf16_ps(acc[m][t], xb, wv[t]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    const int64_t n0 = (tile0 + t) * kTile;
    const int64_t n_valid = std::min<int64_t>(kTile, N - n0);
    for (int m = 0; m < MR; ++m) store_tile_row(out + m * N, acc[m][t], bias, n0, n_valid);
  }
}

// Rows [0, M) against NT tiles from tile0: blocks of 4 rows while the tiles' weights stay in
// L1/L2, the last 1-6 rows in one block (5 or 6 rows x 4 tiles: 24 sums, 4 weights and a
// broadcast in the 32 registers). A step of a few rows (a decode with its 4 draft tokens: 5 rows)
// then reads each weight once: in blocks of 4 and 1 it read them twice, and the 5-row step's
// projections took 1.15x the 4-row step's, now 1.02x (Zen 5 EPYC, one thread). 7 and 8 rows
// stay two blocks: 8 rows x 2 tiles ran slower than reading the weights twice.
template <int NT, typename T>
void dot_rows(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t tile0,
              int64_t N, const float* bias, T* out) {
  int64_t m = 0;
  for (; M - m > 6; m += 4)
    dot_micro_kernel<4, NT>(x + m * K, K, w, tile0, N, bias, out + m * N);
  const uint16_t* xr = x + m * K;
  T* o = out + m * N;
  switch (M - m) {
    case 6: dot_micro_kernel<6, NT>(xr, K, w, tile0, N, bias, o); break;
    case 5: dot_micro_kernel<5, NT>(xr, K, w, tile0, N, bias, o); break;
    case 4: dot_micro_kernel<4, NT>(xr, K, w, tile0, N, bias, o); break;
    case 3: dot_micro_kernel<3, NT>(xr, K, w, tile0, N, bias, o); break;
    case 2: dot_micro_kernel<2, NT>(xr, K, w, tile0, N, bias, o); break;
    case 1: dot_micro_kernel<1, NT>(xr, K, w, tile0, N, bias, o); break;
    default: break;
  }
}

// Units [begin, end) on the calling thread: whole 4-tile groups, then the tiles past the last
// whole group one at a time.
constexpr int64_t kGroup = 4;
template <typename T>
void dot_units(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t num_tiles,
               int64_t N, const float* bias, T* out, int64_t begin, int64_t end) {
  const int64_t groups = num_tiles / kGroup;
  for (int64_t i = begin; i < end; ++i) {
    if (i < groups) dot_rows<kGroup>(x, M, K, w, i * kGroup, N, bias, out);
    else dot_rows<1>(x, M, K, w, groups * kGroup + (i - groups), N, bias, out);
  }
}

template <typename T>
void run_dot_gemm(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t num_tiles,
                  int64_t N, const float* bias, T* out) {
  // Threads claim chunks of units (each streams its own weights), about 8 per thread.
  parallel_chunks(step::bf16_pairs_units(num_tiles),
                  step::bf16_pairs_chunk(num_tiles, at::get_num_threads()),
                  [&](int64_t begin, int64_t end) {
                    dot_units(x, M, K, w, num_tiles, N, bias, out, begin, end);
                  });
}

}  // namespace
#endif

at::Tensor linear_bf16_pairs(const at::Tensor& x, const at::Tensor& packed,
                             const c10::optional<at::Tensor>& bias, int64_t N, bool fp32_out) {
#ifdef LLM_FORGE_BF16_DOT
  const int64_t num_tiles = packed.size(0), K = step::bf16_pairs_check_layout(packed, N);
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x must be bf16 for the bf16 dot-product GEMM");
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  GemmOutput o(x, bias, M, N, fp32_out);
  const auto* xp = reinterpret_cast<const uint16_t*>(x2.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  if (M > 0 && fp32_out) run_dot_gemm(xp, M, K, wp, num_tiles, N, o.bias(), o.out.data_ptr<float>());
  else if (M > 0)
    run_dot_gemm(xp, M, K, wp, num_tiles, N, o.bias(), o.out.data_ptr<at::BFloat16>());
  return o.result();
#else
  TORCH_CHECK(false, "this build of the kernels has no bf16 dot-product GEMM (the CPU or the "
                     "compiler target lacks AVX-512 BF16)");
#endif
}

namespace step {

int64_t bf16_pairs_check_layout(const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
                  packed.size(2) == 16 && packed.size(3) == 2 && packed.is_contiguous(),
              "packed weight must be a contiguous bf16 [tiles, K / 2, 16, 2] tensor");
  bf16_check_tiles_fit(packed.size(0), N);
  return 2 * packed.size(1);
}

int64_t bf16_pairs_units(int64_t num_tiles) { return num_tiles / 4 + num_tiles % 4; }

int64_t bf16_pairs_chunk(int64_t num_tiles, int64_t threads) {
  return std::max<int64_t>(1, num_tiles / 4 / (8 * std::max<int64_t>(1, threads)));
}

template <typename T>
void bf16_pairs_range(const at::BFloat16* x, int64_t M, int64_t K, const at::BFloat16* packed,
                      int64_t num_tiles, int64_t N, const float* bias, T* out, int64_t u_begin,
                      int64_t u_end) {
#ifdef LLM_FORGE_BF16_DOT
  dot_units(reinterpret_cast<const uint16_t*>(x), M, K, reinterpret_cast<const uint16_t*>(packed),
            num_tiles, N, bias, out, u_begin, u_end);
#else
  TORCH_CHECK(false, "this build of the kernels has no bf16 dot-product GEMM");
#endif
}
template void bf16_pairs_range<float>(const at::BFloat16*, int64_t, int64_t, const at::BFloat16*,
                                      int64_t, int64_t, const float*, float*, int64_t, int64_t);
template void bf16_pairs_range<at::BFloat16>(const at::BFloat16*, int64_t, int64_t,
                                             const at::BFloat16*, int64_t, int64_t, const float*,
                                             at::BFloat16*, int64_t, int64_t);

}  // namespace step

}  // namespace llm_forge
