#include "executor/engine/generator.h"

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/base/clock.h"
#include "common/base/status.h"
#include "common/model/decode_attention.h"
#include "common/model/exception_status.h"
#include "common/model/layer_mask.h"
#include "executor/engine/kv_cache.h"
#include "executor/engine/sequence.h"

namespace knapserve {

std::string FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kEos:
      return "eos";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kStopSequence:
      return "stop_sequence";
    case FinishReason::kAborted:
      return "aborted";
  }
  return "unknown";
}

double GenerationStats::prefill_tokens_per_second() const {
  return prefill_seconds > 0
             ? static_cast<double>(prompt_tokens) / prefill_seconds
             : 0.0;
}

double GenerationStats::decode_tokens_per_second() const {
  return decode_seconds > 0 && completion_tokens > 1
             ? static_cast<double>(completion_tokens - 1) / decode_seconds
             : 0.0;
}

absl::Status ValidateSpecBoundConfig(const SpecBoundConfig& config,
                                     const LlamaModel& model) {
  if (!(config.lambda >= 0.0 && config.lambda <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "specbound.lambda: must be in [0, 1], got ", config.lambda));
  }
  if (!(config.t0 >= 1.0 && config.t0 <= 1e6)) {
    return absl::InvalidArgumentError(
        absl::StrCat("specbound.t0: must be in [1, 1e6], got ", config.t0));
  }
  if (config.depth_bound < 0 || config.depth_bound > model.num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "specbound.depth_bound: must be in [0, ", model.num_layers(),
        "] (0 = all layers), got ", config.depth_bound));
  }
  if (config.check_every < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "specbound.check_every: must be >= 1, got ", config.check_every));
  }
  if (config.trained_heads && config.heads == nullptr) {
    return absl::FailedPreconditionError(
        "specbound.trained_heads: no trained exit heads are loaded (train "
        "them with `knapserve train-exit-heads`, load them with "
        "--exit-heads)");
  }
  if (config.trained_heads && !config.heads->trained()) {
    return absl::InvalidArgumentError(
        "specbound.heads: trained_heads is set but the heads are the "
        "training-free ones");
  }
  return absl::OkStatus();
}

absl::Status ValidateGenerationRequest(const GenerationRequest& request,
                                       const LlamaModel& model) {
  const int64_t n = static_cast<int64_t>(request.prompt_ids.size());
  if (n == 0)
    return absl::InvalidArgumentError(
        "prompt: empty (it needs at least one token)");
  if (n >= model.max_context()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt: ", n, " tokens do not fit the model's context of ",
        model.max_context(), " tokens"));
  }
  const int64_t vocab = model.config().vocab_size;
  for (int32_t id : request.prompt_ids) {
    if (id < 0 || id >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt: token id ", id, " outside the vocabulary [0, ", vocab, ")"));
    }
  }
  if (request.max_new_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_new_tokens: must be >= 1, got ", request.max_new_tokens));
  }
  if (request.prefill_chunk < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefill_chunk: must be >= 1, got ", request.prefill_chunk));
  }
  for (const std::string& stop : request.stop_strings) {
    if (stop.empty())
      return absl::InvalidArgumentError("stop: empty stop string");
  }
  const SpeculationConfig& spec = request.speculation;
  if (Drafts(spec.mode)) {
    if (spec.max_draft < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "max_draft: must be >= 1 with speculation on, got ", spec.max_draft));
    }
    // A verification pass is max_draft + 1 rows; past kMaxDecodeAttentionRows
    // it would leave the batch-invariant few-row path, and greedy output
    // could then differ from plain decoding at a near-tie.
    if (spec.max_draft > kMaxDecodeAttentionRows - 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "max_draft: at most ", kMaxDecodeAttentionRows - 1,
          " (verification passes must stay on the batch-invariant path), got ",
          spec.max_draft));
    }
    if (!(spec.exit_threshold >= 0.0 && spec.exit_threshold <= 1.0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "exit_threshold: must be in [0, 1], got ", spec.exit_threshold));
    }
    if (spec.plan_interval < 1 || spec.reference_steps < 1) {
      return absl::InvalidArgumentError(
          "plan_interval and reference_steps: must be >= 1");
    }
    if (spec.reference_steps > spec.plan_interval) {
      return absl::InvalidArgumentError(
          absl::StrCat("reference_steps: ", spec.reference_steps,
                       " exceeds plan_interval ", spec.plan_interval,
                       " (the steps captured after a plan boundary must fit "
                       "before the next)"));
    }
    if (spec.plan_bucket_tokens < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "plan_bucket_tokens: must be >= 1, got ", spec.plan_bucket_tokens));
    }
    if (!(spec.drift_tolerance > 0.0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "drift_tolerance: must be > 0, got ", spec.drift_tolerance));
    }
    if (spec.drift_min_tokens < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "drift_min_tokens: must be >= 1, got ", spec.drift_min_tokens));
    }
    if (spec.sequence_prior_tokens < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence_prior_tokens: must be >= 0 (0 = off), got ",
                       spec.sequence_prior_tokens));
    }
    if (spec.plain_recheck_steps < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("plain_recheck_steps: must be >= 0 (0 = never), got ",
                       spec.plain_recheck_steps));
    }
    if (!(spec.planner_budget >= 0.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("planner_budget: must be >= 0 (0 = no limit), got ",
                       spec.planner_budget));
    }
    if (!(spec.guard_margin >= 0.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("guard_margin: must be >= 0, got ", spec.guard_margin));
    }
    if (!(spec.guard_explore_share >= 0.0 && spec.guard_explore_share < 1.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("guard_explore_share: must be in [0, 1), got ",
                       spec.guard_explore_share));
    }
    if (!(spec.guard_confirm_confidence >= 0.0 &&
          std::isfinite(spec.guard_confirm_confidence))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "guard_confirm_confidence: must be finite and >= 0, got ",
          spec.guard_confirm_confidence));
    }
    if (spec.guard_reprobe_steps < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "guard_reprobe_steps: must be >= 1, got ", spec.guard_reprobe_steps));
    }
    if (spec.guard_min_steps < 1 || spec.guard_probe_steps < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "guard_min_steps and guard_probe_steps: must be >= 1, got ",
          spec.guard_min_steps, " and ", spec.guard_probe_steps));
    }
    if (DraftsByEarlyExit(spec.mode)) {
      RETURN_IF_ERROR(ValidateSpecBoundConfig(spec.specbound, model));
    }
    RETURN_IF_ERROR(LayerMask::Parse(spec.skip, model.num_layers()).status());
    if (spec.clasp_layers < 0 || spec.clasp_layers >= model.num_layers()) {
      return absl::InvalidArgumentError(
          absl::StrCat("clasp_layers: must be in [0, ", model.num_layers() - 1,
                       "], got ", spec.clasp_layers));
    }
  }
  RETURN_IF_ERROR(ValidateSamplingParams(request.sampling, vocab));
  if (request.n < 1 || request.n > kMaxChoices) {
    return absl::InvalidArgumentError(
        absl::StrCat("n: must be in [1, ", kMaxChoices, "], got ", request.n));
  }
  if (request.best_of != 0 &&
      (request.best_of < request.n || request.best_of > kMaxChoices)) {
    return absl::InvalidArgumentError(
        absl::StrCat("best_of: must be in [n = ", request.n, ", ", kMaxChoices,
                     "], got ", request.best_of));
  }
  if (request.top_logprobs < 0 || request.top_logprobs > kMaxTopLogprobs) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_logprobs: must be in [0, ", kMaxTopLogprobs,
                     "], got ", request.top_logprobs));
  }
  if (request.top_logprobs > 0 && !request.logprobs) {
    return absl::InvalidArgumentError(
        "top_logprobs: needs logprobs (the chosen tokens' log-probabilities)");
  }
  if (request.sampling.min_tokens > request.max_new_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "min_tokens: must be <= max_new_tokens (", request.max_new_tokens,
        "), got ", request.sampling.min_tokens));
  }
  return absl::OkStatus();
}

TextStream::TextStream(const Tokenizer& tokenizer,
                       std::vector<int32_t> prompt_ids,
                       std::vector<std::string> stop_strings)
    : decoder_(tokenizer, /*skip_special_tokens=*/true, std::move(prompt_ids)),
      stop_strings_(std::move(stop_strings)) {}

std::string TextStream::TakeSafeText(bool final) {
  if (matched_stop_.has_value()) return "";
  // Look for a completed stop string. None can start in already-emitted text:
  // anything that could begin one was held back.
  size_t best = std::string::npos;
  for (const std::string& stop : stop_strings_) {
    size_t at = text_.find(stop, emitted_);
    if (at != std::string::npos && (best == std::string::npos || at < best)) {
      best = at;
      matched_stop_ = stop;
    }
  }
  size_t safe_end = text_.size();
  if (best != std::string::npos) {
    safe_end = best;
  } else if (!final) {
    // Hold back the longest suffix that is a proper prefix of a stop string.
    for (const std::string& stop : stop_strings_) {
      const size_t max_len = std::min(stop.size() - 1, text_.size() - emitted_);
      for (size_t len = max_len; len > 0; --len) {
        if (text_.compare(text_.size() - len, len, stop, 0, len) == 0) {
          safe_end = std::min(safe_end, text_.size() - len);
          break;
        }
      }
    }
  }
  std::string out = text_.substr(emitted_, safe_end - emitted_);
  emitted_ = safe_end;
  emitted_text_ += out;
  return out;
}

absl::StatusOr<std::string> TextStream::Push(int32_t id) {
  if (matched_stop_.has_value()) return std::string();
  ASSIGN_OR_RETURN(std::string piece, decoder_.Push(id));
  text_ += piece;
  return TakeSafeText(/*final=*/false);
}

std::string TextStream::Finish() {
  if (matched_stop_.has_value()) return "";
  text_ += decoder_.Flush();
  return TakeSafeText(/*final=*/true);
}

namespace {

absl::StatusOr<GenerationResult> GenerateOrThrow(
    const LlamaModel& model, const Tokenizer& tokenizer,
    const GenerationRequest& request, const StreamCallback& on_tokens,
    const ReferenceCallback& on_reference, PlannerClient* planner,
    const PlanningShared* shared) {
  // The same step code as the batched engine, with a batch of one and a
  // contiguous K/V cache of exactly the positions the sequence may write.
  ASSIGN_OR_RETURN(std::unique_ptr<Sequence> seq,
                   Sequence::Create(model, tokenizer, request, on_tokens,
                                    on_reference, planner, shared));
  std::vector<LayerKv> kv = model.AllocateKv(seq->max_positions());
  seq->UseKv(&kv);
  BatchStepOptions options;
  options.max_batch_tokens = request.prefill_chunk;
  Sequence* const batch[] = {seq.get()};
  while (!seq->done()) RunBatchStep(model, batch, options);
  return seq->TakeResult();
}

}  // namespace

absl::StatusOr<GenerationResult> Generate(const LlamaModel& model,
                                          const Tokenizer& tokenizer,
                                          const GenerationRequest& request,
                                          const StreamCallback& on_tokens,
                                          const ReferenceCallback& on_reference,
                                          PlannerClient* planner,
                                          const PlanningShared* shared) {
  // LibTorch reports broken invariants by throwing (c10::Error); none may
  // escape into a server thread, so the sequence fails with INTERNAL and
  // the server goes on. Its KV cache is freed with the stack.
  try {
    return GenerateOrThrow(model, tokenizer, request, on_tokens, on_reference,
                           planner, shared);
  } catch (...) {
    return CurrentExceptionAsInternal("generation failed");
  }
}

}  // namespace knapserve
