// Sequence and RunBatchStep: the one decode loop of knapserve, written as a
// state machine so that many sequences can share every forward pass
// (continuous batching) and a single sequence runs exactly the same code.
//
// A Sequence is one generation request in flight: its prompt, sampler,
// stop conditions and text stream, its speculation state (mask, gamma, the
// planned modes' PlanController and plan session), its statistics, and where
// its K/V lives (a contiguous cache, or blocks of the executor's KvPool).
// RunBatchStep advances every sequence of a batch by one step:
//
//   1. each decoding sequence begins its step: plan bookkeeping (a cached
//      or newly solved plan takes effect, the guard decides), then the
//      number of tokens it may draft;
//   2. draft rounds: every sequence still drafting feeds its newest token
//      through the model with its own layer mask, all of them in one
//      masked pass per round (ragged draft lengths simply drop out); a
//      SpecBound sequence (executor/engine/specbound.h) instead runs its newest
//      row up by one exit-check interval per round (with the rows that lag
//      below it) and checks its exit head; then SpecBound's alignment
//      passes bring its rows to the deepest exit;
//   3. one main pass: decoding sequences verify [last, drafts...] (one row
//      when not speculating; SpecBound's from its deepest exit layer up,
//      from the cached hidden states), prefilling sequences add a chunk of
//      their prompt, within --max-batch-tokens (decode rows first, so running
//      streams keep their pace while a long prompt loads);
//   4. each sequence accepts, commits, streams and checks its stop
//      conditions (executor/engine/speculation_step.h's AcceptDrafts, so the
//      output is the model's own, token for token).
// Every logits row a sequence chooses from (prefill, draft, SpecBound exit,
// verification) first goes through its logits processors
// (executor/engine/logits_processors.h) with that position's own history:
// the committed output plus the step's drafts before it.
//
// Passes go through LlamaModel::ForwardBatch, whose rows are batch-invariant
// on CPU: a sequence's tokens do not depend on who shares its batch.
//
// Tracing (common/trace, when a tracer is installed): a planned sequence's
// plans are spans under GenerationRequest::trace_parent: plan.snapshot
// (the captured steps; its traceparent goes with the PlanRequest),
// plan.receive (on the planner's callback thread) and plan.apply (the plan
// in force, with the tokens per second it realized).
//
// Errors: whatever one sequence's own work throws (its callbacks, its plan
// bookkeeping, the test hook) fails that sequence only, with Internal naming
// the step. A forward pass that throws fails every sequence in that pass.
//
// Thread safety: a Sequence and RunBatchStep are used by one thread at a
// time (the engine's step thread, or the caller of Generate). Callbacks run
// on that thread.
#ifndef KNAPSERVE_EXECUTOR_ENGINE_SEQUENCE_H_
#define KNAPSERVE_EXECUTOR_ENGINE_SEQUENCE_H_

#include <chrono>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/model/exit_heads.h"
#include "common/model/layer_mask.h"
#include "common/model/llama.h"
#include "common/plan/batch_cost_model.h"
#include "common/plan/planner_client.h"
#include "common/text/tokenizer.h"
#include "executor/engine/generator.h"
#include "executor/engine/kv_pool.h"
#include "executor/engine/logits_processors.h"
#include "executor/engine/reference_states.h"
#include "executor/engine/sampler.h"
#include "executor/engine/specbound.h"
#include "executor/engine/speculation_step.h"
#include "executor/planning/domain_router.h"

namespace knapserve {

class PlanSession;

class Sequence {
 public:
  // Validates `request` (InvalidArgument naming the field;
  // FailedPrecondition for a planned mode without a planner) and sets the
  // sequence up. `planner` and `shared` as for Generate(); they must outlive
  // the sequence.
  static absl::StatusOr<std::unique_ptr<Sequence>> Create(
      const LlamaModel& model, const Tokenizer& tokenizer,
      GenerationRequest request, StreamCallback on_tokens,
      ReferenceCallback on_reference, PlannerClient* planner,
      const PlanningShared* shared);
  ~Sequence();
  Sequence(const Sequence&) = delete;
  Sequence& operator=(const Sequence&) = delete;

  // K/V positions this sequence may ever write: prompt + max output (capped
  // at the context), drafts included.
  int64_t max_positions() const { return prompt_len_ + limit_; }
  int64_t prompt_tokens() const { return prompt_len_; }
  // Where its K/V lives; exactly one, set before the first step and kept
  // alive (by the caller) until the sequence is destroyed.
  void UseKv(std::vector<LayerKv>* contiguous);
  void UseKv(SequenceKv* paged);

  bool prefilling() const { return !done_ && prefilled_ < prompt_len_; }
  // Whether the whole prompt is in the K/V (also after the sequence ended).
  bool prefilled() const { return prefilled_ == prompt_len_; }

  // A request's n > 1 choices (executor/engine/batch_engine.h) prefill once.
  // The first choice keeps its prompt's last logits row (KeepPrefillLogits,
  // before its prefill ends); every other choice, its paged K/V already
  // holding the prompt (SequenceKv::SharePrefix), starts decoding from them
  // with its own sampler (StartFromPrefill), taking the prompt's routing
  // vector and prompt logprobs from `first`. A contiguous K/V works the
  // same way when the caller has put the prompt's K/V in it (the step
  // overhead measurement, tools/step_overhead.h, runs many sequences from
  // one prefill in one buffer: each writes only positions past the prompt).
  // `first` must hold the same prompt; only its length is checked.
  // FailedPrecondition when `first` has not kept its prefill, the prompts'
  // lengths differ, no K/V is bound or this one already started.
  void KeepPrefillLogits() { keep_prefill_logits_ = true; }
  absl::Status StartFromPrefill(const Sequence& first);
  // Committed K/V positions.
  int64_t context_length() const { return length_; }
  // The speculation counters so far (the result's `speculation` at the
  // end): after each step, how many tokens it drafted and accepted.
  const SpeculationStats& speculation() const { return spec_stats_; }
  // How this sequence would draft next (gamma 0 and no mask when it does
  // not), with its acceptance so far under a Beta(1, 1) prior.
  BatchMember batch_member() const;
  bool done() const { return done_; }
  // Whether it ended with an error (Fail).
  bool failed() const { return done_ && !error_.ok(); }
  // Ends the sequence now with FinishReason::kAborted (cancelled, deadline
  // passed, Abort), keeping what it generated.
  void Abort();
  // Ends the sequence now with `status` (an error).
  void Fail(absl::Status status);
  // The outcome, once done(): the result, or the error that ended it.
  absl::StatusOr<GenerationResult> TakeResult();

 private:
  friend struct BatchStepRunner;
  Sequence(const LlamaModel& model, const Tokenizer& tokenizer,
           GenerationRequest request, StreamCallback on_tokens,
           ReferenceCallback on_reference, LayerMask mask);

  // Fills the K/V fields of `input` (and grows paged K/V to `positions`).
  absl::Status BindKv(BatchSequence& input, int64_t positions);
  // Step begin for a decoding sequence: hook, plans, draft budget (none
  // unless allow_drafts).
  void BeginStep(bool allow_drafts);
  // A draft pass's logits ([vocab]) for this sequence.
  void OnDraftLogits(const torch::Tensor& logits);
  // SpecBound, inside a draft pass (BatchSequence::after_layer of the
  // newest row): at a check depth, the exit head of `state` (after `layer`);
  // an exit records the draft's scaled logits and sets exit_stop_, which
  // stops the pass for this sequence's rows. Never throws: an error is kept
  // in exit_error_ (and stops the pass) for OnExitPass.
  void OnExitCheck(int layer, const torch::Tensor& state);
  // SpecBound: the outputs of a draft pass (exit_rows_.DraftPass's groups,
  // their output states and reached depths): drafts from an exit, or ends
  // drafting at a bound.
  absl::Status OnExitPass(absl::Span<const torch::Tensor> states,
                          absl::Span<const int> reached);
  // SpecBound: the mask the batch cost model prices a draft with (the
  // layers above the mean exit depth skipped).
  void UpdateExitCostMask();
  // The main pass's logits for the prefill chunk that ended the prompt.
  absl::Status OnPrefillDone(const torch::Tensor& logits);
  // With prompt_logprobs: a prefill chunk's logits, one row per prompt
  // position from `start`; adds the log-probabilities of the prompt tokens
  // they predict.
  void OnPromptLogits(const torch::Tensor& logits, int64_t start);
  // The main pass's logits ([m+1, vocab]) and boundary states of a decode
  // step; the step's seconds run from the end of the previous one
  // (step_mark_) to its acceptance.
  absl::Status OnVerified(const torch::Tensor& logits,
                          const torch::Tensor& states);
  // Commits `tokens` one by one, streaming them; sets done_ at a stop.
  // `logits` holds each token's raw full-model logits in its rows (row j
  // for tokens[j]), read only when the request asked for logprobs or
  // logits.
  absl::Status Commit(const std::vector<int32_t>& tokens,
                      const torch::Tensor& logits);
  // Ends the sequence normally and fills the result's totals.
  void Finish();
  // kKnn, after the prefill: routes routing_ to a domain and takes the mask
  // and gamma of its draft for prompts of this one's length
  // (RoutedDomain::DraftFor) for the rest of the generation.
  void Route();
  // The drafting modes that are not planned (static, knn, specbound): their
  // guard (the planned modes' is in their PlanController), keyed by
  // `setting` (the mode and what fixes its drafts).
  void StartGuard(const std::string& setting);

  const LlamaModel& model_;
  GenerationRequest request_;
  StreamCallback on_tokens_;
  std::vector<float> pending_logprobs_;  // Commit's scratch, per token
  std::vector<std::vector<TokenLogprob>> pending_top_;  // the same
  ReferenceCallback on_reference_;
  const bool planned_;
  int64_t prompt_len_ = 0;
  int64_t limit_ = 0;  // most output tokens (max_new_tokens within context)
  Sampler sampler_;
  // Steps 1-5 of the sampling pipeline (logits_processors.h), with this
  // sequence's history: every position's logits go through them before the
  // sampler or an argmax sees them.
  LogitsProcessors processors_;
  std::vector<torch::Tensor> logit_rows_;  // return_logits: one per token
  TextStream stream_;
  LayerMask mask_;
  int gamma_ = 0;
  SpeculationStats spec_stats_;
  ReferenceStateCollector collector_;
  ReferenceStateCollector planned_collector_;
  std::unique_ptr<PlanSession> plans_;
  // The process's planning state, or empty. Every sequence records its
  // plain steps for the guards in shared_.plain_rates (under execution_id_)
  // when the process shares one.
  PlanningShared shared_;
  std::string execution_id_;
  std::unique_ptr<SpeculationGuard> guard_;  // StartGuard
  // kKnn: the process's domain anchors, and the prompt's routing vector
  // (built by the prefill's chunks; chunk_states_ is the pass's output).
  std::shared_ptr<const DomainRouter> router_;
  RoutingVector routing_;
  torch::Tensor chunk_states_;
  std::vector<LayerKv>* contiguous_ = nullptr;
  SequenceKv* paged_ = nullptr;

  GenerationResult result_;
  absl::Status error_;
  bool done_ = false;
  bool started_ = false;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point decode_start_;
  int64_t prefilled_ = 0;  // prompt positions in the K/V
  // KeepPrefillLogits: the prompt's last row of logits, once prefilled.
  bool keep_prefill_logits_ = false;
  torch::Tensor prefill_logits_;
  int64_t length_ = 0;  // committed K/V positions

  // The current decode step.
  int64_t step_ = 0;
  bool capture_ = false;
  int64_t capture_offset_ = 0;
  int64_t budget_ = 0;  // drafts allowed this step
  int step_gamma_ = 0;  // the gamma this step runs with (0: plain)
  // Unplanned modes: a solve of the process was in flight when this step
  // began (its plain time is then no plain rate; RecordPlainStep).
  bool step_began_beside_solve_ = false;
  bool drafting_ = false;
  std::vector<int32_t> drafts_;
  std::vector<torch::Tensor> draft_dists_;
  // SpecBound (DraftsByEarlyExit): its rows and hidden-state cache, the heads
  // and the resolved depth bound (1..L).
  const bool early_exit_;
  SpecBoundRows exit_rows_;
  // The current draft pass's exit (OnExitCheck): the stop flag its groups
  // share, the processed z_l / T_l of the exit (undefined without one) and
  // an error of the check.
  bool exit_stop_ = false;
  torch::Tensor exit_scaled_;
  absl::Status exit_error_;
  std::shared_ptr<const ExitHeads> exit_heads_;
  int depth_bound_ = 0;
  // A draft token of this step exited below the model's last layer (else
  // the step saved nothing: StepObservation::saved_no_layers).
  bool exited_below_last_layer_ = false;
  LayerMask exit_cost_mask_;
  // When this sequence's previous decode step ended (its OnVerified; the
  // first step: decode_start_). A step's seconds are the wall time from
  // there to the end of its acceptance: everything the sequence waited for
  // since its last tokens, passes and the engine's own work alike, as the
  // planner's latency profile prices a step (o_step, o_draft).
  std::chrono::steady_clock::time_point step_mark_;
};

struct BatchStepOptions {
  // Rows of the main pass: decode rows always run; prefill chunks fill what
  // is left, at least min_prefill_rows when a prompt is waiting.
  int64_t max_batch_tokens = 512;
  int64_t min_prefill_rows = 16;
  // At most this many prompt rows in the step, over all prompts (the
  // engine's step-time budget; it wins over min_prefill_rows).
  int64_t max_prefill_rows = std::numeric_limits<int64_t>::max();
  // Whether sequences may draft this step (false: every decoding sequence
  // takes a plain step, as at a batch size where speculation stops paying).
  bool allow_drafts = true;
};

// What one RunBatchStep did (for metrics and the engine's pacing).
struct BatchStepStats {
  int decoding = 0;    // sequences that decoded a step
  int prefilling = 0;  // sequences that prefilled a chunk
  int64_t draft_passes = 0;
  int64_t main_rows = 0;     // rows of the main pass
  int64_t prefill_rows = 0;  // of which prompt rows
  double seconds = 0;
};

// Advances every sequence of `batch` that is not done by one step (see the
// file comment). Sequences with their K/V bound.
BatchStepStats RunBatchStep(const LlamaModel& model,
                            absl::Span<Sequence* const> batch,
                            const BatchStepOptions& options);

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_ENGINE_SEQUENCE_H_
