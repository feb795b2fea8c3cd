// Greedy picks of a step's rows in one call: each row's first maximal logit and its log
// probability (the logit minus the row's log-sum-exp), the EOS ids of rows below their
// min_tokens masked out. torch needs a clone of the batch for the mask, then argmax, gather and
// logsumexp: several passes and allocations, ~4 ms a step for 16 rows of a 49k vocabulary on two
// cores. Here: two passes over each row (plus a copy of a row that has masked ids).
//
// A row holding NaN or +inf gets a NaN log probability and token 0, so the caller redoes it on
// its guarded path (sampler.py), which decides what such a row means.
#include "ops.h"
#include "vec.h"

#include <limits>
#include <tuple>
#include <vector>

namespace llm_forge {

namespace {

constexpr int64_t kSumBlock = 256;  // lanes summed in fp32 this far, then added in double

struct Pick {
  int64_t token;
  float log_prob;
};

// One row, masked ids already -inf.
Pick pick_row(const float* x, int64_t V) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float pos_inf = std::numeric_limits<float>::infinity();
  // Pass 1: the maximum, and whether any entry is NaN or +inf.
  vf vmax = splat(neg_inf);
  vi bad = vi{0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + kLanes <= V; i += kLanes) {
    const vf v = load(x + i);
    bad |= (v != v) | (v == splat(pos_inf));
    vmax = v > vmax ? v : vmax;
  }
  float m = hmax(vmax);
  bool any_bad = false;
  for (int l = 0; l < kLanes; ++l) any_bad |= bad[l] != 0;
  for (; i < V; ++i) {
    any_bad |= std::isnan(x[i]) || x[i] == pos_inf;
    m = x[i] > m ? x[i] : m;
  }
  if (any_bad || m == neg_inf) return {0, std::numeric_limits<float>::quiet_NaN()};
  int64_t token = 0;  // the first entry equal to the maximum (torch.argmax's tie rule)
  while (x[token] != m) ++token;
  // Pass 2: sum of exp(x - m), in fp32 lanes over short blocks, the blocks added in double.
  // -inf entries add exp(-88.4) at most (vexp clamps), nothing next to the maximum's 1.
  double total = 0.0;
  const vf vm = splat(m);
  const int64_t vector_end = V - V % kLanes;
  i = 0;
  while (i < vector_end) {
    vf acc = splat(0.f);
    const int64_t end = std::min<int64_t>(vector_end, i + kSumBlock);
    for (; i < end; i += kLanes) acc += vexp(load(x + i) - vm);
    total += hsum(acc);
  }
  for (; i < V; ++i) total += std::exp(x[i] - m);
  return {token, static_cast<float>(-std::log(total))};  // x[token] - m is 0
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> greedy_pick(const at::Tensor& logits,
                                               at::IntArrayRef masked_rows,
                                               at::IntArrayRef masked_ids) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits must be a contiguous float32 [rows, vocab] tensor");
  TORCH_CHECK(masked_rows.size() == masked_ids.size(),
              "masked_rows and masked_ids must have the same length");
  const int64_t M = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "logits must have a vocabulary");
  std::vector<std::vector<int64_t>> masks(M);  // each row's masked ids
  for (size_t j = 0; j < masked_rows.size(); ++j) {
    TORCH_CHECK(masked_rows[j] >= 0 && masked_rows[j] < M, "masked row ", masked_rows[j],
                " outside [0, ", M, ")");
    TORCH_CHECK(masked_ids[j] >= 0 && masked_ids[j] < V, "masked id ", masked_ids[j],
                " outside the vocabulary [0, ", V, ")");
    masks[masked_rows[j]].push_back(masked_ids[j]);
  }
  at::Tensor tokens = at::empty({M}, logits.options().dtype(at::kLong));
  at::Tensor log_probs = at::empty({M}, logits.options());
  const float* x = logits.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  float* lp = log_probs.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * V;
      if (!masks[r].empty()) {  // a copy with the row's masked ids at -inf
        thread_local std::vector<float> masked;
        masked.assign(row, row + V);
        for (const int64_t id : masks[r]) masked[id] = -std::numeric_limits<float>::infinity();
        row = masked.data();
      }
      const Pick p = pick_row(row, V);
      tp[r] = p.token;
      lp[r] = p.log_prob;
    }
  });
  return {tokens, log_probs};
}

}  // namespace llm_forge
