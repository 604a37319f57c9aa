#include "planner/planner.h"

#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/clock.h"
#include "common/base/status.h"
#include "common/model/llama.h"
#include "common/trace/tracer.h"
#include "planner/knapsack.h"
#include "planner/tpt.h"

namespace knapserve {
namespace {

// Validated inputs in the model's device and dtype.
struct Checked {
  torch::Tensor states;  // [2L+1, r, hidden]
  int64_t r = 0;
  int64_t context_length = 0;  // PricingContextLength(inputs)
};

absl::StatusOr<Checked> CheckInputs(const LlamaModel& model,
                                    const LatencyProfile& profile,
                                    const PlanInputs& inputs, int max_draft,
                                    const AlphaPrior& alpha_prior) {
  RETURN_IF_ERROR(ValidateAlphaPrior(alpha_prior));
  if (max_draft < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_draft must be >= 1, got ", max_draft));
  }
  RETURN_IF_ERROR(Annotate(profile.Validate(), "latency profile"));
  if (profile.model_fingerprint != model.config().Fingerprint() ||
      profile.device != model.device().str() ||
      profile.dtype != DtypeName(model.dtype())) {
    // Threads are not compared here: the planner may run on a thread whose
    // OpenMP setting differs; the caller checks them once at load.
    return profile.CheckMatches(model.config().Fingerprint(),
                                model.device().str(), DtypeName(model.dtype()),
                                profile.threads);
  }
  if (profile.max_draft < max_draft) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_draft ", max_draft,
        " exceeds the latency profile's verify table (max_draft ",
        profile.max_draft, "); re-run `knapserve profile --max-draft ",
        max_draft, "`"));
  }
  const torch::Tensor& s = inputs.states;
  const int64_t boundaries = 2 * static_cast<int64_t>(model.num_layers()) + 1;
  if (!s.defined() || s.dim() != 3 || s.size(0) != boundaries ||
      s.size(2) != model.config().hidden_size || s.size(1) < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "states must be [2L+1 = ", boundaries,
        ", r >= 1, hidden = ", model.config().hidden_size, "], got ",
        s.defined() ? c10::str(s.sizes())
                    : std::string("an undefined tensor")));
  }
  if (!s.is_floating_point()) {
    return absl::InvalidArgumentError("states must be a floating-point tensor");
  }
  // NaN or Inf would make every cosine of the DP NaN, and no candidate
  // survive (found by tests/fuzz/fuzz_plan_codec).
  if (!torch::isfinite(s).all().item<bool>()) {
    return absl::InvalidArgumentError("states hold NaN or infinite values");
  }
  Checked c;
  c.r = s.size(1);
  if (static_cast<int64_t>(inputs.target_argmax.size()) != c.r) {
    return absl::InvalidArgumentError(
        absl::StrCat("target_argmax has ", inputs.target_argmax.size(),
                     " ids for r = ", c.r, " reference tokens"));
  }
  for (int32_t id : inputs.target_argmax) {
    if (id < 0 || id >= model.config().vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "target_argmax holds id ", id, " outside the vocabulary [0, ",
          model.config().vocab_size, ")"));
    }
  }
  if (inputs.first_position < 0 ||
      inputs.first_position + c.r > model.max_context()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "first_position ", inputs.first_position, " with r = ", c.r,
        " reference tokens does not fit the model's context ",
        model.max_context()));
  }
  if (inputs.prefix_len < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix_len must be >= 0, got ", inputs.prefix_len));
  }
  if ((inputs.prefix_kv == nullptr) != (inputs.prefix_len == 0)) {
    return absl::InvalidArgumentError(
        "prefix_kv must be set exactly when prefix_len > 0");
  }
  if (inputs.prefix_kv != nullptr) {
    if (static_cast<int>(inputs.prefix_kv->size()) != model.num_layers()) {
      return absl::InvalidArgumentError(
          absl::StrCat("prefix_kv has ", inputs.prefix_kv->size(),
                       " layers, the model has ", model.num_layers()));
    }
    for (const LayerKv& kv : *inputs.prefix_kv) {
      if (!kv.k.defined() || kv.k.dim() != 3 ||
          kv.k.size(1) < inputs.prefix_len) {
        return absl::InvalidArgumentError(absl::StrCat(
            "prefix_len ", inputs.prefix_len, " but prefix_kv holds ",
            kv.k.defined() && kv.k.dim() == 3 ? kv.k.size(1) : 0,
            " positions"));
      }
    }
  }
  if (inputs.context_length < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "context_length must be >= 0, got ", inputs.context_length));
  }
  if (!(inputs.exit_threshold >= 0 && inputs.exit_threshold <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "exit_threshold must be in [0, 1], got ", inputs.exit_threshold));
  }
  if (inputs.plan_lifetime_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan_lifetime_tokens must be >= 0, got ",
                     inputs.plan_lifetime_tokens));
  }
  c.context_length = PricingContextLength(inputs);
  try {
    c10::InferenceMode guard;
    c.states = s.to(model.device(), model.dtype());
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("states: ", e.what_without_backtrace()));
  }
  return c;
}

std::vector<double> VerifyTable(const LatencyProfile& profile, int64_t n,
                                int max_draft) {
  std::vector<double> table;
  for (int t = 1; t <= max_draft + 1; ++t)
    table.push_back(profile.StepSeconds(n, t));
  return table;
}

// A candidate's acceptance and confidence stop as the TPT grid takes them:
// its shares on r tokens (raw, or pooled by PoolSharesByCosine), each smoothed
// with the prior (monotone, so the stop's accept_and_go_on stays below alpha
// and go_on), and drafts 2..gamma's odds (SmoothedLaterOdds). With
// exit_threshold 0 no draft stops.
DraftOdds SmoothedOdds(const DraftShares& shares, int64_t r,
                       const AlphaPrior& prior, double exit_threshold) {
  DraftOdds odds;
  odds.alpha = SmoothAlpha(shares.accept, r, prior);
  if (exit_threshold > 0) {
    odds.stop = ConfidenceStop{SmoothAlpha(shares.go_on, r, prior),
                               SmoothAlpha(shares.accept_and_go_on, r, prior)};
  }
  odds.later = SmoothedLaterOdds(shares.later, prior, exit_threshold > 0);
  return odds;
}

DraftShares SharesOf(const SkipCandidate& c) {
  if (c.go_on_share < 0) return {c.alpha_hat, 1.0, c.alpha_hat, c.later};
  return {c.alpha_hat, c.go_on_share, c.accept_and_go_on_share, c.later};
}

// The plan's promise per step: what ForecastStep expects of (candidate,
// gamma), or one plain token per verification for gamma 0. Returns it.
StepForecast SetForecast(const TptCandidate& candidate, int gamma,
                         absl::Span<const double> verify, DraftPlan& plan) {
  const StepForecast f = ForecastStep(candidate, gamma, verify);
  plan.predicted_tokens_per_step = f.tokens;
  plan.predicted_drafts_per_step = f.drafts;
  plan.alpha_smoothed = gamma > 0 ? candidate.alpha : 0.0;
  return f;
}

// Records what the plan's gamma rests on (DraftPlan::basis): the step prices
// and the shares its odds were smoothed from. Only a drafting plan has one.
void SetBasis(const std::vector<double>& verify, double draft_seconds,
              const DraftShares& shares, int64_t r, const AlphaPrior& prior,
              double exit_threshold, bool gamma_fixed, DraftPlan& plan) {
  if (plan.gamma <= 0) return;
  PlanBasis& basis = plan.basis;
  basis.verify_seconds = verify;
  basis.draft_seconds = draft_seconds;
  basis.reference_tokens = r;
  basis.accept_share = shares.accept;
  basis.prior = prior;
  basis.confidence_stop = exit_threshold > 0;
  basis.go_on_share = basis.confidence_stop ? shares.go_on : 1.0;
  basis.accept_and_go_on_share =
      basis.confidence_stop ? shares.accept_and_go_on : shares.accept;
  const LaterDraftCounts& later = shares.later;
  if (later.accept_trials > 0) {
    basis.later_accept_trials = later.accept_trials;
    basis.later_accept_share = later.accepted / later.accept_trials;
    basis.later_accept_and_go_on_share =
        basis.confidence_stop ? later.accept_and_go_on / later.accept_trials
                              : basis.later_accept_share;
    basis.later_go_on_trials =
        basis.confidence_stop ? later.go_on_trials : later.accept_trials;
    basis.later_go_on_share = basis.confidence_stop && later.go_on_trials > 0
                                  ? later.went_on / later.go_on_trials
                                  : 1.0;
  }
  basis.gamma_fixed = gamma_fixed;
}

// Fills plan.gamma / predicted_tpt / baseline_tpt for one fixed candidate
// measured on r tokens. fixed_gamma > 0 forces gamma (the TPT is still
// predicted for it).
absl::Status ChooseGamma(const LatencyProfile& profile, int64_t n,
                         const SkipCandidate& candidate, int64_t r,
                         const AlphaPrior& prior, double exit_threshold,
                         int max_draft, int fixed_gamma, DraftPlan& plan) {
  const std::vector<double> verify =
      VerifyTable(profile, n, std::max(max_draft, fixed_gamma));
  const DraftOdds odds =
      SmoothedOdds(SharesOf(candidate), r, prior, exit_threshold);
  const TptCandidate tc{odds.alpha,
                        profile.DraftTokenSeconds(candidate.mask, n), odds.stop,
                        odds.later};
  plan.mask = candidate.mask;
  plan.alpha_hat = candidate.alpha_hat;
  plan.mean_cosine = candidate.mean_cosine;
  plan.num_candidates = 1;
  plan.num_evaluated = 1;
  if (fixed_gamma > 0) {
    plan.gamma = fixed_gamma;
    plan.predicted_tpt =
        SetForecast(tc, fixed_gamma, verify, plan).tokens_per_second();
    plan.baseline_tpt = TokensPerSecond(0, 0, 0, verify[0]);
    SetBasis(verify, tc.draft_seconds, SharesOf(candidate), r, prior,
             exit_threshold, /*gamma_fixed=*/true, plan);
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(TptChoice choice, MaximizeTpt({&tc, 1}, verify, max_draft));
  plan.gamma = choice.gamma;
  plan.predicted_tpt = choice.tpt;
  plan.baseline_tpt = choice.baseline_tpt;
  SetForecast(tc, choice.gamma, verify, plan);
  SetBasis(verify, tc.draft_seconds, SharesOf(candidate), r, prior,
           exit_threshold, /*gamma_fixed=*/false, plan);
  return absl::OkStatus();
}

}  // namespace

std::optional<LaterDraftOdds> SmoothedLaterOdds(const LaterDraftCounts& counts,
                                                const AlphaPrior& prior,
                                                bool confidence_stop) {
  if (!(counts.accept_trials > 0)) return std::nullopt;
  const int64_t accept_tokens = WholeTrials(counts.accept_trials);
  const double accept_share = counts.accepted / counts.accept_trials;
  if (!confidence_stop) {
    return LaterDraftOdds{SmoothAlpha(accept_share, accept_tokens, prior),
                          ConfidenceStop()};
  }
  const bool went = counts.go_on_trials > 0;
  return SmoothDraftOdds(
      accept_share, accept_tokens,
      went ? counts.went_on / counts.go_on_trials : 1.0,
      went ? WholeTrials(counts.go_on_trials) : accept_tokens,
      counts.accept_and_go_on / counts.accept_trials, accept_tokens, prior);
}

int64_t KvEntriesBefore(const PlanInputs& inputs, int64_t position) {
  if (inputs.kv_positions.empty()) {
    return std::clamp<int64_t>(position, 0, inputs.prefix_len);
  }
  const auto end =
      inputs.kv_positions.begin() +
      std::min<int64_t>(inputs.prefix_len, inputs.kv_positions.size());
  return std::lower_bound(inputs.kv_positions.begin(), end, position) -
         inputs.kv_positions.begin();
}

int64_t PricingContextLength(const PlanInputs& inputs) {
  const int64_t r = inputs.states.defined() && inputs.states.dim() >= 2
                        ? inputs.states.size(1)
                        : 0;
  const int64_t n = inputs.context_length > 0 ? inputs.context_length
                                              : inputs.first_position + r;
  return n + std::max<int64_t>(0, inputs.plan_lifetime_tokens) / 2;
}

absl::StatusOr<ModelSublayerRunner> ReferenceRunner(const LlamaModel& model,
                                                    const PlanInputs& inputs,
                                                    int64_t r) {
  if (r < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("a reference runner needs r >= 1 tokens, got ", r));
  }
  ModelSublayerRunner::Options options;
  for (int64_t i = 0; i < r; ++i) {
    options.row_prefix_limits.push_back(
        KvEntriesBefore(inputs, inputs.first_position + i));
  }
  return ModelSublayerRunner::Create(model, inputs.prefix_kv,
                                     options.row_prefix_limits.back(),
                                     inputs.first_position, options);
}

absl::StatusOr<DraftPlan> SolveKnapSpec(const LlamaModel& model,
                                        const LatencyProfile& profile,
                                        const PlanInputs& inputs,
                                        const KnapSpecOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  if (options.weight_cap < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight_cap must be >= 1, got ", options.weight_cap));
  }
  if (!(options.weight_tolerance >= 0) ||
      !std::isfinite(options.weight_tolerance)) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight_tolerance must be finite and >= 0, got ",
                     options.weight_tolerance));
  }
  if (!(options.tau >= -1.0 && options.tau <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tau must be in [-1, 1], got ", options.tau));
  }
  RETURN_IF_ERROR(CheckSkippedShare(options.max_skipped_share));
  if (options.max_reference_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_reference_tokens must be >= 0 (0 = all), got ",
                     options.max_reference_tokens));
  }
  // Traced stages (common/trace): children of the caller's plan.solve span.
  trace::ScopedSpan check_stage("plan.solve.check_inputs");
  ASSIGN_OR_RETURN(Checked in,
                   CheckInputs(model, profile, inputs, options.max_draft,
                               options.alpha_prior));
  const int64_t n = in.context_length;
  // The first r_used reference tokens: their prefix K/V is exactly the given
  // one.
  const int64_t r_used =
      options.max_reference_tokens > 0
          ? std::min<int64_t>(in.r, options.max_reference_tokens)
          : in.r;
  torch::Tensor states;
  {
    c10::InferenceMode guard;
    states = r_used < in.r ? in.states.narrow(1, 0, r_used) : in.states;
  }
  check_stage.span().SetAttribute("knapserve.plan.reference_tokens", in.r);
  check_stage.span().SetAttribute("knapserve.plan.reference_tokens_used",
                                  r_used);
  check_stage.End();
  const absl::Span<const int32_t> targets(inputs.target_argmax.data(),
                                          static_cast<size_t>(r_used));
  // The latency profile priced at the plan's mean context: the DP's integer
  // weights.
  trace::ScopedSpan price_stage("plan.solve.profile_prices");
  const SublayerWeights weights =
      ComputeSublayerWeights(profile.AttentionSeconds(n), profile.MlpSeconds(),
                             options.weight_cap, options.weight_tolerance);
  price_stage.span().SetAttribute("knapserve.plan.pricing_context_length", n);
  price_stage.span().SetAttribute("knapserve.plan.attention_seconds",
                                  profile.AttentionSeconds(n));
  price_stage.span().SetAttribute("knapserve.plan.mlp_seconds",
                                  profile.MlpSeconds());
  price_stage.span().SetAttribute("knapserve.plan.weight_attention",
                                  weights.attention);
  price_stage.span().SetAttribute("knapserve.plan.weight_mlp", weights.mlp);
  price_stage.End();
  trace::ScopedSpan dp_stage("plan.solve.knapsack_dp");
  ASSIGN_OR_RETURN(ModelSublayerRunner runner,
                   ReferenceRunner(model, inputs, r_used));
  KnapsackOptions dp;
  dp.tau = options.tau;
  dp.keep_first_and_last = options.keep_first_and_last;
  dp.max_skipped_share = options.max_skipped_share;
  torch::Tensor final_states;
  SkipDpStats dp_stats;
  ASSIGN_OR_RETURN(std::vector<SkipCandidate> candidates,
                   SolveKnapsack(runner, states, absl::Span<const int32_t>(),
                                 weights, dp, &dp_stats, &final_states));
  dp_stage.span().SetAttribute("knapserve.plan.candidates",
                               static_cast<int64_t>(candidates.size()));
  dp_stage.span().SetAttribute("knapserve.plan.dp_sublayer_calls",
                               dp_stats.sublayer_calls);
  dp_stage.span().SetAttribute("knapserve.plan.dp_branch_rows",
                               dp_stats.branch_rows);
  dp_stage.span().SetAttribute("knapserve.plan.dp_max_live_cells",
                               dp_stats.max_live_cells);
  dp_stage.End();

  // The TPT grid over candidates x gamma; with lazy_alpha it measures the
  // alpha_hat of the candidates that can still win (LM head) as it goes.
  trace::ScopedSpan grid_stage("plan.solve.tpt_grid");
  std::vector<double> draft_seconds;
  draft_seconds.reserve(candidates.size());
  for (const SkipCandidate& c : candidates)
    draft_seconds.push_back(profile.DraftTokenSeconds(c.mask, n));
  const std::vector<double> verify = VerifyTable(profile, n, options.max_draft);
  const double exit_threshold = inputs.exit_threshold;
  std::vector<std::optional<DraftOdds>> odds(candidates.size());
  // The share each candidate's odds came from: its alpha_hat, or with
  // pool_alpha its block's pooled share.
  std::vector<double> grid_share(candidates.size(), 0.0);
  // And its shares as the grid took them (pooled with pool_alpha).
  std::vector<DraftShares> grid_shares(candidates.size());
  const bool lazy = options.lazy_alpha && !options.pool_alpha;
  TptChoice choice;
  if (lazy) {
    auto odds_of = [&](int i) -> absl::StatusOr<DraftOdds> {
      torch::Tensor one;
      {
        c10::InferenceMode guard;
        one = final_states.narrow(0, i, 1);
      }
      ASSIGN_OR_RETURN(
          std::vector<DraftShares> shares,
          MeasureDraftShares(runner, one, targets, exit_threshold));
      candidates[i].alpha_hat = shares[0].accept;
      grid_share[i] = shares[0].accept;
      grid_shares[i] = shares[0];
      odds[i] =
          SmoothedOdds(shares[0], r_used, options.alpha_prior, exit_threshold);
      return *odds[i];
    };
    ASSIGN_OR_RETURN(
        choice,
        MaximizeTptLazily(draft_seconds,
                          SmoothAlpha(1.0, r_used, options.alpha_prior), verify,
                          options.max_draft,
                          /*confidence_stop=*/exit_threshold > 0, odds_of));
  } else {
    ASSIGN_OR_RETURN(
        std::vector<DraftShares> shares,
        MeasureDraftShares(runner, final_states, targets, exit_threshold));
    for (size_t i = 0; i < candidates.size(); ++i)
      candidates[i].alpha_hat = shares[i].accept;  // raw
    if (options.pool_alpha) {
      std::vector<double> cosines;
      cosines.reserve(candidates.size());
      for (const SkipCandidate& c : candidates)
        cosines.push_back(c.mean_cosine);
      ASSIGN_OR_RETURN(shares, PoolSharesByCosine(shares, cosines));
    }
    std::vector<TptCandidate> tpt;
    tpt.reserve(candidates.size());
    for (size_t i = 0; i < candidates.size(); ++i) {
      grid_share[i] = shares[i].accept;
      grid_shares[i] = shares[i];
      odds[i] =
          SmoothedOdds(shares[i], r_used, options.alpha_prior, exit_threshold);
      tpt.push_back(
          {odds[i]->alpha, draft_seconds[i], odds[i]->stop, odds[i]->later});
    }
    ASSIGN_OR_RETURN(choice, MaximizeTpt(tpt, verify, options.max_draft));
  }
  grid_stage.span().SetAttribute("knapserve.plan.evaluated_candidates",
                                 choice.num_evaluated);
  grid_stage.span().SetAttribute("knapserve.plan.lazy_alpha", lazy);
  grid_stage.span().SetAttribute("knapserve.plan.pool_alpha",
                                 options.pool_alpha);
  grid_stage.span().SetAttribute("knapserve.plan.gamma", choice.gamma);
  grid_stage.End();
  DraftPlan plan;
  plan.mask = LayerMask(model.num_layers());
  plan.gamma = choice.gamma;
  plan.predicted_tpt = choice.tpt;
  plan.baseline_tpt = choice.baseline_tpt;
  plan.num_candidates = static_cast<int>(candidates.size());
  plan.num_evaluated = choice.num_evaluated;
  plan.step = inputs.step;
  if (choice.candidate >= 0) {
    const SkipCandidate& best = candidates[choice.candidate];
    plan.mask = best.mask;
    plan.alpha_hat = grid_share[choice.candidate];
    plan.mean_cosine = best.mean_cosine;
    const DraftOdds& chosen = *odds[choice.candidate];
    SetForecast({chosen.alpha, draft_seconds[choice.candidate], chosen.stop,
                 chosen.later},
                choice.gamma, verify, plan);
    SetBasis(verify, draft_seconds[choice.candidate],
             grid_shares[choice.candidate], r_used, options.alpha_prior,
             exit_threshold, /*gamma_fixed=*/false, plan);
  } else {
    // No speculation: the full model (candidate j = 0) accepts its own tokens.
    plan.alpha_hat = 1.0;
    plan.mean_cosine = candidates.front().mean_cosine;
    SetForecast({}, 0, verify, plan);
  }
  plan.solve_seconds = SecondsSince(start);
  return plan;
}

absl::StatusOr<DraftPlan> SolveClasp(const LlamaModel& model,
                                     const LatencyProfile& profile,
                                     const PlanInputs& inputs,
                                     const ClaspOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  if (options.gamma < 0 || options.gamma > options.max_draft) {
    return absl::InvalidArgumentError(
        absl::StrCat("gamma must be in [0, max_draft = ", options.max_draft,
                     "], got ", options.gamma));
  }
  trace::ScopedSpan check_stage("plan.solve.check_inputs");
  ASSIGN_OR_RETURN(Checked in,
                   CheckInputs(model, profile, inputs, options.max_draft,
                               options.alpha_prior));
  check_stage.span().SetAttribute("knapserve.plan.reference_tokens", in.r);
  check_stage.End();
  trace::ScopedSpan dp_stage("plan.solve.layer_dp");
  // The DP on the last reference token, attending to the full model's K/V of
  // every earlier position it has.
  const int64_t last = inputs.first_position + in.r - 1;
  ASSIGN_OR_RETURN(
      ModelSublayerRunner last_runner,
      ModelSublayerRunner::Create(model, inputs.prefix_kv,
                                  KvEntriesBefore(inputs, last), last));
  torch::Tensor last_states;
  {
    c10::InferenceMode guard;
    last_states = in.states.narrow(1, in.r - 1, 1);
  }
  ASSIGN_OR_RETURN(
      SkipCandidate chosen,
      SolveLayerSkip(last_runner, last_states, {}, options.num_skipped_layers,
                     options.keep_first_and_last));
  dp_stage.End();
  // alpha_hat of the chosen mask on all r tokens.
  trace::ScopedSpan eval_stage("plan.solve.evaluate_mask");
  ASSIGN_OR_RETURN(ModelSublayerRunner runner,
                   ReferenceRunner(model, inputs, in.r));
  ASSIGN_OR_RETURN(SkipCandidate measured,
                   EvaluateMask(runner, in.states, inputs.target_argmax,
                                chosen.mask, {}, inputs.exit_threshold));
  eval_stage.span().SetAttribute("knapserve.plan.alpha_hat",
                                 measured.alpha_hat);
  eval_stage.End();
  trace::ScopedSpan grid_stage("plan.solve.tpt_grid");
  DraftPlan plan;
  RETURN_IF_ERROR(ChooseGamma(profile, in.context_length, measured, in.r,
                              options.alpha_prior, inputs.exit_threshold,
                              options.max_draft, options.gamma, plan));
  grid_stage.span().SetAttribute("knapserve.plan.gamma", plan.gamma);
  grid_stage.End();
  plan.step = inputs.step;
  plan.solve_seconds = SecondsSince(start);
  return plan;
}

absl::StatusOr<DraftPlan> SolveStatic(const LlamaModel& model,
                                      const LatencyProfile& profile,
                                      const PlanInputs& inputs,
                                      const LayerMask& mask,
                                      const StaticOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  if (mask.num_layers() != model.num_layers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("mask '", mask.ToString(), "' has ", mask.num_layers(),
                     " layers, the model has ", model.num_layers()));
  }
  trace::ScopedSpan check_stage("plan.solve.check_inputs");
  ASSIGN_OR_RETURN(Checked in,
                   CheckInputs(model, profile, inputs, options.max_draft,
                               options.alpha_prior));
  check_stage.span().SetAttribute("knapserve.plan.reference_tokens", in.r);
  check_stage.End();
  trace::ScopedSpan eval_stage("plan.solve.evaluate_mask");
  ASSIGN_OR_RETURN(ModelSublayerRunner runner,
                   ReferenceRunner(model, inputs, in.r));
  ASSIGN_OR_RETURN(SkipCandidate measured,
                   EvaluateMask(runner, in.states, inputs.target_argmax, mask,
                                {}, inputs.exit_threshold));
  eval_stage.span().SetAttribute("knapserve.plan.alpha_hat",
                                 measured.alpha_hat);
  eval_stage.End();
  trace::ScopedSpan grid_stage("plan.solve.tpt_grid");
  DraftPlan plan;
  RETURN_IF_ERROR(ChooseGamma(profile, in.context_length, measured, in.r,
                              options.alpha_prior, inputs.exit_threshold,
                              options.max_draft, /*fixed_gamma=*/0, plan));
  grid_stage.span().SetAttribute("knapserve.plan.gamma", plan.gamma);
  grid_stage.End();
  plan.step = inputs.step;
  plan.solve_seconds = SecondsSince(start);
  return plan;
}

}  // namespace knapserve
