// PlanController: when one sequence of a planned mode (knapspec, clasp)
// asks for a plan, which plan it decodes with, and when it decodes plainly.
// It holds no tensors and reads no clock: the decode loop
// (executor/engine/sequence.cc) reports each step's measured seconds, so tests
// drive it with made-up numbers.
//
// Plans come from the process's PlanCache (executor/planning/plan_cache.h).
// Before every step the controller looks at the context bucket of the committed
// length:
//   * entering a bucket (the first step included) with a cached plan: the
//     plan takes effect at once (a cache hit; no snapshot, no solve);
//   * entering a bucket without one: a trigger, kNoPlan on the first step,
//     kNewBucket later (a cache miss); meanwhile the plan in force (or the
//     request's `skip` mask, or plain decoding) stays;
//   * a newer plan for the current bucket appeared in the cache (this
//     sequence's solve arrived, or another sequence's): it takes effect;
//   * the bucket's plan in force is plain (gamma 0) and the process has
//     decoded plain_recheck_steps plain steps under it: a kRecheck trigger
//     (PlanCache::CountPlainStep; a recheck that comes to nothing fires
//     again a period later).
// After every speculative step under a plan it adds the step's drafting to
// the cache's evidence for the plan (PlanCache::RecordDraftStep), which
// refines the plan's odds, gamma and predictions for every sequence (a new
// gamma comes back as a newer plan, above). It also keeps the sequence's own
// drafting under the solve in force (its mask; the cache's refinements of
// that solve keep it): when the own accept trials reach
// sequence_first_trials, then twice as many, and so on, the plan in force
// gets the sequence's own odds (RefinePlanForSequence, plan_refinement.h:
// the other requests' odds as a prior worth at most sequence_prior_tokens
// tokens) and the gamma and predictions they choose, from the next step on
// (source "sequence"; the cache's plan is not changed). A newer version of
// the same solve takes effect with the sequence's odds at once. When its own
// odds choose plain decoding, no more evidence comes: after
// sequence_plain_steps plain steps the sequence forgets its own evidence
// (its text has moved on) and takes the cache's plan again (source
// "cache"). It also
// compares the observed per-token acceptance with the plan's alpha_hat as the
// cache holds it then (its predictions refined by every sequence's evidence:
// the drift is this sequence's text against the process's best estimate):
//   observed = accepted / (accepted + rejections),
// where a rejection is a step that stopped at a rejected draft token (the
// maximum-likelihood per-token acceptance when each draft token is accepted
// with the same probability; alpha_hat is that probability on the reference
// tokens). It also compares the draft tokens its steps made with the plan's
// predicted_drafts_per_step (fewer than gamma when drafts stop on low
// confidence: a plan's reference tokens may be less, or more, confident
// than the text that follows). After at least drift_min_tokens trials
// (accepted + rejections) since the plan took effect,
// |observed - alpha_hat| > drift_tolerance, or drafts per step off the
// prediction by more than drift_tolerance of it, is a kDrift trigger (once
// per plan).
//
// A pending trigger turns into a snapshot only when (1) the sequence's last
// snapshot began at least min_request_gap steps ago, (2) no other sequence is
// solving the same key (PlanCache::TryClaim; its plan will arrive instead),
// and (3) the PlannerBudget allows a solve (else the trigger is deferred and
// retried every step). Then the next reference_steps steps capture reference
// states, and TakeTicket() hands the claim and the budget reservation to the
// submission; CompleteTicket() stores the answer in the cache and settles
// both. When a bucket's first solve fails (no plan, no claim) its trigger
// comes back (counted once); a failed drift or recheck solve leaves the
// plan in force. Without a trigger nothing is captured and nothing is
// sent.
//
// A solve that answers after the sequence has left the snapshot's bucket is
// not wasted: while no plan of the current bucket is in force, the plan of
// the sequence's own newest answered solve takes effect when it arrives
// (source "solve"), unless the plan in force is newer; the current bucket's
// own plan replaces it when it comes. On a small CPU a solve can take longer
// than decoding a bucket (256 tokens): a single long generation then got no
// plan at all.
//
// The online guard (SpeculationGuard, below) may force plain steps.
//
// While the planner's latency profile is pending (BeforeStep's
// profile_pending) no snapshot starts: the sequence decodes with what it has
// (its skip mask, a cached plan, else plainly) and counts the plain steps.
//
// Not thread-safe: one per sequence, used by its decode thread. The shared
// objects it points to are thread-safe.
#ifndef KNAPSERVE_EXECUTOR_PLANNING_PLAN_CONTROLLER_H_
#define KNAPSERVE_EXECUTOR_PLANNING_PLAN_CONTROLLER_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/plan/planner_client.h"
#include "common/plan/step_forecast.h"
#include "executor/planning/plan_cache.h"

namespace knapserve {

struct GuardOptions {
  bool enabled = true;
  // Speculation stays only while its measured tokens/s is at least
  // (1 + margin) times the plain rate at the same context bucket. The
  // default is the gain a plan must predict to draft at all.
  double margin = kMinSpeculationGain;
  // Speculative steps between two judgements (the minimum sample), counted
  // over every sequence of the setting at the bucket when verdicts are
  // shared.
  int64_t min_steps = 16;
  // A judgement weighs the setting's last evidence_steps speculative steps
  // at the bucket since it last lost, from every sequence that drafts with
  // it (a win keeps its steps as evidence for the next), and
  // the setting loses only when its rate plus `confidence` standard errors
  // is below plain x (1 + margin). The error is that of the difference:
  // the setting's rate's (from its steps' spread) and the plain rate's
  // (from the plain steps' spread), both measured. Tokens per step vary
  // with acceptance, and on a busy machine so do step times, so a winner's
  // unlucky 16 steps, or a lucky plain probe, must not pass for a loss.
  // 0 judges the bare rates.
  int64_t evidence_steps = 64;
  double confidence = 1.0;
  // Plain steps the bucket needs in the plain-rate table
  // (PlanningShared::plain_rates) before a judgement,
  // none older than plain_max_age_seconds (<= 0: any age); when it has
  // fewer, the guard decodes this many plain steps (a probe), each right
  // after one of the setting's steps: the two rates are measured over the
  // same stretch of time, so a slow spell of the machine (or the slow steps
  // right after a prefill) weighs on both, not on the reference alone. A
  // winning setting decodes no plain steps, so without the age limit one
  // early, unlucky probe would stay its reference for good.
  int64_t probe_steps = 8;
  double plain_max_age_seconds = 10;
  // Plain steps a losing verdict holds (GuardVerdicts) before the setting
  // is measured again. Each further loss in a row of the same setting at the
  // same bucket doubles it (256, 512, 1024, ...) up to max_hold_steps (never
  // below reprobe_steps); a win that proves the setting (its rate less
  // `confidence` standard errors still at plain x (1 + margin)) starts
  // again from reprobe_steps, a narrower win lets it draft but keeps the
  // doubling. A setting that keeps losing is then re-measured ever more
  // rarely, even when a short re-probe wins by chance.
  int64_t reprobe_steps = 256;
  int64_t max_hold_steps = 4096;
  // Re-measuring a loser costs what its judged steps cost over plain
  // decoding (their tokens at plain decoding's rate against the time they
  // took), and the next re-probe costs about as much again. So a loss holds
  // the setting plain for at least that cost, in plain steps, divided by
  // explore_share (within max_hold_steps): the steps that re-measure a
  // losing setting cost at most about this share of the plain steps it is
  // held for. A narrow loser costs little to re-measure and is re-probed as
  // before; a clear one at 0.72x of plain decoding (static's mask on
  // stories-24l at 1000 tokens of context, bf16, 2-core Zen 4 VM) cost about
  // 5 plain steps per judgement and was re-probed after 512, twice in each
  // 762-token cold pass of the benchmark. 0: off (the doubling alone).
  double explore_share = 0.005;
  // A clear loser is judged before min_steps: from early_steps speculative
  // steps on, when even its rate plus `confidence` standard errors is below
  // the plain rate x (1 - early_loss), it loses at once. A setting whose
  // last judgement at the bucket was a loss (GuardVerdicts::LastLost: its
  // re-probe) is expected to lose again, so from early_steps on it is judged
  // by the full rule (below plain x (1 + margin) loses); a winner's
  // re-probe keeps its steps' spread in the standard error. 0 early_steps
  // turns both off.
  int64_t early_steps = 6;
  double early_loss = 0.15;
  // Both rates leave out steps longer than outlier_factor times their
  // sample's median step (OutlierThresholdSeconds, plan_cache.h): a
  // preempted step says nothing about speculation. <= 0 keeps every step.
  double outlier_factor = 3.0;
  // A setting that takes effect at a bucket, or whose context reaches a
  // bucket, without a plain rate probes first (its first 2 x probe_steps
  // steps there alternate with plain ones), so that a clear loser is judged
  // when the probe ends. Otherwise it would speculate min_steps steps and
  // then probe: the same probe, after up to min_steps losing steps.
  bool probe_first = true;
  // A setting that has never been judged at a bucket, while a losing
  // verdict measured at the bucket beside it (one below or one above) holds
  // it there, decodes plainly at this bucket too, for reprobe_steps plain
  // steps (GuardVerdicts::TakePlainStep's carrying), and is then measured
  // here as any loser's re-probe is. Neighbouring buckets differ in context
  // by a bucket's width, and a setting's speed against plain decoding moves
  // little across it; the bucket a request only passes through (a
  // 1000-token prompt spends its first 24 positions below 1024) otherwise
  // paid each request's first steps, drafting with a setting that loses a
  // few tokens later, until enough of them added up to a judgement there.
  // A planned mode's verdict holds one plan version, so it carries only to
  // steps of that same plan (one still in force as the context crosses
  // into the next bucket, before that bucket's own plan takes effect).
  bool carry_neighbour_losses = true;
  // A sequence's first settle_steps decode steps are no evidence: neither
  // its plain steps (the plain-rate table), its drafting steps (the
  // draft-cost table: PlanController::DraftCostRatio) nor its setting's
  // steps count, and
  // a first probe waits for them to pass (a verdict holds from the first
  // step). Right after a prefill the machine runs every step slower for a
  // while, plain and speculative alike (on a 2-core Zen 4 VM the first step
  // after a prefill took about 1.5x the steady step, the first eight 1.2x
  // on average); a probe of those steps would make plain decoding look
  // slower than it is for as long as the reference stands.
  int64_t settle_steps = 8;
  // A setting that has not won its last judgement at the bucket (never
  // judged there, or re-probed after a loss) decodes the sequence's settle
  // steps plainly instead of drafting them (counted as
  // PlanningStats::guard_settle_steps): they are no evidence, so drafting
  // them risks a loser's cost that no judgement weighs. A setting that won
  // there drafts from the first step. On a 2-core Zen 4 VM, knn's settings
  // at 1000 tokens on stories-24l-skip (bf16) drafted their 8 settle steps
  // and 6 more before the first judgement condemned them, at 0.75x of
  // plain decoding. Needs the shared verdicts (a guard without them drafts
  // its settle steps).
  bool settle_plain = true;
  // A drafting step whose drafts saved no layer (StepObservation::
  // saved_no_layers: SpecBound's draft tokens all ran the whole model) cost
  // at least the plain steps of its tokens, however the machine times it.
  // After futile_steps such steps in a row the setting loses at once, with
  // no timing and no probe (the settle steps count: this is not a timing).
  // SpecBound with training-free heads on stories-24l exits at the last
  // layer (24 of 24) almost always; the timing rules took 16-24 of its
  // steps per bucket to judge what these steps show. 0: off.
  int64_t futile_steps = 6;
  // A loss whose rate, plus `confidence` standard errors, is still below
  // plain x (1 - early_loss) is a clear one (GuardVerdicts::Verdict::clear):
  // it counts as two losses in a row (its first hold is 2 x reprobe_steps),
  // and with carry_neighbour_losses it holds the mode's other settings that
  // were never judged at the bucket or the two beside it (unplanned modes:
  // static, knn, specbound; GuardVerdicts). A setting far below plain
  // decoding is not there by a slow spell of the machine, and re-probing it
  // after 256 plain steps cost most of what the guard's judging costs: in
  // each cold pass of the benchmark on stories-24l-skip (bf16, 2-core Zen 4
  // VM, 762 tokens at 1000 of context) knn judged three times, its first
  // setting at 0.73x of plain, that setting's re-probe, and its second
  // setting at 0.64x, 23 drafting steps at about 0.65x in all.
  bool clear_losses = true;
  // A narrow loss (not a clear one) judged against the plain-rate table's
  // reference is confirmed before it holds anything: the guard runs a probe
  // (probe_steps plain steps, each after one of the setting's steps) and
  // judges by the full rule the setting's pooled rate at the pace of its
  // steps in the pairs, against the pairs' plain steps;
  // the pairs pool with the setting's earlier confirming pairs at the
  // bucket (GuardVerdicts::AddPairs; SpeculationGuard::PairedRateOf). That
  // verdict, win or loss, is the judgement. The table's plain steps ran at
  // another time than the setting's (up to plain_max_age_seconds before,
  // other requests' texts), and a 2-core VM's speed drifts by 10-25% between
  // such stretches: on stories-24l-skip (fp32, warm plan cache) a static mask
  // that drafted at 1.12x of plain in every cold pass lost judgements at
  // 1268 against a plain reference of 1312 tokens/s that read 1043 a second
  // earlier, and each loss held every request plain for 256 steps and more
  // (doubling), so the warm row read 1.005x. Pairs measure both over the
  // same stretch. A loser pays probe_steps more of its steps before the
  // verdict; a clear loss needs no confirmation. false: a narrow loss
  // against the table holds at once. A loss against this guard's own probe
  // reference (the table did not take the probe's plain steps: they ran
  // beside a solve) is a pairs' verdict already and holds at once. One
  // confirmation runs at a time per setting and bucket
  // (GuardVerdicts::StartConfirmation: the others drafting it judge no loss
  // until it ends); it is dropped when the context leaves its bucket, or
  // when another sequence's loss holds the setting meanwhile (that loss
  // stands).
  bool confirm_losses = true;
  // The standard errors the confirmation grants the setting (as
  // `confidence` does for the other judgements). The narrow loss already had
  // `confidence` errors' benefit of the doubt against the table; 0 judges
  // the pairs' bare rates: the setting must measure at least plain x
  // (1 + margin) beside the pairs' plain steps to draft on.
  double confirm_confidence = 1.0;
};

struct PlanControllerOptions {
  int64_t bucket_tokens = 256;  // context bucket width, >= 1
  // |observed acceptance - alpha_hat| that triggers, and the share of
  // predicted_drafts_per_step by which the drafts a step made may differ.
  double drift_tolerance = 0.2;
  int64_t drift_min_tokens = 40;  // trials before drift is judged
  double planner_budget = 0.05;   // PlannerBudget fraction; <= 0: no limit
  int64_t reference_steps = 16;   // m: steps captured per snapshot, >= 1
  int64_t min_request_gap = 64;   // T: steps between two snapshot starts, >= 1
  // A plain plan (gamma 0) of the current bucket is rechecked (a kRecheck
  // trigger) once the process's sequences have decoded this many plain steps
  // under it, twice as many after each recheck that answers plain again
  // (PlanCache::CountPlainStep); 0 = never.
  int64_t plain_recheck_steps = 1024;
  // The sequence's own odds (see the class comment): the other requests'
  // pooled odds count as at most this many draft tokens against the
  // sequence's own; 0 = off (every sequence decodes with the cache's
  // odds). Prompts under one plan accepted 0.76-0.98 of their drafts in a
  // bench run: a between-prompt spread of about 0.05 at a share of 0.85-0.9
  // is worth 0.1 / 0.05^2, some 32-50 tokens, of anyone else's evidence.
  int64_t sequence_prior_tokens = 32;
  // Own accept trials at the first re-choice, doubling after each (>= 1).
  int64_t sequence_first_trials = 8;
  // Plain steps under the sequence's own plain choice before it drafts with
  // the cache's plan again (>= 1).
  int64_t sequence_plain_steps = 64;
  GuardOptions guard;
  // The request's own skip mask, drafted with before the first plan ("" =
  // none): part of the guard's setting, so that requests with other masks
  // do not share a verdict on it.
  std::string initial_mask;
};

// kRecheck: the bucket's plain plan has served its share of plain steps
// (PlanControllerOptions::plain_recheck_steps).
enum class PlanTrigger { kNone, kNoPlan, kNewBucket, kDrift, kRecheck };
// "none", "no_plan", "new_bucket", "drift", "recheck".
std::string PlanTriggerName(PlanTrigger trigger);

// What one sequence's planning did (GenerationResult::planning).
struct PlanningStats {
  int64_t cache_hits = 0;        // buckets entered with a cached plan
  int64_t cache_misses = 0;      // buckets entered without one
  int64_t triggers_no_plan = 0;  // first step without a cached plan
  int64_t triggers_new_bucket = 0;
  int64_t triggers_drift = 0;
  int64_t triggers_recheck = 0;  // a plain plan's recheck (kRecheck)
  int64_t budget_deferrals =
      0;                     // triggers that had to wait for the planner budget
  double solve_seconds = 0;  // planner solve time of this sequence's requests
  // The guard.
  int64_t guard_checks = 0;       // judgements made
  int64_t guard_fallbacks = 0;    // judgements that switched to plain decoding
  int64_t guard_probe_steps = 0;  // plain steps run to measure the plain rate
  // Plain steps at a sequence's start (its settle steps) because its setting
  // had not won at the bucket (GuardOptions::settle_plain).
  int64_t guard_settle_steps = 0;
  // Narrow losses against the plain-rate table that a probe was run to
  // confirm (GuardOptions::confirm_losses), and those its pairs cleared
  // (the setting drafted on). A dropped confirmation (its bucket left, a
  // loss overtook it) counts in neither outcome.
  int64_t guard_confirmations = 0;
  int64_t guard_cleared_losses = 0;
  int64_t guard_plain_steps = 0;    // plain steps decoded because a plan lost
  double guard_last_spec_tps = 0;   // measured at the last judgement
  double guard_last_plain_tps = 0;  // the plain rate it was compared with
  // Of guard_plain_steps: those decoded under a verdict another sequence
  // gave (the shared verdict spared this one its own losing steps).
  int64_t guard_inherited_steps = 0;
  // Of guard_plain_steps: those decoded under a verdict carried from the
  // neighbouring bucket (GuardOptions::carry_neighbour_losses).
  int64_t guard_carried_steps = 0;
  // Process-wide, when the generation ended: solve seconds / decode seconds.
  double process_planner_cpu_share = 0;
  // The planner's latency profile was still being measured at some step of
  // this request (PlannerClient::ProfilePending: a server that started
  // before it had its profile), and the steps decoded plainly because of
  // that (no plan in force while it was pending; steps drafting with the
  // request's own skip mask are not counted).
  bool profile_pending = false;
  int64_t profile_pending_steps = 0;
};

// One step's outcome as the decode loop measured it.
struct StepObservation {
  int gamma = 0;     // gamma the step ran with (0: plain)
  int drafted = 0;   // draft tokens proposed
  int accepted = 0;  // of which accepted
  int tokens = 0;    // tokens committed
  // Wall time of the step: from the end of the sequence's previous step
  // (or of its prefill) to the end of this one's acceptance, so the
  // passes and the engine's work around them (sampling, acceptance,
  // bookkeeping, streaming the last step's tokens, the other sequences of
  // the batch), as the latency profile prices a step.
  double seconds = 0;
  // Draft tokens the step could make: gamma, fewer near the end of the
  // generation. A draft that stopped below it stopped on low confidence.
  // 0: gamma (or a plain step), unless `capped` (the last token: none).
  int budget = 0;
  // The end of the generation (or of the K/V cache) held the step's draft
  // budget below gamma, to 0 at the last token: the last steps of a request
  // are not the step a plan forecasts.
  bool capped = false;
  // A drafting step that computed at least what plain decoding of its
  // tokens would: SpecBound's, when no draft token of the step exited below
  // the model's last layer (each ran the whole model, one token a pass, as
  // plain decoding does, plus the exit checks). No other mode's step is.
  bool saved_no_layers = false;
};

// Whether `step` measures a plan of gamma `plan_gamma` (AppliedPlan's
// measured_*, executor/engine/generator.h): it ran as the plan said, drafting
// (plan_gamma > 0) or plain, and a drafting step with its whole budget (not
// capped).
bool StepMeasuresPlan(int plan_gamma, const StepObservation& step);

// Where a step that ran as its plan said (StepMeasuresPlan) is counted in
// the plan's AppliedPlan (executor/engine/generator.h):
//  - kBesideSolve: a solve of the process was in flight at either end of it
//    (PlanController::last_step_beside_solve): the solve shared the cores;
//  - kUnsteady: one of the sequence's first settle steps after its prefill
//    (`settled` false: GuardOptions::settle_steps; right after a prefill
//    every step runs slower for a while, plain decoding's too), or a
//    preempted step: longer than `outlier_factor` times
//    `expected_seconds`, the plan's calibrated seconds a step
//    (predicted_tokens_per_step / calibrated_tpt(); <= 0: none known, no
//    step is preempted; outlier_factor <= 0: off). The plain rate its
//    prediction is calibrated by and the draft cost beside it leave out the
//    same steps (RecordPlainStep, RecordDraftCost), so measured_* compares
//    like with like;
//  - kMeasured: the rest, the steps the plan's measured rate is made of.
enum class PlanStepKind { kBesideSolve, kUnsteady, kMeasured };
PlanStepKind ClassifyPlanStep(bool beside_solve, bool settled, double seconds,
                              double expected_seconds, double outlier_factor);

// The standard error of a rate measured over `steps` steps, the i-th of t_i
// tokens in s_i seconds, as tokens / seconds (T / S), from the sums T, S,
// sum t_i^2, sum t_i s_i and sum s_i^2. The delta method for a ratio of
// sums: Var(T / S) ~ sum (t_i - R s_i)^2 / S^2 * n / (n - 1), R = T / S.
// It treats the steps as independent; on a machine whose speed drifts they
// are not, so it is a lower bound. 0 with fewer than 2 steps or no seconds.
// The guard's rates, AppliedPlan::measured_tpt_standard_error and bench
// spec's pooled prediction (tools/bench_util.h) use it.
double RateStandardError(int64_t steps, double tokens, double seconds,
                         double tokens_sq, double token_seconds,
                         double seconds_sq);

// The guard of one sequence in any drafting mode (static, knapspec, clasp,
// knn, specbound): judges the setting in force against plain decoding at the
// same context bucket. The plain rate is measured online: the mean wall time
// of the plain steps (gamma 0, one token) recorded in the process's
// plain-rate table (PlanningShared::plain_rates) for the bucket, fed by
// every sequence, preempted steps left
// out (GuardOptions::outlier_factor, as for the speculative steps); when the
// bucket has fewer than probe_steps of them the guard runs a probe: the
// setting's steps and plain steps alternate until probe_steps plain steps
// ran (from the setting's first step, with probe_first, else before its
// first judgement). At the probe's end its pairs (the setting's steps
// against the plain ones) condemn a clear loser at once (the early rule
// below); the plain steps are then the bucket's reference. Every min_steps
// speculative steps it judges (the last steps of a request, whose draft
// budget the end of the generation capped, are no evidence): the
// speculative rate is tokens committed over summed step seconds of the
// setting's last evidence_steps speculative steps
// at the bucket since it last lost, from every sequence drafting with it
// (pooled in GuardVerdicts: the verdict holds them all; the min_steps count
// too, so a bucket that every request only passes through is judged), with
// its standard error; when rate + confidence * error < plain * (1 + margin),
// where error also counts the plain rate's own standard error (the plain
// steps' spread), the setting loses: the verdict goes to the process's
// GuardVerdicts (executor/planning/plan_cache.h) under (execution, setting,
// bucket), and every sequence of that setting in that bucket, this one and
// those that come later, decodes plainly for reprobe_steps plain steps in all
// (doubling with each loss in a row, up to max_hold_steps); then the setting is
// measured again. A window that is already far below plain after early_steps is
// judged then, and so is a re-probe's window that is below plain x (1 +
// margin). A narrow loss against the plain-rate table's steps (measured at
// another time) is first confirmed by a probe's pairs, whose verdict stands
// (GuardOptions::confirm_losses). A win clears the verdict (a narrow one,
// below plain x (1 + margin) once `confidence` standard errors are taken
// off, keeps the run of losses that doubles the next hold). A run of
// futile_steps drafting steps that saved no layer
// (StepObservation::saved_no_layers) loses without a timing. A new plan
// (SetPlan) is a new setting version: an older verdict does not hold it back.
// Without a verdict table the sequence falls back alone, until its next plan.
// With carry_neighbour_losses a verdict measured at the bucket beside this one
// holds the setting here too while it has never been judged here
// (GuardVerdicts::TakePlainStep). With probe_first the probe also comes
// first whenever the context reaches a bucket without a plain rate.
class SpeculationGuard {
 public:
  // `setting`: the drafting mode and what fixes its drafts (the verdict's
  // key with `execution_id`); `verdicts` may be null (no sharing).
  SpeculationGuard(GuardOptions options,
                   std::shared_ptr<StepTimeTable> plain_rates,
                   std::shared_ptr<GuardVerdicts> verdicts,
                   std::string execution_id, std::string setting,
                   uint64_t sequence_id, int64_t bucket_tokens);

  // A new setting took effect: measure from scratch (with probe_first, a
  // probe comes first when the bucket has no plain rate).
  void Reset();
  // A plan took effect (planned modes): its version keys the verdicts.
  void SetPlan(int64_t plan_version) {
    plan_version_ = plan_version;
    Reset();
  }
  // Before a step that would draft, at context bucket `bucket`: whether it
  // must be plain (a probe, or a losing verdict, whose step it counts).
  bool BeforeStep(int64_t bucket, PlanningStats& stats);
  // Whether the sequence's steps so far passed GuardOptions::settle_steps
  // (its steps are evidence now).
  bool settled() const { return steps_seen_ >= options_.settle_steps; }
  bool in_fallback() const { return state_ == State::kFallback; }
  // After every step (its plain step already recorded in the table).
  // `speculating`: the setting in force drafts (gamma > 0).
  void Observe(bool speculating, int64_t bucket, const StepObservation& step,
               PlanningStats& stats);

  // A measured rate: tokens/s, and that rate's standard error (0 below two
  // steps).
  struct Rate {
    double tokens_per_second = 0;
    double standard_error = 0;
    double tokens = 0;  // the steps' tokens the rate was measured over
  };

 private:
  enum class State { kSpeculate, kProbe, kFallback };
  // Probes: probe_steps plain steps, each after one of the setting's steps.
  void StartProbe();
  // In a probe: whether this step is its plain one (they alternate).
  bool NextProbeStepIsPlain();
  // One of the setting's steps; judges it when due (JudgeIfDue) unless a
  // probe is under way.
  void AddEvidence(int64_t bucket, const StepObservation& step,
                   PlanningStats& stats);
  // A judgement at min_steps steps since the last, an early one from
  // early_steps.
  void JudgeIfDue(int64_t bucket, PlanningStats& stats);
  // kFull: the evidence against the bucket's plain rate (a probe when it
  // has none); kEarly: the same, but only a clear loss is judged (the
  // early_loss bound; any loss for a re-probe of a loser); kPaired: as
  // kEarly, with the setting's steps of a probe against its plain steps;
  // kConfirm: a confirming probe's pairs, pooled with the setting's earlier
  // ones at the bucket, by the full rule (GuardOptions::confirm_losses).
  // Whether it judged (a verdict, win or loss, was given).
  enum class JudgeKind { kFull, kEarly, kPaired, kConfirm };
  bool Judge(int64_t bucket, PlanningStats& stats,
             JudgeKind kind = JudgeKind::kFull);
  // A run of futile_steps steps that saved no layer: a loss, whatever the
  // rates (reported with those measured so far, 0 where none).
  void JudgeFutile(int64_t bucket, PlanningStats& stats);
  // Records a judgement of `rate` against `plain` (the guard's stats, the
  // verdict table or this guard's own fallback); `loses` decides it;
  // `confirmation`: a confirmation's pairs judged (GuardVerdicts::Verdict).
  void Record(const Rate& rate, const Rate& plain, bool loses, int64_t bucket,
              PlanningStats& stats, bool confirmation = false);
  // Ends the confirmation under way without a judgement (its bucket left,
  // a loss overtook it, Reset), releasing it in the verdict table.
  void DropConfirmation();
  // Whether the probe under way confirms a narrow loss (confirm_bucket_).
  bool confirming() const { return confirm_bucket_ >= 0; }
  // The least hold of a loss of `rate` against `plain`
  // (GuardOptions::explore_share); 0 when off or nothing was lost.
  int64_t ExploreHoldSteps(const Rate& rate, const Rate& plain) const;
  // Plain decoding's rate at the bucket, once it has probe_steps plain
  // steps, with that rate's standard error (from the steps' spread): the
  // plain-rate table's, else this guard's last probe's (probe_reference_).
  // `from_table` (may be null) says which.
  std::optional<Rate> PlainRate(int64_t bucket,
                                bool* from_table = nullptr) const;

  const GuardOptions options_;
  const std::shared_ptr<StepTimeTable> plain_rates_;
  const std::shared_ptr<GuardVerdicts> verdicts_;
  const std::string execution_id_;
  const std::string setting_;
  const uint64_t sequence_id_;
  const int64_t bucket_tokens_;
  int64_t plan_version_ = 0;
  State state_ = State::kSpeculate;
  using StepEvidence = GuardVerdicts::Step;
  // Tokens/s of `steps` (outliers left out) and that rate's standard error.
  Rate RateOf(const std::deque<StepEvidence>& steps) const;
  // A confirmation's rate (JudgeKind::kConfirm): the rate of the setting's
  // pooled steps `evidence` (tokens over seconds), at the pace of its steps
  // in the confirming pairs (`paired`, measured beside the pairs' plain
  // steps): the pooled rate divided by the pairs' seconds over the pool's
  // mean seconds of steps that proposed as many draft tokens (a step's time
  // follows its draft tokens: on stories-24l at 1000 tokens of context,
  // bf16, a static mask's steps took 1.7 ms with one draft token and 3.9
  // ms with four, each within about 7%). Its standard error is that of
  // both ratios. Tokens a step spread widely (1 to gamma + 1) and the pool
  // knows their rate from up to evidence_steps steps; only the pairs
  // measured the pace beside plain decoding. Comparing each paired step
  // with pool steps of its own draft count keeps a run of pairs that
  // stopped their drafts early (cheap steps of few tokens) from passing for
  // a faster machine. The pool holds the pairs' steps too (they are
  // evidence), so a change of pace reads smaller than it is by their share
  // of the pool (8 of up to evidence_steps). Without a paired step whose
  // draft count the pool has, the pairs' own rate (RateOf).
  Rate PairedRateOf(const std::deque<StepEvidence>& evidence,
                    const std::deque<StepEvidence>& paired) const;
  // The last evidence_steps speculative steps since the last loss or Reset:
  // this sequence's own, weighed only without a verdict table (with one,
  // the setting's pool there is the evidence: GuardVerdicts::AddStep).
  std::deque<StepEvidence> evidence_;
  // The steps a judgement weighs: the verdict table's pool for the setting
  // at `bucket`, else evidence_.
  std::deque<StepEvidence> Evidence(int64_t bucket) const;
  // Speculative steps since the last judgement: with a verdict table, the
  // setting's at the bucket from every sequence (GuardVerdicts::AddStep).
  int64_t window_steps_ = 0;
  int64_t probe_left_ = 0;  // plain steps the probe still runs
  // The probe's pairs so far: the setting's steps and the plain steps.
  std::deque<StepEvidence> probe_setting_;
  std::deque<StepEvidence> probe_plain_;
  bool probe_plain_next_ = false;  // the probe's next step is its plain one
  // The last probe's plain steps, kept as this guard's own reference for
  // their bucket when the process's table did not take them (they ran
  // beside a solve: RecordPlainStep). The setting's steps ran beside the
  // same solves, so judging them against the probe is fair; without it, a
  // guard whose every probe ran beside a solve never judged (a 1k-context
  // knapspec plan at 0.89x of plain drafted 181 steps, with 133 probe
  // steps and no judgement). The plain-rate table's rate, when there is one,
  // comes first; this one ages out as the table's does.
  struct ProbeReference {
    int64_t bucket = -1;
    Rate plain;  // of the probe's plain steps
    absl::Time at;
  };
  std::optional<ProbeReference> probe_reference_;
  // Drafting steps in a row that saved no layer (futile_steps).
  int64_t futile_run_ = 0;
  // The bucket where the guard last decided whether to probe first
  // (probe_first): -1 after Reset (no step of the setting has run yet).
  int64_t probe_first_bucket_ = -1;
  // The bucket whose narrow loss the probe under way confirms
  // (GuardOptions::confirm_losses; -1: none): at the probe's end its pairs
  // are judged by the full rule, if the context is still at this bucket.
  int64_t confirm_bucket_ = -1;
  int64_t steps_seen_ = 0;  // steps observed (any setting, guard on or off)
};

// What the decode loop does at one step.
struct StepDirective {
  std::optional<CachedPlan> apply;  // put this plan in force before the step
  // "cache" (bucket entered), "solve" (own), "shared", "refined" (the
  // cache's newer gamma), "sequence" (the plan in force with this
  // sequence's own odds)
  std::string apply_source;
  int gamma = 0;               // gamma of this step
  bool capture = false;        // capture reference states this step
  int64_t capture_offset = 0;  // 0 .. reference_steps - 1 within the snapshot
};

// A snapshot ready to submit: the cache key its plan goes to, the claim on
// it, and the budget reservation. CompleteTicket() must run exactly once.
struct SubmitTicket {
  PlanCacheKey key;
  double reserved_seconds = 0;
  PlanTrigger trigger = PlanTrigger::kNone;
};

// Settles `ticket` with the planner's answer: stores a plan in the cache
// (from `sequence_id`'s snapshot of `context_length`), ends the claim and
// settles the budget with the solve time (0 on error). Thread-safe; called
// from planner threads.
void CompleteTicket(const PlanningShared& shared, const SubmitTicket& ticket,
                    uint64_t sequence_id, int64_t context_length,
                    const absl::StatusOr<DraftPlan>& plan);

class PlanController {
 public:
  // `key`: the sequence's cache key (its bucket is set per step);
  // `initial_gamma`: gamma before any plan (the request's skip mask's D, or 0).
  PlanController(PlanControllerOptions options, PlanCacheKey key,
                 uint64_t sequence_id, int initial_gamma,
                 PlanningShared shared);
  PlanController(const PlanController&) = delete;
  PlanController& operator=(const PlanController&) = delete;
  ~PlanController();

  // Before decode step `step`, with `context_length` positions committed.
  // With `may_start_capture` false (the batch runs this step without drafts:
  // a plan would not be used now) no new snapshot starts; a pending trigger
  // waits for a step where it may, and a capture in progress goes on.
  // `profile_pending` (PlannerClient::ProfilePending): the planner cannot
  // plan yet, so no new snapshot starts either (the trigger waits, and is
  // not counted as a budget deferral); the step is counted in
  // PlanningStats::profile_pending_steps when it decodes plainly for want
  // of a plan.
  StepDirective BeforeStep(int64_t step, int64_t context_length,
                           bool may_start_capture = true,
                           bool profile_pending = false);
  // After the step.
  void AfterStep(const StepObservation& observation);
  // The capture of the current snapshot is complete: its ticket (the caller
  // now owns the claim and the reservation; see CompleteTicket).
  SubmitTicket TakeTicket();
  // Generation over: releases a capture in progress, fills the process share.
  void Finish();

  const PlanningStats& stats() const { return stats_; }
  PlanTrigger pending_trigger() const { return trigger_; }
  bool capturing() const { return capturing_; }
  int gamma_in_force() const { return gamma_; }
  const std::optional<CachedPlan>& plan_in_force() const { return in_force_; }
  // Plain decoding's mean step seconds at `context_length`'s bucket in the
  // process's plain-rate table (every sequence of this execution, the guard's
  // outlier rule, none older than the guard's plain_max_age_seconds: the
  // machine's speed drifts), nullopt with fewer than the guard's probe_steps
  // samples. Reads the shared table (thread-safe).
  std::optional<double> PlainStepSeconds(int64_t context_length) const;
  // Drafting steps' cost against the latency model at `context_length`'s
  // bucket: the mean, over the recent drafting steps in the process's
  // draft_costs table (StepTimeTable), of a step's seconds over its plan's
  // predicted seconds a step, with PlainStepSeconds' window, age and
  // outlier rule; nullopt with fewer than the guard's probe_steps of them
  // or without the table. Reads the shared table (thread-safe). AfterStep
  // records a step there when it drafted under a plan in force that
  // predicts its rate, as that plan said (StepMeasuresPlan), at the plan's
  // own bucket (a plan still in force past it was priced for less
  // context), after the guard's settle steps and with no solve in flight
  // at either end: the steps a drafting plan's measured rate is made of,
  // less those that are no evidence of the machine's steady speed.
  std::optional<double> DraftCostRatio(int64_t context_length) const;
  // Whether a solve of the process (PlannerBudget::solves_in_flight) was in
  // flight at the start or at the end of the last step AfterStep saw: the
  // solve shared the cores with it, so its time is not what the latency
  // model priced (AppliedPlan::beside_solve_*).
  bool last_step_beside_solve() const { return last_step_beside_solve_; }
  // Whether the sequence's steps so far passed the guard's settle_steps
  // (SpeculationGuard::settled): called before AfterStep, whether the step
  // that just ran was past them.
  bool settled() const { return guard_.settled(); }
  // The guard's outlier factor (GuardOptions::outlier_factor).
  double outlier_factor() const { return options_.guard.outlier_factor; }

 private:
  bool SolvesInFlight() const;
  // Puts `plan`, cached under `key`'s `bucket`, in force.
  void Apply(const CachedPlan& plan, int64_t bucket, const std::string& source,
             StepDirective& directive);
  // The newest plan of awaited_keys_ that arrived after the sequence left
  // its bucket, when it is newer than the plan in force.
  void ApplyAwaitedPlan(StepDirective& directive);
  // The plan in force with the sequence's own odds (own_evidence_ on top of
  // pooled_evidence_'s others), nullopt when off or it cannot be refined.
  std::optional<DraftPlan> SequencePlan(const DraftPlan& plan) const;
  void SetTrigger(PlanTrigger trigger);
  void AbandonCapture();

  const PlanControllerOptions options_;
  PlanCacheKey key_;
  // key_.ExecutionId(), built once (read on every plain step).
  const std::string execution_id_;
  const uint64_t sequence_id_;
  const PlanningShared shared_;
  SpeculationGuard guard_;
  PlanningStats stats_;

  bool started_ = false;
  int64_t bucket_ = 0;
  std::optional<CachedPlan> in_force_;
  // The key in_force_ came from: key_ at the bucket it was applied for
  // (another bucket's when a late solve is applied; meaningless while
  // in_force_ is empty).
  PlanCacheKey in_force_key_;
  int gamma_ = 0;  // of the setting in force
  int64_t applied_version_ = 0;
  // The keys of this sequence's submitted solves that may still answer for
  // a bucket the sequence has left (see the class comment), oldest first;
  // at most kMaxAwaited (older ones are dropped).
  static constexpr size_t kMaxAwaited = 8;
  std::deque<PlanCacheKey> awaited_keys_;

  PlanTrigger trigger_ = PlanTrigger::kNone;
  PlanTrigger last_trigger_ = PlanTrigger::kNone;  // of the current bucket
  bool deferral_counted_ = false;
  bool capturing_ = false;
  int64_t capture_start_ = 0;
  std::optional<int64_t> last_capture_start_;
  SubmitTicket capture_ticket_;

  // The sequence's own drafting under the solve in force, the cache's
  // pooled evidence of that solve as of the last step that added to it, the
  // own accept trials of the next re-choice, and a re-choice waiting for the
  // next step.
  DraftEvidence own_evidence_;
  DraftEvidence pooled_evidence_;
  int64_t own_next_trials_ = 0;
  std::optional<DraftPlan> sequence_plan_;
  // Plain steps since the sequence's own odds chose gamma 0.
  int64_t own_plain_steps_ = 0;

  int64_t drift_trials_ = 0;
  int64_t drift_accepted_ = 0;
  int64_t drift_steps_ = 0;    // speculative steps under the plan in force
  int64_t drift_drafted_ = 0;  // their draft tokens
  bool drift_fired_ = false;

  bool step_began_beside_solve_ = false;  // BeforeStep's SolvesInFlight()
  bool last_step_beside_solve_ = false;
};

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_PLANNING_PLAN_CONTROLLER_H_
