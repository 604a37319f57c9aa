// Scheduler: admission control and concurrency for generation requests.
//
// At most `max_running` requests run at once, each on a worker thread of its
// own (the OS interleaves their decode steps; torch's intra-op threads are
// shared). At most `max_queue` more wait, first come first served. A request
// beyond that is refused at once with ResourceExhausted; after Drain starts,
// every new request is refused with Unavailable.
//
// Ownership: owns its worker threads; jobs are std::functions it runs once.
// The destructor drains (waits for every admitted job). Thread safety: all
// methods from any thread.
#ifndef KNAPSERVE_EXECUTOR_SCHEDULER_H_
#define KNAPSERVE_EXECUTOR_SCHEDULER_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"

namespace knapserve {

struct SchedulerOptions {
  int max_running = 4;  // >= 1
  int max_queue = 16;   // >= 0
};

// StepLock: lets one running sequence at a time execute a decode step, in
// FIFO order, so concurrent requests interleave step by step and each step
// gets all of torch's threads (several OpenMP teams spinning on the same
// cores slowed decoding by tens of times when measured here). Not recursive.
class StepLock {
 public:
  // Blocks until every earlier Acquire has been released.
  void Acquire();
  void Release();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t next_ticket_ = 0;
  uint64_t serving_ = 0;
};

class Scheduler {
 public:
  explicit Scheduler(SchedulerOptions options);
  ~Scheduler();

  // Admits `job` (runs it on a worker when one is free) or refuses it:
  // ResourceExhausted when running + queued is at the limit, Unavailable
  // while draining.
  absl::Status Submit(std::function<void()> job);

  // Refuses new jobs from now on and waits until every admitted job has
  // finished or `timeout` passes. Returns true when all finished.
  bool Drain(std::chrono::milliseconds timeout);

  int running() const;
  int queued() const;
  bool draining() const;

 private:
  void Work();

  const SchedulerOptions options_;
  mutable std::mutex mu_;
  std::condition_variable cv_;       // workers wait for jobs
  std::condition_variable idle_cv_;  // Drain waits for running_ == 0 && queue empty
  std::deque<std::function<void()>> queue_;
  int running_ = 0;
  bool draining_ = false;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_SCHEDULER_H_
