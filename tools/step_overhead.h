// MeasureStepOverhead: what a decode step costs in the engine beyond the
// latency profile's prices of its passes (planner/latency_profile.h, o_step
// and o_draft).
//
// A decode step is more than its passes: the engine picks tokens from the
// logits, accepts or rejects drafts, keeps the sequence's books and calls
// back with the new tokens. And a drafting step costs more, against a plain
// one, than the profile's pass prices say: on this project's Intel VMs a
// verification pass inside a drafting step ran 10-30% longer than the
// profile's table, a plain step's pass 5-8% (the profile times each pass
// back to back; the cause is not pinned down). The planner's layer has no
// engine, so the processes that own one (every `knapserve` command and
// knapserve-planner, which load the same model) measure both here on the
// real engine (`Generate`, executor/engine/generator.h) and hand them to
// ProfileModel through ProfileOptions::measure_overhead:
//
//   o_step  = (decode - passes - planning) / steps         of a plain run
//   o_draft such that the profile prices a drafting step at the ratio to a
//           plain step that the engine measured:
//             t_verify(n, 1 + d) + o_step + d * (t_draft(S, n) + o_draft)
//               = ratio * (t_verify(n, 1) + o_step)
//           ratio = (decode - planning) per step of a static-mask run that
//           drafts d tokens every step (S: every other layer skipped, no
//           confidence stop) over the same of the plain runs around it
//
// The runs alternate plain, drafting, plain, ..., plain, and each drafting
// run is compared with the mean of the plain runs on either side, so the
// machine's drift (a shared VM's speed moves by tenths within minutes)
// cancels in the ratio, and what the planner predicts after calibrating to
// plain decoding's measured rate is what the engine does. The prices are at
// each run's mean context n (the profile is linear in n between its contexts);
// each figure is the median over `repeats` drafting runs of `new_tokens`
// tokens, at each of `contexts` (the prompt length; ids spread over the
// vocabulary, EOS ignored). Two contexts give each figure as a line in n (its
// slope clamped at 0: a cost that falls with context is noise); one gives it
// flat.
//
// The runs at one context share one prefill: the prompt's K/V is computed
// once, and every run starts decoding from it (Sequence::StartFromPrefill),
// writing only positions past the prompt, which the next run overwrites.
// (Re-prefilling 1024 positions for each of 17 runs was 57 of the 200 s
// this took on the smollm2-135m shape in bf16.)
//
// Cost: one prefill and 2 * repeats + 3 runs of `new_tokens` decode steps
// per context, within `budget_seconds` when set: the two untimed runs show
// what a pair costs, and when `repeats` pairs would not fit, fewer are run
// (at least min_repeats) and, when even those would not, shorter ones (at
// least kMinRun tokens). Small models never reach the budget.
//
// Thread safety: runs on the calling thread and only reads the model and
// tokenizer, which must outlive the call. Like ProfileModel it should not
// race with other heavy work if its timings are to mean anything.
#ifndef KNAPSERVE_TOOLS_STEP_OVERHEAD_H_
#define KNAPSERVE_TOOLS_STEP_OVERHEAD_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model/llama.h"
#include "common/text/tokenizer.h"
#include "planner/latency_profile.h"

namespace knapserve {

struct StepOverheadOptions {
  // Prompt lengths, so the contexts the overheads are measured at: one or
  // two, each >= 1. Empty: the profile's shortest verify context and the
  // longest one up to kLongContext, those that leave room for a run.
  std::vector<int64_t> contexts;
  static constexpr int64_t kLongContext = 1024;
  int new_tokens = 64;  // per run, >= 8
  int repeats = 7;      // runs per figure (the median is kept), >= 1
  int max_draft = 4;    // draft tokens per step of the static run, >= 1
  // Seconds for one context's timed runs (0 = no limit); see the cost above.
  // A wait during the two untimed runs counts in what they cost.
  double budget_seconds = 15;
  int min_repeats = 3;                    // >= 1
  static constexpr int64_t kMinRun = 16;  // tokens per run, at the least
  // As ProfileOptions::before_run: called before every run and between its
  // decode steps; `true` (it waited, the caches are cold) cuts the run short
  // if it was under way, and the run is repeated after one untimed run that
  // warms the caches again. An error stops the measurement.
  std::function<absl::StatusOr<bool>()> before_run;
};

// `passes`: the profile whose pass prices the overheads complete (its own
// overheads are not read). InvalidArgument for bad options, a profile with
// no verify table, or a model too short for the runs; the engine's errors as
// they are.
absl::StatusOr<StepOverhead> MeasureStepOverhead(
    const LlamaModel& model, const Tokenizer& tokenizer,
    const LatencyProfile& passes, const StepOverheadOptions& options);

// ProfileOptions::measure_overhead for `model`: MeasureStepOverhead with
// default options and the profile's before_run. `model` and `tokenizer`
// must outlive the function.
std::function<absl::StatusOr<StepOverhead>(
    const LatencyProfile& passes,
    const std::function<absl::StatusOr<bool>()>& before_run)>
StepOverheadFunction(const LlamaModel& model, const Tokenizer& tokenizer);

}  // namespace knapserve

#endif  // KNAPSERVE_TOOLS_STEP_OVERHEAD_H_
