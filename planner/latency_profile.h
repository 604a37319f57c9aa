// LatencyProfile: the planner's latency model of one model on one machine,
// measured once per hardware + dtype + model + thread count and kept as a
// small JSON file.
//
//   t_attn(n)          = attention.a + attention.b * n   (one attention
//   sublayer,
//                        one decode token, context length n)
//   t_mlp              = mlp_seconds                     (one MLP sublayer)
//   t_verify(n, t)     = the measured full-model pass over t tokens at context
//   n:
//                        linear in n between the measured contexts; past the
//                        largest one, the last measurement plus the
//                        least-squares slope of that token count's row over all
//                        contexts (fitted like attention: a line in n, a
//                        negative slope counts as 0), so verification keeps
//                        getting dearer with context as attention does; below
//                        the smallest context, clamped to it (the shortest
//                        profiled context is short, 128 by default, and
//                        extrapolating down could only reach non-positive times
//                        on noisy rows). Non-decreasing in t: a pass over more
//                        tokens never counts as cheaper (the running maximum
//                        over 1..t hides timing noise that would otherwise make
//                        "draft, then verify more tokens" look cheaper than
//                        plain decoding).
//   t_draft(S, n)      = t_verify(n, 1) * sublayer(S, n) / sublayer(empty, n),
//   where
//                        sublayer(S, n) = step_fixed_seconds
//                                         + kept attention sublayers *
//                                         t_attn(n)
//                                         + kept MLP sublayers * t_mlp
//
// The whole step. The passes timed alone are not all a step costs: the
// engine also picks the tokens from the logits, accepts or rejects drafts,
// keeps its books and calls back with the new tokens, and its passes run
// slower than the same passes timed back to back here (on the Intel VMs of
// this project a verification pass inside a drafting step took 10-30% longer
// than the table below, a plain step's pass 5-8%).
// ProfileOptions::measure_overhead measures both on the real engine
// (tools/step_overhead.h has how: o_draft makes a drafting step cost,
// against a plain one, what the engine measured) as two lines in the
// context length n:
//
//   o_step(n)  = step_overhead_seconds  + n * step_overhead_slope   (per step)
//   o_draft(n) = draft_overhead_seconds + n * draft_overhead_slope  (per draft
//                                                                     token)
//
// and the planner prices a step with them (tpt.h):
//
//   StepSeconds(n, t)       = t_verify(n, t) + o_step(n)
//   DraftTokenSeconds(S, n) = t_draft(S, n) + o_draft(n)
//
// Without them the TPT grid over-speculates: every draft token looks cheaper
// than it is, and plain decoding's own step cost is understated less than a
// speculative step's.
//
// One basis: the sublayer timings (each sublayer timed on its own inside a
// step) do not sum exactly to the measured one-token pass, so t_draft scales
// the sublayer model to it. The empty mask (skip nothing) costs exactly
// t_verify(n, 1), and skipping a sublayer saves its scaled share. Hence a
// draft that skips nothing can never beat plain decoding in the TPT grid
// (it would need t_verify(n, gamma + 1) < t_verify(n, 1)).
//
// ProfileModel measures one on the real engine; Save/Load move it to and from
// JSON; CheckMatches refuses a profile measured for another engine.
//
//   ASSIGN_OR_RETURN(LatencyProfile profile, LatencyProfile::Load(path));
//   RETURN_IF_ERROR(profile.CheckMatches(model.config().Fingerprint(), "cpu",
//   "bf16", 2)); double t = profile.DraftSeconds(plan.mask, context_length);
//
// A LatencyProfile is a plain value: copy it freely. Its const methods are
// thread-safe. ProfileModel runs the model and must not race with other heavy
// work if its timings are to mean anything.
#ifndef KNAPSERVE_PLANNER_LATENCY_PROFILE_H_
#define KNAPSERVE_PLANNER_LATENCY_PROFILE_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/model/layer_mask.h"

namespace knapserve {

class LlamaModel;

// y = a + b * x fitted by ordinary least squares. r2 is the coefficient of
// determination (1 when the points are exactly on a line, including the case
// where all y are equal and so the fit is exact).
struct LineFit {
  double a = 0;
  double b = 0;
  double r2 = 0;
};

// Least-squares line through (x[i], y[i]). InvalidArgument when the spans
// differ in length, hold fewer than two points, or all x are equal.
absl::StatusOr<LineFit> FitLine(absl::Span<const double> x,
                                absl::Span<const double> y);

struct LatencyProfile {
  // Bumped when the JSON layout changes; Load refuses other versions (a
  // cached profile of another version is measured again). Version 2 added
  // step_overhead_seconds and draft_overhead_seconds; version 3 measures
  // o_draft against this profile's pass prices (a drafting step costs,
  // against a plain one, what the engine measured; before, the engine's time
  // outside its measured passes) and added their slopes in the context
  // length.
  static constexpr int kVersion = 3;

  // ---- Key: which engine the timings are for ----
  std::string model_fingerprint;  // ModelConfig::Fingerprint()
  std::string device;             // torch::Device::str(), e.g. "cpu", "cuda:0"
  std::string dtype;              // DtypeName(), e.g. "bf16"
  int threads = 0;                // torch intra-op threads while measuring

  // ---- The model ----
  // One attention sublayer, one token: t_attn(n) = a + b * n.
  LineFit attention;
  // One MLP sublayer, one token (the mean of its per-context medians).
  double mlp_seconds = 0;
  // A line through the MLP timings over the same contexts, kept as a check:
  // b * n should be tiny next to a (MLP cost does not depend on n); its r2 is
  // near 0 exactly when the timings are flat.
  LineFit mlp_fit;
  // Per decode step on top of the sublayers: embedding, final norm, LM head.
  double step_fixed_seconds = 0;
  // What a step costs in the engine beyond its passes' prices here (the file
  // comment): per decode step (o_step) and per draft token (o_draft), each a
  // line in the context length (seconds at n = 0, seconds per position), all
  // >= 0. 0 when the profile was measured without an engine
  // (ProfileOptions::measure_overhead empty).
  double step_overhead_seconds = 0;
  double step_overhead_slope = 0;
  double draft_overhead_seconds = 0;
  double draft_overhead_slope = 0;
  // o_step(n) and o_draft(n).
  double StepOverheadSeconds(int64_t context_length) const;
  double DraftOverheadSeconds(int64_t context_length) const;
  // The largest gamma the verify table covers (tokens 1..max_draft+1).
  int max_draft = 0;
  // Context lengths of the verify table, strictly increasing.
  std::vector<int64_t> verify_contexts;
  // verify_seconds[c][t-1]: full-model pass over t tokens at
  // verify_contexts[c], t = 1..max_draft+1.
  std::vector<std::vector<double>> verify_seconds;

  // ---- Raw medians behind the fits (diagnostics; not used for planning) ----
  std::vector<int64_t> sublayer_contexts;
  std::vector<double> attention_medians;
  std::vector<double> mlp_medians;

  // Where Load read this profile from ("" if built in memory); used in error
  // messages, not saved.
  std::string source;

  // t_attn(n), never below 0.
  double AttentionSeconds(int64_t context_length) const;
  // t_mlp.
  double MlpSeconds() const { return mlp_seconds; }
  // t_verify(n, tokens) as in the file comment: interpolated inside the
  // measured contexts, extrapolated with VerifySlope past the largest,
  // clamped below the smallest, non-decreasing in tokens; tokens is clamped
  // to [1, max_draft + 1].
  double VerifySeconds(int64_t context_length, int tokens) const;
  // d t_verify / d n for `tokens` tokens (clamped to [1, max_draft + 1]) past
  // the largest measured context: the least-squares slope of that row of
  // verify_seconds over verify_contexts, 0 when negative or with a single
  // context.
  double VerifySlope(int tokens) const;
  // t_draft(S, n) for one draft token with `mask`'s kept sublayers, on the
  // basis of the measured one-token pass: VerifySeconds(n, 1) *
  // SublayerSeconds(mask, n) / FullStepSeconds(L, n), computed as
  // VerifySeconds(n, 1) minus the skipped sublayers' share of it, so the
  // empty mask costs exactly VerifySeconds(n, 1) (bit for bit).
  double DraftSeconds(const LayerMask& mask, int64_t context_length) const;
  // The whole step as the TPT objective prices it: VerifySeconds(n, tokens)
  // + StepOverheadSeconds(n).
  double StepSeconds(int64_t context_length, int tokens) const;
  // VerifySeconds for a fractional token count (a mean over steps): linear
  // between the neighbouring whole counts.
  double MeanVerifySeconds(int64_t context_length, double tokens) const;
  // One draft token as the TPT objective prices it: DraftSeconds(mask, n) +
  // DraftOverheadSeconds(n).
  double DraftTokenSeconds(const LayerMask& mask, int64_t context_length) const;
  // The raw sublayer model of one draft token: step_fixed_seconds + kept
  // attention sublayers * t_attn(n) + kept MLP sublayers * t_mlp.
  double SublayerSeconds(const LayerMask& mask, int64_t context_length) const;
  // Full-model step cost as the raw sublayer model sees it (no sublayer
  // skipped): step_fixed_seconds + L * (t_attn(n) + t_mlp).
  double FullStepSeconds(int num_layers, int64_t context_length) const;

  // OK when the fields are internally consistent (non-empty key, positive
  // times, a verify table of the right shape with increasing contexts);
  // InvalidArgument naming the first bad field otherwise.
  absl::Status Validate() const;

  // FailedPrecondition naming both keys (the profile's and the engine's) when
  // any of the four differ; the message says to re-run `knapserve profile`.
  absl::Status CheckMatches(const std::string& fingerprint,
                            const std::string& device, const std::string& dtype,
                            int threads) const;

  // JSON text (pretty-printed) and back. FromJson errors are InvalidArgument
  // prefixed with `source_name`: corrupt JSON, a missing or mistyped field, a
  // version other than kVersion, or a profile that fails Validate().
  std::string ToJson() const;
  static absl::StatusOr<LatencyProfile> FromJson(
      const std::string& text, const std::string& source_name);

  // File round trip. Errors name the path.
  absl::Status Save(const std::string& path) const;
  static absl::StatusOr<LatencyProfile> Load(const std::string& path);
};

// What a step costs in the engine beyond its passes' prices (LatencyProfile's
// o_step and o_draft, lines in the context length), as
// ProfileOptions::measure_overhead reports it.
struct StepOverhead {
  double step_seconds = 0;   // per decode step at context 0, >= 0
  double step_slope = 0;     // its growth per context position, >= 0
  double draft_seconds = 0;  // per draft token at context 0, >= 0
  double draft_slope = 0;    // its growth per context position, >= 0
};

// What ProfileModel measures and how often.
struct ProfileOptions {
  // Context lengths n for the attention fit and the verify table. Values that
  // do not fit the model (n + max_draft + 1 > max_context) are dropped; at
  // least two distinct ones must remain.
  std::vector<int64_t> contexts = {128, 512, 1024, 2048, 4096};
  int repeats = 20;  // timed runs per point; the median is kept
  int warmup = 3;    // untimed runs before them
  // Seconds a point may take before it is cut short (0 = no limit): once
  // its runs have taken this long, the warm-up ends after its first run and
  // the timed runs after min_repeats. On a model whose pass over 11 tokens
  // at 8k context takes 0.1 s, `repeats` runs at every context take
  // minutes; the budget keeps a profile of a large model on a slow CPU
  // within minutes, and leaves a small model's (whose runs take
  // milliseconds) as it was.
  double point_budget_seconds = 0;
  int min_repeats = 3;  // >= 1; at most `repeats` are run in any case
  int max_draft = 10;   // verify table covers 1..max_draft+1 tokens
  uint64_t seed = 0;    // for the random K/V contents and hidden states
  // Called on the measuring thread before every run (warm-up or timed) of
  // every point, and inside a verify run before each of its passes (one per
  // token count: on a large model a run is max_draft+1 full passes, too long
  // for a waiting request to sit behind); empty = never. An error stops the
  // measurement and is returned (a server shutting down answers Cancelled).
  // `true` says it waited (a server's background profile pauses while
  // requests decode, planner/background_profile.h): the caches are then
  // cold, so the point starts over with its warm-up and its timings so far
  // are dropped.
  std::function<absl::StatusOr<bool>()> before_run;
  // Measures what a step costs in the engine beyond the passes' prices,
  // called once on the measuring thread after the passes are timed, with the
  // profile so far (every pass price set, the overheads 0) and `before_run`
  // to call before each of its runs and between their decode steps; empty
  // leaves the overheads 0 (the planner's layer has no engine: the caller
  // that owns one supplies it, tools/step_overhead.h). Negative or
  // non-finite results are InvalidArgument; its errors are returned.
  std::function<absl::StatusOr<StepOverhead>(
      const LatencyProfile& passes,
      const std::function<absl::StatusOr<bool>()>& before_run)>
      measure_overhead;
};

// Measures `model` on its own device and dtype. At each context length n: a
// one-token decode step through every layer with each sublayer timed on its
// own (Attention with a K/V cache at n, Mlp), giving the mean attention and
// MLP sublayer latency in a real step (weights streaming from memory as in
// decoding, not one layer's weights hot in cache) and the fixed cost (Embed +
// Logits); then the full model's pass over 1..max_draft+1 tokens as the
// engine runs it (LlamaModel::ForwardBatch), every token count once per run,
// in turns, so that drift in the machine's speed hits them alike. Medians of
// `repeats` runs after `warmup` runs, measured in two sweeps (up the
// contexts, then down) keeping each figure's smaller median: interference
// only slows runs down, and a disturbance of one context in one sweep misses
// it in the other. The K/V contents are random (latency
// does not depend on them), so no prefill is needed. A negative fitted
// attention slope (timing noise) is replaced by a constant, the mean (r2 is
// kept as measured). The key is filled from the model and the current torch
// thread count.
// InvalidArgument for bad options (repeats < 1, fewer than two usable
// contexts); Internal if torch throws; before_run's errors.
absl::StatusOr<LatencyProfile> ProfileModel(const LlamaModel& model,
                                            const ProfileOptions& options);

}  // namespace knapserve

#endif  // KNAPSERVE_PLANNER_LATENCY_PROFILE_H_
