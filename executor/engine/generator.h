// Generation of one sequence: validation, prefill, the decode loop, stop
// conditions (EOS ids, stop token ids, stop strings, max_new_tokens, the
// context limit) and streaming of finalized text.
//
// Generate() decodes autoregressively (SpeculationMode::kOff: one full
// forward per token), with self-speculative decoding under a fixed layer
// mask (kStatic, see executor/engine/speculation_step.h), or under plans
// (kKnapSpec, kClasp) from the process's plan cache
// (executor/planning/plan_cache.h) and, on a trigger only, from a planner:
// executor/planning/plan_controller.h decides when (no cached plan for the
// context bucket, a new bucket, acceptance drifting from the plan's alpha_hat,
// a plain plan's recheck; subject to the planner CPU budget), and then the
// reference states of reference_steps verification steps go to the
// PlannerClient without waiting; its plan lands in the cache and is applied at
// the next step boundary. Before the first plan it decodes with the `skip` mask
// if one is given, else autoregressively; a failed plan leaves the last plan in
// force. The online guard decodes plainly while a plan measures slower than
// plain decoding. kSpecBound drafts by early exit (executor/engine/specbound.h)
// and verifies from the deepest exit layer up. Every mode gives the same greedy
// output. Several tokens committed in one step are checked for stop conditions
// one by one, so a step never emits past EOS or a stop. The stop-string logic
// lives in TextStream so every decoding mode shares it: text that could still
// turn out to be the beginning of a stop string is held back until it is known
// not to be, and text after a stop string is never emitted.
//
// Thread safety: Generate() touches only its arguments; several threads may
// generate concurrently with the same model and tokenizer.
#ifndef KNAPSERVE_EXECUTOR_ENGINE_GENERATOR_H_
#define KNAPSERVE_EXECUTOR_ENGINE_GENERATOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/model/exit_heads.h"
#include "common/model/llama.h"
#include "common/plan/planner_client.h"
#include "common/plan/step_forecast.h"
#include "common/text/tokenizer.h"
#include "common/trace/span_context.h"
#include "executor/engine/reference_states.h"
#include "executor/engine/sampler.h"
#include "executor/engine/speculation_mode.h"
#include "executor/engine/speculation_step.h"
#include "executor/planning/plan_cache.h"
#include "executor/planning/plan_controller.h"

namespace knapserve {

// SpecBound's per-request settings (executor/engine/specbound.h says what each
// does). The defaults were chosen by a small search on the stories dev
// prompts with stories-24l (README.md, SpecBound: lambda x T_0 with the
// bounds open, then the depth bound x the check interval, then the width;
// the width bound is max_draft, DefaultMaxDraft(kSpecBound) = 6).
struct SpecBoundConfig {
  // A draft token exits at the first checked layer l where the top-1
  // probability of softmax(z_l / T_l) reaches lambda; [0, 1].
  double lambda = 0.7;
  // T_0, the exit temperature after layer 0; T_l falls linearly to 1 after
  // the last layer (ExitTemperature). >= 1. The default suits the
  // training-free heads (the default heads), whose shallow layers are
  // overconfident; trained heads did best with 1 (README.md, SpecBound).
  double t0 = 2.5;
  // Depth bound: layers a draft token may run without exiting before
  // drafting ends for the step; 0 = all layers. [0, L].
  int depth_bound = 0;
  // The exit head is checked every `check_every` layers (after layers
  // k-1, 2k-1, ...) and at the depth bound (so a k above the depth bound
  // checks only there). >= 1.
  int check_every = 8;
  // Which exit heads: false = the model's own final norm and LM head
  // (training-free); true = `heads`, the trained heads the process loaded.
  bool trained_heads = false;
  // The trained heads (set by the server or CLI from --exit-heads, never by
  // a client); required when trained_heads.
  std::shared_ptr<const ExitHeads> heads;
};

struct SpeculationConfig {
  SpeculationMode mode = SpeculationMode::kOff;
  std::string skip;   // layer mask text ("a3,m3,m7") for kStatic; for
                      // planned modes the mask before the first plan
  int max_draft = 5;  // gamma (kStatic) or D, the planner's largest gamma; >= 1
                      // (DefaultMaxDraft(mode) is the flags' default)
  double exit_threshold = 0.7;  // stop drafting when top-1 prob < this; [0, 1]
  int64_t plan_interval =
      64;  // T: at least T steps between two snapshots of a sequence, >= 1
  // m: verification steps captured per snapshot, >= 1, <= T. 16: a first
  // snapshot (plain steps, one token each) gives the planner 16 reference
  // tokens, the most KnapSpec uses. With 5, one confident draft in five
  // made a first plan (gamma 4, stories-24l) expect 1.39 drafts a step
  // where the engine then made 1.96.
  int64_t reference_steps = 16;
  int clasp_layers = 0;  // kClasp: M whole layers skipped; 0 = half the layers
  // Planned modes (IsPlanned: kKnapSpec, kClasp)
  // (executor/planning/plan_controller.h).
  int64_t plan_bucket_tokens = 256;  // plan cache context bucket width, >= 1
  // |observed acceptance - alpha_hat| that replans, and the share of the
  // plan's predicted drafts per step by which the steps' drafts may differ;
  // > 0.
  double drift_tolerance = 0.2;
  int64_t drift_min_tokens =
      40;  // acceptance trials before drift is judged, >= 1
  // Plain steps the process decodes under a bucket's plain plan before it is
  // solved again (doubling each time it stays plain); 0 = never, >= 0.
  int64_t plain_recheck_steps = 1024;
  // A sequence's own drafting against the other requests' under the same
  // plan: their pooled odds count as at most this many draft tokens when
  // the sequence chooses its gamma again from its own (0 = off: every
  // sequence decodes with the plan cache's odds), >= 0.
  int64_t sequence_prior_tokens = 32;
  double planner_budget =
      0.05;  // solve seconds / decode seconds, process-wide; 0 = no limit
  bool guard = true;  // the online guard (plain decoding while a plan loses)
  // Speculation must beat plain by this fraction; >= 0.
  double guard_margin = kMinSpeculationGain;
  int64_t guard_min_steps = 16;  // speculative steps per guard judgement, >= 1
  int64_t guard_probe_steps =
      8;  // plain steps measured when the bucket has none, >= 1
  // Plain steps a losing verdict holds (over every sequence decoding under
  // it) before the setting is measured again, >= 1.
  int64_t guard_reprobe_steps = 256;
  // A losing verdict also holds the buckets beside its own where the
  // setting was never judged (GuardOptions::carry_neighbour_losses).
  bool guard_carry = true;
  // GuardOptions::settle_plain (--guard-settle-plain).
  bool guard_settle_plain = true;
  // GuardOptions::clear_losses (--guard-clear-losses).
  bool guard_clear_losses = true;
  // GuardOptions::confirm_losses (--guard-confirm-losses).
  bool guard_confirm_losses = true;
  // GuardOptions::confirm_confidence (--guard-confirm-confidence), >= 0.
  double guard_confirm_confidence = 1.0;
  // GuardOptions::explore_share (--guard-explore-share), in [0, 1); 0: off.
  double guard_explore_share = 0.005;
  // SpecBound (kSpecBound, executor/engine/specbound.h): early-exit drafting.
  // Its width bound is max_draft (the longest run of drafts per step).
  SpecBoundConfig specbound;
};

struct GenerationRequest {
  uint64_t sequence_id =
      0;  // the planner's key for this sequence; 0 = assign one
  std::vector<int32_t>
      prompt_ids;                // must be non-empty, shorter than the context
  int64_t max_new_tokens = 128;  // >= 1
  SamplingParams sampling;
  std::vector<std::string> stop_strings;  // output ends before the first match
  std::vector<int32_t> stop_token_ids;    // output ends after such a token
  bool ignore_eos = false;                // keep going past the model's EOS ids
  // Report each output token's log-probability under the model
  // (GenerationResult::output_logprobs, and the stream): log_softmax of the
  // full model's logits at that position, before temperature and top-p, so
  // the same for greedy and sampled requests and for every speculation mode.
  bool logprobs = false;
  // With logprobs: also the `top_logprobs` most likely ids at each output
  // position and their log-probabilities, from the same full-model
  // log_softmax (GenerationResult::output_top_logprobs, and the stream), so
  // the same in every speculation mode. In [0, kMaxTopLogprobs]; > 0 needs
  // logprobs.
  int top_logprobs = 0;
  // Report each prompt token's log-probability after the first (the first
  // has no position before it): the full model's log_softmax at the
  // position before it, from the prefill's logits
  // (GenerationResult::prompt_logprobs, and with the first output tokens in
  // the stream); with top_logprobs also that many alternatives. The prefill
  // then computes the logits of every prompt row, in chunks of at most
  // kPromptLogprobsChunk rows (bounding that memory).
  bool prompt_logprobs = false;
  // Return the raw logits (before the logits processors and the sampler) of
  // every output position: GenerationResult::output_logits (for
  // `knapserve generate --dump-logits` and an outside check of the
  // processors, tests/testing/check_logits_processors.py).
  bool return_logits = false;
  int64_t prefill_chunk = 512;  // positions per prefill forward
  // OpenAI's n and best_of: choices returned and candidates generated (0 =
  // n), each in [1, kMaxChoices] with best_of >= n. Served by the service
  // through BatchEngine::GenerateChoices (executor/engine/batch_engine.h);
  // Generate() and a Sequence make one choice and ignore them.
  int n = 1;
  int best_of = 0;
  SpeculationConfig speculation;
  // The trace this generation belongs to (common/trace): the span its plan
  // spans (plan.snapshot, plan.apply) hang from, the service's decode span.
  // Invalid (the default): plan spans start traces of their own, when
  // tracing is on at all.
  trace::SpanContext trace_parent;
  // Fault injection for tests; empty (the default) in production, where it
  // costs one empty-function check per step. Runs before decode step `step`
  // (0-based, after prefill) does its forward passes, on the generating
  // thread, inside the step's exception boundary: whatever it throws fails
  // this generation the way a LibTorch error in that step's forward would.
  std::function<void(int64_t step)> before_step_for_tests;
};

// Most choices (n, best_of) one request may ask for.
inline constexpr int kMaxChoices = 16;
// Most alternatives GenerationRequest::top_logprobs may ask for (OpenAI's).
inline constexpr int kMaxTopLogprobs = 20;
// Most prompt rows per prefill pass of a request with prompt_logprobs.
inline constexpr int64_t kPromptLogprobsChunk = 64;

// One alternative at a position: a token id and its log-probability under
// the full model (before the logits processors and temperature).
struct TokenLogprob {
  int32_t id = 0;
  float logprob = 0;
  bool operator==(const TokenLogprob&) const = default;
};

enum class FinishReason { kEos, kLength, kStopSequence, kAborted };
// "eos", "length", "stop_sequence", "aborted".
std::string FinishReasonName(FinishReason reason);

struct GenerationStats {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  double prefill_seconds = 0;  // prompt forward + first token
  double decode_seconds = 0;   // everything after the first token
  double total_seconds = 0;
  double draft_seconds = 0;  // inside decode_seconds: masked draft forwards
  double verify_seconds =
      0;  // inside decode_seconds: full forwards (all of them when off)
  // Inside decode_seconds: time the decode thread spent on planning (building
  // and submitting requests, applying plans). It never blocks on a solve.
  double waiting_seconds = 0;
  // kKnn: routing the prompt to its domain (after the prefill, outside
  // prefill_seconds and decode_seconds).
  double routing_seconds = 0;
  int64_t steps = 0;          // decode steps (full forwards after prefill)
  int64_t plan_requests = 0;  // snapshots sent to the planner
  int64_t plan_failures =
      0;  // requests answered with an error (last plan kept)
  // The same instants on the system clock, nanoseconds since the Unix epoch
  // (for trace spans; 0 when it did not get there): the sequence's first
  // pass, its first token, its end.
  int64_t first_pass_unix_nanos = 0;
  int64_t first_token_unix_nanos = 0;
  int64_t end_unix_nanos = 0;
  // prompt_tokens / prefill_seconds and (completion_tokens - 1) /
  // decode_seconds.
  double prefill_tokens_per_second() const;
  double decode_tokens_per_second() const;
};

// A plan as the executor applied it.
struct AppliedPlan {
  int64_t applied_step = 0;  // decode step it took effect at
  int64_t plan_step = 0;     // the plan boundary its reference states came from
  int64_t age_steps = 0;     // applied_step - plan_step: steps it was in flight
  std::string mask;          // "" = nothing skipped
  int gamma = 0;             // 0 = autoregressive until the next plan
  double alpha_hat = 0;      // share on the reference tokens (DraftPlan's)
  double alpha_smoothed = 0;  // the alpha the TPT objective used (0: gamma 0)
  // Draft tokens of drafting evidence behind alpha_hat and the predictions
  // (the cache refined the plan: executor/planning/plan_refinement.h); 0:
  // the planner's reference tokens alone.
  int64_t evidence_trials = 0;
  // What predicted_tpt expects of one step: tokens committed and draft
  // tokens made (below gamma when drafts stop on low confidence).
  double predicted_tokens_per_step = 1;
  double predicted_drafts_per_step = 0;
  double predicted_tpt = 0;  // tokens per second the latency model predicts
  double baseline_tpt = 0;   // the same for autoregressive decoding
  int num_candidates = 0;
  double solve_seconds = 0;
  double queue_seconds = 0;
  int64_t context_length = 0;  // n the plan was made for
  // Where it came from: "cache" (a cached plan, applied on entering its
  // context bucket), "solve" (this sequence's own request) or "shared" (a
  // solve another sequence requested for the same bucket) or "refined" (the
  // cached plan in force, with the gamma the drafting evidence of the
  // requests under it chose: executor/planning/plan_refinement.h; no solve)
  // or "sequence" (the plan in force with this sequence's own odds: its own
  // drafting weighed above the other requests'; gamma and predictions chosen
  // again, mask kept).
  // For "cache", "shared", "refined" and "sequence", plan_step is the
  // solve's step and age_steps is 0.
  std::string source;
  // What the plan did while it was in force and ran as planned: the steps
  // that drafted with it (for a gamma-0 plan, its plain steps; a step the
  // guard made plain is not counted, nor one whose draft budget the end of
  // the generation held below gamma), the tokens they committed, their wall
  // seconds, and their draft tokens proposed and accepted. predicted_tpt is
  // the latency model's promise for exactly these steps. A step that ran
  // while a solve of the process was in flight (PlanController::
  // last_step_beside_solve) is not among them: the solve shared the cores,
  // which the latency model does not price (the planner's share of the
  // cores is PlanningStats' planner budget); such steps are counted in
  // beside_solve_* instead. Nor is an unsteady one (ClassifyPlanStep,
  // executor/planning/plan_controller.h): one of the sequence's first
  // settle steps after its prefill, which run slower for every mode (plain
  // decoding too), or a preempted one (over the guard's outlier factor
  // times the plan's calibrated seconds a step); the plain rate and the
  // draft cost that calibrate the prediction leave out the same steps.
  // Such steps are counted in unsteady_* instead.
  int64_t measured_steps = 0;
  int64_t measured_tokens = 0;
  double measured_seconds = 0;
  int64_t measured_drafted = 0;
  int64_t measured_accepted = 0;
  int64_t beside_solve_steps = 0;
  int64_t beside_solve_tokens = 0;
  double beside_solve_seconds = 0;
  int64_t unsteady_steps = 0;
  int64_t unsteady_tokens = 0;
  double unsteady_seconds = 0;
  // measured_tokens / measured_seconds; 0 before a measured step.
  double measured_tpt() const {
    return measured_seconds > 0
               ? static_cast<double>(measured_tokens) / measured_seconds
               : 0.0;
  }
  // The measured steps' second moments: sums over them of tokens^2,
  // tokens x seconds and seconds^2, so that measured_tpt's uncertainty is
  // known, and plans can be pooled (tools' bench spec): a plan measured
  // over 6 steps cannot tell a 10% miss from its steps' spread.
  double measured_tokens_sq = 0;
  double measured_token_seconds = 0;
  double measured_seconds_sq = 0;
  // measured_tpt's standard error from the steps' spread
  // (RateStandardError, executor/planning/plan_controller.h); 0 below 2
  // measured steps.
  double measured_tpt_standard_error() const {
    return RateStandardError(
        measured_steps, static_cast<double>(measured_tokens), measured_seconds,
        measured_tokens_sq, measured_token_seconds, measured_seconds_sq);
  }
  // Plain decoding's tokens/s that the engine measured at the context bucket
  // where the plan took effect, read as it took effect, before its first
  // step (the guard's plain-rate table: the bucket's last 32 plain steps of
  // any sequence of the execution, none older than the guard's
  // plain_max_age_seconds, preempted steps and steps beside a solve left
  // out); 0 when the bucket had too few (GuardOptions::probe_steps).
  double measured_plain_tpt = 0;
  // How drafting steps' cost compared with the latency model's when the
  // plan took effect: the mean over the bucket's recent drafting steps of
  // any sequence of the execution, any planned mode (the last 32 that
  // measured their plan at its own bucket, past the guard's settle steps
  // and with no solve in flight, none older than the guard's
  // plain_max_age_seconds, outliers out: PlanController::DraftCostRatio) of
  // a step's seconds over its plan's predicted seconds a step
  // (predicted_tokens_per_step / predicted_tpt). 1.1: drafting steps ran
  // 10% slower than their plans predicted. 0 for a gamma-0 plan, or when
  // the bucket had fewer than the guard's probe_steps such steps (a cold
  // start: the first plans of a bucket).
  double draft_cost_ratio = 0;
  // The prediction on the machine's speed as it was when the plan took
  // effect: predicted_tpt x measured_plain_tpt / baseline_tpt, the plan's
  // promise relative to plain decoding (the speed-up the TPT objective chose
  // it for) times plain decoding's rate at its bucket just before. The
  // latency profile was measured earlier, minutes or days, and a shared
  // machine's speed moves by a quarter within minutes. A gap between
  // calibrated_tpt() and measured_tpt() is the planner's (acceptance, or
  // drafting steps' cost moving against plain ones). Every input precedes
  // the plan's steps, so it is a prediction, not its own measurement. 0
  // without a measured plain rate.
  double calibrated_tpt() const {
    return baseline_tpt > 0 && measured_plain_tpt > 0
               ? predicted_tpt * measured_plain_tpt / baseline_tpt
               : 0.0;
  }
  // A second calibration, reported beside it: predicted_tpt /
  // draft_cost_ratio, the plan's tokens a step over its predicted step time
  // as the bucket's recent drafting steps measured against theirs. 0 for a
  // gamma-0 plan or without a ratio. Against calibrated_tpt() it shows how
  // far drafting steps' cost moved apart from plain steps'; measured on
  // steady steps, calibrated_tpt() came the closer of the two
  // (tools/README.md has the runs).
  double draft_calibrated_tpt() const {
    return gamma > 0 && draft_cost_ratio > 0 ? predicted_tpt / draft_cost_ratio
                                             : 0.0;
  }
};

struct GenerationResult {
  std::vector<int32_t>
      output_ids;  // generated ids, including a final EOS/stop id
  std::string
      text;  // decoded output, special tokens skipped, cut at a stop string
  // With GenerationRequest::logprobs: one per output id (else empty).
  std::vector<float> output_logprobs;
  // With GenerationRequest::top_logprobs > 0: per output id, that many
  // alternatives, most likely first (ties by the smaller id); else empty.
  std::vector<std::vector<TokenLogprob>> output_top_logprobs;
  // With GenerationRequest::prompt_logprobs: one per prompt id after the
  // first, and with top_logprobs that many alternatives each; else empty.
  std::vector<float> prompt_logprobs;
  std::vector<std::vector<TokenLogprob>> prompt_top_logprobs;
  // With GenerationRequest::return_logits: float32 [output ids, vocab] on the
  // CPU, row i the full model's raw logits that chose output_ids[i].
  torch::Tensor output_logits;
  FinishReason finish_reason = FinishReason::kLength;
  std::string matched_stop;  // the stop string that ended it, if any
  uint64_t seed = 0;         // the sampler seed used
  int index = 0;             // the choice it is, in [0, n)
  // The sum of output_logprobs (set with logprobs, and with best_of > n).
  std::optional<double> cumulative_logprob;
  std::string mask;  // the layer mask used ("" when off)
  GenerationStats stats;
  SpeculationStats speculation;
  std::vector<AppliedPlan>
      plans;               // kKnapSpec / kClasp: every plan applied, in order
  PlanningStats planning;  // kKnapSpec / kClasp: cache, triggers, budget, guard
  std::string last_plan_error;  // the planner's last error ("" if none)
  // kKnn: the domain the prompt routed to ("" in other modes) and the cosine
  // similarity of its last hidden vector with the nearest anchor.
  std::string routed_domain;
  double routing_similarity = 0;
};

// The log-probabilities of one step's new ids, as the request asked for
// them: `chosen` one per id (GenerationRequest::logprobs, else empty) and
// `top` one list of alternatives per id (top_logprobs > 0, else empty).
// With prompt_logprobs, the first step also carries the prompt's
// (GenerationResult::prompt_logprobs and prompt_top_logprobs); later steps
// leave them empty (every member defaults to empty, so a brace list may name
// only the first ones). Borrowed for the callback's duration.
struct StepLogprobs {
  absl::Span<const float> chosen = {};
  absl::Span<const std::vector<TokenLogprob>> top = {};
  absl::Span<const float> prompt = {};
  absl::Span<const std::vector<TokenLogprob>> prompt_top = {};
};

// Receives each step's newly generated ids, the text they finalized (which
// may be empty, e.g. half of a UTF-8 character) and their log-probabilities
// when the request asked for them. Returning false aborts the generation
// (FinishReason::kAborted).
using StreamCallback =
    std::function<bool(absl::Span<const int32_t> ids, std::string_view text,
                       const StepLogprobs& logprobs)>;
// Receives each reference-state snapshot as it completes (the planner's input).
using ReferenceCallback = std::function<void(ReferenceStates&& states)>;

// Checks SpecBound's settings against the model: InvalidArgument naming the
// field; FailedPrecondition when trained heads are asked for and none are
// set.
absl::Status ValidateSpecBoundConfig(const SpecBoundConfig& config,
                                     const LlamaModel& model);
// Checks `request` against the model: InvalidArgument naming the field.
absl::Status ValidateGenerationRequest(const GenerationRequest& request,
                                       const LlamaModel& model);

// Incremental detokenization plus stop strings for one sequence.
class TextStream {
 public:
  TextStream(const Tokenizer& tokenizer, std::vector<int32_t> prompt_ids,
             std::vector<std::string> stop_strings);
  // Adds one generated id; returns the text that is now safe to emit.
  // Sets stopped() when a stop string completed (its text is not emitted).
  absl::StatusOr<std::string> Push(int32_t id);
  // Remaining held-back text at the end of generation (empty after a stop).
  std::string Finish();
  bool stopped() const { return matched_stop_.has_value(); }
  const std::optional<std::string>& matched_stop() const {
    return matched_stop_;
  }
  // All text emitted so far.
  const std::string& emitted() const { return emitted_text_; }

 private:
  std::string TakeSafeText(bool final);

  IncrementalDecoder decoder_;
  std::vector<std::string> stop_strings_;
  std::string text_;    // all finalized text, emitted or held
  size_t emitted_ = 0;  // bytes of text_ already emitted
  std::string emitted_text_;
  std::optional<std::string> matched_stop_;
};

// Generation (autoregressive or speculative). Planned modes need a
// `planner` (FailedPrecondition without one); it must outlive the call.
// `shared`: the process's plan cache, planner budget, plain-rate and draft-cost
// tables (see PlanningShared::Create); nullptr gives the call fresh ones of its
// own, as if it were the first request of a new process. Errors: invalid
// request (InvalidArgument naming the field); Internal when anything inside
// throws (a c10::Error from a LibTorch check, any std::exception, a throwing
// callback): the prefill and every decode step (draft, verify, commit,
// callbacks) run inside an exception boundary that turns the exception into an
// Internal status naming the step, and no exception leaves Generate. The
// sequence's KV cache is freed on return.
absl::StatusOr<GenerationResult> Generate(
    const LlamaModel& model, const Tokenizer& tokenizer,
    const GenerationRequest& request, const StreamCallback& on_tokens = nullptr,
    const ReferenceCallback& on_reference = nullptr,
    PlannerClient* planner = nullptr, const PlanningShared* shared = nullptr);

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_ENGINE_GENERATOR_H_
