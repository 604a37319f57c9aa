// The planning statistics of one request as JSON: the `planning` object and
// the `plans` array that `knapserve generate --json` prints (in-process and
// with --server, from the FinalResult), `bench spec --json` prints per mode
// and the HTTP API puts in its `knapserve` extension. One definition, so
// the keys and their meaning are the same in every output
// (executor/README.md, "Plan cache, triggers, budget, guard").
//
// Stateless functions; thread safety: any thread.
#ifndef KNAPSERVE_EXECUTOR_API_PLANNING_JSON_H_
#define KNAPSERVE_EXECUTOR_API_PLANNING_JSON_H_

#include <nlohmann/json.hpp>

#include "absl/types/span.h"
#include "executor/engine/generator.h"
#include "executor/planning/plan_controller.h"

namespace knapserve {

// `s` as the `planning` object: plan_cache_hits, plan_cache_misses,
// triggers.{no_plan,new_bucket,drift,recheck}, budget_deferrals, solve_seconds,
// planner_cpu_share (s.solve_seconds / decode_seconds, 0 without decoding),
// process_planner_cpu_share, guard.{checks,fallbacks,probe_steps,
// plain_steps,last_spec_tps,last_plain_tps}, profile_pending and
// profile_pending_steps.
nlohmann::json PlanningJson(const PlanningStats& s, double decode_seconds);

// The plans a request applied, in order, as the `plans` array: step,
// plan_step, age_steps, context_length, mask, gamma, alpha_hat,
// predicted_tpt, baseline_tpt, num_candidates, solve_seconds, queue_seconds,
// source.
nlohmann::json AppliedPlansJson(absl::Span<const AppliedPlan> plans);

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_API_PLANNING_JSON_H_
