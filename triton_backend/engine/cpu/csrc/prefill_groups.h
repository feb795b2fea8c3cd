// The loops around prefill attention's register tiles (prefill_tiles.h), shared by the
// instruction sets: which tile shape each call gets, and an item's scratch. A policy with
// kWholeBlock (AMX's) takes a whole key block per call.
#pragma once

#include "prefill_tiles.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace llm_forge {
namespace prefill {

// A thread's scratch, carved into 64-byte aligned sections of 4-byte elements.
class Arena {
 public:
  Arena(std::vector<float>& buf, int64_t floats) : buf_(buf) {
    buf_.resize(floats + 16);
    next_ = reinterpret_cast<uintptr_t>(buf_.data());
  }
  template <typename U>
  U* take(int64_t n) {
    static_assert(sizeof(U) == 4, "sections hold 4-byte elements");
    next_ = (next_ + 63) & ~uintptr_t{63};
    U* p = reinterpret_cast<U*>(next_);
    next_ += 4 * n;
    return p;
  }
  static int64_t floats(int64_t n) { return n + 16; }  // a section's size with its alignment

 private:
  std::vector<float>& buf_;
  uintptr_t next_;
};

// f(std::integral_constant<int, n>) for a runtime 1 <= n <= N: the register tiles' shapes are
// template arguments.
template <int N, class F>
inline void with_count(int64_t n, const F& f) {
  if constexpr (N > 1) {
    if (n < N) return with_count<N - 1>(n, f);
  }
  f(std::integral_constant<int, N>{});
}

// A register tile of NT lane tiles takes kSums / NT keys (or features) per call, so that each
// call keeps about kSums sums in flight: with fewer, the dot products wait on each other's
// latency (a call on 8 sums ran at half the rate of one on 16).
template <class Tiles, int NT>
constexpr int per_call() { return std::min(8, Tiles::kSums / NT); }

// Scores of keys [0, keys) of the block for lane tiles [t, t + NT).
template <class Tiles, int NT>
void scores_group(const Lanes& ln, const typename Tiles::KeyBlock& block,
                  const typename Tiles::QElem* q, float* s, float* bmax, int64_t kb,
                  int64_t keys, int64_t t) {
  constexpr int L = Tiles::kL, NK = per_call<Tiles, NT>();
  if constexpr (Tiles::kWholeBlock) {
    Tiles::template scores_block<NT>(ln, block, q + t * L, ln.pos + t * L, s + t * L,
                                     bmax + t * L, kb, keys);
  } else {
    for (int64_t j = 0; j < keys; j += NK)
      with_count<NK>(std::min<int64_t>(NK, keys - j), [&](auto nk) {
        Tiles::template scores<decltype(nk)::value, NT>(ln, Tiles::key_ref(block, j, ln.D),
                                                        q + t * L, ln.pos + t * L,
                                                        s + j * ln.Rp + t * L, bmax + t * L,
                                                        kb + j);
      });
  }
}

// O^T of lane tiles [t, t + NT), every feature, over the block's first `rows` value rows.
template <class Tiles, int NT>
void values_group(const Lanes& ln, const typename Tiles::PElem* v, const typename Tiles::PElem* p,
                  int64_t rows, float* ot, const float* alpha, int64_t t) {
  constexpr int L = Tiles::kL, ND = per_call<Tiles, NT>();
  if constexpr (Tiles::kWholeBlock) {
    Tiles::template values_block<NT>(ln, v, p + t * L, rows, ot + t * L, alpha + t * L);
  } else {
    for (int64_t d = 0; d < ln.D; d += ND)
      with_count<ND>(std::min<int64_t>(ND, ln.D - d), [&](auto nd) {
        Tiles::template values<decltype(nd)::value, NT>(ln, v + d, p + t * L, rows,
                                                        ot + d * ln.Rp + t * L, alpha + t * L);
      });
  }
}

// Lane tiles [t_first, tiles) in groups of Tiles::kTiles, then 2, then 1: f(group size, t).
template <class Tiles, class F>
inline void for_tile_groups(int64_t t_first, int64_t tiles, const F& f) {
  int64_t t = t_first;
  for (; t + Tiles::kTiles <= tiles; t += Tiles::kTiles)
    f(std::integral_constant<int, Tiles::kTiles>{}, t);
  for (; t + 2 <= tiles; t += 2) f(std::integral_constant<int, 2>{}, t);
  if (t < tiles) f(std::integral_constant<int, 1>{}, t);
}

}  // namespace prefill
}  // namespace llm_forge
