// Scheduler: admission control and concurrency for generation requests.
//
// At most `max_running` requests run at once, each on a worker thread of its
// own. In the Generation service a worker only hands its sequence to the
// batch engine (executor/engine/batch_engine.h), which decodes every running
// sequence in shared forward passes, and waits for it. At most `max_queue`
// more wait, first come first served. A request beyond that is refused at
// once with ResourceExhausted; after Drain starts, every new request is
// refused with Unavailable.
//
// Ownership: the Scheduler owns its worker threads; jobs are std::functions
// it runs once. The destructor drains (waits for every admitted job). A job
// must not throw (the service's jobs catch everything); one that does anyway
// is reported on stderr and its worker goes on. Thread safety: all methods
// from any thread.
#ifndef KNAPSERVE_EXECUTOR_API_SCHEDULER_H_
#define KNAPSERVE_EXECUTOR_API_SCHEDULER_H_

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace knapserve {

struct SchedulerOptions {
  int max_running = 4;  // >= 1
  int max_queue = 16;   // >= 0
};

class Scheduler {
 public:
  explicit Scheduler(SchedulerOptions options);
  ~Scheduler();

  // Admits `job` (runs it on a worker when one is free) or refuses it:
  // ResourceExhausted when running + queued is at the limit, Unavailable
  // while draining.
  absl::Status Submit(std::function<void()> job) ABSL_LOCKS_EXCLUDED(mu_);

  // Refuses new jobs from now on and waits until every admitted job has
  // finished or `timeout` passes. Returns true when all finished.
  bool Drain(std::chrono::milliseconds timeout) ABSL_LOCKS_EXCLUDED(mu_);

  int running() const ABSL_LOCKS_EXCLUDED(mu_);
  int queued() const ABSL_LOCKS_EXCLUDED(mu_);
  bool draining() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Work() ABSL_LOCKS_EXCLUDED(mu_);
  // Conditions (evaluated under mu_).
  bool HasJobOrStopping() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const SchedulerOptions options_;
  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread>
      workers_;  // set in the constructor, joined in the destructor
};

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_API_SCHEDULER_H_
