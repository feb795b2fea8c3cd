// y[M, N] = x[M, K] . W[N, K]^T (+ bias) on AMX tiles (TDPBF16PS), for bf16 activations and
// weights.
//
// Why: the bf16 dot-product kernel (gemm_bf16_dot.cpp) reads the weights at memory speed for one
// row, but from a few rows on it is bound by its vdpbf16ps instructions (16 rows of Gemma 3's LM
// head: 4x the one-row time), where one AMX instruction does the work of 16 of them. Here every
// weight is read from memory once per call and multiplied with up to 16 rows at a time, so a
// decode step of 16 sequences costs about what one sequence costs.
//
// Layout: the dot-product kernel's pairs ([tiles, K / 2, 16, 2]), viewed as
// [tiles, K / 32, 16, 16, 2]: 32 k of a tile of 16 columns are 1 KiB in a row, exactly one B tile
// (16 rows of k pairs x 16 columns x 2). x is read in place as A tiles (rows x 32 k). K must be a
// multiple of 32.
//
// Every output element is summed over k in blocks of 32, in order, by the same instruction
// whatever M is and however the rows are blocked (each row of a tile is computed on its own), so
// a row's result does not depend on the rows batched with it.
//
// Compiled only where the compiler targets AMX-BF16 (`-march=native` on such a CPU); at run time
// the process must also be granted the tile state by the kernel (Linux 5.16+), else
// `bf16_amx_available()` is false and the Python side keeps the other kernels.
#include "ops.h"
#include "step.h"
#include "vec.h"

#include <ATen/ATen.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define LLM_FORGE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace llm_forge {

#ifdef LLM_FORGE_AMX
namespace {

constexpr int kTile = 16;           // output columns per tile
constexpr int kRows = 16;           // rows of x per A tile
constexpr int64_t kKBlock = 32;     // k per A / B tile
constexpr int64_t kGroup = 4;       // column tiles per pass (C tiles 0-3)
constexpr int64_t kRowPanel = 256;  // rows of x (a multiple of kRows) kept in L2 per pass
constexpr int64_t kBTileElems = kKBlock * kTile;  // bf16 values in one B tile

// Linux hands out the AMX tile state only to processes that ask for it (arch_prctl).
bool request_tile_state() {
  constexpr long kReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

// Palette 1: C tiles 0-3 and the A tile 4 hold `rows` rows of 64 bytes; B tiles 5 and 6 16 rows.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  explicit TileConfig(int r) {
    for (int t = 0; t < 7; ++t) {
      colsb[t] = 64;
      rows[t] = static_cast<uint8_t>(t < 5 ? r : kRows);
    }
  }
};

// One C tile row (16 sums) plus the bias into row[n0, n0 + n_valid), rounded as static_cast
// rounds (store_row's values): a prefill writes millions per projection, so whole tiles go
// through vectors.
template <typename T>
inline void store_sums(T* row, const float* sums, const float* bias, int64_t n0,
                       int64_t n_valid) {
  if (n_valid < kTile) {
    store_row(row, sums, bias, n0, n_valid);
    return;
  }
  for (int h = 0; h < kTile; h += kLanes)
    store(row + n0 + h, load(sums + h) + (bias ? load(bias + n0 + h) : splat(0.f)));
}

// One row block (rows <= 16, tile config loaded for it) against `nt` <= 4 column tiles.
template <typename T>
void amx_block(const uint16_t* x, int64_t rows, int64_t K, const uint16_t* w, int64_t tile0,
               int64_t nt, int64_t N, const float* bias, T* out) {
  const int64_t kblocks = K / kKBlock;
  const int64_t tile_elems = K * kTile;
  const uint16_t* b0 = w + tile0 * tile_elems;
  const int64_t x_stride = K * 2, b_stride = 64;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    const uint16_t* b = b0 + kb * kBTileElems;
    _tile_loadd(4, x + kb * kKBlock, x_stride);
    _tile_loadd(5, b, b_stride);
    _tile_dpbf16ps(0, 4, 5);
    if (nt > 1) {
      _tile_loadd(6, b + tile_elems, b_stride);
      _tile_dpbf16ps(1, 4, 6);
    }
    if (nt > 2) {
      _tile_loadd(5, b + 2 * tile_elems, b_stride);
      _tile_dpbf16ps(2, 4, 5);
    }
    if (nt > 3) {
      _tile_loadd(6, b + 3 * tile_elems, b_stride);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  alignas(64) float sums[kGroup][kRows][kTile];
  _tile_stored(0, sums[0], 64);
  if (nt > 1) _tile_stored(1, sums[1], 64);
  if (nt > 2) _tile_stored(2, sums[2], 64);
  if (nt > 3) _tile_stored(3, sums[3], 64);
  for (int64_t t = 0; t < nt; ++t) {
    const int64_t n0 = (tile0 + t) * kTile;
    const int64_t n_valid = std::min<int64_t>(kTile, N - n0);
    for (int64_t m = 0; m < rows; ++m) store_sums(out + m * N, sums[t][m], bias, n0, n_valid);
  }
}

// Groups [begin, end) of 4 column tiles against every row, on the calling thread. The tile
// configuration is loaded here and released at the end: it is per thread, and other code on this
// thread (oneDNN) may have loaded its own since.
template <typename T>
void amx_groups(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t num_tiles,
                int64_t N, const float* bias, T* out, int64_t begin, int64_t end) {
  const TileConfig full(kRows), tail(static_cast<int>(M % kRows));
  const TileConfig* loaded = nullptr;
  // Panels of rows against the range's groups: the panel's x and the range's weights both stay
  // in L2 (a prefill's x read again for every group came from L3).
  for (int64_t p0 = 0; p0 < M; p0 += kRowPanel) {
    const int64_t p_end = std::min(M, p0 + kRowPanel);
    for (int64_t g = begin; g < end; ++g) {
      const int64_t tile0 = g * kGroup, nt = std::min(kGroup, num_tiles - tile0);
      for (int64_t m0 = p0; m0 < p_end; m0 += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, M - m0);
        const TileConfig* want = rows == kRows ? &full : &tail;
        if (want != loaded) {
          _tile_loadconfig(want);
          loaded = want;
        }
        amx_block(x + m0 * K, rows, K, w, tile0, nt, N, bias, out + m0 * N);
      }
    }
  }
  _tile_release();
}

int64_t amx_group_count(int64_t num_tiles) { return (num_tiles + kGroup - 1) / kGroup; }

template <typename T>
void run_amx_gemm(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t num_tiles,
                  int64_t N, const float* bias, T* out) {
  // Threads claim chunks of 4-tile groups (each streams its own weights, once: every row block
  // meets a group while its 4 tiles are in L2), about 8 chunks per thread.
  const int64_t groups = amx_group_count(num_tiles);
  parallel_chunks(groups, step::bf16_amx_chunk(groups, at::get_num_threads()),
                  [&](int64_t begin, int64_t end) {
                    amx_groups(x, M, K, w, num_tiles, N, bias, out, begin, end);
                  });
}

}  // namespace
#endif

bool bf16_amx_available() {
#ifdef LLM_FORGE_AMX
  static const bool granted = request_tile_state();
  return granted;
#else
  return false;
#endif
}

at::Tensor linear_bf16_amx(const at::Tensor& x, const at::Tensor& packed,
                           const c10::optional<at::Tensor>& bias, int64_t N, bool fp32_out) {
#ifdef LLM_FORGE_AMX
  TORCH_CHECK(bf16_amx_available(), "the kernel did not grant this process the AMX tile state");
  const int64_t num_tiles = packed.size(0), K = step::bf16_amx_check_layout(packed, N);
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x must be bf16 for the AMX GEMM");
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  GemmOutput o(x, bias, M, N, fp32_out);
  const auto* xp = reinterpret_cast<const uint16_t*>(x2.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  if (M > 0 && fp32_out) run_amx_gemm(xp, M, K, wp, num_tiles, N, o.bias(), o.out.data_ptr<float>());
  else if (M > 0)
    run_amx_gemm(xp, M, K, wp, num_tiles, N, o.bias(), o.out.data_ptr<at::BFloat16>());
  return o.result();
#else
  TORCH_CHECK(false, "this build of the kernels has no AMX GEMM (the CPU or the compiler target "
                     "lacks AMX-BF16)");
#endif
}

namespace step {

int64_t bf16_amx_check_layout(const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 5 &&
                  packed.size(2) == 16 && packed.size(3) == 16 && packed.size(4) == 2 &&
                  packed.is_contiguous(),
              "packed weight must be a contiguous bf16 [tiles, K / 32, 16, 16, 2] tensor");
  bf16_check_tiles_fit(packed.size(0), N);
  return 32 * packed.size(1);
}

int64_t bf16_amx_chunk(int64_t groups, int64_t threads) {
  return std::max<int64_t>(1, groups / (8 * std::max<int64_t>(1, threads)));
}

int64_t bf16_amx_units(int64_t num_tiles) {
#ifdef LLM_FORGE_AMX
  return amx_group_count(num_tiles);
#else
  return 0;
#endif
}

template <typename T>
void bf16_amx_range(const at::BFloat16* x, int64_t M, int64_t K, const at::BFloat16* packed,
                    int64_t num_tiles, int64_t N, const float* bias, T* out, int64_t u_begin,
                    int64_t u_end) {
#ifdef LLM_FORGE_AMX
  amx_groups(reinterpret_cast<const uint16_t*>(x), M, K,
             reinterpret_cast<const uint16_t*>(packed), num_tiles, N, bias, out, u_begin, u_end);
#else
  TORCH_CHECK(false, "this build of the kernels has no AMX GEMM");
#endif
}
template void bf16_amx_range<float>(const at::BFloat16*, int64_t, int64_t, const at::BFloat16*,
                                    int64_t, int64_t, const float*, float*, int64_t, int64_t);
template void bf16_amx_range<at::BFloat16>(const at::BFloat16*, int64_t, int64_t,
                                           const at::BFloat16*, int64_t, int64_t, const float*,
                                           at::BFloat16*, int64_t, int64_t);

}  // namespace step

}  // namespace llm_forge
