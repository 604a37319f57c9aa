// ReadThreadSched / CountThreads: a thread's scheduling policy and nice
// value as the kernel keeps them (/proc/<pid>/task/<tid>/stat), for tests of
// ThreadPriority (common/base/thread_priority.h) and of the threads that
// use it. Linux only; header-only; any thread.
#ifndef KNAPSERVE_TESTS_TESTING_THREAD_SCHED_H_
#define KNAPSERVE_TESTS_TESTING_THREAD_SCHED_H_

#include <dirent.h>

#include <fstream>
#include <functional>
#include <iterator>
#include <sstream>
#include <string>

namespace knapserve::testing {

struct ThreadSched {
  int nice = 0;
  int policy = 0;  // SCHED_OTHER, SCHED_IDLE, ...
};

// Fields 19 (nice) and 41 (policy) of a stat file, e.g.
// "/proc/thread-self/stat"; the command name in parentheses may hold spaces.
inline ThreadSched ReadThreadSched(const std::string& stat_path) {
  std::ifstream in(stat_path);
  std::string stat((std::istreambuf_iterator<char>(in)),
                   std::istreambuf_iterator<char>());
  ThreadSched sched;
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return sched;
  std::istringstream fields(stat.substr(close + 2));
  std::string field;
  for (int k = 3; k <= 41 && (fields >> field); ++k) {  // fields from 3 on
    if (k == 19) sched.nice = std::stoi(field);
    if (k == 41) sched.policy = std::stoi(field);
  }
  return sched;
}

// This process's threads whose scheduling satisfies `match`.
inline int CountThreads(const std::function<bool(const ThreadSched&)>& match) {
  int count = 0;
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return count;
  while (dirent* entry = readdir(dir)) {
    const std::string name = entry->d_name;
    if (name == "." || name == "..") continue;
    count +=
        match(ReadThreadSched("/proc/self/task/" + name + "/stat")) ? 1 : 0;
  }
  closedir(dir);
  return count;
}

}  // namespace knapserve::testing

#endif  // KNAPSERVE_TESTS_TESTING_THREAD_SCHED_H_
