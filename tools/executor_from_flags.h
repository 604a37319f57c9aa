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
// it from the main thread. The server then runs on gRPC's threads; a latency
// profile missing from the cache is measured on a thread of its own while
// the server already serves (MeasureProfileInBackground).
#ifndef KNAPSERVE_TOOLS_EXECUTOR_FROM_FLAGS_H_
#define KNAPSERVE_TOOLS_EXECUTOR_FROM_FLAGS_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "common/metrics/metrics.h"
#include "common/trace/tracer.h"
#include "executor/api/executor_server.h"
#include "executor/engine/kv_pool.h"
#include "planner/background_profile.h"
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
  // With an in-process planner: priced from its profile once it has one.
  std::unique_ptr<DeferredBatchCost> batch_cost;
  std::unique_ptr<MetricsRegistry> metrics;
  // Flushes the process's tracer (with OTEL_EXPORTER_OTLP_ENDPOINT) after
  // the server stopped and before `metrics`, its counters' registry, goes.
  std::unique_ptr<trace::TracerShutdown> tracer_shutdown;
  std::string planner_where;  // "inproc", "none" or the planner's address
  std::unique_ptr<ExecutorServer> server;
  std::unique_ptr<MetricsHttpServer> metrics_server;  // with --metrics-port
  // Measures the in-process planner's profile after a cache miss. Declared
  // last, so it stops first: it reads the server's gauges and feeds the
  // planner and the batch cost model.
  std::unique_ptr<BackgroundProfile> background_profile;

  // Whether the in-process planner is still waiting for its profile.
  bool profile_pending() const {
    return planner.local != nullptr && planner.local->ProfilePending();
  }
};

// An in-process planner for a server (`serve`, `knapserve-executor
// --planner inproc`, `knapserve-planner`) that lets it serve at once: with
// --profile FILE or a profile-cache hit (FindProfile) it plans from the
// start, as PlannerFromFlags would; on a miss it starts without a profile
// (InProcessPlanner::CreateWithoutProfile: planned requests decode plainly)
// and `profile.origin` is "pending": the caller starts its server, then
// MeasureProfileInBackground. --planner-threads, --planner-priority. Logs where
// the profile came from.
absl::StatusOr<PlannerHandle> ServerPlannerFromFlags(
    const Engine& engine, const std::string& command);

// Measures `engine`'s latency profile on a low-priority thread of its own
// while the server serves (planner/background_profile.h: it measures only
// while `busy` says the process is idle; nullptr = always idle) and stores
// it in the profile cache. When it is ready it goes to `planner`
// (SetProfile) and, when given, `batch_cost`. Logs "profile: measuring in
// the background ..." now and "profile ready after X s" then, prefixed
// "knapserve <command>: ". Call from the main thread (it reads the flags and
// the decode's thread count). `planner`, `batch_cost` and whatever `busy`
// reads must outlive the returned object.
//
// Test only: while the file named by $KNAPSERVE_TEST_PROFILE_GATE does not
// exist, the process counts as busy, so the measurement does not begin (the
// CLI tests hold the profile pending with it; never set in production).
absl::StatusOr<std::unique_ptr<BackgroundProfile>> MeasureProfileInBackground(
    const Engine& engine, InProcessPlanner* planner,
    DeferredBatchCost* batch_cost, const std::string& command,
    std::function<bool()> busy);

// Starts the Generation service for `engine` on `listen` ("127.0.0.1:0"
// picks a free port: server->port()). `planner_where` is "inproc" (a planner
// thread in this process: ServerPlannerFromFlags, its profile measured in
// the background on a cache miss while the server already serves), "none"
// (planned modes are refused) or a knapserve-planner address.
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
