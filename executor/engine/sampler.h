// Sampler: turns a position's processed logits (executor/engine/
// logits_processors.h, steps 1-5) into the next token, with the sampling
// semantics users expect from Hugging Face / vLLM: temperature, then top-k,
// then top-p (nucleus), then min-p, then a draw (steps 6-9 of the pipeline
// logits_processors.h documents). A temperature below kGreedyTemperature
// (0 included) means greedy: the argmax.
//
// Reproducibility: the sampler owns a 64-bit Mersenne Twister seeded from
// SamplingParams::seed, and every draw consumes exactly one uniform number, so
// the same seed, model and prompt give the same output. Speculative
// acceptance (executor/engine/speculation_step.h) uses Distribution() and
// Uniform() for rejection sampling with the same semantics.
//
// Not thread-safe (it owns an RNG); one per sequence.
#ifndef KNAPSERVE_EXECUTOR_ENGINE_SAMPLER_H_
#define KNAPSERVE_EXECUTOR_ENGINE_SAMPLER_H_

#include <torch/types.h>

#include <cstdint>
#include <random>

#include "executor/engine/logits_processors.h"

namespace knapserve {

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);

  bool greedy() const { return params_.greedy(); }
  // The seed actually used (params.seed or the random one drawn).
  uint64_t seed() const { return seed_; }

  // float32 [vocab] probabilities on the CPU after temperature, top-k, top-p
  // and min-p; filtered tokens are exactly 0. For greedy params it is one-hot
  // on the argmax. `logits` is [vocab] on any device.
  torch::Tensor Distribution(const torch::Tensor& logits) const;

  // Next token from `logits` ([vocab]): the argmax when greedy, else a draw
  // from Distribution(logits).
  int32_t Sample(const torch::Tensor& logits);
  // A draw from a probability vector (float32 [vocab], CPU, sums to ~1).
  int32_t SampleFrom(const torch::Tensor& probs);
  // One uniform number in [0, 1) from the sampler's RNG.
  double Uniform();

 private:
  SamplingParams params_;
  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
};

// Index of the largest logit ([vocab] on any device); ties go to the lowest
// index.
int32_t Argmax(const torch::Tensor& logits);

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_ENGINE_SAMPLER_H_
