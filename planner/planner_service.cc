#include "planner/planner_service.h"

#include <deque>
#include <mutex>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "common/wire/plan_codec.h"

namespace knapserve {

// One Plan stream. It stays alive until Finish, and Finish waits for every
// outstanding solve, so planner callbacks never outlive the stream.
class PlannerService::Stream final
    : public grpc::ServerBidiReactor<v1::PlanRequest, v1::PlanResponse> {
 public:
  explicit Stream(PlannerService* service) : service_(service) { StartRead(&request_); }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the executor half-closed, or the stream broke
      {
        std::lock_guard<std::mutex> lock(mu_);
        reads_done_ = true;
      }
      ForgetAll();
      MaybeFinish();
      return;
    }
    service_->requests_.fetch_add(1);
    Handle(request_);
    StartRead(&request_);
  }

  void OnWriteDone(bool ok) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.pop_front();
      writing_ = false;
      if (!ok) broken_ = true;
      if (ok) service_->answers_.fetch_add(1);
    }
    WriteNext();
    MaybeFinish();
  }

  void OnCancel() override { ForgetAll(); }

  void OnDone() override { delete this; }

 private:
  void Handle(const v1::PlanRequest& wire) {
    absl::StatusOr<PlanRequest> request =
        DecodePlanRequest(wire, service_->num_layers_, service_->default_max_draft_);
    const int64_t step = static_cast<int64_t>(wire.step());
    if (!request.ok()) {
      Enqueue(ResponseFor(wire.sequence_id(), step, request.status()));
      return;
    }
    uint64_t internal = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto [it, inserted] = ids_.try_emplace(wire.sequence_id(), 0);
      if (inserted) it->second = service_->next_internal_id_.fetch_add(1);
      internal = it->second;
      ++outstanding_;
    }
    request->sequence_id = internal;
    const std::string wire_id = wire.sequence_id();
    service_->planner_->Submit(std::move(*request),
                               [this, wire_id, step](absl::StatusOr<DraftPlan> plan) {
                                 // outstanding_ > 0 keeps the stream alive
                                 // until OnSolved, the last use of `this`.
                                 Enqueue(ResponseFor(wire_id, step, plan));
                                 OnSolved();
                               });
  }

  // Runs on a planner thread, outside any reaction: after the decrement the
  // stream may finish (and be deleted) at any moment, so `this` is touched
  // again only by the one thread that decides to finish.
  void OnSolved() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      --outstanding_;
      if (finished_ || !reads_done_ || outstanding_ > 0 || writing_) return;
      if (!queue_.empty() && !broken_) return;
      finished_ = true;
    }
    Finish(grpc::Status::OK);
  }

  static v1::PlanResponse ResponseFor(const std::string& wire_id, int64_t step,
                                      const absl::StatusOr<DraftPlan>& plan) {
    v1::PlanResponse response = EncodePlanResponse(0, step, plan);
    response.set_sequence_id(wire_id);
    return response;
  }

  void Enqueue(v1::PlanResponse response) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_) return;
      queue_.push_back(std::move(response));
    }
    WriteNext();
  }

  // Starts the next write if none is in flight (never under mu_: a reaction
  // may run on this thread).
  void WriteNext() {
    const v1::PlanResponse* next = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (writing_ || queue_.empty() || broken_ || finished_) return;
      writing_ = true;
      next = &queue_.front();
    }
    StartWrite(next);
  }

  void MaybeFinish() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_ || !reads_done_ || outstanding_ > 0 || writing_) return;
      if (!queue_.empty() && !broken_) return;
      finished_ = true;
    }
    Finish(grpc::Status::OK);
  }

  void ForgetAll() {
    std::vector<uint64_t> ids;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [wire, internal] : ids_) ids.push_back(internal);
    }
    for (uint64_t id : ids) service_->planner_->Forget(id);
  }

  PlannerService* service_;
  v1::PlanRequest request_;
  std::mutex mu_;
  std::deque<v1::PlanResponse> queue_;  // front() is being written while writing_
  absl::flat_hash_map<std::string, uint64_t> ids_;  // wire sequence id -> planner id
  int64_t outstanding_ = 0;  // submitted, not yet answered
  bool writing_ = false;
  bool reads_done_ = false;
  bool broken_ = false;
  bool finished_ = false;
};

PlannerService::PlannerService(InProcessPlanner* planner, int num_layers, int default_max_draft)
    : planner_(planner), num_layers_(num_layers), default_max_draft_(default_max_draft) {}

grpc::ServerBidiReactor<v1::PlanRequest, v1::PlanResponse>* PlannerService::Plan(
    grpc::CallbackServerContext* /*context*/) {
  return new Stream(this);
}

}  // namespace knapserve
