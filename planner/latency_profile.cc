#include "planner/latency_profile.h"

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/file_util.h"
#include "common/base/json_fields.h"
#include "common/base/status.h"
#include "common/model/llama.h"
#include "nlohmann/json.hpp"

namespace knapserve {
namespace {

using Json = nlohmann::json;

constexpr const char* kFormat = "knapserve-latency-profile";

// Index of the segment [contexts[k], contexts[k+1]] holding n and the weight
// of contexts[k+1], clamped at both ends.
std::pair<size_t, double> Bracket(const std::vector<int64_t>& contexts,
                                  int64_t n) {
  if (contexts.size() == 1 || n <= contexts.front()) return {0, 0.0};
  if (n >= contexts.back()) return {contexts.size() - 2, 1.0};
  size_t k = 0;
  while (k + 2 < contexts.size() && n > contexts[k + 1]) ++k;
  const double span = static_cast<double>(contexts[k + 1] - contexts[k]);
  return {k, static_cast<double>(n - contexts[k]) / span};
}

// An error of Validate() about one field, in the style of the JSON reader's.
absl::Status FieldError(const std::string& field, const std::string& problem) {
  return absl::InvalidArgumentError(
      absl::StrCat("field \"", field, "\": ", problem));
}

absl::StatusOr<LineFit> ReadFit(const JsonReader& object,
                                std::string_view name) {
  ASSIGN_OR_RETURN(const JsonReader value, object.Child(name));
  LineFit fit;
  ASSIGN_OR_RETURN(fit.a, value.RequiredDouble("a"));
  ASSIGN_OR_RETURN(fit.b, value.RequiredDouble("b"));
  ASSIGN_OR_RETURN(fit.r2, value.RequiredDouble("r2"));
  return fit;
}

Json FitToJson(const LineFit& fit) {
  return Json{{"a", fit.a}, {"b", fit.b}, {"r2", fit.r2}};
}

absl::StatusOr<LatencyProfile> ParseProfile(const JsonReader& json) {
  RETURN_IF_ERROR(json.ExpectObject());
  ASSIGN_OR_RETURN(std::string format, json.RequiredString("format"));
  if (format != kFormat) {
    return json.FieldError(
        "format", absl::StrCat("expected '", kFormat, "', got '", format, "'"));
  }
  ASSIGN_OR_RETURN(int64_t version, json.RequiredInt64("version"));
  if (version != LatencyProfile::kVersion) {
    return json.FieldError(
        "version", absl::StrCat("profile version ", version,
                                " is not supported (this build reads version ",
                                LatencyProfile::kVersion,
                                "); re-run `knapserve profile`"));
  }
  LatencyProfile p;
  ASSIGN_OR_RETURN(p.model_fingerprint,
                   json.RequiredString("model_fingerprint"));
  ASSIGN_OR_RETURN(p.device, json.RequiredString("device"));
  ASSIGN_OR_RETURN(p.dtype, json.RequiredString("dtype"));
  ASSIGN_OR_RETURN(p.threads, json.RequiredInt("threads"));
  ASSIGN_OR_RETURN(p.attention, ReadFit(json, "attention"));
  ASSIGN_OR_RETURN(p.mlp_seconds, json.RequiredDouble("mlp_seconds"));
  ASSIGN_OR_RETURN(p.mlp_fit, ReadFit(json, "mlp_fit"));
  ASSIGN_OR_RETURN(p.step_fixed_seconds,
                   json.RequiredDouble("step_fixed_seconds"));
  ASSIGN_OR_RETURN(p.step_overhead_seconds,
                   json.RequiredDouble("step_overhead_seconds"));
  ASSIGN_OR_RETURN(p.step_overhead_slope,
                   json.RequiredDouble("step_overhead_slope"));
  ASSIGN_OR_RETURN(p.draft_overhead_seconds,
                   json.RequiredDouble("draft_overhead_seconds"));
  ASSIGN_OR_RETURN(p.draft_overhead_slope,
                   json.RequiredDouble("draft_overhead_slope"));
  ASSIGN_OR_RETURN(p.max_draft, json.RequiredInt("max_draft"));
  ASSIGN_OR_RETURN(p.verify_contexts,
                   json.RequiredInt64Array("verify_contexts"));
  ASSIGN_OR_RETURN(const std::vector<JsonReader> rows,
                   json.RequiredArray("verify_seconds"));
  for (const JsonReader& row : rows) {
    ASSIGN_OR_RETURN(std::vector<double> values, row.AsDoubleArray());
    p.verify_seconds.push_back(std::move(values));
  }
  ASSIGN_OR_RETURN(p.sublayer_contexts,
                   json.RequiredInt64Array("sublayer_contexts"));
  ASSIGN_OR_RETURN(p.attention_medians,
                   json.RequiredDoubleArray("attention_medians"));
  ASSIGN_OR_RETURN(p.mlp_medians, json.RequiredDoubleArray("mlp_medians"));
  RETURN_IF_ERROR(json.Annotate(p.Validate()));
  return p;
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 == 1 ? values[mid]
                                : 0.5 * (values[mid - 1] + values[mid]);
}

// Runs one point of the profile: `run(timed)` `warmup` times untimed, then
// `repeats` times timed; with options.point_budget_seconds, once the point
// has run that long, the warm-up ends after its first run and the timed runs
// after min(min_repeats, repeats). Before every run asks options.before_run:
// an error stops it; a wait means the caches went cold, so `restart` drops
// what the point measured and the warm-up (and the budget's clock) starts
// over. `run` may ask before_run itself between its passes: it returns true
// when that waited (the run is cut short, and the point starts over the
// same way) and its errors stop the point.
absl::Status RunPoint(
    const ProfileOptions& options, int warmup, int repeats,
    const std::function<void()>& restart,
    const std::function<absl::StatusOr<bool>(bool timed)>& run) {
  const int enough = std::min(options.min_repeats, repeats);
  auto start = std::chrono::steady_clock::now();
  int timed = 0;
  for (int i = 0; i < warmup + repeats; ++i) {
    bool waited = false;
    if (options.before_run) {
      ASSIGN_OR_RETURN(waited, options.before_run());
    }
    if (!waited || i == 0) {
      ASSIGN_OR_RETURN(waited, run(i >= warmup));
    }
    if (waited) {
      restart();
      i = -1;  // the loop's ++i starts the warm-up again
      timed = 0;
      start = std::chrono::steady_clock::now();
      continue;
    }
    if (i >= warmup) ++timed;
    const double spent =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count();
    if (options.point_budget_seconds > 0 &&
        spent >= options.point_budget_seconds) {
      if (i < warmup) {
        i = warmup - 1;  // the loop's ++i makes the next run the first timed
      } else if (timed >= enough) {
        break;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<LineFit> FitLine(absl::Span<const double> x,
                                absl::Span<const double> y) {
  if (x.size() != y.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FitLine: ", x.size(), " x values but ", y.size(), " y values"));
  }
  if (x.size() < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("FitLine: needs at least two points, got ", x.size()));
  }
  const double n = static_cast<double>(x.size());
  double mx = 0, my = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    mx += x[i];
    my += y[i];
  }
  mx /= n;
  my /= n;
  double sxx = 0, sxy = 0, syy = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    sxx += (x[i] - mx) * (x[i] - mx);
    sxy += (x[i] - mx) * (y[i] - my);
    syy += (y[i] - my) * (y[i] - my);
  }
  if (sxx <= 0)
    return absl::InvalidArgumentError("FitLine: all x values are equal");
  LineFit fit;
  fit.b = sxy / sxx;
  fit.a = my - fit.b * mx;
  double ss_res = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double e = y[i] - (fit.a + fit.b * x[i]);
    ss_res += e * e;
  }
  fit.r2 = syy > 0 ? 1.0 - ss_res / syy : 1.0;
  return fit;
}

double LatencyProfile::AttentionSeconds(int64_t context_length) const {
  return std::max(
      0.0, attention.a + attention.b * static_cast<double>(context_length));
}

double LatencyProfile::VerifySlope(int tokens) const {
  if (verify_contexts.size() < 2 ||
      verify_seconds.size() != verify_contexts.size() || max_draft < 0) {
    return 0;
  }
  const int t = std::clamp(tokens, 1, max_draft + 1);
  std::vector<double> x, y;
  for (size_t c = 0; c < verify_contexts.size(); ++c) {
    if (static_cast<int>(verify_seconds[c].size()) < t) return 0;
    x.push_back(static_cast<double>(verify_contexts[c]));
    y.push_back(verify_seconds[c][t - 1]);
  }
  absl::StatusOr<LineFit> fit = FitLine(x, y);
  if (!fit.ok() || !std::isfinite(fit->b)) return 0;
  return std::max(0.0, fit->b);
}

double LatencyProfile::VerifySeconds(int64_t context_length, int tokens) const {
  if (verify_contexts.empty() || verify_seconds.empty() || max_draft < 0)
    return 0;
  const int t_max = std::clamp(tokens, 1, max_draft + 1);
  const auto [k, w] = Bracket(verify_contexts, context_length);
  const int64_t last = verify_contexts.back();
  // The running maximum over 1..t_max keeps t_verify non-decreasing in tokens.
  double result = 0;
  for (int t = 1; t <= t_max; ++t) {
    double value = 0;
    if (context_length > last) {
      value = verify_seconds.back()[t - 1] +
              VerifySlope(t) * static_cast<double>(context_length - last);
    } else {
      const double lo = verify_seconds[k][t - 1];
      value = w == 0.0 ? lo : lo + w * (verify_seconds[k + 1][t - 1] - lo);
    }
    result = std::max(result, value);
  }
  return result;
}

double LatencyProfile::SublayerSeconds(const LayerMask& mask,
                                       int64_t context_length) const {
  int kept_attention = 0;
  int kept_mlp = 0;
  for (int layer = 0; layer < mask.num_layers(); ++layer) {
    if (!mask.skip_attention(layer)) ++kept_attention;
    if (!mask.skip_mlp(layer)) ++kept_mlp;
  }
  return step_fixed_seconds +
         kept_attention * AttentionSeconds(context_length) +
         kept_mlp * MlpSeconds();
}

double LatencyProfile::DraftSeconds(const LayerMask& mask,
                                    int64_t context_length) const {
  int skipped_attention = 0;
  int skipped_mlp = 0;
  for (int layer = 0; layer < mask.num_layers(); ++layer) {
    if (mask.skip_attention(layer)) ++skipped_attention;
    if (mask.skip_mlp(layer)) ++skipped_mlp;
  }
  const double one_token = VerifySeconds(context_length, 1);
  const double full = FullStepSeconds(mask.num_layers(), context_length);
  if (!(full > 0)) return one_token;
  // The measured pass minus the skipped sublayers' share of it: exactly
  // one_token (no rounding) when nothing is skipped.
  const double skipped = skipped_attention * AttentionSeconds(context_length) +
                         skipped_mlp * MlpSeconds();
  return one_token - one_token * (skipped / full);
}

double LatencyProfile::StepOverheadSeconds(int64_t context_length) const {
  return step_overhead_seconds +
         step_overhead_slope *
             static_cast<double>(std::max<int64_t>(0, context_length));
}

double LatencyProfile::DraftOverheadSeconds(int64_t context_length) const {
  return draft_overhead_seconds +
         draft_overhead_slope *
             static_cast<double>(std::max<int64_t>(0, context_length));
}

double LatencyProfile::StepSeconds(int64_t context_length, int tokens) const {
  return VerifySeconds(context_length, tokens) +
         StepOverheadSeconds(context_length);
}

double LatencyProfile::MeanVerifySeconds(int64_t context_length,
                                         double tokens) const {
  const double whole = std::floor(tokens);
  const int below = static_cast<int>(whole);
  const double above_share = tokens - whole;
  const double low = VerifySeconds(context_length, below);
  if (above_share <= 0) return low;
  return low + above_share * (VerifySeconds(context_length, below + 1) - low);
}

double LatencyProfile::DraftTokenSeconds(const LayerMask& mask,
                                         int64_t context_length) const {
  return DraftSeconds(mask, context_length) +
         DraftOverheadSeconds(context_length);
}

double LatencyProfile::FullStepSeconds(int num_layers,
                                       int64_t context_length) const {
  return step_fixed_seconds +
         num_layers * (AttentionSeconds(context_length) + MlpSeconds());
}

absl::Status LatencyProfile::Validate() const {
  if (model_fingerprint.empty())
    return FieldError("model_fingerprint", "is empty");
  if (device.empty()) return FieldError("device", "is empty");
  if (dtype.empty()) return FieldError("dtype", "is empty");
  if (threads < 1)
    return FieldError("threads", absl::StrCat("must be >= 1, got ", threads));
  auto finite = [](double v) { return std::isfinite(v); };
  if (!finite(attention.a) || !finite(attention.b) || !finite(attention.r2)) {
    return FieldError("attention", "has a non-finite coefficient");
  }
  if (!finite(mlp_seconds) || mlp_seconds <= 0) {
    return FieldError("mlp_seconds", "must be a positive number");
  }
  if (!finite(step_fixed_seconds) || step_fixed_seconds < 0) {
    return FieldError("step_fixed_seconds", "must be a non-negative number");
  }
  if (!finite(step_overhead_seconds) || step_overhead_seconds < 0) {
    return FieldError("step_overhead_seconds", "must be a non-negative number");
  }
  if (!finite(draft_overhead_seconds) || draft_overhead_seconds < 0) {
    return FieldError("draft_overhead_seconds",
                      "must be a non-negative number");
  }
  if (!finite(step_overhead_slope) || step_overhead_slope < 0) {
    return FieldError("step_overhead_slope", "must be a non-negative number");
  }
  if (!finite(draft_overhead_slope) || draft_overhead_slope < 0) {
    return FieldError("draft_overhead_slope", "must be a non-negative number");
  }
  if (max_draft < 1)
    return FieldError("max_draft",
                      absl::StrCat("must be >= 1, got ", max_draft));
  if (verify_contexts.empty()) return FieldError("verify_contexts", "is empty");
  for (size_t i = 0; i < verify_contexts.size(); ++i) {
    if (verify_contexts[i] < 0 ||
        (i > 0 && verify_contexts[i] <= verify_contexts[i - 1])) {
      return FieldError("verify_contexts",
                        "must be non-negative and strictly increasing");
    }
  }
  if (AttentionSeconds(verify_contexts.back()) <= 0) {
    return FieldError("attention",
                      absl::StrCat("predicts no positive latency at context ",
                                   verify_contexts.back()));
  }
  if (verify_seconds.size() != verify_contexts.size()) {
    return FieldError("verify_seconds",
                      absl::StrCat("has ", verify_seconds.size(),
                                   " rows, expected one per context (",
                                   verify_contexts.size(), ")"));
  }
  for (const std::vector<double>& row : verify_seconds) {
    if (static_cast<int>(row.size()) != max_draft + 1) {
      return FieldError(
          "verify_seconds",
          absl::StrCat("rows must hold max_draft + 1 = ", max_draft + 1,
                       " values, got ", row.size()));
    }
    for (double v : row) {
      if (!finite(v) || v <= 0)
        return FieldError("verify_seconds", "must hold positive numbers");
    }
  }
  return absl::OkStatus();
}

absl::Status LatencyProfile::CheckMatches(const std::string& fingerprint,
                                          const std::string& device_name,
                                          const std::string& dtype_name,
                                          int num_threads) const {
  if (fingerprint == model_fingerprint && device_name == device &&
      dtype_name == dtype && num_threads == threads) {
    return absl::OkStatus();
  }
  std::vector<std::string> differences;
  if (fingerprint != model_fingerprint) differences.push_back("model");
  if (device_name != device) differences.push_back("device");
  if (dtype_name != dtype) differences.push_back("dtype");
  if (num_threads != threads) differences.push_back("threads");
  return absl::FailedPreconditionError(absl::StrCat(
      "latency profile", source.empty() ? "" : absl::StrCat(" ", source),
      " does not match this engine (", absl::StrJoin(differences, ", "),
      " differ): profile is {model ", model_fingerprint, ", device ", device,
      ", dtype ", dtype, ", threads ", threads, "}, engine is {model ",
      fingerprint, ", device ", device_name, ", dtype ", dtype_name,
      ", threads ", num_threads,
      "}; re-run `knapserve profile` for this engine"));
}

std::string LatencyProfile::ToJson() const {
  nlohmann::ordered_json json;
  json["format"] = kFormat;
  json["version"] = kVersion;
  json["model_fingerprint"] = model_fingerprint;
  json["device"] = device;
  json["dtype"] = dtype;
  json["threads"] = threads;
  json["attention"] = FitToJson(attention);
  json["mlp_seconds"] = mlp_seconds;
  json["mlp_fit"] = FitToJson(mlp_fit);
  json["step_fixed_seconds"] = step_fixed_seconds;
  json["step_overhead_seconds"] = step_overhead_seconds;
  json["step_overhead_slope"] = step_overhead_slope;
  json["draft_overhead_seconds"] = draft_overhead_seconds;
  json["draft_overhead_slope"] = draft_overhead_slope;
  json["max_draft"] = max_draft;
  json["verify_contexts"] = verify_contexts;
  json["verify_seconds"] = verify_seconds;
  json["sublayer_contexts"] = sublayer_contexts;
  json["attention_medians"] = attention_medians;
  json["mlp_medians"] = mlp_medians;
  return json.dump(2) + "\n";
}

absl::StatusOr<LatencyProfile> LatencyProfile::FromJson(
    const std::string& text, const std::string& source_name) {
  ASSIGN_OR_RETURN(const Json json, ParseJsonText(text, source_name));
  ASSIGN_OR_RETURN(LatencyProfile profile,
                   ParseProfile(JsonReader(json, source_name)));
  profile.source = source_name;
  return profile;
}

absl::Status LatencyProfile::Save(const std::string& path) const {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out)
    return absl::PermissionDeniedError(
        absl::StrCat(path, ": cannot open for writing"));
  out << ToJson();
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

absl::StatusOr<LatencyProfile> LatencyProfile::Load(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  return FromJson(text, path);
}

absl::StatusOr<LatencyProfile> ProfileModel(const LlamaModel& model,
                                            const ProfileOptions& options) {
  if (options.repeats < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("profile: repeats must be >= 1, got ", options.repeats));
  }
  if (options.warmup < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("profile: warmup must be >= 0, got ", options.warmup));
  }
  if (options.max_draft < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "profile: max_draft must be >= 1, got ", options.max_draft));
  }
  if (!(options.point_budget_seconds >= 0) || options.min_repeats < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "profile: point_budget_seconds must be >= 0 and min_repeats >= 1, got ",
        options.point_budget_seconds, " and ", options.min_repeats));
  }
  const int64_t max_tokens = options.max_draft + 1;
  std::set<int64_t> usable;
  for (int64_t n : options.contexts) {
    if (n >= 0 && n + max_tokens <= model.max_context()) usable.insert(n);
  }
  if (usable.size() < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "profile: needs at least two distinct context lengths n with n + ",
        max_tokens, " <= max_context ", model.max_context(), "; got {",
        absl::StrJoin(options.contexts, ", "), "}"));
  }
  const std::vector<int64_t> contexts(usable.begin(), usable.end());

  LatencyProfile profile;
  profile.model_fingerprint = model.config().Fingerprint();
  profile.device = model.device().str();
  profile.dtype = DtypeName(model.dtype());
  profile.threads = at::get_num_threads();
  profile.max_draft = options.max_draft;
  profile.verify_contexts = contexts;
  profile.sublayer_contexts = contexts;

  const bool cuda = model.device().is_cuda();
  const int warmup = options.warmup;
  const int repeats = options.repeats;
  try {
    c10::InferenceMode guard;
    torch::manual_seed(options.seed);
    const int num_layers = model.num_layers();
    // One K/V store, large enough for the longest context plus a verify pass,
    // with random contents (timings do not depend on them).
    std::vector<LayerKv> kv = model.AllocateKv(contexts.back() + max_tokens);
    for (LayerKv& layer : kv) {
      layer.k.normal_(0, 1);
      layer.v.normal_(0, 1);
    }
    torch::Tensor sink;  // keeps results alive so nothing is optimized away
    torch::Tensor one_id =
        torch::zeros({1}, torch::TensorOptions().dtype(torch::kInt64));
    auto sync = [cuda] {
      if (cuda) torch::cuda::synchronize();
    };
    auto now = [] { return std::chrono::steady_clock::now(); };
    auto seconds = [](auto a, auto b) {
      return std::chrono::duration<double>(b - a).count();
    };

    // One context's medians: the sublayers inside a real step and the
    // verify row.
    struct Point {
      double attention = 0, mlp = 0, fixed = 0;
      std::vector<double> verify;
    };
    auto measure = [&](int64_t n) -> absl::StatusOr<Point> {
      // Sublayer costs inside a real decode step: one token through every
      // layer, each sublayer timed on its own, so weights and K/V stream as
      // they do when decoding (timing one layer over and over keeps its
      // weights in cache and underestimates). Per rep: the mean over layers.
      std::vector<double> attention, mlp, fixed;
      RETURN_IF_ERROR(RunPoint(
          options, warmup, repeats,
          [&] {
            attention.clear();
            mlp.clear();
            fixed.clear();
          },
          [&](bool timed) -> absl::StatusOr<bool> {
            sync();
            auto t0 = now();
            torch::Tensor h = model.Embed(one_id);
            sync();
            double embed = seconds(t0, now());
            double attention_sum = 0, mlp_sum = 0;
            for (int layer = 0; layer < num_layers; ++layer) {
              auto a = now();
              h = model.Attention(layer, h, n, kv[layer]);
              sync();
              auto b = now();
              h = model.Mlp(layer, h);
              sync();
              auto c = now();
              attention_sum += seconds(a, b);
              mlp_sum += seconds(b, c);
            }
            auto l0 = now();
            sink = model.Logits(h);
            sync();
            const double logits = seconds(l0, now());
            if (timed) {
              attention.push_back(attention_sum / num_layers);
              mlp.push_back(mlp_sum / num_layers);
              fixed.push_back(embed + logits);
            }
            return false;  // one pass: RunPoint's own check before it
          }));
      Point point{Median(attention), Median(mlp), Median(fixed), {}};
      // The verify row: the full model's pass over t = 1..max_tokens tokens
      // as the engine runs it (ForwardBatch, one sequence, logits for every
      // row as verification takes them; on the CPU its row-wise path has
      // kernels of its own, 5-13% faster for one token than Forward). The
      // token counts take turns within each run, in alternating order, so
      // that the machine's drift (a shared VM's speed moves by a quarter
      // within minutes) hits them alike: timed one count after another, the
      // 5-token pass measured 1.5x to 2.9x the 1-token one in profiles of
      // one model, where interleaved it is 1.8x.
      std::vector<int32_t> ids;  // a pass over t tokens takes the first t
      for (int64_t i = 0; i < max_tokens; ++i) {
        ids.push_back(
            static_cast<int32_t>((i * 7919 + 1) % model.config().vocab_size));
      }
      std::vector<std::vector<double>> times(static_cast<size_t>(max_tokens));
      int64_t round = 0;
      RETURN_IF_ERROR(RunPoint(
          options, warmup, repeats,
          [&] {
            for (std::vector<double>& t : times) t.clear();
          },
          [&](bool timed) -> absl::StatusOr<bool> {
            for (int64_t k = 0; k < max_tokens; ++k) {
              // A request may be waiting between two passes (RunPoint asked
              // before the first).
              if (k > 0 && options.before_run) {
                ASSIGN_OR_RETURN(const bool waited, options.before_run());
                if (waited) return true;
              }
              const size_t t =
                  static_cast<size_t>(round % 2 == 0 ? k : max_tokens - 1 - k);
              BatchSequence pass;
              pass.tokens = absl::MakeConstSpan(ids.data(), t + 1);
              pass.start_pos = n;
              pass.kv = &kv;
              pass.num_logits = -1;
              sync();
              const auto start = now();
              sink = model.ForwardBatch({pass})[0];
              sync();
              if (timed) times[t].push_back(seconds(start, now()));
            }
            ++round;
            return false;
          }));
      for (std::vector<double>& t : times) {
        point.verify.push_back(Median(std::move(t)));
      }
      return point;
    };
    // Two sweeps, up the contexts and back down, keeping each figure's
    // smaller median: interference (another process, a cold start) only
    // ever makes a run slower, and a disturbance that hits one context in
    // one sweep (the first point measured, typically) misses it in the
    // other.
    std::vector<Point> points(contexts.size());
    for (int sweep = 0; sweep < 2; ++sweep) {
      for (size_t k = 0; k < contexts.size(); ++k) {
        const size_t c = sweep == 0 ? k : contexts.size() - 1 - k;
        ASSIGN_OR_RETURN(Point point, measure(contexts[c]));
        if (sweep == 0) {
          points[c] = std::move(point);
          continue;
        }
        Point& kept = points[c];
        kept.attention = std::min(kept.attention, point.attention);
        kept.mlp = std::min(kept.mlp, point.mlp);
        kept.fixed = std::min(kept.fixed, point.fixed);
        for (size_t t = 0; t < kept.verify.size(); ++t)
          kept.verify[t] = std::min(kept.verify[t], point.verify[t]);
      }
    }
    std::vector<double> xs;
    std::vector<double> fixed_medians;
    for (size_t c = 0; c < contexts.size(); ++c) {
      xs.push_back(static_cast<double>(contexts[c]));
      profile.attention_medians.push_back(points[c].attention);
      profile.mlp_medians.push_back(points[c].mlp);
      fixed_medians.push_back(points[c].fixed);
      profile.verify_seconds.push_back(std::move(points[c].verify));
    }
    profile.step_fixed_seconds = Median(fixed_medians);
    ASSIGN_OR_RETURN(profile.attention, FitLine(xs, profile.attention_medians));
    if (profile.attention.b < 0) {
      // Attention cannot get cheaper with more context: a negative slope is
      // timing noise (tiny models, busy machines). Fall back to the mean.
      double sum = 0;
      for (double v : profile.attention_medians) sum += v;
      profile.attention.a =
          sum / static_cast<double>(profile.attention_medians.size());
      profile.attention.b = 0;
    }
    ASSIGN_OR_RETURN(profile.mlp_fit, FitLine(xs, profile.mlp_medians));
    double sum = 0;
    for (double v : profile.mlp_medians) sum += v;
    profile.mlp_seconds = sum / static_cast<double>(profile.mlp_medians.size());
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("profile: torch error: ", e.what_without_backtrace()));
  }
  if (options.measure_overhead) {
    ASSIGN_OR_RETURN(const StepOverhead overhead,
                     options.measure_overhead(profile, options.before_run));
    auto usable = [](double v) { return std::isfinite(v) && v >= 0; };
    if (!usable(overhead.step_seconds) || !usable(overhead.step_slope) ||
        !usable(overhead.draft_seconds) || !usable(overhead.draft_slope)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "profile: the measured step overhead must be non-negative, got ",
          overhead.step_seconds, " s + ", overhead.step_slope,
          " s/position per step and ", overhead.draft_seconds, " s + ",
          overhead.draft_slope, " s/position per draft token"));
    }
    profile.step_overhead_seconds = overhead.step_seconds;
    profile.step_overhead_slope = overhead.step_slope;
    profile.draft_overhead_seconds = overhead.draft_seconds;
    profile.draft_overhead_slope = overhead.draft_slope;
  }
  RETURN_IF_ERROR(
      Annotate(profile.Validate(), "profile: measured values are unusable"));
  return profile;
}

}  // namespace knapserve
