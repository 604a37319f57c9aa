#include "tools/step_overhead.h"

#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/status.h"
#include "executor/engine/generator.h"
#include "tools/bench_util.h"

namespace knapserve {
namespace {

// Decode time outside the model's passes and the planner.
double OutsidePasses(const GenerationResult& result) {
  const GenerationStats& s = result.stats;
  return s.decode_seconds - s.draft_seconds - s.verify_seconds -
         s.waiting_seconds;
}

// Runs `request` until a run goes through with no wait in it. before_run is
// asked before the run and between its steps (the stream callback), so a
// request that reaches a serving process waits for one decode step of this
// measurement, not a whole run. A wait between steps cuts the run short (its
// timings now hold the wait); a run right after a wait starts with cold
// caches, so it only warms them and the next one is timed.
absl::StatusOr<GenerationResult> RunOnce(const LlamaModel& model,
                                         const Tokenizer& tokenizer,
                                         const GenerationRequest& request,
                                         const StepOverheadOptions& options) {
  bool cold = false;
  for (;;) {
    bool waited = cold;
    if (options.before_run) {
      ASSIGN_OR_RETURN(const bool waited_now, options.before_run());
      waited = waited || waited_now;
    }
    absl::Status gate;
    bool cut = false;
    StreamCallback between_steps;
    if (options.before_run) {
      between_steps = [&](absl::Span<const int32_t>, std::string_view,
                          const StepLogprobs&) {
        absl::StatusOr<bool> waited_now = options.before_run();
        if (!waited_now.ok()) {
          gate = waited_now.status();
          return false;
        }
        cut = *waited_now;
        return !cut;
      };
    }
    ASSIGN_OR_RETURN(GenerationResult result,
                     Generate(model, tokenizer, request, between_steps));
    RETURN_IF_ERROR(gate);
    cold = cut;
    if (!waited && !cut) return result;
  }
}

}  // namespace

absl::StatusOr<StepOverhead> MeasureStepOverhead(
    const LlamaModel& model, const Tokenizer& tokenizer,
    const StepOverheadOptions& options) {
  if (options.prompt_tokens < 1 || options.new_tokens < 8 ||
      options.repeats < 1 || options.max_draft < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step overhead: needs prompt_tokens >= 1, new_tokens >= 8, repeats "
        ">= 1 and max_draft >= 1; got ",
        options.prompt_tokens, ", ", options.new_tokens, ", ", options.repeats,
        ", ", options.max_draft));
  }
  const int64_t length = int64_t{options.prompt_tokens} + options.new_tokens +
                         options.max_draft + 1;
  if (length > model.max_context()) {
    return absl::InvalidArgumentError(
        absl::StrCat("step overhead: the runs need ", length,
                     " positions, the model holds ", model.max_context()));
  }
  GenerationRequest plain;
  const int64_t vocab = model.config().vocab_size;
  for (int i = 0; i < options.prompt_tokens; ++i) {
    plain.prompt_ids.push_back(static_cast<int32_t>((7 * i + 3) % vocab));
  }
  plain.max_new_tokens = options.new_tokens;
  plain.ignore_eos = true;
  plain.speculation.mode = SpeculationMode::kOff;

  // Drafts every step: half the layers skipped (any mask costs the same
  // outside its pass), no confidence stop, no guard.
  GenerationRequest drafting = plain;
  drafting.speculation.mode = SpeculationMode::kStatic;
  std::vector<std::string> skipped;
  for (int layer = 1; layer < model.num_layers(); layer += 2) {
    skipped.push_back(absl::StrCat("a", layer));
    skipped.push_back(absl::StrCat("m", layer));
  }
  if (skipped.empty()) skipped.push_back("m0");
  drafting.speculation.skip = absl::StrJoin(skipped, ",");
  drafting.speculation.max_draft = options.max_draft;
  drafting.speculation.exit_threshold = 0;
  drafting.speculation.guard = false;

  // One untimed run of each warms the caches and the engine.
  RETURN_IF_ERROR(RunOnce(model, tokenizer, plain, options).status());
  RETURN_IF_ERROR(RunOnce(model, tokenizer, drafting, options).status());
  std::vector<double> per_step, per_draft;
  for (int r = 0; r < options.repeats; ++r) {
    ASSIGN_OR_RETURN(const GenerationResult a,
                     RunOnce(model, tokenizer, plain, options));
    if (a.stats.steps < 1) {
      return absl::InternalError("step overhead: the plain run took no step");
    }
    const double step =
        std::max(0.0, OutsidePasses(a) / static_cast<double>(a.stats.steps));
    ASSIGN_OR_RETURN(const GenerationResult b,
                     RunOnce(model, tokenizer, drafting, options));
    if (b.speculation.draft_tokens < 1) {
      return absl::InternalError(
          "step overhead: the drafting run drafted no token");
    }
    const double draft =
        (OutsidePasses(b) - step * static_cast<double>(b.stats.steps)) /
        static_cast<double>(b.speculation.draft_tokens);
    per_step.push_back(step);
    per_draft.push_back(std::max(0.0, draft));
  }
  return StepOverhead{Median(per_step), Median(per_draft)};
}

std::function<absl::StatusOr<StepOverhead>(
    const std::function<absl::StatusOr<bool>()>& before_run)>
StepOverheadFunction(const LlamaModel& model, const Tokenizer& tokenizer) {
  return [&model,
          &tokenizer](const std::function<absl::StatusOr<bool>()>& before_run) {
    StepOverheadOptions options;
    options.before_run = before_run;
    return MeasureStepOverhead(model, tokenizer, options);
  };
}

}  // namespace knapserve
