// BatchEngine: continuous batching. One step thread runs every admitted
// sequence in shared forward passes (executor/engine/sequence.h's
// RunBatchStep): each decode step is one pass over all running sequences (plus
// their draft passes when they speculate), and long prompts are prefilled in
// chunks inside the same passes, so running streams keep getting tokens while a
// prompt loads.
//
// Pacing: while sequences decode, prompt rows per step are limited so that
// a step carrying them costs at most prefill_step_budget times a
// decode-only step of every sequence in the batch (the time per decode row
// and per prompt row measured online, as moving averages), which bounds the
// inter-token latency a long prompt inflicts on running streams.
//
// Admission: a sequence joins the batch when the K/V pool
// (executor/engine/kv_pool.h) can reserve blocks for its longest possible
// length and fewer than max_running sequences run; otherwise it waits, first
// come first served. A request that could never fit the whole pool is refused
// at once (ResourceExhausted). Its blocks go back to the pool the moment it
// ends: finish, stop condition, cancellation, deadline, Abort or error.
//
// Speculation in a batch: each sequence keeps its own mode, mask, gamma and
// planner state; sequences with gamma > 0 draft in shared masked passes and
// verify inside the main pass. Before each step with two or more decoding
// sequences, the cost model (priced from the latency profile) compares the
// step drafting against all plain; when a pass over sum(gamma+1) rows plus
// the draft passes costs more than the tokens it saves, the step runs
// without drafts (vLLM's disable-by-batch-size, chosen per step from the
// profile). A fixed plain_batch_size can cap it as well.
//
// Ownership: borrows the model, tokenizer, pool and planner (they must
// outlive the engine); owns its step thread. The destructor stops the
// thread after aborting whatever still runs.
//
// Thread safety: Generate may be called from any number of threads at once
// (each call blocks its caller until its sequence ends); callbacks run on
// the engine's step thread, one at a time. Gauges may be read from any
// thread.
#ifndef KNAPSERVE_EXECUTOR_ENGINE_BATCH_ENGINE_H_
#define KNAPSERVE_EXECUTOR_ENGINE_BATCH_ENGINE_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/model/llama.h"
#include "common/plan/batch_cost_model.h"
#include "common/plan/planner_client.h"
#include "common/text/tokenizer.h"
#include "executor/engine/generator.h"
#include "executor/engine/kv_pool.h"
#include "executor/engine/sequence.h"
#include "executor/planning/plan_cache.h"

namespace knapserve {

struct BatchEngineOptions {
  // Rows of one main pass (--max-batch-tokens): decode rows always run,
  // prompt chunks fill the rest.
  int64_t max_batch_tokens = 256;
  // A waiting prompt gets at least this many rows per step (unless the
  // step-time budget allows fewer).
  int64_t min_prefill_rows = 16;
  // While sequences decode, a step that also carries prompt rows may take
  // at most this many times as long as a decode-only step of all the
  // batch's sequences (--prefill-step-budget): the engine measures, online,
  // the time per decode row and per prompt row, and admits that many
  // prompt rows. On a CPU a pass is compute-bound, so a full
  // max_batch_tokens chunk would stall every stream for many steps' worth
  // of time. 0 = no budget (chunks of max_batch_tokens). A prompt loading
  // while nothing decodes always gets max_batch_tokens rows.
  double prefill_step_budget = 2.5;
  // Sequences in the batch at once (the service's --max-running).
  int max_running = 16;
  // Above this many decoding sequences a step decodes plainly (no drafts);
  // 0 = no fixed limit.
  int plain_batch_size = 0;
  // Prices each step with two or more decoding sequences, drafting against
  // plain (common/plan/batch_cost_model.h), and drops the drafts when they
  // do not pay; borrowed, nullptr = never. A lone sequence is governed by
  // its own mode, plans and guard.
  const BatchCostModel* cost_model = nullptr;
};

// Counters of the step loop (monotonic) and the last step's shape.
struct BatchEngineStats {
  int64_t steps = 0;
  int64_t rows = 0;               // main-pass rows over all steps
  int64_t decode_rows = 0;        // sequences that decoded, summed over steps
  int64_t prefill_chunks = 0;     // prompt chunks run
  int64_t refused_never_fit = 0;  // requests larger than the whole pool
  // Steps whose drafts were switched off (plain_batch_size, cost model).
  int64_t plain_steps = 0;
  // Steps whose prompt rows the step-time budget cut below what
  // max_batch_tokens would have allowed.
  int64_t budgeted_prefill_steps = 0;
  int last_batch_size = 0;  // sequences in the last step
};

class BatchEngine {
 public:
  BatchEngine(const LlamaModel& model, const Tokenizer& tokenizer, KvPool& pool,
              PlannerClient* planner, PlanningShared planning,
              BatchEngineOptions options);
  ~BatchEngine();
  BatchEngine(const BatchEngine&) = delete;
  BatchEngine& operator=(const BatchEngine&) = delete;

  // Runs one generation in the shared batch and returns its result, as
  // knapserve::Generate would (same validation errors, same output for the
  // same request). Blocks the caller. `should_stop` (optional) is polled
  // before every step, also while the request waits for admission; when it
  // returns true the sequence ends with FinishReason::kAborted. Callbacks run
  // on the step thread. ResourceExhausted when the request could never fit
  // the K/V pool.
  absl::StatusOr<GenerationResult> Generate(
      const GenerationRequest& request, StreamCallback on_tokens,
      ReferenceCallback on_reference = nullptr,
      std::function<bool()> should_stop = nullptr) ABSL_LOCKS_EXCLUDED(mu_);

  // A request's n choices (OpenAI's n; best_of's candidates) in the shared
  // batch, admitted together (they count n against max_running): choice 0
  // prefills the prompt; the others share its K/V blocks (KvPool prefix
  // sharing: the prompt's full blocks are held once, its partial last block
  // is copied) and start from its prompt's last logits row, each with a
  // sampler of its own: seed ChoiceSeed(seed, i) when the request has one,
  // else a random seed each. `on_tokens(i)` (optional) gives choice i's
  // stream callback. Results come in choice order; the first error of any
  // choice fails the call. InvalidArgument when n is not in
  // [1, max_running]; otherwise as Generate.
  absl::StatusOr<std::vector<GenerationResult>> GenerateChoices(
      const GenerationRequest& request, int n,
      const std::function<StreamCallback(int)>& on_tokens,
      std::function<bool()> should_stop = nullptr) ABSL_LOCKS_EXCLUDED(mu_);

  // Gauges.
  int running() const ABSL_LOCKS_EXCLUDED(mu_);  // sequences in the batch
  int waiting() const ABSL_LOCKS_EXCLUDED(mu_);  // admitted by the caller,
                                                 // waiting for K/V
  BatchEngineStats stats() const ABSL_LOCKS_EXCLUDED(mu_);
  const KvPool& pool() const { return pool_; }

 private:
  // One request between Generate and its end. Lives on Generate's stack;
  // the step thread drops every pointer to it before `done` is notified.
  struct Entry;

  // Checks that `entry` could ever fit the pool, queues it and waits for
  // its end.
  absl::Status Run(Entry& entry) ABSL_LOCKS_EXCLUDED(mu_);
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);
  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const LlamaModel& model_;
  const Tokenizer& tokenizer_;
  KvPool& pool_;
  PlannerClient* const planner_;
  const PlanningShared planning_;
  const BatchEngineOptions options_;
  const int threads_;  // torch intra-op threads of the creating thread

  mutable absl::Mutex mu_;
  std::deque<Entry*> incoming_ ABSL_GUARDED_BY(mu_);  // not yet seen
  int waiting_ ABSL_GUARDED_BY(mu_) = 0;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  BatchEngineStats stats_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // started in the constructor, joined in ~BatchEngine
};

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_ENGINE_BATCH_ENGINE_H_
