// Linear: y = x @ w^T, the projection every sublayer runs, with a CPU kernel
// that makes a pass over several tokens cost little more than one token.
//
// A projection weight is held as a LinearWeight. On a CPU (fp32 or bf16) it is
// packed once, at load, into panels of 16 output columns stored K-major
// (common/model/linear_kernels.h), and Linear runs the register-blocked SIMD
// kernel of the chosen target (common/model/simd_target.h: AVX-512, AVX2,
// Arm or the scalar fallback) for any number of rows: tiles of up to 6 token
// rows x up to 64 output columns, every weight vector loaded once and used by
// all the rows of the tile, no horizontal sums. A decode step (1 row) streams
// the weights once; a verification pass over 5 rows streams them once too
// and adds only the arithmetic. Elsewhere (CUDA; fp16, which models run on
// CUDA only) the weight stays a plain [N, K] tensor and Linear calls
// torch::mm.
//
// Batch invariance: with the packed kernel each output element is one
// fused-multiply-add chain over K in a fixed order, whatever the number of
// rows and however the work is split between threads, so one token decoded
// alone and the same token inside a verification pass get bit-identical
// projections. Speculative greedy output then equals autoregressive output
// exactly, not merely up to floating-point ties. This holds within one SIMD
// target; the packed layout is the same for all of them.
//
// Ownership: a LinearWeight owns its storage (by torch reference count);
// copies share it. Thread safety: immutable after construction; Linear is a
// pure function and runs on torch's intra-op threads.
#ifndef KNAPSERVE_COMMON_MODEL_LINEAR_H_
#define KNAPSERVE_COMMON_MODEL_LINEAR_H_

#include <torch/types.h>

#include <cstdint>

namespace knapserve {

// Whether CPU weights of `dtype` are packed for the SIMD kernel (fp32 and
// bf16, on every CPU).
bool FastLinearSupported(torch::ScalarType dtype);

class LinearWeight {
 public:
  LinearWeight() = default;
  // w: [N, K] (out_features x in_features) on any device. Packs it when the
  // fast kernel supports its device and dtype; otherwise keeps w as is.
  explicit LinearWeight(const torch::Tensor& w);

  bool defined() const { return n_ > 0; }
  int64_t out_features() const { return n_; }
  int64_t in_features() const { return k_; }
  torch::ScalarType dtype() const { return dtype_; }
  // True when held in the packed CPU layout (dense() is then undefined).
  bool packed() const { return packed_.defined(); }
  // The plain [N, K] tensor when not packed.
  const torch::Tensor& dense() const { return dense_; }
  // The packed panels (see linear_kernels.h) when packed.
  const torch::Tensor& panels() const { return packed_; }
  // [N, K] in the weight's dtype, unpacked again if needed (a copy when
  // packed).
  torch::Tensor ToDense() const;
  // Bytes of the weight itself (N * K * element size, without panel padding).
  int64_t bytes() const;

 private:
  torch::Tensor dense_;
  torch::Tensor packed_;
  int64_t n_ = 0;
  int64_t k_ = 0;
  torch::ScalarType dtype_ = torch::kFloat32;
};

// x: [M, K] with K == w.in_features(), same dtype as w; returns [M, N] in x's
// dtype. bias ([N]) is optional (undefined tensor = none) and is added in
// fp32 before rounding, as a fused addmm would.
torch::Tensor Linear(const torch::Tensor& x, const LinearWeight& w,
                     const torch::Tensor& bias = torch::Tensor());

// The packed kernel's fp32 result before rounding to x's dtype ([M, N]
// float32); w must be packed. Exposed for tests and benchmarks.
torch::Tensor LinearFloatOut(const torch::Tensor& x, const LinearWeight& w);

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_MODEL_LINEAR_H_
