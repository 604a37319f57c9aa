// End-to-end tests of the servers: `knapserve serve`, knapserve-executor and
// knapserve-planner as child processes, in one-process and split
// deployments, driven by our own and outside clients (Python grpcio, the
// official openai npm client, Prometheus), under TLS, planner crashes,
// SIGTERM and a latency profile still being measured.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "knapserve/v1/generation.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "testing/build_paths.h"
#include "tests/testing/test_models.h"
#include "tests/testing/test_util.h"
#include "tests/tools/cli_test_util.h"
#include "tools/prompt_set.h"
#include "tools/shared_data.h"

namespace knapserve {
namespace cli_test {
namespace {

using knapserve::testing::FreeLoopbackPort;
using knapserve::testing::ReadFile;
using knapserve::testing::ServerProcess;
using ::testing::AllOf;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

// Two processes and a client: knapserve-planner, knapserve-executor --planner
// ADDR, and generate --server ADDR; also generate --planner ADDR locally and
// the one-process `knapserve serve`. Greedy ids equal local --spec off, and
// SIGTERM stops each server with exit 0.
TEST(KnapserveServerTest, SplitAndOneProcessDeploymentsGiveTheSameGreedyIds) {
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
TEST(KnapserveServerTest, IndependentPythonClientStreamsAndChecksHealth) {
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
TEST(KnapserveServerTest, OfficialOpenAiClientDrivesTheHttpFrontDoor) {
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
  // The client's penalized completion (presence_penalty 0.5,
  // frequency_penalty 1) is what the same flags give locally and over gRPC.
  std::vector<std::string> penalized = Stories(GreedyJson(40));
  penalized.insert(penalized.end(),
                   {"--presence-penalty", "0.5", "--frequency-penalty", "1"});
  const nlohmann::json local_penalized = RunJson(penalized);
  EXPECT_EQ(Ids(out["penalized_ids"]), Ids(local_penalized["output_ids"]));
  EXPECT_NE(Ids(local_penalized["output_ids"]), Ids(local["output_ids"]));
  penalized.insert(penalized.end(), {"--server", serve.address()});
  EXPECT_EQ(Ids(out["penalized_ids"]), Ids(RunJson(penalized)["output_ids"]));
  EXPECT_EQ(serve.Stop(), 0) << serve.log();
}
// Split deployment under a planner crash: the planner process is SIGKILLed
// mid-generation; the generation completes with the same ids, the executor
// stays SERVING, and once a planner listens on the address again the
// executor reconnects and applies plans.
TEST(KnapserveServerTest, ExecutorSurvivesAPlannerKillAndReconnects) {
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
TEST(KnapserveServerTest, ExecutorDrainsOnSigterm) {
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
TEST(KnapserveServerTest, TlsOnTheGenerationServiceAndMutualTlsToThePlanner) {
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

// Issue 26, item 8. `knapserve serve` on a model without a cached profile
// serves at once: the port is open and SERVING while the profile is still
// pending (held by the test-only gate file, so "before the profile is
// ready" is certain), plain and planned requests succeed with plain
// decoding's output and say the planned one decoded plainly for want of the
// profile (gRPC final message and the HTTP extension); once the gate opens
// the profile is measured in the background, logged, stored in the cache
// folder, and planned requests plan.
TEST(KnapserveServerTest, ServeAnswersAtOnceWhileItsProfileIsMeasured) {
  const knapserve::testing::ScopedTempDir temp("cli_background_profile");
  const std::string cache = temp.path() + "/profiles";
  const std::string gate = temp.path() + "/gate";
  const auto started = std::chrono::steady_clock::now();
  ServerProcess serve(
      Stories({knapserve::testing::kKnapserveBinary, "serve", "--listen",
               "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
               "--served-model-name", "stories", "--profile-cache", cache}),
      "", {"KNAPSERVE_TEST_PROFILE_GATE=" + gate});
  ASSERT_FALSE(serve.port().empty()) << serve.log();
  const double to_port =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started)
          .count();
  EXPECT_EQ(HealthStatus(serve.address(), "knapserve.v1.Generation"), 1)
      << serve.log();
  std::printf("[ serve  ] port open and SERVING %.2f s after start\n", to_port);
  EXPECT_THAT(serve.log(), HasSubstr("profile: measuring in the background"));
  EXPECT_THAT(serve.log(), HasSubstr("planned modes decode plainly until it "
                                     "is ready"));
  EXPECT_THAT(serve.log(), ::testing::Not(HasSubstr("profile ready")));

  const nlohmann::json local = RunJson(Stories(GreedyJson(60)));
  std::vector<std::string> off = GreedyJson(60);
  off.insert(off.end(), {"--server", serve.address(), "--spec", "off"});
  const nlohmann::json plain = RunJson(off);
  EXPECT_EQ(Ids(plain["output_ids"]), Ids(local["output_ids"]));
  EXPECT_EQ(plain["planning"]["profile_pending"], false);
  std::vector<std::string> knapspec = GreedyJson(60);
  knapspec.insert(knapspec.end(),
                  {"--server", serve.address(), "--spec", "knapspec",
                   "--plan-interval", "8", "--reference-steps", "2"});
  const nlohmann::json pending = RunJson(knapspec);
  EXPECT_EQ(Ids(pending["output_ids"]), Ids(local["output_ids"]));
  EXPECT_EQ(pending["planning"]["profile_pending"], true) << pending.dump();
  // Every decode step after the prefill's token was plain for want of it.
  EXPECT_EQ(pending["planning"]["profile_pending_steps"], 59) << pending.dump();
  EXPECT_EQ(pending["plan_requests"], 0);
  EXPECT_EQ(pending["plan_failures"], 0);
  EXPECT_TRUE(pending["plans"].empty());
  EXPECT_EQ(pending["speculation"]["drafts"], 0);

  // The HTTP API's `knapserve` extension says the same.
  const std::string log = serve.log();
  const size_t at = log.find("http port ");
  ASSERT_NE(at, std::string::npos) << log;
  const std::string http_port =
      log.substr(at + 10, log.find('\n', at) - at - 10);
  httplib::Client http("127.0.0.1", std::stoi(http_port));
  const nlohmann::json body = {
      {"model", "stories"}, {"prompt", "Once upon a time"},
      {"max_tokens", 20},   {"temperature", 0},
      {"ignore_eos", true}, {"knapserve", {{"spec", "knapspec"}}}};
  const httplib::Result completion =
      http.Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(completion) << log;
  ASSERT_EQ(completion->status, 200) << completion->body;
  const nlohmann::json answer = nlohmann::json::parse(completion->body);
  EXPECT_EQ(answer["knapserve"]["planning"]["profile_pending"], true)
      << completion->body;
  EXPECT_EQ(answer["knapserve"]["planning"]["profile_pending_steps"], 19);
  EXPECT_TRUE(ProfilesIn(cache).empty());

  // The gate opens: the profile is measured while the server is idle.
  knapserve::testing::WriteFile(gate, "");
  ASSERT_TRUE(WaitUntil(
      [&] {
        return serve.log().find("profile ready after") != std::string::npos;
      },
      600))
      << serve.log();
  EXPECT_THAT(ProfilesIn(cache), ::testing::SizeIs(1)) << serve.log();
  std::vector<std::string> planned = GreedyJson(150);
  planned.insert(planned.end(),
                 {"--server", serve.address(), "--spec", "knapspec",
                  "--plan-interval", "8", "--reference-steps", "2"});
  const nlohmann::json ready = RunJson(planned);
  EXPECT_EQ(Ids(ready["output_ids"]),
            Ids(RunJson(Stories(GreedyJson(150)))["output_ids"]));
  EXPECT_EQ(ready["planning"]["profile_pending"], false) << ready.dump();
  EXPECT_EQ(ready["planning"]["profile_pending_steps"], 0);
  EXPECT_GT(ready["plan_requests"].get<int64_t>(), 0) << ready.dump();
  EXPECT_EQ(ready["plan_failures"], 0) << ready.dump();
  EXPECT_EQ(ready["planning"]["triggers"]["no_plan"], 1);
  EXPECT_EQ(serve.Stop(), 0) << serve.log();
}

// The split deployment under the same start: knapserve-planner without a
// cached profile serves at once and answers "profile pending"; the executor
// decodes plainly, counts no failure, and plans once the planner has
// measured its profile.
TEST(KnapserveServerTest, APlannerStillMeasuringItsProfileIsNoFailure) {
  const knapserve::testing::ScopedTempDir temp("cli_planner_pending");
  const std::string cache = temp.path() + "/profiles";
  const std::string gate = temp.path() + "/gate";
  ServerProcess planner(
      Stories({knapserve::testing::kKnapservePlannerBinary, "--listen",
               "127.0.0.1:0", "--profile-cache", cache}),
      "", {"KNAPSERVE_TEST_PROFILE_GATE=" + gate});
  ASSERT_FALSE(planner.port().empty()) << planner.log();
  EXPECT_THAT(planner.log(), HasSubstr("profile: measuring in the background"));
  ServerProcess executor(
      Stories({knapserve::testing::kKnapserveExecutorBinary, "--listen",
               "127.0.0.1:0", "--planner", planner.address()}));
  ASSERT_FALSE(executor.port().empty()) << executor.log();
  const nlohmann::json local = RunJson(Stories(GreedyJson(100)));
  std::vector<std::string> knapspec = GreedyJson(100);
  knapspec.insert(knapspec.end(),
                  {"--server", executor.address(), "--spec", "knapspec",
                   "--plan-interval", "8", "--reference-steps", "2"});
  // The first snapshot's "pending" answer reaches the executor while some
  // request runs; requests until one reports it (each must be lossless and
  // count no failure).
  nlohmann::json reported;
  ASSERT_TRUE(WaitUntil(
      [&] {
        const nlohmann::json out = RunJson(knapspec);
        EXPECT_EQ(Ids(out["output_ids"]), Ids(local["output_ids"]));
        EXPECT_EQ(out["plan_failures"], 0) << out.dump();
        EXPECT_TRUE(out["plans"].empty()) << out.dump();
        if (out["planning"]["profile_pending"] != true) return false;
        reported = out;
        return true;
      },
      120))
      << executor.log() << planner.log();
  EXPECT_GT(reported["planning"]["profile_pending_steps"].get<int64_t>(), 0);

  knapserve::testing::WriteFile(gate, "");
  ASSERT_TRUE(WaitUntil(
      [&] {
        return planner.log().find("profile ready after") != std::string::npos;
      },
      600))
      << planner.log();
  EXPECT_THAT(ProfilesIn(cache), ::testing::SizeIs(1)) << planner.log();
  // Once the executor's retry window has passed it plans again.
  ASSERT_TRUE(WaitUntil(
      [&] {
        const nlohmann::json out = RunJson(knapspec);
        EXPECT_EQ(Ids(out["output_ids"]), Ids(local["output_ids"]));
        EXPECT_EQ(out["plan_failures"], 0) << out.dump();
        return !out["plans"].empty();
      },
      120))
      << executor.log() << planner.log();
  EXPECT_EQ(executor.Stop(), 0) << executor.log();
  EXPECT_EQ(planner.Stop(), 0) << planner.log();
}

// Issue 26, item 6: `generate --server --json` prints the planning
// statistics in-process `generate --json` prints, from the final message:
// the same keys in `planning` and in each plan, the same counts (timings and
// the guard's measurements differ by nature).
TEST(KnapserveServerTest,
     GenerateOverTheServerPrintsTheSamePlanningStatistics) {
  ServerProcess serve(
      Stories({knapserve::testing::kKnapserveBinary, "serve", "--listen",
               "127.0.0.1:0", "--profile", StoriesProfile()}));
  ASSERT_FALSE(serve.port().empty()) << serve.log();
  std::vector<std::string> planned = GreedyJson(150);
  planned.insert(planned.end(), {"--spec", "knapspec", "--plan-interval", "8",
                                 "--reference-steps", "3", "--logprobs",
                                 "--top-logprobs", "2"});
  std::vector<std::string> in_process = planned;
  in_process.insert(in_process.end(), {"--profile", StoriesProfile()});
  const nlohmann::json local = RunJson(Stories(in_process));
  std::vector<std::string> over_grpc = planned;
  over_grpc.insert(over_grpc.end(), {"--server", serve.address()});
  const nlohmann::json remote = RunJson(over_grpc);
  EXPECT_EQ(Ids(remote["output_ids"]), Ids(local["output_ids"]));
  // The log-probabilities, and the two most likely tokens at each position,
  // arrive the same over gRPC (issue 28, item 4).
  ASSERT_EQ(local["output_logprobs"].size(), 150u);
  ASSERT_EQ(remote["output_logprobs"].size(), 150u);
  ASSERT_EQ(remote["output_top_logprobs"].size(), 150u);
  for (size_t i = 0; i < 150; ++i) {
    EXPECT_NEAR(remote["output_logprobs"][i].get<double>(),
                local["output_logprobs"][i].get<double>(), 1e-4)
        << i;
    const nlohmann::json& top = remote["output_top_logprobs"][i];
    ASSERT_EQ(top.size(), 2u) << i;
    EXPECT_EQ(top[0][0], local["output_top_logprobs"][i][0][0]) << i;
    EXPECT_EQ(top[0][0], remote["output_ids"][i]) << "greedy: the top one";
    EXPECT_NEAR(top[1][1].get<double>(),
                local["output_top_logprobs"][i][1][1].get<double>(), 1e-4)
        << i;
  }

  ASSERT_TRUE(local["planning"].is_object()) << local.dump();
  ASSERT_TRUE(remote["planning"].is_object()) << remote.dump();
  EXPECT_EQ(KeyPaths(remote["planning"]), KeyPaths(local["planning"]));
  EXPECT_GE(KeyPaths(local["planning"]).size(), 17u);
  for (const char* count :
       {"/plan_cache_hits", "/plan_cache_misses", "/triggers/no_plan",
        "/triggers/new_bucket", "/profile_pending", "/profile_pending_steps"}) {
    const nlohmann::json::json_pointer at(count);
    EXPECT_EQ(remote["planning"][at], local["planning"][at]) << count;
  }
  EXPECT_EQ(local["planning"]["plan_cache_misses"], 1);
  EXPECT_EQ(local["planning"]["triggers"]["no_plan"], 1);
  for (const char* key : {"plan_requests", "plan_failures", "plans"}) {
    EXPECT_TRUE(remote.contains(key)) << key;
  }
  EXPECT_GT(local["plan_requests"].get<int64_t>(), 0);
  EXPECT_GT(remote["plan_requests"].get<int64_t>(), 0);
  EXPECT_EQ(remote["plan_failures"], local["plan_failures"]);
  EXPECT_GT(remote["decode_seconds"].get<double>(), 0);
  EXPECT_GE(remote["planning"]["solve_seconds"].get<double>(), 0);
  ASSERT_TRUE(remote["plans"].is_array());
  if (!local["plans"].empty() && !remote["plans"].empty()) {
    EXPECT_EQ(KeyPaths(remote["plans"][0]), KeyPaths(local["plans"][0]));
    EXPECT_EQ(remote["plans"][0]["source"], "solve");
    EXPECT_EQ(local["plans"][0]["source"], "solve");
  }
  EXPECT_EQ(serve.Stop(), 0) << serve.log();
}

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
TEST(KnapserveServerTest,
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

}  // namespace
}  // namespace cli_test
}  // namespace knapserve
