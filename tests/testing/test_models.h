// Test fixtures shared by the test binaries: random-weight models written once
// per process by make-model (in MakeTempDir folders, temp_dir.h), the bundled
// stories260k, and the skip helpers of tests that need ../shared.
//
// The shared data folder is tools/shared_data.h's SharedDir():
// $KNAPSERVE_SHARED, which tests/test_main.cc sets to the folder beside the
// source checkout when it is unset and that folder exists, else ../shared
// relative to the working directory. A test that reads anything there beyond
// the bundled model starts with KNAPSERVE_SKIP_WITHOUT_SHARED(relative) (or
// the _MODEL variant), so that without the folder it skips saying what it
// needs instead of failing. The functions are thread-safe.
#ifndef KNAPSERVE_TESTS_TESTING_TEST_MODELS_H_
#define KNAPSERVE_TESTS_TESTING_TEST_MODELS_H_

#include <string>

#include "common/plan/planner_client.h"
#include "planner/latency_profile.h"
#include "tests/testing/temp_dir.h"

namespace knapserve {
class LlamaModel;
class Tokenizer;
}  // namespace knapserve

namespace knapserve::testing {

// The folder of a make-model checkpoint of `shape` in fp32 with `seed`,
// written on first use and reused for the rest of the process. Fails the
// current test (ADD_FAILURE) and returns "" if make-model fails.
std::string RandomModelDir(const std::string& shape, uint64_t seed = 0,
                           const std::string& dtype = "fp32");

// The bundled stories260k (tools/models/stories260k) as the build copies it:
// <build>/share/knapserve/models/stories260k.
std::string Stories260kDir();
// Whether stories260k (weights and tokenizer) is there; tests skip without it.
bool HaveStories260k();

// <shared>/models/<name>, and whether it holds a checkpoint ("stories-24l",
// ...).
std::string SharedModelDir(const std::string& name);
bool HaveSharedModel(const std::string& name);

// Whether <shared>/<relative> exists, and the message a test that needs it
// skips with: "needs <shared>/<relative> (not found at <path>); set
// KNAPSERVE_SHARED to the shared data folder".
bool HaveShared(const std::string& relative);
std::string NeedsSharedMessage(const std::string& relative);

// In a test body (or SetUp): skip the test unless <shared>/<relative>
// exists, or unless <shared>/models/<name> holds a checkpoint.
#define KNAPSERVE_SKIP_WITHOUT_SHARED(relative)                           \
  do {                                                                    \
    if (!::knapserve::testing::HaveShared(relative)) {                    \
      GTEST_SKIP() << ::knapserve::testing::NeedsSharedMessage(relative); \
    }                                                                     \
  } while (0)
#define KNAPSERVE_SKIP_WITHOUT_SHARED_MODEL(name)               \
  do {                                                          \
    if (!::knapserve::testing::HaveSharedModel(name)) {         \
      GTEST_SKIP() << ::knapserve::testing::NeedsSharedMessage( \
          std::string("models/") + std::string(name));          \
    }                                                           \
  } while (0)

// Called by main() before anything else: sets KNAPSERVE_SHARED to the
// folder beside the source checkout when it is unset and that folder exists.
void SetUpTestEnvironment();

// The GoogleTest environment that main() registers: before the first test
// it sets KNAPSERVE_PROFILE_CACHE to a fresh temporary folder (MakeTempDir,
// removed after the last test by TempDirEnvironment) so that no test, nor
// any binary it starts, writes to the user's profile cache. An environment,
// not a step of main(), so that a run that starts no test (--gtest_list_tests,
// which ctest runs to find the suites, or a skipped SIMD run) makes no folder.
class ProfileCacheEnvironment : public ::testing::Environment {
 public:
  void SetUp() override;
};

// Models by name, loaded once per process and kept: the bundled
// "stories260k", a checkpoint in <shared>/models ("stories-24l"), a
// make-model shape in fp32 ("tiny-llama"), or either in another dtype
// ("stories260k/bf16", "tiny-qwen2/bf16"). nullptr (and a test failure) if
// it cannot be loaded.
const LlamaModel* CachedModel(const std::string& name);

// stories260k's tokenizer (512 ids: it decodes every id of the tiny shapes
// too, whose synthetic tokenizer knows only 288 of their 300), loaded once.
const Tokenizer* StoriesTokenizer();

// A knapspec plan request for `model` from one full forward over prefix + r
// random tokens (seeded by sequence_id): the last r tokens' boundary states,
// their argmax, and the prefix K/V (kv_length = prefix).
PlanRequest ForwardPlanRequest(const LlamaModel& model, uint64_t sequence_id,
                               int64_t prefix, int64_t r);

// A hand-made latency profile keyed for `model`: attention and MLP sublayers
// cost `attention` and `mlp` seconds at every context, `fixed` per step, and
// verifying t tokens costs the full step plus 2% per extra token.
LatencyProfile HandLatencyProfile(const LlamaModel& model,
                                  double attention = 1e-4, double mlp = 2e-4,
                                  double fixed = 1e-4, int max_draft = 10);

}  // namespace knapserve::testing

#endif  // KNAPSERVE_TESTS_TESTING_TEST_MODELS_H_
