#include "executor/api/remote_planner_client.h"

#include <algorithm>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/model/exception_status.h"
#include "common/plan/plan_trace.h"

namespace knapserve {

RemotePlannerClient::RemotePlannerClient(RemotePlannerOptions options)
    : options_(std::move(options)), thread_([this] { Run(); }) {}

RemotePlannerClient::~RemotePlannerClient() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    if (context_ != nullptr) context_->TryCancel();
    cv_.SignalAll();
  }
  thread_.join();
  std::map<uint64_t, Queued> queued;
  {
    absl::MutexLock lock(&mu_);
    queued.swap(queued_);
    order_.clear();
  }
  for (auto& [id, q] : queued)
    q.done(absl::UnavailableError("the planner client is closing"));
  FailInFlight(absl::UnavailableError("the planner client is closing"));
}

void RemotePlannerClient::Submit(PlanRequest request, PlanCallback done) {
  PlanCallback replaced;
  {
    absl::MutexLock lock(&mu_);
    const uint64_t id = request.sequence_id;
    auto it = queued_.find(id);
    if (it != queued_.end()) {
      replaced = std::move(it->second.done);
      it->second = Queued{std::move(request), std::move(done)};
    } else {
      queued_.emplace(id, Queued{std::move(request), std::move(done)});
      order_.push_back(id);
    }
    cv_.SignalAll();
  }
  if (replaced)
    replaced(
        absl::CancelledError("replaced by a newer request of the sequence"));
}

void RemotePlannerClient::Forget(uint64_t sequence_id) {
  PlanCallback dropped;
  {
    absl::MutexLock lock(&mu_);
    auto it = queued_.find(sequence_id);
    if (it == queued_.end()) return;
    dropped = std::move(it->second.done);
    queued_.erase(it);
    std::erase(order_, sequence_id);
  }
  dropped(absl::CancelledError("the sequence finished"));
}

bool RemotePlannerClient::ProfilePending() const {
  absl::MutexLock lock(&mu_);
  return std::chrono::steady_clock::now() < profile_pending_until_;
}

int64_t RemotePlannerClient::profile_pending_answers() const {
  absl::MutexLock lock(&mu_);
  return profile_pending_answers_;
}

void RemotePlannerClient::FailInFlight(const absl::Status& status) {
  std::map<Key, Pending> failed;
  {
    absl::MutexLock lock(&mu_);
    failed.swap(in_flight_);
  }
  for (auto& [key, pending] : failed) {
    pending.send_span.SetError(status.ToString());
    pending.send_span.End();
    pending.done(status);
  }
}

void RemotePlannerClient::Read(
    grpc::ClientReaderWriter<v1::PlanRequest, v1::PlanResponse>* stream) {
  v1::PlanResponse response;
  while (stream->Read(&response)) {
    uint64_t id = 0;
    if (!absl::SimpleAtoi(response.sequence_id(), &id)) continue;  // not ours
    const Key key{id, static_cast<int64_t>(response.step())};
    Pending pending;
    {
      absl::MutexLock lock(&mu_);
      auto it = in_flight_.find(key);
      if (it == in_flight_.end()) continue;
      pending = std::move(it->second);
      in_flight_.erase(it);
    }
    absl::StatusOr<DraftPlan> plan =
        DecodePlanResponse(response, options_.num_layers, pending.max_draft);
    if (plan.ok() || IsProfilePending(plan.status())) {
      absl::MutexLock lock(&mu_);
      if (plan.ok()) {
        profile_pending_until_ = std::chrono::steady_clock::time_point();
      } else {
        profile_pending_until_ =
            std::chrono::steady_clock::now() + options_.profile_pending_retry;
        ++profile_pending_answers_;
      }
    }
    if (pending.send_span.context().valid()) {
      if (!plan.ok()) pending.send_span.SetError(plan.status().ToString());
      if (plan.ok()) plan->traceparent = pending.send_span.traceparent();
      pending.send_span.End();
    }
    pending.done(std::move(plan));
  }
  {
    absl::MutexLock lock(&mu_);
    broken_ = true;
    cv_.SignalAll();
  }
}

void RemotePlannerClient::Serve(
    grpc::ClientReaderWriter<v1::PlanRequest, v1::PlanResponse>* stream) {
  while (true) {
    Queued next;
    {
      absl::MutexLock lock(&mu_);
      while (!stopping_ && !broken_ && order_.empty()) cv_.Wait(&mu_);
      if (stopping_ || broken_) return;
      const uint64_t id = order_.front();
      order_.pop_front();
      auto it = queued_.find(id);
      next = std::move(it->second);
      queued_.erase(it);
    }
    // Traced (common/trace): plan.encode, then plan.send from the write to
    // the answer; the planner's spans hang from plan.send (its traceparent
    // travels in the request).
    trace::Span encode_span =
        trace::StartSpan("plan.encode", next.request.traceparent);
    SetPlanRequestAttributes(encode_span, next.request);
    const int max_draft = next.request.max_draft;
    v1::PlanRequest wire;
    // The encoder copies a snapshot's K/V out of the pool here: whatever
    // LibTorch throws fails this request, never the sender thread.
    absl::Status encoded;
    try {
      encoded = EncodePlanRequest(next.request, options_.window, &wire);
    } catch (...) {
      encoded = CurrentExceptionAsInternal("encoding a plan request");
    }
    next.request = PlanRequest();  // drop the K/V handles
    if (!encoded.ok()) {
      encode_span.SetError(encoded.ToString());
      encode_span.End();
      next.done(encoded);
      continue;
    }
    encode_span.SetAttribute(
        "knapserve.plan.kv_positions",
        static_cast<int64_t>(wire.kv_context().window().positions_size()));
    encode_span.End();
    trace::Span send_span = trace::StartSpan("plan.send", encode_span.context(),
                                             trace::SpanKind::kClient);
    if (send_span.context().valid()) {
      wire.set_traceparent(send_span.traceparent());
    }
    const int64_t bytes = static_cast<int64_t>(wire.ByteSizeLong());
    if (send_span.recording()) {
      send_span.SetAttribute("rpc.system", "grpc");
      send_span.SetAttribute("rpc.service", "knapserve.v1.Planner");
      send_span.SetAttribute("rpc.method", "Plan");
      send_span.SetAttribute("server.address", options_.address);
      send_span.SetAttribute("knapserve.plan.request_bytes", bytes);
      send_span.SetAttribute("knapserve.plan.step",
                             static_cast<int64_t>(wire.step()));
    }
    if (bytes > options_.max_message_bytes) {
      const absl::Status too_large = absl::ResourceExhaustedError(absl::StrCat(
          "plan request: ", bytes, " bytes, more than the limit of ",
          options_.max_message_bytes, " (--max-plan-request-bytes)"));
      send_span.SetError(too_large.ToString());
      send_span.End();
      next.done(too_large);
      continue;
    }
    const Key key{std::stoull(wire.sequence_id()),
                  static_cast<int64_t>(wire.step())};
    {
      absl::MutexLock lock(&mu_);
      in_flight_[key] =
          Pending{std::move(next.done), max_draft, std::move(send_span)};
    }
    if (!stream->Write(wire)) return;  // broken: FailInFlight answers it
    bytes_sent_.fetch_add(bytes);
    requests_sent_.fetch_add(1);
  }
}

void RemotePlannerClient::Run() {
  std::chrono::milliseconds backoff = options_.initial_backoff;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
    }
    grpc::ChannelArguments args;
    args.SetMaxSendMessageSize(options_.max_message_bytes);
    args.SetMaxReceiveMessageSize(options_.max_message_bytes);
    std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(
        options_.address,
        options_.credentials != nullptr ? options_.credentials
                                        : grpc::InsecureChannelCredentials(),
        args);
    const bool up =
        channel->WaitForConnected(std::chrono::system_clock::now() + backoff);
    if (up) {
      auto stub = v1::Planner::NewStub(channel);
      grpc::ClientContext context;
      {
        absl::MutexLock lock(&mu_);
        if (stopping_) return;
        context_ = &context;
        broken_ = false;
      }
      std::unique_ptr<
          grpc::ClientReaderWriter<v1::PlanRequest, v1::PlanResponse>>
          stream = stub->Plan(&context);
      connected_ = true;
      connections_.fetch_add(1);
      backoff = options_.initial_backoff;
      std::thread reader([&] { Read(stream.get()); });
      Serve(stream.get());
      context.TryCancel();
      reader.join();
      stream->Finish()
          .ok();  // the status says why; the caller only needs "gone"
      connected_ = false;
      {
        absl::MutexLock lock(&mu_);
        context_ = nullptr;
      }
      FailInFlight(absl::UnavailableError(
          absl::StrCat("the planner stream to ", options_.address, " broke")));
    }
    // Wait before the next attempt (interrupted by the destructor).
    {
      const absl::Time deadline =
          absl::Now() +
          absl::FromChrono(up ? options_.initial_backoff : backoff);
      absl::MutexLock lock(&mu_);
      while (!stopping_ && !cv_.WaitWithDeadline(&mu_, deadline)) {
      }
      if (stopping_) return;
    }
    if (!up) backoff = std::min(backoff * 2, options_.max_backoff);
  }
}

}  // namespace knapserve
