// ThreadPriority: how a thread that works beside decoding (the planner's
// solves, the background latency profile) shares the CPU with the decode
// threads, and the call that applies it to the calling thread.
//
//   nice N (0..19)  setpriority(2) on the thread id. A nice-19 thread still
//                   competes: under the kernel's fair scheduler a decode
//                   thread that wakes (from a barrier, after sampling) may
//                   wait for it to finish its slice. Measured on a 2-core
//                   VM (README.md): one busy nice-19 thread beside a
//                   2-thread decode cost the decode 8-13% of its rate.
//   idle            SCHED_IDLE (sched(7)): the thread runs only on a core
//                   that no normal thread wants, and a normal thread that
//                   wakes preempts it at once. The same busy thread at
//                   SCHED_IDLE cost the decode 0-1%. But it may never run:
//                   a decode that keeps every core busy (the kernel pool's
//                   workers spin between a step's regions) starves it. In
//                   `bench spec` on that VM, planners at idle answered 0-2
//                   of the 5-6 plans nice 19 answered in a short-context
//                   set, so knapspec fell from 1.17x to 0.98x. Unprivileged
//                   threads may enter SCHED_IDLE; leaving it needs
//                   CAP_SYS_NICE, so use it only for threads that keep it
//                   for life.
//
// Threads that a thread starts afterwards (its OpenMP team) inherit both.
// Thread safety: plain value type; ApplyToThisThread from any thread, for
// that thread.
#ifndef KNAPSERVE_COMMON_BASE_THREAD_PRIORITY_H_
#define KNAPSERVE_COMMON_BASE_THREAD_PRIORITY_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace knapserve {

struct ThreadPriority {
  // SCHED_IDLE; `nice` is then not used.
  bool idle = false;
  // Linux nice value, 0..19 (0 = unchanged from a normal thread).
  int nice = 0;

  static ThreadPriority Idle() { return {true, 0}; }
  static ThreadPriority Nice(int nice) { return {false, nice}; }
  bool operator==(const ThreadPriority& other) const {
    return idle == other.idle && (idle || nice == other.nice);
  }
};

// InvalidArgument, naming `what`, for a nice value outside 0..19.
absl::Status ValidateThreadPriority(const ThreadPriority& priority,
                                    absl::string_view what);

// "idle", or "nice N" (for logs).
std::string ThreadPriorityName(const ThreadPriority& priority);

// "idle", "normal" (nice 0), or a nice value "0".."19". InvalidArgument
// otherwise.
absl::StatusOr<ThreadPriority> ParseThreadPriority(absl::string_view text);

// Applies `priority` to the calling thread. Nice 0 changes nothing. Errors
// (the errno of the failed call, e.g. a seccomp filter that forbids
// sched_setscheduler) leave the thread at its previous priority.
absl::Status ApplyToThisThread(const ThreadPriority& priority);

// ApplyToThisThread for a thread that goes on either way: a refusal is
// written to stderr once, naming `thread` and the priority it wanted.
void ApplyToThisThreadOrWarn(const ThreadPriority& priority,
                             absl::string_view thread);

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_BASE_THREAD_PRIORITY_H_
