// Planned generation (executor/engine/generator.h with
// executor/planning/plan_controller.h) against real models and a real planner:
// greedy output stays identical to
// --spec off with the plan cache, the triggers and the guard active (on
// stories260k and stories-24l), cached plans serve a second request from its
// first step, and the CLaSp request carries the committed K/V length.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "absl/time/time.h"
#include "common/model/llama.h"
#include "common/text/tokenizer.h"
#include "executor/engine/generator.h"
#include "executor/planning/plan_cache.h"
#include "planner/inprocess_planner.h"
#include "tests/testing/synchronous_planner.h"
#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

using testing::SynchronousPlanner;

// The hand profile has no per-step cost outside the sublayers, so a draft
// that skips half the model's sublayer cost costs half a step and KnapSpec
// drafts on stories260k even with its acceptance pooled (planner/planner.h
// KnapSpecOptions::pool_alpha: about 0.6 on 3 reference tokens).
std::unique_ptr<InProcessPlanner> MakeCore(const LlamaModel& model) {
  auto planner = InProcessPlanner::Create(
      model, testing::HandLatencyProfile(model, 1e-4, 2e-4, /*fixed=*/0),
      InProcessPlannerOptions());
  EXPECT_TRUE(planner.ok()) << planner.status();
  return planner.ok() ? std::move(*planner) : nullptr;
}

GenerationRequest Request(SpeculationMode mode, std::vector<int32_t> prompt,
                          int64_t tokens) {
  GenerationRequest r;
  r.prompt_ids = std::move(prompt);
  r.max_new_tokens = tokens;
  r.ignore_eos = true;
  SpeculationConfig& s = r.speculation;
  s.mode = mode;
  s.max_draft = 5;
  s.exit_threshold = 0.0;
  s.plan_interval = 8;
  s.reference_steps = 3;
  s.clasp_layers = 2;
  s.plan_bucket_tokens = 32;  // several buckets in a short run
  s.drift_tolerance = 0.1;    // drift triggers happen
  s.drift_min_tokens = 8;
  s.planner_budget = 0;  // the budget has its own tests (timing-free)
  s.guard_min_steps = 4;
  s.guard_probe_steps = 2;
  return r;
}

struct Model {
  const char* name;
  std::vector<int32_t> prompt;
  int64_t tokens;
};

class PlannedLosslessTest : public ::testing::TestWithParam<Model> {};

// Two requests of one "process" (one PlanningShared) per mode and guard
// setting: the first fills the cache through triggers, the second starts
// from the cache. A guard margin of 100 forces the guard to fall back (no
// plan is 101 times faster than plain), margin 0 lets it judge for real
// (and each sequence choose its gamma from its own drafting).
TEST_P(PlannedLosslessTest, GreedyOutputEqualsOffWithCacheTriggersAndGuard) {
  const Model& param = GetParam();
  if (std::string(param.name) != "stories260k")
    KNAPSERVE_SKIP_WITHOUT_SHARED_MODEL(param.name);
  const LlamaModel* model = testing::CachedModel(param.name);
  ASSERT_NE(model, nullptr);
  const Tokenizer* tokenizer = testing::StoriesTokenizer();
  auto core = MakeCore(*model);
  ASSERT_NE(core, nullptr);
  auto off =
      Generate(*model, *tokenizer,
               Request(SpeculationMode::kOff, param.prompt, param.tokens));
  ASSERT_TRUE(off.ok()) << off.status();
  for (SpeculationMode mode :
       {SpeculationMode::kKnapSpec, SpeculationMode::kClasp}) {
    for (double margin : {100.0, 0.0}) {
      SCOPED_TRACE(SpeculationModeName(mode) + " guard margin " +
                   std::to_string(margin));
      const PlanningShared shared = PlanningShared::Create();
      SynchronousPlanner planner(core.get());
      GenerationRequest request = Request(mode, param.prompt, param.tokens);
      request.speculation.guard_margin = margin;
      // With margin 100 the guard must get to judge: the sequence's own odds
      // (on with margin 0) may turn drafting off first, on stories260k after
      // 8 draft tokens.
      if (margin > 1) request.speculation.sequence_prior_tokens = 0;
      auto first = Generate(*model, *tokenizer, request, nullptr, nullptr,
                            &planner, &shared);
      ASSERT_TRUE(first.ok()) << first.status();
      EXPECT_EQ(first->output_ids, off->output_ids);
      const PlanningStats& p1 = first->planning;
      EXPECT_EQ(p1.triggers_no_plan, 1);
      EXPECT_GE(p1.triggers_new_bucket, 1);
      // One lookup per bucket entered: contexts 4 .. 4 + tokens - 1.
      EXPECT_GE(p1.cache_hits + p1.cache_misses,
                (4 + param.tokens - 8) / 32 + 1);
      EXPECT_LE(p1.cache_hits + p1.cache_misses, (4 + param.tokens) / 32 + 1);
      EXPECT_EQ(first->stats.plan_requests,
                static_cast<int64_t>(planner.requests().size()));
      EXPECT_LE(first->stats.plan_requests,
                p1.triggers_no_plan + p1.triggers_new_bucket +
                    p1.triggers_drift + p1.triggers_recheck)
          << "no snapshot without a trigger";
      EXPECT_GT(first->plans.size(), 0u);
      bool drafted = false;
      for (const AppliedPlan& p : first->plans)
        drafted = drafted || p.gamma > 0;
      // The hand profile makes drafts cheap, so KnapSpec drafts on the
      // 24-layer model; on stories260k's 5 layers (3 skippable) no draft
      // beats plain decoding by kMinSpeculationGain (common/plan/
      // step_forecast.h) on 3 reference tokens. CLaSp's fixed layer count
      // may not pay, and then there is nothing to guard.
      if (mode == SpeculationMode::kKnapSpec &&
          std::string(param.name) != "stories260k") {
        EXPECT_TRUE(drafted);
      }
      // Each plan measures the steps that ran as it planned: for a drafting
      // plan its drafting steps, never the guard's plain ones.
      int64_t measured = 0, measured_drafting = 0;
      for (const AppliedPlan& p : first->plans) {
        EXPECT_GE(p.measured_tokens, p.measured_steps);
        EXPECT_LE(p.measured_tokens, p.measured_steps + p.measured_accepted);
        EXPECT_LE(p.measured_accepted, p.measured_drafted);
        EXPECT_EQ(p.measured_steps > 0, p.measured_seconds > 0);
        // The second moments are of the same steps (Cauchy-Schwarz: a sum
        // of squares is at least the squared sum over the count).
        if (p.measured_steps > 0) {
          const double n = static_cast<double>(p.measured_steps);
          const double t = static_cast<double>(p.measured_tokens);
          EXPECT_GE(p.measured_tokens_sq, t * t / n - 1e-9);
          EXPECT_GE(p.measured_seconds_sq,
                    p.measured_seconds * p.measured_seconds / n * (1 - 1e-9));
          EXPECT_GT(p.measured_token_seconds, 0);
          EXPECT_GE(p.measured_tpt_standard_error(), 0);
          if (p.measured_steps == 1) {
            EXPECT_EQ(p.measured_tpt_standard_error(), 0);
          }
        } else {
          EXPECT_EQ(p.measured_tokens_sq, 0);
          EXPECT_EQ(p.measured_seconds_sq, 0);
        }
        if (p.gamma == 0) {
          EXPECT_EQ(p.measured_drafted, 0);
        } else {
          EXPECT_GE(p.measured_drafted, p.measured_steps);
        }
        EXPECT_EQ(p.beside_solve_steps > 0, p.beside_solve_seconds > 0);
        EXPECT_GE(p.beside_solve_tokens, p.beside_solve_steps);
        EXPECT_EQ(p.unsteady_steps > 0, p.unsteady_seconds > 0);
        EXPECT_GE(p.unsteady_tokens, p.unsteady_steps);
        measured += p.measured_steps + p.beside_solve_steps + p.unsteady_steps;
        if (p.gamma > 0) measured_drafting += p.measured_steps;
      }
      EXPECT_LE(measured + p1.guard_plain_steps + p1.guard_probe_steps,
                first->stats.steps);
      // Each plan keeps the plain rate its bucket had measured when it took
      // effect, and a drafting plan the cost of its bucket's drafting steps
      // against their predicted time then. Its calibrated prediction is its
      // speed-up over the profile's plain rate times that plain rate; the
      // drafting calibration, beside it, its promise over the cost ratio.
      // The first plan of the process comes before any plain step it could
      // use (the steps that captured its snapshot are not timed: its solve
      // was in flight), the first drafting plan before any drafting step.
      bool drafted_before = false;
      int64_t drafting_with_prediction = 0;
      for (const AppliedPlan& p : first->plans) {
        EXPECT_GE(p.draft_cost_ratio, 0);
        if (p.gamma == 0) {
          EXPECT_EQ(p.draft_cost_ratio, 0);
        }
        if (p.gamma > 0 && !drafted_before) {
          EXPECT_EQ(p.draft_cost_ratio, 0) << "no drafting step before it";
        }
        drafted_before = drafted_before || p.gamma > 0;
        if (p.gamma > 0 && p.draft_cost_ratio > 0) {
          EXPECT_NEAR(p.draft_calibrated_tpt(),
                      p.predicted_tpt / p.draft_cost_ratio,
                      1e-9 * p.predicted_tpt / p.draft_cost_ratio);
        } else {
          EXPECT_EQ(p.draft_calibrated_tpt(), 0);
        }
        if (p.measured_plain_tpt > 0) {
          EXPECT_NEAR(p.calibrated_tpt() / p.predicted_tpt,
                      p.measured_plain_tpt / p.baseline_tpt, 1e-9);
        } else {
          EXPECT_EQ(p.calibrated_tpt(), 0);
        }
        // The draft-cost table also takes a settled step slower than the
        // plan's outlier limit, which the plan counts as unsteady (a busy
        // machine makes some).
        if (p.gamma > 0 && p.predicted_tpt > 0 &&
            p.predicted_tokens_per_step > 0) {
          drafting_with_prediction += p.measured_steps + p.unsteady_steps;
        }
      }
      EXPECT_EQ(first->plans.front().measured_plain_tpt, 0)
          << "read before any plain step of the process was timed";
      // The drafting steps that measured their plan (steady or unsteady)
      // went into the process's draft-cost table at their bucket, less the
      // guard's settle steps and those under a plan past its own bucket (at
      // most 32 a bucket: a step commits at least one of the bucket's 32
      // tokens, so none dropped out of the window).
      PlanCacheKey execution;
      execution.model_fingerprint = model->config().Fingerprint();
      execution.device = model->device().str();
      execution.dtype = DtypeName(model->dtype());
      execution.threads = at::get_num_threads();
      auto recorded_at = [&](int64_t bucket) {
        return shared.draft_costs->samples(execution.ExecutionId(), 32, bucket);
      };
      int64_t recorded = 0;
      for (int64_t b = 0; b <= (4 + param.tokens) / 32; ++b) {
        recorded += recorded_at(b);
      }
      EXPECT_LE(recorded, drafting_with_prediction);
      // Whether bucket 0 has enough recent drafting steps for a ratio (the
      // guard's default age limit, 10 s, might pass on a loaded machine).
      const bool ratio_at_zero =
          shared.draft_costs
              ->RecentStepTime(execution.ExecutionId(), 32, 0,
                               request.speculation.guard_probe_steps,
                               absl::Seconds(10))
              .has_value();
      if (drafted && margin == 0) {
        EXPECT_GT(measured_drafting, 0);
      }
      if (drafted) {
        EXPECT_GT(p1.guard_checks + p1.guard_probe_steps, 0);
        if (margin > 1) {
          EXPECT_GT(p1.guard_fallbacks, 0);
          EXPECT_GT(p1.guard_plain_steps, 0);
        }
      }

      auto second = Generate(*model, *tokenizer, request, nullptr, nullptr,
                             &planner, &shared);
      ASSERT_TRUE(second.ok()) << second.status();
      EXPECT_EQ(second->output_ids, off->output_ids);
      const PlanningStats& p2 = second->planning;
      EXPECT_EQ(p2.triggers_no_plan, 0) << "the first request cached bucket 0";
      EXPECT_GE(p2.cache_hits, 1);
      ASSERT_FALSE(second->plans.empty());
      EXPECT_EQ(second->plans.front().applied_step, 0)
          << "speculates from its first step";
      EXPECT_EQ(second->plans.front().source, "cache");
      // The first request's plain steps at bucket 0 (the guard's probe
      // before its drafting plan, or a plain plan's own steps) calibrate the
      // cached plan before the second request's first step.
      EXPECT_GT(second->plans.front().measured_plain_tpt, 0)
          << "the first request measured bucket 0";
      // And its drafting steps there, the cost of a cached drafting plan.
      if (second->plans.front().gamma > 0 && ratio_at_zero) {
        EXPECT_GT(second->plans.front().draft_cost_ratio, 0);
      }
      // Its first steps, right after the prefill, ran as planned (a plain
      // plan's, or a drafting plan's that the guard left alone) but are no
      // evidence of the steady speed: unsteady, not in its measured rate
      // (the plain rate that calibrates it leaves them out too).
      const AppliedPlan& front = second->plans.front();
      if (front.gamma == 0 ||
          (p2.guard_settle_steps == 0 && p2.guard_plain_steps == 0 &&
           p2.guard_probe_steps == 0)) {
        EXPECT_GT(front.unsteady_steps, 0);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Models, PlannedLosslessTest,
    ::testing::Values(Model{"stories260k", {1, 410, 469, 347}, 120},
                      Model{"stories-24l", {1, 410, 469, 347}, 100}),
    [](const ::testing::TestParamInfo<Model>& info) {
      return info.param.name == std::string("stories260k")
                 ? std::string("stories260k")
                 : std::string("stories24l");
    });

// CLaSp's DP runs on the last reference token, which must attend to every
// committed position before it, the other reference tokens included: the
// request carries the committed length, not the first reference position.
TEST(PlannedRequestTest, SnapshotsCarryTheCommittedKvLength) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = testing::CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  auto core = MakeCore(*model);
  ASSERT_NE(core, nullptr);
  for (SpeculationMode mode :
       {SpeculationMode::kClasp, SpeculationMode::kKnapSpec}) {
    SynchronousPlanner planner(core.get());
    auto result = Generate(*model, *testing::StoriesTokenizer(),
                           Request(mode, {1, 410, 469, 347}, 60), nullptr,
                           nullptr, &planner);
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_FALSE(planner.requests().empty());
    for (const SynchronousPlanner::Seen& seen : planner.requests()) {
      EXPECT_GE(seen.r, 3) << "three captured steps";
      EXPECT_EQ(seen.context_length, seen.first_position + seen.r);
      EXPECT_EQ(seen.kv_length, seen.context_length)
          << SpeculationModeName(mode);
      EXPECT_GT(seen.kv_length, seen.first_position);
    }
  }
}

// A plain plan (verifying t tokens costs t steps here, so no draft pays) is
// solved again after plain_recheck_steps plain steps under it, then after
// twice as many, and the output stays the model's own.
TEST(PlannedRequestTest, APlainPlanIsSolvedAgainAfterItsRecheckSteps) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = testing::CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  LatencyProfile dear = testing::HandLatencyProfile(*model);
  for (auto& row : dear.verify_seconds) {
    for (size_t t = 1; t < row.size(); ++t)
      row[t] = row[0] * static_cast<double>(t + 1);
  }
  auto core = InProcessPlanner::Create(*model, dear, InProcessPlannerOptions());
  ASSERT_TRUE(core.ok()) << core.status();
  SynchronousPlanner planner(core->get());
  const std::vector<int32_t> prompt = {1, 410, 469, 347};
  auto off = Generate(*model, *testing::StoriesTokenizer(),
                      Request(SpeculationMode::kOff, prompt, 100));
  ASSERT_TRUE(off.ok()) << off.status();
  GenerationRequest request = Request(SpeculationMode::kKnapSpec, prompt, 100);
  request.speculation.plan_bucket_tokens = 1024;  // one bucket
  request.speculation.plain_recheck_steps = 20;
  const PlanningShared shared = PlanningShared::Create();
  auto result = Generate(*model, *testing::StoriesTokenizer(), request, nullptr,
                         nullptr, &planner, &shared);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->output_ids, off->output_ids);
  // The first plan after 3 captured steps, a recheck 20 plain steps later
  // and another 40 after that one's plan: two rechecks in 100 tokens.
  const PlanningStats& p = result->planning;
  EXPECT_EQ(p.triggers_no_plan, 1);
  EXPECT_EQ(p.triggers_recheck, 2);
  EXPECT_EQ(result->stats.plan_requests, 3);
  ASSERT_EQ(result->plans.size(), 3u);
  for (const AppliedPlan& plan : result->plans) EXPECT_EQ(plan.gamma, 0);
  EXPECT_EQ(result->plans[1].applied_step - result->plans[0].applied_step,
            20 + 3);
  EXPECT_EQ(result->plans[2].applied_step - result->plans[1].applied_step,
            40 + 3);
}

}  // namespace
}  // namespace knapserve
