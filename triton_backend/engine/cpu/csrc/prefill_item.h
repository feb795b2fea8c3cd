// One work item of prefill attention (prefill_attention.cpp): a block of one sequence's query
// rows for one kv head, its lanes packed once, the keys streamed past in blocks with an online
// softmax, the outputs written at the end.
#pragma once

#include "prefill_groups.h"
#include "step.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace llm_forge {
namespace prefill {

using step::Geometry;
using step::PrefillWork;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <typename T, typename C>
struct Call {
  const T* q;  // the plan's first row
  const C* k;
  const C* v;
  T* out;      // [rows, Hq, D] from the plan's first row
  const int32_t* tables;
  const int32_t* seq_lens;
  const int32_t* starts;
  float k_scale, v_scale;
};

// One work item: a block of one sequence's query rows for one kv head. Lane r is query row
// row_begin + r / G, query head r % G of the kv head (position-major); padding lanes sit at the
// last position with zero queries. `window` > 0: a lane sees only the last `window` keys up to
// its own position.
template <class Tiles, typename T, typename C>
class WorkItem {
 public:
  static constexpr int64_t L = Tiles::kL, KB = kKeyBlock;

  WorkItem(const Geometry& g, const Call<T, C>& call, const PrefillWork& w, int64_t window,
           std::vector<float>& buf)
      : g_(g), call_(call), w_(w), G_(g.group()), D_(g.D), R_((w.row_end - w.row_begin) * G_),
        tiles_(ceil_div(R_, L)), Rp_(tiles_ * L),
        first_row_(call.starts[w.seq] + w.row_begin),
        first_pos_(call.seq_lens[w.seq] - (call.starts[w.seq + 1] - call.starts[w.seq]) +
                   w.row_begin),
        last_(first_pos_ + (w.row_end - w.row_begin) - 1), window_(window),
        // the key block holding the first row's first key (blocks sit at multiples of KB)
        first_block_(window > 0 ? std::max<int64_t>(0, first_pos_ - window + 1) / KB * KB : 0) {
    const int64_t q_size = Tiles::query_elems(D_) * Rp_;
    const int64_t kbuf_size = Tiles::template key_elems<T, C>(D_);
    const int64_t p_size = Tiles::prob_rows(KB) * Rp_, v_size = Tiles::prob_rows(KB) * D_;
    Arena arena(buf, 5 * Arena::floats(Rp_) + Arena::floats(q_size) + Arena::floats(KB * Rp_) +
                         Arena::floats(p_size) + Arena::floats(kbuf_size) +
                         Arena::floats(v_size) + Arena::floats(D_ * Rp_));
    pos_ = arena.take<float>(Rp_);
    m_ = arena.take<float>(Rp_);
    l_ = arena.take<float>(Rp_);
    alpha_ = arena.take<float>(Rp_);
    bmax_ = arena.take<float>(Rp_);  // the block's largest score of each lane
    q_ = arena.take<typename Tiles::QElem>(q_size);
    s_ = arena.take<float>(KB * Rp_);
    p_ = arena.take<typename Tiles::PElem>(p_size);
    kbuf_ = arena.take<float>(kbuf_size);
    v_ = arena.take<typename Tiles::PElem>(v_size);
    ot_ = arena.take<float>(D_ * Rp_);
  }

  void run() {
    pack_lanes();
    const C* cache_rows[2][2][KB];  // [this block or the next][keys, values][key]
    int64_t n_next = walk(first_block_, cache_rows[0][0], cache_rows[0][1], false);
    for (int64_t kb = first_block_, at = 0; kb <= last_; kb += KB, at ^= 1) {
      const int64_t n = n_next;
      if (kb + KB <= last_)
        n_next = walk(kb + KB, cache_rows[at ^ 1][0], cache_rows[at ^ 1][1], true);
      attend_block(kb, n, cache_rows[at][0], cache_rows[at][1]);
    }
    write();
  }

 private:
  int64_t lane_row(int64_t r) const { return first_row_ + r / G_; }
  int64_t lane_head(int64_t r) const { return w_.kv_head * G_ + r % G_; }
  int64_t tile_last(int64_t t) const { return static_cast<int64_t>(pos_[t * L + L - 1]); }
  int64_t tile_first(int64_t t) const { return static_cast<int64_t>(pos_[t * L]); }

  void pack_lanes() {
    for (int64_t t = 0; t < tiles_; ++t) {
      const T* rows[L];
      for (int64_t i = 0; i < L; ++i) {
        const int64_t r = t * L + i;
        rows[i] = r < R_ ? call_.q + lane_row(r) * g_.q_row_stride +
                               lane_head(r) * g_.q_head_stride
                         : nullptr;
        pos_[r] = static_cast<float>(first_pos_ + std::min(r, R_ - 1) / G_);
        m_[r] = Tiles::kMasked;
        l_[r] = 0.f;
      }
      Tiles::pack_queries(rows, D_, q_ + t * L, Rp_);
    }
    std::fill(ot_, ot_ + D_ * Rp_, 0.f);
  }

  // The cache rows of keys [kb, kb + KB), walked block by block; the next block's are asked for
  // while this one is computed (they are scattered over the cache, often out of L2).
  int64_t walk(int64_t kb, const C** krows, const C** vrows, bool prefetch) const {
    const int64_t n = std::min(KB, last_ + 1 - kb), row_bytes = D_ * sizeof(C);
    const int32_t* table = call_.tables + w_.seq * g_.max_blocks;
    const int64_t tpb = g_.tokens_per_block;
    for (int64_t j = 0, blk = kb / tpb, off = kb % tpb; j < n; ++j) {
      const int64_t slot = static_cast<int64_t>(table[blk]) * tpb + off;
      krows[j] = call_.k + slot * g_.kv_slot_stride + w_.kv_head * D_;
      vrows[j] = call_.v + slot * g_.kv_slot_stride + w_.kv_head * D_;
      for (int64_t at = 0; prefetch && at < row_bytes; at += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(krows[j]) + at, 0, 2);
        __builtin_prefetch(reinterpret_cast<const char*>(vrows[j]) + at, 0, 2);
      }
      if (++off == tpb) off = 0, ++blk;
    }
    return n;
  }

  // Keys [kb, kb + n): scores, the online softmax, O^T. Lane tiles that see none of them (their
  // last position before kb, or, in a local layer, their first lane's window starting after the
  // block) are skipped; tile t sees keys [kb, kb + seen(t)) but the ones before its lanes'
  // windows, and a group of tiles computes as far as its last tile sees.
  void attend_block(int64_t kb, int64_t n, const C* const* krows, const C* const* vrows) {
    const float window = window_ > 0 ? static_cast<float>(window_)
                                     : std::numeric_limits<float>::infinity();
    const Lanes ln{D_, Rp_, tiles_, pos_, g_.scale * call_.k_scale * prefill::kLog2e, window};
    int64_t t_first = 0, t_end = tiles_;
    while (t_first < tiles_ && tile_last(t_first) < kb) ++t_first;
    while (window_ > 0 && t_end > t_first && tile_first(t_end - 1) - window_ + 1 >= kb + n)
      --t_end;
    auto seen = [&](int64_t t) { return std::min(n, tile_last(t) + 1 - kb); };
    const typename Tiles::KeyBlock keys = Tiles::prepare_keys(krows, n, D_, kbuf_);
    std::fill(bmax_ + t_first * L, bmax_ + Rp_, Tiles::kMasked);
    for_tile_groups<Tiles>(t_first, t_end, [&](auto nt, int64_t t) {
      constexpr int NT = decltype(nt)::value;
      scores_group<Tiles, NT>(ln, keys, q_, s_, bmax_, kb, seen(t + NT - 1), t);
    });
    for (int64_t t = t_first; t < t_end; ++t)
      Tiles::softmax(ln, t, s_, seen(t), Tiles::prob_rows(n), bmax_, m_, l_, alpha_, p_,
                     std::is_same<T, bf16>::value);
    Tiles::pack_values(vrows, n, D_, v_);
    for_tile_groups<Tiles>(t_first, t_end, [&](auto nt, int64_t t) {
      constexpr int NT = decltype(nt)::value;
      values_group<Tiles, NT>(ln, v_, p_, Tiles::prob_rows(seen(t + NT - 1)), ot_, alpha_, t);
    });
  }

  void write() const {
    for (int64_t t = 0; t < tiles_; ++t) {
      T* outs[L];
      float scale[L];
      for (int64_t i = 0; i < L; ++i) {
        const int64_t r = t * L + i;
        outs[i] = r < R_ ? call_.out + lane_row(r) * g_.num_q_heads * D_ +
                               lane_head(r) * D_
                         : nullptr;
        scale[i] = call_.v_scale / l_[r];
      }
      Tiles::write_tile(ot_ + t * L, Rp_, D_, scale, outs);
    }
  }

  const Geometry& g_;
  const Call<T, C>& call_;
  const PrefillWork& w_;
  const int64_t G_, D_, R_, tiles_, Rp_, first_row_, first_pos_, last_, window_, first_block_;
  float *pos_, *m_, *l_, *alpha_, *bmax_, *s_, *kbuf_, *ot_;
  typename Tiles::QElem* q_;
  typename Tiles::PElem *p_, *v_;
};

}  // namespace prefill
}  // namespace llm_forge
