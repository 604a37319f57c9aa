#include "common/model/row_ops.h"

#include <c10/util/BFloat16.h>

#include <cmath>

namespace knapserve::row_ops {
namespace {

// Partial sums in 16 lanes, then the lanes in order: vectorizable, and the
// order depends only on d.
constexpr int64_t kLanes = 16;

template <typename E>
float SumOfSquares(const E* x, int64_t d) {
  float lanes[kLanes] = {};
  const int64_t full = d / kLanes * kLanes;
  for (int64_t i = 0; i < full; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      const float v = static_cast<float>(x[i + l]);
      lanes[l] += v * v;
    }
  }
  float s = 0.0f;
  for (int64_t i = full; i < d; ++i) {
    const float v = static_cast<float>(x[i]);
    s += v * v;
  }
  for (int64_t l = 0; l < kLanes; ++l) s += lanes[l];
  return s;
}

}  // namespace

template <typename E>
void RmsNorm(const E* x, const E* w, int64_t rows, int64_t d, float eps,
             E* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const E* xr = x + r * d;
    E* o = out + r * d;
    const float inv =
        1.0f / std::sqrt(SumOfSquares(xr, d) / static_cast<float>(d) + eps);
    for (int64_t i = 0; i < d; ++i) {
      const E normalized = static_cast<E>(static_cast<float>(xr[i]) * inv);
      o[i] = static_cast<E>(static_cast<float>(w[i]) *
                            static_cast<float>(normalized));
    }
  }
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
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * 2 * inter;
    const float* u = g + inter;
    E* o = out + r * inter;
    for (int64_t i = 0; i < inter; ++i) {
      const float gate = static_cast<float>(static_cast<E>(g[i]));
      const float up = static_cast<float>(static_cast<E>(u[i]));
      const float silu =
          static_cast<float>(static_cast<E>(gate / (1.0f + std::exp(-gate))));
      o[i] = static_cast<E>(silu * up);
    }
  }
}

template <typename E>
void AddResidual(const E* h, const float* y, int64_t count, E* out) {
  for (int64_t i = 0; i < count; ++i) {
    out[i] = static_cast<E>(static_cast<float>(h[i]) +
                            static_cast<float>(static_cast<E>(y[i])));
  }
}

template <typename E>
void Round(const float* y, int64_t count, E* out) {
  for (int64_t i = 0; i < count; ++i) out[i] = static_cast<E>(y[i]);
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
