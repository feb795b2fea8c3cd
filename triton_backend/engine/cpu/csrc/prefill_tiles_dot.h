// Prefill attention's inner loops on AVX-512 BF16 (see prefill_tiles.h): vdpbf16ps multiplies
// 16 lanes x 2 bf16 pairs and adds them to fp32 sums, as the bf16 GEMM (gemm_bf16_dot.cpp) does.
//
// Layouts: queries [D / 2][Rp] bf16 pairs; keys read in place as bf16 rows (a pair of features
// broadcast to all lanes); scores [keys][Rp] fp32; probabilities [keys / 2][Rp] bf16 pairs (two
// consecutive keys of one lane); values [keys / 2][D] bf16 pairs (two consecutive keys of one
// feature, broadcast); O^T [D][Rp] fp32. Probabilities are rounded to bf16 for P.V, as torch's
// flash attention rounds them; the sums l are of the unrounded values.
#pragma once

#include <immintrin.h>

namespace llm_forge {
namespace prefill {

// 2^x, 16 lanes, for x <= 0: the same polynomial as vexp2, 2^n applied by vscalefps, which
// takes x = -1e30 (DotTiles::kMasked, or any x below 2^-149) to exactly 0.
inline __m512 exp2_16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 16-bit lane indices for vpermw / vpermt2w: (a[i], b[i]) pairs of two 32-lane sources, the
// first 16 of them (kPairLow) or the last 16 (kPairHigh); and of one register holding a then b
// (16 lanes each, kPairSplit).
alignas(64) inline constexpr uint16_t kPairLow[32] = {
    0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
alignas(64) inline constexpr uint16_t kPairHigh[32] = {
    16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
    24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
alignas(64) inline constexpr uint16_t kPairSplit[32] = {
    0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

inline __m512i lane_indices(const uint16_t* idx) { return _mm512_load_si512(idx); }

// Two rows of 32 bf16 (a, b) -> 32 pairs (a[i], b[i]).
inline void interleave_pairs(__m512i a, __m512i b, pair_bits* out) {
  _mm512_storeu_si512(out, _mm512_permutex2var_epi16(a, lane_indices(kPairLow), b));
  _mm512_storeu_si512(out + 16, _mm512_permutex2var_epi16(a, lane_indices(kPairHigh), b));
}

// x[i][j] -> x[j][i] for 16 x 16 32-bit elements: pairs of rows interleaved by 32 and 64 bits
// (each 128-bit lane then holds one column of four rows), then the 128-bit lanes transposed.
inline void transpose16(__m512i x[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(x[i], x[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(x[i], x[i + 1]);
  }
  __m512i u[4][4];  // u[g][c]: lane L holds column 4L + c of rows 4g .. 4g + 3
  for (int g = 0; g < 4; ++g) {
    u[g][0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[g][1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[g][2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[g][3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[0][c], u[1][c], 0x44);
    const __m512i v1 = _mm512_shuffle_i32x4(u[0][c], u[1][c], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[2][c], u[3][c], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(u[2][c], u[3][c], 0xEE);
    x[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    x[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    x[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    x[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// A cache element's bf16 bits: bf16 as it is, a one-byte element widened (exactly: int8 and
// FP8 e4m3 values are all bf16 values).
inline uint16_t bf16_bits(bf16 x) { return x.x; }
template <typename C>
inline uint16_t bf16_bits(C x) { return bf16(to_float(x)).x; }

struct DotTiles {
  static constexpr int kL = 16;
  // Register tiles: up to 4 lane tiles, 16 sums (as the GEMM's 4 x 4).
  static constexpr int kTiles = 4, kSums = 16;
  static constexpr bool kWholeBlock = false;
  // A masked score (and the running max before any key): finite, so that 2^(score - max) needs
  // no test for -inf - -inf; vscalefps takes its huge negative exponent to exactly 0.
  static constexpr float kMasked = -1e30f;
  // A key before a lane's window scores below kMasked: a lane that has seen no key yet (m still
  // kMasked) gets probability 2^(kBeforeWindow - kMasked) = exactly 0 for it, not 2^0.
  static constexpr float kBeforeWindow = -3e30f;
  using QElem = pair_bits;
  using PElem = pair_bits;
  struct KeyBlock {
    const pair_bits* rows[kKeyBlock];
  };
  using KeyRef = const pair_bits* const*;

  static int64_t query_elems(int64_t D) { return D / 2; }
  static int64_t prob_rows(int64_t keys) { return (keys + 1) / 2; }
  // Room to widen a one-byte cache's keys to bf16 (a bf16 cache's are read in place).
  template <typename T, typename C>
  static int64_t key_elems(int64_t D) {
    return std::is_same<C, bf16>::value ? 0 : kKeyBlock * D / 2;
  }

  // One lane tile of packed queries from its 16 rows (null: a padding lane, zeros), 16 pairs of
  // features at a time through a transpose.
  template <typename T>
  static void pack_queries(const T* const* rows, int64_t D, pair_bits* q, int64_t Rp) {
    static_assert(std::is_same<T, bf16>::value, "the dot path multiplies bf16 queries");
    int64_t p0 = 0;
    for (; 2 * (p0 + 16) <= D; p0 += 16) {
      __m512i x[16];
      for (int i = 0; i < 16; ++i)
        x[i] = rows[i] ? _mm512_loadu_si512(rows[i] + 2 * p0) : _mm512_setzero_si512();
      transpose16(x);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(q + (p0 + j) * Rp, x[j]);
    }
    for (int64_t p = p0; p < D / 2; ++p)
      for (int i = 0; i < 16; ++i) {
        uint32_t bits = 0;
        if (rows[i]) std::memcpy(&bits, rows[i] + 2 * p, sizeof bits);
        q[p * Rp + i] = bits;
      }
  }

  // One lane tile's outputs: lane i's O^T column times scale[i] into outs[i] (null: padding),
  // 16 features at a time through a transpose.
  template <typename T>
  static void write_tile(const float* ot, int64_t Rp, int64_t D, const float* scale,
                         T* const* outs) {
    static_assert(std::is_same<T, bf16>::value, "the dot path writes bf16");
    int64_t d0 = 0;
    for (; d0 + 16 <= D; d0 += 16) {
      __m512i x[16];
      for (int i = 0; i < 16; ++i) x[i] = _mm512_castps_si512(_mm512_loadu_ps(ot + (d0 + i) * Rp));
      transpose16(x);
      for (int j = 0; j < 16; ++j) {
        if (!outs[j]) continue;
        const __m512 y = _mm512_mul_ps(_mm512_castsi512_ps(x[j]), _mm512_set1_ps(scale[j]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(outs[j] + d0),
                            (__m256i)_mm512_cvtneps_pbh(y));
      }
    }
    for (int j = 0; j < 16; ++j)
      if (outs[j])
        for (int64_t d = d0; d < D; ++d) outs[j][d] = static_cast<T>(ot[d * Rp + j] * scale[j]);
  }

  template <typename C>
  static KeyBlock prepare_keys(const C* const* rows, int64_t n, int64_t D, float* buf) {
    KeyBlock keys;
    if constexpr (std::is_same<C, bf16>::value) {
      for (int64_t j = 0; j < n; ++j) keys.rows[j] = reinterpret_cast<const pair_bits*>(rows[j]);
    } else {
      auto* widened = reinterpret_cast<uint16_t*>(buf);
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t d = 0; d < D; ++d) widened[j * D + d] = bf16_bits(rows[j][d]);
        keys.rows[j] = reinterpret_cast<const pair_bits*>(widened + j * D);
      }
    }
    return keys;
  }
  static KeyRef key_ref(const KeyBlock& keys, int64_t j, int64_t) { return keys.rows + j; }

  // Values [pairs][D]: (V[2i][d], V[2i + 1][d]); an odd last key is paired with zeros.
  template <typename C>
  static void pack_values(const C* const* rows, int64_t n, int64_t D, pair_bits* v) {
    for (int64_t j = 0; j < n; j += 2) {
      const C* a = rows[j];
      const C* b = j + 1 < n ? rows[j + 1] : nullptr;
      pair_bits* out = v + (j / 2) * D;
      int64_t d = 0;
      if constexpr (std::is_same<C, bf16>::value) {
        if (b != nullptr)
          for (; d + 32 <= D; d += 32)
            interleave_pairs(_mm512_loadu_si512(a + d), _mm512_loadu_si512(b + d), out + d);
      }
      for (; d < D; ++d)
        out[d] = bf16_bits(a[d]) | (b ? static_cast<uint32_t>(bf16_bits(b[d])) << 16 : 0u);
    }
  }

  template <int NK, int NT>
  __attribute__((noinline)) static void scores(const Lanes& ln, const pair_bits* const* keys,
                                               const pair_bits* q, const float* pos_at, float* s,
                                               float* bmax, int64_t key0) {
    __m512 acc[NK][NT];
    for (int k = 0; k < NK; ++k)
      for (int t = 0; t < NT; ++t) acc[k][t] = _mm512_setzero_ps();
    for (int64_t p = 0; p < ln.D / 2; ++p) {
      __m512bh qv[NT];
      for (int t = 0; t < NT; ++t) qv[t] = (__m512bh)_mm512_loadu_si512(q + p * ln.Rp + t * kL);
      for (int k = 0; k < NK; ++k) {
        const __m512bh kv = (__m512bh)_mm512_set1_epi32(static_cast<int>(keys[k][p]));
        for (int t = 0; t < NT; ++t) acc[k][t] = _mm512_dpbf16_ps(acc[k][t], kv, qv[t]);
      }
    }
    const __m512 c = _mm512_set1_ps(ln.c);
    const __m512 minus_inf = _mm512_set1_ps(kMasked);
    const __m512 before = _mm512_set1_ps(kBeforeWindow), window = _mm512_set1_ps(ln.window);
    for (int t = 0; t < NT; ++t) {
      const __m512 pos = _mm512_loadu_ps(pos_at + t * kL);
      __m512 mx = _mm512_loadu_ps(bmax + t * kL);
      for (int k = 0; k < NK; ++k) {
        const __m512 key = _mm512_set1_ps(static_cast<float>(key0 + k));
        const __mmask16 keep = _mm512_cmp_ps_mask(pos, key, _CMP_GE_OQ);
        const __mmask16 in_window =
            _mm512_cmp_ps_mask(_mm512_sub_ps(pos, key), window, _CMP_LT_OQ);
        const __m512 x = _mm512_mask_mov_ps(
            before, in_window, _mm512_mask_mul_ps(minus_inf, keep, acc[k][t], c));
        _mm512_storeu_ps(s + k * ln.Rp + t * kL, x);
        mx = _mm512_max_ps(mx, x);
      }
      _mm512_storeu_ps(bmax + t * kL, mx);
    }
  }

  // `pairs` key pairs of values [pairs][D] against probabilities [pairs][Rp].
  template <int ND, int NT>
  __attribute__((noinline)) static void values(const Lanes& ln, const pair_bits* v,
                                               const pair_bits* p, int64_t pairs, float* ot,
                                               const float* alpha) {
    __m512 acc[ND][NT];
    for (int t = 0; t < NT; ++t) {
      const __m512 a = _mm512_loadu_ps(alpha + t * kL);
      for (int d = 0; d < ND; ++d)
        acc[d][t] = _mm512_mul_ps(_mm512_loadu_ps(ot + d * ln.Rp + t * kL), a);
    }
    for (int64_t j = 0; j < pairs; ++j) {
      __m512bh pv[NT];
      for (int t = 0; t < NT; ++t) pv[t] = (__m512bh)_mm512_loadu_si512(p + j * ln.Rp + t * kL);
      for (int d = 0; d < ND; ++d) {
        const __m512bh vv = (__m512bh)_mm512_set1_epi32(static_cast<int>(v[j * ln.D + d]));
        for (int t = 0; t < NT; ++t) acc[d][t] = _mm512_dpbf16_ps(acc[d][t], vv, pv[t]);
      }
    }
    for (int d = 0; d < ND; ++d)
      for (int t = 0; t < NT; ++t) _mm512_storeu_ps(ot + d * ln.Rp + t * kL, acc[d][t]);
  }

  // Lane tile t over the block's first `keys` keys (the rest of the block's `pairs` pairs are
  // masked for all its lanes): m, l updated; alpha and the probability pairs written.
  __attribute__((noinline)) static void softmax(const Lanes& ln, int64_t t, const float* s,
                                                int64_t keys, int64_t pairs, const float* bmax,
                                                float* m, float* l, float* alpha, pair_bits* p,
                                                bool /*round_bf16: always*/) {
    const int64_t o = t * kL;
    const __m512 m_old = _mm512_loadu_ps(m + o);
    const __m512 m_new = _mm512_max_ps(m_old, _mm512_loadu_ps(bmax + o));
    const __m512 a = exp2_16(_mm512_sub_ps(m_old, m_new));
    const __m512i order = lane_indices(kPairSplit);
    __m512 sum = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 2 <= keys; j += 2) {
      const __m512 e0 = exp2_16(_mm512_sub_ps(_mm512_loadu_ps(s + j * ln.Rp + o), m_new));
      const __m512 e1 = exp2_16(_mm512_sub_ps(_mm512_loadu_ps(s + (j + 1) * ln.Rp + o), m_new));
      sum = _mm512_add_ps(_mm512_add_ps(sum, e0), e1);
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);  // e0's 16, then e1's
      _mm512_storeu_si512(p + (j / 2) * ln.Rp + o, _mm512_permutexvar_epi16(order, both));
    }
    if (j < keys) {  // an odd last key, paired with a masked one
      const __m512 e0 = exp2_16(_mm512_sub_ps(_mm512_loadu_ps(s + j * ln.Rp + o), m_new));
      sum = _mm512_add_ps(sum, e0);
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_setzero_ps(), e0);
      _mm512_storeu_si512(p + (j / 2) * ln.Rp + o, _mm512_permutexvar_epi16(order, both));
      j += 2;
    }
    for (; j < 2 * pairs; j += 2)
      _mm512_storeu_si512(p + (j / 2) * ln.Rp + o, _mm512_setzero_si512());
    _mm512_storeu_ps(m + o, m_new);
    _mm512_storeu_ps(l + o, _mm512_fmadd_ps(_mm512_loadu_ps(l + o), a, sum));
    _mm512_storeu_ps(alpha + o, a);
  }
};

}  // namespace prefill
}  // namespace llm_forge
