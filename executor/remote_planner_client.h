// RemotePlannerClient: the PlannerClient (common/plan/planner_client.h) that talks
// to a knapserve-planner over one long-lived knapserve.v1.Planner/Plan stream.
//
// Submit never blocks the decode thread: it queues the request (a newer
// request of the same sequence replaces a queued one, whose callback gets
// Cancelled) and a client thread encodes it (common/wire/plan_codec.h, K/V as a
// window of the prefix) and writes it. A reader thread matches answers to
// requests by (sequence, step) and runs their callbacks.
//
// Faults: when the stream breaks (planner down, restarted, network), every
// request in flight is answered Unavailable, and the client reconnects with
// exponential backoff (initial_backoff doubling up to max_backoff) while
// queued requests wait. The executor meanwhile decodes with its last plan.
//
// Ownership: owns its threads and channel; requests hold K/V handles until
// they are written. The destructor closes the stream and answers everything
// still pending with Unavailable. Thread safety: Submit and Forget from any
// thread.
#ifndef KNAPSERVE_EXECUTOR_REMOTE_PLANNER_CLIENT_H_
#define KNAPSERVE_EXECUTOR_REMOTE_PLANNER_CLIENT_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "common/wire/plan_codec.h"
#include "common/plan/planner_client.h"
#include "knapserve/v1/planner.grpc.pb.h"

namespace knapserve {

struct RemotePlannerOptions {
  std::string address;  // host:port of the planner service
  int num_layers = 0;   // of the served model (parses masks in answers)
  KvWindowOptions window;
  std::chrono::milliseconds initial_backoff{100};
  std::chrono::milliseconds max_backoff{5000};
  int max_message_bytes = 512 << 20;
};

class RemotePlannerClient : public PlannerClient {
 public:
  explicit RemotePlannerClient(RemotePlannerOptions options);
  ~RemotePlannerClient() override;

  void Submit(PlanRequest request, PlanCallback done) override;
  void Forget(uint64_t sequence_id) override;

  // Whether a stream is open now; how many times one was (re)opened; bytes of
  // encoded requests written; requests written.
  bool connected() const { return connected_.load(); }
  int64_t connections() const { return connections_.load(); }
  int64_t bytes_sent() const { return bytes_sent_.load(); }
  int64_t requests_sent() const { return requests_sent_.load(); }

 private:
  struct Queued {
    PlanRequest request;
    PlanCallback done;
  };
  using Key = std::pair<uint64_t, int64_t>;  // (sequence, step)

  void Run();
  // Writes queued requests until the stream breaks or the client stops.
  void Serve(grpc::ClientReaderWriter<v1::PlanRequest, v1::PlanResponse>* stream);
  void Read(grpc::ClientReaderWriter<v1::PlanRequest, v1::PlanResponse>* stream);
  void FailInFlight(const absl::Status& status);

  const RemotePlannerOptions options_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<uint64_t> order_;           // sequences with a queued request
  std::map<uint64_t, Queued> queued_;    // one per sequence
  std::map<Key, PlanCallback> in_flight_;  // written, not yet answered
  grpc::ClientContext* context_ = nullptr;  // of the open stream, for TryCancel
  bool broken_ = false;
  bool stopping_ = false;
  std::atomic<bool> connected_{false};
  std::atomic<int64_t> connections_{0};
  std::atomic<int64_t> bytes_sent_{0};
  std::atomic<int64_t> requests_sent_{0};
  std::thread thread_;
};

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_REMOTE_PLANNER_CLIENT_H_
