// The projection kernels of linear_kernels.h, one Highway source compiled for
// every SIMD target (hwy/foreach_target.h re-includes this file once per
// target; HWY_DYNAMIC_DISPATCH picks the chosen one at run time).
#include "common/model/linear_kernels.h"

#include <cstdint>
#include <cstring>

#include "common/model/simd_target.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "common/model/linear_kernels.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace knapserve::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Up to 16 lanes of fp32: a panel is kVecsPerPanel vectors.
using DF = hn::CappedTag<float, kPanelWidth>;
using DU = hn::RebindToUnsigned<DF>;

#if HWY_HAVE_SCALABLE
// Scalable vectors (SVE, RVV) cannot live in arrays: one row and one vector
// at a time, the same chain per element.
void PanelLinearF32Impl(const float* x, const float* packed, float* y,
                        int64_t n, int64_t k, int64_t r0, int64_t r1,
                        int64_t p0, int64_t p1) {
  const DF d;
  const int64_t lanes = hn::Lanes(d);
  for (int64_t p = p0; p < p1; ++p) {
    const float* panel = packed + p * PanelElementsF32(k);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = 0; c < kPanelWidth; c += lanes) {
        auto acc = hn::Zero(d);
        for (int64_t i = 0; i < k; ++i) {
          acc = hn::MulAdd(hn::Set(d, x[r * k + i]),
                           hn::LoadU(d, panel + i * kPanelWidth + c), acc);
        }
        float out[kPanelWidth];
        hn::StoreU(acc, d, out);
        for (int64_t l = 0; l < lanes; ++l) {
          const int64_t col = p * kPanelWidth + c + l;
          if (col < n) y[r * n + col] = out[l];
        }
      }
    }
  }
}
void PanelLinearBf16Impl(const uint16_t* x, const uint16_t* packed, float* y,
                         int64_t n, int64_t k, int64_t r0, int64_t r1,
                         int64_t p0, int64_t p1) {
  const DF d;
  const DU du;
  const int64_t lanes = hn::Lanes(d);
  auto widen = [](uint16_t b) {
    const uint32_t bits = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  };
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t* panel = packed + p * PanelElementsBf16(k);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = 0; c < kPanelWidth; c += lanes) {
        auto acc = hn::Zero(d);
        for (int64_t i = 0; i < k; ++i) {
          const auto u =
              hn::LoadU(du, reinterpret_cast<const uint32_t*>(
                                panel + ((i / 2) * kPanelWidth + c) * 2));
          const auto w =
              (i % 2 == 0)
                  ? hn::BitCast(d, hn::ShiftLeft<16>(u))
                  : hn::BitCast(d, hn::And(u, hn::Set(du, 0xFFFF0000u)));
          acc = hn::MulAdd(hn::Set(d, widen(x[r * k + i])), w, acc);
        }
        float out[kPanelWidth];
        hn::StoreU(acc, d, out);
        for (int64_t l = 0; l < lanes; ++l) {
          const int64_t col = p * kPanelWidth + c + l;
          if (col < n) y[r * n + col] = out[l];
        }
      }
    }
  }
}
#else  // !HWY_HAVE_SCALABLE

constexpr int kLanes = static_cast<int>(hn::MaxLanes(DF()));
constexpr int kVecsPerPanel = static_cast<int>(kPanelWidth) / kLanes;
// Accumulator registers a tile may use: about 3/4 of the vector registers
// (32 on AVX-512 and AArch64, 16 elsewhere), leaving room for the weight
// vectors and the broadcast x value.
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL || HWY_ARCH_ARM_A64
constexpr int kAccBudget = 24;
#else
constexpr int kAccBudget = 12;
#endif
constexpr int kMaxTileRows = 6;
constexpr int kMaxTilePanels = 4;

// Panels per tile for a tile of `rows` rows: as many as the accumulator
// budget allows, at least 1, at most kMaxTilePanels.
constexpr int PanelsForRows(int rows) {
  const int by_budget = kAccBudget / (rows * kVecsPerPanel);
  return by_budget < 1
             ? 1
             : (by_budget > kMaxTilePanels ? kMaxTilePanels : by_budget);
}

// Stores vector `acc` of output columns [col, col + kLanes) of one row,
// where `valid` columns of the matrix remain from `col`.
HWY_INLINE void StoreColumns(hn::Vec<DF> acc, float* y, int64_t valid) {
  const DF d;
  if (valid >= kLanes) {
    hn::StoreU(acc, d, y);
  } else if (valid > 0) {
    float out[kLanes];
    hn::StoreU(acc, d, out);
    std::memcpy(y, out, static_cast<size_t>(valid) * sizeof(float));
  }
}

// bf16 bits to fp32 (exact).
HWY_INLINE float Bf16ToF32(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// One tile: MR rows x NP panels (NP * kVecsPerPanel vectors per row).
// `valid`: output columns left from the tile's first column.
template <int MR, int NP>
void TileF32(const float* x, int64_t k, const float* panel,
             int64_t panel_stride, float* y, int64_t ldy, int64_t valid) {
  constexpr int NV = NP * kVecsPerPanel;
  const DF d;
  hn::Vec<DF> acc[MR][NV];
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < NV; ++v) acc[r][v] = hn::Zero(d);
  }
  for (int64_t i = 0; i < k; ++i) {
    hn::Vec<DF> w[NV];
    for (int v = 0; v < NV; ++v) {
      w[v] = hn::LoadU(d, panel + (v / kVecsPerPanel) * panel_stride +
                              i * kPanelWidth + (v % kVecsPerPanel) * kLanes);
    }
    for (int r = 0; r < MR; ++r) {
      const auto xb = hn::Set(d, x[r * k + i]);
      for (int v = 0; v < NV; ++v) acc[r][v] = hn::MulAdd(xb, w[v], acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < NV; ++v) {
      StoreColumns(acc[r][v], y + r * ldy + v * kLanes, valid - v * kLanes);
    }
  }
}

// bf16 pairs: lane c of a 32-bit load holds (w[2p][c], w[2p+1][c]) in its
// low and high halves; shifting the low half up, or masking the high half,
// widens each to fp32 exactly. Then the same chain over k as TileF32.
template <int MR, int NP>
void TileBf16(const uint16_t* x, int64_t k, const uint16_t* panel,
              int64_t panel_stride, float* y, int64_t ldy, int64_t valid) {
  constexpr int NV = NP * kVecsPerPanel;
  const DF d;
  const DU du;
  const auto high_mask = hn::Set(du, 0xFFFF0000u);
  hn::Vec<DF> acc[MR][NV];
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < NV; ++v) acc[r][v] = hn::Zero(d);
  }
  const int64_t full_pairs = k / 2;
  for (int64_t p = 0; p < full_pairs; ++p) {
    hn::Vec<DF> even[NV];
    hn::Vec<DF> odd[NV];
    for (int v = 0; v < NV; ++v) {
      const auto u = hn::LoadU(
          du, reinterpret_cast<const uint32_t*>(
                  panel + (v / kVecsPerPanel) * panel_stride +
                  (p * kPanelWidth + (v % kVecsPerPanel) * kLanes) * 2));
      even[v] = hn::BitCast(d, hn::ShiftLeft<16>(u));
      odd[v] = hn::BitCast(d, hn::And(u, high_mask));
    }
    for (int r = 0; r < MR; ++r) {
      const auto x0 = hn::Set(d, Bf16ToF32(x[r * k + 2 * p]));
      const auto x1 = hn::Set(d, Bf16ToF32(x[r * k + 2 * p + 1]));
      for (int v = 0; v < NV; ++v) {
        acc[r][v] = hn::MulAdd(x0, even[v], acc[r][v]);
        acc[r][v] = hn::MulAdd(x1, odd[v], acc[r][v]);
      }
    }
  }
  if (k % 2 != 0) {
    const int64_t p = full_pairs;
    for (int v = 0; v < NV; ++v) {
      const auto u = hn::LoadU(
          du, reinterpret_cast<const uint32_t*>(
                  panel + (v / kVecsPerPanel) * panel_stride +
                  (p * kPanelWidth + (v % kVecsPerPanel) * kLanes) * 2));
      const auto even = hn::BitCast(d, hn::ShiftLeft<16>(u));
      for (int r = 0; r < MR; ++r) {
        acc[r][v] = hn::MulAdd(hn::Set(d, Bf16ToF32(x[r * k + 2 * p])), even,
                               acc[r][v]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < NV; ++v) {
      StoreColumns(acc[r][v], y + r * ldy + v * kLanes, valid - v * kLanes);
    }
  }
}

template <typename E>
using TileFn = void (*)(const E* x, int64_t k, const E* panel,
                        int64_t panel_stride, float* y, int64_t ldy,
                        int64_t valid);

template <int MR, int NP>
struct F32Tile {
  static constexpr TileFn<float> fn = &TileF32<MR, NP>;
};
template <int MR, int NP>
struct Bf16Tile {
  static constexpr TileFn<uint16_t> fn = &TileBf16<MR, NP>;
};

// table[mr - 1][np - 1] for mr in 1..6 and np in 1..PanelsForRows(mr)
// (entries past that repeat the widest allowed tile and are never used).
template <typename E, template <int, int> class T>
struct Tiles {
  template <int MR>
  static constexpr TileFn<E> At(int np) {
    constexpr int max_np = PanelsForRows(MR);
    return np <= 1   ? T<MR, 1>::fn
           : np == 2 ? T<MR, (max_np < 2 ? max_np : 2)>::fn
           : np == 3 ? T<MR, (max_np < 3 ? max_np : 3)>::fn
                     : T<MR, (max_np < 4 ? max_np : 4)>::fn;
  }
  static TileFn<E> Get(int mr, int np) {
    switch (mr) {
      case 1:
        return At<1>(np);
      case 2:
        return At<2>(np);
      case 3:
        return At<3>(np);
      case 4:
        return At<4>(np);
      case 5:
        return At<5>(np);
      default:
        return At<6>(np);
    }
  }
};

// Panels in groups of kMaxTilePanels; within a group, rows in tiles of up to
// 6, each row tile covering the group's panels PanelsForRows(mr) at a time,
// so the group's weights are read from memory once and reused from cache by
// every row tile.
template <typename E, template <int, int> class T>
void RunPanels(const E* x, const E* packed, int64_t panel_elements, float* y,
               int64_t n, int64_t k, int64_t r0, int64_t r1, int64_t p0,
               int64_t p1) {
  for (int64_t g = p0; g < p1; g += kMaxTilePanels) {
    const int64_t g_end = p1 - g < kMaxTilePanels ? p1 : g + kMaxTilePanels;
    for (int64_t r = r0; r < r1; r += kMaxTileRows) {
      const int mr =
          static_cast<int>(r1 - r < kMaxTileRows ? r1 - r : kMaxTileRows);
      const int max_np = PanelsForRows(mr);
      for (int64_t p = g; p < g_end; p += max_np) {
        const int np =
            static_cast<int>(g_end - p < max_np ? g_end - p : max_np);
        Tiles<E, T>::Get(mr, np)(x + r * k, k, packed + p * panel_elements,
                                 panel_elements, y + r * n + p * kPanelWidth, n,
                                 n - p * kPanelWidth);
      }
    }
  }
}

void PanelLinearF32Impl(const float* x, const float* packed, float* y,
                        int64_t n, int64_t k, int64_t r0, int64_t r1,
                        int64_t p0, int64_t p1) {
  RunPanels<float, F32Tile>(x, packed, PanelElementsF32(k), y, n, k, r0, r1, p0,
                            p1);
}

void PanelLinearBf16Impl(const uint16_t* x, const uint16_t* packed, float* y,
                         int64_t n, int64_t k, int64_t r0, int64_t r1,
                         int64_t p0, int64_t p1) {
  RunPanels<uint16_t, Bf16Tile>(x, packed, PanelElementsBf16(k), y, n, k, r0,
                                r1, p0, p1);
}
#endif  // HWY_HAVE_SCALABLE

}  // namespace HWY_NAMESPACE
}  // namespace knapserve::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace knapserve::kernels {

HWY_EXPORT(PanelLinearF32Impl);
HWY_EXPORT(PanelLinearBf16Impl);

void PackPanelsF32(const float* w, int64_t n, int64_t k, float* packed) {
  for (int64_t p = 0; p < NumPanels(n); ++p) {
    float* panel = packed + p * PanelElementsF32(k);
    for (int64_t i = 0; i < k; ++i) {
      for (int64_t c = 0; c < kPanelWidth; ++c) {
        const int64_t row = p * kPanelWidth + c;
        panel[i * kPanelWidth + c] = row < n ? w[row * k + i] : 0.0f;
      }
    }
  }
}

void PackPanelsBf16(const uint16_t* w, int64_t n, int64_t k, uint16_t* packed) {
  const int64_t pairs = (k + 1) / 2;
  for (int64_t p = 0; p < NumPanels(n); ++p) {
    uint16_t* panel = packed + p * PanelElementsBf16(k);
    for (int64_t q = 0; q < pairs; ++q) {
      for (int64_t c = 0; c < kPanelWidth; ++c) {
        const int64_t row = p * kPanelWidth + c;
        for (int64_t h = 0; h < 2; ++h) {
          const int64_t i = 2 * q + h;
          panel[(q * kPanelWidth + c) * 2 + h] =
              row < n && i < k ? w[row * k + i] : uint16_t{0};
        }
      }
    }
  }
}

void PanelLinearF32(const float* x, const float* packed, float* y, int64_t n,
                    int64_t k, int64_t r0, int64_t r1, int64_t p0, int64_t p1) {
  simd::EnsureChosen().IgnoreError();
  HWY_DYNAMIC_DISPATCH(PanelLinearF32Impl)(x, packed, y, n, k, r0, r1, p0, p1);
}

void PanelLinearBf16(const uint16_t* x, const uint16_t* packed, float* y,
                     int64_t n, int64_t k, int64_t r0, int64_t r1, int64_t p0,
                     int64_t p1) {
#if HWY_ARCH_X86
  if (simd::Avx512Bf16Active()) {
    PanelLinearBf16Avx512Bf16(x, packed, y, n, k, r0, r1, p0, p1);
    return;
  }
#endif
  simd::EnsureChosen().IgnoreError();
  HWY_DYNAMIC_DISPATCH(PanelLinearBf16Impl)(x, packed, y, n, k, r0, r1, p0, p1);
}

}  // namespace knapserve::kernels
#endif  // HWY_ONCE
