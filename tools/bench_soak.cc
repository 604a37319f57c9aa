// `knapserve bench soak`: a long mixed load against a running executor
// (--server ADDR) that checks the server stays correct and bounded. Driven
// by tools/soak.sh, which also starts the split deployment and kills the
// planner every minute.
//
// Before the load, each prompt of --prompts runs once alone, greedy with
// speculation off: its reference output. Then --concurrency client threads
// send requests back to back for --soak-seconds. Each request picks, at
// random (seeded by --soak-seed):
//   - a prompt, and a speculation mode (off, static, clasp, knapspec);
//   - greedy (60%) or sampling (temperature 0.8, top-p 0.95, a seed);
//   - what the client does: read to the end (55%); cancel the call after a
//     random number of tokens (15%); give the call a deadline of 0.05-1.5 s
//     (15%); or send Abort for it after a random number of tokens (15%).
// Every call has a deadline (120 s unless it drew a short one).
//
// Checks, each printed with its figure:
//   - every greedy stream that ends normally equals its prompt's reference
//     (batching and speculation are lossless, whatever else is going on);
//   - no call ends later than its deadline plus --hang-grace-seconds;
//   - no call fails in a way its action does not explain (a cancelled call
//     may end CANCELLED, a short deadline DEADLINE_EXCEEDED, an aborted one
//     with finish_reason ABORTED; anything else is an error);
//   - after the load, the server's running, queued and K/V gauges
//     (--metrics HOST:PORT, the executor's --metrics-port) return to zero
//     within 30 s;
//   - the resident memory of --server-pid (read from /proc) at the end of the
//     load grew less than --max-rss-growth over its value after
//     --warmup-seconds.
// Exit 0 when all hold, 1 otherwise (or on a set-up error), 2 bad flags.
#include <grpcpp/grpcpp.h>
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/base/status.h"
#include "executor/api/generation_codec.h"
#include "executor/engine/speculation_mode.h"
#include "knapserve/v1/generation.grpc.pb.h"
#include "tools/bench_util.h"
#include "tools/cli_flags.h"
#include "tools/commands.h"
#include "tools/prompt_set.h"
#include "tools/shared_data.h"
#include "tools/tls_from_flags.h"

ABSL_DECLARE_FLAG(int32_t, concurrency);  // tools/bench_serve.cc

ABSL_FLAG(double, soak_seconds, 600, "bench soak: how long the load runs.");
ABSL_FLAG(double, warmup_seconds, 60,
          "bench soak: the server's resident memory is first read this long "
          "into the load (the baseline of --max-rss-growth).");
ABSL_FLAG(uint64_t, soak_seed, 1, "bench soak: seed of the clients' choices.");
ABSL_FLAG(std::string, metrics, "",
          "bench soak: HOST:PORT of the executor's Prometheus endpoint "
          "(--metrics-port); its gauges must return to zero after the load.");
ABSL_FLAG(int64_t, server_pid, 0,
          "bench soak: process id of the executor, whose resident memory is "
          "watched (0: not watched).");
ABSL_FLAG(double, max_rss_growth, 0.05,
          "bench soak: the largest allowed growth of the executor's resident "
          "memory from the end of the warm-up to the end of the load.");
ABSL_FLAG(double, hang_grace_seconds, 2.0,
          "bench soak: how long past its deadline a call may end before it "
          "counts as hung.");

namespace knapserve {
namespace {

using Clock = std::chrono::steady_clock;

constexpr double kLongDeadlineSeconds = 120;

enum class Action { kComplete, kCancel, kDeadline, kAbort };

const char* ActionName(Action action) {
  switch (action) {
    case Action::kComplete:
      return "complete";
    case Action::kCancel:
      return "cancel";
    case Action::kDeadline:
      return "deadline";
    case Action::kAbort:
      return "abort";
  }
  return "?";
}

// What the clients saw, summed over all calls. Guarded by Tally::mu.
struct Tally {
  absl::Mutex mu;
  int64_t calls ABSL_GUARDED_BY(mu) = 0;
  int64_t tokens ABSL_GUARDED_BY(mu) = 0;
  int64_t completed ABSL_GUARDED_BY(mu) = 0;
  int64_t greedy_checked ABSL_GUARDED_BY(mu) = 0;
  int64_t mismatches ABSL_GUARDED_BY(mu) = 0;
  int64_t cancelled ABSL_GUARDED_BY(mu) = 0;
  int64_t deadline_exceeded ABSL_GUARDED_BY(mu) = 0;
  int64_t aborted ABSL_GUARDED_BY(mu) = 0;
  int64_t hangs ABSL_GUARDED_BY(mu) = 0;
  double worst_overrun ABSL_GUARDED_BY(mu) = 0;  // seconds past a deadline
  std::map<std::string, int64_t> errors ABSL_GUARDED_BY(mu);
  std::map<std::string, int64_t> by_mode ABSL_GUARDED_BY(mu);
  std::vector<std::string> examples ABSL_GUARDED_BY(mu);  // first few faults

  void Example(std::string text) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (examples.size() < 8) examples.push_back(std::move(text));
  }
};

struct SoakPrompt {
  std::string text;
  std::vector<int32_t> reference;  // greedy, speculation off
};

const SpeculationMode kModes[] = {
    SpeculationMode::kOff, SpeculationMode::kStatic, SpeculationMode::kClasp,
    SpeculationMode::kKnapSpec};

std::chrono::system_clock::time_point DeadlineIn(double seconds) {
  return std::chrono::system_clock::now() +
         std::chrono::microseconds(static_cast<int64_t>(seconds * 1e6));
}

// One greedy, speculation-off run of `text`: the reference.
absl::StatusOr<std::vector<int32_t>> Reference(v1::Generation::Stub& stub,
                                               const std::string& text,
                                               int64_t max_new_tokens) {
  v1::GenerateRequest request;
  request.set_request_id("soak-reference");
  request.set_text(text);
  request.set_max_new_tokens(static_cast<int32_t>(max_new_tokens));
  request.set_temperature(0);
  request.mutable_speculation()->set_mode(v1::SPECULATION_MODE_OFF);
  grpc::ClientContext context;
  context.set_deadline(DeadlineIn(kLongDeadlineSeconds));
  context.set_wait_for_ready(true);
  auto reader = stub.Generate(&context, request);
  std::vector<int32_t> ids;
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
    if (!response.has_chunk()) continue;
    const auto& chunk = response.chunk().token_ids();
    ids.insert(ids.end(), chunk.begin(), chunk.end());
  }
  const grpc::Status status = reader->Finish();
  if (!status.ok()) {
    return absl::UnavailableError(
        absl::StrCat("bench soak: reference run: ", status.error_message()));
  }
  return ids;
}

// One client thread: calls until `end`.
void Client(v1::Generation::Stub& stub, const std::vector<SoakPrompt>& prompts,
            int64_t max_new_tokens, uint64_t seed, int index,
            Clock::time_point end, Tally& tally) {
  std::mt19937_64 rng(seed * 1000003 + index);
  std::uniform_real_distribution<double> unit(0, 1);
  for (int64_t n = 0; Clock::now() < end; ++n) {
    const int p = static_cast<int>(rng() % prompts.size());
    const SpeculationMode mode = kModes[rng() % 4];
    const std::string mode_name = SpeculationModeName(mode);
    const bool greedy = unit(rng) < 0.6;
    const double draw = unit(rng);
    const Action action = draw < 0.55   ? Action::kComplete
                          : draw < 0.70 ? Action::kCancel
                          : draw < 0.85 ? Action::kDeadline
                                        : Action::kAbort;
    const int64_t act_after = static_cast<int64_t>(rng() % max_new_tokens);
    const double deadline_seconds = action == Action::kDeadline
                                        ? 0.05 + 1.45 * unit(rng)
                                        : kLongDeadlineSeconds;

    v1::GenerateRequest request;
    const std::string id = absl::StrCat("soak-", index, "-", n);
    request.set_request_id(id);
    request.set_text(prompts[p].text);
    request.set_max_new_tokens(static_cast<int32_t>(max_new_tokens));
    request.mutable_speculation()->set_mode(ToWireMode(mode));
    if (greedy) {
      request.set_temperature(0);
    } else {
      request.set_temperature(0.8);
      request.set_top_p(0.95);
      request.set_seed(rng());
    }

    grpc::ClientContext context;
    context.set_deadline(DeadlineIn(deadline_seconds));
    const Clock::time_point start = Clock::now();
    auto reader = stub.Generate(&context, request);
    std::vector<int32_t> ids;
    v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;
    bool acted = false;
    v1::GenerateResponse response;
    while (reader->Read(&response)) {
      if (response.has_final()) finish = response.final().finish_reason();
      if (!response.has_chunk()) continue;
      const auto& chunk = response.chunk().token_ids();
      ids.insert(ids.end(), chunk.begin(), chunk.end());
      if (acted || static_cast<int64_t>(ids.size()) < act_after) continue;
      if (action == Action::kCancel) {
        context.TryCancel();
        acted = true;
      } else if (action == Action::kAbort) {
        grpc::ClientContext abort_context;
        abort_context.set_deadline(DeadlineIn(10));
        v1::AbortRequest abort;
        abort.set_request_id(id);
        v1::AbortResponse abort_response;
        const grpc::Status status =
            stub.Abort(&abort_context, abort, &abort_response);
        acted = true;
        if (!status.ok()) {
          absl::MutexLock lock(&tally.mu);
          ++tally.errors[absl::StrCat("Abort RPC: ",
                                      grpc::StatusCode(status.error_code()))];
          tally.Example(
              absl::StrCat("Abort ", id, ": ", status.error_message()));
        }
      }
    }
    const grpc::Status status = reader->Finish();
    const double elapsed =
        std::chrono::duration<double>(Clock::now() - start).count();

    absl::MutexLock lock(&tally.mu);
    ++tally.calls;
    tally.tokens += static_cast<int64_t>(ids.size());
    ++tally.by_mode[mode_name];
    const double overrun = elapsed - deadline_seconds;
    tally.worst_overrun = std::max(tally.worst_overrun, overrun);
    if (overrun > absl::GetFlag(FLAGS_hang_grace_seconds)) {
      ++tally.hangs;
      tally.Example(absl::StrCat(id, " (", ActionName(action), ", ", mode_name,
                                 ") ended ", overrun, " s past its deadline"));
    }
    std::string error;  // what the call's fate does not explain, if any
    switch (status.error_code()) {
      case grpc::StatusCode::OK:
        if (finish == v1::FINISH_REASON_ABORTED) {
          if (action == Action::kAbort) {
            ++tally.aborted;
          } else {
            error = "finish_reason ABORTED without an Abort";
          }
          break;
        }
        ++tally.completed;
        if (greedy) {
          ++tally.greedy_checked;
          if (ids != prompts[p].reference) {
            ++tally.mismatches;
            tally.Example(absl::StrCat(id, " (", mode_name,
                                       "): greedy output differs from the "
                                       "reference (",
                                       ids.size(), " vs ",
                                       prompts[p].reference.size(), " ids)"));
          }
        }
        break;
      case grpc::StatusCode::CANCELLED:
        if (action == Action::kCancel) {
          ++tally.cancelled;
        } else {
          error = "CANCELLED";
        }
        break;
      case grpc::StatusCode::DEADLINE_EXCEEDED:
        if (action == Action::kDeadline) {
          ++tally.deadline_exceeded;
        } else {
          error = "DEADLINE_EXCEEDED";
        }
        break;
      default:
        error = absl::StrCat("status ", static_cast<int>(status.error_code()));
    }
    if (!error.empty()) {
      ++tally.errors[error];
      tally.Example(absl::StrCat(id, " (", ActionName(action), ", ", mode_name,
                                 "): ", error, ": ", status.error_message()));
    }
  }
}

// Resident set size of `pid` in bytes (VmRSS), 0 if unreadable.
int64_t ResidentBytes(int64_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) != 0) continue;
    int64_t kb = 0;
    std::istringstream fields(line.substr(6));
    fields >> kb;
    return kb * 1024;
  }
  return 0;
}

// The gauges a drained server must show as zero.
const char* const kDrainedGauges[] = {
    "knapserve_running_requests",   "knapserve_queued_requests",
    "knapserve_kv_sequences",       "knapserve_kv_blocks_used",
    "knapserve_kv_blocks_reserved", "knapserve_kv_waiting_requests"};

// Counters reported beside the checks: planning went on while the planner
// was being killed.
const char* const kReportedCounters[] = {
    "knapserve_planner_plans_applied_total", "knapserve_planner_failures_total",
    "knapserve_spec_decode_num_accepted_tokens_total"};

// The unlabelled samples of a Prometheus text exposition, by name.
absl::StatusOr<std::map<std::string, double>> Scrape(
    const std::string& hostport) {
  const std::vector<std::string> parts = absl::StrSplit(hostport, ':');
  int port = 0;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[1], &port)) {
    return absl::InvalidArgumentError("--metrics: expected HOST:PORT, got " +
                                      hostport);
  }
  httplib::Client client(parts[0], port);
  client.set_connection_timeout(5);
  client.set_read_timeout(5);
  auto result = client.Get("/metrics");
  if (!result || result->status != 200) {
    return absl::UnavailableError("bench soak: cannot scrape http://" +
                                  hostport + "/metrics");
  }
  std::map<std::string, double> samples;
  std::istringstream lines(result->body);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.find(' ');
    if (space == std::string::npos || line.find('{') < space) continue;
    double value = 0;
    if (absl::SimpleAtod(line.substr(space + 1), &value)) {
      samples[line.substr(0, space)] = value;
    }
  }
  return samples;
}

absl::Status BenchSoak() {
  const std::string address = absl::GetFlag(FLAGS_server);
  const int concurrency = absl::GetFlag(FLAGS_concurrency);
  const double seconds = absl::GetFlag(FLAGS_soak_seconds);
  const int64_t max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  const int64_t pid = absl::GetFlag(FLAGS_server_pid);
  const double warmup = absl::GetFlag(FLAGS_warmup_seconds);
  if (address.empty()) {
    return absl::InvalidArgumentError("bench soak: --server ADDR is required");
  }
  if (concurrency < 1 || !(seconds > 0) || max_new_tokens < 2 || warmup < 0 ||
      warmup >= seconds) {
    return absl::InvalidArgumentError(
        "bench soak: need --concurrency >= 1, --soak-seconds > "
        "--warmup-seconds >= 0 and --max-new-tokens >= 2");
  }
  std::string prompts_path = absl::GetFlag(FLAGS_prompts);
  if (prompts_path.empty()) {
    prompts_path = SharedPath("bench/stories/prompts.jsonl");
  }
  ASSIGN_OR_RETURN(
      std::vector<BenchPrompt> loaded,
      LoadPromptSet(prompts_path, absl::GetFlag(FLAGS_num_prompts)));
  if (loaded.empty()) {
    return absl::InvalidArgumentError("bench soak: no prompts in " +
                                      prompts_path);
  }

  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                   ClientCredentialsFromFlags());
  auto stub = v1::Generation::NewStub(
      grpc::CreateChannel(address, OrInsecure(credentials)));
  std::vector<SoakPrompt> prompts;
  for (const BenchPrompt& prompt : loaded) {
    ASSIGN_OR_RETURN(std::vector<int32_t> reference,
                     Reference(*stub, prompt.text, max_new_tokens));
    prompts.push_back({prompt.text, std::move(reference)});
  }
  // Progress goes to stderr: stdout is the report (JSON with --json).
  std::fprintf(stderr,
               "soak: %zu prompts, references done; %d clients for %.0f s\n",
               prompts.size(), concurrency, seconds);

  // Resident memory, every second, from a watcher thread.
  const Clock::time_point t0 = Clock::now();
  const Clock::time_point end =
      t0 + std::chrono::microseconds(static_cast<int64_t>(seconds * 1e6));
  std::atomic<bool> load_over{false};
  std::atomic<int64_t> rss_warm{0}, rss_end{0}, rss_peak{0};
  std::thread watcher([&] {
    while (!load_over.load()) {
      if (pid > 0) {
        const int64_t rss = ResidentBytes(pid);
        if (std::chrono::duration<double>(Clock::now() - t0).count() < warmup) {
          // Before the baseline: only the peak counts.
        } else if (rss_warm.load() == 0) {
          rss_warm = rss;
        }
        rss_end = rss;
        rss_peak = std::max(rss_peak.load(), rss);
      }
      std::this_thread::sleep_for(std::chrono::seconds(1));
    }
  });

  Tally tally;
  std::vector<std::thread> clients;
  const uint64_t seed = absl::GetFlag(FLAGS_soak_seed);
  for (int c = 0; c < concurrency; ++c) {
    clients.emplace_back([&, c] {
      Client(*stub, prompts, max_new_tokens, seed, c, end, tally);
    });
  }
  for (std::thread& client : clients) client.join();
  load_over = true;
  watcher.join();
  const double load_seconds =
      std::chrono::duration<double>(Clock::now() - t0).count();

  // The gauges, until they read zero (or 30 s).
  std::map<std::string, double> gauges;
  std::map<std::string, double> counters;  // what planning did meanwhile
  bool drained = false;
  const std::string metrics = absl::GetFlag(FLAGS_metrics);
  if (!metrics.empty()) {
    for (int attempt = 0; attempt < 60 && !drained; ++attempt) {
      if (attempt > 0)
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
      using Samples = std::map<std::string, double>;
      ASSIGN_OR_RETURN(Samples samples, Scrape(metrics));
      drained = true;
      for (const char* name : kReportedCounters) {
        if (auto it = samples.find(name); it != samples.end()) {
          counters[name] = it->second;
        }
      }
      for (const char* name : kDrainedGauges) {
        auto it = samples.find(name);
        if (it == samples.end()) {
          return absl::NotFoundError(
              absl::StrCat("bench soak: the server exports no gauge ", name));
        }
        gauges[name] = it->second;
        drained &= it->second == 0;
      }
    }
  }

  absl::MutexLock lock(&tally.mu);
  const double growth =
      rss_warm.load() > 0
          ? static_cast<double>(rss_end.load() - rss_warm.load()) /
                static_cast<double>(rss_warm.load())
          : 0.0;
  int64_t errors = 0;
  for (const auto& [what, count] : tally.errors) errors += count;
  const bool rss_ok =
      pid <= 0 ||
      (rss_warm.load() > 0 && growth < absl::GetFlag(FLAGS_max_rss_growth));
  const bool ok = tally.mismatches == 0 && tally.hangs == 0 && errors == 0 &&
                  (metrics.empty() || drained) && rss_ok &&
                  tally.greedy_checked > 0;

  nlohmann::json out;
  out["seconds"] = load_seconds;
  out["clients"] = concurrency;
  out["calls"] = tally.calls;
  out["tokens"] = tally.tokens;
  out["completed"] = tally.completed;
  out["greedy_checked"] = tally.greedy_checked;
  out["mismatches"] = tally.mismatches;
  out["cancelled"] = tally.cancelled;
  out["deadline_exceeded"] = tally.deadline_exceeded;
  out["aborted"] = tally.aborted;
  out["hangs"] = tally.hangs;
  out["worst_deadline_overrun_seconds"] = tally.worst_overrun;
  out["errors"] = tally.errors;
  out["calls_by_mode"] = tally.by_mode;
  out["gauges_after"] = gauges;
  out["server_counters"] = counters;
  out["drained"] = drained;
  out["rss_after_warmup_bytes"] = rss_warm.load();
  out["rss_end_bytes"] = rss_end.load();
  out["rss_peak_bytes"] = rss_peak.load();
  out["rss_growth"] = growth;
  out["examples"] = tally.examples;
  out["ok"] = ok;
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    std::printf(
        "soak: %.0f s, %lld calls, %lld tokens (%.0f tok/s)\n"
        "soak: completed %lld, greedy checked %lld, mismatches %lld\n"
        "soak: cancelled %lld, deadline exceeded %lld, aborted %lld\n"
        "soak: hangs %lld (worst end past a deadline %.3f s), errors %lld\n",
        load_seconds, static_cast<long long>(tally.calls),
        static_cast<long long>(tally.tokens),
        static_cast<double>(tally.tokens) / load_seconds,
        static_cast<long long>(tally.completed),
        static_cast<long long>(tally.greedy_checked),
        static_cast<long long>(tally.mismatches),
        static_cast<long long>(tally.cancelled),
        static_cast<long long>(tally.deadline_exceeded),
        static_cast<long long>(tally.aborted),
        static_cast<long long>(tally.hangs), tally.worst_overrun,
        static_cast<long long>(errors));
    for (const auto& [what, count] : tally.errors) {
      std::printf("soak:   error %s: %lld\n", what.c_str(),
                  static_cast<long long>(count));
    }
    if (!metrics.empty()) {
      std::printf("soak: gauges after the load: %s%s\n",
                  nlohmann::json(gauges).dump().c_str(),
                  drained ? " (all zero)" : " (NOT ZERO after 30 s)");
    }
    if (!counters.empty()) {
      std::printf("soak: server counters: %s\n",
                  nlohmann::json(counters).dump().c_str());
    }
    if (pid > 0) {
      std::printf(
          "soak: executor RSS %.1f MiB after warm-up, %.1f MiB at the end "
          "(%+.2f%%), peak %.1f MiB\n",
          rss_warm.load() / 1048576.0, rss_end.load() / 1048576.0, 100 * growth,
          rss_peak.load() / 1048576.0);
    }
    for (const std::string& example : tally.examples) {
      std::printf("soak:   e.g. %s\n", example.c_str());
    }
    std::printf("soak: %s\n", ok ? "PASS" : "FAIL");
  }
  if (!ok) return absl::InternalError("bench soak: a check failed (above)");
  return absl::OkStatus();
}

}  // namespace

int RunBenchSoak() { return ExitCode(BenchSoak(), "bench soak"); }

}  // namespace knapserve
