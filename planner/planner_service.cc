#include "planner/planner_service.h"

#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "common/model/exception_status.h"
#include "common/rpc/queued_writer.h"
#include "common/wire/plan_codec.h"

namespace knapserve {

// One Plan stream. It finishes only once the executor half-closed (or the
// stream broke) and every solve it submitted has answered, so planner
// callbacks never outlive it; the writer then sends OK after the last answer.
class PlannerService::Stream final
    : public grpc::ServerBidiReactor<v1::PlanRequest, v1::PlanResponse> {
 public:
  explicit Stream(PlannerService* service) : service_(service) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override ABSL_LOCKS_EXCLUDED(mu_) {
    if (!ok) {  // the executor half-closed, or the stream broke
      {
        absl::MutexLock lock(&mu_);
        reads_done_ = true;
      }
      ForgetAll();
      MaybeFinish();
      return;
    }
    service_->requests_.fetch_add(1);
    if (service_->metrics_ != nullptr) {
      service_->metrics_->requests.Add();
      service_->metrics_->received_bytes.Add(
          static_cast<double>(request_.ByteSizeLong()));
    }
    Handle(request_);
    StartRead(&request_);
  }

  void OnWriteDone(bool ok) override {
    if (ok) service_->answers_.fetch_add(1);
    writer_.OnWriteDone(ok);
  }

  void OnCancel() override {
    writer_.Cancel();
    ForgetAll();
  }

  void OnDone() override { delete this; }

 private:
  void Handle(const v1::PlanRequest& wire) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::StatusOr<PlanRequest> request = Decode(wire);
    const int64_t step = static_cast<int64_t>(wire.step());
    if (!request.ok()) {
      service_->RecordAnswer(request.status());
      writer_.Enqueue(ResponseFor(wire.sequence_id(), step, request.status()));
      return;
    }
    uint64_t internal = 0;
    {
      absl::MutexLock lock(&mu_);
      auto [it, inserted] = ids_.try_emplace(wire.sequence_id(), 0);
      if (inserted) it->second = service_->next_internal_id_.fetch_add(1);
      internal = it->second;
      ++outstanding_;
    }
    request->sequence_id = internal;
    const std::string wire_id = wire.sequence_id();
    service_->planner_->Submit(
        std::move(*request),
        [this, wire_id, step](absl::StatusOr<DraftPlan> plan) {
          // outstanding_ > 0 keeps the stream alive
          // until OnSolved, the last use of `this`.
          service_->RecordAnswer(plan);
          writer_.Enqueue(ResponseFor(wire_id, step, plan));
          OnSolved();
        });
  }

  // The wire request decoded; an exception (a LibTorch check on a tensor)
  // is an Internal error for this request only.
  absl::StatusOr<PlanRequest> Decode(const v1::PlanRequest& wire) {
    try {
      return DecodePlanRequest(wire, service_->num_layers_,
                               service_->default_max_draft_);
    } catch (...) {
      service_->internal_errors_.fetch_add(1);
      return CurrentExceptionAsInternal("planner: decoding the request");
    }
  }

  // Runs on a planner thread, outside any reaction: after the decrement the
  // stream may finish (and be deleted) at any moment, so `this` is touched
  // again only by the one thread that decides to finish.
  void OnSolved() ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      --outstanding_;
      if (!ShouldFinishLocked()) return;
      finish_requested_ = true;
    }
    writer_.Finish(grpc::Status::OK);
  }

  void MaybeFinish() ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      if (!ShouldFinishLocked()) return;
      finish_requested_ = true;
    }
    writer_.Finish(grpc::Status::OK);
  }

  // Reads are over and no solve is outstanding: nothing more can be answered.
  bool ShouldFinishLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !finish_requested_ && reads_done_ && outstanding_ == 0;
  }

  static v1::PlanResponse ResponseFor(const std::string& wire_id, int64_t step,
                                      const absl::StatusOr<DraftPlan>& plan) {
    v1::PlanResponse response = EncodePlanResponse(0, step, plan);
    response.set_sequence_id(wire_id);
    return response;
  }

  // Drops the queued requests of this stream's sequences; their callbacks
  // (Cancelled) may run on this thread. Called from reactions only, which
  // gRPC never overlaps with OnDone, so `this` stays valid throughout.
  void ForgetAll() ABSL_LOCKS_EXCLUDED(mu_) {
    std::vector<uint64_t> ids;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [wire, internal] : ids_) ids.push_back(internal);
    }
    for (uint64_t id : ids) service_->planner_->Forget(id);
  }

  PlannerService* const service_;
  v1::PlanRequest request_;  // the read in flight (reads are sequential)
  QueuedWriter<v1::PlanResponse> writer_{this};
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, uint64_t> ids_
      ABSL_GUARDED_BY(mu_);                       // wire id -> planner id
  int64_t outstanding_ ABSL_GUARDED_BY(mu_) = 0;  // submitted, not yet answered
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_requested_ ABSL_GUARDED_BY(mu_) = false;
};

namespace {
// Solve and queue times of a plan: 100 us to 10 s.
std::vector<double> PlanSecondsBuckets() {
  return {1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1, 3, 10};
}
}  // namespace

PlannerService::Metrics::Metrics(MetricsRegistry& r)
    : registry(r),
      requests(r.AddCounter("knapserve_planner_server_requests_total",
                            "Plan requests received, over all streams.")),
      received_bytes(
          r.AddCounter("knapserve_planner_server_received_bytes_total",
                       "Bytes of the plan requests received.")),
      plans(r.AddCounter("knapserve_planner_server_plans_total",
                         "Plan requests answered with a plan.")),
      superseded(r.AddCounter(
          "knapserve_planner_server_superseded_total",
          "Queued plan requests replaced by a newer one of their sequence.")),
      solve_seconds(r.AddHistogram("knapserve_planner_server_solve_seconds",
                                   "Wall time of each solve.",
                                   PlanSecondsBuckets())),
      queue_seconds(
          r.AddHistogram("knapserve_planner_server_queue_seconds",
                         "Time each solved request waited for the solver.",
                         PlanSecondsBuckets())) {}

PlannerService::PlannerService(InProcessPlanner* planner, int num_layers,
                               int default_max_draft, MetricsRegistry* metrics)
    : planner_(planner),
      num_layers_(num_layers),
      default_max_draft_(default_max_draft) {
  if (metrics != nullptr) {
    metrics_ = std::make_unique<Metrics>(*metrics);
    // The failure family is there (at 0) before the first failure.
    metrics->AddCounter("knapserve_planner_server_failed_total",
                        "Plan requests answered with an error, by code.",
                        {{"code", "INTERNAL"}});
    metrics->AddGauge("knapserve_planner_server_queue_depth",
                      "Plan requests waiting for the solver now.", [planner] {
                        return static_cast<double>(planner->queued());
                      });
  }
}

void PlannerService::RecordAnswer(const absl::StatusOr<DraftPlan>& plan) {
  if (metrics_ == nullptr) return;
  if (plan.ok()) {
    metrics_->plans.Add();
    metrics_->solve_seconds.Observe(plan->solve_seconds);
    metrics_->queue_seconds.Observe(plan->queue_seconds);
  } else if (plan.status().code() == absl::StatusCode::kCancelled) {
    metrics_->superseded.Add();
  } else if (IsProfilePending(plan.status())) {
    metrics_->registry
        .AddCounter("knapserve_planner_server_profile_pending_total",
                    "Plan requests answered \"profile pending\": the latency "
                    "profile was still being measured.")
        .Add();
  } else {
    metrics_->registry
        .AddCounter("knapserve_planner_server_failed_total",
                    "Plan requests answered with an error, by code.",
                    {{"code", absl::StatusCodeToString(plan.status().code())}})
        .Add();
  }
}

grpc::ServerBidiReactor<v1::PlanRequest, v1::PlanResponse>*
PlannerService::Plan(grpc::CallbackServerContext* /*context*/) {
  return new Stream(this);
}

}  // namespace knapserve
