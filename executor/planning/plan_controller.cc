#include "executor/planning/plan_controller.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"

namespace knapserve {

std::string PlanTriggerName(PlanTrigger trigger) {
  switch (trigger) {
    case PlanTrigger::kNone:
      return "none";
    case PlanTrigger::kNoPlan:
      return "no_plan";
    case PlanTrigger::kNewBucket:
      return "new_bucket";
    case PlanTrigger::kDrift:
      return "drift";
    case PlanTrigger::kRecheck:
      return "recheck";
  }
  return "unknown";
}

// ---------------------------------------------------------------------------
// SpeculationGuard

SpeculationGuard::SpeculationGuard(GuardOptions options,
                                   std::shared_ptr<StepTimeTable> plain_rates,
                                   std::shared_ptr<GuardVerdicts> verdicts,
                                   std::string execution_id,
                                   std::string setting, uint64_t sequence_id,
                                   int64_t bucket_tokens)
    : options_(options),
      plain_rates_(std::move(plain_rates)),
      verdicts_(std::move(verdicts)),
      execution_id_(std::move(execution_id)),
      setting_(std::move(setting)),
      sequence_id_(sequence_id),
      bucket_tokens_(bucket_tokens) {}

void SpeculationGuard::Reset() {
  if (confirming()) DropConfirmation();
  state_ = State::kSpeculate;
  evidence_.clear();
  window_steps_ = 0;
  probe_left_ = 0;
  probe_setting_.clear();
  probe_plain_.clear();
  futile_run_ = 0;
  probe_first_bucket_ = -1;
}

double RateStandardError(int64_t steps, double tokens, double seconds,
                         double tokens_sq, double token_seconds,
                         double seconds_sq) {
  if (steps < 2 || seconds <= 0) return 0.0;
  const double rate = tokens / seconds;
  // sum (t_i - R s_i)^2, expanded; rounding can take it just below 0.
  const double residuals = std::max(
      0.0, tokens_sq - 2 * rate * token_seconds + rate * rate * seconds_sq);
  const double n = static_cast<double>(steps);
  return std::sqrt(residuals * n / (n - 1)) / seconds;
}

namespace {

// The steps no longer than OutlierThresholdSeconds(`factor`) of their own.
std::vector<GuardVerdicts::Step> StepsWithinOutlierBound(
    const std::deque<GuardVerdicts::Step>& steps, double factor) {
  std::vector<double> seconds;
  for (const GuardVerdicts::Step& e : steps) seconds.push_back(e.seconds);
  const double threshold = OutlierThresholdSeconds(seconds, factor);
  std::vector<GuardVerdicts::Step> kept;
  for (const GuardVerdicts::Step& e : steps) {
    if (e.seconds <= threshold) kept.push_back(e);
  }
  return kept;
}

// A ratio of two sums, sum x_i / sum y_i, with its standard error
// (RateStandardError: the delta method, which counts how x and y move
// together).
class RatioOfSums {
 public:
  void Add(double x, double y) {
    ++n_;
    x_ += x;
    y_ += y;
    xx_ += x * x;
    xy_ += x * y;
    yy_ += y * y;
  }
  double x() const { return x_; }
  double ratio() const { return y_ > 0 ? x_ / y_ : 0.0; }
  double standard_error() const {
    return RateStandardError(n_, x_, y_, xx_, xy_, yy_);
  }

 private:
  int64_t n_ = 0;
  double x_ = 0, y_ = 0, xx_ = 0, xy_ = 0, yy_ = 0;
};

}  // namespace

SpeculationGuard::Rate SpeculationGuard::RateOf(
    const std::deque<StepEvidence>& steps) const {
  RatioOfSums sums;  // tokens over seconds
  for (const StepEvidence& e :
       StepsWithinOutlierBound(steps, options_.outlier_factor)) {
    sums.Add(e.tokens, e.seconds);
  }
  Rate rate;
  if (sums.ratio() <= 0) return rate;
  rate.tokens_per_second = sums.ratio();
  rate.tokens = sums.x();
  rate.standard_error = sums.standard_error();
  return rate;
}

SpeculationGuard::Rate SpeculationGuard::PairedRateOf(
    const std::deque<StepEvidence>& evidence,
    const std::deque<StepEvidence>& paired) const {
  // Each sample's steps within its own outlier bound. The pool's rate, and
  // its step seconds by draft tokens proposed.
  struct Seconds {
    double sum = 0;
    int64_t steps = 0;
  };
  RatioOfSums pool_rate;  // tokens over seconds
  std::map<int, Seconds> pool_seconds;
  for (const StepEvidence& e :
       StepsWithinOutlierBound(evidence, options_.outlier_factor)) {
    pool_rate.Add(e.tokens, e.seconds);
    Seconds& by_drafts = pool_seconds[e.drafted];
    by_drafts.sum += e.seconds;
    ++by_drafts.steps;
  }
  // The pace now against the pool's: each paired step's seconds against
  // the pool's mean for its draft count.
  RatioOfSums pace;  // paired seconds over the pool's seconds
  for (const StepEvidence& e :
       StepsWithinOutlierBound(paired, options_.outlier_factor)) {
    const auto found = pool_seconds.find(e.drafted);
    if (found == pool_seconds.end()) continue;
    pace.Add(e.seconds,
             found->second.sum / static_cast<double>(found->second.steps));
  }
  if (pool_rate.ratio() <= 0 || pace.ratio() <= 0) return RateOf(paired);
  Rate rate;
  rate.tokens_per_second = pool_rate.ratio() / pace.ratio();
  rate.standard_error =
      rate.tokens_per_second *
      std::hypot(pool_rate.standard_error() / pool_rate.ratio(),
                 pace.standard_error() / pace.ratio());
  rate.tokens = pool_rate.x();
  return rate;
}

bool SpeculationGuard::BeforeStep(int64_t bucket, PlanningStats& stats) {
  if (!options_.enabled) return false;
  if (state_ == State::kFallback) return true;  // lone fallback
  if (state_ == State::kProbe) {
    if (!confirming() || verdicts_ == nullptr) return NextProbeStepIsPlain();
    const std::optional<GuardVerdicts::Verdict> held =
        verdicts_->Find(execution_id_, setting_, bucket_tokens_, bucket);
    if (!held.has_value() || held->plan_version < plan_version_) {
      return NextProbeStepIsPlain();
    }
    // Another sequence's loss holds the setting now: it stands, and the
    // confirmation is dropped (GuardOptions::confirm_losses).
    DropConfirmation();
    state_ = State::kSpeculate;
    probe_left_ = 0;
  }
  if (verdicts_ != nullptr) {
    const std::optional<GuardVerdicts::Verdict> verdict =
        verdicts_->TakePlainStep(
            execution_id_, setting_, bucket_tokens_, bucket, plan_version_,
            options_.carry_neighbour_losses ? options_.reprobe_steps : 0);
    if (verdict.has_value()) {
      ++stats.guard_plain_steps;
      if (verdict->sequence_id != sequence_id_) ++stats.guard_inherited_steps;
      if (verdict->carried_from_bucket >= 0) ++stats.guard_carried_steps;
      if (stats.guard_last_plain_tps == 0) {
        stats.guard_last_spec_tps = verdict->spec_tps;
        stats.guard_last_plain_tps = verdict->plain_tps;
      }
      return true;
    }
  }
  if (!settled() && options_.settle_plain && verdicts_ != nullptr &&
      !verdicts_->WonLast(execution_id_, setting_, bucket_tokens_, bucket,
                          plan_version_)) {
    ++stats.guard_settle_steps;
    return true;
  }
  if (settled() && bucket != probe_first_bucket_) {
    // The setting's first step, or its first at this bucket.
    probe_first_bucket_ = bucket;
    if (options_.probe_first && options_.probe_steps > 0 &&
        !PlainRate(bucket).has_value()) {
      StartProbe();
      return NextProbeStepIsPlain();
    }
  }
  return false;
}

void SpeculationGuard::StartProbe() {
  if (confirming()) DropConfirmation();
  state_ = State::kProbe;
  probe_left_ = options_.probe_steps;
  probe_setting_.clear();
  probe_plain_.clear();
  // The setting's step first: a slow start (the steps right after a
  // prefill) then weighs on the setting, not on its reference.
  probe_plain_next_ = false;
}

void SpeculationGuard::DropConfirmation() {
  if (verdicts_ != nullptr) {
    verdicts_->EndConfirmation(execution_id_, setting_, bucket_tokens_,
                               confirm_bucket_, sequence_id_);
  }
  confirm_bucket_ = -1;
}

bool SpeculationGuard::NextProbeStepIsPlain() {
  const bool plain = probe_plain_next_;
  probe_plain_next_ = !plain;
  return plain;
}

void SpeculationGuard::AddEvidence(int64_t bucket, const StepObservation& step,
                                   PlanningStats& stats) {
  const int64_t keep = std::max(options_.evidence_steps, options_.min_steps);
  if (verdicts_ != nullptr) {
    // The setting's steps since its last judgement at the bucket, from
    // every sequence, make the window.
    window_steps_ = verdicts_->AddStep(
        execution_id_, setting_, bucket_tokens_, bucket, plan_version_,
        {step.tokens, step.seconds, step.drafted}, keep);
  } else {
    ++window_steps_;
    evidence_.push_back({step.tokens, step.seconds, step.drafted});
    while (static_cast<int64_t>(evidence_.size()) > keep) evidence_.pop_front();
  }
  if (state_ == State::kProbe) return;  // judged when the probe ends
  JudgeIfDue(bucket, stats);
}

void SpeculationGuard::JudgeIfDue(int64_t bucket, PlanningStats& stats) {
  if (window_steps_ >= options_.min_steps) {
    Judge(bucket, stats);
  } else if (options_.early_steps > 0 &&
             window_steps_ >= options_.early_steps) {
    Judge(bucket, stats, JudgeKind::kEarly);
  }
}

void SpeculationGuard::Observe(bool speculating, int64_t bucket,
                               const StepObservation& step,
                               PlanningStats& stats) {
  if (options_.enabled && options_.futile_steps > 0 && speculating &&
      step.gamma > 0 && !step.capped && state_ != State::kFallback) {
    // Not a timing: counted in the settle steps too.
    futile_run_ = step.saved_no_layers ? futile_run_ + 1 : 0;
    if (futile_run_ >= options_.futile_steps) {
      if (!settled()) ++steps_seen_;
      JudgeFutile(bucket, stats);
      return;
    }
  }
  if (!settled()) {
    ++steps_seen_;
    return;
  }
  if (!options_.enabled) return;
  // The last steps of a request, whose draft budget the end of the
  // generation held below gamma, are not the setting's steps.
  if (step.capped) return;
  switch (state_) {
    case State::kSpeculate:
      if (!speculating || step.gamma == 0) return;
      AddEvidence(bucket, step, stats);
      return;
    case State::kProbe: {
      if (speculating && step.gamma > 0) {
        // The setting's step of a pair.
        probe_setting_.push_back({step.tokens, step.seconds, step.drafted});
        AddEvidence(bucket, step, stats);
        return;
      }
      ++stats.guard_probe_steps;
      if (step.tokens == 1) probe_plain_.push_back({1, step.seconds});
      if (--probe_left_ > 0) return;
      state_ = State::kSpeculate;
      if (confirming()) {
        // A narrow loss's confirmation: the pairs judge it, win or loss,
        // unless the context left its bucket meanwhile (they are pairs of
        // two buckets) or a loss overtook it (AddPairs).
        if (bucket != confirm_bucket_) {
          DropConfirmation();
        } else {
          confirm_bucket_ = -1;  // AddPairs ends its mark
          if (Judge(bucket, stats, JudgeKind::kConfirm)) return;
        }
      }
      // The pairs condemn a clear loser at once; otherwise the setting is
      // judged as before, against the bucket's plain rate (the probe's
      // plain steps, now), when due.
      if (probe_setting_.size() >= 2 && !probe_plain_.empty() &&
          Judge(bucket, stats, JudgeKind::kPaired)) {
        return;
      }
      bool has_plain = PlainRate(bucket).has_value();
      if (!has_plain && !probe_plain_.empty()) {
        // The table did not take the probe's plain steps (a solve ran
        // beside them): they are this guard's reference for the bucket.
        const Rate plain_rate = RateOf(probe_plain_);
        if (plain_rate.tokens_per_second > 0) {
          probe_reference_ = ProbeReference{bucket, plain_rate, absl::Now()};
          has_plain = true;
        }
      }
      if (has_plain) {
        JudgeIfDue(bucket, stats);
      } else {
        // No plain rate for the bucket (the context crossed a boundary
        // meanwhile, or the probe's steps aged out): measure speculation
        // again, then probe again.
        Reset();
        probe_first_bucket_ = bucket;
      }
      return;
    }
    case State::kFallback:
      ++stats.guard_plain_steps;
      return;
  }
}

namespace {

// AppliedPlan::source of a plan that replaced the one in force: a
// refinement of a cached solve, this sequence's own solve, or another's.
const char* NewerPlanSource(const CachedPlan& plan, uint64_t sequence_id) {
  if (plan.refined) return "refined";
  return plan.sequence_id == sequence_id ? "solve" : "shared";
}

// How old a plain step may be to count as plain decoding's rate now
// (GuardOptions::plain_max_age_seconds; <= 0: any age).
absl::Duration PlainMaxAge(const GuardOptions& options) {
  return options.plain_max_age_seconds > 0
             ? absl::Seconds(options.plain_max_age_seconds)
             : absl::InfiniteDuration();
}

// How long a confirmation under way keeps others from starting one at its
// key (GuardVerdicts::StartConfirmation): as long as a plain step counts, at
// most 10 s (a sequence that ended mid-probe leaves its mark behind).
absl::Duration ConfirmationMaxAge(const GuardOptions& options) {
  return std::min(PlainMaxAge(options), absl::Seconds(10));
}

// The bucket's recent steps in `table` (plain steps or draft costs) by the
// guard's rules (probe_steps samples, outlier_factor, PlainMaxAge).
std::optional<StepTimeTable::StepTime> RecentStepsByGuardRules(
    const StepTimeTable& table, const GuardOptions& options,
    const std::string& execution_id, int64_t bucket_tokens, int64_t bucket) {
  const int min_samples =
      static_cast<int>(std::max<int64_t>(1, options.probe_steps));
  return table.RecentStepTime(execution_id, bucket_tokens, bucket, min_samples,
                              PlainMaxAge(options), absl::Now(),
                              options.outlier_factor);
}

}  // namespace

std::optional<SpeculationGuard::Rate> SpeculationGuard::PlainRate(
    int64_t bucket, bool* from_table) const {
  const std::optional<StepTimeTable::StepTime> table = RecentStepsByGuardRules(
      *plain_rates_, options_, execution_id_, bucket_tokens_, bucket);
  const bool table_has_rate = table.has_value() && table->mean_seconds > 0;
  if (from_table != nullptr) *from_table = table_has_rate;
  if (table_has_rate) {
    // One token a step: the rate is 1 / mean, and its standard error the
    // mean's over mean^2 (the delta method).
    const double mean = table->mean_seconds;
    return Rate{1.0 / mean, table->standard_error / (mean * mean)};
  }
  if (probe_reference_.has_value() && probe_reference_->bucket == bucket &&
      absl::Now() - probe_reference_->at <= PlainMaxAge(options_)) {
    return probe_reference_->plain;
  }
  return std::nullopt;
}

std::deque<SpeculationGuard::StepEvidence> SpeculationGuard::Evidence(
    int64_t bucket) const {
  if (verdicts_ == nullptr) return evidence_;
  return verdicts_->Steps(execution_id_, setting_, bucket_tokens_, bucket,
                          plan_version_);
}

namespace {

// Whether `rate` is below `bound` times the plain rate by more than
// `confidence` standard errors of their difference: both rates are
// measured, so the plain rate's own error counts with the setting's (on a
// noisy machine 8 plain steps know their mean to a few percent, as much as
// the margin).
bool BelowPlain(const SpeculationGuard::Rate& rate,
                const SpeculationGuard::Rate& plain, double bound,
                double confidence) {
  const double error =
      std::hypot(rate.standard_error, bound * plain.standard_error);
  return rate.tokens_per_second + confidence * error <
         bound * plain.tokens_per_second;
}

// Whether `rate` is at least `bound` times the plain rate even less
// `confidence` standard errors of their difference: a win that proves the
// setting, not one its steps' spread allows (BelowPlain with the error
// counted against the setting).
bool ProvenAbovePlain(const SpeculationGuard::Rate& rate,
                      const SpeculationGuard::Rate& plain, double bound,
                      double confidence) {
  return !BelowPlain(rate, plain, bound, -confidence);
}

}  // namespace

bool SpeculationGuard::Judge(int64_t bucket, PlanningStats& stats,
                             JudgeKind kind) {
  std::optional<Rate> plain;
  bool plain_from_table = false;
  Rate rate;
  if (kind == JudgeKind::kPaired) {
    // The probe's own pairs: its plain steps against the setting's steps
    // between them (outliers left out alike).
    const Rate plain_rate = RateOf(probe_plain_);
    if (plain_rate.tokens_per_second > 0) plain = plain_rate;
    rate = RateOf(probe_setting_);
  } else if (kind == JudgeKind::kConfirm) {
    // The probe's pairs with the setting's earlier confirming pairs here.
    GuardVerdicts::Pairs pairs{probe_setting_, probe_plain_};
    if (verdicts_ != nullptr) {
      pairs = verdicts_->AddPairs(
          execution_id_, setting_, bucket_tokens_, bucket, plan_version_,
          sequence_id_, pairs,
          std::max(options_.evidence_steps, options_.min_steps));
    }
    if (pairs.setting.size() < 2 || pairs.plain.empty()) return false;
    const Rate plain_rate = RateOf(pairs.plain);
    if (plain_rate.tokens_per_second > 0) plain = plain_rate;
    rate = PairedRateOf(Evidence(bucket), pairs.setting);
  } else {
    plain = PlainRate(bucket, &plain_from_table);
    rate = RateOf(Evidence(bucket));
  }
  const bool has_plain = plain.has_value() && plain->tokens_per_second > 0;
  if (kind == JudgeKind::kEarly || kind == JudgeKind::kPaired) {
    // Before min_steps, and on a probe's pairs, only a loss is judged, and
    // only against a measured plain rate (no probe for it): a clear loss,
    // or, when the setting lost its last judgement here (a re-probe), any
    // loss. Eight of a winner's steps early in its text may draft less
    // than the rest, and a loss holds every request of the setting plain.
    if (!has_plain) return false;
    const bool lost_here =
        verdicts_ != nullptr &&
        verdicts_->LastLost(execution_id_, setting_, bucket_tokens_, bucket,
                            plan_version_);
    const double bound =
        lost_here ? 1.0 + options_.margin : 1.0 - options_.early_loss;
    if (rate.tokens_per_second <= 0 ||
        !BelowPlain(rate, *plain, bound, options_.confidence)) {
      return false;
    }
  }
  if (!has_plain) {
    StartProbe();
    return false;
  }
  if (rate.tokens_per_second <= 0) {
    Reset();
    return false;
  }
  const bool loses =
      BelowPlain(rate, *plain, 1.0 + options_.margin,
                 kind == JudgeKind::kConfirm ? options_.confirm_confidence
                                             : options_.confidence);
  // At least two pairs: kConfirm needs two of the setting's steps.
  if (loses && options_.confirm_losses && options_.probe_steps >= 2 &&
      plain_from_table &&
      !BelowPlain(rate, *plain, 1.0 - options_.early_loss,
                  options_.confidence)) {
    // A narrow loss against the table's plain steps, measured at another
    // time: the pairs of a probe confirm it or not (GuardOptions::
    // confirm_losses). Against a probe's own plain steps it stands. While
    // another sequence confirms it (or a loss holds it), this one drafts
    // on: that confirmation's verdict will come.
    if (verdicts_ != nullptr &&
        !verdicts_->StartConfirmation(
            execution_id_, setting_, bucket_tokens_, bucket, plan_version_,
            sequence_id_, absl::Now(), ConfirmationMaxAge(options_))) {
      return false;
    }
    StartProbe();
    confirm_bucket_ = bucket;
    ++stats.guard_confirmations;
    return false;
  }
  if (kind == JudgeKind::kConfirm && !loses) ++stats.guard_cleared_losses;
  Record(rate, *plain, loses, bucket, stats, kind == JudgeKind::kConfirm);
  return true;
}

void SpeculationGuard::JudgeFutile(int64_t bucket, PlanningStats& stats) {
  // The rates measured so far, for the reports only.
  const Rate rate = RateOf(Evidence(bucket));
  const Rate plain = PlainRate(bucket).value_or(Rate{});
  // A probe under way ends here: its verdict is in.
  Reset();
  probe_first_bucket_ = bucket;
  Record(rate, plain, /*loses=*/true, bucket, stats);
}

int64_t SpeculationGuard::ExploreHoldSteps(const Rate& rate,
                                           const Rate& plain) const {
  if (options_.explore_share <= 0 || rate.tokens_per_second <= 0 ||
      plain.tokens_per_second <= rate.tokens_per_second) {
    return 0;
  }
  // The judged steps' tokens took tokens / rate seconds, tokens / plain
  // plainly: the difference in plain steps (one token each).
  const double cost_steps =
      rate.tokens * (plain.tokens_per_second / rate.tokens_per_second - 1.0);
  return std::llround(cost_steps / options_.explore_share);
}

void SpeculationGuard::Record(const Rate& rate, const Rate& plain, bool loses,
                              int64_t bucket, PlanningStats& stats,
                              bool confirmation) {
  ++stats.guard_checks;
  stats.guard_last_spec_tps = rate.tokens_per_second;
  stats.guard_last_plain_tps = plain.tokens_per_second;
  window_steps_ = 0;
  futile_run_ = 0;
  if (loses) {
    ++stats.guard_fallbacks;
    evidence_.clear();  // the re-probe measures afresh
  }
  state_ = State::kSpeculate;
  if (verdicts_ != nullptr) {
    GuardVerdicts::Verdict verdict;
    verdict.spec_tps = rate.tokens_per_second;
    verdict.plain_tps = plain.tokens_per_second;
    verdict.plan_version = plan_version_;
    verdict.sequence_id = sequence_id_;
    verdict.confirmation = confirmation;
    verdict.clear =
        loses && options_.clear_losses && rate.tokens_per_second > 0 &&
        plain.tokens_per_second > 0 &&
        BelowPlain(rate, plain, 1.0 - options_.early_loss, options_.confidence);
    GuardVerdicts::Judgement judgement = GuardVerdicts::Judgement::kLoss;
    if (!loses) {
      judgement = ProvenAbovePlain(rate, plain, 1.0 + options_.margin,
                                   options_.confidence)
                      ? GuardVerdicts::Judgement::kWin
                      : GuardVerdicts::Judgement::kUnprovenWin;
    }
    verdicts_->Judge(execution_id_, setting_, bucket_tokens_, bucket, judgement,
                     verdict, options_.reprobe_steps, options_.max_hold_steps,
                     loses ? ExploreHoldSteps(rate, plain) : 0);
  } else if (loses) {
    state_ = State::kFallback;
  }
}

// ---------------------------------------------------------------------------
// Tickets

void CompleteTicket(const PlanningShared& shared, const SubmitTicket& ticket,
                    uint64_t sequence_id, int64_t context_length,
                    const absl::StatusOr<DraftPlan>& plan) {
  double solve_seconds = 0;
  if (plan.ok()) {
    solve_seconds = plan->solve_seconds;
    shared.cache->Insert(ticket.key, *plan, sequence_id, context_length);
  }
  shared.cache->ReleaseClaim(ticket.key);
  shared.budget->Settle(ticket.reserved_seconds, solve_seconds);
}

// ---------------------------------------------------------------------------
// PlanController

PlanController::PlanController(PlanControllerOptions options, PlanCacheKey key,
                               uint64_t sequence_id, int initial_gamma,
                               PlanningShared shared)
    : options_(options),
      key_(std::move(key)),
      execution_id_(key_.ExecutionId()),
      sequence_id_(sequence_id),
      shared_(std::move(shared)),
      guard_(options_.guard, shared_.plain_rates, shared_.verdicts,
             execution_id_,
             absl::StrCat(PlanPolicyName(key_.policy),
                          key_.policy_detail.empty() ? "" : " ",
                          key_.policy_detail, " D", key_.max_draft,
                          options_.initial_mask.empty() ? "" : " skip=",
                          options_.initial_mask),
             sequence_id, options_.bucket_tokens),
      gamma_(initial_gamma) {
  key_.bucket_tokens = options_.bucket_tokens;
}

PlanController::~PlanController() { AbandonCapture(); }

void PlanController::SetTrigger(PlanTrigger trigger) {
  trigger_ = trigger;
  last_trigger_ = trigger;
  deferral_counted_ = false;
  switch (trigger) {
    case PlanTrigger::kNoPlan:
      ++stats_.triggers_no_plan;
      break;
    case PlanTrigger::kNewBucket:
      ++stats_.triggers_new_bucket;
      break;
    case PlanTrigger::kDrift:
      ++stats_.triggers_drift;
      break;
    case PlanTrigger::kRecheck:
      ++stats_.triggers_recheck;
      break;
    case PlanTrigger::kNone:
      break;
  }
}

void PlanController::AbandonCapture() {
  if (!capturing_) return;
  capturing_ = false;
  shared_.cache->ReleaseClaim(capture_ticket_.key);
  shared_.budget->Settle(capture_ticket_.reserved_seconds, 0);
}

void PlanController::Apply(const CachedPlan& plan, int64_t bucket,
                           const std::string& source,
                           StepDirective& directive) {
  // A newer version of the solve in force (the cache refined its gamma)
  // keeps the sequence's own evidence; any other plan starts it afresh.
  const bool same_solve = in_force_.has_value() &&
                          in_force_key_.bucket == bucket &&
                          in_force_->sequence_id == plan.sequence_id &&
                          in_force_->plan.step == plan.plan.step &&
                          in_force_->plan.mask == plan.plan.mask;
  sequence_plan_.reset();
  if (!same_solve) {
    own_evidence_ = DraftEvidence();
    pooled_evidence_ = DraftEvidence();
    own_next_trials_ = std::max<int64_t>(1, options_.sequence_first_trials);
  }
  own_plain_steps_ = 0;
  in_force_ = plan;
  in_force_key_ = key_;
  in_force_key_.bucket = bucket;
  std::string applied_source = source;
  if (same_solve && own_evidence_.accept_trials() > 0) {
    std::optional<DraftPlan> own = SequencePlan(plan.plan);
    if (own.has_value()) {
      in_force_->plan = *std::move(own);
      applied_source = "sequence";
    }
  }
  gamma_ = in_force_->plan.gamma;
  applied_version_ = plan.version;
  drift_trials_ = 0;
  drift_accepted_ = 0;
  drift_steps_ = 0;
  drift_drafted_ = 0;
  drift_fired_ = false;
  guard_.SetPlan(plan.version);
  directive.apply = in_force_;
  directive.apply_source = applied_source;
}

std::optional<DraftPlan> PlanController::SequencePlan(
    const DraftPlan& plan) const {
  if (options_.sequence_prior_tokens <= 0) return std::nullopt;
  return RefinePlanForSequence(plan, pooled_evidence_, own_evidence_,
                               options_.sequence_prior_tokens);
}

StepDirective PlanController::BeforeStep(int64_t step, int64_t context_length,
                                         bool may_start_capture,
                                         bool profile_pending) {
  StepDirective directive;
  step_began_beside_solve_ = SolvesInFlight();
  const int64_t bucket = ContextBucket(context_length, options_.bucket_tokens);
  if (!started_ || bucket != bucket_) {
    const bool first = !started_;
    started_ = true;
    AbandonCapture();
    trigger_ = PlanTrigger::kNone;
    last_trigger_ = PlanTrigger::kNone;
    bucket_ = bucket;
    key_.bucket = bucket;
    std::optional<CachedPlan> hit = shared_.cache->Lookup(key_);
    if (hit.has_value()) {
      ++stats_.cache_hits;
      Apply(*hit, bucket_, "cache", directive);
    } else {
      ++stats_.cache_misses;
      SetTrigger(first ? PlanTrigger::kNoPlan : PlanTrigger::kNewBucket);
    }
  } else {
    const int64_t version = shared_.cache->Version(key_);
    if (version != 0 && version != applied_version_) {
      std::optional<CachedPlan> newer = shared_.cache->Peek(key_);
      if (newer.has_value()) {
        Apply(*newer, bucket_, NewerPlanSource(*newer, sequence_id_),
              directive);
        // The newer plan answers whatever this sequence was waiting for.
        AbandonCapture();
        trigger_ = PlanTrigger::kNone;
      }
    }
  }

  ApplyAwaitedPlan(directive);

  if (sequence_plan_.has_value()) {
    // The sequence's own odds chose again at its last step: they take
    // effect unless a newer plan just did.
    if (!directive.apply.has_value() && in_force_.has_value()) {
      in_force_->plan = *std::move(sequence_plan_);
      gamma_ = in_force_->plan.gamma;
      own_plain_steps_ = 0;
      directive.apply = in_force_;
      directive.apply_source = "sequence";
    }
    sequence_plan_.reset();
  }
  if (!directive.apply.has_value() && in_force_.has_value() && gamma_ == 0 &&
      own_evidence_.accept_trials() > 0 &&
      own_plain_steps_ >= std::max<int64_t>(1, options_.sequence_plain_steps)) {
    // Its own odds chose plain decoding long enough ago: the cache's plan
    // again, and fresh evidence of its own.
    std::optional<CachedPlan> pooled = shared_.cache->Peek(in_force_key_);
    own_plain_steps_ = 0;
    if (pooled.has_value() && pooled->version == applied_version_ &&
        pooled->plan.gamma > 0) {
      own_evidence_ = DraftEvidence();
      own_next_trials_ = std::max<int64_t>(1, options_.sequence_first_trials);
      in_force_ = *std::move(pooled);
      gamma_ = in_force_->plan.gamma;
      directive.apply = in_force_;
      directive.apply_source = "cache";
    }
  }

  if (trigger_ == PlanTrigger::kNone && !capturing_ &&
      last_trigger_ != PlanTrigger::kDrift &&
      last_trigger_ != PlanTrigger::kNone &&
      shared_.cache->Version(key_) == 0 && !shared_.cache->Claimed(key_)) {
    // This bucket's solve failed (no plan, none in flight): the same trigger
    // again, not counted twice.
    trigger_ = last_trigger_;
    deferral_counted_ = false;
  }
  if (capturing_ && step - capture_start_ >= options_.reference_steps) {
    // The snapshot never completed (a step gave no states): try again.
    AbandonCapture();
  }
  if (profile_pending) stats_.profile_pending = true;
  if (may_start_capture && !profile_pending && trigger_ != PlanTrigger::kNone &&
      !capturing_) {
    const bool gap_ok = !last_capture_start_.has_value() ||
                        step - *last_capture_start_ >= options_.min_request_gap;
    if (gap_ok && shared_.cache->TryClaim(key_)) {
      std::optional<double> reserved =
          shared_.budget->TryReserve(options_.planner_budget);
      if (reserved.has_value()) {
        capturing_ = true;
        capture_start_ = step;
        last_capture_start_ = step;
        capture_ticket_ = SubmitTicket{key_, *reserved, trigger_};
      } else {
        shared_.cache->ReleaseClaim(key_);
        if (!deferral_counted_) {
          deferral_counted_ = true;
          ++stats_.budget_deferrals;
          shared_.budget->CountDeferral();
        }
      }
    }
  }
  if (capturing_) {
    directive.capture = true;
    directive.capture_offset = step - capture_start_;
  }
  directive.gamma =
      gamma_ > 0 && may_start_capture && guard_.BeforeStep(bucket_, stats_)
          ? 0
          : gamma_;
  if (profile_pending && directive.gamma == 0 && !in_force_.has_value()) {
    ++stats_.profile_pending_steps;
  }
  return directive;
}

bool PlanController::SolvesInFlight() const {
  return shared_.budget != nullptr && shared_.budget->solves_in_flight() > 0;
}

bool StepMeasuresPlan(int plan_gamma, const StepObservation& step) {
  return (plan_gamma > 0) == (step.gamma > 0) && !step.capped;
}

PlanStepKind ClassifyPlanStep(bool beside_solve, bool settled, double seconds,
                              double expected_seconds, double outlier_factor) {
  if (beside_solve) return PlanStepKind::kBesideSolve;
  if (!settled) return PlanStepKind::kUnsteady;
  if (outlier_factor > 0 && expected_seconds > 0 &&
      seconds > outlier_factor * expected_seconds) {
    return PlanStepKind::kUnsteady;
  }
  return PlanStepKind::kMeasured;
}

void PlanController::AfterStep(const StepObservation& step) {
  last_step_beside_solve_ = step_began_beside_solve_ || SolvesInFlight();
  shared_.budget->AddDecodeSeconds(step.seconds);
  if (guard_.settled() && step.gamma == 0 && step.tokens == 1) {
    RecordPlainStep(shared_, execution_id_, options_.bucket_tokens, bucket_,
                    step.seconds, step_began_beside_solve_);
  }
  if (guard_.settled() && !last_step_beside_solve_ && in_force_.has_value() &&
      gamma_ > 0 && in_force_key_.bucket == bucket_ &&
      StepMeasuresPlan(gamma_, step) && in_force_->plan.predicted_tpt > 0) {
    const DraftPlan& plan = in_force_->plan;
    RecordDraftCost(shared_, execution_id_, options_.bucket_tokens, bucket_,
                    step.seconds,
                    plan.predicted_tokens_per_step / plan.predicted_tpt);
  }
  if (in_force_.has_value() && gamma_ == 0 && in_force_key_.bucket == bucket_ &&
      step.gamma == 0 && trigger_ == PlanTrigger::kNone && !capturing_ &&
      shared_.cache->CountPlainStep(key_, applied_version_,
                                    options_.plain_recheck_steps)) {
    SetTrigger(PlanTrigger::kRecheck);
  }
  if (in_force_.has_value() && gamma_ == 0 &&
      own_evidence_.accept_trials() > 0 && step.gamma == 0) {
    ++own_plain_steps_;  // under the sequence's own plain choice
  }
  if (in_force_.has_value() && gamma_ > 0 && step.gamma > 0 &&
      step.drafted > 0) {
    const int budget = step.budget > 0 ? step.budget : step.gamma;
    const PlanCache::PlanOdds cached = shared_.cache->RecordDraftStep(
        in_force_key_, applied_version_, budget, step.drafted, step.accepted);
    if (cached.evidence.accept_trials() > 0) pooled_evidence_ = cached.evidence;
    own_evidence_.AddStep(budget, step.drafted, step.accepted);
    if (own_evidence_.accept_trials() >= own_next_trials_) {
      while (own_next_trials_ <= own_evidence_.accept_trials()) {
        own_next_trials_ = std::max<int64_t>(1, own_next_trials_) * 2;
      }
      sequence_plan_ = SequencePlan(in_force_->plan);
    }
    drift_accepted_ += step.accepted;
    drift_trials_ += step.accepted + (step.accepted < step.drafted ? 1 : 0);
    ++drift_steps_;
    drift_drafted_ += step.drafted;
    if (!drift_fired_ && trigger_ == PlanTrigger::kNone &&
        drift_trials_ >= options_.drift_min_tokens && drift_trials_ > 0) {
      const double observed = static_cast<double>(drift_accepted_) /
                              static_cast<double>(drift_trials_);
      // Judged against the plan as the cache holds it now: refined by the
      // evidence of every sequence under it (this one's included), the
      // odds are the process's best estimate; one sequence's text drifted
      // when it differs from them. A plan from a planner that does not
      // predict drafts (0) is judged on acceptance alone.
      const bool refined_odds =
          cached.version == applied_version_ && cached.gamma > 0;
      const double expected_alpha =
          refined_odds ? cached.alpha_hat : in_force_->plan.alpha_hat;
      const double expected_drafts =
          refined_odds ? cached.predicted_drafts_per_step
                       : in_force_->plan.predicted_drafts_per_step;
      const double drafts = static_cast<double>(drift_drafted_) /
                            static_cast<double>(drift_steps_);
      const bool drafts_drift =
          expected_drafts > 0 && std::abs(drafts - expected_drafts) >
                                     options_.drift_tolerance * expected_drafts;
      if (std::abs(observed - expected_alpha) > options_.drift_tolerance ||
          drafts_drift) {
        drift_fired_ = true;
        SetTrigger(PlanTrigger::kDrift);
      }
    }
  }
  guard_.Observe(gamma_ > 0, bucket_, step, stats_);
}

namespace {

// The mean of `table`'s recent steps at `context_length`'s bucket by the
// guard's rules; nullopt without the table or with too few steps.
std::optional<double> RecentMean(const StepTimeTable* table,
                                 const PlanControllerOptions& options,
                                 const std::string& execution_id,
                                 int64_t context_length) {
  if (table == nullptr) return std::nullopt;
  const std::optional<StepTimeTable::StepTime> time = RecentStepsByGuardRules(
      *table, options.guard, execution_id, options.bucket_tokens,
      ContextBucket(context_length, options.bucket_tokens));
  if (!time.has_value()) return std::nullopt;
  return time->mean_seconds;
}

}  // namespace

std::optional<double> PlanController::PlainStepSeconds(
    int64_t context_length) const {
  return RecentMean(shared_.plain_rates.get(), options_, execution_id_,
                    context_length);
}

std::optional<double> PlanController::DraftCostRatio(
    int64_t context_length) const {
  return RecentMean(shared_.draft_costs.get(), options_, execution_id_,
                    context_length);
}

void PlanController::ApplyAwaitedPlan(StepDirective& directive) {
  if (awaited_keys_.empty()) return;
  if (in_force_.has_value() && in_force_key_.bucket == bucket_) {
    awaited_keys_.clear();  // the current bucket's own plan is in force
    return;
  }
  // The newest answered solve; answered, failed and current-bucket keys
  // leave the list (the current bucket's plan comes the usual way).
  std::optional<PlanCacheKey> newest;
  int64_t newest_version = 0;
  for (auto it = awaited_keys_.begin(); it != awaited_keys_.end();) {
    const int64_t version = shared_.cache->Version(*it);
    if (it->bucket == bucket_) {
      if (version != 0) {
        it = awaited_keys_.erase(it);
      } else {
        ++it;
      }
      continue;
    }
    if (version == 0) {
      // Not answered yet; or the solve failed (no claim left): nothing comes.
      if (shared_.cache->Claimed(*it)) {
        ++it;
      } else {
        it = awaited_keys_.erase(it);
      }
      continue;
    }
    if (version > newest_version) {
      newest_version = version;
      newest = *it;
    }
    it = awaited_keys_.erase(it);
  }
  if (!newest.has_value()) return;
  if (in_force_.has_value() && in_force_->version >= newest_version) return;
  std::optional<CachedPlan> plan = shared_.cache->Peek(*newest);
  if (!plan.has_value()) return;
  Apply(*plan, newest->bucket, NewerPlanSource(*plan, sequence_id_), directive);
}

SubmitTicket PlanController::TakeTicket() {
  capturing_ = false;
  trigger_ = PlanTrigger::kNone;
  awaited_keys_.push_back(capture_ticket_.key);
  if (awaited_keys_.size() > kMaxAwaited) awaited_keys_.pop_front();
  return capture_ticket_;
}

void PlanController::Finish() {
  AbandonCapture();
  stats_.process_planner_cpu_share = shared_.budget->share();
}

}  // namespace knapserve
