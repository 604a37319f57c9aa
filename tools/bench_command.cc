// `knapserve bench <mode>`: the benchmark dispatcher and `bench ar`.
//
// `bench ar` measures prefill and decode speed of plain autoregressive
// decoding over a prompt set, and the decode rate as a fraction of the
// machine's measured memory bandwidth. Decode at batch 1 is memory-bound:
// every token reads all weights once plus the K/V of the context.
// bytes/token x tokens/s over the bandwidth a plain copy reaches on this
// machine (bytes copied per second, as memcpy benchmarks report it) says how
// close the engine runs to the limit; the share of pure read bandwidth is
// printed beside it.
//
// `bench spec` and `bench step-cost` live in tools/bench_spec.cc and
// tools/bench_step_cost.cc, `bench serve` in tools/bench_serve.cc, `bench
// soak` in tools/bench_soak.cc.
#include <ATen/Parallel.h>

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "common/base/status.h"
#include "common/model/simd_target.h"
#include "tools/bench_util.h"
#include "tools/cli_flags.h"
#include "tools/commands.h"

namespace knapserve {
namespace {

constexpr char kBenchUsage[] =
    "usage: knapserve bench <mode> [flags]\n"
    "  ar         prefill/decode speed of autoregressive decoding and its "
    "share of memory\n"
    "             bandwidth: [--model DIR] [--dtype bf16] [--threads N] "
    "[--prompts FILE]\n"
    "             [--num-prompts N] [--max-new-tokens N] [--min-prompt-tokens "
    "N] [--repeats N]\n"
    "             [--json]\n"
    "  spec       --spec off against --spec static --skip MASK on the same "
    "prompts (greedy,\n"
    "             fixed length): decode tok/s, speedup, acceptance, "
    "draft/verify time share,\n"
    "             and a check that both give the same ids (exit 1 if not):\n"
    "             [--skip MASK] [--max-draft N] [--exit-threshold X] "
    "[--repeats N] plus the\n"
    "             flags of ar. --search-masks first finds a mask by greedy "
    "forward selection\n"
    "             on --search-prompts prompts of --search-tokens tokens, one "
    "sublayer (or\n"
    "             with --search-whole-layers one layer) per step (see "
    "--helpfull).\n"
    "  step-cost  cost of one draft step with k of 2L sublayers kept relative "
    "to a full\n"
    "             decode step (vs k/2L), and of verifying gamma+1 tokens "
    "relative to gamma+1\n"
    "             decode steps (gamma 1..10), at --context-length positions of "
    "KV cache:\n"
    "             [--model DIR] [--dtype] [--threads N] [--step-repeats N] "
    "[--json]\n"
    "  serve      concurrent gRPC streams against a server (--server ADDR, "
    "or one started\n"
    "             here with the flags of serve): tok/s, TTFT and ITL "
    "percentiles, outputs\n"
    "             checked: [--concurrency N] [--num-requests N] [--arrival "
    "closed|poisson]\n"
    "             [--request-rate R] [--burst-prompt-tokens N] [--modes "
    "off,static,...]\n"
    "  soak       a long mixed load against --server ADDR (tools/soak.sh): "
    "greedy and\n"
    "             sampling, every mode, cancels, deadlines, Aborts; checks "
    "outputs, hangs,\n"
    "             drained gauges (--metrics HOST:PORT) and memory growth "
    "(--server-pid):\n"
    "             [--soak-seconds S] [--warmup-seconds S] [--concurrency N] "
    "[--soak-seed N]";

absl::Status BenchAr() {
  ASSIGN_OR_RETURN(Engine engine, LoadEngineFromFlags());
  const LlamaModel& model = *engine.model;
  const int64_t max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  ASSIGN_OR_RETURN(
      std::vector<BenchInput> inputs,
      LoadBenchInputs(model, *engine.tokenizer,
                      absl::GetFlag(FLAGS_num_prompts), max_new_tokens));
  const int repeats = std::max(1, absl::GetFlag(FLAGS_repeats));
  const Bandwidth bandwidth = MeasureBandwidth();
  const ModelConfig& c = model.config();
  const double kv_bytes_per_position =
      2.0 * static_cast<double>(
                c.num_hidden_layers * c.num_key_value_heads * c.head_dim *
                static_cast<int64_t>(torch::elementSize(model.dtype())));

  ASSIGN_OR_RETURN(GenerationRequest request, GenerationRequestFromFlags({}));
  request.ignore_eos = true;  // fixed-length runs
  ASSIGN_OR_RETURN(
      std::vector<std::vector<PromptRun>> runs,
      RunModes(model, *engine.tokenizer, inputs, {request}, repeats,
               /*warmup=*/true));

  std::vector<double> prefill_rates, decode_rates, fractions;
  nlohmann::json rows = nlohmann::json::array();
  const bool json = absl::GetFlag(FLAGS_json);
  if (!json) {
    std::printf("%-16s %7s %7s %13s %12s %9s\n", "category", "prompt", "new",
                "prefill tok/s", "decode tok/s", "of bw");
  }
  for (size_t p = 0; p < inputs.size(); ++p) {
    const PromptRun& run = runs[0][p];
    const size_t prompt_tokens = inputs[p].ids.size();
    const double prefill_rate =
        run.prefill_seconds > 0
            ? static_cast<double>(prompt_tokens) / run.prefill_seconds
            : 0.0;
    const double decode_rate =
        run.decode_seconds > 0
            ? static_cast<double>(run.decoded_tokens) / run.decode_seconds
            : 0.0;
    const int64_t generated = static_cast<int64_t>(run.output_ids.size());
    const double mean_context = static_cast<double>(prompt_tokens) +
                                0.5 * static_cast<double>(generated);
    const double bytes_per_token =
        static_cast<double>(model.weight_bytes_per_token()) +
        kv_bytes_per_position * mean_context;
    const double fraction = bytes_per_token * decode_rate / bandwidth.copy;
    prefill_rates.push_back(prefill_rate);
    decode_rates.push_back(decode_rate);
    fractions.push_back(fraction);
    rows.push_back({{"category", inputs[p].prompt.category},
                    {"question_id", inputs[p].prompt.question_id},
                    {"prompt_tokens", prompt_tokens},
                    {"new_tokens", generated},
                    {"prefill_tokens_per_s", prefill_rate},
                    {"decode_tokens_per_s", decode_rate},
                    {"bytes_per_token", bytes_per_token},
                    {"bandwidth_fraction", fraction}});
    if (!json) {
      std::printf("%-16s %7zu %7lld %13.1f %12.1f %8.1f%%\n",
                  inputs[p].prompt.category.c_str(), prompt_tokens,
                  static_cast<long long>(generated), prefill_rate, decode_rate,
                  100 * fraction);
    }
  }
  const ModeSummary total = Summarize(runs[0]);
  nlohmann::json summary = {
      {"model", engine.model_dir},
      {"dtype", DtypeName(model.dtype())},
      {"threads", at::get_num_threads()},
      {"simd", simd::CurrentTarget()},
      {"repeats", repeats},
      {"weight_bytes_per_token", model.weight_bytes_per_token()},
      {"copy_bandwidth_bytes_per_s", bandwidth.copy},
      {"read_bandwidth_bytes_per_s", bandwidth.read},
      {"decode_bytes_per_s", Median(fractions) * bandwidth.copy},
      {"prefill_tokens_per_s", Median(prefill_rates)},
      {"decode_tokens_per_s", Median(decode_rates)},
      {"aggregate_decode_tokens_per_s", total.decode_tokens_per_second()},
      {"bandwidth_fraction", Median(fractions)},
      {"prompts", rows}};
  if (json) {
    std::cout << summary.dump(2) << std::endl;
  } else {
    std::printf(
        "\nmodel %s (%s, %d threads, simd %s): weights %.1f MB/token\n"
        "memory: copy %.2f GB/s (bytes copied/s), read %.2f GB/s\n"
        "median prefill %.1f tok/s, median decode %.1f tok/s (aggregate %.1f) "
        "= %.2f GB/s = "
        "%.1f%% of copy bandwidth (%.1f%% of read bandwidth)\n",
        engine.model_dir.c_str(), DtypeName(model.dtype()).c_str(),
        at::get_num_threads(), simd::CurrentTarget().c_str(),
        model.weight_bytes_per_token() / 1e6, bandwidth.copy / 1e9,
        bandwidth.read / 1e9, Median(prefill_rates), Median(decode_rates),
        total.decode_tokens_per_second(),
        Median(fractions) * bandwidth.copy / 1e9, 100 * Median(fractions),
        100 * Median(fractions) * bandwidth.copy / bandwidth.read);
  }
  return absl::OkStatus();
}

}  // namespace

int RunBench(const std::vector<std::string>& args) {
  const std::string mode = args.empty() ? "" : args[0];
  if (args.size() == 1 && mode == "ar") return ExitCode(BenchAr(), "bench ar");
  if (args.size() == 1 && mode == "spec") return RunBenchSpec();
  if (args.size() == 1 && mode == "step-cost") return RunBenchStepCost();
  if (args.size() == 1 && mode == "serve") return RunBenchServe();
  if (args.size() == 1 && mode == "soak") return RunBenchSoak();
  if (!mode.empty()) {
    std::cerr << "knapserve bench: unknown mode '" << mode
              << (args.size() > 1 ? "' or extra arguments" : "'") << "\n";
  }
  std::cerr << kBenchUsage << std::endl;
  return 2;
}

}  // namespace knapserve
