// Tests of KNN-SSD's request-time half (executor/planning/domain_router.h and
// --spec knn in the decode loop): the router's checks, cosine 1-NN, the file
// round trip and its refusal of another model's anchors, the routing vector
// (mean of the last layer's states without position 0, the same however the
// prompt is chunked), and generation: each prompt drafts with its own
// domain's mask and gamma, greedy output equals plain decoding, a sampled
// knn request is token for token a static request with the routed draft,
// knn sequences batched with others equal their single-stream output, and
// the routed domain reaches the result.
#include "executor/planning/domain_router.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "common/checkpoint/safetensors.h"
#include "executor/engine/batch_engine.h"
#include "executor/engine/generator.h"
#include "tests/testing/test_models.h"
#include "tests/testing/test_util.h"
#include "tools/domain_anchors.h"

namespace knapserve {
namespace {

using testing::CachedModel;
using ::testing::HasSubstr;
using testing::Message;
using testing::StoriesTokenizer;

LayerMask Mask(const std::string& text, int layers) {
  auto mask = LayerMask::Parse(text, layers);
  EXPECT_TRUE(mask.ok()) << mask.status();
  return mask.ok() ? *mask : LayerMask(layers);
}

RoutedDomain Domain(const std::string& name, const std::string& mask, int gamma,
                    int layers) {
  RoutedDomain d;
  d.name = name;
  d.mask = Mask(mask, layers);
  d.gamma = gamma;
  d.mask_source = "test";
  return d;
}

std::shared_ptr<const DomainRouter> RouterOrDie(
    std::vector<RoutedDomain> domains, const torch::Tensor& anchors,
    std::vector<int> anchor_domain, int layers = 2) {
  auto router =
      DomainRouter::Create("arch", "weights", layers, std::move(domains),
                           anchors, std::move(anchor_domain));
  EXPECT_TRUE(router.ok()) << router.status();
  return router.ok() ? *router : nullptr;
}

TEST(DomainRouterTest, CreateRefusesInconsistentAnchors) {
  const torch::Tensor anchors = torch::eye(3);
  auto create = [&](std::vector<RoutedDomain> domains, torch::Tensor a,
                    std::vector<int> ids) {
    return DomainRouter::Create("arch", "weights", 2, std::move(domains), a,
                                std::move(ids))
        .status();
  };
  const RoutedDomain a = Domain("a", "a1", 2, 2);
  const RoutedDomain b = Domain("b", "m0", 2, 2);
  EXPECT_THAT(Message(create({}, anchors, {0, 0, 0})), HasSubstr("no domains"));
  EXPECT_THAT(Message(create({a, b}, anchors, {0, 1})),
              HasSubstr("3 anchors but 2 anchor domains"));
  EXPECT_THAT(Message(create({a, b}, anchors, {0, 2, 1})),
              HasSubstr("anchor domain 2 is not one of the 2 domains"));
  EXPECT_THAT(Message(create({a, b}, anchors, {0, 0, 0})),
              HasSubstr("domain 'b' has no anchor"));
  EXPECT_THAT(Message(create({a, a}, anchors, {0, 1, 1})),
              HasSubstr("'a' appears twice"));
  RoutedDomain wrong = Domain("c", "", 2, 3);
  EXPECT_THAT(Message(create({a, wrong}, anchors, {0, 1, 1})),
              HasSubstr("mask of 3 layers, the model has 2"));
  RoutedDomain negative = b;
  negative.gamma = -1;
  EXPECT_THAT(Message(create({a, negative}, anchors, {0, 1, 1})),
              HasSubstr("gamma -1"));
  torch::Tensor nan = anchors.clone();
  nan[1][1] = std::nan("");
  EXPECT_THAT(Message(create({a, b}, nan, {0, 1, 1})), HasSubstr("non-finite"));
  EXPECT_THAT(Message(create({a, b}, torch::ones({3}), {0, 1, 1})),
              HasSubstr("[N, hidden]"));
}

// A domain's drafts by prompt length: own draft priced at 100 tokens,
// longer ones at 512 and 1024; a prompt takes the nearest on a log scale.
TEST(DomainRouterTest, DraftForTakesTheDraftPricedNearestThePromptLength) {
  RoutedDomain d = Domain("d", "a1", 3, 2);
  // No longer drafts: the domain's own for every length.
  for (int64_t n : {1, 100, 5000}) {
    EXPECT_EQ(d.DraftFor(n).gamma, 3);
    EXPECT_EQ(d.DraftFor(n).mask.ToString(), "a1");
  }
  d.prompt_tokens = 100;
  d.predicted_speedup = 1.2;
  d.longer.push_back({512, Mask("m0", 2), 1, 1.1});
  d.longer.push_back({1024, Mask("", 2), 0, 1.0});
  auto at = [&](int64_t n) { return d.DraftFor(n).prompt_tokens; };
  EXPECT_EQ(at(1), 100);
  EXPECT_EQ(at(100), 100);
  EXPECT_EQ(at(226), 100);  // sqrt(100 * 512) = 226.3
  EXPECT_EQ(at(227), 512);
  EXPECT_EQ(at(724), 512);  // sqrt(512 * 1024) = 724.1
  EXPECT_EQ(at(725), 1024);
  EXPECT_EQ(at(100000), 1024);
  const ContextDraft own = d.DraftFor(50);
  EXPECT_EQ(own.mask.ToString(), "a1");
  EXPECT_EQ(own.gamma, 3);
  EXPECT_DOUBLE_EQ(own.predicted_speedup, 1.2);
  EXPECT_EQ(d.DraftFor(600).mask.ToString(), "m0");
  EXPECT_EQ(d.DraftFor(600).gamma, 1);
  EXPECT_EQ(d.DraftFor(1000).gamma, 0);
}

TEST(DomainRouterTest, CreateRefusesBadDraftsByLength) {
  const torch::Tensor anchors = torch::eye(2);
  auto create = [&](const RoutedDomain& d) {
    return DomainRouter::Create("arch", "weights", 2, {d}, anchors, {0, 0})
        .status();
  };
  RoutedDomain d = Domain("d", "a1", 2, 2);
  d.longer.push_back({512, Mask("m0", 2), 1, 1.1});
  // Longer drafts need the length the domain's own was priced at.
  EXPECT_THAT(Message(create(d)), HasSubstr("prompt_tokens 0"));
  d.prompt_tokens = 100;
  EXPECT_TRUE(create(d).ok()) << create(d);
  RoutedDomain shorter = d;
  shorter.longer[0].prompt_tokens = 100;
  EXPECT_THAT(Message(create(shorter)),
              HasSubstr("100-token prompts is not for longer prompts than the "
                        "draft before it (100 tokens)"));
  RoutedDomain unordered = d;
  unordered.longer.push_back({256, Mask("", 2), 0, 1.0});
  EXPECT_THAT(Message(create(unordered)),
              HasSubstr("256-token prompts is not for longer prompts than the "
                        "draft before it (512 tokens)"));
  RoutedDomain wide = d;
  wide.longer[0].mask = Mask("", 3);
  EXPECT_THAT(Message(create(wide)),
              HasSubstr("512-token prompts has a mask of 3 layers"));
  RoutedDomain negative = d;
  negative.longer[0].gamma = -1;
  EXPECT_THAT(Message(create(negative)),
              HasSubstr("512-token prompts has gamma -1"));
}

TEST(DomainRouterTest, RoutesByCosineNotByDistance) {
  // Anchor 0 points along x; anchor 1 is far away but along y. A long vector
  // near the y axis is closer (Euclidean) to anchor 0 and must still route
  // to anchor 1's domain.
  const torch::Tensor anchors =
      torch::tensor({{1.0f, 0.0f, 0.0f}, {0.0f, 100.0f, 0.0f}});
  auto router = RouterOrDie({Domain("x", "a1", 3, 2), Domain("y", "m0", 1, 2)},
                            anchors, {0, 1});
  ASSERT_NE(router, nullptr);
  DomainRoute route = router->Route(torch::tensor({0.3f, 2.0f, 0.0f}));
  EXPECT_EQ(route.domain, 1);
  EXPECT_EQ(route.anchor, 1);
  EXPECT_NEAR(route.similarity, 2.0 / std::sqrt(4.09), 1e-5);
  route = router->Route(torch::tensor({5.0f, 1.0f, 3.0f}));
  EXPECT_EQ(route.domain, 0);
  // Scaling a state does not change its route.
  EXPECT_EQ(router->Route(torch::tensor({50.0f, 10.0f, 30.0f})).anchor, 0);
  // A zero state goes to anchor 0 with similarity 0.
  route = router->Route(torch::zeros({3}));
  EXPECT_EQ(route.anchor, 0);
  EXPECT_EQ(route.similarity, 0);
}

TEST(DomainRouterTest, FileRoundTripsAndRefusesAnotherModel) {
  const LlamaModel* model = CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  const int layers = model->num_layers();
  const int64_t hidden = model->config().hidden_size;
  torch::manual_seed(3);
  const torch::Tensor anchors = torch::randn({5, hidden});
  RoutedDomain stories = Domain("stories", "a1,m3", 3, layers);
  stories.samples = 40;
  stories.predicted_speedup = 1.25;
  stories.prompt_tokens = 60;
  stories.longer.push_back({256, Mask("m2", layers), 1, 1.05});
  stories.longer.push_back({1000, Mask("", layers), 0, 1.0});
  auto made = DomainRouter::Create(
      model->config().Fingerprint(), model->weights_fingerprint(), layers,
      {stories, Domain("code", "", 0, layers)}, anchors, {0, 1, 0, 1, 1});
  ASSERT_TRUE(made.ok()) << made.status();
  testing::ScopedTempDir dir("anchors");
  const std::string path = dir.path() + "/a.anchors";
  ASSERT_TRUE((*made)->Save(path).ok());

  auto loaded =
      DomainRouter::Load(path, model->config(), model->weights_fingerprint());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const DomainRouter& r = **loaded;
  ASSERT_EQ(r.domains().size(), 2u);
  EXPECT_EQ(r.domains()[0].name, "stories");
  EXPECT_EQ(r.domains()[0].mask.ToString(), "a1,m3");
  EXPECT_EQ(r.domains()[0].gamma, 3);
  EXPECT_EQ(r.domains()[0].samples, 40);
  EXPECT_DOUBLE_EQ(r.domains()[0].predicted_speedup, 1.25);
  EXPECT_EQ(r.domains()[0].prompt_tokens, 60);
  ASSERT_EQ(r.domains()[0].longer.size(), 2u);
  EXPECT_EQ(r.domains()[0].longer[0].prompt_tokens, 256);
  EXPECT_EQ(r.domains()[0].longer[0].mask.ToString(), "m2");
  EXPECT_EQ(r.domains()[0].longer[0].gamma, 1);
  EXPECT_DOUBLE_EQ(r.domains()[0].longer[0].predicted_speedup, 1.05);
  EXPECT_EQ(r.domains()[0].longer[1].prompt_tokens, 1000);
  EXPECT_EQ(r.domains()[0].longer[1].gamma, 0);
  EXPECT_EQ(r.domains()[1].gamma, 0);
  EXPECT_TRUE(r.domains()[1].longer.empty());
  EXPECT_EQ(r.anchor_domain(), (std::vector<int>{0, 1, 0, 1, 1}));
  EXPECT_TRUE(torch::equal(r.anchors(), anchors));
  for (int i = 0; i < 5; ++i) EXPECT_EQ(r.Route(anchors[i] * 7).anchor, i);

  // Same architecture, other weights (another training): refused.
  auto other = DomainRouter::Load(path, model->config(), "0123456789abcdef");
  EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Message(other.status()), HasSubstr("other weights"));
  // Another architecture: refused.
  ModelConfig wider = model->config();
  wider.hidden_size *= 2;
  auto arch = DomainRouter::Load(path, wider, model->weights_fingerprint());
  EXPECT_EQ(arch.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Message(arch.status()), HasSubstr("model fingerprint"));
  // Not an anchors file at all (a checkpoint): InvalidArgument naming it.
  auto checkpoint =
      DomainRouter::Load(testing::Stories260kDir() + "/model.safetensors",
                         model->config(), model->weights_fingerprint());
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(checkpoint.status()),
              HasSubstr("model.safetensors: format 'pt'"));
  // Metadata that lies about the anchors: refused, naming the file.
  std::map<std::string, std::string> meta;
  {
    auto file = SafetensorsFile::Open(path);
    ASSERT_TRUE(file.ok());
    meta = (*file)->metadata();
  }
  auto rewrite = [&](const std::string& key, const std::string& value) {
    std::map<std::string, std::string> bad = meta;
    bad[key] = value;
    const std::string bad_path = dir.path() + "/bad.anchors";
    EXPECT_TRUE(WriteSafetensors(bad_path, {{"anchors", anchors}}, bad).ok());
    return DomainRouter::Load(bad_path, model->config(),
                              model->weights_fingerprint())
        .status();
  };
  EXPECT_THAT(Message(rewrite("domains", "{")), HasSubstr("bad.anchors"));
  EXPECT_THAT(Message(rewrite("anchor_domain", "[0, 1, 0, 1, 7]")),
              HasSubstr("anchor domain 7"));
  EXPECT_THAT(Message(rewrite("format", "something.else")),
              HasSubstr("format 'something.else'"));
  EXPECT_THAT(
      Message(rewrite(
          "domains",
          R"([{"name":"a","mask":"a99","gamma":1},{"name":"b","mask":"","gamma":0}])")),
      HasSubstr("domain 'a'"));
  EXPECT_THAT(
      Message(rewrite(
          "domains",
          R"([{"name":"a","mask":"","gamma":0,"prompt_tokens":9,"longer":)"
          R"([{"prompt_tokens":512,"mask":"m99","gamma":1}]},)"
          R"({"name":"b","mask":"","gamma":0}])")),
      HasSubstr("domain 'a' at 512 tokens"));
  // A file written before drafts by length (no prompt_tokens, no longer)
  // loads, and every prompt takes the domain's one draft.
  auto older = DomainRouter::Load(
      [&] {
        std::map<std::string, std::string> old = meta;
        old["domains"] = R"([{"name":"a","mask":"a1","gamma":2},)"
                         R"({"name":"b","mask":"","gamma":0}])";
        const std::string old_path = dir.path() + "/old.anchors";
        EXPECT_TRUE(
            WriteSafetensors(old_path, {{"anchors", anchors}}, old).ok());
        return old_path;
      }(),
      model->config(), model->weights_fingerprint());
  ASSERT_TRUE(older.ok()) << older.status();
  const RoutedDomain& a = (*older)->domains()[0];
  EXPECT_EQ(a.prompt_tokens, 0);
  EXPECT_TRUE(a.longer.empty());
  EXPECT_EQ(a.DraftFor(5000).mask.ToString(), "a1");
  EXPECT_EQ(a.DraftFor(5000).gamma, 2);
}

TEST(DomainRouterTest, WeightsFingerprintTellsTrainingsApart) {
  KNAPSERVE_SKIP_WITHOUT_SHARED_MODEL("stories-24l");
  KNAPSERVE_SKIP_WITHOUT_SHARED_MODEL("stories-24l-skip");
  auto base = Checkpoint::Open(testing::SharedModelDir("stories-24l"));
  auto skip = Checkpoint::Open(testing::SharedModelDir("stories-24l-skip"));
  ASSERT_TRUE(base.ok() && skip.ok());
  EXPECT_EQ((*base)->WeightsFingerprint(), (*base)->WeightsFingerprint());
  EXPECT_NE((*base)->WeightsFingerprint(), (*skip)->WeightsFingerprint());
  EXPECT_EQ((*base)->WeightsFingerprint().size(), 16u);
}

TEST(RoutingVectorTest, MeanLeavesOutPositionZeroAndIgnoresChunking) {
  const torch::Tensor states =
      torch::arange(0, 12, torch::kFloat32).reshape({4, 3});
  RoutingVector whole;
  whole.Add(states, 0);
  EXPECT_TRUE(torch::allclose(whole.Mean(), states.narrow(0, 1, 3).mean(0)));
  RoutingVector chunked;
  chunked.Add(states.narrow(0, 0, 1), 0);
  chunked.Add(states.narrow(0, 1, 2), 1);
  chunked.Add(states.narrow(0, 3, 1), 3);
  EXPECT_TRUE(torch::allclose(chunked.Mean(), whole.Mean()));
  RoutingVector one;
  one.Add(states.narrow(0, 0, 1), 0);
  EXPECT_TRUE(torch::equal(one.Mean(), states[0]));
}

// Two prompts of stories260k and a router whose two domains are anchored at
// exactly those prompts' routing vectors, each with its own draft.
struct TwoDomains {
  const LlamaModel* model = nullptr;
  std::vector<std::vector<int32_t>> prompts;
  std::shared_ptr<const DomainRouter> router;
  PlanningShared shared;
};

TwoDomains MakeTwoDomains(const std::string& model_name,
                          const std::string& mask_a, int gamma_a,
                          const std::string& mask_b, int gamma_b) {
  TwoDomains t;
  t.model = CachedModel(model_name);
  if (t.model == nullptr) return t;
  const Tokenizer& tokenizer = *StoriesTokenizer();
  for (const char* text :
       {"Once upon a time, there was a little girl named Lily. She loved to",
        "The old man walked slowly to the market with his dog"}) {
    auto ids = tokenizer.Encode(text, true);
    EXPECT_TRUE(ids.ok());
    t.prompts.push_back(*ids);
  }
  std::vector<torch::Tensor> vectors;
  for (const auto& ids : t.prompts) {
    auto v = PromptRoutingVector(*t.model, ids);
    EXPECT_TRUE(v.ok()) << v.status();
    vectors.push_back(*v);
  }
  const int layers = t.model->num_layers();
  auto router = DomainRouter::Create(
      t.model->config().Fingerprint(), t.model->weights_fingerprint(), layers,
      {Domain("girl", mask_a, gamma_a, layers),
       Domain("market", mask_b, gamma_b, layers)},
      torch::stack(vectors), {0, 1});
  EXPECT_TRUE(router.ok()) << router.status();
  t.router = *router;
  t.shared = PlanningShared::Create();
  t.shared.router = t.router;
  return t;
}

GenerationRequest KnnRequest(const std::vector<int32_t>& prompt, int64_t n) {
  GenerationRequest r;
  r.prompt_ids = prompt;
  r.max_new_tokens = n;
  r.ignore_eos = true;
  r.speculation.mode = SpeculationMode::kKnn;
  r.speculation.max_draft = 10;
  r.speculation.exit_threshold = 0;
  // These tests count drafts: no guard verdict (tests/executor/engine/
  // guard_test.cc) may turn a later request plain.
  r.speculation.guard = false;
  return r;
}

TEST(KnnGenerationTest, EachPromptDraftsWithItsDomainAndMatchesPlainDecoding) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  TwoDomains t = MakeTwoDomains("stories260k", "a1,m3", 3, "m1,a2", 2);
  ASSERT_NE(t.router, nullptr);
  const Tokenizer& tokenizer = *StoriesTokenizer();
  const std::vector<std::string> names = {"girl", "market"};
  const std::vector<std::string> masks = {"a1,m3", "m1,a2"};
  for (size_t p = 0; p < t.prompts.size(); ++p) {
    GenerationRequest off = KnnRequest(t.prompts[p], 48);
    off.speculation = SpeculationConfig();
    auto plain = Generate(*t.model, tokenizer, off);
    ASSERT_TRUE(plain.ok()) << plain.status();
    // Prefilled whole and in chunks of 3: the routing vector is the same.
    for (int64_t chunk : {512, 3}) {
      SCOPED_TRACE(absl::StrCat("prompt ", p, ", prefill chunk ", chunk));
      GenerationRequest request = KnnRequest(t.prompts[p], 48);
      request.prefill_chunk = chunk;
      auto result = Generate(*t.model, tokenizer, request, nullptr, nullptr,
                             nullptr, &t.shared);
      ASSERT_TRUE(result.ok()) << result.status();
      EXPECT_EQ(result->routed_domain, names[p]);
      EXPECT_GT(result->routing_similarity, 0.9999);
      EXPECT_EQ(result->mask, masks[p]);
      EXPECT_GT(result->speculation.drafts, 0);
      EXPECT_LE(result->speculation.accepted_per_position.size(),
                static_cast<size_t>(p == 0 ? 3 : 2));
      EXPECT_GT(result->stats.routing_seconds, 0);
      EXPECT_EQ(result->output_ids, plain->output_ids);
    }
  }
}

TEST(KnnGenerationTest, SampledKnnIsAStaticRequestWithTheRoutedDraft) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  TwoDomains t = MakeTwoDomains("stories260k", "a1,m3", 3, "m1,a2", 2);
  ASSERT_NE(t.router, nullptr);
  GenerationRequest knn = KnnRequest(t.prompts[1], 40);
  knn.sampling.temperature = 0.8;
  knn.sampling.seed = 11;
  GenerationRequest fixed = knn;
  fixed.speculation.mode = SpeculationMode::kStatic;
  fixed.speculation.skip = "m1,a2";
  fixed.speculation.max_draft = 2;
  auto a = Generate(*t.model, *StoriesTokenizer(), knn, nullptr, nullptr,
                    nullptr, &t.shared);
  auto b = Generate(*t.model, *StoriesTokenizer(), fixed);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->routed_domain, "market");
  EXPECT_EQ(a->output_ids, b->output_ids);
  EXPECT_EQ(a->speculation.drafts, b->speculation.drafts);
  EXPECT_EQ(a->speculation.accepted_tokens, b->speculation.accepted_tokens);
}

TEST(KnnGenerationTest, GammaZeroDecodesPlainlyAndMaxDraftCapsGamma) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  TwoDomains t = MakeTwoDomains("stories260k", "a1,m3", 6, "m1", 0);
  ASSERT_NE(t.router, nullptr);
  auto plain =
      Generate(*t.model, *StoriesTokenizer(), KnnRequest(t.prompts[1], 20),
               nullptr, nullptr, nullptr, &t.shared);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->routed_domain, "market");
  EXPECT_EQ(plain->speculation.drafts, 0);
  EXPECT_EQ(plain->mask, "");
  GenerationRequest capped = KnnRequest(t.prompts[0], 40);
  capped.speculation.max_draft = 2;
  auto result = Generate(*t.model, *StoriesTokenizer(), capped, nullptr,
                         nullptr, nullptr, &t.shared);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_GT(result->speculation.drafts, 0);
  EXPECT_LE(result->speculation.accepted_per_position.size(), 2u);
}

// A request takes its domain's draft for prompts of its length: the
// domain's own after a short prompt, the longer drafts after long ones
// (here the short prompt repeated), plain decoding where that draft is plain;
// every output is plain decoding's.
TEST(KnnGenerationTest, ALongPromptTakesItsDomainsDraftForItsLength) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  const int layers = model->num_layers();
  auto short_prompt = StoriesTokenizer()->Encode(
      "Once upon a time, there was a little girl named Lily. She loved to",
      true);
  ASSERT_TRUE(short_prompt.ok());
  const int64_t n = static_cast<int64_t>(short_prompt->size());
  // The short prompt, then its text again (without BOS) up to `length`.
  auto repeated = [&](int64_t length) {
    std::vector<int32_t> ids = *short_prompt;
    while (static_cast<int64_t>(ids.size()) < length)
      ids.insert(ids.end(), short_prompt->begin() + 1, short_prompt->end());
    ids.resize(length);
    return ids;
  };
  RoutedDomain domain = Domain("all", "a1,m3", 3, layers);
  domain.prompt_tokens = n;
  domain.longer.push_back({4 * n, Mask("m1,a2", layers), 2, 1.1});
  domain.longer.push_back({16 * n, Mask("", layers), 0, 1.0});
  auto router = DomainRouter::Create(
      model->config().Fingerprint(), model->weights_fingerprint(), layers,
      {domain}, torch::ones({1, model->config().hidden_size}), {0});
  ASSERT_TRUE(router.ok()) << router.status();
  PlanningShared shared = PlanningShared::Create();
  shared.router = *router;
  struct Case {
    int64_t length;
    std::string mask;
  };
  for (const Case& c : std::vector<Case>{
           {n, "a1,m3"}, {4 * n + 3, "m1,a2"}, {16 * n - 5, ""}}) {
    SCOPED_TRACE(absl::StrCat(c.length, "-token prompt"));
    const std::vector<int32_t> prompt = repeated(c.length);
    GenerationRequest off = KnnRequest(prompt, 24);
    off.speculation = SpeculationConfig();
    auto plain = Generate(*model, *StoriesTokenizer(), off);
    ASSERT_TRUE(plain.ok()) << plain.status();
    auto result = Generate(*model, *StoriesTokenizer(), KnnRequest(prompt, 24),
                           nullptr, nullptr, nullptr, &shared);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->routed_domain, "all");
    EXPECT_EQ(result->mask, c.mask);
    if (c.mask.empty()) {
      EXPECT_EQ(result->speculation.drafts, 0);
    } else {
      EXPECT_GT(result->speculation.drafts, 0);
    }
    EXPECT_EQ(result->output_ids, plain->output_ids);
  }
}

TEST(KnnGenerationTest, WithoutAnchorsItFailsWithFailedPrecondition) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  for (bool with_shared : {false, true}) {
    const PlanningShared shared = PlanningShared::Create();
    auto result =
        Generate(*model, *StoriesTokenizer(), KnnRequest({1, 410, 469}, 4),
                 nullptr, nullptr, nullptr, with_shared ? &shared : nullptr);
    EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(Message(result.status()), HasSubstr("--anchors"));
  }
}

TEST(KnnGenerationTest, BatchedWithOtherModesEachEqualsItsPlainOutput) {
  KNAPSERVE_SKIP_WITHOUT_SHARED_MODEL("stories-24l");
  TwoDomains t =
      MakeTwoDomains("stories-24l", "a6,m6,a7,m7,a8,m8,a9,m9,a10,m10,a11,m11",
                     4, "m4,m5,m6,m7,m8,m9,m10,m11,m12,m13,m14,m15", 3);
  ASSERT_NE(t.router, nullptr);
  auto pool = KvPool::Create(
      *t.model, KvPoolOptions{200 * t.model->KvBytesPerBlock(16), 16});
  ASSERT_TRUE(pool.ok()) << pool.status();
  BatchEngineOptions options;
  options.max_batch_tokens = 24;  // prompts arrive in chunks
  BatchEngine engine(*t.model, *StoriesTokenizer(), **pool, nullptr, t.shared,
                     options);
  std::vector<GenerationRequest> requests;
  for (int i = 0; i < 6; ++i) {
    GenerationRequest r = KnnRequest(t.prompts[i % 2], 40 + 8 * i);
    if (i == 2) r.speculation = SpeculationConfig();  // off
    if (i == 5) {
      r.speculation.mode = SpeculationMode::kStatic;
      r.speculation.skip = "a9,m9";
      r.speculation.max_draft = 3;
    }
    requests.push_back(r);
  }
  std::vector<std::thread> threads;
  std::vector<absl::StatusOr<GenerationResult>> results(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    threads.emplace_back(
        [&, i] { results[i] = engine.Generate(requests[i], nullptr); });
  }
  for (std::thread& thread : threads) thread.join();
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(results[i].ok()) << i << ": " << results[i].status();
    GenerationRequest plain = requests[i];
    plain.speculation = SpeculationConfig();
    auto alone = Generate(*t.model, *StoriesTokenizer(), plain);
    ASSERT_TRUE(alone.ok());
    EXPECT_EQ(results[i]->output_ids, alone->output_ids) << "request " << i;
    if (requests[i].speculation.mode == SpeculationMode::kKnn) {
      EXPECT_EQ(results[i]->routed_domain, i % 2 == 0 ? "girl" : "market")
          << "request " << i;
    } else {
      EXPECT_EQ(results[i]->routed_domain, "") << "request " << i;
    }
  }
}

}  // namespace
}  // namespace knapserve
