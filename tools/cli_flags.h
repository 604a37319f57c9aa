// Flags of the knapserve command line, shared by its subcommands, and the
// helpers that turn them into engine objects.
//
// Flags are process-global (Abseil); each subcommand reads only those that
// apply to it, and its --help text says which. The model defaults to
// $KNAPSERVE_MODEL, else the bundled stories260k found relative to the
// executable (tools/default_model.h); ../shared is only read by benchmarks
// and make-model (tools/shared_data.h). Without --profile, the planned modes
// take their latency profile from the profile cache (planner/profile_cache.h),
// measuring it on a miss.
#ifndef KNAPSERVE_TOOLS_CLI_FLAGS_H_
#define KNAPSERVE_TOOLS_CLI_FLAGS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "common/model/exit_heads.h"
#include "common/model/llama.h"
#include "common/text/tokenizer.h"
#include "executor/api/remote_planner_client.h"
#include "executor/engine/generator.h"
#include "executor/planning/domain_router.h"
#include "knapserve/v1/generation.pb.h"
#include "planner/inprocess_planner.h"
#include "planner/profile_cache.h"

ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(std::string, prompt);
ABSL_DECLARE_FLAG(std::string, text);
ABSL_DECLARE_FLAG(int64_t, max_new_tokens);
ABSL_DECLARE_FLAG(double, temperature);
ABSL_DECLARE_FLAG(int64_t, top_k);
ABSL_DECLARE_FLAG(double, top_p);
ABSL_DECLARE_FLAG(double, min_p);
ABSL_DECLARE_FLAG(double, repetition_penalty);
ABSL_DECLARE_FLAG(double, presence_penalty);
ABSL_DECLARE_FLAG(double, frequency_penalty);
ABSL_DECLARE_FLAG(std::vector<std::string>, logit_bias);
ABSL_DECLARE_FLAG(int64_t, min_tokens);
ABSL_DECLARE_FLAG(std::string, bad_words);
ABSL_DECLARE_FLAG(std::optional<uint64_t>, seed);
ABSL_DECLARE_FLAG(std::vector<std::string>, stop);
ABSL_DECLARE_FLAG(bool, ignore_eos);
ABSL_DECLARE_FLAG(bool, logprobs);
ABSL_DECLARE_FLAG(int32_t, top_logprobs);
ABSL_DECLARE_FLAG(std::string, dtype);
ABSL_DECLARE_FLAG(std::string, device);
ABSL_DECLARE_FLAG(std::string, threads);
ABSL_DECLARE_FLAG(bool, json);
ABSL_DECLARE_FLAG(std::string, shape);
ABSL_DECLARE_FLAG(std::string, out);
ABSL_DECLARE_FLAG(std::string, tokenizer);
ABSL_DECLARE_FLAG(std::string, prompts);
ABSL_DECLARE_FLAG(int32_t, num_prompts);
ABSL_DECLARE_FLAG(int64_t, min_prompt_tokens);
ABSL_DECLARE_FLAG(int32_t, repeats);
ABSL_DECLARE_FLAG(int64_t, plan_refine_trials);
ABSL_DECLARE_FLAG(std::string, spec);
ABSL_DECLARE_FLAG(std::string, skip);
ABSL_DECLARE_FLAG(std::string, anchors);
ABSL_DECLARE_FLAG(std::vector<std::string>, domains);
ABSL_DECLARE_FLAG(std::string, split);
ABSL_DECLARE_FLAG(std::optional<int32_t>, max_draft);
ABSL_DECLARE_FLAG(std::string, profile);
ABSL_DECLARE_FLAG(std::string, profile_cache);
ABSL_DECLARE_FLAG(std::string, listen);
ABSL_DECLARE_FLAG(std::string, server);
ABSL_DECLARE_FLAG(std::string, planner);
ABSL_DECLARE_FLAG(int64_t, max_plan_request_bytes);
ABSL_DECLARE_FLAG(int32_t, clasp_layers);
ABSL_DECLARE_FLAG(std::vector<std::string>, modes);
ABSL_DECLARE_FLAG(int64_t, long_context_tokens);
ABSL_DECLARE_FLAG(int32_t, planner_threads);
ABSL_DECLARE_FLAG(std::string, planner_priority);
ABSL_DECLARE_FLAG(std::string, planner_cores);
ABSL_DECLARE_FLAG(double, knapspec_max_skip);
ABSL_DECLARE_FLAG(bool, knapspec_pool_alpha);
ABSL_DECLARE_FLAG(std::vector<std::string>, profile_contexts);
ABSL_DECLARE_FLAG(int32_t, profile_repeats);
ABSL_DECLARE_FLAG(double, profile_point_budget);
ABSL_DECLARE_FLAG(int32_t, profile_max_draft);
ABSL_DECLARE_FLAG(double, exit_threshold);
ABSL_DECLARE_FLAG(double, specbound_lambda);
ABSL_DECLARE_FLAG(std::optional<double>, specbound_t0);
ABSL_DECLARE_FLAG(int32_t, specbound_depth);
ABSL_DECLARE_FLAG(int32_t, specbound_check_every);
ABSL_DECLARE_FLAG(std::string, exit_heads);
ABSL_DECLARE_FLAG(int64_t, plan_interval);
ABSL_DECLARE_FLAG(int64_t, reference_steps);
ABSL_DECLARE_FLAG(bool, search_masks);
ABSL_DECLARE_FLAG(int32_t, search_prompts);
ABSL_DECLARE_FLAG(int64_t, search_tokens);
ABSL_DECLARE_FLAG(int32_t, search_max_steps);
ABSL_DECLARE_FLAG(double, search_min_gain);
ABSL_DECLARE_FLAG(bool, search_edge_layers);
ABSL_DECLARE_FLAG(bool, search_whole_layers);
ABSL_DECLARE_FLAG(int64_t, context_length);
ABSL_DECLARE_FLAG(int32_t, step_repeats);
ABSL_DECLARE_FLAG(int64_t, plan_bucket_tokens);
ABSL_DECLARE_FLAG(double, drift_tolerance);
ABSL_DECLARE_FLAG(int64_t, sequence_prior_tokens);
ABSL_DECLARE_FLAG(int64_t, drift_min_tokens);
ABSL_DECLARE_FLAG(int64_t, plain_recheck_steps);
ABSL_DECLARE_FLAG(double, planner_budget);
ABSL_DECLARE_FLAG(bool, warm_plan_cache);
ABSL_DECLARE_FLAG(bool, guard);
ABSL_DECLARE_FLAG(double, guard_margin);
ABSL_DECLARE_FLAG(int64_t, guard_min_steps);
ABSL_DECLARE_FLAG(int64_t, guard_probe_steps);
ABSL_DECLARE_FLAG(int64_t, guard_reprobe_steps);
ABSL_DECLARE_FLAG(bool, guard_carry);
ABSL_DECLARE_FLAG(bool, guard_settle_plain);
ABSL_DECLARE_FLAG(bool, guard_clear_losses);
ABSL_DECLARE_FLAG(bool, guard_confirm_losses);
ABSL_DECLARE_FLAG(double, guard_confirm_confidence);
ABSL_DECLARE_FLAG(double, guard_explore_share);

namespace knapserve {

// Parses the command line, accepting flags with dashes (--max-new-tokens) as
// well as Abseil's underscores, and returns the positional arguments
// (argv[0] first).
std::vector<std::string> ParseFlagsWithDashes(int argc, char** argv);

// A list flag of token counts (--profile-contexts, --longer-prompts),
// `flag` its name with dashes: each item as an integer >= 1, in the given
// order; InvalidArgument naming the flag and the first item that is not
// one.
absl::StatusOr<std::vector<int64_t>> TokenCountsFromFlag(
    const std::string& flag, const std::vector<std::string>& items);

// The model folder: --model, else DefaultModelDir() ($KNAPSERVE_MODEL, else
// the bundled stories260k beside the executable); NotFound listing where it
// looked when there is none.
absl::StatusOr<std::string> ModelDirFromFlags();

// A loaded model and its tokenizer.
struct Engine {
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<Tokenizer> tokenizer;
  std::string model_dir;
  // --anchors, checked against the model; null without the flag.
  std::shared_ptr<const DomainRouter> router;
  // SpecBound's trained exit heads (--exit-heads auto when MODEL_DIR/
  // exit_heads.safetensors exists, trained or FILE); nullptr with
  // --exit-heads model, or auto without the file. Requests get them through
  // ApplyExitHeads.
  std::shared_ptr<const ExitHeads> exit_heads;
};

// Loads the model (--model, --dtype, --device, --threads), tokenizer.json,
// the exit heads (ExitHeadsFromFlags) and, with --anchors, the KNN-SSD
// domain anchors.
absl::StatusOr<Engine> LoadEngineFromFlags();

// --exit-heads for `engine`'s model: nullptr for 'model', and for 'auto'
// without MODEL_DIR/exit_heads.safetensors; the trained heads of that file
// for 'auto' (with it) and 'trained', else of the named file (ExitHeads::
// Load's errors name the file).
absl::StatusOr<std::shared_ptr<const ExitHeads>> ExitHeadsFromFlags(
    const Engine& engine);

// T_0 for trained exit heads: they are calibrated and need no extra
// temperature (SpecBoundConfig::t0 suits the model's own heads;
// executor/README.md, SpecBound).
inline constexpr double kTrainedExitHeadsT0 = 1.0;

// Puts `engine`'s exit heads into `speculation.specbound`: the heads, trained
// whenever there are any (trained heads are used when present), and T_0 from
// --specbound-t0, else the heads' default (kTrainedExitHeadsT0 for trained
// heads, SpecBoundConfig().t0 for the model's own).
void ApplyExitHeads(const Engine& engine, SpeculationConfig& speculation);

// The sampling settings the flags describe: --temperature, --top-k,
// --top-p, --min-p, --seed and the logits processors' --repetition-penalty,
// --presence-penalty, --frequency-penalty, --logit-bias ID:BIAS,...,
// --min-tokens and --bad-words 'ID ID,ID' (executor/engine/
// logits_processors.h defines them). InvalidArgument naming the flag when
// --logit-bias or --bad-words does not parse; the ranges are checked with
// the request.
absl::StatusOr<SamplingParams> SamplingParamsFromFlags();

// The generation request the flags describe, for already tokenized prompt ids.
absl::StatusOr<GenerationRequest> GenerationRequestFromFlags(
    std::vector<int32_t> prompt_ids);

// The same request as a knapserve.v1.GenerateRequest for a server (sampling,
// stop strings, speculation), without a prompt: the caller sets text or
// token_ids. InvalidArgument for an unknown --spec.
absl::StatusOr<v1::GenerateRequest> WireRequestFromFlags();

// Where the latency profile of a local planner came from (for logs and
// --json): ProfileOriginName() and the file read or written.
struct ProfileSource {
  std::string origin;
  std::string path;
};

// Where a latency profile comes from: --profile, the cache folder
// (--profile-cache, planner/profile_cache.h ProfileCacheDir), and the
// largest draft it must cover (--max-draft, at least 10).
ObtainProfileOptions ObtainProfileOptionsFromFlags();

// The latency profile for planning with `engine`: --profile FILE, else the
// profile cache (--profile-cache, planner/profile_cache.h), measured with
// QuickProfileOptions and stored on a miss, for drafts up to --max-draft
// (default 10). Logs to stderr, prefixed "knapserve <command>: ", where the
// profile came from (file, cache hit, measured) and any cache warning.
absl::StatusOr<ObtainedProfile> LatencyProfileFromFlags(
    const Engine& engine, const std::string& command);

// --planner-priority for a planner beside `model`: the flag (a nice value,
// normal or idle; InvalidArgument for anything else), or with auto (the
// default) nice 19 when the model runs on the CPU and the decode's threads
// (at::get_num_threads: call after the model is loaded) plus
// --planner-threads outnumber the cores this process may use, so that the
// solve would share the decode's cores (measured in README.md: a cold
// 1k-token bucket's first solve slowed decoding to 0.82-0.89x at nice 0,
// 0.95x at nice 19); else nice 0 (a free core, or a GPU, where the solve
// runs on its own stream). Never idle by default: SCHED_IDLE starves the
// solve while decoding keeps every core busy
// (common/base/thread_priority.h).
absl::StatusOr<ThreadPriority> PlannerPriorityFromFlags(
    const LlamaModel& model);
// Whether the model runs on the CPU and the decode's threads
// (at::get_num_threads) plus --planner-threads outnumber UsableCores().
bool PlannerSharesTheDecodesCores(const LlamaModel& model);
// --planner-cores: the cores each solve gets to itself while it runs
// (InProcessPlannerOptions::reserve_cores); default 0; auto =
// --planner-threads when PlannerSharesTheDecodesCores, else 0.
// InvalidArgument, naming the flag, for anything but auto or a number >= 0.
absl::StatusOr<int> PlannerCoresFromFlags(const LlamaModel& model);
// The knapsack DP's options from --knapspec-max-skip (checked:
// InvalidArgument naming the flag) and --knapspec-pool-alpha: for the
// in-process planner and for `knapserve anchors`, whose per-domain masks
// come from the same DP.
absl::StatusOr<KnapSpecOptions> KnapSpecOptionsFromFlags();
// The in-process planner's options from --planner-threads,
// --planner-priority, --planner-cores and KnapSpecOptionsFromFlags.
absl::StatusOr<InProcessPlannerOptions> PlannerOptionsFromFlags(
    const LlamaModel& model);

// The in-process planner for a planned --spec mode (IsPlanned) (the profile
// from LatencyProfileFromFlags, --planner-threads, --planner-priority), or
// nullptr for the other modes. The profile's load and match errors, and
// measurement errors. `source`, when given, receives where the profile came
// from.
absl::StatusOr<std::unique_ptr<InProcessPlanner>> PlannerFromFlags(
    const Engine& engine, SpeculationMode mode, const std::string& command,
    ProfileSource* source = nullptr);

// Where a knapspec/clasp generation gets its plans: a planner thread in this
// process or a knapserve-planner at --planner ADDR. Empty for other modes.
struct PlannerHandle {
  std::unique_ptr<InProcessPlanner> local;
  std::unique_ptr<RemotePlannerClient> remote;
  ProfileSource profile;  // of `local`; empty otherwise
  PlannerClient* get() const {
    return local != nullptr ? static_cast<PlannerClient*>(local.get())
                            : remote.get();
  }
};
// The options of a client of the knapserve-planner at `address`
// (--max-plan-request-bytes, and TLS from tools/tls_from_flags.h); the TLS
// files' errors.
absl::StatusOr<RemotePlannerOptions> RemotePlannerOptionsFromFlags(
    const std::string& address, int num_layers);

absl::StatusOr<PlannerHandle> PlannerClientFromFlags(
    const Engine& engine, SpeculationMode mode, const std::string& command);

// For the server commands: blocks SIGTERM and SIGINT in this thread (call
// before any other thread starts, so every thread inherits the mask) and
// returns the --listen address; InvalidArgument when --listen is empty.
absl::StatusOr<std::string> ListenAddressAndBlockStopSignals();
// Waits for SIGTERM or SIGINT (blocked by the call above); returns which.
int WaitForStopSignal();

// Prints a failed status as "knapserve <command>: <status>" to stderr and
// returns the exit code: 0 for OK, 2 for InvalidArgument (bad usage), else 1.
int ExitCode(const absl::Status& status, const char* command);

}  // namespace knapserve

#endif  // KNAPSERVE_TOOLS_CLI_FLAGS_H_
