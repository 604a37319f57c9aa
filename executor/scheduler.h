// Scheduler: admission control and concurrency for generation requests.
//
// At most `max_running` requests run at once, each on a worker thread of its
// own (the OS interleaves their decode steps; torch's intra-op threads are
// shared). At most `max_queue` more wait, first come first served. A request
// beyond that is refused at once with ResourceExhausted; after Drain starts,
// every new request is refused with Unavailable.
//
// StepLock: the running sequences take turns, one prefill or decode step at a
// time (see the class).
//
// Ownership: the Scheduler owns its worker threads; jobs are std::functions
// it runs once. The destructor drains (waits for every admitted job). A job
// must not throw (the service's jobs catch everything); one that does anyway
// is reported on stderr and its worker goes on. Thread safety: all methods of
// both classes from any thread.
#ifndef KNAPSERVE_EXECUTOR_SCHEDULER_H_
#define KNAPSERVE_EXECUTOR_SCHEDULER_H_

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

// StepLock: lets one running sequence at a time execute a decode step, in
// FIFO order, so concurrent requests interleave step by step and each step
// gets all of torch's threads (several OpenMP teams spinning on the same
// cores slowed decoding by tens of times when measured here).
//
// It is held only through a Turn, a scoped guard: the constructor waits for
// the turn, the destructor ends it, also when an exception unwinds the stack,
// so no path can leave it held. Not recursive: a thread holds at most one
// Turn of a lock.
//
//   StepLock::Turn turn(step_lock);  // waits for every earlier turn
//   ... prefill ...
//   turn.Yield();                    // between steps: the others go first
//   ... next step ...
class ABSL_LOCKABLE StepLock {
 public:
  class ABSL_SCOPED_LOCKABLE Turn {
   public:
    explicit Turn(StepLock& lock) ABSL_EXCLUSIVE_LOCK_FUNCTION(lock);
    ~Turn() ABSL_UNLOCK_FUNCTION();
    Turn(const Turn&) = delete;
    Turn& operator=(const Turn&) = delete;

    // Ends this turn and, in the same step, asks for a new one at the back
    // of the line: every sequence that asked for a turn before this call
    // goes first, none that asks after it does. Held on return.
    void Yield();

   private:
    StepLock& lock_;
  };

  // Turns asked for and not yet ended: the one held plus those waiting.
  int64_t turns_wanted() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // Turns are served in ticket order.
  void Acquire() ABSL_LOCKS_EXCLUDED(mu_);
  void Release() ABSL_LOCKS_EXCLUDED(mu_);
  void ReleaseAndAcquire() ABSL_LOCKS_EXCLUDED(mu_);
  // Waits (under mu_) until `ticket` is served.
  void AwaitTurn(uint64_t ticket) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t serving_ ABSL_GUARDED_BY(mu_) = 0;  // the ticket whose turn it is
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

#endif  // KNAPSERVE_EXECUTOR_SCHEDULER_H_
