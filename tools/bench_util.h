// Measurement helpers shared by the `knapserve bench` modes (ar, spec,
// step-cost, serve): medians and quantiles, the benchmark prompt set as token
// ids, the machine's memory bandwidth, one timed pass of Generate() over a
// prompt set (RunModes), each mode against a baseline pair by pair, the
// plans' promise against what they measured, and the peaks of gauges while
// a phase runs (PeakSampler).
//
// Timing conventions: every figure is a median over
// repeats after a warm-up run, and comparisons are ratios taken within one
// run on one machine. Decode speed over a prompt set is the aggregate
// (total tokens decoded / total decode seconds), so long and short prompts
// weigh by their tokens, not one vote each.
//
// Apart from PeakSampler (its own comment), nothing here keeps state between
// calls; functions are thread-compatible (they use the model's intra-op
// threads, so run one at a time).
#ifndef KNAPSERVE_TOOLS_BENCH_UTIL_H_
#define KNAPSERVE_TOOLS_BENCH_UTIL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/model/llama.h"
#include "common/text/tokenizer.h"
#include "executor/api/planning_json.h"
#include "executor/engine/generator.h"
#include "tools/prompt_set.h"

namespace knapserve {

// The median of `values` (mean of the middle two for an even count); 0 if
// empty.
double Median(std::vector<double> values);
// The q-quantile (0..1) of `values` by linear interpolation between order
// statistics; 0 when empty.
double Quantile(std::vector<double> values, double q);

// Runs in order (run k: `names[k]`, measured `rates[k]`), each against the
// `baseline` runs around it: rates[k] over the mean of the nearest baseline
// run before k and the nearest after k (either alone at an end; a baseline
// run is compared with its neighbouring baseline runs, not itself). 0 where
// no other baseline run exists. On a machine whose speed drifts, a run
// bracketed by baseline runs (off,static,off,knapspec,off) is compared with
// what the baseline did at the same time.
std::vector<double> RatiosToAdjacentBaseline(
    const std::vector<std::string>& names, const std::vector<double>& rates,
    const std::string& baseline);

// Seconds `fn` takes: runs it `warmup` times untimed, then `repeats` times,
// and returns the median.
double MedianSeconds(const std::function<void()>& fn, int warmup, int repeats);

// Memory bandwidth of this machine with torch's current threads, best of five
// passes over 512 MiB buffers (far larger than any cache here).
struct Bandwidth {
  double copy =
      0;  // bytes copied per second (memcpy's convention: each byte once)
  double read = 0;  // bytes read per second by a reduction
};
Bandwidth MeasureBandwidth();

// Prompt text repeated (joined by blank lines) until it has at least
// `min_tokens` tokens, then cut to `max_tokens` tokens if longer (max_tokens
// <= 0: no cut).
absl::StatusOr<std::vector<int32_t>> PromptIds(const Tokenizer& tokenizer,
                                               const std::string& text,
                                               int64_t min_tokens,
                                               int64_t max_tokens);

// One benchmark prompt, tokenized.
struct BenchInput {
  BenchPrompt prompt;
  std::vector<int32_t> ids;
};

// Loads --prompts (default <shared>/bench/spec_bench/question.jsonl), takes
// `count` prompts round-robin over the categories, and tokenizes each with
// --min-prompt-tokens, cut so that `max_new_tokens` more tokens still fit the
// model's context. InvalidArgument when max_new_tokens leaves no room.
// `min_prompt_tokens` overrides --min-prompt-tokens (capped to what fits).
absl::StatusOr<std::vector<BenchInput>> LoadBenchInputs(
    const LlamaModel& model, const Tokenizer& tokenizer, int count,
    int64_t max_new_tokens,
    std::optional<int64_t> min_prompt_tokens = std::nullopt);

// The outcome of Generate() on one prompt in one mode, with the decode time as
// the median over repeats (ids must be the same in every repeat: greedy).
struct PromptRun {
  std::vector<int32_t> output_ids;
  int64_t decoded_tokens =
      0;  // completion tokens after the first (prefill) one
  double prefill_seconds = 0;    // median over repeats
  double decode_seconds = 0;     // median over repeats
  double draft_seconds = 0;      // of the repeat with the median decode time
  double verify_seconds = 0;     // idem
  SpeculationStats speculation;  // idem (the same in every greedy repeat)
  // Planned modes (knapspec, clasp), of the median repeat: the plans applied,
  // the decode thread's time on planning, requests sent.
  std::vector<AppliedPlan> plans;
  double waiting_seconds = 0;
  int64_t plan_requests = 0;
  PlanningStats planning;  // cache, triggers, budget, guard (median repeat)
  // kKnn: the domain the prompt routed to and the routing time (median
  // repeat).
  std::string routed_domain;
  double routing_seconds = 0;
  // Every repeat's decode seconds and decoded tokens, in the order the
  // repeats ran; repeat k of every mode ran back to back with the others'
  // (PairedSpeedupOf).
  std::vector<double> repeat_decode_seconds;
  std::vector<int64_t> repeat_decoded_tokens;
};

// How much faster `runs` decode than `base` (the same prompts, measured in
// one interleaved RunModes call), pair by pair: for every prompt and repeat,
// runs' tokens per second over base's in the same repeat. The two ran back to
// back (the other modes of that prompt between them), so a drift of the
// machine's speed over the set, which an aggregate carries, hits both alike,
// and a run that another process slowed moves one ratio, not the median
// (a drift within a run, at the scale of milliseconds, is not cancelled).
// Quantiles of those ratios (the spread of the pairs); all 0 without pairs.
// ci95_low and ci95_high bound the median with at least 95% confidence
// (MedianInterval95): a cell that reads below a line while its interval
// reaches above it is not shown to be below it. Both 0 below 6 pairs.
struct PairedSpeedup {
  int pairs = 0;
  double median = 0;
  double q25 = 0;
  double q75 = 0;
  double ci95_low = 0;
  double ci95_high = 0;
};
PairedSpeedup PairedSpeedupOf(const std::vector<PromptRun>& base,
                              const std::vector<PromptRun>& runs);
// The same against several baselines at once: each pair's base rate is the
// mean of the baselines' rates in that prompt and repeat (a pair counts only
// where every baseline and `runs` have a rate). With the baseline runs just
// before and after `runs` in the order they ran, a drift of the machine's
// speed within the seconds of one prompt's modes is cancelled too.
PairedSpeedup PairedSpeedupOfMean(
    const std::vector<const std::vector<PromptRun>*>& bases,
    const std::vector<PromptRun>& runs);

// The distribution-free confidence interval of the median of `values` (the
// sign test's): the k-th smallest and the k-th largest value, k the largest
// rank at which P(Binomial(n, 1/2) < k) <= 2.5%, so that the true median
// lies outside with at most 5% probability whatever the values'
// distribution, for independent values. 18 values: the 5th and 14th; 30:
// the 10th and 21st. {0, 0} for fewer than 6 values (no interval reaches
// 95%).
std::pair<double, double> MedianInterval95(std::vector<double> values);

// The baselines of mode k of a RunModes list, whose modes of a prompt and
// repeat run in list order or in reverse (so the neighbours of k in the list
// ran just before and after it): the neighbours k-1 and k+1 that are
// baseline modes (`is_baseline`), else the nearest baseline mode on each
// side of k (none: empty). A baseline mode k is compared with its baseline
// neighbours likewise, else with the nearest other baseline mode on each
// side: with off between the modes (off,static,off,knapspec,off), each off
// run between two modes is paired with the off runs two places away, so its
// ratios show how far this run's pairing moves when nothing differs.
std::vector<size_t> AdjacentBaselines(const std::vector<bool>& is_baseline,
                                      size_t k);

// Aggregates of one mode over a prompt set.
struct ModeSummary {
  int64_t decoded_tokens = 0;
  double decode_seconds = 0;
  double draft_seconds = 0;
  double verify_seconds = 0;
  SpeculationStats speculation;    // counters summed over prompts
  std::vector<AppliedPlan> plans;  // every plan applied, all prompts
  double waiting_seconds = 0;
  int64_t plan_requests = 0;
  PlanningStats planning;  // summed over prompts
  // decoded_tokens / decode_seconds.
  double decode_tokens_per_second() const;
  double draft_share() const;   // draft_seconds / decode_seconds
  double verify_share() const;  // verify_seconds / decode_seconds
};

// Adds b's counts and seconds to a (the last guard rates and the process
// share are b's).
void AccumulatePlanning(PlanningStats& a, const PlanningStats& b);
// PlanningJson (`s` as JSON): executor/api/planning_json.h.

// Sums `runs` (one per prompt) into a ModeSummary.
ModeSummary Summarize(const std::vector<PromptRun>& runs);

// The latency model's promise against what the plans did while they ran as
// planned (AppliedPlan::measured_*), over every plan with a measured step.
// The rates are time-weighted (each plan by its measured seconds), so
// measured_tpt is simply tokens over seconds; the per-step figures are
// step-weighted. The prediction splits into tokens per step (the plan's
// predicted_tokens_per_step, common/plan/step_forecast.h ForecastStep) and
// seconds per step (tokens per step over the predicted rate), so an error shows
// whether acceptance or time missed.
struct PlanPrediction {
  int64_t plans = 0;  // plans with a measured step
  int64_t steps = 0;  // their measured steps
  // The plans' steps left out of the measurement because a solve was in
  // flight beside them (AppliedPlan::beside_solve_*), over every plan.
  int64_t beside_solve_steps = 0;
  double beside_solve_seconds = 0;
  // And those left out as no evidence of the machine's steady speed: the
  // first steps after a prefill and preempted ones (AppliedPlan::
  // unsteady_*).
  int64_t unsteady_steps = 0;
  double unsteady_seconds = 0;
  double predicted_tpt = 0;
  double measured_tpt = 0;
  double predicted_tokens_per_step = 0;
  double measured_tokens_per_step = 0;
  double predicted_step_seconds = 0;
  double measured_step_seconds = 0;
  // Draft tokens a step: what the plans expected (below gamma when the
  // draft's confidence stop, exit_threshold, ends drafts early) against what
  // the steps drafted.
  double planned_drafts_per_step = 0;
  double measured_drafts_per_step = 0;
  // measured_tpt / predicted_tpt - 1 (0 without plans): -0.08 means the
  // plans delivered 8% less than promised.
  double error() const;
  // The same on the machine's speed as it was when each plan took effect
  // (AppliedPlan::calibrated_tpt), over the plans that had a measured plain
  // rate then (calibrated_seconds of the measured seconds): their
  // calibrated promise and what they measured, time-weighted, and plain
  // decoding's rate as the profile priced it (baseline_tpt, at the plan's
  // context) against as the engine had measured it at the plans' buckets
  // just before. A profile_plain_tpt above measured_plain_tpt means the
  // machine ran slower than when it was profiled.
  double calibrated_seconds = 0;
  double calibrated_tpt = 0;
  double calibrated_measured_tpt = 0;
  // calibrated_measured_tpt's standard error in tokens/s, from its steps'
  // spread (AppliedPlan::measured_tpt_standard_error over the pooled
  // steps): a gap |calibrated_measured_tpt - calibrated_tpt| within about
  // two of these is what the steps' spread alone gives (a few plans of a
  // dozen steps spread by more than 10%); against calibrated_error() take
  // it over calibrated_tpt. The steps' drift in time adds to it. 0 below 2
  // steps, and without the plans' second moments (zeros from an older
  // server); plans with and without them pooled give no meaningful figure.
  double calibrated_measured_standard_error = 0;
  double profile_plain_tpt = 0;
  double measured_plain_tpt = 0;
  // calibrated_measured_tpt / calibrated_tpt - 1 (0 without such plans).
  double calibrated_error() const;
  // The calibration by drafting steps' cost (AppliedPlan::
  // draft_calibrated_tpt), over the drafting plans with a draft_cost_ratio:
  // their measured seconds, their ratio (1.1: drafting ran 10% slower than
  // the plans predicted when they took effect), their promise and what
  // they measured, time-weighted. Against calibrated_error() it shows how
  // drafting steps' cost moved apart from plain steps'.
  double draft_calibrated_seconds = 0;
  double draft_cost_ratio = 0;
  double draft_calibrated_tpt = 0;
  double draft_calibrated_measured_tpt = 0;
  double draft_calibrated_error() const;
};
PlanPrediction SummarizePredictions(const std::vector<AppliedPlan>& plans);
nlohmann::json PlanPredictionJson(const PlanPrediction& p);

// Runs each of `requests` (several modes of the same prompts, e.g. off and
// static) on every prompt, `repeats` times, interleaved by mode so that
// drift in machine speed (another process, frequency changes) hits all modes
// alike; the mode order alternates between runs. A solve a run started that
// outlives the run finishes before the next run starts (untimed), so a
// mode's solves slow its own runs and never another mode's (as in a server
// whose requests come with gaps; under continuous load the solve would
// overlap the next request). Each request's prompt_ids are replaced by each
// input's ids. Each prompt's time is the median over
// its repeats.
// Returns runs[mode][prompt]. `warmup` runs one short generation per mode
// first (kernel selection, page faults). `planners[k]` serves mode k's plans
// (empty, or null entries, when the mode plans nothing). Each mode gets one
// PlanningShared (plan cache, planner budget, guard verdicts, draft-cost
// table: its drafting plans' calibration) for all its runs, as one server
// process would, and the modes share one plain-rate table (StepTimeTable:
// every mode's plain steps, off's above all, are plain decoding's rate for
// the guards and the plans' plain calibration, as in one server that
// serves every mode); the warm-up runs
// use a separate one, so the measured runs start with an empty cache.
// Without `warm_plan_cache` every repeat is such a cold pass (repeat x prompt
// x mode, fresh PlanningShareds and plain rates per repeat). With
// `warm_plan_cache` (prompt x repeat x mode), each mode first generates every
// input once, untimed, with the PlanningShared it is then measured with, and
// the solves it started are awaited (at most a minute: a planner that yields
// the cores may still be solving): the measured runs see the steady state of a
// server that has already planned for these context buckets (cached plans,
// plain rates), not its first requests. `router` (the --anchors of kKnn) goes
// into every mode's PlanningShared.
absl::StatusOr<std::vector<std::vector<PromptRun>>> RunModes(
    const LlamaModel& model, const Tokenizer& tokenizer,
    const std::vector<BenchInput>& inputs,
    const std::vector<GenerationRequest>& requests, int repeats, bool warmup,
    const std::vector<PlannerClient*>& planners = {},
    bool warm_plan_cache = false,
    std::shared_ptr<const DomainRouter> router = nullptr);

// The largest values a few gauges reach while something runs (`bench serve`:
// the K/V pool's used blocks and the process's resident memory during a
// load phase). The constructor calls `sample` once, then a thread of its
// own every `interval`, keeping each field's maximum; Stop() takes one last
// sample, joins the thread and returns the peaks (element k the largest k-th
// field seen; samples of another length than the first are ignored).
//
// Thread safety: `sample` runs on the sampler's thread and must be safe to
// call there (KvPool's gauges are); what it reads must outlive Stop() (or the
// destructor, which stops a sampler that was not stopped). Construct, Stop
// and destroy on one thread. Each sample costs what `sample` does: pick an
// interval that leaves the measured work alone.
class PeakSampler {
 public:
  using Sample = std::vector<int64_t>;
  PeakSampler(std::function<Sample()> sample, absl::Duration interval);
  ~PeakSampler();
  PeakSampler(const PeakSampler&) = delete;
  PeakSampler& operator=(const PeakSampler&) = delete;

  // The peaks so far, including a sample taken now. Call once.
  Sample Stop() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Take() ABSL_LOCKS_EXCLUDED(mu_);

  const std::function<Sample()> sample_;
  absl::Notification stop_;
  absl::Mutex mu_;
  Sample peaks_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;  // started by the constructor after the first sample
};

// This process's resident memory in bytes (/proc/self/statm), 0 where it
// cannot be read.
int64_t ResidentSetBytes();

}  // namespace knapserve

#endif  // KNAPSERVE_TOOLS_BENCH_UTIL_H_
