// Linear: y = x @ w^T, the projection every sublayer runs, with a CPU fast
// path for the decode shapes.
//
// At batch 1 (decode) and for the few rows of a verification pass, a matmul
// is memory-bound: it must stream every weight byte once. LibTorch 1.13's
// CPU bf16 matmul for a handful of rows reaches a small fraction of the
// machine's bandwidth, so for x with at most kMaxFastRows rows on an AVX-512
// CPU this file runs its own kernel: rows of w are streamed once, split over
// torch's intra-op threads, and dotted with every row of x while they sit in
// L1 (bf16 with AVX512-BF16 dot products accumulating in fp32, fp32 with FMA).
// Everything else (prefill, CUDA, CPUs without AVX-512) uses torch::mm.
//
// Batch invariance: the fast kernel computes each output element with the
// same instruction sequence whatever the number of rows, so one token decoded
// alone and the same token inside a verification pass get bit-identical
// projections. Speculative greedy output then equals autoregressive output
// exactly, not merely up to floating-point ties.
//
// Thread safety: pure functions of their inputs.
#ifndef KNAPSERVE_COMMON_MODEL_LINEAR_H_
#define KNAPSERVE_COMMON_MODEL_LINEAR_H_

#include <torch/types.h>

namespace knapserve {

// Rows of x up to which Linear uses the fast CPU kernel.
inline constexpr int64_t kMaxFastRows = 16;

// Whether this CPU runs the fast kernel for `dtype` (kBFloat16 needs
// AVX512-BF16, kFloat32 needs AVX-512F).
bool FastLinearSupported(torch::ScalarType dtype);

// x: [M, K], w: [N, K], both contiguous, same dtype and device; returns
// [M, N] in x's dtype. bias ([N]) is optional (undefined tensor = none).
torch::Tensor Linear(const torch::Tensor& x, const torch::Tensor& w,
                     const torch::Tensor& bias = torch::Tensor());

// The fast kernel itself (M <= kMaxFastRows, CPU, contiguous, supported
// dtype); exposed for tests and benchmarks. Output is float32 [M, N].
torch::Tensor FastLinearFloatOut(const torch::Tensor& x, const torch::Tensor& w);

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_MODEL_LINEAR_H_
