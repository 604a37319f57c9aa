#include "common/model/linear.h"

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cstdint>

#include "common/model/linear_kernels.h"
#include "common/model/parallel_for.h"

namespace knapserve {
namespace {

// Rows per work item when M is large (prefill, the planner's batched DP): a
// multiple of the kernel's 6-row tile. Up to this many rows, threads split
// the panels only and each runs every row, so a decode step and a
// verification pass both read each weight byte once.
constexpr int64_t kRowChunk = 96;

}  // namespace

bool FastLinearSupported(torch::ScalarType dtype) {
  return dtype == torch::kBFloat16 || dtype == torch::kFloat32;
}

LinearWeight::LinearWeight(const torch::Tensor& w_in) {
  c10::InferenceMode guard;
  TORCH_CHECK(w_in.dim() == 2 && w_in.size(0) > 0 && w_in.size(1) > 0,
              "LinearWeight: want a non-empty [N, K] matrix");
  n_ = w_in.size(0);
  k_ = w_in.size(1);
  dtype_ = w_in.scalar_type();
  if (!w_in.device().is_cpu() || !FastLinearSupported(dtype_)) {
    dense_ = w_in.contiguous();
    return;
  }
  const torch::Tensor w = w_in.contiguous();
  const int64_t panels = kernels::NumPanels(n_);
  if (dtype_ == torch::kBFloat16) {
    packed_ =
        torch::empty({panels * kernels::PanelElementsBf16(k_)}, w.options());
    kernels::PackPanelsBf16(
        reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), n_, k_,
        reinterpret_cast<uint16_t*>(packed_.data_ptr<at::BFloat16>()));
  } else {
    packed_ =
        torch::empty({panels * kernels::PanelElementsF32(k_)}, w.options());
    kernels::PackPanelsF32(w.data_ptr<float>(), n_, k_,
                           packed_.data_ptr<float>());
  }
}

torch::Tensor LinearWeight::ToDense() const {
  if (!packed()) return dense_;
  c10::InferenceMode guard;
  // Row j of the result is x = e_j through the kernel: exact for one-hot x.
  const torch::Tensor eye =
      torch::eye(k_, torch::TensorOptions().dtype(torch::kFloat32)).to(dtype_);
  return LinearFloatOut(eye, *this).t().contiguous().to(dtype_);
}

int64_t LinearWeight::bytes() const {
  return n_ * k_ * static_cast<int64_t>(c10::elementSize(dtype_));
}

torch::Tensor LinearFloatOut(const torch::Tensor& x_in, const LinearWeight& w) {
  TORCH_CHECK(w.packed(), "LinearFloatOut: weight is not packed");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == w.in_features() &&
                  x_in.scalar_type() == w.dtype() && x_in.device().is_cpu(),
              "LinearFloatOut: x must be a CPU [M, ", w.in_features(),
              "] tensor of the weight's dtype");
  const torch::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = w.in_features(), n = w.out_features();
  torch::Tensor y =
      torch::empty({m, n}, torch::TensorOptions().dtype(torch::kFloat32));
  if (m == 0) return y;
  float* out = y.data_ptr<float>();
  const int64_t panels = kernels::NumPanels(n);
  const int64_t row_chunks =
      m <= kRowChunk ? 1 : (m + kRowChunk - 1) / kRowChunk;
  const int64_t rows_per_chunk = row_chunks == 1 ? m : kRowChunk;
  // Items are (row chunk, panel), panel-minor; each thread takes one
  // contiguous run of items (one fork/join per call).
  const int64_t items = row_chunks * panels;
  int64_t threads = std::max(1, at::get_num_threads());
  if (const int pass = PassThreads(m); pass > 0)
    threads = std::min<int64_t>(threads, pass);
  const int64_t grain = std::max<int64_t>(1, (items + threads - 1) / threads);
  auto run = [&](auto kernel, const auto* xp, const auto* wp) {
    ParallelFor(
        0, items, grain,
        [&](int64_t begin, int64_t end) {
          for (int64_t item = begin; item < end;) {
            const int64_t chunk = item / panels;
            const int64_t p0 = item % panels;
            const int64_t p1 = std::min(panels, p0 + (end - item));
            const int64_t r0 = chunk * rows_per_chunk;
            kernel(xp, wp, out, n, k, r0, std::min(m, r0 + rows_per_chunk), p0,
                   p1);
            item += p1 - p0;
          }
        },
        static_cast<int>(threads));
  };
  if (w.dtype() == torch::kBFloat16) {
    run(kernels::PanelLinearBf16,
        reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
        reinterpret_cast<const uint16_t*>(w.panels().data_ptr<at::BFloat16>()));
  } else {
    run(kernels::PanelLinearF32, x.data_ptr<float>(),
        w.panels().data_ptr<float>());
  }
  return y;
}

torch::Tensor Linear(const torch::Tensor& x, const LinearWeight& w,
                     const torch::Tensor& bias) {
  if (w.packed()) {
    torch::Tensor y = LinearFloatOut(x, w);
    if (bias.defined()) y.add_(bias.to(torch::kFloat32));
    return x.scalar_type() == torch::kFloat32 ? y : y.to(x.scalar_type());
  }
  const torch::Tensor& dense = w.dense();
  return bias.defined() ? torch::addmm(bias, x, dense.t())
                        : torch::mm(x, dense.t());
}

}  // namespace knapserve
