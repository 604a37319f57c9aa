// The SIMD bodies of row_ops.h (RMSNorm, SwiGLU, residual add, rounding),
// one Highway source compiled for every SIMD target (hwy/foreach_target.h
// re-includes this file once per target; HWY_DYNAMIC_DISPATCH picks the
// chosen one, common/model/simd_target.h). Declared in row_kernels.h.
//
// bf16 values are raw 16-bit patterns: widening is exact (a shift), rounding
// to bf16 is round-to-nearest-even with NaN kept quiet, as c10::BFloat16
// does. A row of width d is processed in vectors of the target's width; the
// last, partial vector goes through a zero-padded copy, so every element's
// arithmetic depends only on its row, d and the target (batch invariance).
#include "common/model/row_kernels.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/model/simd_target.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "common/model/row_kernels.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace knapserve::row_kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using DU = hn::RebindToUnsigned<DF>;
using DI = hn::RebindToSigned<DF>;
using DU16 = hn::Rebind<uint16_t, DF>;

// The most lanes any target has for fp32 (AVX-512: 16; SVE up to 64).
constexpr size_t kMaxLanes = 64;

HWY_INLINE hn::Vec<DF> Load(const float* p) { return hn::LoadU(DF(), p); }
HWY_INLINE hn::Vec<DF> Load(const uint16_t* p) {
  const DF d;
  return hn::BitCast(
      d, hn::ShiftLeft<16>(hn::PromoteTo(DU(), hn::LoadU(DU16(), p))));
}

// v rounded to bf16 (nearest even; NaN -> quiet NaN), still as fp32.
HWY_INLINE hn::Vec<DF> RoundBf16(hn::Vec<DF> v) {
  const DF d;
  const DU du;
  const auto bits = hn::BitCast(du, v);
  const auto lsb = hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 1u));
  const auto rounded =
      hn::And(hn::Add(bits, hn::Add(hn::Set(du, 0x7FFFu), lsb)),
              hn::Set(du, 0xFFFF0000u));
  return hn::IfThenElse(hn::Eq(v, v), hn::BitCast(d, rounded),
                        hn::BitCast(d, hn::Set(du, 0x7FC00000u)));
}
HWY_INLINE hn::Vec<DF> RoundTo(hn::Vec<DF> v, const float*) { return v; }
HWY_INLINE hn::Vec<DF> RoundTo(hn::Vec<DF> v, const uint16_t*) {
  return RoundBf16(v);
}

HWY_INLINE void Store(hn::Vec<DF> v, float* p) { hn::StoreU(v, DF(), p); }
// v must already be a bf16 value (RoundBf16): its high 16 bits are stored.
HWY_INLINE void Store(hn::Vec<DF> v, uint16_t* p) {
  const DI di;
  const auto high =
      hn::BitCast(di, hn::ShiftRight<16>(hn::BitCast(DU(), v)));  // 0..0xFFFF
  hn::StoreU(hn::DemoteTo(DU16(), high), DU16(), p);
}

// The last `count` (< lanes) elements of a row, zero-padded to a vector.
template <typename T>
HWY_INLINE void LoadPart(const T* p, size_t count, T* buf) {
  std::memset(buf, 0, kMaxLanes * sizeof(T));
  std::memcpy(buf, p, count * sizeof(T));
}

template <typename E>
void RmsNorm(const E* x, const E* w, int64_t rows, int64_t d, float eps,
             E* out) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  alignas(64) E xb[kMaxLanes], wb[kMaxLanes], ob[kMaxLanes];
  for (int64_t r = 0; r < rows; ++r) {
    const E* xr = x + r * d;
    E* o = out + r * d;
    auto ss = hn::Zero(df);
    size_t i = 0;
    for (; i + lanes <= static_cast<size_t>(d); i += lanes) {
      const auto v = Load(xr + i);
      ss = hn::MulAdd(v, v, ss);
    }
    const size_t tail = static_cast<size_t>(d) - i;
    if (tail > 0) {
      LoadPart(xr + i, tail, xb);
      const auto v = Load(xb);
      ss = hn::MulAdd(v, v, ss);
    }
    const float sum = hn::GetLane(hn::SumOfLanes(df, ss));
    const auto inv =
        hn::Set(df, 1.0f / std::sqrt(sum / static_cast<float>(d) + eps));
    auto norm = [&](const E* xp, const E* wp, E* op) {
      const auto normalized = RoundTo(hn::Mul(Load(xp), inv), xp);
      Store(RoundTo(hn::Mul(Load(wp), normalized), xp), op);
    };
    for (i = 0; i + lanes <= static_cast<size_t>(d); i += lanes) {
      norm(xr + i, w + i, o + i);
    }
    if (tail > 0) {
      LoadPart(xr + i, tail, xb);
      LoadPart(w + i, tail, wb);
      norm(xb, wb, ob);
      std::memcpy(o + i, ob, tail * sizeof(E));
    }
  }
}

template <typename E>
void SiluMul(const float* gu, int64_t rows, int64_t inter, E* out) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  alignas(64) float gb[kMaxLanes], ub[kMaxLanes];
  alignas(64) E ob[kMaxLanes];
  const E* tag = nullptr;
  auto silu_mul = [&](const float* g, const float* u, E* o) {
    const auto gate = RoundTo(Load(g), tag);
    const auto up = RoundTo(Load(u), tag);
    const auto one = hn::Set(df, 1.0f);
    // exp(88) is finite; silu(gate) is -0 below gate = -88 either way.
    const auto max_exp_arg = hn::Set(df, 88.0f);
    const auto silu = RoundTo(
        hn::Div(gate,
                hn::Add(one, hn::Exp(df, hn::Min(hn::Neg(gate), max_exp_arg)))),
        tag);
    Store(RoundTo(hn::Mul(silu, up), tag), o);
  };
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * 2 * inter;
    const float* u = g + inter;
    E* o = out + r * inter;
    size_t i = 0;
    for (; i + lanes <= static_cast<size_t>(inter); i += lanes) {
      silu_mul(g + i, u + i, o + i);
    }
    const size_t tail = static_cast<size_t>(inter) - i;
    if (tail > 0) {
      LoadPart(g + i, tail, gb);
      LoadPart(u + i, tail, ub);
      silu_mul(gb, ub, ob);
      std::memcpy(o + i, ob, tail * sizeof(E));
    }
  }
}

template <typename E>
void AddResidual(const E* h, const float* y, int64_t count, E* out) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  alignas(64) E hb[kMaxLanes], ob[kMaxLanes];
  alignas(64) float yb[kMaxLanes];
  auto add = [&](const E* hp, const float* yp, E* op) {
    Store(RoundTo(hn::Add(Load(hp), RoundTo(Load(yp), hp)), hp), op);
  };
  size_t i = 0;
  for (; i + lanes <= static_cast<size_t>(count); i += lanes) {
    add(h + i, y + i, out + i);
  }
  const size_t tail = static_cast<size_t>(count) - i;
  if (tail > 0) {
    LoadPart(h + i, tail, hb);
    LoadPart(y + i, tail, yb);
    add(hb, yb, ob);
    std::memcpy(out + i, ob, tail * sizeof(E));
  }
}

void RmsNormF32(const float* x, const float* w, int64_t rows, int64_t d,
                float eps, float* out) {
  RmsNorm(x, w, rows, d, eps, out);
}
void RmsNormBf16(const uint16_t* x, const uint16_t* w, int64_t rows, int64_t d,
                 float eps, uint16_t* out) {
  RmsNorm(x, w, rows, d, eps, out);
}
void SiluMulF32(const float* gu, int64_t rows, int64_t inter, float* out) {
  SiluMul(gu, rows, inter, out);
}
void SiluMulBf16(const float* gu, int64_t rows, int64_t inter, uint16_t* out) {
  SiluMul(gu, rows, inter, out);
}
void AddResidualF32(const float* h, const float* y, int64_t count, float* out) {
  AddResidual(h, y, count, out);
}
void AddResidualBf16(const uint16_t* h, const float* y, int64_t count,
                     uint16_t* out) {
  AddResidual(h, y, count, out);
}
void RoundToBf16(const float* y, int64_t count, uint16_t* out) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  alignas(64) float yb[kMaxLanes];
  alignas(64) uint16_t ob[kMaxLanes];
  size_t i = 0;
  for (; i + lanes <= static_cast<size_t>(count); i += lanes) {
    Store(RoundBf16(Load(y + i)), out + i);
  }
  const size_t tail = static_cast<size_t>(count) - i;
  if (tail > 0) {
    LoadPart(y + i, tail, yb);
    Store(RoundBf16(Load(yb)), ob);
    std::memcpy(out + i, ob, tail * sizeof(uint16_t));
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace knapserve::row_kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace knapserve::row_kernels {

HWY_EXPORT(RmsNormF32);
HWY_EXPORT(RmsNormBf16);
HWY_EXPORT(SiluMulF32);
HWY_EXPORT(SiluMulBf16);
HWY_EXPORT(AddResidualF32);
HWY_EXPORT(AddResidualBf16);
HWY_EXPORT(RoundToBf16);

void RmsNorm(const float* x, const float* w, int64_t rows, int64_t d, float eps,
             float* out) {
  simd::EnsureChosen().IgnoreError();
  HWY_DYNAMIC_DISPATCH(RmsNormF32)(x, w, rows, d, eps, out);
}
void RmsNorm(const uint16_t* x, const uint16_t* w, int64_t rows, int64_t d,
             float eps, uint16_t* out) {
  simd::EnsureChosen().IgnoreError();
  HWY_DYNAMIC_DISPATCH(RmsNormBf16)(x, w, rows, d, eps, out);
}
void SiluMul(const float* gu, int64_t rows, int64_t inter, float* out) {
  simd::EnsureChosen().IgnoreError();
  HWY_DYNAMIC_DISPATCH(SiluMulF32)(gu, rows, inter, out);
}
void SiluMul(const float* gu, int64_t rows, int64_t inter, uint16_t* out) {
  simd::EnsureChosen().IgnoreError();
  HWY_DYNAMIC_DISPATCH(SiluMulBf16)(gu, rows, inter, out);
}
void AddResidual(const float* h, const float* y, int64_t count, float* out) {
  simd::EnsureChosen().IgnoreError();
  HWY_DYNAMIC_DISPATCH(AddResidualF32)(h, y, count, out);
}
void AddResidual(const uint16_t* h, const float* y, int64_t count,
                 uint16_t* out) {
  simd::EnsureChosen().IgnoreError();
  HWY_DYNAMIC_DISPATCH(AddResidualBf16)(h, y, count, out);
}
void Round(const float* y, int64_t count, uint16_t* out) {
  simd::EnsureChosen().IgnoreError();
  HWY_DYNAMIC_DISPATCH(RoundToBf16)(y, count, out);
}

}  // namespace knapserve::row_kernels
#endif  // HWY_ONCE
