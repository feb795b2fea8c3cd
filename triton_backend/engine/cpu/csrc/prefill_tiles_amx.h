// Prefill attention's two products on AMX tiles (TDPBF16PS), for bf16 activations and a head
// dim that is a multiple of 32. One tile instruction does the work of 16 vdpbf16ps, and the dot
// path's layouts (prefill_tiles_dot.h) are already its B operands, so only the A sides are new:
//
//   S^T [keys][lanes] = K [keys][D] . Q^T: A = 16 keys x 32 features, read in place from a bf16
//     cache when the 16 keys are one run of slots (else copied, a one-byte cache widened);
//     B = the packed queries [D / 2][Rp] (16 feature pairs x 16 lanes); C stored into the scores.
//   O^T [D][lanes] += V^T . P^T: A = V^T [D][kKeyBlock] bf16 (16 features x 32 keys, packed per
//     block), B = the probability pairs [keys / 2][Rp] (16 key pairs x 16 lanes); each block's
//     sums come out of fresh C tiles and are added to O^T * alpha in vectors.
//
// Every score and every output element is summed in the same order (32 features or 32 keys per
// instruction, blocks in order) whatever the other lanes, keys or items are, so a row's result
// still does not depend on the chunk it is computed in (prefill_attention.cpp). Tiles hold 16
// rows of 64 bytes: C 0-3 ([key or feature tile][lane tile]), A 4-5, B 6-7; the caller loads
// `AmxTiles::Config` around a work item and releases it after.
#pragma once

#include "prefill_tiles_dot.h"

#include <cstring>

namespace llm_forge {
namespace prefill {

struct AmxTiles : DotTiles {
  static constexpr int kTiles = 2;  // lane tiles per call: 2 x 2 C tiles
  static constexpr bool kWholeBlock = true;
  static constexpr int64_t kRun = 16;  // keys per A tile

  struct alignas(64) Config {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
  };

  // Probability pairs rounded up to whole B tiles (32 keys), the padding zeroed by softmax.
  static int64_t prob_rows(int64_t keys) { return (keys + 31) / 32 * 16; }
  struct KeyBlock {
    const uint16_t* rows[kKeyBlock / kRun];  // each run's first key
    int64_t stride[kKeyBlock / kRun];        // bytes from one key of the run to the next
  };
  template <typename T, typename C>
  static int64_t key_elems(int64_t D) { return kKeyBlock * D / 2; }  // room to copy every run

  // Each run of 16 keys in place when its rows are evenly spaced bf16 (one cache block's slots),
  // else copied (widened) into `buf` with zero rows past the block's `n` keys.
  template <typename C>
  static KeyBlock prepare_keys(const C* const* rows, int64_t n, int64_t D, float* buf) {
    KeyBlock keys;
    auto* copy = reinterpret_cast<uint16_t*>(buf);
    for (int64_t r = 0; r * kRun < n; ++r) {
      const int64_t j0 = r * kRun, count = std::min(kRun, n - j0);
      if constexpr (std::is_same<C, bf16>::value) {
        const int64_t step = count == kRun ? rows[j0 + 1] - rows[j0] : 0;
        bool even = step > 0;
        for (int64_t i = 2; even && i < kRun; ++i) even = rows[j0 + i] - rows[j0] == i * step;
        if (even) {
          keys.rows[r] = reinterpret_cast<const uint16_t*>(rows[j0]);
          keys.stride[r] = step * static_cast<int64_t>(sizeof(bf16));
          continue;
        }
      }
      uint16_t* out = copy + j0 * D;
      for (int64_t i = 0; i < kRun; ++i) {
        if (i >= count) {
          std::memset(out + i * D, 0, D * sizeof(uint16_t));
        } else if constexpr (std::is_same<C, bf16>::value) {
          std::memcpy(out + i * D, rows[j0 + i], D * sizeof(uint16_t));
        } else {
          for (int64_t d = 0; d < D; ++d) out[i * D + d] = bf16_bits(rows[j0 + i][d]);
        }
      }
      keys.rows[r] = out;
      keys.stride[r] = D * static_cast<int64_t>(sizeof(uint16_t));
    }
    return keys;
  }

  // V^T [D][kKeyBlock] bf16: feature d's row holds the block's keys in order, zeros from key n
  // to the next multiple of 32 (its probabilities are 0, and 0 times a stale value could be
  // NaN). 32 keys x 16 features at a time: key pairs interleaved, then a 16 x 16 transpose.
  template <typename C>
  static void pack_values(const C* const* rows, int64_t n, int64_t D, pair_bits* v) {
    const int64_t padded = prob_rows(n) * 2;
    auto* vt = reinterpret_cast<uint16_t*>(v);
    if constexpr (std::is_same<C, bf16>::value) {
      const __m512i low = lane_indices(kPairLow);
      for (int64_t j0 = 0; j0 < padded; j0 += 32)
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
          __m512i x[16];
          for (int i = 0; i < 16; ++i) {
            const int64_t a = j0 + 2 * i, b = a + 1;
            const __m256i ra = a < n ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                           rows[a] + d0))
                                     : _mm256_setzero_si256();
            const __m256i rb = b < n ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                           rows[b] + d0))
                                     : _mm256_setzero_si256();
            x[i] = _mm512_permutex2var_epi16(_mm512_castsi256_si512(ra), low,
                                             _mm512_castsi256_si512(rb));
          }
          transpose16(x);
          for (int f = 0; f < 16; ++f) _mm512_storeu_si512(vt + (d0 + f) * kKeyBlock + j0, x[f]);
        }
    } else {
      for (int64_t d = 0; d < D; ++d)
        for (int64_t j = 0; j < padded; ++j)
          vt[d * kKeyBlock + j] = j < n ? bf16_bits(rows[j][d]) : uint16_t{0};
    }
  }

  // S^T of the block's first `keys` keys for lane tiles [t, t + NT) (q, pos_at, s and bmax
  // already at tile t), scaled, causal- and window-masked, and each lane's largest score.
  template <int NT>
  __attribute__((noinline)) static void scores_block(const Lanes& ln, const KeyBlock& block,
                                                     const pair_bits* q, const float* pos_at,
                                                     float* s, float* bmax, int64_t key0,
                                                     int64_t keys) {
    const int64_t lane_bytes = ln.Rp * static_cast<int64_t>(sizeof(float));
    for (int64_t r = 0; r * kRun < keys; r += 2) {
      const bool two = (r + 1) * kRun < keys;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const auto* a0 = reinterpret_cast<const char*>(block.rows[r]);
      const auto* a1 = two ? reinterpret_cast<const char*>(block.rows[r + 1]) : a0;
      for (int64_t f = 0; f < ln.D / 32; ++f) {
        const pair_bits* b = q + f * 16 * ln.Rp;
        _tile_loadd(6, b, lane_bytes);
        _tile_loadd(4, a0 + f * 64, block.stride[r]);
        _tile_dpbf16ps(0, 4, 6);
        if (NT > 1) {
          _tile_loadd(7, b + kL, lane_bytes);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (two) {
          _tile_loadd(5, a1 + f * 64, block.stride[r + 1]);
          _tile_dpbf16ps(2, 5, 6);
          if (NT > 1) _tile_dpbf16ps(3, 5, 7);
        }
      }
      float* s0 = s + r * kRun * ln.Rp;
      _tile_stored(0, s0, lane_bytes);
      if (NT > 1) _tile_stored(1, s0 + kL, lane_bytes);
      if (two) {
        _tile_stored(2, s0 + kRun * ln.Rp, lane_bytes);
        if (NT > 1) _tile_stored(3, s0 + kRun * ln.Rp + kL, lane_bytes);
      }
    }
    const __m512 c = _mm512_set1_ps(ln.c), minus_inf = _mm512_set1_ps(kMasked);
    const __m512 before = _mm512_set1_ps(kBeforeWindow), window = _mm512_set1_ps(ln.window);
    for (int t = 0; t < NT; ++t) {
      const __m512 pos = _mm512_loadu_ps(pos_at + t * kL);
      __m512 mx = _mm512_loadu_ps(bmax + t * kL);
      for (int64_t k = 0; k < keys; ++k) {
        float* at = s + k * ln.Rp + t * kL;
        const __m512 key = _mm512_set1_ps(static_cast<float>(key0 + k));
        const __mmask16 keep = _mm512_cmp_ps_mask(pos, key, _CMP_GE_OQ);
        const __mmask16 in_window =
            _mm512_cmp_ps_mask(_mm512_sub_ps(pos, key), window, _CMP_LT_OQ);
        const __m512 x = _mm512_mask_mov_ps(
            before, in_window, _mm512_mask_mul_ps(minus_inf, keep, _mm512_loadu_ps(at), c));
        _mm512_storeu_ps(at, x);
        mx = _mm512_max_ps(mx, x);
      }
      _mm512_storeu_ps(bmax + t * kL, mx);
    }
  }

  // O^T = O^T * alpha + V^T . P^T over the block's first `pairs` key pairs (a multiple of 16),
  // every feature, lane tiles [t, t + NT) (p, ot and alpha already at tile t).
  template <int NT>
  __attribute__((noinline)) static void values_block(const Lanes& ln, const pair_bits* v,
                                                     const pair_bits* p, int64_t pairs,
                                                     float* ot, const float* alpha) {
    const int64_t lane_bytes = ln.Rp * static_cast<int64_t>(sizeof(float));
    const int64_t row_bytes = kKeyBlock * static_cast<int64_t>(sizeof(uint16_t));
    const auto* vt = reinterpret_cast<const uint16_t*>(v);
    __m512 a[NT];
    for (int t = 0; t < NT; ++t) a[t] = _mm512_loadu_ps(alpha + t * kL);
    alignas(64) float sums[2][NT][16][16];  // [feature tile][lane tile][feature][lane]
    for (int64_t d0 = 0; d0 < ln.D; d0 += 32) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t j = 0; j < pairs; j += 16) {
        const pair_bits* b = p + j * ln.Rp;
        _tile_loadd(6, b, lane_bytes);
        if (NT > 1) _tile_loadd(7, b + kL, lane_bytes);
        _tile_loadd(4, vt + d0 * kKeyBlock + 2 * j, row_bytes);
        _tile_loadd(5, vt + (d0 + 16) * kKeyBlock + 2 * j, row_bytes);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        if (NT > 1) {
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, sums[0][0], 64);
      _tile_stored(2, sums[1][0], 64);
      if (NT > 1) {
        _tile_stored(1, sums[0][NT - 1], 64);
        _tile_stored(3, sums[1][NT - 1], 64);
      }
      for (int h = 0; h < 2; ++h)
        for (int t = 0; t < NT; ++t)
          for (int f = 0; f < 16; ++f) {
            float* row = ot + (d0 + 16 * h + f) * ln.Rp + t * kL;
            _mm512_storeu_ps(row, _mm512_fmadd_ps(_mm512_loadu_ps(row), a[t],
                                                  _mm512_load_ps(sums[h][t][f])));
          }
    }
  }
};

}  // namespace prefill
}  // namespace llm_forge
