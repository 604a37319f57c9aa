// Tests of executor/planning/plan_controller.h with made-up steps and timings:
// cache hits from the first step, the three triggers, no snapshot without one,
// the planner budget, shared solves between sequences, and the online guard.
#include "executor/planning/plan_controller.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace knapserve {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

PlanCacheKey BaseKey() {
  PlanCacheKey key;
  key.model_fingerprint = "llama:L=4";
  key.device = "cpu";
  key.dtype = "fp32";
  key.threads = 2;
  key.max_draft = 6;
  return key;
}

PlanCacheKey KeyAt(int64_t bucket, int64_t bucket_tokens = 32) {
  PlanCacheKey key = BaseKey();
  key.bucket_tokens = bucket_tokens;
  key.bucket = bucket;
  return key;
}

DraftPlan Plan(int gamma, double alpha_hat, double solve_seconds = 0.01) {
  DraftPlan plan;
  plan.mask = LayerMask(4);
  plan.gamma = gamma;
  plan.alpha_hat = alpha_hat;
  plan.solve_seconds = solve_seconds;
  return plan;
}

// A drafting plan the cache and a sequence can choose gamma for again (it
// carries the planner's prices): mask a1, 16 reference tokens at `share`,
// gamma 0..max_draft.
DraftPlan PricedPlan(int gamma, double share, int max_draft = 4) {
  DraftPlan plan = Plan(gamma, share);
  plan.mask = *LayerMask::Parse("a1", 4);
  for (int g = 0; g <= max_draft; ++g) {
    plan.basis.verify_seconds.push_back(1.0e-3 + 0.1e-3 * g);
  }
  plan.basis.draft_seconds = 0.2e-3;
  plan.basis.reference_tokens = 16;
  plan.basis.accept_share = share;
  return plan;
}

PlanControllerOptions Options() {
  PlanControllerOptions o;
  o.bucket_tokens = 32;
  o.drift_tolerance = 0.2;
  o.drift_min_tokens = 10;
  o.planner_budget = 0;  // no limit unless a test sets one
  o.reference_steps = 2;
  o.min_request_gap = 4;
  o.guard.enabled = false;
  // Every step is evidence (the settle tests set their own).
  o.guard.settle_steps = 0;
  return o;
}

StepObservation Spec(int gamma, int drafted, int accepted, double seconds) {
  return StepObservation{gamma, drafted, accepted, accepted + 1, seconds};
}
StepObservation Plain(double seconds) {
  return StepObservation{0, 0, 0, 1, seconds};
}

// The rate's standard error from the sums equals the delta method's
// formula over the steps themselves, and is 0 where it is not defined.
TEST(RateStandardErrorTest, MatchesTheRatioOfSumsOverTheSteps) {
  const std::vector<std::pair<int, double>> steps = {
      {1, 0.010}, {3, 0.021}, {2, 0.016}, {5, 0.030}, {1, 0.011}, {2, 0.019}};
  double t = 0, s = 0, tt = 0, ts = 0, ss = 0;
  for (const auto& [tokens, seconds] : steps) {
    t += tokens;
    s += seconds;
    tt += tokens * tokens;
    ts += tokens * seconds;
    ss += seconds * seconds;
  }
  const double rate = t / s;
  double residuals = 0;
  for (const auto& [tokens, seconds] : steps) {
    residuals += (tokens - rate * seconds) * (tokens - rate * seconds);
  }
  const double n = static_cast<double>(steps.size());
  const double expected = std::sqrt(residuals * n / (n - 1)) / s;
  EXPECT_NEAR(RateStandardError(6, t, s, tt, ts, ss), expected, 1e-9);
  EXPECT_GT(expected, 0.05 * rate);  // steps this uneven: several percent
  // Every step at the same rate (2 tokens in 10 ms): nothing to doubt, up
  // to the expanded sum's rounding (a millionth of the rate of 200).
  EXPECT_NEAR(RateStandardError(3, 6, 0.03, 4 * 3, 2 * 0.01 * 3, 0.0001 * 3), 0,
              1e-4);
  EXPECT_EQ(RateStandardError(1, 2, 0.01, 4, 0.02, 0.0001), 0);
  EXPECT_EQ(RateStandardError(0, 0, 0, 0, 0, 0), 0);
  EXPECT_EQ(RateStandardError(5, 5, 0, 5, 0, 0), 0);
  // Four times the steps at the same spread: half the error (times the
  // small-sample factors sqrt(n / (n - 1)) of 24 steps against 6).
  EXPECT_NEAR(RateStandardError(24, 4 * t, 4 * s, 4 * tt, 4 * ts, 4 * ss),
              expected / 2 * std::sqrt((24.0 / 23.0) / (n / (n - 1))), 1e-9);
}

// A plan measures the steps that ran as it said, and a drafting step only
// with its whole budget: the last steps of a request, which the end of the
// generation held to fewer drafts (to none at the last token), commit fewer
// tokens than the step the plan forecast.
TEST(StepMeasuresPlanTest, OnlyStepsThatRanAsPlannedWithTheirWholeBudget) {
  EXPECT_TRUE(StepMeasuresPlan(4, Spec(4, 4, 4, 0.01)));
  EXPECT_TRUE(StepMeasuresPlan(4, Spec(4, 2, 2, 0.01)));  // confidence stop
  EXPECT_FALSE(StepMeasuresPlan(4, Plain(0.01)));  // made plain (guard, batch)
  EXPECT_TRUE(StepMeasuresPlan(0, Plain(0.01)));
  EXPECT_FALSE(StepMeasuresPlan(0, Spec(4, 4, 4, 0.01)));
  StepObservation capped = Spec(4, 2, 2, 0.01);
  capped.budget = 2;
  capped.capped = true;
  EXPECT_FALSE(StepMeasuresPlan(4, capped));
  StepObservation last = Spec(4, 0, 0, 0.01);
  last.capped = true;
  EXPECT_FALSE(StepMeasuresPlan(4, last));
}

// A step beside a solve is that first; then the settle steps after the
// prefill and preempted steps (over the factor times the expected step) are
// unsteady; the rest measure the plan.
TEST(ClassifyPlanStepTest, BesideSolveThenSettleAndPreemptedStepsThenMeasured) {
  using K = PlanStepKind;
  EXPECT_EQ(ClassifyPlanStep(true, false, 0.01, 0.001, 3), K::kBesideSolve);
  EXPECT_EQ(ClassifyPlanStep(true, true, 0.001, 0.001, 3), K::kBesideSolve);
  EXPECT_EQ(ClassifyPlanStep(false, false, 0.001, 0.001, 3), K::kUnsteady);
  EXPECT_EQ(ClassifyPlanStep(false, true, 0.0031, 0.001, 3), K::kUnsteady);
  EXPECT_EQ(ClassifyPlanStep(false, true, 0.0029, 0.001, 3), K::kMeasured);
  // No expected step (no calibration yet) or the rule off: none preempted.
  EXPECT_EQ(ClassifyPlanStep(false, true, 1.0, 0, 3), K::kMeasured);
  EXPECT_EQ(ClassifyPlanStep(false, true, 1.0, 0.001, 0), K::kMeasured);
}

TEST(PlanControllerTest, CachedPlanTakesEffectAtTheFirstStepWithoutASnapshot) {
  PlanningShared shared = PlanningShared::Create();
  shared.cache->Insert(KeyAt(0), Plan(4, 0.8), /*sequence_id=*/99, 20);
  PlanController c(Options(), BaseKey(), 1, /*initial_gamma=*/0, shared);
  StepDirective d = c.BeforeStep(0, 10);
  ASSERT_TRUE(d.apply.has_value());
  EXPECT_EQ(d.apply_source, "cache");
  EXPECT_EQ(d.gamma, 4);
  EXPECT_FALSE(d.capture);
  for (int64_t step = 1; step < 15; ++step) {
    c.AfterStep(
        Spec(4, 4, 3, 0.01));  // acceptance close to alpha_hat: no drift
    d = c.BeforeStep(step, 10 + step);
    EXPECT_FALSE(d.capture) << step;
    EXPECT_FALSE(d.apply.has_value()) << step;
  }
  EXPECT_EQ(c.stats().cache_hits, 1);
  EXPECT_EQ(c.stats().cache_misses, 0);
  EXPECT_EQ(c.stats().triggers_no_plan + c.stats().triggers_new_bucket +
                c.stats().triggers_drift,
            0);
}

// Every sequence's drafting under a cached plan is evidence for it
// (PlanCache::RecordDraftStep): once two sequences together have drafted 32
// tokens, all accepted, under a plan whose 16 reference tokens said 0.5, the
// cache chooses a longer draft, and both sequences take it up at their next
// step as a newer plan.
TEST(PlanControllerTest, DraftingUnderACachedPlanRefinesItForEverySequence) {
  PlanningShared shared = PlanningShared::Create(/*refine_every_trials=*/32);
  const DraftPlan plan = PricedPlan(1, 0.5);
  const int64_t v1 = shared.cache->Insert(KeyAt(0), plan, 99, 10);
  PlanControllerOptions options = Options();
  options.drift_min_tokens = 1000;  // the drift has a test of its own
  // The cache's odds alone (each sequence's own have a test of their own).
  options.sequence_prior_tokens = 0;
  PlanController a(options, BaseKey(), 1, 0, shared);
  PlanController b(options, BaseKey(), 2, 0, shared);
  ASSERT_EQ(a.BeforeStep(0, 10).gamma, 1);
  ASSERT_EQ(b.BeforeStep(0, 10).gamma, 1);
  for (int64_t step = 1; step <= 16; ++step) {
    a.AfterStep(Spec(1, 1, 1, 0.01));
    b.AfterStep(Spec(1, 1, 1, 0.01));
    if (step == 16) break;
    EXPECT_FALSE(a.BeforeStep(step, 10).apply.has_value()) << step;
    EXPECT_FALSE(b.BeforeStep(step, 10).apply.has_value()) << step;
  }
  auto cached = shared.cache->Peek(KeyAt(0));
  ASSERT_TRUE(cached.has_value());
  EXPECT_GT(cached->version, v1);
  EXPECT_GT(cached->plan.gamma, 1);
  EXPECT_EQ(cached->plan.evidence_trials, 32);
  for (PlanController* c : {&a, &b}) {
    StepDirective d = c->BeforeStep(16, 10);
    ASSERT_TRUE(d.apply.has_value());
    EXPECT_EQ(d.apply->version, cached->version);
    EXPECT_EQ(d.apply_source, "refined");
    EXPECT_EQ(d.gamma, cached->plan.gamma);
    EXPECT_FALSE(d.capture);  // no solve: the mask stays
  }
}

// Drift is judged against the plan's odds as the cache holds them: once
// the evidence of every sequence refined them, a sequence that agrees with
// the rest does not drift though it differs from the 16-token snapshot,
// and one whose text drafts worse does. Without refinement the first one
// drifts too.
TEST(PlanControllerTest, DriftIsJudgedAgainstTheRefinedOdds) {
  for (int64_t refine : {32, 0}) {
    PlanningShared shared = PlanningShared::Create(refine);
    DraftPlan plan = PricedPlan(1, 0.5, /*max_draft=*/2);
    plan.basis.gamma_fixed = true;  // the version stays: predictions only
    shared.cache->Insert(KeyAt(0), plan, 99, 10);
    PlanControllerOptions options = Options();
    options.drift_min_tokens = 20;
    PlanController a(options, BaseKey(), 1, 0, shared);
    PlanController b(options, BaseKey(), 2, 0, shared);
    a.BeforeStep(0, 10);
    b.BeforeStep(0, 10);
    // 16 accepted drafts each (32: refined to (8 + 32) / 48 = 0.83), then
    // a's 20th trial is judged: 1.0 against 0.83 is within 0.2.
    for (int64_t step = 1; step <= 16; ++step) {
      a.AfterStep(Spec(1, 1, 1, 0.01));
      b.AfterStep(Spec(1, 1, 1, 0.01));
      a.BeforeStep(step, 10);
      b.BeforeStep(step, 10);
    }
    for (int64_t step = 17; step <= 20; ++step) {
      a.AfterStep(Spec(1, 1, 1, 0.01));
      a.BeforeStep(step, 10);
    }
    EXPECT_EQ(a.stats().triggers_drift, refine > 0 ? 0 : 1) << refine;
    if (refine == 0) continue;
    EXPECT_NEAR(shared.cache->Peek(KeyAt(0))->plan.alpha_hat, 40.0 / 48.0,
                1e-12);
    // A third sequence whose drafts are all rejected drifts.
    PlanController c(options, BaseKey(), 3, 0, shared);
    c.BeforeStep(0, 10);
    for (int64_t step = 1; step <= 20; ++step) {
      c.AfterStep(Spec(1, 1, 0, 0.01));
      c.BeforeStep(step, 10);
    }
    EXPECT_EQ(c.stats().triggers_drift, 1);
  }
}

// A bucket's plain plan is one snapshot's verdict: once the process's
// sequences have decoded plain_recheck_steps plain steps under it (counted
// across sequences), the sequence at that step asks for a new plan (a
// recheck, one snapshot), and a drafting answer takes effect.
// A sequence weighs its own drafting above the other requests' (the
// PlanController's own odds): under a plan whose 16 reference tokens said
// 0.9, one sequence's drafts are all accepted and another's all rejected.
// At 8, 16, 32, ... trials of its own each takes the plan with its own odds
// ("sequence", same version, same mask): the first keeps gamma 4, the second
// drafts less and then not at all; 64 plain steps later it forgets its own
// evidence and drafts with the cache's plan again. The cache's plan is not
// changed by it. With sequence_prior_tokens 0 both keep the cache's gamma.
TEST(PlanControllerTest, ASequenceChoosesItsGammaFromItsOwnDrafting) {
  for (int64_t prior : {32, 0}) {
    SCOPED_TRACE(prior);
    PlanningShared shared = PlanningShared::Create(/*refine_every_trials=*/0);
    const DraftPlan plan = PricedPlan(4, 0.9);
    const int64_t v1 = shared.cache->Insert(KeyAt(0), plan, 99, 10);
    PlanControllerOptions options = Options();
    options.drift_min_tokens = 1000;  // the drift has tests of its own
    options.sequence_prior_tokens = prior;
    PlanController easy(options, BaseKey(), 1, 0, shared);
    PlanController hard(options, BaseKey(), 2, 0, shared);
    ASSERT_EQ(easy.BeforeStep(0, 10).gamma, 4);
    ASSERT_EQ(hard.BeforeStep(0, 10).gamma, 4);
    std::vector<std::string> easy_sources;
    std::vector<int> hard_gammas;  // at each plan the hard one took
    int hard_gamma = 4;
    int64_t step = 1;
    for (; step <= 100 && hard_gamma > 0; ++step) {
      easy.AfterStep(Spec(4, 4, 4, 0.01));
      hard.AfterStep(Spec(hard_gamma, hard_gamma, 0, 0.01));
      const StepDirective e = easy.BeforeStep(step, 10);
      const StepDirective h = hard.BeforeStep(step, 10);
      if (e.apply.has_value()) {
        easy_sources.push_back(e.apply_source);
        EXPECT_EQ(e.apply->version, v1);
        EXPECT_EQ(e.apply->plan.mask, plan.mask);
      }
      if (h.apply.has_value()) {
        EXPECT_EQ(h.apply_source, "sequence");
        EXPECT_EQ(h.apply->version, v1);
        EXPECT_EQ(h.apply->plan.mask, plan.mask);
        EXPECT_LT(h.apply->plan.alpha_hat, 0.9);
        hard_gammas.push_back(h.gamma);
      }
      EXPECT_EQ(e.gamma, 4) << step;
      hard_gamma = h.gamma;
    }
    EXPECT_EQ(shared.cache->Peek(KeyAt(0))->plan.gamma, 4);
    if (prior == 0) {
      EXPECT_THAT(easy_sources, IsEmpty());
      EXPECT_THAT(hard_gammas, IsEmpty());
      EXPECT_EQ(hard_gamma, 4);
      continue;
    }
    // Easy: 8 own trials after 2 steps, 16 after 4, ... 64 after 16.
    ASSERT_GE(easy_sources.size(), 4u);
    for (const std::string& source : easy_sources) {
      EXPECT_EQ(source, "sequence");
    }
    EXPECT_EQ(easy.plan_in_force()->plan.gamma, 4);
    EXPECT_GT(easy.plan_in_force()->plan.alpha_hat, 0.9);
    // Hard: one rejection a step, its odds fall and so does its gamma, to
    // plain decoding.
    ASSERT_FALSE(hard_gammas.empty());
    EXPECT_LT(hard_gammas.front(), 4);
    EXPECT_EQ(hard_gamma, 0);
    // 64 plain steps later the cache's plan is back.
    for (int64_t i = 0; i < 64; ++i, ++step) {
      hard.AfterStep(Plain(0.01));
      const StepDirective h = hard.BeforeStep(step, 10);
      if (i < 63) {
        EXPECT_FALSE(h.apply.has_value()) << i;
        EXPECT_EQ(h.gamma, 0) << i;
        continue;
      }
      ASSERT_TRUE(h.apply.has_value());
      EXPECT_EQ(h.apply_source, "cache");
      EXPECT_EQ(h.apply->version, v1);
      EXPECT_EQ(h.gamma, 4);
      EXPECT_DOUBLE_EQ(h.apply->plan.alpha_hat, 0.9);
    }
  }
}

TEST(PlanControllerTest, APlainPlanIsRecheckedAfterTheProcessDecodedUnderIt) {
  PlanningShared shared = PlanningShared::Create();
  shared.cache->Insert(KeyAt(0), Plan(0, 1.0), /*sequence_id=*/99, 5);
  PlanControllerOptions options = Options();
  options.plain_recheck_steps = 6;
  PlanController a(options, BaseKey(), 1, 0, shared);
  PlanController b(options, BaseKey(), 2, 0, shared);
  for (int64_t step = 0; step < 3; ++step) {
    EXPECT_FALSE(a.BeforeStep(step, 5 + step).capture);
    a.AfterStep(Plain(0.01));
    EXPECT_FALSE(b.BeforeStep(step, 5 + step).capture);
    b.AfterStep(Plain(0.01));
  }
  // Six plain steps between them: b's last one reached the count.
  EXPECT_EQ(a.pending_trigger(), PlanTrigger::kNone);
  EXPECT_EQ(b.pending_trigger(), PlanTrigger::kRecheck);
  EXPECT_EQ(b.stats().triggers_recheck, 1);
  EXPECT_EQ(a.stats().triggers_recheck, 0);
  StepDirective d = b.BeforeStep(3, 8);
  EXPECT_TRUE(d.capture);
  EXPECT_EQ(d.capture_offset, 0);
  b.AfterStep(Plain(0.01));
  d = b.BeforeStep(4, 9);
  EXPECT_TRUE(d.capture);
  b.AfterStep(Plain(0.01));
  SubmitTicket ticket = b.TakeTicket();
  EXPECT_EQ(ticket.trigger, PlanTrigger::kRecheck);
  CompleteTicket(shared, ticket, 2, 9, Plan(3, 0.8));
  d = a.BeforeStep(3, 8);
  ASSERT_TRUE(d.apply.has_value());
  EXPECT_EQ(d.apply_source, "shared");
  EXPECT_EQ(d.gamma, 3);
  EXPECT_EQ(a.stats().triggers_recheck, 0);
}

TEST(PlanControllerTest, NoPlanTriggersOneSnapshotAndTheSolveTakesEffect) {
  PlanningShared shared = PlanningShared::Create();
  PlanController c(Options(), BaseKey(), 1, 0, shared);
  StepDirective d = c.BeforeStep(0, 5);
  EXPECT_FALSE(d.apply.has_value());
  EXPECT_EQ(d.gamma, 0);
  EXPECT_TRUE(d.capture);
  EXPECT_EQ(d.capture_offset, 0);
  EXPECT_EQ(c.pending_trigger(), PlanTrigger::kNoPlan);
  EXPECT_TRUE(shared.cache->Claimed(KeyAt(0)));
  c.AfterStep(Plain(0.01));
  d = c.BeforeStep(1, 6);
  EXPECT_TRUE(d.capture);
  EXPECT_EQ(d.capture_offset, 1);
  c.AfterStep(Plain(0.01));
  SubmitTicket ticket = c.TakeTicket();
  EXPECT_EQ(ticket.key, KeyAt(0));
  EXPECT_EQ(ticket.trigger, PlanTrigger::kNoPlan);
  EXPECT_EQ(c.pending_trigger(), PlanTrigger::kNone);
  // Nothing more is captured while the solve runs.
  d = c.BeforeStep(2, 7);
  EXPECT_FALSE(d.capture);
  c.AfterStep(Plain(0.01));
  CompleteTicket(shared, ticket, 1, 7, Plan(3, 0.7, 0.25));
  EXPECT_FALSE(shared.cache->Claimed(KeyAt(0)));
  EXPECT_DOUBLE_EQ(shared.budget->solve_seconds(), 0.25);
  d = c.BeforeStep(3, 8);
  ASSERT_TRUE(d.apply.has_value());
  EXPECT_EQ(d.apply_source, "solve");
  EXPECT_EQ(d.gamma, 3);
  EXPECT_EQ(c.stats().triggers_no_plan, 1);
  EXPECT_EQ(c.stats().cache_misses, 1);
}

// While the planner's profile is pending the sequence decodes plainly,
// takes no snapshot and counts those steps; once it is ready the trigger it
// kept starts a snapshot at the next step. Steps drafting with the request's
// own skip mask (initial gamma) are not counted.
TEST(PlanControllerTest, WhileTheProfileIsPendingItDecodesPlainlyAndCounts) {
  PlanningShared shared = PlanningShared::Create();
  PlanController c(Options(), BaseKey(), 1, 0, shared);
  for (int64_t step = 0; step < 6; ++step) {
    const StepDirective d = c.BeforeStep(step, 5 + step, true,
                                         /*profile_pending=*/true);
    EXPECT_FALSE(d.capture) << step;
    EXPECT_EQ(d.gamma, 0) << step;
    c.AfterStep(Plain(0.01));
  }
  EXPECT_FALSE(shared.cache->Claimed(KeyAt(0)));
  EXPECT_EQ(c.pending_trigger(), PlanTrigger::kNoPlan);
  EXPECT_TRUE(c.stats().profile_pending);
  EXPECT_EQ(c.stats().profile_pending_steps, 6);
  EXPECT_EQ(c.stats().triggers_no_plan, 1);  // raised once, kept
  EXPECT_EQ(c.stats().budget_deferrals, 0);
  // The profile is ready: the kept trigger's snapshot starts.
  const StepDirective ready = c.BeforeStep(6, 11, true, false);
  EXPECT_TRUE(ready.capture);
  EXPECT_TRUE(shared.cache->Claimed(KeyAt(0)));
  EXPECT_EQ(c.stats().profile_pending_steps, 6);
  EXPECT_EQ(c.stats().triggers_no_plan, 1);

  // With a skip mask the steps draft: pending, but none decoded plainly.
  PlanningShared other = PlanningShared::Create();
  PlanController masked(Options(), BaseKey(), 2, /*initial_gamma=*/3, other);
  for (int64_t step = 0; step < 4; ++step) {
    EXPECT_EQ(masked.BeforeStep(step, 5 + step, true, true).gamma, 3);
    masked.AfterStep(Spec(3, 3, 2, 0.01));
  }
  EXPECT_TRUE(masked.stats().profile_pending);
  EXPECT_EQ(masked.stats().profile_pending_steps, 0);

  // Never pending: nothing reported.
  PlanController plain(Options(), BaseKey(), 3, 0, PlanningShared::Create());
  plain.BeforeStep(0, 5);
  EXPECT_FALSE(plain.stats().profile_pending);
  EXPECT_EQ(plain.stats().profile_pending_steps, 0);
}

TEST(PlanControllerTest, NoSnapshotStartsWhileTheBatchRunsWithoutDrafts) {
  PlanningShared shared = PlanningShared::Create();
  PlanController c(Options(), BaseKey(), 1, 0, shared);
  // The trigger is raised but waits: no capture, no claim on the bucket.
  StepDirective d = c.BeforeStep(0, 5, /*may_start_capture=*/false);
  EXPECT_FALSE(d.capture);
  EXPECT_EQ(c.pending_trigger(), PlanTrigger::kNoPlan);
  EXPECT_FALSE(shared.cache->Claimed(KeyAt(0)));
  c.AfterStep(Plain(0.01));
  d = c.BeforeStep(1, 6, false);
  EXPECT_FALSE(d.capture);
  c.AfterStep(Plain(0.01));
  // The first step that may draft starts the snapshot.
  d = c.BeforeStep(2, 7, true);
  EXPECT_TRUE(d.capture);
  EXPECT_EQ(d.capture_offset, 0);
  EXPECT_TRUE(shared.cache->Claimed(KeyAt(0)));
  c.AfterStep(Plain(0.01));
  // A capture in progress goes on through a step without drafts.
  d = c.BeforeStep(3, 8, false);
  EXPECT_TRUE(d.capture);
  EXPECT_EQ(d.capture_offset, 1);
  EXPECT_EQ(c.stats().triggers_no_plan, 1);
}

TEST(PlanControllerTest, CrossingIntoABucketUsesItsPlanOrTriggers) {
  PlanningShared shared = PlanningShared::Create();
  shared.cache->Insert(KeyAt(0), Plan(2, 0.8), 50, 10);
  shared.cache->Insert(KeyAt(1), Plan(5, 0.8), 50, 40);
  PlanController c(Options(), BaseKey(), 1, 0, shared);
  EXPECT_EQ(c.BeforeStep(0, 30).gamma, 2);
  c.AfterStep(Spec(2, 2, 2, 0.01));
  StepDirective d = c.BeforeStep(1, 33);  // bucket 1: cached
  ASSERT_TRUE(d.apply.has_value());
  EXPECT_EQ(d.gamma, 5);
  c.AfterStep(Spec(5, 5, 4, 0.01));
  d = c.BeforeStep(2, 64);  // bucket 2: nothing cached; the bucket-1 plan stays
  EXPECT_FALSE(d.apply.has_value());
  EXPECT_EQ(d.gamma, 5);
  EXPECT_EQ(c.pending_trigger(), PlanTrigger::kNewBucket);
  EXPECT_TRUE(d.capture);
  EXPECT_EQ(c.stats().cache_hits, 2);
  EXPECT_EQ(c.stats().cache_misses, 1);
  EXPECT_EQ(c.stats().triggers_new_bucket, 1);
  // Leaving the bucket mid-capture abandons the snapshot and its claim.
  c.AfterStep(Spec(5, 5, 4, 0.01));
  d = c.BeforeStep(3, 96);
  EXPECT_FALSE(shared.cache->Claimed(KeyAt(2)));
  EXPECT_EQ(c.stats().triggers_new_bucket, 2);
}

// Steps 0 and 1, at contexts `context` and `context` + 1, capture the
// snapshot of the first step's trigger; returns its ticket.
SubmitTicket CaptureFirstSnapshot(PlanController& c, int64_t context) {
  EXPECT_TRUE(c.BeforeStep(0, context).capture);
  c.AfterStep(Plain(0.01));
  EXPECT_TRUE(c.BeforeStep(1, context + 1).capture);
  c.AfterStep(Plain(0.01));
  return c.TakeTicket();
}

// A solve that answers after the sequence left the snapshot's bucket (on a
// small CPU a solve can outlast a bucket) takes effect while nothing of the
// current bucket is in force, and the current bucket's own plan replaces it.
TEST(PlanControllerTest, ALateSolveTakesEffectUntilTheBucketsOwnPlanComes) {
  PlanningShared shared = PlanningShared::Create();
  PlanController c(Options(), BaseKey(), 1, 0, shared);
  const SubmitTicket first = CaptureFirstSnapshot(c, 5);
  ASSERT_EQ(first.key, KeyAt(0));
  for (int64_t step = 2; step < 4; ++step) {
    EXPECT_FALSE(c.BeforeStep(step, 5 + step).capture);
    c.AfterStep(Plain(0.01));
  }
  // Bucket 1 before the answer: no plan, a snapshot of its own starts.
  StepDirective d = c.BeforeStep(4, 33);
  EXPECT_FALSE(d.apply.has_value());
  EXPECT_EQ(d.gamma, 0);
  EXPECT_TRUE(d.capture);
  c.AfterStep(Plain(0.01));
  CompleteTicket(shared, first, 1, 6, Plan(3, 0.7));
  d = c.BeforeStep(5, 34);
  ASSERT_TRUE(d.apply.has_value()) << "the bucket-0 plan, the best there is";
  EXPECT_EQ(d.apply_source, "solve");
  EXPECT_EQ(d.gamma, 3);
  EXPECT_TRUE(d.capture) << "bucket 1's own snapshot goes on";
  c.AfterStep(Spec(3, 3, 2, 0.01));
  const SubmitTicket second = c.TakeTicket();
  ASSERT_EQ(second.key, KeyAt(1));
  d = c.BeforeStep(6, 37);
  EXPECT_FALSE(d.apply.has_value());
  EXPECT_EQ(d.gamma, 3);
  c.AfterStep(Spec(3, 3, 2, 0.01));
  CompleteTicket(shared, second, 1, 37, Plan(5, 0.8));
  d = c.BeforeStep(7, 40);
  ASSERT_TRUE(d.apply.has_value());
  EXPECT_EQ(d.gamma, 5);
  c.AfterStep(Spec(5, 5, 4, 0.01));
  EXPECT_FALSE(c.BeforeStep(8, 45).apply.has_value());
}

TEST(PlanControllerTest, ALateSolveNeverReplacesTheCurrentBucketsPlan) {
  PlanningShared shared = PlanningShared::Create();
  shared.cache->Insert(KeyAt(1), Plan(5, 0.8), /*sequence_id=*/50, 40);
  PlanController c(Options(), BaseKey(), 1, 0, shared);
  const SubmitTicket first = CaptureFirstSnapshot(c, 5);
  StepDirective d = c.BeforeStep(2, 33);  // bucket 1: cached
  ASSERT_TRUE(d.apply.has_value());
  EXPECT_EQ(d.gamma, 5);
  c.AfterStep(Spec(5, 5, 4, 0.01));
  CompleteTicket(shared, first, 1, 6, Plan(2, 0.6));
  for (int64_t step = 3; step < 8; ++step) {
    d = c.BeforeStep(step, 31 + step);
    EXPECT_FALSE(d.apply.has_value()) << step;
    EXPECT_EQ(d.gamma, 5) << step;
    c.AfterStep(Spec(5, 5, 4, 0.01));
  }
  // A failed late solve leaves the plan in force as it is, too.
  PlanController e(Options(), BaseKey(), 2, 0, shared);
  const SubmitTicket failing = CaptureFirstSnapshot(e, 64);  // bucket 2
  EXPECT_FALSE(e.BeforeStep(2, 96).apply.has_value());       // bucket 3
  e.AfterStep(Plain(0.01));
  CompleteTicket(shared, failing, 2, 65,
                 absl::StatusOr<DraftPlan>(absl::InternalError("solve")));
  d = e.BeforeStep(3, 97);
  EXPECT_FALSE(d.apply.has_value());
  EXPECT_EQ(d.gamma, 0);
}

TEST(PlanControllerTest, ConcurrentSequencesShareOneSolvePerBucket) {
  PlanningShared shared = PlanningShared::Create();
  PlanController a(Options(), BaseKey(), 1, 0, shared);
  PlanController b(Options(), BaseKey(), 2, 0, shared);
  EXPECT_TRUE(a.BeforeStep(0, 5).capture);
  EXPECT_FALSE(b.BeforeStep(0, 5).capture) << "a already claimed bucket 0";
  EXPECT_EQ(b.pending_trigger(), PlanTrigger::kNoPlan);
  a.AfterStep(Plain(0.01));
  b.AfterStep(Plain(0.01));
  EXPECT_TRUE(a.BeforeStep(1, 6).capture);
  EXPECT_FALSE(b.BeforeStep(1, 6).capture);
  SubmitTicket ticket = a.TakeTicket();
  CompleteTicket(shared, ticket, 1, 6, Plan(4, 0.8));
  StepDirective db = b.BeforeStep(2, 7);
  ASSERT_TRUE(db.apply.has_value());
  EXPECT_EQ(db.apply_source, "shared");
  EXPECT_EQ(b.pending_trigger(), PlanTrigger::kNone);
  EXPECT_EQ(a.BeforeStep(2, 7).apply_source, "solve");
}

TEST(PlanControllerTest, AFailedSolveReleasesTheClaimSoAnotherSequenceTries) {
  PlanningShared shared = PlanningShared::Create();
  PlanControllerOptions o = Options();
  o.reference_steps = 1;
  PlanController a(o, BaseKey(), 1, 0, shared);
  PlanController b(o, BaseKey(), 2, 0, shared);
  EXPECT_TRUE(a.BeforeStep(0, 5).capture);
  SubmitTicket ticket = a.TakeTicket();
  EXPECT_FALSE(b.BeforeStep(0, 5).capture);
  CompleteTicket(shared, ticket, 1, 5, absl::UnavailableError("planner gone"));
  EXPECT_EQ(shared.cache->size(), 0);
  b.AfterStep(Plain(0.01));
  EXPECT_TRUE(b.BeforeStep(1, 6).capture);
}

TEST(PlanControllerTest, DriftBeyondToleranceTriggersOncePerPlan) {
  PlanningShared shared = PlanningShared::Create();
  shared.cache->Insert(KeyAt(0), Plan(4, 0.9), 50, 10);
  PlanController c(Options(), BaseKey(), 1, 0, shared);
  c.BeforeStep(0, 1);
  // Every step rejects the first draft token: observed acceptance 0, one trial
  // per step; drift_min_tokens = 10 trials.
  int64_t step = 1;
  for (; step <= 9; ++step) {
    c.AfterStep(Spec(4, 4, 0, 0.01));
    EXPECT_FALSE(c.BeforeStep(step, 1).capture) << step;
  }
  EXPECT_EQ(c.pending_trigger(), PlanTrigger::kNone);
  c.AfterStep(Spec(4, 4, 0, 0.01));  // the 10th trial
  EXPECT_EQ(c.pending_trigger(), PlanTrigger::kDrift);
  EXPECT_EQ(c.stats().triggers_drift, 1);
  StepDirective d = c.BeforeStep(step, 1);
  EXPECT_TRUE(d.capture);
  c.AfterStep(Spec(4, 4, 0, 0.01));
  EXPECT_TRUE(c.BeforeStep(++step, 1).capture);
  SubmitTicket ticket = c.TakeTicket();
  EXPECT_EQ(ticket.trigger, PlanTrigger::kDrift);
  for (int i = 0; i < 20; ++i) {
    c.AfterStep(Spec(4, 4, 0, 0.01));
    EXPECT_FALSE(c.BeforeStep(++step, 1).capture)
        << "drift fires once per plan";
  }
  EXPECT_EQ(c.stats().triggers_drift, 1);
  // The new plan replaces the cached one for every sequence in the bucket.
  CompleteTicket(shared, ticket, 1, 1, Plan(2, 0.1));
  StepDirective applied = c.BeforeStep(++step, 1);
  ASSERT_TRUE(applied.apply.has_value());
  EXPECT_EQ(applied.gamma, 2);
}

TEST(PlanControllerTest, AcceptanceWithinToleranceNeverTriggers) {
  PlanningShared shared = PlanningShared::Create();
  // alpha_hat 0.75; steps accept 3 of 4 and reject the 4th: trials 4, accepted
  // 3 per step, observed 0.75.
  shared.cache->Insert(KeyAt(0), Plan(4, 0.75), 50, 10);
  PlanController c(Options(), BaseKey(), 1, 0, shared);
  c.BeforeStep(0, 1);
  for (int64_t step = 1; step < 200; ++step) {
    c.AfterStep(Spec(4, 4, 3, 0.01));
    EXPECT_FALSE(c.BeforeStep(step, 1).capture);
  }
  EXPECT_EQ(c.stats().triggers_drift, 0);
}

// Acceptance as planned (every draft token accepted against alpha_hat 0.9),
// but the steps draft 2 tokens where the plan expected 1.4 (its reference
// tokens were less confident than the text that follows): drift, once the
// trials are in. Steps that draft 1 or 2 (1.5 a step) are within 20% of 1.4,
// and a plan that predicts no drafts count (0) is judged on acceptance only.
TEST(PlanControllerTest, DraftsPerStepOffThePredictionTriggerDrift) {
  for (const double predicted : {1.4, 0.0}) {
    SCOPED_TRACE(predicted);
    PlanningShared shared = PlanningShared::Create();
    DraftPlan plan = Plan(4, 0.9);
    plan.predicted_drafts_per_step = predicted;
    shared.cache->Insert(KeyAt(0), plan, 50, 10);
    PlanController c(Options(), BaseKey(), 1, 0, shared);
    c.BeforeStep(0, 1);
    int64_t step = 1;
    for (; step <= 4; ++step) {  // 2 trials a step; drift_min_tokens = 10
      c.AfterStep(Spec(4, 2, 2, 0.01));
      c.BeforeStep(step, 1);
    }
    EXPECT_EQ(c.pending_trigger(), PlanTrigger::kNone);
    c.AfterStep(Spec(4, 2, 2, 0.01));
    EXPECT_EQ(c.stats().triggers_drift, predicted > 0 ? 1 : 0);
  }
  PlanningShared shared = PlanningShared::Create();
  DraftPlan plan = Plan(4, 0.9);
  plan.predicted_drafts_per_step = 1.4;
  shared.cache->Insert(KeyAt(0), plan, 50, 10);
  PlanController c(Options(), BaseKey(), 1, 0, shared);
  c.BeforeStep(0, 1);
  for (int64_t step = 1; step < 200; ++step) {
    c.AfterStep(step % 2 == 0 ? Spec(4, 2, 2, 0.01) : Spec(4, 1, 1, 0.01));
    c.BeforeStep(step, 1);
  }
  EXPECT_EQ(c.stats().triggers_drift, 0);
}

TEST(PlanControllerTest, TheBudgetDefersATriggerUntilDecodingCatchesUp) {
  PlanningShared shared = PlanningShared::Create();
  shared.budget->Settle(0, 1.0);  // 1 s of solving already spent
  PlanControllerOptions o = Options();
  o.planner_budget = 0.05;  // needs 20 s of decoding
  PlanController c(o, BaseKey(), 1, 0, shared);
  StepDirective d = c.BeforeStep(0, 5);
  EXPECT_FALSE(d.capture);
  EXPECT_EQ(c.pending_trigger(), PlanTrigger::kNoPlan);
  EXPECT_FALSE(shared.cache->Claimed(KeyAt(0)))
      << "a deferred trigger holds no claim";
  for (int64_t step = 1; step < 10; ++step) {
    c.AfterStep(Plain(1.0));
    EXPECT_FALSE(c.BeforeStep(step, 5).capture);
  }
  EXPECT_EQ(c.stats().budget_deferrals, 1) << "one trigger, counted once";
  EXPECT_EQ(shared.budget->deferrals(), 1);
  c.AfterStep(Plain(10.0));  // 19 s decoded
  EXPECT_FALSE(c.BeforeStep(10, 5).capture);
  c.AfterStep(Plain(1.0));  // 20 s: 1 / 20 = 0.05
  EXPECT_TRUE(c.BeforeStep(11, 5).capture);
  EXPECT_DOUBLE_EQ(shared.budget->decode_seconds(), 20.0);
}

TEST(PlanControllerTest, SnapshotsOfOneSequenceAreAtLeastTheGapApart) {
  PlanningShared shared = PlanningShared::Create();
  PlanControllerOptions o = Options();
  o.reference_steps = 1;
  o.min_request_gap = 10;
  PlanController c(o, BaseKey(), 1, 0, shared);
  EXPECT_TRUE(c.BeforeStep(0, 5).capture);
  CompleteTicket(shared, c.TakeTicket(), 1, 5, absl::InternalError("failed"));
  for (int64_t step = 1; step < 10; ++step) {
    c.AfterStep(Plain(0.01));
    EXPECT_FALSE(c.BeforeStep(step, 5).capture) << step;
  }
  c.AfterStep(Plain(0.01));
  EXPECT_TRUE(c.BeforeStep(10, 5).capture);
}

// ---------------------------------------------------------------------------
// The guard

// The guard's rules against the plain-rate table: a narrow loss holds at
// once, as with confirm_losses off (its confirmation by a probe's pairs has
// tests of its own: ANarrowLossIsConfirmedByAProbesPairs).
PlanControllerOptions GuardOn() {
  PlanControllerOptions o = Options();
  o.guard.enabled = true;
  o.guard.margin = 0.05;
  o.guard.min_steps = 4;
  o.guard.probe_steps = 3;
  o.guard.confirm_losses = false;
  return o;
}

// The process's planning state with a plan of `gamma` cached at bucket 0
// and plain timings from another sequence: 0.005 s a token (200 tokens/s).
PlanningShared SharedWithPlanAndPlainRate(int gamma = 3) {
  PlanningShared shared = PlanningShared::Create();
  shared.cache->Insert(KeyAt(0), Plan(gamma, 0.5), 50, 10);
  for (int i = 0; i < 3; ++i) {
    shared.plain_rates->Record(BaseKey().ExecutionId(), 32, 0, 0.005);
  }
  return shared;
}

// Runs one probe pair: the setting's step (`setting`, drafting with
// `gamma`), then a plain step of `plain_seconds`.
void ProbePair(PlanController& c, int64_t& step, int gamma,
               const StepObservation& setting, double plain_seconds) {
  EXPECT_EQ(c.BeforeStep(step, 1).gamma, gamma) << "the setting's step";
  c.AfterStep(setting);
  ++step;
  EXPECT_EQ(c.BeforeStep(step, 1).gamma, 0) << "the probe's plain step";
  c.AfterStep(Plain(plain_seconds));
  ++step;
}

PlanControllerOptions GuardOnProbing(bool probe_first) {
  PlanControllerOptions o = GuardOn();
  o.guard.probe_first = probe_first;
  return o;
}

// A plan of gamma 3 in a bucket without plain timings: without
// probe_first, 4 of its steps (`before`) first; then the probe's 3 pairs
// (`in_probe`, and plain steps of `plain_seconds`).
void RunFirstProbe(PlanController& c, bool probe_first, int64_t& step,
                   const StepObservation& before,
                   const StepObservation& in_probe, double plain_seconds) {
  if (!probe_first) {
    for (int i = 0; i < 4; ++i, ++step) {
      EXPECT_EQ(c.BeforeStep(step, 1).gamma, 3) << "speculative " << i;
      c.AfterStep(before);
    }
    EXPECT_EQ(c.stats().guard_checks, 0) << "no plain rate yet: a probe";
  }
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(i);
    ProbePair(c, step, 3, in_probe, plain_seconds);
  }
}

// A bucket without plain timings: a probe of 3 plain steps, each after one
// of the plan's steps, from the plan's first step (probe_first) or after
// its first window (without). The probe's pairs judge the plan: it loses,
// and then decodes plainly until a newer plan arrives.
//
// "slow spell": the machine slows down to half speed while the probe runs,
// and the plan runs at 0.8x plain decoding's rate throughout. Its normal
// steps (2 tokens in 12.5 ms, 160 tokens/s) would beat the slowed plain
// steps (10 ms, 100 tokens/s), but the probe judges its own pairs, slowed
// alike (80 against 100 tokens/s: a clear loss). Plain steps measured back
// to back in the slow spell would have been its reference.
TEST(SpeculationGuardTest, ALosingPlanFallsBackToPlainUntilTheNextPlan) {
  struct Case {
    const char* name;
    StepObservation before;    // the plan's steps before the probe
    StepObservation in_probe;  // its steps in the probe
    double plain_seconds;      // the probe's plain steps
    double spec_tps;           // the judgement's rates
    double plain_tps;
  };
  // Speculative steps of 2 tokens in 0.02 s: 100 tokens/s; plain steps of
  // 5 ms: 200 tokens/s.
  const Case cases[] = {
      {"steady", Spec(3, 3, 1, 0.02), Spec(3, 3, 1, 0.02), 0.005, 100, 200},
      {"slow spell", Spec(3, 3, 1, 0.0125), Spec(3, 3, 1, 0.025), 0.01, 80,
       100},
  };
  for (const Case& test : cases) {
    for (bool probe_first : {true, false}) {
      SCOPED_TRACE(absl::StrCat(
          test.name,
          probe_first ? ", probe first" : ", probe before the judgement"));
      PlanningShared shared = PlanningShared::Create();
      shared.cache->Insert(KeyAt(0), Plan(3, 0.5), 50, 10);
      PlanController c(GuardOnProbing(probe_first), BaseKey(), 1, 0, shared);
      int64_t step = 0;
      RunFirstProbe(c, probe_first, step, test.before, test.in_probe,
                    test.plain_seconds);
      EXPECT_EQ(c.stats().guard_probe_steps, 3);
      EXPECT_EQ(c.stats().guard_checks, 1);
      EXPECT_EQ(c.stats().guard_fallbacks, 1);
      EXPECT_NEAR(c.stats().guard_last_spec_tps, test.spec_tps, 1e-9);
      EXPECT_NEAR(c.stats().guard_last_plain_tps, test.plain_tps, 1e-9);
      for (int i = 0; i < 10; ++i) {
        EXPECT_EQ(c.BeforeStep(step, 1).gamma, 0) << "fallback " << i;
        c.AfterStep(Plain(test.plain_seconds));
        ++step;
      }
      EXPECT_EQ(c.stats().guard_plain_steps, 10);
      EXPECT_EQ(c.stats().triggers_drift, 0)
          << "plain steps observe no acceptance";
      // A newer plan for the bucket: speculation resumes and is measured
      // afresh (the bucket has plain timings now: no probe).
      shared.cache->Insert(KeyAt(0), Plan(5, 0.5), 60, 10);
      StepDirective d = c.BeforeStep(step, 1);
      ASSERT_TRUE(d.apply.has_value());
      EXPECT_EQ(d.gamma, 5);
    }
  }
}

// The first settle_steps steps after the prefill are no evidence: no probe
// runs during them, their plain steps are no reference and their
// speculative steps are not judged, however slow; the probe starts after
// them.
TEST(SpeculationGuardTest, TheStepsRightAfterThePrefillAreNoEvidence) {
  PlanningShared shared = PlanningShared::Create();
  shared.cache->Insert(KeyAt(0), Plan(3, 0.5), 50, 10);
  PlanControllerOptions o = GuardOn();
  o.guard.settle_steps = 7;
  // The settle steps draft here (AnUnprovenSettingSettlesPlainly has the
  // default, which decodes them plainly for a setting that has not won).
  o.guard.settle_plain = false;
  PlanController c(o, BaseKey(), 1, 0, shared);
  int64_t step = 0;
  for (; step < 7; ++step) {
    EXPECT_EQ(c.BeforeStep(step, 1).gamma, 3) << "settling " << step;
    c.AfterStep(Spec(3, 3, 1, 0.2));  // 10 tokens/s: a clear loser
  }
  EXPECT_EQ(c.stats().guard_probe_steps, 0);
  EXPECT_EQ(c.stats().guard_checks, 0);
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(i);
    ProbePair(c, step, 3, Spec(3, 3, 2, 0.012), 0.005);  // 250 against 200
  }
  EXPECT_EQ(c.stats().guard_probe_steps, 3);
  EXPECT_EQ(c.stats().guard_checks, 0)
      << "the pairs condemn only a clear loser; a winner waits for its "
         "window";
  EXPECT_EQ(c.BeforeStep(step, 1).gamma, 3);
  c.AfterStep(Spec(3, 3, 2, 0.012));
  ++step;
  EXPECT_EQ(c.stats().guard_checks, 1) << "min_steps: against the probe's "
                                          "plain steps in the table";
  EXPECT_EQ(c.stats().guard_fallbacks, 0);
  EXPECT_NEAR(c.stats().guard_last_spec_tps, 250, 1e-9);

  // Plain decoding (a plain plan cached: no solve in flight): the first
  // settle_steps plain steps are not recorded as the bucket's plain rate,
  // the later ones are.
  PlanningShared plain_only = PlanningShared::Create();
  plain_only.cache->Insert(KeyAt(0), Plan(0, 0.5), 50, 10);
  PlanController p(o, BaseKey(), 2, 0, plain_only);
  for (int64_t k = 0; k < 10; ++k) {
    EXPECT_EQ(p.BeforeStep(k, 1).gamma, 0);
    p.AfterStep(Plain(k < 7 ? 0.05 : 0.005));
  }
  EXPECT_EQ(plain_only.plain_rates->samples(BaseKey().ExecutionId(), 32, 0), 3);
}

// The settle steps weigh in no judgement, so a setting that has not won its
// last judgement at the bucket decodes them plainly instead of risking a
// loser's cost unmeasured; once it won there, the next sequence drafts from
// its first step. A loss (its re-probe) and another bucket settle plainly
// again; settle_plain = false drafts them.
TEST(SpeculationGuardTest, AnUnprovenSettingSettlesPlainly) {
  GuardOptions o;
  o.settle_steps = 3;
  o.min_steps = 4;
  o.early_steps = 0;
  o.probe_steps = 3;
  PlanningShared shared = PlanningShared::Create();
  const std::string execution = BaseKey().ExecutionId();
  for (int i = 0; i < 3; ++i) {
    shared.plain_rates->Record(execution, 32, 0, 0.005);  // 200 tokens/s
  }
  const std::string setting = "static a1 D3";
  SpeculationGuard first(o, shared.plain_rates, shared.verdicts, execution,
                         setting, 1, 32);
  PlanningStats stats;
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(first.BeforeStep(0, stats)) << "settling " << i;
    first.Observe(true, 0, Plain(0.005), stats);
  }
  EXPECT_EQ(stats.guard_settle_steps, 3);
  EXPECT_EQ(stats.guard_probe_steps + stats.guard_plain_steps, 0);
  EXPECT_EQ(shared.plain_rates->samples(execution, 32, 0), 3)
      << "settle steps are no plain reference either";
  for (int i = 0; i < 4; ++i) {  // settled: 3 tokens in 12 ms, 250 tokens/s
    EXPECT_FALSE(first.BeforeStep(0, stats)) << "drafting " << i;
    first.Observe(true, 0, Spec(3, 3, 2, 0.012), stats);
  }
  EXPECT_EQ(stats.guard_checks, 1);
  EXPECT_EQ(stats.guard_fallbacks, 0);

  SpeculationGuard second(o, shared.plain_rates, shared.verdicts, execution,
                          setting, 2, 32);
  PlanningStats second_stats;
  EXPECT_FALSE(second.BeforeStep(0, second_stats))
      << "it won at bucket 0: drafts from the first step";
  EXPECT_TRUE(second.BeforeStep(2, second_stats)) << "never judged at 2";
  EXPECT_EQ(second_stats.guard_settle_steps, 1);

  GuardVerdicts::Verdict lost;
  lost.spec_tps = 100;
  lost.plain_tps = 200;
  shared.verdicts->Judge(execution, setting, 32, 0,
                         GuardVerdicts::Judgement::kLoss, lost, 1);
  SpeculationGuard third(o, shared.plain_rates, shared.verdicts, execution,
                         setting, 3, 32);
  PlanningStats third_stats;
  EXPECT_TRUE(third.BeforeStep(0, third_stats)) << "the verdict's one step";
  EXPECT_EQ(third_stats.guard_plain_steps, 1);
  EXPECT_TRUE(third.BeforeStep(0, third_stats)) << "its re-probe settles";
  EXPECT_EQ(third_stats.guard_settle_steps, 1);

  o.settle_plain = false;
  SpeculationGuard drafting(o, shared.plain_rates, shared.verdicts, execution,
                            setting, 4, 32);
  PlanningStats drafting_stats;
  EXPECT_FALSE(drafting.BeforeStep(2, drafting_stats));
  EXPECT_EQ(drafting_stats.guard_settle_steps, 0);
}

// The guard of the hold tests: no settle steps, judged at the 4th step (no
// earlier), 3 plain steps make a rate, a first hold of 5 plain steps.
// As GuardOn: a narrow loss holds at once (confirm_losses off).
GuardOptions HoldTestOptions() {
  GuardOptions o;
  o.settle_steps = 0;
  o.min_steps = 4;
  o.early_steps = 0;
  o.probe_steps = 3;
  o.reprobe_steps = 5;
  o.confirm_losses = false;
  return o;
}

// A loss far below plain decoding (100 tokens/s against 200: below 200 x
// (1 - early_loss) even with its error) is a clear one: it counts as two
// losses in a row, so its hold is twice reprobe_steps, and it holds the
// mode's other settings never judged at its bucket or the buckets beside
// it (carried, each then re-probed as a loser). A narrow loss (190 against
// 200 x 1.03) holds reprobe_steps and holds no other setting; neither does
// a clear loss with clear_losses off, nor one of another mode.
TEST(SpeculationGuardTest, AClearLossHoldsTwiceAndHoldsTheModesOtherSettings) {
  for (const bool clear_losses : {true, false}) {
    SCOPED_TRACE(clear_losses ? "clear losses" : "clear_losses off");
    GuardOptions o = HoldTestOptions();
    o.clear_losses = clear_losses;
    o.explore_share = 0;  // ALossHoldsAtLeastItsCostOverTheExploreShare
    PlanningShared shared = PlanningShared::Create();
    const std::string execution = BaseKey().ExecutionId();
    for (int64_t bucket = 0; bucket < 5; ++bucket) {
      for (int i = 0; i < 3; ++i) {
        shared.plain_rates->Record(execution, 32, bucket, 0.005);  // 200/s
      }
    }
    // Drafts `step` at `bucket` until the guard judges; returns the stats.
    const auto judge = [&](const std::string& setting, uint64_t id,
                           int64_t bucket, const StepObservation& step) {
      SpeculationGuard guard(o, shared.plain_rates, shared.verdicts, execution,
                             setting, id, 32);
      PlanningStats stats;
      for (int i = 0; i < 4; ++i) {
        EXPECT_FALSE(guard.BeforeStep(bucket, stats)) << setting << " " << i;
        guard.Observe(true, bucket, step, stats);
      }
      EXPECT_EQ(stats.guard_checks, 1) << setting;
      return stats;
    };
    // Plain steps a new sequence of `setting` decodes at `bucket` before it
    // drafts, with how many of them were carried.
    const auto hold = [&](const std::string& setting, uint64_t id,
                          int64_t bucket, int64_t* carried = nullptr) {
      SpeculationGuard guard(o, shared.plain_rates, shared.verdicts, execution,
                             setting, id, 32);
      PlanningStats stats;
      int64_t plain = 0;
      while (plain < 40 && guard.BeforeStep(bucket, stats)) {
        guard.Observe(true, bucket, Plain(0.005), stats);
        ++plain;
      }
      if (carried != nullptr) *carried = stats.guard_carried_steps;
      return plain;
    };

    const std::string stories = "knn stories a1,m2 D3";
    const std::string novels = "knn novels m1 D2";
    const std::string other_novels = "knn novels m3 D2";
    PlanningStats stats = judge(stories, 1, 2, Spec(3, 3, 1, 0.02));
    EXPECT_EQ(stats.guard_fallbacks, 1);
    const std::optional<GuardVerdicts::Verdict> verdict =
        shared.verdicts->Find(execution, stories, 32, 2);
    ASSERT_TRUE(verdict.has_value());
    EXPECT_EQ(verdict->clear, clear_losses);
    EXPECT_EQ(verdict->hold_steps, clear_losses ? 10 : 5);
    EXPECT_EQ(verdict->losses_in_a_row, clear_losses ? 2 : 1);
    // Another knn setting, at the loser's bucket and beside it.
    int64_t carried = 0;
    EXPECT_EQ(hold(novels, 2, 2, &carried), clear_losses ? 5 : 0);
    EXPECT_EQ(carried, clear_losses ? 5 : 0);
    if (clear_losses) {
      const std::optional<GuardVerdicts::Verdict> sibling =
          shared.verdicts->Find(execution, novels, 32, 2);
      EXPECT_FALSE(sibling.has_value()) << "its hold was spent";
      EXPECT_TRUE(shared.verdicts->LastLost(execution, novels, 32, 2, 0))
          << "a carried loss: its re-probe is a loser's";
    }
    EXPECT_EQ(hold(other_novels, 3, 1), clear_losses ? 5 : 0);
    EXPECT_EQ(hold(other_novels, 4, 3), clear_losses ? 5 : 0);
    EXPECT_EQ(hold(other_novels, 5, 4), 0) << "two buckets away";
    EXPECT_EQ(hold("static a1,m2 D3", 6, 2), 0) << "another mode";
    EXPECT_EQ(shared.verdicts->verdicts_carried(), clear_losses ? 3 : 0);

    // A narrow loss at bucket 0 (with no clear loss beside it).
    PlanningShared narrow_shared = PlanningShared::Create();
    shared = narrow_shared;
    for (int i = 0; i < 3; ++i) {
      shared.plain_rates->Record(execution, 32, 0, 0.005);
    }
    stats = judge(stories, 7, 0, Spec(3, 3, 1, 0.0105));  // 190 tokens/s
    EXPECT_EQ(stats.guard_fallbacks, 1);
    ASSERT_TRUE(shared.verdicts->Find(execution, stories, 32, 0).has_value());
    EXPECT_FALSE(shared.verdicts->Find(execution, stories, 32, 0)->clear);
    EXPECT_EQ(hold(stories, 8, 0), 5);
    EXPECT_EQ(hold(novels, 9, 0), 0) << "a narrow loss holds no sibling";
  }
}

// A loss holds the setting at least what its judged steps cost over plain
// decoding, in plain steps, over explore_share. Four steps of 2 tokens in
// 20 ms (100 tokens/s) against plain decoding's 200: their 8 tokens took
// 80 ms, 40 ms plainly, a cost of 8 plain steps, so with a share of 0.1 a
// hold of 80 (above reprobe_steps' 5), capped by max_hold_steps. A narrow
// loss (190 tokens/s: a cost of 0.4 steps, 4 at that share) keeps
// reprobe_steps, and at a share of 0.01 holds 40. explore_share 0 leaves
// the hold to the doubling.
TEST(SpeculationGuardTest, ALossHoldsAtLeastItsCostOverTheExploreShare) {
  struct Case {
    double explore_share;
    int64_t max_hold_steps;
    double step_seconds;
    int64_t want_hold;
  };
  for (const Case& c : {Case{0.1, 4096, 0.02, 80}, Case{0.1, 50, 0.02, 50},
                        Case{0.0, 4096, 0.02, 5}, Case{0.1, 4096, 0.0105, 5},
                        Case{0.01, 4096, 0.0105, 40}}) {
    SCOPED_TRACE(absl::StrCat("share ", c.explore_share, " max ",
                              c.max_hold_steps, " step ", c.step_seconds));
    GuardOptions o = HoldTestOptions();
    o.clear_losses = false;
    o.explore_share = c.explore_share;
    o.max_hold_steps = c.max_hold_steps;
    PlanningShared shared = PlanningShared::Create();
    const std::string execution = BaseKey().ExecutionId();
    for (int i = 0; i < 3; ++i) {
      shared.plain_rates->Record(execution, 32, 1, 0.005);  // 200/s
    }
    const std::string setting = "static a1,m2 D3";
    SpeculationGuard guard(o, shared.plain_rates, shared.verdicts, execution,
                           setting, 1, 32);
    PlanningStats stats;
    for (int i = 0; i < 4; ++i) {
      EXPECT_FALSE(guard.BeforeStep(1, stats)) << i;
      guard.Observe(true, 1, Spec(3, 3, 1, c.step_seconds), stats);
    }
    EXPECT_EQ(stats.guard_fallbacks, 1);
    const std::optional<GuardVerdicts::Verdict> verdict =
        shared.verdicts->Find(execution, setting, 32, 1);
    ASSERT_TRUE(verdict.has_value());
    EXPECT_EQ(verdict->hold_steps, c.want_hold);
    // A new sequence of the setting decodes that many plain steps, then
    // drafts again (the re-probe).
    SpeculationGuard next(o, shared.plain_rates, shared.verdicts, execution,
                          setting, 2, 32);
    int64_t plain = 0;
    while (plain < 5000 && next.BeforeStep(1, stats)) {
      next.Observe(true, 1, Plain(0.005), stats);
      ++plain;
    }
    EXPECT_EQ(plain, c.want_hold);
  }
}

TEST(SpeculationGuardTest, AWinningPlanKeepsSpeculatingAndIsJudgedAgain) {
  PlanningShared shared = SharedWithPlanAndPlainRate();
  PlanController c(GuardOn(), BaseKey(), 1, 0, shared);
  for (int64_t step = 0; step < 12; ++step) {
    EXPECT_EQ(c.BeforeStep(step, 1).gamma, 3) << step;
    c.AfterStep(Spec(3, 3, 2, 0.012));  // 3 tokens in 12 ms: 250 tokens/s > 210
  }
  EXPECT_EQ(c.stats().guard_probe_steps, 0)
      << "the table already had plain timings";
  EXPECT_EQ(c.stats().guard_checks, 3);
  EXPECT_EQ(c.stats().guard_fallbacks, 0);
}

// One of the four steps was preempted for 50 ms (a solve, another process):
// judged with it, the plan would lose (12 tokens in 98 ms, 122 tokens/s
// against 200); without it, it wins at 250 tokens/s. outlier_factor 0 keeps
// the step, as before the rule.
// One judgement of GuardOn's 4 speculative steps of 3 tokens against the
// plain 200 tokens/s of SharedWithPlanAndPlainRate; step i takes
// step_seconds[i]. `edit` changes the guard's options first.
PlanningStats JudgeFourSteps(const std::function<void(GuardOptions&)>& edit,
                             const std::vector<double>& step_seconds) {
  PlanningShared shared = SharedWithPlanAndPlainRate();
  PlanControllerOptions o = GuardOn();
  edit(o.guard);
  PlanController c(o, BaseKey(), 1, 0, shared);
  for (int64_t step = 0; step < 4; ++step) {
    c.BeforeStep(step, 1);
    c.AfterStep(Spec(3, 3, 2, step_seconds[step]));
  }
  return c.stats();
}

TEST(SpeculationGuardTest, APreemptedStepIsNoEvidence) {
  for (double factor : {3.0, 0.0}) {
    const PlanningStats stats =
        JudgeFourSteps([&](GuardOptions& g) { g.outlier_factor = factor; },
                       {0.012, 0.062, 0.012, 0.012});
    EXPECT_EQ(stats.guard_checks, 1) << factor;
    EXPECT_EQ(stats.guard_fallbacks, factor > 0 ? 0 : 1) << factor;
    EXPECT_NEAR(stats.guard_last_spec_tps, factor > 0 ? 250 : 12 / 0.098, 1e-9)
        << factor;
  }
}

TEST(SpeculationGuardTest, TheMarginDecidesCloseCalls) {
  for (double margin : {0.0, 0.5}) {
    // 250 tokens/s against 200.
    const PlanningStats stats =
        JudgeFourSteps([&](GuardOptions& g) { g.margin = margin; },
                       {0.012, 0.012, 0.012, 0.012});
    EXPECT_EQ(stats.guard_fallbacks, margin > 0.25 ? 1 : 0) << margin;
  }
}

TEST(SpeculationGuardTest,
     DisabledGuardNeverForcesPlainAndPlainStepsAreRecorded) {
  PlanningShared shared = PlanningShared::Create();
  shared.cache->Insert(KeyAt(0), Plan(0, 0.0), 50,
                       10);  // the planner said: plain
  PlanControllerOptions o = GuardOn();
  PlanController c(o, BaseKey(), 1, 0, shared);
  for (int64_t step = 0; step < 5; ++step) {
    EXPECT_EQ(c.BeforeStep(step, 1).gamma, 0);
    c.AfterStep(Plain(0.004));
  }
  EXPECT_EQ(shared.plain_rates->samples(BaseKey().ExecutionId(), 32, 0), 5);
  EXPECT_EQ(c.stats().guard_checks, 0);

  PlanningShared other = PlanningShared::Create();
  other.cache->Insert(KeyAt(0), Plan(3, 0.5), 50, 10);
  PlanControllerOptions off = Options();  // guard disabled
  PlanController d(off, BaseKey(), 1, 0, other);
  for (int64_t step = 0; step < 40; ++step) {
    EXPECT_EQ(d.BeforeStep(step, 1).gamma, 3);
    d.AfterStep(Spec(3, 3, 1, 1.0));  // hopelessly slow, but the guard is off
  }
  EXPECT_EQ(d.stats().guard_fallbacks + d.stats().guard_probe_steps, 0);
}

// Plain steps timed while a solve of the process is in flight (reserved,
// not yet settled) are not plain decoding's rate: they are not recorded.
TEST(SpeculationGuardTest, PlainStepsBesideASolveAreNotThePlainRate) {
  PlanningShared shared = PlanningShared::Create();
  shared.cache->Insert(KeyAt(0), Plan(0, 0.0), 50, 10);  // plain, no trigger
  const std::optional<double> reserved = shared.budget->TryReserve(0);
  ASSERT_TRUE(reserved.has_value());
  EXPECT_EQ(shared.budget->solves_in_flight(), 1);
  PlanController c(GuardOn(), BaseKey(), 1, 0, shared);
  int64_t step = 0;
  for (; step < 5; ++step) {
    EXPECT_EQ(c.BeforeStep(step, 1).gamma, 0);
    c.AfterStep(Plain(0.02));  // slowed by the solve
  }
  EXPECT_EQ(shared.plain_rates->samples(BaseKey().ExecutionId(), 32, 0), 0);
  shared.budget->Settle(*reserved, 0.1);
  EXPECT_EQ(shared.budget->solves_in_flight(), 0);
  for (; step < 10; ++step) {
    c.BeforeStep(step, 1);
    c.AfterStep(Plain(0.004));
  }
  EXPECT_EQ(shared.plain_rates->samples(BaseKey().ExecutionId(), 32, 0), 5);
  EXPECT_NEAR(
      *shared.plain_rates->MeanStepSeconds(BaseKey().ExecutionId(), 32, 0, 5),
      0.004, 1e-12);
}

// A step is beside a solve when one was in flight at its start or at its
// end (one that began or settled during the step shared the cores with part
// of it); the generator leaves such steps out of a plan's measured rate.
TEST(PlanControllerTest, AStepBesideASolveIsOneWithASolveAtEitherEnd) {
  PlanningShared shared = PlanningShared::Create();
  shared.cache->Insert(KeyAt(0), Plan(0, 0.0), 50, 10);  // plain, no trigger
  PlanController c(Options(), BaseKey(), 1, 0, shared);
  c.BeforeStep(0, 1);
  c.AfterStep(Plain(0.004));
  EXPECT_FALSE(c.last_step_beside_solve());
  c.BeforeStep(1, 1);
  const std::optional<double> reserved = shared.budget->TryReserve(0);
  ASSERT_TRUE(reserved.has_value());
  c.AfterStep(Plain(0.02));  // the solve began during the step
  EXPECT_TRUE(c.last_step_beside_solve());
  c.BeforeStep(2, 1);
  c.AfterStep(Plain(0.02));  // in flight all along
  EXPECT_TRUE(c.last_step_beside_solve());
  c.BeforeStep(3, 1);
  shared.budget->Settle(*reserved, 0.1);
  c.AfterStep(Plain(0.01));  // it settled during the step
  EXPECT_TRUE(c.last_step_beside_solve());
  c.BeforeStep(4, 1);
  c.AfterStep(Plain(0.004));
  EXPECT_FALSE(c.last_step_beside_solve());
  // Only the two steps with no solve at either end are plain-rate samples.
  EXPECT_EQ(shared.plain_rates->samples(BaseKey().ExecutionId(), 32, 0), 2);
}

// A probe whose plain steps ran beside a solve (not recorded in the table)
// still judges the setting: its plain steps are the guard's own reference
// for the bucket. Before, every such probe ended without a reference, and a
// plan at 0.89x of plain (not a clear loss by the early rule) drafted on
// unjudged while probes repeated. A winner keeps speculating.
TEST(SpeculationGuardTest, AProbeBesideASolveJudgesByItsOwnPlainSteps) {
  struct Case {
    double spec_seconds;  // 2 tokens a step
    bool loses;
  };
  for (const Case& test : {Case{0.0112, true}, Case{0.008, false}}) {
    SCOPED_TRACE(test.spec_seconds);
    PlanningShared shared = PlanningShared::Create();
    shared.cache->Insert(KeyAt(0), Plan(3, 0.5), 50, 10);
    const std::optional<double> reserved = shared.budget->TryReserve(0);
    ASSERT_TRUE(reserved.has_value());  // a solve in flight throughout
    PlanController c(GuardOn(), BaseKey(), 1, 0, shared);
    int64_t step = 0;
    for (int i = 0; i < 3; ++i) {
      SCOPED_TRACE(i);
      ProbePair(c, step, 3, Spec(3, 3, 1, test.spec_seconds), 0.005);
    }
    EXPECT_EQ(shared.plain_rates->samples(BaseKey().ExecutionId(), 32, 0), 0)
        << "the table never takes plain steps beside a solve";
    EXPECT_EQ(c.stats().guard_checks, 0) << "3 of min_steps 4";
    EXPECT_EQ(c.BeforeStep(step, 1).gamma, 3);
    c.AfterStep(Spec(3, 3, 1, test.spec_seconds));
    ++step;
    EXPECT_EQ(c.stats().guard_checks, 1);
    EXPECT_EQ(c.stats().guard_fallbacks, test.loses ? 1 : 0);
    EXPECT_NEAR(c.stats().guard_last_plain_tps, 200, 1e-9);
    for (int i = 0; i < 4; ++i, ++step) {
      EXPECT_EQ(c.BeforeStep(step, 1).gamma, test.loses ? 0 : 3) << i;
      c.AfterStep(test.loses ? Plain(0.005) : Spec(3, 3, 1, test.spec_seconds));
    }
    EXPECT_EQ(c.stats().guard_probe_steps, 3) << "no probe again";
    shared.budget->Settle(*reserved, 0.1);
  }
}

// The plain rate a plan's calibrated prediction uses: the bucket's plain
// steps from every sequence of the execution, once there are probe_steps of
// them, with a preempted step left out; another bucket's are not its.
TEST(PlanControllerTest, PlainStepSecondsAreTheBucketsMeasuredPlainSteps) {
  PlanningShared shared = PlanningShared::Create();
  // A cached plain plan: no trigger, so no solve keeps the steps out.
  shared.cache->Insert(KeyAt(1), Plan(0, 0.0), 50, 40);
  PlanControllerOptions o = Options();
  o.guard.probe_steps = 4;
  o.guard.outlier_factor = 3;
  PlanController a(o, BaseKey(), 1, 0, shared);
  PlanController b(o, BaseKey(), 2, 0, shared);
  for (int64_t step = 0; step < 3; ++step) {
    a.BeforeStep(step, 40);  // bucket 1
    a.AfterStep(Plain(0.004));
  }
  EXPECT_FALSE(a.PlainStepSeconds(40).has_value()) << "3 of 4 samples";
  b.BeforeStep(0, 50);
  b.AfterStep(Plain(0.006));
  b.BeforeStep(1, 50);
  b.AfterStep(Plain(0.5));  // preempted: over 3x the median
  ASSERT_TRUE(a.PlainStepSeconds(63).has_value());
  EXPECT_NEAR(*a.PlainStepSeconds(63), (3 * 0.004 + 0.006) / 4, 1e-12);
  EXPECT_EQ(b.PlainStepSeconds(63), a.PlainStepSeconds(40));
  EXPECT_FALSE(a.PlainStepSeconds(64).has_value()) << "bucket 2: none";
}

// The draft cost ratio a drafting plan's calibrated prediction uses: the
// bucket's drafting steps from every sequence of the execution that measured
// their plan, each its seconds over the plan's predicted seconds a step,
// once there are probe_steps of them, with a preempted step left out. Not
// recorded: the guard's settle steps, a capped step, a plain step, a step
// beside a solve, a step under a plan still in force past its own bucket,
// and a plan without a predicted rate; another execution's are not its.
TEST(PlanControllerTest,
     DraftCostRatioIsTheBucketsDraftingStepsAgainstTheirPlans) {
  PlanningShared shared = PlanningShared::Create();
  DraftPlan plan = Plan(3, 0.8);
  plan.predicted_tokens_per_step = 2.5;
  plan.predicted_tpt = 500;  // 0.005 s a step predicted
  shared.cache->Insert(KeyAt(1), plan, 50, 40);
  PlanControllerOptions o = Options();
  o.guard.settle_steps = 2;
  o.guard.probe_steps = 4;
  o.guard.outlier_factor = 3;
  const std::string execution = BaseKey().ExecutionId();
  auto recorded = [&](int64_t bucket) {
    return shared.draft_costs->samples(execution, 32, bucket);
  };
  PlanController a(o, BaseKey(), 1, 0, shared);
  int64_t step = 0;
  auto drafting_step = [&](PlanController& c, const StepObservation& obs,
                           int64_t context) {
    EXPECT_EQ(c.BeforeStep(step++, context).gamma, 3);
    c.AfterStep(obs);
  };
  for (int i = 0; i < 2; ++i) drafting_step(a, Spec(3, 3, 2, 0.006), 40);
  EXPECT_EQ(recorded(1), 0) << "the settle steps are no evidence";
  for (int i = 0; i < 3; ++i) drafting_step(a, Spec(3, 3, 2, 0.006), 40);
  StepObservation capped = Spec(3, 1, 1, 0.002);
  capped.budget = 1;
  capped.capped = true;
  drafting_step(a, capped, 40);
  drafting_step(a, Plain(0.004), 40);  // as if the guard had held it plain
  a.BeforeStep(step++, 40);
  const std::optional<double> reserved = shared.budget->TryReserve(0);
  ASSERT_TRUE(reserved.has_value());
  a.AfterStep(Spec(3, 3, 2, 0.02));  // a solve began during the step
  shared.budget->Settle(*reserved, 0.1);
  EXPECT_EQ(recorded(1), 3);
  EXPECT_FALSE(a.DraftCostRatio(40).has_value()) << "3 of 4 samples";

  PlanController b(o, BaseKey(), 2, 0, shared);
  for (int i = 0; i < 2; ++i) drafting_step(b, Spec(3, 3, 2, 0.006), 50);
  drafting_step(b, Spec(3, 3, 2, 0.004), 50);  // 0.8
  drafting_step(b, Spec(3, 3, 2, 0.5), 50);    // preempted: 100, over 3x
  ASSERT_TRUE(a.DraftCostRatio(63).has_value());
  EXPECT_NEAR(*a.DraftCostRatio(63), (3 * 1.2 + 0.8) / 4, 1e-12);
  EXPECT_EQ(b.DraftCostRatio(63), a.DraftCostRatio(40));
  EXPECT_FALSE(a.DraftCostRatio(64).has_value()) << "bucket 2: none";
  EXPECT_FALSE(a.PlainStepSeconds(40).has_value()) << "no plain step";
  // Past bucket 1 the plan stays in force (nothing cached at bucket 2),
  // priced for bucket 1's context: its steps there are not recorded.
  // (Another sequence's claim on bucket 2 keeps b from capturing a
  // snapshot there, whose solve would keep the step out as well.)
  ASSERT_TRUE(shared.cache->TryClaim(KeyAt(2)));
  drafting_step(b, Spec(3, 3, 2, 0.006), 64);
  EXPECT_FALSE(b.last_step_beside_solve());
  EXPECT_EQ(recorded(2), 0);

  PlanCacheKey other_key = BaseKey();
  other_key.threads = BaseKey().threads + 1;  // another execution
  PlanCacheKey other_at_1 = other_key;
  other_at_1.bucket_tokens = 32;
  other_at_1.bucket = 1;
  DraftPlan unpriced = plan;
  unpriced.predicted_tpt = 0;  // a planner that does not predict
  shared.cache->Insert(other_at_1, unpriced, 50, 40);
  PlanController other(o, other_key, 3, 0, shared);
  for (int i = 0; i < 8; ++i) drafting_step(other, Spec(3, 3, 2, 0.004), 40);
  EXPECT_EQ(shared.draft_costs->samples(other_key.ExecutionId(), 32, 1), 0);
  EXPECT_EQ(recorded(1), 5);

  PlanningShared without = shared;
  without.draft_costs = nullptr;  // no table: nothing recorded, no ratio
  PlanController c(o, BaseKey(), 4, 0, without);
  for (int i = 0; i < 6; ++i) drafting_step(c, Spec(3, 3, 2, 0.006), 40);
  EXPECT_FALSE(c.DraftCostRatio(40).has_value());
  EXPECT_EQ(recorded(1), 5);
}

// A losing verdict is shared: another sequence of the same setting in the
// same bucket decodes plainly from its first step, without measuring the
// setting again, until the verdict's plain steps (over both) are spent; then
// the setting is measured again, and a win clears the verdict.
TEST(SpeculationGuardTest, ALosingVerdictHoldsForEverySequenceUntilItsReprobe) {
  PlanningShared shared = SharedWithPlanAndPlainRate();
  PlanControllerOptions o = GuardOn();
  o.guard.reprobe_steps = 6;
  // A loss this far below plain would hold twice as long
  // (AClearLossHoldsTwiceAndHoldsTheModesOtherSettings), and longer for
  // what re-measuring it costs (ALossHoldsAtLeastItsCostOverTheExploreShare).
  o.guard.clear_losses = false;
  o.guard.explore_share = 0;
  PlanController first(o, BaseKey(), 1, 0, shared);
  for (int64_t step = 0; step < 4; ++step) {
    EXPECT_EQ(first.BeforeStep(step, 1).gamma, 3);
    first.AfterStep(Spec(3, 3, 1, 0.02));  // 100 tokens/s against 200
  }
  EXPECT_EQ(first.stats().guard_fallbacks, 1);
  ASSERT_TRUE(
      shared.verdicts->Find(BaseKey().ExecutionId(), "knapspec D6", 32, 0)
          .has_value());
  EXPECT_EQ(shared.verdicts->losing(), 1);
  // Two plain steps of the first sequence, then a new sequence inherits.
  for (int64_t step = 4; step < 6; ++step) {
    EXPECT_EQ(first.BeforeStep(step, 1).gamma, 0);
    first.AfterStep(Plain(0.005));
  }
  PlanController second(o, BaseKey(), 2, 0, shared);
  for (int64_t step = 0; step < 4; ++step) {
    const StepDirective d = second.BeforeStep(step, 1);
    EXPECT_EQ(d.gamma, 0) << "inherited, step " << step;
    second.AfterStep(Plain(0.005));
  }
  EXPECT_EQ(second.stats().guard_plain_steps, 4);
  EXPECT_EQ(second.stats().guard_inherited_steps, 4);
  EXPECT_EQ(second.stats().guard_checks, 0) << "it never measured the loser";
  EXPECT_EQ(first.stats().guard_inherited_steps, 0);
  // Six plain steps spent: the verdict expired; the setting is measured
  // again, wins this time, and no verdict comes back.
  EXPECT_EQ(shared.verdicts->losing(), 0);
  for (int64_t step = 4; step < 8; ++step) {
    EXPECT_EQ(second.BeforeStep(step, 1).gamma, 3) << step;
    second.AfterStep(Spec(3, 3, 2, 0.012));  // 250 tokens/s
  }
  EXPECT_EQ(second.stats().guard_checks, 1);
  EXPECT_EQ(second.stats().guard_fallbacks, 0);
  EXPECT_EQ(shared.verdicts->losing(), 0);
  EXPECT_EQ(shared.verdicts->verdicts_given(), 1);
}

// A new request (sequence `id`) of the cached gamma-3 plan drafts `steps`
// steps of `observed`; its planning stats.
PlanningStats RequestDrafts(const PlanningShared& shared, uint64_t id,
                            int64_t steps, const StepObservation& observed) {
  PlanController c(GuardOn(), BaseKey(), id, 0, shared);
  for (int64_t step = 0; step < steps; ++step) {
    EXPECT_EQ(c.BeforeStep(step, 1).gamma, 3) << id << " " << step;
    c.AfterStep(observed);
  }
  return c.stats();
}

// A verdict holds every request of the setting, so a judgement weighs the
// setting's recent steps from every sequence: one request whose text drafts
// poorly (alone it would lose) does not condemn a setting that wins over
// the requests before it. A setting that loses over all of them still does.
TEST(SpeculationGuardTest, OneUnluckyRequestDoesNotCondemnAWinningSetting) {
  for (const bool winner : {true, false}) {
    SCOPED_TRACE(winner ? "winner" : "loser");
    PlanningShared shared = SharedWithPlanAndPlainRate();  // 200 tokens/s
    // Three requests of 4 steps (GuardOn: judged every 4): 3 tokens in 10
    // ms (300 tokens/s), or 2 in 12 ms (167 tokens/s) for the loser.
    for (uint64_t id = 1; id <= 3; ++id) {
      const PlanningStats stats = RequestDrafts(
          shared, id, 4, winner ? Spec(3, 3, 2, 0.01) : Spec(3, 3, 1, 0.012));
      EXPECT_EQ(stats.guard_checks, 1);
      EXPECT_EQ(stats.guard_fallbacks, winner ? 0 : 1) << id;
      if (!winner) break;  // held plain from here on
    }
    if (!winner) continue;
    // The unlucky request: 2 tokens in 12 ms (167 tokens/s), below plain x
    // (1 + margin) alone; with the others' 12 steps, 262 tokens/s.
    const PlanningStats unlucky =
        RequestDrafts(shared, 4, 4, Spec(3, 3, 1, 0.012));
    EXPECT_EQ(unlucky.guard_checks, 1);
    EXPECT_EQ(unlucky.guard_fallbacks, 0);
    EXPECT_NEAR(unlucky.guard_last_spec_tps, 44 / 0.168, 1);
    EXPECT_EQ(shared.verdicts->losing(), 0);
  }
}

// Every request passes through a bucket in fewer steps than a judgement
// needs (a 1000-token prompt spends its first 24 positions below the bucket
// boundary at 1024): the setting's steps there from every request make the
// window, so the bucket is judged, and the next requests decode plainly
// there from their first step.
TEST(SpeculationGuardTest, ABucketEveryRequestOnlyPassesThroughIsJudgedToo) {
  PlanningShared shared = SharedWithPlanAndPlainRate();  // 200 tokens/s
  // Two requests of 2 steps at 100 tokens/s (GuardOn: judged every 4).
  for (uint64_t id = 1; id <= 2; ++id) {
    const PlanningStats stats =
        RequestDrafts(shared, id, 2, Spec(3, 3, 1, 0.02));
    EXPECT_EQ(stats.guard_checks, id == 1 ? 0 : 1) << id;
    EXPECT_EQ(stats.guard_fallbacks, id == 1 ? 0 : 1) << id;
  }
  const PlanControllerOptions o = GuardOn();
  PlanController third(o, BaseKey(), 3, 0, shared);
  EXPECT_EQ(third.BeforeStep(0, 1).gamma, 0) << "held from its first step";
}

// A narrow loss against the table's plain steps (measured by another
// sequence, at another time) holds nothing until a probe's pairs confirm
// it: 4 steps of 2 tokens in 10.5 ms (190 tokens/s) against the table's
// 200 tokens/s (below 200 x 1.05), then 3 pairs. "slowed": the machine
// has slowed since the table's steps, its plain steps in the probe take
// 6.5 ms (154 tokens/s): the pairs clear the setting, which drafts on, and
// the table's reference is now the probe's plain steps. "confirmed": the
// probe's plain steps run at the table's 200 tokens/s: the pairs' loss is
// the verdict. With confirm_losses off both lose at the window's end. A
// clear loss (2 tokens in 20 ms: 100 tokens/s) needs no probe.
TEST(SpeculationGuardTest, ANarrowLossIsConfirmedByAProbesPairs) {
  struct Case {
    const char* name;
    double step_seconds;   // the setting's steps (2 tokens)
    double plain_seconds;  // the probe's plain steps
    bool confirm;
    bool loses;
    int64_t probe_steps;
  };
  const Case cases[] = {
      {"slowed", 0.0105, 0.0065, true, false, 3},
      {"confirmed", 0.0105, 0.005, true, true, 3},
      {"slowed, confirm_losses off", 0.0105, 0.0065, false, true, 0},
      {"clear", 0.02, 0.005, true, true, 0},
  };
  for (const Case& test : cases) {
    SCOPED_TRACE(test.name);
    PlanningShared shared = SharedWithPlanAndPlainRate();
    PlanControllerOptions o = GuardOn();
    o.guard.confirm_losses = test.confirm;
    PlanController c(o, BaseKey(), 1, 0, shared);
    int64_t step = 0;
    for (; step < 4; ++step) {
      EXPECT_EQ(c.BeforeStep(step, 1).gamma, 3) << step;
      c.AfterStep(Spec(3, 3, 1, test.step_seconds));
    }
    if (test.probe_steps > 0) {
      EXPECT_EQ(c.stats().guard_checks, 0) << "no verdict before the pairs";
      for (int i = 0; i < 3; ++i) {
        SCOPED_TRACE(i);
        ProbePair(c, step, 3, Spec(3, 3, 1, test.step_seconds),
                  test.plain_seconds);
      }
    }
    EXPECT_EQ(c.stats().guard_probe_steps, test.probe_steps);
    EXPECT_EQ(c.stats().guard_checks, 1);
    EXPECT_EQ(c.stats().guard_fallbacks, test.loses ? 1 : 0);
    EXPECT_EQ(c.stats().guard_confirmations, test.probe_steps > 0 ? 1 : 0);
    EXPECT_EQ(c.stats().guard_cleared_losses, test.loses ? 0 : 1);
    EXPECT_NEAR(c.stats().guard_last_spec_tps, 2 / test.step_seconds, 1e-6);
    EXPECT_NEAR(c.stats().guard_last_plain_tps,
                1 / (test.probe_steps > 0 ? test.plain_seconds : 0.005), 1e-6);
    EXPECT_EQ(c.BeforeStep(step, 1).gamma, test.loses ? 0 : 3)
        << "after the judgement";
    EXPECT_EQ(shared.verdicts->losing(), test.loses ? 1 : 0);
  }
}

// A guard's confirming probe at bucket 0: 3 pairs, each the setting's
// step (`setting`) then a plain step of `plain_seconds`.
void RunConfirmingPairs(SpeculationGuard& guard, PlanningStats& stats,
                        const StepObservation& setting, double plain_seconds) {
  for (int i = 0; i < 3; ++i) {
    EXPECT_FALSE(guard.BeforeStep(0, stats)) << "the setting's step " << i;
    guard.Observe(true, 0, setting, stats);
    EXPECT_TRUE(guard.BeforeStep(0, stats)) << "the plain step " << i;
    guard.Observe(false, 0, Plain(plain_seconds), stats);
  }
}

// The options of the confirmation tests: HoldTestOptions with confirmation
// on and a margin of 0.05.
GuardOptions ConfirmTestOptions() {
  GuardOptions o = HoldTestOptions();
  o.confirm_losses = true;
  o.margin = 0.05;
  return o;
}

// Shared planning state whose plain-rate table holds 3 plain steps of 5 ms
// (200 tokens/s) at bucket 0 of 32 tokens.
PlanningShared SharedWithTablePlainRate() {
  PlanningShared shared = PlanningShared::Create();
  for (int i = 0; i < 3; ++i) {
    shared.plain_rates->Record(BaseKey().ExecutionId(), 32, 0, 0.005);
  }
  return shared;
}

// A confirming probe's pairs join the setting's earlier ones at the bucket,
// whichever sequence ran them: two sequences each find a narrow loss
// (their windows at 182 and 196 tokens/s against the table's 208) and
// confirm it with 3 pairs, and the second judges all 6. The first's pairs
// were a win (the setting at 250 tokens/s against 200) and the second's a
// loss (150 against 200): pooled (2 tokens a step at the 6 pairs' mean
// pace of 10.7 ms: 188 tokens/s against 200) a loss, held for the
// setting's every sequence.
TEST(SpeculationGuardTest, ConfirmingPairsArePooledOverSequences) {
  GuardOptions o = HoldTestOptions();
  o.confirm_losses = true;
  o.margin = 0.0;
  o.confidence = 0;  // the bare rates
  o.confirm_confidence = 0;
  PlanningShared shared = PlanningShared::Create();
  const std::string execution = BaseKey().ExecutionId();
  const std::string setting = "static a1,m2 D3";
  // Runs `spec` steps until the window's narrow loss against the table's
  // plain rate starts a probe, then its 3 pairs with plain steps of 5 ms.
  const auto confirm = [&](uint64_t id, double pair_seconds) {
    for (int i = 0; i < 3; ++i) {
      shared.plain_rates->Record(execution, 32, 0, 0.0048);  // 208/s
    }
    SpeculationGuard guard(o, shared.plain_rates, shared.verdicts, execution,
                           setting, id, 32);
    PlanningStats stats;
    for (int i = 0; i < 4; ++i) {  // 2 tokens in 11 ms: 182 tokens/s
      EXPECT_FALSE(guard.BeforeStep(0, stats)) << i;
      guard.Observe(true, 0, Spec(3, 3, 1, 0.011), stats);
    }
    EXPECT_EQ(stats.guard_checks, 0) << "a probe confirms first";
    RunConfirmingPairs(guard, stats, Spec(3, 3, 1, pair_seconds), 0.005);
    EXPECT_EQ(stats.guard_checks, 1);
    return stats;
  };
  PlanningStats first = confirm(1, 0.008);  // 250 against 200
  EXPECT_EQ(first.guard_fallbacks, 0);
  EXPECT_NEAR(first.guard_last_spec_tps, 250, 1e-6);
  PlanningStats second = confirm(2, 0.04 / 3);  // 150 against 200
  EXPECT_EQ(second.guard_fallbacks, 1);
  EXPECT_NEAR(second.guard_last_spec_tps, 12 / (0.024 + 0.04), 1e-6);
  EXPECT_NEAR(second.guard_last_plain_tps, 200, 1e-6);
  EXPECT_TRUE(shared.verdicts->Find(execution, setting, 32, 0).has_value());
}

// A confirmation weighs the setting's tokens a step over its pooled steps
// and the pace of its steps in the pairs: the window's 4 steps of 3 tokens
// in 15 ms (200 tokens/s, a narrow loss against the table's 200 x 1.05)
// start a probe on a machine that has slowed further (plain steps of 7.5
// ms, 133 tokens/s; the setting's steps 15.5 ms), whose 3 steps of the
// setting happen to draft only 2 tokens each. Tokens a step over all 7
// steps (18 / 7) at the pairs' 15.5 ms a step: 166 tokens/s, a win against
// 133 x 1.05 (all 7 steps' own seconds would read 169); the pairs alone (2
// tokens in 15.5 ms, 129 tokens/s) would have lost.
TEST(SpeculationGuardTest,
     AConfirmationTakesTokensFromThePoolAndPaceFromThePairs) {
  const GuardOptions o = ConfirmTestOptions();
  PlanningShared shared = SharedWithTablePlainRate();  // 200 tokens/s
  const std::string execution = BaseKey().ExecutionId();
  SpeculationGuard guard(o, shared.plain_rates, shared.verdicts, execution,
                         "static a1,m2 D3", 1, 32);
  PlanningStats stats;
  for (int i = 0; i < 4; ++i) {
    EXPECT_FALSE(guard.BeforeStep(0, stats)) << i;
    guard.Observe(true, 0, Spec(3, 3, 2, 0.015), stats);
  }
  EXPECT_EQ(stats.guard_confirmations, 1);
  RunConfirmingPairs(guard, stats, Spec(3, 3, 1, 0.0155), 0.0075);
  EXPECT_EQ(stats.guard_checks, 1);
  EXPECT_EQ(stats.guard_fallbacks, 0);
  EXPECT_EQ(stats.guard_cleared_losses, 1);
  EXPECT_NEAR(stats.guard_last_spec_tps, 18.0 / 7 / 0.0155, 1e-6);
  EXPECT_NEAR(stats.guard_last_plain_tps, 1 / 0.0075, 1e-6);
  EXPECT_FALSE(guard.BeforeStep(0, stats)) << "it drafts on";
}

// A guard (sequence `id`) of the confirmation tests below: its setting's
// steps and the table's plain steps at bucket 0 of 32 tokens.
SpeculationGuard ConfirmingGuard(const GuardOptions& o,
                                 const PlanningShared& shared, uint64_t id) {
  return SpeculationGuard(o, shared.plain_rates, shared.verdicts,
                          BaseKey().ExecutionId(), "static a1,m2 D3", id, 32);
}

// The guard's window of 4 steps of 2 tokens in 10.5 ms (190 tokens/s: a
// narrow loss against SharedWithTablePlainRate's 200 x 1.05, with
// ConfirmTestOptions) starts its confirmation.
void StartNarrowLossConfirmation(SpeculationGuard& guard,
                                 PlanningStats& stats) {
  for (int i = 0; i < 4; ++i) {
    EXPECT_FALSE(guard.BeforeStep(0, stats)) << i;
    guard.Observe(true, 0, Spec(3, 3, 1, 0.0105), stats);
  }
  EXPECT_EQ(stats.guard_confirmations, 1);
}

// A confirmation compares each paired step's time with the pool's steps
// that proposed as many draft tokens: a step's time follows its drafts
// (here 18 ms with three, 6 ms with one). The window's 4 steps (two of 3
// drafts and 4 tokens in 18 ms, two of 1 draft and 1 token in 6 ms: 10
// tokens in 48 ms, 208 tokens/s) are a narrow loss against the table's 200
// x 1.05; the pairs' steps all stop at one draft token (1 token each).
// "unchanged": they take the pool's 6 ms and the plain steps the table's 5:
// the pool's 13 tokens in 66 ms at the same pace (197 tokens/s) lose. By
// the pool's tokens a step (13 / 7) at the pairs' mean 6 ms they would
// read 310 tokens/s and clear the setting. "slowed": the machine runs a
// fifth slower (7.2 ms, plain steps 6.5 ms: 154 tokens/s); the pool holds
// the pairs' steps too, so its one-draft steps take 6.72 ms on average and
// its 13 tokens in 69.6 ms (187 tokens/s) at a pace of 7.2 / 6.72 read 174
// tokens/s: cleared against 154 x 1.05.
TEST(SpeculationGuardTest,
     AConfirmationPacesThePairsAgainstPoolStepsOfAsManyDrafts) {
  struct Case {
    const char* name;
    double pair_seconds;   // the setting's paired steps (1 draft, 1 token)
    double plain_seconds;  // the pairs' plain steps
    bool loses;
  };
  for (const Case& test : {Case{"unchanged", 0.006, 0.005, true},
                           Case{"slowed", 0.0072, 0.0065, false}}) {
    SCOPED_TRACE(test.name);
    GuardOptions o = ConfirmTestOptions();
    o.confidence = 0;  // the bare rates
    o.confirm_confidence = 0;
    PlanningShared shared = SharedWithTablePlainRate();  // 200 tokens/s
    SpeculationGuard guard = ConfirmingGuard(o, shared, 1);
    PlanningStats stats;
    for (int i = 0; i < 4; ++i) {
      EXPECT_FALSE(guard.BeforeStep(0, stats)) << i;
      guard.Observe(true, 0,
                    i % 2 == 0 ? Spec(3, 3, 3, 0.018) : Spec(3, 1, 0, 0.006),
                    stats);
    }
    EXPECT_EQ(stats.guard_confirmations, 1);
    RunConfirmingPairs(guard, stats, Spec(3, 1, 0, test.pair_seconds),
                       test.plain_seconds);
    EXPECT_EQ(stats.guard_checks, 1);
    EXPECT_EQ(stats.guard_fallbacks, test.loses ? 1 : 0);
    EXPECT_EQ(stats.guard_cleared_losses, test.loses ? 0 : 1);
    const double pace =
        test.pair_seconds / ((2 * 0.006 + 3 * test.pair_seconds) / 5);
    EXPECT_NEAR(stats.guard_last_spec_tps,
                13 / (0.048 + 3 * test.pair_seconds) / pace, 1e-6);
    EXPECT_NEAR(stats.guard_last_plain_tps, 1 / test.plain_seconds, 1e-6);
  }
}

// One confirmation at a time, and a loss overtakes it: two sequences draft
// the same setting, their pooled window (2 tokens in 10.5 ms: 190 tokens/s
// against the table's 200 x 1.05) is a narrow loss when the second's step
// completes it, and the second confirms. The first's next steps start the
// count to the next judgement afresh, and while the second's confirmation
// is under way the first starts none of its own (its windows fall due and
// pass without a verdict).
// Then another sequence's loss holds the setting while the probe runs: the
// probe stops at once (its plain steps would have cleared the setting: 6.5
// ms against its 10.5 ms steps) and the loss stands for every sequence.
TEST(SpeculationGuardTest, OneConfirmationAtATimeAndALossOvertakesIt) {
  const GuardOptions o = ConfirmTestOptions();
  PlanningShared shared = SharedWithTablePlainRate();  // 200 tokens/s
  const std::string execution = BaseKey().ExecutionId();
  SpeculationGuard first = ConfirmingGuard(o, shared, 1);
  SpeculationGuard second = ConfirmingGuard(o, shared, 2);
  PlanningStats first_stats, second_stats;
  for (int i = 0; i < 2; ++i) {
    EXPECT_FALSE(first.BeforeStep(0, first_stats)) << i;
    first.Observe(true, 0, Spec(3, 3, 1, 0.0105), first_stats);
    EXPECT_FALSE(second.BeforeStep(0, second_stats)) << i;
    second.Observe(true, 0, Spec(3, 3, 1, 0.0105), second_stats);
  }
  EXPECT_EQ(second_stats.guard_confirmations, 1);
  // The first drafts twice the window beside the second's probe: its
  // narrow losses wait for the second's confirmation.
  for (int i = 0; i < 8; ++i) {
    EXPECT_FALSE(first.BeforeStep(0, first_stats)) << i;
    first.Observe(true, 0, Spec(3, 3, 1, 0.0105), first_stats);
  }
  EXPECT_EQ(first_stats.guard_confirmations, 0) << "one at a time";
  EXPECT_EQ(first_stats.guard_checks, 0);
  EXPECT_EQ(first_stats.guard_probe_steps, 0);

  EXPECT_FALSE(second.BeforeStep(0, second_stats)) << "the probe's first pair";
  second.Observe(true, 0, Spec(3, 3, 1, 0.0105), second_stats);
  EXPECT_TRUE(second.BeforeStep(0, second_stats));
  second.Observe(false, 0, Plain(0.0065), second_stats);
  GuardVerdicts::Verdict loss;
  loss.sequence_id = 3;
  shared.verdicts->Judge(execution, "static a1,m2 D3", 32, 0,
                         GuardVerdicts::Judgement::kLoss, loss, 5);
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(second.BeforeStep(0, second_stats)) << "held plain " << i;
    second.Observe(false, 0, Plain(0.0065), second_stats);
  }
  EXPECT_EQ(second_stats.guard_plain_steps, 4);
  EXPECT_EQ(second_stats.guard_inherited_steps, 4);
  EXPECT_EQ(second_stats.guard_probe_steps, 1);
  EXPECT_EQ(second_stats.guard_checks, 0);
  EXPECT_EQ(second_stats.guard_cleared_losses, 0);
  EXPECT_TRUE(
      shared.verdicts->Find(execution, "static a1,m2 D3", 32, 0).has_value())
      << "the loss stands";
}

// A confirmation is judged at its bucket only: the context crosses into
// bucket 1 while its probe runs, and the pairs (plain steps of 6.5 ms that
// would clear the setting's 10.5 ms steps at bucket 0) judge nothing;
// bucket 1, without a plain rate in the table, takes the probe's plain
// steps as its reference and is judged when its own window is full.
TEST(SpeculationGuardTest, AConfirmationEndsWithItsBucket) {
  PlanningShared shared = SharedWithTablePlainRate();
  SpeculationGuard guard = ConfirmingGuard(ConfirmTestOptions(), shared, 1);
  PlanningStats stats;
  StartNarrowLossConfirmation(guard, stats);
  for (int i = 0; i < 3; ++i) {
    const int64_t bucket = i == 0 ? 0 : 1;
    EXPECT_FALSE(guard.BeforeStep(bucket, stats)) << i;
    guard.Observe(true, bucket, Spec(3, 3, 1, 0.0105), stats);
    EXPECT_TRUE(guard.BeforeStep(1, stats)) << i;
    guard.Observe(false, 1, Plain(0.0065), stats);
  }
  EXPECT_EQ(stats.guard_probe_steps, 3);
  EXPECT_EQ(stats.guard_checks, 0) << "no judgement of the pairs";
  EXPECT_EQ(stats.guard_cleared_losses, 0);
  EXPECT_FALSE(guard.BeforeStep(1, stats)) << "it drafts on at bucket 1";
  guard.Observe(true, 1, Spec(3, 3, 1, 0.0105), stats);
  guard.BeforeStep(1, stats);
  guard.Observe(true, 1, Spec(3, 3, 1, 0.0105), stats);
  EXPECT_EQ(stats.guard_checks, 1) << "bucket 1's window of 4";
  EXPECT_EQ(stats.guard_fallbacks, 0) << "190 against the probe's 154";
}

// A narrow loss against a probe's own plain steps (no table rate at the
// bucket: the probe's plain steps are this guard's reference) is a pairs'
// verdict already: it holds at once, with no second probe to confirm it.
// The first probe's 3 pairs (2 tokens in 10.5 ms, plain steps of 5 ms:
// 190 against 200) are no clear loss; the window's 4th step judges them.
TEST(SpeculationGuardTest,
     ALossAgainstAProbesOwnPlainStepsNeedsNoConfirmation) {
  PlanningShared shared = PlanningShared::Create();  // no table rate
  SpeculationGuard guard = ConfirmingGuard(ConfirmTestOptions(), shared, 1);
  PlanningStats stats;
  RunConfirmingPairs(guard, stats, Spec(3, 3, 1, 0.0105), 0.005);
  EXPECT_EQ(stats.guard_probe_steps, 3) << "the first probe";
  EXPECT_EQ(stats.guard_checks, 0);
  EXPECT_FALSE(guard.BeforeStep(0, stats));
  guard.Observe(true, 0, Spec(3, 3, 1, 0.0105), stats);
  EXPECT_EQ(stats.guard_confirmations, 0);
  EXPECT_EQ(stats.guard_checks, 1);
  EXPECT_EQ(stats.guard_fallbacks, 1);
  EXPECT_EQ(stats.guard_probe_steps, 3);
  EXPECT_TRUE(guard.BeforeStep(0, stats)) << "held";
}

// confirm_confidence: the standard errors the confirmation grants the
// setting. Its steps in the pairs take 8, 12 and 10 ms (2 tokens each: 200
// tokens/s, with a standard error of about 23) against plain steps of 5 ms
// (200 tokens/s) and a margin of 0.05: within one error of 210, so cleared
// with confirm_confidence 1; below 210 by the bare rates (0), a loss.
TEST(SpeculationGuardTest, ConfirmConfidenceIsTheBenefitOfTheDoubt) {
  for (const double confidence : {1.0, 0.0}) {
    SCOPED_TRACE(confidence);
    GuardOptions o = ConfirmTestOptions();
    o.confirm_confidence = confidence;
    PlanningShared shared = SharedWithTablePlainRate();
    SpeculationGuard guard = ConfirmingGuard(o, shared, 1);
    PlanningStats stats;
    StartNarrowLossConfirmation(guard, stats);
    for (const double seconds : {0.008, 0.012, 0.010}) {
      EXPECT_FALSE(guard.BeforeStep(0, stats));
      guard.Observe(true, 0, Spec(3, 3, 1, seconds), stats);
      EXPECT_TRUE(guard.BeforeStep(0, stats));
      guard.Observe(false, 0, Plain(0.005), stats);
    }
    EXPECT_EQ(stats.guard_checks, 1);
    EXPECT_NEAR(stats.guard_last_spec_tps, 200, 1e-6);
    EXPECT_EQ(stats.guard_fallbacks, confidence > 0 ? 0 : 1);
    EXPECT_EQ(stats.guard_cleared_losses, confidence > 0 ? 1 : 0);
  }
}

// A window far below the plain rate is judged after early_steps, not
// min_steps; one only a little below waits for the full window.
TEST(SpeculationGuardTest, AClearLoserIsJudgedAfterItsEarlySteps) {
  for (double step_seconds : {0.02, 0.0105}) {  // 100 or 190 tokens/s
    PlanningShared shared = SharedWithPlanAndPlainRate();
    PlanControllerOptions o = GuardOn();
    o.guard.margin = 0.03;
    o.guard.min_steps = 16;
    o.guard.early_steps = 4;
    o.guard.early_loss = 0.15;  // below 170 tokens/s is a clear loss
    PlanController c(o, BaseKey(), 1, 0, shared);
    int64_t step = 0;
    while (c.stats().guard_checks == 0 && step < 40) {
      EXPECT_EQ(c.BeforeStep(step, 1).gamma, 3) << step;
      c.AfterStep(Spec(3, 3, 1, step_seconds));  // 2 tokens a step
      ++step;
    }
    const bool clear = step_seconds > 0.015;
    EXPECT_EQ(step, clear ? 4 : 16) << step_seconds;
    EXPECT_EQ(c.stats().guard_fallbacks, 1) << step_seconds;
    EXPECT_EQ(c.BeforeStep(step, 1).gamma, 0) << "the verdict holds";
  }
  // early_steps 0: no early judgement.
  PlanningShared shared = SharedWithPlanAndPlainRate();
  PlanControllerOptions o = GuardOn();
  o.guard.min_steps = 16;
  o.guard.early_steps = 0;
  PlanController c(o, BaseKey(), 1, 0, shared);
  for (int64_t step = 0; step < 15; ++step) {
    c.BeforeStep(step, 1);
    c.AfterStep(Spec(3, 3, 1, 0.05));  // 40 tokens/s
  }
  EXPECT_EQ(c.stats().guard_checks, 0);
}

// A setting that lost its last judgement at the bucket is re-probed with the
// full rule from early_steps on: a small loss (190 tokens/s against 200 x
// 1.03) that took min_steps the first time takes early_steps the second.
// After a win, the same small loss waits for min_steps again.
// Drives one sequence through judgements and holds: the options of the
// re-probe tests (plain decoding at 200 tokens/s, margin 0.03, min_steps
// 16, early_steps 4, a first hold of 5 plain steps).
class ReprobeDriver {
 public:
  static PlanControllerOptions Options() {
    PlanControllerOptions o = GuardOn();
    o.guard.margin = 0.03;
    o.guard.min_steps = 16;
    o.guard.early_steps = 4;
    o.guard.early_loss = 0.15;
    o.guard.reprobe_steps = 5;
    // Every hold here is a single loss's (clear ones count twice:
    // AClearLossHoldsTwiceAndHoldsTheModesOtherSettings), the doubling's
    // alone (ALossHoldsAtLeastItsCostOverTheExploreShare).
    o.guard.clear_losses = false;
    o.guard.explore_share = 0;
    return o;
  }
  ReprobeDriver()
      : shared_(SharedWithPlanAndPlainRate()),
        c_(Options(), BaseKey(), 1, 0, shared_) {}

  // Speculative steps (the k-th is step(k)) until a judgement; returns
  // how many.
  int64_t SpeculateUntilJudged(
      const std::function<StepObservation(int64_t)>& step) {
    const int64_t checks = c_.stats().guard_checks;
    int64_t steps = 0;
    while (c_.stats().guard_checks == checks && steps < 40) {
      EXPECT_EQ(c_.BeforeStep(step_, 1).gamma, 3) << step_;
      c_.AfterStep(step(steps));
      ++step_;
      ++steps;
    }
    return steps;
  }
  int64_t SpeculateUntilJudged(const StepObservation& step) {
    return SpeculateUntilJudged([&](int64_t) { return step; });
  }
  // Plain steps at 200 tokens/s until the verdict expires; returns how many.
  int64_t DecodeTheHold() {
    int64_t plain = 0;
    while (plain < 40 && c_.BeforeStep(step_, 1).gamma == 0) {
      c_.AfterStep(Plain(0.005));
      ++step_;
      ++plain;
    }
    return plain;
  }
  const PlanningStats& stats() const { return c_.stats(); }

 private:
  PlanningShared shared_;
  PlanController c_;
  int64_t step_ = 0;
};

TEST(SpeculationGuardTest, AReprobeOfALoserIsJudgedAtItsEarlySteps) {
  ReprobeDriver d;
  const StepObservation small_loss = Spec(3, 3, 1, 0.0105);  // 190 tokens/s
  EXPECT_EQ(d.SpeculateUntilJudged(small_loss), 16) << "not a clear loss";
  EXPECT_EQ(d.stats().guard_fallbacks, 1);
  EXPECT_EQ(d.DecodeTheHold(), 5);
  EXPECT_EQ(d.SpeculateUntilJudged(small_loss), 4) << "the re-probe of a loser";
  EXPECT_EQ(d.stats().guard_fallbacks, 2);
  EXPECT_EQ(d.DecodeTheHold(), 10);
  // A win (300 tokens/s) clears the run of losses: small-loss steps are
  // then not judged before min_steps (and with the winning steps still in
  // the evidence, that judgement is a win).
  EXPECT_EQ(d.SpeculateUntilJudged(Spec(3, 3, 1, 0.0066)), 16);
  EXPECT_EQ(d.stats().guard_fallbacks, 2) << "a win";
  EXPECT_EQ(d.SpeculateUntilJudged(small_loss), 16);
  EXPECT_EQ(d.stats().guard_fallbacks, 2);
}

// A re-probe whose steps win only within their spread (222 tokens/s, above
// plain x 1.03 = 206, but 190 less one standard error) drafts on, but the
// run of losses stands: when the setting loses again, the hold doubles (10
// plain steps, not 5) and the loss is judged at the early steps. A loser
// whose short re-probes win by chance is then measured ever more rarely. A
// win beyond the spread (300 tokens/s, steady) ends the run.
TEST(SpeculationGuardTest, ANarrowWinOfAReprobeKeepsTheRunOfLosses) {
  for (const bool narrow : {true, false}) {
    SCOPED_TRACE(narrow ? "narrow win" : "clear win");
    ReprobeDriver d;
    EXPECT_EQ(d.SpeculateUntilJudged(Spec(3, 3, 1, 0.0105)), 16);
    EXPECT_EQ(d.stats().guard_fallbacks, 1);
    EXPECT_EQ(d.DecodeTheHold(), 5);
    // Two tokens a step in 4 or 14 ms, alternating; or in 6.6 ms.
    EXPECT_EQ(d.SpeculateUntilJudged([&](int64_t k) {
      return Spec(3, 3, 1, narrow ? (k % 2 == 0 ? 0.004 : 0.014) : 0.0066);
    }),
              16);
    EXPECT_EQ(d.stats().guard_fallbacks, 1) << "a win";
    EXPECT_NEAR(d.stats().guard_last_spec_tps, narrow ? 222.2 : 303.0, 0.1);
    // Then it loses (50 tokens/s).
    const int64_t to_loss = d.SpeculateUntilJudged(Spec(3, 3, 0, 0.02));
    EXPECT_EQ(d.stats().guard_fallbacks, 2);
    EXPECT_EQ(d.DecodeTheHold(), narrow ? 10 : 5);
    if (narrow) {
      EXPECT_EQ(to_loss, 4) << "a standing run is judged at the early steps";
    } else {
      EXPECT_GT(to_loss, 4) << "only a clear loss is judged that early";
    }
  }
}

// Tokens per step vary with acceptance: a window whose bare rate is just
// below plain x (1 + margin) but whose steps spread widely is not judged a
// loss (confidence 1), while the bare rate alone (confidence 0) would be.
// A setting well below plain loses despite its spread.
TEST(SpeculationGuardTest, AJudgementWeighsTheSpreadOfTheSteps) {
  struct Case {
    double confidence;
    int high_tokens;  // the tokens of every 4th step (the others commit 1)
    bool loses;
  };
  for (const Case& t :
       {Case{1.0, 5, false}, Case{0.0, 5, true}, Case{1.0, 3, true}}) {
    SCOPED_TRACE(::testing::Message() << "confidence " << t.confidence
                                      << ", high steps " << t.high_tokens);
    PlanningShared shared = SharedWithPlanAndPlainRate(4);
    PlanControllerOptions o = GuardOn();
    o.guard.margin = 0.03;  // stay above 206 tokens/s
    o.guard.min_steps = 16;
    o.guard.confidence = t.confidence;
    o.guard.early_steps = 0;  // the full window only
    PlanController c(o, BaseKey(), 1, 0, shared);
    for (int64_t step = 0; step < 16; ++step) {
      EXPECT_EQ(c.BeforeStep(step, 1).gamma, 4) << step;
      const int tokens = step % 4 == 3 ? t.high_tokens : 1;
      c.AfterStep(Spec(4, 4, tokens - 1, 0.01));
    }
    // 16 steps in 0.16 s: 32 tokens (200 tokens/s, standard error 45) or
    // 24 (150 tokens/s, standard error 22).
    EXPECT_EQ(c.stats().guard_checks, 1);
    EXPECT_EQ(c.stats().guard_fallbacks, t.loses ? 1 : 0);
    EXPECT_NEAR(c.stats().guard_last_spec_tps, t.high_tokens == 5 ? 200 : 150,
                1e-6);
  }
}

// The plain rate is measured too: its steps' spread widens the error of the
// difference, so a setting 3% below plain decoding's mean loses against a
// steady reference but not against one whose steps scatter by +-40%; a
// setting at half the rate loses against either.
TEST(SpeculationGuardTest, AJudgementWeighsThePlainStepsSpreadToo) {
  struct Case {
    double spread;        // plain steps of 5 ms +- this
    double step_seconds;  // the setting's steps, 2 tokens each
    bool loses;
  };
  for (const Case& t : {Case{0.0, 0.0103, true}, Case{0.002, 0.0103, false},
                        Case{0.002, 0.02, true}}) {
    SCOPED_TRACE(::testing::Message()
                 << "spread " << t.spread << ", steps " << t.step_seconds);
    PlanningShared shared = PlanningShared::Create();
    shared.cache->Insert(KeyAt(0), Plan(3, 0.5), 50, 10);
    // 8 plain steps, 200 tokens/s on average; with the spread, standard
    // error 0.00214 / sqrt(8) s of a 5 ms mean: 30 tokens/s.
    for (int i = 0; i < 8; ++i) {
      shared.plain_rates->Record(BaseKey().ExecutionId(), 32, 0,
                                 0.005 + (i % 2 == 0 ? t.spread : -t.spread));
    }
    PlanControllerOptions o = GuardOn();
    o.guard.margin = 0.03;  // 206 tokens/s
    o.guard.min_steps = 16;
    o.guard.early_steps = 0;  // the full window only
    PlanController c(o, BaseKey(), 1, 0, shared);
    for (int64_t step = 0; step < 16; ++step) {
      EXPECT_EQ(c.BeforeStep(step, 1).gamma, 3) << step;
      c.AfterStep(Spec(3, 3, 1, t.step_seconds));
    }
    EXPECT_EQ(c.stats().guard_checks, 1);
    EXPECT_EQ(c.stats().guard_fallbacks, t.loses ? 1 : 0);
    EXPECT_NEAR(c.stats().guard_last_plain_tps, 200, 1e-6);
    EXPECT_NEAR(c.stats().guard_last_spec_tps, 2 / t.step_seconds, 1e-6);
  }
}

// The last steps of a request draft less (the end of the generation holds
// their budget), so they commit fewer tokens than the setting's steps: no
// evidence either way.
TEST(SpeculationGuardTest, TheCappedLastStepsOfARequestAreNoEvidence) {
  PlanningShared shared = PlanningShared::Create();
  shared.cache->Insert(KeyAt(0), Plan(3, 0.5), 50, 10);
  for (int i = 0; i < 8; ++i) {
    shared.plain_rates->Record(BaseKey().ExecutionId(), 32, 0, 0.005);
  }
  PlanControllerOptions o = GuardOn();
  o.guard.margin = 0.03;
  o.guard.min_steps = 16;
  o.guard.early_steps = 0;
  PlanController c(o, BaseKey(), 1, 0, shared);
  StepObservation capped = Spec(3, 0, 0, 0.005);  // one token
  capped.budget = 0;
  capped.capped = true;
  for (int64_t step = 0; step < 32; ++step) {
    EXPECT_EQ(c.BeforeStep(step, 1).gamma, 3) << step;
    c.AfterStep(step % 2 == 0 ? Spec(3, 3, 1, 0.008) : capped);
  }
  // 16 whole steps of 2 tokens in 8 ms: one judgement, 250 tokens/s.
  EXPECT_EQ(c.stats().guard_checks, 1);
  EXPECT_EQ(c.stats().guard_fallbacks, 0);
  EXPECT_NEAR(c.stats().guard_last_spec_tps, 2 / 0.008, 1e-6);
}

// A drafting step that saved no layer (SpecBound's drafts all ran the whole
// model) cannot beat plain decoding, however fast the machine times it: a
// run of futile_steps of them loses at once, from the first step after the
// prefill (the settle steps count), with no probe; the verdict holds every
// sequence of the setting. A step that saved layers ends the run, and the
// capped last steps of a request neither count nor end it.
TEST(SpeculationGuardTest, StepsThatSavedNoLayerLoseWithoutATiming) {
  GuardOptions o;
  o.futile_steps = 3;
  o.settle_steps = 8;
  o.settle_plain = false;  // the settle steps draft, and count as futile
  o.min_steps = 1000;      // no timing judgement in this test
  PlanningShared shared = PlanningShared::Create();
  const std::string execution = BaseKey().ExecutionId();
  SpeculationGuard guard(o, shared.plain_rates, shared.verdicts, execution,
                         "specbound D4", 1, 32);
  PlanningStats stats;
  // 4 tokens in 5 ms: 800 tokens/s, four times any plain rate here.
  StepObservation futile = Spec(4, 3, 3, 0.005);
  futile.saved_no_layers = true;
  StepObservation saved = Spec(4, 3, 3, 0.005);
  StepObservation capped = futile;
  capped.capped = true;
  const StepObservation steps[] = {futile, futile, saved, futile,
                                   capped, futile, futile};
  for (const StepObservation& step : steps) {
    EXPECT_FALSE(guard.BeforeStep(0, stats));
    guard.Observe(true, 0, step, stats);
  }
  EXPECT_EQ(stats.guard_checks, 1);
  EXPECT_EQ(stats.guard_fallbacks, 1);
  EXPECT_EQ(stats.guard_probe_steps, 0);
  EXPECT_EQ(shared.verdicts->losing(), 1);
  EXPECT_TRUE(guard.BeforeStep(0, stats)) << "held plain";
  // Another sequence of the setting inherits the verdict from its first
  // step; one of another bucket is judged on its own.
  SpeculationGuard other(o, shared.plain_rates, shared.verdicts, execution,
                         "specbound D4", 2, 32);
  PlanningStats other_stats;
  EXPECT_TRUE(other.BeforeStep(0, other_stats));
  EXPECT_EQ(other_stats.guard_inherited_steps, 1);
  EXPECT_FALSE(other.BeforeStep(2, other_stats))
      << "not beside bucket 0: no carried verdict";
  // Off: the same steps are only timings.
  o.futile_steps = 0;
  SpeculationGuard unjudged(o, shared.plain_rates, shared.verdicts, execution,
                            "specbound D4", 3, 32);
  PlanningStats unjudged_stats;
  for (int i = 0; i < 8; ++i) {  // the settle steps: no probe yet
    EXPECT_FALSE(unjudged.BeforeStep(2, unjudged_stats)) << i;
    unjudged.Observe(true, 2, futile, unjudged_stats);
  }
  EXPECT_EQ(unjudged_stats.guard_checks, 0);
}

// A setting that lost at one bucket and was never judged at the bucket
// beside it decodes plainly there too, from a new sequence's first step,
// for reprobe_steps plain steps; then it is measured there, as a loser's
// re-probe. Without carry_neighbour_losses it drafts there at once.
TEST(SpeculationGuardTest, ALossCarriesToTheBucketBesideIt) {
  for (const bool carry : {true, false}) {
    SCOPED_TRACE(carry ? "carried" : "not carried");
    PlanningShared shared = PlanningShared::Create();
    const std::string execution = BaseKey().ExecutionId();
    for (int64_t bucket : {0, 1}) {
      for (int i = 0; i < 3; ++i) {
        shared.plain_rates->Record(execution, 32, bucket, 0.005);
      }
    }
    GuardOptions o = GuardOn().guard;
    o.carry_neighbour_losses = carry;
    o.reprobe_steps = 5;
    // The first sequence loses at bucket 1: 2 tokens in 20 ms (100
    // tokens/s) against 200.
    SpeculationGuard first(o, shared.plain_rates, shared.verdicts, execution,
                           "static a1 D3", 1, 32);
    PlanningStats first_stats;
    for (int i = 0; i < 4; ++i) {
      EXPECT_FALSE(first.BeforeStep(1, first_stats)) << i;
      first.Observe(true, 1, Spec(3, 3, 1, 0.02), first_stats);
    }
    ASSERT_EQ(first_stats.guard_fallbacks, 1);
    // A new sequence starts below the boundary, at bucket 0.
    SpeculationGuard second(o, shared.plain_rates, shared.verdicts, execution,
                            "static a1 D3", 2, 32);
    PlanningStats stats;
    for (int i = 0; i < 5; ++i) {
      EXPECT_EQ(second.BeforeStep(0, stats), carry) << i;
      second.Observe(true, 0, carry ? Plain(0.005) : Spec(3, 3, 1, 0.02),
                     stats);
      if (!carry) break;
    }
    if (!carry) {
      EXPECT_EQ(stats.guard_plain_steps, 0);
      EXPECT_FALSE(shared.verdicts->Find(execution, "static a1 D3", 32, 0));
      continue;
    }
    EXPECT_EQ(stats.guard_plain_steps, 5);
    EXPECT_EQ(stats.guard_carried_steps, 5);
    EXPECT_EQ(stats.guard_inherited_steps, 5);
    EXPECT_EQ(stats.guard_checks, 0) << "it never measured the setting here";
    EXPECT_EQ(shared.verdicts->verdicts_carried(), 1);
    // The carried hold is spent: the setting is measured at bucket 0, as a
    // setting that lost there last.
    EXPECT_TRUE(shared.verdicts->LastLost(execution, "static a1 D3", 32, 0, 0));
    EXPECT_FALSE(second.BeforeStep(0, stats));
    EXPECT_FALSE(shared.verdicts->Find(execution, "static a1 D3", 32, 0));
  }
}

// A setting whose context reaches a bucket without a plain rate probes
// there first (its steps alternate with plain ones from its first step at
// the bucket), as it does at its first step; without probe_first it drafts
// a window first.
TEST(SpeculationGuardTest, ANewBucketWithoutAPlainRateIsProbedFirst) {
  for (const bool probe_first : {true, false}) {
    SCOPED_TRACE(probe_first ? "probe first" : "window first");
    PlanningShared shared = SharedWithPlanAndPlainRate();  // bucket 0 only
    GuardOptions o = GuardOn().guard;
    o.probe_first = probe_first;
    SpeculationGuard guard(o, shared.plain_rates, shared.verdicts,
                           BaseKey().ExecutionId(), "static a1 D3", 1, 32);
    PlanningStats stats;
    // A winner at bucket 0: 3 tokens in 10 ms (300 tokens/s) against 200.
    for (int i = 0; i < 4; ++i) {
      EXPECT_FALSE(guard.BeforeStep(0, stats)) << i;
      guard.Observe(true, 0, Spec(3, 3, 2, 0.01), stats);
    }
    EXPECT_EQ(stats.guard_checks, 1);
    EXPECT_EQ(stats.guard_fallbacks, 0);
    // Bucket 1 has no plain rate.
    std::vector<bool> plain;
    for (int i = 0; i < 6; ++i) {
      const bool is_plain = guard.BeforeStep(1, stats);
      plain.push_back(is_plain);
      guard.Observe(!is_plain, 1, is_plain ? Plain(0.005) : Spec(3, 3, 2, 0.01),
                    stats);
    }
    if (probe_first) {
      EXPECT_THAT(plain, ElementsAre(false, true, false, true, false, true));
      EXPECT_EQ(stats.guard_probe_steps, 3);
    } else {
      EXPECT_THAT(plain, ElementsAre(false, false, false, false, false, true));
      EXPECT_EQ(stats.guard_probe_steps, 1);
    }
  }
}

// Plain timings age out: a reference older than the limit does not count.
TEST(StepTimeTableTest, OldPlainStepsAreNoReference) {
  StepTimeTable table;
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  for (int i = 0; i < 3; ++i) table.Record("exec", 32, 0, 0.002, t0);
  for (int i = 0; i < 3; ++i) {
    table.Record("exec", 32, 0, 0.004, t0 + absl::Seconds(20));
  }
  const absl::Time now = t0 + absl::Seconds(25);
  EXPECT_NEAR(*table.MeanStepSeconds("exec", 32, 0, 6), 0.003, 1e-12);
  EXPECT_NEAR(*table.MeanStepSeconds("exec", 32, 0, 3, absl::Seconds(10), now),
              0.004, 1e-12);
  EXPECT_FALSE(table.MeanStepSeconds("exec", 32, 0, 4, absl::Seconds(10), now))
      << "only 3 fresh samples";
  EXPECT_FALSE(table.MeanStepSeconds("exec", 32, 0, 1, absl::Seconds(1), now));
}

// A winning setting decodes no plain steps; once its plain reference is
// older than plain_max_age_seconds, the next judgement probes afresh.
TEST(SpeculationGuardTest, AStalePlainReferenceIsProbedAgain) {
  PlanningShared shared = SharedWithPlanAndPlainRate();
  PlanControllerOptions o = GuardOn();
  o.guard.plain_max_age_seconds = 0.2;
  PlanController c(o, BaseKey(), 1, 0, shared);
  int64_t step = 0;
  for (; step < 4; ++step) {
    EXPECT_EQ(c.BeforeStep(step, 1).gamma, 3);
    c.AfterStep(Spec(3, 3, 2, 0.012));  // 250 tokens/s: a win
  }
  EXPECT_EQ(c.stats().guard_checks, 1);
  EXPECT_EQ(c.stats().guard_probe_steps, 0);
  absl::SleepFor(absl::Milliseconds(300));
  for (; step < 8; ++step) {
    EXPECT_EQ(c.BeforeStep(step, 1).gamma, 3);
    c.AfterStep(Spec(3, 3, 2, 0.012));
  }
  // The reference is stale: a probe of 3 pairs, which judges.
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(i);
    ProbePair(c, step, 3, Spec(3, 3, 2, 0.012), 0.005);
  }
  EXPECT_EQ(c.stats().guard_probe_steps, 3);
  EXPECT_EQ(c.stats().guard_checks, 2);
}

// Losses in a row at one key double the hold up to the cap; a win resets.
constexpr GuardVerdicts::Judgement kWin = GuardVerdicts::Judgement::kWin;
constexpr GuardVerdicts::Judgement kUnprovenWin =
    GuardVerdicts::Judgement::kUnprovenWin;
constexpr GuardVerdicts::Judgement kLoss = GuardVerdicts::Judgement::kLoss;

// A losing verdict's report: 90 tokens/s against plain's 100.
GuardVerdicts::Verdict LosingVerdict(int64_t plan_version = 0,
                                     uint64_t sequence_id = 0) {
  GuardVerdicts::Verdict v;
  v.spec_tps = 90;
  v.plain_tps = 100;
  v.plan_version = plan_version;
  v.sequence_id = sequence_id;
  return v;
}

TEST(GuardVerdictsTest, EachLossInARowDoublesTheHoldUpToTheCap) {
  GuardVerdicts verdicts;
  const GuardVerdicts::Verdict v = LosingVerdict();
  auto spend = [&](const std::string& setting) {
    int64_t steps = 0;
    while (verdicts.TakePlainStep("exec", setting, 256, 1, 0).has_value()) {
      ++steps;
    }
    return steps;
  };
  for (int64_t expected : {3, 6, 10, 10}) {
    verdicts.Judge("exec", "static a1 D3", 256, 1, kLoss, v, 3, 10);
    EXPECT_EQ(verdicts.Find("exec", "static a1 D3", 256, 1)->hold_steps,
              expected);
    EXPECT_EQ(spend("static a1 D3"), expected);
  }
  verdicts.Judge("exec", "static a1 D3", 256, 1, kLoss, v, 3, 10);
  EXPECT_EQ(verdicts.Find("exec", "static a1 D3", 256, 1)->losses_in_a_row, 5);
  spend("static a1 D3");
  EXPECT_TRUE(verdicts.LastLost("exec", "static a1 D3", 256, 1, 0))
      << "the run outlives the expired verdict";
  EXPECT_FALSE(verdicts.LastLost("exec", "static a1 D3", 256, 1, 1))
      << "another plan";
  EXPECT_FALSE(verdicts.LastLost("exec", "static a1 D3", 256, 2, 0));
  // A narrow win lets the setting draft, but its run of losses stands: the
  // next loss holds it twice as long as the last.
  verdicts.Judge("exec", "static a1 D3", 256, 1, kUnprovenWin, v, 3, 10);
  EXPECT_FALSE(verdicts.Find("exec", "static a1 D3", 256, 1).has_value());
  EXPECT_FALSE(verdicts.TakePlainStep("exec", "static a1 D3", 256, 1, 0));
  EXPECT_TRUE(verdicts.LastLost("exec", "static a1 D3", 256, 1, 0));
  verdicts.Judge("exec", "static a1 D3", 256, 1, kLoss, v, 3, 10);
  EXPECT_EQ(verdicts.Find("exec", "static a1 D3", 256, 1)->losses_in_a_row, 6);
  EXPECT_EQ(verdicts.Find("exec", "static a1 D3", 256, 1)->hold_steps, 10);
  spend("static a1 D3");
  verdicts.Judge("exec", "static a1 D3", 256, 1, kWin, v, 3, 10);  // a win
  EXPECT_FALSE(verdicts.LastLost("exec", "static a1 D3", 256, 1, 0));
  verdicts.Judge("exec", "static a1 D3", 256, 1, kLoss, v, 3, 10);
  EXPECT_EQ(verdicts.Find("exec", "static a1 D3", 256, 1)->hold_steps, 3);
  verdicts.Judge("exec", "static a1 D3", 256, 1, kUnprovenWin, v, 3, 10);
  verdicts.Judge("exec", "static a1 D3", 256, 1, kLoss, v, 3, 10);
  EXPECT_EQ(verdicts.Find("exec", "static a1 D3", 256, 1)->hold_steps, 6);
  // Another bucket has its own run; no cap below the first hold.
  verdicts.Judge("exec", "static a1 D3", 256, 2, kLoss, v, 3, 10);
  EXPECT_EQ(verdicts.Find("exec", "static a1 D3", 256, 2)->hold_steps, 3);
  verdicts.Judge("exec", "knn D4", 256, 1, kLoss, v, 8, 2);
  verdicts.Judge("exec", "knn D4", 256, 1, kLoss, v, 8, 2);
  EXPECT_EQ(verdicts.Find("exec", "knn D4", 256, 1)->hold_steps, 8);
}

// The pool of a setting's steps: the last `keep`, of the newest plan only;
// a loss empties it.
TEST(GuardVerdictsTest, TheStepPoolKeepsTheNewestPlansLastSteps) {
  GuardVerdicts verdicts;
  const auto add = [&](int64_t plan, int tokens) {
    return verdicts.AddStep("exec", "knapspec D4", 32, 0, plan, {tokens, 0.01},
                            3);
  };
  const auto tokens = [&](int64_t plan) {
    std::vector<int> out;
    for (const GuardVerdicts::Step& step :
         verdicts.Steps("exec", "knapspec D4", 32, 0, plan)) {
      out.push_back(step.tokens);
    }
    return out;
  };
  for (int t = 1; t <= 3; ++t) add(1, t);
  EXPECT_EQ(add(1, 4), 4) << "steps since the last judgement";
  EXPECT_THAT(tokens(1), ElementsAre(2, 3, 4));
  EXPECT_THAT(tokens(2), IsEmpty()) << "another plan's pool";
  EXPECT_THAT(verdicts.Steps("exec", "knapspec D4", 32, 1, 1), IsEmpty());
  EXPECT_EQ(add(2, 7), 1) << "a newer plan starts afresh";
  EXPECT_EQ(add(1, 5), 0) << "a late step of the older plan is dropped";
  EXPECT_THAT(tokens(2), ElementsAre(7));
  EXPECT_THAT(tokens(1), IsEmpty());
  GuardVerdicts::Verdict verdict;
  verdict.plan_version = 2;
  verdicts.Judge("exec", "knapspec D4", 32, 0, kWin, verdict, 8);
  EXPECT_THAT(tokens(2), ElementsAre(7)) << "a win keeps the pool";
  EXPECT_EQ(add(2, 8), 1) << "and starts the next window";
  EXPECT_TRUE(verdicts.WonLast("exec", "knapspec D4", 32, 0, 2));
  EXPECT_FALSE(verdicts.WonLast("exec", "knapspec D4", 32, 0, 3))
      << "another plan";
  EXPECT_FALSE(verdicts.WonLast("exec", "knapspec D4", 32, 1, 2))
      << "another bucket";
  EXPECT_THAT(tokens(2), ElementsAre(7, 8));
  verdicts.Judge("exec", "knapspec D4", 32, 0, kLoss, verdict, 8);
  EXPECT_THAT(tokens(2), IsEmpty()) << "a loss empties it";
  EXPECT_FALSE(verdicts.WonLast("exec", "knapspec D4", 32, 0, 2))
      << "and its last judgement lost";
}

// Confirming pairs pool as the steps do: the last `keep` of each side, a
// newer plan starts afresh, an older plan's are only handed back, a loss
// empties the pool.
TEST(GuardVerdictsTest, ConfirmingPairsPoolLikeTheSteps) {
  GuardVerdicts verdicts;
  const auto add = [&](int64_t plan, std::vector<int> setting_tokens) {
    GuardVerdicts::Pairs pairs;
    for (int t : setting_tokens) {
      pairs.setting.push_back({t, 0.01});
      pairs.plain.push_back({1, 0.005});
    }
    const GuardVerdicts::Pairs pooled =
        verdicts.AddPairs("exec", "knapspec D4", 32, 0, plan, 1, pairs, 3);
    EXPECT_EQ(pooled.setting.size(), pooled.plain.size());
    std::vector<int> out;
    for (const GuardVerdicts::Step& step : pooled.setting) {
      out.push_back(step.tokens);
    }
    return out;
  };
  EXPECT_THAT(add(1, {1, 2}), ElementsAre(1, 2));
  EXPECT_THAT(add(1, {3, 4}), ElementsAre(2, 3, 4)) << "the last 3";
  EXPECT_THAT(add(2, {5}), ElementsAre(5)) << "a newer plan starts afresh";
  EXPECT_THAT(add(1, {6}), ElementsAre(6)) << "an older plan's: not pooled";
  EXPECT_THAT(add(2, {7}), ElementsAre(5, 7));
  GuardVerdicts::Verdict verdict;
  verdict.plan_version = 2;
  verdicts.Judge("exec", "knapspec D4", 32, 0, kWin, verdict, 8);
  EXPECT_THAT(add(2, {8}), ElementsAre(5, 7, 8)) << "a win keeps them";
  verdicts.Judge("exec", "knapspec D4", 32, 0, kLoss, verdict, 8);
  EXPECT_THAT(add(2, {9}), IsEmpty())
      << "a loss in force: the confirmation it overtook adds nothing";
  for (int i = 0; i < 8; ++i) {
    EXPECT_TRUE(verdicts.TakePlainStep("exec", "knapspec D4", 32, 0, 2));
  }
  EXPECT_THAT(add(2, {10}), ElementsAre(10)) << "the loss emptied the pool";
}

// One confirmation at a time per key: its start makes the setting's steps
// count afresh towards the next judgement; another sequence may not start
// one until it ends (AddPairs, EndConfirmation) or goes stale (a sequence
// that ended mid-probe), nor while a loss holds the setting. A
// confirmation's win does not lift a loss given meanwhile; another win
// does.
TEST(GuardVerdictsTest, OneConfirmationAtATimePerKey) {
  GuardVerdicts verdicts;
  const std::string s = "static a1 D3";
  const auto add = [&](int64_t plan) {
    return verdicts.AddStep("exec", s, 32, 0, plan, {2, 0.01}, 8);
  };
  const absl::Time t0 = absl::Now();
  const absl::Duration age = absl::Seconds(10);
  const auto start = [&](uint64_t sequence, absl::Time at) {
    return verdicts.StartConfirmation("exec", s, 32, 0, /*plan=*/1, sequence,
                                      at, age);
  };
  EXPECT_EQ(add(1), 1);
  EXPECT_EQ(add(1), 2);
  EXPECT_TRUE(
      verdicts.StartConfirmation("exec", s, 32, 0, /*plan=*/2, 1, t0, age));
  EXPECT_EQ(add(1), 3) << "another plan's confirmation marks nothing";
  EXPECT_TRUE(start(1, t0));
  EXPECT_EQ(add(1), 1) << "the count starts afresh";
  EXPECT_EQ(verdicts.Steps("exec", s, 32, 0, 1).size(), 4u)
      << "the steps stay evidence";
  EXPECT_FALSE(start(2, t0 + absl::Seconds(1))) << "1's is under way";
  EXPECT_EQ(add(1), 1) << "2 waits a window more";
  EXPECT_TRUE(start(2, t0 + absl::Seconds(11))) << "1's went stale";
  verdicts.EndConfirmation("exec", s, 32, 0, /*sequence=*/1);
  EXPECT_FALSE(start(3, t0 + absl::Seconds(12))) << "1 no longer holds it";
  GuardVerdicts::Pairs pairs;
  pairs.setting.push_back({2, 0.01});
  pairs.plain.push_back({1, 0.005});
  EXPECT_EQ(verdicts.AddPairs("exec", s, 32, 0, 1, 2, pairs, 8).plain.size(),
            1u);
  EXPECT_TRUE(start(3, t0 + absl::Seconds(12))) << "2's ended with its pairs";

  GuardVerdicts::Verdict loss;
  loss.plan_version = 1;
  verdicts.Judge("exec", s, 32, 0, kLoss, loss, 8);
  EXPECT_FALSE(start(4, t0 + absl::Seconds(13))) << "a loss holds it";
  GuardVerdicts::Verdict confirmed = loss;
  confirmed.confirmation = true;
  verdicts.Judge("exec", s, 32, 0, kWin, confirmed, 8);
  EXPECT_TRUE(verdicts.Find("exec", s, 32, 0).has_value())
      << "a confirmation's win does not lift the loss";
  verdicts.Judge("exec", s, 32, 0, kWin, loss, 8);
  EXPECT_FALSE(verdicts.Find("exec", s, 32, 0).has_value()) << "a win does";
}

TEST(GuardVerdictsTest, VerdictsAreKeyedBySettingBucketAndPlan) {
  GuardVerdicts verdicts;
  GuardVerdicts::Verdict v = LosingVerdict(7, 3);
  verdicts.Judge("exec", "knapspec D6", 256, 1, kLoss, v, 3);
  EXPECT_FALSE(verdicts.TakePlainStep("exec", "knapspec D6", 256, 0, 7))
      << "another bucket";
  EXPECT_FALSE(verdicts.TakePlainStep("exec", "static a1 D3", 256, 1, 0))
      << "another setting";
  EXPECT_FALSE(verdicts.TakePlainStep("other", "knapspec D6", 256, 1, 7))
      << "another execution";
  EXPECT_FALSE(verdicts.TakePlainStep("exec", "knapspec D6", 256, 1, 6))
      << "an older plan is not what lost";
  std::optional<GuardVerdicts::Verdict> taken =
      verdicts.TakePlainStep("exec", "knapspec D6", 256, 1, 7);
  ASSERT_TRUE(taken.has_value());
  EXPECT_EQ(taken->sequence_id, 3u);
  EXPECT_DOUBLE_EQ(taken->plain_tps, 100);
  EXPECT_TRUE(verdicts.TakePlainStep("exec", "knapspec D6", 256, 1, 7));
  EXPECT_TRUE(verdicts.TakePlainStep("exec", "knapspec D6", 256, 1, 7));
  EXPECT_FALSE(verdicts.TakePlainStep("exec", "knapspec D6", 256, 1, 7))
      << "three plain steps held it";
  // A late judgement of an older plan neither clears nor replaces the
  // verdict on a newer one.
  GuardVerdicts::Verdict newer = v;
  newer.plan_version = 9;
  verdicts.Judge("exec", "knapspec D6", 256, 1, kLoss, newer, 3);
  verdicts.Judge("exec", "knapspec D6", 256, 1, kWin, v, 3);
  verdicts.Judge("exec", "knapspec D6", 256, 1, kLoss, v, 3);
  EXPECT_EQ(verdicts.Find("exec", "knapspec D6", 256, 1)->plan_version, 9);
  EXPECT_TRUE(verdicts.TakePlainStep("exec", "knapspec D6", 256, 1, 9));
  verdicts.Judge("exec", "knapspec D6", 256, 1, kWin, newer, 3);
  // A newer plan voids a verdict on an older one; a win clears a verdict.
  verdicts.Judge("exec", "knapspec D6", 256, 1, kLoss, v, 3);
  EXPECT_FALSE(verdicts.TakePlainStep("exec", "knapspec D6", 256, 1, 8));
  EXPECT_EQ(verdicts.losing(), 0);
  v.plan_version = 0;
  verdicts.Judge("exec", "static a1 D3", 256, 1, kLoss, v, 3);
  EXPECT_EQ(verdicts.losing(), 1);
  verdicts.Judge("exec", "static a1 D3", 256, 1, kWin, v, 3);
  EXPECT_EQ(verdicts.losing(), 0);
  EXPECT_EQ(verdicts.verdicts_given(), 4);
}

// A loss carries to the buckets beside it where the setting was never
// judged: as a first loss there (a hold of the carried length, then a
// loser's re-probe), once; a carried verdict carries no further, a bucket
// with a judgement of its own keeps it, and a loss on another plan carries
// nothing.
TEST(GuardVerdictsTest, ALossCarriesOnceToTheNeverJudgedBucketsBesideIt) {
  GuardVerdicts verdicts;
  const GuardVerdicts::Verdict v = LosingVerdict(0, 3);
  const std::string s = "static a1 D3";
  verdicts.Judge("exec", s, 256, 4, kLoss, v, 10);
  EXPECT_FALSE(verdicts.TakePlainStep("exec", s, 256, 3, 0))
      << "no carrying asked for";
  std::optional<GuardVerdicts::Verdict> carried =
      verdicts.TakePlainStep("exec", s, 256, 3, 0, 2);
  ASSERT_TRUE(carried.has_value());
  EXPECT_EQ(carried->carried_from_bucket, 4);
  EXPECT_EQ(carried->hold_steps, 2);
  EXPECT_EQ(carried->sequence_id, 3u);
  EXPECT_DOUBLE_EQ(carried->plain_tps, 100);
  EXPECT_TRUE(verdicts.LastLost("exec", s, 256, 3, 0));
  EXPECT_EQ(verdicts.losing(), 2);
  EXPECT_TRUE(verdicts.TakePlainStep("exec", s, 256, 3, 0, 2));
  EXPECT_FALSE(verdicts.TakePlainStep("exec", s, 256, 3, 0, 2))
      << "its hold spent, it is measured here: no second carry";
  EXPECT_EQ(verdicts.Find("exec", s, 256, 4)->plain_steps_left, 10)
      << "the measured verdict spent none of its steps";
  // Upwards too; a carried verdict does not carry on (bucket 6 is beside
  // 5's carried one only).
  EXPECT_EQ(
      verdicts.TakePlainStep("exec", s, 256, 5, 0, 2)->carried_from_bucket, 4);
  EXPECT_FALSE(verdicts.TakePlainStep("exec", s, 256, 6, 0, 2));
  // A bucket whose own judgement was a win keeps it.
  verdicts.AddStep("exec", s, 256, 7, 0, {3, 0.01}, 8);
  verdicts.Judge("exec", s, 256, 7, kWin, v, 10);
  verdicts.Judge("exec", s, 256, 8, kLoss, v, 10);
  EXPECT_FALSE(verdicts.TakePlainStep("exec", s, 256, 7, 0, 2));
  // A loss on another plan, or of another setting, carries nothing.
  const GuardVerdicts::Verdict planned = LosingVerdict(7, 3);
  verdicts.Judge("exec", "knapspec D6", 256, 1, kLoss, planned, 10);
  EXPECT_FALSE(verdicts.TakePlainStep("exec", "knapspec D6", 256, 2, 8, 2));
  EXPECT_FALSE(verdicts.TakePlainStep("exec", "static a2 D3", 256, 3, 0, 2));
  EXPECT_TRUE(verdicts.TakePlainStep("exec", "knapspec D6", 256, 0, 7, 2))
      << "the same plan carries";
  EXPECT_EQ(verdicts.verdicts_carried(), 3);
  EXPECT_EQ(verdicts.verdicts_given(), 6);
}

}  // namespace
}  // namespace knapserve
