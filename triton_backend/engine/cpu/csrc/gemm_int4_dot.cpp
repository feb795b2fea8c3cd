// y[M, N] = x[M, K] . W[N, K]^T (+ bias) for INT4 weights with int8 activations (W4A8): integer
// dot products of 4-bit weights and 8-bit activations, scaled once per block. At the end, the
// same for int8 weights (W8A8, an int8 LM head).
//
// Why: a decode step of a small batch reads every weight once, and an INT4 weight is a quarter
// of a bf16 one; but widening each nibble to fp32 for an FMA costs more instructions per byte
// than the memory saves (the INT4 engine measured no faster than bf16 at one row on an AVX2 CPU,
// and slower at 16 rows and in prefill). Integer dot products do 32 multiply-adds per
// instruction (AVX2 vpmaddubsw: unsigned bytes x signed bytes, pairs summed into int16), where
// fp32 FMAs do 8.
//
// Numbers: a weight is w = u * s + c with u in [0, 15] (the stored nibble), s the group's scale
// and c its offset (-8 s for symmetric INT4, z - 8 s with a zero point z). Each row of x is
// quantized per block of `block` inputs (32, or the group when smaller): a = max |x| / 127,
// q = round(x / a) in [-127, 127]. Then for one output
//   y = sum over groups g of  s_g * (sum over blocks b of g:  a_b * sum_k u_k q_k)  +  c_g * X_g
// where X_g = sum over blocks b of g of a_b * sum_k q_k (the group's activations as quantized).
// The inner sums are exact integers, so every CPU computes the same int32 values; the float part
// runs in the same order for every row whatever M is, and a row's result does not depend on the
// rows batched with it.
//
// Layout (packed once at load): output columns in panels of 32 (four registers of 8), input in
// steps of 8: [panels, K / 8, 4, 32] bytes; byte 4c + j of register r's 32 holds column 8r + c's
// nibbles for k = 8s + j (low) and k = 8s + 4 + j (high). One 32-byte load and two masks give two
// registers of 8 columns x 4 consecutive k, the operand shape of a 4-byte broadcast of x, and a
// panel is one sequential stream (short per-column-tile streams left the hardware prefetcher
// idle: a third of the bandwidth). Scales and offsets: fp16 [panels, K / group, 4, 16], per
// register its 8 scales then its 8 offsets.
#include "ops.h"
#include "step.h"
#include "vec.h"

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <cstring>
#include <type_traits>
#include <vector>

namespace llm_forge {
namespace {

constexpr int kCols = 8;             // output columns per register of sums
constexpr int kRegs = 4;             // registers per panel
constexpr int64_t kPanel = kCols * kRegs;  // output columns per panel
constexpr int64_t kStep = 8;         // inputs per step
constexpr int64_t kRegBytes = 32;    // one register's nibbles for one step
constexpr int64_t kStepBytes = kRegs * kRegBytes;
constexpr int64_t kMaxBlock = 32;    // int16 sums of 4 steps stay below 2^15 (4 * 2 * 2 * 15 * 127)

int64_t block_of(int64_t group) { return group % kMaxBlock == 0 ? kMaxBlock : group; }

// One block of a row: q = round(x * 127 / amax) (ties to even, as torch.round), its scale and the
// sum of its q.
inline float quantize_block(const float* x, int64_t n, int8_t* q, int32_t* q_sum) {
  float amax = 0.f;
  int64_t k = 0;
#if defined(__AVX2__)
  vf vmax = splat(0.f);
  for (; k + kLanes <= n; k += kLanes) {
    const vf v = load(x + k);
    const vf a = v < -v ? -v : v;
    vmax = a > vmax ? a : vmax;
  }
  amax = hmax(vmax);
#endif
  for (; k < n; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t sum = 0;
  k = 0;
#if defined(__AVX2__)
  __m256i vsum = _mm256_setzero_si256();
  for (; k + kLanes <= n; k += kLanes) {
    const __m256 v = _mm256_mul_ps(load(x + k), _mm256_set1_ps(inv));
    const __m256i qi = _mm256_cvtps_epi32(
        _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    vsum = _mm256_add_epi32(vsum, qi);
    const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1));
    const __m128i q8 = _mm_packs_epi16(q16, q16);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), q8);
  }
  alignas(32) int32_t lanes[kLanes];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), vsum);
  for (int i = 0; i < kLanes; ++i) sum += lanes[i];
#endif
  for (; k < n; ++k) {
    const int32_t qi = static_cast<int32_t>(std::nearbyint(x[k] * inv));  // |x * inv| <= 127
    q[k] = static_cast<int8_t>(qi);
    sum += qi;
  }
  *q_sum = sum;
  return amax / 127.f;
}

// A row block's inputs as fp32 (bf16 widened exactly).
inline void block_as_float(const float* x, int64_t n, float* out) { std::memcpy(out, x, n * 4); }
inline void block_as_float(const bf16* x, int64_t n, float* out) {
  for (int64_t k = 0; k < n; ++k) out[k] = static_cast<float>(x[k]);
}

// Rows of activations quantized per block, and their per-group sums (see above); kept per
// thread and reused, so a decode step's hundred calls allocate nothing here.
struct QuantizedRows {
  std::vector<int8_t> q;      // [M, K]
  std::vector<float> a;       // [M, K / block]
  std::vector<float> x_sums;  // [M, K / group]
};

template <typename T>
void quantize_row(const T* x, int64_t K, int64_t group, int8_t* q, float* a, float* x_sums) {
  const int64_t block = block_of(group), per_group = group / block;
  float values[kMaxBlock];
  for (int64_t g = 0; g < K / group; ++g) {
    float x_sum = 0.f;
    for (int64_t bi = 0; bi < per_group; ++bi) {
      const int64_t b = g * per_group + bi, k0 = b * block;
      int32_t q_sum;
      block_as_float(x + k0, block, values);
      a[b] = quantize_block(values, block, q + k0, &q_sum);
      x_sum = std::fma(a[b], static_cast<float>(q_sum), x_sum);
    }
    x_sums[g] = x_sum;
  }
}

template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int64_t group, QuantizedRows& r) {
  const int64_t blocks = K / block_of(group), groups = K / group;
  r.q.resize(M * K);
  r.a.resize(M * blocks);
  r.x_sums.resize(M * groups);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1));
  at::parallel_for(0, M, grain, [&](int64_t m_begin, int64_t m_end) {
    for (int64_t m = m_begin; m < m_end; ++m)
      quantize_row(x + m * K, K, group, r.q.data() + m * K, r.a.data() + m * blocks,
                   r.x_sums.data() + m * groups);
  });
}

struct Weights {
  const uint8_t* packed;
  const at::Half* scale_offsets;
  int64_t K, group, block;
  int64_t steps() const { return K / kStep; }
  const uint8_t* panel(int64_t p) const { return packed + p * steps() * kStepBytes; }
  const at::Half* group_params(int64_t p, int64_t g) const {
    return scale_offsets + (p * (K / group) + g) * kRegs * 2 * kCols;
  }
};

using Activations = step::Int4Rows;

// The stored nibble of column c (of the panel) for input k.
inline int32_t nibble(const uint8_t* panel, int64_t c, int64_t k) {
  const uint8_t byte = panel[(k / kStep) * kStepBytes + (c / kCols) * kRegBytes + 4 * (c % kCols) +
                             k % 4];
  return (k % kStep) < 4 ? (byte & 15) : (byte >> 4);
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline __m256 load_halves(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The sums of MR rows x NP panels (from m0, p) into their output rows, plus the bias.
template <int MR, int NP, typename T>
void store_panels(const __m256 (&acc)[MR][NP * kRegs], int64_t m0, int64_t p, int64_t N,
                  const float* bias, T* out) {
  for (int i = 0; i < NP; ++i) {
    const int64_t n_valid = std::min<int64_t>(kPanel, N - (p + i) * kPanel);
    for (int m = 0; m < MR; ++m) {
      float values[kPanel];
      for (int r = 0; r < kRegs; ++r) _mm256_storeu_ps(values + r * kCols, acc[m][i * kRegs + r]);
      store_row(out + (m0 + m) * N, values, bias, (p + i) * kPanel, n_valid);
    }
  }
}

// MR rows (from m0) x NP panels (from p), all of K. Each panel's bytes are one sequential stream,
// which the hardware prefetcher follows (software prefetches measured no faster); one row takes
// two panels at a time, two streams in flight.
template <int MR, int NP, typename T>
void micro_kernel(const Activations& x, int64_t m0, const Weights& w, int64_t p, int64_t N,
                  const float* bias, T* out) {
  constexpr int R = NP * kRegs;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t steps = w.block / kStep, per_group = w.group / w.block;
  const uint8_t* panels[NP];
  for (int i = 0; i < NP; ++i) panels[i] = w.panel(p + i);
  const int8_t* rows[MR];
  for (int m = 0; m < MR; ++m) rows[m] = x.q + (m0 + m) * x.K;
  __m256 acc[MR][R];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < x.groups; ++g) {
    __m256 gacc[MR][R];
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < R; ++r) gacc[m][r] = _mm256_setzero_ps();
    for (int64_t bi = 0; bi < per_group; ++bi) {
      const int64_t b = g * per_group + bi;
      __m256i sums[MR][R];
      for (int m = 0; m < MR; ++m)
        for (int r = 0; r < R; ++r) sums[m][r] = _mm256_setzero_si256();
      for (int64_t s = b * steps; s < (b + 1) * steps; ++s) {
        __m256i xa[MR], xb[MR];
        for (int m = 0; m < MR; ++m) {
          xa[m] = _mm256_set1_epi32(load_i32(rows[m] + s * kStep));
          xb[m] = _mm256_set1_epi32(load_i32(rows[m] + s * kStep + 4));
        }
        for (int r = 0; r < R; ++r) {
          const uint8_t* reg = panels[r / kRegs] + s * kStepBytes + (r % kRegs) * kRegBytes;
          const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reg));
          const __m256i lo = _mm256_and_si256(bytes, low4);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
          for (int m = 0; m < MR; ++m)
            sums[m][r] = _mm256_add_epi16(
                sums[m][r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xa[m]),
                                             _mm256_maddubs_epi16(hi, xb[m])));
        }
      }
      for (int m = 0; m < MR; ++m) {
        const __m256 a = _mm256_set1_ps(x.a[(m0 + m) * x.blocks + b]);
        for (int r = 0; r < R; ++r)
          gacc[m][r] = _mm256_fmadd_ps(
              a, _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[m][r], ones)), gacc[m][r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const at::Half* params = w.group_params(p + r / kRegs, g) + (r % kRegs) * 2 * kCols;
      const __m256 scale = load_halves(params), offset = load_halves(params + kCols);
      for (int m = 0; m < MR; ++m) {
        acc[m][r] = _mm256_fmadd_ps(scale, gacc[m][r], acc[m][r]);
        acc[m][r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(x.x_sums[(m0 + m) * x.groups + g]),
                                    acc[m][r]);
      }
    }
  }
  store_panels<MR, NP>(acc, m0, p, N, bias, out);
}
#else
// The portable path: the same integers and the same float operations in the same order, one
// output at a time.
template <int MR, typename T>
void panel_rows(const Activations& x, int64_t m0, const Weights& w, int64_t p, int64_t N,
                const float* bias, T* out) {
  const int64_t per_group = w.group / w.block;
  const uint8_t* panel = w.panel(p);
  const int64_t n_valid = std::min<int64_t>(kPanel, N - p * kPanel);
  for (int m = 0; m < MR; ++m) {
    const int8_t* row = x.q + (m0 + m) * x.K;
    float values[kPanel];
    for (int64_t c = 0; c < kPanel; ++c) {
      float acc = 0.f;
      for (int64_t g = 0; g < x.groups; ++g) {
        float gacc = 0.f;
        for (int64_t bi = 0; bi < per_group; ++bi) {
          const int64_t b = g * per_group + bi;
          int32_t dot = 0;
          for (int64_t k = b * w.block; k < (b + 1) * w.block; ++k)
            dot += nibble(panel, c, k) * row[k];
          gacc = std::fma(x.a[(m0 + m) * x.blocks + b], static_cast<float>(dot), gacc);
        }
        const at::Half* params = w.group_params(p, g) + (c / kCols) * 2 * kCols;
        acc = std::fma(static_cast<float>(params[c % kCols]), gacc, acc);
        acc = std::fma(static_cast<float>(params[kCols + c % kCols]),
                       x.x_sums[(m0 + m) * x.groups + g], acc);
      }
      values[c] = acc;
    }
    store_row(out + (m0 + m) * N, values, bias, p * kPanel, n_valid);
  }
}

template <int MR, int NP, typename T>
void micro_kernel(const Activations& x, int64_t m0, const Weights& w, int64_t p, int64_t N,
                  const float* bias, T* out) {
  for (int i = 0; i < NP; ++i) panel_rows<MR>(x, m0, w, p + i, N, bias, out);
}
#endif

// Panels [p_begin, p_end) against every row: each panel meets the rows two at a time while it
// is in L1/L2, so the weights stream from memory once per call; one row takes two panels at a
// time. `kernel(MR, NP, m0, p)` (MR, NP as std::integral_constant) runs one micro-kernel.
template <typename Kernel>
void panel_range(int64_t M, int64_t p_begin, int64_t p_end, const Kernel& kernel) {
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  if (M == 1) {
    int64_t p = p_begin;
    for (; p + 2 <= p_end; p += 2) kernel(One{}, Two{}, 0, p);
    if (p < p_end) kernel(One{}, One{}, 0, p);
    return;
  }
  for (int64_t p = p_begin; p < p_end; ++p) {
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) kernel(Two{}, One{}, m, p);
    if (m < M) kernel(One{}, One{}, m, p);
  }
}

int64_t panel_chunk(int64_t panels, int64_t threads) {
  return std::max<int64_t>(2, panels / (8 * std::max<int64_t>(1, threads))) / 2 * 2;
}

// Threads claim chunks of panels (panel_range each).
template <typename Kernel>
void run_panels(int64_t M, int64_t panels, const Kernel& kernel) {
  parallel_chunks(panels, panel_chunk(panels, at::get_num_threads()),
                  [&](int64_t p_begin, int64_t p_end) { panel_range(M, p_begin, p_end, kernel); });
}

template <typename T>
void run_gemm(const Activations& x, int64_t M, const Weights& w, int64_t panels, int64_t N,
              const float* bias, T* out) {
  run_panels(M, panels, [&](auto mr, auto np, int64_t m0, int64_t p) {
    micro_kernel<decltype(mr)::value, decltype(np)::value>(x, m0, w, p, N, bias, out);
  });
}

void check_layout(const at::Tensor& packed, const at::Tensor& scale_offsets, int64_t group_size,
                  int64_t N) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 &&
                  packed.size(2) == kStepBytes && packed.is_contiguous(),
              "packed weight must be a contiguous uint8 [panels, K / 8, 128] tensor");
  const int64_t panels = packed.size(0), K = packed.size(1) * kStep;
  TORCH_CHECK(group_size > 0 && group_size % kStep == 0 && K % group_size == 0,
              "group_size must be a multiple of 8 that divides K");
  TORCH_CHECK(scale_offsets.scalar_type() == at::kHalf && scale_offsets.is_contiguous() &&
                  scale_offsets.sizes() ==
                      at::IntArrayRef({panels, K / group_size, kRegs * 2 * kCols}),
              "scale_offsets must be a contiguous fp16 [panels, K / group_size, 64] tensor");
  TORCH_CHECK(N > (panels - 1) * kPanel && N <= panels * kPanel, "N does not fit the panels");
}

}  // namespace

namespace step {

int64_t int4_block(int64_t group) { return block_of(group); }

template <typename T>
void int4_quantize_row(const T* x, int64_t K, int64_t group, int8_t* q, float* a,
                       float* x_sums) {
  quantize_row(x, K, group, q, a, x_sums);
}
template void int4_quantize_row(const float*, int64_t, int64_t, int8_t*, float*, float*);
template void int4_quantize_row(const at::BFloat16*, int64_t, int64_t, int8_t*, float*, float*);

template <typename T>
void int4_panels(const Int4Rows& x, int64_t M, const uint8_t* packed,
                 const at::Half* scale_offsets, int64_t group, int64_t N, const float* bias,
                 T* out, int64_t p_begin, int64_t p_end) {
  const Weights w{packed, scale_offsets, x.K, group, block_of(group)};
  panel_range(M, p_begin, p_end, [&](auto mr, auto np, int64_t m0, int64_t p) {
    micro_kernel<decltype(mr)::value, decltype(np)::value>(x, m0, w, p, N, bias, out);
  });
}
template void int4_panels(const Int4Rows&, int64_t, const uint8_t*, const at::Half*, int64_t,
                          int64_t, const float*, float*, int64_t, int64_t);
template void int4_panels(const Int4Rows&, int64_t, const uint8_t*, const at::Half*, int64_t,
                          int64_t, const float*, at::BFloat16*, int64_t, int64_t);

int64_t int4_chunk(int64_t panels, int64_t threads) { return panel_chunk(panels, threads); }

void int4_check_layout(const at::Tensor& packed, const at::Tensor& scale_offsets,
                       int64_t group_size, int64_t N) {
  check_layout(packed, scale_offsets, group_size, N);
}

}  // namespace step

at::Tensor linear_int4_packed(const at::Tensor& x, const at::Tensor& packed,
                              const at::Tensor& scale_offsets,
                              const c10::optional<at::Tensor>& prequant,
                              const c10::optional<at::Tensor>& bias, int64_t group_size, int64_t N) {
  check_layout(packed, scale_offsets, group_size, N);
  const int64_t K = packed.size(1) * kStep;
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "x must be bf16 or fp32");
  const at::Tensor x2 = x.reshape({-1, K});
  const int64_t M = x2.size(0);
  GemmOutput o(x, bias, M, N, false);
  if (M == 0) return o.result();
  thread_local QuantizedRows qr;
  if (prequant.has_value()) {  // the AWQ scale first, rounded as torch rounds x * prequant
    const at::Tensor xf = widen_rows(x2, prequant);
    quantize_rows(xf.data_ptr<float>(), M, K, group_size, qr);
  } else {
    const at::Tensor xc = x2.contiguous();
    if (xc.scalar_type() == at::kBFloat16)
      quantize_rows(xc.data_ptr<at::BFloat16>(), M, K, group_size, qr);
    else
      quantize_rows(xc.data_ptr<float>(), M, K, group_size, qr);
  }
  const int64_t block = block_of(group_size);
  const Activations acts{qr.q.data(), qr.a.data(), qr.x_sums.data(), K, K / block,
                         K / group_size};
  const Weights w{packed.data_ptr<uint8_t>(), scale_offsets.data_ptr<at::Half>(), K, group_size,
                  block};
  if (o.out.scalar_type() == at::kBFloat16)
    run_gemm(acts, M, w, packed.size(0), N, o.bias(), o.out.data_ptr<at::BFloat16>());
  else
    run_gemm(acts, M, w, packed.size(0), N, o.bias(), o.out.data_ptr<float>());
  return o.result();
}

at::Tensor dequantize_int4_packed(const at::Tensor& packed, const at::Tensor& scale_offsets,
                                  int64_t group_size, int64_t N) {
  check_layout(packed, scale_offsets, group_size, N);
  const int64_t panels = packed.size(0), K = packed.size(1) * kStep;
  const Weights w{packed.data_ptr<uint8_t>(), scale_offsets.data_ptr<at::Half>(), K, group_size,
                  block_of(group_size)};
  at::Tensor out = at::empty({N, K}, packed.options().dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  parallel_chunks(panels, 1, [&](int64_t p_begin, int64_t p_end) {
    for (int64_t p = p_begin; p < p_end; ++p) {
      const uint8_t* panel = w.panel(p);
      const int64_t n_valid = std::min<int64_t>(kPanel, N - p * kPanel);
      for (int64_t c = 0; c < n_valid; ++c) {
        float* row = dst + (p * kPanel + c) * K;
        for (int64_t k = 0; k < K; ++k) {
          const at::Half* params = w.group_params(p, k / group_size) + (c / kCols) * 2 * kCols;
          row[k] = std::fma(static_cast<float>(nibble(panel, c, k)),
                            static_cast<float>(params[c % kCols]),
                            static_cast<float>(params[kCols + c % kCols]));
        }
      }
    }
  });
  return out;
}

// ---- int8 weights (the LM head of `quantization.lm_head: int8`): the same int8 activations ----
//
// w = q * s per column and block of 32 inputs (llama.cpp's Q8_0), q in [-127, 127]. Layout:
// [panels, K / 4, 4, 32] bytes, byte 4c + j of register r holding column 8r + c's q for
// k = 4s + j; scales fp16 [panels, K / 32, 32]. vpmaddubsw takes one unsigned operand, so each
// step multiplies |q| by x carrying q's sign (vpsignb), pairs summed into int16 (at most
// 2 * 127 * 127), then into int32.
namespace {

constexpr int64_t kInt8Step = 4;
constexpr int64_t kInt8Block = 32;

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
template <int MR, int NP, typename T>
void int8_kernel(const Activations& x, int64_t m0, const uint8_t* packed, const at::Half* scales,
                 int64_t K, int64_t p, int64_t N, const float* bias, T* out) {
  constexpr int R = NP * kRegs;
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t steps = K / kInt8Step, blocks = K / kInt8Block;
  const int8_t* rows[MR];
  for (int m = 0; m < MR; ++m) rows[m] = x.q + (m0 + m) * x.K;
  __m256 acc[MR][R];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i sums[MR][R];
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < R; ++r) sums[m][r] = _mm256_setzero_si256();
    for (int64_t s = b * (kInt8Block / kInt8Step); s < (b + 1) * (kInt8Block / kInt8Step); ++s) {
      __m256i xs[MR];
      for (int m = 0; m < MR; ++m) xs[m] = _mm256_set1_epi32(load_i32(rows[m] + s * kInt8Step));
      for (int r = 0; r < R; ++r) {
        const uint8_t* reg = packed + ((p + r / kRegs) * steps + s) * kStepBytes +
                             (r % kRegs) * kRegBytes;
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reg));
        const __m256i magnitude = _mm256_abs_epi8(w);
        for (int m = 0; m < MR; ++m)
          sums[m][r] = _mm256_add_epi32(
              sums[m][r], _mm256_madd_epi16(
                              _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xs[m], w)), ones));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 scale = load_halves(scales + ((p + r / kRegs) * blocks + b) * kPanel +
                                       (r % kRegs) * kCols);
      for (int m = 0; m < MR; ++m) {
        const __m256 a = _mm256_mul_ps(_mm256_set1_ps(x.a[(m0 + m) * x.blocks + b]), scale);
        acc[m][r] = _mm256_fmadd_ps(a, _mm256_cvtepi32_ps(sums[m][r]), acc[m][r]);
      }
    }
  }
  store_panels<MR, NP>(acc, m0, p, N, bias, out);
}
#else
template <int MR, int NP, typename T>
void int8_kernel(const Activations& x, int64_t m0, const uint8_t* packed, const at::Half* scales,
                 int64_t K, int64_t p, int64_t N, const float* bias, T* out) {
  const int64_t steps = K / kInt8Step, blocks = K / kInt8Block;
  for (int i = 0; i < NP; ++i) {
    const int64_t n_valid = std::min<int64_t>(kPanel, N - (p + i) * kPanel);
    for (int m = 0; m < MR; ++m) {
      const int8_t* row = x.q + (m0 + m) * x.K;
      float values[kPanel];
      for (int64_t c = 0; c < kPanel; ++c) {
        float acc = 0.f;
        for (int64_t b = 0; b < blocks; ++b) {
          int32_t dot = 0;
          for (int64_t k = b * kInt8Block; k < (b + 1) * kInt8Block; ++k) {
            const uint8_t* reg = packed + ((p + i) * steps + k / kInt8Step) * kStepBytes +
                                 (c / kCols) * kRegBytes;
            dot += static_cast<int8_t>(reg[4 * (c % kCols) + k % kInt8Step]) * row[k];
          }
          const float scale = static_cast<float>(scales[((p + i) * blocks + b) * kPanel + c]);
          acc = std::fma(x.a[(m0 + m) * x.blocks + b] * scale, static_cast<float>(dot), acc);
        }
        values[c] = acc;
      }
      store_row(out + (m0 + m) * N, values, bias, (p + i) * kPanel, n_valid);
    }
  }
}
#endif

template <typename T>
void run_int8(const Activations& x, int64_t M, const uint8_t* packed, const at::Half* scales,
              int64_t K, int64_t panels, int64_t N, T* out) {
  run_panels(M, panels, [&](auto mr, auto np, int64_t m0, int64_t p) {
    int8_kernel<decltype(mr)::value, decltype(np)::value>(x, m0, packed, scales, K, p, N,
                                                          nullptr, out);
  });
}

}  // namespace

at::Tensor linear_int8_packed(const at::Tensor& x, const at::Tensor& packed,
                              const at::Tensor& scales, int64_t N, bool fp32_out) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 &&
                  packed.size(2) == kStepBytes && packed.is_contiguous(),
              "packed weight must be a contiguous uint8 [panels, K / 4, 128] tensor");
  const int64_t panels = packed.size(0), K = packed.size(1) * kInt8Step;
  TORCH_CHECK(K % kInt8Block == 0, "in_features must be a multiple of 32, got ", K);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.sizes() == at::IntArrayRef({panels, K / kInt8Block, kPanel}),
              "scales must be a contiguous fp16 [panels, K / 32, 32] tensor");
  TORCH_CHECK(N > (panels - 1) * kPanel && N <= panels * kPanel, "N does not fit the panels");
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "x must be bf16 or fp32");
  const at::Tensor xc = x.reshape({-1, K}).contiguous();
  const int64_t M = xc.size(0);
  GemmOutput o(x, c10::nullopt, M, N, fp32_out);
  if (M == 0) return o.result();
  thread_local QuantizedRows qr;
  if (xc.scalar_type() == at::kBFloat16)
    quantize_rows(xc.data_ptr<at::BFloat16>(), M, K, kInt8Block, qr);
  else
    quantize_rows(xc.data_ptr<float>(), M, K, kInt8Block, qr);
  const Activations acts{qr.q.data(), qr.a.data(), qr.x_sums.data(), K, K / kInt8Block,
                         K / kInt8Block};
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const at::Half* s = scales.data_ptr<at::Half>();
  if (o.out.scalar_type() == at::kBFloat16)
    run_int8(acts, M, w, s, K, panels, N, o.out.data_ptr<at::BFloat16>());
  else
    run_int8(acts, M, w, s, K, panels, N, o.out.data_ptr<float>());
  return o.result();
}

}  // namespace llm_forge
