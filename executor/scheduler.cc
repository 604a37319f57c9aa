#include "executor/scheduler.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace knapserve {

void StepLock::Acquire() {
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t ticket = next_ticket_++;
  cv_.wait(lock, [&] { return serving_ == ticket; });
}

void StepLock::Release() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++serving_;
  }
  cv_.notify_all();
}

Scheduler::Scheduler(SchedulerOptions options) : options_(options) {
  const int workers = std::max(1, options_.max_running);
  for (int i = 0; i < workers; ++i) workers_.emplace_back([this] { Work(); });
}

Scheduler::~Scheduler() {
  Drain(std::chrono::hours(24));
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

absl::Status Scheduler::Submit(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (draining_) return absl::UnavailableError("the server is draining");
    const int limit = std::max(1, options_.max_running) + std::max(0, options_.max_queue);
    if (running_ + static_cast<int>(queue_.size()) >= limit) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "queue full: ", running_, " running and ", queue_.size(), " waiting (limit ", limit,
          ")"));
    }
    queue_.push_back(std::move(job));
  }
  cv_.notify_one();
  return absl::OkStatus();
}

bool Scheduler::Drain(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  draining_ = true;
  return idle_cv_.wait_for(lock, timeout, [this] { return running_ == 0 && queue_.empty(); });
}

int Scheduler::running() const {
  std::lock_guard<std::mutex> lock(mu_);
  return running_;
}

int Scheduler::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(queue_.size());
}

bool Scheduler::draining() const {
  std::lock_guard<std::mutex> lock(mu_);
  return draining_;
}

void Scheduler::Work() {
  while (true) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping
      job = std::move(queue_.front());
      queue_.pop_front();
      ++running_;
    }
    job();
    {
      std::lock_guard<std::mutex> lock(mu_);
      --running_;
      if (running_ == 0 && queue_.empty()) idle_cv_.notify_all();
    }
  }
}

}  // namespace knapserve
