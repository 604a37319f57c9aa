// A PlannerClient for tests that solves each request at once, on the
// calling thread, with an InProcessPlanner's Solve: a run's plans are then
// the same every time, and the solves can be counted exactly. Not
// thread-safe: one test thread submits.
#ifndef KNAPSERVE_TESTS_TESTING_SYNCHRONOUS_PLANNER_H_
#define KNAPSERVE_TESTS_TESTING_SYNCHRONOUS_PLANNER_H_

#include <cstdint>

#include "common/plan/planner_client.h"
#include "planner/inprocess_planner.h"

namespace knapserve::testing {

class SynchronousPlanner : public PlannerClient {
 public:
  // `core` must outlive this planner.
  explicit SynchronousPlanner(const InProcessPlanner* core) : core_(core) {}
  void Submit(PlanRequest request, PlanCallback done) override {
    ++solves_;
    done(core_->Solve(request));
  }
  void Forget(uint64_t) override {}
  // Requests solved so far.
  int solves() const { return solves_; }

 private:
  const InProcessPlanner* core_;
  int solves_ = 0;
};

}  // namespace knapserve::testing

#endif  // KNAPSERVE_TESTS_TESTING_SYNCHRONOUS_PLANNER_H_
