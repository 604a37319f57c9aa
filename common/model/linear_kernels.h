// The CPU projection kernels behind common/model/linear.h, over weights
// packed by PackPanels*: the [N, K] weight is cut into panels of 16 output
// columns, each stored K-major ([K][16] floats, or [ceil(K/2)][16][2] bf16
// pairs), the last panel zero-padded. The layout is the same for every SIMD
// target, so a model packed once runs on whichever target is chosen
// (common/model/simd_target.h).
//
// One source, several targets: linear_kernels.cc is compiled by Highway for
// AVX-512, AVX2, the Arm targets and a scalar fallback, and the best target
// the CPU supports runs (or the pinned one). bf16 on CPUs with AVX512-BF16
// may instead run the hand-written vdpbf16ps kernel
// (linear_kernels_avx512bf16.cc), which is a target of its own
// ("avx512bf16").
//
// Each output element y[m, n] is one multiply-add chain over k in increasing
// order, started from zero: fp32 acc = MulAdd(x[m,k], w[k,n], acc); bf16 the
// same on the values widened to fp32 (exact), except on avx512bf16 where each
// k pair is one vdpbf16ps. The kernels compute tiles of several token rows x
// several panels in registers: every weight vector loaded is used by all the
// rows of the tile, x values are broadcast, and no horizontal reduction is
// ever needed. Because the chain of an element does not depend on the tile it
// lands in, the result of a row is bit-identical, within one target, whatever
// the number of rows M and however panels and rows are split between threads:
// the batch invariance that makes speculative greedy decoding exactly equal
// to plain decoding.
//
// Pure functions; any thread.
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
// from x [M, k] (row stride k) and the packed weight of an [n, k] matrix, on
// the current SIMD target.
void PanelLinearF32(const float* x, const float* packed, float* y, int64_t n,
                    int64_t k, int64_t r0, int64_t r1, int64_t p0, int64_t p1);
void PanelLinearBf16(const uint16_t* x, const uint16_t* packed, float* y,
                     int64_t n, int64_t k, int64_t r0, int64_t r1, int64_t p0,
                     int64_t p1);

// The AVX512-BF16 kernel (linear_kernels_avx512bf16.cc): call only when
// simd::Avx512Bf16Active(). PanelLinearBf16 calls it then.
void PanelLinearBf16Avx512Bf16(const uint16_t* x, const uint16_t* packed,
                               float* y, int64_t n, int64_t k, int64_t r0,
                               int64_t r1, int64_t p0, int64_t p1);

}  // namespace knapserve::kernels

#endif  // KNAPSERVE_COMMON_MODEL_LINEAR_KERNELS_H_
