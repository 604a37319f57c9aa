// MeasureStepOverhead: the engine's work per decode step outside the model's
// passes, for the latency profile (planner/latency_profile.h, o_step and
// o_draft).
//
// A decode step is more than its passes: the engine picks tokens from the
// logits, accepts or rejects drafts, keeps the sequence's books and calls
// back with the new tokens. The planner's layer has no engine, so the
// processes that own one (every `knapserve` command and knapserve-planner,
// which load the same model) measure it here on the real engine (`Generate`,
// executor/engine/generator.h) and hand it to ProfileModel through
// ProfileOptions::measure_overhead:
//
//   o_step  = (decode - passes - planning) / steps        of a plain run
//   o_draft = (decode - passes - planning - steps * o_step) / draft tokens
//             of a static-mask run that drafts every step
//
// each the median over `repeats` runs of `new_tokens` tokens after a
// `prompt_tokens`-token prompt (ids spread over the vocabulary; EOS ignored).
//
// Thread safety: runs on the calling thread and only reads the model and
// tokenizer, which must outlive the call. Like ProfileModel it should not
// race with other heavy work if its timings are to mean anything.
#ifndef KNAPSERVE_TOOLS_STEP_OVERHEAD_H_
#define KNAPSERVE_TOOLS_STEP_OVERHEAD_H_

#include <functional>

#include "absl/status/statusor.h"
#include "common/model/llama.h"
#include "common/text/tokenizer.h"
#include "planner/latency_profile.h"

namespace knapserve {

struct StepOverheadOptions {
  int prompt_tokens = 32;  // >= 1
  int new_tokens = 64;     // per run, >= 8
  int repeats = 3;         // runs per figure (the median is kept), >= 1
  int max_draft = 4;       // draft tokens per step of the static run, >= 1
  // As ProfileOptions::before_run: called before every run and between its
  // decode steps; `true` (it waited, the caches are cold) cuts the run short
  // if it was under way, and the run is repeated after one untimed run that
  // warms the caches again. An error stops the measurement.
  std::function<absl::StatusOr<bool>()> before_run;
};

// InvalidArgument for bad options or a model too short for the runs; the
// engine's errors as they are.
absl::StatusOr<StepOverhead> MeasureStepOverhead(
    const LlamaModel& model, const Tokenizer& tokenizer,
    const StepOverheadOptions& options);

// ProfileOptions::measure_overhead for `model`: MeasureStepOverhead with
// default options and the profile's before_run. `model` and `tokenizer`
// must outlive the function.
std::function<absl::StatusOr<StepOverhead>(
    const std::function<absl::StatusOr<bool>()>& before_run)>
StepOverheadFunction(const LlamaModel& model, const Tokenizer& tokenizer);

}  // namespace knapserve

#endif  // KNAPSERVE_TOOLS_STEP_OVERHEAD_H_
