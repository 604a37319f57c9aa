// Sampler: turns a position's processed logits (executor/engine/
// logits_processors.h, steps 1-5) into the next token, with the sampling
// semantics users expect from Hugging Face / vLLM: temperature, then top-k,
// then top-p (nucleus), then min-p, then a draw (steps 6-9 of the pipeline
// logits_processors.h documents). A temperature below kGreedyTemperature
// (0 included) means greedy: the argmax.
//
// Two ways to draw, chosen by SamplingParams::acceptance (coupled() says
// which):
//   - sequential (DraftAcceptance::kRejection): a 64-bit Mersenne Twister
//     seeded from SamplingParams::seed; every draw consumes one uniform
//     number. Speculative rejection sampling (executor/engine/
//     speculation_step.h) draws its acceptance tests and residuals from the
//     same stream, so with speculation the text depends on how many numbers
//     each step drew.
//   - coupled (DraftAcceptance::kCoupled, the default for seeded requests):
//     the token at sequence position t is a function of (seed, t) and the
//     distribution alone. Noise u_i for token i is the Philox 4x32-10
//     counter-based generator's (ATen's at::Philox4_32) i-th number of
//     subsequence t under key `seed`; the token is argmin_i E_i / p_i with
//     E_i = -log(u_i), which is an exact draw from p (the exponential race,
//     Gumbel-max's equivalent: -log E_i is Gumbel noise). A draft drawn from
//     q with the same noise equals the target's token exactly when the
//     coupling agrees, so verification accepts it when they are equal, as
//     greedy does, and every drafting mode and batch gives the same text as
//     plain decoding.
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
  // Whether sampled tokens are drawn with position-keyed noise (DrawAt)
  // rather than the sequential RNG; false when greedy.
  bool coupled() const { return coupled_; }
  // The seed actually used (params.seed or the random one drawn).
  uint64_t seed() const { return seed_; }

  // float32 [vocab] probabilities on the CPU after temperature, top-k, top-p
  // and min-p; filtered tokens are exactly 0. For greedy params it is one-hot
  // on the argmax. `logits` is [vocab] on any device.
  torch::Tensor Distribution(const torch::Tensor& logits) const;

  // Next token for sequence position `position` from `logits` ([vocab]):
  // the argmax when greedy, else a draw from Distribution(logits), coupled
  // (DrawAt) or sequential (SampleFrom).
  int32_t Sample(const torch::Tensor& logits, int64_t position);
  // A sequential draw from a probability vector (float32 [vocab], CPU, sums
  // to ~1).
  int32_t SampleFrom(const torch::Tensor& probs);
  // The coupled draw for sequence position `position` from `probs` (float32
  // [vocab], CPU, sums to ~1): argmin over p_i > 0 of E_i / p_i with the
  // noise of (seed, position). Const: it keeps no state.
  int32_t DrawAt(const torch::Tensor& probs, int64_t position) const;
  // One uniform number in [0, 1) from the sequential RNG.
  double Uniform();

 private:
  SamplingParams params_;
  uint64_t seed_ = 0;
  bool coupled_ = false;
  std::mt19937_64 rng_;
};

// Whether `params` draw sampled tokens with position-keyed noise
// (DraftAcceptance::kCoupled, or kAuto with a seed); false when greedy. Then,
// as under greedy, the output ids are a function of the request alone, the
// same in every drafting mode and batch.
bool CoupledDraws(const SamplingParams& params);

// The seed of choice `index` of a request with n > 1 choices: `seed` itself
// for choice 0 (so n = 1 keeps its text), a SplitMix64 mix of (seed,
// index) for the others, so every choice has a seed stream of its own.
uint64_t ChoiceSeed(uint64_t seed, int index);

// Index of the largest logit ([vocab] on any device); ties go to the lowest
// index.
int32_t Argmax(const torch::Tensor& logits);

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_ENGINE_SAMPLER_H_
