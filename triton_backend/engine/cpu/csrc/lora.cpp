// A LoRA adapter's delta on the rows of one run: out[i] += (x[i] @ A^T) @ B^T, A^T [in, r] and
// B^T [r, out] in float32 or bfloat16 (a bf16 engine's adapters as stored: widened exactly, half
// the bytes to read, and on a few rows reading them is the cost).
//
// On a few rows torch's GEMM spends most of its time getting ready (two calls, a cast and an
// add of ~1 us of arithmetic each, 4-5 us apiece), and the packed bf16 kernel has one 16-wide
// tile of work for the rank-wide product. Here: one pass over A^T per row, then B^T read once
// for up to four rows, in blocks of 64 columns split between threads. Every output element sums
// in the same order (fused multiply-adds over the rank) whatever the number of rows or threads,
// so a row's delta does not depend on its batch.
// The delta is rounded to out's dtype before the add, as `delta.to(dtype)` then `add_` round
// in the torch expression it replaces.
#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace llm_forge {
namespace {

constexpr int64_t kColumns = 64;  // output columns per unit of parallel work

template <typename W>
void rank_product(const float* x, int64_t in, const W* a, int64_t r, float* y) {
  std::fill(y, y + r, 0.f);
  for (int64_t k = 0; k < in; ++k) {  // y += x[k] * A^T[k, :]
    const vf xv = splat(x[k]);
    const W* ak = a + k * r;
    int64_t j = 0;
    for (; j + kLanes <= r; j += kLanes) store(y + j, fmadd(xv, load(ak + j), load(y + j)));
    for (; j < r; ++j) y[j] += x[k] * to_float(ak[j]);
  }
}

// out[0:ROWS, 0:8 * VECS] += y @ B^T for ROWS rows (`rows` of them real, the rest skipped): the
// 8 sums per row and vector stay in registers (8 independent chains of multiply-adds) while
// B^T's rows stream by once.
template <int ROWS, int VECS, typename T, typename W>
void block(const float* y, int64_t r, const W* b, int64_t n, int64_t rows, T* out,
           int64_t out_stride) {
  vf acc[ROWS][VECS];
  for (int i = 0; i < ROWS; ++i) {
    for (int v = 0; v < VECS; ++v) acc[i][v] = splat(0.f);
  }
  for (int64_t j = 0; j < r; ++j) {
    vf bj[VECS];
    for (int v = 0; v < VECS; ++v) bj[v] = load(b + j * n + v * kLanes);
    for (int i = 0; i < ROWS; ++i) {
      if (i < rows) {
        const vf yv = splat(y[i * r + j]);
        for (int v = 0; v < VECS; ++v) acc[i][v] = fmadd(yv, bj[v], acc[i][v]);
      }
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    float d[VECS * kLanes];
    for (int v = 0; v < VECS; ++v) store(d + v * kLanes, acc[i][v]);
    T* oi = out + i * out_stride;
    for (int o = 0; o < VECS * kLanes; ++o) {
      oi[o] = static_cast<T>(to_float(oi[o]) + round_to<T>(d[o]));
    }
  }
}

template <typename T, typename W>
void lora_rows_impl(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                    at::Tensor& out) {
  const int64_t rows = x.size(0), in = x.size(1), r = a.size(1), n = b.size(1);
  const W* ap = a.data_ptr<W>();
  const W* bp = b.data_ptr<W>();
  std::vector<float> xf(in), y(rows * r);
  for (int64_t i = 0; i < rows; ++i) {
    const T* xi = x.data_ptr<T>() + i * x.stride(0);
    for (int64_t k = 0; k < in; ++k) xf[k] = to_float(xi[k]);
    rank_product(xf.data(), in, ap, r, y.data() + i * r);
  }
  T* op = out.data_ptr<T>();
  const int64_t stride = out.stride(0), blocks = n / kColumns;
  // threads only for work worth waking them: ~16K multiply-adds each at least
  const int64_t grain = std::max<int64_t>(1, 16384 / (kColumns * r * rows));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t o0 = c * kColumns;
      for (int64_t i0 = 0; i0 < rows; i0 += 4) {
        const int64_t group = std::min<int64_t>(4, rows - i0);
        const float* yi = y.data() + i0 * r;
        T* oi = op + i0 * stride + o0;
        if (group == 1) {
          block<1, 8>(yi, r, bp + o0, n, 1, oi, stride);
        } else if (group == 2) {
          for (int64_t o = 0; o < kColumns; o += 32) {
            block<2, 4>(yi, r, bp + o0 + o, n, 2, oi + o, stride);
          }
        } else {
          for (int64_t o = 0; o < kColumns; o += 16) {
            block<4, 2>(yi, r, bp + o0 + o, n, group, oi + o, stride);
          }
        }
      }
    }
  });
  for (int64_t o = blocks * kColumns; o < n; ++o) {  // the columns past the last whole block
    for (int64_t i = 0; i < rows; ++i) {
      float sum = 0.f;
      for (int64_t j = 0; j < r; ++j) sum = std::fma(y[i * r + j], to_float(bp[j * n + o]), sum);
      T* oi = op + i * stride + o;
      *oi = static_cast<T>(to_float(*oi) + round_to<T>(sum));
    }
  }
}

}  // namespace

void lora_add_rows(at::Tensor& out, const at::Tensor& x, const at::Tensor& a,
                   const at::Tensor& b) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0) &&
                  a.size(0) == x.size(1) && b.size(0) == a.size(1) && b.size(1) == out.size(1),
              "lora_add_rows: shapes do not chain");
  TORCH_CHECK(a.scalar_type() == b.scalar_type() &&
                  (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16) &&
                  a.is_contiguous() && b.is_contiguous(),
              "lora_add_rows: A^T and B^T must be contiguous, both float32 or both bfloat16");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && x.stride(1) == 1 && out.stride(1) == 1,
              "lora_add_rows: x and out must share a dtype and have contiguous rows");
  const auto dtype = out.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat,
              "lora_add_rows: bfloat16 or float32 rows, got ", dtype);
  const bool bf16_weights = a.scalar_type() == at::kBFloat16;
  if (dtype == at::kBFloat16) {
    if (bf16_weights) lora_rows_impl<at::BFloat16, at::BFloat16>(x, a, b, out);
    else lora_rows_impl<at::BFloat16, float>(x, a, b, out);
  } else {
    if (bf16_weights) lora_rows_impl<float, at::BFloat16>(x, a, b, out);
    else lora_rows_impl<float, float>(x, a, b, out);
  }
}

}  // namespace llm_forge
