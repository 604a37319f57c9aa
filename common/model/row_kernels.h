// The SIMD kernels behind row_ops.h for fp32 and bf16 rows (bf16 as raw
// 16-bit patterns), compiled by Highway for every SIMD target
// (row_kernels.cc; the chosen target runs, common/model/simd_target.h). Each
// computes exactly what the matching row_ops.h function documents, rounding
// to bf16 as c10::BFloat16 does (nearest even). Within one target a row's
// result depends only on that row: batch-invariant.
//
// Pure functions over caller-owned buffers; any thread.
#ifndef KNAPSERVE_COMMON_MODEL_ROW_KERNELS_H_
#define KNAPSERVE_COMMON_MODEL_ROW_KERNELS_H_

#include <cstdint>

namespace knapserve::row_kernels {

void RmsNorm(const float* x, const float* w, int64_t rows, int64_t d, float eps,
             float* out);
void RmsNorm(const uint16_t* x, const uint16_t* w, int64_t rows, int64_t d,
             float eps, uint16_t* out);
void SiluMul(const float* gu, int64_t rows, int64_t inter, float* out);
void SiluMul(const float* gu, int64_t rows, int64_t inter, uint16_t* out);
void AddResidual(const float* h, const float* y, int64_t count, float* out);
void AddResidual(const uint16_t* h, const float* y, int64_t count,
                 uint16_t* out);
// out[i] = bf16(y[i]).
void Round(const float* y, int64_t count, uint16_t* out);

}  // namespace knapserve::row_kernels

#endif  // KNAPSERVE_COMMON_MODEL_ROW_KERNELS_H_
