// Tests of executor/planning/plan_cache.h: cache keying and bucketing, claims,
// thread safety, the planner budget and the step-time tables.
#include "executor/planning/plan_cache.h"

#include <gtest/gtest.h>

#include <atomic>
#include <limits>
#include <thread>
#include <vector>

namespace knapserve {
namespace {

PlanCacheKey Key(int64_t bucket) {
  PlanCacheKey key;
  key.model_fingerprint = "llama:L=2";
  key.device = "cpu";
  key.dtype = "fp32";
  key.threads = 2;
  key.policy = PlanPolicy::kKnapSpec;
  key.max_draft = 6;
  key.bucket_tokens = 256;
  key.bucket = bucket;
  return key;
}

DraftPlan Plan(int gamma, double alpha_hat) {
  DraftPlan plan;
  plan.mask = LayerMask(2);
  plan.gamma = gamma;
  plan.alpha_hat = alpha_hat;
  plan.solve_seconds = 0.5;
  return plan;
}

TEST(ContextBucketTest, FixedWidthBuckets) {
  EXPECT_EQ(ContextBucket(0, 256), 0);
  EXPECT_EQ(ContextBucket(255, 256), 0);
  EXPECT_EQ(ContextBucket(256, 256), 1);
  EXPECT_EQ(ContextBucket(1000, 256), 3);
  EXPECT_EQ(ContextBucket(1024, 256), 4);
  EXPECT_EQ(ContextBucket(31, 32), 0);
  EXPECT_EQ(ContextBucket(32, 32), 1);
  EXPECT_EQ(ContextBucket(-5, 256), 0);
  EXPECT_EQ(ContextBucket(7, 0), 7);  // width clamped to 1
}

TEST(PlanCacheTest, EveryKeyFieldSeparatesPlans) {
  PlanCache cache;
  cache.Insert(Key(1), Plan(3, 0.8), 1, 300);
  ASSERT_TRUE(cache.Lookup(Key(1)).has_value());
  std::vector<PlanCacheKey> others;
  for (int field = 0; field < 10; ++field) {
    PlanCacheKey k = Key(1);
    switch (field) {
      case 0:
        k.model_fingerprint = "llama:L=3";
        break;
      case 1:
        k.device = "cuda:0";
        break;
      case 2:
        k.dtype = "bf16";
        break;
      case 3:
        k.threads = 4;
        break;
      case 4:
        k.policy = PlanPolicy::kClasp;
        break;
      case 5:
        k.policy_detail = "layers=1";
        break;
      case 6:
        k.max_draft = 10;
        break;
      case 7:
        k.bucket_tokens = 128;
        break;
      case 8:
        k.bucket = 2;
        break;
      case 9:
        k.exit_threshold = 0.5;
        break;
    }
    SCOPED_TRACE(field);
    EXPECT_FALSE(cache.Lookup(k).has_value()) << k.ToString();
  }
  EXPECT_EQ(cache.hits(), 1);
  EXPECT_EQ(cache.misses(), 10);
  EXPECT_EQ(cache.size(), 1);
}

TEST(PlanCacheTest, InsertReplacesAndBumpsTheVersion) {
  PlanCache cache;
  EXPECT_EQ(cache.Version(Key(0)), 0);
  EXPECT_FALSE(cache.Peek(Key(0)).has_value());
  const int64_t v1 = cache.Insert(Key(0), Plan(3, 0.8), 7, 40);
  const int64_t v2 = cache.Insert(Key(0), Plan(5, 0.9), 8, 60);
  EXPECT_GT(v1, 0);
  EXPECT_GT(v2, v1);
  EXPECT_EQ(cache.Version(Key(0)), v2);
  std::optional<CachedPlan> got = cache.Peek(Key(0));
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->plan.gamma, 5);
  EXPECT_EQ(got->sequence_id, 8u);
  EXPECT_EQ(got->context_length, 60);
  EXPECT_EQ(cache.hits() + cache.misses(), 0)
      << "Peek and Version do not count";
}

// A plain plan's plain steps are counted per version: the step that reaches
// the threshold is the one recheck; each plain answer in a row doubles the
// threshold, a drafting answer resets it.
TEST(PlanCacheTest, APlainPlanIsRecheckedAfterItsStepsAndThenLessOften) {
  PlanCache cache;
  auto steps_to_recheck = [&](int64_t version, int64_t limit) {
    for (int64_t n = 1; n <= limit; ++n) {
      if (cache.CountPlainStep(Key(0), version, 4)) return n;
    }
    return int64_t{-1};
  };
  EXPECT_FALSE(cache.CountPlainStep(Key(0), 1, 4)) << "no plan";
  int64_t v = cache.Insert(Key(0), Plan(0, 1.0), 7, 40);
  EXPECT_FALSE(cache.CountPlainStep(Key(0), v, 0)) << "0 = never";
  EXPECT_FALSE(cache.CountPlainStep(Key(0), v + 1, 4)) << "another version";
  EXPECT_EQ(steps_to_recheck(v, 100), 4);
  EXPECT_EQ(steps_to_recheck(v, 100), 4)
      << "no new version came (the recheck came to nothing): again";
  v = cache.Insert(Key(0), Plan(0, 1.0), 7, 40);  // plain again
  EXPECT_EQ(steps_to_recheck(v, 100), 8);
  v = cache.Insert(Key(0), Plan(0, 1.0), 7, 40);
  EXPECT_EQ(steps_to_recheck(v, 100), 16);
  for (int k = 0; k < 10; ++k) v = cache.Insert(Key(0), Plan(0, 1.0), 7, 40);
  EXPECT_EQ(steps_to_recheck(v, 1000), 4 << PlanCache::kMaxRecheckDoublings);
  v = cache.Insert(Key(0), Plan(3, 0.8), 7, 40);  // a drafting answer
  EXPECT_EQ(steps_to_recheck(v, 100), -1) << "a drafting plan is not counted";
  v = cache.Insert(Key(0), Plan(0, 1.0), 7, 40);
  EXPECT_EQ(steps_to_recheck(v, 100), 4) << "the doubling starts over";
  EXPECT_FALSE(cache.CountPlainStep(Key(1), v, 4)) << "keys are separate";
  // A base too large to double stays at the largest count.
  constexpr int64_t kHuge = std::numeric_limits<int64_t>::max() / 2;
  for (int k = 0; k < 3; ++k) v = cache.Insert(Key(0), Plan(0, 1.0), 7, 40);
  EXPECT_FALSE(cache.CountPlainStep(Key(0), v, kHuge));
}

TEST(PlanCacheTest, OneClaimPerKey) {
  PlanCache cache;
  EXPECT_TRUE(cache.TryClaim(Key(0)));
  EXPECT_FALSE(cache.TryClaim(Key(0)));
  EXPECT_TRUE(cache.TryClaim(Key(1)));
  EXPECT_TRUE(cache.Claimed(Key(0)));
  cache.ReleaseClaim(Key(0));
  EXPECT_FALSE(cache.Claimed(Key(0)));
  EXPECT_TRUE(cache.TryClaim(Key(0)));
}

// Many threads insert, look up and claim at once: every insert gets its own
// version, exactly one thread wins each claim, and the counters add up.
TEST(PlanCacheTest, ConcurrentUseIsConsistent) {
  PlanCache cache;
  constexpr int kThreads = 8;
  constexpr int kRounds = 500;
  std::atomic<int> claims_won{0};
  std::vector<std::vector<int64_t>> versions(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kRounds; ++i) {
        versions[t].push_back(cache.Insert(Key(i % 4), Plan(t % 5, 0.5), t, i));
        cache.Lookup(Key(i % 8));
        if (cache.TryClaim(Key(100 + i))) ++claims_won;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  std::vector<int64_t> all;
  for (const auto& v : versions) all.insert(all.end(), v.begin(), v.end());
  std::sort(all.begin(), all.end());
  EXPECT_EQ(std::adjacent_find(all.begin(), all.end()), all.end())
      << "duplicate version";
  EXPECT_EQ(claims_won.load(), kRounds);
  EXPECT_EQ(cache.hits() + cache.misses(), kThreads * kRounds);
  EXPECT_EQ(cache.size(), 4);
}

TEST(PlannerBudgetTest, FirstSolveIsFreeThenTheShareGates) {
  PlannerBudget budget;
  // Nothing spent: allowed even before any decoding.
  std::optional<double> first = budget.TryReserve(0.05);
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(*first, 0.0);  // no solve seen yet: nothing to expect
  // Its cost unknown until it settles: no second solve beside it.
  EXPECT_FALSE(budget.TryReserve(0.05).has_value());
  budget.AddDecodeSeconds(100.0);
  EXPECT_FALSE(budget.TryReserve(0.05).has_value());
  budget.Settle(*first, 0.5);
  EXPECT_TRUE(budget.TryReserve(0.05).has_value());  // 0.5 s of 5 s allowed
  budget.Settle(0.5, 0.0);  // (that one failed: frees it, adds nothing)
  PlannerBudget fresh;
  first = fresh.TryReserve(0.05);
  fresh.Settle(*first, 0.0);  // a failed first solve: the next is free too
  EXPECT_TRUE(fresh.TryReserve(0.05).has_value());
}

TEST(PlannerBudgetTest, TheShareGatesOnceASolveSettled) {
  PlannerBudget budget;
  std::optional<double> first = budget.TryReserve(0.05);
  ASSERT_TRUE(first.has_value());
  budget.Settle(*first, 0.5);
  EXPECT_EQ(budget.solve_seconds(), 0.5);
  EXPECT_EQ(budget.solves(), 1);
  // 0.5 s of solving needs 10 s of decoding at 5%.
  budget.AddDecodeSeconds(9.0);
  EXPECT_FALSE(budget.TryReserve(0.05).has_value());
  EXPECT_NEAR(budget.share(), 0.5 / 9.0, 1e-12);
  budget.AddDecodeSeconds(1.0);
  std::optional<double> second = budget.TryReserve(0.05);
  ASSERT_TRUE(second.has_value());
  EXPECT_DOUBLE_EQ(*second, 0.5);  // the mean solve so far
  EXPECT_DOUBLE_EQ(budget.reserved_seconds(), 0.5);
  // The reservation counts: a concurrent request must wait.
  EXPECT_FALSE(budget.TryReserve(0.05).has_value());
  budget.Settle(*second, 0.0);  // failed: frees the reservation, adds nothing
  EXPECT_DOUBLE_EQ(budget.reserved_seconds(), 0.0);
  EXPECT_EQ(budget.solves(), 1);
  EXPECT_TRUE(budget.TryReserve(0.05).has_value());
}

TEST(PlannerBudgetTest, ZeroMeansNoLimitAndDeferralsAreCounted) {
  PlannerBudget budget;
  budget.Settle(0, 100.0);
  budget.AddDecodeSeconds(1.0);
  EXPECT_FALSE(budget.TryReserve(0.5).has_value());
  EXPECT_TRUE(budget.TryReserve(0.0).has_value());
  EXPECT_EQ(budget.deferrals(), 0);
  budget.CountDeferral();
  EXPECT_EQ(budget.deferrals(), 1);
}

TEST(StepTimeTableTest, MeanOfTheLastWindowPerBucketAndExecution) {
  StepTimeTable table;
  EXPECT_FALSE(table.MeanStepSeconds("a", 256, 0, 1).has_value());
  for (int i = 0; i < 3; ++i) table.Record("a", 256, 0, 0.01);
  EXPECT_FALSE(table.MeanStepSeconds("a", 256, 0, 4).has_value());
  table.Record("a", 256, 0, 0.03);
  ASSERT_TRUE(table.MeanStepSeconds("a", 256, 0, 4).has_value());
  EXPECT_NEAR(*table.MeanStepSeconds("a", 256, 0, 4), 0.015, 1e-12);
  // Standard deviation 0.01 over sqrt(4): the mean's standard error.
  const auto time = table.RecentStepTime("a", 256, 0, 4);
  ASSERT_TRUE(time.has_value());
  EXPECT_NEAR(time->mean_seconds, 0.015, 1e-12);
  EXPECT_NEAR(time->standard_error, 0.005, 1e-12);
  EXPECT_EQ(time->kept, 4);
  EXPECT_FALSE(table.MeanStepSeconds("a", 256, 1, 1).has_value());
  EXPECT_FALSE(table.MeanStepSeconds("b", 256, 0, 1).has_value());
  EXPECT_FALSE(table.MeanStepSeconds("a", 128, 0, 1).has_value());
  for (int i = 0; i < StepTimeTable::kWindow; ++i)
    table.Record("a", 256, 0, 0.02);
  EXPECT_EQ(table.samples("a", 256, 0), StepTimeTable::kWindow);
  EXPECT_NEAR(*table.MeanStepSeconds("a", 256, 0, 4), 0.02,
              1e-12);  // old ones dropped
}

// An 8-step probe of 0.6 ms steps in which the scheduler took the core for
// 4 ms: with the outlier rule the plain rate is the steps' own, without it a
// third slower. The preempted step still counts towards min_samples.
TEST(StepTimeTableTest, APreemptedStepDoesNotMoveThePlainRate) {
  StepTimeTable table;
  const absl::Time now = absl::Now();
  for (int i = 0; i < 7; ++i) table.Record("a", 256, 0, 0.0006, now);
  table.Record("a", 256, 0, 0.0046, now);
  EXPECT_NEAR(*table.MeanStepSeconds("a", 256, 0, 8, absl::Seconds(10), now),
              0.0011, 1e-12);
  EXPECT_NEAR(*table.MeanStepSeconds("a", 256, 0, 8, absl::Seconds(10), now,
                                     /*outlier_factor=*/3),
              0.0006, 1e-12);
  EXPECT_FALSE(table
                   .MeanStepSeconds("a", 256, 0, 9, absl::Seconds(10), now,
                                    /*outlier_factor=*/3)
                   .has_value());
}

// A plain step with a solve of the process in flight at either end is no
// plain rate: the solve shared the cores.
TEST(StepTimeTableTest, AStepBesideASolveAtEitherEndIsNotRecorded) {
  PlanningShared shared = PlanningShared::Create();
  RecordPlainStep(shared, "a", 256, 0, 0.001, /*began_beside_solve=*/false);
  EXPECT_EQ(shared.plain_rates->samples("a", 256, 0), 1);
  // A solve was in flight when the step began and settled before its end.
  RecordPlainStep(shared, "a", 256, 0, 0.001, /*began_beside_solve=*/true);
  EXPECT_EQ(shared.plain_rates->samples("a", 256, 0), 1);
  // A solve is in flight at the step's end.
  const std::optional<double> reserved = shared.budget->TryReserve(0.05);
  ASSERT_TRUE(reserved.has_value());
  RecordPlainStep(shared, "a", 256, 0, 0.001, /*began_beside_solve=*/false);
  EXPECT_EQ(shared.plain_rates->samples("a", 256, 0), 1);
  shared.budget->Settle(*reserved, 0.1);
  RecordPlainStep(shared, "a", 256, 0, 0.001, /*began_beside_solve=*/false);
  EXPECT_EQ(shared.plain_rates->samples("a", 256, 0), 2);
}

TEST(OutlierThresholdTest, AFactorOfTheMedian) {
  EXPECT_DOUBLE_EQ(OutlierThresholdSeconds({1, 5, 2, 100, 3}, 3), 9);
  EXPECT_EQ(OutlierThresholdSeconds({1, 2}, 0),
            std::numeric_limits<double>::infinity());
  EXPECT_EQ(OutlierThresholdSeconds({}, 3),
            std::numeric_limits<double>::infinity());
}

}  // namespace
}  // namespace knapserve
