// Tests of the engine overhead measurement behind the latency profile's
// o_step and o_draft (tools/step_overhead.h) on stories260k: both figures
// are measured on the real engine against the profile's pass prices (what
// the profile already prices is not counted again), as lines in the context
// length; the profile's before_run gate is obeyed (asked before each run and
// between its steps; a wait cuts the run and it is repeated), and bad
// options, a profile without prices or a model too short for the runs are
// refused.
#include "tools/step_overhead.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

using ::testing::HasSubstr;

// Short runs (24 new tokens, one repeat) whose gate counts its calls in
// `calls` and never waits.
StepOverheadOptions CountingOptions(int& calls) {
  StepOverheadOptions options;
  options.contexts = {16};
  options.new_tokens = 24;
  options.repeats = 1;
  options.before_run = [&calls]() -> absl::StatusOr<bool> {
    ++calls;
    return false;
  };
  return options;
}

// A profile that prices a one-token pass at `one` and a pass over more
// tokens at `more` (contexts 16 and 64, up to 5 tokens; drafts cost `one`
// less their skipped MLPs' share).
LatencyProfile Priced(double one, double more) {
  LatencyProfile p;
  p.model_fingerprint = "test";
  p.device = "cpu";
  p.dtype = "fp32";
  p.threads = 1;
  p.attention = {0, 0, 1};
  p.mlp_seconds = 1e-6;
  p.max_draft = 4;
  p.verify_contexts = {16, 64};
  p.verify_seconds.assign(2, {one, more, more, more, more});
  return p;
}

// stories260k and its tokenizer, loaded once per test.
class StepOverheadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model = testing::CachedModel("stories260k");
    tokenizer = testing::StoriesTokenizer();
    ASSERT_NE(model, nullptr);
    ASSERT_NE(tokenizer, nullptr);
  }
  const LlamaModel* model = nullptr;
  const Tokenizer* tokenizer = nullptr;
  const LatencyProfile free_passes = Priced(0, 0);
};

TEST_F(StepOverheadTest, MeasuresTheEngineBeyondThePassPrices) {
  int calls = 0;
  StepOverheadOptions options = CountingOptions(calls);
  auto overhead = MeasureStepOverhead(*model, *tokenizer, free_passes, options);
  ASSERT_TRUE(overhead.ok()) << overhead.status();
  // Choosing a token and keeping the books take time, but far less than a
  // second per step.
  EXPECT_GT(overhead->step_seconds, 0);
  EXPECT_LT(overhead->step_seconds, 1.0);
  // Passes priced at nothing: a drafting step, which measures dearer than a
  // plain one, is all o_step and o_draft.
  EXPECT_GT(overhead->draft_seconds, 0);
  EXPECT_LT(overhead->draft_seconds, 1.0);
  // One context: flat lines.
  EXPECT_EQ(overhead->step_slope, 0);
  EXPECT_EQ(overhead->draft_slope, 0);
  // Asked before the prefill, before each of the four runs (two untimed, two
  // timed) and between their steps: a plain run of 24 tokens takes 24 steps.
  EXPECT_GE(calls, 1 + 4 + 2 * 24);

  // The gate's errors stop the measurement, before a run or between steps.
  for (int failing : {1, 2, 4}) {
    int n = 0;
    options.before_run = [&]() -> absl::StatusOr<bool> {
      if (++n == failing) return absl::CancelledError("shutting down");
      return false;
    };
    EXPECT_EQ(MeasureStepOverhead(*model, *tokenizer, free_passes, options)
                  .status()
                  .code(),
              absl::StatusCode::kCancelled);
    EXPECT_EQ(n, failing);  // nothing more was run
  }
}

// A wait between two steps cuts the run short: what the run measured so far
// holds the wait, so it is dropped; the next run only warms the caches again
// and the one after it is timed. A request arriving at a serving process
// thus waits for one decode step of this measurement, not a whole run.
TEST_F(StepOverheadTest, AWaitBetweenStepsCutsTheRunAndRunsItAgainWarm) {
  int calls = 0;
  StepOverheadOptions options = CountingOptions(calls);
  ASSERT_TRUE(
      MeasureStepOverhead(*model, *tokenizer, free_passes, options).ok());
  const int undisturbed = calls;
  // One plain run: asked before it and after each of its 24 steps.
  const int plain_run = 1 + 24;

  // The first call is before the prefill, which is not timed: a wait there
  // changes nothing.
  int wait_at = 1;
  calls = 0;
  options.before_run = [&]() -> absl::StatusOr<bool> {
    return ++calls == wait_at;
  };
  ASSERT_TRUE(
      MeasureStepOverhead(*model, *tokenizer, free_passes, options).ok());
  EXPECT_EQ(calls, undisturbed);

  // The first run (plain, untimed) waits at its fifth call (the sixth in
  // all), between its fourth and fifth steps: those 5 calls are spent, then
  // a warming run and the run itself are made again.
  wait_at = 6;
  calls = 0;
  ASSERT_TRUE(
      MeasureStepOverhead(*model, *tokenizer, free_passes, options).ok());
  EXPECT_EQ(calls, undisturbed + (wait_at - 1) + plain_run);

  // A wait before the first run: that run only warms the caches, and the
  // run is made once more.
  wait_at = 2;
  calls = 0;
  ASSERT_TRUE(
      MeasureStepOverhead(*model, *tokenizer, free_passes, options).ok());
  EXPECT_EQ(calls, undisturbed + plain_run);
}

// The runs start from one prefill and stop within the budget: when the
// untimed pair of runs shows that `repeats` pairs would take longer, fewer
// are run (min_repeats) and, when even those would, shorter ones. The gate
// counts them: asked before the prefill, before each run and after each of
// its steps (a plain run of N tokens takes N steps, a drafting one at most
// N).
TEST_F(StepOverheadTest, StaysWithinItsBudget) {
  int calls = 0;
  StepOverheadOptions options = CountingOptions(calls);
  options.new_tokens = 64;
  options.repeats = 7;
  options.min_repeats = 2;
  options.budget_seconds = 1e-9;
  auto overhead = MeasureStepOverhead(*model, *tokenizer, free_passes, options);
  ASSERT_TRUE(overhead.ok()) << overhead.status();
  EXPECT_GT(overhead->step_seconds, 0);
  const int64_t shortest = StepOverheadOptions::kMinRun;
  // The prefill, the untimed pair at 64 tokens, then 2 drafting runs and 3
  // plain ones of 16 tokens.
  EXPECT_GE(calls, 1 + (1 + 64) + 2 + 3 * (1 + shortest) + 2 * 2);
  EXPECT_LE(calls, 1 + 2 * (1 + 64) + 5 * (1 + shortest));
  // Without the budget: 7 drafting and 8 plain runs of 64 tokens.
  calls = 0;
  options.budget_seconds = 0;
  ASSERT_TRUE(
      MeasureStepOverhead(*model, *tokenizer, free_passes, options).ok());
  EXPECT_GE(calls, 1 + 9 * (1 + 64));
}

// What the profile prices is not counted again: verification priced far
// above what a drafting step measures leaves no draft overhead (o_step does
// not depend on the prices), and a second context makes lines that never go
// below 0.
TEST_F(StepOverheadTest, SubtractsThePricesAndFitsLinesInTheContext) {
  int calls = 0;
  StepOverheadOptions options = CountingOptions(calls);
  auto overhead =
      MeasureStepOverhead(*model, *tokenizer, Priced(1e-3, 1.0), options);
  ASSERT_TRUE(overhead.ok()) << overhead.status();
  EXPECT_GT(overhead->step_seconds, 0);
  EXPECT_EQ(overhead->draft_seconds, 0);

  options.contexts = {16, 200};
  overhead = MeasureStepOverhead(*model, *tokenizer, free_passes, options);
  ASSERT_TRUE(overhead.ok()) << overhead.status();
  for (double v : {overhead->step_seconds, overhead->step_slope,
                   overhead->draft_seconds, overhead->draft_slope}) {
    EXPECT_TRUE(std::isfinite(v));
    EXPECT_GE(v, 0);
  }
  EXPECT_GT(overhead->step_seconds + 200 * overhead->step_slope, 0);
  EXPECT_LT(overhead->step_seconds + 200 * overhead->step_slope, 1.0);
}

TEST_F(StepOverheadTest, RefusesBadOptionsAndModelsTooShort) {
  for (auto bad : {+[](StepOverheadOptions& o) { o.contexts = {0}; },
                   +[](StepOverheadOptions& o) {
                     o.contexts = {16, 32, 64};
                   },
                   +[](StepOverheadOptions& o) { o.new_tokens = 7; },
                   +[](StepOverheadOptions& o) { o.repeats = 0; },
                   +[](StepOverheadOptions& o) { o.max_draft = 0; },
                   +[](StepOverheadOptions& o) { o.min_repeats = 0; },
                   +[](StepOverheadOptions& o) { o.budget_seconds = -1; }}) {
    StepOverheadOptions options;
    bad(options);
    const absl::Status status =
        MeasureStepOverhead(*model, *tokenizer, free_passes, options).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  }
  StepOverheadOptions options;
  options.contexts = {model->max_context()};
  absl::Status status =
      MeasureStepOverhead(*model, *tokenizer, free_passes, options).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("positions"));
  // Nothing to price the passes with.
  status = MeasureStepOverhead(*model, *tokenizer, LatencyProfile(),
                               StepOverheadOptions())
               .status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("verify table"));
}

}  // namespace
}  // namespace knapserve
