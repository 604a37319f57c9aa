#include "planner/inprocess_planner.h"

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <omp.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/model/exception_status.h"
#include "common/model/parallel_for.h"
#include "common/plan/plan_trace.h"
#include "common/trace/tracer.h"
#include "planner/knapsack.h"

namespace knapserve {

namespace {

absl::Status CheckOptions(const InProcessPlannerOptions& options) {
  RETURN_IF_ERROR(ValidateThreadPriority(options.priority, "planner"));
  if (options.threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("planner threads must be >= 1, got ", options.threads));
  }
  if (options.reserve_cores < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "planner reserve_cores must be >= 0, got ", options.reserve_cores));
  }
  return Annotate(CheckSkippedShare(options.knapspec.max_skipped_share),
                  "knapspec");
}

// A profile of another model, device or dtype is refused (thread counts may
// differ: see Create).
absl::Status CheckProfile(const LlamaModel& model,
                          const LatencyProfile& profile) {
  RETURN_IF_ERROR(Annotate(profile.Validate(), "latency profile"));
  return profile.CheckMatches(model.config().Fingerprint(),
                              model.device().str(), DtypeName(model.dtype()),
                              profile.threads);
}

}  // namespace

absl::StatusOr<std::unique_ptr<InProcessPlanner>> InProcessPlanner::Create(
    const LlamaModel& model, LatencyProfile profile,
    InProcessPlannerOptions options) {
  RETURN_IF_ERROR(CheckOptions(options));
  RETURN_IF_ERROR(CheckProfile(model, profile));
  return std::unique_ptr<InProcessPlanner>(new InProcessPlanner(
      model, std::make_shared<const LatencyProfile>(std::move(profile)),
      std::move(options)));
}

absl::StatusOr<std::unique_ptr<InProcessPlanner>>
InProcessPlanner::CreateWithoutProfile(const LlamaModel& model,
                                       InProcessPlannerOptions options) {
  RETURN_IF_ERROR(CheckOptions(options));
  return std::unique_ptr<InProcessPlanner>(
      new InProcessPlanner(model, nullptr, std::move(options)));
}

InProcessPlanner::InProcessPlanner(
    const LlamaModel& model, std::shared_ptr<const LatencyProfile> profile,
    InProcessPlannerOptions options)
    : model_(model),
      options_(std::move(options)),
      profile_(std::move(profile)),
      worker_([this] { Run(); }) {}

absl::Status InProcessPlanner::SetProfile(LatencyProfile profile) {
  RETURN_IF_ERROR(CheckProfile(model_, profile));
  auto landed = std::make_shared<const LatencyProfile>(std::move(profile));
  absl::MutexLock lock(&mu_);
  if (profile_ != nullptr) {
    return absl::FailedPreconditionError(
        "the planner already has its latency profile");
  }
  profile_ = std::move(landed);
  return absl::OkStatus();
}

bool InProcessPlanner::ProfilePending() const {
  absl::MutexLock lock(&mu_);
  return profile_ == nullptr;
}

std::shared_ptr<const LatencyProfile> InProcessPlanner::profile() const {
  absl::MutexLock lock(&mu_);
  return profile_;
}

InProcessPlanner::~InProcessPlanner() {
  absl::flat_hash_map<uint64_t, Pending> left;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    left.swap(pending_);
    order_.clear();
    cv_.SignalAll();
  }
  worker_.join();
  for (auto& [id, pending] : left) {
    pending.done(absl::UnavailableError("the planner is shutting down"));
  }
}

void InProcessPlanner::Submit(PlanRequest request, PlanCallback done) {
  PlanCallback replaced_done;
  absl::Status replaced_status;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) {
      replaced_done = std::move(done);
      replaced_status = absl::UnavailableError("the planner is shutting down");
    } else {
      const uint64_t id = request.sequence_id;
      auto it = pending_.find(id);
      if (it != pending_.end()) {
        replaced_done = std::move(it->second.done);
        replaced_status =
            absl::CancelledError("replaced by a newer request of the sequence");
        it->second = Pending{std::move(request), std::move(done),
                             std::chrono::steady_clock::now()};
        ++replaced_;
      } else {
        pending_.emplace(id, Pending{std::move(request), std::move(done),
                                     std::chrono::steady_clock::now()});
        order_.push_back(id);
      }
      cv_.Signal();
    }
  }
  // Callbacks run outside the lock (they may Submit again).
  if (replaced_done) replaced_done(replaced_status);
}

void InProcessPlanner::Forget(uint64_t sequence_id) {
  PlanCallback dropped;
  {
    absl::MutexLock lock(&mu_);
    auto it = pending_.find(sequence_id);
    if (it == pending_.end()) return;
    dropped = std::move(it->second.done);
    pending_.erase(it);
    std::erase(order_, sequence_id);
  }
  dropped(absl::CancelledError("the sequence finished"));
}

int64_t InProcessPlanner::solved() const {
  absl::MutexLock lock(&mu_);
  return solved_;
}

int64_t InProcessPlanner::replaced() const {
  absl::MutexLock lock(&mu_);
  return replaced_;
}

int64_t InProcessPlanner::queued() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(pending_.size());
}

absl::StatusOr<DraftPlan> InProcessPlanner::Solve(
    const PlanRequest& request) const {
  const std::string fingerprint = model_.config().Fingerprint();
  if (request.model_fingerprint != fingerprint) {
    return absl::FailedPreconditionError(
        absl::StrCat("plan request for model '", request.model_fingerprint,
                     "' but this planner serves '", fingerprint, "'"));
  }
  // A prefix held by reference is copied out here, on the solving thread.
  const std::vector<LayerKv> kv = ResolvedKv(request);
  if (request.kv_length > 0 &&
      static_cast<int>(kv.size()) != model_.num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv: ", kv.size(), " layers for a model with ", model_.num_layers()));
  }
  const std::shared_ptr<const LatencyProfile> profile_in_force = profile();
  if (profile_in_force == nullptr) {
    return ProfilePendingError(
        "profile pending: the planner's latency profile is still being "
        "measured; no plans until it is ready");
  }
  const LatencyProfile& profile = *profile_in_force;
  if (request.policy == PlanPolicy::kOff) {
    DraftPlan off;
    off.mask = LayerMask(model_.num_layers());
    off.step = request.step;
    return off;
  }
  PlanInputs inputs;
  inputs.states = request.states;
  inputs.first_position = request.first_position;
  inputs.target_argmax = request.target_argmax;
  if (inputs.target_argmax.empty() && request.states.defined() &&
      request.states.dim() == 3 &&
      request.states.size(0) == model_.num_sublayers() + 1) {
    // Not sent: the full model's argmax from the last boundary's states.
    trace::ScopedSpan stage("plan.solve.target_argmax");
    torch::Tensor argmax =
        model_
            .Logits(request.states[model_.num_sublayers()].to(model_.device(),
                                                              model_.dtype()))
            .argmax(-1)
            .to(torch::kCPU);
    for (int64_t i = 0; i < argmax.size(0); ++i) {
      inputs.target_argmax.push_back(
          static_cast<int32_t>(argmax[i].item<int64_t>()));
    }
  }
  inputs.prefix_kv = request.kv_length > 0 ? &kv : nullptr;
  inputs.prefix_len = request.kv_length;
  inputs.kv_positions = request.kv_positions;
  inputs.context_length = request.context_length;
  inputs.plan_lifetime_tokens = request.plan_lifetime_tokens;
  inputs.step = request.step;
  inputs.exit_threshold = request.exit_threshold;
  switch (request.policy) {
    case PlanPolicy::kKnapSpec: {
      KnapSpecOptions options = options_.knapspec;
      options.max_draft = request.max_draft;
      return SolveKnapSpec(model_, profile, inputs, options);
    }
    case PlanPolicy::kClasp: {
      ClaspOptions options;
      options.num_skipped_layers = request.clasp_layers;
      options.max_draft = request.max_draft;
      options.keep_first_and_last = options_.knapspec.keep_first_and_last;
      options.alpha_prior = options_.knapspec.alpha_prior;
      return SolveClasp(model_, profile, inputs, options);
    }
    case PlanPolicy::kOff:
      break;  // answered above
    case PlanPolicy::kStatic: {
      ASSIGN_OR_RETURN(LayerMask mask, LayerMask::Parse(request.static_mask,
                                                        model_.num_layers()));
      StaticOptions options;
      options.max_draft = request.max_draft;
      options.alpha_prior = options_.knapspec.alpha_prior;
      return SolveStatic(model_, profile, inputs, mask, options);
    }
  }
  return absl::InvalidArgumentError("policy: unknown");
}

void InProcessPlanner::Run() {
  // This thread's own OpenMP team size: the solve must not take the decode
  // threads' cores away wholesale. (at::set_num_threads would also change the
  // process-wide default that new threads start from.)
  at::get_num_threads();  // ATen's lazy per-thread init first, then override it
  omp_set_num_threads(options_.threads);
  // Applies to this thread; the OpenMP workers it starts inherit it. A
  // refusal (a seccomp filter) leaves the solve at normal priority: plans
  // still come, decoding shares the cores with them.
  ApplyToThisThreadOrWarn(options_.priority, "planner thread");
  c10::InferenceMode inference_mode;
  while (true) {
    Pending job;
    {
      absl::MutexLock lock(&mu_);
      while (!stopping_ && order_.empty()) cv_.Wait(&mu_);
      if (stopping_) return;
      const uint64_t id = order_.front();
      order_.pop_front();
      auto it = pending_.find(id);
      job = std::move(it->second);
      pending_.erase(it);
    }
    const double queued = std::chrono::duration<double>(
                              std::chrono::steady_clock::now() - job.queued_at)
                              .count();
    // Traced (common/trace): the wait and the solve, children of the span
    // that sent the request; the solve's stages hang from plan.solve.
    trace::Span solve_span;
    if (trace::GlobalTracer() != nullptr) {
      const int64_t now = trace::NowUnixNanos();
      trace::Span queue_span = trace::StartSpan(
          "plan.queue", job.request.traceparent, trace::SpanKind::kInternal,
          now - static_cast<int64_t>(queued * 1e9));
      queue_span.SetAttribute("knapserve.plan.queue_seconds", queued);
      queue_span.End(now);
      solve_span = trace::StartSpan("plan.solve", job.request.traceparent);
      SetPlanRequestAttributes(solve_span, job.request);
    }
    absl::StatusOr<DraftPlan> plan;
    // The exception boundary of a solve: it fails this request only.
    try {
      const ScopedSolveCores own_cores(options_.reserve_cores);
      trace::ScopedContext in_solve(solve_span.context());
      if (options_.before_solve_for_tests)
        options_.before_solve_for_tests(job.request);
      plan = Solve(job.request);
    } catch (...) {
      plan = CurrentExceptionAsInternal("planner: the solve failed");
      internal_errors_.fetch_add(1);
    }
    if (plan.ok()) plan->queue_seconds = queued;
    if (solve_span.recording()) {
      if (plan.ok()) {
        SetPlanAttributes(solve_span, *plan);
      } else {
        solve_span.SetError(plan.status().ToString());
      }
    }
    solve_span.End();
    job.request = PlanRequest();  // release the K/V handles before reporting
    {
      absl::MutexLock lock(&mu_);
      ++solved_;
    }
    job.done(std::move(plan));
  }
}

}  // namespace knapserve
