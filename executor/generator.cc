#include "executor/generator.h"

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <limits>
#include <memory>
#include <optional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/base/clock.h"
#include "common/base/status.h"
#include "common/model/decode_attention.h"
#include "common/model/exception_status.h"
#include "common/model/layer_mask.h"
#include "executor/kv_cache.h"

namespace knapserve {
namespace {

// The planned modes' side of one generation: a PlanController decides, this
// class acts on the decoder, the result and the planner. Snapshots go to the
// planner without waiting; answers land in the plan cache (which the
// controller reads at step boundaries) from the planner's callback, which may
// run after the generation ended: it touches only shared_ptr-held state.
class PlanSession {
 public:
  PlanSession(PlannerClient* planner, const LlamaModel& model,
              const GenerationRequest& request, const PlanningShared& shared,
              int initial_gamma)
      : planner_(planner),
        model_(model),
        spec_(request.speculation),
        sequence_id_(request.sequence_id != 0 ? request.sequence_id
                                              : NextSequenceId()),
        shared_(shared),
        mailbox_(std::make_shared<Mailbox>()),
        controller_(ControllerOptions(request.speculation),
                    CacheKey(model, request.speculation), sequence_id_,
                    initial_gamma, shared) {}

  // Before step `step`: puts a plan that took effect into the decoder and the
  // result, sets this step's gamma; returns the directive (capture or not).
  StepDirective BeforeStep(int64_t step, int64_t context_length,
                           SpeculativeDecoder& decoder,
                           GenerationResult& result) {
    const auto start = std::chrono::steady_clock::now();
    {
      absl::MutexLock lock(&mailbox_->mu);
      result.stats.plan_failures += mailbox_->failures;
      mailbox_->failures = 0;
      if (!mailbox_->last_error.empty())
        result.last_plan_error = mailbox_->last_error;
    }
    StepDirective directive = controller_.BeforeStep(step, context_length);
    if (directive.apply.has_value()) {
      const CachedPlan& cached = *directive.apply;
      const DraftPlan& plan = cached.plan;
      decoder.set_mask(plan.mask);
      AppliedPlan applied;
      applied.applied_step = step;
      applied.plan_step = plan.step;
      applied.age_steps =
          directive.apply_source == "solve" ? step - plan.step : 0;
      applied.mask = plan.mask.ToString();
      applied.gamma = plan.gamma;
      applied.alpha_hat = plan.alpha_hat;
      applied.predicted_tpt = plan.predicted_tpt;
      applied.baseline_tpt = plan.baseline_tpt;
      applied.num_candidates = plan.num_candidates;
      applied.solve_seconds = plan.solve_seconds;
      applied.queue_seconds = plan.queue_seconds;
      applied.context_length = cached.context_length;
      applied.source = directive.apply_source;
      result.plans.push_back(std::move(applied));
      result.mask = plan.mask.ToString();
    }
    decoder.set_gamma(directive.gamma);
    result.stats.waiting_seconds += SecondsSince(start);
    return directive;
  }

  void AfterStep(const StepObservation& observation) {
    controller_.AfterStep(observation);
  }

  // Sends one completed snapshot; returns at once.
  void Submit(const ReferenceStates& snapshot, KvCache& cache,
              GenerationResult& result) {
    const auto start = std::chrono::steady_clock::now();
    const SubmitTicket ticket = controller_.TakeTicket();
    PlanRequest request;
    request.sequence_id = sequence_id_;
    request.step = snapshot.step;
    request.context_length = snapshot.context_length;
    request.policy = ticket.key.policy;
    request.clasp_layers = ClaspLayers(model_, spec_);
    request.max_draft = spec_.max_draft;
    request.model_fingerprint = model_.config().Fingerprint();
    request.states = snapshot.states;
    request.first_position = snapshot.positions.front();
    request.target_argmax = snapshot.target_argmax;
    // Positions [0, context_length) are committed and never rewritten while
    // the sequence lives; the handles (not copies) keep them alive for the
    // solve. All of them are sent: the reference tokens' own positions too,
    // which CLaSp's DP on the last reference token attends to (KnapSpec's DP
    // on all r tokens uses [0, first_position) of them).
    request.kv = cache.layers();
    request.kv_length = snapshot.context_length;
    // The plan is cached for its whole context bucket [b W, (b+1) W), so the
    // planner should price it at the bucket's middle: it prices at
    // n + lifetime / 2, hence lifetime = 2 * (middle - n) (0 past the middle).
    const int64_t width = spec_.plan_bucket_tokens;
    const int64_t middle = snapshot.context_length / width * width + width / 2;
    request.plan_lifetime_tokens =
        std::max<int64_t>(0, 2 * (middle - snapshot.context_length));
    ++result.stats.plan_requests;
    std::weak_ptr<Mailbox> weak = mailbox_;
    PlanningShared shared = shared_;
    const uint64_t sequence_id = sequence_id_;
    const int64_t context_length = snapshot.context_length;
    planner_->Submit(
        std::move(request), [weak, shared, ticket, sequence_id,
                             context_length](absl::StatusOr<DraftPlan> plan) {
          CompleteTicket(shared, ticket, sequence_id, context_length, plan);
          std::shared_ptr<Mailbox> box = weak.lock();
          if (box == nullptr) return;  // the generation is over
          absl::MutexLock lock(&box->mu);
          if (plan.ok()) {
            box->solve_seconds += plan->solve_seconds;
          } else if (plan.status().code() != absl::StatusCode::kCancelled) {
            ++box->failures;
            box->last_error = plan.status().ToString();
          }
        });
    result.stats.waiting_seconds += SecondsSince(start);
  }

  // A generation that ends early (an error) still drops its queued request.
  ~PlanSession() {
    if (!finished_) planner_->Forget(sequence_id_);
  }
  PlanSession(const PlanSession&) = delete;
  PlanSession& operator=(const PlanSession&) = delete;

  void Finish(GenerationResult& result) {
    finished_ = true;
    planner_->Forget(sequence_id_);
    controller_.Finish();
    result.planning = controller_.stats();
    absl::MutexLock lock(&mailbox_->mu);
    result.stats.plan_failures += mailbox_->failures;
    result.planning.solve_seconds = mailbox_->solve_seconds;
    if (!mailbox_->last_error.empty())
      result.last_plan_error = mailbox_->last_error;
  }

 private:
  // What planner callbacks report back to the decode thread. Shared (the
  // callback holds a weak_ptr) so a late callback finds it gone rather than
  // dangling; written by planner threads, drained by the decode thread.
  struct Mailbox {
    absl::Mutex mu;
    int64_t failures ABSL_GUARDED_BY(mu) = 0;  // not yet added to the result
    std::string last_error ABSL_GUARDED_BY(mu);
    double solve_seconds ABSL_GUARDED_BY(mu) = 0;
  };

  static uint64_t NextSequenceId() {
    static std::atomic<uint64_t> next{1};
    return next.fetch_add(1);
  }

  static int ClaspLayers(const LlamaModel& model,
                         const SpeculationConfig& spec) {
    return spec.clasp_layers > 0 ? spec.clasp_layers
                                 : std::max(1, model.num_layers() / 2);
  }

  static PlanControllerOptions ControllerOptions(
      const SpeculationConfig& spec) {
    PlanControllerOptions options;
    options.bucket_tokens = spec.plan_bucket_tokens;
    options.drift_tolerance = spec.drift_tolerance;
    options.drift_min_tokens = spec.drift_min_tokens;
    options.planner_budget = spec.planner_budget;
    options.reference_steps = spec.reference_steps;
    options.min_request_gap = spec.plan_interval;
    options.guard.enabled = spec.guard;
    options.guard.margin = spec.guard_margin;
    options.guard.min_steps = spec.guard_min_steps;
    options.guard.probe_steps = spec.guard_probe_steps;
    return options;
  }

  static PlanCacheKey CacheKey(const LlamaModel& model,
                               const SpeculationConfig& spec) {
    PlanCacheKey key;
    key.model_fingerprint = model.config().Fingerprint();
    key.device = model.device().str();
    key.dtype = DtypeName(model.dtype());
    key.threads = at::get_num_threads();
    key.policy = PlannedPolicy(spec.mode);
    if (key.policy == PlanPolicy::kClasp) {
      key.policy_detail = absl::StrCat("layers=", ClaspLayers(model, spec));
    }
    key.max_draft = spec.max_draft;
    key.bucket_tokens = spec.plan_bucket_tokens;
    return key;
  }

  PlannerClient* planner_;
  const LlamaModel& model_;
  const SpeculationConfig& spec_;
  const uint64_t sequence_id_;
  const PlanningShared shared_;
  std::shared_ptr<Mailbox> mailbox_;
  PlanController controller_;
  bool finished_ = false;  // Finish ran (it already told the planner)
};

}  // namespace

std::string FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kEos:
      return "eos";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kStopSequence:
      return "stop_sequence";
    case FinishReason::kAborted:
      return "aborted";
  }
  return "unknown";
}

double GenerationStats::prefill_tokens_per_second() const {
  return prefill_seconds > 0
             ? static_cast<double>(prompt_tokens) / prefill_seconds
             : 0.0;
}

double GenerationStats::decode_tokens_per_second() const {
  return decode_seconds > 0 && completion_tokens > 1
             ? static_cast<double>(completion_tokens - 1) / decode_seconds
             : 0.0;
}

absl::Status ValidateGenerationRequest(const GenerationRequest& request,
                                       const LlamaModel& model) {
  const int64_t n = static_cast<int64_t>(request.prompt_ids.size());
  if (n == 0)
    return absl::InvalidArgumentError(
        "prompt: empty (it needs at least one token)");
  if (n >= model.max_context()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt: ", n, " tokens do not fit the model's context of ",
        model.max_context(), " tokens"));
  }
  const int64_t vocab = model.config().vocab_size;
  for (int32_t id : request.prompt_ids) {
    if (id < 0 || id >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt: token id ", id, " outside the vocabulary [0, ", vocab, ")"));
    }
  }
  if (request.max_new_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_new_tokens: must be >= 1, got ", request.max_new_tokens));
  }
  if (request.prefill_chunk < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefill_chunk: must be >= 1, got ", request.prefill_chunk));
  }
  for (const std::string& stop : request.stop_strings) {
    if (stop.empty())
      return absl::InvalidArgumentError("stop: empty stop string");
  }
  const SpeculationConfig& spec = request.speculation;
  if (Drafts(spec.mode)) {
    if (spec.max_draft < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "max_draft: must be >= 1 with speculation on, got ", spec.max_draft));
    }
    // A verification pass is max_draft + 1 rows; past kMaxDecodeAttentionRows
    // it would leave the batch-invariant few-row path, and greedy output
    // could then differ from plain decoding at a near-tie.
    if (spec.max_draft > kMaxDecodeAttentionRows - 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "max_draft: at most ", kMaxDecodeAttentionRows - 1,
          " (verification passes must stay on the batch-invariant path), got ",
          spec.max_draft));
    }
    if (!(spec.exit_threshold >= 0.0 && spec.exit_threshold <= 1.0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "exit_threshold: must be in [0, 1], got ", spec.exit_threshold));
    }
    if (spec.plan_interval < 1 || spec.reference_steps < 1) {
      return absl::InvalidArgumentError(
          "plan_interval and reference_steps: must be >= 1");
    }
    if (spec.reference_steps > spec.plan_interval) {
      return absl::InvalidArgumentError(
          absl::StrCat("reference_steps: ", spec.reference_steps,
                       " exceeds plan_interval ", spec.plan_interval,
                       " (the steps captured after a plan boundary must fit "
                       "before the next)"));
    }
    if (spec.plan_bucket_tokens < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "plan_bucket_tokens: must be >= 1, got ", spec.plan_bucket_tokens));
    }
    if (!(spec.drift_tolerance > 0.0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "drift_tolerance: must be > 0, got ", spec.drift_tolerance));
    }
    if (spec.drift_min_tokens < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "drift_min_tokens: must be >= 1, got ", spec.drift_min_tokens));
    }
    if (!(spec.planner_budget >= 0.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("planner_budget: must be >= 0 (0 = no limit), got ",
                       spec.planner_budget));
    }
    if (!(spec.guard_margin >= 0.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("guard_margin: must be >= 0, got ", spec.guard_margin));
    }
    if (spec.guard_min_steps < 1 || spec.guard_probe_steps < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "guard_min_steps and guard_probe_steps: must be >= 1, got ",
          spec.guard_min_steps, " and ", spec.guard_probe_steps));
    }
    RETURN_IF_ERROR(LayerMask::Parse(spec.skip, model.num_layers()).status());
    if (spec.clasp_layers < 0 || spec.clasp_layers >= model.num_layers()) {
      return absl::InvalidArgumentError(
          absl::StrCat("clasp_layers: must be in [0, ", model.num_layers() - 1,
                       "], got ", spec.clasp_layers));
    }
  }
  return Annotate(ValidateSamplingParams(request.sampling), "sampling");
}

TextStream::TextStream(const Tokenizer& tokenizer,
                       std::vector<int32_t> prompt_ids,
                       std::vector<std::string> stop_strings)
    : decoder_(tokenizer, /*skip_special_tokens=*/true, std::move(prompt_ids)),
      stop_strings_(std::move(stop_strings)) {}

std::string TextStream::TakeSafeText(bool final) {
  if (matched_stop_.has_value()) return "";
  // Look for a completed stop string. None can start in already-emitted text:
  // anything that could begin one was held back.
  size_t best = std::string::npos;
  for (const std::string& stop : stop_strings_) {
    size_t at = text_.find(stop, emitted_);
    if (at != std::string::npos && (best == std::string::npos || at < best)) {
      best = at;
      matched_stop_ = stop;
    }
  }
  size_t safe_end = text_.size();
  if (best != std::string::npos) {
    safe_end = best;
  } else if (!final) {
    // Hold back the longest suffix that is a proper prefix of a stop string.
    for (const std::string& stop : stop_strings_) {
      const size_t max_len = std::min(stop.size() - 1, text_.size() - emitted_);
      for (size_t len = max_len; len > 0; --len) {
        if (text_.compare(text_.size() - len, len, stop, 0, len) == 0) {
          safe_end = std::min(safe_end, text_.size() - len);
          break;
        }
      }
    }
  }
  std::string out = text_.substr(emitted_, safe_end - emitted_);
  emitted_ = safe_end;
  emitted_text_ += out;
  return out;
}

absl::StatusOr<std::string> TextStream::Push(int32_t id) {
  if (matched_stop_.has_value()) return std::string();
  ASSIGN_OR_RETURN(std::string piece, decoder_.Push(id));
  text_ += piece;
  return TakeSafeText(/*final=*/false);
}

std::string TextStream::Finish() {
  if (matched_stop_.has_value()) return "";
  text_ += decoder_.Flush();
  return TakeSafeText(/*final=*/true);
}

namespace {

absl::StatusOr<GenerationResult> GenerateOrThrow(
    const LlamaModel& model, const Tokenizer& tokenizer,
    const GenerationRequest& request, const StreamCallback& on_tokens,
    const ReferenceCallback& on_reference, PlannerClient* planner,
    const PlanningShared* shared) {
  RETURN_IF_ERROR(ValidateGenerationRequest(request, model));
  const SpeculationConfig& spec = request.speculation;
  const bool planned = IsPlanned(spec.mode);
  if (planned && planner == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("spec ", SpeculationModeName(spec.mode),
                     " needs a planner (and its latency profile)"));
  }
  LayerMask mask(model.num_layers());
  if (Drafts(spec.mode)) {
    ASSIGN_OR_RETURN(mask, LayerMask::Parse(spec.skip, model.num_layers()));
  }
  c10::InferenceMode inference_mode;
  const auto start = std::chrono::steady_clock::now();

  const int64_t prompt_len = static_cast<int64_t>(request.prompt_ids.size());
  // Output stops at max_new_tokens or when prompt + output fills the context.
  const int64_t limit =
      std::min(request.max_new_tokens, model.max_context() - prompt_len);
  // Every position a step feeds is below prompt_len + limit, drafts included.
  KvCache cache(model, prompt_len + limit);
  Sampler sampler(request.sampling);
  TextStream stream(tokenizer, request.prompt_ids, request.stop_strings);
  // Before the first plan, planned modes draft with `skip` if given, else
  // decode autoregressively.
  int gamma = Drafts(spec.mode) ? spec.max_draft : 0;
  if (planned && spec.skip.empty()) gamma = 0;
  SpeculativeDecoder decoder(model, cache, sampler, mask, gamma,
                             spec.exit_threshold);
  // Unplanned modes with on_reference: the first m steps of every T. Planned
  // modes: m steps from where the controller starts a snapshot (offsets
  // 0 .. m-1; the interval never wraps).
  ReferenceStateCollector collector(spec.plan_interval, spec.reference_steps);
  ReferenceStateCollector planned_collector(
      std::numeric_limits<int64_t>::max() / 2, spec.reference_steps);
  std::optional<PlanSession> plans;
  if (planned) {
    const PlanningShared own =
        shared != nullptr ? PlanningShared() : PlanningShared::Create();
    plans.emplace(planner, model, request, shared != nullptr ? *shared : own,
                  gamma);
  }

  GenerationResult result;
  result.seed = sampler.seed();
  result.mask = Drafts(spec.mode) ? mask.ToString() : "";
  result.stats.prompt_tokens = prompt_len;

  const std::vector<int32_t>& eos = model.config().eos_token_ids;
  auto end_reason = [&](int32_t id) -> std::optional<FinishReason> {
    if (!request.ignore_eos &&
        std::find(eos.begin(), eos.end(), id) != eos.end()) {
      return FinishReason::kEos;
    }
    if (std::find(request.stop_token_ids.begin(), request.stop_token_ids.end(),
                  id) != request.stop_token_ids.end()) {
      return FinishReason::kStopSequence;
    }
    return std::nullopt;
  };

  // Commits `tokens` one by one; returns true when generation is over.
  auto commit =
      [&](const std::vector<int32_t>& tokens) -> absl::StatusOr<bool> {
    const size_t first_new = result.output_ids.size();
    std::string text;
    std::optional<FinishReason> reason;
    for (int32_t id : tokens) {
      result.output_ids.push_back(id);
      ASSIGN_OR_RETURN(std::string piece, stream.Push(id));
      text += piece;
      reason = end_reason(id);
      if (stream.stopped()) reason = FinishReason::kStopSequence;
      if (!reason && static_cast<int64_t>(result.output_ids.size()) >= limit) {
        reason = FinishReason::kLength;
      }
      if (reason) break;
    }
    if (reason) text += stream.Finish();
    const size_t added = result.output_ids.size() - first_new;
    if (on_tokens &&
        !on_tokens(
            absl::MakeConstSpan(result.output_ids.data() + first_new, added),
            text)) {
      reason = FinishReason::kAborted;
    }
    if (reason) result.finish_reason = *reason;
    return reason.has_value();
  };

  // The prefill and every decode step run inside an exception boundary: an
  // exception (a c10::Error from a LibTorch check, a throwing callback) fails
  // this generation with Internal, naming the step.
  bool done = false;
  auto decode_start = std::chrono::steady_clock::now();
  try {
    torch::Tensor prompt =
        torch::tensor(std::vector<int64_t>(request.prompt_ids.begin(),
                                           request.prompt_ids.end()),
                      torch::kInt64);
    torch::Tensor logits = model.Prefill(prompt, /*start_pos=*/0,
                                         cache.layers(), request.prefill_chunk);
    cache.Commit(prompt_len);
    const int32_t first = sampler.Sample(logits);
    result.stats.prefill_seconds = SecondsSince(start);
    decode_start = std::chrono::steady_clock::now();
    ASSIGN_OR_RETURN(done, commit({first}));
  } catch (...) {
    return CurrentExceptionAsInternal("generation failed in the prefill");
  }

  // One decode step: plan bookkeeping, draft and verify, commit.
  auto decode_step = [&](int64_t step) -> absl::StatusOr<bool> {
    if (request.before_step_for_tests) request.before_step_for_tests(step);
    StepDirective directive;
    if (planned)
      directive = plans->BeforeStep(step, cache.length(), decoder, result);
    const int64_t remaining =
        limit - static_cast<int64_t>(result.output_ids.size());
    const bool capture = planned
                             ? directive.capture
                             : on_reference != nullptr && collector.Wants(step);
    const auto step_start = std::chrono::steady_clock::now();
    StepResult out = decoder.Step(result.output_ids.back(), remaining, capture);
    const double step_seconds = SecondsSince(step_start);
    ++result.stats.steps;
    if (planned) {
      StepObservation observation;
      observation.gamma = decoder.gamma();
      observation.drafted = out.drafted;
      observation.accepted = out.accepted;
      observation.tokens = static_cast<int>(out.tokens.size());
      observation.seconds = step_seconds;
      plans->AfterStep(observation);
    }
    if (capture) {
      std::optional<ReferenceStates> snapshot =
          planned ? planned_collector.Add(directive.capture_offset, out,
                                          cache.length())
                  : collector.Add(step, out, cache.length());
      if (snapshot && planned) {
        snapshot->step = step - directive.capture_offset;
        plans->Submit(*snapshot, cache, result);
      }
      if (snapshot && on_reference) on_reference(std::move(*snapshot));
    }
    return commit(out.tokens);
  };
  for (int64_t step = 0; !done; ++step) {
    try {
      ASSIGN_OR_RETURN(done, decode_step(step));
    } catch (...) {
      return CurrentExceptionAsInternal(
          absl::StrCat("generation failed at decode step ", step));
    }
  }
  if (planned) plans->Finish(result);
  result.text = stream.emitted();
  if (stream.matched_stop().has_value())
    result.matched_stop = *stream.matched_stop();
  result.speculation = decoder.stats();
  result.stats.completion_tokens =
      static_cast<int64_t>(result.output_ids.size());
  result.stats.decode_seconds = SecondsSince(decode_start);
  result.stats.total_seconds = SecondsSince(start);
  result.stats.draft_seconds = result.speculation.draft_seconds;
  result.stats.verify_seconds = result.speculation.verify_seconds;
  return result;
}

}  // namespace

absl::StatusOr<GenerationResult> Generate(const LlamaModel& model,
                                          const Tokenizer& tokenizer,
                                          const GenerationRequest& request,
                                          const StreamCallback& on_tokens,
                                          const ReferenceCallback& on_reference,
                                          PlannerClient* planner,
                                          const PlanningShared* shared) {
  // LibTorch reports broken invariants by throwing (c10::Error); none may
  // escape into a server thread, so the sequence fails with INTERNAL and
  // the server goes on. Its KV cache is freed with the stack.
  try {
    return GenerateOrThrow(model, tokenizer, request, on_tokens, on_reference,
                           planner, shared);
  } catch (...) {
    return CurrentExceptionAsInternal("generation failed");
  }
}

}  // namespace knapserve
