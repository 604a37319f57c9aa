#include "planner/background_profile.h"

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/base/status.h"
#include "common/model/exception_status.h"
#include "common/model/llama.h"
#include "common/model/parallel_for.h"

namespace knapserve {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

absl::StatusOr<std::unique_ptr<BackgroundProfile>> BackgroundProfile::Start(
    const LlamaModel& model, BackgroundProfileOptions options, DoneFn done) {
  RETURN_IF_ERROR(
      ValidateThreadPriority(options.priority, "background profile"));
  // The kernel pool's workers start on first use and inherit the priority
  // of the thread that starts them: start them here, at this thread's
  // priority, before the measuring thread could.
  ParallelFor(0, std::max(1, options.key.threads), 1, [](int64_t, int64_t) {});
  return std::unique_ptr<BackgroundProfile>(
      new BackgroundProfile(model, std::move(options), std::move(done)));
}

BackgroundProfile::BackgroundProfile(const LlamaModel& model,
                                     BackgroundProfileOptions options,
                                     DoneFn done)
    : model_(model),
      options_(std::move(options)),
      done_(std::move(done)),
      started_(Clock::now()),
      thread_([this] { Run(); }) {}

BackgroundProfile::~BackgroundProfile() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    cv_.SignalAll();
  }
  thread_.join();
}

bool BackgroundProfile::finished() const {
  absl::MutexLock lock(&mu_);
  return finished_;
}

double BackgroundProfile::paused_seconds() const {
  absl::MutexLock lock(&mu_);
  return paused_seconds_;
}

absl::StatusOr<bool> BackgroundProfile::BeforeRun() {
  auto stopping = [this]() -> bool {
    absl::MutexLock lock(&mu_);
    return stopping_;
  };
  if (stopping()) return absl::CancelledError("the server is stopping");
  if (!options_.busy || !options_.busy()) return false;
  // Busy: wait until the process has been idle for `quiet`.
  const Clock::time_point wait_start = Clock::now();
  std::optional<Clock::time_point> idle_since;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (!stopping_)
        cv_.WaitWithTimeout(&mu_, absl::FromChrono(options_.poll));
      if (stopping_) return absl::CancelledError("the server is stopping");
    }
    const Clock::time_point now = Clock::now();
    if (options_.busy()) {
      idle_since.reset();
      continue;
    }
    if (!idle_since.has_value()) idle_since = now;
    if (now - *idle_since >= options_.quiet) break;
  }
  absl::MutexLock lock(&mu_);
  paused_seconds_ += SecondsBetween(wait_start, Clock::now());
  return true;
}

void BackgroundProfile::Run() {
  // The decode's thread count: the profile's key and timings are decoding's.
  at::set_num_threads(std::max(1, options_.key.threads));
  // This thread only (and the OpenMP threads LibTorch ops start from it);
  // the kernel pool's workers were started by Start's caller. A refusal
  // leaves it at normal priority; it still waits while the process serves.
  ApplyToThisThreadOrWarn(options_.priority, "background profile");
  ProfileOptions profile_options = options_.profile;
  profile_options.before_run = [this] { return BeforeRun(); };
  absl::StatusOr<ObtainedProfile> obtained;
  // The exception boundary of the measurement: nothing escapes the thread.
  try {
    c10::InferenceMode inference_mode;
    obtained = MeasureAndStoreProfile(options_.key, options_.cache, [&] {
      return ProfileModel(model_, profile_options);
    });
  } catch (...) {
    obtained = CurrentExceptionAsInternal("background latency profile");
  }
  done_(std::move(obtained), SecondsBetween(started_, Clock::now()),
        paused_seconds());
  absl::MutexLock lock(&mu_);
  finished_ = true;
}

}  // namespace knapserve
