#include "executor/engine/sampler.h"

#include <c10/core/InferenceMode.h>

#include <cmath>

namespace knapserve {

Sampler::Sampler(const SamplingParams& params) : params_(params) {
  seed_ = params.seed.has_value()
              ? *params.seed
              : (static_cast<uint64_t>(std::random_device{}()) << 32) ^
                    std::random_device{}();
  rng_.seed(seed_);
}

int32_t Argmax(const torch::Tensor& logits) {
  c10::InferenceMode guard;
  return static_cast<int32_t>(logits.argmax().item<int64_t>());
}

torch::Tensor Sampler::Distribution(const torch::Tensor& logits) const {
  c10::InferenceMode guard;
  torch::Tensor l = logits.to(torch::kCPU, torch::kFloat32).reshape({-1});
  const int64_t vocab = l.size(0);
  if (greedy()) {
    torch::Tensor one_hot = torch::zeros({vocab}, torch::kFloat32);
    one_hot[Argmax(l)] = 1.0f;
    return one_hot;
  }
  l = l / params_.temperature;
  if (params_.top_k > 0 && params_.top_k < vocab) {
    // Keep the k largest; ties at the boundary are kept as Hugging Face does.
    const float kth = std::get<0>(l.topk(params_.top_k)).min().item<float>();
    l = l.masked_fill(l < kth, -INFINITY);
  }
  torch::Tensor probs = torch::softmax(l, 0);
  if (params_.top_p < 1.0) {
    auto [sorted, order] = probs.sort(/*dim=*/0, /*descending=*/true);
    // Keep a token when the mass strictly before it is below top_p (so the
    // most likely token is always kept).
    torch::Tensor before = sorted.cumsum(0) - sorted;
    torch::Tensor drop_sorted = before >= params_.top_p;
    torch::Tensor drop =
        torch::zeros({vocab}, torch::kBool).scatter(0, order, drop_sorted);
    probs = probs.masked_fill(drop, 0.0f);
    probs = probs / probs.sum();
  }
  if (params_.min_p > 0.0) {
    // Drop what is less likely than min_p times the most likely token (which
    // is always kept).
    const float threshold =
        static_cast<float>(params_.min_p) * probs.max().item<float>();
    probs = probs.masked_fill(probs < threshold, 0.0f);
    probs = probs / probs.sum();
  }
  return probs.contiguous();
}

double Sampler::Uniform() {
  return std::uniform_real_distribution<double>(0.0, 1.0)(rng_);
}

int32_t Sampler::SampleFrom(const torch::Tensor& probs) {
  c10::InferenceMode guard;
  torch::Tensor p = probs.to(torch::kCPU, torch::kFloat32).contiguous();
  const float* data = p.data_ptr<float>();
  const int64_t n = p.numel();
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) total += data[i];
  const double target = Uniform() * total;
  double cumulative = 0.0;
  int32_t last_nonzero = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (data[i] <= 0.0f) continue;
    cumulative += data[i];
    last_nonzero = static_cast<int32_t>(i);
    if (cumulative > target) return last_nonzero;
  }
  return last_nonzero;  // rounding at the very top of the range
}

int32_t Sampler::Sample(const torch::Tensor& logits) {
  if (greedy()) return Argmax(logits);
  return SampleFrom(Distribution(logits));
}

}  // namespace knapserve
