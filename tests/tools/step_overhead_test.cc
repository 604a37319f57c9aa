// Tests of the engine overhead measurement behind the latency profile's
// o_step and o_draft (tools/step_overhead.h) on stories260k: both figures
// are measured on the real engine, the profile's before_run gate is obeyed
// (a run after a wait is repeated), and bad options or a model too short
// for the runs are refused.
#include "tools/step_overhead.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

using ::testing::HasSubstr;

TEST(StepOverheadTest, MeasuresTheEnginesWorkOutsideThePasses) {
  const LlamaModel* model = testing::CachedModel("stories260k");
  const Tokenizer* tokenizer = testing::StoriesTokenizer();
  ASSERT_NE(model, nullptr);
  ASSERT_NE(tokenizer, nullptr);
  StepOverheadOptions options;
  options.new_tokens = 24;
  options.repeats = 1;
  int calls = 0;
  options.before_run = [&]() -> absl::StatusOr<bool> {
    ++calls;
    return calls == 1;  // the first run waited: it is run again
  };
  auto overhead = MeasureStepOverhead(*model, *tokenizer, options);
  ASSERT_TRUE(overhead.ok()) << overhead.status();
  // Two untimed runs and two timed ones, plus the repeat after the wait.
  EXPECT_EQ(calls, 5);
  // Choosing a token and keeping the books take time, but far less than a
  // second per step.
  EXPECT_GT(overhead->step_seconds, 0);
  EXPECT_LT(overhead->step_seconds, 1.0);
  EXPECT_TRUE(std::isfinite(overhead->draft_seconds));
  EXPECT_GE(overhead->draft_seconds, 0);
  EXPECT_LT(overhead->draft_seconds, 1.0);

  // The gate's errors stop the measurement.
  options.before_run = []() -> absl::StatusOr<bool> {
    return absl::CancelledError("shutting down");
  };
  EXPECT_EQ(MeasureStepOverhead(*model, *tokenizer, options).status().code(),
            absl::StatusCode::kCancelled);
}

TEST(StepOverheadTest, RefusesBadOptionsAndModelsTooShort) {
  const LlamaModel* model = testing::CachedModel("stories260k");
  const Tokenizer* tokenizer = testing::StoriesTokenizer();
  ASSERT_NE(model, nullptr);
  ASSERT_NE(tokenizer, nullptr);
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
