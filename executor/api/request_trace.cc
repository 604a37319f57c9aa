#include "executor/api/request_trace.h"

#include <algorithm>
#include <vector>

#include "executor/engine/speculation_mode.h"

namespace knapserve {
namespace {

int64_t Nanos(double seconds) { return static_cast<int64_t>(seconds * 1e9); }

}  // namespace

void RequestTrace::Start(std::string_view traceparent,
                         std::string_view request_id,
                         std::string_view front_door,
                         std::string_view operation, std::string_view model) {
  if (trace::GlobalTracer() == nullptr) return;
  start_unix_nanos_ = trace::NowUnixNanos();
  root_ = trace::StartSpan("generate", traceparent, trace::SpanKind::kServer,
                           start_unix_nanos_);
  if (!root_.recording()) return;
  root_.SetAttribute("gen_ai.system", "knapserve");
  root_.SetAttribute("gen_ai.operation.name", operation);
  root_.SetAttribute("gen_ai.request.model", model);
  root_.SetAttribute("gen_ai.response.id", request_id);
  root_.SetAttribute("knapserve.request_id", request_id);
  root_.SetAttribute("knapserve.front_door", front_door);
}

void RequestTrace::Begin(GenerationRequest& request) {
  if (!root_.context().valid()) return;
  begin_unix_nanos_ = trace::NowUnixNanos();
  decode_ = trace::StartSpan("decode", root_.context(),
                             trace::SpanKind::kInternal, begin_unix_nanos_);
  request.trace_parent = decode_.context();
  if (!root_.recording()) return;
  root_.SetAttribute("gen_ai.request.max_tokens", request.max_new_tokens);
  root_.SetAttribute("gen_ai.request.temperature",
                     request.sampling.temperature);
  root_.SetAttribute("gen_ai.request.top_p", request.sampling.top_p);
  if (request.sampling.top_k > 0) {
    root_.SetAttribute("gen_ai.request.top_k", request.sampling.top_k);
  }
  root_.SetAttribute("knapserve.spec.mode",
                     SpeculationModeName(request.speculation.mode));
  root_.SetAttribute("knapserve.spec.max_draft", request.speculation.max_draft);
}

void RequestTrace::Finish(const absl::Status& status,
                          const GenerationResult* result) {
  if (!root_.context().valid() || finished_) return;
  finished_ = true;
  const int64_t end = trace::NowUnixNanos();
  if (result != nullptr) {
    const GenerationStats& stats = result->stats;
    // The sequence's first pass, first token and end as it recorded them
    // (else measured back from now).
    const int64_t seq_end =
        stats.end_unix_nanos > 0 ? std::min(stats.end_unix_nanos, end) : end;
    const int64_t first_pass = std::clamp(
        stats.first_pass_unix_nanos > 0 ? stats.first_pass_unix_nanos
                                        : seq_end - Nanos(stats.total_seconds),
        start_unix_nanos_, seq_end);
    const int64_t first_token =
        std::clamp(stats.first_token_unix_nanos > 0
                       ? stats.first_token_unix_nanos
                       : first_pass + Nanos(stats.prefill_seconds),
                   first_pass, seq_end);
    trace::Span queue =
        trace::StartSpan("queue", root_.context(), trace::SpanKind::kInternal,
                         start_unix_nanos_);
    queue.End(first_pass);
    trace::Span prefill = trace::StartSpan(
        "prefill", root_.context(), trace::SpanKind::kInternal, first_pass);
    prefill.SetAttribute("gen_ai.usage.input_tokens", stats.prompt_tokens);
    prefill.End(first_token);
    decode_.SetStartTime(first_token);
    decode_.SetAttribute("gen_ai.usage.output_tokens", stats.completion_tokens);
    decode_.SetAttribute("knapserve.decode_steps", stats.steps);
    decode_.SetAttribute("knapserve.decode_tokens_per_second",
                         stats.decode_tokens_per_second());
    decode_.SetAttribute("knapserve.plan_requests", stats.plan_requests);
    decode_.SetAttribute("knapserve.plan_failures", stats.plan_failures);
    // The online guard (every drafting mode): its judgements and the plain
    // steps it forced, those under another request's verdict among them,
    // and the steps after the prefill it kept plain for an unproven setting.
    const PlanningStats& guard = result->planning;
    decode_.SetAttribute("knapserve.guard.checks", guard.guard_checks);
    decode_.SetAttribute("knapserve.guard.fallbacks", guard.guard_fallbacks);
    decode_.SetAttribute("knapserve.guard.plain_steps",
                         guard.guard_plain_steps);
    decode_.SetAttribute("knapserve.guard.inherited_steps",
                         guard.guard_inherited_steps);
    decode_.SetAttribute("knapserve.guard.carried_steps",
                         guard.guard_carried_steps);
    decode_.SetAttribute("knapserve.guard.settle_steps",
                         guard.guard_settle_steps);
    decode_.SetAttribute("knapserve.guard.confirmations",
                         guard.guard_confirmations);
    decode_.SetAttribute("knapserve.guard.cleared_losses",
                         guard.guard_cleared_losses);
    decode_.End(seq_end);

    const SpeculationStats& spec = result->speculation;
    root_.SetAttribute("gen_ai.usage.input_tokens", stats.prompt_tokens);
    root_.SetAttribute("gen_ai.usage.output_tokens", stats.completion_tokens);
    root_.SetAttribute(
        "gen_ai.response.finish_reasons",
        std::vector<std::string>{FinishReasonName(result->finish_reason)});
    root_.SetAttribute("knapserve.spec.drafts", spec.drafts);
    root_.SetAttribute("knapserve.spec.draft_tokens", spec.draft_tokens);
    root_.SetAttribute("knapserve.spec.accepted_tokens", spec.accepted_tokens);
    root_.SetAttribute("knapserve.spec.acceptance_rate",
                       spec.acceptance_rate());
    root_.SetAttribute("knapserve.spec.mean_accepted_length",
                       spec.mean_acceptance_length());
    root_.SetAttribute("knapserve.spec.mask", result->mask);
    root_.SetAttribute("knapserve.plans_applied",
                       static_cast<int64_t>(result->plans.size()));
  } else if (begin_unix_nanos_ > 0) {
    // It failed (or was cancelled) while running: no timings came back, so
    // decode covers everything from the worker on.
    trace::Span queue =
        trace::StartSpan("queue", root_.context(), trace::SpanKind::kInternal,
                         start_unix_nanos_);
    queue.End(begin_unix_nanos_);
    decode_.SetError(status.ToString());
    decode_.End(end);
  }
  if (status.ok()) {
    root_.SetOk();
  } else {
    root_.SetError(status.ToString());
    root_.SetAttribute("knapserve.status_code",
                       absl::StatusCodeToString(status.code()));
  }
  root_.End(end);
}

}  // namespace knapserve
