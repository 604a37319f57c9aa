// Tests of serving before the latency profile exists: ProfileModel's
// before_run hook (a wait restarts the point), BackgroundProfile
// (planner/background_profile.h) measuring only while the process is idle
// and stopping when destroyed, and an InProcessPlanner that starts without a
// profile (it answers "profile pending" until SetProfile).
#include "planner/background_profile.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <future>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "common/model/llama.h"
#include "planner/inprocess_planner.h"
#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

const LlamaModel* Stories() {
  return testing::HaveStories260k() ? testing::CachedModel("stories260k")
                                    : nullptr;
}

// A small profile of stories260k: 2 contexts, 3 draft lengths.
ProfileOptions SmallOptions() {
  ProfileOptions options;
  options.contexts = {16, 64};
  options.repeats = 2;
  options.warmup = 1;
  options.max_draft = 2;
  return options;
}

// Polls `condition` every 10 ms until it holds or `seconds` pass.
bool WaitFor(const std::function<bool()>& condition, double seconds = 120) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!condition()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

// before_run's calls in a profile without waits. Per context and sweep (two,
// latency_profile.h): the sublayer point's warmup + repeats runs, one call
// each, and the verify point's as many runs, one call before each of their
// max_draft + 1 passes (one per token count).
int CallsOf(const ProfileOptions& o) {
  return 2 * static_cast<int>(o.contexts.size()) * (o.warmup + o.repeats) *
         (1 + o.max_draft + 1);
}

TEST(ProfileModelBeforeRunTest, AWaitRestartsThePointAndAnErrorStops) {
  const LlamaModel* model = Stories();
  if (model == nullptr) GTEST_SKIP() << "no stories260k";
  ProfileOptions options = SmallOptions();
  int calls = 0;
  options.before_run = [&]() -> absl::StatusOr<bool> {
    ++calls;
    return calls == 2;  // a wait inside the first point
  };
  auto profile = ProfileModel(*model, options);
  ASSERT_TRUE(profile.ok()) << profile.status();
  EXPECT_TRUE(profile->Validate().ok());
  // The first point's first run was done before the wait, so it ran again:
  // two calls more than without the wait.
  EXPECT_EQ(calls, CallsOf(options) + 2);

  // A wait between two passes of a verify run cuts the run short and starts
  // its point over: the first context's sublayer point makes warmup +
  // repeats calls, then the verify point's first run asks before its first
  // pass, again before its second and, waiting, before its third (max_draft
  // 2: three passes); those three calls are spent and the run starts over.
  const int sublayer_calls = options.warmup + options.repeats;
  calls = 0;
  options.before_run = [&]() -> absl::StatusOr<bool> {
    return ++calls == sublayer_calls + 3;
  };
  auto cut = ProfileModel(*model, options);
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_TRUE(cut->Validate().ok());
  EXPECT_EQ(calls, CallsOf(options) + 3);

  calls = 0;
  options.before_run = [&]() -> absl::StatusOr<bool> {
    if (++calls == 5) return absl::CancelledError("stop");
    return false;
  };
  auto stopped = ProfileModel(*model, options);
  EXPECT_TRUE(absl::IsCancelled(stopped.status())) << stopped.status();
  EXPECT_EQ(calls, 5);
}

// What a BackgroundProfile reported.
struct Outcome {
  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  absl::StatusOr<ObtainedProfile> obtained ABSL_GUARDED_BY(mu);
  double seconds ABSL_GUARDED_BY(mu) = 0;
  double paused ABSL_GUARDED_BY(mu) = 0;

  BackgroundProfile::DoneFn Fn() {
    return [this](absl::StatusOr<ObtainedProfile> result, double s, double p) {
      absl::MutexLock lock(&mu);
      obtained = std::move(result);
      seconds = s;
      paused = p;
      done = true;
    };
  }
  bool Done() {
    absl::MutexLock lock(&mu);
    return done;
  }
};

BackgroundProfileOptions BackgroundOptions(const LlamaModel& model,
                                           const std::string& cache_dir) {
  BackgroundProfileOptions options;
  options.key = ProfileKey::Of(model);
  options.cache.cache_dir = cache_dir;
  options.cache.max_draft = 2;
  options.profile = SmallOptions();
  options.quiet = std::chrono::milliseconds(50);
  options.poll = std::chrono::milliseconds(5);
  return options;
}

TEST(BackgroundProfileTest, MeasuresOnlyOnceIdleAndStoresTheProfile) {
  const LlamaModel* model = Stories();
  if (model == nullptr) GTEST_SKIP() << "no stories260k";
  const std::string dir = testing::MakeTempDir("background_profile");
  BackgroundProfileOptions options = BackgroundOptions(*model, dir);
  const std::string entry = (fs::path(dir) / options.key.FileName()).string();
  std::atomic<bool> busy{true};
  std::atomic<int> asked{0};
  options.busy = [&] {
    ++asked;
    return busy.load();
  };
  Outcome outcome;
  auto background = BackgroundProfile::Start(*model, options, outcome.Fn());
  ASSERT_TRUE(background.ok()) << background.status();
  // While the process is busy nothing is measured: it keeps asking.
  ASSERT_TRUE(WaitFor([&] { return asked.load() >= 10; }));
  EXPECT_FALSE((*background)->finished());
  EXPECT_FALSE(outcome.Done());
  EXPECT_FALSE(fs::exists(entry));

  busy = false;
  ASSERT_TRUE(WaitFor([&] { return outcome.Done(); }));
  EXPECT_TRUE((*background)->finished());
  absl::MutexLock lock(&outcome.mu);
  ASSERT_TRUE(outcome.obtained.ok()) << outcome.obtained.status();
  EXPECT_EQ(outcome.obtained->origin, ProfileOrigin::kMeasured);
  EXPECT_EQ(outcome.obtained->path, entry);
  EXPECT_TRUE(fs::exists(entry));
  EXPECT_EQ(outcome.obtained->profile.threads, options.key.threads);
  EXPECT_TRUE(outcome.obtained->profile.Validate().ok());
  EXPECT_GT(outcome.paused, 0);
  EXPECT_GE(outcome.seconds, outcome.paused);
  // What it stored is a cache hit from now on.
  auto found = FindProfile(options.key, options.cache);
  ASSERT_TRUE(found.ok()) << found.status();
  ASSERT_TRUE(found->has_value());
  EXPECT_EQ((*found)->origin, ProfileOrigin::kCacheHit);
}

TEST(BackgroundProfileTest, DestroyingItStopsTheMeasurement) {
  const LlamaModel* model = Stories();
  if (model == nullptr) GTEST_SKIP() << "no stories260k";
  const std::string dir = testing::MakeTempDir("background_profile_stop");
  BackgroundProfileOptions options = BackgroundOptions(*model, dir);
  std::atomic<int> asked{0};
  options.busy = [&] {
    ++asked;
    return true;  // never idle
  };
  Outcome outcome;
  auto background = BackgroundProfile::Start(*model, options, outcome.Fn());
  ASSERT_TRUE(background.ok()) << background.status();
  ASSERT_TRUE(WaitFor([&] { return asked.load() >= 3; }));
  background->reset();  // joins the thread
  ASSERT_TRUE(outcome.Done());
  absl::MutexLock lock(&outcome.mu);
  EXPECT_TRUE(absl::IsCancelled(outcome.obtained.status()))
      << outcome.obtained.status();
  EXPECT_FALSE(fs::exists(fs::path(dir) / options.key.FileName()));
}

TEST(BackgroundProfileTest, RefusesABadNiceValue) {
  const LlamaModel* model = Stories();
  if (model == nullptr) GTEST_SKIP() << "no stories260k";
  BackgroundProfileOptions options = BackgroundOptions(*model, "");
  options.priority = ThreadPriority::Nice(20);
  Outcome outcome;
  auto background = BackgroundProfile::Start(*model, options, outcome.Fn());
  EXPECT_EQ(background.status().code(), absl::StatusCode::kInvalidArgument);
}

absl::StatusOr<DraftPlan> SubmitAndWait(PlannerClient& planner,
                                        PlanRequest request) {
  auto promise = std::make_shared<std::promise<absl::StatusOr<DraftPlan>>>();
  auto future = promise->get_future();
  planner.Submit(std::move(request), [promise](absl::StatusOr<DraftPlan> plan) {
    promise->set_value(std::move(plan));
  });
  if (future.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    return absl::DeadlineExceededError("no answer within 60 s");
  }
  return future.get();
}

TEST(InProcessPlannerWithoutProfileTest, AnswersPendingUntilTheProfileLands) {
  const LlamaModel* model = Stories();
  if (model == nullptr) GTEST_SKIP() << "no stories260k";
  auto planner = InProcessPlanner::CreateWithoutProfile(*model, {});
  ASSERT_TRUE(planner.ok()) << planner.status();
  EXPECT_TRUE((*planner)->ProfilePending());
  EXPECT_EQ((*planner)->profile(), nullptr);
  auto pending =
      SubmitAndWait(**planner, testing::ForwardPlanRequest(*model, 1, 40, 8));
  EXPECT_TRUE(IsProfilePending(pending.status())) << pending.status();
  EXPECT_THAT(std::string(pending.status().message()),
              HasSubstr("profile pending"));
  EXPECT_FALSE(IsProfilePending(absl::UnavailableError("profile pending")));

  // Another model's profile is refused and changes nothing.
  const LlamaModel* other = testing::CachedModel("tiny-llama");
  ASSERT_NE(other, nullptr);
  EXPECT_EQ((*planner)->SetProfile(testing::HandLatencyProfile(*other)).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE((*planner)->ProfilePending());

  ASSERT_TRUE((*planner)->SetProfile(testing::HandLatencyProfile(*model)).ok());
  EXPECT_FALSE((*planner)->ProfilePending());
  ASSERT_NE((*planner)->profile(), nullptr);
  auto plan =
      SubmitAndWait(**planner, testing::ForwardPlanRequest(*model, 1, 40, 8));
  ASSERT_TRUE(plan.ok()) << plan.status();
  // The same plan as a planner created with that profile.
  auto direct =
      InProcessPlanner::Create(*model, testing::HandLatencyProfile(*model), {});
  ASSERT_TRUE(direct.ok()) << direct.status();
  auto expected =
      (*direct)->Solve(testing::ForwardPlanRequest(*model, 1, 40, 8));
  ASSERT_TRUE(expected.ok()) << expected.status();
  EXPECT_EQ(plan->mask, expected->mask);
  EXPECT_EQ(plan->gamma, expected->gamma);
  // It lands once.
  EXPECT_EQ((*planner)->SetProfile(testing::HandLatencyProfile(*model)).code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace knapserve
