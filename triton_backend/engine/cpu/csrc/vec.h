// Portable 8-lane float vectors (GCC/Clang vector extensions), bf16 <-> fp32 conversions, and
// the one-byte KV cache's elements (int8, FP8 e4m3) read as fp32.
//
// Compiled with -march=native on the machine that runs it, so the compiler maps these onto AVX2
// (or wider) where present and onto NEON elsewhere; nothing here names an instruction set except
// the FMA helper, which uses the x86 intrinsic when the CPU has FMA.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <atomic>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX__) || defined(__FMA__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace llm_forge {

constexpr int kLanes = 8;
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(32)));
typedef uint16_t vh __attribute__((vector_size(16)));

using bf16 = c10::BFloat16;
using fp8 = c10::Float8_e4m3fn;  // a one-byte KV cache's FP8 elements (stored in uint8 by torch)

inline vf splat(float x) { return vf{x, x, x, x, x, x, x, x}; }

// a * b + c with one rounding where the CPU fuses it (only the GEMM and dot products use it;
// elementwise kernels round like the torch ops they replace).
inline vf fmadd(vf a, vf b, vf c) {
#if defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// The 8 horizontal sums of a[0..7], as one vector (score j of 8 keys at once).
inline vf hsum8(const vf* a) {
#if defined(__AVX__)
  __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_permute2f128_ps(u0, u1, 0x20) + _mm256_permute2f128_ps(u0, u1, 0x31);
#else
  vf out;
  for (int j = 0; j < kLanes; ++j) out[j] = hsum(a[j]);
  return out;
#endif
}

inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

inline vf load_bits(const uint16_t* p) {  // 8 bf16 bit patterns -> fp32 (exact)
#if defined(__AVX2__)
  // One vpmovzxwd from memory; GCC's generic widening of a 16-byte vector splits it in halves.
  const __m256i lanes = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return (vf)_mm256_slli_epi32(lanes, 16);
#else
  vh h;
  std::memcpy(&h, p, sizeof h);
  return (vf)(__builtin_convertvector(h, vu) << 16);
#endif
}
inline vf load(const bf16* p) { return load_bits(reinterpret_cast<const uint16_t*>(p)); }

inline vf load(const int8_t* p) {  // 8 int8 values -> fp32 (exact)
#if defined(__AVX2__)
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  typedef int8_t vb __attribute__((vector_size(8)));
  vb b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, vf);
#endif
}

inline vf load(const fp8* p) {  // 8 FP8 e4m3 values -> fp32 (exact, subnormals included)
#if defined(__AVX2__) && defined(__F16C__)
  // s eeee mmm moved into fp16's fields (s 0eeee mmm0000000) is the same number times 2^-8 in
  // fp16, whose exponent bias is 15 where e4m3's is 7; the hardware widens fp16, subnormals too.
  // (e4m3's NaN pattern would read as 480: a cache never holds it, values are clamped to 448.)
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
  return _mm256_cvtph_ps(h) * splat(256.f);
#else
  vf v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// fp32 -> bf16 bits, round to nearest even, NaN -> 0x7FC0: exactly c10::BFloat16's rounding.
inline vh to_bf16_bits(vf v) {
  vu u = (vu)v;
  vu rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  vu nan = (vu)(v != v);
  rounded = (rounded & ~nan) | (vu{0x7FC0, 0x7FC0, 0x7FC0, 0x7FC0, 0x7FC0, 0x7FC0, 0x7FC0,
                                   0x7FC0} & nan);
  return __builtin_convertvector(rounded, vh);
}
inline void store(bf16* p, vf v) {
  vh h = to_bf16_bits(v);
  std::memcpy(p, &h, sizeof h);
}

// The value `v` takes once stored as T and read back (how torch rounds between ops).
inline vf round_as(vf v, const float*) { return v; }
inline vf round_as(vf v, const bf16*) {
  vh h = to_bf16_bits(v);
  return (vf)(__builtin_convertvector(h, vu) << 16);
}
template <typename T> inline vf round_to(vf v) { return round_as(v, static_cast<const T*>(nullptr)); }
template <typename T> inline float round_to(float x) { return static_cast<float>(static_cast<T>(x)); }

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return static_cast<float>(x); }
inline float to_float(int8_t x) { return static_cast<float>(x); }
inline float to_float(fp8 x) { return static_cast<float>(x); }

// exp(x) for 8 lanes: Cephes-style range reduction and polynomial, ~1 ulp in float. Used by
// softmax and SiLU, where torch's own vectorized exp is just as approximate.
inline vf vexp(vf x) {
  const vf hi = splat(88.3762626647949f), lo = splat(-88.3762626647949f);
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  vf fx = x * splat(1.44269504088896341f) + splat(0.5f);
  vi n = __builtin_convertvector(fx, vi);
  vf nf = __builtin_convertvector(n, vf);
  n = nf > fx ? n - 1 : n;  // floor
  nf = __builtin_convertvector(n, vf);
  vf r = x - nf * splat(0.693359375f) - nf * splat(-2.12194440e-4f);
  vf y = splat(1.9875691500E-4f);
  y = y * r + splat(1.3981999507E-3f);
  y = y * r + splat(8.3334519073E-3f);
  y = y * r + splat(4.1665795894E-2f);
  y = y * r + splat(1.6666665459E-1f);
  y = y * r + splat(5.0000001201E-1f);
  y = y * r * r + r + splat(1.0f);
  vi bits = (n + 127) << 23;
  return y * (vf)bits;
}

// Work [0, n) in chunks claimed from a shared counter by every thread of the team. A thread that
// the OS preempts (a server process needing the core for a moment) then delays only the chunk
// it holds, not a fixed half of the work: with a static split the others would wait for its
// whole share at the end of the region.
template <typename F>
void parallel_chunks(int64_t n, int64_t chunk, const F& body) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + chunk - 1) / chunk);
  if (threads <= 1) {
    body(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (;;) {
      const int64_t begin = next.fetch_add(chunk);
      if (begin >= n) return;
      body(begin, std::min(n, begin + chunk));
    }
  });
}

}  // namespace llm_forge
