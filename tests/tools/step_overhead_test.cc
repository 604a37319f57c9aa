// Tests of the engine overhead measurement behind the latency profile's
// o_step and o_draft (tools/step_overhead.h) on stories260k: both figures
// are measured on the real engine, the profile's before_run gate is obeyed
// (asked before each run and between its steps; a wait cuts the run and it
// is repeated), and bad options or a model too short for the runs are
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
  options.new_tokens = 24;
  options.repeats = 1;
  options.before_run = [&calls]() -> absl::StatusOr<bool> {
    ++calls;
    return false;
  };
  return options;
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
};

TEST_F(StepOverheadTest, MeasuresTheEnginesWorkOutsideThePasses) {
  int calls = 0;
  StepOverheadOptions options = CountingOptions(calls);
  auto overhead = MeasureStepOverhead(*model, *tokenizer, options);
  ASSERT_TRUE(overhead.ok()) << overhead.status();
  // Choosing a token and keeping the books take time, but far less than a
  // second per step.
  EXPECT_GT(overhead->step_seconds, 0);
  EXPECT_LT(overhead->step_seconds, 1.0);
  EXPECT_TRUE(std::isfinite(overhead->draft_seconds));
  EXPECT_GE(overhead->draft_seconds, 0);
  EXPECT_LT(overhead->draft_seconds, 1.0);
  // Asked before each of the four runs (two untimed, two timed) and between
  // their steps: a plain run of 24 tokens takes 24 steps.
  EXPECT_GE(calls, 4 + 2 * 24);

  // The gate's errors stop the measurement, before a run or between steps.
  for (int failing : {1, 3}) {
    int n = 0;
    options.before_run = [&]() -> absl::StatusOr<bool> {
      if (++n == failing) return absl::CancelledError("shutting down");
      return false;
    };
    EXPECT_EQ(MeasureStepOverhead(*model, *tokenizer, options).status().code(),
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
  ASSERT_TRUE(MeasureStepOverhead(*model, *tokenizer, options).ok());
  const int undisturbed = calls;
  // One plain run: asked before it and after each of its 24 steps.
  const int plain_run = 1 + 24;

  // The first run (plain, untimed) waits at its fifth call, between its
  // fourth and fifth steps: those 5 calls are spent, then a warming run and
  // the run itself are made again.
  int wait_at = 5;
  calls = 0;
  options.before_run = [&]() -> absl::StatusOr<bool> {
    return ++calls == wait_at;
  };
  ASSERT_TRUE(MeasureStepOverhead(*model, *tokenizer, options).ok());
  EXPECT_EQ(calls, undisturbed + wait_at + plain_run);

  // A wait before the first run: that run only warms the caches, and the
  // run is made once more.
  wait_at = 1;
  calls = 0;
  ASSERT_TRUE(MeasureStepOverhead(*model, *tokenizer, options).ok());
  EXPECT_EQ(calls, undisturbed + plain_run);
}

TEST_F(StepOverheadTest, RefusesBadOptionsAndModelsTooShort) {
  for (auto bad : {+[](StepOverheadOptions& o) { o.prompt_tokens = 0; },
                   +[](StepOverheadOptions& o) { o.new_tokens = 7; },
                   +[](StepOverheadOptions& o) { o.repeats = 0; },
                   +[](StepOverheadOptions& o) { o.max_draft = 0; }}) {
    StepOverheadOptions options;
    bad(options);
    const absl::Status status =
        MeasureStepOverhead(*model, *tokenizer, options).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  }
  StepOverheadOptions options;
  options.prompt_tokens = static_cast<int>(model->max_context());
  const absl::Status status =
      MeasureStepOverhead(*model, *tokenizer, options).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("positions"));
}

}  // namespace
}  // namespace knapserve
