#include "common/base/thread_priority.h"

#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iostream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace knapserve {

absl::Status ValidateThreadPriority(const ThreadPriority& priority,
                                    absl::string_view what) {
  if (!priority.idle && (priority.nice < 0 || priority.nice > 19)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " nice must be in [0, 19], got ", priority.nice));
  }
  return absl::OkStatus();
}

std::string ThreadPriorityName(const ThreadPriority& priority) {
  return priority.idle ? "idle" : absl::StrCat("nice ", priority.nice);
}

absl::StatusOr<ThreadPriority> ParseThreadPriority(absl::string_view text) {
  if (text == "idle") return ThreadPriority::Idle();
  if (text == "normal") return ThreadPriority::Nice(0);
  int nice = 0;
  if (absl::SimpleAtoi(text, &nice) && nice >= 0 && nice <= 19) {
    return ThreadPriority::Nice(nice);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("thread priority must be idle, normal or a nice value "
                   "0..19, got \"",
                   text, "\""));
}

absl::Status ApplyToThisThread(const ThreadPriority& priority) {
  const pid_t tid = static_cast<pid_t>(syscall(SYS_gettid));
  if (priority.idle) {
    sched_param param{};  // sched_priority 0, as SCHED_IDLE requires
    if (sched_setscheduler(tid, SCHED_IDLE, &param) != 0) {
      const int error = errno;
      return absl::ErrnoToStatus(
          error, absl::StrCat("sched_setscheduler(SCHED_IDLE): ",
                              std::strerror(error)));
    }
    return absl::OkStatus();
  }
  if (priority.nice == 0) return absl::OkStatus();
  if (setpriority(PRIO_PROCESS, static_cast<id_t>(tid), priority.nice) != 0) {
    const int error = errno;
    return absl::ErrnoToStatus(error,
                               absl::StrCat("setpriority(", priority.nice,
                                            "): ", std::strerror(error)));
  }
  return absl::OkStatus();
}

void ApplyToThisThreadOrWarn(const ThreadPriority& priority,
                             absl::string_view thread) {
  const absl::Status status = ApplyToThisThread(priority);
  if (!status.ok()) {
    std::cerr << "knapserve: " << thread
              << " stays at normal priority instead of "
              << ThreadPriorityName(priority) << ": " << status << std::endl;
  }
}

}  // namespace knapserve
