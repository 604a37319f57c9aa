// End-to-end tests of the `knapserve` commands that run in one process
// (generate, profile, anchors, tokenize, make-model, bench): each test runs
// the real binary (built by the knapserve target) as a child process, parses
// what it prints, and checks exit codes and error messages. Servers and
// deployments: knapserve_server_test.cc.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/model/simd_target.h"
#include "common/text/tokenizer.h"
#include "nlohmann/json.hpp"
#include "testing/build_paths.h"
#include "tests/testing/test_models.h"
#include "tests/testing/test_util.h"
#include "tests/tools/cli_test_util.h"

namespace knapserve {
namespace cli_test {
namespace {

using knapserve::testing::FreeLoopbackPort;
using knapserve::testing::ReadFile;
using knapserve::testing::ServerProcess;
using ::testing::AllOf;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::Not;

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

// The log does not grow with the generation: nothing is written per step or
// per token (a stray debug print once wrote a line per speculative step).
TEST(KnapserveCliTest, TheLogDoesNotGrowWithTheNumberOfTokens) {
  for (const char* spec : {"off", "static"}) {
    std::vector<size_t> lines;
    for (const char* tokens : {"4", "57"}) {
      const std::vector<std::string> args =
          Stories({"generate", "--prompt", "Zoo", "--max-new-tokens", tokens,
                   "--temperature", "0", "--spec", spec, "--skip", "a1,m3",
                   "--max-draft", "4", "--json"});
      const Outcome outcome = RunKnapserve(args);
      ASSERT_EQ(outcome.exit_code, 0) << Describe(args, outcome);
      lines.push_back(std::count(outcome.err.begin(), outcome.err.end(), '\n'));
    }
    EXPECT_EQ(lines[0], lines[1]) << spec;
  }
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
  // Trained heads beside the model are used when present (--exit-heads
  // auto, the default), with their own T_0; --exit-heads model still picks
  // the model's own.
  const std::string beside = dir.path() + "/model";
  std::filesystem::create_directories(beside);
  for (const auto& entry : std::filesystem::directory_iterator(
           knapserve::testing::Stories260kDir())) {
    std::filesystem::copy(
        entry.path(), std::filesystem::path(beside) / entry.path().filename());
  }
  std::filesystem::copy(heads, beside + "/exit_heads.safetensors");
  for (const std::string& which : {std::string("auto"), std::string("model")}) {
    const std::vector<std::string> args = {"generate",  "--prompt",
                                           "Zoo",       "--max-new-tokens",
                                           "57",        "--temperature",
                                           "0",         "--spec",
                                           "specbound", "--exit-heads",
                                           which,       "--specbound-lambda",
                                           "0.5",       "--json",
                                           "--model",   beside,
                                           "--threads", "1"};
    const nlohmann::json out = RunJson(args);
    EXPECT_THAT(Ids(out["output_ids"]), ElementsAreArray(kZooGreedyIds))
        << which;
    const nlohmann::json& sb = out["speculation"]["specbound"];
    EXPECT_EQ(sb["heads"], which == "auto" ? "trained" : "training-free");
    EXPECT_DOUBLE_EQ(sb["t0"].get<double>(), which == "auto" ? 1.0 : 2.5);
  }

  const std::vector<std::string> wrong =
      Tiny({"generate", "--prompt", "Zoo", "--spec", "specbound",
            "--exit-heads", heads});
  const Outcome outcome = RunKnapserve(wrong);
  EXPECT_NE(outcome.exit_code, 0) << Describe(wrong, outcome);
  EXPECT_THAT(outcome.err, AllOf(HasSubstr(heads), HasSubstr("fingerprint")));
}

TEST(KnapserveCliTest, ProfileThenPlannedGenerationGivesTheSameGreedyIds) {
  const nlohmann::json profile =
      nlohmann::json::parse(ReadFile(StoriesProfile()), nullptr, false);
  ASSERT_FALSE(profile.is_discarded());
  EXPECT_EQ(profile["device"], "cpu");
  EXPECT_EQ(profile["dtype"], "fp32");
  // The engine's own work per step was measured (tools/step_overhead.h): a
  // step does more than its passes. Each overhead is a line in the context.
  EXPECT_GT(profile["step_overhead_seconds"].get<double>() +
                128 * profile["step_overhead_slope"].get<double>(),
            0);
  EXPECT_GE(profile["draft_overhead_seconds"].get<double>(), 0);
  EXPECT_GE(profile["draft_overhead_slope"].get<double>(), 0);
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
      {{"profile", "--out", dir + "/p.json", "--profile-contexts", "128,-5"},
       "--profile-contexts: '-5' is not a positive token count"},
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
// and gives plain decoding's greedy ids; each domain also gets a draft for
// longer prompts (--longer-prompts); the file is refused by another model,
// and bad --domains and --longer-prompts are refused naming the item.

TEST(KnapserveCliTest, AnchorsThenKnnGenerationRoutesAndStaysLossless) {
  const knapserve::testing::ScopedTempDir temp("cli_anchors");
  const std::string& dir = temp.path();
  const std::string file = dir + "/s260k.anchors";
  const nlohmann::json built = RunJson(
      Stories({"anchors", "--domains", WriteTwoDomains(dir), "--split", "all",
               "--out", file, "--mask-samples", "2", "--reference-tokens", "8",
               "--max-draft", "4", "--profile", StoriesProfile(),
               "--longer-prompts", "96", "--json"}));
  ASSERT_TRUE(built["domains"].is_array());
  ASSERT_EQ(built["domains"].size(), 2u);
  EXPECT_EQ(built["domains"][0]["name"], "stories");
  EXPECT_EQ(built["domains"][0]["samples"], 4);
  // One draft for 96-token prompts per domain, beside the samples' own.
  for (const nlohmann::json& domain : built["domains"]) {
    EXPECT_LT(domain["prompt_tokens"].get<int64_t>(), 96) << domain;
    ASSERT_EQ(domain["longer"].size(), 1u) << domain;
    EXPECT_EQ(domain["longer"][0]["prompt_tokens"], 96) << domain;
  }

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
      {Stories({"anchors", "--domains", WriteTwoDomains(dir), "--out",
                dir + "/x", "--longer-prompts", "512,many"}),
       "'many' is not a positive token count"},
  };
  for (const Case& c : cases) {
    const Outcome outcome = RunKnapserve(c.args);
    EXPECT_NE(outcome.exit_code, 0) << Describe(c.args, outcome);
    EXPECT_THAT(outcome.err, HasSubstr(c.expected))
        << Describe(c.args, outcome);
  }
}

// An outside check of the logits processors: `generate --dump-logits` writes
// the raw logits of every generated position, and
// tests/testing/check_logits_processors.py (plain Python, written from the
// definitions) recomputes the processed greedy choice at each position from
// them and the history, with the settings given to knapserve. Plain and
// speculative runs pass it with the same ids, the processors changed some
// choices, and the same dump checked against other settings fails.
TEST(KnapserveCliTest, AnOutsideScriptRecomputesTheProcessedGreedyChoices) {
  const knapserve::testing::ScopedTempDir dir("dump_logits");
  const std::string script =
      knapserve::testing::kSourceDir +
      std::string("/tests/testing/check_logits_processors.py");
  const std::vector<std::string> settings = {
      "--repetition-penalty", "1.3", "--presence-penalty", "0.4",
      "--frequency-penalty",  "0.6", "--logit-bias",       "261:-100,298:1.5",
      "--min-tokens",         "30",  "--bad-words",        "376 298,432"};
  std::vector<int32_t> plain_ids;
  std::string plain_dump;
  for (const std::string spec : {"off", "static"}) {
    SCOPED_TRACE(spec);
    const std::string dump = dir.path() + "/" + spec + ".json";
    std::vector<std::string> args = {"generate",
                                     "--prompt",
                                     "Once upon a time",
                                     "--max-new-tokens",
                                     "48",
                                     "--temperature",
                                     "0",
                                     "--json",
                                     "--dump-logits",
                                     dump,
                                     "--spec",
                                     spec};
    if (spec == "static") {
      args.insert(args.end(), {"--skip", "a2,m2", "--max-draft", "3"});
    }
    args.insert(args.end(), settings.begin(), settings.end());
    const nlohmann::json out = RunJson(Stories(args));
    std::vector<std::string> check = {"/usr/bin/python3", script, dump};
    check.insert(check.end(), settings.begin(), settings.end());
    const Outcome checked = RunProcess(check);
    ASSERT_EQ(checked.exit_code, 0) << checked.out << checked.err;
    const nlohmann::json summary =
        nlohmann::json::parse(checked.out, nullptr, false);
    ASSERT_TRUE(summary.is_object()) << checked.out;
    EXPECT_EQ(summary["positions"],
              static_cast<int64_t>(Ids(out["output_ids"]).size()));
    EXPECT_GT(summary["changed"].get<int>(), 0)
        << "the processors changed no choice: the check would prove nothing";
    if (spec == "off") {
      plain_ids = Ids(out["output_ids"]);
      plain_dump = dump;
    } else {
      EXPECT_EQ(Ids(out["output_ids"]), plain_ids);
      EXPECT_GT(out["speculation"]["drafts"].get<int>(), 0);
    }
  }
  // The check can fail: the plain run's dump against settings it did not
  // run with.
  std::vector<std::string> wrong = {"/usr/bin/python3", script, plain_dump};
  wrong.insert(wrong.end(), settings.begin() + 2, settings.end());
  const Outcome refused = RunProcess(wrong);
  EXPECT_EQ(refused.exit_code, 1) << refused.out << refused.err;
  EXPECT_THAT(refused.err, HasSubstr("knapserve chose"));
}

// The processors' flags: what does not parse names the flag, a value out of
// range names the field, --dump-logits is local only.
TEST(KnapserveCliTest, LogitsProcessorFlagsAreCheckedByName) {
  struct Case {
    std::vector<std::string> flags;
    std::string says;
  };
  const std::vector<Case> cases = {
      {{"--logit-bias", "12"}, "--logit-bias: '12' is not ID:BIAS"},
      {{"--logit-bias", "x:1"}, "--logit-bias"},
      {{"--bad-words", "1 y"}, "--bad-words: 'y' is not a token id"},
      {{"--logit-bias", "12:500"}, "logit_bias: the bias of token id 12"},
      {{"--presence-penalty", "3"}, "presence_penalty: must be in [-2, 2]"},
      {{"--repetition-penalty", "0"}, "repetition_penalty: must be"},
      {{"--min-p", "2"}, "min_p: must be in [0, 1]"},
      {{"--min-tokens", "9"}, "min_tokens: must be <= max_new_tokens"},
      {{"--dump-logits", "/tmp/x.json", "--server", "127.0.0.1:1"},
       "--dump-logits: only for local generation"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = {"generate", "--prompt", "Zoo",
                                     "--max-new-tokens", "4"};
    args.insert(args.end(), c.flags.begin(), c.flags.end());
    const Outcome outcome = RunKnapserve(Stories(args));
    EXPECT_EQ(outcome.exit_code, 2) << Describe(args, outcome);
    EXPECT_THAT(outcome.err, HasSubstr(c.says)) << Describe(args, outcome);
  }
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
      Stories({"bench", "spec", "--num-prompts", "2", "--max-new-tokens", "24",
               "--skip", "m0", "--max-draft", "3", "--modes", "off,static,off",
               "--json"});
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
  // off named twice runs twice: off#2 is timed against the first off.
  EXPECT_EQ(set["modes"].size(), 3u);
  for (const char* mode : {"off", "static", "off#2"}) {
    const nlohmann::json& m = set["modes"][mode];
    ASSERT_TRUE(m.is_object()) << mode;
    EXPECT_GT(m["decode_tokens_per_s"].get<double>(), 0) << mode;
    EXPECT_EQ(m["decoded_tokens"], 2 * 23)
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
  // Pair by pair (2 prompts x 1 repeat): static against the off runs on
  // either side of it, off#2 against the first off.
  const nlohmann::json& paired = set["modes"]["static"]["paired_speedup"];
  EXPECT_EQ(paired["pairs"], 2);
  EXPECT_EQ(paired["against"], nlohmann::json({"off", "off#2"}));
  EXPECT_GT(paired["median"].get<double>(), 0);
  EXPECT_EQ(set["modes"]["off#2"]["paired_speedup"]["against"],
            nlohmann::json({"off"}));
  EXPECT_EQ(set["modes"]["off"]["paired_speedup"]["median"], 1.0);
  // Two pairs: too few for a 95% interval of the median.
  EXPECT_EQ(paired["ci95_high"], 0.0);
  EXPECT_THAT(outcome.err, HasSubstr("(under 6 pairs)"));
  // Every run's own time, from which the pairs are formed again: static's
  // rate over the mean of the off runs beside it, prompt by prompt.
  for (const char* mode : {"off", "static", "off#2"}) {
    ASSERT_TRUE(set["modes"][mode].contains("repeat_runs")) << mode;
    ASSERT_EQ(set["modes"][mode]["repeat_runs"].size(), 2u) << mode;
  }
  auto rate = [&](const char* mode, int prompt) {
    const nlohmann::json& run = set["modes"][mode]["repeat_runs"][prompt];
    EXPECT_EQ(run["decode_seconds"].size(), 1u) << mode;
    EXPECT_EQ(run["decoded_tokens"], nlohmann::json({23})) << mode;
    return run["decoded_tokens"][0].get<double>() /
           run["decode_seconds"][0].get<double>();
  };
  double ratio_sum = 0;
  for (int p = 0; p < 2; ++p) {
    ratio_sum +=
        rate("static", p) / (0.5 * (rate("off", p) + rate("off#2", p)));
  }
  EXPECT_NEAR(paired["median"].get<double>(), ratio_sum / 2, 1e-9);
  // The run's noise floor: the off runs after the first, paired likewise.
  EXPECT_EQ(set["off_against_off"]["runs"], 1);
  EXPECT_EQ(set["off_against_off"]["min"],
            set["modes"]["off#2"]["paired_speedup"]["median"]);
  EXPECT_EQ(set["off_against_off"]["max"], set["off_against_off"]["min"]);
  EXPECT_THAT(outcome.err, HasSubstr("off against off (each later off"));
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
    const nlohmann::json& knapspec = out["sets"][set]["modes"]["knapspec"];
    EXPECT_GT(knapspec["plan_requests"].get<int64_t>(), 0) << set;
    // Each applied plan, as `generate --json` lists them.
    ASSERT_TRUE(knapspec.contains("plans") && knapspec.at("plans").is_array())
        << set;
    EXPECT_EQ(knapspec.at("plans").size(),
              knapspec.at("plans_applied").get<size_t>())
        << set;
    for (const nlohmann::json& plan : knapspec.at("plans")) {
      EXPECT_TRUE(plan.contains("source")) << set;
      EXPECT_TRUE(plan.contains("measured_steps")) << set;
      EXPECT_GE(plan.at("gamma").get<int>(), 0) << set;
    }
  }
  // tools/spec_table.py (README.md's 16-row table) reads this JSON: filed
  // as one (model, dtype, cache) of tools/spec_table.sh's folder, it makes
  // that model's two rows and the criteria lines.
  const knapserve::testing::ScopedTempDir dir("spec_table");
  {
    std::ofstream file(dir.path() + "/stories-24l_fp32_cold.json");
    file << outcome.out;
  }
  const Outcome table = RunProcess(
      {"/usr/bin/python3",
       knapserve::testing::kSourceDir + std::string("/tools/spec_table.py"),
       dir.path()});
  ASSERT_EQ(table.exit_code, 0) << table.out << table.err;
  EXPECT_THAT(table.out,
              AllOf(HasSubstr("| stories-24l fp32 | short | cold |"),
                    HasSubstr("| stories-24l fp32 | 1k | cold |"),
                    HasSubstr("cells at 0.97x or better:"),
                    HasSubstr("best planned or routed mode at least static:"),
                    HasSubstr("calibrated prediction within 10%")));
  EXPECT_THAT(table.out, Not(HasSubstr("**NO**")));
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

  const nlohmann::json poisson = RunJson(Stories({"bench",
                                                  "serve",
                                                  "--prompts",
                                                  prompts,
                                                  "--arrival",
                                                  "poisson",
                                                  "--request-rate",
                                                  "40",
                                                  "--num-requests",
                                                  "4",
                                                  "--max-new-tokens",
                                                  "16",
                                                  "--modes",
                                                  "off,static,off",
                                                  "--skip",
                                                  "a1,m2",
                                                  "--max-draft",
                                                  "3",
                                                  "--profile",
                                                  StoriesProfile(),
                                                  "--json"}));
  EXPECT_EQ(poisson["arrival"], "poisson");
  // Each run against the off runs around it: static against the mean of
  // the two, each off against the other.
  ASSERT_EQ(poisson["modes"].size(), 3u);
  auto load_rate = [&](int k) {
    return poisson["modes"][k]["load"]["decode_tokens_per_s"].get<double>();
  };
  EXPECT_NEAR(
      poisson["modes"][1]["load_decode_vs_adjacent_first_mode"].get<double>(),
      load_rate(1) / (0.5 * (load_rate(0) + load_rate(2))), 1e-9);
  EXPECT_NEAR(
      poisson["modes"][0]["load_decode_vs_adjacent_first_mode"].get<double>(),
      load_rate(0) / load_rate(2), 1e-9);
  EXPECT_EQ(poisson["mode_summary"][0]["vs_adjacent_first_mode"].size(), 2u);
  // A mode's second run has no single phase: its load follows the last run's.
  EXPECT_TRUE(poisson["modes"][0].contains("single"));
  EXPECT_FALSE(poisson["modes"][2].contains("single"));
  EXPECT_FALSE(poisson["modes"][2].contains("output_throughput_ratio"));

  // The same load through the OpenAI front door, sampled with a seed: the
  // same outputs as off's single streams (checked by the command), with
  // speculation and three streams side by side (coupled draws: a seed means
  // the same text in every mode and batch).
  const nlohmann::json http = RunJson(Stories(
      {"bench",          "serve",      "--prompts",        prompts,
       "--protocol",     "http",       "--concurrency",    "3",
       "--num-requests", "4",          "--max-new-tokens", "12",
       "--modes",        "off,static", "--skip",           "a1,m2",
       "--max-draft",    "3",          "--profile",        StoriesProfile(),
       "--temperature",  "1",          "--seed",           "5",
       "--json"}));
  EXPECT_EQ(http["protocol"], "http");
  EXPECT_EQ(http["checked"], true);
  ASSERT_EQ(http["modes"].size(), 2u);
  for (const nlohmann::json& mode : http["modes"]) {
    EXPECT_EQ(mode["load"]["failed"], 0);
    EXPECT_EQ(mode["load"]["completion_tokens"], 48);
    EXPECT_EQ(mode["mismatches"], 0);
  }
  EXPECT_EQ(http["mismatches"], 0);
  EXPECT_GT(http["modes"][1]["single"]["tokens_per_step"].get<double>(), 1.0)
      << "static drafted and some drafts were accepted";
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

  // --rounds 2 runs the list twice: off,static,off,static, the single phases
  // at the first two runs only, every load checked against off's singles.
  // Each run is compared with the off runs around it, and the summary gives
  // the median and range of those ratios (for off: off against off).
  const nlohmann::json rounds = RunJson(Stories({"bench",
                                                 "serve",
                                                 "--prompts",
                                                 prompts,
                                                 "--concurrency",
                                                 "2",
                                                 "--num-requests",
                                                 "2",
                                                 "--max-new-tokens",
                                                 "8",
                                                 "--modes",
                                                 "off,static",
                                                 "--rounds",
                                                 "2",
                                                 "--skip",
                                                 "a1,m2",
                                                 "--max-draft",
                                                 "3",
                                                 "--profile",
                                                 StoriesProfile(),
                                                 "--json"}));
  ASSERT_EQ(rounds["modes"].size(), 4u);
  const std::vector<std::string> specs = {"off", "static", "off", "static"};
  for (int k = 0; k < 4; ++k) {
    SCOPED_TRACE(k);
    const nlohmann::json& run = rounds["modes"][k];
    EXPECT_EQ(run["spec"], specs[k]);
    EXPECT_EQ(run["round"], k / 2);
    EXPECT_EQ(run.contains("single"), k < 2);
    EXPECT_EQ(run["load"]["completion_tokens"], 16);
    EXPECT_EQ(run["mismatches"], 0);
  }
  EXPECT_EQ(rounds["mismatches"], 0);
  auto rate = [&](int k) {
    return rounds["modes"][k]["load"]["decode_tokens_per_s"].get<double>();
  };
  // static's first run sits between the two off runs; its second follows
  // the last off run only.
  const std::vector<double> static_ratios = {
      rate(1) / (0.5 * (rate(0) + rate(2))), rate(3) / rate(2)};
  const nlohmann::json& static_summary = rounds["mode_summary"][1];
  EXPECT_EQ(static_summary["spec"], "static");
  EXPECT_EQ(static_summary["runs"], 2);
  ASSERT_EQ(static_summary["vs_adjacent_first_mode"].size(), 2u);
  EXPECT_NEAR(
      static_summary["vs_adjacent_first_mode_spread"]["median"].get<double>(),
      0.5 * (static_ratios[0] + static_ratios[1]), 1e-9);
  EXPECT_NEAR(
      static_summary["vs_adjacent_first_mode_spread"]["min"].get<double>(),
      std::min(static_ratios[0], static_ratios[1]), 1e-9);
  EXPECT_NEAR(
      static_summary["vs_adjacent_first_mode_spread"]["max"].get<double>(),
      std::max(static_ratios[0], static_ratios[1]), 1e-9);
  // Off against off: each off run against the other.
  EXPECT_NEAR(rounds["mode_summary"][0]["vs_adjacent_first_mode_spread"]["max"]
                  .get<double>(),
              std::max(rate(0) / rate(2), rate(2) / rate(0)), 1e-9);

  const Outcome bad = RunKnapserve(
      Stories({"bench", "serve", "--prompts", prompts, "--arrival", "burst"}));
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_THAT(bad.err, HasSubstr("--arrival"));
  const Outcome no_rounds = RunKnapserve(
      Stories({"bench", "serve", "--prompts", prompts, "--rounds", "0"}));
  EXPECT_EQ(no_rounds.exit_code, 2);
  EXPECT_THAT(no_rounds.err, HasSubstr("--rounds must be >= 1"));
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

}  // namespace
}  // namespace cli_test
}  // namespace knapserve
