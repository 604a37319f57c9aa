#include "executor/planning/plan_cache.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"

namespace knapserve {

int64_t ContextBucket(int64_t context_length, int64_t bucket_tokens) {
  return std::max<int64_t>(0, context_length) /
         std::max<int64_t>(1, bucket_tokens);
}

std::string PlanCacheKey::ExecutionId() const {
  return absl::StrCat(model_fingerprint, "|", device, "|", dtype,
                      "|threads=", threads);
}

std::string PlanCacheKey::ToString() const {
  return absl::StrCat(ExecutionId(), "|", PlanPolicyName(policy), "|",
                      policy_detail, "|D=", max_draft, "|exit=", exit_threshold,
                      "|bucket=", bucket, "x", bucket_tokens);
}

bool PlanCacheKey::operator==(const PlanCacheKey& o) const {
  return model_fingerprint == o.model_fingerprint && device == o.device &&
         dtype == o.dtype && threads == o.threads && policy == o.policy &&
         policy_detail == o.policy_detail && max_draft == o.max_draft &&
         exit_threshold == o.exit_threshold &&
         bucket_tokens == o.bucket_tokens && bucket == o.bucket;
}

// ---------------------------------------------------------------------------
// PlanCache

std::optional<CachedPlan> PlanCache::Lookup(const PlanCacheKey& key) {
  absl::MutexLock lock(&mu_);
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    ++misses_;
    return std::nullopt;
  }
  ++hits_;
  return it->second;
}

std::optional<CachedPlan> PlanCache::Peek(const PlanCacheKey& key) const {
  absl::MutexLock lock(&mu_);
  auto it = plans_.find(key);
  if (it == plans_.end()) return std::nullopt;
  return it->second;
}

int64_t PlanCache::Version(const PlanCacheKey& key) const {
  absl::MutexLock lock(&mu_);
  auto it = plans_.find(key);
  return it == plans_.end() ? 0 : it->second.version;
}

int64_t PlanCache::Insert(const PlanCacheKey& key, DraftPlan plan,
                          uint64_t sequence_id, int64_t context_length) {
  absl::MutexLock lock(&mu_);
  CachedPlan& entry = plans_[key];
  const bool plain = plan.gamma == 0;
  entry.plan = std::move(plan);
  entry.version = next_version_++;
  entry.sequence_id = sequence_id;
  entry.context_length = context_length;
  entry.refined = false;
  if (plain) {
    PlainRecheck& recheck = rechecks_[key];
    recheck.version = entry.version;
    recheck.steps = 0;
    ++recheck.consecutive_plain;
  } else {
    rechecks_.erase(key);
  }
  refinements_[key] = Refinement{entry.version, DraftEvidence{}, 0};
  return entry.version;
}

PlanCache::PlanOdds PlanCache::RecordDraftStep(const PlanCacheKey& key,
                                               int64_t version, int gamma,
                                               int drafted, int accepted) {
  absl::MutexLock lock(&mu_);
  auto plan_it = plans_.find(key);
  if (plan_it == plans_.end()) return PlanOdds{};
  CachedPlan& entry = plan_it->second;
  const auto odds = [&entry](const DraftEvidence* evidence = nullptr) {
    return PlanOdds{entry.version, entry.plan.gamma, entry.plan.alpha_hat,
                    entry.plan.predicted_drafts_per_step,
                    evidence != nullptr ? *evidence : DraftEvidence()};
  };
  auto it = refinements_.find(key);
  if (refine_every_trials_ <= 0 || it == refinements_.end() ||
      version < it->second.solve_version || version > entry.version) {
    return odds();
  }
  Refinement& refinement = it->second;
  refinement.evidence.AddStep(gamma, drafted, accepted);
  const DraftEvidence* evidence = &refinement.evidence;
  if (refinement.evidence.accept_trials() - refinement.refined_at_trials <
      refine_every_trials_) {
    return odds(evidence);
  }
  refinement.refined_at_trials = refinement.evidence.accept_trials();
  std::optional<DraftPlan> refined =
      RefinePlan(entry.plan, refinement.evidence);
  if (!refined.has_value()) return odds(evidence);
  const bool new_gamma = refined->gamma != entry.plan.gamma;
  entry.plan = *std::move(refined);
  if (!new_gamma) {
    ++prediction_refinements_;
    return odds(evidence);
  }
  ++gamma_refinements_;
  entry.version = next_version_++;
  entry.refined = true;
  if (entry.plan.gamma == 0) {
    rechecks_[key] = PlainRecheck{entry.version, 0, 1};
  }
  return odds(evidence);
}

int64_t PlanCache::gamma_refinements() const {
  absl::MutexLock lock(&mu_);
  return gamma_refinements_;
}

int64_t PlanCache::prediction_refinements() const {
  absl::MutexLock lock(&mu_);
  return prediction_refinements_;
}

bool PlanCache::CountPlainStep(const PlanCacheKey& key, int64_t version,
                               int64_t base_steps) {
  if (base_steps <= 0) return false;
  absl::MutexLock lock(&mu_);
  auto it = rechecks_.find(key);
  if (it == rechecks_.end() || it->second.version != version) return false;
  PlainRecheck& recheck = it->second;
  const int doublings =
      std::min(recheck.consecutive_plain - 1, kMaxRecheckDoublings);
  const int64_t target =
      base_steps > (std::numeric_limits<int64_t>::max() >> doublings)
          ? std::numeric_limits<int64_t>::max()
          : base_steps << doublings;
  if (++recheck.steps < target) return false;
  recheck.steps = 0;  // a recheck that came to nothing comes back
  return true;
}

bool PlanCache::TryClaim(const PlanCacheKey& key) {
  absl::MutexLock lock(&mu_);
  return claimed_.insert(key).second;
}

void PlanCache::ReleaseClaim(const PlanCacheKey& key) {
  absl::MutexLock lock(&mu_);
  claimed_.erase(key);
}

bool PlanCache::Claimed(const PlanCacheKey& key) const {
  absl::MutexLock lock(&mu_);
  return claimed_.contains(key);
}

int64_t PlanCache::hits() const {
  absl::MutexLock lock(&mu_);
  return hits_;
}

int64_t PlanCache::misses() const {
  absl::MutexLock lock(&mu_);
  return misses_;
}

int64_t PlanCache::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(plans_.size());
}

// ---------------------------------------------------------------------------
// PlannerBudget

void PlannerBudget::AddDecodeSeconds(double seconds) {
  absl::MutexLock lock(&mu_);
  decode_seconds_ += std::max(0.0, seconds);
}

std::optional<double> PlannerBudget::TryReserve(double fraction) {
  absl::MutexLock lock(&mu_);
  const double expected =
      solves_ > 0 ? solve_seconds_ / static_cast<double>(solves_) : 0.0;
  const double committed = solve_seconds_ + reserved_seconds_;
  // The first solve is free; until one has settled its cost is unknown, so
  // no second starts beside it.
  const bool first = solves_ == 0 && in_flight_ == 0;
  const bool allowed = fraction <= 0 || first ||
                       (solves_ > 0 && committed <= fraction * decode_seconds_);
  if (!allowed) return std::nullopt;
  reserved_seconds_ += expected;
  ++in_flight_;
  return expected;
}

int64_t PlannerBudget::solves_in_flight() const {
  absl::MutexLock lock(&mu_);
  return in_flight_;
}

void PlannerBudget::CountDeferral() {
  absl::MutexLock lock(&mu_);
  ++deferrals_;
}

double PlannerBudget::reserved_seconds() const {
  absl::MutexLock lock(&mu_);
  return reserved_seconds_;
}

void PlannerBudget::Settle(double reserved, double solve_seconds) {
  absl::MutexLock lock(&mu_);
  reserved_seconds_ = std::max(0.0, reserved_seconds_ - reserved);
  in_flight_ = std::max<int64_t>(0, in_flight_ - 1);
  if (solve_seconds > 0) {
    solve_seconds_ += solve_seconds;
    ++solves_;
  }
}

double PlannerBudget::solve_seconds() const {
  absl::MutexLock lock(&mu_);
  return solve_seconds_;
}

double PlannerBudget::decode_seconds() const {
  absl::MutexLock lock(&mu_);
  return decode_seconds_;
}

double PlannerBudget::share() const {
  absl::MutexLock lock(&mu_);
  return decode_seconds_ > 0 ? solve_seconds_ / decode_seconds_ : 0.0;
}

int64_t PlannerBudget::solves() const {
  absl::MutexLock lock(&mu_);
  return solves_;
}

int64_t PlannerBudget::deferrals() const {
  absl::MutexLock lock(&mu_);
  return deferrals_;
}

// ---------------------------------------------------------------------------
// StepTimeTable

void StepTimeTable::Record(const std::string& execution_id,
                           int64_t bucket_tokens, int64_t bucket,
                           double seconds, absl::Time at) {
  absl::MutexLock lock(&mu_);
  std::deque<Sample>& window = steps_[Key(execution_id, bucket_tokens, bucket)];
  window.push_back({seconds, at});
  while (window.size() > static_cast<size_t>(kWindow)) window.pop_front();
}

double OutlierThresholdSeconds(std::vector<double> seconds, double factor) {
  if (factor <= 0 || seconds.empty()) {
    return std::numeric_limits<double>::infinity();
  }
  const size_t middle = seconds.size() / 2;
  std::nth_element(seconds.begin(), seconds.begin() + middle, seconds.end());
  return factor * seconds[middle];
}

std::optional<StepTimeTable::StepTime> StepTimeTable::RecentStepTime(
    const std::string& execution_id, int64_t bucket_tokens, int64_t bucket,
    int min_samples, absl::Duration max_age, absl::Time now,
    double outlier_factor) const {
  std::vector<double> recent;
  {
    absl::MutexLock lock(&mu_);
    auto it = steps_.find(Key(execution_id, bucket_tokens, bucket));
    if (it == steps_.end()) return std::nullopt;
    for (const Sample& sample : it->second) {
      if (now - sample.at <= max_age) recent.push_back(sample.seconds);
    }
  }
  const int64_t count = static_cast<int64_t>(recent.size());
  if (count == 0 || count < std::max(1, min_samples)) return std::nullopt;
  const double threshold = OutlierThresholdSeconds(recent, outlier_factor);
  double sum = 0;
  double squares = 0;
  StepTime out;
  for (double seconds : recent) {
    if (seconds > threshold) continue;
    sum += seconds;
    squares += seconds * seconds;
    ++out.kept;
  }
  const double n = static_cast<double>(out.kept);  // the median is kept
  out.mean_seconds = sum / n;
  if (out.kept >= 2) {
    const double variance =
        std::max(0.0, (squares - sum * out.mean_seconds) / (n - 1));
    out.standard_error = std::sqrt(variance / n);
  }
  return out;
}

std::optional<double> StepTimeTable::MeanStepSeconds(
    const std::string& execution_id, int64_t bucket_tokens, int64_t bucket,
    int min_samples, absl::Duration max_age, absl::Time now,
    double outlier_factor) const {
  const std::optional<StepTime> time =
      RecentStepTime(execution_id, bucket_tokens, bucket, min_samples, max_age,
                     now, outlier_factor);
  if (!time.has_value()) return std::nullopt;
  return time->mean_seconds;
}

int64_t StepTimeTable::samples(const std::string& execution_id,
                               int64_t bucket_tokens, int64_t bucket) const {
  absl::MutexLock lock(&mu_);
  auto it = steps_.find(Key(execution_id, bucket_tokens, bucket));
  return it == steps_.end() ? 0 : static_cast<int64_t>(it->second.size());
}

// ---------------------------------------------------------------------------
// GuardVerdicts

namespace {

// The drafting mode of a guard's setting: its text before the first space
// ("knn" of "knn stories a1,m3 D3").
std::string ModeOf(const std::string& setting) {
  return setting.substr(0, setting.find(' '));
}

}  // namespace

void GuardVerdicts::Judge(const std::string& execution_id,
                          const std::string& setting, int64_t bucket_tokens,
                          int64_t bucket, Judgement judgement,
                          const Verdict& verdict, int64_t hold_steps,
                          int64_t max_hold_steps, int64_t min_hold_steps) {
  absl::MutexLock lock(&mu_);
  const Key key(execution_id, setting, bucket_tokens, bucket);
  auto held_it = losing_.find(key);
  if (held_it != losing_.end() &&
      held_it->second.plan_version > verdict.plan_version) {
    return;  // a late judgement of an older plan: the newer verdict stands
  }
  if (judgement != Judgement::kLoss) {
    if (verdict.confirmation && held_it != losing_.end() &&
        held_it->second.plan_version == verdict.plan_version) {
      return;  // another sequence's loss overtook the confirmation
    }
    auto pool = pools_.find(key);
    if (pool != pools_.end() &&
        pool->second.plan_version == verdict.plan_version) {
      pool->second.since_judged = 0;  // its steps stay evidence for the next
      pool->second.won_plan = verdict.plan_version;
    }
    losing_.erase(key);
    if (judgement == Judgement::kWin) losses_in_a_row_.erase(key);
    return;
  }
  LossRun& run = losses_in_a_row_[key];
  run.losses += verdict.clear ? 2 : 1;
  const int64_t losses = run.losses;
  run.plan_version = verdict.plan_version;
  if (verdict.clear && verdict.plan_version == 0) {
    clear_losses_[Key(execution_id, ModeOf(setting), bucket_tokens, bucket)] =
        setting;
  }
  const int64_t first = std::max<int64_t>(1, hold_steps);
  const int64_t most = std::max(first, max_hold_steps);
  int64_t hold = first;
  for (int64_t k = 1; k < losses && hold < most; ++k) hold *= 2;
  hold = std::max(hold, min_hold_steps);
  HoldPlain(key, verdict, std::min(hold, most), losses);
}

void GuardVerdicts::HoldPlain(const Key& key, Verdict verdict,
                              int64_t hold_steps, int64_t losses) {
  pools_.erase(key);  // the re-probe measures afresh
  verdict.hold_steps = hold_steps;
  verdict.plain_steps_left = hold_steps;
  verdict.plain_steps = 0;
  verdict.losses_in_a_row = losses;
  losing_[key] = verdict;
  ++given_;
}

std::optional<GuardVerdicts::Verdict> GuardVerdicts::TakePlainStep(
    const std::string& execution_id, const std::string& setting,
    int64_t bucket_tokens, int64_t bucket, int64_t plan_version,
    int64_t carry_hold_steps) {
  absl::MutexLock lock(&mu_);
  const Key key(execution_id, setting, bucket_tokens, bucket);
  auto it = losing_.find(key);
  if (it == losing_.end()) {
    if (carry_hold_steps <= 0 ||
        !CarryLoss(key, plan_version, carry_hold_steps)) {
      return std::nullopt;
    }
    it = losing_.find(key);
  }
  if (it->second.plan_version != plan_version) {
    // A verdict on another plan: the newest plan is judged afresh.
    if (it->second.plan_version < plan_version) losing_.erase(it);
    return std::nullopt;
  }
  Verdict verdict = it->second;
  ++it->second.plain_steps;
  if (--it->second.plain_steps_left <= 0) losing_.erase(it);
  return verdict;
}

std::optional<GuardVerdicts::Verdict> GuardVerdicts::CarriableLoss(
    const Key& from, int64_t plan_version, bool sibling) const {
  const auto it = losing_.find(from);
  if (it == losing_.end() || it->second.plan_version != plan_version ||
      it->second.carried_from_bucket >= 0 || (sibling && !it->second.clear)) {
    return std::nullopt;
  }
  return it->second;
}

bool GuardVerdicts::CarryLoss(const Key& key, int64_t plan_version,
                              int64_t hold_steps) {
  if (losing_.empty()) return false;  // nothing to carry (most steps)
  // Judged here before (a run of losses, or a win): its own record stands.
  if (losses_in_a_row_.contains(key)) return false;
  const auto pool = pools_.find(key);
  if (pool != pools_.end() && pool->second.won_plan >= 0) return false;
  const auto& [execution_id, setting, bucket_tokens, bucket] = key;
  std::optional<Verdict> carried;
  int64_t from_bucket = -1;
  for (const int64_t neighbour : {bucket - 1, bucket + 1}) {
    if (neighbour < 0) continue;
    carried =
        CarriableLoss(Key(execution_id, setting, bucket_tokens, neighbour),
                      plan_version, /*sibling=*/false);
    if (carried.has_value()) {
      from_bucket = neighbour;
      break;
    }
  }
  if (!carried.has_value() && plan_version == 0) {
    // A sibling's clear loss, here or beside.
    const std::string mode = ModeOf(setting);
    for (const int64_t near : {bucket, bucket - 1, bucket + 1}) {
      if (near < 0) continue;
      const auto sibling =
          clear_losses_.find(Key(execution_id, mode, bucket_tokens, near));
      if (sibling == clear_losses_.end() || sibling->second == setting) {
        continue;
      }
      carried =
          CarriableLoss(Key(execution_id, sibling->second, bucket_tokens, near),
                        plan_version, /*sibling=*/true);
      if (carried.has_value()) {
        from_bucket = near;
        break;
      }
    }
  }
  if (!carried.has_value()) return false;
  carried->carried_from_bucket = from_bucket;
  carried->clear = false;
  // As a first loss here: the re-probe after the hold is a loser's.
  losses_in_a_row_[key] = LossRun{1, plan_version};
  HoldPlain(key, *carried, hold_steps, /*losses=*/1);
  ++carried_;
  return true;
}

std::optional<GuardVerdicts::Verdict> GuardVerdicts::Find(
    const std::string& execution_id, const std::string& setting,
    int64_t bucket_tokens, int64_t bucket) const {
  absl::MutexLock lock(&mu_);
  auto it = losing_.find(Key(execution_id, setting, bucket_tokens, bucket));
  if (it == losing_.end()) return std::nullopt;
  return it->second;
}

int64_t GuardVerdicts::AddStep(const std::string& execution_id,
                               const std::string& setting,
                               int64_t bucket_tokens, int64_t bucket,
                               int64_t plan_version, Step step, int64_t keep) {
  absl::MutexLock lock(&mu_);
  const Key key(execution_id, setting, bucket_tokens, bucket);
  if (pools_.size() >= kMaxPools && !pools_.contains(key)) {
    pools_.erase(pools_.begin());  // any: a bound, not a policy
  }
  Pool& pool = pools_[key];
  if (plan_version < pool.plan_version) return 0;  // an older plan's step
  if (plan_version > pool.plan_version) RestartPool(pool, plan_version);
  pool.steps.push_back(step);
  while (static_cast<int64_t>(pool.steps.size()) > std::max<int64_t>(1, keep)) {
    pool.steps.pop_front();
  }
  return ++pool.since_judged;
}

GuardVerdicts::Pairs GuardVerdicts::AddPairs(
    const std::string& execution_id, const std::string& setting,
    int64_t bucket_tokens, int64_t bucket, int64_t plan_version,
    uint64_t sequence_id, const Pairs& pairs, int64_t keep) {
  absl::MutexLock lock(&mu_);
  const Key key(execution_id, setting, bucket_tokens, bucket);
  EndConfirmationLocked(key, sequence_id);
  if (HeldLocked(key, plan_version)) {
    return Pairs{};  // a loss overtook the confirmation: it stands
  }
  if (pools_.size() >= kMaxPools && !pools_.contains(key)) {
    pools_.erase(pools_.begin());  // any: a bound, not a policy
  }
  Pool& pool = pools_[key];
  if (plan_version < pool.plan_version) return pairs;  // an older plan's
  if (plan_version > pool.plan_version) RestartPool(pool, plan_version);
  const auto append = [keep](const std::deque<Step>& from,
                             std::deque<Step>& to) {
    to.insert(to.end(), from.begin(), from.end());
    while (static_cast<int64_t>(to.size()) > std::max<int64_t>(1, keep)) {
      to.pop_front();
    }
  };
  append(pairs.setting, pool.pairs.setting);
  append(pairs.plain, pool.pairs.plain);
  return pool.pairs;
}

void GuardVerdicts::RestartPool(Pool& pool, int64_t plan_version) {
  pool.plan_version = plan_version;
  pool.steps.clear();
  pool.pairs = Pairs{};
  pool.since_judged = 0;
  pool.confirming_sequence.reset();
}

bool GuardVerdicts::HeldLocked(const Key& key, int64_t plan_version) const {
  const auto held = losing_.find(key);
  return held != losing_.end() && held->second.plan_version >= plan_version;
}

void GuardVerdicts::EndConfirmationLocked(const Key& key,
                                          uint64_t sequence_id) {
  auto it = pools_.find(key);
  if (it != pools_.end() && it->second.confirming_sequence == sequence_id) {
    it->second.confirming_sequence.reset();
  }
}

bool GuardVerdicts::StartConfirmation(const std::string& execution_id,
                                      const std::string& setting,
                                      int64_t bucket_tokens, int64_t bucket,
                                      int64_t plan_version,
                                      uint64_t sequence_id, absl::Time now,
                                      absl::Duration max_age) {
  absl::MutexLock lock(&mu_);
  const Key key(execution_id, setting, bucket_tokens, bucket);
  if (HeldLocked(key, plan_version)) return false;
  auto it = pools_.find(key);
  if (it == pools_.end() || it->second.plan_version != plan_version) {
    return true;  // no pool of the plan to mark (dropped: kMaxPools)
  }
  Pool& pool = it->second;
  pool.since_judged = 0;
  if (pool.confirming_sequence.has_value() &&
      *pool.confirming_sequence != sequence_id &&
      now - pool.confirming_since <= max_age) {
    return false;  // another sequence's confirmation is under way
  }
  pool.confirming_sequence = sequence_id;
  pool.confirming_since = now;
  return true;
}

void GuardVerdicts::EndConfirmation(const std::string& execution_id,
                                    const std::string& setting,
                                    int64_t bucket_tokens, int64_t bucket,
                                    uint64_t sequence_id) {
  absl::MutexLock lock(&mu_);
  EndConfirmationLocked(Key(execution_id, setting, bucket_tokens, bucket),
                        sequence_id);
}

std::deque<GuardVerdicts::Step> GuardVerdicts::Steps(
    const std::string& execution_id, const std::string& setting,
    int64_t bucket_tokens, int64_t bucket, int64_t plan_version) const {
  absl::MutexLock lock(&mu_);
  auto it = pools_.find(Key(execution_id, setting, bucket_tokens, bucket));
  if (it == pools_.end() || it->second.plan_version != plan_version) return {};
  return it->second.steps;
}

bool GuardVerdicts::WonLast(const std::string& execution_id,
                            const std::string& setting, int64_t bucket_tokens,
                            int64_t bucket, int64_t plan_version) const {
  absl::MutexLock lock(&mu_);
  auto it = pools_.find(Key(execution_id, setting, bucket_tokens, bucket));
  return it != pools_.end() && it->second.won_plan == plan_version;
}

bool GuardVerdicts::LastLost(const std::string& execution_id,
                             const std::string& setting, int64_t bucket_tokens,
                             int64_t bucket, int64_t plan_version) const {
  absl::MutexLock lock(&mu_);
  auto it =
      losses_in_a_row_.find(Key(execution_id, setting, bucket_tokens, bucket));
  return it != losses_in_a_row_.end() && it->second.losses > 0 &&
         it->second.plan_version == plan_version;
}

int64_t GuardVerdicts::losing() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(losing_.size());
}

int64_t GuardVerdicts::verdicts_given() const {
  absl::MutexLock lock(&mu_);
  return given_;
}

int64_t GuardVerdicts::verdicts_carried() const {
  absl::MutexLock lock(&mu_);
  return carried_;
}

void RecordPlainStep(const PlanningShared& shared,
                     const std::string& execution_id, int64_t bucket_tokens,
                     int64_t bucket, double seconds, bool began_beside_solve) {
  if (shared.plain_rates == nullptr || began_beside_solve) return;
  if (shared.budget != nullptr && shared.budget->solves_in_flight() > 0) return;
  shared.plain_rates->Record(execution_id, bucket_tokens, bucket, seconds);
}

void RecordDraftCost(const PlanningShared& shared,
                     const std::string& execution_id, int64_t bucket_tokens,
                     int64_t bucket, double seconds, double predicted_seconds) {
  if (shared.draft_costs == nullptr || !(predicted_seconds > 0)) return;
  shared.draft_costs->Record(execution_id, bucket_tokens, bucket,
                             seconds / predicted_seconds);
}

PlanningShared PlanningShared::Create(int64_t refine_every_trials) {
  PlanningShared shared;
  shared.cache = std::make_shared<PlanCache>(refine_every_trials);
  shared.budget = std::make_shared<PlannerBudget>();
  shared.plain_rates = std::make_shared<StepTimeTable>();
  shared.draft_costs = std::make_shared<StepTimeTable>();
  shared.verdicts = std::make_shared<GuardVerdicts>();
  return shared;
}

}  // namespace knapserve
