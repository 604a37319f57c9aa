// Speculation stays lossless with the logits processors
// (executor/engine/logits_processors.h) on, in every drafting mode (static,
// knapspec, clasp, knn, specbound), on stories260k and stories-24l:
//   - greedy: speculative ids equal plain ids for each processor and all of
//     them at once (GreedyLosslessWithProcessorsTest); a draft made of the
//     full model (empty mask) is then always accepted, which holds only if
//     draft and verification process each position with the same history;
//   - rejection sampling: the first generated tokens have the plain
//     sampler's distribution (chi-square two-sample test,
//     tests/testing/chi_square.h) for each processor and all at once
//     (SamplingLosslessWithProcessorsTest),
//     and the same statistic tells the processed distribution from the
//     unprocessed one, so a speculation that dropped a processor would fail;
//   - seeded sampling (coupled draws, executor/engine/sampler.h): the same
//     seed gives the same ids alone, in a batch, and in every mode, with
//     every processor on (SeededSamplingTest);
//   - batching: a sequence's tokens do not depend on which sequences, with
//     which processors, share its passes (ProcessorsBatchTest);
//   - a temperature so small that logits / T overflows is greedy.
//
// These run once, not once per SIMD target as the GreedyLossless and
// SamplingLossless families do (tests/CMakeLists.txt): the processors are
// plain C++ on the logits rows, the same code on every target, and the
// per-target runs already prove that the rows they get are bit-identical.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/text/tokenizer.h"
#include "executor/engine/generator.h"
#include "executor/engine/sequence.h"
#include "executor/planning/domain_router.h"
#include "planner/inprocess_planner.h"
#include "tests/testing/chi_square.h"
#include "tests/testing/generate_many.h"
#include "tests/testing/synchronous_planner.h"
#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

using testing::CachedModel;
using testing::StoriesTokenizer;

using testing::SynchronousPlanner;  // a run's plans are the same every time

// Keeps every plan request unanswered: a planned sequence then drafts with
// its pre-plan mask throughout, as while a slow solve is outstanding.
class HoldingPlanner : public PlannerClient {
 public:
  void Submit(PlanRequest, PlanCallback) override {}
  void Forget(uint64_t) override {}
};

// What every mode needs for one model: its planner core (hand latency
// profile) and a router whose one domain drafts with `kKnnMask`.
constexpr char kKnnMask[] = "m1,a3";
constexpr char kStaticMask[] = "a2,m2,a3";

struct ModeKit {
  const LlamaModel* model = nullptr;
  std::unique_ptr<InProcessPlanner> core;
  std::shared_ptr<const DomainRouter> router;
};

ModeKit MakeKit(const std::string& model_name) {
  ModeKit kit;
  kit.model = CachedModel(model_name);
  if (kit.model == nullptr) return kit;
  auto core = InProcessPlanner::Create(*kit.model,
                                       testing::HandLatencyProfile(*kit.model),
                                       InProcessPlannerOptions());
  EXPECT_TRUE(core.ok()) << core.status();
  if (core.ok()) kit.core = std::move(*core);
  const int layers = kit.model->num_layers();
  RoutedDomain domain;
  domain.name = "all";
  auto mask = LayerMask::Parse(kKnnMask, layers);
  EXPECT_TRUE(mask.ok()) << mask.status();
  domain.mask = mask.ok() ? *mask : LayerMask(layers);
  domain.gamma = 3;
  domain.mask_source = "test";
  auto router = DomainRouter::Create(
      kit.model->config().Fingerprint(), kit.model->weights_fingerprint(),
      layers, {domain}, torch::ones({1, kit.model->config().hidden_size}), {0});
  EXPECT_TRUE(router.ok()) << router.status();
  if (router.ok()) kit.router = *router;
  return kit;
}

// One drafting setting: a label and how it edits a request.
struct Mode {
  std::string label;
  SpeculationMode mode;
  std::function<void(SpeculationConfig&)> edit;
};

std::vector<Mode> Modes() {
  auto planned = [](SpeculationConfig& s) {
    s.max_draft = 4;
    s.exit_threshold = 0.0;
    s.skip = kStaticMask;  // before the first plan
    s.plan_interval = 8;
    s.reference_steps = 3;
    s.clasp_layers = 2;
    s.plan_bucket_tokens = 64;  // every run here stays in bucket 0
    s.planner_budget = 0;
    s.guard = false;  // plans draft whatever the timings say
  };
  return {
      {"static", SpeculationMode::kStatic,
       [](SpeculationConfig& s) {
         s.skip = kStaticMask;
         s.max_draft = 3;
         s.exit_threshold = 0.0;
       }},
      // The full model as its own draft: every draft must be accepted.
      {"static-full", SpeculationMode::kStatic,
       [](SpeculationConfig& s) {
         s.skip = "";
         s.max_draft = 4;
         s.exit_threshold = 0.0;
       }},
      {"knapspec", SpeculationMode::kKnapSpec, planned},
      {"clasp", SpeculationMode::kClasp, planned},
      {"knn", SpeculationMode::kKnn,
       [](SpeculationConfig& s) {
         s.max_draft = 3;
         s.exit_threshold = 0.0;
       }},
      {"specbound", SpeculationMode::kSpecBound,
       [](SpeculationConfig& s) {
         s.max_draft = 3;
         s.specbound.lambda = 0.2;
         s.specbound.t0 = 2.0;
         s.specbound.check_every = 1;
       }},
  };
}

GenerationRequest InMode(GenerationRequest r, const Mode& mode) {
  r.speculation.mode = mode.mode;
  mode.edit(r.speculation);
  return r;
}

// One processor setting, given the model's plain greedy output without
// processors (`plain`), so that bans and biases hit tokens the model does
// produce there.
struct Processors {
  std::string name;
  std::function<void(GenerationRequest&, const std::vector<int32_t>& plain)>
      set;
};

// For greedy runs: each processor alone, then all of them.
std::vector<Processors> GreedyProcessors() {
  return {
      {"repetition",
       [](GenerationRequest& r, const std::vector<int32_t>&) {
         r.sampling.repetition_penalty = 1.5;
       }},
      // A run of one token in the prompt invites repeating it, which these
      // penalties (on generated tokens only) forbid once it was generated:
      // the choices then hang on the drafts before them.
      {"presence",
       [](GenerationRequest& r, const std::vector<int32_t>& plain) {
         r.prompt_ids.insert(r.prompt_ids.end(), 6, plain[0]);
         r.sampling.presence_penalty = 2.0;
       }},
      {"frequency",
       [](GenerationRequest& r, const std::vector<int32_t>& plain) {
         r.prompt_ids.insert(r.prompt_ids.end(), 6, plain[0]);
         r.sampling.frequency_penalty = 1.5;
       }},
      {"logit_bias",
       [](GenerationRequest& r, const std::vector<int32_t>& plain) {
         r.sampling.logit_bias = {{plain[3], -100.0}, {plain[0], 2.0}};
       }},
      {"min_tokens",
       [](GenerationRequest& r, const std::vector<int32_t>& plain) {
         // plain[2] would stop the output at its third token.
         r.stop_token_ids = {plain[2]};
         r.sampling.min_tokens = 12;
       }},
      {"bad_words",
       [](GenerationRequest& r, const std::vector<int32_t>& plain) {
         r.sampling.bad_words = {{plain[4], plain[5]}, {plain[9]}};
       }},
      {"all",
       [](GenerationRequest& r, const std::vector<int32_t>& plain) {
         r.sampling.repetition_penalty = 1.2;
         r.sampling.presence_penalty = 0.5;
         r.sampling.frequency_penalty = 0.5;
         r.sampling.logit_bias = {{plain[6], -100.0}, {plain[1], 1.0}};
         r.stop_token_ids = {plain[2]};
         r.sampling.min_tokens = 10;
         r.sampling.bad_words = {{plain[4], plain[5]}, {plain[11]}};
         r.sampling.min_p = 0.1;  // ignored when greedy
       }},
  };
}

struct GreedyCase {
  std::string model;
  std::string processors;
};

class GreedyLosslessWithProcessorsTest
    : public ::testing::TestWithParam<GreedyCase> {};

TEST_P(GreedyLosslessWithProcessorsTest, EveryModeEqualsPlainDecoding) {
  const GreedyCase& param = GetParam();
  if (param.model == "stories260k") {
    if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  } else {
    KNAPSERVE_SKIP_WITHOUT_SHARED_MODEL(param.model);
  }
  ModeKit kit = MakeKit(param.model);
  ASSERT_NE(kit.model, nullptr);
  ASSERT_NE(kit.core, nullptr);
  ASSERT_NE(kit.router, nullptr);
  const Tokenizer& tokenizer = *StoriesTokenizer();
  GenerationRequest base;
  base.prompt_ids = {1, 410, 469, 347};  // "Zoo"
  if (param.model != "stories260k") {
    auto ids = tokenizer.Encode(
        "Once upon a time, there was a little girl named Lily. She loved to",
        true);
    ASSERT_TRUE(ids.ok()) << ids.status();
    base.prompt_ids = *ids;
  }
  base.max_new_tokens = param.model == "stories260k" ? 40 : 32;
  base.ignore_eos = true;
  auto unprocessed = Generate(*kit.model, tokenizer, base);
  ASSERT_TRUE(unprocessed.ok()) << unprocessed.status();
  ASSERT_GE(unprocessed->output_ids.size(), 12u);

  GenerationRequest request = base;
  for (const Processors& p : GreedyProcessors()) {
    if (p.name == param.processors) p.set(request, unprocessed->output_ids);
  }
  if (request.sampling.min_tokens > 0) request.ignore_eos = false;
  auto plain = Generate(*kit.model, tokenizer, request);
  ASSERT_TRUE(plain.ok()) << plain.status();
  // The processors change the output (else this test could not fail).
  EXPECT_NE(plain->output_ids, unprocessed->output_ids);

  for (const Mode& mode : Modes()) {
    SCOPED_TRACE(
        absl::StrCat(param.model, ", ", param.processors, ", ", mode.label));
    PlanningShared shared = PlanningShared::Create();
    shared.router = kit.router;
    SynchronousPlanner planner(kit.core.get());
    auto spec = Generate(*kit.model, tokenizer, InMode(request, mode), nullptr,
                         nullptr, &planner, &shared);
    ASSERT_TRUE(spec.ok()) << spec.status();
    EXPECT_EQ(spec->output_ids, plain->output_ids);
    EXPECT_EQ(spec->finish_reason, plain->finish_reason);
    EXPECT_GT(spec->speculation.draft_tokens, 0);
    if (mode.label == "static-full") {
      EXPECT_EQ(spec->speculation.acceptance_rate(), 1.0)
          << "the full model's drafts are its own choices";
    }
    if (IsPlanned(mode.mode)) {
      EXPECT_GT(planner.solves(), 0);
    }
  }
}

std::vector<GreedyCase> GreedyCases() {
  std::vector<GreedyCase> cases;
  for (const char* model : {"stories260k", "stories-24l"}) {
    for (const Processors& p : GreedyProcessors())
      cases.push_back({model, p.name});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Processors, GreedyLosslessWithProcessorsTest,
                         ::testing::ValuesIn(GreedyCases()),
                         [](const ::testing::TestParamInfo<GreedyCase>& info) {
                           std::string name =
                               info.param.model + "_" + info.param.processors;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// ---------------------------------------------------------------------------
// Sampling.

// Significance level; seeds are fixed, so each outcome is deterministic.
constexpr double kAlpha = 1e-3;

// For sampled runs (SamplingPrompt): settings whose effect shows in the
// first four tokens (negative presence and frequency penalties make repeats
// likely; the prompt holds the likely next tokens, so the repetition
// penalty bites).
std::vector<Processors> SamplingProcessors() {
  return {
      {"repetition",
       [](GenerationRequest& r, const std::vector<int32_t>&) {
         r.sampling.repetition_penalty = 1.8;
       }},
      {"presence",
       [](GenerationRequest& r, const std::vector<int32_t>&) {
         r.sampling.presence_penalty = -2.0;
       }},
      {"frequency",
       [](GenerationRequest& r, const std::vector<int32_t>&) {
         r.sampling.frequency_penalty = -2.0;
       }},
      {"logit_bias",
       [](GenerationRequest& r, const std::vector<int32_t>& plain) {
         r.sampling.logit_bias = {{plain[0], -100.0}, {plain[2], 3.0}};
       }},
      {"min_tokens",
       [](GenerationRequest& r, const std::vector<int32_t>& plain) {
         r.stop_token_ids = {plain[1], plain[2]};
         r.sampling.min_tokens = 2;
       }},
      {"bad_words",
       [](GenerationRequest& r, const std::vector<int32_t>& plain) {
         r.sampling.bad_words = {{plain[0], plain[1]}, {plain[2]}};
       }},
      {"min_p", [](GenerationRequest& r,
                   const std::vector<int32_t>&) { r.sampling.min_p = 0.2; }},
      {"all",
       [](GenerationRequest& r, const std::vector<int32_t>& plain) {
         r.sampling.repetition_penalty = 1.3;
         r.sampling.presence_penalty = -1.5;
         r.sampling.frequency_penalty = 0.5;
         r.sampling.logit_bias = {{plain[0], -3.0}, {plain[2], 2.0}};
         r.stop_token_ids = {plain[1]};
         r.sampling.min_tokens = 2;
         r.sampling.bad_words = {{plain[0], plain[3]}};
         r.sampling.min_p = 0.05;
         r.sampling.top_p = 0.95;
       }},
  };
}

struct SamplingCase {
  std::string model;
  std::string processors;
  int samples;      // generations per sampler
  bool every_mode;  // else static and specbound only (see SamplingCases)
  bool control;     // also check the processors' effect is detectable
};

// "Zoo" and the first eight tokens of its greedy continuation on
// stories260k: the next tokens are often ones the prompt holds.
const std::vector<int32_t> kSamplingPrompt = {1,   410, 469, 347, 286, 261,
                                              376, 298, 315, 421, 395, 317};

// The outputs of `n` generations with seeds first_seed.. (run side by side:
// tests/testing/generate_many.h) and their summed draft counts.
struct Samples {
  std::vector<std::vector<int32_t>> outputs;
  int64_t draft_tokens = 0, accepted_tokens = 0;
};

Samples Draw(const LlamaModel& model, GenerationRequest request,
             uint64_t first_seed, int n, PlannerClient* planner,
             const PlanningShared* shared) {
  Samples samples;
  for (absl::StatusOr<GenerationResult>& result :
       testing::GenerateMany(model, *StoriesTokenizer(), std::move(request),
                             first_seed, n, planner, shared)) {
    EXPECT_TRUE(result.ok()) << result.status();
    if (!result.ok()) break;
    samples.outputs.push_back(result->output_ids);
    samples.draft_tokens += result->speculation.draft_tokens;
    samples.accepted_tokens += result->speculation.accepted_tokens;
  }
  return samples;
}

// The statistics compared, each a histogram of the outputs: each
// position's marginal, the joints of the first two and of all four generated
// tokens, and how many distinct ids the four hold (what the penalties move).
std::vector<std::pair<std::string, testing::Histogram>> Statistics(
    const Samples& samples) {
  std::vector<std::pair<std::string, testing::Histogram>> stats;
  const std::vector<std::pair<std::string, std::vector<int>>> tuples = {
      {"token 0", {0}}, {"token 1", {1}},       {"token 2", {2}},
      {"token 3", {3}}, {"tokens 0-1", {0, 1}}, {"tokens 0-3", {0, 1, 2, 3}}};
  for (const auto& [name, positions] : tuples)
    stats.emplace_back(name, testing::Tally(samples.outputs, positions));
  testing::Histogram distinct;
  for (const std::vector<int32_t>& out : samples.outputs) {
    std::vector<int32_t> ids(out.begin(),
                             out.begin() + std::min<size_t>(4, out.size()));
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    ++distinct[{static_cast<int32_t>(ids.size())}];
  }
  stats.emplace_back("distinct ids", std::move(distinct));
  return stats;
}

// The smallest p-value of the statistics comparing `a` with `b`; with
// `expect_same`, each one below kAlpha fails the test.
double SmallestPValue(const Samples& a, const Samples& b, bool expect_same) {
  const auto sa = Statistics(a);
  const auto sb = Statistics(b);
  double smallest = 1;
  for (size_t i = 0; i < sa.size(); ++i) {
    const testing::ChiSquare test =
        testing::TwoSampleChiSquare(sa[i].second, sb[i].second);
    smallest = std::min(smallest, test.p_value);
    if (expect_same) {
      EXPECT_GE(test.p_value, kAlpha) << sa[i].first << ": " << test.Describe();
    }
  }
  return smallest;
}

class SamplingLosslessWithProcessorsTest
    : public ::testing::TestWithParam<SamplingCase> {};

TEST_P(SamplingLosslessWithProcessorsTest,
       FirstTokensHaveThePlainDistributionInEveryMode) {
  const SamplingCase& param = GetParam();
  if (param.model == "stories260k") {
    if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  } else {
    KNAPSERVE_SKIP_WITHOUT_SHARED_MODEL(param.model);
  }
  ModeKit kit = MakeKit(param.model);
  ASSERT_NE(kit.model, nullptr);
  ASSERT_NE(kit.core, nullptr);
  GenerationRequest base;
  base.prompt_ids = kSamplingPrompt;
  base.max_new_tokens = 4;
  base.ignore_eos = true;
  auto greedy = Generate(*kit.model, *StoriesTokenizer(), base);
  ASSERT_TRUE(greedy.ok()) << greedy.status();
  GenerationRequest request = base;
  request.sampling.temperature = 1.0;
  // Rejection sampling, seeded for repeatability; coupled draws are held to
  // exact equality by SeededSamplingTest.
  request.sampling.acceptance = DraftAcceptance::kRejection;
  for (const Processors& p : SamplingProcessors()) {
    if (p.name == param.processors) p.set(request, greedy->output_ids);
  }
  if (request.sampling.min_tokens > 0) request.ignore_eos = false;
  // Four tokens never pass the guard's settle steps, so a setting that has
  // not won a judgement would decode them plainly (--guard-settle-plain):
  // these requests draft from the first step, as this test needs.
  request.speculation.guard_settle_plain = false;
  const int n = param.samples;
  const Samples plain = Draw(*kit.model, request, 1, n, nullptr, nullptr);
  ASSERT_EQ(plain.outputs.size(), static_cast<size_t>(n));

  // The statistics tell the processed distribution from the unprocessed
  // one at this sample size: a speculation that left the processors out
  // would be caught.
  if (param.control) {
    GenerationRequest unprocessed_request = base;
    unprocessed_request.sampling.temperature = 1.0;
    unprocessed_request.sampling.acceptance = DraftAcceptance::kRejection;
    const Samples unprocessed =
        Draw(*kit.model, unprocessed_request, 5'000'001, n, nullptr, nullptr);
    EXPECT_LT(SmallestPValue(plain, unprocessed, /*expect_same=*/false), kAlpha)
        << "the processors do not change the first tokens detectably";
  }

  // KnapSpec drafts with a cached plan from its first step (a greedy run
  // solves it first). CLaSp's plan for these models under the hand-made
  // profile drafts nothing (gamma 0), so CLaSp drafts with its pre-plan mask
  // while its solve is held back.
  PlanningShared shared = PlanningShared::Create();
  shared.router = kit.router;
  SynchronousPlanner planner(kit.core.get());
  HoldingPlanner holding;
  uint64_t seed = 1'000'001;
  for (const Mode& mode : Modes()) {
    if (mode.label == "static-full") continue;  // adds nothing here
    if (!param.every_mode && mode.label != "static" &&
        mode.label != "specbound") {
      continue;
    }
    SCOPED_TRACE(
        absl::StrCat(param.model, ", ", param.processors, ", ", mode.label));
    PlannerClient* mode_planner = mode.mode == SpeculationMode::kClasp
                                      ? static_cast<PlannerClient*>(&holding)
                                      : &planner;
    if (mode.mode == SpeculationMode::kKnapSpec) {
      GenerationRequest warm = InMode(base, mode);
      warm.max_new_tokens = 24;
      auto warmed = Generate(*kit.model, *StoriesTokenizer(), warm, nullptr,
                             nullptr, &planner, &shared);
      ASSERT_TRUE(warmed.ok()) << warmed.status();
      ASSERT_FALSE(warmed->plans.empty());
    }
    const Samples spec =
        Draw(*kit.model, InMode(request, mode), seed, n, mode_planner, &shared);
    seed += 1'000'000;
    ASSERT_EQ(spec.outputs.size(), static_cast<size_t>(n));
    // Drafts were made and some rejected, so the resampling decided tokens.
    ASSERT_GT(spec.draft_tokens, 0);
    EXPECT_LT(spec.accepted_tokens, spec.draft_tokens);
    SmallestPValue(plain, spec, /*expect_same=*/true);
  }
}

// Each processor alone (1000 or 2000 samples) drafts in the two ways a
// draft is made (a masked pass: static, and knapspec, clasp and knn with
// their own masks; an early exit: specbound); all of them at once (2000
// samples) in every mode. The greedy tests above run every processor in
// every mode. stories-24l's steps are ~30x dearer (a 4-token generation
// takes ~25 ms): all processors at once, 400 samples, static and specbound
// (its greedy test runs every mode), no effect check (the stories260k one
// shows these settings' effect is large).
std::vector<SamplingCase> SamplingCases() {
  std::vector<SamplingCase> cases;
  for (const Processors& p : SamplingProcessors()) {
    const bool all = p.name == "all";
    // The presence and frequency penalties act only on repeats, which are
    // rare in four tokens: their effect needs the larger sample to show.
    const bool repeats = p.name == "presence" || p.name == "frequency";
    cases.push_back(
        {"stories260k", p.name, all || repeats ? 2000 : 1000, all, true});
  }
  cases.push_back({"stories-24l", "all", 400, false, false});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(
    Processors, SamplingLosslessWithProcessorsTest,
    ::testing::ValuesIn(SamplingCases()),
    [](const ::testing::TestParamInfo<SamplingCase>& info) {
      std::string name = info.param.model + "_" + info.param.processors;
      std::replace(name.begin(), name.end(), '-', '_');
      return name;
    });

// ---------------------------------------------------------------------------
// Seeded sampling: a function of (seed, prompt) alone.

class SeededSamplingTest : public ::testing::TestWithParam<std::string> {};

// With a seed, sampling draws coupled tokens (noise keyed by the seed and
// the position), and verification accepts a draft exactly when it equals the
// target's own coupled draw. So each seed's ids equal plain decoding's, in
// every drafting mode, and in a batch beside other seeds, as greedy ids do;
// drafts are both accepted and rejected on the way.
TEST_P(SeededSamplingTest, ASeedGivesTheSameTextAloneInABatchAndInEveryMode) {
  const std::string& model_name = GetParam();
  if (model_name == "stories260k") {
    if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  } else {
    KNAPSERVE_SKIP_WITHOUT_SHARED_MODEL(model_name);
  }
  ModeKit kit = MakeKit(model_name);
  ASSERT_NE(kit.model, nullptr);
  ASSERT_NE(kit.core, nullptr);
  const Tokenizer& tokenizer = *StoriesTokenizer();
  GenerationRequest request;
  request.prompt_ids = kSamplingPrompt;
  request.max_new_tokens = model_name == "stories260k" ? 40 : 24;
  request.ignore_eos = true;
  request.sampling.temperature = 1.0;
  request.sampling.top_p = 0.95;
  request.sampling.repetition_penalty = 1.2;
  request.sampling.presence_penalty = 0.3;
  request.sampling.frequency_penalty = 0.2;
  request.sampling.logit_bias = {{kSamplingPrompt[5], -2.0}};
  request.sampling.min_p = 0.02;
  constexpr int kSeeds = 6;
  constexpr uint64_t kFirstSeed = 41;

  std::vector<std::vector<int32_t>> plain;
  for (int i = 0; i < kSeeds; ++i) {
    GenerationRequest r = request;
    r.sampling.seed = kFirstSeed + i;
    auto result = Generate(*kit.model, tokenizer, r);
    ASSERT_TRUE(result.ok()) << result.status();
    plain.push_back(result->output_ids);
  }
  // Seeds differ, so do their texts (the test could not fail otherwise).
  EXPECT_NE(plain[0], plain[1]);
  // Rejection sampling with the same seed draws other tokens: the equality
  // below comes from the coupling, not from the seed alone.
  GenerationRequest rejection = InMode(request, Modes().front());
  rejection.sampling.acceptance = DraftAcceptance::kRejection;
  rejection.sampling.seed = kFirstSeed;
  auto rejected = Generate(*kit.model, tokenizer, rejection);
  ASSERT_TRUE(rejected.ok()) << rejected.status();
  EXPECT_NE(rejected->output_ids, plain[0]);

  for (const Mode& mode : Modes()) {
    SCOPED_TRACE(absl::StrCat(model_name, ", ", mode.label));
    PlanningShared shared = PlanningShared::Create();
    shared.router = kit.router;
    SynchronousPlanner planner(kit.core.get());
    // Alone: the first seed.
    GenerationRequest alone = InMode(request, mode);
    alone.sampling.seed = kFirstSeed;
    auto one = Generate(*kit.model, tokenizer, alone, nullptr, nullptr,
                        &planner, &shared);
    ASSERT_TRUE(one.ok()) << one.status();
    EXPECT_EQ(one->output_ids, plain[0]);
    // In one batch: every seed side by side. The planned modes' plans for
    // these sampled runs draft little or nothing, so here they keep their
    // pre-plan mask (their solves are held, and the plan cache the run
    // alone filled is not theirs) and draft throughout.
    HoldingPlanner holding;
    PlanningShared batch_shared = PlanningShared::Create();
    batch_shared.router = kit.router;
    int64_t drafted = 0, accepted = 0;
    std::vector<absl::StatusOr<GenerationResult>> batch = testing::GenerateMany(
        *kit.model, tokenizer, InMode(request, mode), kFirstSeed, kSeeds,
        IsPlanned(mode.mode) ? static_cast<PlannerClient*>(&holding) : &planner,
        &batch_shared, /*batch=*/kSeeds);
    ASSERT_EQ(batch.size(), static_cast<size_t>(kSeeds));
    for (int i = 0; i < kSeeds; ++i) {
      ASSERT_TRUE(batch[i].ok()) << batch[i].status();
      EXPECT_EQ(batch[i]->output_ids, plain[i]) << "seed " << kFirstSeed + i;
      drafted += batch[i]->speculation.draft_tokens;
      accepted += batch[i]->speculation.accepted_tokens;
    }
    EXPECT_GT(drafted, 0);
    if (mode.label == "static-full") {
      EXPECT_EQ(accepted, drafted) << "the full model's drafts are its own";
    } else {
      EXPECT_GT(accepted, 0);
      EXPECT_LT(accepted, drafted);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, SeededSamplingTest,
                         ::testing::Values("stories260k", "stories-24l"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// ---------------------------------------------------------------------------
// Batching and the greedy threshold.

// Sequences with different processors, modes and samplers share every pass
// of RunBatchStep; each one's tokens equal its output alone.
TEST(ProcessorsBatchTest, ASequencesTokensDoNotDependOnWhoSharesItsBatch) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  ModeKit kit = MakeKit("stories260k");
  ASSERT_NE(kit.model, nullptr);
  ASSERT_NE(kit.router, nullptr);
  const LlamaModel& model = *kit.model;
  const Tokenizer& tokenizer = *StoriesTokenizer();
  PlanningShared shared = PlanningShared::Create();
  shared.router = kit.router;
  const std::vector<Mode> modes = Modes();
  auto mode = [&](const std::string& label) {
    for (const Mode& m : modes)
      if (m.label == label) return m;
    return modes.front();
  };
  std::vector<GenerationRequest> requests;
  for (int i = 0; i < 6; ++i) {
    GenerationRequest r;
    r.prompt_ids = {1, 410, 469, 347};
    for (int j = 0; j < 3 * i; ++j) r.prompt_ids.push_back(20 + 37 * j % 400);
    r.max_new_tokens = 30;
    r.ignore_eos = true;
    requests.push_back(r);
  }
  requests[0].sampling.repetition_penalty = 1.4;
  requests[1] = InMode(requests[1], mode("static"));
  requests[1].sampling.frequency_penalty = 1.0;
  requests[1].sampling.bad_words = {{286}, {261, 376}};
  requests[2] = InMode(requests[2], mode("specbound"));
  requests[2].sampling.presence_penalty = 1.2;
  requests[2].sampling.logit_bias = {{298, 2.0}};
  requests[3] = InMode(requests[3], mode("knn"));
  requests[3].sampling.temperature = 0.9;
  requests[3].sampling.seed = 7;
  requests[3].sampling.repetition_penalty = 1.3;
  requests[3].sampling.min_p = 0.05;
  requests[4] = InMode(requests[4], mode("static"));
  requests[4].sampling.temperature = 1.0;
  requests[4].sampling.seed = 11;
  requests[4].sampling.presence_penalty = -1.0;
  requests[4].stop_token_ids = {261};
  requests[4].sampling.min_tokens = 8;
  requests[4].ignore_eos = false;
  // requests[5]: no processors at all.

  std::vector<std::vector<int32_t>> alone;
  for (const GenerationRequest& r : requests) {
    auto result =
        Generate(model, tokenizer, r, nullptr, nullptr, nullptr, &shared);
    ASSERT_TRUE(result.ok()) << result.status();
    alone.push_back(result->output_ids);
  }
  std::vector<std::unique_ptr<Sequence>> seqs;
  std::vector<std::vector<LayerKv>> kv(requests.size());
  std::vector<Sequence*> batch;
  for (size_t i = 0; i < requests.size(); ++i) {
    auto seq = Sequence::Create(model, tokenizer, requests[i], nullptr, nullptr,
                                nullptr, &shared);
    ASSERT_TRUE(seq.ok()) << seq.status();
    kv[i] = model.AllocateKv((*seq)->max_positions());
    (*seq)->UseKv(&kv[i]);
    batch.push_back(seq->get());
    seqs.push_back(std::move(*seq));
  }
  BatchStepOptions options;
  options.max_batch_tokens = 12;  // prompts load in chunks beside decoding
  options.min_prefill_rows = 4;
  int64_t shared_steps = 0;
  for (int step = 0; step < 500; ++step) {
    int running = 0;
    for (Sequence* s : batch) running += !s->done();
    if (running == 0) break;
    const BatchStepStats stats = RunBatchStep(model, batch, options);
    shared_steps += stats.decoding + stats.prefilling >= 3;
  }
  EXPECT_GT(shared_steps, 10);
  for (size_t i = 0; i < seqs.size(); ++i) {
    auto result = seqs[i]->TakeResult();
    ASSERT_TRUE(result.ok()) << i << ": " << result.status();
    EXPECT_EQ(result->output_ids, alone[i]) << "request " << i;
  }
}

// Temperatures below kGreedyTemperature decode greedily in every mode (1e-39
// used to overflow logits / T into NaN probabilities, and every draft was
// accepted).
TEST(GreedyTemperatureTest, TinyTemperaturesDecodeGreedilyInEveryMode) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  ModeKit kit = MakeKit("stories260k");
  ASSERT_NE(kit.model, nullptr);
  GenerationRequest greedy;
  greedy.prompt_ids = {1, 410, 469, 347};
  greedy.max_new_tokens = 30;
  greedy.ignore_eos = true;
  greedy.sampling.repetition_penalty = 1.2;
  auto want = Generate(*kit.model, *StoriesTokenizer(), greedy);
  ASSERT_TRUE(want.ok()) << want.status();
  for (double t : {1e-39, 1e-10, 9e-6}) {
    for (const Mode& mode : Modes()) {
      SCOPED_TRACE(absl::StrCat("temperature ", t, ", ", mode.label));
      PlanningShared shared = PlanningShared::Create();
      shared.router = kit.router;
      SynchronousPlanner planner(kit.core.get());
      GenerationRequest r = InMode(greedy, mode);
      r.sampling.temperature = t;
      r.sampling.seed = 3;
      auto got = Generate(*kit.model, *StoriesTokenizer(), r, nullptr, nullptr,
                          &planner, &shared);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(got->output_ids, want->output_ids);
      if (mode.label == "static") {
        EXPECT_LT(got->speculation.accepted_tokens,
                  got->speculation.draft_tokens)
            << "a partial draft is rejected somewhere";
      }
    }
  }
}

}  // namespace
}  // namespace knapserve
