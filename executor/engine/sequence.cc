#include "executor/engine/sequence.h"

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <numeric>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/base/clock.h"
#include "common/base/status.h"
#include "common/model/exception_status.h"
#include "common/model/parallel_for.h"
#include "common/plan/plan_trace.h"
#include "common/trace/tracer.h"
#include "executor/engine/speculation_mode.h"
#include "executor/engine/speculation_step.h"
#include "executor/planning/plan_cache.h"
#include "executor/planning/plan_controller.h"

namespace knapserve {
namespace {

// What min_tokens holds back: the EOS ids (unless ignore_eos) and the stop
// token ids.
std::vector<int32_t> MinTokensEndIds(const LlamaModel& model,
                                     const GenerationRequest& request) {
  std::vector<int32_t> ids = request.stop_token_ids;
  if (!request.ignore_eos) {
    const std::vector<int32_t>& eos = model.config().eos_token_ids;
    ids.insert(ids.end(), eos.begin(), eos.end());
  }
  return ids;
}

// The log-probabilities of `targets` under the first targets.size() rows
// of `logits` ([rows, vocab]), one log_softmax for both: row j's value at
// targets[j], and with k > 0 each row's k most likely ids, most likely
// first, equal values by the smaller id (a fixed order, whatever the
// kernels' target).
struct RowLogprobs {
  std::vector<float> chosen;
  std::vector<std::vector<TokenLogprob>> top;
};
RowLogprobs LogprobsOf(const torch::Tensor& logits,
                       absl::Span<const int32_t> targets, int k) {
  const int64_t rows = static_cast<int64_t>(targets.size());
  const torch::Tensor log_probs =
      torch::log_softmax(logits.narrow(0, 0, rows).to(torch::kFloat32), -1);
  const torch::Tensor ids =
      torch::tensor(std::vector<int64_t>(targets.begin(), targets.end()),
                    torch::kInt64)
          .to(log_probs.device());
  // Only the chosen values leave the device unless alternatives are asked.
  const torch::Tensor chosen = log_probs.gather(1, ids.unsqueeze(1))
                                   .squeeze(1)
                                   .to(torch::kCPU)
                                   .contiguous();
  RowLogprobs out;
  out.chosen.assign(chosen.data_ptr<float>(), chosen.data_ptr<float>() + rows);
  if (k <= 0) return out;
  const torch::Tensor host = log_probs.to(torch::kCPU).contiguous();
  const int64_t vocab = host.size(1);
  const float* all = host.data_ptr<float>();
  k = static_cast<int>(std::min<int64_t>(k, vocab));
  std::vector<int32_t> order(static_cast<size_t>(vocab));
  out.top.resize(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = all + r * vocab;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [row](int32_t a, int32_t b) {
                        return row[a] > row[b] || (row[a] == row[b] && a < b);
                      });
    std::vector<TokenLogprob>& top = out.top[static_cast<size_t>(r)];
    top.reserve(static_cast<size_t>(k));
    for (int i = 0; i < k; ++i) top.push_back({order[i], row[order[i]]});
  }
  return out;
}

// Process-wide ids of sequences (the planner's key; the guard's verdicts
// say which sequence judged).
uint64_t NextSequenceId() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1);
}

// The guard settings of a request (SpeculationConfig's guard_* fields).
GuardOptions GuardOptionsFrom(const SpeculationConfig& spec) {
  GuardOptions options;
  options.enabled = spec.guard;
  options.margin = spec.guard_margin;
  options.min_steps = spec.guard_min_steps;
  options.probe_steps = spec.guard_probe_steps;
  options.reprobe_steps = spec.guard_reprobe_steps;
  options.carry_neighbour_losses = spec.guard_carry;
  options.settle_plain = spec.guard_settle_plain;
  options.clear_losses = spec.guard_clear_losses;
  options.confirm_losses = spec.guard_confirm_losses;
  options.confirm_confidence = spec.guard_confirm_confidence;
  options.explore_share = spec.guard_explore_share;
  return options;
}

// The part of a plan cache key that plain-decoding speed depends on
// (PlanCacheKey::ExecutionId): model, device, dtype and threads.
PlanCacheKey ExecutionKey(const LlamaModel& model) {
  PlanCacheKey key;
  key.model_fingerprint = model.config().Fingerprint();
  key.device = model.device().str();
  key.dtype = DtypeName(model.dtype());
  key.threads = at::get_num_threads();
  return key;
}

}  // namespace

// The planned modes' side of one generation: a PlanController decides, this
// class acts on the sequence's mask and gamma, the result and the planner.
// Snapshots go to the planner without waiting; answers land in the plan cache
// (which the controller reads at step boundaries) from the planner's callback,
// which may run after the generation ended: it touches only shared_ptr-held
// state.
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
                    initial_gamma, shared),
        trace_parent_(request.trace_parent),
        tracing_(trace::GlobalTracer() != nullptr) {}

  // Before step `step`: puts a plan that took effect into mask and the
  // result, sets this step's gamma; returns the directive (capture or not).
  StepDirective BeforeStep(int64_t step, int64_t context_length,
                           LayerMask& mask, int& gamma,
                           GenerationResult& result,
                           bool may_start_capture = true) {
    const auto start = std::chrono::steady_clock::now();
    {
      absl::MutexLock lock(&mailbox_->mu);
      result.stats.plan_failures += mailbox_->failures;
      mailbox_->failures = 0;
      if (!mailbox_->last_error.empty())
        result.last_plan_error = mailbox_->last_error;
    }
    StepDirective directive = controller_.BeforeStep(
        step, context_length, may_start_capture, planner_->ProfilePending());
    if (snapshot_span_.context().valid() && !controller_.capturing()) {
      // The controller dropped the capture (a new bucket, a newer plan).
      snapshot_span_.SetError("abandoned: the snapshot did not complete");
      snapshot_span_.End();
      snapshot_span_ = trace::Span();
    }
    if (tracing_ && directive.capture && directive.capture_offset == 0) {
      // The trigger stays pending until the snapshot is submitted.
      StartSnapshotSpan(step, context_length, controller_.pending_trigger());
    }
    if (directive.apply.has_value()) {
      const CachedPlan& cached = *directive.apply;
      const DraftPlan& plan = cached.plan;
      mask = plan.mask;
      AppliedPlan applied;
      applied.applied_step = step;
      applied.plan_step = plan.step;
      applied.age_steps =
          directive.apply_source == "solve" ? step - plan.step : 0;
      applied.mask = plan.mask.ToString();
      applied.gamma = plan.gamma;
      applied.alpha_hat = plan.alpha_hat;
      applied.alpha_smoothed = plan.alpha_smoothed;
      applied.evidence_trials = plan.evidence_trials;
      applied.predicted_tokens_per_step = plan.predicted_tokens_per_step;
      applied.predicted_drafts_per_step = plan.predicted_drafts_per_step;
      applied.predicted_tpt = plan.predicted_tpt;
      applied.baseline_tpt = plan.baseline_tpt;
      applied.num_candidates = plan.num_candidates;
      applied.solve_seconds = plan.solve_seconds;
      applied.queue_seconds = plan.queue_seconds;
      applied.context_length = cached.context_length;
      applied.source = directive.apply_source;
      // Plain decoding's rate at this bucket now, before the plan's first
      // step: the machine's speed its plain calibration uses.
      const std::optional<double> plain =
          controller_.PlainStepSeconds(context_length);
      applied.measured_plain_tpt =
          plain.has_value() && *plain > 0 ? 1 / *plain : 0;
      // And drafting steps' cost against the latency model's, the same way.
      if (plan.gamma > 0) {
        applied.draft_cost_ratio =
            controller_.DraftCostRatio(context_length).value_or(0);
      }
      if (tracing_) StartApplySpan(cached, applied);
      result.plans.push_back(std::move(applied));
      result.mask = plan.mask.ToString();
    }
    gamma = directive.gamma;
    result.stats.waiting_seconds += SecondsSince(start);
    return directive;
  }

  void AfterStep(const StepObservation& observation, GenerationResult& result) {
    const bool settled = controller_.settled();  // before this step counts
    controller_.AfterStep(observation);
    if (!result.plans.empty()) {
      // The last plan applied is the one in force.
      AppliedPlan& plan = result.plans.back();
      const bool as_planned = StepMeasuresPlan(plan.gamma, observation);
      const double calibrated = plan.calibrated_tpt();
      const PlanStepKind kind = ClassifyPlanStep(
          controller_.last_step_beside_solve(), settled, observation.seconds,
          calibrated > 0 ? plan.predicted_tokens_per_step / calibrated : 0.0,
          controller_.outlier_factor());
      if (as_planned && kind == PlanStepKind::kBesideSolve) {
        ++plan.beside_solve_steps;
        plan.beside_solve_tokens += observation.tokens;
        plan.beside_solve_seconds += observation.seconds;
      } else if (as_planned && kind == PlanStepKind::kUnsteady) {
        ++plan.unsteady_steps;
        plan.unsteady_tokens += observation.tokens;
        plan.unsteady_seconds += observation.seconds;
      } else if (as_planned) {
        ++plan.measured_steps;
        plan.measured_tokens += observation.tokens;
        plan.measured_seconds += observation.seconds;
        const double tokens = observation.tokens;
        plan.measured_tokens_sq += tokens * tokens;
        plan.measured_token_seconds += tokens * observation.seconds;
        plan.measured_seconds_sq += observation.seconds * observation.seconds;
        plan.measured_drafted += observation.drafted;
        plan.measured_accepted += observation.accepted;
      }
    }
    if (apply_span_.recording()) {
      ++apply_steps_;
      apply_tokens_ += observation.tokens;
      apply_seconds_ += observation.seconds;
    }
  }

  // Sends one completed snapshot; returns at once.
  void Submit(const ReferenceStates& snapshot, std::vector<LayerKv> kv,
              std::shared_ptr<const KvSnapshot> kv_snapshot,
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
    request.exit_threshold = spec_.exit_threshold;
    request.model_fingerprint = model_.config().Fingerprint();
    request.states = snapshot.states;
    request.first_position = snapshot.positions.front();
    request.target_argmax = snapshot.target_argmax;
    // Positions [0, context_length) are committed and never rewritten while
    // the sequence lives; `kv` holds them (handles to a contiguous cache), or
    // `kv_snapshot` does (references to the paged pool's blocks, copied out
    // by the planner on its own thread) for the solve. All of them are sent:
    // the reference tokens' own positions too, which CLaSp's DP on the last
    // reference token attends to (KnapSpec's DP on all r tokens uses [0,
    // first_position) of them).
    request.kv = std::move(kv);
    request.kv_snapshot = std::move(kv_snapshot);
    request.kv_length = snapshot.context_length;
    // The plan is cached for its whole context bucket [b W, (b+1) W), so the
    // planner should price it at the bucket's middle: it prices at
    // n + lifetime / 2, hence lifetime = 2 * (middle - n) (0 past the middle).
    const int64_t width = spec_.plan_bucket_tokens;
    const int64_t middle = snapshot.context_length / width * width + width / 2;
    request.plan_lifetime_tokens =
        std::max<int64_t>(0, 2 * (middle - snapshot.context_length));
    if (snapshot_span_.context().valid()) {
      // The snapshot is taken: it parents the request's spans.
      SetPlanRequestAttributes(snapshot_span_, request);
      snapshot_span_.SetAttribute("knapserve.plan.first_position",
                                  request.first_position);
      request.traceparent = snapshot_span_.traceparent();
      snapshot_span_.End();
      snapshot_span_ = trace::Span();
    }
    ++result.stats.plan_requests;
    std::weak_ptr<Mailbox> weak = mailbox_;
    PlanningShared shared = shared_;
    const uint64_t sequence_id = sequence_id_;
    const int64_t context_length = snapshot.context_length;
    const std::string snapshot_traceparent = request.traceparent;
    planner_->Submit(std::move(request), [weak, shared, ticket, sequence_id,
                                          context_length, snapshot_traceparent](
                                             absl::StatusOr<DraftPlan> plan) {
      // plan.receive: the answer back on the executor, child of the span
      // that delivered it (plan.send across gRPC, else the snapshot);
      // the plan enters the cache carrying receive's context, which the
      // plan.apply spans hang from.
      trace::Span receive;
      if (!snapshot_traceparent.empty()) {
        receive = trace::StartSpan(
            "plan.receive", plan.ok() && !plan->traceparent.empty()
                                ? std::string_view(plan->traceparent)
                                : std::string_view(snapshot_traceparent));
        if (plan.ok()) {
          SetPlanAttributes(receive, *plan);
          plan->traceparent = receive.traceparent();
        } else {
          receive.SetError(plan.status().ToString());
        }
      }
      CompleteTicket(shared, ticket, sequence_id, context_length, plan);
      receive.End();
      std::shared_ptr<Mailbox> box = weak.lock();
      if (box == nullptr) return;  // the generation is over
      absl::MutexLock lock(&box->mu);
      if (plan.ok()) {
        box->solve_seconds += plan->solve_seconds;
      } else if (plan.status().code() != absl::StatusCode::kCancelled &&
                 !IsProfilePending(plan.status())) {
        // A planner still measuring its profile is no failure: the
        // trigger comes back and asks again later.
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
    EndApplySpan("finished");
    if (snapshot_span_.recording()) {
      snapshot_span_.SetError("the generation ended before the snapshot");
    }
    snapshot_span_.End();
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

  // plan.snapshot: from the first captured step until the request is
  // submitted (Submit ends it). A capture that restarts ends the old one as
  // abandoned.
  void StartSnapshotSpan(int64_t step, int64_t context_length,
                         PlanTrigger trigger) {
    if (snapshot_span_.recording()) {
      snapshot_span_.SetError("abandoned: the snapshot did not complete");
    }
    snapshot_span_.End();
    snapshot_span_ = trace::StartSpan("plan.snapshot", trace_parent_);
    snapshot_span_.SetAttribute("knapserve.plan.trigger",
                                PlanTriggerName(trigger));
    snapshot_span_.SetAttribute("knapserve.plan.capture_start_step", step);
    snapshot_span_.SetAttribute("knapserve.plan.capture_start_context_length",
                                context_length);
    snapshot_span_.SetAttribute("knapserve.plan.reference_steps",
                                spec_.reference_steps);
  }

  // plan.apply: the plan in force, from the step it took effect until the
  // next plan replaces it or the generation ends, with the tokens per second
  // it realized meanwhile. Child of the plan's plan.receive when the plan
  // was solved in this trace; a plan from another trace (the plan cache, or
  // another request's solve) hangs from this request's decode span and
  // names its origin.
  void StartApplySpan(const CachedPlan& cached, const AppliedPlan& applied) {
    EndApplySpan("replaced");
    const std::optional<trace::SpanContext> origin =
        trace::ParseTraceparent(cached.plan.traceparent);
    const bool same_trace =
        origin.has_value() &&
        (!trace_parent_.valid() || origin->trace_id == trace_parent_.trace_id);
    apply_span_ =
        trace::StartSpan("plan.apply", same_trace ? *origin : trace_parent_);
    apply_steps_ = 0;
    apply_tokens_ = 0;
    apply_seconds_ = 0;
    if (!apply_span_.recording()) return;
    SetPlanAttributes(apply_span_, cached.plan);
    apply_span_.SetAttribute("knapserve.plan.source", applied.source);
    apply_span_.SetAttribute("knapserve.plan.applied_step",
                             applied.applied_step);
    apply_span_.SetAttribute("knapserve.plan.step", applied.plan_step);
    apply_span_.SetAttribute("knapserve.plan.age_steps", applied.age_steps);
    apply_span_.SetAttribute("knapserve.plan.context_length",
                             applied.context_length);
    if (!same_trace && origin.has_value()) {
      apply_span_.SetAttribute("knapserve.plan.origin_traceparent",
                               cached.plan.traceparent);
    }
  }

  void EndApplySpan(const char* reason) {
    if (apply_span_.recording()) {
      apply_span_.SetAttribute("knapserve.plan.end_reason", reason);
      apply_span_.SetAttribute("knapserve.plan.steps_in_force", apply_steps_);
      apply_span_.SetAttribute("knapserve.plan.tokens_in_force", apply_tokens_);
      apply_span_.SetAttribute(
          "knapserve.plan.realized_tokens_per_second",
          apply_seconds_ > 0
              ? static_cast<double>(apply_tokens_) / apply_seconds_
              : 0.0);
    }
    apply_span_.End();
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
    options.plain_recheck_steps = spec.plain_recheck_steps;
    options.sequence_prior_tokens = spec.sequence_prior_tokens;
    options.planner_budget = spec.planner_budget;
    options.reference_steps = spec.reference_steps;
    options.min_request_gap = spec.plan_interval;
    options.guard = GuardOptionsFrom(spec);
    options.initial_mask = spec.skip;
    return options;
  }

  static PlanCacheKey CacheKey(const LlamaModel& model,
                               const SpeculationConfig& spec) {
    PlanCacheKey key = ExecutionKey(model);
    key.policy = PlannedPolicy(spec.mode);
    if (key.policy == PlanPolicy::kClasp) {
      key.policy_detail = absl::StrCat("layers=", ClaspLayers(model, spec));
    }
    key.max_draft = spec.max_draft;
    key.exit_threshold = spec.exit_threshold;
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
  // Tracing (common/trace): the request's decode span, the snapshot being
  // captured, and the plan in force with what it realized so far.
  const trace::SpanContext trace_parent_;
  const bool tracing_;  // a tracer was installed when the sequence began
  trace::Span snapshot_span_;
  trace::Span apply_span_;
  int64_t apply_steps_ = 0;
  int64_t apply_tokens_ = 0;
  double apply_seconds_ = 0;
};

// ---- Sequence ----

absl::StatusOr<std::unique_ptr<Sequence>> Sequence::Create(
    const LlamaModel& model, const Tokenizer& tokenizer,
    GenerationRequest request, StreamCallback on_tokens,
    ReferenceCallback on_reference, PlannerClient* planner,
    const PlanningShared* shared) {
  RETURN_IF_ERROR(ValidateGenerationRequest(request, model));
  const SpeculationConfig& spec = request.speculation;
  const bool planned = IsPlanned(spec.mode);
  if (planned && planner == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("spec ", SpeculationModeName(spec.mode),
                     " needs a planner (and its latency profile)"));
  }
  if (IsRouted(spec.mode) && (shared == nullptr || shared->router == nullptr)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "spec ", SpeculationModeName(spec.mode),
        " needs domain anchors (made by `knapserve anchors`, given to the "
        "server with --anchors FILE)"));
  }
  LayerMask mask(model.num_layers());
  if (Drafts(spec.mode)) {
    ASSIGN_OR_RETURN(mask, LayerMask::Parse(spec.skip, model.num_layers()));
  }
  std::unique_ptr<Sequence> seq(
      new Sequence(model, tokenizer, std::move(request), std::move(on_tokens),
                   std::move(on_reference), std::move(mask)));
  if (IsRouted(seq->request_.speculation.mode)) seq->router_ = shared->router;
  if (shared != nullptr) {
    seq->shared_ = *shared;
    seq->execution_id_ = ExecutionKey(model).ExecutionId();
  }
  // Static and SpecBound drafts are fixed from the start; knn's once routed.
  if (spec.mode == SpeculationMode::kStatic) {
    seq->StartGuard(absl::StrCat("static ", spec.skip, " D", spec.max_draft));
  } else if (spec.mode == SpeculationMode::kSpecBound) {
    const SpecBoundConfig& sb = spec.specbound;
    seq->StartGuard(
        absl::StrCat("specbound lambda=", sb.lambda, " t0=", sb.t0,
                     " depth=", sb.depth_bound, " every=", sb.check_every,
                     sb.trained_heads ? " trained" : "", " D", spec.max_draft));
  }
  if (planned) {
    const PlanningShared own =
        shared != nullptr ? PlanningShared() : PlanningShared::Create();
    seq->plans_ = std::make_unique<PlanSession>(
        planner, model, seq->request_, shared != nullptr ? *shared : own,
        seq->gamma_);
  }
  return seq;
}

Sequence::Sequence(const LlamaModel& model, const Tokenizer& tokenizer,
                   GenerationRequest request, StreamCallback on_tokens,
                   ReferenceCallback on_reference, LayerMask mask)
    : model_(model),
      request_(std::move(request)),
      on_tokens_(std::move(on_tokens)),
      on_reference_(std::move(on_reference)),
      planned_(IsPlanned(request_.speculation.mode)),
      prompt_len_(static_cast<int64_t>(request_.prompt_ids.size())),
      // Output stops at max_new_tokens or when prompt + output fills the
      // context; every position a step feeds is below prompt_len + limit.
      limit_(
          std::min(request_.max_new_tokens, model.max_context() - prompt_len_)),
      sampler_(request_.sampling),
      processors_(request_.sampling, request_.prompt_ids,
                  MinTokensEndIds(model, request_)),
      stream_(tokenizer, request_.prompt_ids, request_.stop_strings),
      mask_(std::move(mask)),
      collector_(request_.speculation.plan_interval,
                 request_.speculation.reference_steps),
      planned_collector_(std::numeric_limits<int64_t>::max() / 2,
                         request_.speculation.reference_steps),
      early_exit_(DraftsByEarlyExit(request_.speculation.mode)) {
  const SpeculationConfig& spec = request_.speculation;
  // Before the first plan, planned modes draft with `skip` if given, else
  // decode autoregressively.
  gamma_ = Drafts(spec.mode) ? spec.max_draft : 0;
  if (planned_ && spec.skip.empty()) gamma_ = 0;
  // A routed sequence decodes with its domain's draft, known after prefill.
  if (IsRouted(spec.mode)) gamma_ = 0;
  if (early_exit_) {
    exit_heads_ = spec.specbound.trained_heads ? spec.specbound.heads
                                               : ExitHeads::TrainingFree();
    depth_bound_ = spec.specbound.depth_bound > 0 ? spec.specbound.depth_bound
                                                  : model.num_layers();
    UpdateExitCostMask();
  }
  result_.seed = sampler_.seed();
  result_.mask =
      Drafts(spec.mode) && !IsRouted(spec.mode) ? mask_.ToString() : "";
  result_.stats.prompt_tokens = prompt_len_;
}

Sequence::~Sequence() = default;

void Sequence::UseKv(std::vector<LayerKv>* contiguous) {
  contiguous_ = contiguous;
  paged_ = nullptr;
}

void Sequence::UseKv(SequenceKv* paged) {
  paged_ = paged;
  contiguous_ = nullptr;
}

absl::Status Sequence::BindKv(BatchSequence& input, int64_t positions) {
  if (paged_ != nullptr) {
    RETURN_IF_ERROR(paged_->EnsureCapacity(positions));
    input.paged = &paged_->storage();
    input.blocks = paged_->blocks();
    return absl::OkStatus();
  }
  if (contiguous_ == nullptr)
    return absl::FailedPreconditionError("sequence has no K/V bound");
  input.kv = contiguous_;
  return absl::OkStatus();
}

BatchMember Sequence::batch_member() const {
  BatchMember member;
  if (Drafts(request_.speculation.mode) && gamma_ > 0) {
    member.gamma = gamma_;
    member.mask = early_exit_ ? &exit_cost_mask_ : &mask_;
  }
  member.acceptance = (static_cast<double>(spec_stats_.accepted_tokens) + 1.0) /
                      (static_cast<double>(spec_stats_.draft_tokens) + 2.0);
  return member;
}

void Sequence::Abort() {
  if (done_) return;
  result_.finish_reason = FinishReason::kAborted;
  Finish();
}

void Sequence::Fail(absl::Status status) {
  if (done_) return;
  error_ = std::move(status);
  done_ = true;
  if (plans_ != nullptr) plans_->Finish(result_);
}

void Sequence::Finish() {
  if (done_) return;
  done_ = true;
  if (plans_ != nullptr) plans_->Finish(result_);
  result_.text = stream_.emitted();
  if (stream_.matched_stop().has_value())
    result_.matched_stop = *stream_.matched_stop();
  result_.speculation = spec_stats_;
  result_.stats.completion_tokens =
      static_cast<int64_t>(result_.output_ids.size());
  if (started_) {
    if (result_.output_ids.empty()) {
      result_.stats.prefill_seconds = SecondsSince(start_);
    } else {
      result_.stats.decode_seconds = SecondsSince(decode_start_);
    }
    result_.stats.total_seconds = SecondsSince(start_);
    result_.stats.end_unix_nanos = trace::NowUnixNanos();
  }
  result_.stats.draft_seconds = spec_stats_.draft_seconds;
  result_.stats.verify_seconds = spec_stats_.verify_seconds;
  if (!logit_rows_.empty()) {
    result_.output_logits = torch::stack(logit_rows_);
    logit_rows_.clear();
  }
}

absl::StatusOr<GenerationResult> Sequence::TakeResult() {
  if (!done_) return absl::FailedPreconditionError("sequence still running");
  if (!error_.ok()) return error_;
  return std::move(result_);
}

absl::Status Sequence::Commit(const std::vector<int32_t>& tokens,
                              const torch::Tensor& logits) {
  const std::vector<int32_t>& eos = model_.config().eos_token_ids;
  auto end_reason = [&](int32_t id) -> std::optional<FinishReason> {
    if (!request_.ignore_eos &&
        std::find(eos.begin(), eos.end(), id) != eos.end()) {
      return FinishReason::kEos;
    }
    const std::vector<int32_t>& stops = request_.stop_token_ids;
    if (std::find(stops.begin(), stops.end(), id) != stops.end()) {
      return FinishReason::kStopSequence;
    }
    return std::nullopt;
  };
  const size_t first_new = result_.output_ids.size();
  if (request_.logprobs) {
    // Row j's log_softmax at tokens[j], for every token (those past a stop
    // are dropped with the ids below).
    RowLogprobs values = LogprobsOf(logits, tokens, request_.top_logprobs);
    pending_logprobs_ = std::move(values.chosen);
    pending_top_ = std::move(values.top);
  }
  std::string text;
  std::optional<FinishReason> reason;
  for (size_t j = 0; j < tokens.size(); ++j) {
    const int32_t id = tokens[j];
    result_.output_ids.push_back(id);
    if (request_.logprobs) {
      result_.output_logprobs.push_back(pending_logprobs_[j]);
    }
    if (request_.top_logprobs > 0) {
      result_.output_top_logprobs.push_back(std::move(pending_top_[j]));
    }
    if (request_.return_logits) {
      logit_rows_.push_back(logits[static_cast<int64_t>(j)].to(
          torch::kCPU, torch::kFloat32, /*non_blocking=*/false,
          /*copy=*/true));
    }
    ASSIGN_OR_RETURN(std::string piece, stream_.Push(id));
    text += piece;
    reason = end_reason(id);
    if (stream_.stopped()) reason = FinishReason::kStopSequence;
    if (!reason && static_cast<int64_t>(result_.output_ids.size()) >= limit_) {
      reason = FinishReason::kLength;
    }
    if (reason) break;
  }
  if (reason) text += stream_.Finish();
  const size_t added = result_.output_ids.size() - first_new;
  processors_.Commit(
      absl::MakeConstSpan(result_.output_ids.data() + first_new, added));
  StepLogprobs logprobs;
  if (first_new == 0) {
    logprobs.prompt = result_.prompt_logprobs;
    logprobs.prompt_top = result_.prompt_top_logprobs;
  }
  if (request_.logprobs) {
    logprobs.chosen =
        absl::MakeConstSpan(result_.output_logprobs.data() + first_new, added);
  }
  if (request_.top_logprobs > 0) {
    logprobs.top = absl::MakeConstSpan(
        result_.output_top_logprobs.data() + first_new, added);
  }
  if (on_tokens_ &&
      !on_tokens_(
          absl::MakeConstSpan(result_.output_ids.data() + first_new, added),
          text, logprobs)) {
    reason = FinishReason::kAborted;
  }
  if (reason) {
    result_.finish_reason = *reason;
    Finish();
  }
  return absl::OkStatus();
}

void Sequence::BeginStep(bool allow_drafts) {
  if (request_.before_step_for_tests) request_.before_step_for_tests(step_);
  capture_ = false;
  capture_offset_ = 0;
  if (planned_) {
    // While the batch drops drafts a new plan would go unused: no solve
    // starts then (a pending trigger waits for a step that drafts).
    const StepDirective directive = plans_->BeforeStep(
        step_, length_, mask_, gamma_, result_, allow_drafts);
    capture_ = directive.capture;
    capture_offset_ = directive.capture_offset;
  } else {
    step_began_beside_solve_ =
        shared_.budget != nullptr && shared_.budget->solves_in_flight() > 0;
    if (!early_exit_) {
      capture_ = on_reference_ != nullptr && collector_.Wants(step_);
    }
  }
  // SpecBound's verification is a partial pass, which captures no boundary
  // states (it has no reference snapshots).
  if (early_exit_) exit_rows_.Begin(length_, result_.output_ids.back());
  exited_below_last_layer_ = false;
  // The guard of an unplanned drafting mode: plain while its setting's
  // verdict (this sequence's or another's) says drafting loses here.
  if (guard_ != nullptr && allow_drafts && gamma_ > 0 &&
      guard_->BeforeStep(
          ContextBucket(length_, request_.speculation.plan_bucket_tokens),
          result_.planning)) {
    allow_drafts = false;
  }
  const int64_t remaining =
      limit_ - static_cast<int64_t>(result_.output_ids.size());
  // Drafts + the verified token must fit both the budget and the K/V.
  budget_ =
      std::max<int64_t>(0, std::min<int64_t>({gamma_, remaining - 1,
                                              max_positions() - length_ - 1}));
  step_gamma_ = allow_drafts ? gamma_ : 0;
  if (!allow_drafts) budget_ = 0;
  drafts_.clear();
  draft_dists_.clear();
  drafting_ = budget_ > 0;
}

void Sequence::OnDraftLogits(const torch::Tensor& logits) {
  bool confident = false;
  // The draft's logits processed with the history its position will have
  // at verification: the output so far and the drafts before it.
  // `last` sits at position length_; draft k goes to length_ + 1 + k.
  const int64_t position = length_ + 1 + static_cast<int64_t>(drafts_.size());
  drafts_.push_back(ChooseDraft(sampler_, processors_.Apply(logits, drafts_),
                                position, request_.speculation.exit_threshold,
                                draft_dists_, confident));
  if (!confident || static_cast<int64_t>(drafts_.size()) >= budget_)
    drafting_ = false;
}

void Sequence::OnExitCheck(int layer, const torch::Tensor& state) {
  const int depth = layer + 1;
  const SpecBoundConfig& config = request_.speculation.specbound;
  if (exit_stop_ || !IsCheckDepth(depth, config.check_every, depth_bound_))
    return;
  // Inside the pass, between two layers: no OpenMP team (as in the batch
  // step's Guarded).
  ScopedSerialAten serial;
  try {
    // z_l / T_l for the exit after `layer`, processed with the history of
    // the position it drafts for.
    torch::Tensor scaled = processors_.Apply(
        exit_heads_->Logits(model_, layer, state)[0] /
            ExitTemperature(config.t0, layer, model_.num_layers()),
        drafts_);
    const double top1 = torch::softmax(scaled, 0).max().item<double>();
    if (top1 >= config.lambda) {
      exit_scaled_ = std::move(scaled);
      exit_stop_ = true;
    }
  } catch (...) {
    exit_error_ = CurrentExceptionAsInternal(absl::StrCat(
        "generation failed at decode step ", step_, " (exit check)"));
    exit_stop_ = true;
  }
}

absl::Status Sequence::OnExitPass(absl::Span<const torch::Tensor> states,
                                  absl::Span<const int> reached) {
  exit_stop_ = false;
  torch::Tensor scaled = std::move(exit_scaled_);
  exit_scaled_ = torch::Tensor();
  if (!exit_error_.ok()) return std::exchange(exit_error_, absl::OkStatus());
  exit_rows_.ApplyDraftPass(states, reached);
  const int newest = exit_rows_.rows() - 1;
  const int depth = exit_rows_.depth(newest);
  if (scaled.defined()) {
    // q_j (for rejection sampling): exactly the distribution the draft is
    // drawn from.
    const int32_t draft = DrawDraft(
        sampler_, scaled, length_ + 1 + static_cast<int64_t>(drafts_.size()),
        draft_dists_);
    drafts_.push_back(draft);
    exit_rows_.AddRow(draft);
    std::vector<int64_t>& depths = spec_stats_.exit_depths;
    if (static_cast<int>(depths.size()) < depth) depths.resize(depth, 0);
    ++depths[depth - 1];
    if (depth < model_.num_layers()) exited_below_last_layer_ = true;
    if (static_cast<int64_t>(drafts_.size()) >= budget_) {
      drafting_ = false;
      ++spec_stats_.width_bound_stops;
    }
  } else {
    // No exit: the row ran to the depth bound.
    drafting_ = false;
    ++spec_stats_.depth_bound_stops;
  }
  return absl::OkStatus();
}

void Sequence::UpdateExitCostMask() {
  // What a draft costs the batch cost model: the layers a draft token runs
  // on average (half the depth bound before any exit), nothing above.
  const double mean = spec_stats_.mean_exit_depth();
  const int depth = std::clamp(
      mean > 0 ? static_cast<int>(mean + 0.5) : (depth_bound_ + 1) / 2, 1,
      model_.num_layers());
  exit_cost_mask_ = LayerMask(model_.num_layers());
  for (int l = depth; l < model_.num_layers(); ++l) {
    exit_cost_mask_.set_skipped(2 * l, true);
    exit_cost_mask_.set_skipped(2 * l + 1, true);
  }
}

void Sequence::OnPromptLogits(const torch::Tensor& logits, int64_t start) {
  // Row r is position start + r; it predicts the prompt token after it.
  const int64_t rows =
      std::min<int64_t>(logits.size(0), prompt_len_ - 1 - start);
  if (rows <= 0) return;
  RowLogprobs values =
      LogprobsOf(logits,
                 absl::MakeConstSpan(request_.prompt_ids.data() + start + 1,
                                     static_cast<size_t>(rows)),
                 request_.top_logprobs);
  result_.prompt_logprobs.insert(result_.prompt_logprobs.end(),
                                 values.chosen.begin(), values.chosen.end());
  for (std::vector<TokenLogprob>& top : values.top) {
    result_.prompt_top_logprobs.push_back(std::move(top));
  }
}

absl::Status Sequence::StartFromPrefill(const Sequence& first) {
  if (!first.prefill_logits_.defined() || started_ ||
      (paged_ == nullptr && contiguous_ == nullptr) ||
      first.prompt_len_ != prompt_len_) {
    return absl::FailedPreconditionError(
        "a sequence can start only from a kept prefill of a prompt as long as "
        "its own, with its K/V bound and before it ran");
  }
  started_ = true;
  start_ = first.start_;
  prefilled_ = prompt_len_;
  routing_ = first.routing_;
  result_.prompt_logprobs = first.result_.prompt_logprobs;
  result_.prompt_top_logprobs = first.result_.prompt_top_logprobs;
  return OnPrefillDone(first.prefill_logits_);
}

absl::Status Sequence::OnPrefillDone(const torch::Tensor& logits) {
  if (keep_prefill_logits_) prefill_logits_ = logits.clone();
  length_ = prompt_len_;
  // The first generated token sits at position prompt_len_.
  const int32_t first =
      sampler_.Sample(processors_.Apply(logits, {}), prompt_len_);
  result_.stats.prefill_seconds = SecondsSince(start_);
  decode_start_ = std::chrono::steady_clock::now();
  step_mark_ = decode_start_;
  result_.stats.first_token_unix_nanos = trace::NowUnixNanos();
  if (router_ != nullptr) Route();
  return Commit({first}, logits.unsqueeze(0));
}

void Sequence::StartGuard(const std::string& setting) {
  const SpeculationConfig& spec = request_.speculation;
  if (!spec.guard || shared_.plain_rates == nullptr) return;
  guard_ = std::make_unique<SpeculationGuard>(
      GuardOptionsFrom(spec), shared_.plain_rates, shared_.verdicts,
      execution_id_, setting, NextSequenceId(), spec.plan_bucket_tokens);
}

void Sequence::Route() {
  const auto start = std::chrono::steady_clock::now();
  const DomainRoute route = router_->Route(routing_.Mean());
  const RoutedDomain& domain = router_->domains()[route.domain];
  // The domain's draft priced for prompts of about this one's length.
  const ContextDraft draft = domain.DraftFor(prompt_len_);
  mask_ = draft.mask;
  gamma_ = std::min(draft.gamma, request_.speculation.max_draft);
  result_.mask = gamma_ > 0 ? mask_.ToString() : "";
  result_.routed_domain = domain.name;
  if (gamma_ > 0) {
    StartGuard(
        absl::StrCat("knn ", domain.name, " ", mask_.ToString(), " D", gamma_));
  }
  result_.routing_similarity = route.similarity;
  result_.stats.routing_seconds = SecondsSince(start);
}

absl::Status Sequence::OnVerified(const torch::Tensor& logits,
                                  const torch::Tensor& states) {
  const int64_t pos = length_;
  // Row j is processed with the drafts before it as pending history; the
  // raw rows still give the logprobs (Commit).
  StepResult out = FinishVerification(sampler_, drafts_, draft_dists_,
                                      processors_.ApplyRows(logits, drafts_),
                                      states, pos, capture_, spec_stats_);
  // Keep [last, accepted drafts]; later positions are overwritten later.
  length_ = pos + out.accepted + 1;
  ++result_.stats.steps;
  if (early_exit_) UpdateExitCostMask();
  const auto step_end = std::chrono::steady_clock::now();
  const double step_seconds =
      std::chrono::duration<double>(step_end - step_mark_).count();
  step_mark_ = step_end;
  StepObservation observation;
  observation.gamma = step_gamma_;
  observation.budget = static_cast<int>(budget_);
  observation.capped = step_gamma_ > 0 && budget_ < step_gamma_;
  observation.drafted = out.drafted;
  observation.accepted = out.accepted;
  observation.tokens = static_cast<int>(out.tokens.size());
  observation.seconds = step_seconds;
  observation.saved_no_layers =
      early_exit_ && step_gamma_ > 0 && !exited_below_last_layer_;
  if (planned_) {
    plans_->AfterStep(observation, result_);  // records its plain steps
  } else {
    const int64_t bucket_tokens = request_.speculation.plan_bucket_tokens;
    const int64_t bucket = ContextBucket(pos, bucket_tokens);
    // The first steps after the prefill are no plain reference (the
    // guard's settle_steps).
    if (observation.gamma == 0 && observation.tokens == 1 &&
        step_ >= GuardOptionsFrom(request_.speculation).settle_steps) {
      RecordPlainStep(shared_, execution_id_, bucket_tokens, bucket,
                      step_seconds, step_began_beside_solve_);
    }
    if (guard_ != nullptr) {
      guard_->Observe(gamma_ > 0, bucket, observation, result_.planning);
    }
  }
  if (capture_) {
    std::optional<ReferenceStates> snapshot =
        planned_ ? planned_collector_.Add(capture_offset_, out, length_)
                 : collector_.Add(step_, out, length_);
    if (snapshot && planned_) {
      snapshot->step = step_ - capture_offset_;
      // Paged K/V goes by reference (no copy on this thread; the blocks
      // count against the pool until the planner is done with them).
      std::vector<LayerKv> kv;
      std::shared_ptr<const KvSnapshot> held;
      if (paged_ != nullptr) {
        absl::StatusOr<std::shared_ptr<const KvSnapshot>> taken =
            paged_->Snapshot(length_);
        if (!taken.ok()) return taken.status();
        held = *std::move(taken);
      } else {
        kv = *contiguous_;
      }
      plans_->Submit(*snapshot, std::move(kv), std::move(held), result_);
    }
    if (snapshot && on_reference_) on_reference_(std::move(*snapshot));
  }
  ++step_;
  return Commit(out.tokens, logits);
}

// ---- RunBatchStep ----

// The step driver; a struct so that it may touch Sequence's privates.
struct BatchStepRunner {
  const LlamaModel& model;
  const BatchStepOptions& options;
  BatchStepStats stats;

  // Runs `fn` for `seq`, failing only that sequence if it throws. `fn` is a
  // sequence's own work between the passes (sampling, verification, its
  // K/V bookkeeping, routing), never a pass: its ATen ops run on this
  // thread alone (ScopedSerialAten, common/model/parallel_for.h). An ATen
  // op over more than 32,768 entries (a vocabulary's logits) would wake
  // ATen's OpenMP team, whose workers spin on and take a core from the next
  // pass's kernels, as the bf16 LM head's rounding did
  // (LlamaModel::RowLogits) and knn's routing of a long prompt.
  template <typename Fn>
  static void Guarded(Sequence* seq, const char* what, Fn&& fn) {
    ScopedSerialAten serial;
    try {
      absl::Status status = fn();
      if (!status.ok()) seq->Fail(std::move(status));
    } catch (...) {
      seq->Fail(CurrentExceptionAsInternal(
          seq->prefilling() ? std::string("generation failed in the prefill")
                            : absl::StrCat("generation failed at decode step ",
                                           seq->step_, " (", what, ")")));
    }
  }

  // One forward pass; an exception fails every sequence in it.
  std::vector<torch::Tensor> Pass(const std::vector<Sequence*>& seqs,
                                  const std::vector<BatchSequence>& inputs,
                                  double& seconds) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<torch::Tensor> out;
    try {
      out = model.ForwardBatch(inputs);
    } catch (...) {
      const absl::Status status =
          CurrentExceptionAsInternal("generation failed in a forward pass");
      for (Sequence* seq : seqs) seq->Fail(status);
      out.clear();
    }
    seconds = SecondsSince(start);
    return out;
  }

  // A pass before the main one (a draft round, or SpecBound's alignment):
  // its time counts as drafting for every sequence in it, then
  // `take(i, seq, logits)` takes sequence i's output, failing only that
  // sequence if it throws.
  // `first_input`: sequence i's inputs are [first_input[i],
  // first_input[i + 1]) (empty: one input each, in order); take gets their
  // outputs.
  template <typename Take>
  void DraftPass(const std::vector<Sequence*>& ready,
                 const std::vector<BatchSequence>& inputs, const char* what,
                 Take&& take, const std::vector<size_t>& first_input = {}) {
    double seconds = 0;
    std::vector<torch::Tensor> logits = Pass(ready, inputs, seconds);
    ++stats.draft_passes;
    for (size_t i = 0; i < ready.size() && !logits.empty(); ++i) {
      Sequence* seq = ready[i];
      seq->spec_stats_.draft_seconds += seconds;
      const size_t a = first_input.empty() ? i : first_input[i];
      const size_t b = first_input.empty() ? i + 1 : first_input[i + 1];
      Guarded(seq, what, [&] {
        return take(i, seq, absl::MakeConstSpan(logits.data() + a, b - a));
      });
    }
  }

  void Run(absl::Span<Sequence* const> batch) {
    const auto step_start = std::chrono::steady_clock::now();
    c10::InferenceMode inference_mode;
    // 1. Begin: decoding sequences set up their step.
    for (Sequence* seq : batch) {
      if (seq->done()) continue;
      if (!seq->started_) {
        seq->started_ = true;
        seq->start_ = std::chrono::steady_clock::now();
        seq->result_.stats.first_pass_unix_nanos = trace::NowUnixNanos();
      }
      if (seq->prefilling()) continue;
      Guarded(seq, "begin", [&] {
        seq->BeginStep(options.allow_drafts);
        return absl::OkStatus();
      });
    }

    // 2. Draft rounds: one masked pass per round over the sequences still
    //    drafting, each with its own mask.
    for (;;) {
      std::vector<Sequence*> seqs;
      std::vector<BatchSequence> inputs;
      std::vector<int32_t> tokens;
      for (Sequence* seq : batch) {
        if (!seq->done() && !seq->prefilling() && seq->drafting_)
          seqs.push_back(seq);
      }
      if (seqs.empty()) break;
      tokens.reserve(seqs.size());
      for (Sequence* seq : seqs) {
        tokens.push_back(seq->drafts_.empty() ? seq->result_.output_ids.back()
                                              : seq->drafts_.back());
      }
      // Per ready sequence, its inputs [first_input[i], first_input[i + 1]):
      // one, or SpecBound's groups (specbound.h).
      std::vector<Sequence*> ready;
      std::vector<size_t> first_input;
      for (size_t i = 0; i < seqs.size(); ++i) {
        Sequence* seq = seqs[i];
        std::vector<BatchSequence> mine;
        if (seq->early_exit_) {
          // The newest row up to its exit (checked inside the pass) or the
          // depth bound, with the rows that lag below it.
          Guarded(seq, "draft", [&] {
            // exit_stop_, exit_scaled_ and exit_error_ are clear here:
            // OnExitPass consumed the last pass's.
            mine = seq->exit_rows_.DraftPass(seq->depth_bound_);
            // Every group binds the K/V grown to the newest row's end, so
            // no later growth moves the block table under an earlier one.
            const int64_t positions =
                mine.back().start_pos + mine.back().rows();
            for (BatchSequence& input : mine) {
              input.num_logits = 0;
              input.stop = &seq->exit_stop_;
              RETURN_IF_ERROR(seq->BindKv(input, positions));
            }
            // The newest row (last: K/V in position order) checks its
            // exits; the groups stop with it.
            mine.back().after_layer = [seq](int layer,
                                            const torch::Tensor& state) {
              seq->OnExitCheck(layer, state);
            };
            return absl::OkStatus();
          });
        } else {
          BatchSequence input;
          input.tokens = absl::MakeConstSpan(&tokens[i], 1);
          input.start_pos =
              seq->length_ + static_cast<int64_t>(seq->drafts_.size());
          input.skip = &seq->mask_;
          input.num_logits = 1;
          mine.push_back(input);
          Guarded(seq, "draft",
                  [&] { return seq->BindKv(mine[0], mine[0].start_pos + 1); });
        }
        if (seq->done()) continue;
        ready.push_back(seq);
        first_input.push_back(inputs.size());
        inputs.insert(inputs.end(), mine.begin(), mine.end());
      }
      if (ready.empty()) continue;
      first_input.push_back(inputs.size());
      std::vector<torch::Tensor> exit_states(inputs.size());
      std::vector<int> reached(inputs.size(), 0);
      for (size_t k = 0; k < inputs.size(); ++k) {
        if (inputs[k].stop != nullptr) {
          inputs[k].output_states = &exit_states[k];
          inputs[k].reached_layer = &reached[k];
        }
      }
      DraftPass(
          ready, inputs, "draft",
          [&](size_t i, Sequence* seq, absl::Span<const torch::Tensor> logits) {
            const size_t a = first_input[i];
            const size_t n = first_input[i + 1] - a;
            if (!seq->early_exit_) {
              seq->OnDraftLogits(logits[0][0]);
              return absl::OkStatus();
            }
            return seq->OnExitPass(
                absl::MakeConstSpan(exit_states.data() + a, n),
                absl::MakeConstSpan(reached.data() + a, n));
          },
          first_input);
    }

    // 2b. SpecBound's alignment: rows below their step's deepest exit go up
    //     to it, one stage per pass, every such sequence in each pass.
    for (;;) {
      std::vector<Sequence*> ready;
      std::vector<BatchSequence> inputs;
      std::vector<torch::Tensor> out(batch.size());
      for (Sequence* seq : batch) {
        if (seq->done() || seq->prefilling() || !seq->early_exit_) continue;
        BatchSequence input;
        bool align = false;
        Guarded(seq, "align", [&] {
          align = seq->exit_rows_.max_depth() > 0 &&
                  seq->exit_rows_.AlignPass(input);
          if (!align) return absl::OkStatus();
          input.num_logits = 0;
          input.output_states = &out[ready.size()];
          return seq->BindKv(input, input.start_pos + input.rows());
        });
        if (!align || seq->done()) continue;
        ready.push_back(seq);
        inputs.push_back(input);
      }
      if (ready.empty()) break;
      DraftPass(ready, inputs, "align",
                [&](size_t i, Sequence* seq, absl::Span<const torch::Tensor>) {
                  seq->exit_rows_.Apply(out[i]);
                  return absl::OkStatus();
                });
    }

    // 3. The main pass: decode rows first, then prefill chunks within the
    //    token budget.
    std::vector<Sequence*> seqs;
    std::vector<BatchSequence> inputs;
    std::vector<std::vector<int32_t>> rows;  // decode rows' tokens
    std::vector<torch::Tensor> states;
    std::vector<bool> is_prefill;
    rows.reserve(batch.size());
    states.resize(batch.size());
    int64_t used = 0;
    for (Sequence* seq : batch) {
      if (seq->done() || seq->prefilling()) continue;
      std::vector<int32_t> input = {seq->result_.output_ids.back()};
      input.insert(input.end(), seq->drafts_.begin(), seq->drafts_.end());
      rows.push_back(std::move(input));
      BatchSequence in;
      in.tokens = rows.back();
      in.start_pos = seq->length_;
      in.num_logits = -1;
      Guarded(seq, "verify", [&] {
        if (seq->early_exit_ && seq->exit_rows_.max_depth() > 0) {
          // From the deepest exit up, over the cached states.
          in.tokens = {};
          seq->exit_rows_.VerifyPass(in);
        }
        return seq->BindKv(in, in.start_pos + in.rows());
      });
      if (seq->done()) continue;
      if (seq->capture_) in.boundary_states = &states[seqs.size()];
      used += in.rows();
      seqs.push_back(seq);
      inputs.push_back(in);
      is_prefill.push_back(false);
    }
    const int decoding = static_cast<int>(seqs.size());
    int64_t prefill_used = 0;
    for (Sequence* seq : batch) {
      if (!seq->prefilling()) continue;
      // The first prompt waiting always gets min_prefill_rows, so prompts
      // make progress however many streams decode; the rest fill the room.
      int64_t room = std::min(options.max_batch_tokens - used,
                              options.max_prefill_rows - prefill_used);
      if (room < options.min_prefill_rows) {
        if (stats.prefilling > 0) break;
        room = std::min(options.min_prefill_rows, options.max_prefill_rows);
      }
      if (room <= 0) break;
      const int64_t chunk =
          std::min({room, seq->request_.prefill_chunk,
                    seq->request_.prompt_logprobs ? kPromptLogprobsChunk
                                                  : seq->request_.prefill_chunk,
                    seq->prompt_len_ - seq->prefilled_});
      BatchSequence in;
      in.tokens = absl::MakeConstSpan(
          seq->request_.prompt_ids.data() + seq->prefilled_, chunk);
      in.start_pos = seq->prefilled_;
      // With prompt_logprobs every row's logits, else the last chunk's last.
      in.num_logits = seq->request_.prompt_logprobs                 ? chunk
                      : seq->prefilled_ + chunk == seq->prompt_len_ ? 1
                                                                    : 0;
      // A routed sequence routes by its prompt's final hidden states.
      if (seq->router_ != nullptr) in.output_states = &seq->chunk_states_;
      Guarded(seq, "prefill",
              [&] { return seq->BindKv(in, in.start_pos + chunk); });
      if (seq->done()) continue;
      used += chunk;
      prefill_used += chunk;
      ++stats.prefilling;
      seqs.push_back(seq);
      inputs.push_back(in);
      is_prefill.push_back(true);
    }
    stats.decoding = decoding;
    stats.main_rows = used;
    stats.prefill_rows = prefill_used;
    if (!seqs.empty()) {
      double seconds = 0;
      std::vector<torch::Tensor> logits = Pass(seqs, inputs, seconds);
      for (size_t i = 0; i < seqs.size() && !logits.empty(); ++i) {
        Sequence* seq = seqs[i];
        if (is_prefill[i]) {
          if (seq->router_ != nullptr) {
            Guarded(seq, "prefill", [&] {
              seq->routing_.Add(seq->chunk_states_, seq->prefilled_);
              seq->chunk_states_ = torch::Tensor();
              return absl::OkStatus();
            });
            if (seq->done()) continue;
          }
          if (seq->request_.prompt_logprobs) {
            Guarded(seq, "prefill", [&] {
              seq->OnPromptLogits(logits[i], seq->prefilled_);
              return absl::OkStatus();
            });
            if (seq->done()) continue;
          }
          seq->prefilled_ += static_cast<int64_t>(inputs[i].tokens.size());
          if (seq->prefilled_ == seq->prompt_len_) {
            // The prompt's last row: the first output token's logits.
            Guarded(seq, "prefill", [&] {
              return seq->OnPrefillDone(logits[i][logits[i].size(0) - 1]);
            });
          }
          continue;
        }
        seq->spec_stats_.verify_seconds += seconds;
        Guarded(seq, "verify",
                [&] { return seq->OnVerified(logits[i], states[i]); });
      }
    }
    stats.seconds = SecondsSince(step_start);
  }
};

BatchStepStats RunBatchStep(const LlamaModel& model,
                            absl::Span<Sequence* const> batch,
                            const BatchStepOptions& options) {
  BatchStepRunner runner{model, options, {}};
  runner.Run(batch);
  return runner.stats;
}

}  // namespace knapserve
