// The Generation service set up from the command line (see the header).
#include "tools/executor_from_flags.h"

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <optional>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/base/file_util.h"
#include "common/base/status.h"
#include "common/text/chat_template.h"
#include "common/trace/otlp_http_exporter.h"
#include "tools/step_overhead.h"
#include "tools/tls_from_flags.h"

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
ABSL_FLAG(double, prefill_step_budget, 2.5,
          "executor: while streams decode, a step that also loads prompt "
          "rows may take at most this many times a decode-only step "
          "(measured online); 0 = chunks of --max-batch-tokens.");
ABSL_FLAG(int32_t, plain_batch_size, 0,
          "executor: above this many decoding sequences a step decodes "
          "without drafts; 0 = speculate at any batch size.");
ABSL_FLAG(int64_t, max_request_bytes, 4 << 20,
          "executor: largest Generate request message in bytes; larger is "
          "RESOURCE_EXHAUSTED (0 = gRPC's default, 4 MiB).");
ABSL_FLAG(int64_t, max_prompt_tokens, 0,
          "executor: most prompt tokens a request may send; 0 = the model's "
          "context.");
ABSL_FLAG(int64_t, max_new_tokens_limit, 0,
          "executor: most max_new_tokens a request may ask for; 0 = the "
          "model's context.");
ABSL_FLAG(int64_t, max_stop_strings, 16,
          "executor: most stop strings per request; 0 = no limit.");
ABSL_FLAG(int64_t, max_stop_bytes, 256,
          "executor: longest stop string in bytes; 0 = no limit.");
ABSL_FLAG(int64_t, max_stop_token_ids, 64,
          "executor: most stop token ids per request; 0 = no limit.");
ABSL_FLAG(int32_t, metrics_port, 0,
          "executor and planner: serve Prometheus metrics at "
          "http://0.0.0.0:PORT/metrics; 0 = off.");
ABSL_FLAG(std::string, http_listen, "",
          "executor: also serve the OpenAI-compatible HTTP API "
          "(/v1/completions, /v1/chat/completions, /v1/models, /health, "
          "/metrics) on HOST:PORT; empty = off.");
ABSL_FLAG(std::string, served_model_name, "",
          "executor: the model name HTTP clients send in `model`; empty = the "
          "--model folder's name.");
ABSL_FLAG(std::string, chat_template, "",
          "executor: a Jinja chat template file for /v1/chat/completions; "
          "empty = the chat_template of the model's tokenizer_config.json.");

namespace knapserve {
namespace {

// The HTTP front door's options: the served name, the chat template
// (--chat-template, else tokenizer_config.json's), the same metrics and
// request-size limit as gRPC, and a connection per running and queued
// request plus a few for /health, /metrics and refusals.
absl::StatusOr<HttpFrontDoorOptions> HttpOptionsFromFlags(
    const Engine& engine, const GenerationServiceOptions& service,
    const RunningExecutor& running) {
  HttpFrontDoorOptions http;
  http.model_name = absl::GetFlag(FLAGS_served_model_name);
  if (http.model_name.empty()) {
    std::string dir = engine.model_dir;
    while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
    const size_t slash = dir.rfind('/');
    http.model_name = slash == std::string::npos ? dir : dir.substr(slash + 1);
  }
  ASSIGN_OR_RETURN(ChatTemplateConfig config,
                   LoadChatTemplateConfig(engine.model_dir));
  if (const std::string file = absl::GetFlag(FLAGS_chat_template);
      !file.empty()) {
    ASSIGN_OR_RETURN(config.source, ReadFileToString(file));
  }
  if (config.source.has_value()) {
    absl::StatusOr<ChatTemplate> parsed = ChatTemplate::Parse(*config.source);
    if (!parsed.ok()) {
      return Annotate(parsed.status(),
                      absl::GetFlag(FLAGS_chat_template).empty()
                          ? "tokenizer_config.json"
                          : "--chat-template");
    }
    http.chat = ChatPromptFormat{std::move(*parsed), config.bos_token,
                                 config.eos_token};
  }
  http.metrics = running.metrics.get();
  if (service.limits.max_request_bytes > 0) {
    http.max_body_bytes = service.limits.max_request_bytes;
  }
  http.max_connections =
      service.scheduler.max_running + service.scheduler.max_queue + 16;
  return http;
}

}  // namespace

absl::StatusOr<std::unique_ptr<RunningExecutor>> StartExecutorFromFlags(
    const Engine& engine, const std::string& planner_where,
    const std::string& listen, const std::string& command,
    const std::string& trace_service) {
  auto running = std::make_unique<RunningExecutor>();
  running->planner_where = planner_where;
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
  options.engine.prefill_step_budget = absl::GetFlag(FLAGS_prefill_step_budget);
  if (options.engine.max_batch_tokens < 1 ||
      options.engine.plain_batch_size < 0) {
    return absl::InvalidArgumentError(
        "--max-batch-tokens must be >= 1 and --plain-batch-size >= 0");
  }
  if (!(options.engine.prefill_step_budget == 0 ||
        options.engine.prefill_step_budget > 1)) {
    return absl::InvalidArgumentError(
        "--prefill-step-budget must be 0 (off) or greater than 1");
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
  ASSIGN_OR_RETURN(running->kv_pool,
                   KvPool::Create(*engine.model, pool_options));
  options.kv_pool = running->kv_pool.get();
  std::cerr << "knapserve " << command << ": K/V pool of "
            << running->kv_pool->total_blocks() << " blocks x "
            << running->kv_pool->block_rows() << " positions ("
            << running->kv_pool->total_blocks() *
                   running->kv_pool->bytes_per_block() / 1e6
            << " MB)" << std::endl;
  ASSIGN_OR_RETURN(GenerationRequest defaults, GenerationRequestFromFlags({}));
  options.default_max_new_tokens = defaults.max_new_tokens;
  options.limits.max_request_bytes = absl::GetFlag(FLAGS_max_request_bytes);
  options.limits.max_prompt_tokens = absl::GetFlag(FLAGS_max_prompt_tokens);
  options.limits.max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens_limit);
  options.limits.max_stop_strings = absl::GetFlag(FLAGS_max_stop_strings);
  options.limits.max_stop_bytes = absl::GetFlag(FLAGS_max_stop_bytes);
  options.limits.max_stop_token_ids = absl::GetFlag(FLAGS_max_stop_token_ids);
  const RequestLimits& l = options.limits;
  if (l.max_request_bytes < 0 || l.max_prompt_tokens < 0 ||
      l.max_new_tokens < 0 || l.max_stop_strings < 0 || l.max_stop_bytes < 0 ||
      l.max_stop_token_ids < 0) {
    return absl::InvalidArgumentError(
        "--max-request-bytes, --max-prompt-tokens, --max-new-tokens-limit, "
        "--max-stop-strings, --max-stop-bytes and --max-stop-token-ids must "
        "be >= 0");
  }
  options.default_speculation = defaults.speculation;
  ApplyExitHeads(engine, options.default_speculation);

  if (planner_where == "inproc") {
    // The latency profile: --profile, else the profile cache; on a miss it
    // is measured in the background once the server serves (below).
    ASSIGN_OR_RETURN(running->planner, ServerPlannerFromFlags(engine, command));
    options.planner_mode = v1::PLANNER_MODE_IN_PROCESS;
    // The same profile prices batched steps: drafts are dropped for a step
    // where they would not pay at that batch size.
    running->batch_cost =
        std::make_unique<DeferredBatchCost>(engine.model->num_layers());
    if (const std::shared_ptr<const LatencyProfile> profile =
            running->planner.local->profile();
        profile != nullptr) {
      running->batch_cost->SetProfile(*profile);
    }
    options.engine.cost_model = running->batch_cost.get();
  } else if (planner_where != "none") {
    ASSIGN_OR_RETURN(RemotePlannerOptions remote,
                     RemotePlannerOptionsFromFlags(planner_where,
                                                   engine.model->num_layers()));
    running->planner.remote =
        std::make_unique<RemotePlannerClient>(std::move(remote));
    options.planner_mode = v1::PLANNER_MODE_REMOTE;
    options.planner_address = planner_where;
  }
  options.planner = running->planner.get();
  // One plan cache, planner budget, plain-rate and draft-cost table for every
  // request of this process; they outlive the planner's callbacks (shared
  // ownership).
  options.planning =
      PlanningShared::Create(absl::GetFlag(FLAGS_plan_refine_trials));
  options.planning.router = engine.router;
  running->metrics = std::make_unique<MetricsRegistry>();
  options.metrics = running->metrics.get();
  if (!trace_service.empty()) {
    ASSIGN_OR_RETURN(
        trace::Tracer * tracer,
        trace::InstallTracerFromEnv(trace_service, running->metrics.get()));
    running->tracer_shutdown = std::make_unique<trace::TracerShutdown>(tracer);
  }
  if (const int port = absl::GetFlag(FLAGS_metrics_port); port > 0) {
    running->metrics_server =
        MetricsHttpServer::Start(running->metrics.get(), "0.0.0.0", port);
    if (running->metrics_server == nullptr) {
      return absl::UnavailableError(
          absl::StrCat("--metrics-port: cannot listen on ", port));
    }
  }
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                   GenerationServerCredentialsFromFlags());
  ASSIGN_OR_RETURN(
      running->server,
      ExecutorServer::Start(*engine.model, *engine.tokenizer, options, listen,
                            credentials, absl::GetFlag(FLAGS_health_listen)));
  if (const std::string http = absl::GetFlag(FLAGS_http_listen);
      !http.empty()) {
    ASSIGN_OR_RETURN(HttpFrontDoorOptions front,
                     HttpOptionsFromFlags(engine, options, *running));
    const std::string name = front.model_name;
    const bool chat = front.chat.has_value();
    RETURN_IF_ERROR(running->server->StartHttp(http, std::move(front)));
    std::cerr << "knapserve " << command << ": OpenAI-compatible HTTP API ("
              << "model '" << name << "', chat "
              << (chat ? "with a template" : "off: no template")
              << ") at http port " << running->server->http_port() << std::endl;
  }
  if (running->server->health_port() != 0) {
    std::cerr << "knapserve " << command << ": grpc.health.v1 (plaintext) at "
              << "port " << running->server->health_port() << std::endl;
  }
  if (running->profile_pending()) {
    // The server serves; the profile is measured while it is idle: no
    // request running or queued, and no decode step since the last look.
    const GenerationService& service = running->server->service();
    auto last_steps = std::make_shared<int64_t>(service.engine().stats().steps);
    auto busy = [&service, last_steps] {
      const int64_t steps = service.engine().stats().steps;
      const bool stepped = steps != *last_steps;
      *last_steps = steps;
      return stepped || service.scheduler().running() > 0 ||
             service.scheduler().queued() > 0;
    };
    ASSIGN_OR_RETURN(running->background_profile,
                     MeasureProfileInBackground(
                         engine, running->planner.local.get(),
                         running->batch_cost.get(), command, std::move(busy)));
  }
  return running;
}

absl::StatusOr<PlannerHandle> ServerPlannerFromFlags(
    const Engine& engine, const std::string& command) {
  const std::string prefix = absl::StrCat("knapserve ", command, ": ");
  std::vector<std::string> warnings;
  ASSIGN_OR_RETURN(std::optional<ObtainedProfile> found,
                   FindProfile(ProfileKey::Of(*engine.model),
                               ObtainProfileOptionsFromFlags(), &warnings));
  for (const std::string& warning :
       found.has_value() ? found->warnings : warnings) {
    std::cerr << prefix << "warning: " << warning << std::endl;
  }
  ASSIGN_OR_RETURN(InProcessPlannerOptions options,
                   PlannerOptionsFromFlags(*engine.model));
  PlannerHandle handle;
  if (!found.has_value()) {
    handle.profile.origin = "pending";
    ASSIGN_OR_RETURN(handle.local, InProcessPlanner::CreateWithoutProfile(
                                       *engine.model, options));
    return handle;
  }
  std::cerr << prefix
            << (found->origin == ProfileOrigin::kFile
                    ? "latency profile from --profile "
                    : "latency profile: cache hit ")
            << found->path << std::endl;
  handle.profile.origin = std::string(ProfileOriginName(found->origin));
  handle.profile.path = found->path;
  ASSIGN_OR_RETURN(handle.local,
                   InProcessPlanner::Create(
                       *engine.model, std::move(found->profile), options));
  return handle;
}

absl::StatusOr<std::unique_ptr<BackgroundProfile>> MeasureProfileInBackground(
    const Engine& engine, InProcessPlanner* planner,
    DeferredBatchCost* batch_cost, const std::string& command,
    std::function<bool()> busy) {
  const std::string prefix = absl::StrCat("knapserve ", command, ": ");
  BackgroundProfileOptions options;
  options.key = ProfileKey::Of(*engine.model);
  options.cache = ObtainProfileOptionsFromFlags();
  options.cache.profile_path.clear();
  options.profile = QuickProfileOptions(*engine.model, options.cache.max_draft);
  options.profile.measure_overhead =
      StepOverheadFunction(*engine.model, *engine.tokenizer);
  // Test only (see the header): hold the measurement while the gate file
  // is missing.
  const char* gate_env = std::getenv("KNAPSERVE_TEST_PROFILE_GATE");
  const std::string gate = gate_env == nullptr ? "" : gate_env;
  const bool yields = busy != nullptr;
  options.busy = [gate, busy = std::move(busy)] {
    if (!gate.empty() && !std::filesystem::exists(gate)) return true;
    return busy != nullptr && busy();
  };
  std::cerr << prefix
            << "profile: measuring in the background (no --profile and no "
               "usable entry in the profile cache"
            << (options.cache.cache_dir.empty()
                    ? ""
                    : absl::StrCat(" ", options.cache.cache_dir))
            << (yields ? "; at low priority, only while no request decodes"
                       : "; at low priority")
            << "); planned modes decode plainly until it is ready" << std::endl;
  auto done = [prefix, planner, batch_cost](
                  absl::StatusOr<ObtainedProfile> obtained, double seconds,
                  double paused_seconds) {
    if (absl::IsCancelled(obtained.status())) return;  // shutting down
    if (!obtained.ok()) {
      std::cerr << prefix << "warning: profile: measuring failed ("
                << obtained.status()
                << "); planned modes go on decoding plainly" << std::endl;
      return;
    }
    for (const std::string& warning : obtained->warnings) {
      std::cerr << prefix << "warning: " << warning << std::endl;
    }
    if (batch_cost != nullptr) batch_cost->SetProfile(obtained->profile);
    const absl::Status set = planner->SetProfile(std::move(obtained->profile));
    if (!set.ok()) {
      std::cerr << prefix << "warning: profile: the measured profile was "
                << "refused (" << set << "); planned modes go on decoding "
                << "plainly" << std::endl;
      return;
    }
    std::cerr << prefix << "profile ready after "
              << absl::StrFormat("%.1f", seconds) << " s ("
              << absl::StrFormat("%.1f", paused_seconds)
              << " s of it paused while requests decoded"
              << (obtained->path.empty()
                      ? ", not stored"
                      : absl::StrCat(", stored in ", obtained->path))
              << "); planned modes plan from now on" << std::endl;
  };
  return BackgroundProfile::Start(*engine.model, std::move(options),
                                  std::move(done));
}

}  // namespace knapserve
