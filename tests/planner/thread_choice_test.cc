#include "planner/thread_choice.h"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "common/model/llama.h"
#include "common/model/parallel_for.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

// Restores one torch thread and no pass limits after each test.
class ThreadChoiceTest : public ::testing::Test {
 protected:
  void TearDown() override {
    at::set_num_threads(1);
    SetPassThreads(0, 0);
  }
};

TEST_F(ThreadChoiceTest, MeasuresOnceThenReadsTheCacheEntry) {
  const LlamaModel* model = testing::CachedModel("tiny-llama");
  ASSERT_NE(model, nullptr);
  const std::string dir = testing::MakeTempDir("thread_choice");
  absl::StatusOr<ThreadChoice> first = ChooseThreads(*model, dir, 2);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->origin, "measured");
  ASSERT_FALSE(first->path.empty());
  EXPECT_TRUE(std::filesystem::exists(first->path));
  ASSERT_EQ(first->decode_ms.size(), 2u);
  ASSERT_EQ(first->prefill_ms.size(), 2u);
  for (double ms : first->decode_ms) EXPECT_GT(ms, 0);
  EXPECT_GE(first->decode_threads, 1);
  EXPECT_LE(first->decode_threads, 2);
  // The fewest threads within 3% of the fastest.
  const double best = std::min(first->decode_ms[0], first->decode_ms[1]);
  EXPECT_LE(first->decode_ms[first->decode_threads - 1], best * 1.03);
  if (first->decode_threads == 2) {
    EXPECT_GT(first->decode_ms[0], first->decode_ms[1] * 1.03);
  }

  absl::StatusOr<ThreadChoice> second = ChooseThreads(*model, dir, 2);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->origin, "cache");
  EXPECT_EQ(second->path, first->path);
  EXPECT_EQ(second->decode_threads, first->decode_threads);
  EXPECT_EQ(second->prefill_threads, first->prefill_threads);
  EXPECT_EQ(second->decode_ms, first->decode_ms);
  EXPECT_NE(second->Describe().find("from " + first->path), std::string::npos);

  // Another core count is another entry.
  absl::StatusOr<ThreadChoice> one = ChooseThreads(*model, dir, 1);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->origin, "measured");
  EXPECT_NE(one->path, first->path);
  EXPECT_EQ(one->decode_threads, 1);
}

TEST_F(ThreadChoiceTest, ACorruptEntryIsMeasuredAgainWithAWarning) {
  const LlamaModel* model = testing::CachedModel("tiny-llama");
  ASSERT_NE(model, nullptr);
  const std::string dir = testing::MakeTempDir("thread_choice");
  absl::StatusOr<ThreadChoice> first = ChooseThreads(*model, dir, 1);
  ASSERT_TRUE(first.ok()) << first.status();
  for (const char* text : {"{not json", "{\"decode_threads\": 7}"}) {
    std::ofstream(first->path) << text;
    absl::StatusOr<ThreadChoice> again = ChooseThreads(*model, dir, 1);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->origin, "measured");
    ASSERT_EQ(again->warnings.size(), 1u);
    EXPECT_NE(again->warnings[0].find("unusable"), std::string::npos);
  }
}

TEST_F(ThreadChoiceTest, NoCacheFolderStillChoosesAndRefusesZeroThreads) {
  const LlamaModel* model = testing::CachedModel("tiny-llama");
  ASSERT_NE(model, nullptr);
  absl::StatusOr<ThreadChoice> choice = ChooseThreads(*model, "", 1);
  ASSERT_TRUE(choice.ok()) << choice.status();
  EXPECT_TRUE(choice->path.empty());
  EXPECT_EQ(choice->warnings.size(), 1u);
  EXPECT_EQ(ChooseThreads(*model, "", 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ThreadChoiceTest, ApplySetsTorchThreadsAndEachPhasesPassThreads) {
  ThreadChoice choice;
  choice.decode_threads = 1;
  choice.prefill_threads = 2;
  ApplyThreadChoice(choice);
  EXPECT_EQ(at::get_num_threads(), 2);
  EXPECT_EQ(PassThreads(1), 1);
  EXPECT_EQ(PassThreads(kDecodePassRows), 1);
  EXPECT_EQ(PassThreads(kDecodePassRows + 1), 2);
}

}  // namespace
}  // namespace knapserve
