#include "common/model/linear.h"
#include "common/model/linear_kernels.h"

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cstdint>

namespace knapserve {
namespace {

// Splits [0, n) into one contiguous range per torch thread (multiples of 8
// rows, the kernels' block), so each thread streams one long run of weights
// and a call pays for one fork/join only.
template <class F>
void ParallelRows(int64_t n, const F& body) {
  const int64_t threads = std::max(1, at::get_num_threads());
  const int64_t per_thread = (n / threads + 7) / 8 * 8;
  at::parallel_for(0, n, std::max<int64_t>(per_thread, 8), body);
}

#if defined(__x86_64__)

bool CpuHasAvx512Bf16() {
  static const bool has = __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512bf16");
  return has;
}

bool CpuHasAvx512F() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}

#endif  // __x86_64__

bool FastPathApplies(const torch::Tensor& x, const torch::Tensor& w) {
  return x.device().is_cpu() && x.dim() == 2 && w.dim() == 2 && x.size(0) <= kMaxFastRows &&
         x.size(0) > 0 && x.size(1) == w.size(1) && x.scalar_type() == w.scalar_type() &&
         FastLinearSupported(x.scalar_type());
}

}  // namespace

bool FastLinearSupported(torch::ScalarType dtype) {
#if defined(__x86_64__)
  if (dtype == torch::kBFloat16) return CpuHasAvx512Bf16();
  if (dtype == torch::kFloat32) return CpuHasAvx512F();
#endif
  return false;
}

torch::Tensor FastLinearFloatOut(const torch::Tensor& x_in, const torch::Tensor& w_in) {
  TORCH_CHECK(FastPathApplies(x_in, w_in), "FastLinearFloatOut: unsupported shapes or dtype");
  const torch::Tensor x = x_in.contiguous();
  const torch::Tensor w = w_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  torch::Tensor y = torch::empty({m, n}, torch::TensorOptions().dtype(torch::kFloat32));
  float* out = y.data_ptr<float>();
#if defined(__x86_64__)
  if (x.scalar_type() == torch::kBFloat16) {
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    ParallelRows(n, [&](int64_t begin, int64_t end) {
      kernels::DotRowsBf16(xp, wp, out, m, n, k, begin, end);
    });
  } else {
    const float* xp = x.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    ParallelRows(n, [&](int64_t begin, int64_t end) {
      kernels::DotRowsF32(xp, wp, out, m, n, k, begin, end);
    });
  }
#endif
  return y;
}

torch::Tensor Linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias) {
  if (FastPathApplies(x, w)) {
    torch::Tensor y = FastLinearFloatOut(x, w);
    // Add the bias in fp32 before rounding, as a fused addmm would.
    if (bias.defined()) y.add_(bias.to(torch::kFloat32));
    return x.scalar_type() == torch::kFloat32 ? y : y.to(x.scalar_type());
  }
  return bias.defined() ? torch::addmm(bias, x, w.t()) : torch::mm(x, w.t());
}

}  // namespace knapserve
