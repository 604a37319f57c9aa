// Executor-side planning state shared by every sequence and request of a
// process, so that planning costs almost nothing per request:
//
//   PlanCache      plans by (model, device, dtype, threads, policy, max_draft,
//                  context bucket), so a new request speculates from its first
//                  decode step and plans survive a planner restart;
//   PlannerBudget  the process's planner CPU share (solve seconds over decode
//                  seconds), which gates new solves (--planner-budget);
//   StepTimeTable  recent steps per context bucket, measured online: plain
//                  decoding's step times, against which the online guard
//                  judges a plan and by which a new plan's promise is
//                  calibrated, and drafting steps' times over what their
//                  plan's latency model predicted (reported beside it).
//
// Context buckets are fixed-width: bucket = context_length / bucket_tokens
// (default 256 tokens: [0, 256), [256, 512), ...). A plan is keyed by the
// bucket of the snapshot it was solved from.
//
// They live on the executor side, so the in-process and the remote planner
// get the same cache and budget. PlanningShared bundles them, with
// the process's KNN-SSD domain anchors when it has any (--anchors); the
// binaries make one per process and pass it to every Generate() call.
//
// Ownership: shared_ptr, because planner callbacks (which may run after the
// generation that submitted them ended) insert plans and settle the budget.
// Thread safety: every method of every class here may be called from any
// thread; each class guards its state with one absl::Mutex.
#ifndef KNAPSERVE_EXECUTOR_PLANNING_PLAN_CACHE_H_
#define KNAPSERVE_EXECUTOR_PLANNING_PLAN_CACHE_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/plan/planner_client.h"
#include "executor/planning/domain_router.h"
#include "executor/planning/plan_refinement.h"

namespace knapserve {

// The bucket of a context length: context_length / bucket_tokens
// (bucket_tokens >= 1; lengths < 0 count as 0).
int64_t ContextBucket(int64_t context_length, int64_t bucket_tokens);

// What a cached plan is valid for. Two requests whose keys are equal get the
// same plan.
struct PlanCacheKey {
  std::string model_fingerprint;  // ModelConfig::Fingerprint()
  std::string device;             // "cpu", "cuda:0"
  std::string dtype;              // DtypeName()
  int threads = 0;                // torch intra-op threads of the decode
  PlanPolicy policy = PlanPolicy::kKnapSpec;
  std::string policy_detail;  // kStatic: the mask; kClasp: "layers=M"; else ""
  int max_draft = 0;          // D: plans choose gamma in 0..D
  // The draft confidence stop the plan was priced for (drafts end earlier
  // with a higher one, so the best gamma and mask differ).
  double exit_threshold = 0;
  int64_t bucket_tokens = 256;  // bucket width the key was made with
  int64_t bucket = 0;           // ContextBucket(context, bucket_tokens)

  // Everything but the policy and the bucket: what plain-decoding speed depends
  // on.
  std::string ExecutionId() const;
  std::string ToString() const;

  bool operator==(const PlanCacheKey& other) const;
  template <typename H>
  friend H AbslHashValue(H h, const PlanCacheKey& k) {
    return H::combine(std::move(h), k.model_fingerprint, k.device, k.dtype,
                      k.threads, static_cast<int>(k.policy), k.policy_detail,
                      k.max_draft, k.exit_threshold, k.bucket_tokens, k.bucket);
  }
};

// One cached plan and where it came from.
struct CachedPlan {
  DraftPlan plan;
  int64_t version =
      0;  // process-wide insert counter: a newer plan has a larger one
  uint64_t sequence_id = 0;    // the sequence whose snapshot it was solved from
  int64_t context_length = 0;  // committed length of that snapshot
  // This version is a refinement of that solve's plan (a new gamma from the
  // drafting evidence: PlanCache::RecordDraftStep), not a solve.
  bool refined = false;
};

class PlanCache {
 public:
  // refine_every_trials: RecordDraftStep refines a plan each time its
  // evidence grows by this many accept trials; <= 0 never refines.
  static constexpr int64_t kDefaultRefineTrials = 32;
  explicit PlanCache(int64_t refine_every_trials = kDefaultRefineTrials)
      : refine_every_trials_(refine_every_trials) {}
  PlanCache(const PlanCache&) = delete;
  PlanCache& operator=(const PlanCache&) = delete;

  // The plan for `key`, counting a hit or a miss.
  std::optional<CachedPlan> Lookup(const PlanCacheKey& key)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The same without counting (for the per-step "did a newer plan arrive"
  // check).
  std::optional<CachedPlan> Peek(const PlanCacheKey& key) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // The version of the plan for `key`, 0 when there is none. Cheap: no copy.
  int64_t Version(const PlanCacheKey& key) const ABSL_LOCKS_EXCLUDED(mu_);
  // Stores `plan` for `key`, replacing an older one; returns its version.
  int64_t Insert(const PlanCacheKey& key, DraftPlan plan, uint64_t sequence_id,
                 int64_t context_length) ABSL_LOCKS_EXCLUDED(mu_);

  // A plain plan (gamma 0) is one snapshot's judgement, 16 reference tokens
  // that may have been unusually hard; cached, it would hold for the
  // process's life. So the cache counts the plain steps every sequence
  // decodes under it: CountPlainStep returns true at the step that brings
  // the count of `key`'s plan `version` to
  //   base_steps * 2^min(k - 1, kMaxRecheckDoublings),
  // where k counts the key's consecutive plain answers up to this one (a
  // drafting answer resets it), and starts the count again: the caller
  // then asks for a new plan (a recheck, under the planner budget like any
  // solve). A recheck that comes to nothing (its sequence ended, or its
  // solve failed, so no new version came) fires again a period later; a
  // bucket that stays plain is rechecked ever less often. False for any
  // other step, a drafting plan, another version, or base_steps <= 0.
  static constexpr int kMaxRecheckDoublings = 6;
  bool CountPlainStep(const PlanCacheKey& key, int64_t version,
                      int64_t base_steps) ABSL_LOCKS_EXCLUDED(mu_);

  // Drafting evidence (executor/planning/plan_refinement.h). A step that
  // drafted with `key`'s plan `version` (the version a solve inserted, or a
  // refinement of it: the same mask) adds to that solve's DraftEvidence;
  // a step of an older solve's plan, or of a plan this key no longer holds,
  // adds nothing. Each time the evidence has grown by refine_every_trials
  // accept trials the plan is refined (RefinePlan, from the solve's basis
  // and all of the evidence): a new gamma is stored as a new version, which
  // sequences take up like any newer plan (their guard then judges it
  // afresh); new predictions under the same gamma replace the plan's in
  // place, same version, for the sequences that apply it next. A refinement
  // to gamma 0 is a plain plan like a solve's (CountPlainStep rechecks it).
  // Returns what is now cached for `key` (version 0: none), so that the
  // caller's drift check needs no copy of the plan, and the solve's evidence
  // with this step in it (for the sequence's own odds: RefinePlanForSequence
  // in plan_refinement.h; empty when the step added nothing).
  struct PlanOdds {
    int64_t version = 0;
    int gamma = 0;
    double alpha_hat = 0;                  // DraftPlan::alpha_hat
    double predicted_drafts_per_step = 0;  // DraftPlan's (0: not predicted)
    DraftEvidence evidence;
  };
  PlanOdds RecordDraftStep(const PlanCacheKey& key, int64_t version, int gamma,
                           int drafted, int accepted) ABSL_LOCKS_EXCLUDED(mu_);
  // Refinements so far that changed a plan's gamma / only its predictions.
  int64_t gamma_refinements() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t prediction_refinements() const ABSL_LOCKS_EXCLUDED(mu_);

  // Marks a solve for `key` as in flight. False when one already is, so
  // concurrent sequences in one bucket share a single solve.
  bool TryClaim(const PlanCacheKey& key) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the claim (the solve answered, failed, or was abandoned).
  void ReleaseClaim(const PlanCacheKey& key) ABSL_LOCKS_EXCLUDED(mu_);
  bool Claimed(const PlanCacheKey& key) const ABSL_LOCKS_EXCLUDED(mu_);

  int64_t hits() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t misses() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t size() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<PlanCacheKey, CachedPlan> plans_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<PlanCacheKey> claimed_ ABSL_GUARDED_BY(mu_);
  // Of the keys whose plan is plain: CountPlainStep's count.
  struct PlainRecheck {
    int64_t version = 0;        // the plain plan's
    int64_t steps = 0;          // plain steps counted under it
    int consecutive_plain = 0;  // plain answers in a row, this one included
  };
  absl::flat_hash_map<PlanCacheKey, PlainRecheck> rechecks_
      ABSL_GUARDED_BY(mu_);
  // Of the keys whose plan a solve inserted: RecordDraftStep's evidence.
  struct Refinement {
    int64_t solve_version = 0;  // the version Insert gave the solve's plan
    DraftEvidence evidence;
    int64_t refined_at_trials = 0;  // evidence.accept_trials() at the last one
  };
  absl::flat_hash_map<PlanCacheKey, Refinement> refinements_
      ABSL_GUARDED_BY(mu_);
  const int64_t refine_every_trials_;
  int64_t gamma_refinements_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t prediction_refinements_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t next_version_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t hits_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t misses_ ABSL_GUARDED_BY(mu_) = 0;
};

// The planner CPU budget, process-wide: new solves may start while
//   (solve seconds so far + seconds reserved by solves in flight)
//     <= fraction * decode seconds so far,
// where decode seconds is the summed wall time of every decode step of every
// sequence of the process (running sequences take turns, so steps do not
// overlap: this is the time the process spent decoding), and solve seconds is
// the planners' reported solve time (DraftPlan::solve_seconds). A solve in
// flight reserves the mean solve time seen so far, so many sequences cannot
// all start one at once. The first solve of a process is never deferred;
// until a solve has settled with its time, no second one starts (its cost
// is unknown: a first 1k-context solve on 2 cores took 1.1 s beside
// decoding, and the sequence crossed three buckets meanwhile, each of which
// queued a solve of its own). fraction <= 0 means no limit.
class PlannerBudget {
 public:
  PlannerBudget() = default;
  PlannerBudget(const PlannerBudget&) = delete;
  PlannerBudget& operator=(const PlannerBudget&) = delete;

  void AddDecodeSeconds(double seconds) ABSL_LOCKS_EXCLUDED(mu_);
  // Whether a solve may start under `fraction`; if so, reserves its expected
  // cost and returns the seconds reserved (give them back to Settle). nullopt
  // when over budget.
  std::optional<double> TryReserve(double fraction) ABSL_LOCKS_EXCLUDED(mu_);
  // Counts one trigger deferred for the budget (callers count each trigger
  // once).
  void CountDeferral() ABSL_LOCKS_EXCLUDED(mu_);
  // A reserved solve ended: frees `reserved` and adds `solve_seconds`
  // (0 for a failed or cancelled request).
  void Settle(double reserved, double solve_seconds) ABSL_LOCKS_EXCLUDED(mu_);

  double solve_seconds() const ABSL_LOCKS_EXCLUDED(mu_);
  double decode_seconds() const ABSL_LOCKS_EXCLUDED(mu_);
  // solve_seconds / decode_seconds (0 before any decoding).
  double share() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t solves() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t deferrals() const ABSL_LOCKS_EXCLUDED(mu_);
  // Seconds reserved by solves in flight.
  double reserved_seconds() const ABSL_LOCKS_EXCLUDED(mu_);
  // Reservations not yet settled: solves in flight, from their snapshot's
  // capture to the planner's answer (or the capture's abandonment). While
  // one runs, an in-process planner shares the cores with decoding, so a
  // plain step timed meanwhile is not plain decoding's rate: the callers of
  // StepTimeTable::Record skip those steps (the guard then probes afresh).
  int64_t solves_in_flight() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  double solve_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  double reserved_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  double decode_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t solves_ ABSL_GUARDED_BY(mu_) = 0;  // settled with solve_seconds > 0
  int64_t deferrals_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // reserved, not yet settled
};

// Recent steps by execution and context bucket, the last kWindow per bucket:
// one value a step, with the time it was recorded. PlanningShared holds two:
//
//   plain_rates  plain-decoding (gamma 0, one token per step) step times in
//                seconds. Any sequence's plain steps count: those before its
//                first plan, under a gamma-0 plan, and under the guard
//                (probes and fallbacks), but none timed while a solve of the
//                process is in flight (PlannerBudget::solves_in_flight: the
//                solve slows them); RecordPlainStep.
//   draft_costs  drafting steps of the planned modes (knapspec, clasp) that
//                measured their plan (PlanController::DraftCostRatio says
//                which): each step's seconds over the seconds its plan's
//                latency model predicted for a step (predicted tokens per
//                step over predicted tokens/s), a unitless cost ratio;
//                RecordDraftCost. On a shared machine a drafting step's
//                cost against a plain one moves by a fifth within a minute
//                (its multi-row and shortened passes slow down, one-row full
//                passes do not), which plain steps alone do not see
//                (AppliedPlan::draft_calibrated_tpt against calibrated_tpt).
//
// The names below say "seconds"; for draft_costs read "cost ratio".
class StepTimeTable {
 public:
  static constexpr int kWindow = 32;

  StepTimeTable() = default;
  StepTimeTable(const StepTimeTable&) = delete;
  StepTimeTable& operator=(const StepTimeTable&) = delete;

  // A step of `seconds` (a draft cost: its ratio), timed at `at`.
  void Record(const std::string& execution_id, int64_t bucket_tokens,
              int64_t bucket, double seconds, absl::Time at = absl::Now())
      ABSL_LOCKS_EXCLUDED(mu_);
  // The steps' mean and how well it is known.
  struct StepTime {
    double mean_seconds = 0;
    // The mean's standard error: the kept steps' standard deviation over
    // sqrt(kept); 0 with a single kept step.
    double standard_error = 0;
    int64_t kept = 0;  // steps in the mean
  };
  // The recorded steps of the bucket (the last kWindow) no older than
  // `max_age` at `now`, nullopt with fewer than `min_samples` of them. The
  // machine's speed drifts (other processes, frequency), so a step time
  // from long ago is no reference for speculation now. Steps above
  // OutlierThresholdSeconds(outlier_factor) of those samples are left out
  // of the mean (they still count towards min_samples).
  std::optional<StepTime> RecentStepTime(
      const std::string& execution_id, int64_t bucket_tokens, int64_t bucket,
      int min_samples, absl::Duration max_age = absl::InfiniteDuration(),
      absl::Time now = absl::Now(), double outlier_factor = 0) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // RecentStepTime's mean alone.
  std::optional<double> MeanStepSeconds(
      const std::string& execution_id, int64_t bucket_tokens, int64_t bucket,
      int min_samples, absl::Duration max_age = absl::InfiniteDuration(),
      absl::Time now = absl::Now(), double outlier_factor = 0) const
      ABSL_LOCKS_EXCLUDED(mu_);
  int64_t samples(const std::string& execution_id, int64_t bucket_tokens,
                  int64_t bucket) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using Key = std::tuple<std::string, int64_t, int64_t>;
  mutable absl::Mutex mu_;
  struct Sample {
    double seconds = 0;
    absl::Time at;
  };
  absl::flat_hash_map<Key, std::deque<Sample>> steps_ ABSL_GUARDED_BY(mu_);
};

// The guard's shared verdicts (executor/planning/plan_controller.h's
// SpeculationGuard): which drafting settings measured slower than plain
// decoding, per execution and context bucket, so that a new request does
// not try a losing setting again. A setting is a drafting mode and what
// fixes its drafts ("static a1,m3 D3", "knapspec D6", "knn stories D4",
// ...); for the planned modes a verdict holds for the plan version it
// judged, and a newer plan is judged afresh. A losing verdict holds for
// `hold_steps` plain steps, counted over every sequence that decodes under
// it; then it expires and the next speculative steps measure again (the
// re-probe). Each further loss in a row at the same key (setting and
// bucket, whatever the plan version) doubles the hold, up to
// `max_hold_steps`. A winning judgement clears the verdict; a win that
// proves the setting (kWin) also ends the run of losses, a narrow one
// (kUnprovenWin) lets it draft again but keeps the run, so that its next
// loss holds twice as long. Otherwise a loser whose short re-probe won by
// chance (a window of 16 steps spreads widely when tokens per step vary)
// started again from hold_steps after every such win, and paid a losing
// re-probe every hold_steps plain steps. The run also
// tells the re-probe that the setting lost here last (LastLost): the guard
// then judges it by the full rule from its first few steps on, not only a
// clear loss.
//
// A loss carries to the neighbouring buckets (TakePlainStep with
// carry_hold_steps > 0): a setting never judged at a bucket, with a losing
// verdict measured at the bucket just below or just above in force (same
// setting and plan version), gets a verdict of its own there, as if it had
// lost there once: carry_hold_steps plain steps, then a re-probe judged as
// a loser's (LastLost). Only measured verdicts carry (a carried one does
// not carry further), and a bucket with a judgement of its own keeps it.
//
// A clear loss (Verdict::clear: the guard found the setting far below
// plain decoding, GuardOptions::clear_losses) says more than a narrow one:
// it counts as two losses in the run (its hold is twice a first narrow
// loss's), and in an unplanned mode (plan version 0: static, knn,
// specbound) it also carries to the mode's other settings (the text
// before the setting's first space: "knn"), at its own bucket and the two
// beside it, as a neighbour's loss carries. Where one of knn's settings
// lost far at 1000 tokens of context, its others were measured to lose
// there too (stories-24l-skip, bf16): the context decided, not the mask;
// each cold pass of the benchmark judged every one of them afresh. Only
// the mode's latest clear loss at a bucket carries to its siblings.
class GuardVerdicts {
 public:
  // A judgement's outcome (SpeculationGuard decides which).
  enum class Judgement {
    kWin,          // the setting drafts on; its run of losses ends
    kUnprovenWin,  // it drafts on, but its run of losses stands
    kLoss,         // a losing verdict holds it plain
  };
  // One speculative step as the guard weighs it.
  struct Step {
    int tokens = 0;      // tokens committed
    double seconds = 0;  // its wall time (StepObservation::seconds)
    // Draft tokens it proposed (StepObservation::drafted; 0 for a plain
    // step): what its time depends on (SpeculationGuard::PairedRateOf).
    int drafted = 0;
  };
  struct Verdict {
    // The rates measured at the judgement; 0 where none was yet (a loss
    // that needed no timing: GuardOptions::futile_steps).
    double spec_tps = 0;
    double plain_tps = 0;          // the plain rate it lost to
    int64_t plan_version = 0;      // planned modes: the plan judged; else 0
    uint64_t sequence_id = 0;      // the sequence that judged
    int64_t plain_steps_left = 0;  // before the re-probe
    int64_t plain_steps = 0;       // decoded under it so far
    int64_t hold_steps = 0;        // plain steps it was given
    int64_t losses_in_a_row = 0;   // losing judgements at its key, it included
    // The bucket whose measured verdict this one was carried from (its
    // own bucket when carried from another setting); -1: the setting's own
    // judgement here.
    int64_t carried_from_bucket = -1;
    // A clear loss (the class comment); false for carried verdicts.
    bool clear = false;
    // Judged by a confirmation's pairs (SpeculationGuard, GuardOptions::
    // confirm_losses): its win does not lift a loss of the same plan that
    // another sequence gave meanwhile (that loss stands).
    bool confirmation = false;
  };

  GuardVerdicts() = default;
  GuardVerdicts(const GuardVerdicts&) = delete;
  GuardVerdicts& operator=(const GuardVerdicts&) = delete;

  // A judgement: the setting lost (kLoss: a verdict of `hold_steps` plain
  // steps, times 2 for each earlier loss in a row at the key, a clear loss
  // counting as two, and at least min_hold_steps (what re-measuring it
  // costs, GuardOptions::explore_share), at most max(hold_steps,
  // max_hold_steps)) or won (any verdict for it is cleared; with kWin its
  // run of losses too).
  void Judge(const std::string& execution_id, const std::string& setting,
             int64_t bucket_tokens, int64_t bucket, Judgement judgement,
             const Verdict& verdict, int64_t hold_steps,
             int64_t max_hold_steps = 0, int64_t min_hold_steps = 0)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Before a step of `setting` at `bucket` under plan `plan_version` (0
  // unplanned): the verdict in force, if it loses, with one of its plain
  // steps spent by this call (at the last one it expires). nullopt: draft.
  // carry_hold_steps > 0: a neighbour's loss, or a sibling setting's clear
  // one, carries here first when the setting was never judged at `bucket`
  // (the class comment), holding it that many plain steps.
  std::optional<Verdict> TakePlainStep(const std::string& execution_id,
                                       const std::string& setting,
                                       int64_t bucket_tokens, int64_t bucket,
                                       int64_t plan_version,
                                       int64_t carry_hold_steps = 0)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Whether the setting's last judgement at the bucket was a win (kWin or
  // kUnprovenWin) of plan `plan_version` (0 unplanned): false when it was
  // never judged there, its last judgement lost, the win was another plan's,
  // or the pool was dropped (kMaxPools).
  bool WonLast(const std::string& execution_id, const std::string& setting,
               int64_t bucket_tokens, int64_t bucket,
               int64_t plan_version) const ABSL_LOCKS_EXCLUDED(mu_);
  // The verdict in force, without spending a step (tests, reports).
  std::optional<Verdict> Find(const std::string& execution_id,
                              const std::string& setting, int64_t bucket_tokens,
                              int64_t bucket) const ABSL_LOCKS_EXCLUDED(mu_);
  // Whether the setting's run of losses at the bucket stands, on plan
  // `plan_version` (0 unplanned): its last judgement was a loss (held or
  // expired) or a narrow win after one, until a kWin ends it. A loss on another
  // plan does not count (a new plan is judged afresh).
  bool LastLost(const std::string& execution_id, const std::string& setting,
                int64_t bucket_tokens, int64_t bucket,
                int64_t plan_version) const ABSL_LOCKS_EXCLUDED(mu_);
  // The setting's speculative steps at the key, pooled from every sequence
  // that drafts with it: a verdict holds every request of the setting, so it
  // weighs their steps, not one sequence's (whose text may draft less than
  // the others': one unlucky request must not condemn the setting for all).
  // AddStep keeps the last `keep` steps of plan `plan_version` (a newer plan
  // starts the pool afresh; a step of an older plan is dropped); a loss
  // empties the pool (the re-probe measures afresh). Steps returns the pool
  // for `plan_version` (empty for another plan). AddStep returns the steps
  // added at the key since its last judgement (Judge), this one included:
  // a judgement is due when they reach the guard's min_steps, whichever
  // sequence drafted them (a bucket that every request only passes through,
  // such as the last few positions below a bucket boundary, is judged too).
  int64_t AddStep(const std::string& execution_id, const std::string& setting,
                  int64_t bucket_tokens, int64_t bucket, int64_t plan_version,
                  Step step, int64_t keep) ABSL_LOCKS_EXCLUDED(mu_);
  std::deque<Step> Steps(const std::string& execution_id,
                         const std::string& setting, int64_t bucket_tokens,
                         int64_t bucket, int64_t plan_version) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // A confirming probe's pairs (SpeculationGuard, GuardOptions::
  // confirm_losses): `setting` holds the setting's steps of the pairs,
  // `plain` their plain steps.
  struct Pairs {
    std::deque<Step> setting;
    std::deque<Step> plain;
  };
  // Adds the confirming probe's pairs of sequence `sequence_id` to the
  // setting's pairs at the key (pooled over every sequence that confirmed
  // there, the last `keep` of each kept), ends its confirmation there
  // (StartConfirmation) and returns the pool. The pool follows the step
  // pool's rules (AddStep): a newer plan starts it afresh, an older plan's
  // pairs are not added (only returned), a loss empties it. While a losing
  // verdict of the plan (or a newer one) holds the setting, the pairs came
  // from a confirmation that another sequence's loss overtook: nothing is
  // added and the result is empty (no judgement; the loss stands).
  Pairs AddPairs(const std::string& execution_id, const std::string& setting,
                 int64_t bucket_tokens, int64_t bucket, int64_t plan_version,
                 uint64_t sequence_id, const Pairs& pairs, int64_t keep)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Sequence `sequence_id` would confirm a narrow loss of the setting at the
  // key (SpeculationGuard): whether it may. One confirmation runs at a time
  // per key: false while another sequence's, begun within `max_age` of
  // `now` (an older one is stale: its sequence ended mid-probe), is under
  // way, or while a losing verdict of the plan (or a newer one) holds the
  // setting. Either way the steps added since the last judgement count
  // afresh, so the sequences drafting beside it wait min_steps steps more.
  bool StartConfirmation(const std::string& execution_id,
                         const std::string& setting, int64_t bucket_tokens,
                         int64_t bucket, int64_t plan_version,
                         uint64_t sequence_id, absl::Time now,
                         absl::Duration max_age) ABSL_LOCKS_EXCLUDED(mu_);
  // Sequence `sequence_id` dropped its confirmation at the key (its context
  // left the bucket, a loss overtook it, or a new plan took effect).
  void EndConfirmation(const std::string& execution_id,
                       const std::string& setting, int64_t bucket_tokens,
                       int64_t bucket, uint64_t sequence_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Losing verdicts in force (a gauge), and all ever given (a counter;
  // carried ones included, and counted by verdicts_carried too).
  int64_t losing() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t verdicts_given() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t verdicts_carried() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using Key = std::tuple<std::string, std::string, int64_t, int64_t>;
  // TakePlainStep's carrying: installs at `key` (no verdict there) the loss
  // of a neighbouring bucket, or a sibling's clear loss, if one may carry;
  // whether it did.
  bool CarryLoss(const Key& key, int64_t plan_version, int64_t hold_steps)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The verdict to carry to `key` from `from` (a copy: inserting at `key`
  // may move the entry), if `from` holds a measured loss of `plan_version`
  // that may carry (a sibling's only when clear).
  std::optional<Verdict> CarriableLoss(const Key& from, int64_t plan_version,
                                       bool sibling) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether a losing verdict of `plan_version` or a newer plan holds `key`.
  bool HeldLocked(const Key& key, int64_t plan_version) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the confirmation of `sequence_id` at `key`, if it is the one under
  // way there.
  void EndConfirmationLocked(const Key& key, uint64_t sequence_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A losing verdict in force at `key` (Judge's losses and carried ones):
  // `verdict` holding `hold_steps` plain steps, the `losses`-th in a row;
  // the key's step pool is emptied (the re-probe measures afresh).
  void HoldPlain(const Key& key, Verdict verdict, int64_t hold_steps,
                 int64_t losses) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  mutable absl::Mutex mu_;
  absl::flat_hash_map<Key, Verdict> losing_ ABSL_GUARDED_BY(mu_);
  // Losing judgements in a row per key, and the plan version of the last;
  // outlives the verdicts it doubled.
  struct LossRun {
    int64_t losses = 0;
    int64_t plan_version = 0;
  };
  absl::flat_hash_map<Key, LossRun> losses_in_a_row_ ABSL_GUARDED_BY(mu_);
  // Pools kept at most (clients choose static masks freely): beyond it an
  // arbitrary pool is dropped, which only makes its setting measure afresh.
  static constexpr size_t kMaxPools = 4096;
  struct Pool {
    int64_t plan_version = 0;
    std::deque<Step> steps;
    Pairs pairs;               // confirming probes' pairs (AddPairs)
    int64_t since_judged = 0;  // steps added since the last judgement
    // The confirmation under way (StartConfirmation), if any: its sequence
    // and start.
    std::optional<uint64_t> confirming_sequence;
    absl::Time confirming_since;
    // The plan version of the last win judged at its key; -1: none. Any
    // win keeps a neighbour's loss from carrying there.
    int64_t won_plan = -1;
  };
  absl::flat_hash_map<Key, Pool> pools_ ABSL_GUARDED_BY(mu_);
  // A newer plan's step or pairs at `pool`: it starts afresh (its step
  // pool, pairs, count and confirmation; its last win stays, see
  // CarryLoss).
  static void RestartPool(Pool& pool, int64_t plan_version);
  // The setting of each unplanned mode's latest clear loss per execution
  // and bucket: (execution, mode, bucket_tokens, bucket) -> setting.
  absl::flat_hash_map<Key, std::string> clear_losses_ ABSL_GUARDED_BY(mu_);
  int64_t given_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t carried_ ABSL_GUARDED_BY(mu_) = 0;
};

// The process's shared planning state. Make one with Create() and hand it
// to every Generate() call; copies share the same objects.
struct PlanningShared {
  std::shared_ptr<PlanCache> cache;
  std::shared_ptr<PlannerBudget> budget;
  std::shared_ptr<StepTimeTable> plain_rates;
  std::shared_ptr<StepTimeTable> draft_costs;  // null: not recorded
  std::shared_ptr<GuardVerdicts> verdicts;
  // The domain anchors SpeculationMode::kKnn routes by; null when the
  // process has none (a kKnn request then fails with FailedPrecondition).
  // Create() leaves it null: the binaries load it from --anchors.
  std::shared_ptr<const DomainRouter> router;

  // refine_every_trials: the cache's PlanCache::RecordDraftStep period
  // (--plan-refine-trials; <= 0: plans are never refined).
  static PlanningShared Create(
      int64_t refine_every_trials = PlanCache::kDefaultRefineTrials);
};

// The guard's outlier rule, for plain and speculative steps alike: a step
// longer than `factor` times the median step of its sample is left out of a
// rate. A step the scheduler preempted (another process, or a planner solve
// sharing the cores) takes milliseconds longer; on a model that decodes a
// token in 0.6 ms, one such step in an 8-step probe moves the plain rate by a
// third. Returns the threshold in seconds (for draft costs, as a ratio):
// infinity when factor <= 0 or the sample is empty.
double OutlierThresholdSeconds(std::vector<double> seconds, double factor);

// Records a plain step (gamma 0, one token) of `seconds` in
// shared.plain_rates, unless a solve of the process was in flight at either
// end of it: at its start (`began_beside_solve`, the caller's
// PlannerBudget::solves_in_flight() > 0 when the step began) or now, at its
// end. A step timed beside a solve is not plain decoding's rate. Nothing
// without a plain-rate table.
void RecordPlainStep(const PlanningShared& shared,
                     const std::string& execution_id, int64_t bucket_tokens,
                     int64_t bucket, double seconds, bool began_beside_solve);

// Records a drafting step that measured its plan (PlanController::AfterStep
// chooses which) in shared.draft_costs: `seconds` over `predicted_seconds`,
// the plan's predicted seconds a step. Nothing without a draft-cost table or
// a predicted time.
void RecordDraftCost(const PlanningShared& shared,
                     const std::string& execution_id, int64_t bucket_tokens,
                     int64_t bucket, double seconds, double predicted_seconds);

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_PLANNING_PLAN_CACHE_H_
