// HttpFrontDoor: the OpenAI-compatible HTTP API of an executor, beside its
// gRPC service and on the same GenerationService: the same scheduler
// (admission limits, queue), the same batch, the same request-id registry
// and metrics, the same drain. Endpoints:
//
//   POST /v1/completions       prompt -> text (SSE with "stream": true)
//   POST /v1/chat/completions  messages -> text, through the chat template
//   GET  /v1/models            the served model
//   GET  /health               200 while serving, 503 while draining
//   GET  /metrics              the process's Prometheus registry
//
// The wire format (fields honoured and refused, the `knapserve` extension)
// is executor/api/openai_api.h. Errors use OpenAI's JSON shape: 400 for a bad
// field (naming it), 404 for an unknown model or path, 413 for a body over
// max_body_bytes, 429 when the queue is full, 503 while draining, 500 for an
// internal error. A streamed response that fails after its first event ends
// with an error event and [DONE].
//
// A client that disconnects stops its sequence: the request is marked
// cancelled and the batch drops it at its next step, freeing its K/V
// blocks. A streamed response notices at a failed write (the first write
// after the peer closed can still succeed into the kernel's buffer, so this
// takes one or two steps; a request whose client left while it was queued
// is noticed at its first writes, once it runs). A non-streamed one, which
// writes nothing before its end, watches its connection's socket instead
// (every 20 ms: poll(2) for the peer's hang-up), queued or running.
//
// Request ids ("cmpl-" or "chatcmpl-" and 32 hex digits) are unguessable
// (common/base/random_id.h) and registered under the owner "http", apart
// from every gRPC caller's ids, so no gRPC client can claim or abort them
// (executor/api/generation_service.h).
//
// Tracing: a `traceparent` header (W3C Trace Context) makes the request's
// generate span its child (executor/api/request_trace.h).
//
// Threads: cpp-httplib accepts on a thread of its own and runs each
// connection on a pool thread (max_connections of them), which waits for
// its request's tokens; the tokens are produced on the engine's step thread
// and handed over through a queue, so a slow client never holds up the
// batch.
//
// Ownership: borrows the service, which must outlive the front door, and
// the metrics registry; owns its server and threads. Shutdown (also run by
// the destructor) cancels what still streams and joins the threads.
#ifndef KNAPSERVE_EXECUTOR_API_HTTP_FRONT_DOOR_H_
#define KNAPSERVE_EXECUTOR_API_HTTP_FRONT_DOOR_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics/metrics.h"
#include "executor/api/generation_service.h"
#include "executor/api/openai_api.h"

namespace httplib {
struct Request;
struct Response;
}  // namespace httplib

namespace knapserve {

struct HttpFrontDoorOptions {
  // The name clients put in `model` and GET /v1/models lists.
  std::string model_name = "knapserve";
  // The chat template (nullopt: /v1/chat/completions answers 400).
  std::optional<ChatPromptFormat> chat;
  // GET /metrics renders it (nullptr: 404).
  const MetricsRegistry* metrics = nullptr;
  // Largest request body; larger is 413 before it is parsed.
  int64_t max_body_bytes = 4 << 20;
  // Connections served at once (each streaming response holds one). At
  // least the scheduler's running + queued requests plus a few, so that a
  // full queue is still answered with 429 rather than left waiting.
  int max_connections = 96;
};

class HttpFrontDoor {
 public:
  // Listens on `listen` ("HOST:PORT"; port 0 picks a free one: port()).
  // InvalidArgument for a malformed address, Unavailable if it cannot bind.
  static absl::StatusOr<std::unique_ptr<HttpFrontDoor>> Start(
      GenerationService& service, const std::string& listen,
      HttpFrontDoorOptions options);
  ~HttpFrontDoor();

  int port() const { return port_; }
  // /health answers 503 from now on (the service's drain refuses new
  // requests with 503 itself). Any thread.
  void StartDraining() { draining_ = true; }
  // Cancels every request still streaming, stops listening and joins the
  // threads. Idempotent; any thread but the front door's own.
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  class Request;  // one POST's generation, in flight
  struct Impl;    // the cpp-httplib server (its types stay in the .cc)

  HttpFrontDoor(GenerationService& service, HttpFrontDoorOptions options);
  // POST /v1/completions and /v1/chat/completions, on a pool thread.
  void HandleGenerate(const httplib::Request& req, httplib::Response& res,
                      OpenAiEndpoint endpoint);
  // false once Shutdown has begun.
  bool Track(const std::shared_ptr<Request>& request) ABSL_LOCKS_EXCLUDED(mu_);
  void Untrack(const Request* request) ABSL_LOCKS_EXCLUDED(mu_);

  GenerationService& service_;
  const HttpFrontDoorOptions options_;
  std::unique_ptr<Impl> impl_;
  std::thread listener_;
  int port_ = 0;
  std::atomic<bool> draining_{false};
  absl::Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  // Requests between admission and their response's end, to cancel at
  // Shutdown.
  absl::flat_hash_map<const Request*, std::shared_ptr<Request>> live_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_API_HTTP_FRONT_DOOR_H_
