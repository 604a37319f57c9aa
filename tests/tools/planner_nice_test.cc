// Tests of --planner-nice (tools/cli_flags.h's PlannerNiceFromFlags): by
// default a planner beside a CPU model whose decode uses every core runs at
// nice 19, so its solves take only what decoding leaves; with a core left
// over it runs at 0; an explicit value is kept. The
// planner thread's nice is read back from /proc, where the kernel keeps it.
#include <ATen/Parallel.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <sched.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "tests/testing/test_models.h"
#include "tools/cli_flags.h"

namespace knapserve {
namespace {

// The nice values of this process's threads (/proc/self/task/*/stat, field
// 19; the command name in parentheses may hold spaces).
std::vector<int> ThreadNiceValues() {
  std::vector<int> values;
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return values;
  while (dirent* entry = readdir(dir)) {
    const std::string name = entry->d_name;
    if (name == "." || name == "..") continue;
    std::ifstream in("/proc/self/task/" + name + "/stat");
    std::string stat((std::istreambuf_iterator<char>(in)),
                     std::istreambuf_iterator<char>());
    const size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream fields(stat.substr(close + 2));
    std::string field;
    // Fields from 3 (state) on; nice is field 19.
    for (int k = 3; k <= 19 && (fields >> field); ++k) {
      if (k == 19) values.push_back(std::stoi(field));
    }
  }
  closedir(dir);
  return values;
}

int CountNice(int nice) {
  int count = 0;
  for (int value : ThreadNiceValues()) count += value == nice ? 1 : 0;
  return count;
}

TEST(PlannerNiceTest, ThePlannerYieldsTheCoresWhenDecodingUsesThemAll) {
  const LlamaModel* model = testing::CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  absl::FlagSaver saver;
  const int saved_threads = at::get_num_threads();
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  const int cores = CPU_COUNT(&set);
  ASSERT_EQ(absl::GetFlag(FLAGS_planner_nice), -1) << "the default is auto";
  absl::SetFlag(&FLAGS_planner_threads, 1);
  // Decoding on every core: the planner would share them, so it yields.
  at::set_num_threads(cores);
  EXPECT_EQ(PlannerNiceFromFlags(*model), 19);
  // A core left over for the planner: no need to yield.
  if (cores >= 2) {
    at::set_num_threads(cores - 1);
    EXPECT_EQ(PlannerNiceFromFlags(*model), 0);
    absl::SetFlag(&FLAGS_planner_threads, 2);
    EXPECT_EQ(PlannerNiceFromFlags(*model), 19);
    absl::SetFlag(&FLAGS_planner_threads, 1);
  }
  // An explicit value is kept.
  absl::SetFlag(&FLAGS_planner_nice, 0);
  EXPECT_EQ(PlannerNiceFromFlags(*model), 0);
  absl::SetFlag(&FLAGS_planner_nice, 7);
  EXPECT_EQ(PlannerNiceFromFlags(*model), 7);

  // The planner thread really runs at the auto value.
  absl::SetFlag(&FLAGS_planner_nice, -1);
  at::set_num_threads(cores);
  const int before = CountNice(19);
  InProcessPlannerOptions options;
  options.nice = PlannerNiceFromFlags(*model);
  at::set_num_threads(saved_threads);
  auto planner = InProcessPlanner::CreateWithoutProfile(*model, options);
  ASSERT_TRUE(planner.ok()) << planner.status();
  int now = CountNice(19);
  for (int i = 0; i < 500 && now <= before; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    now = CountNice(19);
  }
  EXPECT_EQ(now, before + 1) << "one more thread at nice 19: the planner's";
  planner->reset();
  EXPECT_EQ(CountNice(19), before) << "it ends with the planner";
}

}  // namespace
}  // namespace knapserve
