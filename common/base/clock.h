// Wall-clock helpers shared by the timing code (generation stats, planner
// solves, service timings, benchmarks). Header-only; thread-safe.
#ifndef KNAPSERVE_COMMON_BASE_CLOCK_H_
#define KNAPSERVE_COMMON_BASE_CLOCK_H_

#include <chrono>

namespace knapserve {

// Seconds elapsed since `start` on the steady clock.
inline double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_BASE_CLOCK_H_
