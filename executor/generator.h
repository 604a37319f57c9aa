// Generation of one sequence: validation, prefill, the decode loop, stop
// conditions (EOS ids, stop token ids, stop strings, max_new_tokens, the
// context limit) and streaming of finalized text.
//
// Generate() decodes autoregressively (SpeculationMode::kOff: one full
// forward per token) or with self-speculative decoding under a fixed layer
// mask (kStatic, see executor/speculative_decoder.h); both give the same
// greedy output. Several tokens committed in one step are checked for stop
// conditions one by one, so a step never emits past EOS or a stop. The
// stop-string logic lives in TextStream so every decoding mode shares it: text
// that could still turn out to be the beginning of a stop string is held back
// until it is known not to be, and text after a stop string is never emitted.
//
// Thread safety: Generate() touches only its arguments; several threads may
// generate concurrently with the same model and tokenizer.
#ifndef KNAPSERVE_EXECUTOR_GENERATOR_H_
#define KNAPSERVE_EXECUTOR_GENERATOR_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/model/llama.h"
#include "common/tokenizer.h"
#include "executor/reference_states.h"
#include "executor/sampler.h"
#include "executor/speculative_decoder.h"

namespace knapserve {

enum class SpeculationMode { kOff, kStatic };
// "off" / "static".
std::string SpeculationModeName(SpeculationMode mode);
absl::StatusOr<SpeculationMode> ParseSpeculationMode(const std::string& name);

struct SpeculationConfig {
  SpeculationMode mode = SpeculationMode::kOff;
  std::string skip;             // layer mask text ("a3,m3,m7") for kStatic
  int max_draft = 5;            // gamma: draft tokens per step, >= 1
  double exit_threshold = 0.7;  // stop drafting when top-1 prob < this; [0, 1]
  int64_t plan_interval = 64;   // T: steps between plan boundaries, >= 1
  int64_t reference_steps = 5;  // m: verification steps captured after each, >= 1
};

struct GenerationRequest {
  std::vector<int32_t> prompt_ids;  // must be non-empty, shorter than the context
  int64_t max_new_tokens = 128;     // >= 1
  SamplingParams sampling;
  std::vector<std::string> stop_strings;   // output ends before the first match
  std::vector<int32_t> stop_token_ids;     // output ends after such a token
  bool ignore_eos = false;                 // keep going past the model's EOS ids
  int64_t prefill_chunk = 512;             // positions per prefill forward
  SpeculationConfig speculation;
};

enum class FinishReason { kEos, kLength, kStopSequence, kAborted };
// "eos", "length", "stop_sequence", "aborted".
std::string FinishReasonName(FinishReason reason);

struct GenerationStats {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  double prefill_seconds = 0;  // prompt forward + first token
  double decode_seconds = 0;   // everything after the first token
  double total_seconds = 0;
  double draft_seconds = 0;    // inside decode_seconds: masked draft forwards
  double verify_seconds = 0;   // inside decode_seconds: full forwards (all of them when off)
  double waiting_seconds = 0;  // inside decode_seconds: waiting on a planner
  int64_t steps = 0;           // decode steps (full forwards after prefill)
  // prompt_tokens / prefill_seconds and (completion_tokens - 1) / decode_seconds.
  double prefill_tokens_per_second() const;
  double decode_tokens_per_second() const;
};

struct GenerationResult {
  std::vector<int32_t> output_ids;  // generated ids, including a final EOS/stop id
  std::string text;                 // decoded output, special tokens skipped, cut at a stop string
  FinishReason finish_reason = FinishReason::kLength;
  std::string matched_stop;         // the stop string that ended it, if any
  uint64_t seed = 0;                // the sampler seed used
  std::string mask;                 // the layer mask used ("" when off)
  GenerationStats stats;
  SpeculationStats speculation;
};

// Receives each step's newly generated ids and the text they finalized (which
// may be empty, e.g. half of a UTF-8 character). Returning false aborts the
// generation (FinishReason::kAborted).
using StreamCallback = std::function<bool(absl::Span<const int32_t> ids, std::string_view text)>;
// Receives each reference-state snapshot as it completes (the planner's input).
using ReferenceCallback = std::function<void(ReferenceStates&& states)>;

// Checks `request` against the model: InvalidArgument naming the field.
absl::Status ValidateGenerationRequest(const GenerationRequest& request, const LlamaModel& model);

// Incremental detokenization plus stop strings for one sequence.
class TextStream {
 public:
  TextStream(const Tokenizer& tokenizer, std::vector<int32_t> prompt_ids,
             std::vector<std::string> stop_strings);
  // Adds one generated id; returns the text that is now safe to emit.
  // Sets stopped() when a stop string completed (its text is not emitted).
  absl::StatusOr<std::string> Push(int32_t id);
  // Remaining held-back text at the end of generation (empty after a stop).
  std::string Finish();
  bool stopped() const { return matched_stop_.has_value(); }
  const std::optional<std::string>& matched_stop() const { return matched_stop_; }
  // All text emitted so far.
  const std::string& emitted() const { return emitted_text_; }

 private:
  std::string TakeSafeText(bool final);

  IncrementalDecoder decoder_;
  std::vector<std::string> stop_strings_;
  std::string text_;          // all finalized text, emitted or held
  size_t emitted_ = 0;        // bytes of text_ already emitted
  std::string emitted_text_;
  std::optional<std::string> matched_stop_;
};

// Generation (autoregressive or speculative). Errors: invalid request (InvalidArgument), a
// token the tokenizer cannot decode (OutOfRange).
absl::StatusOr<GenerationResult> Generate(const LlamaModel& model, const Tokenizer& tokenizer,
                                          const GenerationRequest& request,
                                          const StreamCallback& on_tokens = nullptr,
                                          const ReferenceCallback& on_reference = nullptr);

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_GENERATOR_H_
