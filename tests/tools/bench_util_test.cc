// Tests of the benchmarks' helpers (tools/bench_util.h): each run against
// the baseline runs around it; the plans' promise against what they
// measured; each mode against off pair by pair; the peaks of gauges while
// a phase runs; and the runner, RunModes: a
// cold run's every repeat plans from an empty plan cache, so a repeat never
// reuses another repeat's solves; a warm run solves in its untimed pass and
// its timed runs use the cache. Counted at the planner, on stories260k with
// a hand-made latency profile (solved synchronously, so counts are exact).
#include "tools/bench_util.h"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "planner/inprocess_planner.h"
#include "tests/testing/synchronous_planner.h"
#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

// Each run against the baseline runs just before and after it: a drift
// that slows the second half of a run slows its baseline alike.
// Two plans that promised 100 and 200 tokens/s: the rates weigh each plan
// by its measured seconds, the per-step figures by its steps, and a plan
// without a measured step (replaced at once) is left out.
TEST(SummarizePredictionsTest, WeighsEachPlanByWhatItRan) {
  AppliedPlan a;  // gamma 2, of which 0.9 drafts and 1.5 tokens predicted
  a.gamma = 2;
  a.alpha_hat = 0.75;  // raw; the objective used the smoothed 0.5
  a.alpha_smoothed = 0.5;
  a.predicted_tokens_per_step = 1.5;  // the planner's, not recomputed
  a.predicted_drafts_per_step = 0.9;
  a.predicted_tpt = 100;
  a.measured_steps = 10;
  a.measured_tokens = 12;
  a.measured_seconds = 0.2;   // 60 tokens/s: 40% below its promise
  a.measured_drafted = 8;     // the confidence stop cut two drafts
  a.baseline_tpt = 80;        // the profile's plain rate: 1.25x promised
  a.measured_plain_tpt = 48;  // plain measured 40% slower: 60 calibrated
  AppliedPlan b;              // gamma 0: plain, 1 token a step
  b.predicted_tpt = 200;
  b.baseline_tpt = 200;        // a plain plan: its promise is the baseline,
  b.measured_plain_tpt = 160;  // plain measured before it: 160 calibrated
  b.measured_steps = 30;
  b.measured_tokens = 30;
  b.measured_seconds = 0.2;  // 150 tokens/s
  AppliedPlan unmeasured;    // its only steps ran beside a solve
  unmeasured.predicted_tpt = 1000;
  unmeasured.beside_solve_steps = 3;
  unmeasured.beside_solve_tokens = 5;
  unmeasured.beside_solve_seconds = 0.25;
  a.beside_solve_steps = 1;  // counted, never in a's rate
  a.beside_solve_tokens = 1;
  a.beside_solve_seconds = 0.5;
  b.unsteady_steps = 8;   // its first steps after the prefill: counted,
  b.unsteady_tokens = 8;  // never in b's rate
  b.unsteady_seconds = 0.125;
  const PlanPrediction p = SummarizePredictions({a, unmeasured, b});
  EXPECT_EQ(p.plans, 2);
  EXPECT_EQ(p.steps, 40);
  EXPECT_DOUBLE_EQ(p.predicted_tpt, (100 * 0.2 + 200 * 0.2) / 0.4);
  EXPECT_DOUBLE_EQ(p.measured_tpt, 42 / 0.4);
  EXPECT_DOUBLE_EQ(p.error(), 105.0 / 150.0 - 1);
  EXPECT_DOUBLE_EQ(p.predicted_tokens_per_step, (1.5 * 10 + 1 * 30) / 40.0);
  EXPECT_DOUBLE_EQ(p.measured_tokens_per_step, 42 / 40.0);
  EXPECT_DOUBLE_EQ(p.predicted_step_seconds,
                   (1.5 / 100 * 10 + 1.0 / 200 * 30) / 40.0);
  EXPECT_DOUBLE_EQ(p.measured_step_seconds, 0.4 / 40.0);
  EXPECT_DOUBLE_EQ(p.planned_drafts_per_step, 0.9 * 10 / 40.0);
  EXPECT_DOUBLE_EQ(p.measured_drafts_per_step, 8 / 40.0);
  EXPECT_EQ(PlanPredictionJson(p)["steps"], 40);
  EXPECT_EQ(p.beside_solve_steps, 4);
  EXPECT_DOUBLE_EQ(p.beside_solve_seconds, 0.75);
  EXPECT_EQ(p.unsteady_steps, 8);
  EXPECT_DOUBLE_EQ(p.unsteady_seconds, 0.125);
  EXPECT_EQ(PlanPredictionJson(p)["unsteady_steps"], 8);
  // Both plans had a plain rate when they took effect, the plain plan too
  // (it was read before its steps): time-weighted, 0.2 s each.
  EXPECT_DOUBLE_EQ(p.calibrated_seconds, 0.4);
  EXPECT_DOUBLE_EQ(p.calibrated_tpt, (60 + 160) / 2.0);
  EXPECT_DOUBLE_EQ(p.calibrated_measured_tpt, 42 / 0.4);
  EXPECT_DOUBLE_EQ(p.calibrated_error(), 105.0 / 110.0 - 1);
  EXPECT_DOUBLE_EQ(p.profile_plain_tpt, (80 + 200) / 2.0);
  EXPECT_DOUBLE_EQ(p.measured_plain_tpt, (48 + 160) / 2.0);
  // Without draft cost ratios there is no drafting calibration.
  EXPECT_EQ(p.draft_calibrated_seconds, 0);
  EXPECT_EQ(p.draft_cost_ratio, 0);
  EXPECT_EQ(p.draft_calibrated_tpt, 0);
  EXPECT_EQ(p.draft_calibrated_error(), 0);
  {
    // a's recent drafting steps had cost 1.5x their predicted time when it
    // took effect: 100 / 1.5 by drafting steps, while plain steps say 60
    // (the calibrated prediction). d drafts like a with a ratio of 0.8 and
    // no plain rate: 125 by drafting steps, out of the calibrated figures.
    // b stays plain: in the calibrated figures only.
    AppliedPlan a_cost = a;
    a_cost.draft_cost_ratio = 1.5;
    AppliedPlan d = a;
    d.measured_plain_tpt = 0;
    d.draft_cost_ratio = 0.8;
    const PlanPrediction r = SummarizePredictions({a_cost, b, d});
    EXPECT_DOUBLE_EQ(r.calibrated_seconds, 0.4);
    EXPECT_DOUBLE_EQ(r.calibrated_tpt, (60 + 160) / 2.0);
    EXPECT_DOUBLE_EQ(r.calibrated_measured_tpt, 42 / 0.4);
    EXPECT_DOUBLE_EQ(r.calibrated_error(), 105.0 / 110.0 - 1);
    EXPECT_DOUBLE_EQ(r.profile_plain_tpt, (80 + 200) / 2.0);
    EXPECT_DOUBLE_EQ(r.measured_plain_tpt, (48 + 160) / 2.0);
    EXPECT_DOUBLE_EQ(r.draft_calibrated_seconds, 0.4);
    EXPECT_DOUBLE_EQ(r.draft_cost_ratio, (1.5 + 0.8) / 2);
    EXPECT_NEAR(r.draft_calibrated_tpt, (100 / 1.5 + 125) / 2, 1e-9);
    EXPECT_DOUBLE_EQ(r.draft_calibrated_measured_tpt, 24 / 0.4);
    EXPECT_NEAR(r.draft_calibrated_error(), 60 / ((100 / 1.5 + 125) / 2) - 1,
                1e-12);
    EXPECT_EQ(PlanPredictionJson(r)["draft_cost_ratio"], r.draft_cost_ratio);
    EXPECT_EQ(PlanPredictionJson(r)["draft_calibrated_error"],
              r.draft_calibrated_error());
  }
  // A plan without a plain rate when it took effect has no calibrated
  // promise and stays out of those figures.
  AppliedPlan c = b;
  c.measured_plain_tpt = 0;
  const PlanPrediction q = SummarizePredictions({a, c});
  EXPECT_DOUBLE_EQ(q.calibrated_seconds, 0.2);
  EXPECT_DOUBLE_EQ(q.calibrated_tpt, 60);

  // The calibrated plans' steps are pooled for the measured rate's
  // standard error: a's 10 steps of 1.2 tokens in 0.02 s, b's 30 plain
  // steps, each at its plan's own rate with a spread.
  a.measured_tokens_sq = 16;  // 8 steps of 1 token, 2 of 2
  a.measured_token_seconds = 12 * 0.02 + 0.01;
  a.measured_seconds_sq = 10 * 0.02 * 0.02 + 0.0002;
  b.measured_tokens_sq = 30;
  b.measured_token_seconds = 0.2;
  b.measured_seconds_sq = 30 * (0.2 / 30) * (0.2 / 30) + 0.0001;
  const PlanPrediction pooled = SummarizePredictions({a, b});
  EXPECT_NEAR(pooled.calibrated_measured_standard_error,
              RateStandardError(40, 42, 0.4, 46, 12 * 0.02 + 0.01 + 0.2,
                                10 * 0.02 * 0.02 + 0.0002 +
                                    30 * (0.2 / 30) * (0.2 / 30) + 0.0001),
              1e-9);
  EXPECT_GT(pooled.calibrated_measured_standard_error, 0);
  EXPECT_EQ(PlanPredictionJson(pooled)["calibrated_measured_standard_error"],
            pooled.calibrated_measured_standard_error);
  // Without the second moments (zeros: a plan from an older server) the
  // steps' spread is unknown: 0, never a negative variance or NaN.
  EXPECT_EQ(p.calibrated_measured_standard_error, 0);

  const PlanPrediction none = SummarizePredictions({unmeasured});
  EXPECT_EQ(none.steps, 0);
  EXPECT_EQ(none.measured_tpt, 0);
  EXPECT_EQ(none.error(), 0);
  EXPECT_EQ(none.calibrated_tpt, 0);
  EXPECT_EQ(none.calibrated_error(), 0);
}

TEST(RatiosToAdjacentBaselineTest, EachRunIsComparedWithTheOffRunsAroundIt) {
  const std::vector<std::string> names = {"off",    "static", "off",
                                          "static", "knn",    "off"};
  const std::vector<double> rates = {100, 102, 100, 82, 80, 80};
  const std::vector<double> r = RatiosToAdjacentBaseline(names, rates, "off");
  ASSERT_EQ(r.size(), 6u);
  EXPECT_DOUBLE_EQ(r[0], 1.0);           // off against the next off
  EXPECT_DOUBLE_EQ(r[1], 1.02);          // between two offs of 100
  EXPECT_DOUBLE_EQ(r[2], 100.0 / 90.0);  // off against 100 and 80
  EXPECT_DOUBLE_EQ(r[3], 82.0 / 90.0);   // between 100 and 80
  EXPECT_DOUBLE_EQ(r[4], 80.0 / 90.0);   // the nearest offs, not all
  EXPECT_DOUBLE_EQ(r[5], 0.8);           // the last off: its neighbour
  // A baseline run alone has no other to compare with; no baseline: all 0.
  EXPECT_EQ(RatiosToAdjacentBaseline({"off", "static"}, {100, 90}, "off"),
            (std::vector<double>{0.0, 0.9}));
  EXPECT_EQ(RatiosToAdjacentBaseline({"static"}, {90}, "off"),
            (std::vector<double>{0.0}));
}

// What several planners did, in order: "a+" planner a got a request, "a-"
// it answered one.
struct EventLog {
  absl::Mutex mu;
  std::vector<std::string> events ABSL_GUARDED_BY(mu);
  void Add(std::string event) {
    absl::MutexLock lock(&mu);
    events.push_back(std::move(event));
  }
};

// A planner that answers each request from a thread of its own after
// `delay`, as a planner that yields the cores may (the solve is the real
// one). With a `log`, it logs its requests and answers under `name`.
class SlowPlanner : public PlannerClient {
 public:
  SlowPlanner(const InProcessPlanner* core, absl::Duration delay,
              EventLog* log = nullptr, std::string name = "")
      : core_(core), delay_(delay), log_(log), name_(std::move(name)) {}
  ~SlowPlanner() override {
    for (std::thread& t : threads_) t.join();
  }
  void Submit(PlanRequest request, PlanCallback done) override {
    if (log_ != nullptr) log_->Add(name_ + "+");
    threads_.emplace_back(
        [this, request = std::move(request), done = std::move(done)]() mutable {
          absl::SleepFor(delay_);
          // Logged first: the answer lets the bench go on.
          if (log_ != nullptr) log_->Add(name_ + "-");
          done(core_->Solve(request));
        });
  }
  void Forget(uint64_t) override {}

 private:
  const InProcessPlanner* core_;
  absl::Duration delay_;
  EventLog* log_;
  std::string name_;
  std::vector<std::thread> threads_;  // the test thread only
};

// A knapspec request of 8 new tokens: one 256-token bucket (every prompt
// here in it), no planner budget, no drift re-plans in 8 tokens, no guard.
GenerationRequest KnapSpecRequest() {
  GenerationRequest request;
  request.max_new_tokens = 8;
  request.ignore_eos = true;
  SpeculationConfig& s = request.speculation;
  s.mode = SpeculationMode::kKnapSpec;
  s.max_draft = 3;
  s.reference_steps = 2;
  s.plan_bucket_tokens = 256;
  s.planner_budget = 0;
  s.drift_min_tokens = 1000;
  s.guard = false;
  return request;
}

// stories260k, its tokenizer and an in-process planner with a hand profile,
// shared by the RunModes tests; Inputs(n) gives n distinct 4-token prompts.
class RunModesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = testing::CachedModel("stories260k");
    tokenizer_ = testing::StoriesTokenizer();
    ASSERT_NE(model_, nullptr);
    ASSERT_NE(tokenizer_, nullptr);
    auto core =
        InProcessPlanner::Create(*model_, testing::HandLatencyProfile(*model_),
                                 InProcessPlannerOptions());
    ASSERT_TRUE(core.ok()) << core.status();
    core_ = std::move(*core);
  }

  static std::vector<BenchInput> Inputs(int n) {
    std::vector<BenchInput> inputs(n);
    for (int i = 0; i < n; ++i) {
      inputs[i].prompt.question_id = i + 1;
      const int32_t first = 400 + 10 * i;
      inputs[i].ids = {1, first, first + 1, first + 2};
    }
    return inputs;
  }

  const LlamaModel* model_ = nullptr;
  const Tokenizer* tokenizer_ = nullptr;
  std::unique_ptr<InProcessPlanner> core_;
};

// A warm run's untimed pass awaits the solves it started: its last solve
// answers after the pass has ended, and no timed run then finds its bucket
// without a plan.
TEST_F(RunModesTest, AWarmRunAwaitsTheSolvesOfItsUntimedPass) {
  SlowPlanner planner(core_.get(), absl::Milliseconds(500));
  auto runs = RunModes(*model_, *tokenizer_, Inputs(1), {KnapSpecRequest()},
                       /*repeats=*/2, /*warmup=*/false, {&planner},
                       /*warm_plan_cache=*/true);
  ASSERT_TRUE(runs.ok()) << runs.status();
  const PromptRun& run = (*runs)[0][0];
  EXPECT_EQ(run.planning.cache_misses, 0);
  EXPECT_EQ(run.planning.cache_hits, 1);
  EXPECT_EQ(run.plan_requests, 0);
}

// A solve that outlives its run (8 tokens decode long before a planner that
// answers 300 ms late) ends before the next mode's run begins, so it never
// slows that run: each planner's answer comes before the other's next
// request.
TEST_F(RunModesTest, ARunsSolveEndsBeforeTheNextModeRuns) {
  EventLog log;
  SlowPlanner a(core_.get(), absl::Milliseconds(300), &log, "a");
  SlowPlanner b(core_.get(), absl::Milliseconds(300), &log, "b");
  auto runs = RunModes(*model_, *tokenizer_, Inputs(2),
                       {KnapSpecRequest(), KnapSpecRequest()},
                       /*repeats=*/2, /*warmup=*/false, {&a, &b});
  ASSERT_TRUE(runs.ok()) << runs.status();
  absl::MutexLock lock(&log.mu);
  // One solve per mode and repeat (the second prompt finds the plan).
  EXPECT_EQ(log.events, (std::vector<std::string>{"a+", "a-", "b+", "b-", "b+",
                                                  "b-", "a+", "a-"}));
}

TEST_F(RunModesTest, EveryColdRepeatPlansFromAnEmptyCache) {
  for (bool warm : {false, true}) {
    SCOPED_TRACE(warm ? "warm" : "cold");
    testing::SynchronousPlanner planner(core_.get());
    auto runs = RunModes(*model_, *tokenizer_, Inputs(2), {KnapSpecRequest()},
                         /*repeats=*/3, /*warmup=*/false, {&planner}, warm);
    ASSERT_TRUE(runs.ok()) << runs.status();
    ASSERT_EQ(runs->size(), 1u);
    ASSERT_EQ((*runs)[0].size(), 2u);
    // Cold: one solve per repeat (the second prompt finds the first's plan
    // of the same bucket). Warm: one in the untimed pass, then cache hits.
    EXPECT_EQ(planner.solves(), warm ? 1 : 3);
    for (const PromptRun& run : (*runs)[0]) {
      EXPECT_EQ(run.decoded_tokens, 7);
    }
  }
}

// The modes share plain decoding's rate as one server's would: off's plain
// steps calibrate the knapspec plan that takes effect after them (its own
// sequence timed no plain step before its plan: the steps that captured the
// snapshot ran beside its solve).
TEST_F(RunModesTest, OffsPlainStepsCalibrateTheOtherModesPlans) {
  GenerationRequest off = KnapSpecRequest();
  off.speculation.mode = SpeculationMode::kOff;
  off.max_new_tokens = 40;
  GenerationRequest knapspec = KnapSpecRequest();
  knapspec.max_new_tokens = 40;
  testing::SynchronousPlanner planner(core_.get());
  auto runs = RunModes(*model_, *tokenizer_, Inputs(1), {off, knapspec},
                       /*repeats=*/1, /*warmup=*/false, {nullptr, &planner});
  ASSERT_TRUE(runs.ok()) << runs.status();
  const std::vector<AppliedPlan>& plans = (*runs)[1][0].plans;
  ASSERT_FALSE(plans.empty());
  EXPECT_GT(plans.front().measured_plain_tpt, 0)
      << "off ran first, in the same repeat";
  EXPECT_GT(plans.front().calibrated_tpt(), 0);
}

PromptRun Repeats(std::vector<double> seconds, int64_t tokens = 100) {
  PromptRun run;
  run.repeat_decode_seconds = seconds;
  run.repeat_decoded_tokens.assign(seconds.size(), tokens);
  return run;
}

// The machine slows to half speed after the first prompt: a mode 1.25x
// faster than off in every pair is 1.25x paired, whatever the drift; runs
// that another process stalled move their ratios, not the median.
TEST(PairedSpeedupTest, EachRunAgainstOffInTheSameRepeat) {
  const std::vector<PromptRun> off = {Repeats({1.0, 1.0, 1.0}),
                                      Repeats({2.0, 2.0, 2.0})};
  std::vector<PromptRun> mode = {Repeats({0.8, 0.8, 0.8}),
                                 Repeats({1.6, 1.6, 1.6})};
  PairedSpeedup p = PairedSpeedupOf(off, mode);
  EXPECT_EQ(p.pairs, 6);
  EXPECT_DOUBLE_EQ(p.median, 1.25);
  EXPECT_DOUBLE_EQ(p.q25, 1.25);
  EXPECT_DOUBLE_EQ(p.q75, 1.25);

  mode[1].repeat_decode_seconds[2] = 16;  // stalled: 0.125x
  mode[0].repeat_decode_seconds[1] = 8;   // 0.125x
  p = PairedSpeedupOf(off, mode);
  EXPECT_DOUBLE_EQ(p.median, 1.25);
  EXPECT_DOUBLE_EQ(p.q25, 0.125 + 0.25 * (1.25 - 0.125));

  // Ratios of rates: a run with fewer tokens in the same time is slower.
  const std::vector<PromptRun> shorter = {Repeats({1.0}, 50)};
  EXPECT_DOUBLE_EQ(PairedSpeedupOf({Repeats({1.0})}, shorter).median, 0.5);
  // No repeats, no pairs.
  EXPECT_EQ(PairedSpeedupOf({PromptRun()}, {PromptRun()}).pairs, 0);
  EXPECT_EQ(PairedSpeedupOf({PromptRun()}, {PromptRun()}).median, 0);
}

// The median's 95% interval: order statistics by the binomial tail, so it
// holds the true median at least 95% of the time whatever the distribution.
TEST(PairedSpeedupTest, TheMediansIntervalHoldsItNineteenTimesInTwenty) {
  auto ranks = [](int n) {
    std::vector<double> values;
    for (int i = n; i >= 1; --i) values.push_back(i);  // unsorted
    return MedianInterval95(values);
  };
  EXPECT_EQ(ranks(5), std::make_pair(0.0, 0.0));  // no 95% interval yet
  EXPECT_EQ(ranks(6), std::make_pair(1.0, 6.0));  // 1 - 2/64
  EXPECT_EQ(ranks(18), std::make_pair(5.0, 14.0));
  EXPECT_EQ(ranks(30), std::make_pair(10.0, 21.0));
  EXPECT_EQ(ranks(100), std::make_pair(40.0, 61.0));

  // Coverage, 18 pairs of a skewed distribution with median 1: the interval
  // misses 1 in about 3% of the samples (2 x P(X <= 4) = 3.1%), a rank
  // nearer the middle would miss it in 10%.
  std::mt19937 rng(7);
  std::lognormal_distribution<double> skewed(0.0, 0.3);
  int missed = 0;
  constexpr int kSamples = 4000;
  for (int s = 0; s < kSamples; ++s) {
    std::vector<double> values(18);
    for (double& v : values) v = skewed(rng);
    const auto [low, high] = MedianInterval95(values);
    if (!(low <= 1.0 && 1.0 <= high)) ++missed;
  }
  EXPECT_LT(missed, kSamples * 5 / 100);
  EXPECT_GT(missed, kSamples * 1 / 100);

  // PairedSpeedupOf reports it: 6 pairs, ratios 1.25 but one 0.125.
  std::vector<PromptRun> off = {Repeats({1.0, 1.0, 1.0}),
                                Repeats({1.0, 1.0, 1.0})};
  std::vector<PromptRun> mode = {Repeats({0.8, 0.8, 0.8}),
                                 Repeats({0.8, 8.0, 0.8})};
  const PairedSpeedup p = PairedSpeedupOf(off, mode);
  EXPECT_DOUBLE_EQ(p.ci95_low, 0.125);
  EXPECT_DOUBLE_EQ(p.ci95_high, 1.25);
}

// Against the mean of two baselines per pair: the off runs before and after
// a mode in the same prompt and repeat.
TEST(PairedSpeedupTest, AgainstTheMeanOfTheBaselinesInEachPair) {
  const std::vector<PromptRun> before = {Repeats({1.0, 2.0})};
  const std::vector<PromptRun> after = {Repeats({3.0, 2.0})};
  const std::vector<PromptRun> mode = {Repeats({2.0, 4.0})};
  // Rates 100/s: off 100 and 33.3 (mean 66.7) against 50 in pair 0; off 50
  // and 50 against 25 in pair 1.
  const PairedSpeedup p = PairedSpeedupOfMean({&before, &after}, mode);
  EXPECT_EQ(p.pairs, 2);
  EXPECT_DOUBLE_EQ(p.median, 0.5 * (50.0 / (200.0 / 3.0) + 0.5));
  // One baseline is PairedSpeedupOf.
  EXPECT_DOUBLE_EQ(PairedSpeedupOfMean({&before}, mode).median,
                   PairedSpeedupOf(before, mode).median);
  // A pair counts only where every baseline has a rate.
  const std::vector<PromptRun> one_repeat = {Repeats({1.0})};
  EXPECT_EQ(PairedSpeedupOfMean({&before, &one_repeat}, mode).pairs, 1);
  EXPECT_EQ(PairedSpeedupOfMean({}, mode).pairs, 0);
}

// off,static,off,knapspec,clasp,off: static between two offs, knapspec after
// one, clasp before one; an entry without off beside it uses the nearest off
// on each side (the off between static and knapspec: the first and the last).
TEST(AdjacentBaselinesTest, TheOffRunsBesideEachMode) {
  const std::vector<bool> list = {true, false, true, false, false, true};
  EXPECT_EQ(AdjacentBaselines(list, 1), (std::vector<size_t>{0, 2}));
  EXPECT_EQ(AdjacentBaselines(list, 3), (std::vector<size_t>{2}));
  EXPECT_EQ(AdjacentBaselines(list, 4), (std::vector<size_t>{5}));
  EXPECT_EQ(AdjacentBaselines(list, 2), (std::vector<size_t>{0, 5}));
  EXPECT_EQ(AdjacentBaselines(list, 0), (std::vector<size_t>{2}));
  EXPECT_EQ(AdjacentBaselines(list, 5), (std::vector<size_t>{2}));
  // off,static,clasp,knapspec,off: clasp has no off beside it.
  const std::vector<bool> apart = {true, false, false, false, true};
  EXPECT_EQ(AdjacentBaselines(apart, 2), (std::vector<size_t>{0, 4}));
  const std::vector<bool> one_off = {true, false, false, false};
  EXPECT_EQ(AdjacentBaselines(one_off, 3), (std::vector<size_t>{0}));
  EXPECT_EQ(AdjacentBaselines(one_off, 0), (std::vector<size_t>{}));
  EXPECT_EQ(AdjacentBaselines({false, false}, 1), (std::vector<size_t>{}));
}

TEST(QuantileTest, InterpolatesBetweenOrderStatistics) {
  EXPECT_EQ(Quantile({}, 0.5), 0);
  EXPECT_DOUBLE_EQ(Quantile({3, 1, 2}, 0.5), 2);
  EXPECT_DOUBLE_EQ(Quantile({1, 2, 3, 4}, 0.5), 2.5);
  EXPECT_DOUBLE_EQ(Quantile({1, 2, 3, 5}, 1), 5);
  EXPECT_DOUBLE_EQ(Quantile({0, 10}, 0.25), 2.5);
}

// A gauge that rises to 7 and falls back, and another that only falls: the
// sampler keeps each one's largest value, the first sample included, and a
// sample taken at Stop() (the 9 written just before it).
TEST(PeakSamplerTest, KeepsEachGaugesLargestValue) {
  std::atomic<int64_t> rising{0};
  std::atomic<int> samples{0};
  PeakSampler sampler(
      [&]() -> PeakSampler::Sample {
        ++samples;
        return {rising.load(), 100 - rising.load()};
      },
      absl::Milliseconds(1));
  for (int64_t v : {3, 7, 2}) {
    rising = v;
    const int seen = samples.load();
    while (samples.load() < seen + 2) absl::SleepFor(absl::Milliseconds(1));
  }
  rising = 9;
  EXPECT_EQ(sampler.Stop(), (PeakSampler::Sample{9, 100}));
}

// A sample of another shape than the first is ignored, not mixed in.
TEST(PeakSamplerTest, IgnoresSamplesOfAnotherLength) {
  std::atomic<int> calls{0};
  PeakSampler sampler(
      [&]() -> PeakSampler::Sample {
        if (calls++ == 0) return {5};
        return {50, 60};
      },
      absl::Milliseconds(1));
  while (calls.load() < 3) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(sampler.Stop(), (PeakSampler::Sample{5}));
}

TEST(ResidentSetBytesTest, GrowsWithTouchedMemory) {
  const int64_t before = ResidentSetBytes();
  ASSERT_GT(before, 0);
  std::vector<char> block(64 << 20, 1);  // 64 MiB, every page written
  EXPECT_GE(ResidentSetBytes(), before + (48 << 20));
  EXPECT_EQ(block[12345], 1);
}

}  // namespace
}  // namespace knapserve
