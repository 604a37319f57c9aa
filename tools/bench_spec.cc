// `knapserve bench spec`: autoregressive decoding (--spec off) against
// self-speculative decoding with a static mask (--spec static --skip MASK),
// on the same prompts in one run, greedy and fixed-length (ignore_eos).
//
// Per mode it reports the aggregate decode rate (tokens decoded / decode
// seconds over all prompts), the speedup over off, acceptance rate, mean
// acceptance length (tokens committed per verification) and the share of
// decode time spent drafting and verifying. Greedy speculative decoding is
// lossless, so the static output ids must equal the off output ids on every
// prompt; so must sampled ones with coupled draws (--temperature with a seed:
// bench spec seeds with 0 unless --seed is given, and --draft-acceptance
// rejection switches coupling off). A mismatch is reported and makes the
// command exit 1.
//
// --search-masks first looks for a good static mask by greedy forward
// selection, measured with the same code: start from skipping nothing; each
// round times every one-more-sublayer (or, with --search-whole-layers,
// one-more-layer) candidate on a few calibration prompts
// and keeps the fastest if it beats the current mask by --search-min-gain both
// in that round and in a re-measurement of the two (more repeats, off timed
// beside them); stop when none does. Gains are paired per prompt (median of
// time ratios) so drift in machine speed cancels. Like the KnapSpec reference
// code, the first and last layer are not skipped unless --search-edge-layers.
// The path and the best mask are printed, then the comparison runs with that
// mask on the --num-prompts prompts.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/base/status.h"
#include "common/model/layer_mask.h"
#include "common/model/simd_target.h"
#include "executor/engine/sampler.h"
#include "planner/inprocess_planner.h"
#include "tools/bench_util.h"
#include "tools/cli_flags.h"
#include "tools/commands.h"
#include "tools/domain_anchors.h"

ABSL_FLAG(std::vector<std::string>, mix_ratios,
          std::vector<std::string>({"0", "0.3", "0.7", "1"}),
          "bench spec --domains: the mixed-domain streams to run. Ratio r "
          "shuffles a random r of the stream's positions among themselves: "
          "0 is task by task (each domain's prompts in a block), 1 a "
          "uniform shuffle.");

namespace knapserve {
namespace {

// The request every mode shares: fixed length, no stop strings; sampling
// (greedy unless --temperature is given; seed 0 unless --seed is) and the
// speculation knobs (--max-draft, --exit-threshold) from the flags.
absl::StatusOr<GenerationRequest> BaseRequest(int64_t max_new_tokens) {
  ASSIGN_OR_RETURN(GenerationRequest request, GenerationRequestFromFlags({}));
  request.max_new_tokens = max_new_tokens;
  request.ignore_eos = true;
  if (!request.sampling.seed.has_value()) request.sampling.seed = 0;
  request.stop_strings.clear();
  request.stop_token_ids.clear();
  return request;
}

GenerationRequest WithMode(GenerationRequest request, SpeculationMode mode,
                           const std::string& skip) {
  request.speculation.mode = mode;
  request.speculation.skip = skip;
  return request;
}

// The first index where a and b differ, or nullopt if equal.
std::optional<size_t> FirstDifference(const std::vector<int32_t>& a,
                                      const std::vector<int32_t>& b) {
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    if (a[i] != b[i]) return i;
  }
  if (a.size() != b.size()) return n;
  return std::nullopt;
}

nlohmann::json ModeJson(const ModeSummary& s, double off_rate) {
  const double rate = s.decode_tokens_per_second();
  return {{"decode_tokens_per_s", rate},
          {"speedup", off_rate > 0 ? rate / off_rate : 0.0},
          {"decoded_tokens", s.decoded_tokens},
          {"decode_seconds", s.decode_seconds},
          {"draft_seconds", s.draft_seconds},
          {"verify_seconds", s.verify_seconds},
          {"draft_share", s.draft_share()},
          {"verify_share", s.verify_share()},
          {"drafts", s.speculation.drafts},
          {"draft_tokens", s.speculation.draft_tokens},
          {"accepted_tokens", s.speculation.accepted_tokens},
          {"accepted_per_position", s.speculation.accepted_per_position},
          {"acceptance_rate", s.speculation.acceptance_rate()},
          {"mean_acceptance_length", s.speculation.mean_acceptance_length()}};
}

// A SpecBound mode's settings and exit statistics.
nlohmann::json SpecBoundJson(const GenerationRequest& request,
                             const SpeculationStats& s) {
  const SpecBoundConfig& c = request.speculation.specbound;
  return {{"heads", c.trained_heads ? "trained" : "training-free"},
          {"lambda", c.lambda},
          {"t0", c.t0},
          {"depth_bound", c.depth_bound},
          {"width_bound", request.speculation.max_draft},
          {"check_every", c.check_every},
          {"mean_exit_depth", s.mean_exit_depth()},
          {"exit_depths", s.exit_depths},
          {"depth_bound_stops", s.depth_bound_stops},
          {"width_bound_stops", s.width_bound_stops}};
}

// Progress and tables go to stdout, or to stderr when stdout carries JSON.
FILE* TextOut(bool json) { return json ? stderr : stdout; }

struct SearchStep {
  int round = 0;
  std::string mask;    // the mask after this round
  std::string added;   // the sublayer added this round ("" for round 0)
  double rate = 0;     // decode tok/s of `mask` on the calibration prompts
  double speedup = 0;  // over off, measured in the same run (PairedGain)
  double acceptance_rate = 0;
  double mean_acceptance_length = 0;
};

struct SearchResult {
  LayerMask best;
  double off_rate = 0;
  std::vector<SearchStep> path;
  std::string stop_reason;
  std::vector<std::string>
      lossless_failures;  // "mask / prompt" pairs that differed from off
};

// How much faster `runs` decode than `base` (the same prompts, measured in
// one interleaved RunModes call): the median over the prompt x repeat pairs
// (PairedSpeedupOf), which cancel drift that an aggregate would not.
double PairedGain(const std::vector<PromptRun>& base,
                  const std::vector<PromptRun>& runs) {
  return PairedSpeedupOf(base, runs).median;
}

std::string SublayerName(int sublayer) {
  return absl::StrCat(sublayer % 2 == 0 ? "a" : "m", sublayer / 2);
}

// Greedy forward selection of a static mask (see the file comment).
absl::StatusOr<SearchResult> SearchMask(const LlamaModel& model,
                                        const Tokenizer& tokenizer, bool json) {
  FILE* out = TextOut(json);
  const int64_t tokens = absl::GetFlag(FLAGS_search_tokens);
  const int repeats = std::max(1, absl::GetFlag(FLAGS_repeats));
  const double min_gain = absl::GetFlag(FLAGS_search_min_gain);
  const int max_steps = absl::GetFlag(FLAGS_search_max_steps);
  ASSIGN_OR_RETURN(
      std::vector<BenchInput> calibration,
      LoadBenchInputs(model, tokenizer, absl::GetFlag(FLAGS_search_prompts),
                      tokens));
  ASSIGN_OR_RETURN(GenerationRequest base, BaseRequest(tokens));
  const int num_layers = model.num_layers();
  // Each candidate step skips one sublayer, or with --search-whole-layers both
  // sublayers of one layer (bigger steps: a single sublayer of a deep model
  // can be below the timing noise).
  std::vector<std::vector<int>> pool;
  const bool edges = absl::GetFlag(FLAGS_search_edge_layers) || num_layers <= 2;
  const bool whole_layers = absl::GetFlag(FLAGS_search_whole_layers);
  for (int layer = 0; layer < num_layers; ++layer) {
    if (!edges && (layer == 0 || layer == num_layers - 1)) continue;
    if (whole_layers) {
      pool.push_back({2 * layer, 2 * layer + 1});
    } else {
      pool.push_back({2 * layer});
      pool.push_back({2 * layer + 1});
    }
  }

  SearchResult result;
  result.best = LayerMask(num_layers);
  // Confirmation runs use more repeats: the winner of many noisy candidates is
  // biased upward, and a wrong step is never undone.
  const int confirm_repeats = std::max(3, 2 * repeats + 1);
  // Round 0: off (the reference ids and the speedup baseline) and the empty
  // mask.
  ASSIGN_OR_RETURN(std::vector<std::vector<PromptRun>> first,
                   RunModes(model, tokenizer, calibration,
                            {WithMode(base, SpeculationMode::kOff, ""),
                             WithMode(base, SpeculationMode::kStatic, "")},
                            confirm_repeats, /*warmup=*/true));
  std::vector<std::vector<int32_t>> reference;
  for (const PromptRun& run : first[0]) reference.push_back(run.output_ids);
  result.off_rate = Summarize(first[0]).decode_tokens_per_second();
  auto check = [&](const std::string& mask,
                   const std::vector<PromptRun>& runs) {
    for (size_t p = 0; p < runs.size(); ++p) {
      if (runs[p].output_ids != reference[p]) {
        result.lossless_failures.push_back(absl::StrCat(
            "mask '", mask, "' prompt ", calibration[p].prompt.question_id));
      }
    }
  };
  check("", first[1]);
  // off_runs: off measured in the same interleaved run as `runs`.
  auto add_step = [&](int round, const std::string& added,
                      const std::vector<PromptRun>& off_runs,
                      const std::vector<PromptRun>& runs) {
    const ModeSummary s = Summarize(runs);
    SearchStep step{round,
                    result.best.ToString(),
                    added,
                    s.decode_tokens_per_second(),
                    PairedGain(off_runs, runs),
                    s.speculation.acceptance_rate(),
                    s.speculation.mean_acceptance_length()};
    result.path.push_back(step);
    std::fprintf(out, "%5d %7d %-28s %10.1f %7.2fx %7.2f %8.2f\n", round,
                 result.best.num_skipped(),
                 step.mask.empty() ? "-" : step.mask.c_str(), step.rate,
                 step.speedup, step.acceptance_rate,
                 step.mean_acceptance_length);
    std::fflush(out);
  };
  std::fprintf(
      out,
      "mask search: %zu calibration prompts x %lld tokens, %zu candidate %s, "
      "min gain %.1f%%, %d repeats (%d to confirm); off: %.1f tok/s\n",
      calibration.size(), static_cast<long long>(tokens), pool.size(),
      whole_layers ? "layers" : "sublayers", 100 * min_gain, repeats,
      confirm_repeats, result.off_rate);
  std::fprintf(out, "%5s %7s %-28s %10s %8s %7s %8s\n", "round", "skipped",
               "mask", "tok/s", "vs off", "accept", "mean len");
  add_step(0, "", first[0], first[1]);

  for (int round = 1;; ++round) {
    if (max_steps > 0 &&
        static_cast<int>(result.path.size()) - 1 >= max_steps) {
      result.stop_reason =
          absl::StrCat("reached --search-max-steps ", max_steps);
      break;
    }
    std::vector<const std::vector<int>*> candidates;
    const GenerationRequest current =
        WithMode(base, SpeculationMode::kStatic, result.best.ToString());
    std::vector<GenerationRequest> requests = {current};
    for (const std::vector<int>& step : pool) {
      if (result.best.skipped(step[0])) continue;
      LayerMask mask = result.best;
      for (int s : step) mask.set_skipped(s, true);
      candidates.push_back(&step);
      requests.push_back(
          WithMode(base, SpeculationMode::kStatic, mask.ToString()));
    }
    if (candidates.empty()) {
      result.stop_reason = "no sublayer left to skip";
      break;
    }
    ASSIGN_OR_RETURN(
        std::vector<std::vector<PromptRun>> runs,
        RunModes(model, tokenizer, calibration, requests, repeats, false));
    size_t best = 0;
    std::vector<double> gains;
    for (size_t i = 0; i < candidates.size(); ++i) {
      check(requests[i + 1].speculation.skip, runs[i + 1]);
      gains.push_back(PairedGain(runs[0], runs[i + 1]));
      if (gains[i] > gains[best]) best = i;
    }
    std::string name;
    for (int sublayer : *candidates[best]) {
      absl::StrAppend(&name, name.empty() ? "" : ",", SublayerName(sublayer));
    }
    if (gains[best] <= 1 + min_gain) {
      result.stop_reason = absl::StrFormat(
          "no candidate improves: best +%s at %.3fx of the current mask", name,
          gains[best]);
      break;
    }
    ASSIGN_OR_RETURN(std::vector<std::vector<PromptRun>> confirm,
                     RunModes(model, tokenizer, calibration,
                              {WithMode(base, SpeculationMode::kOff, ""),
                               current, requests[best + 1]},
                              confirm_repeats, false));
    const double confirm_gain = PairedGain(confirm[1], confirm[2]);
    if (confirm_gain <= 1 + min_gain) {
      result.stop_reason = absl::StrFormat(
          "no candidate improves: best +%s at %.3fx of the current mask, %.3fx "
          "re-measured",
          name, gains[best], confirm_gain);
      break;
    }
    for (int sublayer : *candidates[best])
      result.best.set_skipped(sublayer, true);
    add_step(round, name, confirm[0], confirm[2]);
  }
  std::fprintf(out, "search stopped: %s\nbest mask: %s\n",
               result.stop_reason.c_str(),
               result.best.empty() ? "(none)" : result.best.ToString().c_str());
  std::fflush(out);
  return result;
}

// The prompts of --domains (--split, default test: the half `anchors`
// did not see by default), --num-prompts per domain (all when <= 0), each
// labelled with its domain as its category, in domain order.
absl::StatusOr<std::vector<BenchInput>> LoadDomainInputs(
    const LlamaModel& model, const Tokenizer& tokenizer,
    int64_t max_new_tokens) {
  ASSIGN_OR_RETURN(std::vector<DomainSource> sources,
                   ParseDomainSources(absl::GetFlag(FLAGS_domains)));
  const std::string split_name = absl::GetFlag(FLAGS_split);
  ASSIGN_OR_RETURN(SampleSplit split,
                   ParseSampleSplit(split_name.empty() ? "test" : split_name));
  ASSIGN_OR_RETURN(
      std::vector<DomainSamples> domains,
      LoadDomainSamples(sources, split, absl::GetFlag(FLAGS_num_prompts)));
  const int64_t room = model.max_context() - max_new_tokens;
  if (room < 1) {
    return absl::InvalidArgumentError(
        "--max-new-tokens leaves no room for a prompt");
  }
  std::vector<BenchInput> inputs;
  for (const DomainSamples& domain : domains) {
    for (const std::string& text : domain.texts) {
      BenchInput input;
      input.prompt.question_id = static_cast<int64_t>(inputs.size());
      input.prompt.category = domain.name;
      input.prompt.text = text;
      ASSIGN_OR_RETURN(input.ids, PromptIds(tokenizer, text, 1, room));
      inputs.push_back(std::move(input));
    }
  }
  return inputs;
}

// The mixed-domain stream of mix ratio `ratio` (see --mix-ratios): a fixed
// random choice (seed 1) of round(ratio * n) positions of the task-by-task
// stream, whose prompts are shuffled among themselves.
std::vector<BenchInput> MixedStream(const std::vector<BenchInput>& blocks,
                                    double ratio) {
  std::mt19937 rng(1);
  std::vector<size_t> positions(blocks.size());
  for (size_t i = 0; i < positions.size(); ++i) positions[i] = i;
  std::shuffle(positions.begin(), positions.end(), rng);
  positions.resize(static_cast<size_t>(
      std::lround(ratio * static_cast<double>(blocks.size()))));
  std::vector<size_t> moved = positions;
  std::shuffle(moved.begin(), moved.end(), rng);
  std::vector<BenchInput> stream = blocks;
  for (size_t i = 0; i < positions.size(); ++i)
    stream[positions[i]] = blocks[moved[i]];
  return stream;
}

struct BenchMode {
  std::string name;
  GenerationRequest request;
  PlannerClient* planner = nullptr;  // planned modes: where plans come from
};

// Mean number of skipped attention and MLP sublayers over `plans` that draft.
std::pair<double, double> MeanSkipped(const std::vector<AppliedPlan>& plans,
                                      int num_layers) {
  double attention = 0, mlp = 0;
  int counted = 0;
  for (const AppliedPlan& p : plans) {
    if (p.gamma == 0) continue;
    auto mask = LayerMask::Parse(p.mask, num_layers);
    if (!mask.ok()) continue;
    for (int i = 0; i < num_layers; ++i) {
      attention += mask->skip_attention(i) ? 1 : 0;
      mlp += mask->skip_mlp(i) ? 1 : 0;
    }
    ++counted;
  }
  if (counted == 0) return {0, 0};
  return {attention / counted, mlp / counted};
}

// Runs every mode on `inputs` (interleaved), checks each against off and
// prints one table in the style of the KnapSpec paper's Table 2.
absl::StatusOr<nlohmann::json> RunSet(
    const std::string& label, const LlamaModel& model,
    const Tokenizer& tokenizer, const std::vector<BenchInput>& inputs,
    const std::vector<BenchMode>& modes, int repeats, FILE* out,
    std::vector<std::string>* failures,
    const std::shared_ptr<const DomainRouter>& router) {
  std::vector<GenerationRequest> requests;
  std::vector<PlannerClient*> planners;
  for (const BenchMode& m : modes) {
    requests.push_back(m.request);
    planners.push_back(m.planner);
  }
  ASSIGN_OR_RETURN(
      std::vector<std::vector<PromptRun>> runs,
      RunModes(model, tokenizer, inputs, requests, repeats, /*warmup=*/true,
               planners, absl::GetFlag(FLAGS_warm_plan_cache), router));
  int64_t prompt_tokens = 0;
  for (const BenchInput& input : inputs)
    prompt_tokens += static_cast<int64_t>(input.ids.size());
  std::fprintf(out, "\n[%s] %zu prompts, mean prompt %lld tokens\n",
               label.c_str(), inputs.size(),
               static_cast<long long>(
                   inputs.empty() ? 0 : prompt_tokens / inputs.size()));
  // "pred TPT" against "plan TPT": the plans' promise against what their
  // drafting steps measured (SummarizePredictions); tok/s is the whole run,
  // the steps before the first plan and the guard's plain steps included.
  std::fprintf(out, "%-9s %8s %8s %7s %7s %6s %9s %9s %7s %7s %5s %6s\n",
               "mode", "tok/s", "speedup", "accept", "meanlen", "plans",
               "pred TPT", "plan TPT", "solve%", "wait%", "age", "same");
  const ModeSummary off = Summarize(runs[0]);
  const double off_rate = off.decode_tokens_per_second();
  // Each mode against the off runs just before and after it when the list
  // puts off there (--modes off,static,off,knapspec,off: a prompt's modes
  // run in list order or in reverse), else against the nearest off run on
  // each side (AdjacentBaselines); the first off against itself.
  std::vector<bool> is_off;
  for (const BenchMode& m : modes) {
    is_off.push_back(m.request.speculation.mode == SpeculationMode::kOff);
  }
  std::vector<PairedSpeedup> paired_with_off;
  std::vector<std::vector<std::string>> paired_bases;
  for (size_t k = 0; k < runs.size(); ++k) {
    const std::vector<size_t> bases =
        k == 0 ? std::vector<size_t>{0} : AdjacentBaselines(is_off, k);
    std::vector<const std::vector<PromptRun>*> base_runs;
    paired_bases.emplace_back();
    for (const size_t j : bases) {
      base_runs.push_back(&runs[j]);
      paired_bases.back().push_back(modes[j].name);
    }
    paired_with_off.push_back(PairedSpeedupOfMean(base_runs, runs[k]));
  }
  nlohmann::json set = {{"prompts", inputs.size()},
                        {"modes", nlohmann::json::object()}};
  // Greedy and coupled sampling (the default with a seed) are compared id
  // for id. Rejection-sampled outputs legitimately differ from off's (they
  // draw other random numbers; their distribution is the model's, which
  // SamplingLosslessTest checks statistically).
  const bool compared = modes[0].request.sampling.greedy() ||
                        CoupledDraws(modes[0].request.sampling);
  for (size_t k = 0; k < modes.size(); ++k) {
    int differing = 0;
    for (size_t p = 0; p < inputs.size() && compared; ++p) {
      const std::optional<size_t> diff =
          FirstDifference(runs[0][p].output_ids, runs[k][p].output_ids);
      if (diff) {
        ++differing;
        failures->push_back(absl::StrCat(
            label, " / ", modes[k].name, ": prompt ",
            inputs[p].prompt.question_id, " (", inputs[p].prompt.category,
            ") first differs at output ", *diff));
      }
    }
    const ModeSummary m = Summarize(runs[k]);
    const double rate = m.decode_tokens_per_second();
    double predicted = 0, age = 0;
    for (const AppliedPlan& p : m.plans) {
      predicted += p.predicted_tpt;
      age += static_cast<double>(p.age_steps);
    }
    // Solves of this mode's own requests (cached plans cost nothing).
    const double solve = m.planning.solve_seconds;
    const size_t n_plans = m.plans.size();
    if (n_plans > 0) {
      predicted /= static_cast<double>(n_plans);
      age /= static_cast<double>(n_plans);
    }
    const double solve_share =
        m.decode_seconds > 0 ? solve / m.decode_seconds : 0.0;
    const double wait_share =
        m.decode_seconds > 0 ? m.waiting_seconds / m.decode_seconds : 0.0;
    const auto [skipped_attention, skipped_mlp] =
        MeanSkipped(m.plans, model.num_layers());
    nlohmann::json mode_json = ModeJson(m, off_rate);
    const PairedSpeedup& paired = paired_with_off[k];
    mode_json["paired_speedup"] = {{"median", paired.median},
                                   {"q25", paired.q25},
                                   {"q75", paired.q75},
                                   {"ci95_low", paired.ci95_low},
                                   {"ci95_high", paired.ci95_high},
                                   {"pairs", paired.pairs},
                                   {"against", paired_bases[k]}};
    // Every run's own time, prompt by prompt in the set's order, repeats in
    // the order they ran: the pairs above can be formed again from them.
    nlohmann::json repeat_runs = nlohmann::json::array();
    for (const PromptRun& run : runs[k]) {
      repeat_runs.push_back({{"decode_seconds", run.repeat_decode_seconds},
                             {"decoded_tokens", run.repeat_decoded_tokens}});
    }
    mode_json["repeat_runs"] = std::move(repeat_runs);
    mode_json["plans_applied"] = n_plans;
    mode_json["plan_requests"] = m.plan_requests;
    mode_json["predicted_tpt"] = predicted;
    mode_json["measured_tpt"] = rate;
    const PlanPrediction prediction = SummarizePredictions(m.plans);
    mode_json["prediction"] = PlanPredictionJson(prediction);
    // Each plan of the median repeats, as `generate --json` lists them: what
    // a prediction miss came from (its odds, its steps).
    mode_json["plans"] = AppliedPlansJson(m.plans);
    mode_json["solve_seconds"] = solve;
    mode_json["solve_share"] = solve_share;
    mode_json["waiting_share"] = wait_share;
    mode_json["mean_plan_age_steps"] = age;
    mode_json["mean_skipped_attention"] = skipped_attention;
    mode_json["mean_skipped_mlp"] = skipped_mlp;
    mode_json["planning"] = PlanningJson(m.planning, m.decode_seconds);
    mode_json["plan_cache_hits"] = m.planning.cache_hits;
    if (compared) mode_json["same_ids"] = differing == 0;
    if (DraftsByEarlyExit(modes[k].request.speculation.mode)) {
      mode_json["specbound"] = SpecBoundJson(modes[k].request, m.speculation);
    }
    set["modes"][modes[k].name] = mode_json;
    const bool is_planned = n_plans > 0 || m.plan_requests > 0;
    std::fprintf(
        out, "%-9s %8.1f %7.2fx %7.3f %7.2f %6s %9s %9s %6s %6s %5s %6s\n",
        modes[k].name.c_str(), rate, off_rate > 0 ? rate / off_rate : 0.0,
        m.speculation.acceptance_rate(), m.speculation.mean_acceptance_length(),
        is_planned ? absl::StrCat(n_plans).c_str() : "-",
        prediction.steps > 0
            ? absl::StrFormat("%.1f", prediction.predicted_tpt).c_str()
        : n_plans > 0 ? absl::StrFormat("%.1f", predicted).c_str()
                      : "-",
        prediction.steps > 0
            ? absl::StrFormat("%.1f", prediction.measured_tpt).c_str()
            : "-",
        is_planned ? absl::StrFormat("%.1f%%", 100 * solve_share).c_str() : "-",
        is_planned ? absl::StrFormat("%.2f%%", 100 * wait_share).c_str() : "-",
        n_plans > 0 ? absl::StrFormat("%.1f", age).c_str() : "-",
        !compared        ? "-"
        : differing == 0 ? "yes"
                         : "NO");
  }
  // Each mode against off pair by pair (PairedSpeedupOfMean): robust to the
  // machine's drift during the set, where the aggregate speed-up above is
  // not; with off beside each mode in the list, against those off runs.
  std::fprintf(out,
               "paired with off (median of prompt x repeat, IQR, 95%% "
               "interval of the median):");
  for (size_t k = 1; k < modes.size(); ++k) {
    const PairedSpeedup& paired = paired_with_off[k];
    const std::string interval =
        paired.ci95_high > 0
            ? absl::StrFormat("%.3f-%.3f", paired.ci95_low, paired.ci95_high)
            : "under 6 pairs";
    std::fprintf(out, " %s %.3fx [%.3f-%.3f] (%s)", modes[k].name.c_str(),
                 paired.median, paired.q25, paired.q75, interval.c_str());
  }
  std::fprintf(out, "\n");
  // This run's noise floor: every off run after the first against its
  // nearest off runs, paired as the modes are. Nothing differs between
  // them, so how far these read from 1x is how far the machine moves a
  // mode's paired ratio with no change of its own.
  std::vector<double> off_against_off;
  for (size_t k = 1; k < modes.size(); ++k) {
    if (is_off[k] && paired_with_off[k].pairs > 0) {
      off_against_off.push_back(paired_with_off[k].median);
    }
  }
  if (!off_against_off.empty()) {
    const auto [low, high] =
        std::minmax_element(off_against_off.begin(), off_against_off.end());
    set["off_against_off"] = {
        {"min", *low}, {"max", *high}, {"runs", off_against_off.size()}};
    std::fprintf(out,
                 "off against off (each later off paired with its nearest "
                 "off runs; the run's noise floor): %.3fx-%.3fx over %zu\n",
                 *low, *high, off_against_off.size());
  }
  // Routed modes (knn): how often the prompt went to its own domain (the
  // prompt's category), and what routing cost against decoding.
  for (size_t k = 0; k < modes.size(); ++k) {
    if (!IsRouted(modes[k].request.speculation.mode)) continue;
    // Accuracy counts the prompts whose category is one of the anchors'
    // domains (the --domains sets; Spec-Bench's own categories need not be).
    int correct = 0, labelled = 0;
    double routing = 0;
    std::map<std::string, int> routed_to;
    for (size_t p = 0; p < inputs.size(); ++p) {
      const PromptRun& run = runs[k][p];
      bool known = false;
      for (const RoutedDomain& d : router->domains())
        known = known || d.name == inputs[p].prompt.category;
      if (known) {
        ++labelled;
        correct += run.routed_domain == inputs[p].prompt.category ? 1 : 0;
      }
      routing += run.routing_seconds;
      ++routed_to[run.routed_domain];
    }
    const ModeSummary m = Summarize(runs[k]);
    const double accuracy = labelled == 0 ? 0.0
                                          : static_cast<double>(correct) /
                                                static_cast<double>(labelled);
    const double share =
        m.decode_seconds > 0 ? routing / m.decode_seconds : 0.0;
    std::fprintf(
        out,
        "%s routing: %s; routing %.3f ms per request, %.3f%% of "
        "decode time\n",
        modes[k].name.c_str(),
        labelled == 0
            ? "no prompt is labelled with an anchors domain"
            : absl::StrFormat("%d of %d prompts to their own domain (%.1f%%)",
                              correct, labelled, 100 * accuracy)
                  .c_str(),
        inputs.empty() ? 0.0 : 1e3 * routing / inputs.size(), 100 * share);
    nlohmann::json& mode_json = set["modes"][modes[k].name];
    if (labelled > 0) mode_json["routing_accuracy"] = accuracy;
    mode_json["routing_seconds"] = routing;
    mode_json["routing_share"] = share;
    mode_json["routed_to"] = routed_to;
  }
  for (size_t k = 0; k < modes.size(); ++k) {
    const SpeculationConfig& spec = modes[k].request.speculation;
    if (!DraftsByEarlyExit(spec.mode)) continue;
    const SpeculationStats st = Summarize(runs[k]).speculation;
    std::fprintf(out,
                 "%s: %s heads, lambda %.2f, T0 %.2f, depth bound %d, width "
                 "%d, check every %d: mean exit depth %.2f of %d layers, "
                 "steps ended by the depth bound %lld, by the width bound "
                 "%lld\n",
                 modes[k].name.c_str(),
                 spec.specbound.trained_heads ? "trained" : "training-free",
                 spec.specbound.lambda, spec.specbound.t0,
                 spec.specbound.depth_bound > 0 ? spec.specbound.depth_bound
                                                : model.num_layers(),
                 spec.max_draft, spec.specbound.check_every,
                 st.mean_exit_depth(), model.num_layers(),
                 static_cast<long long>(st.depth_bound_stops),
                 static_cast<long long>(st.width_bound_stops));
  }
  for (size_t k = 0; k < modes.size(); ++k) {
    const ModeSummary m = Summarize(runs[k]);
    if (m.plans.empty()) continue;
    const auto [skipped_attention, skipped_mlp] =
        MeanSkipped(m.plans, model.num_layers());
    double context = 0;
    for (const AppliedPlan& p : m.plans)
      context += static_cast<double>(p.context_length);
    std::fprintf(out,
                 "%s plans: mean context %.0f, skipped attention %.2f and MLP "
                 "%.2f of %d layers "
                 "(plans that draft)\n",
                 modes[k].name.c_str(),
                 context / static_cast<double>(m.plans.size()),
                 skipped_attention, skipped_mlp, model.num_layers());
  }
  std::fflush(out);
  return set;
}

absl::Status BenchSpec() {
  ASSIGN_OR_RETURN(Engine engine, LoadEngineFromFlags());
  const LlamaModel& model = *engine.model;
  const Tokenizer& tokenizer = *engine.tokenizer;
  const bool json = absl::GetFlag(FLAGS_json);
  FILE* out = TextOut(json);
  const int64_t max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  const int repeats = std::max(1, absl::GetFlag(FLAGS_repeats));
  ASSIGN_OR_RETURN(GenerationRequest base, BaseRequest(max_new_tokens));
  ApplyExitHeads(engine, base.speculation);
  // Check the speculation flags up front, so a bad --skip fails before any
  // timing.
  {
    GenerationRequest check =
        WithMode(base, SpeculationMode::kStatic, absl::GetFlag(FLAGS_skip));
    check.prompt_ids = {0};
    RETURN_IF_ERROR(ValidateGenerationRequest(check, model));
  }
  ASSIGN_OR_RETURN(
      std::vector<BenchInput> inputs,
      LoadBenchInputs(model, tokenizer, absl::GetFlag(FLAGS_num_prompts),
                      max_new_tokens));

  nlohmann::json summary = {{"model", engine.model_dir},
                            {"dtype", DtypeName(model.dtype())},
                            {"threads", at::get_num_threads()},
                            {"simd", simd::CurrentTarget()},
                            {"num_layers", model.num_layers()},
                            {"max_new_tokens", max_new_tokens},
                            {"max_draft", base.speculation.max_draft},
                            {"exit_threshold", base.speculation.exit_threshold},
                            {"repeats", repeats}};
  std::string skip = absl::GetFlag(FLAGS_skip);
  std::vector<std::string> failures;
  if (absl::GetFlag(FLAGS_search_masks)) {
    ASSIGN_OR_RETURN(SearchResult search, SearchMask(model, tokenizer, json));
    nlohmann::json path = nlohmann::json::array();
    for (const SearchStep& step : search.path) {
      path.push_back({{"round", step.round},
                      {"mask", step.mask},
                      {"added", step.added},
                      {"decode_tokens_per_s", step.rate},
                      {"speedup", step.speedup},
                      {"acceptance_rate", step.acceptance_rate},
                      {"mean_acceptance_length", step.mean_acceptance_length}});
    }
    summary["search"] = {{"off_decode_tokens_per_s", search.off_rate},
                         {"path", path},
                         {"best_mask", search.best.ToString()},
                         {"stop_reason", search.stop_reason},
                         {"lossless", search.lossless_failures.empty()}};
    failures = search.lossless_failures;
    skip = search.best.ToString();
    std::fprintf(out, "\n");
  }

  // The modes to compare, in the mode table's order: off, the fixed-mask
  // mode when there is a mask, the planned ones when a latency profile is
  // given (or those --modes names).
  std::vector<std::string> mode_names = absl::GetFlag(FLAGS_modes);
  const bool have_profile = !absl::GetFlag(FLAGS_profile).empty();
  if (mode_names.empty()) {
    for (const SpeculationModeInfo& info : AllSpeculationModes()) {
      const bool runnable = !info.drafts || info.early_exit ||
                            (info.planned  ? have_profile
                             : info.routed ? engine.router != nullptr
                                           : !skip.empty());
      if (runnable) mode_names.push_back(info.name);
    }
  }
  std::vector<BenchMode> modes;
  bool planned = false;
  // "knapspec@host:port" plans through a remote planner at that address.
  std::map<std::string, std::unique_ptr<RemotePlannerClient>> remotes;
  std::vector<std::string> remote_of_mode;
  // A mode named again runs again, as "<name>#2", "<name>#3", ... (off twice
  // shows the machine's own spread in the same run).
  std::map<std::string, int> times_named;
  for (const std::string& name : mode_names) {
    const size_t at = name.find('@');
    remote_of_mode.push_back(at == std::string::npos ? ""
                                                     : name.substr(at + 1));
    ASSIGN_OR_RETURN(SpeculationMode mode,
                     ParseSpeculationMode(name.substr(0, at)));
    if (DraftsWithFixedMask(mode) && skip.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--modes ", SpeculationModeName(mode),
                       " needs --skip MASK or --search-masks"));
    }
    GenerationRequest request =
        WithMode(base, mode, DraftsWithFixedMask(mode) ? skip : "");
    if (IsPlanned(mode) || IsRouted(mode)) {
      planned = planned || IsPlanned(mode);
      request.speculation.max_draft =
          absl::GetFlag(FLAGS_max_draft).value_or(DefaultMaxDraft(mode));
    }
    if (DraftsByEarlyExit(mode)) {
      // The width bound.
      request.speculation.max_draft =
          absl::GetFlag(FLAGS_max_draft).value_or(DefaultMaxDraft(mode));
      RETURN_IF_ERROR(
          ValidateSpecBoundConfig(request.speculation.specbound, model));
    }
    const int times = ++times_named[name];
    modes.push_back({times == 1 ? name : absl::StrCat(name, "#", times),
                     std::move(request)});
  }
  if (modes.empty() || modes[0].name != "off") {
    return absl::InvalidArgumentError(
        "--modes must start with off (the baseline)");
  }
  PlannerHandle planner;
  bool local_planned = false;
  for (size_t k = 0; k < modes.size(); ++k) {
    if (!IsPlanned(modes[k].request.speculation.mode)) continue;
    if (remote_of_mode[k].empty()) {
      local_planned = true;
      continue;
    }
    std::unique_ptr<RemotePlannerClient>& remote = remotes[remote_of_mode[k]];
    if (remote == nullptr) {
      ASSIGN_OR_RETURN(
          RemotePlannerOptions options,
          RemotePlannerOptionsFromFlags(remote_of_mode[k], model.num_layers()));
      remote = std::make_unique<RemotePlannerClient>(std::move(options));
    }
    modes[k].planner = remote.get();
  }
  if (planned && local_planned) {
    ASSIGN_OR_RETURN(planner,
                     PlannerClientFromFlags(engine, SpeculationMode::kKnapSpec,
                                            "bench spec"));
    for (BenchMode& m : modes) {
      if (m.planner == nullptr) m.planner = planner.get();
    }
  }

  summary["skip"] = skip;
  summary["sets"] = nlohmann::json::object();
  ASSIGN_OR_RETURN(nlohmann::json set_json,
                   RunSet("spec_bench", model, tokenizer, inputs, modes,
                          repeats, out, &failures, engine.router));
  summary["sets"]["spec_bench"] = set_json;
  const int64_t long_tokens = absl::GetFlag(FLAGS_long_context_tokens);
  if (long_tokens > 0) {
    ASSIGN_OR_RETURN(
        std::vector<BenchInput> long_inputs,
        LoadBenchInputs(model, tokenizer, absl::GetFlag(FLAGS_num_prompts),
                        max_new_tokens, long_tokens));
    ASSIGN_OR_RETURN(
        set_json, RunSet("long_context", model, tokenizer, long_inputs, modes,
                         repeats, out, &failures, engine.router));
    summary["sets"]["long_context"] = set_json;
  }
  if (!absl::GetFlag(FLAGS_domains).empty()) {
    ASSIGN_OR_RETURN(std::vector<BenchInput> domain_inputs,
                     LoadDomainInputs(model, tokenizer, max_new_tokens));
    for (const std::string& text : absl::GetFlag(FLAGS_mix_ratios)) {
      double ratio = 0;
      if (!absl::SimpleAtod(text, &ratio) || !(ratio >= 0 && ratio <= 1)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--mix-ratios: '", text, "' is not a number in [0, 1]"));
      }
      const std::string label = absl::StrCat("mixed_", text);
      ASSIGN_OR_RETURN(
          set_json,
          RunSet(label, model, tokenizer, MixedStream(domain_inputs, ratio),
                 modes, repeats, out, &failures, engine.router));
      set_json["mix_ratio"] = ratio;
      summary["sets"][label] = set_json;
    }
  }
  for (const auto& [address, remote] : remotes) {
    const int64_t sent = remote->requests_sent();
    const double per =
        sent > 0 ? static_cast<double>(remote->bytes_sent()) / sent : 0.0;
    std::fprintf(out,
                 "remote planner %s: %lld requests, %.1f KiB per request\n",
                 address.c_str(), static_cast<long long>(sent), per / 1024);
    summary["remote_planners"][address] = {{"requests", sent},
                                           {"bytes_sent", remote->bytes_sent()},
                                           {"bytes_per_request", per}};
  }
  const bool lossless = failures.empty();
  summary["lossless"] = lossless;
  summary["draft_acceptance"] =
      base.sampling.greedy()
          ? "greedy"
          : (CoupledDraws(base.sampling) ? "coupled" : "rejection");
  summary["lossless_failures"] = failures;
  std::fprintf(
      out,
      "\nmodel %s (%s, %d threads, simd %s), %lld new tokens per prompt, %s, "
      "max_draft "
      "%d, "
      "exit_threshold %.2f, median of %d repeats; static mask: %s\n",
      engine.model_dir.c_str(), DtypeName(model.dtype()).c_str(),
      at::get_num_threads(), simd::CurrentTarget().c_str(),
      static_cast<long long>(max_new_tokens),
      base.sampling.greedy()
          ? "greedy"
          : absl::StrCat("sampling at temperature ", base.sampling.temperature,
                         CoupledDraws(base.sampling) ? " (coupled draws)"
                                                     : " (rejection sampling)")
                .c_str(),
      base.speculation.max_draft, base.speculation.exit_threshold, repeats,
      skip.empty() ? "(none)" : skip.c_str());
  if (!base.sampling.greedy() && !CoupledDraws(base.sampling)) {
    std::fprintf(out,
                 "rejection sampling: output ids are not compared (the "
                 "distribution is the model's)\n");
  } else if (lossless) {
    std::fprintf(
        out, "lossless: every mode's output ids equal off's on every prompt\n");
  } else {
    std::fprintf(out, "LOSSLESS CHECK FAILED on %zu run(s)\n", failures.size());
  }
  std::fflush(out);
  if (json) std::cout << summary.dump(2) << std::endl;
  if (!lossless) {
    std::string list;
    for (const std::string& f : failures) absl::StrAppend(&list, "\n  ", f);
    return absl::InternalError(absl::StrCat(
        "speculative output differs from autoregressive output:", list));
  }
  return absl::OkStatus();
}

}  // namespace

int RunBenchSpec() { return ExitCode(BenchSpec(), "bench spec"); }

}  // namespace knapserve
