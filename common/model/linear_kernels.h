// The raw CPU kernels behind Linear (common/model/linear.h): y[m, n] =
// dot(x[m, :], w[n, :]) for output rows n in [n0, n1), y row-major [M, N] in
// fp32. Defined in linear_kernels_avx512.cc, which is compiled for AVX-512:
// call only when the CPU has AVX-512F (and AVX512-BF16 for the bf16 kernel).
// Thread-safe for disjoint [n0, n1) ranges.
#ifndef KNAPSERVE_COMMON_MODEL_LINEAR_KERNELS_H_
#define KNAPSERVE_COMMON_MODEL_LINEAR_KERNELS_H_

#include <cstdint>

namespace knapserve::kernels {

// bf16 inputs given as their raw 16-bit patterns.
void DotRowsBf16(const uint16_t* x, const uint16_t* w, float* y, int64_t m_rows, int64_t n_total,
                 int64_t k, int64_t n0, int64_t n1);
void DotRowsF32(const float* x, const float* w, float* y, int64_t m_rows, int64_t n_total,
                int64_t k, int64_t n0, int64_t n1);

}  // namespace knapserve::kernels

#endif  // KNAPSERVE_COMMON_MODEL_LINEAR_KERNELS_H_
