// `knapserve bench step-cost`: what the speculation steps cost on this
// machine, measured directly with LlamaModel::Forward on a KV cache holding
// --context-length positions (median of --step-repeats runs after 3 warm-up
// runs each).
//
// 1. Draft step: one token through the model with k of 2L sublayers kept
//    (whole layers skipped, spread evenly; and all attention or all MLP
//    sublayers skipped), relative to a full one-token step. The naive model
//    says k/2L; the bytes model says (bytes the kept sublayers read, K/V
//    included, + embedding row, final norm and LM head) / (all bytes), which
//    is what a memory-bound step should follow. Both are printed.
// 2. Verification: one forward over gamma+1 tokens (all logits, as the
//    verifier runs it) relative to gamma+1 one-token steps, gamma = 1..10.
//
// These are the inputs of the KnapSpec latency model (DESIGN.md section 1).
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <iostream>

#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/layer_mask.h"
#include "common/status.h"
#include "tools/bench_util.h"
#include "tools/cli_flags.h"
#include "tools/commands.h"

namespace knapserve {
namespace {

constexpr int kWarmup = 3;
constexpr int kMaxGamma = 10;

// A mask skipping `skip` whole layers out of L, spread evenly (Bresenham), so
// early and late layers are skipped alike.
LayerMask SkipWholeLayers(int num_layers, int skip) {
  LayerMask mask(num_layers);
  for (int i = 0; i < num_layers; ++i) {
    const int64_t before = static_cast<int64_t>(i) * skip / num_layers;
    const int64_t after = static_cast<int64_t>(i + 1) * skip / num_layers;
    if (after > before) {
      mask.set_skipped(2 * i, true);
      mask.set_skipped(2 * i + 1, true);
    }
  }
  return mask;
}

// Bytes one decode step reads per sublayer kind, from the config (the same
// layout LlamaModel loads), at `context` positions of K/V.
struct StepBytes {
  double attention = 0;  // one attention sublayer: norm, qkv, o, K/V of the context
  double mlp = 0;        // one MLP sublayer: norm, gate/up, down
  double rest = 0;       // embedding row, final norm, LM head
  double Of(const LayerMask& mask) const {
    double total = rest;
    for (int i = 0; i < mask.num_layers(); ++i) {
      if (!mask.skip_attention(i)) total += attention;
      if (!mask.skip_mlp(i)) total += mlp;
    }
    return total;
  }
};

StepBytes EstimateStepBytes(const LlamaModel& model, int64_t context) {
  const ModelConfig& c = model.config();
  const double e = static_cast<double>(torch::elementSize(model.dtype()));
  const double d = static_cast<double>(c.hidden_size);
  const double q = static_cast<double>(c.num_attention_heads * c.head_dim);
  const double kv = static_cast<double>(c.num_key_value_heads * c.head_dim);
  const double m = static_cast<double>(c.intermediate_size);
  StepBytes bytes;
  bytes.attention = e * (d + d * (q + 2 * kv) + q * d + (c.attention_bias ? q + 2 * kv : 0) +
                         (c.qk_norm ? 2.0 * c.head_dim : 0) + 2 * kv * context);
  bytes.mlp = e * (d + 3 * d * m);
  const double layers = static_cast<double>(c.num_hidden_layers) * (bytes.attention + bytes.mlp) -
                        static_cast<double>(c.num_hidden_layers) * e * 2 * kv * context;
  bytes.rest = std::max(0.0, static_cast<double>(model.weight_bytes_per_token()) - layers);
  return bytes;
}

absl::Status BenchStepCost() {
  ASSIGN_OR_RETURN(Engine engine, LoadEngineFromFlags());
  const LlamaModel& model = *engine.model;
  const bool json = absl::GetFlag(FLAGS_json);
  const int repeats = std::max(1, absl::GetFlag(FLAGS_step_repeats));
  const int num_layers = model.num_layers();
  const int64_t room = model.max_context() - (kMaxGamma + 1);
  if (room < 1) return absl::InvalidArgumentError("model: context too short for step-cost");
  const int64_t context = std::clamp<int64_t>(absl::GetFlag(FLAGS_context_length), 1, room);
  if (absl::GetFlag(FLAGS_context_length) < 1) {
    return absl::InvalidArgumentError("context_length: must be >= 1");
  }

  c10::InferenceMode guard;
  std::vector<LayerKv> kv = model.AllocateKv(context + kMaxGamma + 1);
  // Fill the cache with a deterministic token sequence.
  const int64_t vocab = model.config().vocab_size;
  torch::Tensor prefix = torch::arange(context, torch::kInt64).mul_(7919).remainder_(vocab);
  model.Prefill(prefix, 0, kv);
  torch::Tensor one = torch::tensor({int64_t{1} % vocab}, torch::kInt64);

  // Every measurement is a case; the cases are timed round-robin (case 0,
  // 1, ..., then again) so that drift in machine speed hits them alike.
  std::vector<std::function<void()>> cases;
  auto add_step_case = [&](const LayerMask* skip) {
    cases.push_back([&model, &kv, one, context, skip] {
      ForwardOptions options;
      options.skip = skip;
      options.num_logits = 1;
      torch::Tensor logits = model.Forward(one, context, kv, options);
      volatile int64_t sink = logits.argmax(-1)[0].item<int64_t>();
      (void)sink;
    });
    return cases.size() - 1;
  };
  auto add_verify_case = [&](int64_t tokens) {
    torch::Tensor ids = torch::arange(tokens, torch::kInt64).add_(3).remainder_(vocab);
    cases.push_back([&model, &kv, ids, context] {
      torch::Tensor logits = model.Forward(ids, context, kv, -1);
      volatile int64_t sink = logits.argmax(-1)[0].item<int64_t>();
      (void)sink;
    });
    return cases.size() - 1;
  };

  struct Row {
    std::string label;
    LayerMask mask;
    size_t case_index = 0;
  };
  std::vector<Row> masks;
  for (int keep_percent : {100, 75, 50, 25}) {
    const int skip = num_layers - (num_layers * keep_percent + 50) / 100;
    masks.push_back({absl::StrCat("keep ", keep_percent, "% (whole layers)"),
                     SkipWholeLayers(num_layers, skip)});
  }
  {
    LayerMask attention(num_layers), mlp(num_layers);
    for (int i = 0; i < num_layers; ++i) {
      attention.set_skipped(2 * i, true);
      mlp.set_skipped(2 * i + 1, true);
    }
    masks.push_back({"all attention skipped", attention});
    masks.push_back({"all MLP skipped", mlp});
  }
  const size_t full_case = add_step_case(nullptr);
  for (Row& row : masks) row.case_index = add_step_case(&row.mask);
  std::vector<size_t> verify_cases;  // [0]: one token with all logits; [g]: g+1 tokens
  for (int gamma = 0; gamma <= kMaxGamma; ++gamma) verify_cases.push_back(add_verify_case(gamma + 1));

  std::vector<std::vector<double>> samples(cases.size());
  for (int w = 0; w < kWarmup; ++w) {
    for (auto& fn : cases) fn();
  }
  for (int r = 0; r < repeats; ++r) {
    for (size_t c = 0; c < cases.size(); ++c) {
      const auto t0 = std::chrono::steady_clock::now();
      cases[c]();
      samples[c].push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  std::vector<double> seconds;
  for (auto& s : samples) seconds.push_back(Median(s));

  // 1. Draft steps.
  const double full = seconds[full_case];
  const StepBytes bytes = EstimateStepBytes(model, context);
  const double all_bytes = bytes.Of(LayerMask(num_layers));
  nlohmann::json draft_rows = nlohmann::json::array();
  FILE* out = json ? stderr : stdout;
  std::fprintf(out,
               "model %s (%s, %d threads), %d layers = %d sublayers, context %lld, median of %d "
               "after %d warm-up, cases interleaved\nfull decode step: %.3f ms\n\n",
               engine.model_dir.c_str(), DtypeName(model.dtype()).c_str(), at::get_num_threads(),
               num_layers, 2 * num_layers, static_cast<long long>(context), repeats, kWarmup,
               1e3 * full);
  std::fprintf(out, "%-26s %5s %9s %9s %7s %11s\n", "draft step", "kept", "ms", "measured",
               "k/2L", "bytes model");
  for (const Row& row : masks) {
    const double t = seconds[row.case_index];
    const int kept = row.mask.num_kept();
    const double naive = static_cast<double>(kept) / (2.0 * num_layers);
    const double by_bytes = all_bytes > 0 ? bytes.Of(row.mask) / all_bytes : 0.0;
    draft_rows.push_back({{"label", row.label},
                          {"mask", row.mask.ToString()},
                          {"kept_sublayers", kept},
                          {"seconds", t},
                          {"ratio", t / full},
                          {"kept_fraction", naive},
                          {"bytes_ratio", by_bytes}});
    std::fprintf(out, "%-26s %2d/%-2d %9.3f %9.3f %7.3f %11.3f\n", row.label.c_str(), kept,
                 2 * num_layers, 1e3 * t, t / full, naive, by_bytes);
  }

  // 2. Verification of gamma+1 tokens against gamma+1 single steps.
  const double single = seconds[verify_cases[0]];
  nlohmann::json verify_rows = nlohmann::json::array();
  std::fprintf(out, "\n%-6s %7s %9s %14s %12s\n", "gamma", "tokens", "ms", "vs (g+1) steps",
               "vs 1 step");
  for (int gamma = 1; gamma <= kMaxGamma; ++gamma) {
    const double t = seconds[verify_cases[gamma]];
    const double ratio = t / ((gamma + 1) * single);
    verify_rows.push_back({{"gamma", gamma},
                           {"tokens", gamma + 1},
                           {"seconds", t},
                           {"ratio_vs_steps", ratio},
                           {"ratio_vs_one_step", t / single}});
    std::fprintf(out, "%-6d %7d %9.3f %14.3f %12.3f\n", gamma, gamma + 1, 1e3 * t, ratio,
                 t / single);
  }
  std::fflush(out);
  if (json) {
    nlohmann::json summary = {{"model", engine.model_dir},
                              {"dtype", DtypeName(model.dtype())},
                              {"threads", at::get_num_threads()},
                              {"num_layers", num_layers},
                              {"context_length", context},
                              {"repeats", repeats},
                              {"full_step_seconds", full},
                              {"single_step_all_logits_seconds", single},
                              {"draft", draft_rows},
                              {"verify", verify_rows}};
    std::cout << summary.dump(2) << std::endl;
  }
  return absl::OkStatus();
}

}  // namespace

int RunBenchStepCost() { return ExitCode(BenchStepCost(), "bench step-cost"); }

}  // namespace knapserve
