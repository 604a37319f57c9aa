// End-to-end tests of the `knapserve` binary: each test runs the real binary
// (built by the knapserve target) as a child process, parses what it prints,
// and checks exit codes and error messages.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/model/simd_target.h"
#include "common/text/tokenizer.h"
#include "knapserve/v1/generation.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "testing/build_paths.h"
#include "tests/testing/test_models.h"
#include "tests/testing/test_util.h"
#include "tools/prompt_set.h"
#include "tools/shared_data.h"

extern char** environ;

namespace knapserve {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using testing::ReadFile;

// The greedy continuation of "Zoo" (57 tokens) of the bundled stories260k
// (tools/models/stories260k/PROVENANCE.md: the text llama2.c64 prints).
const std::vector<int32_t> kZooPromptIds = {1, 410, 469, 347};
const std::vector<int32_t> kZooGreedyIds = {
    286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410,
    408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394,
    261, 370, 432, 352, 266, 268, 388, 426, 338, 391, 266, 267, 337, 335, 312,
    432, 398, 358, 279, 292, 416, 439, 413, 391, 267, 337, 335};

using Outcome = testing::ProcessOutcome;
using testing::RunProcess;

Outcome RunKnapserve(const std::vector<std::string>& args,
                     const std::vector<std::string>& env_changes = {}) {
  std::vector<std::string> argv = {knapserve::testing::kKnapserveBinary};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunProcess(std::move(argv), env_changes);
}

std::string Describe(const std::vector<std::string>& args,
                     const Outcome& outcome) {
  std::string command = "knapserve";
  for (const std::string& a : args) absl::StrAppend(&command, " ", a);
  return absl::StrCat(command, "\nexit ", outcome.exit_code, "\nstdout:\n",
                      outcome.out, "\nstderr:\n", outcome.err);
}

// Runs and expects exit 0 and stdout holding one JSON value.
nlohmann::json RunJson(const std::vector<std::string>& args,
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
std::vector<std::string> Stories(std::vector<std::string> args) {
  args.insert(args.end(), {"--model", knapserve::testing::Stories260kDir(),
                           "--threads", "1"});
  return args;
}

std::vector<int32_t> Ids(const nlohmann::json& value) {
  if (!value.is_array()) return {};
  return value.get<std::vector<int32_t>>();
}

// `generate` of "Once upon a time", greedy, exactly `new_tokens` tokens, as
// one JSON object (model flags not included).
std::vector<std::string> GreedyJson(int new_tokens) {
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
const std::string& TinyModelDir() {
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

std::vector<std::string> Tiny(std::vector<std::string> args) {
  args.insert(args.end(), {"--model", TinyModelDir(), "--threads", "1"});
  return args;
}

// KNAPSERVE_SIMD pins the kernels' target: every target the CPU runs gives
// the golden ids, the log names it, and a bad name is a clear error.
TEST(KnapserveCliTest, KnapserveSimdPinsTheTargetAndRefusesBadNames) {
  for (const std::string& target : knapserve::simd::SupportedTargets()) {
    const std::vector<std::string> args =
        Stories({"generate", "--prompt", "Zoo", "--max-new-tokens", "57",
                 "--temperature", "0", "--json"});
    const Outcome outcome = RunKnapserve(args, {"KNAPSERVE_SIMD=" + target});
    ASSERT_EQ(outcome.exit_code, 0) << Describe(args, outcome);
    EXPECT_THAT(outcome.err, HasSubstr("simd " + target + " (supported"));
    EXPECT_THAT(outcome.err, HasSubstr("pinned by KNAPSERVE_SIMD"));
    const nlohmann::json out = nlohmann::json::parse(outcome.out);
    EXPECT_THAT(Ids(out["output_ids"]), ElementsAreArray(kZooGreedyIds))
        << target;
  }
  const std::vector<std::string> args =
      Stories({"generate", "--prompt", "Zoo", "--max-new-tokens", "2"});
  const Outcome bad = RunKnapserve(args, {"KNAPSERVE_SIMD=avx9000"});
  EXPECT_NE(bad.exit_code, 0) << Describe(args, bad);
  EXPECT_THAT(bad.err, HasSubstr("KNAPSERVE_SIMD: unknown SIMD target"));
}

// --threads auto (the default) measures once, then reads the profile cache,
// and says what it chose; a bad --threads is a clear error.
TEST(KnapserveCliTest, ThreadsAutoMeasuresOnceAndSaysWhatItChose) {
  const std::string cache = knapserve::testing::MakeTempDir("threads_cache");
  const std::vector<std::string> args = {"generate",
                                         "--prompt",
                                         "Zoo",
                                         "--max-new-tokens",
                                         "4",
                                         "--model",
                                         knapserve::testing::Stories260kDir(),
                                         "--profile-cache",
                                         cache};
  const Outcome first = RunKnapserve(args);
  ASSERT_EQ(first.exit_code, 0) << Describe(args, first);
  EXPECT_THAT(first.err, HasSubstr("threads auto: decode "));
  EXPECT_THAT(first.err, HasSubstr("measured now, stored in " + cache));
  const Outcome second = RunKnapserve(args);
  ASSERT_EQ(second.exit_code, 0) << Describe(args, second);
  EXPECT_THAT(second.err, HasSubstr("threads auto: decode "));
  EXPECT_THAT(second.err, HasSubstr("(from " + cache));
  std::vector<std::string> explicit_args = args;
  explicit_args.insert(explicit_args.end(), {"--threads", "1"});
  const Outcome fixed = RunKnapserve(explicit_args);
  ASSERT_EQ(fixed.exit_code, 0) << Describe(explicit_args, fixed);
  EXPECT_THAT(fixed.err, HasSubstr("threads 1 (--threads)"));
  std::vector<std::string> bad_args = args;
  bad_args.insert(bad_args.end(), {"--threads", "many"});
  const Outcome bad = RunKnapserve(bad_args);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_THAT(bad.err, HasSubstr("--threads must be auto or a count"));
}

TEST(KnapserveCliTest, GreedyGenerateReproducesGoldenIds) {
  const nlohmann::json out =
      RunJson(Stories({"generate", "--prompt", "Zoo", "--max-new-tokens", "57",
                       "--temperature", "0", "--json"}));
  EXPECT_THAT(Ids(out["prompt_ids"]), ElementsAreArray(kZooPromptIds));
  EXPECT_THAT(Ids(out["output_ids"]), ElementsAreArray(kZooGreedyIds));
  ASSERT_TRUE(out["text"].is_string());
  EXPECT_THAT(out["text"].get<std::string>(),
              HasSubstr("was a little girl named Lily"));
  for (const char* key : {"prefill_tokens_per_s", "decode_tokens_per_s"}) {
    ASSERT_TRUE(out.contains(key)) << key;
    EXPECT_GT(out[key].get<double>(), 0) << key;
  }
  EXPECT_EQ(out["finish_reason"], "length");
  EXPECT_EQ(out["spec"], "off");
  const nlohmann::json& spec = out["speculation"];
  for (const char* key :
       {"drafts", "draft_tokens", "accepted_tokens", "accepted_per_position",
        "acceptance_rate", "mean_acceptance_length"}) {
    EXPECT_TRUE(spec.contains(key)) << key;
  }
  EXPECT_EQ(spec["drafts"], 0);
}

TEST(KnapserveCliTest, StaticSpeculationGivesTheSameGreedyIds) {
  const nlohmann::json out =
      RunJson(Stories({"generate", "--prompt", "Zoo", "--max-new-tokens", "57",
                       "--temperature", "0", "--spec", "static", "--skip",
                       "a1,m3", "--max-draft", "4", "--json"}));
  EXPECT_THAT(Ids(out["prompt_ids"]), ElementsAreArray(kZooPromptIds));
  EXPECT_THAT(Ids(out["output_ids"]), ElementsAreArray(kZooGreedyIds));
  EXPECT_EQ(out["spec"], "static");
  EXPECT_EQ(out["mask"], "a1,m3");
  EXPECT_EQ(out["max_draft"], 4);
  const nlohmann::json& spec = out["speculation"];
  EXPECT_GT(spec["drafts"].get<int64_t>(), 0);
  EXPECT_LE(spec["accepted_tokens"].get<int64_t>(),
            spec["draft_tokens"].get<int64_t>());
  EXPECT_LE(spec["accepted_per_position"].size(), 4u);
  EXPECT_GE(spec["mean_acceptance_length"].get<double>(), 1.0);
}

// `knapserve train-exit-heads` writes trained heads into a temporary folder
// (never beside the shared checkpoint); SpecBound with them, and with the
// training-free heads, gives the golden greedy ids; heads made for another
// model are refused, naming the file.
TEST(KnapserveCliTest, TrainedExitHeadsThenSpecBoundGivesTheSameGreedyIds) {
  knapserve::testing::ScopedTempDir dir("cli_exit_heads");
  const std::string corpus = dir.path() + "/corpus.txt";
  std::ofstream(corpus)
      << "Once upon a time, there was a little girl named Lily.\nShe liked "
         "to play.\n\nTom had a big red ball. He kicked it high.\n\n"
         "The sun was shining and the birds were singing.\n";
  const std::string heads = dir.path() + "/heads.safetensors";
  const nlohmann::json trained = RunJson(Stories(
      {"train-exit-heads", "--corpus", corpus, "--out", heads, "--steps", "30",
       "--batch", "2", "--seq-len", "16", "--rank", "4", "--lr", "0.01"}));
  EXPECT_EQ(trained["documents"], 3);
  EXPECT_EQ(trained["out"], heads);
  EXPECT_LT(trained["last_tenth_mean_loss"].get<double>(),
            trained["first_tenth_mean_loss"].get<double>());
  for (const std::string& which : {std::string("model"), heads}) {
    const nlohmann::json out = RunJson(Stories(
        {"generate", "--prompt", "Zoo", "--max-new-tokens", "57",
         "--temperature", "0", "--spec", "specbound", "--exit-heads", which,
         "--specbound-lambda", "0.5", "--specbound-t0", "2", "--json"}));
    EXPECT_THAT(Ids(out["output_ids"]), ElementsAreArray(kZooGreedyIds))
        << which;
    EXPECT_EQ(out["spec"], "specbound");
    const nlohmann::json& sb = out["speculation"]["specbound"];
    EXPECT_EQ(sb["heads"], which == "model" ? "training-free" : "trained");
    EXPECT_GT(out["speculation"]["drafts"].get<int64_t>(), 0) << which;
    EXPECT_GE(sb["mean_exit_depth"].get<double>(), 1.0);
  }
  const std::vector<std::string> wrong =
      Tiny({"generate", "--prompt", "Zoo", "--spec", "specbound",
            "--exit-heads", heads});
  const Outcome outcome = RunKnapserve(wrong);
  EXPECT_NE(outcome.exit_code, 0) << Describe(wrong, outcome);
  EXPECT_THAT(outcome.err, AllOf(HasSubstr(heads), HasSubstr("fingerprint")));
}

// `knapserve profile` writes a profile (once per process) that generate
// --spec knapspec|clasp then plans with.
const std::string& StoriesProfile() {
  static const std::string* path = [] {
    auto* file = new std::string(
        knapserve::testing::MakeTempDir("cli_profile") + "/p.json");
    const std::vector<std::string> args =
        Stories({"profile", "--out", *file, "--profile-repeats", "3",
                 "--profile-contexts", "32,128,256"});
    const Outcome outcome = RunKnapserve(args);
    EXPECT_EQ(outcome.exit_code, 0) << Describe(args, outcome);
    EXPECT_THAT(outcome.out, HasSubstr("t_attn(n)"));
    return file;
  }();
  return *path;
}

TEST(KnapserveCliTest, ProfileThenPlannedGenerationGivesTheSameGreedyIds) {
  const nlohmann::json profile =
      nlohmann::json::parse(ReadFile(StoriesProfile()), nullptr, false);
  ASSERT_FALSE(profile.is_discarded());
  EXPECT_EQ(profile["device"], "cpu");
  EXPECT_EQ(profile["dtype"], "fp32");
  const std::vector<std::string> base = GreedyJson(150);
  std::vector<std::string> off_args = base;
  const nlohmann::json off = RunJson(Stories(off_args));
  for (const char* mode : {"knapspec", "clasp"}) {
    std::vector<std::string> args = base;
    args.insert(args.end(), {"--spec", mode, "--profile", StoriesProfile(),
                             "--plan-interval", "8", "--reference-steps", "3",
                             "--clasp-layers", "2"});
    const nlohmann::json out = RunJson(Stories(args));
    EXPECT_EQ(Ids(out["output_ids"]), Ids(off["output_ids"])) << mode;
    EXPECT_EQ(out["spec"], mode);
    EXPECT_GT(out["plan_requests"].get<int64_t>(), 0) << mode;
    ASSERT_TRUE(out["plans"].is_array());
    for (const nlohmann::json& plan : out["plans"]) {
      for (const char* key : {"step", "mask", "gamma", "alpha_hat",
                              "predicted_tpt", "solve_seconds", "age_steps"}) {
        EXPECT_TRUE(plan.contains(key)) << key;
      }
    }
  }
}

TEST(KnapserveCliTest, PlannedGenerationRefusesMissingOrWrongProfiles) {
  const knapserve::testing::ScopedTempDir temp("cli_bad_profile");
  const std::string& dir = temp.path();
  {
    std::ofstream(dir + "/corrupt.json")
        << "{\"version\": 1, \"model_fingerprint\": ";
  }
  struct Case {
    std::vector<std::string> args;
    std::string expected;
    bool tiny = false;  // run on the tiny model instead of stories260k
  };
  const std::vector<Case> cases = {
      {{"generate", "--prompt", "Hi", "--spec", "clasp", "--profile",
        dir + "/missing.json"},
       "missing.json"},
      {{"generate", "--prompt", "Hi", "--spec", "knapspec", "--profile",
        dir + "/corrupt.json"},
       "corrupt.json"},
      // A profile of the stories model for the tiny one: the key differs.
      {{"generate", "--prompt", "Hi", "--spec", "knapspec", "--profile",
        StoriesProfile()},
       "knapserve profile",
       true},
      {{"generate", "--prompt", "Hi", "--spec", "knapsack"}, "knapsack"},
      {{"profile", "--out", dir + "/p.json", "--profile-contexts", "100000"},
       "profile-contexts"},
  };
  for (const Case& c : cases) {
    const std::vector<std::string> args =
        c.tiny ? Tiny(c.args) : Stories(c.args);
    const Outcome outcome = RunKnapserve(args);
    EXPECT_NE(outcome.exit_code, 0) << Describe(args, outcome);
    EXPECT_THAT(outcome.err, HasSubstr(c.expected)) << Describe(args, outcome);
  }
}

// KNN-SSD end to end: `anchors` builds a file from two domains of text,
// `generate --spec knn --anchors` routes a story opening to the story domain
// and gives plain decoding's greedy ids; the file is refused by another
// model, and bad --domains are refused naming the item.
// Writes two domains of text into `dir` (stories.txt, numbers.txt: four
// samples each) and returns the --domains value naming them.
std::string WriteTwoDomains(const std::string& dir) {
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

TEST(KnapserveCliTest, AnchorsThenKnnGenerationRoutesAndStaysLossless) {
  const knapserve::testing::ScopedTempDir temp("cli_anchors");
  const std::string& dir = temp.path();
  const std::string file = dir + "/s260k.anchors";
  const nlohmann::json built = RunJson(
      Stories({"anchors", "--domains", WriteTwoDomains(dir), "--split", "all",
               "--out", file, "--mask-samples", "2", "--reference-tokens", "8",
               "--max-draft", "4", "--profile", StoriesProfile(), "--json"}));
  ASSERT_TRUE(built["domains"].is_array());
  ASSERT_EQ(built["domains"].size(), 2u);
  EXPECT_EQ(built["domains"][0]["name"], "stories");
  EXPECT_EQ(built["domains"][0]["samples"], 4);

  const nlohmann::json off = RunJson(Stories(GreedyJson(120)));
  std::vector<std::string> args = GreedyJson(120);
  args.insert(args.end(), {"--spec", "knn", "--anchors", file});
  const nlohmann::json knn = RunJson(Stories(args));
  EXPECT_EQ(knn["routed_domain"], "stories");
  EXPECT_GT(knn["routing_similarity"].get<double>(), 0.5);
  EXPECT_EQ(Ids(knn["output_ids"]), Ids(off["output_ids"]));

  struct Case {
    std::vector<std::string> args;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {Tiny({"generate", "--prompt", "Hi", "--spec", "knn", "--anchors", file}),
       "model fingerprint"},
      {Stories({"generate", "--prompt", "Hi", "--spec", "knn"}), "--anchors"},
      {Stories(
           {"generate", "--prompt", "Hi", "--anchors", dir + "/stories.txt"}),
       "stories.txt"},
      {Stories({"anchors", "--domains", "stories", "--out", dir + "/x"}),
       "NAME=FILE"},
  };
  for (const Case& c : cases) {
    const Outcome outcome = RunKnapserve(c.args);
    EXPECT_NE(outcome.exit_code, 0) << Describe(c.args, outcome);
    EXPECT_THAT(outcome.err, HasSubstr(c.expected))
        << Describe(c.args, outcome);
  }
}

using knapserve::testing::ServerProcess;

// Two processes and a client: knapserve-planner, knapserve-executor --planner
// ADDR, and generate --server ADDR; also generate --planner ADDR locally and
// the one-process `knapserve serve`. Greedy ids equal local --spec off, and
// SIGTERM stops each server with exit 0.
TEST(KnapserveCliTest, SplitAndOneProcessDeploymentsGiveTheSameGreedyIds) {
  KNAPSERVE_SKIP_WITHOUT_SHARED(
      "bench/spec_bench/question.jsonl");  // the prompts
  ServerProcess planner(
      Stories({knapserve::testing::kKnapservePlannerBinary, "--listen",
               "127.0.0.1:0", "--profile", StoriesProfile()}));
  ASSERT_FALSE(planner.port().empty()) << planner.log();
  ServerProcess executor(
      Stories({knapserve::testing::kKnapserveExecutorBinary, "--listen",
               "127.0.0.1:0", "--planner", planner.address()}));
  ASSERT_FALSE(executor.port().empty()) << executor.log();
  ServerProcess serve(
      Stories({knapserve::testing::kKnapserveBinary, "serve", "--listen",
               "127.0.0.1:0", "--profile", StoriesProfile()}));
  ASSERT_FALSE(serve.port().empty()) << serve.log();

  // Spec-Bench prompts (three categories), cut to fit stories260k's context.
  auto prompts =
      LoadPromptSet(SharedPath("bench/spec_bench/question.jsonl"), 3);
  ASSERT_TRUE(prompts.ok()) << prompts.status();
  for (const BenchPrompt& prompt : *prompts) {
    const std::string text = prompt.text.substr(0, 300);
    SCOPED_TRACE(prompt.category);
    const std::vector<std::string> base = {
        "generate", "--prompt",      text, "--max-new-tokens",
        "100",      "--temperature", "0",  "--ignore-eos",
        "--json"};
    const nlohmann::json off = RunJson(Stories(base));
    std::vector<std::string> planned = base;
    planned.insert(planned.end(), {"--spec", "knapspec", "--plan-interval", "8",
                                   "--reference-steps", "2"});
    std::vector<std::string> local_remote_planner = planned;
    local_remote_planner.insert(local_remote_planner.end(),
                                {"--planner", planner.address()});
    const nlohmann::json a = RunJson(Stories(local_remote_planner));
    EXPECT_EQ(Ids(a["output_ids"]), Ids(off["output_ids"]));
    EXPECT_GT(a["plan_requests"].get<int64_t>(), 0);
    for (const ServerProcess* server : {&executor, &serve}) {
      std::vector<std::string> args = planned;
      args.insert(args.end(), {"--server", server->address()});
      const nlohmann::json b = RunJson(args);
      EXPECT_EQ(Ids(b["output_ids"]), Ids(off["output_ids"])) << server->log();
      EXPECT_EQ(b["text"], off["text"]);
      EXPECT_EQ(b["finish_reason"], "FINISH_REASON_LENGTH");
      EXPECT_EQ(b["completion_tokens"], 100);
    }
  }
  // A bad request over the wire is refused naming the field.
  const Outcome bad = RunKnapserve({"generate", "--server", executor.address(),
                                    "--prompt", "Hi", "--temperature", "-1"});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_THAT(bad.err, HasSubstr("temperature"));
  EXPECT_EQ(serve.Stop(), 0) << serve.log();
  EXPECT_EQ(executor.Stop(), 0) << executor.log();
  EXPECT_EQ(planner.Stop(), 0) << planner.log();
}

// A client that is not ours (Python grpcio) streams from `knapserve serve`,
// checks grpc.health.v1, and gets INVALID_ARGUMENT for a bad request.
TEST(KnapserveCliTest, IndependentPythonClientStreamsAndChecksHealth) {
  const std::string python = "/usr/bin/python3";
  if (RunProcess({python, "-c", "import grpc, google.protobuf"}).exit_code !=
      0) {
    GTEST_SKIP() << "python3-grpcio / python3-protobuf not installed";
  }
  ServerProcess serve(
      Stories({knapserve::testing::kKnapserveBinary, "serve", "--listen",
               "127.0.0.1:0", "--profile", StoriesProfile()}));
  ASSERT_FALSE(serve.port().empty()) << serve.log();
  const knapserve::testing::ScopedTempDir work_dir("python_client");
  const std::string& work = work_dir.path();
  const Outcome client = RunProcess(
      {python,
       knapserve::testing::kSourceDir +
           std::string("/tests/tools/independent_client.py"),
       serve.address(), knapserve::testing::kSourceDir + std::string("/proto"),
       work, "Once upon a time", "60"});
  ASSERT_EQ(client.exit_code, 0) << client.out << client.err;
  const nlohmann::json out = nlohmann::json::parse(client.out, nullptr, false);
  ASSERT_TRUE(out.is_object()) << client.out;
  const nlohmann::json local = RunJson(
      Stories({"generate", "--prompt", "Once upon a time", "--max-new-tokens",
               "60", "--temperature", "0", "--ignore-eos", "--json"}));
  EXPECT_EQ(Ids(out["ids"]), Ids(local["output_ids"]));
  EXPECT_EQ(out["text"], local["text"]);
  EXPECT_EQ(out["finish_reason"], "FINISH_REASON_LENGTH");
  EXPECT_EQ(out["completion_tokens"], 60);
  EXPECT_GT(out["chunks"].get<int>(), 1);
  EXPECT_EQ(out["health"][""], 1);  // SERVING
  EXPECT_EQ(out["health"]["knapserve.v1.Generation"], 1);
  EXPECT_EQ(out["bad_request_code"], "INVALID_ARGUMENT");
  // Server reflection lists the public service and health.
  const std::string services = out["reflected_services"].dump();
  EXPECT_NE(services.find("knapserve.v1.Generation"), std::string::npos)
      << services;
  EXPECT_NE(services.find("grpc.health.v1.Health"), std::string::npos)
      << services;
  EXPECT_EQ(serve.Stop(), 0) << serve.log();
}

// The official `openai` npm client (tests/node, installed by tools/setup.sh)
// drives `knapserve serve --http-listen` over loopback: streamed and whole
// completions and chat, usage, stop strings, seeds, speculation through the
// extension object, typed errors (tests/node/openai_client.mjs asserts
// those). Its greedy ids equal gRPC's and local generation's.
TEST(KnapserveCliTest, OfficialOpenAiClientDrivesTheHttpFrontDoor) {
  const std::string node_dir =
      knapserve::testing::kSourceDir + std::string("/tests/node");
  ASSERT_TRUE(std::filesystem::exists(node_dir + "/node_modules/openai"))
      << "the openai npm package is missing: tools/setup.sh installs it "
         "(npm ci in tests/node)";
  const std::string chat_template =
      knapserve::testing::kSourceDir +
      std::string(
          "/tests/testing/chat_templates/"
          "HuggingFaceTB-SmolLM2-1.7B-Instruct.jinja");
  ServerProcess serve(Stories(
      {knapserve::testing::kKnapserveBinary, "serve", "--listen", "127.0.0.1:0",
       "--http-listen", "127.0.0.1:0", "--profile", StoriesProfile(),
       "--served-model-name", "stories", "--chat-template", chat_template}));
  ASSERT_FALSE(serve.port().empty()) << serve.log();
  const std::string log = serve.log();
  const size_t at = log.find("http port ");
  ASSERT_NE(at, std::string::npos) << log;
  const std::string http_port =
      log.substr(at + 10, log.find('\n', at) - at - 10);
  const Outcome client =
      RunProcess({"/usr/bin/env", "node", node_dir + "/openai_client.mjs",
                  "http://127.0.0.1:" + http_port + "/v1", "stories"});
  ASSERT_EQ(client.exit_code, 0) << client.out << client.err << serve.log();
  const nlohmann::json out = nlohmann::json::parse(client.out, nullptr, false);
  ASSERT_TRUE(out.is_object()) << client.out;
  const nlohmann::json local = RunJson(Stories(GreedyJson(40)));
  EXPECT_EQ(Ids(out["greedy_ids"]), Ids(local["output_ids"]));
  EXPECT_EQ(out["greedy_text"], local["text"]);
  std::vector<std::string> grpc = Stories(GreedyJson(40));
  grpc.insert(grpc.end(), {"--server", serve.address()});
  const nlohmann::json remote = RunJson(grpc);
  EXPECT_EQ(Ids(out["greedy_ids"]), Ids(remote["output_ids"]));
  EXPECT_EQ(serve.Stop(), 0) << serve.log();
}

// Split deployment under a planner crash: the planner process is SIGKILLed
// mid-generation; the generation completes with the same ids, the executor
// stays SERVING, and once a planner listens on the address again the
// executor reconnects and applies plans.
TEST(KnapserveCliTest, ExecutorSurvivesAPlannerKillAndReconnects) {
  const std::string python = "/usr/bin/python3";
  const bool have_python =
      RunProcess({python, "-c", "import grpc"}).exit_code == 0;
  auto planner = std::make_unique<ServerProcess>(
      Stories({knapserve::testing::kKnapservePlannerBinary, "--listen",
               "127.0.0.1:0", "--profile", StoriesProfile()}));
  ASSERT_FALSE(planner->port().empty()) << planner->log();
  const std::string planner_port = planner->port();
  ServerProcess executor(
      Stories({knapserve::testing::kKnapserveExecutorBinary, "--listen",
               "127.0.0.1:0", "--planner", planner->address()}));
  ASSERT_FALSE(executor.port().empty()) << executor.log();
  const std::vector<std::string> base = GreedyJson(480);
  const nlohmann::json off = RunJson(Stories(base));
  std::vector<std::string> remote = base;
  remote.insert(remote.end(),
                {"--spec", "knapspec", "--plan-interval", "8",
                 "--reference-steps", "2", "--server", executor.address()});
  nlohmann::json during;
  std::thread client([&] { during = RunJson(remote); });
  usleep(150 * 1000);
  planner->Kill();  // SIGKILL mid-generation: no goodbye on the stream
  client.join();
  EXPECT_EQ(Ids(during["output_ids"]), Ids(off["output_ids"]));
  if (have_python) {
    const knapserve::testing::ScopedTempDir work_dir("python_health");
    const std::string& work = work_dir.path();
    const Outcome health =
        RunProcess({python,
                    knapserve::testing::kSourceDir +
                        std::string("/tests/tools/independent_client.py"),
                    executor.address(),
                    knapserve::testing::kSourceDir + std::string("/proto"),
                    work, "", "0"});
    ASSERT_EQ(health.exit_code, 0) << health.err;
    const nlohmann::json h = nlohmann::json::parse(health.out, nullptr, false);
    EXPECT_EQ(h["health"]["knapserve.v1.Generation"], 1)
        << health.out;  // still SERVING
  }
  // The planner comes back on the same port; plans flow again.
  ServerProcess restarted(
      Stories({knapserve::testing::kKnapservePlannerBinary, "--listen",
               "127.0.0.1:" + planner_port, "--profile", StoriesProfile()}));
  ASSERT_EQ(restarted.port(), planner_port) << restarted.log();
  int plans = 0;
  for (int attempt = 0; attempt < 40 && plans == 0; ++attempt) {
    const nlohmann::json after = RunJson(remote);
    EXPECT_EQ(Ids(after["output_ids"]), Ids(off["output_ids"]));
    plans = after["speculation"]["plans_applied"].get<int>();
  }
  EXPECT_GT(plans, 0) << "no plan applied after the planner restarted";
  EXPECT_EQ(executor.Stop(), 0) << executor.log();
}

// SIGTERM on a knapserve-executor process with a request running: the
// request finishes in full, a new one is refused UNAVAILABLE, exit code 0.
TEST(KnapserveCliTest, ExecutorDrainsOnSigterm) {
  ServerProcess executor(
      Stories({knapserve::testing::kKnapserveExecutorBinary, "--listen",
               "127.0.0.1:0", "--planner", "none"}));
  ASSERT_FALSE(executor.port().empty()) << executor.log();
  auto stub = v1::Generation::NewStub(grpc::CreateChannel(
      executor.address(), grpc::InsecureChannelCredentials()));
  v1::GenerateRequest request;
  request.set_text("Once upon a time");
  request.set_max_new_tokens(480);
  request.set_ignore_eos(true);
  request.set_temperature(0);
  grpc::ClientContext context;
  auto reader = stub->Generate(&context, request);
  v1::GenerateResponse response;
  int tokens = 0;
  bool signalled = false;
  grpc::Status refused;
  while (reader->Read(&response)) {
    if (!response.has_chunk()) continue;
    tokens += response.chunk().token_ids_size();
    if (!signalled) {
      signalled = true;
      executor.SendSigterm();
      usleep(20 * 1000);
      grpc::ClientContext other;
      v1::GenerateRequest small = request;
      small.set_max_new_tokens(2);
      auto second = stub->Generate(&other, small);
      v1::GenerateResponse ignored;
      while (second->Read(&ignored)) {
      }
      refused = second->Finish();
    }
  }
  const grpc::Status status = reader->Finish();
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(tokens, 480);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE)
      << refused.error_message();
  EXPECT_EQ(executor.Wait(), 0) << executor.log();
}

// Neither --model nor KNAPSERVE_MODEL: the bundled stories260k, which the
// build copied to <build>/share/knapserve/models/stories260k, found relative
// to the binary; no ../shared needed. KNAPSERVE_MODEL names another model.
TEST(KnapserveCliTest, GenerateWithoutAModelUsesTheBundledOne) {
  const nlohmann::json out = RunJson(
      {"generate", "--prompt", "Zoo", "--max-new-tokens", "57", "--temperature",
       "0", "--threads", "1", "--json"},
      {"KNAPSERVE_MODEL", "KNAPSERVE_SHARED=/nonexistent/knapserve_shared"});
  EXPECT_THAT(Ids(out["output_ids"]), ElementsAreArray(kZooGreedyIds));
  ASSERT_TRUE(out["model"].is_string());
  EXPECT_EQ(
      std::filesystem::weakly_canonical(out["model"].get<std::string>()),
      std::filesystem::weakly_canonical(knapserve::testing::Stories260kDir()));

  const nlohmann::json tiny =
      RunJson({"generate", "--prompt", "hello", "--max-new-tokens", "3",
               "--ignore-eos", "--threads", "1", "--json"},
              {"KNAPSERVE_MODEL=" + TinyModelDir()});
  EXPECT_EQ(tiny["model"], TinyModelDir());
  EXPECT_EQ(Ids(tiny["output_ids"]).size(), 3u);
}

// A binary with no model beside it says where it looked; the install layout
// (<prefix>/bin/knapserve and <prefix>/share/knapserve/models/stories260k,
// what `cmake --install` writes) finds the model.
TEST(KnapserveCliTest, DefaultModelIsFoundRelativeToTheExecutable) {
  namespace fs = std::filesystem;
  const fs::path prefix =
      fs::weakly_canonical(knapserve::testing::MakeTempDir("cli_install"));
  fs::create_directories(prefix / "bin");
  const std::string binary = (prefix / "bin" / "knapserve").string();
  std::error_code ec;
  fs::create_hard_link(knapserve::testing::kKnapserveBinary, binary, ec);
  if (ec) {
    ec.clear();
    fs::copy_file(knapserve::testing::kKnapserveBinary, binary, ec);
  }
  ASSERT_FALSE(ec) << ec.message();
  const std::vector<std::string> argv = {
      binary,  "generate",      "--prompt", "Zoo",       "--max-new-tokens",
      "5",     "--temperature", "0",        "--threads", "1",
      "--json"};
  const std::string model_dir =
      (prefix / "share/knapserve/models/stories260k").string();

  const Outcome missing = RunProcess(argv, {"KNAPSERVE_MODEL"});
  EXPECT_EQ(missing.exit_code, 1) << missing.err;
  EXPECT_THAT(missing.err,
              AllOf(HasSubstr("default model stories260k was not found"),
                    HasSubstr(model_dir), HasSubstr("KNAPSERVE_MODEL"),
                    HasSubstr("--model DIR")));

  fs::create_directories(prefix / "share/knapserve/models");
  fs::copy(knapserve::testing::Stories260kDir(), model_dir,
           fs::copy_options::recursive, ec);
  ASSERT_FALSE(ec) << ec.message();
  const Outcome installed = RunProcess(argv, {"KNAPSERVE_MODEL"});
  ASSERT_EQ(installed.exit_code, 0) << installed.err;
  const nlohmann::json out =
      nlohmann::json::parse(installed.out, nullptr, false);
  ASSERT_TRUE(out.is_object()) << installed.out;
  EXPECT_EQ(out["model"], model_dir);
  EXPECT_THAT(
      Ids(out["output_ids"]),
      ElementsAreArray(kZooGreedyIds.begin(), kZooGreedyIds.begin() + 5));
}

// Planned generation without --profile: the first run measures the latency
// profile and stores it in the cache folder, the next ones hit it (given by
// --profile-cache or KNAPSERVE_PROFILE_CACHE), --profile still wins, and
// knapserve-planner without --profile hits the same entry. Output ids equal
// --spec off throughout.
TEST(KnapserveCliTest,
     PlannedGenerationWithoutProfileMeasuresOnceThenHitsTheCache) {
  const std::string cache =
      knapserve::testing::MakeTempDir("cli_profile_cache") + "/profiles";
  const std::vector<std::string> base = GreedyJson(60);
  const nlohmann::json off = RunJson(Stories(base));
  std::vector<std::string> planned = base;
  planned.insert(planned.end(), {"--spec", "knapspec", "--plan-interval", "8",
                                 "--reference-steps", "2"});
  std::vector<std::string> with_flag = planned;
  with_flag.insert(with_flag.end(), {"--profile-cache", cache});

  auto run = [&](const std::vector<std::string>& args,
                 const std::vector<std::string>& env, const std::string& origin,
                 const std::string& log) {
    const std::vector<std::string> full = Stories(args);
    const Outcome outcome = RunKnapserve(full, env);
    EXPECT_EQ(outcome.exit_code, 0) << Describe(full, outcome);
    EXPECT_THAT(outcome.err, HasSubstr(log)) << Describe(full, outcome);
    const nlohmann::json out =
        nlohmann::json::parse(outcome.out, nullptr, false);
    EXPECT_TRUE(out.is_object()) << Describe(full, outcome);
    if (!out.is_object()) return nlohmann::json();
    EXPECT_EQ(out["profile"]["origin"], origin) << Describe(full, outcome);
    EXPECT_EQ(Ids(out["output_ids"]), Ids(off["output_ids"]));
    return out;
  };
  const nlohmann::json first =
      run(with_flag, {}, "measured", "latency profile: measured");
  ASSERT_TRUE(first.is_object());
  const std::string entry = first["profile"]["path"].get<std::string>();
  EXPECT_EQ(entry.rfind(cache + "/", 0), 0u) << entry;
  EXPECT_TRUE(std::filesystem::exists(entry)) << entry;

  const nlohmann::json second =
      run(with_flag, {}, "cache", "latency profile: cache hit");
  EXPECT_EQ(second["profile"]["path"], entry);
  const nlohmann::json by_env =
      run(planned, {"KNAPSERVE_PROFILE_CACHE=" + cache}, "cache",
          "latency profile: cache hit");
  EXPECT_EQ(by_env["profile"]["path"], entry);
  std::vector<std::string> with_file = with_flag;
  with_file.insert(with_file.end(), {"--profile", StoriesProfile()});
  const nlohmann::json file =
      run(with_file, {}, "file", "latency profile from --profile");
  EXPECT_EQ(file["profile"]["path"], StoriesProfile());

  ServerProcess planner(
      Stories({knapserve::testing::kKnapservePlannerBinary, "--listen",
               "127.0.0.1:0", "--profile-cache", cache}));
  ASSERT_FALSE(planner.port().empty()) << planner.log();
  EXPECT_THAT(planner.log(), HasSubstr("latency profile: cache hit " + entry));
  EXPECT_EQ(planner.Stop(), 0) << planner.log();
}

TEST(KnapserveCliTest, SampledGenerationIsReproducibleWithASeed) {
  const std::vector<std::string> args =
      Stories({"generate", "--prompt", "Once upon a time", "--max-new-tokens",
               "30", "--temperature", "0.8", "--seed", "5", "--json"});
  const nlohmann::json first = RunJson(args);
  const nlohmann::json second = RunJson(args);
  EXPECT_EQ(first["seed"], 5);
  EXPECT_FALSE(Ids(first["output_ids"]).empty());
  EXPECT_EQ(Ids(first["output_ids"]), Ids(second["output_ids"]));
  EXPECT_EQ(first["text"], second["text"]);
}

TEST(KnapserveCliTest, TokenizePrintsTheTokenizerIds) {
  const nlohmann::json out =
      RunJson(Stories({"tokenize", "--text", "Hello world"}));
  auto tokenizer = Tokenizer::FromFile(knapserve::testing::Stories260kDir() +
                                       "/tokenizer.json");
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  auto expected =
      (*tokenizer)->Encode("Hello world", /*add_special_tokens=*/true);
  ASSERT_TRUE(expected.ok()) << expected.status();
  ASSERT_TRUE(out.is_array());
  EXPECT_THAT(Ids(out), ElementsAreArray(*expected));
  EXPECT_EQ(Ids(out).front(), 1);  // BOS
}

struct BadInput {
  std::string name;
  std::vector<std::string> args;
  std::string message;  // stderr must contain this
};

TEST(KnapserveCliTest, BadInputExitsNonZeroNamingTheProblem) {
  const std::string stories = knapserve::testing::Stories260kDir();
  std::string long_prompt;
  for (int i = 0; i < 400; ++i) long_prompt += "Zoo ";
  const std::vector<BadInput> cases = {
      {"unknown subcommand", {"frobnicate"}, "unknown subcommand 'frobnicate'"},
      {"unknown bench mode",
       {"bench", "frobnicate"},
       "unknown mode 'frobnicate'"},
      {"layer out of range",
       Stories({"generate", "--prompt", "Zoo", "--spec", "static", "--skip",
                "a99"}),
       "'a99' names layer 99"},
      {"malformed mask",
       Stories(
           {"generate", "--prompt", "Zoo", "--spec", "static", "--skip", "x1"}),
       "bad entry 'x1'"},
      {"zero max draft",
       Stories({"generate", "--prompt", "Zoo", "--spec", "static",
                "--max-draft", "0"}),
       "max_draft"},
      {"unknown spec mode",
       Stories({"generate", "--prompt", "Zoo", "--spec", "bogus"}),
       "unknown speculation mode 'bogus'"},
      {"negative temperature",
       Stories({"generate", "--prompt", "Zoo", "--temperature", "-1"}),
       "temperature"},
      {"missing model dir",
       {"generate", "--model", "/nonexistent/knapserve_model", "--prompt",
        "Zoo"},
       "/nonexistent/knapserve_model"},
      {"prompt longer than the context",
       Stories({"generate", "--prompt", long_prompt}), "context"},
      {"bench spec bad mask",
       Stories({"bench", "spec", "--skip", "a99", "--num-prompts", "1",
                "--max-new-tokens", "4"}),
       "'a99' names layer 99"},
  };
  for (const BadInput& c : cases) {
    SCOPED_TRACE(c.name);
    const Outcome outcome = RunKnapserve(c.args);
    EXPECT_NE(outcome.exit_code, 0) << Describe(c.args, outcome);
    EXPECT_GT(outcome.exit_code, 0) << "crashed?\n"
                                    << Describe(c.args, outcome);
    EXPECT_THAT(outcome.err, HasSubstr(c.message)) << Describe(c.args, outcome);
  }
}

TEST(KnapserveCliTest, MakeModelThenGenerate) {
  const nlohmann::json out =
      RunJson(Tiny({"generate", "--prompt", "hello world", "--max-new-tokens",
                    "6", "--ignore-eos", "--json"}));
  EXPECT_FALSE(Ids(out["prompt_ids"]).empty());
  EXPECT_EQ(Ids(out["output_ids"]).size(), 6u);
  EXPECT_EQ(out["finish_reason"], "length");
  // Self-speculation on the random model is lossless too.
  const nlohmann::json spec = RunJson(
      Tiny({"generate", "--prompt", "hello world", "--max-new-tokens", "6",
            "--ignore-eos", "--spec", "static", "--skip", "m0", "--json"}));
  EXPECT_EQ(Ids(spec["output_ids"]), Ids(out["output_ids"]));
}

// The bench runs use stories260k, a real tiny model: the tiny-* random models
// have a vocabulary (300) larger than their synthetic tokenizer (288), and a
// generated id the tokenizer does not know fails detokenization, which the
// bench prompts happen to trigger.
TEST(KnapserveCliTest, BenchArPrintsItsSummary) {
  KNAPSERVE_SKIP_WITHOUT_SHARED(
      "bench/spec_bench/question.jsonl");  // the default --prompts
  const std::vector<std::string> args =
      Stories({"bench", "ar", "--num-prompts", "2", "--max-new-tokens", "8"});
  const Outcome text = RunKnapserve(args);
  ASSERT_EQ(text.exit_code, 0) << Describe(args, text);
  EXPECT_THAT(text.out, AllOf(HasSubstr("median decode"),
                              HasSubstr("of copy bandwidth")));

  std::vector<std::string> json_args = args;
  json_args.push_back("--json");
  const nlohmann::json out = RunJson(json_args);
  ASSERT_TRUE(out.is_object());
  EXPECT_EQ(out["prompts"].size(), 2u);
  EXPECT_GT(out["decode_tokens_per_s"].get<double>(), 0);
  EXPECT_GT(out["copy_bandwidth_bytes_per_s"].get<double>(), 0);
  for (const nlohmann::json& row : out["prompts"])
    EXPECT_EQ(row["new_tokens"], 8);
}

TEST(KnapserveCliTest, BenchSpecComparesModesAndChecksLosslessness) {
  KNAPSERVE_SKIP_WITHOUT_SHARED(
      "bench/spec_bench/question.jsonl");  // the default --prompts
  // With --json the tables go to stderr and one JSON object to stdout.
  const std::vector<std::string> args =
      Stories({"bench", "spec", "--num-prompts", "2", "--max-new-tokens", "8",
               "--skip", "m0", "--max-draft", "3", "--json"});
  const Outcome outcome = RunKnapserve(args);
  ASSERT_EQ(outcome.exit_code, 0) << Describe(args, outcome);
  EXPECT_THAT(
      outcome.err,
      AllOf(HasSubstr("tok/s"), HasSubstr("speedup"),
            HasSubstr("lossless: every mode's output ids equal off's")));
  const nlohmann::json out =
      nlohmann::json::parse(outcome.out, nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(out.is_object());
  EXPECT_EQ(out["lossless"], true);
  EXPECT_EQ(out["skip"], "m0");
  const nlohmann::json& set = out["sets"]["spec_bench"];
  EXPECT_EQ(set["prompts"], 2);
  for (const char* mode : {"off", "static"}) {
    const nlohmann::json& m = set["modes"][mode];
    EXPECT_GT(m["decode_tokens_per_s"].get<double>(), 0) << mode;
    EXPECT_EQ(m["decoded_tokens"], 2 * 7)
        << mode;  // the first token comes from prefill
    EXPECT_EQ(m["same_ids"], true) << mode;
    for (const char* key :
         {"speedup", "acceptance_rate", "mean_acceptance_length", "draft_share",
          "verify_share"}) {
      EXPECT_TRUE(m.contains(key)) << mode << " " << key;
    }
  }
  EXPECT_DOUBLE_EQ(set["modes"]["off"]["speedup"].get<double>(), 1.0);
  EXPECT_GT(set["modes"]["static"]["drafts"].get<int64_t>(), 0);
}

// Off, static, clasp and knapspec on the Spec-Bench set and a long-context
// set: the Table-2 style comparison, all lossless.
TEST(KnapserveCliTest, BenchSpecComparesPlannedModesOnTwoSets) {
  KNAPSERVE_SKIP_WITHOUT_SHARED(
      "bench/spec_bench/question.jsonl");  // the default --prompts
  const std::vector<std::string> args =
      Stories({"bench", "spec", "--num-prompts", "2", "--max-new-tokens", "48",
               "--skip", "a2", "--profile", StoriesProfile(),
               "--long-context-tokens", "300", "--plan-interval", "8",
               "--reference-steps", "2", "--clasp-layers", "2", "--json"});
  const Outcome outcome = RunKnapserve(args);
  ASSERT_EQ(outcome.exit_code, 0) << Describe(args, outcome);
  EXPECT_THAT(outcome.err,
              AllOf(HasSubstr("[spec_bench]"), HasSubstr("[long_context]"),
                    HasSubstr("pred TPT"), HasSubstr("wait%")));
  const nlohmann::json out = nlohmann::json::parse(outcome.out, nullptr, false);
  ASSERT_TRUE(out.is_object());
  EXPECT_EQ(out["lossless"], true);
  for (const char* set : {"spec_bench", "long_context"}) {
    for (const char* mode : {"off", "static", "clasp", "knapspec"}) {
      const nlohmann::json& m = out["sets"][set]["modes"][mode];
      ASSERT_TRUE(m.is_object()) << set << " " << mode;
      EXPECT_EQ(m["same_ids"], true) << set << " " << mode;
      EXPECT_GT(m["measured_tpt"].get<double>(), 0) << set << " " << mode;
    }
    EXPECT_GT(
        out["sets"][set]["modes"]["knapspec"]["plan_requests"].get<int64_t>(),
        0)
        << set;
  }
}

TEST(KnapserveCliTest, BenchSpecSearchesAMask) {
  KNAPSERVE_SKIP_WITHOUT_SHARED(
      "bench/spec_bench/question.jsonl");  // the default --prompts
  const nlohmann::json out = RunJson(
      Stories({"bench", "spec", "--num-prompts", "1", "--max-new-tokens", "8",
               "--search-masks", "--search-prompts", "1", "--search-tokens",
               "8", "--search-max-steps", "2", "--json"}));
  ASSERT_TRUE(out.is_object());
  ASSERT_TRUE(out.contains("search"));
  const nlohmann::json& search = out["search"];
  ASSERT_GE(search["path"].size(), 1u);
  EXPECT_EQ(search["path"][0]["mask"], "");
  EXPECT_EQ(search["best_mask"], search["path"].back()["mask"]);
  EXPECT_EQ(out["skip"], search["best_mask"]);
  EXPECT_LE(search["path"].size(),
            3u);  // round 0 + at most 2 skipped sublayers
  EXPECT_EQ(out["lossless"], true);
}

TEST(KnapserveCliTest, BenchStepCostPrintsRatios) {
  const nlohmann::json out =
      RunJson(Tiny({"bench", "step-cost", "--context-length", "32",
                    "--step-repeats", "3", "--json"}));
  ASSERT_TRUE(out.is_object());
  EXPECT_EQ(out["context_length"], 32);
  ASSERT_EQ(out["draft"].size(), 6u);
  EXPECT_EQ(out["draft"][0]["kept_sublayers"], 4);  // tiny-llama: 2 layers
  EXPECT_DOUBLE_EQ(out["draft"][0]["kept_fraction"].get<double>(), 1.0);
  ASSERT_EQ(out["verify"].size(), 10u);
  for (const nlohmann::json& row : out["verify"]) {
    EXPECT_GT(row["seconds"].get<double>(), 0);
    EXPECT_EQ(row["tokens"].get<int>(), row["gamma"].get<int>() + 1);
  }
}

// A prompt file of three story openings in the Spec-Bench row format.
std::string WriteStoryPrompts(const knapserve::testing::ScopedTempDir& dir) {
  const std::string path = dir.path() + "/prompts.jsonl";
  std::ofstream out(path);
  out << R"({"question_id": 1, "category": "a", "turns": ["Once upon a time, there was a little girl named Lily."]})"
      << "\n"
      << R"({"question_id": 2, "category": "b", "turns": ["Tom had a red ball. He liked to play with it in the park."]})"
      << "\n"
      << R"({"question_id": 3, "category": "c", "turns": ["The sun was hot and the dog was tired."]})"
      << "\n";
  return path;
}

// `bench serve` with a server of its own: closed-loop streams plus a long
// prompt arriving while they decode, then Poisson arrivals with speculation.
// Every load stream must equal its prompt's single stream (the command
// checks it and exits 1 otherwise); the JSON counts must add up.
TEST(KnapserveCliTest, BenchServeStreamsConcurrentlyAndChecksOutputs) {
  const knapserve::testing::ScopedTempDir dir("bench_serve");
  const std::string prompts = WriteStoryPrompts(dir);
  const nlohmann::json closed =
      RunJson(Stories({"bench", "serve", "--prompts", prompts, "--concurrency",
                       "3", "--num-requests", "5", "--max-new-tokens", "12",
                       "--burst-prompt-tokens", "300", "--json"}));
  EXPECT_EQ(closed["in_process"], true);
  EXPECT_EQ(closed["modes"][0]["single"]["requests"], 3);
  EXPECT_EQ(closed["modes"][0]["single"]["completion_tokens"], 36);
  EXPECT_EQ(closed["modes"][0]["load"]["requests"], 5);
  EXPECT_EQ(closed["modes"][0]["load"]["failed"], 0);
  EXPECT_EQ(closed["modes"][0]["load"]["completion_tokens"], 60);
  EXPECT_EQ(closed["checked"], true);
  EXPECT_EQ(closed["mismatches"], 0);
  EXPECT_TRUE(closed["errors"].empty());
  EXPECT_GT(closed["modes"][0]["load"]["output_tokens_per_s"].get<double>(), 0);
  EXPECT_GT(closed["modes"][0]["load"]["itl_p50_seconds"].get<double>(), 0);
  EXPECT_GE(closed["modes"][0]["load"]["itl_p99_seconds"].get<double>(),
            closed["modes"][0]["load"]["itl_p50_seconds"].get<double>());
  EXPECT_EQ(closed["modes"][0]["burst"]["ok"], true);
  EXPECT_EQ(closed["modes"][0]["burst"]["prompt_tokens"], 300);
  EXPECT_GT(closed["modes"][0]["burst"]["ttft_seconds"].get<double>(), 0);
  // The 300-token prompt went in as chunks of the batched passes.
  EXPECT_GE(closed["modes"][0]["engine"]["prefill_chunks"].get<int64_t>(), 2);

  const nlohmann::json poisson = RunJson(Stories(
      {"bench",          "serve",      "--prompts",        prompts,
       "--arrival",      "poisson",    "--request-rate",   "40",
       "--num-requests", "4",          "--max-new-tokens", "16",
       "--modes",        "off,static", "--skip",           "a1,m2",
       "--max-draft",    "3",          "--profile",        StoriesProfile(),
       "--json"}));
  EXPECT_EQ(poisson["arrival"], "poisson");

  // The same load through the OpenAI front door: same outputs as the
  // single streams (checked by the command), speculation included.
  const nlohmann::json http = RunJson(Stories(
      {"bench",          "serve",      "--prompts",        prompts,
       "--protocol",     "http",       "--concurrency",    "3",
       "--num-requests", "4",          "--max-new-tokens", "12",
       "--modes",        "off,static", "--skip",           "a1,m2",
       "--max-draft",    "3",          "--profile",        StoriesProfile(),
       "--json"}));
  EXPECT_EQ(http["protocol"], "http");
  ASSERT_EQ(http["modes"].size(), 2u);
  for (const nlohmann::json& mode : http["modes"]) {
    EXPECT_EQ(mode["load"]["failed"], 0);
    EXPECT_EQ(mode["load"]["completion_tokens"], 48);
    EXPECT_EQ(mode["mismatches"], 0);
  }
  EXPECT_EQ(http["mismatches"], 0);
  ASSERT_EQ(poisson["modes"].size(), 2u);
  EXPECT_EQ(poisson["modes"][1]["spec"], "static");
  for (const nlohmann::json& mode : poisson["modes"]) {
    EXPECT_EQ(mode["load"]["requests"], 4);
    EXPECT_EQ(mode["load"]["completion_tokens"], 64);
    EXPECT_EQ(mode["mismatches"], 0);
  }
  // Static speculation equals off (the command checks every stream against
  // off's single streams) and commits more than one token in some steps.
  EXPECT_EQ(poisson["mismatches"], 0);
  EXPECT_EQ(poisson["modes"][0]["single"]["tokens_per_step"], 1.0);
  EXPECT_GT(poisson["modes"][1]["single"]["tokens_per_step"].get<double>(),
            1.0);

  const Outcome bad = RunKnapserve(
      Stories({"bench", "serve", "--prompts", prompts, "--arrival", "burst"}));
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_THAT(bad.err, HasSubstr("--arrival"));
}

// `bench serve --server ADDR` drives a separate `knapserve serve` process;
// the tokenizer comes from the server's model folder.
TEST(KnapserveCliTest, BenchServeDrivesARunningServer) {
  const knapserve::testing::ScopedTempDir dir("bench_serve_remote");
  const std::string prompts = WriteStoryPrompts(dir);
  ServerProcess serve(
      Stories({knapserve::testing::kKnapserveBinary, "serve", "--listen",
               "127.0.0.1:0", "--profile", StoriesProfile()}));
  ASSERT_FALSE(serve.port().empty()) << serve.log();
  const nlohmann::json remote = RunJson(
      {"bench", "serve", "--server", serve.address(), "--prompts", prompts,
       "--concurrency", "4", "--max-new-tokens", "10", "--json"});
  EXPECT_EQ(remote["in_process"], false);
  EXPECT_EQ(remote["modes"][0]["load"]["requests"], 4);
  EXPECT_EQ(remote["modes"][0]["load"]["completion_tokens"], 40);
  EXPECT_EQ(remote["mismatches"], 0);
  EXPECT_FALSE(remote["modes"][0].contains("engine"));
  EXPECT_EQ(serve.Stop(), 0) << serve.log();
  // Nothing listens there any more: a clear error, not a hang.
  const Outcome gone = RunKnapserve(
      {"bench", "serve", "--server", serve.address(), "--prompts", prompts});
  EXPECT_EQ(gone.exit_code, 1);
  EXPECT_THAT(gone.err, HasSubstr(serve.address()));
}

using testing::FreeLoopbackPort;

// bench soak (tools/soak.sh's client) against a running `serve`: a short
// mixed load (every mode, greedy and sampling, cancels, deadlines, Aborts)
// passes its checks (greedy outputs equal the references, no hang, no
// unexplained error, the gauges drain), and its JSON says what happened. A
// load no longer than its warm-up is bad usage (exit 2).
TEST(KnapserveCliTest, BenchSoakRunsAMixedLoadAndChecksTheServer) {
  const knapserve::testing::ScopedTempDir dir("bench_soak");
  const std::string prompts = WriteStoryPrompts(dir);
  const int metrics_port = FreeLoopbackPort();
  ASSERT_GT(metrics_port, 0);
  ServerProcess serve(Stories(
      {knapserve::testing::kKnapserveBinary, "serve", "--listen", "127.0.0.1:0",
       "--profile", StoriesProfile(), "--metrics-port",
       std::to_string(metrics_port), "--skip", "a1,m3", "--max-draft", "4"}));
  ASSERT_FALSE(serve.port().empty()) << serve.log();
  const nlohmann::json soak = RunJson({"bench",
                                       "soak",
                                       "--server",
                                       serve.address(),
                                       "--prompts",
                                       prompts,
                                       "--metrics",
                                       absl::StrCat("127.0.0.1:", metrics_port),
                                       "--server-pid",
                                       std::to_string(serve.pid()),
                                       "--soak-seconds",
                                       "6",
                                       "--warmup-seconds",
                                       "2",
                                       "--max-rss-growth",
                                       "0.5",
                                       "--concurrency",
                                       "6",
                                       "--max-new-tokens",
                                       "24",
                                       "--json"});
  EXPECT_EQ(soak["ok"], true) << soak.dump(2);
  EXPECT_GT(soak["calls"].get<int64_t>(), 10) << soak.dump(2);
  EXPECT_GT(soak["greedy_checked"].get<int64_t>(), 0);
  EXPECT_EQ(soak["mismatches"], 0);
  EXPECT_EQ(soak["hangs"], 0);
  EXPECT_EQ(soak["drained"], true);
  EXPECT_EQ(soak["calls_by_mode"].size(), 4u) << soak.dump(2);
  EXPECT_GT(soak["cancelled"].get<int64_t>() +
                soak["deadline_exceeded"].get<int64_t>() +
                soak["aborted"].get<int64_t>(),
            0);
  EXPECT_GT(soak["rss_end_bytes"].get<int64_t>(), 0);
  EXPECT_EQ(serve.Stop(), 0) << serve.log();
  const Outcome bad =
      RunKnapserve({"bench", "soak", "--server", "127.0.0.1:1",
                    "--soak-seconds", "5", "--warmup-seconds", "5"});
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
}

// The port a server process logged for its plaintext health checks
// ("(plaintext) at port N"); "" if none.
std::string HealthPortOf(const std::string& log) {
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
int HealthStatus(const std::string& address, const std::string& service,
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

// Certificates made by openssl for the TLS tests: a CA, a server/executor
// certificate it signs (for localhost and 127.0.0.1), and a second CA with
// a certificate of its own. Empty when openssl is missing.
struct TestCerts {
  std::string ca, cert, key;                    // the trusted CA and its leaf
  std::string other_ca, other_cert, other_key;  // a CA nobody trusts
};
std::optional<TestCerts> MakeTestCerts(const std::string& dir) {
  const std::string openssl = "/usr/bin/openssl";
  if (access(openssl.c_str(), X_OK) != 0) return std::nullopt;
  {
    std::ofstream ext(dir + "/ext.cnf");
    ext << "subjectAltName=DNS:localhost,IP:127.0.0.1\n";
  }
  auto run = [&](std::vector<std::string> args) {
    args.insert(args.begin(), openssl);
    const Outcome outcome = RunProcess(args);
    EXPECT_EQ(outcome.exit_code, 0) << outcome.err;
  };
  auto make_ca = [&](const std::string& name) {
    run({"req", "-x509", "-newkey", "ec", "-pkeyopt",
         "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
         dir + "/" + name + ".key", "-out", dir + "/" + name + ".crt", "-days",
         "2", "-subj", "/CN=" + name});
  };
  auto make_leaf = [&](const std::string& name, const std::string& ca) {
    run({"req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", dir + "/" + name + ".key", "-out",
         dir + "/" + name + ".csr", "-subj", "/CN=localhost"});
    run({"x509", "-req", "-in", dir + "/" + name + ".csr", "-CA",
         dir + "/" + ca + ".crt", "-CAkey", dir + "/" + ca + ".key",
         "-CAcreateserial", "-out", dir + "/" + name + ".crt", "-days", "2",
         "-extfile", dir + "/ext.cnf"});
  };
  make_ca("ca");
  make_leaf("leaf", "ca");
  make_ca("other-ca");
  make_leaf("other-leaf", "other-ca");
  return TestCerts{dir + "/ca.crt",         dir + "/leaf.crt",
                   dir + "/leaf.key",       dir + "/other-ca.crt",
                   dir + "/other-leaf.crt", dir + "/other-leaf.key"};
}

// TLS on the Generation service and mutual TLS between executor and
// planner, with certificates openssl makes here: clients that trust the CA
// stream (and the executor's plans come from the mTLS planner); a client
// trusting another CA, or speaking plaintext, is refused and the server
// goes on; the planner gives no plan to an executor without a client
// certificate from its CA.
TEST(KnapserveCliTest, TlsOnTheGenerationServiceAndMutualTlsToThePlanner) {
  const knapserve::testing::ScopedTempDir dir("tls");
  const std::optional<TestCerts> certs = MakeTestCerts(dir.path());
  if (!certs.has_value()) GTEST_SKIP() << "openssl not installed";
  const std::vector<std::string> tls = {"--tls-cert", certs->cert, "--tls-key",
                                        certs->key,   "--tls-ca",  certs->ca};
  std::vector<std::string> planner_args = {
      knapserve::testing::kKnapservePlannerBinary,
      "--listen",
      "127.0.0.1:0",
      "--profile",
      StoriesProfile(),
      "--health-listen",
      "127.0.0.1:0"};
  planner_args.insert(planner_args.end(), tls.begin(), tls.end());
  ServerProcess planner(Stories(planner_args));
  ASSERT_FALSE(planner.port().empty()) << planner.log();
  std::vector<std::string> executor_args = {
      knapserve::testing::kKnapserveExecutorBinary,
      "--listen",
      "127.0.0.1:0",
      "--planner",
      planner.address(),
      "--health-listen",
      "127.0.0.1:0"};
  executor_args.insert(executor_args.end(), tls.begin(), tls.end());
  ServerProcess executor(Stories(executor_args));
  ASSERT_FALSE(executor.port().empty()) << executor.log();

  const std::vector<std::string> base = GreedyJson(60);
  // Probes that cannot speak TLS use the plaintext health ports: readiness
  // and liveness answer there, and nothing else does.
  const std::string executor_health =
      "127.0.0.1:" + HealthPortOf(executor.log());
  const std::string planner_health = "127.0.0.1:" + HealthPortOf(planner.log());
  ASSERT_NE(executor_health, "127.0.0.1:") << executor.log();
  ASSERT_NE(planner_health, "127.0.0.1:") << planner.log();
  EXPECT_EQ(HealthStatus(executor_health, "knapserve.v1.Generation"), 1);
  EXPECT_EQ(HealthStatus(executor_health, ""), 1);
  EXPECT_EQ(HealthStatus(planner_health, "knapserve.v1.Planner"), 1);
  grpc::StatusCode code = grpc::StatusCode::OK;
  EXPECT_EQ(HealthStatus(executor_health, "knapserve.v1.Nothing", &code), -1);
  EXPECT_EQ(code, grpc::StatusCode::NOT_FOUND);
  {
    auto stub = v1::Generation::NewStub(grpc::CreateChannel(
        executor_health, grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    v1::GetModelInfoResponse info;
    EXPECT_EQ(stub->GetModelInfo(&context, v1::GetModelInfoRequest(), &info)
                  .error_code(),
              grpc::StatusCode::UNIMPLEMENTED);
  }
  // The TLS port itself does not answer plaintext health checks.
  EXPECT_EQ(HealthStatus(executor.address(), "", &code), -1);
  EXPECT_EQ(code, grpc::StatusCode::UNAVAILABLE);

  // Planned runs are long enough (400 tokens) for a plan to come back
  // before the end; a run that still got none is tried again (a loaded
  // machine), while refused connections never get one.
  const std::vector<std::string> long_base = GreedyJson(400);
  std::vector<std::string> planned = long_base;
  planned.insert(planned.end(), {"--spec", "knapspec", "--plan-interval", "8",
                                 "--reference-steps", "2"});
  const nlohmann::json long_off = RunJson(Stories(long_base));
  // Over TLS, trusting the CA: the executor's plans come over mutual TLS.
  std::vector<std::string> good = planned;
  good.insert(good.end(),
              {"--server", executor.address(), "--tls-ca", certs->ca});
  int plans_applied = 0;
  for (int attempt = 0; attempt < 3 && plans_applied == 0; ++attempt) {
    const nlohmann::json remote = RunJson(good);
    EXPECT_EQ(Ids(remote["output_ids"]), Ids(long_off["output_ids"]));
    plans_applied = remote["speculation"]["plans_applied"].get<int>();
  }
  EXPECT_GT(plans_applied, 0) << executor.log() << planner.log();
  // Trusting another CA, or plaintext: refused, cleanly.
  std::vector<std::string> wrong_ca = base;
  wrong_ca.insert(wrong_ca.end(), {"--server", executor.address(), "--tls-ca",
                                   certs->other_ca});
  const Outcome refused = RunKnapserve(wrong_ca);
  EXPECT_EQ(refused.exit_code, 1) << refused.err;
  EXPECT_THAT(refused.err, HasSubstr(executor.address()));
  std::vector<std::string> plaintext = base;
  plaintext.insert(plaintext.end(), {"--server", executor.address()});
  const Outcome plain = RunKnapserve(plaintext);
  EXPECT_EQ(plain.exit_code, 1) << plain.err;
  EXPECT_THAT(plain.err, HasSubstr(executor.address()));
  // The planner itself: an executor (here a local generate) with a client
  // certificate from the CA gets plans; with one from another CA, or none,
  // it gets none (the output is the same either way).
  auto plans_from_planner = [&](std::vector<std::string> client_tls) {
    std::vector<std::string> args = planned;
    args.insert(args.end(), {"--planner", planner.address()});
    args.insert(args.end(), client_tls.begin(), client_tls.end());
    const nlohmann::json out = RunJson(Stories(args));
    EXPECT_EQ(Ids(out["output_ids"]), Ids(long_off["output_ids"]));
    return out["plans"].size();
  };
  size_t plans = 0;
  for (int attempt = 0; attempt < 3 && plans == 0; ++attempt) {
    plans = plans_from_planner(tls);
  }
  EXPECT_GT(plans, 0u);
  EXPECT_EQ(
      plans_from_planner({"--tls-ca", certs->ca, "--tls-cert",
                          certs->other_cert, "--tls-key", certs->other_key}),
      0u);
  EXPECT_EQ(plans_from_planner({"--tls-ca", certs->ca}), 0u);
  // The servers still serve after all that.
  EXPECT_EQ(Ids(RunJson(good)["output_ids"]), Ids(long_off["output_ids"]));
  // A certificate without its key is a usage error naming the flags.
  const Outcome half = RunKnapserve(
      Stories({"serve", "--listen", "127.0.0.1:0", "--tls-cert", certs->cert}));
  EXPECT_EQ(half.exit_code, 2) << half.err;
  EXPECT_THAT(half.err, HasSubstr("--tls-cert and --tls-key go together"));
  EXPECT_EQ(executor.Stop(), 0) << executor.log();
  EXPECT_EQ(planner.Stop(), 0) << planner.log();
}

}  // namespace

// Prometheus's HTTP API: the instant query `query` (URL-encoded here), or a
// null json when it does not answer.
nlohmann::json PrometheusQuery(httplib::Client& prometheus,
                               const std::string& query) {
  const httplib::Params params = {{"query", query}};
  const httplib::Result res =
      prometheus.Get("/api/v1/query", params, httplib::Headers());
  if (!res) return nullptr;
  return nlohmann::json::parse(res->body, nullptr, false);
}

// The single value of an instant query (NaN when there is none).
double PrometheusValue(httplib::Client& prometheus, const std::string& query) {
  const nlohmann::json r = PrometheusQuery(prometheus, query);
  if (!r.is_object() || r.value("status", "") != "success") return NAN;
  const nlohmann::json& result = r["data"]["result"];
  if (r["data"]["resultType"] == "scalar") {
    return std::stod(r["data"]["result"][1].get<std::string>());
  }
  if (!result.is_array() || result.size() != 1) return NAN;
  return std::stod(result[0]["value"][1].get<std::string>());
}

// Every "expr" of a Grafana dashboard, however deep.
void CollectExprs(const nlohmann::json& j, std::vector<std::string>& out) {
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (it.key() == "expr" && it->is_string()) out.push_back(*it);
      CollectExprs(*it, out);
    }
  } else if (j.is_array()) {
    for (const nlohmann::json& e : j) CollectExprs(e, out);
  }
}

// Debian's Prometheus server scrapes a split deployment (knapserve-planner
// and knapserve-executor, each with --metrics-port) on loopback. After real
// requests its HTTP API holds exactly the values they produced: requests,
// tokens, drafts and accepted tokens, plans applied (the executor), plan
// requests, plans, bytes and solve times (the planner). Then every PromQL
// expression of deploy/grafana/*.json runs against it without error, and
// every metric they name is one the processes expose.
TEST(KnapserveCliTest,
     PrometheusScrapesTheDeploymentAndRunsEveryDashboardQuery) {
  const std::string prometheus_binary = "/usr/bin/prometheus";
  if (!std::filesystem::exists(prometheus_binary)) {
    GTEST_SKIP() << "no " << prometheus_binary
                 << " (tools/setup.sh installs Debian's prometheus)";
  }
  const int planner_metrics = FreeLoopbackPort();
  const int executor_metrics = FreeLoopbackPort();
  const int prometheus_port = FreeLoopbackPort();
  ASSERT_TRUE(planner_metrics > 0 && executor_metrics > 0 &&
              prometheus_port > 0);
  ServerProcess planner(
      Stories({knapserve::testing::kKnapservePlannerBinary, "--listen",
               "127.0.0.1:0", "--profile", StoriesProfile(), "--metrics-port",
               std::to_string(planner_metrics)}));
  ASSERT_FALSE(planner.port().empty()) << planner.log();
  const knapserve::testing::ScopedTempDir dir("prometheus");
  // KNN-SSD anchors (routing only: every domain decodes plainly), so the
  // routed-domain series exist.
  const std::string anchors = dir.path() + "/s260k.anchors";
  RunJson(
      Stories({"anchors", "--domains", WriteTwoDomains(dir.path()), "--split",
               "all", "--mask-samples", "0", "--out", anchors, "--json"}));
  ServerProcess executor(
      Stories({knapserve::testing::kKnapserveExecutorBinary, "--listen",
               "127.0.0.1:0", "--planner", planner.address(), "--metrics-port",
               std::to_string(executor_metrics), "--anchors", anchors}));
  ASSERT_FALSE(executor.port().empty()) << executor.log();

  const std::string config = dir.path() + "/prometheus.yml";
  {
    std::ofstream out(config);
    out << "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        << "scrape_configs:\n"
        << "  - job_name: executor\n    static_configs:\n"
        << "      - targets: ['127.0.0.1:" << executor_metrics << "']\n"
        << "  - job_name: planner\n    static_configs:\n"
        << "      - targets: ['127.0.0.1:" << planner_metrics << "']\n";
  }
  ServerProcess prometheus(
      {prometheus_binary, "--config.file=" + config,
       "--storage.tsdb.path=" + dir.path() + "/data",
       "--web.listen-address=127.0.0.1:" + std::to_string(prometheus_port),
       "--log.level=info"},
      "Server is ready to receive web requests.");
  ASSERT_EQ(prometheus.port(), "ready") << prometheus.log();

  // Real requests: two static-mask streams (drafts and acceptances), two
  // planned ones (plan requests to the planner) and a routed one.
  int64_t drafts = 0, accepted = 0, plans_applied = 0, tokens = 0;
  for (const std::string spec :
       {"static", "static", "knapspec", "knapspec", "knn"}) {
    std::vector<std::string> args = Stories(GreedyJson(48));
    args.insert(args.end(), {"--server", executor.address(), "--spec", spec,
                             "--skip", "a1,m2", "--max-draft", "3"});
    const nlohmann::json out = RunJson(args);
    ASSERT_TRUE(out.is_object());
    drafts += out["speculation"]["drafts"].get<int64_t>();
    accepted += out["speculation"]["accepted_tokens"].get<int64_t>();
    plans_applied += out["speculation"]["plans_applied"].get<int64_t>();
    tokens += out["completion_tokens"].get<int64_t>();
  }
  ASSERT_EQ(tokens, 5 * 48);
  ASSERT_GT(drafts, 0);

  httplib::Client client("127.0.0.1", prometheus_port);
  client.set_read_timeout(10, 0);
  auto value = [&](const std::string& q) { return PrometheusValue(client, q); };
  // What the deployment must show once Prometheus has scraped both processes
  // after the requests and the planner has answered every plan request (a
  // solve may still run after the request that asked for it ended). The
  // test waits for exactly that, however loaded the machine (scrapes come
  // every second; 180 s bounds a deployment that never gets there), then
  // asserts each value so a failure names it.
  const std::string ok_requests =
      "sum(knapserve_requests_total{job=\"executor\",code=\"OK\"})";
  const std::string plan_requests_query =
      "knapserve_planner_server_requests_total{job=\"planner\"}";
  auto planner_answered = [&] {
    return value("knapserve_planner_server_plans_total") +
           value("knapserve_planner_server_superseded_total") +
           value("sum(knapserve_planner_server_failed_total)");
  };
  auto settled = [&] {
    return value("count(up == 1)") == 2 && value(ok_requests) == 5 &&
           value("knapserve_generation_tokens_total{job=\"executor\"}") ==
               tokens &&
           value("knapserve_spec_decode_num_drafts_total") == drafts &&
           value("knapserve_spec_decode_num_accepted_tokens_total") ==
               accepted &&
           value("knapserve_planner_plans_applied_total") == plans_applied &&
           value("knapserve_running_requests") == 0 &&
           value("knapserve_routing_seconds_count") == 1 &&
           value("knapserve_planner_server_queue_depth") == 0 &&
           planner_answered() == value(plan_requests_query) &&
           value("knapserve_planner_server_solve_seconds_count") ==
               value("knapserve_planner_server_plans_total");
  };
  const auto give_up =
      std::chrono::steady_clock::now() + std::chrono::seconds(180);
  while (!settled() && std::chrono::steady_clock::now() < give_up) {
    usleep(200 * 1000);
  }
  EXPECT_EQ(value("count(up == 1)"), 2)
      << client.Get("/api/v1/targets")->body << prometheus.log();
  EXPECT_EQ(value(ok_requests), 5);
  EXPECT_EQ(value("knapserve_generation_tokens_total{job=\"executor\"}"),
            tokens);
  EXPECT_EQ(value("knapserve_spec_decode_num_drafts_total"), drafts);
  EXPECT_EQ(value("knapserve_spec_decode_num_accepted_tokens_total"), accepted);
  EXPECT_EQ(value("knapserve_planner_plans_applied_total"), plans_applied);
  // The planner's side of the planning overhead.
  const double plan_requests = value(plan_requests_query);
  // The second planned request may reuse the first's plan (the plan cache).
  EXPECT_GE(plan_requests, 1);
  EXPECT_EQ(planner_answered(), plan_requests);
  EXPECT_EQ(value("knapserve_planner_server_solve_seconds_count"),
            value("knapserve_planner_server_plans_total"));
  EXPECT_GT(value("knapserve_planner_server_received_bytes_total"), 0);
  EXPECT_EQ(value("knapserve_planner_server_queue_depth"), 0);
  EXPECT_GE(value("knapserve_planner_cpu_share"), 0);
  EXPECT_EQ(value("knapserve_running_requests"), 0);
  // The knn request went to the story domain ("Once upon a time").
  EXPECT_EQ(value("knapserve_routed_requests_total{domain=\"stories\"}"), 1);
  EXPECT_EQ(value("knapserve_routed_requests_total{domain=\"numbers\"}"), 0);
  EXPECT_EQ(value("knapserve_routing_seconds_count"), 1);

  // Every dashboard query runs, and names only exposed metrics.
  const nlohmann::json names_reply = [&] {
    const httplib::Result res = client.Get("/api/v1/label/__name__/values");
    return res ? nlohmann::json::parse(res->body, nullptr, false)
               : nlohmann::json();
  }();
  ASSERT_TRUE(names_reply.is_object()) << "no metric names";
  const std::set<std::string> exposed =
      names_reply["data"].get<std::set<std::string>>();
  const std::regex metric_name("knapserve_[a-z_]+");
  int exprs_checked = 0;
  for (const auto& entry : std::filesystem::directory_iterator(
           knapserve::testing::kSourceDir + std::string("/deploy/grafana"))) {
    if (entry.path().extension() != ".json") continue;
    const nlohmann::json dashboard =
        nlohmann::json::parse(ReadFile(entry.path().string()), nullptr, false);
    ASSERT_FALSE(dashboard.is_discarded()) << entry.path();
    std::vector<std::string> exprs;
    CollectExprs(dashboard, exprs);
    for (const std::string& expr : exprs) {
      if (expr.rfind("{", 0) == 0) continue;  // a TraceQL query (Tempo)
      const nlohmann::json r = PrometheusQuery(client, expr);
      ASSERT_TRUE(r.is_object()) << expr;
      EXPECT_EQ(r.value("status", ""), "success")
          << entry.path().filename() << ": " << expr << "\n"
          << r.dump();
      for (std::sregex_iterator it(expr.begin(), expr.end(), metric_name), end;
           it != end; ++it) {
        EXPECT_TRUE(exposed.count(it->str())) << entry.path().filename() << ": "
                                              << it->str() << " is not exposed";
      }
      ++exprs_checked;
    }
  }
  EXPECT_GE(exprs_checked, 20);
  EXPECT_EQ(executor.Stop(), 0) << executor.log();
  EXPECT_EQ(planner.Stop(), 0) << planner.log();
}

}  // namespace knapserve
