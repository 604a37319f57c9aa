#include "planner/thread_choice.h"

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/file_util.h"
#include "common/base/status.h"
#include "common/model/exception_status.h"
#include "common/model/llama.h"
#include "common/model/parallel_for.h"
#include "common/model/simd_target.h"
#include "nlohmann/json.hpp"
#include "planner/profile_cache.h"

namespace knapserve {
namespace {

// A count above 1 must beat fewer threads by this much to be chosen.
constexpr double kMoreThreadsMargin = 0.03;
constexpr int kRepeats = 5;
constexpr int kDecodeContext = 64;
constexpr int kDecodeSteps = 8;
constexpr int kPrefillRows = 128;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The fewest threads within the margin of the fastest.
int Fastest(const std::vector<double>& ms) {
  const double best = *std::min_element(ms.begin(), ms.end());
  for (size_t t = 0; t < ms.size(); ++t) {
    if (ms[t] <= best * (1 + kMoreThreadsMargin))
      return static_cast<int>(t + 1);
  }
  return 1;
}

std::string EntryName(const LlamaModel& model, int cores) {
  return CacheFileName(
      absl::StrCat(model.config().Fingerprint(), "_", model.device().str(), "_",
                   DtypeName(model.dtype()), "_", simd::CurrentTarget(), "_c",
                   cores, "_threads"));
}

nlohmann::json ToJson(const ThreadChoice& choice) {
  return {{"decode_threads", choice.decode_threads},
          {"prefill_threads", choice.prefill_threads},
          {"decode_ms", choice.decode_ms},
          {"prefill_ms", choice.prefill_ms},
          {"prefill_rows", choice.prefill_rows}};
}

absl::StatusOr<ThreadChoice> FromJson(const std::string& text,
                                      int max_threads) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("not a JSON object");
  }
  ThreadChoice choice;
  try {
    choice.decode_threads = j.at("decode_threads").get<int>();
    choice.prefill_threads = j.at("prefill_threads").get<int>();
    choice.decode_ms = j.at("decode_ms").get<std::vector<double>>();
    choice.prefill_ms = j.at("prefill_ms").get<std::vector<double>>();
    choice.prefill_rows = j.at("prefill_rows").get<int>();
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(e.what());
  }
  if (choice.decode_threads < 1 || choice.decode_threads > max_threads ||
      choice.prefill_threads < 1 || choice.prefill_threads > max_threads ||
      static_cast<int>(choice.decode_ms.size()) != max_threads ||
      static_cast<int>(choice.prefill_ms.size()) != max_threads) {
    return absl::InvalidArgumentError(absl::StrCat(
        "thread counts out of range for ", max_threads, " threads"));
  }
  return choice;
}

using Clock = std::chrono::steady_clock;
double MsSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start)
      .count();
}

// Median ms of a decode step (one token at position kDecodeContext..) and of
// a kPrefillRows-token chunk at `threads` threads.
absl::Status TimeAt(const LlamaModel& model, int threads, double* decode_ms,
                    double* prefill_ms) {
  at::set_num_threads(threads);
  SetPassThreads(threads, threads);
  try {
    c10::InferenceMode guard;
    const int64_t vocab = model.config().vocab_size;
    const int64_t rows = std::min<int64_t>(kPrefillRows, model.max_context());
    torch::Tensor ids = torch::arange(rows, torch::kInt64).remainder(vocab);
    std::vector<LayerKv> kv = model.AllocateKv(rows + kDecodeSteps + 1);
    std::vector<double> decode, prefill;
    for (int r = 0; r < kRepeats + 1; ++r) {  // the first is a warm-up
      const auto p0 = Clock::now();
      model.Forward(ids, 0, kv, 1);
      const double p = MsSince(p0);
      const int64_t context = std::min<int64_t>(kDecodeContext, rows);
      const auto d0 = Clock::now();
      for (int s = 0; s < kDecodeSteps; ++s) {
        model.Forward(ids.narrow(0, s % rows, 1), context + s, kv, 1);
      }
      const double d = MsSince(d0) / kDecodeSteps;
      if (r == 0) continue;
      prefill.push_back(p);
      decode.push_back(d);
    }
    *decode_ms = Median(decode);
    *prefill_ms = Median(prefill);
    return absl::OkStatus();
  } catch (...) {
    return CurrentExceptionAsInternal(
        absl::StrCat("threads auto: timing at ", threads, " threads"));
  }
}

}  // namespace

std::string ThreadChoice::Describe() const {
  auto list = [](const std::vector<double>& ms) {
    std::vector<std::string> parts;
    for (size_t t = 0; t < ms.size(); ++t) {
      parts.push_back(absl::StrCat(t + 1, ": ", absl::SixDigits(ms[t])));
    }
    return absl::StrJoin(parts, ", ");
  };
  return absl::StrCat(
      "threads auto: decode ", decode_threads, ", prefill ", prefill_threads,
      " (", origin == "cache" ? "from " : "measured now, stored in ",
      path.empty() ? "nowhere" : path, "; ms per decode step by threads {",
      list(decode_ms), "}, per ", prefill_rows, "-token prefill {",
      list(prefill_ms), "}; more threads must be ",
      static_cast<int>(kMoreThreadsMargin * 100), "% faster)");
}

absl::StatusOr<ThreadChoice> ChooseThreads(const LlamaModel& model,
                                           const std::string& cache_dir,
                                           int max_threads) {
  if (max_threads < 1) {
    return absl::InvalidArgumentError("threads auto: max_threads must be >= 1");
  }
  std::vector<std::string> warnings;
  const std::string entry =
      cache_dir.empty()
          ? ""
          : (std::filesystem::path(cache_dir) / EntryName(model, max_threads))
                .string();
  if (!entry.empty() && std::filesystem::exists(entry)) {
    absl::StatusOr<std::string> text = ReadFileToString(entry);
    absl::StatusOr<ThreadChoice> cached =
        text.ok() ? FromJson(*text, max_threads)
                  : absl::StatusOr<ThreadChoice>(text.status());
    if (cached.ok()) {
      cached->origin = "cache";
      cached->path = entry;
      return cached;
    }
    warnings.push_back(absl::StrCat("thread choice ", entry, " is unusable (",
                                    cached.status().message(),
                                    "); measuring again"));
  }
  ThreadChoice choice;
  choice.prefill_rows =
      static_cast<int>(std::min<int64_t>(kPrefillRows, model.max_context()));
  for (int t = 1; t <= max_threads; ++t) {
    double decode = 0, prefill = 0;
    RETURN_IF_ERROR(TimeAt(model, t, &decode, &prefill));
    choice.decode_ms.push_back(decode);
    choice.prefill_ms.push_back(prefill);
  }
  choice.decode_threads = Fastest(choice.decode_ms);
  choice.prefill_threads = Fastest(choice.prefill_ms);
  choice.origin = "measured";
  if (entry.empty()) {
    warnings.push_back(
        "no profile cache folder: the thread choice is not kept");
  } else if (absl::Status written =
                 WriteCacheFileAtomically(entry, ToJson(choice).dump(2) + "\n");
             !written.ok()) {
    warnings.push_back(std::string(written.message()));
  } else {
    choice.path = entry;
  }
  choice.warnings = std::move(warnings);
  return choice;
}

void ApplyThreadChoice(const ThreadChoice& choice) {
  at::set_num_threads(std::max(choice.decode_threads, choice.prefill_threads));
  SetPassThreads(choice.decode_threads, choice.prefill_threads);
}

}  // namespace knapserve
