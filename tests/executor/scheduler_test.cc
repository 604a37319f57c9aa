// Tests of the Scheduler and the StepLock (executor/scheduler.h): turns are
// FIFO, Yield lets waiting sequences go first, a turn ends when an exception
// unwinds it, admission limits, a job that throws does not take its worker.
#include "executor/scheduler.h"

#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace knapserve {
namespace {

// Records events from several threads in order.
class Log {
 public:
  void Add(std::string event) {
    absl::MutexLock lock(&mu_);
    events_.push_back(std::move(event));
  }
  std::vector<std::string> events() {
    absl::MutexLock lock(&mu_);
    return events_;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> events_ ABSL_GUARDED_BY(mu_);
};

TEST(StepLockTest, YieldLetsTheWaitingSequenceGoFirstAndTurnsAlternate) {
  StepLock lock;
  Log log;
  absl::Notification b_waiting;
  std::thread b;
  {
    StepLock::Turn a(lock);
    log.Add("a0");
    b = std::thread([&] {
      b_waiting.Notify();
      StepLock::Turn turn(lock);
      for (int step = 0; step < 3; ++step) {
        log.Add(absl::StrCat("b", step));
        turn.Yield();
      }
    });
    // b asks for a turn right after notifying; wait until it waits.
    b_waiting.WaitForNotification();
    while (lock.turns_wanted() < 2) absl::SleepFor(absl::Milliseconds(1));
    for (int step = 1; step < 3; ++step) {
      a.Yield();
      log.Add(absl::StrCat("a", step));
    }
  }
  b.join();
  EXPECT_EQ(log.events(),
            (std::vector<std::string>{"a0", "b0", "a1", "b1", "a2", "b2"}));
}

TEST(StepLockTest, AnExceptionEndsTheTurn) {
  StepLock lock;
  try {
    StepLock::Turn turn(lock);
    throw std::runtime_error("a step failed");
  } catch (const std::runtime_error&) {
  }
  // Another thread gets a turn (it would wait forever if the turn were held).
  absl::Notification got_turn;
  std::thread other([&] {
    StepLock::Turn turn(lock);
    got_turn.Notify();
  });
  EXPECT_TRUE(got_turn.WaitForNotificationWithTimeout(absl::Seconds(30)));
  other.join();
}

TEST(SchedulerTest, RefusesBeyondTheLimitAndWhileDraining) {
  Scheduler scheduler(SchedulerOptions{/*max_running=*/1, /*max_queue=*/1});
  absl::Notification release;
  absl::Notification started;
  ASSERT_TRUE(scheduler
                  .Submit([&] {
                    started.Notify();
                    release.WaitForNotification();
                  })
                  .ok());
  started.WaitForNotification();
  EXPECT_TRUE(scheduler.Submit([] {}).ok());  // queued
  EXPECT_EQ(scheduler.Submit([] {}).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(scheduler.running(), 1);
  EXPECT_EQ(scheduler.queued(), 1);
  release.Notify();
  EXPECT_TRUE(scheduler.Drain(std::chrono::seconds(30)));
  EXPECT_TRUE(scheduler.draining());
  EXPECT_EQ(scheduler.Submit([] {}).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(scheduler.running(), 0);
}

TEST(SchedulerTest, AJobThatThrowsDoesNotTakeItsWorker) {
  Scheduler scheduler(SchedulerOptions{/*max_running=*/1, /*max_queue=*/4});
  ASSERT_TRUE(
      scheduler.Submit([] { throw std::runtime_error("a bug in a job"); })
          .ok());
  std::atomic<bool> ran{false};
  ASSERT_TRUE(scheduler.Submit([&] { ran = true; }).ok());
  EXPECT_TRUE(scheduler.Drain(std::chrono::seconds(30)));
  EXPECT_TRUE(ran.load());
  EXPECT_EQ(scheduler.running(), 0);
}

}  // namespace
}  // namespace knapserve
