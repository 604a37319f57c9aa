#include "tools/cli_flags.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <climits>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/base/status.h"
#include "common/model/parallel_for.h"
#include "common/model/simd_target.h"
#include "common/plan/step_forecast.h"
#include "executor/api/generation_codec.h"
#include "planner/knapsack.h"
#include "planner/thread_choice.h"
#include "tools/default_model.h"
#include "tools/step_overhead.h"
#include "tools/tls_from_flags.h"

ABSL_FLAG(std::string, model, "",
          "Model folder (config.json, safetensors, tokenizer.json). Default: "
          "$KNAPSERVE_MODEL, "
          "else the bundled stories260k at <executable "
          "dir>/../share/knapserve/models.");
ABSL_FLAG(std::string, prompt, "",
          "generate: the prompt text (BOS is added as the model's "
          "tokenizer says).");
ABSL_FLAG(std::string, text, "", "tokenize: the text to encode.");
ABSL_FLAG(int64_t, max_new_tokens, 128,
          "generate/bench: tokens to generate at most.");
ABSL_FLAG(double, temperature, 0.0,
          "Sampling temperature; 0 (or below 1e-5) = greedy.");
ABSL_FLAG(int64_t, top_k, 0, "Top-k filter; 0 = off.");
ABSL_FLAG(double, top_p, 1.0, "Nucleus (top-p) filter; 1 = off.");
ABSL_FLAG(double, min_p, 0.0,
          "Min-p filter (vLLM), in [0, 1]: after top-p, drop the tokens less "
          "likely than min_p times the most likely one; 0 = off.");
ABSL_FLAG(double, repetition_penalty, 1.0,
          "Repetition penalty (vLLM/Hugging Face), > 0: the logit of every "
          "token in the prompt or the output so far is divided by it when "
          "positive, multiplied otherwise; 1 = off.");
ABSL_FLAG(double, presence_penalty, 0.0,
          "Presence penalty (OpenAI), in [-2, 2]: subtracted from the logit "
          "of every token generated so far.");
ABSL_FLAG(double, frequency_penalty, 0.0,
          "Frequency penalty (OpenAI), in [-2, 2]: subtracted from a token's "
          "logit once per time it was generated so far.");
ABSL_FLAG(std::vector<std::string>, logit_bias, {},
          "Comma-separated ID:BIAS pairs: BIAS (in [-100, 100]) is added to "
          "token ID's logit at every position (e.g. 42:-100,7:2.5).");
ABSL_FLAG(int64_t, min_tokens, 0,
          "The EOS ids (unless --ignore-eos) cannot be generated before this "
          "many tokens were.");
ABSL_FLAG(std::string, bad_words, "",
          "Banned token-id sequences (vLLM's bad_words), comma-separated, the "
          "ids of one sequence separated by spaces: '12 34,56' bans 34 right "
          "after 12, and 56 everywhere.");
ABSL_FLAG(std::optional<uint64_t>, seed, std::nullopt,
          "Sampling seed (same seed, same output); unset = random, reported in "
          "--json.");
ABSL_FLAG(std::string, draft_acceptance, "auto",
          "How sampled drafts are accepted (in-process only): rejection "
          "(speculative rejection sampling, the most accepted drafts), coupled "
          "(position-keyed noise: a seed gives the same text in every mode), "
          "or auto (coupled with --seed, else rejection).");
ABSL_FLAG(std::vector<std::string>, stop, {}, "Comma-separated stop strings.");
ABSL_FLAG(bool, ignore_eos, false,
          "Keep generating past the model's EOS tokens.");
ABSL_FLAG(bool, logprobs, false,
          "Report each output token's log-probability under the model (the "
          "full model's log_softmax, before the logits processors and "
          "temperature; generate --json prints output_logprobs).");
ABSL_FLAG(int32_t, top_logprobs, 0,
          "With --logprobs: also the N most likely tokens at each output "
          "position, in [0, 20] (generate --json prints output_top_logprobs: "
          "[[id, logprob], ...] per output token).");
ABSL_FLAG(std::string, dtype, "fp32",
          "Compute dtype: fp32, bf16 or fp16 (fp16: CUDA only).");
ABSL_FLAG(std::string, device, "cpu", "cpu, cuda or cuda:N.");
ABSL_FLAG(std::string, threads, "auto",
          "CPU threads: auto (measure decode and prefill at 1..cores threads "
          "once per model, dtype and SIMD target, keep the fastest of each in "
          "the profile cache), N, or 0 = one per core.");
ABSL_FLAG(bool, json, false,
          "Print one JSON object with ids, text and timings instead of text.");
ABSL_FLAG(std::string, shape, "",
          "make-model: the model shape (see `knapserve make-model`).");
ABSL_FLAG(std::string, out, "",
          "make-model: output folder; profile: output file.");
ABSL_FLAG(std::string, tokenizer, "",
          "make-model: a tokenizer.json to copy into the new model (default: a "
          "synthetic "
          "byte-level one, or the shared SmolLM tokenizer for smollm2-135m).");
ABSL_FLAG(std::string, prompts, "",
          "bench: a Spec-Bench style JSONL prompt file (default "
          "<shared>/bench/spec_bench/question.jsonl).");
ABSL_FLAG(int32_t, num_prompts, 8,
          "bench: prompts to run (spread over the categories).");
ABSL_FLAG(int64_t, min_prompt_tokens, 0,
          "bench: repeat each prompt's text until it has at least this many "
          "tokens (long-context "
          "runs).");
ABSL_FLAG(int32_t, repeats, 1,
          "bench: runs per prompt (the median is reported).");
ABSL_FLAG(std::string, spec, "off",
          "Speculation mode: off (autoregressive), static (draft with the "
          "--skip mask), "
          "knapspec (the KnapSpec planner picks mask and gamma every "
          "--plan-interval steps; "
          "its latency profile: --profile or the profile cache), clasp (the "
          "CLaSp baseline: "
          "--clasp-layers whole layers), knn (KNN-SSD: each request drafts "
          "with the mask of the domain its prompt is nearest to; --anchors) "
          "or specbound (early-exit drafting: "
          "--specbound-lambda, --specbound-t0, --specbound-depth, "
          "--specbound-check-every, --exit-heads; width bound --max-draft).");
ABSL_FLAG(std::string, anchors, "",
          "KNN-SSD domain anchors made by `knapserve anchors` for this model: "
          "needed by --spec knn (each request drafts with the mask and draft "
          "length of the domain its prompt is nearest to).");
ABSL_FLAG(std::vector<std::string>, domains, {},
          "KNN-SSD domains, NAME=FILE[#CATEGORY],...: FILE is a prompt set "
          "(.jsonl; #CATEGORY keeps that category's rows) or a text file of "
          "blank-line separated samples; a NAME may repeat. `anchors` builds "
          "the anchors from them, `bench spec` runs a mixed-domain stream.");
ABSL_FLAG(std::string, split, "",
          "Which samples of each --domains source to use: all, train (the "
          "even-indexed ones) or test (the odd-indexed ones). Default: train "
          "for `anchors`, test for `bench spec`, so the two are disjoint.");
ABSL_FLAG(std::string, skip, "",
          "Layer mask of the draft: skipped sublayers, e.g. a3,m3,m7 (aN "
          "attention, mN MLP of "
          "layer N, 0-based). With knapspec/clasp: the mask before the first "
          "plan (empty: "
          "autoregressive until then).");
ABSL_FLAG(
    std::string, profile, "",
    "knapspec/clasp (generate, bench, serve, executor, planner): the latency "
    "profile JSON "
    "(`knapserve profile` writes one); it must match the model, device, dtype. "
    "Default: "
    "the profile cache (--profile-cache), measured and stored on a miss.");
ABSL_FLAG(
    std::string, profile_cache, "",
    "knapspec/clasp without --profile: the latency profile cache folder. "
    "Default: "
    "$KNAPSERVE_PROFILE_CACHE, else $XDG_CACHE_HOME/knapserve/profiles, else "
    "$HOME/.cache/knapserve/profiles. Entries are keyed by model fingerprint, "
    "device, "
    "dtype and threads; a miss measures the profile (seconds for small models) "
    "and "
    "stores it.");
ABSL_FLAG(std::vector<std::string>, modes, {},
          "bench spec: modes to compare, off first (default: off, static if "
          "--skip or "
          "--search-masks, clasp and knapspec if --profile). A planned mode "
          "may name a "
          "remote planner: knapspec@host:port. A mode named again runs "
          "again, reported as off#2, ... (off twice: the machine's spread).");
ABSL_FLAG(int64_t, long_context_tokens, 0,
          "bench spec: also run a long-context set whose prompts are repeated "
          "to this many "
          "tokens (capped to fit the context with --max-new-tokens); 0 = off.");
ABSL_FLAG(std::string, listen, "",
          "planner/executor/serve: address to serve on, e.g. 0.0.0.0:50051.");
ABSL_FLAG(std::string, server, "",
          "generate: send the request to a knapserve executor at host:port "
          "instead of "
          "loading the model here.");
ABSL_FLAG(int64_t, max_plan_request_bytes, int64_t{512} << 20,
          "planner and its clients: largest plan request message in bytes; "
          "the planner ends a stream that sends a larger one "
          "(RESOURCE_EXHAUSTED), and an executor fails such a request alone "
          "without sending it.");
ABSL_FLAG(std::string, planner, "inproc",
          "generate/bench with knapspec or clasp: where plans come from: "
          "inproc (a planner "
          "thread in this process) or host:port of a knapserve-planner.");
ABSL_FLAG(int32_t, clasp_layers, 0,
          "clasp: whole layers the draft skips (M); 0 = half.");
ABSL_FLAG(int32_t, planner_threads, 1,
          "knapspec/clasp: CPU threads of the planner's solves.");
ABSL_FLAG(std::string, planner_priority, "auto",
          "knapspec/clasp: scheduling of the planner thread: a Linux nice "
          "value 0..19, normal (= 0), or idle (SCHED_IDLE: it runs only on "
          "cores decoding leaves idle, so plans may never come while decoding "
          "keeps every core busy); auto = 19 when the model runs on the CPU "
          "and the decode's threads and the planner's together outnumber the "
          "cores (the solve would share the decode's cores), else normal.");
ABSL_FLAG(double, knapspec_max_skip, 0.5,
          "knapspec: the largest share of the model's sublayer cost a draft "
          "may skip, in (0, 1] (the DP's work grows with it; planner/planner.h "
          "KnapSpecOptions::max_skipped_share has measurements).");
ABSL_FLAG(bool, knapspec_pool_alpha, true,
          "knapspec: pool the candidates' measured acceptance along their "
          "cosine order before choosing (planner/planner.h "
          "KnapSpecOptions::pool_alpha); false takes each candidate's own "
          "share, the best of which is the luckiest.");
ABSL_FLAG(std::string, planner_cores, "0",
          "knapspec/clasp: cores the decode's passes leave to the planner "
          "while a solve runs (a number), so the solve ends in its CPU time "
          "and the decode runs on fewer cores meanwhile; auto = "
          "--planner-threads when the model runs on the CPU and the decode's "
          "threads and the planner's together outnumber the cores, else 0.");
ABSL_FLAG(std::vector<std::string>, profile_contexts, {},
          "profile: context lengths to measure (default 128,512,1024,2048,4096 "
          "and the model's "
          "context, those that fit).");
ABSL_FLAG(int32_t, profile_repeats, 20,
          "profile: timed runs per point (median kept).");
ABSL_FLAG(double, profile_point_budget, 3.0,
          "profile: seconds a point may take before its runs stop at 3 timed "
          "ones after one warm-up (large models, slow CPUs); 0 = no limit.");
ABSL_FLAG(int32_t, profile_max_draft, 10,
          "profile: the verify table covers 1..N+1 tokens (the planner's "
          "largest gamma).");
ABSL_FLAG(std::optional<int32_t>, max_draft, std::nullopt,
          "Draft tokens per speculation step at most: gamma for --spec static "
          "(default 5), the "
          "planner's largest gamma D for knapspec/clasp (default 10).");
ABSL_FLAG(double, exit_threshold, 0.7,
          "Stop drafting when the draft's top-1 probability falls below this.");
ABSL_FLAG(double, specbound_lambda, knapserve::SpecBoundConfig().lambda,
          "specbound: a draft token exits at the first checked layer where the "
          "top-1 probability of softmax(z_l / T_l) reaches this; [0, 1].");
ABSL_FLAG(std::optional<double>, specbound_t0, std::nullopt,
          "specbound: the exit temperature after layer 0 (>= 1); it falls "
          "linearly to 1 after the last layer. Default: 2.5 with the model's "
          "own heads, 1 with trained heads.");
ABSL_FLAG(int32_t, specbound_depth, knapserve::SpecBoundConfig().depth_bound,
          "specbound: the depth bound, layers a draft token may run without "
          "exiting before drafting ends (0 = all layers).");
ABSL_FLAG(int32_t, specbound_check_every,
          knapserve::SpecBoundConfig().check_every,
          "specbound: check the exit head every this many layers (and at the "
          "depth bound).");
ABSL_FLAG(std::string, exit_heads, "auto",
          "specbound's exit heads: 'auto' (the trained heads of MODEL_DIR/"
          "exit_heads.safetensors when that file exists, else the model's "
          "own), 'model' (the model's own final norm and LM head at every "
          "layer, training-free), 'trained' (MODEL_DIR/exit_heads.safetensors, "
          "see train-exit-heads; an error without it) or a .safetensors file "
          "of trained heads.");
ABSL_FLAG(int64_t, plan_interval, 64,
          "knapspec/clasp: at least this many decode steps between two "
          "snapshots a sequence "
          "sends to the planner (T).");
ABSL_FLAG(int64_t, reference_steps, 16,
          "knapspec/clasp: verification steps whose hidden states make one "
          "snapshot (m).");
ABSL_FLAG(int64_t, plan_bucket_tokens, 256,
          "knapspec/clasp: width of the plan cache's context buckets ([0, N), "
          "[N, 2N), ...). "
          "A sequence entering a bucket uses the process's cached plan for it, "
          "or asks the "
          "planner for one.");
ABSL_FLAG(
    double, drift_tolerance, 0.2,
    "knapspec/clasp: replan when the observed per-token acceptance of the plan "
    "in force differs from its alpha_hat by more than this, or its steps' "
    "draft tokens from the plan's expected drafts per step by more than this "
    "share of them (after --drift-min-tokens).");
ABSL_FLAG(int64_t, drift_min_tokens, 40,
          "knapspec/clasp: acceptance trials (accepted draft tokens + "
          "rejections) under a plan "
          "before drift is judged.");
ABSL_FLAG(int64_t, sequence_prior_tokens, 32,
          "knapspec/clasp: a sequence chooses its gamma again from its own "
          "drafting under the plan in force, with the other requests' pooled "
          "odds worth at most this many draft tokens (0 = off: the plan "
          "cache's odds for every sequence).");
ABSL_FLAG(int64_t, plain_recheck_steps, 1024,
          "knapspec/clasp: solve a context bucket's plain plan (no "
          "speculation) again after the process has decoded this many plain "
          "steps under it, twice as many after each recheck that stays "
          "plain; 0 = never.");
ABSL_FLAG(int64_t, plan_refine_trials, 32,
          "knapspec/clasp/static: refine a cached plan each time the draft "
          "tokens decoded under it (accept trials) grow by this many: pool "
          "their acceptance and confidence with the plan's reference tokens "
          "and choose its gamma and predictions again with the planner's "
          "prices. 0 = never.");
ABSL_FLAG(bool, warm_plan_cache, false,
          "bench spec: before the timed runs, generate every prompt once per "
          "mode with the "
          "plan cache the mode is then timed with (a server's steady state: "
          "plans already "
          "made for these context buckets). Off: the timed runs include the "
          "first solves.");
ABSL_FLAG(double, planner_budget, 0.05,
          "knapspec/clasp: planner CPU budget, solve seconds over decode "
          "seconds of the whole "
          "process; a replanning trigger waits while the share is above it. 0 "
          "= no limit.");
ABSL_FLAG(bool, guard, true,
          "Every drafting mode (static, knapspec, clasp, knn, specbound): the "
          "online guard: decode plainly (gamma 0) while the setting in force "
          "measures slower than plain decoding at the same context bucket, "
          "over every request drafting with it, until it is measured again "
          "(--guard_reprobe_steps) or a new plan takes effect.");
ABSL_FLAG(double, guard_margin, knapserve::kMinSpeculationGain,
          "The guard: speculation must measure at least (1 + this) times the "
          "plain rate to stay on.");
ABSL_FLAG(int64_t, guard_min_steps, 16,
          "The guard: a setting's speculative steps at a context bucket, "
          "from every request drafting with it, between two judgements.");
ABSL_FLAG(int64_t, guard_probe_steps, 8,
          "The guard: plain steps it measures, alternating with the setting's "
          "steps, when the context bucket has no recent plain timings.");
ABSL_FLAG(int64_t, guard_reprobe_steps, 256,
          "Plain steps a losing guard verdict holds, over every request of the "
          "same setting and context bucket, before the setting is measured "
          "again.");
ABSL_FLAG(bool, guard_carry, true,
          "The guard: a losing verdict also holds the context buckets just "
          "below and above its own where the setting was never judged "
          "(--guard_reprobe_steps plain steps, then it is measured there).");
ABSL_FLAG(bool, guard_settle_plain, true,
          "The guard: a sequence's first steps after its prefill, which are "
          "no evidence, decode plainly while its drafting setting has not "
          "won a judgement at the context bucket (a setting that won drafts "
          "from the first step).");
ABSL_FLAG(bool, guard_clear_losses, true,
          "The guard: a setting far below plain decoding (a clear loss) is "
          "held plain twice as long as a narrow loser, and its loss also "
          "holds the mode's other settings (static, knn, specbound) that "
          "were never judged at that context.");
ABSL_FLAG(bool, guard_confirm_losses, true,
          "The guard: a narrow loss against plain steps measured at another "
          "time is confirmed by a probe (plain steps alternating with the "
          "setting's) before it holds the setting plain; the probe's pairs "
          "decide.");
ABSL_FLAG(double, guard_confirm_confidence, 1.0,
          "The guard: standard errors of benefit of the doubt a narrow "
          "loss's confirmation grants the setting (>= 0); 0: the setting "
          "must draft at least --guard-margin faster than the probe's plain "
          "steps to go on.");
ABSL_FLAG(double, guard_explore_share, 0.005,
          "The guard: a losing setting is held plain for at least what its "
          "judged steps cost over plain decoding divided by this share, so "
          "re-measuring a clear loser costs at most about this share of the "
          "plain steps; in [0, 1), 0 = off.");
ABSL_FLAG(bool, search_masks, false,
          "bench spec: first find a static mask by greedy forward selection "
          "(start from no "
          "skip; each round, skip the one more sublayer that gives the best "
          "measured decode "
          "tok/s on the calibration prompts; stop when none improves), then "
          "compare it with "
          "--spec off. Replaces --skip.");
ABSL_FLAG(int32_t, search_prompts, 3,
          "bench spec --search-masks: calibration prompts.");
ABSL_FLAG(
    int64_t, search_tokens, 64,
    "bench spec --search-masks: tokens generated per calibration prompt.");
ABSL_FLAG(int32_t, search_max_steps, 0,
          "bench spec --search-masks: at most this many steps taken "
          "(sublayers, or layers with "
          "--search-whole-layers); 0 = no limit.");
ABSL_FLAG(double, search_min_gain, 0.01,
          "bench spec --search-masks: a round's best candidate is kept only if "
          "it beats the "
          "current mask by this fraction, in its first measurement and in a "
          "re-measurement "
          "(guards against picking timing noise).");
ABSL_FLAG(bool, search_edge_layers, false,
          "bench spec --search-masks: also try skipping sublayers of the first "
          "and last layer "
          "(the KnapSpec reference code never does).");
ABSL_FLAG(bool, search_whole_layers, false,
          "bench spec --search-masks: each step skips a whole layer (attention "
          "and MLP) instead "
          "of one sublayer.");
ABSL_FLAG(int64_t, context_length, 512,
          "bench step-cost: positions already in the KV cache when a step is "
          "timed (capped to "
          "fit the model's context).");
ABSL_FLAG(int32_t, step_repeats, 30,
          "bench step-cost: timed runs per measurement (the median is "
          "reported, after 3 "
          "warm-up runs).");

namespace knapserve {

std::vector<std::string> ParseFlagsWithDashes(int argc, char** argv) {
  // Abseil names flags with underscores; rewrite "--a-b[=v]" to "--a_b[=v]"
  // up to "--".
  std::vector<std::string> normalized(argv, argv + argc);
  for (size_t i = 1; i < normalized.size(); ++i) {
    std::string& arg = normalized[i];
    if (arg == "--") break;
    if (arg.size() < 3 || arg[0] != '-') continue;
    const size_t name_begin = arg[1] == '-' ? 2 : 1;
    const size_t name_end = std::min(arg.find('='), arg.size());
    std::replace(arg.begin() + name_begin, arg.begin() + name_end, '-', '_');
  }
  std::vector<char*> pointers;
  for (std::string& arg : normalized) pointers.push_back(arg.data());
  std::vector<char*> rest = absl::ParseCommandLine(
      static_cast<int>(pointers.size()), pointers.data());
  return std::vector<std::string>(rest.begin(), rest.end());
}

absl::StatusOr<std::vector<int64_t>> TokenCountsFromFlag(
    const std::string& flag, const std::vector<std::string>& items) {
  std::vector<int64_t> counts;
  for (const std::string& item : items) {
    int64_t n = 0;
    if (!absl::SimpleAtoi(item, &n) || n < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--", flag, ": '", item, "' is not a positive token count"));
    }
    counts.push_back(n);
  }
  return counts;
}

absl::StatusOr<std::string> ModelDirFromFlags() {
  std::string dir = absl::GetFlag(FLAGS_model);
  if (!dir.empty()) return dir;
  return DefaultModelDir();
}

absl::StatusOr<Engine> LoadEngineFromFlags() {
  RETURN_IF_ERROR(simd::EnsureChosen());
  ModelOptions options;
  ASSIGN_OR_RETURN(options.dtype, ParseDtype(absl::GetFlag(FLAGS_dtype)));
  ASSIGN_OR_RETURN(options.device, ParseDevice(absl::GetFlag(FLAGS_device)));
  const std::string threads_flag = absl::GetFlag(FLAGS_threads);
  const int cores =
      static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const bool auto_threads = threads_flag == "auto";
  int threads = cores;
  if (!auto_threads &&
      (!absl::SimpleAtoi(threads_flag, &threads) || threads < 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--threads must be auto or a count >= 0, not \"", threads_flag, "\""));
  }
  if (threads == 0) threads = cores;
  options.threads = threads;
  Engine engine;
  ASSIGN_OR_RETURN(engine.model_dir, ModelDirFromFlags());
  ASSIGN_OR_RETURN(engine.model, LlamaModel::Load(engine.model_dir, options));
  ASSIGN_OR_RETURN(engine.tokenizer,
                   Tokenizer::FromFile(engine.model_dir + "/tokenizer.json"));
  if (const std::string anchors = absl::GetFlag(FLAGS_anchors);
      !anchors.empty()) {
    ASSIGN_OR_RETURN(engine.router,
                     DomainRouter::Load(anchors, engine.model->config(),
                                        engine.model->weights_fingerprint()));
  }
  ASSIGN_OR_RETURN(engine.exit_heads, ExitHeadsFromFlags(engine));
  std::cerr << "knapserve: " << simd::Describe() << std::endl;
  if (auto_threads && engine.model->device().is_cpu()) {
    ASSIGN_OR_RETURN(
        ThreadChoice choice,
        ChooseThreads(*engine.model,
                      ProfileCacheDir(absl::GetFlag(FLAGS_profile_cache)),
                      cores));
    for (const std::string& warning : choice.warnings) {
      std::cerr << "knapserve: warning: " << warning << std::endl;
    }
    ApplyThreadChoice(choice);
    std::cerr << "knapserve: " << choice.Describe() << std::endl;
  } else {
    std::cerr << "knapserve: threads " << at::get_num_threads()
              << (auto_threads ? " (one per core)" : " (--threads)")
              << std::endl;
  }
  return engine;
}

absl::StatusOr<std::shared_ptr<const ExitHeads>> ExitHeadsFromFlags(
    const Engine& engine) {
  const std::string which = absl::GetFlag(FLAGS_exit_heads);
  if (which == "model") return std::shared_ptr<const ExitHeads>();
  const std::string beside = DefaultExitHeadsPath(engine.model_dir);
  if (which == "auto") {
    if (!std::filesystem::exists(beside))
      return std::shared_ptr<const ExitHeads>();
    std::cerr << "knapserve: specbound: trained exit heads " << beside
              << " (--exit-heads model for the model's own)" << std::endl;
  }
  return ExitHeads::Load(which == "trained" || which == "auto" ? beside : which,
                         *engine.model);
}

void ApplyExitHeads(const Engine& engine, SpeculationConfig& speculation) {
  SpecBoundConfig& specbound = speculation.specbound;
  specbound.heads = engine.exit_heads;
  specbound.trained_heads = engine.exit_heads != nullptr;
  specbound.t0 = absl::GetFlag(FLAGS_specbound_t0)
                     .value_or(specbound.trained_heads ? kTrainedExitHeadsT0
                                                       : SpecBoundConfig().t0);
}

// The sampling flags (temperature, top-k/p, min-p, seed and the logits
// processors' flags); InvalidArgument naming the flag for a --logit-bias or
// --bad-words that does not parse (ranges are the request's checks).
absl::StatusOr<SamplingParams> SamplingParamsFromFlags() {
  SamplingParams params;
  params.temperature = absl::GetFlag(FLAGS_temperature);
  params.top_k = absl::GetFlag(FLAGS_top_k);
  params.top_p = absl::GetFlag(FLAGS_top_p);
  params.min_p = absl::GetFlag(FLAGS_min_p);
  params.seed = absl::GetFlag(FLAGS_seed);
  absl::StatusOr<DraftAcceptance> acceptance =
      ParseDraftAcceptance(absl::GetFlag(FLAGS_draft_acceptance));
  if (!acceptance.ok()) {
    return Annotate(acceptance.status(), "--draft-acceptance");
  }
  params.acceptance = *acceptance;
  params.repetition_penalty = absl::GetFlag(FLAGS_repetition_penalty);
  params.presence_penalty = absl::GetFlag(FLAGS_presence_penalty);
  params.frequency_penalty = absl::GetFlag(FLAGS_frequency_penalty);
  params.min_tokens = absl::GetFlag(FLAGS_min_tokens);
  for (const std::string& item : absl::GetFlag(FLAGS_logit_bias)) {
    const std::vector<std::string> parts = absl::StrSplit(item, ':');
    int32_t id = 0;
    double bias = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &id) ||
        !absl::SimpleAtod(parts[1], &bias)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--logit-bias: '", item, "' is not ID:BIAS (e.g. 42:-100)"));
    }
    params.logit_bias[id] = bias;
  }
  for (absl::string_view word :
       absl::StrSplit(absl::GetFlag(FLAGS_bad_words), ',', absl::SkipEmpty())) {
    std::vector<int32_t> ids;
    for (absl::string_view token :
         absl::StrSplit(word, ' ', absl::SkipWhitespace())) {
      int32_t id = 0;
      if (!absl::SimpleAtoi(token, &id)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--bad-words: '", token,
                         "' is not a token id (sequences are comma-separated, "
                         "their ids space-separated)"));
      }
      ids.push_back(id);
    }
    params.bad_words.push_back(std::move(ids));
  }
  return params;
}

absl::StatusOr<v1::GenerateRequest> WireRequestFromFlags() {
  ASSIGN_OR_RETURN(const SamplingParams sampling, SamplingParamsFromFlags());
  if (sampling.acceptance != DraftAcceptance::kAuto) {
    return absl::InvalidArgumentError(
        "--draft-acceptance is an in-process setting: a server accepts "
        "drafts its own way (coupled with a seed, else rejection)");
  }
  v1::GenerateRequest request;
  request.set_max_new_tokens(
      static_cast<int32_t>(absl::GetFlag(FLAGS_max_new_tokens)));
  request.set_temperature(sampling.temperature);
  request.set_top_k(static_cast<int32_t>(
      std::clamp<int64_t>(sampling.top_k, INT32_MIN, INT32_MAX)));
  request.set_top_p(sampling.top_p);
  request.set_min_p(sampling.min_p);
  if (sampling.seed.has_value()) request.set_seed(*sampling.seed);
  request.set_repetition_penalty(sampling.repetition_penalty);
  request.set_presence_penalty(sampling.presence_penalty);
  request.set_frequency_penalty(sampling.frequency_penalty);
  request.mutable_logit_bias()->insert(sampling.logit_bias.begin(),
                                       sampling.logit_bias.end());
  request.set_min_tokens(static_cast<int32_t>(
      std::clamp<int64_t>(sampling.min_tokens, INT32_MIN, INT32_MAX)));
  for (const std::vector<int32_t>& word : sampling.bad_words)
    request.add_bad_words()->mutable_ids()->Add(word.begin(), word.end());
  request.set_ignore_eos(absl::GetFlag(FLAGS_ignore_eos));
  request.set_logprobs(absl::GetFlag(FLAGS_logprobs));
  request.set_top_logprobs(absl::GetFlag(FLAGS_top_logprobs));
  for (const std::string& stop : absl::GetFlag(FLAGS_stop))
    request.add_stop(stop);
  ASSIGN_OR_RETURN(SpeculationMode mode,
                   ParseSpeculationMode(absl::GetFlag(FLAGS_spec)));
  v1::SpeculationOptions* spec = request.mutable_speculation();
  spec->set_mode(ToWireMode(mode));
  if (absl::GetFlag(FLAGS_max_draft).has_value()) {
    spec->set_max_draft_tokens(
        static_cast<uint32_t>(*absl::GetFlag(FLAGS_max_draft)));
  }
  if (!absl::GetFlag(FLAGS_skip).empty())
    spec->set_static_mask(absl::GetFlag(FLAGS_skip));
  spec->set_exit_threshold(absl::GetFlag(FLAGS_exit_threshold));
  if (DraftsByEarlyExit(mode)) {
    spec->set_specbound_lambda(absl::GetFlag(FLAGS_specbound_lambda));
    // Unset: the server's defaults, which follow its heads.
    if (const std::optional<double> t0 = absl::GetFlag(FLAGS_specbound_t0))
      spec->set_specbound_t0(*t0);
    spec->set_specbound_depth_bound(static_cast<uint32_t>(
        std::max(0, absl::GetFlag(FLAGS_specbound_depth))));
    spec->set_specbound_check_every(static_cast<uint32_t>(
        std::max(0, absl::GetFlag(FLAGS_specbound_check_every))));
    const std::string heads = absl::GetFlag(FLAGS_exit_heads);
    if (heads != "auto") spec->set_specbound_trained_heads(heads != "model");
  }
  return request;
}

absl::StatusOr<GenerationRequest> GenerationRequestFromFlags(
    std::vector<int32_t> prompt_ids) {
  GenerationRequest request;
  request.prompt_ids = std::move(prompt_ids);
  request.max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  ASSIGN_OR_RETURN(request.sampling, SamplingParamsFromFlags());
  request.stop_strings = absl::GetFlag(FLAGS_stop);
  request.ignore_eos = absl::GetFlag(FLAGS_ignore_eos);
  request.logprobs = absl::GetFlag(FLAGS_logprobs);
  request.top_logprobs = absl::GetFlag(FLAGS_top_logprobs);
  ASSIGN_OR_RETURN(request.speculation.mode,
                   ParseSpeculationMode(absl::GetFlag(FLAGS_spec)));
  request.speculation.skip = absl::GetFlag(FLAGS_skip);
  request.speculation.max_draft =
      absl::GetFlag(FLAGS_max_draft)
          .value_or(DefaultMaxDraft(request.speculation.mode));
  request.speculation.clasp_layers = absl::GetFlag(FLAGS_clasp_layers);
  request.speculation.exit_threshold = absl::GetFlag(FLAGS_exit_threshold);
  SpecBoundConfig& specbound = request.speculation.specbound;
  specbound.lambda = absl::GetFlag(FLAGS_specbound_lambda);
  specbound.t0 =
      absl::GetFlag(FLAGS_specbound_t0).value_or(SpecBoundConfig().t0);
  specbound.depth_bound = absl::GetFlag(FLAGS_specbound_depth);
  specbound.check_every = absl::GetFlag(FLAGS_specbound_check_every);
  // ApplyExitHeads settles the heads (and T_0) once the engine is loaded.
  specbound.trained_heads = false;
  request.speculation.plan_interval = absl::GetFlag(FLAGS_plan_interval);
  request.speculation.reference_steps = absl::GetFlag(FLAGS_reference_steps);
  request.speculation.plan_bucket_tokens =
      absl::GetFlag(FLAGS_plan_bucket_tokens);
  request.speculation.drift_tolerance = absl::GetFlag(FLAGS_drift_tolerance);
  request.speculation.drift_min_tokens = absl::GetFlag(FLAGS_drift_min_tokens);
  request.speculation.plain_recheck_steps =
      absl::GetFlag(FLAGS_plain_recheck_steps);
  request.speculation.sequence_prior_tokens =
      absl::GetFlag(FLAGS_sequence_prior_tokens);
  request.speculation.planner_budget = absl::GetFlag(FLAGS_planner_budget);
  request.speculation.guard = absl::GetFlag(FLAGS_guard);
  request.speculation.guard_margin = absl::GetFlag(FLAGS_guard_margin);
  request.speculation.guard_min_steps = absl::GetFlag(FLAGS_guard_min_steps);
  request.speculation.guard_probe_steps =
      absl::GetFlag(FLAGS_guard_probe_steps);
  request.speculation.guard_reprobe_steps =
      absl::GetFlag(FLAGS_guard_reprobe_steps);
  request.speculation.guard_carry = absl::GetFlag(FLAGS_guard_carry);
  request.speculation.guard_settle_plain =
      absl::GetFlag(FLAGS_guard_settle_plain);
  request.speculation.guard_clear_losses =
      absl::GetFlag(FLAGS_guard_clear_losses);
  request.speculation.guard_confirm_losses =
      absl::GetFlag(FLAGS_guard_confirm_losses);
  request.speculation.guard_confirm_confidence =
      absl::GetFlag(FLAGS_guard_confirm_confidence);
  request.speculation.guard_explore_share =
      absl::GetFlag(FLAGS_guard_explore_share);
  return request;
}

ObtainProfileOptions ObtainProfileOptionsFromFlags() {
  ObtainProfileOptions options;
  options.profile_path = absl::GetFlag(FLAGS_profile);
  options.cache_dir = ProfileCacheDir(absl::GetFlag(FLAGS_profile_cache));
  options.max_draft = std::max(10, absl::GetFlag(FLAGS_max_draft).value_or(10));
  return options;
}

absl::StatusOr<ObtainedProfile> LatencyProfileFromFlags(
    const Engine& engine, const std::string& command) {
  const LlamaModel& model = *engine.model;
  const ObtainProfileOptions options = ObtainProfileOptionsFromFlags();
  const std::string prefix = absl::StrCat("knapserve ", command, ": ");
  auto measure = [&]() -> absl::StatusOr<LatencyProfile> {
    std::cerr << prefix
              << "no --profile and no usable entry in the profile cache"
              << (options.cache_dir.empty()
                      ? ""
                      : absl::StrCat(" ", options.cache_dir))
              << "; measuring the latency profile now" << std::endl;
    ProfileOptions quick = QuickProfileOptions(model, options.max_draft);
    quick.measure_overhead = StepOverheadFunction(model, *engine.tokenizer);
    return ProfileModel(model, quick);
  };
  ASSIGN_OR_RETURN(ObtainedProfile obtained,
                   ObtainProfile(ProfileKey::Of(model), options, measure));
  for (const std::string& warning : obtained.warnings) {
    std::cerr << prefix << "warning: " << warning << std::endl;
  }
  switch (obtained.origin) {
    case ProfileOrigin::kFile:
      std::cerr << prefix << "latency profile from --profile " << obtained.path
                << std::endl;
      break;
    case ProfileOrigin::kCacheHit:
      std::cerr << prefix << "latency profile: cache hit " << obtained.path
                << std::endl;
      break;
    case ProfileOrigin::kMeasured:
      std::cerr << prefix << "latency profile: measured in "
                << absl::StrFormat("%.1f", obtained.measure_seconds) << " s"
                << (obtained.path.empty()
                        ? ", not stored"
                        : absl::StrCat(", stored in ", obtained.path))
                << std::endl;
      break;
  }
  return obtained;
}

absl::StatusOr<ThreadPriority> PlannerPriorityFromFlags(
    const LlamaModel& model) {
  const std::string flag = absl::GetFlag(FLAGS_planner_priority);
  if (flag != "auto") {
    absl::StatusOr<ThreadPriority> parsed = ParseThreadPriority(flag);
    if (!parsed.ok()) return Annotate(parsed.status(), "--planner-priority");
    return parsed;
  }
  return ThreadPriority::Nice(PlannerSharesTheDecodesCores(model) ? 19 : 0);
}

bool PlannerSharesTheDecodesCores(const LlamaModel& model) {
  if (!model.device().is_cpu()) return false;
  const int decode_threads = at::get_num_threads();
  const int planner_threads = std::max(1, absl::GetFlag(FLAGS_planner_threads));
  return decode_threads + planner_threads > UsableCores();
}

absl::StatusOr<int> PlannerCoresFromFlags(const LlamaModel& model) {
  const std::string flag = absl::GetFlag(FLAGS_planner_cores);
  if (flag == "auto") {
    return PlannerSharesTheDecodesCores(model)
               ? std::max(1, absl::GetFlag(FLAGS_planner_threads))
               : 0;
  }
  int cores = 0;
  if (!absl::SimpleAtoi(flag, &cores) || cores < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--planner-cores: want auto or a number >= 0, got '", flag, "'"));
  }
  return cores;
}

absl::StatusOr<KnapSpecOptions> KnapSpecOptionsFromFlags() {
  KnapSpecOptions options;
  options.max_skipped_share = absl::GetFlag(FLAGS_knapspec_max_skip);
  options.pool_alpha = absl::GetFlag(FLAGS_knapspec_pool_alpha);
  RETURN_IF_ERROR(Annotate(CheckSkippedShare(options.max_skipped_share),
                           "--knapspec-max-skip"));
  return options;
}

absl::StatusOr<InProcessPlannerOptions> PlannerOptionsFromFlags(
    const LlamaModel& model) {
  InProcessPlannerOptions options;
  options.threads = absl::GetFlag(FLAGS_planner_threads);
  ASSIGN_OR_RETURN(options.priority, PlannerPriorityFromFlags(model));
  ASSIGN_OR_RETURN(options.reserve_cores, PlannerCoresFromFlags(model));
  ASSIGN_OR_RETURN(options.knapspec, KnapSpecOptionsFromFlags());
  return options;
}

absl::StatusOr<std::unique_ptr<InProcessPlanner>> PlannerFromFlags(
    const Engine& engine, SpeculationMode mode, const std::string& command,
    ProfileSource* source) {
  if (!IsPlanned(mode)) return nullptr;
  ASSIGN_OR_RETURN(ObtainedProfile obtained,
                   LatencyProfileFromFlags(engine, command));
  if (source != nullptr) {
    source->origin = std::string(ProfileOriginName(obtained.origin));
    source->path = obtained.path;
  }
  ASSIGN_OR_RETURN(InProcessPlannerOptions options,
                   PlannerOptionsFromFlags(*engine.model));
  return InProcessPlanner::Create(*engine.model, std::move(obtained.profile),
                                  options);
}

absl::StatusOr<PlannerHandle> PlannerClientFromFlags(
    const Engine& engine, SpeculationMode mode, const std::string& command) {
  PlannerHandle handle;
  if (!IsPlanned(mode)) return handle;
  const std::string where = absl::GetFlag(FLAGS_planner);
  if (where == "inproc") {
    ASSIGN_OR_RETURN(handle.local,
                     PlannerFromFlags(engine, mode, command, &handle.profile));
    return handle;
  }
  if (where.empty() || where == "none") {
    return absl::InvalidArgumentError(
        absl::StrCat("--spec ", SpeculationModeName(mode),
                     " needs --planner inproc or host:port"));
  }
  ASSIGN_OR_RETURN(
      RemotePlannerOptions options,
      RemotePlannerOptionsFromFlags(where, engine.model->num_layers()));
  handle.remote = std::make_unique<RemotePlannerClient>(std::move(options));
  return handle;
}

absl::StatusOr<RemotePlannerOptions> RemotePlannerOptionsFromFlags(
    const std::string& address, int num_layers) {
  RemotePlannerOptions options;
  ASSIGN_OR_RETURN(options.credentials, ClientCredentialsFromFlags());
  options.address = address;
  options.num_layers = num_layers;
  options.max_message_bytes = static_cast<int>(std::clamp<int64_t>(
      absl::GetFlag(FLAGS_max_plan_request_bytes), 1, INT32_MAX));
  return options;
}

namespace {
sigset_t StopSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  return signals;
}
}  // namespace

absl::StatusOr<std::string> ListenAddressAndBlockStopSignals() {
  const std::string listen = absl::GetFlag(FLAGS_listen);
  if (listen.empty())
    return absl::InvalidArgumentError("--listen ADDR is required");
  const sigset_t signals = StopSignals();
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  return listen;
}

int WaitForStopSignal() {
  const sigset_t signals = StopSignals();
  int received = 0;
  sigwait(&signals, &received);
  return received;
}

int ExitCode(const absl::Status& status, const char* command) {
  if (status.ok()) return 0;
  std::cerr << "knapserve " << command << ": " << status << std::endl;
  return status.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace knapserve
