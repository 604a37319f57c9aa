#include "executor/engine/sampler.h"

#include <ATen/core/PhiloxRNGEngine.h>
#include <c10/core/InferenceMode.h>

#include <cmath>
#include <limits>

namespace knapserve {

Sampler::Sampler(const SamplingParams& params) : params_(params) {
  seed_ = params.seed.has_value()
              ? *params.seed
              : (static_cast<uint64_t>(std::random_device{}()) << 32) ^
                    std::random_device{}();
  rng_.seed(seed_);
  coupled_ = CoupledDraws(params);
}

bool CoupledDraws(const SamplingParams& params) {
  return !params.greedy() && (params.acceptance == DraftAcceptance::kCoupled ||
                              (params.acceptance == DraftAcceptance::kAuto &&
                               params.seed.has_value()));
}

uint64_t ChoiceSeed(uint64_t seed, int index) {
  if (index == 0) return seed;
  // SplitMix64's finalizer over seed + index * its increment.
  uint64_t z = seed + static_cast<uint64_t>(index) * 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
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

int32_t Sampler::DrawAt(const torch::Tensor& probs, int64_t position) const {
  c10::InferenceMode guard;
  torch::Tensor p = probs.to(torch::kCPU, torch::kFloat32).contiguous();
  const float* data = p.data_ptr<float>();
  const int64_t n = p.numel();
  // Subsequence `position` of the key `seed`: the i-th number is token i's.
  at::Philox4_32 noise(seed_, static_cast<uint64_t>(position), 0);
  constexpr double kScale = 1.0 / 4294967296.0;  // 2^-32
  double best = std::numeric_limits<double>::infinity();
  int32_t choice = -1;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = noise();
    if (!(data[i] > 0.0f)) continue;
    // u in (0, 1): never 0, so E is finite.
    const double u = (static_cast<double>(bits) + 0.5) * kScale;
    const double pi = data[i];
    // -log(u) >= 1 - u: most tokens lose without computing the logarithm.
    if ((1.0 - u) / pi >= best) continue;
    const double key = -std::log(u) / pi;
    if (key < best) {
      best = key;
      choice = static_cast<int32_t>(i);
    }
  }
  // An all-zero vector cannot come from Distribution(); keep the argmax
  // then rather than an invalid id.
  return choice >= 0 ? choice : Argmax(p);
}

int32_t Sampler::Sample(const torch::Tensor& logits, int64_t position) {
  if (greedy()) return Argmax(logits);
  if (coupled()) return DrawAt(Distribution(logits), position);
  return SampleFrom(Distribution(logits));
}

}  // namespace knapserve
