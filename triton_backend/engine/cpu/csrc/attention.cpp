// Attention over the paged KV cache, read in place (no gather into a padded tensor).
//
// Packed queries: sequence b owns rows [query_start[b], query_start[b+1]) of q, its keys are the
// first seq_lens[b] cache entries named by its block table (the new tokens' keys are already
// written), and query row t sees the keys up to its own position (causal, offset by what was
// cached before this step). The query heads that share a kv head read each key and value once.
//
// Work is split into parts of at most kPart keys: one work item is (row, kv head, part), so a
// long context is spread over the threads even for a single sequence. Each part keeps its own
// max, sum and weighted values; parts are merged in order. Part boundaries depend only on the
// row's own key count, so a row's result never depends on what else is in the step.
//
// The cache holds the activations' dtype, or one byte per element (int8 or FP8 e4m3, stored as
// value / scale with one key and one value scale per layer): its rows are widened to fp32 as
// they are read, the key scale folded into the scaled query and the value scale applied to each
// part's weighted sum, so a one-byte cache is read at half the bytes of a bf16 one.
#include "step.h"
#include "vec.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <limits>
#include <type_traits>
#include <vector>

namespace llm_forge {
namespace {

constexpr int64_t kPart = 256;
constexpr int64_t kMaxHeadDim = 512;

constexpr int64_t kPrefetchKeys = 16;  // how far ahead key rows are requested

// Ask for a cache row's lines: Locality 3 into L1 (read next), 2 into L2 (read later).
template <int Locality, typename T>
inline void prefetch_row(const T* row, int64_t D) {
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(row) + b, 0, Locality);
}

template <typename T>
inline void widen(const T* src, float* dst, int64_t D) {
  int64_t i = 0;
  for (; i + kLanes <= D; i += kLanes) store(dst + i, load(src + i));
  for (; i < D; ++i) dst[i] = to_float(src[i]);
}

using step::Geometry;
using step::Item;

// acc_h[0..D) += sum over the block's keys jj of p_h[jj] * value row jj, for HEADS query heads
// of one kv head: each value chunk is widened once and meets every head's accumulators in
// registers (HEADS x 2 vectors). Per head and feature the products are added in key order, the
// same sums whichever heads share the call.
constexpr int kValueHeads = 4;

template <int HEADS, typename T>
inline void add_values(const T* const* rows, int64_t count, const float* const* probs,
                       float* const* accs, int64_t D) {
  int64_t i = 0;
  for (; i + 2 * kLanes <= D; i += 2 * kLanes) {
    vf a[HEADS][2];
    for (int h = 0; h < HEADS; ++h) {
      a[h][0] = load(accs[h] + i);
      a[h][1] = load(accs[h] + i + kLanes);
    }
    for (int64_t jj = 0; jj < count; ++jj) {
      const vf v0 = load(rows[jj] + i), v1 = load(rows[jj] + i + kLanes);
      for (int h = 0; h < HEADS; ++h) {
        const vf pj = splat(probs[h][jj]);
        a[h][0] = fmadd(pj, v0, a[h][0]);
        a[h][1] = fmadd(pj, v1, a[h][1]);
      }
    }
    for (int h = 0; h < HEADS; ++h) {
      store(accs[h] + i, a[h][0]);
      store(accs[h] + i + kLanes, a[h][1]);
    }
  }
  for (; i + kLanes <= D; i += kLanes) {
    vf a[HEADS];
    for (int h = 0; h < HEADS; ++h) a[h] = load(accs[h] + i);
    for (int64_t jj = 0; jj < count; ++jj) {
      const vf v = load(rows[jj] + i);
      for (int h = 0; h < HEADS; ++h) a[h] = fmadd(splat(probs[h][jj]), v, a[h]);
    }
    for (int h = 0; h < HEADS; ++h) store(accs[h] + i, a[h]);
  }
  for (; i < D; ++i)
    for (int64_t jj = 0; jj < count; ++jj) {
      const float v = to_float(rows[jj][i]);
      for (int h = 0; h < HEADS; ++h) accs[h][i] += probs[h][jj] * v;
    }
}

// One part for kv heads [h0, h1): scores of keys [kb, ke) for each head's query group, softmax
// numerators against the part's own max, and the weighted sum of values. Writes (m, l, acc[D])
// per query head of kv head h to `partial + (h - h0) * head_stride`. The cache holds a slot's kv
// heads side by side, so walking a key block across all the item's heads reads each slot's rows
// as one run; each head's arithmetic is the same whichever heads share its item.
template <typename T, typename C>
void attend_part(const Geometry& g, const T* q_row, const C* k_cache, const C* v_cache,
                 const int32_t* table, int64_t h0, int64_t h1, int64_t kb, int64_t ke,
                 float* partial, int64_t head_stride, float k_scale, float v_scale,
                 std::vector<float>& scratch, std::vector<int64_t>& slots) {
  const int64_t G = g.group(), D = g.D, n = ke - kb, H = h1 - h0, QH = H * G;
  const int64_t stride = n + kLanes;
  scratch.resize(QH * stride + QH * D);
  float* scores = scratch.data();        // [H * G, n + 8]: rows padded for the 8-key stores
  float* qf = scores + QH * stride;      // [H * G, D] scaled queries
  // Each key's slot offset (of kv head h0), walked block by block (a division per key cost as
  // much as its dots).
  slots.resize(n);
  for (int64_t j = 0, block = kb / g.tokens_per_block, offset = kb % g.tokens_per_block; j < n;
       ++j) {
    slots[j] = (static_cast<int64_t>(table[block]) * g.tokens_per_block + offset) *
               g.kv_slot_stride + h0 * D;
    if (++offset == g.tokens_per_block) offset = 0, ++block;
  }
  const float q_scale = g.scale * k_scale;  // q . key = (q * k_scale) . stored key
  for (int64_t qh = 0; qh < QH; ++qh) {
    const T* q = q_row + (h0 * G + qh) * g.q_head_stride;
    for (int64_t i = 0; i < D; ++i) qf[qh * D + i] = to_float(q[i]) * q_scale;
  }
  const int64_t row_elems = H * D;  // one slot's rows of the item's heads, contiguous
  for (int64_t j = 0; j < std::min(n, kPrefetchKeys); ++j)
    prefetch_row<3>(k_cache + slots[j], row_elems);
  // Value rows: an item of one kv head asks for them kPrefetchKeys ahead in the second pass,
  // into L1; an item of all kv heads (rows three times as long) asks for each block's in the
  // first pass, into L2, so the second pass finds them there. Each measured the faster in its
  // case on an AVX2 EPYC (decode steps, in turns: one head per item, c=1, 0.94-0.98x the step
  // time; all heads, c=16: early 0.96x late's).
  const bool values_late = H == 1;
  const bool vector_dots = D % kLanes == 0;
  float keys[kLanes * kMaxHeadDim];  // this block's keys of one head, widened once for its group
  for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, n - j0);
    // The cache rows are scattered over blocks and, in a decode step, no longer in any cache:
    // ask for the keys kPrefetchKeys ahead, instead of waiting on each row's load. Values: see
    // values_late.
    for (int64_t jj = 0; jj < count; ++jj) {
      if (j0 + kPrefetchKeys + jj < n)
        prefetch_row<3>(k_cache + slots[j0 + kPrefetchKeys + jj], row_elems);
      if (!values_late) prefetch_row<2>(v_cache + slots[j0 + jj], row_elems);
    }
    for (int64_t kvh = 0; kvh < H; ++kvh) {
      for (int64_t jj = 0; jj < kLanes; ++jj)
        widen(k_cache + slots[j0 + std::min(jj, count - 1)] + kvh * D, keys + jj * D, D);
      for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h) {
        float* out = scores + h * stride + j0;
        if (vector_dots) {
          vf acc[kLanes];
          for (int jj = 0; jj < kLanes; ++jj) acc[jj] = splat(0.f);
          for (int64_t d = 0; d < D; d += kLanes) {
            vf qv = load(qf + h * D + d);
            for (int jj = 0; jj < kLanes; ++jj)
              acc[jj] = fmadd(qv, load(keys + jj * D + d), acc[jj]);
          }
          store(out, hsum8(acc));
        } else {
          for (int64_t jj = 0; jj < count; ++jj) {
            float sum = 0.f;
            for (int64_t d = 0; d < D; ++d) sum += qf[h * D + d] * keys[jj * D + d];
            out[jj] = sum;
          }
        }
      }
    }
  }
  auto head_partial = [&](int64_t h) {  // query head h of the item -> its (m, l, acc[D])
    return partial + (h / G) * head_stride + (h % G) * (2 + D);
  };
  for (int64_t h = 0; h < QH; ++h) {
    float* s = scores + h * stride;
    int64_t j = 0;
    vf vmax = splat(-std::numeric_limits<float>::infinity());
    for (; j + kLanes <= n; j += kLanes) {
      const vf v = load(s + j);
      vmax = v > vmax ? v : vmax;
    }
    float m = hmax(vmax);
    for (; j < n; ++j) m = s[j] > m ? s[j] : m;
    vf vsum = splat(0.f);
    for (j = 0; j + kLanes <= n; j += kLanes) {
      const vf e = vexp(load(s + j) - splat(m));
      store(s + j, e);
      vsum += e;
    }
    float l = hsum(vsum);
    for (; j < n; ++j) {
      s[j] = std::exp(s[j] - m);
      l += s[j];
    }
    float* ph = head_partial(h);
    ph[0] = m;
    ph[1] = l;
    for (int64_t i = 0; i < D; ++i) ph[2 + i] = 0.f;
  }
  // Values read in place, 8 keys at a time, each widened once for the query heads of its kv head
  // (add_values).
  if (values_late)
    for (int64_t j = 0; j < std::min(n, kPrefetchKeys); ++j)
      prefetch_row<3>(v_cache + slots[j], row_elems);
  for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, n - j0);
    if (values_late)
      for (int64_t jj = 0; jj < count && j0 + kPrefetchKeys + jj < n; ++jj)
        prefetch_row<3>(v_cache + slots[j0 + kPrefetchKeys + jj], row_elems);
    for (int64_t kvh = 0; kvh < H; ++kvh) {
      const C* rows[kLanes];
      for (int64_t jj = 0; jj < count; ++jj) rows[jj] = v_cache + slots[j0 + jj] + kvh * D;
      for (int64_t h = kvh * G; h < (kvh + 1) * G; h += kValueHeads) {
        const int64_t heads = std::min<int64_t>(kValueHeads, (kvh + 1) * G - h);
        float* accs[kValueHeads];
        const float* probs[kValueHeads];
        for (int64_t i = 0; i < heads; ++i) {
          accs[i] = head_partial(h + i) + 2;
          probs[i] = scores + (h + i) * stride + j0;
        }
        switch (heads) {
          case 1: add_values<1>(rows, count, probs, accs, D); break;
          case 2: add_values<2>(rows, count, probs, accs, D); break;
          case 3: add_values<3>(rows, count, probs, accs, D); break;
          default: add_values<4>(rows, count, probs, accs, D); break;
        }
      }
    }
  }
  if (v_scale != 1.f)  // a one-byte cache's values are stored / v_scale
    for (int64_t h = 0; h < QH; ++h) {
      float* acc = head_partial(h) + 2;
      for (int64_t i = 0; i < D; ++i) acc[i] *= v_scale;
    }
}

// Merge a (row, kv head)'s parts in order and write its heads' outputs.
template <typename T>
void merge_parts(const Geometry& g, const float* parts, int64_t num_parts, int64_t kv_head,
                 T* out_row) {
  const int64_t G = g.group(), D = g.D, size = g.partial_size();
  for (int64_t h = 0; h < G; ++h) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < num_parts; ++p) m = std::max(m, parts[p * size + h * (2 + D)]);
    float l = 0.f;
    float acc[kMaxHeadDim];
    for (int64_t i = 0; i < D; ++i) acc[i] = 0.f;
    for (int64_t p = 0; p < num_parts; ++p) {
      const float* ph = parts + p * size + h * (2 + D);
      const float w = num_parts == 1 ? 1.f : std::exp(ph[0] - m);
      l += w * ph[1];
      for (int64_t i = 0; i < D; ++i) acc[i] += w * ph[2 + i];
    }
    T* o = out_row + (kv_head * G + h) * D;
    const float inv = 1.f / l;
    for (int64_t i = 0; i < D; ++i) o[i] = static_cast<T>(acc[i] * inv);
  }
}

template <typename T>
void paged_attention_impl(const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_tables,
                          const at::Tensor& seq_lens, const at::Tensor& query_start,
                          const Geometry& g, float k_scale, float v_scale, int64_t window,
                          at::Tensor& out) {
  step::AttentionPlan plan = step::plan_attention(g, block_tables, seq_lens, query_start,
                                                  at::get_num_threads(), window);
  const T* qp = q.data_ptr<T>();
  step::with_cache_type<T>(k_cache, v_cache, [&](auto* tag) {
    using C = std::remove_pointer_t<decltype(tag)>;
    const C* kp = static_cast<const C*>(k_cache.data_ptr());
    const C* vp = static_cast<const C*>(v_cache.data_ptr());
    parallel_chunks(static_cast<int64_t>(plan.items.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        step::attend_item(plan, qp, kp, vp, i, k_scale, v_scale);
    });
  });
  T* op = out.data_ptr<T>();
  at::parallel_for(0, plan.groups(), 16, [&](int64_t begin, int64_t end) {
    for (int64_t gi = begin; gi < end; ++gi) step::merge_group(plan, gi, op);
  });
}

}  // namespace

namespace step {

AttentionPlan plan_attention(const Geometry& g, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, const at::Tensor& query_start,
                             int64_t threads, int64_t window) {
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  seq_lens.is_contiguous() && query_start.is_contiguous(),
              "block_tables, seq_lens and query_start must be int32");
  TORCH_CHECK(query_start.size(0) == seq_lens.size(0) + 1, "query_start must have B + 1 entries");
  TORCH_CHECK(g.D <= kMaxHeadDim, "head_dim over ", kMaxHeadDim, " is not supported");
  TORCH_CHECK(g.num_q_heads % g.num_kv_heads == 0, "query heads must be a multiple of kv heads");
  AttentionPlan plan{g, block_tables.data_ptr<int32_t>(), {}, {}, {}};
  const int64_t num_seqs = seq_lens.size(0);
  const int32_t* starts = query_start.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  // Partials are stored by (row, kv head, part): first[r * Hkv + h] .. first[r * Hkv + h + 1].
  // An item is one part of one row for one kv head, or, when the step has enough (row, part)
  // pairs to keep every thread busy, for all kv heads at once (each slot's rows then read as one
  // run). Which heads share an item changes no head's arithmetic.
  const int64_t Hkv = g.num_kv_heads, psize = g.partial_size();
  std::vector<int64_t> num_keys_of(starts[num_seqs]);
  // A local layer's row reads keys [first_key, num_keys): the window ends at the row itself.
  auto first_key = [window](int64_t num_keys) {
    return window > 0 ? std::max<int64_t>(0, num_keys - window) : 0;
  };
  int64_t pairs = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    for (int64_t row = starts[b]; row < starts[b + 1]; ++row) {
      const int64_t num_keys = lens[b] - (starts[b + 1] - 1 - row);  // causal: up to this row
      TORCH_CHECK(num_keys >= 1 && num_keys <= g.max_blocks * g.tokens_per_block,
                  "a row sees ", num_keys, " keys, outside its block table");
      num_keys_of[row] = num_keys;
      pairs += (num_keys - first_key(num_keys) + kPart - 1) / kPart;
    }
  }
  const bool all_heads = pairs >= 4 * std::max<int64_t>(1, threads);
  int64_t base = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    for (int64_t row = starts[b]; row < starts[b + 1]; ++row) {
      const int64_t num_keys = num_keys_of[row], key0 = first_key(num_keys);
      const int64_t P = (num_keys - key0 + kPart - 1) / kPart;
      for (int64_t h = 0; h < Hkv; ++h) plan.first.push_back(base + h * P);
      for (int64_t p = 0; p < P; ++p) {
        const int64_t kb = key0 + p * kPart, ke = std::min(kb + kPart, num_keys);
        if (all_heads) {
          plan.items.push_back({row, 0, Hkv, kb, ke, b, base + p, P * psize});
        } else {
          for (int64_t h = 0; h < Hkv; ++h)
            plan.items.push_back({row, h, h + 1, kb, ke, b, base + h * P + p, P * psize});
        }
      }
      base += Hkv * P;
    }
  }
  plan.first.push_back(base);
  plan.parts.resize(base * psize);
  return plan;
}

template <typename T, typename C>
void attend_item(AttentionPlan& plan, const T* q, const C* k_cache, const C* v_cache, int64_t i,
                 float k_scale, float v_scale) {
  thread_local std::vector<float> scratch;
  thread_local std::vector<int64_t> slots;
  const Geometry& g = plan.g;
  const Item& it = plan.items[i];
  attend_part(g, q + it.row * g.q_row_stride, k_cache, v_cache,
              plan.tables + it.seq * g.max_blocks, it.kv_begin, it.kv_end, it.key_begin,
              it.key_end, plan.parts.data() + it.partial * g.partial_size(), it.head_stride,
              k_scale, v_scale, scratch, slots);
}
#define LLM_FORGE_ATTEND_ITEM(T, C) \
  template void attend_item(AttentionPlan&, const T*, const C*, const C*, int64_t, float, float);
LLM_FORGE_ATTEND_ITEM(float, float)
LLM_FORGE_ATTEND_ITEM(float, int8_t)
LLM_FORGE_ATTEND_ITEM(float, fp8)
LLM_FORGE_ATTEND_ITEM(at::BFloat16, at::BFloat16)
LLM_FORGE_ATTEND_ITEM(at::BFloat16, int8_t)
LLM_FORGE_ATTEND_ITEM(at::BFloat16, fp8)
#undef LLM_FORGE_ATTEND_ITEM

template <typename T>
void merge_group(const AttentionPlan& plan, int64_t gi, T* out) {
  const Geometry& g = plan.g;
  const int64_t row = gi / g.num_kv_heads, kv_head = gi % g.num_kv_heads;
  merge_parts(g, plan.parts.data() + plan.first[gi] * g.partial_size(),
              plan.first[gi + 1] - plan.first[gi], kv_head, out + row * g.num_q_heads * g.D);
}
template void merge_group(const AttentionPlan&, int64_t, float*);
template void merge_group(const AttentionPlan&, int64_t, at::BFloat16*);

}  // namespace step

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start,
                           int64_t tokens_per_block, double scale, double k_scale,
                           double v_scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, Hq, D] with unit last stride");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "the cache must be contiguous [slots, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat,
              "q must be bf16 or fp32");
  Geometry g{q.size(1), k_cache.size(1), q.size(2), tokens_per_block, block_tables.size(1),
             q.stride(0), q.stride(1), k_cache.stride(0), static_cast<float>(scale)};
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (q.scalar_type() == at::kBFloat16)
    paged_attention_impl<at::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, query_start,
                                       g, k_scale, v_scale, window, out);
  else
    paged_attention_impl<float>(q, k_cache, v_cache, block_tables, seq_lens, query_start, g,
                                k_scale, v_scale, window, out);
  return out;
}

}  // namespace llm_forge
