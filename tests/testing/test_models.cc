#include "tests/testing/test_models.h"

#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/model/llama.h"
#include "common/plan/planner_client.h"
#include "common/text/tokenizer.h"
#include "testing/build_paths.h"
#include "tools/make_model.h"
#include "tools/shared_data.h"

namespace knapserve::testing {
namespace {

// Guards the random-model cache (tests may run fixtures from several
// threads).
ABSL_CONST_INIT absl::Mutex mu(absl::kConstInit);
// RandomModelDir's models by "shape/seed/dtype" (made on first use: no
// dynamic initialization, so static initializers elsewhere may call in).
std::map<std::string, std::string>* random_model_dirs ABSL_GUARDED_BY(mu)
    ABSL_PT_GUARDED_BY(mu) = nullptr;

// CachedModel's loaded models by name (made on first use); models_mu is held
// across a load, so a model loads once even when several threads ask for it.
ABSL_CONST_INIT absl::Mutex models_mu(absl::kConstInit);
std::map<std::string, std::unique_ptr<LlamaModel>>* cached_models
    ABSL_GUARDED_BY(models_mu) ABSL_PT_GUARDED_BY(models_mu) = nullptr;

}  // namespace

std::string RandomModelDir(const std::string& shape, uint64_t seed,
                           const std::string& dtype) {
  const std::string key = absl::StrCat(shape, "/", seed, "/", dtype);
  {
    absl::MutexLock lock(&mu);
    if (random_model_dirs == nullptr)
      random_model_dirs = new std::map<std::string, std::string>();
    auto it = random_model_dirs->find(key);
    if (it != random_model_dirs->end()) return it->second;
  }
  MakeModelOptions options;
  options.shape = shape;
  options.seed = seed;
  options.dtype = dtype;
  options.out_dir = MakeTempDir("model");
  absl::Status status = MakeModel(options);
  if (!status.ok()) {
    ADD_FAILURE() << "make-model " << shape << ": " << status;
    return "";
  }
  absl::MutexLock lock(&mu);
  (*random_model_dirs)[key] = options.out_dir;
  return options.out_dir;
}

std::string Stories260kDir() { return kBundledModelDir; }

bool HaveStories260k() {
  return std::filesystem::exists(Stories260kDir() + "/model.safetensors") &&
         std::filesystem::exists(Stories260kDir() + "/tokenizer.json");
}

std::string SharedModelDir(const std::string& name) {
  return SharedPath("models/" + name);
}

bool HaveSharedModel(const std::string& name) {
  const std::string dir = SharedModelDir(name);
  return std::filesystem::exists(dir + "/model.safetensors") &&
         std::filesystem::exists(dir + "/config.json");
}

bool HaveShared(const std::string& relative) {
  std::error_code ec;
  return std::filesystem::exists(SharedPath(relative), ec);
}

std::string NeedsSharedMessage(const std::string& relative) {
  std::error_code ec;
  const std::string path =
      std::filesystem::absolute(SharedPath(relative), ec).string();
  return absl::StrCat("needs <shared>/", relative, " (not found at ", path,
                      "); set KNAPSERVE_SHARED to the shared data folder");
}

void SetUpTestEnvironment() {
  const char* shared = std::getenv("KNAPSERVE_SHARED");
  if (shared == nullptr) {
    const std::filesystem::path beside =
        (std::filesystem::path(kSourceDir) / ".." / "shared")
            .lexically_normal();
    std::error_code ec;
    if (std::filesystem::is_directory(beside, ec)) {
      setenv("KNAPSERVE_SHARED", beside.c_str(), /*overwrite=*/0);
    }
  }
}

void ProfileCacheEnvironment::SetUp() {
  setenv("KNAPSERVE_PROFILE_CACHE", MakeTempDir("profile_cache").c_str(),
         /*overwrite=*/1);
}

const LlamaModel* CachedModel(const std::string& name) {
  absl::MutexLock lock(&models_mu);
  if (cached_models == nullptr) {
    cached_models = new std::map<std::string, std::unique_ptr<LlamaModel>>();
  }
  if (auto it = cached_models->find(name); it != cached_models->end())
    return it->second.get();
  std::string shape = name;
  ModelOptions options;
  if (const size_t slash = name.find('/'); slash != std::string::npos) {
    shape = name.substr(0, slash);
    auto dtype = ParseDtype(name.substr(slash + 1));
    EXPECT_TRUE(dtype.ok()) << dtype.status();
    if (!dtype.ok()) return nullptr;
    options.dtype = *dtype;
  }
  // The bundled stories260k, a trained checkpoint in <shared>/models by that
  // name, else a make-model shape.
  const std::string dir = shape == "stories260k"   ? Stories260kDir()
                          : HaveSharedModel(shape) ? SharedModelDir(shape)
                                                   : RandomModelDir(shape);
  if (dir.empty()) return nullptr;
  auto model = LlamaModel::Load(dir, options);
  EXPECT_TRUE(model.ok()) << name << ": " << model.status();
  if (!model.ok()) return nullptr;
  return ((*cached_models)[name] = std::move(*model)).get();
}

const Tokenizer* StoriesTokenizer() {
  static Tokenizer* tokenizer = [] {
    auto t = Tokenizer::FromFile(Stories260kDir() + "/tokenizer.json");
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? t->release() : nullptr;
  }();
  return tokenizer;
}

PlanRequest ForwardPlanRequest(const LlamaModel& model, uint64_t sequence_id,
                               int64_t prefix, int64_t r) {
  c10::InferenceMode guard;
  torch::manual_seed(static_cast<uint64_t>(sequence_id));
  torch::Tensor ids =
      torch::randint(3, model.config().vocab_size, {prefix + r}, torch::kInt64);
  std::vector<LayerKv> kv = model.AllocateKv(prefix + r);
  torch::Tensor boundaries;
  ForwardOptions options;
  options.boundary_states = &boundaries;
  torch::Tensor logits = model.Forward(ids, 0, kv, options);
  PlanRequest request;
  request.sequence_id = sequence_id;
  request.step = 64;
  request.context_length = prefix + r;
  request.policy = PlanPolicy::kKnapSpec;
  request.max_draft = 10;
  request.model_fingerprint = model.config().Fingerprint();
  request.states = boundaries.narrow(1, prefix, r).contiguous();
  request.first_position = prefix;
  torch::Tensor argmax = logits.narrow(0, prefix, r).argmax(-1);
  for (int64_t i = 0; i < r; ++i)
    request.target_argmax.push_back(argmax[i].item<int32_t>());
  request.kv = std::move(kv);
  request.kv_length = prefix;
  return request;
}

LatencyProfile HandLatencyProfile(const LlamaModel& model, double attention,
                                  double mlp, double fixed, int max_draft) {
  LatencyProfile p;
  p.model_fingerprint = model.config().Fingerprint();
  p.device = model.device().str();
  p.dtype = DtypeName(model.dtype());
  p.threads = 2;
  p.attention = {attention, 0, 1};
  p.mlp_seconds = mlp;
  p.mlp_fit = {mlp, 0, 1};
  p.step_fixed_seconds = fixed;
  p.max_draft = max_draft;
  p.verify_contexts = {0, model.max_context()};
  const double full = fixed + model.num_layers() * (attention + mlp);
  for (int c = 0; c < 2; ++c) {
    std::vector<double> row;
    for (int t = 1; t <= max_draft + 1; ++t)
      row.push_back(full * (1 + 0.02 * (t - 1)));
    p.verify_seconds.push_back(row);
  }
  return p;
}

}  // namespace knapserve::testing
