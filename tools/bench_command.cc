// `knapserve bench ar`: prefill and decode speed of plain autoregressive
// decoding over a prompt set, and the decode rate as a fraction of the
// machine's measured memory bandwidth.
//
// Decode at batch 1 is memory-bound: every token reads all weights once plus
// the K/V of the context. bytes/token x tokens/s over the bandwidth a plain
// copy reaches on this machine (bytes copied per second, as memcpy
// benchmarks report it) says how close the engine runs to the limit; the
// share of pure read bandwidth is printed beside it.
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>

#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/shared_data.h"
#include "common/status.h"
#include "tools/cli_flags.h"
#include "tools/commands.h"
#include "tools/prompt_set.h"

namespace knapserve {
namespace {

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Memory bandwidth of this machine with torch's current threads, best of
// five passes over 512 MiB buffers (far larger than any cache here).
struct Bandwidth {
  double copy = 0;  // bytes copied per second (memcpy's convention: each byte once)
  double read = 0;  // bytes read per second by a reduction
};

Bandwidth MeasureBandwidth() {
  c10::InferenceMode guard;
  const int64_t bytes = int64_t{512} << 20;
  torch::Tensor src = torch::ones({bytes / 4}, torch::kFloat32);
  torch::Tensor dst = torch::empty_like(src);
  dst.copy_(src);  // fault the pages in
  Bandwidth best;
  for (int i = 0; i < 5; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    dst.copy_(src);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best.copy = std::max(best.copy, static_cast<double>(bytes) / s);
    t0 = std::chrono::steady_clock::now();
    volatile float sink = src.sum().item<float>();
    (void)sink;
    s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best.read = std::max(best.read, static_cast<double>(bytes) / s);
  }
  return best;
}

// Prompt text repeated until it has at least `min_tokens` tokens.
absl::StatusOr<std::vector<int32_t>> PromptIds(const Tokenizer& tokenizer, const std::string& text,
                                               int64_t min_tokens) {
  std::string repeated = text;
  while (true) {
    ASSIGN_OR_RETURN(std::vector<int32_t> ids, tokenizer.Encode(repeated, true));
    if (static_cast<int64_t>(ids.size()) >= min_tokens) return ids;
    repeated += "\n\n" + text;
  }
}

absl::Status BenchAr() {
  ASSIGN_OR_RETURN(Engine engine, LoadEngineFromFlags());
  const LlamaModel& model = *engine.model;
  std::string path = absl::GetFlag(FLAGS_prompts);
  if (path.empty()) path = SharedPath("bench/spec_bench/question.jsonl");
  ASSIGN_OR_RETURN(std::vector<BenchPrompt> prompts,
                   LoadPromptSet(path, absl::GetFlag(FLAGS_num_prompts)));
  const int repeats = std::max(1, absl::GetFlag(FLAGS_repeats));
  const Bandwidth bandwidth = MeasureBandwidth();
  const ModelConfig& c = model.config();
  const double kv_bytes_per_position = 2.0 * static_cast<double>(
      c.num_hidden_layers * c.num_key_value_heads * c.head_dim *
      static_cast<int64_t>(torch::elementSize(model.dtype())));

  std::vector<double> prefill_rates, decode_rates, fractions;
  nlohmann::json rows = nlohmann::json::array();
  const bool json = absl::GetFlag(FLAGS_json);
  if (!json) {
    std::printf("%-16s %7s %7s %12s %12s %9s\n", "category", "prompt", "new", "prefill tok/s",
                "decode tok/s", "of bw");
  }
  for (const BenchPrompt& prompt : prompts) {
    ASSIGN_OR_RETURN(std::vector<int32_t> ids,
                     PromptIds(*engine.tokenizer, prompt.text, absl::GetFlag(FLAGS_min_prompt_tokens)));
    // Leave room for the generation inside the context.
    const int64_t max_prompt = model.max_context() - absl::GetFlag(FLAGS_max_new_tokens) - 1;
    if (max_prompt < 1) return absl::InvalidArgumentError("--max_new_tokens exceeds the context");
    if (static_cast<int64_t>(ids.size()) > max_prompt) ids.resize(max_prompt);
    ASSIGN_OR_RETURN(GenerationRequest request, GenerationRequestFromFlags(ids));
    request.ignore_eos = true;  // fixed-length runs
    std::vector<double> prefill, decode;
    int64_t generated = 0;
    for (int r = 0; r < repeats; ++r) {
      ASSIGN_OR_RETURN(GenerationResult result, Generate(model, *engine.tokenizer, request));
      prefill.push_back(result.stats.prefill_tokens_per_second());
      decode.push_back(result.stats.decode_tokens_per_second());
      generated = result.stats.completion_tokens;
    }
    const double decode_rate = Median(decode);
    const double mean_context = static_cast<double>(ids.size()) + 0.5 * static_cast<double>(generated);
    const double bytes_per_token =
        static_cast<double>(model.weight_bytes_per_token()) + kv_bytes_per_position * mean_context;
    const double fraction = bytes_per_token * decode_rate / bandwidth.copy;
    prefill_rates.push_back(Median(prefill));
    decode_rates.push_back(decode_rate);
    fractions.push_back(fraction);
    rows.push_back({{"category", prompt.category},
                    {"question_id", prompt.question_id},
                    {"prompt_tokens", ids.size()},
                    {"new_tokens", generated},
                    {"prefill_tokens_per_s", Median(prefill)},
                    {"decode_tokens_per_s", decode_rate},
                    {"bytes_per_token", bytes_per_token},
                    {"bandwidth_fraction", fraction}});
    if (!json) {
      std::printf("%-16s %7zu %7lld %12.1f %12.1f %8.1f%%\n", prompt.category.c_str(), ids.size(),
                  static_cast<long long>(generated), Median(prefill), decode_rate, 100 * fraction);
    }
  }
  nlohmann::json summary = {
      {"model", engine.model_dir},
      {"dtype", DtypeName(model.dtype())},
      {"threads", at::get_num_threads()},
      {"weight_bytes_per_token", model.weight_bytes_per_token()},
      {"copy_bandwidth_bytes_per_s", bandwidth.copy},
      {"read_bandwidth_bytes_per_s", bandwidth.read},
      {"decode_bytes_per_s", Median(fractions) * bandwidth.copy},
      {"prefill_tokens_per_s", Median(prefill_rates)},
      {"decode_tokens_per_s", Median(decode_rates)},
      {"bandwidth_fraction", Median(fractions)},
      {"prompts", rows}};
  if (json) {
    std::cout << summary.dump(2) << std::endl;
  } else {
    std::printf(
        "\nmodel %s (%s, %d threads): weights %.1f MB/token\n"
        "memory: copy %.2f GB/s (bytes copied/s), read %.2f GB/s\n"
        "median prefill %.1f tok/s, median decode %.1f tok/s = %.2f GB/s = %.1f%% of copy "
        "bandwidth (%.1f%% of read bandwidth)\n",
        engine.model_dir.c_str(), DtypeName(model.dtype()).c_str(), at::get_num_threads(),
        model.weight_bytes_per_token() / 1e6, bandwidth.copy / 1e9, bandwidth.read / 1e9,
        Median(prefill_rates), Median(decode_rates), Median(fractions) * bandwidth.copy / 1e9,
        100 * Median(fractions), 100 * Median(fractions) * bandwidth.copy / bandwidth.read);
  }
  return absl::OkStatus();
}

}  // namespace

int RunBench(const std::vector<std::string>& args) {
  if (args.empty() || args[0] != "ar") {
    std::cerr << "usage: knapserve bench ar [--model DIR] [--dtype bf16] [--num_prompts N] "
                 "[--max_new_tokens N] [--min_prompt_tokens N] [--json]"
              << std::endl;
    return 2;
  }
  return ExitCode(BenchAr(), "bench ar");
}

}  // namespace knapserve
