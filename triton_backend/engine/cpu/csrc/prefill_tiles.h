// The inner loops of prefill attention (prefill_attention.cpp), in three instruction sets behind
// one interface: `AmxTiles` multiplies bf16 on AMX tiles (prefill_tiles_amx.h), `DotTiles` bf16
// pairs with AVX-512 BF16 (vdpbf16ps, as the bf16 GEMM does), `WidenTiles` widens to fp32 and
// uses 8-lane FMAs (AVX2, or plain vectors elsewhere).
//
// Orientation: an item's query rows are the lanes. Queries are packed once per item (the GEMM's
// "weights" side) and every key or value element is broadcast to all lanes, so keys and values
// are read as rows, in place from the cache; scores come out as S^T [key][lane], whose softmax
// (the running max, the sums, the rescaling) is all lane-wise: no horizontal reductions and no
// transposes. Per lane, every sum runs in the same order whatever else the item holds.
//
// Each policy provides, over an item's scratch (layouts below; Rp = padded lanes):
//   pack_query(d, r, values of Q[row r][d..]): fill the packed queries
//   scores<NK, NT>: S^T for NK keys x NT lane tiles, scaled, causal- and window-masked
//   softmax: per lane tile, the running max and sum, alpha, and the packed probabilities
//   pack_values: one block's values in the layout `values<ND, NT>` broadcasts from
//   values<ND, NT>: O^T[d][lane] = O^T * alpha + sum over the block's keys of V[k][d] * P[k][lane]
#pragma once

#include "vec.h"

#include <limits>

namespace llm_forge {
namespace prefill {

constexpr float kLog2e = 1.44269504088896341f;
typedef uint32_t pair_bits __attribute__((may_alias));  // two bf16 side by side

// 2^x, 8 lanes: ~1 ulp (Cephes exp2f's polynomial on [-0.5, 0.5]); exactly 0 below 2^-126, for
// -inf (a masked score) included, so a masked key adds exactly nothing.
inline vf vexp2(vf x) {
  const vi live = x >= splat(-126.f);
  x = live ? x : splat(-126.f);
  x = x > splat(127.f) ? splat(127.f) : x;
  const vf fx = x + splat(0.5f);
  vi n = __builtin_convertvector(fx, vi);
  n = __builtin_convertvector(n, vf) > fx ? n - 1 : n;  // floor(x + 0.5)
  const vf f = x - __builtin_convertvector(n, vf);
  vf p = splat(1.535336188319500e-4f);
  p = p * f + splat(1.339887440266574e-3f);
  p = p * f + splat(9.618437357674640e-3f);
  p = p * f + splat(5.550332471162809e-2f);
  p = p * f + splat(2.402264791363012e-1f);
  p = p * f + splat(6.931472028550421e-1f);
  p = p * f + splat(1.0f);
  const vf y = p * (vf)((n + 127) << 23);
  return live ? y : splat(0.f);
}

// The lanes an item's passes share.
constexpr int64_t kKeyBlock = 128;  // keys per block (even: the dot path pairs them)

struct Lanes {
  int64_t D, Rp, tiles;  // head dim, padded lanes, lane tiles
  const float* pos;      // [Rp] each lane's position (its query row's); padding lanes the last
  float c;               // scale * k_scale * log2(e): scores are kept in log2 units
  // A lane sees key k when 0 <= pos - k < window (+inf: every key up to its own).
  float window = std::numeric_limits<float>::infinity();
};

// ---- 8-lane fp32 FMAs ----
// Layouts: queries [D][Rp] fp32, keys and values [keys][D] fp32 (widened from the cache), scores
// and probabilities [keys][Rp] fp32; probabilities rounded to bf16 for bf16 activations, as
// torch's flash attention rounds them before P.V.
struct WidenTiles {
  static constexpr int kL = kLanes;
  // Register tiles: up to 3 lane tiles, 12 sums (AVX2 has 16 registers).
  static constexpr int kTiles = 3, kSums = 12;
  static constexpr bool kWholeBlock = false;
  // A masked score. A lane whose keys so far were all masked (before its window) keeps m = -inf:
  // its alpha and probabilities come out of vexp2(nan) as exactly 0, and its sums stay 0.
  static constexpr float kMasked = -std::numeric_limits<float>::infinity();
  using QElem = float;
  using PElem = float;
  using KeyBlock = const float*;
  using KeyRef = const float*;

  static int64_t query_elems(int64_t D) { return D; }
  static int64_t prob_rows(int64_t keys) { return keys; }
  template <typename T, typename C>
  static int64_t key_elems(int64_t D) { return kKeyBlock * D; }

  // One lane tile of packed queries from its rows (null: a padding lane, zeros).
  template <typename T>
  static void pack_queries(const T* const* rows, int64_t D, float* q, int64_t Rp) {
    for (int64_t d = 0; d < D; ++d)
      for (int i = 0; i < kL; ++i) q[d * Rp + i] = rows[i] ? to_float(rows[i][d]) : 0.f;
  }
  // One lane tile's outputs: lane i's O^T column times scale[i] into outs[i] (null: padding).
  template <typename T>
  static void write_tile(const float* ot, int64_t Rp, int64_t D, const float* scale,
                         T* const* outs) {
    for (int i = 0; i < kL; ++i)
      if (outs[i])
        for (int64_t d = 0; d < D; ++d) outs[i][d] = static_cast<T>(ot[d * Rp + i] * scale[i]);
  }

  template <typename C>
  static void widen_rows(const C* const* rows, int64_t n, int64_t D, float* out) {
    for (int64_t j = 0; j < n; ++j) {
      int64_t d = 0;
      for (; d + kLanes <= D; d += kLanes) store(out + j * D + d, load(rows[j] + d));
      for (; d < D; ++d) out[j * D + d] = to_float(rows[j][d]);
    }
  }
  template <typename C>
  static KeyBlock prepare_keys(const C* const* rows, int64_t n, int64_t D, float* buf) {
    widen_rows(rows, n, D, buf);
    return buf;
  }
  static KeyRef key_ref(KeyBlock keys, int64_t j, int64_t D) { return keys + j * D; }
  template <typename C>
  static void pack_values(const C* const* rows, int64_t n, int64_t D, float* v) {
    widen_rows(rows, n, D, v);
  }
  template <int NK, int NT>
  __attribute__((noinline)) static void scores(const Lanes& ln, const float* keys,
                                               const float* q, const float* pos_at, float* s,
                                               float* bmax, int64_t key0) {
    vf acc[NK][NT];
    for (int k = 0; k < NK; ++k)
      for (int t = 0; t < NT; ++t) acc[k][t] = splat(0.f);
    for (int64_t d = 0; d < ln.D; ++d) {
      vf qv[NT];
      for (int t = 0; t < NT; ++t) qv[t] = load(q + d * ln.Rp + t * kL);
      for (int k = 0; k < NK; ++k) {
        const vf kv = splat(keys[k * ln.D + d]);
        for (int t = 0; t < NT; ++t) acc[k][t] = fmadd(kv, qv[t], acc[k][t]);
      }
    }
    const vf minus_inf = splat(kMasked);
    for (int t = 0; t < NT; ++t) {
      const vf pos = load(pos_at + t * kL);
      vf mx = load(bmax + t * kL);
      for (int k = 0; k < NK; ++k) {
        const vf behind = pos - splat(static_cast<float>(key0 + k));  // exact: small integers
        const vi keep = (behind >= splat(0.f)) & (behind < splat(ln.window));
        const vf x = keep ? acc[k][t] * splat(ln.c) : minus_inf;
        store(s + k * ln.Rp + t * kL, x);
        mx = x > mx ? x : mx;
      }
      store(bmax + t * kL, mx);
    }
  }

  template <int ND, int NT>
  __attribute__((noinline)) static void values(const Lanes& ln, const float* v, const float* p,
                                               int64_t keys, float* ot, const float* alpha) {
    vf acc[ND][NT];
    for (int t = 0; t < NT; ++t) {
      const vf a = load(alpha + t * kL);
      for (int d = 0; d < ND; ++d) acc[d][t] = load(ot + d * ln.Rp + t * kL) * a;
    }
    for (int64_t j = 0; j < keys; ++j) {
      vf pv[NT];
      for (int t = 0; t < NT; ++t) pv[t] = load(p + j * ln.Rp + t * kL);
      for (int d = 0; d < ND; ++d) {
        const vf vv = splat(v[j * ln.D + d]);
        for (int t = 0; t < NT; ++t) acc[d][t] = fmadd(vv, pv[t], acc[d][t]);
      }
    }
    for (int d = 0; d < ND; ++d)
      for (int t = 0; t < NT; ++t) store(ot + d * ln.Rp + t * kL, acc[d][t]);
  }

  // Lane tile t over the block's first `keys` keys (the rest of its `block` keys are masked for
  // every lane of it), bmax the block's largest scores: m, l updated; alpha and probabilities
  // written. round_bf16: P as bf16.
  __attribute__((noinline)) static void softmax(const Lanes& ln, int64_t t, const float* s,
                                                int64_t keys, int64_t block, const float* bmax,
                                                float* m, float* l, float* alpha, float* p,
                                                bool round_bf16) {
    const int64_t o = t * kL;
    const vf mx = load(bmax + o), m_old = load(m + o), m_new = mx > m_old ? mx : m_old;
    const vf a = vexp2(m_old - m_new);
    vf sum = splat(0.f);
    for (int64_t j = 0; j < keys; ++j) {
      const vf e = vexp2(load(s + j * ln.Rp + o) - m_new);
      sum += e;
      store(p + j * ln.Rp + o, round_bf16 ? round_to<bf16>(e) : e);
    }
    for (int64_t j = keys; j < block; ++j) store(p + j * ln.Rp + o, splat(0.f));
    store(m + o, m_new);
    store(l + o, fmadd(load(l + o), a, sum));
    store(alpha + o, a);
  }
};

}  // namespace prefill
}  // namespace llm_forge

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include "prefill_tiles_dot.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define LLM_FORGE_PREFILL_AMX 1
#include "prefill_tiles_amx.h"
#endif
#endif
