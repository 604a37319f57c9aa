#include "tools/bench_util.h"

#include <c10/core/InferenceMode.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <tuple>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/base/clock.h"
#include "common/base/status.h"
#include "tools/cli_flags.h"
#include "tools/shared_data.h"

namespace knapserve {
double Median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

std::vector<double> RatiosToAdjacentBaseline(
    const std::vector<std::string>& names, const std::vector<double>& rates,
    const std::string& baseline) {
  const int n = static_cast<int>(std::min(names.size(), rates.size()));
  std::vector<double> ratios(n, 0.0);
  for (int k = 0; k < n; ++k) {
    double sum = 0;
    int count = 0;
    for (int j = k - 1; j >= 0; --j) {
      if (names[j] != baseline) continue;
      sum += rates[j];
      ++count;
      break;
    }
    for (int j = k + 1; j < n; ++j) {
      if (names[j] != baseline) continue;
      sum += rates[j];
      ++count;
      break;
    }
    if (count > 0 && sum > 0) ratios[k] = rates[k] / (sum / count);
  }
  return ratios;
}

double MedianSeconds(const std::function<void()>& fn, int warmup, int repeats) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> seconds;
  for (int i = 0; i < std::max(1, repeats); ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    seconds.push_back(SecondsSince(t0));
  }
  return Median(std::move(seconds));
}

Bandwidth MeasureBandwidth() {
  c10::InferenceMode guard;
  const int64_t bytes = int64_t{512} << 20;
  torch::Tensor src = torch::ones({bytes / 4}, torch::kFloat32);
  torch::Tensor dst = torch::empty_like(src);
  dst.copy_(src);  // fault the pages in
  Bandwidth best;
  for (int i = 0; i < 5; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    dst.copy_(src);
    double s = SecondsSince(t0);
    best.copy = std::max(best.copy, static_cast<double>(bytes) / s);
    t0 = std::chrono::steady_clock::now();
    volatile float sink = src.sum().item<float>();
    (void)sink;
    s = SecondsSince(t0);
    best.read = std::max(best.read, static_cast<double>(bytes) / s);
  }
  return best;
}

absl::StatusOr<std::vector<int32_t>> PromptIds(const Tokenizer& tokenizer,
                                               const std::string& text,
                                               int64_t min_tokens,
                                               int64_t max_tokens) {
  std::string repeated = text;
  while (true) {
    ASSIGN_OR_RETURN(std::vector<int32_t> ids,
                     tokenizer.Encode(repeated, true));
    if (static_cast<int64_t>(ids.size()) >= min_tokens) {
      if (max_tokens > 0 && static_cast<int64_t>(ids.size()) > max_tokens)
        ids.resize(max_tokens);
      return ids;
    }
    if (text.empty())
      return absl::InvalidArgumentError(
          "prompt: empty text cannot be repeated");
    repeated += "\n\n" + text;
  }
}

absl::StatusOr<std::vector<BenchInput>> LoadBenchInputs(
    const LlamaModel& model, const Tokenizer& tokenizer, int count,
    int64_t max_new_tokens, std::optional<int64_t> min_prompt_tokens) {
  std::string path = absl::GetFlag(FLAGS_prompts);
  if (path.empty()) path = SharedPath("bench/spec_bench/question.jsonl");
  ASSIGN_OR_RETURN(std::vector<BenchPrompt> prompts,
                   LoadPromptSet(path, count));
  // Leave room for the generation inside the context.
  const int64_t max_prompt = model.max_context() - max_new_tokens - 1;
  if (max_prompt < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens: ", max_new_tokens,
                     " leaves no room for a prompt in the context of ",
                     model.max_context(), " tokens"));
  }
  std::vector<BenchInput> inputs;
  for (BenchPrompt& prompt : prompts) {
    BenchInput input;
    ASSIGN_OR_RETURN(
        input.ids,
        PromptIds(tokenizer, prompt.text,
                  std::min(max_prompt, min_prompt_tokens.value_or(absl::GetFlag(
                                           FLAGS_min_prompt_tokens))),
                  max_prompt));
    input.prompt = std::move(prompt);
    inputs.push_back(std::move(input));
  }
  return inputs;
}

double ModeSummary::decode_tokens_per_second() const {
  return decode_seconds > 0
             ? static_cast<double>(decoded_tokens) / decode_seconds
             : 0.0;
}

double ModeSummary::draft_share() const {
  return decode_seconds > 0 ? draft_seconds / decode_seconds : 0.0;
}

double ModeSummary::verify_share() const {
  return decode_seconds > 0 ? verify_seconds / decode_seconds : 0.0;
}

ModeSummary Summarize(const std::vector<PromptRun>& runs) {
  ModeSummary sum;
  for (const PromptRun& run : runs) {
    sum.decoded_tokens += run.decoded_tokens;
    sum.decode_seconds += run.decode_seconds;
    sum.draft_seconds += run.draft_seconds;
    sum.verify_seconds += run.verify_seconds;
    const SpeculationStats& s = run.speculation;
    sum.speculation.drafts += s.drafts;
    sum.speculation.draft_tokens += s.draft_tokens;
    sum.speculation.accepted_tokens += s.accepted_tokens;
    sum.speculation.draft_seconds += s.draft_seconds;
    sum.speculation.verify_seconds += s.verify_seconds;
    std::vector<int64_t>& per = sum.speculation.accepted_per_position;
    if (per.size() < s.accepted_per_position.size())
      per.resize(s.accepted_per_position.size(), 0);
    for (size_t j = 0; j < s.accepted_per_position.size(); ++j)
      per[j] += s.accepted_per_position[j];
    std::vector<int64_t>& exits = sum.speculation.exit_depths;
    if (exits.size() < s.exit_depths.size())
      exits.resize(s.exit_depths.size(), 0);
    for (size_t d = 0; d < s.exit_depths.size(); ++d)
      exits[d] += s.exit_depths[d];
    sum.speculation.depth_bound_stops += s.depth_bound_stops;
    sum.speculation.width_bound_stops += s.width_bound_stops;
    sum.plans.insert(sum.plans.end(), run.plans.begin(), run.plans.end());
    sum.waiting_seconds += run.waiting_seconds;
    sum.plan_requests += run.plan_requests;
    AccumulatePlanning(sum.planning, run.planning);
  }
  return sum;
}

double PlanPrediction::error() const {
  return predicted_tpt > 0 ? measured_tpt / predicted_tpt - 1 : 0.0;
}

double PlanPrediction::calibrated_error() const {
  return calibrated_tpt > 0 ? calibrated_measured_tpt / calibrated_tpt - 1
                            : 0.0;
}

double PlanPrediction::draft_calibrated_error() const {
  return draft_calibrated_tpt > 0
             ? draft_calibrated_measured_tpt / draft_calibrated_tpt - 1
             : 0.0;
}

PlanPrediction SummarizePredictions(const std::vector<AppliedPlan>& plans) {
  PlanPrediction out;
  double calibrated_tokens = 0, calibrated_rate = 0, profile_plain = 0,
         measured_plain = 0, draft_cost = 0;
  // The drafting plans with a cost ratio: tokens and draft-calibrated rate.
  double draft_tokens = 0, draft_rate = 0;
  // The calibrated plans' steps pooled: their count and second moments.
  int64_t calibrated_steps = 0;
  double calibrated_tokens_sq = 0, calibrated_token_seconds = 0,
         calibrated_seconds_sq = 0;
  double seconds = 0, tokens = 0, weighted_rate = 0;
  double predicted_tokens = 0, predicted_seconds = 0, planned_drafts = 0,
         drafted = 0;
  for (const AppliedPlan& p : plans) {
    out.beside_solve_steps += p.beside_solve_steps;
    out.beside_solve_seconds += p.beside_solve_seconds;
    out.unsteady_steps += p.unsteady_steps;
    out.unsteady_seconds += p.unsteady_seconds;
    if (p.measured_steps <= 0 || p.measured_seconds <= 0 ||
        p.predicted_tpt <= 0) {
      continue;
    }
    ++out.plans;
    out.steps += p.measured_steps;
    seconds += p.measured_seconds;
    tokens += static_cast<double>(p.measured_tokens);
    weighted_rate += p.predicted_tpt * p.measured_seconds;
    // The TPT objective's own expectation of a step (with the draft's
    // confidence stop, when the request has one).
    const double per_step = p.predicted_tokens_per_step;
    const double steps = static_cast<double>(p.measured_steps);
    predicted_tokens += per_step * steps;
    predicted_seconds += per_step / p.predicted_tpt * steps;
    planned_drafts += p.predicted_drafts_per_step * steps;
    drafted += static_cast<double>(p.measured_drafted);
    if (p.calibrated_tpt() > 0) {
      out.calibrated_seconds += p.measured_seconds;
      calibrated_tokens += static_cast<double>(p.measured_tokens);
      calibrated_steps += p.measured_steps;
      calibrated_tokens_sq += p.measured_tokens_sq;
      calibrated_token_seconds += p.measured_token_seconds;
      calibrated_seconds_sq += p.measured_seconds_sq;
      calibrated_rate += p.calibrated_tpt() * p.measured_seconds;
      profile_plain += p.baseline_tpt * p.measured_seconds;
      measured_plain += p.measured_plain_tpt * p.measured_seconds;
    }
    if (p.draft_calibrated_tpt() > 0) {
      out.draft_calibrated_seconds += p.measured_seconds;
      draft_tokens += static_cast<double>(p.measured_tokens);
      draft_rate += p.draft_calibrated_tpt() * p.measured_seconds;
      draft_cost += p.draft_cost_ratio * p.measured_seconds;
    }
  }
  if (out.steps == 0) return out;
  const double steps = static_cast<double>(out.steps);
  out.predicted_tpt = weighted_rate / seconds;
  out.measured_tpt = tokens / seconds;
  out.predicted_tokens_per_step = predicted_tokens / steps;
  out.measured_tokens_per_step = tokens / steps;
  out.predicted_step_seconds = predicted_seconds / steps;
  out.measured_step_seconds = seconds / steps;
  out.planned_drafts_per_step = planned_drafts / steps;
  out.measured_drafts_per_step = drafted / steps;
  if (out.calibrated_seconds > 0) {
    const double s = out.calibrated_seconds;
    out.calibrated_tpt = calibrated_rate / s;
    out.calibrated_measured_tpt = calibrated_tokens / s;
    out.calibrated_measured_standard_error = RateStandardError(
        calibrated_steps, calibrated_tokens, s, calibrated_tokens_sq,
        calibrated_token_seconds, calibrated_seconds_sq);
    out.profile_plain_tpt = profile_plain / s;
    out.measured_plain_tpt = measured_plain / s;
  }
  if (out.draft_calibrated_seconds > 0) {
    const double s = out.draft_calibrated_seconds;
    out.draft_cost_ratio = draft_cost / s;
    out.draft_calibrated_tpt = draft_rate / s;
    out.draft_calibrated_measured_tpt = draft_tokens / s;
  }
  return out;
}

nlohmann::json PlanPredictionJson(const PlanPrediction& p) {
  return {{"plans", p.plans},
          {"steps", p.steps},
          {"beside_solve_steps", p.beside_solve_steps},
          {"beside_solve_seconds", p.beside_solve_seconds},
          {"unsteady_steps", p.unsteady_steps},
          {"unsteady_seconds", p.unsteady_seconds},
          {"predicted_tpt", p.predicted_tpt},
          {"measured_tpt", p.measured_tpt},
          {"error", p.error()},
          {"predicted_tokens_per_step", p.predicted_tokens_per_step},
          {"measured_tokens_per_step", p.measured_tokens_per_step},
          {"predicted_step_seconds", p.predicted_step_seconds},
          {"measured_step_seconds", p.measured_step_seconds},
          {"planned_drafts_per_step", p.planned_drafts_per_step},
          {"measured_drafts_per_step", p.measured_drafts_per_step},
          {"calibrated_seconds", p.calibrated_seconds},
          {"calibrated_tpt", p.calibrated_tpt},
          {"calibrated_measured_tpt", p.calibrated_measured_tpt},
          {"calibrated_measured_standard_error",
           p.calibrated_measured_standard_error},
          {"calibrated_error", p.calibrated_error()},
          {"profile_plain_tpt", p.profile_plain_tpt},
          {"measured_plain_tpt", p.measured_plain_tpt},
          {"draft_calibrated_seconds", p.draft_calibrated_seconds},
          {"draft_cost_ratio", p.draft_cost_ratio},
          {"draft_calibrated_tpt", p.draft_calibrated_tpt},
          {"draft_calibrated_measured_tpt", p.draft_calibrated_measured_tpt},
          {"draft_calibrated_error", p.draft_calibrated_error()}};
}

void AccumulatePlanning(PlanningStats& a, const PlanningStats& b) {
  a.cache_hits += b.cache_hits;
  a.cache_misses += b.cache_misses;
  a.triggers_no_plan += b.triggers_no_plan;
  a.triggers_new_bucket += b.triggers_new_bucket;
  a.triggers_drift += b.triggers_drift;
  a.triggers_recheck += b.triggers_recheck;
  a.budget_deferrals += b.budget_deferrals;
  a.solve_seconds += b.solve_seconds;
  a.guard_checks += b.guard_checks;
  a.guard_fallbacks += b.guard_fallbacks;
  a.guard_probe_steps += b.guard_probe_steps;
  a.guard_plain_steps += b.guard_plain_steps;
  a.guard_inherited_steps += b.guard_inherited_steps;
  a.guard_carried_steps += b.guard_carried_steps;
  a.guard_settle_steps += b.guard_settle_steps;
  a.guard_confirmations += b.guard_confirmations;
  a.guard_cleared_losses += b.guard_cleared_losses;
  if (b.guard_checks > 0) {
    a.guard_last_spec_tps = b.guard_last_spec_tps;
    a.guard_last_plain_tps = b.guard_last_plain_tps;
  }
  a.process_planner_cpu_share = b.process_planner_cpu_share;
  a.profile_pending = a.profile_pending || b.profile_pending;
  a.profile_pending_steps += b.profile_pending_steps;
}

namespace {

// Waits (at most a minute: a planner that yields the cores may take long)
// until no solve of `shared` is in flight; says so on stderr when it gives
// up (the next runs then share the cores with that solve).
void AwaitSolves(const PlanningShared& shared) {
  const absl::Time deadline = absl::Now() + absl::Minutes(1);
  while (shared.budget->solves_in_flight() > 0) {
    if (absl::Now() >= deadline) {
      std::fprintf(stderr,
                   "bench: a plan solve is still running after a minute; the "
                   "next runs share the cores with it\n");
      return;
    }
    absl::SleepFor(absl::Milliseconds(2));
  }
}

}  // namespace

absl::StatusOr<std::vector<std::vector<PromptRun>>> RunModes(
    const LlamaModel& model, const Tokenizer& tokenizer,
    const std::vector<BenchInput>& inputs,
    const std::vector<GenerationRequest>& requests, int repeats, bool warmup,
    const std::vector<PlannerClient*>& planners, bool warm_plan_cache,
    std::shared_ptr<const DomainRouter> router) {
  auto planner_of = [&](size_t mode) {
    return mode < planners.size() ? planners[mode] : nullptr;
  };
  repeats = std::max(1, repeats);
  const size_t num_modes = requests.size();
  // Each mode plans on its own (cache, budget, verdicts, draft costs), but
  // plain decoding's rate is the process's, fed by every mode's plain steps
  // (off's above all), as in one server that serves them all.
  std::vector<PlanningShared> planning(num_modes);
  auto fresh_planning = [&] {
    const auto plain_rates = std::make_shared<StepTimeTable>();
    for (PlanningShared& shared : planning) {
      shared = PlanningShared::Create(absl::GetFlag(FLAGS_plan_refine_trials));
      shared.plain_rates = plain_rates;
      shared.router = router;
    }
  };
  fresh_planning();
  if (warmup && !inputs.empty()) {
    PlanningShared warmup_planning =
        PlanningShared::Create(absl::GetFlag(FLAGS_plan_refine_trials));
    warmup_planning.router = router;
    for (size_t k = 0; k < requests.size(); ++k) {
      GenerationRequest short_request = requests[k];
      short_request.prompt_ids = inputs[0].ids;
      short_request.max_new_tokens =
          std::min<int64_t>(requests[k].max_new_tokens, 16);
      RETURN_IF_ERROR(Generate(model, tokenizer, short_request, nullptr,
                               nullptr, planner_of(k), &warmup_planning)
                          .status());
      AwaitSolves(warmup_planning);  // not into the first timed run
    }
  }
  if (warm_plan_cache) {
    for (size_t k = 0; k < num_modes; ++k) {
      for (const BenchInput& input : inputs) {
        GenerationRequest request = requests[k];
        request.prompt_ids = input.ids;
        RETURN_IF_ERROR(Generate(model, tokenizer, request, nullptr, nullptr,
                                 planner_of(k), &planning[k])
                            .status());
      }
      // The steady state: the solves this pass started have answered (else
      // a timed run finds the bucket without a plan and solves again).
      AwaitSolves(planning[k]);
    }
  }
  // results[prompt][mode][repeat]
  std::vector<std::vector<std::vector<GenerationResult>>> results(
      inputs.size(), std::vector<std::vector<GenerationResult>>(num_modes));
  auto run_one = [&](size_t p, size_t mode) -> absl::Status {
    GenerationRequest request = requests[mode];
    request.prompt_ids = inputs[p].ids;
    ASSIGN_OR_RETURN(GenerationResult result,
                     Generate(model, tokenizer, request, nullptr, nullptr,
                              planner_of(mode), &planning[mode]));
    results[p][mode].push_back(std::move(result));
    // A solve this run started and that outlives it finishes before the
    // next run starts (untimed): a mode's solves then slow its own runs,
    // never the next mode's (nor the plain steps it adds to the plain
    // rates).
    AwaitSolves(planning[mode]);
    return absl::OkStatus();
  };
  if (warm_plan_cache) {
    // Steady state: the repeats of a prompt back to back.
    for (size_t p = 0; p < inputs.size(); ++p) {
      for (int r = 0; r < repeats; ++r) {
        for (size_t k = 0; k < num_modes; ++k) {
          RETURN_IF_ERROR(run_one(p, r % 2 == 0 ? k : num_modes - 1 - k));
        }
      }
    }
  } else {
    // Cold: every repeat is a pass over all prompts from an empty plan cache
    // (fresh PlanningShared per mode), so no repeat plans with another's
    // solves.
    for (int r = 0; r < repeats; ++r) {
      if (r > 0) fresh_planning();
      for (size_t p = 0; p < inputs.size(); ++p) {
        for (size_t k = 0; k < num_modes; ++k) {
          RETURN_IF_ERROR(run_one(p, (r + p) % 2 == 0 ? k : num_modes - 1 - k));
        }
      }
    }
  }
  std::vector<std::vector<PromptRun>> runs(
      num_modes, std::vector<PromptRun>(inputs.size()));
  for (size_t p = 0; p < inputs.size(); ++p) {
    for (size_t mode = 0; mode < num_modes; ++mode) {
      std::vector<GenerationResult>& reps = results[p][mode];
      for (const GenerationResult& rep : reps) {
        if (requests[mode].sampling.greedy() &&
            rep.output_ids != reps[0].output_ids) {
          return absl::InternalError(
              absl::StrCat("prompt ", inputs[p].prompt.question_id,
                           ": greedy output differs between repeats of the "
                           "same mode (nondeterminism)"));
        }
      }
      // The repeat with the median decode time carries the time split.
      std::vector<size_t> order(reps.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = i;
      std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
        return reps[a].stats.decode_seconds < reps[b].stats.decode_seconds;
      });
      const GenerationResult& median = reps[order[order.size() / 2]];
      std::vector<double> prefill, decode;
      PromptRun& run = runs[mode][p];
      for (const GenerationResult& rep : reps) {
        prefill.push_back(rep.stats.prefill_seconds);
        decode.push_back(rep.stats.decode_seconds);
        run.repeat_decode_seconds.push_back(rep.stats.decode_seconds);
        run.repeat_decoded_tokens.push_back(
            std::max<int64_t>(0, rep.stats.completion_tokens - 1));
      }
      run.output_ids = median.output_ids;
      run.decoded_tokens =
          std::max<int64_t>(0, median.stats.completion_tokens - 1);
      run.prefill_seconds = Median(prefill);
      run.decode_seconds = Median(decode);
      run.draft_seconds = median.stats.draft_seconds;
      run.verify_seconds = median.stats.verify_seconds;
      run.speculation = median.speculation;
      run.plans = median.plans;
      run.waiting_seconds = median.stats.waiting_seconds;
      run.plan_requests = median.stats.plan_requests;
      run.planning = median.planning;
      run.routed_domain = median.routed_domain;
      run.routing_seconds = median.stats.routing_seconds;
    }
  }
  return runs;
}

double Quantile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const double rank = q * static_cast<double>(values.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(values.size() - 1, lo + 1);
  return values[lo] +
         (rank - static_cast<double>(lo)) * (values[hi] - values[lo]);
}

PairedSpeedup PairedSpeedupOf(const std::vector<PromptRun>& base,
                              const std::vector<PromptRun>& runs) {
  return PairedSpeedupOfMean({&base}, runs);
}

PairedSpeedup PairedSpeedupOfMean(
    const std::vector<const std::vector<PromptRun>*>& bases,
    const std::vector<PromptRun>& runs) {
  auto rate = [](const PromptRun& run, size_t k) {
    return k < run.repeat_decode_seconds.size() &&
                   k < run.repeat_decoded_tokens.size() &&
                   run.repeat_decode_seconds[k] > 0
               ? run.repeat_decoded_tokens[k] / run.repeat_decode_seconds[k]
               : 0.0;
  };
  std::vector<double> ratios;
  for (size_t p = 0; p < runs.size() && !bases.empty(); ++p) {
    const PromptRun& r = runs[p];
    for (size_t k = 0; k < r.repeat_decode_seconds.size(); ++k) {
      const double mode_rate = rate(r, k);
      double base_sum = 0;
      bool complete = mode_rate > 0;
      for (const std::vector<PromptRun>* base : bases) {
        const double base_rate = p < base->size() ? rate((*base)[p], k) : 0.0;
        complete = complete && base_rate > 0;
        base_sum += base_rate;
      }
      if (complete) {
        ratios.push_back(mode_rate /
                         (base_sum / static_cast<double>(bases.size())));
      }
    }
  }
  PairedSpeedup out;
  out.pairs = static_cast<int>(ratios.size());
  out.median = Quantile(ratios, 0.5);
  out.q25 = Quantile(ratios, 0.25);
  out.q75 = Quantile(ratios, 0.75);
  std::tie(out.ci95_low, out.ci95_high) = MedianInterval95(std::move(ratios));
  return out;
}

std::pair<double, double> MedianInterval95(std::vector<double> values) {
  const size_t n = values.size();
  const double count = static_cast<double>(n);
  // P(Binomial(n, 1/2) = i) = C(n, i) / 2^n in log space (n may be in the
  // thousands); k is the largest rank with P(X <= k - 1) <= 0.025.
  const double log_scale = std::lgamma(count + 1) + count * std::log(0.5);
  double below = 0;  // P(X <= i)
  size_t k = 0;
  for (size_t i = 0; i < n; ++i) {
    const double x = static_cast<double>(i);
    below +=
        std::exp(log_scale - std::lgamma(x + 1) - std::lgamma(count - x + 1));
    if (below > 0.025) break;
    k = i + 1;
  }
  if (k == 0) return {0, 0};
  std::sort(values.begin(), values.end());
  return {values[k - 1], values[n - k]};
}

std::vector<size_t> AdjacentBaselines(const std::vector<bool>& is_baseline,
                                      size_t k) {
  std::vector<size_t> out;
  if (k > 0 && k - 1 < is_baseline.size() && is_baseline[k - 1]) {
    out.push_back(k - 1);
  }
  if (k + 1 < is_baseline.size() && is_baseline[k + 1]) out.push_back(k + 1);
  if (!out.empty()) return out;
  // The nearest on each side.
  for (size_t j = std::min(k, is_baseline.size()); j-- > 0;) {
    if (is_baseline[j]) {
      out.push_back(j);
      break;
    }
  }
  for (size_t j = k + 1; j < is_baseline.size(); ++j) {
    if (is_baseline[j]) {
      out.push_back(j);
      break;
    }
  }
  return out;
}

PeakSampler::PeakSampler(std::function<Sample()> sample,
                         absl::Duration interval)
    : sample_(std::move(sample)) {
  Take();  // the first sample before the constructor returns
  thread_ = std::thread([this, interval] {
    while (!stop_.WaitForNotificationWithTimeout(interval)) Take();
  });
}

PeakSampler::~PeakSampler() {
  if (thread_.joinable()) Stop();
}

PeakSampler::Sample PeakSampler::Stop() {
  stop_.Notify();
  thread_.join();
  Take();
  absl::MutexLock lock(&mu_);
  return peaks_;
}

void PeakSampler::Take() {
  const Sample now = sample_();
  absl::MutexLock lock(&mu_);
  if (peaks_.empty()) {
    peaks_ = now;
    return;
  }
  if (now.size() != peaks_.size()) return;
  for (size_t k = 0; k < now.size(); ++k) {
    peaks_[k] = std::max(peaks_[k], now[k]);
  }
}

int64_t ResidentSetBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size_pages = 0, resident_pages = 0;
  if (!(statm >> size_pages >> resident_pages)) return 0;
  return resident_pages * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

}  // namespace knapserve
