// Tests of --planner-priority (tools/cli_flags.h's PlannerPriorityFromFlags):
// by default a planner beside a CPU model whose decode uses every core runs
// at nice 19, so its solves take mostly what decoding leaves; with a core
// left over it runs normally; an explicit value (idle too) is kept and a bad
// one refused. The planner thread's nice value and policy are read back
// from /proc, where the kernel keeps them. Also --knapspec-max-skip, the
// other planner option that PlannerOptionsFromFlags reads.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <sched.h>

#include <chrono>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "common/base/thread_priority.h"
#include "tests/testing/test_models.h"
#include "tests/testing/thread_sched.h"
#include "tools/cli_flags.h"

namespace knapserve {
namespace {

int CountNice19() {
  return testing::CountThreads([](const testing::ThreadSched& s) {
    return s.policy == SCHED_OTHER && s.nice == 19;
  });
}

int CountIdle() {
  return testing::CountThreads(
      [](const testing::ThreadSched& s) { return s.policy == SCHED_IDLE; });
}

// Starts a planner at `priority` and waits until one more thread than
// before satisfies `count`; returns how many more there were.
int PlannerThreadsAt(const LlamaModel& model, ThreadPriority priority,
                     int (*count)()) {
  const int before = count();
  InProcessPlannerOptions options;
  options.priority = priority;
  auto planner = InProcessPlanner::CreateWithoutProfile(model, options);
  EXPECT_TRUE(planner.ok()) << planner.status();
  if (!planner.ok()) return 0;
  int now = count();
  for (int i = 0; i < 500 && now <= before; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    now = count();
  }
  const int more = now - before;
  planner->reset();
  EXPECT_EQ(count(), before) << "it ends with the planner";
  return more;
}

ThreadPriority PriorityOrDie(const LlamaModel& model) {
  absl::StatusOr<ThreadPriority> priority = PlannerPriorityFromFlags(model);
  EXPECT_TRUE(priority.ok()) << priority.status();
  return priority.value_or(ThreadPriority::Nice(-1));
}

TEST(PlannerPriorityTest, ThePlannerYieldsTheCoresWhenDecodingUsesThemAll) {
  const LlamaModel* model = testing::CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  absl::FlagSaver saver;
  const int saved_threads = at::get_num_threads();
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  const int cores = CPU_COUNT(&set);
  ASSERT_EQ(absl::GetFlag(FLAGS_planner_priority), "auto")
      << "the default is auto";
  absl::SetFlag(&FLAGS_planner_threads, 1);
  // Decoding on every core: the planner would share them, so it yields.
  at::set_num_threads(cores);
  EXPECT_EQ(PriorityOrDie(*model), ThreadPriority::Nice(19));
  // A core left over for the planner: no need to yield.
  if (cores >= 2) {
    at::set_num_threads(cores - 1);
    EXPECT_EQ(PriorityOrDie(*model), ThreadPriority::Nice(0));
    absl::SetFlag(&FLAGS_planner_threads, 2);
    EXPECT_EQ(PriorityOrDie(*model), ThreadPriority::Nice(19));
    absl::SetFlag(&FLAGS_planner_threads, 1);
  }
  // --planner-cores: none by default; auto follows the same rule (the
  // planner's threads' cores while it solves where it would share them,
  // else none); a number is kept.
  at::set_num_threads(cores);
  EXPECT_EQ(PlannerCoresFromFlags(*model).value_or(-1), 0);
  absl::SetFlag(&FLAGS_planner_cores, "auto");
  EXPECT_EQ(PlannerCoresFromFlags(*model).value_or(-1), 1);
  if (cores >= 2) {
    at::set_num_threads(cores - 1);
    EXPECT_EQ(PlannerCoresFromFlags(*model).value_or(-1), 0);
  }
  absl::SetFlag(&FLAGS_planner_cores, "0");
  at::set_num_threads(cores);
  EXPECT_EQ(PlannerCoresFromFlags(*model).value_or(-1), 0);
  absl::SetFlag(&FLAGS_planner_cores, "2");
  EXPECT_EQ(PlannerCoresFromFlags(*model).value_or(-1), 2);
  absl::SetFlag(&FLAGS_planner_cores, "some");
  const absl::StatusOr<int> bad_cores = PlannerCoresFromFlags(*model);
  EXPECT_EQ(bad_cores.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_cores.status().message().find("--planner-cores"),
            std::string::npos)
      << bad_cores.status();
  absl::SetFlag(&FLAGS_planner_cores, "0");
  // An explicit value is kept; a bad one is refused, naming the flag.
  absl::SetFlag(&FLAGS_planner_priority, "normal");
  EXPECT_EQ(PriorityOrDie(*model), ThreadPriority::Nice(0));
  absl::SetFlag(&FLAGS_planner_priority, "7");
  EXPECT_EQ(PriorityOrDie(*model), ThreadPriority::Nice(7));
  absl::SetFlag(&FLAGS_planner_priority, "idle");
  EXPECT_EQ(PriorityOrDie(*model), ThreadPriority::Idle());
  absl::SetFlag(&FLAGS_planner_priority, "lowest");
  const absl::StatusOr<ThreadPriority> bad = PlannerPriorityFromFlags(*model);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("--planner-priority"),
            std::string::npos)
      << bad.status();

  // The planner thread really runs at the auto value, and at idle when
  // asked.
  absl::SetFlag(&FLAGS_planner_priority, "auto");
  at::set_num_threads(cores);
  const ThreadPriority auto_priority = PriorityOrDie(*model);
  at::set_num_threads(saved_threads);
  EXPECT_EQ(PlannerThreadsAt(*model, auto_priority, &CountNice19), 1)
      << "one more thread at nice 19: the planner's";
  EXPECT_EQ(PlannerThreadsAt(*model, ThreadPriority::Idle(), &CountIdle), 1)
      << "one more thread at SCHED_IDLE: the planner's";
}

// --knapspec-max-skip: the reference's 0.5 by default, a value in (0, 1]
// kept, others refused naming the flag (and a planner refuses them too).
TEST(PlannerOptionsTest, TheKnapSpecSkipShareComesFromItsFlag) {
  const LlamaModel* model = testing::CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  absl::StatusOr<InProcessPlannerOptions> options =
      PlannerOptionsFromFlags(*model);
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->knapspec.max_skipped_share, 0.5);
  absl::SetFlag(&FLAGS_knapspec_max_skip, 0.67);
  options = PlannerOptionsFromFlags(*model);
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->knapspec.max_skipped_share, 0.67);
  for (double bad : {0.0, 1.2}) {
    absl::SetFlag(&FLAGS_knapspec_max_skip, bad);
    options = PlannerOptionsFromFlags(*model);
    EXPECT_EQ(options.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(options.status().message().find("--knapspec-max-skip"),
              std::string::npos)
        << options.status();
  }
  absl::SetFlag(&FLAGS_knapspec_max_skip, 0.5);
  // --knapspec-pool-alpha: on by default.
  options = PlannerOptionsFromFlags(*model);
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_TRUE(options->knapspec.pool_alpha);
  absl::SetFlag(&FLAGS_knapspec_pool_alpha, false);
  options = PlannerOptionsFromFlags(*model);
  absl::SetFlag(&FLAGS_knapspec_pool_alpha, true);
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_FALSE(options->knapspec.pool_alpha);
  InProcessPlannerOptions direct;
  direct.knapspec.max_skipped_share = 0;
  EXPECT_EQ(
      InProcessPlanner::CreateWithoutProfile(*model, direct).status().code(),
      absl::StatusCode::kInvalidArgument);
}

// `knapserve anchors` chooses each domain's mask with the same DP, so it takes
// the same two flags (KnapSpecOptionsFromFlags), not the defaults.
TEST(PlannerOptionsTest, TheAnchorsDpTakesTheKnapSpecFlags) {
  absl::SetFlag(&FLAGS_knapspec_max_skip, 0.6);
  absl::SetFlag(&FLAGS_knapspec_pool_alpha, false);
  absl::StatusOr<KnapSpecOptions> options = KnapSpecOptionsFromFlags();
  absl::SetFlag(&FLAGS_knapspec_pool_alpha, true);
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->max_skipped_share, 0.6);
  EXPECT_FALSE(options->pool_alpha);
  absl::SetFlag(&FLAGS_knapspec_max_skip, 1.5);
  options = KnapSpecOptionsFromFlags();
  absl::SetFlag(&FLAGS_knapspec_max_skip, 0.5);
  EXPECT_EQ(options.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(options.status().message().find("--knapspec-max-skip"),
            std::string::npos)
      << options.status();
}

}  // namespace
}  // namespace knapserve
