// The logits processors: every sampling control of a request as ONE
// pipeline, from a position's raw logits (the full model's, or a draft's) to
// the distribution the token there is chosen from. Every front door fills the
// same SamplingParams (the gRPC GenerateRequest through
// executor/api/generation_codec.h, the OpenAI HTTP API through
// executor/api/openai_api.h, `knapserve generate` flags through
// tools/cli_flags.h), and the one decode loop (executor/engine/sequence.h)
// runs it for every token of every request, in every speculation mode.
//
// The order is fixed, vLLM's:
//   1. logit_bias          logits[id] += bias, for each (id, bias) given.
//   2. bad_words           for each banned sequence [w_0, ..., w_k]:
//                          logits[w_k] = -inf when the generated tokens so
//                          far end with w_0 ... w_{k-1} (a one-id sequence
//                          is banned at every position). Only generated
//                          tokens count, not the prompt (vLLM's bad_words,
//                          given as token ids).
//   3. min_tokens          logits[id] = -inf for the end ids (the model's
//                          EOS ids unless ignore_eos, and stop_token_ids)
//                          while fewer than min_tokens tokens were
//                          generated. Stop strings are not held back.
//   4. repetition_penalty  r, for every id in the prompt or the generated
//                          tokens (vLLM / Hugging Face): logit > 0 becomes
//                          logit / r, otherwise logit * r. 1 = off.
//   5. frequency_penalty f and presence_penalty p (OpenAI), over the
//                          generated tokens only: logit -= f * count + p for
//                          every id generated count > 0 times.
//   6. temperature T       logits / T. T < kGreedyTemperature (1e-5, vLLM's
//                          threshold; 1e-39 would overflow logits / T to
//                          inf and NaN) is greedy: the token is the argmax
//                          of the logits after steps 1-5 (ties to the lowest
//                          id), and 7-9 do not apply.
//   7. top_k, 8. top_p, 9. min_p (vLLM): after top_p, tokens whose
//                          probability is below min_p times the most likely
//                          token's are dropped; 0 = off.
// Steps 1-5 depend on the history and are LogitsProcessors below; steps 6-9
// depend on the logits alone and are Sampler::Distribution
// (executor/engine/sampler.h). When the bans of steps 2 and 3 would leave no
// token at a position, that position keeps no ban (steps 1, 4 and 5 still
// apply), so a distribution always exists.
//
// Arithmetic: steps 1-5 run in float32 on each touched logit, in this order:
// l += float(bias); l = l > 0 ? l / float(r) : l * float(r);
// l -= float(f * count + p) (the product and sum in double). An independent
// reimplementation (tests/testing/check_logits_processors.py) reproduces them
// bit for bit from the raw logits `knapserve generate --dump-logits` writes.
//
// Speculation stays lossless: the history of a position is the committed
// output before it plus, under speculation, the draft tokens before it in
// the step. A draft token is chosen from the draft's own logits processed
// with exactly the history its target position will have (greedy: their
// argmax; sampling: a draw from their distribution q, which the rejection
// sampler gets), and each verified row j (the position after drafts 0..j-1)
// is processed with the committed output plus drafts 0..j-1. Greedy
// acceptance then compares argmaxes of processed logits, and rejection
// sampling (executor/engine/speculation_step.h) compares the processed
// target distribution p with q, so greedy output equals plain greedy output
// and sampling keeps exactly the processed distribution.
//
// Ownership: LogitsProcessors copies what it needs from the params and the
// prompt. Thread safety: one per sequence, used by its step thread only;
// Apply and ApplyRows do not modify it.
#ifndef KNAPSERVE_EXECUTOR_ENGINE_LOGITS_PROCESSORS_H_
#define KNAPSERVE_EXECUTOR_ENGINE_LOGITS_PROCESSORS_H_

#include <torch/types.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace knapserve {

// Temperatures below this are greedy decoding (vLLM's _SAMPLING_EPS).
inline constexpr double kGreedyTemperature = 1e-5;
// How a sampled draft token is judged against the full model (executor/
// engine/speculation_step.h). Both keep every output token exactly
// distributed as plain sampling would draw it.
enum class DraftAcceptance {
  // kCoupled when the request has a seed, else kRejection: rejection
  // sampling accepts more drafts (it is the maximal coupling), coupling
  // makes a seed mean the same text in every mode and batch.
  kAuto,
  // Speculative rejection sampling: accept draft d with min(1, p(d)/q(d)),
  // else resample from norm(max(0, p - q)). Draws from the sampler's
  // sequential RNG, so the text depends on how many draws each step made.
  kRejection,
  // Gumbel-max coupling: the token at sequence position t is
  // argmin_i E_i / p_i with E_i = -log(u_i) and u_i counter-based noise
  // f(seed, t, i); the draft is chosen the same way from q and accepted
  // when it equals the target's token. Plain decoding uses the same rule, so
  // the text is a function of (seed, prompt) alone.
  kCoupled,
};

// "auto", "rejection", "coupled"; and back (InvalidArgument naming the
// choices for anything else).
const char* DraftAcceptanceName(DraftAcceptance acceptance);
absl::StatusOr<DraftAcceptance> ParseDraftAcceptance(std::string_view name);

// Limits of bad_words: sequences per request, ids per sequence.
inline constexpr int64_t kMaxBadWords = 1024;
inline constexpr int64_t kMaxBadWordTokens = 64;

// A request's sampling controls. The ranges are ValidateSamplingParams'; the
// defaults switch every control off.
struct SamplingParams {
  // 6. 0, or anything below kGreedyTemperature, = greedy; >= 0, finite.
  double temperature = 0.0;
  int64_t top_k = 0;   // 7. 0 = no top-k filter; >= 0
  double top_p = 1.0;  // 8. 1 = no nucleus filter; in (0, 1]
  double min_p = 0.0;  // 9. 0 = off; in [0, 1]
  // 4. > 0 and finite; 1 = off.
  double repetition_penalty = 1.0;
  double presence_penalty = 0.0;   // 5. in [-2, 2]; 0 = off
  double frequency_penalty = 0.0;  // 5. in [-2, 2]; 0 = off
  // 1. token id (in [0, vocab)) -> bias in [-100, 100].
  std::map<int32_t, double> logit_bias;
  // 3. >= 0 (and <= max_new_tokens, checked with the request).
  int64_t min_tokens = 0;
  // 2. at most kMaxBadWords sequences of 1 to kMaxBadWordTokens ids, each
  // in [0, vocab).
  std::vector<std::vector<int32_t>> bad_words;
  // Seed for the sampler's RNG; unset draws one from std::random_device.
  // With a seed (and DraftAcceptance::kAuto) the output is the same alone,
  // in any batch and in every drafting mode.
  std::optional<uint64_t> seed;
  // Engine setting, not a client field: how sampled drafts are accepted.
  DraftAcceptance acceptance = DraftAcceptance::kAuto;

  // Whether sampling is greedy (temperature < kGreedyTemperature).
  bool greedy() const { return temperature < kGreedyTemperature; }
};

// InvalidArgument naming the field ("presence_penalty: must be in [-2, 2],
// got 3") when a value is out of range; token ids are checked against
// [0, vocab_size).
absl::Status ValidateSamplingParams(const SamplingParams& params,
                                    int64_t vocab_size);

// Steps 1-5 for one sequence: its history (prompt and generated tokens) and
// the processors' settings.
class LogitsProcessors {
 public:
  // `end_ids`: what min_tokens holds back (the EOS ids unless ignore_eos,
  // and the stop token ids). `params` must be valid.
  LogitsProcessors(const SamplingParams& params,
                   absl::Span<const int32_t> prompt_ids,
                   absl::Span<const int32_t> end_ids);

  // Whether any of steps 1-5 is on. When not, Apply and ApplyRows return
  // their input tensor itself, so such a request decodes exactly as before
  // the processors existed.
  bool active() const { return active_; }
  // Appends committed output tokens to the history.
  void Commit(absl::Span<const int32_t> ids);
  int64_t generated() const { return static_cast<int64_t>(generated_.size()); }

  // The logits ([vocab], any device and dtype) of the position after the
  // history plus `pending` (draft tokens of this step, not committed yet),
  // processed: float32 [vocab] on the CPU, a new tensor (the input is not
  // modified).
  torch::Tensor Apply(const torch::Tensor& logits,
                      absl::Span<const int32_t> pending) const;
  // A verification's logits ([m+1, vocab]): row j processed with pending =
  // drafts[0, j). float32 [m+1, vocab] on the CPU, a new tensor.
  torch::Tensor ApplyRows(const torch::Tensor& logits,
                          absl::Span<const int32_t> drafts) const;
  // The same on one float32 row in place (`logits` has the vocabulary's
  // size).
  void ApplyInPlace(absl::Span<float> logits,
                    absl::Span<const int32_t> pending) const;

 private:
  // logits[id] = -inf for every id the bad words and min_tokens ban after
  // history + pending, unless that bans every id.
  void Ban(absl::Span<float> logits, absl::Span<const int32_t> pending) const;
  void Penalize(absl::Span<float> logits,
                absl::Span<const int32_t> pending) const;

  std::vector<std::pair<int32_t, float>> bias_;
  std::vector<std::vector<int32_t>> bad_words_;
  int64_t min_tokens_ = 0;
  std::vector<int32_t> end_ids_;
  float repetition_ = 1.0f;
  double presence_ = 0.0;
  double frequency_ = 0.0;
  bool penalties_ = false;  // any of step 4 and 5 on
  bool active_ = false;
  std::vector<int32_t> prompt_ids_;               // distinct, in prompt order
  absl::flat_hash_set<int32_t> prompt_set_;       // the same, for lookups
  std::vector<int32_t> generated_;                // committed output
  absl::flat_hash_map<int32_t, int64_t> counts_;  // id -> times in generated_
};

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_ENGINE_LOGITS_PROCESSORS_H_
