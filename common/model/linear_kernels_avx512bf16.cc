// The hand-written AVX512-BF16 projection kernel for bf16 weights (contract
// in linear_kernels.h): one vdpbf16ps per k pair, which Highway 1.0.3 cannot
// express (it has no AVX3_ZEN4 target). It is the "avx512bf16" SIMD target
// (common/model/simd_target.h), chosen only on CPUs with AVX512-BF16. This
// file alone is compiled with -mavx512f -mavx512bw -mavx512vl -mavx512bf16
// (common/model/CMakeLists.txt) and includes no torch or STL header, so no
// AVX-512 code leaks into code that runs on CPUs without it.
#include <immintrin.h>
#include <string.h>

#include "common/model/linear_kernels.h"

namespace knapserve::kernels {
namespace {

constexpr int kMaxTileRows = 6;
constexpr int kMaxTilePanels = 4;

// Stores one 16-column accumulator, masked when the matrix ends inside it.
inline void StoreColumns(float* y, __m512 v, int64_t valid) {
  if (valid >= kPanelWidth) {
    _mm512_storeu_ps(y, v);
  } else if (valid > 0) {
    _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << valid) - 1), v);
  }
}

// x pair (x[i], x[i+1]) as one 32-bit lane value; the element past an odd k
// is zero, as is the packed weight there.
inline uint32_t PairAt(const uint16_t* row, int64_t i, int64_t k) {
  if (i + 1 < k) {
    uint32_t pair;
    memcpy(&pair, row + i, sizeof(pair));
    return pair;
  }
  return row[i];
}

// MR rows x NV panels. `valid` = output columns left from the tile's first
// column (the last panel may be padding past n).
template <int MR, int NV>
void TileBf16(const uint16_t* x, int64_t k, const uint16_t* panel,
              int64_t panel_stride, float* y, int64_t ldy, int64_t valid) {
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  const int64_t pairs = (k + 1) / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh w[NV];
    for (int v = 0; v < NV; ++v) {
      w[v] = (__m512bh)_mm512_loadu_si512(panel + v * panel_stride +
                                          p * 2 * kPanelWidth);
    }
    for (int r = 0; r < MR; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(
          static_cast<int>(PairAt(x + r * k, 2 * p, k)));
      for (int v = 0; v < NV; ++v)
        acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xb, w[v]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < NV; ++v)
      StoreColumns(y + r * ldy + v * kPanelWidth, acc[r][v],
                   valid - v * kPanelWidth);
  }
}

template <typename E>
using TileFn = void (*)(const E* x, int64_t k, const E* panel,
                        int64_t panel_stride, float* y, int64_t ldy,
                        int64_t valid);

template <int MR, int NV>
struct Bf16Tile {
  static constexpr TileFn<uint16_t> fn = &TileBf16<MR, NV>;
};

// table[mr - 1][nv - 1] for mr in 1..6, nv in 1..4.
template <typename E, template <int, int> class T>
struct Tiles {
  static constexpr TileFn<E> table[kMaxTileRows][kMaxTilePanels] = {
      {T<1, 1>::fn, T<1, 2>::fn, T<1, 3>::fn, T<1, 4>::fn},
      {T<2, 1>::fn, T<2, 2>::fn, T<2, 3>::fn, T<2, 4>::fn},
      {T<3, 1>::fn, T<3, 2>::fn, T<3, 3>::fn, T<3, 4>::fn},
      {T<4, 1>::fn, T<4, 2>::fn, T<4, 3>::fn, T<4, 4>::fn},
      {T<5, 1>::fn, T<5, 2>::fn, T<5, 3>::fn, T<5, 4>::fn},
      {T<6, 1>::fn, T<6, 2>::fn, T<6, 3>::fn, T<6, 4>::fn},
  };
};

// Panels in groups of up to 4; within a group, rows in tiles of up to 6, so
// the group's weights are read from memory once and reused from cache by
// every row tile.
template <typename E, template <int, int> class T>
void RunPanels(const E* x, const E* packed, int64_t panel_elements, float* y,
               int64_t n, int64_t k, int64_t r0, int64_t r1, int64_t p0,
               int64_t p1) {
  for (int64_t p = p0; p < p1; p += kMaxTilePanels) {
    const int64_t nv = p1 - p < kMaxTilePanels ? p1 - p : kMaxTilePanels;
    for (int64_t r = r0; r < r1; r += kMaxTileRows) {
      const int64_t mr = r1 - r < kMaxTileRows ? r1 - r : kMaxTileRows;
      Tiles<E, T>::table[mr - 1][nv - 1](
          x + r * k, k, packed + p * panel_elements, panel_elements,
          y + r * n + p * kPanelWidth, n, n - p * kPanelWidth);
    }
  }
}

}  // namespace

void PanelLinearBf16Avx512Bf16(const uint16_t* x, const uint16_t* packed,
                               float* y, int64_t n, int64_t k, int64_t r0,
                               int64_t r1, int64_t p0, int64_t p1) {
  RunPanels<uint16_t, Bf16Tile>(x, packed, PanelElementsBf16(k), y, n, k, r0,
                                r1, p0, p1);
}

}  // namespace knapserve::kernels
