// Tests of KNN-SSD's offline half (tools/domain_anchors.h): --domains
// parsing, samples from prompt sets and text files with disjoint train and
// test halves, spherical K-means, and the whole build on stories260k: two
// domains of different text separate, every domain gets its anchors and a
// draft chosen by the KnapSpec DP, held-out samples route to their own
// domain, the router the build returns survives its file, and longer prompt
// lengths get drafts of their own.
#include "tools/domain_anchors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <optional>

#include "tests/testing/test_models.h"
#include "tests/testing/test_util.h"

namespace knapserve {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::Message;

TEST(DomainAnchorsTest, ParsesDomainSourcesAndRefusesBadOnes) {
  auto sources = ParseDomainSources(
      {"stories=a/b.jsonl", "qa=c.jsonl#qa", "stories=d.txt"});
  ASSERT_TRUE(sources.ok()) << sources.status();
  ASSERT_EQ(sources->size(), 3u);
  EXPECT_EQ((*sources)[0].name, "stories");
  EXPECT_EQ((*sources)[0].path, "a/b.jsonl");
  EXPECT_EQ((*sources)[0].category, "");
  EXPECT_EQ((*sources)[1].path, "c.jsonl");
  EXPECT_EQ((*sources)[1].category, "qa");
  for (const char* bad : {"stories", "=x.txt", "x=", "x=f.jsonl#", "x=#qa"}) {
    auto parsed = ParseDomainSources({bad});
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
    EXPECT_THAT(Message(parsed.status()), HasSubstr("NAME=FILE")) << bad;
  }
  EXPECT_FALSE(ParseDomainSources({}).ok());
  EXPECT_FALSE(ParseSampleSplit("half").ok());
}

TEST(DomainAnchorsTest, LoadsSamplesWithDisjointTrainAndTestHalves) {
  testing::ScopedTempDir dir("domains");
  const std::string jsonl = dir.path() + "/q.jsonl";
  {
    std::ofstream out(jsonl);
    for (int i = 0; i < 6; ++i) {
      out << "{\"question_id\": " << i << ", \"category\": \""
          << (i % 2 == 0 ? "qa" : "math") << "\", \"turns\": [\"q" << i
          << "\"]}\n";
    }
  }
  const std::string text = dir.path() + "/t.txt";
  std::ofstream(text) << "first block\nstill first\n\n\nsecond\n  \nthird\n";
  auto sources = ParseDomainSources(
      {"qa=" + jsonl + "#qa", "all=" + jsonl, "prose=" + text});
  ASSERT_TRUE(sources.ok());
  auto all = LoadDomainSamples(*sources, SampleSplit::kAll, 0);
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->size(), 3u);
  EXPECT_THAT((*all)[0].texts, ElementsAre("q0", "q2", "q4"));
  EXPECT_THAT((*all)[1].texts, ElementsAre("q0", "q1", "q2", "q3", "q4", "q5"));
  EXPECT_THAT((*all)[2].texts,
              ElementsAre("first block\nstill first", "second", "third"));
  auto train = LoadDomainSamples(*sources, SampleSplit::kTrain, 0);
  auto test = LoadDomainSamples(*sources, SampleSplit::kTest, 0);
  ASSERT_TRUE(train.ok() && test.ok());
  EXPECT_THAT((*train)[1].texts, ElementsAre("q0", "q2", "q4"));
  EXPECT_THAT((*test)[1].texts, ElementsAre("q1", "q3", "q5"));
  EXPECT_THAT((*test)[2].texts, ElementsAre("second"));
  auto capped = LoadDomainSamples(*sources, SampleSplit::kAll, 2);
  ASSERT_TRUE(capped.ok());
  EXPECT_THAT((*capped)[1].texts, ElementsAre("q0", "q1"));
  // A category with no rows, a missing file, a category on a text file.
  for (const std::string& bad :
       {"x=" + jsonl + "#code", "x=" + dir.path() + "/missing.txt",
        "x=" + text + "#qa"}) {
    auto parsed = ParseDomainSources({bad});
    ASSERT_TRUE(parsed.ok());
    auto loaded = LoadDomainSamples(*parsed, SampleSplit::kAll, 0);
    EXPECT_FALSE(loaded.ok()) << bad;
  }
}

TEST(DomainAnchorsTest, SphericalKMeansSeparatesDirections) {
  torch::manual_seed(5);
  // Two bundles of directions (along x and along y) with different lengths;
  // the initial centroids are deliberately poor.
  torch::Tensor a =
      torch::randn({20, 3}) * 0.1 + torch::tensor({5.0, 0.0, 0.0});
  torch::Tensor b =
      torch::randn({20, 3}) * 0.1 + torch::tensor({0.0, 0.5, 0.0});
  const torch::Tensor x = torch::cat({a, b}).to(torch::kFloat32);
  const KMeansResult result = SphericalKMeans(
      x, torch::tensor({{1.0f, 1.0f, 0.0f}, {0.0f, 1.0f, 1.0f}}), 50);
  EXPECT_TRUE(result.converged);
  for (int i = 0; i < 40; ++i)
    EXPECT_EQ(result.assignment[i], result.assignment[i < 20 ? 0 : 20]) << i;
  EXPECT_NE(result.assignment[0], result.assignment[20]);
  EXPECT_NEAR(result.centroids.norm(2, 1).min().item<double>(), 1.0, 1e-5);

  // Weights: one cluster over a point along x (weight 1) and two along y
  // (weight 1.5 each) sits at the direction (1, 3).
  const KMeansResult weighted =
      SphericalKMeans(torch::tensor({{2.0f, 0.0f}, {0.0f, 1.0f}, {0.0f, 5.0f}}),
                      torch::tensor({{1.0f, 0.0f}}), 10, {1.0, 1.5, 1.5});
  EXPECT_NEAR(weighted.centroids[0][0].item<double>(), 1 / std::sqrt(10.0),
              1e-5);
  EXPECT_NEAR(weighted.centroids[0][1].item<double>(), 3 / std::sqrt(10.0),
              1e-5);
}

// Two domains of clearly different text, the last sample of each held out.
std::vector<DomainSamples> TwoTextDomains() {
  return {{"stories",
           {"Once upon a time, there was a little girl named Lily.",
            "Tom had a red ball. He liked to play with it in the park.",
            "The cat was very happy. She jumped on the bed and smiled.",
            "One day, a big dog saw a bird in the tree.",
            "Sue went to the store with her mom to buy a cake.",
            "The little boy was sad because his toy was broken."}},
          {"numbers",
           {"1 2 3 4 5 6 7 8 9 10 11 12", "20 30 40 50 60 70 80 90",
            "7 14 21 28 35 42 49 56 63", "100 200 300 400 500 600 700",
            "3 6 9 12 15 18 21 24 27 30", "11 22 33 44 55 66 77 88 99"}}};
}

std::vector<DomainSamples> WithoutLast(std::vector<DomainSamples> domains) {
  for (DomainSamples& d : domains) d.texts.pop_back();
  return domains;
}

TEST(DomainAnchorsTest, AnchorsRouteHeldOutSamplesToTheirDomain) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = testing::CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  const Tokenizer& tokenizer = *testing::StoriesTokenizer();
  const std::vector<DomainSamples> domains = TwoTextDomains();
  AnchorOptions options;
  options.anchors_per_domain = 3;
  options.mask_samples = 0;  // routing alone: no profile needed
  auto build = BuildDomainAnchors(*model, tokenizer, WithoutLast(domains),
                                  nullptr, options);
  ASSERT_TRUE(build.ok()) << build.status();
  const DomainRouter& router = *build->router;
  EXPECT_EQ(router.num_anchors(), 6);
  EXPECT_THAT(router.anchor_domain(), ElementsAre(0, 0, 0, 1, 1, 1));
  EXPECT_EQ(router.model_fingerprint(), model->config().Fingerprint());
  EXPECT_EQ(router.weights_fingerprint(), model->weights_fingerprint());
  ASSERT_EQ(build->reports.size(), 2u);
  for (size_t d = 0; d < 2; ++d) {
    EXPECT_EQ(build->reports[d].name, domains[d].name);
    EXPECT_EQ(build->reports[d].samples, 5);
    EXPECT_DOUBLE_EQ(build->reports[d].cluster_purity, 1.0);
    EXPECT_EQ(router.domains()[d].gamma, 0);
    auto ids = tokenizer.Encode(domains[d].texts.back(), true);
    ASSERT_TRUE(ids.ok());
    auto vector = PromptRoutingVector(*model, *ids);
    ASSERT_TRUE(vector.ok());
    EXPECT_EQ(router.Route(*vector).domain, static_cast<int>(d))
        << domains[d].texts.back();
  }
  // Choosing drafts needs a profile.
  options.mask_samples = 2;
  EXPECT_FALSE(BuildDomainAnchors(*model, tokenizer, WithoutLast(domains),
                                  nullptr, options)
                   .ok());
}

// The choice of drafts on stories-24l (deep enough for drafts that pay),
// with a hand-made latency profile, few anchors, samples and reference
// tokens, drafts of at most 4: a second per build.
class DeepModelAnchorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KNAPSERVE_SKIP_WITHOUT_SHARED_MODEL("stories-24l");
    model_ = testing::CachedModel("stories-24l");
    ASSERT_NE(model_, nullptr);
    profile_.emplace(testing::HandLatencyProfile(*model_));
  }

  static AnchorOptions SmallDraftChoice() {
    AnchorOptions options;
    options.anchors_per_domain = 3;
    options.mask_samples = 2;
    options.reference_tokens = 8;
    options.max_draft = 4;
    return options;
  }

  const LlamaModel* model_ = nullptr;
  const Tokenizer& tokenizer_ = *testing::StoriesTokenizer();
  std::optional<LatencyProfile> profile_;
};

// On the deep model the DP finds drafts that pay: every domain gets a
// candidate from its samples, the chosen one is among them, and its
// predicted speed-up is above 1.
TEST_F(DeepModelAnchorsTest, TheKnapSpecDpChoosesADraftPerDomain) {
  AnchorOptions options = SmallDraftChoice();
  options.longer_prompt_tokens = {};  // LongerPromptsGetDraftsOfTheirOwn
  auto build = BuildDomainAnchors(
      *model_, tokenizer_, WithoutLast(TwoTextDomains()), &*profile_, options);
  ASSERT_TRUE(build.ok()) << build.status();
  for (size_t d = 0; d < 2; ++d) {
    const DomainReport& report = build->reports[d];
    const RoutedDomain& domain = build->router->domains()[d];
    SCOPED_TRACE(report.name);
    EXPECT_FALSE(report.candidates.empty());
    EXPECT_EQ(domain.mask.ToString(), report.mask);
    EXPECT_EQ(domain.gamma, report.gamma);
    EXPECT_GE(domain.gamma, 1);
    EXPECT_LE(domain.gamma, 4);
    EXPECT_THAT(report.candidates, ::testing::Contains(report.mask));
    EXPECT_GT(report.predicted_speedup, 1.0);
    EXPECT_GT(report.alpha, 0.0);
    EXPECT_LT(report.alpha, 1.0);
    EXPECT_EQ(domain.mask_source, "knapspec-dp");
  }
}

// Drafts by prompt length: every domain gets one for each longer length that
// fits the context (on long samples of its own text), recorded in its report
// and in the router; a length past the context is skipped and said so; the
// lengths must ascend.
TEST_F(DeepModelAnchorsTest, LongerPromptsGetDraftsOfTheirOwn) {
  AnchorOptions options = SmallDraftChoice();
  options.longer_prompt_tokens = {160, model_->max_context()};
  const std::vector<DomainSamples> domains = WithoutLast(TwoTextDomains());
  auto build =
      BuildDomainAnchors(*model_, tokenizer_, domains, &*profile_, options);
  ASSERT_TRUE(build.ok()) << build.status();
  EXPECT_THAT(build->longer_prompt_tokens, ElementsAre(160));
  EXPECT_THAT(build->skipped_prompt_tokens, ElementsAre(model_->max_context()));
  for (size_t d = 0; d < 2; ++d) {
    const DomainReport& report = build->reports[d];
    const RoutedDomain& domain = build->router->domains()[d];
    SCOPED_TRACE(report.name);
    EXPECT_GT(domain.prompt_tokens, 0);
    EXPECT_LT(domain.prompt_tokens, 160);
    EXPECT_EQ(report.prompt_tokens, domain.prompt_tokens);
    ASSERT_EQ(domain.longer.size(), 1u);
    ASSERT_EQ(report.longer.size(), 1u);
    const ContextDraft& draft = domain.longer[0];
    EXPECT_EQ(draft.prompt_tokens, 160);
    EXPECT_EQ(report.longer[0].prompt_tokens, 160);
    EXPECT_EQ(draft.gamma, report.longer[0].gamma);
    EXPECT_EQ(draft.gamma > 0 ? draft.mask.ToString() : "",
              report.longer[0].mask);
    EXPECT_LE(draft.gamma, 4);
    if (draft.gamma > 0) {
      EXPECT_THAT(report.candidates,
                  ::testing::Contains(draft.mask.ToString()));
      EXPECT_GT(draft.predicted_speedup, 1.0);
      EXPECT_GT(report.longer[0].alpha, 0.0);
    } else {
      EXPECT_EQ(draft.predicted_speedup, 1.0);
    }
    EXPECT_EQ(domain.DraftFor(170).prompt_tokens, 160);
    EXPECT_EQ(domain.DraftFor(domain.prompt_tokens).prompt_tokens,
              domain.prompt_tokens);
  }
  options.longer_prompt_tokens = {300, 200};
  auto unordered =
      BuildDomainAnchors(*model_, tokenizer_, domains, &*profile_, options);
  EXPECT_EQ(unordered.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(unordered.status()), HasSubstr("ascending"));
}

}  // namespace
}  // namespace knapserve
