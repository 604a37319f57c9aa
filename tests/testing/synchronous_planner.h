// A PlannerClient for tests that solves each request at once, on the
// calling thread, with an InProcessPlanner's Solve (the real solve): plans
// then arrive at the very next step boundary, a run's plans are the same
// every time, and the solves can be counted exactly. It records what each
// request asked, and can fail every n-th request (a planner that fails).
// Not thread-safe: one test thread submits.
#ifndef KNAPSERVE_TESTS_TESTING_SYNCHRONOUS_PLANNER_H_
#define KNAPSERVE_TESTS_TESTING_SYNCHRONOUS_PLANNER_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "common/plan/planner_client.h"
#include "planner/inprocess_planner.h"

namespace knapserve::testing {

class SynchronousPlanner : public PlannerClient {
 public:
  // `core` must outlive this planner. fail_every > 0: every fail_every-th
  // request is answered UNAVAILABLE instead of solved.
  explicit SynchronousPlanner(const InProcessPlanner* core, int fail_every = 0)
      : core_(core), fail_every_(fail_every) {}
  void Submit(PlanRequest request, PlanCallback done) override {
    ++submitted_;
    requests_.push_back({request.policy, request.first_position,
                         request.context_length, request.kv_length,
                         static_cast<int64_t>(request.target_argmax.size())});
    if (fail_every_ > 0 && submitted_ % fail_every_ == 0) {
      done(absl::UnavailableError("injected planner failure"));
      return;
    }
    ++solves_;
    done(core_->Solve(request));
  }
  void Forget(uint64_t) override {}

  // What one request asked.
  struct Seen {
    PlanPolicy policy;
    int64_t first_position, context_length, kv_length, r;
  };
  const std::vector<Seen>& requests() const { return requests_; }
  // Requests submitted, and those solved (not failed on purpose).
  int submitted() const { return submitted_; }
  int solves() const { return solves_; }

 private:
  const InProcessPlanner* core_;
  int fail_every_;
  int submitted_ = 0;
  int solves_ = 0;
  std::vector<Seen> requests_;
};

}  // namespace knapserve::testing

#endif  // KNAPSERVE_TESTS_TESTING_SYNCHRONOUS_PLANNER_H_
