#include "tools/step_overhead.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/model/exception_status.h"
#include "common/model/layer_mask.h"
#include "executor/engine/generator.h"
#include "executor/engine/sequence.h"
#include "tools/bench_util.h"

namespace knapserve {
namespace {

// Decode time outside the planner.
double OutsidePlanning(const GenerationResult& result) {
  return result.stats.decode_seconds - result.stats.waiting_seconds;
}

// One context's prompt, prefilled once (the header's shared prefill): the
// K/V buffer, sized for the longest run, and the sequence that prefilled
// it, kept for its last logits row, from which every run starts. Not
// movable: `first` holds the buffer's address.
struct Prefilled {
  Prefilled() = default;
  Prefilled(const Prefilled&) = delete;
  Prefilled& operator=(const Prefilled&) = delete;

  int64_t positions = 0;
  std::vector<LayerKv> kv;
  std::unique_ptr<Sequence> first;
};

// Prefills `request`'s prompt into a buffer of `positions` positions, one
// chunk per step, asking before_run before each chunk (its errors stop it;
// a wait does not matter: nothing here is timed).
absl::StatusOr<std::unique_ptr<Prefilled>> Prefill(
    const LlamaModel& model, const Tokenizer& tokenizer,
    GenerationRequest request, int64_t positions,
    const StepOverheadOptions& options) {
  try {
    auto prefilled = std::make_unique<Prefilled>();
    request.max_new_tokens = 1;
    ASSIGN_OR_RETURN(prefilled->first,
                     Sequence::Create(model, tokenizer, request, nullptr,
                                      nullptr, nullptr, nullptr));
    Sequence& first = *prefilled->first;
    first.KeepPrefillLogits();
    prefilled->positions = positions;
    prefilled->kv = model.AllocateKv(positions);
    first.UseKv(&prefilled->kv);
    BatchStepOptions step;
    step.max_batch_tokens = request.prefill_chunk;
    Sequence* const batch[] = {&first};
    while (first.prefilling()) {
      if (options.before_run) RETURN_IF_ERROR(options.before_run().status());
      RunBatchStep(model, batch, step);
    }
    if (!first.prefilled()) return first.TakeResult().status();
    return prefilled;
  } catch (...) {
    return CurrentExceptionAsInternal("step overhead: prefill");
  }
}

// Runs `request` (its prompt the one prefilled) from the prefill, as
// Generate would after it: the same steps, one sequence, contiguous K/V.
absl::StatusOr<GenerationResult> RunFromPrefill(
    const LlamaModel& model, const Tokenizer& tokenizer, Prefilled& prefilled,
    const GenerationRequest& request, const StreamCallback& on_tokens) {
  try {
    ASSIGN_OR_RETURN(std::unique_ptr<Sequence> seq,
                     Sequence::Create(model, tokenizer, request, on_tokens,
                                      nullptr, nullptr, nullptr));
    if (seq->max_positions() > prefilled.positions) {
      return absl::InternalError(absl::StrCat(
          "step overhead: a run needs ", seq->max_positions(),
          " K/V positions, the prefill's buffer holds ", prefilled.positions));
    }
    seq->UseKv(&prefilled.kv);
    RETURN_IF_ERROR(seq->StartFromPrefill(*prefilled.first));
    BatchStepOptions step;
    step.max_batch_tokens = request.prefill_chunk;
    Sequence* const batch[] = {seq.get()};
    while (!seq->done()) RunBatchStep(model, batch, step);
    return seq->TakeResult();
  } catch (...) {
    return CurrentExceptionAsInternal("step overhead: run");
  }
}

// Runs `request` until a run goes through with no wait in it. before_run is
// asked before the run and between its steps (the stream callback), so a
// request that reaches a serving process waits for one decode step of this
// measurement, not a whole run. A wait between steps cuts the run short (its
// timings now hold the wait); a run right after a wait starts with cold
// caches, so it only warms them and the next one is timed.
absl::StatusOr<GenerationResult> RunOnce(const LlamaModel& model,
                                         const Tokenizer& tokenizer,
                                         Prefilled& prefilled,
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
    ASSIGN_OR_RETURN(
        GenerationResult result,
        RunFromPrefill(model, tokenizer, prefilled, request, between_steps));
    RETURN_IF_ERROR(gate);
    cold = cut;
    if (!waited && !cut) return result;
  }
}

// One context's overheads (o_step, o_draft) at the runs' mean context.
struct Point {
  double context = 0;
  double step = 0;
  double draft = 0;
};

// One context's runs (the header's recipe); the medians over its drafting
// runs.
absl::StatusOr<Point> MeasureAt(const LlamaModel& model,
                                const Tokenizer& tokenizer,
                                const LatencyProfile& passes,
                                const LayerMask& mask, int64_t context,
                                const StepOverheadOptions& options) {
  GenerationRequest plain;
  const int64_t vocab = model.config().vocab_size;
  for (int64_t i = 0; i < context; ++i) {
    plain.prompt_ids.push_back(static_cast<int32_t>((7 * i + 3) % vocab));
  }
  plain.max_new_tokens = options.new_tokens;
  plain.ignore_eos = true;
  plain.speculation.mode = SpeculationMode::kOff;

  // Drafts every step: no confidence stop, no guard.
  GenerationRequest drafting = plain;
  drafting.speculation.mode = SpeculationMode::kStatic;
  drafting.speculation.skip = mask.ToString();
  drafting.speculation.max_draft = options.max_draft;
  drafting.speculation.exit_threshold = 0;
  drafting.speculation.guard = false;

  // The run's steps start at context, context + 1 (plain) or further
  // (drafting): the prices at their mean context.
  auto mean_context = [context](const GenerationResult& r) {
    return static_cast<double>(context) +
           0.5 * static_cast<double>(r.stats.completion_tokens - 1);
  };
  // Every run starts from one prefill of the prompt.
  int64_t positions = 0;
  for (const GenerationRequest* request : {&plain, &drafting}) {
    ASSIGN_OR_RETURN(std::unique_ptr<Sequence> probe,
                     Sequence::Create(model, tokenizer, *request, nullptr,
                                      nullptr, nullptr, nullptr));
    positions = std::max(positions, probe->max_positions());
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Prefilled> prefilled,
                   Prefill(model, tokenizer, plain, positions, options));
  // One untimed run of each warms the caches and the engine, and shows
  // what a pair of runs costs: the budget sets the repeats (and the runs'
  // length) from it.
  const auto warm_start = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(
      RunOnce(model, tokenizer, *prefilled, plain, options).status());
  RETURN_IF_ERROR(
      RunOnce(model, tokenizer, *prefilled, drafting, options).status());
  const double pair = std::chrono::duration<double>(
                          std::chrono::steady_clock::now() - warm_start)
                          .count();
  int repeats = options.repeats;
  if (options.budget_seconds > 0 && pair * repeats > options.budget_seconds) {
    repeats = std::max(std::min(options.min_repeats, options.repeats),
                       static_cast<int>(options.budget_seconds / pair));
    if (pair * repeats > options.budget_seconds) {
      const double scale = options.budget_seconds / (pair * repeats);
      const int64_t shortest =
          std::min<int64_t>(options.new_tokens, StepOverheadOptions::kMinRun);
      plain.max_new_tokens =
          std::max(shortest, static_cast<int64_t>(options.new_tokens * scale));
      drafting.max_new_tokens = plain.max_new_tokens;
    }
  }
  auto run_plain = [&]() -> absl::StatusOr<GenerationResult> {
    ASSIGN_OR_RETURN(GenerationResult a,
                     RunOnce(model, tokenizer, *prefilled, plain, options));
    if (a.stats.steps < 1) {
      return absl::InternalError("step overhead: the plain run took no step");
    }
    return a;
  };
  auto per_step_time = [](const GenerationResult& r) {
    return OutsidePlanning(r) / static_cast<double>(r.stats.steps);
  };
  auto outside_passes = [](const GenerationResult& r) {
    return (OutsidePlanning(r) - r.stats.verify_seconds) /
           static_cast<double>(r.stats.steps);
  };
  // The runs alternate plain, drafting, plain, ..., plain: each drafting run
  // is compared with the mean of the plain runs on either side, so that
  // drift that is linear over the three cancels.
  std::vector<double> contexts, per_step, per_draft;
  ASSIGN_OR_RETURN(GenerationResult before, run_plain());
  for (int r = 0; r < repeats; ++r) {
    ASSIGN_OR_RETURN(const GenerationResult b,
                     RunOnce(model, tokenizer, *prefilled, drafting, options));
    if (b.speculation.draft_tokens < 1) {
      return absl::InternalError(
          "step overhead: the drafting run drafted no token");
    }
    ASSIGN_OR_RETURN(GenerationResult after, run_plain());
    const auto n_a = static_cast<int64_t>(std::llround(mean_context(before)));
    // o_step: the plain runs' time outside their passes, per step.
    const double step =
        std::max(0.0, 0.5 * (outside_passes(before) + outside_passes(after)));
    const double plain_seconds =
        0.5 * (per_step_time(before) + per_step_time(after));
    const double steps_b = static_cast<double>(b.stats.steps);
    const double drafts = static_cast<double>(b.speculation.draft_tokens);
    const auto n_b = static_cast<int64_t>(std::llround(mean_context(b)));
    // A drafting step costs `ratio` plain steps, measured against the plain
    // runs on either side (the machine's drift, which moves a shared VM's
    // speed by tenths within minutes, cancels). o_draft makes the profile's
    // drafting step cost the same ratio of its plain step:
    //   t_verify(n, 1 + d) + o_step + d * (t_draft(S, n) + o_draft)
    //     = ratio * (t_verify(n, 1) + o_step),  d = drafts per step.
    const double ratio = per_step_time(b) / plain_seconds;
    const double d = drafts / steps_b;
    const double plain_priced = passes.VerifySeconds(n_a, 1) + step;
    const double drafting_priced = passes.MeanVerifySeconds(n_b, 1 + d) + step +
                                   d * passes.DraftSeconds(mask, n_b);
    const double draft = (ratio * plain_priced - drafting_priced) / d;
    contexts.push_back(0.5 * (mean_context(before) + mean_context(b)));
    per_step.push_back(step);
    per_draft.push_back(draft);
    before = std::move(after);
  }
  return Point{Median(contexts), std::max(0.0, Median(per_step)),
               std::max(0.0, Median(per_draft))};
}

// A line through two (x, y) points with its slope clamped at 0 and its value
// at 0 kept >= 0: {value at 0, slope}.
std::pair<double, double> NonNegativeLine(double x1, double y1, double x2,
                                          double y2) {
  if (!(x2 > x1)) return {0.5 * (y1 + y2), 0.0};
  const double slope = (y2 - y1) / (x2 - x1);
  if (slope <= 0) return {0.5 * (y1 + y2), 0.0};
  const double at_zero = y1 - slope * x1;
  if (at_zero >= 0) return {at_zero, slope};
  // Steeper than through the origin: through the origin and the far point.
  return {0.0, y2 / x2};
}

}  // namespace

absl::StatusOr<StepOverhead> MeasureStepOverhead(
    const LlamaModel& model, const Tokenizer& tokenizer,
    const LatencyProfile& passes, const StepOverheadOptions& options) {
  if (options.new_tokens < 8 || options.repeats < 1 || options.max_draft < 1 ||
      options.min_repeats < 1 || !(options.budget_seconds >= 0) ||
      options.contexts.size() > 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step overhead: needs new_tokens >= 8, repeats >= 1, max_draft >= 1, "
        "min_repeats >= 1, budget_seconds >= 0 and at most two contexts; got ",
        options.new_tokens, ", ", options.repeats, ", ", options.max_draft,
        ", ", options.min_repeats, ", ", options.budget_seconds, " and ",
        options.contexts.size(), " contexts"));
  }
  if (passes.verify_contexts.empty() || passes.verify_seconds.empty()) {
    return absl::InvalidArgumentError(
        "step overhead: the profile has no verify table to price passes");
  }
  // Positions a run needs beyond its prompt.
  const int64_t run = int64_t{options.new_tokens} + options.max_draft + 1;
  std::vector<int64_t> contexts = options.contexts;
  if (contexts.empty()) {
    for (int64_t n : passes.verify_contexts) {
      if (n + run > model.max_context()) break;
      if (contexts.empty() || n <= StepOverheadOptions::kLongContext) {
        if (contexts.size() == 2) contexts.pop_back();
        contexts.push_back(n);
      }
    }
    // A model shorter than the profile's first context: as long a prompt as
    // fits.
    if (contexts.empty() && model.max_context() > run) {
      contexts.push_back(model.max_context() - run);
    }
  }
  for (int64_t n : contexts) {
    if (n < 1 || n + run > model.max_context()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step overhead: a run at context ", n, " needs ", n + run,
          " positions, the model holds ", model.max_context()));
    }
  }
  if (contexts.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("step overhead: the runs need more than ", run,
                     " positions, the model holds ", model.max_context()));
  }
  // Every other layer skipped: half the sublayers, as the plans on the models
  // here skip (the engine's work outside the passes is the same for any
  // mask).
  LayerMask mask(model.num_layers());
  for (int layer = 1; layer < model.num_layers(); layer += 2) {
    mask.set_skipped(2 * layer, true);
    mask.set_skipped(2 * layer + 1, true);
  }
  if (mask.num_kept() == 2 * model.num_layers()) mask.set_skipped(1, true);

  std::vector<Point> points;
  for (int64_t n : contexts) {
    ASSIGN_OR_RETURN(Point point,
                     MeasureAt(model, tokenizer, passes, mask, n, options));
    points.push_back(point);
  }
  const Point& a = points.front();
  const Point& b = points.back();
  const auto [step_at_zero, step_slope] =
      NonNegativeLine(a.context, a.step, b.context, b.step);
  const auto [draft_at_zero, draft_slope] =
      NonNegativeLine(a.context, a.draft, b.context, b.draft);
  return StepOverhead{step_at_zero, step_slope, draft_at_zero, draft_slope};
}

std::function<absl::StatusOr<StepOverhead>(
    const LatencyProfile& passes,
    const std::function<absl::StatusOr<bool>()>& before_run)>
StepOverheadFunction(const LlamaModel& model, const Tokenizer& tokenizer) {
  return [&model, &tokenizer](
             const LatencyProfile& passes,
             const std::function<absl::StatusOr<bool>()>& before_run) {
    StepOverheadOptions options;
    options.before_run = before_run;
    return MeasureStepOverhead(model, tokenizer, passes, options);
  };
}

}  // namespace knapserve
