// Helpers shared by the end-to-end tests of the binaries
// (knapserve_cli_test.cc: one-process commands; knapserve_server_test.cc:
// servers, deployments and their clients): running `knapserve` and parsing
// its JSON, the model flags, fixtures made once per test process (a tiny
// random model, a stories260k latency profile), and polling a server's
// health. Header-only; the fixtures are function-local statics, so each
// test binary makes them at most once. Call from the test thread.
#ifndef KNAPSERVE_TESTS_TOOLS_CLI_TEST_UTIL_H_
#define KNAPSERVE_TESTS_TOOLS_CLI_TEST_UTIL_H_

#include <gmock/gmock.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "testing/build_paths.h"
#include "tests/testing/test_models.h"
#include "tests/testing/test_util.h"

namespace knapserve {
namespace cli_test {

using ::testing::HasSubstr;
using Outcome = knapserve::testing::ProcessOutcome;
using knapserve::testing::RunProcess;

// The greedy continuation of "Zoo" (57 tokens) of the bundled stories260k
// (tools/models/stories260k/PROVENANCE.md: the text llama2.c64 prints).
inline const std::vector<int32_t> kZooPromptIds = {1, 410, 469, 347};
inline const std::vector<int32_t> kZooGreedyIds = {
    286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410,
    408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394,
    261, 370, 432, 352, 266, 268, 388, 426, 338, 391, 266, 267, 337, 335, 312,
    432, 398, 358, 279, 292, 416, 439, 413, 391, 267, 337, 335};

inline Outcome RunKnapserve(const std::vector<std::string>& args,
                            const std::vector<std::string>& env_changes = {}) {
  std::vector<std::string> argv = {knapserve::testing::kKnapserveBinary};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunProcess(std::move(argv), env_changes);
}

inline std::string Describe(const std::vector<std::string>& args,
                            const Outcome& outcome) {
  std::string command = "knapserve";
  for (const std::string& a : args) absl::StrAppend(&command, " ", a);
  return absl::StrCat(command, "\nexit ", outcome.exit_code, "\nstdout:\n",
                      outcome.out, "\nstderr:\n", outcome.err);
}

// Runs and expects exit 0 and stdout holding one JSON value.
inline nlohmann::json RunJson(
    const std::vector<std::string>& args,
    const std::vector<std::string>& env_changes = {}) {
  const Outcome outcome = RunKnapserve(args, env_changes);
  EXPECT_EQ(outcome.exit_code, 0) << Describe(args, outcome);
  nlohmann::json parsed =
      nlohmann::json::parse(outcome.out, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(parsed.is_discarded()) << "stdout is not JSON\n"
                                      << Describe(args, outcome);
  return parsed;
}

// Appends the model and thread flags (Abseil takes flags anywhere).
inline std::vector<std::string> Stories(std::vector<std::string> args) {
  args.insert(args.end(), {"--model", knapserve::testing::Stories260kDir(),
                           "--threads", "1"});
  return args;
}

inline std::vector<int32_t> Ids(const nlohmann::json& value) {
  if (!value.is_array()) return {};
  return value.get<std::vector<int32_t>>();
}

// `generate` of "Once upon a time", greedy, exactly `new_tokens` tokens, as
// one JSON object (model flags not included).
inline std::vector<std::string> GreedyJson(int new_tokens) {
  return {"generate",
          "--prompt",
          "Once upon a time",
          "--max-new-tokens",
          std::to_string(new_tokens),
          "--temperature",
          "0",
          "--ignore-eos",
          "--json"};
}

// A tiny random model written by `knapserve make-model` itself (once).
inline const std::string& TinyModelDir() {
  static const std::string* dir = [] {
    auto* path =
        new std::string(knapserve::testing::MakeTempDir("cli_model") + "/tiny");
    const std::vector<std::string> args = {
        "make-model", "--shape", "tiny-llama", "--out",
        *path,        "--dtype", "fp32"};
    const Outcome outcome = RunKnapserve(args);
    EXPECT_EQ(outcome.exit_code, 0) << Describe(args, outcome);
    return path;
  }();
  return *dir;
}

inline std::vector<std::string> Tiny(std::vector<std::string> args) {
  args.insert(args.end(), {"--model", TinyModelDir(), "--threads", "1"});
  return args;
}

// `knapserve profile` writes a profile (once per process) that generate
// --spec knapspec|clasp then plans with.
inline const std::string& StoriesProfile() {
  static const std::string* path = [] {
    auto* file = new std::string(
        knapserve::testing::MakeTempDir("cli_profile") + "/p.json");
    const std::vector<std::string> args =
        Stories({"profile", "--out", *file, "--profile-repeats", "3",
                 "--profile-contexts", "32,128,256"});
    const Outcome outcome = RunKnapserve(args);
    EXPECT_EQ(outcome.exit_code, 0) << Describe(args, outcome);
    EXPECT_THAT(outcome.out, HasSubstr("t_attn(n)"));
    EXPECT_THAT(outcome.out, HasSubstr("engine beyond the pass prices"));
    return file;
  }();
  return *path;
}

// Writes two domains of text into `dir` (stories.txt, numbers.txt: four
// samples each) and returns the --domains value naming them.
inline std::string WriteTwoDomains(const std::string& dir) {
  std::ofstream(dir + "/stories.txt")
      << "Once upon a time, there was a little girl named Lily.\n\n"
         "Tom had a red ball. He liked to play with it in the park.\n\n"
         "The cat was very happy. She jumped on the bed and smiled.\n\n"
         "One day, a big dog saw a bird in the tree.\n";
  std::ofstream(dir + "/numbers.txt")
      << "1 2 3 4 5 6 7 8 9 10 11 12\n\n20 30 40 50 60 70 80 90\n\n"
         "7 14 21 28 35 42 49 56 63\n\n100 200 300 400 500 600 700\n";
  return "stories=" + dir + "/stories.txt,numbers=" + dir + "/numbers.txt";
}

// The port a server process logged for its plaintext health checks
// ("(plaintext) at port N"); "" if none.
inline std::string HealthPortOf(const std::string& log) {
  const std::string mark = "(plaintext) at port ";
  const size_t at = log.find(mark);
  if (at == std::string::npos) return "";
  const size_t begin = at + mark.size();
  return log.substr(begin, log.find('\n', begin) - begin);
}

// grpc.health.v1.Health/Check(service) over plaintext at `address`, with the
// messages written by hand (HealthCheckRequest{service = 1},
// HealthCheckResponse{status = 1}): the status number (1 SERVING,
// 2 NOT_SERVING), or -1 with the call's error code in `code`.
inline int HealthStatus(const std::string& address, const std::string& service,
                        grpc::StatusCode* code = nullptr) {
  auto channel =
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  std::string request;
  if (!service.empty()) {
    request.push_back('\x0a');
    request.push_back(static_cast<char>(service.size()));
    request += service;
  }
  grpc::Slice slice(request);
  grpc::ByteBuffer send(&slice, 1);
  grpc::ByteBuffer receive;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(10));
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status status;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(),
                 &send, &receive, [&](grpc::Status s) {
                   std::lock_guard<std::mutex> lock(mu);
                   status = s;
                   done = true;
                   cv.notify_one();
                 });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done; });
  if (code != nullptr) *code = status.error_code();
  if (!status.ok()) return -1;
  std::vector<grpc::Slice> slices;
  if (!receive.Dump(&slices).ok()) return -1;
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return bytes.size() >= 2 && bytes[0] == '\x08' ? bytes[1] : 0;
}

// Polls `condition` every 50 ms until it holds or `seconds` pass.
inline bool WaitUntil(const std::function<bool()>& condition, double seconds) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!condition()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return true;
}

// The latency profiles in a profile cache folder (not the thread choices).
inline std::vector<std::string> ProfilesIn(const std::string& dir) {
  std::vector<std::string> files;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() > 5 && name.substr(name.size() - 5) == ".json" &&
        name.find("_threads") == std::string::npos) {
      files.push_back(name);
    }
  }
  return files;
}

// Every key path of a JSON object ("guard.checks"), for comparing shapes.
inline void KeyPaths(const nlohmann::json& j, const std::string& prefix,
                     std::set<std::string>& out) {
  if (!j.is_object()) return;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string path =
        prefix.empty() ? it.key() : prefix + "." + it.key();
    out.insert(path);
    KeyPaths(it.value(), path, out);
  }
}
inline std::set<std::string> KeyPaths(const nlohmann::json& j) {
  std::set<std::string> out;
  KeyPaths(j, "", out);
  return out;
}

}  // namespace cli_test
}  // namespace knapserve

#endif  // KNAPSERVE_TESTS_TOOLS_CLI_TEST_UTIL_H_
