// The Generation service set up from the command line: the K/V pool
// (--kv-cache-memory, --kv-block-size), the batched step loop
// (--max-batch-tokens, --prefill-step-budget, --plain-batch-size), admission
// (--max-running,
// --max-queue), the planner (in-process, remote or none), the batch cost model
// priced from the in-process planner's latency profile, metrics
// (--metrics-port) and the gRPC server. Used by knapserve-executor,
// `knapserve serve` and `knapserve bench serve` (which starts one on
// loopback when it is given no --server).
//
// Ownership: a RunningExecutor owns everything it starts and borrows the
// engine (model and tokenizer), which must outlive it. Its destructor stops
// the server first, then the pieces the server borrowed.
//
// Thread safety: StartExecutorFromFlags reads the process-global flags; call
// it from the main thread. The server then runs on gRPC's threads.
#ifndef KNAPSERVE_TOOLS_EXECUTOR_FROM_FLAGS_H_
#define KNAPSERVE_TOOLS_EXECUTOR_FROM_FLAGS_H_

#include <memory>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "common/metrics/metrics.h"
#include "common/trace/tracer.h"
#include "executor/api/executor_server.h"
#include "executor/engine/kv_pool.h"
#include "planner/batch_cost.h"
#include "tools/cli_flags.h"

ABSL_DECLARE_FLAG(int32_t, max_running);
ABSL_DECLARE_FLAG(int32_t, max_queue);
ABSL_DECLARE_FLAG(std::string, kv_cache_memory);
ABSL_DECLARE_FLAG(int32_t, kv_block_size);
ABSL_DECLARE_FLAG(int64_t, max_batch_tokens);
ABSL_DECLARE_FLAG(int32_t, plain_batch_size);
ABSL_DECLARE_FLAG(double, prefill_step_budget);
ABSL_DECLARE_FLAG(int32_t, metrics_port);
ABSL_DECLARE_FLAG(std::string, http_listen);

namespace knapserve {

// A started Generation server and what it borrows. Members are destroyed in
// reverse order: the metrics endpoint (declared last) stops first, since a
// scrape reads gauges of the server's scheduler and engine; then the server;
// then what it borrowed.
struct RunningExecutor {
  std::unique_ptr<KvPool> kv_pool;
  PlannerHandle planner;
  std::unique_ptr<ProfileBatchCost> batch_cost;  // with an in-process planner
  std::unique_ptr<MetricsRegistry> metrics;
  // Flushes the process's tracer (with OTEL_EXPORTER_OTLP_ENDPOINT) after
  // the server stopped and before `metrics`, its counters' registry, goes.
  std::unique_ptr<trace::TracerShutdown> tracer_shutdown;
  std::string planner_where;  // "inproc", "none" or the planner's address
  std::unique_ptr<ExecutorServer> server;
  std::unique_ptr<MetricsHttpServer> metrics_server;  // with --metrics-port
};

// Starts the Generation service for `engine` on `listen` ("127.0.0.1:0"
// picks a free port: server->port()). `planner_where` is "inproc" (a planner
// thread in this process, its latency profile from LatencyProfileFromFlags),
// "none" (planned modes are refused) or a knapserve-planner address.
// `command` prefixes log lines. `trace_service`: when not empty, traces go
// where the OTEL_* environment says (common/trace/otlp_http_exporter.h;
// nowhere without an endpoint), with this default service.name; call it so
// once per process. InvalidArgument for bad flags or OTEL_* variables; the
// profile's and the pool's errors; Unavailable when an address cannot be
// bound.
absl::StatusOr<std::unique_ptr<RunningExecutor>> StartExecutorFromFlags(
    const Engine& engine, const std::string& planner_where,
    const std::string& listen, const std::string& command,
    const std::string& trace_service = "");

}  // namespace knapserve

#endif  // KNAPSERVE_TOOLS_EXECUTOR_FROM_FLAGS_H_
