#include "executor/api/generation_metrics.h"

#include <memory>

#include "absl/strings/str_cat.h"

namespace knapserve {

GenerationMetrics::GenerationMetrics(MetricsRegistry& r,
                                     const Scheduler& scheduler,
                                     const BatchEngine& engine,
                                     const PlanningShared& planning)
    : registry_(r),
      internal_errors_(r.AddCounter(
          "knapserve_request_internal_errors_total",
          "Requests ended INTERNAL by an exception inside LibTorch or "
          "the generator (other requests went on).")),
      prompt_tokens_(r.AddCounter("knapserve_prompt_tokens_total",
                                  "Prompt tokens prefilled.")),
      generation_tokens_(r.AddCounter("knapserve_generation_tokens_total",
                                      "Tokens generated.")),
      drafts_(
          r.AddCounter("knapserve_spec_decode_num_drafts_total",
                       "Speculation steps that proposed at least one token.")),
      draft_tokens_(r.AddCounter("knapserve_spec_decode_num_draft_tokens_total",
                                 "Draft tokens proposed.")),
      accepted_tokens_(
          r.AddCounter("knapserve_spec_decode_num_accepted_tokens_total",
                       "Draft tokens accepted.")),
      plans_applied_(r.AddCounter("knapserve_planner_plans_applied_total",
                                  "Plans applied at a step boundary.")),
      plan_failures_(r.AddCounter(
          "knapserve_planner_failures_total",
          "Plan requests answered with an error (last plan kept).")),
      planner_wait_(r.AddCounter(
          "knapserve_planner_wait_seconds_total",
          "Decode-thread time spent on planning (it never blocks).")),
      ttft_(r.AddHistogram(
          "knapserve_time_to_first_token_seconds",
          "Arrival to first token, queue included.",
          {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10})),
      itl_(r.AddHistogram("knapserve_inter_token_latency_seconds",
                          "Mean time per token after the first, per request.",
                          {0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25})),
      duration_(r.AddHistogram(
          "knapserve_request_duration_seconds", "Arrival to the last message.",
          {0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120})),
      solve_(r.AddHistogram(
          "knapserve_planner_solve_seconds", "Planner solve time per plan.",
          {0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10})),
      age_(
          r.AddHistogram("knapserve_planner_plan_age_steps",
                         "Steps between a plan's boundary and its application.",
                         {1, 2, 4, 8, 16, 32, 64, 128, 256})),
      cache_hits_(r.AddCounter(
          "knapserve_plan_cache_hits_total",
          "Context buckets entered with a cached plan (no solve).")),
      cache_misses_(
          r.AddCounter("knapserve_plan_cache_misses_total",
                       "Context buckets entered without a cached plan.")),
      budget_deferrals_(r.AddCounter(
          "knapserve_planner_budget_deferrals_total",
          "Plan triggers that waited for the planner CPU budget.")),
      guard_fallbacks_(
          r.AddCounter("knapserve_guard_fallbacks_total",
                       "Times the online guard switched a sequence to plain "
                       "decoding because its plan measured slower.")),
      guard_probe_steps_(
          r.AddCounter("knapserve_guard_probe_steps_total",
                       "Plain steps the guard ran to measure the plain rate.")),
      guard_plain_steps_(
          r.AddCounter("knapserve_guard_plain_steps_total",
                       "Steps decoded plainly because the drafting setting "
                       "lost to plain decoding (any drafting mode).")),
      guard_inherited_steps_(r.AddCounter(
          "knapserve_guard_inherited_steps_total",
          "Of those, steps decoded plainly under a verdict another request "
          "gave (shared per setting and context bucket).")),
      guard_carried_steps_(r.AddCounter(
          "knapserve_guard_carried_steps_total",
          "Of those, steps decoded plainly under a verdict carried from the "
          "neighbouring context bucket, where the setting lost.")),
      guard_settle_steps_(r.AddCounter(
          "knapserve_guard_settle_steps_total",
          "Plain steps right after a prefill because the request's drafting "
          "setting had not won a guard judgement at the context bucket.")),
      guard_confirmations_(r.AddCounter(
          "knapserve_guard_confirmations_total",
          "Narrow losses against plain steps measured at another time that "
          "the guard ran a probe to confirm.")),
      guard_cleared_losses_(r.AddCounter(
          "knapserve_guard_cleared_losses_total",
          "Of those, the losses the probe's pairs cleared (the setting "
          "drafted on).")),
      routing_(r.AddHistogram(
          "knapserve_routing_seconds",
          "KNN-SSD: time to route a request to its domain (1-NN over the "
          "anchors, after the prefill).",
          {0.00001, 0.00003, 0.0001, 0.0003, 0.001, 0.003, 0.01})) {
  for (const char* kind : {"no_plan", "new_bucket", "drift", "recheck"}) {
    triggers_.push_back(&r.AddCounter("knapserve_plan_triggers_total",
                                      "Replanning triggers by kind.",
                                      {{"kind", kind}}));
  }
  // KNN-SSD: one series per domain of the anchors, exposed at 0 from the
  // start (the domain names come from the --anchors file: bounded).
  if (planning.router != nullptr) {
    for (const RoutedDomain& domain : planning.router->domains())
      RoutedCounter(domain.name);
  }
  std::shared_ptr<PlannerBudget> budget = planning.budget;
  r.AddGauge("knapserve_planner_cpu_share",
             "Planner solve seconds over decode seconds, process-wide (the "
             "--planner-budget "
             "quantity).",
             [budget] { return budget->share(); });
  std::shared_ptr<PlanCache> cache = planning.cache;
  r.AddGauge("knapserve_plan_cache_entries",
             "Plans in the executor's plan cache.",
             [cache] { return static_cast<double>(cache->size()); });
  r.AddGauge(
      "knapserve_plan_gamma_refinements",
      "Cached plans whose gamma the drafting evidence of the requests "
      "under them changed (--plan-refine-trials; a new plan version; "
      "a counter read as a gauge).",
      [cache] { return static_cast<double>(cache->gamma_refinements()); });
  r.AddGauge(
      "knapserve_plan_prediction_refinements",
      "Cached plans whose predictions alone the drafting evidence of "
      "the requests under them changed (a counter read as a gauge).",
      [cache] { return static_cast<double>(cache->prediction_refinements()); });
  if (std::shared_ptr<GuardVerdicts> verdicts = planning.verdicts) {
    r.AddGauge("knapserve_guard_losing_settings",
               "Drafting settings (mode and draft, per context bucket) the "
               "guard holds at plain decoding now: their verdicts lost.",
               [verdicts] { return static_cast<double>(verdicts->losing()); });
  }
  r.AddGauge("knapserve_running_requests", "Requests decoding now.",
             [&scheduler] { return scheduler.running(); });
  r.AddGauge("knapserve_queued_requests", "Requests waiting for a slot.",
             [&scheduler] { return scheduler.queued(); });
  r.AddGauge("knapserve_batch_size",
             "Sequences in the last batched step (decoding and prefilling).",
             [&engine] { return engine.stats().last_batch_size; });
  r.AddGauge("knapserve_batch_steps",
             "Batched steps run since start (a counter read as a gauge).",
             [&engine] { return static_cast<double>(engine.stats().steps); });
  r.AddGauge(
      "knapserve_batch_plain_steps",
      "Batched steps run without drafts because drafting would not "
      "pay at that batch (cost model or --plain-batch-size).",
      [&engine] { return static_cast<double>(engine.stats().plain_steps); });
  r.AddGauge(
      "knapserve_batch_budgeted_prefill_steps",
      "Batched steps whose prompt rows the step-time budget "
      "(--prefill-step-budget) cut while streams decoded.",
      [&engine] {
        return static_cast<double>(engine.stats().budgeted_prefill_steps);
      });
  r.AddGauge("knapserve_kv_waiting_requests",
             "Requests admitted by the scheduler, waiting for K/V blocks.",
             [&engine] { return engine.waiting(); });
  const KvPool& pool = engine.pool();
  r.AddGauge("knapserve_kv_blocks_total", "K/V blocks in the pool.",
             [&pool] { return static_cast<double>(pool.total_blocks()); });
  r.AddGauge("knapserve_kv_blocks_used",
             "K/V blocks holding positions of running sequences.",
             [&pool] { return static_cast<double>(pool.used_blocks()); });
  r.AddGauge(
      "knapserve_kv_blocks_shared_saved",
      "K/V blocks that prefix sharing saves: a request's n > 1 "
      "choices hold the prompt's full blocks once.",
      [&pool] { return static_cast<double>(pool.shared_saved_blocks()); });
  r.AddGauge("knapserve_kv_blocks_reserved",
             "K/V blocks promised to running sequences (used ones included).",
             [&pool] { return static_cast<double>(pool.reserved_blocks()); });
  r.AddGauge("knapserve_kv_blocks_free",
             "K/V blocks neither used nor reserved.",
             [&pool] { return static_cast<double>(pool.free_blocks()); });
  r.AddGauge("knapserve_kv_sequences", "Sequences holding K/V blocks.",
             [&pool] { return static_cast<double>(pool.sequences()); });
}

void GenerationMetrics::RecordRequest(absl::StatusCode code,
                                      const GenerationResult* result,
                                      double ttft_seconds,
                                      double total_seconds) {
  // absl's code names are gRPC's ("OK", "INVALID_ARGUMENT", ...).
  registry_
      .AddCounter("knapserve_requests_total",
                  "Generate calls by final gRPC status.",
                  {{"code", absl::StatusCodeToString(code)}})
      .Add();
  if (code == absl::StatusCode::kInternal) internal_errors_.Add();
  if (result == nullptr) return;
  AddResult(*result, /*count_prompt=*/true);
  ttft_.Observe(ttft_seconds);
  duration_.Observe(total_seconds);
}

void GenerationMetrics::RecordChoice(const GenerationResult& choice) {
  AddResult(choice, /*count_prompt=*/false);
}

void GenerationMetrics::AddResult(const GenerationResult& r,
                                  bool count_prompt) {
  const GenerationResult* result = &r;
  if (count_prompt) {
    prompt_tokens_.Add(static_cast<double>(result->stats.prompt_tokens));
  }
  generation_tokens_.Add(static_cast<double>(result->stats.completion_tokens));
  drafts_.Add(static_cast<double>(result->speculation.drafts));
  draft_tokens_.Add(static_cast<double>(result->speculation.draft_tokens));
  accepted_tokens_.Add(
      static_cast<double>(result->speculation.accepted_tokens));
  const std::vector<int64_t>& per = result->speculation.accepted_per_position;
  for (size_t j = 0; j < per.size(); ++j) {
    registry_
        .AddCounter("knapserve_spec_decode_num_accepted_tokens_per_pos_total",
                    "Accepted draft tokens by draft position (0-based).",
                    {{"position", absl::StrCat(j)}})
        .Add(static_cast<double>(per[j]));
  }
  // SpecBound: draft tokens by the depth they exited at, and the steps
  // whose drafting a bound ended.
  const std::vector<int64_t>& exits = result->speculation.exit_depths;
  for (size_t d = 0; d < exits.size(); ++d) {
    if (exits[d] == 0) continue;
    registry_
        .AddCounter("knapserve_specbound_exit_tokens_total",
                    "SpecBound draft tokens by the layers they ran before "
                    "their exit head was confident (depth, 1-based).",
                    {{"depth", absl::StrCat(d + 1)}})
        .Add(static_cast<double>(exits[d]));
  }
  const std::pair<const char*, int64_t> stops[] = {
      {"depth", result->speculation.depth_bound_stops},
      {"width", result->speculation.width_bound_stops}};
  for (const auto& [bound, n] : stops) {
    if (n == 0) continue;
    registry_
        .AddCounter("knapserve_specbound_bound_stops_total",
                    "SpecBound steps whose drafting ended at a bound: depth "
                    "(a token reached the depth bound without exiting) or "
                    "width (the step's draft budget).",
                    {{"bound", bound}})
        .Add(static_cast<double>(n));
  }
  plans_applied_.Add(static_cast<double>(result->plans.size()));
  plan_failures_.Add(static_cast<double>(result->stats.plan_failures));
  planner_wait_.Add(result->stats.waiting_seconds);
  for (const AppliedPlan& p : result->plans) {
    if (p.source != "solve")
      continue;  // cached and shared plans were solved for others
    solve_.Observe(p.solve_seconds);
    age_.Observe(static_cast<double>(p.age_steps));
  }
  const PlanningStats& planning = result->planning;
  cache_hits_.Add(static_cast<double>(planning.cache_hits));
  cache_misses_.Add(static_cast<double>(planning.cache_misses));
  triggers_[0]->Add(static_cast<double>(planning.triggers_no_plan));
  triggers_[1]->Add(static_cast<double>(planning.triggers_new_bucket));
  triggers_[2]->Add(static_cast<double>(planning.triggers_drift));
  triggers_[3]->Add(static_cast<double>(planning.triggers_recheck));
  budget_deferrals_.Add(static_cast<double>(planning.budget_deferrals));
  guard_fallbacks_.Add(static_cast<double>(planning.guard_fallbacks));
  guard_probe_steps_.Add(static_cast<double>(planning.guard_probe_steps));
  guard_plain_steps_.Add(static_cast<double>(planning.guard_plain_steps));
  guard_inherited_steps_.Add(
      static_cast<double>(planning.guard_inherited_steps));
  guard_carried_steps_.Add(static_cast<double>(planning.guard_carried_steps));
  guard_settle_steps_.Add(static_cast<double>(planning.guard_settle_steps));
  guard_confirmations_.Add(static_cast<double>(planning.guard_confirmations));
  guard_cleared_losses_.Add(static_cast<double>(planning.guard_cleared_losses));
  if (result->stats.completion_tokens > 1) {
    itl_.Observe(result->stats.decode_seconds /
                 static_cast<double>(result->stats.completion_tokens - 1));
  }
  if (!result->routed_domain.empty()) {
    RoutedCounter(result->routed_domain).Add();
    routing_.Observe(result->stats.routing_seconds);
  }
}

Counter& GenerationMetrics::RoutedCounter(const std::string& domain) {
  return registry_.AddCounter(
      "knapserve_routed_requests_total",
      "KNN-SSD requests by the domain their prompt was routed to.",
      {{"domain", domain}});
}

}  // namespace knapserve
