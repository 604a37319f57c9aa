// `knapserve bench step-cost`: what the speculation steps cost on this
// machine, measured directly with the engine's pass (LlamaModel::ForwardBatch,
// one sequence) on a KV cache holding --context-length positions (median of
// --step-repeats runs after 3 warm-up runs each, the cases taking turns).
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
// 3. The machine's limits beside them (a roofline): the time to read the
//    model's weight bytes once (measured by streaming a buffer of exactly
//    that size, warm, with the same threads: if the weights fit the
//    last-level cache this is cache bandwidth, else memory bandwidth), and
//    the time to do a k-token pass's arithmetic at the measured peak of the
//    packed projection kernel (a cache-resident 12-row problem). A pass can
//    be no faster than the larger of the two.
//
// These are the inputs of the KnapSpec latency model.
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/model/layer_mask.h"
#include "common/model/linear.h"
#include "common/model/simd_target.h"
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
  double attention =
      0;            // one attention sublayer: norm, qkv, o, K/V of the context
  double mlp = 0;   // one MLP sublayer: norm, gate/up, down
  double rest = 0;  // embedding row, final norm, LM head
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
  bytes.attention =
      e * (d + d * (q + 2 * kv) + q * d + (c.attention_bias ? q + 2 * kv : 0) +
           (c.qk_norm ? 2.0 * c.head_dim : 0) + 2 * kv * context);
  bytes.mlp = e * (d + 3 * d * m);
  const double layers =
      static_cast<double>(c.num_hidden_layers) * (bytes.attention + bytes.mlp) -
      static_cast<double>(c.num_hidden_layers) * e * 2 * kv * context;
  bytes.rest = std::max(
      0.0, static_cast<double>(model.weight_bytes_per_token()) - layers);
  return bytes;
}

// Multiply-adds of one token's forward pass at `context` positions: every
// projection (weights / element size) plus attention's two products.
double FlopsPerToken(const LlamaModel& model, int64_t context) {
  const ModelConfig& c = model.config();
  const double params = static_cast<double>(model.weight_bytes_per_token()) /
                        static_cast<double>(torch::elementSize(model.dtype()));
  const double attention = 2.0 * c.num_attention_heads * c.head_dim *
                           static_cast<double>(context) * c.num_hidden_layers;
  return 2.0 * (params + attention);
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) double SumFloats(const float* p, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + i + 48));
  }
  // Lanes summed by hand: GCC 12 warns inside _mm512_reduce_add_ps.
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes,
                  _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  double s = 0;
  for (float lane : lanes) s += lane;
  for (; i < n; ++i) s += p[i];
  return s;
}
#endif

// Seconds to read `bytes` once with torch's threads, from a buffer of that
// size read over and over (so it sits in whatever cache level it fits).
double ReadSeconds(int64_t bytes, int repeats) {
  const int64_t n = std::max<int64_t>(1024, bytes / 4);
  std::vector<float> buffer(n, 1.0f);
  volatile double sink = 0;
  auto read = [&] {
    const int64_t threads = std::max(1, at::get_num_threads());
    std::vector<double> partial(threads, 0.0);
    at::parallel_for(0, n, (n + threads - 1) / threads,
                     [&](int64_t b, int64_t e) {
                       double s = 0;
#if defined(__x86_64__)
                       if (__builtin_cpu_supports("avx512f")) {
                         s = SumFloats(buffer.data() + b, e - b);
                       } else
#endif
                       {
                         for (int64_t i = b; i < e; ++i) s += buffer[i];
                       }
                       partial[at::get_thread_num()] += s;
                     });
    for (double p : partial) sink = sink + p;
  };
  return MedianSeconds(read, 3, std::max(5, repeats));
}

// Peak multiply-add rate of the packed projection kernel in FLOP/s (2 per
// multiply-add), on a 12-row problem small enough to stay in cache; 0 where
// the packed kernel does not run.
double KernelPeakFlops(torch::ScalarType dtype, int repeats) {
  if (!FastLinearSupported(dtype)) return 0;
  const int64_t m = 12, n = 256, k = 256;
  const LinearWeight w(torch::ones({n, k}).to(dtype));
  const torch::Tensor x = torch::ones({m, k}).to(dtype);
  const int kInner = 200;
  const double seconds = MedianSeconds(
      [&] {
        for (int i = 0; i < kInner; ++i) LinearFloatOut(x, w);
      },
      2, std::max(5, repeats));
  return 2.0 * m * n * k * kInner / seconds;
}

absl::Status BenchStepCost() {
  ASSIGN_OR_RETURN(Engine engine, LoadEngineFromFlags());
  const LlamaModel& model = *engine.model;
  const bool json = absl::GetFlag(FLAGS_json);
  const int repeats = std::max(1, absl::GetFlag(FLAGS_step_repeats));
  const int num_layers = model.num_layers();
  const int64_t room = model.max_context() - (kMaxGamma + 1);
  if (room < 1)
    return absl::InvalidArgumentError("model: context too short for step-cost");
  const int64_t context =
      std::clamp<int64_t>(absl::GetFlag(FLAGS_context_length), 1, room);
  if (absl::GetFlag(FLAGS_context_length) < 1) {
    return absl::InvalidArgumentError("context_length: must be >= 1");
  }

  c10::InferenceMode guard;
  std::vector<LayerKv> kv = model.AllocateKv(context + kMaxGamma + 1);
  // Fill the cache with a deterministic token sequence.
  const int64_t vocab = model.config().vocab_size;
  torch::Tensor prefix =
      torch::arange(context, torch::kInt64).mul_(7919).remainder_(vocab);
  model.Prefill(prefix, 0, kv);

  // Every measurement is a case; the cases are timed round-robin (case 0,
  // 1, ..., then again) so that drift in machine speed hits them alike.
  std::vector<std::function<void()>> cases;
  // Each case is one pass as the engine runs it (ForwardBatch with one
  // sequence): on the CPU its row-wise path has kernels of its own for
  // few-token passes.
  auto add_pass_case = [&](std::vector<int32_t> ids, const LayerMask* skip,
                           int64_t num_logits) {
    cases.push_back(
        [&model, &kv, ids = std::move(ids), context, skip, num_logits] {
          BatchSequence pass;
          pass.tokens = absl::MakeConstSpan(ids);
          pass.start_pos = context;
          pass.kv = &kv;
          pass.skip = skip;
          pass.num_logits = num_logits;
          torch::Tensor logits = model.ForwardBatch({pass})[0];
          volatile int64_t sink = logits.argmax(-1)[0].item<int64_t>();
          (void)sink;
        });
    return cases.size() - 1;
  };
  auto add_step_case = [&](const LayerMask* skip) {
    return add_pass_case({static_cast<int32_t>(1 % vocab)}, skip, 1);
  };
  auto add_verify_case = [&](int64_t tokens) {
    std::vector<int32_t> ids(static_cast<size_t>(tokens));
    for (int64_t i = 0; i < tokens; ++i)
      ids[static_cast<size_t>(i)] = static_cast<int32_t>((i + 3) % vocab);
    return add_pass_case(std::move(ids), nullptr, -1);
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
  std::vector<size_t>
      verify_cases;  // [0]: one token with all logits; [g]: g+1 tokens
  for (int gamma = 0; gamma <= kMaxGamma; ++gamma)
    verify_cases.push_back(add_verify_case(gamma + 1));

  std::vector<std::vector<double>> samples(cases.size());
  for (int w = 0; w < kWarmup; ++w) {
    for (auto& fn : cases) fn();
  }
  for (int r = 0; r < repeats; ++r) {
    for (size_t c = 0; c < cases.size(); ++c) {
      const auto t0 = std::chrono::steady_clock::now();
      cases[c]();
      samples[c].push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
              .count());
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
  std::fprintf(
      out,
      "model %s (%s, %d threads, simd %s), %d layers = %d sublayers, context "
      "%lld, "
      "median of %d "
      "after %d warm-up, cases interleaved\nfull decode step: %.3f ms\n\n",
      engine.model_dir.c_str(), DtypeName(model.dtype()).c_str(),
      at::get_num_threads(), simd::CurrentTarget().c_str(), num_layers,
      2 * num_layers, static_cast<long long>(context), repeats, kWarmup,
      1e3 * full);
  std::fprintf(out, "%-26s %5s %9s %9s %7s %11s\n", "draft step", "kept", "ms",
               "measured", "k/2L", "bytes model");
  for (const Row& row : masks) {
    const double t = seconds[row.case_index];
    const int kept = row.mask.num_kept();
    const double naive = static_cast<double>(kept) / (2.0 * num_layers);
    const double by_bytes =
        all_bytes > 0 ? bytes.Of(row.mask) / all_bytes : 0.0;
    draft_rows.push_back({{"label", row.label},
                          {"mask", row.mask.ToString()},
                          {"kept_sublayers", kept},
                          {"seconds", t},
                          {"ratio", t / full},
                          {"kept_fraction", naive},
                          {"bytes_ratio", by_bytes}});
    std::fprintf(out, "%-26s %2d/%-2d %9.3f %9.3f %7.3f %11.3f\n",
                 row.label.c_str(), kept, 2 * num_layers, 1e3 * t, t / full,
                 naive, by_bytes);
  }

  // 2. Verification of gamma+1 tokens against gamma+1 single steps.
  const double single = seconds[verify_cases[0]];
  nlohmann::json verify_rows = nlohmann::json::array();
  std::fprintf(out, "\n%-6s %7s %9s %14s %12s\n", "gamma", "tokens", "ms",
               "vs (g+1) steps", "vs 1 step");
  for (int gamma = 1; gamma <= kMaxGamma; ++gamma) {
    const double t = seconds[verify_cases[gamma]];
    const double ratio = t / ((gamma + 1) * single);
    verify_rows.push_back({{"gamma", gamma},
                           {"tokens", gamma + 1},
                           {"seconds", t},
                           {"ratio_vs_steps", ratio},
                           {"ratio_vs_one_step", t / single}});
    std::fprintf(out, "%-6d %7d %9.3f %14.3f %12.3f\n", gamma, gamma + 1,
                 1e3 * t, ratio, t / single);
  }

  // 3. Roofline: the floor of a k-token pass is max(weight bytes / read
  //    bandwidth, k * FLOPs per token / peak).
  const double weight_bytes =
      static_cast<double>(model.weight_bytes_per_token());
  const double read_seconds =
      ReadSeconds(model.weight_bytes_per_token(), repeats);
  const double dram_seconds_per_byte =
      ReadSeconds(int64_t{512} << 20, 5) / (512.0 * (1 << 20));
  const double peak = KernelPeakFlops(model.dtype(), repeats);
  const double flops = FlopsPerToken(model, context);
  std::fprintf(
      out,
      "\nroofline: weights %.1f MB read in %.3f ms (%.1f GB/s; memory %.1f "
      "GB/s, a "
      "512 MB stream), %.1f MFLOP per token, kernel peak %.1f GFLOP/s\n",
      weight_bytes / 1e6, 1e3 * read_seconds, weight_bytes / read_seconds / 1e9,
      1e-9 / dram_seconds_per_byte, flops / 1e6, peak / 1e9);
  std::fprintf(out, "%-7s %9s %12s %12s %12s %9s\n", "tokens", "ms",
               "bytes floor", "flops floor", "floor ms", "measured/floor");
  nlohmann::json roofline_rows = nlohmann::json::array();
  for (int tokens = 1; tokens <= kMaxGamma + 1; ++tokens) {
    const double t = seconds[verify_cases[tokens - 1]];
    const double flop_seconds = peak > 0 ? tokens * flops / peak : 0.0;
    const double floor = std::max(read_seconds, flop_seconds);
    roofline_rows.push_back({{"tokens", tokens},
                             {"seconds", t},
                             {"bytes_floor_seconds", read_seconds},
                             {"flops_floor_seconds", flop_seconds},
                             {"measured_over_floor", t / floor}});
    std::fprintf(out, "%-7d %9.3f %12.3f %12.3f %12.3f %9.2f\n", tokens,
                 1e3 * t, 1e3 * read_seconds, 1e3 * flop_seconds, 1e3 * floor,
                 t / floor);
  }
  std::fflush(out);
  if (json) {
    nlohmann::json summary = {
        {"model", engine.model_dir},
        {"dtype", DtypeName(model.dtype())},
        {"threads", at::get_num_threads()},
        {"simd", simd::CurrentTarget()},
        {"num_layers", num_layers},
        {"context_length", context},
        {"repeats", repeats},
        {"full_step_seconds", full},
        {"single_step_all_logits_seconds", single},
        {"draft", draft_rows},
        {"verify", verify_rows},
        {"roofline",
         {{"weight_bytes", weight_bytes},
          {"weight_read_seconds", read_seconds},
          {"memory_read_bytes_per_second", 1.0 / dram_seconds_per_byte},
          {"flops_per_token", flops},
          {"kernel_peak_flops_per_second", peak},
          {"passes", roofline_rows}}}};
    std::cout << summary.dump(2) << std::endl;
  }
  return absl::OkStatus();
}

}  // namespace

int RunBenchStepCost() { return ExitCode(BenchStepCost(), "bench step-cost"); }

}  // namespace knapserve
