#include "executor/api/scheduler.h"

#include <algorithm>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/model/exception_status.h"

namespace knapserve {

Scheduler::Scheduler(SchedulerOptions options) : options_(options) {
  const int workers = std::max(1, options_.max_running);
  for (int i = 0; i < workers; ++i) workers_.emplace_back([this] { Work(); });
}

Scheduler::~Scheduler() {
  Drain(std::chrono::hours(24));
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : workers_) t.join();
}

absl::Status Scheduler::Submit(std::function<void()> job) {
  absl::MutexLock lock(&mu_);
  if (draining_) return absl::UnavailableError("the server is draining");
  const int limit =
      std::max(1, options_.max_running) + std::max(0, options_.max_queue);
  if (running_ + static_cast<int>(queue_.size()) >= limit) {
    return absl::ResourceExhaustedError(
        absl::StrCat("queue full: ", running_, " running and ", queue_.size(),
                     " waiting (limit ", limit, ")"));
  }
  queue_.push_back(std::move(job));
  return absl::OkStatus();
}

bool Scheduler::HasJobOrStopping() const {
  return stopping_ || !queue_.empty();
}

bool Scheduler::Idle() const { return running_ == 0 && queue_.empty(); }

bool Scheduler::Drain(std::chrono::milliseconds timeout) {
  absl::MutexLock lock(&mu_);
  draining_ = true;
  return mu_.AwaitWithTimeout(absl::Condition(this, &Scheduler::Idle),
                              absl::FromChrono(timeout));
}

int Scheduler::running() const {
  absl::MutexLock lock(&mu_);
  return running_;
}

int Scheduler::queued() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(queue_.size());
}

bool Scheduler::draining() const {
  absl::MutexLock lock(&mu_);
  return draining_;
}

void Scheduler::Work() {
  while (true) {
    std::function<void()> job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &Scheduler::HasJobOrStopping));
      if (queue_.empty()) return;  // stopping
      job = std::move(queue_.front());
      queue_.pop_front();
      ++running_;
    }
    try {
      job();
    } catch (...) {
      // A bug in the job; the worker (and every other request) goes on.
      std::cerr << "knapserve scheduler: "
                << CurrentExceptionAsInternal("a job threw") << std::endl;
    }
    absl::MutexLock lock(&mu_);
    --running_;
  }
}

}  // namespace knapserve
