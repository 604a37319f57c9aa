// BackgroundProfile: measures a latency profile (planner/latency_profile.h)
// on a thread of its own while the process already serves, so that a server
// on a model without a cached profile opens its port and decodes at once
// instead of measuring first (minutes for a 135M-parameter model on a slow
// CPU). `knapserve serve`, `knapserve-executor --planner inproc` and
// `knapserve-planner` start one on a profile cache miss
// (tools/executor_from_flags.h); until it is done their planner answers
// ProfilePendingError and planned requests decode plainly.
//
// How it stays out of decoding's way:
//   * it measures only while the process is idle: before every run of the
//     profile (one decode step or one multi-token pass) it asks `busy` (are
//     requests running or queued, did a decode step run since the last
//     call) and, while the answer is yes, waits until the process has been
//     idle for `quiet`; a point whose runs were interrupted starts over with
//     its warm-up, so waiting never distorts a timing;
//   * its thread runs at `priority` (nice 19 by default:
//     common/base/thread_priority.h), so the one run in flight when a
//     request arrives yields the CPU to the decode threads. Not idle
//     (SCHED_IDLE), unlike the planner's solves: it measures only while the
//     process is idle anyway, and at SCHED_IDLE any normal thread of the
//     machine that wakes (a gRPC poller) would interrupt a timed run.
// It measures with the decode's thread count (the profile's key and
// timings are decoding's): a profile measured with fewer threads would be
// stored under the wrong key or price every pass wrongly. Start therefore
// starts the kernel pool's workers (common/model/parallel_for.h) from the
// calling thread first, so they never inherit the measuring thread's
// priority.
//
// Ownership: borrows the model (must outlive it); owns its thread. The
// destructor stops the measurement at its next run (`done` then gets
// Cancelled) and joins the thread.
// Exceptions: a LibTorch exception while measuring becomes an Internal
// status for `done`; nothing escapes the thread.
// Thread safety: `busy` and `done` run on the measuring thread; finished()
// and paused_seconds() from any thread; Start and the destructor from one
// thread.
#ifndef KNAPSERVE_PLANNER_BACKGROUND_PROFILE_H_
#define KNAPSERVE_PLANNER_BACKGROUND_PROFILE_H_

#include <chrono>
#include <functional>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/base/thread_priority.h"
#include "planner/latency_profile.h"
#include "planner/profile_cache.h"

namespace knapserve {

class LlamaModel;

struct BackgroundProfileOptions {
  // What it is measured for and stored as: ProfileKey::Of(model) taken on
  // the thread that decodes (its thread count is the decode's, and the
  // measuring thread uses as many).
  ProfileKey key;
  // Where it is stored (cache_dir: "" = not stored; profile_path unused).
  ObtainProfileOptions cache;
  // What is measured (QuickProfileOptions); before_run is replaced by the
  // idle wait.
  ProfileOptions profile;
  // Scheduling of the measuring thread.
  ThreadPriority priority = ThreadPriority::Nice(19);
  // Whether the process is serving now; nullptr = never busy. Called on the
  // measuring thread before every run and while it waits.
  std::function<bool()> busy;
  // How long the process must have been idle before a run after a wait, and
  // how often `busy` is asked while waiting.
  std::chrono::milliseconds quiet{250};
  std::chrono::milliseconds poll{20};
};

class BackgroundProfile {
 public:
  // Runs once on the measuring thread when it ends: the measured profile
  // (origin kMeasured, stored when the cache could be written), or the
  // error (Cancelled when the destructor stopped it); `seconds` from Start
  // to the end, of which `paused_seconds` waiting for the process to be
  // idle.
  using DoneFn = std::function<void(absl::StatusOr<ObtainedProfile> obtained,
                                    double seconds, double paused_seconds)>;

  // Starts measuring. InvalidArgument for a nice value outside 0..19.
  static absl::StatusOr<std::unique_ptr<BackgroundProfile>> Start(
      const LlamaModel& model, BackgroundProfileOptions options, DoneFn done);
  ~BackgroundProfile();
  BackgroundProfile(const BackgroundProfile&) = delete;
  BackgroundProfile& operator=(const BackgroundProfile&) = delete;

  // Whether `done` has run.
  bool finished() const ABSL_LOCKS_EXCLUDED(mu_);
  // Seconds the measurement has waited for the process to be idle.
  double paused_seconds() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  BackgroundProfile(const LlamaModel& model, BackgroundProfileOptions options,
                    DoneFn done);
  // The measuring thread.
  void Run() ABSL_LOCKS_EXCLUDED(mu_);
  // ProfileOptions::before_run: waits while busy; true when it waited,
  // Cancelled when stopping.
  absl::StatusOr<bool> BeforeRun() ABSL_LOCKS_EXCLUDED(mu_);

  const LlamaModel& model_;
  const BackgroundProfileOptions options_;
  const DoneFn done_;
  const std::chrono::steady_clock::time_point started_;

  mutable absl::Mutex mu_;
  absl::CondVar cv_;  // signalled when stopping_ is set
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  double paused_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;  // last: started after everything above exists
};

}  // namespace knapserve

#endif  // KNAPSERVE_PLANNER_BACKGROUND_PROFILE_H_
