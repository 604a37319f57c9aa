// `knapserve-executor` / `knapserve executor` / `knapserve serve`: the
// Generation gRPC service for one model until SIGTERM or SIGINT, then a drain.
//   knapserve-executor --model DIR --listen ADDR --planner ADDR|inproc|none
//   knapserve serve --model DIR --listen ADDR          (in-process planner)
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/metrics/metrics.h"
#include "executor/executor_server.h"
#include "executor/kv_pool.h"
#include "planner/batch_cost.h"
#include "tools/cli_flags.h"
#include "tools/commands.h"

ABSL_FLAG(int32_t, max_running, 16,
          "executor: requests decoding at once, in one shared batch.");
ABSL_FLAG(
    int32_t, max_queue, 64,
    "executor: requests waiting for a slot; beyond that RESOURCE_EXHAUSTED.");
ABSL_FLAG(std::string, kv_cache_memory, "",
          "executor: K/V pool size: bytes (536870912, 512MiB, 2GB) or a "
          "fraction of RAM (0.25); empty = K/V for --max-running sequences at "
          "full context, at most a quarter of RAM.");
ABSL_FLAG(int32_t, kv_block_size, 16,
          "executor: positions per K/V block (a multiple of 16).");
ABSL_FLAG(int64_t, max_batch_tokens, 256,
          "executor: rows of one batched pass; decode rows always run, "
          "prompt chunks fill the rest (chunked prefill).");
ABSL_FLAG(int32_t, plain_batch_size, 0,
          "executor: above this many decoding sequences a step decodes "
          "without drafts; 0 = speculate at any batch size.");
ABSL_FLAG(int32_t, metrics_port, 0,
          "executor: serve Prometheus metrics at http://0.0.0.0:PORT/metrics; "
          "0 = off.");
ABSL_FLAG(
    double, drain_seconds, 30,
    "executor: on SIGTERM, how long running requests may take to finish.");

namespace knapserve {
namespace {

absl::Status ServeExecutor(bool one_process) {
  const std::string command = one_process ? "serve" : "executor";
  ASSIGN_OR_RETURN(const std::string listen,
                   ListenAddressAndBlockStopSignals());

  ASSIGN_OR_RETURN(Engine engine, LoadEngineFromFlags());
  GenerationServiceOptions options;
  options.model_path = engine.model_dir;
  options.scheduler.max_running = absl::GetFlag(FLAGS_max_running);
  options.scheduler.max_queue = absl::GetFlag(FLAGS_max_queue);
  if (options.scheduler.max_running < 1 || options.scheduler.max_queue < 0) {
    return absl::InvalidArgumentError(
        "--max-running must be >= 1 and --max-queue >= 0");
  }
  options.engine.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  options.engine.plain_batch_size = absl::GetFlag(FLAGS_plain_batch_size);
  if (options.engine.max_batch_tokens < 1 ||
      options.engine.plain_batch_size < 0) {
    return absl::InvalidArgumentError(
        "--max-batch-tokens must be >= 1 and --plain-batch-size >= 0");
  }
  KvPoolOptions pool_options;
  pool_options.block_rows = absl::GetFlag(FLAGS_kv_block_size);
  const std::string kv_memory = absl::GetFlag(FLAGS_kv_cache_memory);
  if (kv_memory.empty()) {
    pool_options.memory_bytes =
        DefaultKvCacheBytes(*engine.model, options.scheduler.max_running);
  } else {
    ASSIGN_OR_RETURN(pool_options.memory_bytes,
                     ParseKvCacheMemory(kv_memory, TotalRamBytes()));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<KvPool> kv_pool,
                   KvPool::Create(*engine.model, pool_options));
  options.kv_pool = kv_pool.get();
  std::cerr << "knapserve-executor: K/V pool of " << kv_pool->total_blocks()
            << " blocks x " << kv_pool->block_rows() << " positions ("
            << kv_pool->total_blocks() * kv_pool->bytes_per_block() / 1e6
            << " MB)" << std::endl;
  ASSIGN_OR_RETURN(GenerationRequest defaults, GenerationRequestFromFlags({}));
  options.default_max_new_tokens = defaults.max_new_tokens;
  options.default_speculation = defaults.speculation;

  PlannerHandle planner;
  std::unique_ptr<ProfileBatchCost> batch_cost;  // outlives the server
  const std::string where =
      one_process ? "inproc" : absl::GetFlag(FLAGS_planner);
  if (where == "inproc") {
    // The latency profile: --profile, else the profile cache (measured on a
    // miss).
    ASSIGN_OR_RETURN(
        planner.local,
        PlannerFromFlags(engine, SpeculationMode::kKnapSpec, command));
    options.planner_mode = v1::PLANNER_MODE_IN_PROCESS;
    // The same profile prices batched steps: drafts are dropped for a step
    // where they would not pay at that batch size.
    batch_cost = std::make_unique<ProfileBatchCost>(planner.local->profile(),
                                                    engine.model->num_layers());
    options.engine.cost_model = batch_cost.get();
  } else if (where != "none") {
    RemotePlannerOptions remote;
    remote.address = where;
    remote.num_layers = engine.model->num_layers();
    planner.remote = std::make_unique<RemotePlannerClient>(remote);
    options.planner_mode = v1::PLANNER_MODE_REMOTE;
    options.planner_address = where;
  }
  options.planner = planner.get();
  // One plan cache, planner budget and plain-rate table for every request of
  // this process; they outlive the planner's callbacks (shared ownership).
  options.planning = PlanningShared::Create();
  MetricsRegistry metrics;
  options.metrics = &metrics;
  std::unique_ptr<MetricsHttpServer> metrics_server;
  if (const int port = absl::GetFlag(FLAGS_metrics_port); port > 0) {
    metrics_server = MetricsHttpServer::Start(&metrics, "0.0.0.0", port);
    if (metrics_server == nullptr) {
      return absl::UnavailableError(
          absl::StrCat("--metrics-port: cannot listen on ", port));
    }
  }
  ASSIGN_OR_RETURN(
      std::unique_ptr<ExecutorServer> server,
      ExecutorServer::Start(*engine.model, *engine.tokenizer, options, listen));
  std::cerr << "knapserve-executor: serving " << engine.model_dir
            << " (planner " << where << ") on port " << server->port()
            << std::endl;
  const int received = WaitForStopSignal();
  std::cerr << "knapserve-executor: signal " << received << ", draining"
            << std::endl;
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(
      1000 * std::max(0.0, absl::GetFlag(FLAGS_drain_seconds))));
  if (!server->Drain(timeout)) {
    std::cerr
        << "knapserve-executor: drain timed out; cancelling what still runs"
        << std::endl;
  }
  return absl::OkStatus();
}

}  // namespace

int RunExecutorServer() { return ExitCode(ServeExecutor(false), "executor"); }
int RunServe() { return ExitCode(ServeExecutor(true), "serve"); }

}  // namespace knapserve
