// `knapserve bench serve`: a load generator over gRPC. It drives a running
// server (--server ADDR) or starts one in this process on loopback (the same
// set-up as `knapserve serve`, tools/executor_from_flags.h), and measures
// what a client sees.
//
// Phases, in order, against the same server, for each run of the --modes
// list (default: --spec; the list --rounds times) in turn:
//   1. warm-up: one short request, untimed (a mode's first run only);
//   2. single: each distinct prompt alone, one after another (the
//      single-stream baseline, and the reference output of each prompt; a
//      mode's first run only, so that the load runs of later rounds follow
//      one another closely);
//   3. load: --num-requests requests, either closed loop (--concurrency
//      streams, each sending its next request when the last one ends) or
//      Poisson arrivals at --request-rate per second (each request its own
//      stream). With --burst-prompt-tokens N, one more request with an
//      N-token prompt is sent once the first --concurrency requests all have
//      their first token: the chunked prefill of a long prompt while streams
//      decode.
//
// Per phase: output tokens per second (completion tokens over the phase's
// wall time, from the first send to the last end), decode tokens per second
// (tokens after each stream's first over the time some stream was
// decoding), time to first token and inter-token latency percentiles. ITL is
// per token: a chunk carrying n tokens (speculation commits several per step)
// after a gap g counts n gaps of g/n. Every request asks for exactly
// --max-new-tokens tokens (EOS ignored). When the output is deterministic
// (greedy, or --seed), every stream of every mode must equal its prompt's
// single-stream output in the first mode (batching and speculation are
// lossless); a mismatch or a failed stream makes the command exit 1. Modes run
// one after another on one server, so their ratios come from one run; each
// run's load is also compared with the first mode's runs just before and
// after it, and per mode the median and range of those ratios are reported
// (for the first mode: its runs against each other, the machine's own
// spread).
//
// An in-process server also reports, per load phase, its engine's steps and
// the peaks of its memory: K/V pool blocks used (plan snapshots hold theirs
// inside the pool) and reserved, and the process's resident bytes, sampled
// every 10 ms (a pool lock and a /proc read each). It also reports its start:
// seconds from the command's start (model load included) to serving, and to the
// first token of the first request (the first mode's warm-up). A planned mode
// waits for the server's latency profile when it is still measured in the
// background, so that its phases time planning.
#include <ATen/Parallel.h>
#include <grpcpp/grpcpp.h>
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/base/status.h"
#include "executor/api/generation_codec.h"
#include "knapserve/v1/generation.grpc.pb.h"
#include "tools/bench_util.h"
#include "tools/cli_flags.h"
#include "tools/commands.h"
#include "tools/executor_from_flags.h"
#include "tools/shared_data.h"
#include "tools/tls_from_flags.h"

ABSL_FLAG(int32_t, concurrency, 16,
          "bench serve: concurrent streams of the closed-loop load phase "
          "(each sends its next request when its last one ends).");
ABSL_FLAG(int32_t, num_requests, 0,
          "bench serve: requests in the load phase; 0 = --concurrency.");
ABSL_FLAG(std::string, arrival, "closed",
          "bench serve: closed (--concurrency streams back to back) or "
          "poisson (arrivals at --request-rate per second, each request its "
          "own stream).");
ABSL_FLAG(double, request_rate, 4.0,
          "bench serve: mean arrivals per second with --arrival poisson.");
ABSL_FLAG(int64_t, burst_prompt_tokens, 0,
          "bench serve: once the first --concurrency load requests have their "
          "first token, send one more with a prompt of this many tokens "
          "(capped to the context); 0 = none.");
ABSL_FLAG(std::string, protocol, "grpc",
          "bench serve: grpc (the Generation service) or http (the OpenAI "
          "front door: streamed POST /v1/completions with token-id prompts; "
          "a server of its own listens on both; with --server, "
          "--http-server names the HTTP address).");
ABSL_FLAG(std::string, http_server, "",
          "bench serve: HOST:PORT of the server's HTTP front door, with "
          "--server and --protocol http.");
ABSL_FLAG(int32_t, rounds, 1,
          "bench serve: run the --modes list this many times in a row. A "
          "mode's warm-up and single phase run at its first run only, so "
          "later runs are load phases back to back; list the first mode "
          "between the others (off,static,off,knapspec,off) and each run is "
          "compared with the first mode's runs just around it; on a shared "
          "machine 8 rounds' median outvotes a slow spell, 3 may not.");
ABSL_FLAG(bool, check_outputs, true,
          "bench serve: when outputs are deterministic (greedy or --seed), "
          "require every load stream to equal its single-stream output.");

namespace knapserve {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kArrivalSeed = 20261125;  // Poisson gaps, fixed per run
constexpr int64_t kBurstNewTokens = 8;
constexpr int64_t kWarmupNewTokens = 8;
constexpr double kRequestDeadlineSeconds = 1800;

double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// One request to send: its prompt's index (-1 for the burst) and the wire
// request.
struct PlannedRequest {
  int prompt = -1;
  v1::GenerateRequest request;
};

// What the client saw of one stream. Times are seconds since the phase's
// start.
struct StreamRecord {
  int prompt = -1;
  grpc::Status status;
  std::vector<int32_t> ids;
  double send = 0;
  double end = 0;
  std::vector<double> chunk_times;
  std::vector<int> chunk_tokens;
  v1::FinalResult final;

  double ttft() const {
    return chunk_times.empty() ? 0.0 : chunk_times.front() - send;
  }
  // Per-token gaps after the first chunk.
  void AppendItl(std::vector<double>& out) const {
    for (size_t k = 1; k < chunk_times.size(); ++k) {
      const int n = std::max(1, chunk_tokens[k]);
      const double gap = (chunk_times[k] - chunk_times[k - 1]) / n;
      for (int j = 0; j < n; ++j) out.push_back(gap);
    }
  }
};

// Streams `planned` to the end; `on_first_chunk` (optional) runs on this
// thread when the first chunk arrives. One per protocol.
using StreamFn = std::function<StreamRecord(
    const PlannedRequest& planned, Clock::time_point t0,
    const std::function<void()>& on_first_chunk)>;

StreamRecord RunStream(v1::Generation::Stub& stub,
                       const PlannedRequest& planned, Clock::time_point t0,
                       const std::function<void()>& on_first_chunk) {
  StreamRecord record;
  record.prompt = planned.prompt;
  grpc::ClientContext context;
  context.set_deadline(
      std::chrono::system_clock::now() +
      std::chrono::seconds(static_cast<int64_t>(kRequestDeadlineSeconds)));
  record.send = SecondsSince(t0);
  auto reader = stub.Generate(&context, planned.request);
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
    if (response.has_chunk()) {
      const auto& ids = response.chunk().token_ids();
      if (ids.empty()) continue;
      record.chunk_times.push_back(SecondsSince(t0));
      record.chunk_tokens.push_back(ids.size());
      record.ids.insert(record.ids.end(), ids.begin(), ids.end());
      if (record.chunk_times.size() == 1 && on_first_chunk) on_first_chunk();
    } else if (response.has_final()) {
      record.final = response.final();
    }
  }
  record.status = reader->Finish();
  record.end = SecondsSince(t0);
  return record;
}

// The same request through the OpenAI front door: a streamed
// /v1/completions with the prompt as token ids, the sampling fields, and
// the speculation in the `knapserve` extension; each SSE event's
// knapserve.token_ids are a chunk. A refusal or an error event fails the
// stream with the error's message.
StreamRecord RunHttpStream(const std::string& host, int port,
                           const std::string& model,
                           const PlannedRequest& planned, Clock::time_point t0,
                           const std::function<void()>& on_first_chunk) {
  const v1::GenerateRequest& w = planned.request;
  nlohmann::json body = {
      {"model", model},
      {"prompt", std::vector<int32_t>(w.token_ids().ids().begin(),
                                      w.token_ids().ids().end())},
      {"max_tokens", w.max_new_tokens()},
      {"temperature", w.temperature()},
      {"ignore_eos", w.ignore_eos()},
      {"stream", true}};
  if (w.has_top_p()) body["top_p"] = w.top_p();
  if (w.has_top_k()) body["top_k"] = w.top_k();
  if (w.has_seed()) body["seed"] = w.seed();
  nlohmann::json spec = {
      {"spec", SpeculationModeName(*FromWireMode(w.speculation().mode(),
                                                 SpeculationMode::kOff))}};
  if (w.speculation().has_max_draft_tokens())
    spec["max_draft"] = w.speculation().max_draft_tokens();
  if (w.speculation().has_static_mask())
    spec["static_mask"] = w.speculation().static_mask();
  if (w.speculation().has_exit_threshold())
    spec["exit_threshold"] = w.speculation().exit_threshold();
  body["knapserve"] = spec;

  StreamRecord record;
  record.prompt = planned.prompt;
  httplib::Client client(host, port);
  client.set_read_timeout(static_cast<time_t>(kRequestDeadlineSeconds), 0);
  std::string buffer, error;
  bool done = false;
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  req.content_receiver = [&](const char* data, size_t size, uint64_t,
                             uint64_t) {
    buffer.append(data, size);
    for (size_t end; (end = buffer.find("\n\n")) != std::string::npos;) {
      const std::string event = buffer.substr(0, end);
      buffer.erase(0, end + 2);
      if (event.rfind("data: ", 0) != 0) continue;
      if (event == "data: [DONE]") {
        done = true;
        continue;
      }
      const nlohmann::json json =
          nlohmann::json::parse(event.substr(6), nullptr, false);
      if (json.contains("error")) {
        error = json["error"].value("message", "error event");
        continue;
      }
      const nlohmann::json* ext =
          json.contains("knapserve") ? &json["knapserve"] : nullptr;
      if (ext == nullptr || !ext->contains("token_ids")) continue;
      const std::vector<int32_t> ids = (*ext)["token_ids"];
      if (ids.empty()) continue;
      record.chunk_times.push_back(SecondsSince(t0));
      record.chunk_tokens.push_back(static_cast<int>(ids.size()));
      record.ids.insert(record.ids.end(), ids.begin(), ids.end());
      if (record.chunk_times.size() == 1 && on_first_chunk) on_first_chunk();
    }
    return true;
  };
  record.send = SecondsSince(t0);
  const httplib::Result res = client.send(req);
  record.end = SecondsSince(t0);
  if (!res) {
    record.status = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                 httplib::to_string(res.error()));
  } else if (res->status != 200) {
    // A refusal's body went to the content receiver too.
    const nlohmann::json json = nlohmann::json::parse(
        buffer.empty() ? res->body : buffer, nullptr, false);
    record.status =
        grpc::Status(grpc::StatusCode::UNKNOWN,
                     absl::StrCat("HTTP ", res->status, ": ",
                                  json.is_object() && json.contains("error")
                                      ? json["error"].value("message", "")
                                      : buffer));
  } else if (!error.empty() || !done) {
    record.status = grpc::Status(grpc::StatusCode::UNKNOWN,
                                 error.empty() ? "no [DONE]" : error);
  }
  return record;
}

// How the load phase sends its requests.
struct LoadShape {
  bool poisson = false;
  int concurrency = 1;      // closed loop: streams at once
  double request_rate = 0;  // poisson: arrivals per second
};

struct PhaseResult {
  std::vector<StreamRecord> streams;
  std::optional<StreamRecord> burst;
  double duration = 0;  // first send to last end
};

// Runs `requests` shaped by `shape`, plus `burst` (when given) once the
// first `shape.concurrency` requests have their first token.
PhaseResult RunPhase(const StreamFn& stream,
                     const std::vector<PlannedRequest>& requests,
                     const LoadShape& shape,
                     const std::optional<PlannedRequest>& burst) {
  PhaseResult result;
  result.streams.resize(requests.size());
  const Clock::time_point t0 = Clock::now();
  absl::Mutex mu;
  int first_chunks = 0;  // guarded by mu
  const int burst_after = std::min<int>(shape.concurrency, requests.size());
  auto first_chunk_of = [&](size_t index) -> std::function<void()> {
    if (!burst.has_value() || index >= static_cast<size_t>(burst_after))
      return nullptr;
    return [&] {
      absl::MutexLock lock(&mu);
      ++first_chunks;
    };
  };
  std::thread burst_thread;
  if (burst.has_value()) {
    burst_thread = std::thread([&] {
      {
        absl::MutexLock lock(&mu);
        const auto ready = [&] { return first_chunks >= burst_after; };
        mu.Await(absl::Condition(&ready));
      }
      result.burst = stream(*burst, t0, nullptr);
    });
  }
  // Outlives every stream thread (they are joined below).
  std::atomic<size_t> next{0};
  std::vector<std::thread> threads;
  if (shape.poisson) {
    std::mt19937_64 rng(kArrivalSeed);
    std::exponential_distribution<double> gap(shape.request_rate);
    double at = 0;
    for (size_t i = 0; i < requests.size(); ++i) {
      std::this_thread::sleep_until(t0 +
                                    std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(at)));
      threads.emplace_back([&, i] {
        result.streams[i] = stream(requests[i], t0, first_chunk_of(i));
      });
      at += gap(rng);
    }
  } else {
    for (int c = 0; c < shape.concurrency; ++c) {
      threads.emplace_back([&] {
        for (size_t i = next++; i < requests.size(); i = next++) {
          result.streams[i] = stream(requests[i], t0, first_chunk_of(i));
        }
      });
    }
  }
  for (std::thread& t : threads) t.join();
  if (burst_thread.joinable()) {
    // If a stream failed before its first token the burst never starts:
    // release its waiter by counting the missing first chunks.
    {
      absl::MutexLock lock(&mu);
      first_chunks = std::max(first_chunks, burst_after);
    }
    burst_thread.join();
  }
  double first = 1e300, last = 0;
  for (const StreamRecord& s : result.streams) {
    first = std::min(first, s.send);
    last = std::max(last, s.end);
  }
  if (result.burst.has_value()) last = std::max(last, result.burst->end);
  result.duration = requests.empty() ? 0.0 : last - first;
  return result;
}

// Client-side figures of one phase (burst excluded).
struct PhaseSummary {
  int requests = 0;
  int failed = 0;
  int64_t tokens = 0;
  double duration = 0;
  double output_tokens_per_second = 0;
  double ttft_p50 = 0, ttft_p99 = 0;
  double itl_p50 = 0, itl_p99 = 0, itl_max = 0;
  double mean_acceptance_length = 0;  // committed tokens per decode step
  // Tokens after each stream's first, over the time at least one stream was
  // decoding (the union of the streams' first-to-last-chunk intervals): the
  // aggregate decode rate, prefill and queueing left out.
  double decode_tokens_per_second = 0;
  std::vector<double> itl;  // every per-token gap
};

PhaseSummary Summarize(const PhaseResult& phase) {
  PhaseSummary s;
  std::vector<double> ttft;
  int64_t steps = 0, step_tokens = 0;
  for (const StreamRecord& r : phase.streams) {
    ++s.requests;
    if (!r.status.ok()) ++s.failed;
    s.tokens += static_cast<int64_t>(r.ids.size());
    if (!r.chunk_times.empty()) ttft.push_back(r.ttft());
    r.AppendItl(s.itl);
    steps +=
        std::max<int64_t>(0, static_cast<int64_t>(r.chunk_times.size()) - 1);
    step_tokens += std::max<int64_t>(0, static_cast<int64_t>(r.ids.size()) - 1);
  }
  std::vector<std::pair<double, double>> spans;
  int64_t decode_tokens = 0;
  for (const StreamRecord& r : phase.streams) {
    if (r.chunk_times.size() < 2) continue;
    spans.emplace_back(r.chunk_times.front(), r.chunk_times.back());
    decode_tokens += static_cast<int64_t>(r.ids.size()) - r.chunk_tokens[0];
  }
  std::sort(spans.begin(), spans.end());
  double covered = 0, open_begin = 0, open_end = -1;
  for (const auto& [b, e] : spans) {
    if (b > open_end) {
      if (open_end > open_begin) covered += open_end - open_begin;
      open_begin = b;
      open_end = e;
    } else {
      open_end = std::max(open_end, e);
    }
  }
  if (open_end > open_begin) covered += open_end - open_begin;
  s.decode_tokens_per_second =
      covered > 0 ? static_cast<double>(decode_tokens) / covered : 0.0;
  s.duration = phase.duration;
  s.output_tokens_per_second =
      s.duration > 0 ? static_cast<double>(s.tokens) / s.duration : 0.0;
  s.ttft_p50 = Quantile(ttft, 0.5);
  s.ttft_p99 = Quantile(ttft, 0.99);
  s.itl_p50 = Quantile(s.itl, 0.5);
  s.itl_p99 = Quantile(s.itl, 0.99);
  s.itl_max =
      s.itl.empty() ? 0.0 : *std::max_element(s.itl.begin(), s.itl.end());
  s.mean_acceptance_length =
      steps > 0 ? static_cast<double>(step_tokens) / steps : 0.0;
  return s;
}

nlohmann::json PhaseJson(const PhaseSummary& s) {
  return {{"requests", s.requests},
          {"failed", s.failed},
          {"completion_tokens", s.tokens},
          {"duration_seconds", s.duration},
          {"output_tokens_per_s", s.output_tokens_per_second},
          {"decode_tokens_per_s", s.decode_tokens_per_second},
          {"ttft_p50_seconds", s.ttft_p50},
          {"ttft_p99_seconds", s.ttft_p99},
          {"itl_p50_seconds", s.itl_p50},
          {"itl_p99_seconds", s.itl_p99},
          {"itl_max_seconds", s.itl_max},
          {"tokens_per_step", s.mean_acceptance_length}};
}

void PrintPhase(const char* name, const PhaseSummary& s) {
  std::printf(
      "%-16s %5d %7lld %8.2f %10.1f %10.1f %9.1f %9.1f %8.2f %8.2f %7.2f\n",
      name, s.requests, static_cast<long long>(s.tokens), s.duration,
      s.output_tokens_per_second, s.decode_tokens_per_second, 1e3 * s.ttft_p50,
      1e3 * s.ttft_p99, 1e3 * s.itl_p50, 1e3 * s.itl_p99,
      s.mean_acceptance_length);
}

// The tokenizer a remote server's prompts are encoded with: --tokenizer,
// else tokenizer.json in the server's model folder (readable when the server
// runs on this machine).
absl::StatusOr<std::unique_ptr<Tokenizer>> RemoteTokenizer(
    const v1::ModelInfo& info) {
  std::string path = absl::GetFlag(FLAGS_tokenizer);
  if (path.empty()) path = info.model_path() + "/tokenizer.json";
  auto tokenizer = Tokenizer::FromFile(path);
  if (!tokenizer.ok()) {
    return absl::Status(tokenizer.status().code(),
                        absl::StrCat("bench serve: the server's tokenizer (",
                                     path, "): ", tokenizer.status().message(),
                                     "; pass --tokenizer FILE"));
  }
  return std::move(*tokenizer);
}

absl::Status BenchServe() {
  // The in-process server's start: loading the model, then serving.
  const Clock::time_point started = Clock::now();
  const int concurrency = absl::GetFlag(FLAGS_concurrency);
  const int num_requests = absl::GetFlag(FLAGS_num_requests) > 0
                               ? absl::GetFlag(FLAGS_num_requests)
                               : concurrency;
  const std::string arrival = absl::GetFlag(FLAGS_arrival);
  const int64_t max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  if (concurrency < 1 || absl::GetFlag(FLAGS_num_requests) < 0) {
    return absl::InvalidArgumentError(
        "--concurrency must be >= 1 and --num-requests >= 0");
  }
  if (arrival != "closed" && arrival != "poisson") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--arrival: expected closed or poisson, got '", arrival, "'"));
  }
  if (arrival == "poisson" && !(absl::GetFlag(FLAGS_request_rate) > 0)) {
    return absl::InvalidArgumentError("--request-rate must be > 0");
  }
  const int rounds = absl::GetFlag(FLAGS_rounds);
  if (rounds < 1) return absl::InvalidArgumentError("--rounds must be >= 1");
  if (max_new_tokens < 2 || absl::GetFlag(FLAGS_burst_prompt_tokens) < 0) {
    return absl::InvalidArgumentError(
        "--max-new-tokens must be >= 2 and --burst-prompt-tokens >= 0");
  }
  ASSIGN_OR_RETURN(v1::GenerateRequest base, WireRequestFromFlags());
  std::vector<SpeculationMode> modes;
  for (const std::string& name : absl::GetFlag(FLAGS_modes)) {
    ASSIGN_OR_RETURN(SpeculationMode mode, ParseSpeculationMode(name));
    modes.push_back(mode);
  }
  if (modes.empty()) {
    ASSIGN_OR_RETURN(SpeculationMode mode,
                     ParseSpeculationMode(absl::GetFlag(FLAGS_spec)));
    modes.push_back(mode);
  }
  base.set_ignore_eos(true);  // fixed-length streams
  const std::string protocol = absl::GetFlag(FLAGS_protocol);
  if (protocol != "grpc" && protocol != "http") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--protocol: expected grpc or http, got '", protocol, "'"));
  }
  const bool http = protocol == "http";
  std::string http_address = absl::GetFlag(FLAGS_http_server);
  if (http && !absl::GetFlag(FLAGS_server).empty() && http_address.empty()) {
    return absl::InvalidArgumentError(
        "--protocol http with --server needs --http-server HOST:PORT");
  }
  base.set_max_new_tokens(static_cast<int32_t>(max_new_tokens));

  // The server: --server, else one in this process on loopback.
  std::string address = absl::GetFlag(FLAGS_server);
  Engine engine;
  std::unique_ptr<RunningExecutor> running;
  double serving_seconds = 0;  // in-process: start to the port serving
  if (address.empty()) {
    ASSIGN_OR_RETURN(engine, LoadEngineFromFlags());
    // Drafting modes get the in-process planner: its profile also prices
    // batched steps (drafts dropped where they do not pay).
    bool any_drafts = false;
    for (const SpeculationMode mode : modes) any_drafts |= Drafts(mode);
    const std::string planner = any_drafts ? "inproc" : "none";
    if (http) absl::SetFlag(&FLAGS_http_listen, "127.0.0.1:0");
    ASSIGN_OR_RETURN(
        running,
        StartExecutorFromFlags(engine, planner, "127.0.0.1:0", "bench serve"));
    serving_seconds = SecondsSince(started);
    address = absl::StrCat("127.0.0.1:", running->server->port());
    if (http) {
      http_address = absl::StrCat("127.0.0.1:", running->server->http_port());
    }
  }
  // A server of our own gets the flags' TLS too, so the client then needs
  // --tls-ca like any other.
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                   ClientCredentialsFromFlags());
  auto stub = v1::Generation::NewStub(
      grpc::CreateChannel(address, OrInsecure(credentials)));
  v1::ModelInfo info;
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(30));
    v1::GetModelInfoResponse response;
    const grpc::Status status =
        stub->GetModelInfo(&context, v1::GetModelInfoRequest(), &response);
    if (!status.ok()) {
      return absl::UnavailableError(absl::StrCat(
          "bench serve: server ", address, ": ", status.error_message()));
    }
    info = response.model_info();
  }
  StreamFn stream = [&stub](const PlannedRequest& planned, Clock::time_point t0,
                            const std::function<void()>& on_first_chunk) {
    return RunStream(*stub, planned, t0, on_first_chunk);
  };
  if (http) {
    // The name the front door serves, from its /v1/models.
    const size_t colon = http_address.rfind(':');
    int http_port = 0;
    if (colon == std::string::npos ||
        !absl::SimpleAtoi(http_address.substr(colon + 1), &http_port)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--http-server: expected HOST:PORT, got '", http_address, "'"));
    }
    const std::string host = http_address.substr(0, colon);
    httplib::Client client(host, http_port);
    const httplib::Result models = client.Get("/v1/models");
    const nlohmann::json list =
        models ? nlohmann::json::parse(models->body, nullptr, false)
               : nlohmann::json();
    if (!models || models->status != 200 || !list.contains("data") ||
        list["data"].empty()) {
      return absl::UnavailableError(
          absl::StrCat("bench serve: no OpenAI front door at ", http_address));
    }
    const std::string model = list["data"][0].value("id", "");
    stream = [host, http_port, model](
                 const PlannedRequest& planned, Clock::time_point t0,
                 const std::function<void()>& on_first_chunk) {
      return RunHttpStream(host, http_port, model, planned, t0, on_first_chunk);
    };
  }
  std::unique_ptr<Tokenizer> remote_tokenizer;
  const Tokenizer* tokenizer = engine.tokenizer.get();
  if (tokenizer == nullptr) {
    ASSIGN_OR_RETURN(remote_tokenizer, RemoteTokenizer(info));
    tokenizer = remote_tokenizer.get();
  }

  // Prompts, cut so that the generation fits the context.
  std::string path = absl::GetFlag(FLAGS_prompts);
  if (path.empty()) path = SharedPath("bench/spec_bench/question.jsonl");
  ASSIGN_OR_RETURN(std::vector<BenchPrompt> prompts,
                   LoadPromptSet(path, absl::GetFlag(FLAGS_num_prompts)));
  if (prompts.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": no prompts"));
  }
  const int64_t max_prompt = info.max_context() - max_new_tokens - 1;
  if (max_prompt < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-new-tokens: ", max_new_tokens,
                     " leaves no room for a prompt in the context of ",
                     info.max_context(), " tokens"));
  }
  std::vector<std::vector<int32_t>> prompt_ids;
  for (const BenchPrompt& p : prompts) {
    ASSIGN_OR_RETURN(
        std::vector<int32_t> ids,
        PromptIds(*tokenizer, p.text,
                  std::min(max_prompt, absl::GetFlag(FLAGS_min_prompt_tokens)),
                  max_prompt));
    prompt_ids.push_back(std::move(ids));
  }
  auto request_for = [&](int prompt, int64_t new_tokens,
                         const std::vector<int32_t>& ids, std::string id) {
    PlannedRequest planned;
    planned.prompt = prompt;
    planned.request = base;
    planned.request.set_request_id(std::move(id));
    planned.request.set_max_new_tokens(static_cast<int32_t>(new_tokens));
    *planned.request.mutable_token_ids()->mutable_ids() = {ids.begin(),
                                                           ids.end()};
    return planned;
  };
  const int distinct =
      std::min<int>(num_requests, static_cast<int>(prompt_ids.size()));
  std::vector<PlannedRequest> singles, load;
  for (int p = 0; p < distinct; ++p) {
    singles.push_back(request_for(p, max_new_tokens, prompt_ids[p],
                                  absl::StrCat("bench-single-", p)));
  }
  for (int i = 0; i < num_requests; ++i) {
    load.push_back(request_for(i % distinct, max_new_tokens,
                               prompt_ids[i % distinct],
                               absl::StrCat("bench-load-", i)));
  }
  std::optional<PlannedRequest> burst;
  int64_t burst_tokens = absl::GetFlag(FLAGS_burst_prompt_tokens);
  if (burst_tokens > 0) {
    const int64_t cap = info.max_context() - kBurstNewTokens - 1;
    if (burst_tokens > cap) {
      std::cerr << "bench serve: --burst-prompt-tokens " << burst_tokens
                << " capped to " << cap << " (context " << info.max_context()
                << ")" << std::endl;
      burst_tokens = cap;
    }
    std::string text;
    for (const BenchPrompt& p : prompts) absl::StrAppend(&text, p.text, "\n\n");
    ASSIGN_OR_RETURN(std::vector<int32_t> ids,
                     PromptIds(*tokenizer, text, burst_tokens, burst_tokens));
    burst = request_for(-1, kBurstNewTokens, ids, "bench-burst");
  }

  LoadShape shape;
  shape.poisson = arrival == "poisson";
  shape.concurrency = concurrency;
  shape.request_rate = absl::GetFlag(FLAGS_request_rate);
  const bool deterministic = !(base.temperature() > 0) || base.has_seed();
  const bool check = deterministic && absl::GetFlag(FLAGS_check_outputs);
  nlohmann::json out = {
      {"server", address},
      {"in_process", running != nullptr},
      {"model", info.model_name()},
      {"dtype", info.dtype()},
      {"arrival", arrival},
      {"protocol", protocol},
      {"concurrency", concurrency},
      {"request_rate", shape.poisson ? shape.request_rate : 0.0},
      {"max_new_tokens", max_new_tokens},
      {"prompts", path},
      {"checked", check},
      {"modes", nlohmann::json::array()}};
  if (running != nullptr) out["threads"] = at::get_num_threads();
  if (!absl::GetFlag(FLAGS_json)) {
    std::printf(
        "bench serve: %s (%s) at %s%s, %s, %d requests x %lld new tokens\n",
        info.model_name().c_str(), info.dtype().c_str(), address.c_str(),
        running != nullptr
            ? absl::StrCat(" (in-process, ", at::get_num_threads(),
                           " threads, planner ", running->planner_where, ")")
                  .c_str()
            : "",
        shape.poisson
            ? absl::StrCat("Poisson ", shape.request_rate, "/s").c_str()
            : absl::StrCat(concurrency, " streams closed loop").c_str(),
        num_requests, static_cast<long long>(max_new_tokens));
    std::printf("%-16s %5s %7s %8s %10s %10s %9s %9s %8s %8s %7s\n",
                "mode, phase", "reqs", "tokens", "wall s", "out tok/s",
                "dec tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
                "tok/step");
    std::printf("%-16s %5s %7s %8s %10s %10s %9s %9s %8s %8s %7s\n", "", "", "",
                "", "", "", "ms", "ms", "ms", "ms", "");
  }

  // The runs: the --modes list, --rounds times.
  std::vector<SpeculationMode> runs;
  for (int r = 0; r < rounds; ++r) {
    runs.insert(runs.end(), modes.begin(), modes.end());
  }

  // Per run: at a mode's first run 1. warm-up, 2. each prompt alone; then
  // 3. the load. The first mode's single streams are the reference output of
  // every stream.
  std::vector<std::vector<int32_t>> reference;
  std::vector<std::string> errors;
  int mismatches = 0;
  double first_load_rate = 0;
  bool first_request = true;
  std::set<SpeculationMode> modes_run;
  for (size_t run = 0; run < runs.size(); ++run) {
    const SpeculationMode mode = runs[run];
    const std::string name = SpeculationModeName(mode);
    // A mode's later runs go straight to the load, so that the load runs of
    // the list follow one another within milliseconds.
    const bool first_of_mode = modes_run.insert(mode).second;
    auto set_mode = [&](PlannedRequest& r) {
      v1::SpeculationOptions* spec = r.request.mutable_speculation();
      spec->set_mode(ToWireMode(mode));
      if (!DraftsWithFixedMask(mode)) spec->clear_static_mask();
    };
    PlannedRequest warm =
        request_for(0, kWarmupNewTokens, prompt_ids[0], "bench-warmup");
    set_mode(warm);
    for (PlannedRequest& r : singles) set_mode(r);
    for (PlannedRequest& r : load) set_mode(r);
    if (burst.has_value()) set_mode(*burst);
    if (first_of_mode) {
      // The very first request of an in-process server is timed from the
      // server's start: the time to the first served token.
      const bool from_start = first_request && running != nullptr;
      first_request = false;
      const StreamRecord r =
          stream(warm, from_start ? started : Clock::now(), nullptr);
      if (!r.status.ok()) {
        return absl::Status(
            static_cast<absl::StatusCode>(r.status.error_code()),
            absl::StrCat("bench serve: ", name,
                         " warm-up request: ", r.status.error_message()));
      }
      if (from_start && !r.chunk_times.empty()) {
        out["startup"] = {{"serving_seconds", serving_seconds},
                          {"first_served_token_seconds", r.chunk_times[0]},
                          {"profile_pending", running->profile_pending()}};
        if (!absl::GetFlag(FLAGS_json)) {
          std::printf(
              "startup: serving %.2f s after start, first served token at "
              "%.2f s (%s, latency profile %s)\n",
              serving_seconds, r.chunk_times[0], name.c_str(),
              running->profile_pending() ? "still being measured" : "ready");
        }
      }
    }
    // Planned modes are timed planning: an in-process server whose profile
    // is still measured in the background (it measures while the server is
    // idle) is waited for first.
    if (first_of_mode && IsPlanned(mode) && running != nullptr &&
        running->profile_pending()) {
      const Clock::time_point wait_start = Clock::now();
      if (!absl::GetFlag(FLAGS_json)) {
        std::printf(
            "%s: waiting for the latency profile (measured in the "
            "background)\n",
            name.c_str());
        std::fflush(stdout);
      }
      while (running->profile_pending() &&
             !running->background_profile->finished()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      if (running->profile_pending()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "bench serve: ", name,
            ": the latency profile could not be measured (see the log)"));
      }
      out["profile_wait_seconds"] = SecondsSince(wait_start);
    }
    // Plan solves of the in-process planner, by phase.
    auto solves = [&]() -> int64_t {
      return running != nullptr && running->planner.local != nullptr
                 ? running->planner.local->solved()
                 : 0;
    };
    const int64_t solves_start = solves();
    std::optional<PhaseResult> single_phase;
    if (first_of_mode) {
      single_phase =
          RunPhase(stream, singles, LoadShape{false, 1, 0}, std::nullopt);
    }
    const int64_t solves_single = solves();
    BatchEngineStats before;
    std::optional<PeakSampler> memory;  // an in-process server's
    if (running != nullptr) {
      before = running->server->service().engine().stats();
      // Used blocks include what plan snapshots hold (kv_pool.h).
      KvPool* pool = running->kv_pool.get();
      memory.emplace(
          [pool]() -> PeakSampler::Sample {
            return {pool->used_blocks(), pool->reserved_blocks(),
                    ResidentSetBytes()};
          },
          absl::Milliseconds(10));
    }
    const PhaseResult load_phase = RunPhase(stream, load, shape, burst);
    BatchEngineStats after;
    PeakSampler::Sample peaks;
    if (running != nullptr) {
      after = running->server->service().engine().stats();
      peaks = memory->Stop();
    }
    const int64_t solves_load = solves();

    const PhaseSummary loaded = Summarize(load_phase);
    if (reference.empty()) {
      for (const StreamRecord& r : single_phase->streams)
        reference.push_back(r.ids);
    }
    int mode_mismatches = 0;
    int profile_pending = 0;  // streams that could not plan (gRPC finals)
    std::vector<const PhaseResult*> phases = {&load_phase};
    if (single_phase.has_value()) phases.insert(phases.begin(), &*single_phase);
    for (const PhaseResult* phase : phases) {
      for (const StreamRecord& r : phase->streams) {
        if (r.final.planning().profile_pending()) ++profile_pending;
        if (!r.status.ok()) {
          errors.push_back(absl::StrCat(
              name, ", prompt ", r.prompt, ": ",
              absl::StatusCodeToString(
                  static_cast<absl::StatusCode>(r.status.error_code())),
              " ", r.status.error_message()));
        } else if (check && r.ids != reference[r.prompt]) {
          ++mode_mismatches;
        }
      }
    }
    if (load_phase.burst.has_value() && !load_phase.burst->status.ok()) {
      errors.push_back(absl::StrCat(
          name, ", burst: ", load_phase.burst->status.error_message()));
    }
    mismatches += mode_mismatches;
    if (first_load_rate == 0) first_load_rate = loaded.decode_tokens_per_second;
    nlohmann::json row = {
        {"spec", name},
        {"round", static_cast<int>(run / modes.size())},
        {"load", PhaseJson(loaded)},
        {"itl_p99_over_p50",
         loaded.itl_p50 > 0 ? loaded.itl_p99 / loaded.itl_p50 : 0.0},
        {"load_decode_vs_first_mode",
         first_load_rate > 0 ? loaded.decode_tokens_per_second / first_load_rate
                             : 0.0},
        {"mismatches", mode_mismatches},
        {"profile_pending_requests", profile_pending}};
    // Load against single: at a mode's first run, which has a single phase.
    std::optional<PhaseSummary> single;
    if (single_phase.has_value()) {
      single = Summarize(*single_phase);
      auto ratio = [](double a, double b) { return b > 0 ? a / b : 0.0; };
      row["single"] = PhaseJson(*single);
      row["output_throughput_ratio"] = ratio(loaded.output_tokens_per_second,
                                             single->output_tokens_per_second);
      row["decode_throughput_ratio"] = ratio(loaded.decode_tokens_per_second,
                                             single->decode_tokens_per_second);
      row["itl_p50_ratio"] = ratio(loaded.itl_p50, single->itl_p50);
    }
    if (running != nullptr) {
      const int64_t steps = after.steps - before.steps;
      row["engine"] = {
          {"steps", steps},
          {"mean_batch_size",
           steps > 0
               ? static_cast<double>(after.decode_rows - before.decode_rows) /
                     steps
               : 0.0},
          {"rows", after.rows - before.rows},
          {"prefill_chunks", after.prefill_chunks - before.prefill_chunks},
          {"plain_steps", after.plain_steps - before.plain_steps},
          {"budgeted_prefill_steps",
           after.budgeted_prefill_steps - before.budgeted_prefill_steps},
          {"plan_solves_single", solves_single - solves_start},
          {"plan_solves_load", solves_load - solves_single},
          {"kv_blocks_total", running->kv_pool->total_blocks()},
          {"kv_bytes_per_block", running->kv_pool->bytes_per_block()},
          {"peak_kv_blocks_used", peaks.at(0)},
          {"peak_kv_blocks_reserved", peaks.at(1)},
          {"peak_resident_bytes", peaks.at(2)}};
    }
    if (load_phase.burst.has_value()) {
      const StreamRecord& b = *load_phase.burst;
      // The streams' per-token gaps that overlap the burst's prefill.
      double window_max = 0;
      for (const StreamRecord& r : load_phase.streams) {
        for (size_t k = 1; k < r.chunk_times.size(); ++k) {
          if (r.chunk_times[k] > b.send &&
              r.chunk_times[k - 1] < b.send + b.ttft()) {
            window_max =
                std::max(window_max, (r.chunk_times[k] - r.chunk_times[k - 1]) /
                                         std::max(1, r.chunk_tokens[k]));
          }
        }
      }
      row["burst"] = {{"prompt_tokens", burst_tokens},
                      {"ttft_seconds", b.ttft()},
                      {"sent_at_seconds", b.send},
                      {"ok", b.status.ok()},
                      {"max_itl_during_prefill_seconds", window_max}};
    }
    if (!absl::GetFlag(FLAGS_json)) {
      if (single.has_value()) {
        PrintPhase(absl::StrCat(name, ", single").c_str(), *single);
      }
      PrintPhase(absl::StrCat(name, ", load").c_str(), loaded);
      if (single.has_value()) {
        std::printf(
            "  load / single: output tok/s %.2fx, decode tok/s %.2fx, ITL p50 "
            "%.2fx; ",
            row["output_throughput_ratio"].get<double>(),
            row["decode_throughput_ratio"].get<double>(),
            row["itl_p50_ratio"].get<double>());
      } else {
        std::printf("  round %d: ", row["round"].get<int>() + 1);
      }
      std::printf("load ITL p99 / p50 %.2fx; load decode tok/s vs %s %.3fx\n",
                  row["itl_p99_over_p50"].get<double>(),
                  SpeculationModeName(modes.front()).c_str(),
                  row["load_decode_vs_first_mode"].get<double>());
      if (profile_pending > 0) {
        std::printf(
            "  %d request(s) decoded plainly: the server was still measuring "
            "its latency profile\n",
            profile_pending);
      }
      if (row.contains("engine")) {
        const auto& e = row["engine"];
        std::printf(
            "  engine (load): %lld steps, mean batch %.2f, %lld prefill "
            "chunks (%lld cut by the step-time budget), %lld steps with "
            "drafts dropped; plan solves: %lld single, %lld load\n",
            e["steps"].get<long long>(), e["mean_batch_size"].get<double>(),
            e["prefill_chunks"].get<long long>(),
            e["budgeted_prefill_steps"].get<long long>(),
            e["plain_steps"].get<long long>(),
            e["plan_solves_single"].get<long long>(),
            e["plan_solves_load"].get<long long>());
        std::printf(
            "  memory (load): K/V blocks used at most %lld of %lld (plan "
            "snapshots' included), reserved at most %lld; resident at most "
            "%.1f MiB\n",
            e["peak_kv_blocks_used"].get<long long>(),
            e["kv_blocks_total"].get<long long>(),
            e["peak_kv_blocks_reserved"].get<long long>(),
            e["peak_resident_bytes"].get<double>() / (1 << 20));
      }
      if (row.contains("burst")) {
        const auto& b = row["burst"];
        std::printf(
            "  burst: a %lld-token prompt at %.2f s, TTFT %.1f ms; the "
            "streams' largest per-token gap while it prefilled %.1f ms\n",
            static_cast<long long>(burst_tokens),
            b["sent_at_seconds"].get<double>(),
            1e3 * b["ttft_seconds"].get<double>(),
            1e3 * b["max_itl_during_prefill_seconds"].get<double>());
      }
    }
    out["modes"].push_back(std::move(row));
  }
  out["mismatches"] = mismatches;
  out["errors"] = errors;
  // A mode listed more than once (off,static,static,off: drift on a shared
  // machine hits both alike) is summarized by its mean over its runs.
  std::map<std::string, std::pair<double, int>> by_mode;  // sum, runs
  std::vector<std::string> order;
  for (const nlohmann::json& row : out["modes"]) {
    const std::string name = row["spec"];
    if (!by_mode.count(name)) order.push_back(name);
    by_mode[name].first += row["load"]["decode_tokens_per_s"].get<double>();
    by_mode[name].second += 1;
  }
  const double first_mean =
      by_mode[order.front()].first / by_mode[order.front()].second;
  // Each run against the first mode's runs just before and after it (with
  // --modes off,static,off,knapspec,off each is bracketed): the machine's
  // drift during the command hits those alike.
  std::vector<std::string> run_names;
  std::vector<double> run_rates;
  for (const nlohmann::json& row : out["modes"]) {
    run_names.push_back(row["spec"]);
    run_rates.push_back(row["load"]["decode_tokens_per_s"].get<double>());
  }
  const std::vector<double> adjacent =
      RatiosToAdjacentBaseline(run_names, run_rates, order.front());
  std::map<std::string, std::vector<double>> adjacent_by_mode;
  for (size_t k = 0; k < adjacent.size(); ++k) {
    out["modes"][k]["load_decode_vs_adjacent_first_mode"] = adjacent[k];
    if (adjacent[k] > 0) adjacent_by_mode[run_names[k]].push_back(adjacent[k]);
  }
  nlohmann::json summary = nlohmann::json::array();
  for (const std::string& name : order) {
    const double mean = by_mode[name].first / by_mode[name].second;
    const std::vector<double>& adjacent_runs = adjacent_by_mode[name];
    // Over the runs' ratios to the first mode's runs around them; for the
    // first mode itself, its runs against each other: the spread that the
    // machine alone gives.
    nlohmann::json adjacent_spread = nullptr;
    if (!adjacent_runs.empty()) {
      adjacent_spread = {{"median", Median(adjacent_runs)},
                         {"min", *std::min_element(adjacent_runs.begin(),
                                                   adjacent_runs.end())},
                         {"max", *std::max_element(adjacent_runs.begin(),
                                                   adjacent_runs.end())}};
    }
    summary.push_back(
        {{"spec", name},
         {"runs", by_mode[name].second},
         {"load_decode_tokens_per_s", mean},
         {"vs_first_mode", first_mean > 0 ? mean / first_mean : 0.0},
         {"vs_adjacent_first_mode", adjacent_runs},
         {"vs_adjacent_first_mode_spread", adjacent_spread}});
  }
  out["mode_summary"] = summary;

  if (absl::GetFlag(FLAGS_json)) {
    std::cout << out.dump(2) << std::endl;
  } else {
    if (by_mode.size() > 1) {
      std::printf("load decode tok/s by mode (mean over its runs):");
      for (const nlohmann::json& m : summary) {
        std::printf(" %s %.1f (%.3fx, %d run%s)",
                    m["spec"].get<std::string>().c_str(),
                    m["load_decode_tokens_per_s"].get<double>(),
                    m["vs_first_mode"].get<double>(), m["runs"].get<int>(),
                    m["runs"].get<int>() == 1 ? "" : "s");
      }
      std::printf("\n");
      std::printf(
          "load decode tok/s of each run against the %s runs around it:",
          order.front().c_str());
      for (const nlohmann::json& m : summary) {
        std::printf("\n  %s", m["spec"].get<std::string>().c_str());
        for (const nlohmann::json& r : m["vs_adjacent_first_mode"]) {
          std::printf(" %.3fx", r.get<double>());
        }
        const nlohmann::json& spread = m["vs_adjacent_first_mode_spread"];
        if (spread.is_null()) {
          std::printf(" -");
        } else if (m["vs_adjacent_first_mode"].size() > 1) {
          std::printf(" (median %.3fx, %.3f-%.3fx)",
                      spread["median"].get<double>(),
                      spread["min"].get<double>(), spread["max"].get<double>());
        }
      }
      std::printf("\n");
    }
    if (check) {
      std::printf(
          "outputs: %d stream(s) differ from the %s single-stream output\n",
          mismatches, SpeculationModeName(modes.front()).c_str());
    } else {
      std::printf(
          "outputs: not compared (%s)\n",
          deterministic ? "--check-outputs=false" : "sampling without --seed");
    }
    for (const std::string& e : errors) std::printf("error: %s\n", e.c_str());
  }
  if (!errors.empty()) {
    return absl::InternalError(
        absl::StrCat("bench serve: ", errors.size(),
                     " stream(s) failed; first: ", errors.front()));
  }
  if (mismatches > 0) {
    return absl::InternalError(absl::StrCat(
        "bench serve: ", mismatches, " stream(s) differ from the ",
        SpeculationModeName(modes.front()), " single-stream output"));
  }
  return absl::OkStatus();
}

}  // namespace

int RunBenchServe() { return ExitCode(BenchServe(), "bench serve"); }

}  // namespace knapserve
