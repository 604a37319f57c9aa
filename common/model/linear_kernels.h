// The AVX-512 projection kernels behind common/model/linear.h, over weights
// packed by PackPanels*: the [N, K] weight is cut into panels of 16 output
// columns, each stored K-major ([K][16] floats, or [ceil(K/2)][16][2] bf16
// pairs for AVX512-BF16 dot products), the last panel zero-padded.
//
// Each output element y[m, n] is one fused multiply-add chain over k in
// increasing order (fp32: acc = fma(x[m,k], w[k,n], acc); bf16: one
// vdpbf16ps per k pair), started from zero. The kernels compute tiles of up
// to 6 token rows x 4 panels (24 accumulators in registers): every weight
// vector loaded is used by all rows of the tile, x values are broadcast, and
// no horizontal reduction is ever needed. Because the chain of an element
// does not depend on the tile it lands in, the result of a row is
// bit-identical whatever the number of rows M and however panels and rows
// are split between threads: the batch invariance that makes speculative
// greedy decoding exactly equal to plain decoding.
//
// Only linear_kernels_avx512.cc is compiled with AVX-512 flags; callers check
// the CPU first (linear.cc). Pure functions; any thread.
#ifndef KNAPSERVE_COMMON_MODEL_LINEAR_KERNELS_H_
#define KNAPSERVE_COMMON_MODEL_LINEAR_KERNELS_H_

#include <cstdint>

namespace knapserve::kernels {

// Output columns per panel.
inline constexpr int64_t kPanelWidth = 16;

// Panels for n output columns.
inline int64_t NumPanels(int64_t n) {
  return (n + kPanelWidth - 1) / kPanelWidth;
}
// Elements (floats or bf16 values) of one packed panel for reduction size k.
inline int64_t PanelElementsF32(int64_t k) { return k * kPanelWidth; }
inline int64_t PanelElementsBf16(int64_t k) {
  return (k + 1) / 2 * 2 * kPanelWidth;
}

// Packs w [n, k] (row-major) into NumPanels(n) panels at `packed`.
void PackPanelsF32(const float* w, int64_t n, int64_t k, float* packed);
void PackPanelsBf16(const uint16_t* w, int64_t n, int64_t k, uint16_t* packed);

// y[m, c] (row stride n) for rows [r0, r1) and the columns of panels [p0, p1),
// from x [M, k] (row stride k) and the packed weight of an [n, k] matrix.
void PanelLinearF32(const float* x, const float* packed, float* y, int64_t n,
                    int64_t k, int64_t r0, int64_t r1, int64_t p0, int64_t p1);
void PanelLinearBf16(const uint16_t* x, const uint16_t* packed, float* y,
                     int64_t n, int64_t k, int64_t r0, int64_t r1, int64_t p0,
                     int64_t p1);

}  // namespace knapserve::kernels

#endif  // KNAPSERVE_COMMON_MODEL_LINEAR_KERNELS_H_
