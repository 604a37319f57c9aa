// `knapserve bench spec`: autoregressive decoding (--spec off) against
// self-speculative decoding with a static mask (--spec static --skip MASK),
// on the same prompts in one run, greedy and fixed-length (ignore_eos).
//
// Per mode it reports the aggregate decode rate (tokens decoded / decode
// seconds over all prompts), the speedup over off, acceptance rate, mean
// acceptance length (tokens committed per verification) and the share of
// decode time spent drafting and verifying. Greedy speculative decoding is
// lossless, so the static output ids must equal the off output ids on every
// prompt; a mismatch is reported and makes the command exit 1.
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
#include <optional>

#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/layer_mask.h"
#include "common/status.h"
#include "tools/bench_util.h"
#include "tools/cli_flags.h"
#include "tools/commands.h"

namespace knapserve {
namespace {

// The request both modes share: greedy, fixed length, no stop strings; the
// speculation knobs (--max-draft, --exit-threshold) from the flags.
absl::StatusOr<GenerationRequest> BaseRequest(int64_t max_new_tokens) {
  ASSIGN_OR_RETURN(GenerationRequest request, GenerationRequestFromFlags({}));
  request.max_new_tokens = max_new_tokens;
  request.ignore_eos = true;
  request.sampling = SamplingParams{};
  request.sampling.seed = 0;
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

// Progress and tables go to stdout, or to stderr when stdout carries JSON.
FILE* TextOut(bool json) { return json ? stderr : stdout; }

struct SearchStep {
  int round = 0;
  std::string mask;        // the mask after this round
  std::string added;       // the sublayer added this round ("" for round 0)
  double rate = 0;         // decode tok/s of `mask` on the calibration prompts
  double speedup = 0;      // over off, measured in the same run (PairedGain)
  double acceptance_rate = 0;
  double mean_acceptance_length = 0;
};

struct SearchResult {
  LayerMask best;
  double off_rate = 0;
  std::vector<SearchStep> path;
  std::string stop_reason;
  std::vector<std::string> lossless_failures;  // "mask / prompt" pairs that differed from off
};

// How much faster `runs` decode than `base` (the same prompts, measured in
// one interleaved RunModes call): the median over prompts of the ratio of
// decode times. Per-prompt pairs cancel drift that an aggregate would not.
double PairedGain(const std::vector<PromptRun>& base, const std::vector<PromptRun>& runs) {
  std::vector<double> ratios;
  for (size_t p = 0; p < base.size() && p < runs.size(); ++p) {
    if (runs[p].decode_seconds > 0) ratios.push_back(base[p].decode_seconds / runs[p].decode_seconds);
  }
  return Median(std::move(ratios));
}

std::string SublayerName(int sublayer) {
  return absl::StrCat(sublayer % 2 == 0 ? "a" : "m", sublayer / 2);
}

// Greedy forward selection of a static mask (see the file comment).
absl::StatusOr<SearchResult> SearchMask(const LlamaModel& model, const Tokenizer& tokenizer,
                                        bool json) {
  FILE* out = TextOut(json);
  const int64_t tokens = absl::GetFlag(FLAGS_search_tokens);
  const int repeats = std::max(1, absl::GetFlag(FLAGS_repeats));
  const double min_gain = absl::GetFlag(FLAGS_search_min_gain);
  const int max_steps = absl::GetFlag(FLAGS_search_max_steps);
  ASSIGN_OR_RETURN(std::vector<BenchInput> calibration,
                   LoadBenchInputs(model, tokenizer, absl::GetFlag(FLAGS_search_prompts), tokens));
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
  // Round 0: off (the reference ids and the speedup baseline) and the empty mask.
  ASSIGN_OR_RETURN(
      std::vector<std::vector<PromptRun>> first,
      RunModes(model, tokenizer, calibration,
               {WithMode(base, SpeculationMode::kOff, ""),
                WithMode(base, SpeculationMode::kStatic, "")},
               confirm_repeats, /*warmup=*/true));
  std::vector<std::vector<int32_t>> reference;
  for (const PromptRun& run : first[0]) reference.push_back(run.output_ids);
  result.off_rate = Summarize(first[0]).decode_tokens_per_second();
  auto check = [&](const std::string& mask, const std::vector<PromptRun>& runs) {
    for (size_t p = 0; p < runs.size(); ++p) {
      if (runs[p].output_ids != reference[p]) {
        result.lossless_failures.push_back(
            absl::StrCat("mask '", mask, "' prompt ", calibration[p].prompt.question_id));
      }
    }
  };
  check("", first[1]);
  // off_runs: off measured in the same interleaved run as `runs`.
  auto add_step = [&](int round, const std::string& added, const std::vector<PromptRun>& off_runs,
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
                 result.best.num_skipped(), step.mask.empty() ? "-" : step.mask.c_str(), step.rate,
                 step.speedup, step.acceptance_rate, step.mean_acceptance_length);
    std::fflush(out);
  };
  std::fprintf(out,
               "mask search: %zu calibration prompts x %lld tokens, %zu candidate %s, "
               "min gain %.1f%%, %d repeats (%d to confirm); off: %.1f tok/s\n",
               calibration.size(), static_cast<long long>(tokens), pool.size(),
               whole_layers ? "layers" : "sublayers", 100 * min_gain,
               repeats, confirm_repeats, result.off_rate);
  std::fprintf(out, "%5s %7s %-28s %10s %8s %7s %8s\n", "round", "skipped", "mask", "tok/s",
               "vs off", "accept", "mean len");
  add_step(0, "", first[0], first[1]);

  for (int round = 1;; ++round) {
    if (max_steps > 0 && static_cast<int>(result.path.size()) - 1 >= max_steps) {
      result.stop_reason = absl::StrCat("reached --search-max-steps ", max_steps);
      break;
    }
    std::vector<const std::vector<int>*> candidates;
    const GenerationRequest current = WithMode(base, SpeculationMode::kStatic,
                                               result.best.ToString());
    std::vector<GenerationRequest> requests = {current};
    for (const std::vector<int>& step : pool) {
      if (result.best.skipped(step[0])) continue;
      LayerMask mask = result.best;
      for (int s : step) mask.set_skipped(s, true);
      candidates.push_back(&step);
      requests.push_back(WithMode(base, SpeculationMode::kStatic, mask.ToString()));
    }
    if (candidates.empty()) {
      result.stop_reason = "no sublayer left to skip";
      break;
    }
    ASSIGN_OR_RETURN(std::vector<std::vector<PromptRun>> runs,
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
          "no candidate improves: best +%s at %.3fx of the current mask", name, gains[best]);
      break;
    }
    ASSIGN_OR_RETURN(std::vector<std::vector<PromptRun>> confirm,
                     RunModes(model, tokenizer, calibration,
                              {WithMode(base, SpeculationMode::kOff, ""), current,
                               requests[best + 1]},
                              confirm_repeats, false));
    const double confirm_gain = PairedGain(confirm[1], confirm[2]);
    if (confirm_gain <= 1 + min_gain) {
      result.stop_reason = absl::StrFormat(
          "no candidate improves: best +%s at %.3fx of the current mask, %.3fx re-measured", name,
          gains[best], confirm_gain);
      break;
    }
    for (int sublayer : *candidates[best]) result.best.set_skipped(sublayer, true);
    add_step(round, name, confirm[0], confirm[2]);
  }
  std::fprintf(out, "search stopped: %s\nbest mask: %s\n", result.stop_reason.c_str(),
               result.best.empty() ? "(none)" : result.best.ToString().c_str());
  std::fflush(out);
  return result;
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
  // Check the speculation flags up front, so a bad --skip fails before any timing.
  {
    GenerationRequest check = WithMode(base, SpeculationMode::kStatic, absl::GetFlag(FLAGS_skip));
    check.prompt_ids = {0};
    RETURN_IF_ERROR(ValidateGenerationRequest(check, model));
  }
  ASSIGN_OR_RETURN(std::vector<BenchInput> inputs,
                   LoadBenchInputs(model, tokenizer, absl::GetFlag(FLAGS_num_prompts),
                                   max_new_tokens));

  nlohmann::json summary = {{"model", engine.model_dir},
                            {"dtype", DtypeName(model.dtype())},
                            {"threads", at::get_num_threads()},
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

  ASSIGN_OR_RETURN(std::vector<std::vector<PromptRun>> runs,
                   RunModes(model, tokenizer, inputs,
                            {WithMode(base, SpeculationMode::kOff, ""),
                             WithMode(base, SpeculationMode::kStatic, skip)},
                            repeats, /*warmup=*/true));
  const ModeSummary off = Summarize(runs[0]);
  const ModeSummary spec = Summarize(runs[1]);
  const double off_rate = off.decode_tokens_per_second();

  nlohmann::json rows = nlohmann::json::array();
  std::fprintf(out, "%-16s %6s %5s %10s %10s %8s %7s %8s %5s\n", "category", "prompt", "new",
               "off tok/s", "spec tok/s", "speedup", "accept", "mean len", "same");
  for (size_t p = 0; p < inputs.size(); ++p) {
    const PromptRun& a = runs[0][p];
    const PromptRun& b = runs[1][p];
    const std::optional<size_t> diff = FirstDifference(a.output_ids, b.output_ids);
    if (diff) {
      failures.push_back(absl::StrCat("prompt ", inputs[p].prompt.question_id, " (",
                                      inputs[p].prompt.category, ") first differs at output ",
                                      *diff));
    }
    const double ra = a.decode_seconds > 0 ? a.decoded_tokens / a.decode_seconds : 0.0;
    const double rb = b.decode_seconds > 0 ? b.decoded_tokens / b.decode_seconds : 0.0;
    rows.push_back({{"category", inputs[p].prompt.category},
                    {"question_id", inputs[p].prompt.question_id},
                    {"prompt_tokens", inputs[p].ids.size()},
                    {"new_tokens", a.output_ids.size()},
                    {"off_decode_tokens_per_s", ra},
                    {"static_decode_tokens_per_s", rb},
                    {"acceptance_rate", b.speculation.acceptance_rate()},
                    {"mean_acceptance_length", b.speculation.mean_acceptance_length()},
                    {"same_ids", !diff.has_value()}});
    std::fprintf(out, "%-16s %6zu %5zu %10.1f %10.1f %7.2fx %7.2f %8.2f %5s\n",
                 inputs[p].prompt.category.c_str(), inputs[p].ids.size(), a.output_ids.size(), ra,
                 rb, ra > 0 ? rb / ra : 0.0, b.speculation.acceptance_rate(),
                 b.speculation.mean_acceptance_length(), diff ? "NO" : "yes");
  }
  const bool lossless = failures.empty();
  summary["skip"] = skip;
  summary["prompts"] = rows;
  summary["modes"] = {{"off", ModeJson(off, off_rate)}, {"static", ModeJson(spec, off_rate)}};
  summary["speedup"] = off_rate > 0 ? spec.decode_tokens_per_second() / off_rate : 0.0;
  summary["lossless"] = lossless;
  summary["lossless_failures"] = failures;

  std::fprintf(out,
               "\nmodel %s (%s, %d threads), %zu prompts x %lld new tokens, greedy, "
               "max_draft %d, exit_threshold %.2f, median of %d repeats\n",
               engine.model_dir.c_str(), DtypeName(model.dtype()).c_str(), at::get_num_threads(),
               inputs.size(), static_cast<long long>(max_new_tokens), base.speculation.max_draft,
               base.speculation.exit_threshold, repeats);
  ASSIGN_OR_RETURN(const LayerMask mask, LayerMask::Parse(skip, model.num_layers()));
  std::fprintf(out, "%-7s %10s %12s %8s %8s %9s %7s %7s\n", "mode", "skipped", "decode tok/s",
               "speedup", "accept", "mean len", "draft", "verify");
  std::fprintf(out, "%-7s %10s %12.1f %7.2fx %8s %9s %6.1f%% %6.1f%%\n", "off", "-", off_rate, 1.0,
               "-", "-", 100 * off.draft_share(), 100 * off.verify_share());
  std::fprintf(out, "%-7s %4d of %-2d %12.1f %7.2fx %8.3f %9.2f %6.1f%% %6.1f%%\n", "static",
               mask.num_skipped(), mask.num_sublayers(), spec.decode_tokens_per_second(),
               off_rate > 0 ? spec.decode_tokens_per_second() / off_rate : 0.0,
               spec.speculation.acceptance_rate(), spec.speculation.mean_acceptance_length(),
               100 * spec.draft_share(), 100 * spec.verify_share());
  std::fprintf(out, "static mask: %s\n", skip.empty() ? "(none)" : skip.c_str());
  if (lossless) {
    std::fprintf(out, "lossless: static output ids equal off output ids on all %zu prompts\n",
                 inputs.size());
  } else {
    std::fprintf(out, "LOSSLESS CHECK FAILED on %zu run(s)\n", failures.size());
  }
  std::fflush(out);
  if (json) std::cout << summary.dump(2) << std::endl;
  if (!lossless) {
    std::string list;
    for (const std::string& f : failures) absl::StrAppend(&list, "\n  ", f);
    return absl::InternalError(
        absl::StrCat("greedy speculative output differs from autoregressive output:", list));
  }
  return absl::OkStatus();
}

}  // namespace

int RunBenchSpec() { return ExitCode(BenchSpec(), "bench spec"); }

}  // namespace knapserve
