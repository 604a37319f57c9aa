#include "common/model/row_ops.h"

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/model/row_kernels.h"

namespace knapserve::row_ops {
namespace {

// The kernels' view of an element type: fp32 as is, bf16 as its 16 bits.
inline const float* Raw(const float* p) { return p; }
inline float* Raw(float* p) { return p; }
inline const uint16_t* Raw(const c10::BFloat16* p) {
  return reinterpret_cast<const uint16_t*>(p);
}
inline uint16_t* Raw(c10::BFloat16* p) {
  return reinterpret_cast<uint16_t*>(p);
}

}  // namespace

template <typename E>
void RmsNorm(const E* x, const E* w, int64_t rows, int64_t d, float eps,
             E* out) {
  row_kernels::RmsNorm(Raw(x), Raw(w), rows, d, eps, Raw(out));
}

template <typename E>
void Rope(E* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t hd,
          int64_t pos0, const E* cos, const E* sin) {
  const int64_t half = hd / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const E* c = cos + (pos0 + r) * hd;
    const E* s = sin + (pos0 + r) * hd;
    for (int64_t h = 0; h < heads; ++h) {
      E* v = x + r * row_stride + h * hd;
      for (int64_t i = 0; i < half; ++i) {
        const float a = static_cast<float>(v[i]);
        const float b = static_cast<float>(v[i + half]);
        v[i] = static_cast<E>(a * static_cast<float>(c[i]) -
                              b * static_cast<float>(s[i]));
        v[i + half] = static_cast<E>(b * static_cast<float>(c[i + half]) +
                                     a * static_cast<float>(s[i + half]));
      }
    }
  }
}

template <typename E>
void SiluMul(const float* gu, int64_t rows, int64_t inter, E* out) {
  row_kernels::SiluMul(gu, rows, inter, Raw(out));
}

template <typename E>
void AddResidual(const E* h, const float* y, int64_t count, E* out) {
  row_kernels::AddResidual(Raw(h), y, count, Raw(out));
}

template <typename E>
void Round(const float* y, int64_t count, E* out) {
  if constexpr (std::is_same_v<E, float>) {
    std::copy_n(y, count, out);
  } else {
    row_kernels::Round(y, count, Raw(out));
  }
}

template <typename E>
void ToFloat(const E* x, int64_t count, float* out) {
  for (int64_t i = 0; i < count; ++i) out[i] = static_cast<float>(x[i]);
}

#define KNAPSERVE_ROW_OPS(E)                                                 \
  template void RmsNorm<E>(const E*, const E*, int64_t, int64_t, float, E*); \
  template void Rope<E>(E*, int64_t, int64_t, int64_t, int64_t, int64_t,     \
                        const E*, const E*);                                 \
  template void SiluMul<E>(const float*, int64_t, int64_t, E*);              \
  template void AddResidual<E>(const E*, const float*, int64_t, E*);         \
  template void Round<E>(const float*, int64_t, E*);                         \
  template void ToFloat<E>(const E*, int64_t, float*);
KNAPSERVE_ROW_OPS(float)
KNAPSERVE_ROW_OPS(c10::BFloat16)
#undef KNAPSERVE_ROW_OPS

}  // namespace knapserve::row_ops
