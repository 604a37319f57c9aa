// Tests of SpecBound (--spec specbound, executor/engine/specbound.h) through
// Generate() and the batched step (executor/engine/sequence.h):
//   - greedy losslessness: output ids equal --spec off on stories260k and
//     stories-24l for several prompts and settings, lambda 0 and 1, depth
//     bound 1 and L, width 1 and 15, checks every layer and every few, with
//     training-free and trained exit heads;
//   - the statistics (exit depths, bound stops) follow the settings;
//   - the batched path: several SpecBound sequences beside other modes and
//     a prompt being prefilled, in shared passes (RunBatchStep) and through
//     the batch engine's paged K/V, give the ids each gives alone, greedy
//     and sampled;
//   - validation names the field.
// (Sampling losslessness through the rejection sampler is in
// speculation_step_test.cc, with the other distribution tests.)
#include "executor/engine/specbound.h"

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/model/exit_heads.h"
#include "executor/engine/batch_engine.h"
#include "executor/engine/generator.h"
#include "executor/engine/kv_pool.h"
#include "executor/engine/sequence.h"
#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

using testing::CachedModel;
using testing::StoriesTokenizer;

// Trained heads for `name`, trained once per process (a few steps: enough to
// differ from the training-free heads, which is what these tests need).
std::shared_ptr<const ExitHeads> TrainedHeads(const std::string& name) {
  static auto* cache =
      new std::map<std::string, std::shared_ptr<const ExitHeads>>();
  auto it = cache->find(name);
  if (it != cache->end()) return it->second;
  const LlamaModel* model = CachedModel(name);
  if (model == nullptr) return nullptr;
  std::vector<std::vector<int32_t>> docs;
  for (const char* text :
       {"Once upon a time, there was a little girl named Lily. She loved to "
        "play outside in the park with her friends every day.",
        "Tom had a big red ball. He liked to kick it very high. One day the "
        "ball went over the fence and Tom was sad. His mom helped him."}) {
    auto ids = StoriesTokenizer()->Encode(text, true);
    EXPECT_TRUE(ids.ok());
    if (ids.ok()) docs.push_back(*ids);
  }
  ExitHeadsTrainOptions options;
  options.rank = 8;
  options.steps = 15;
  options.lr = 1e-2;
  options.seq_len = 32;
  options.batch = 2;
  auto heads = TrainExitHeads(*model, docs, options, nullptr);
  EXPECT_TRUE(heads.ok()) << heads.status();
  if (!heads.ok()) return nullptr;
  (*cache)[name] = *heads;
  return *heads;
}

std::vector<std::vector<int32_t>> Prompts(const LlamaModel& model) {
  std::vector<std::vector<int32_t>> prompts = {{1, 410, 469, 347}, {1}};
  auto text = StoriesTokenizer()->Encode(
      "Lily and Ben went to the park. They saw a big dog.", true);
  EXPECT_TRUE(text.ok());
  if (text.ok()) prompts.push_back(*text);
  std::mt19937 rng(11);
  std::vector<int32_t> random = {1};
  for (int i = 0; i < 20; ++i)
    random.push_back(static_cast<int32_t>(rng() % model.config().vocab_size));
  prompts.push_back(random);
  return prompts;
}

GenerationRequest Request(std::vector<int32_t> prompt, int64_t max_new) {
  GenerationRequest r;
  r.prompt_ids = std::move(prompt);
  r.max_new_tokens = max_new;
  r.ignore_eos = true;
  return r;
}

struct Setting {
  double lambda;
  double t0;
  int depth_bound;  // 0 = L
  int width;
  int check_every;
  bool trained;
};

std::string Describe(const Setting& s) {
  return absl::StrCat("lambda ", s.lambda, " t0 ", s.t0, " depth ",
                      s.depth_bound, " width ", s.width, " every ",
                      s.check_every, s.trained ? " trained" : " free");
}

GenerationRequest WithSpecBound(GenerationRequest r, const Setting& s,
                                const std::string& model_name) {
  r.speculation.mode = SpeculationMode::kSpecBound;
  r.speculation.max_draft = s.width;
  r.speculation.specbound.lambda = s.lambda;
  r.speculation.specbound.t0 = s.t0;
  r.speculation.specbound.depth_bound = s.depth_bound;
  r.speculation.specbound.check_every = s.check_every;
  r.speculation.specbound.trained_heads = s.trained;
  if (s.trained) r.speculation.specbound.heads = TrainedHeads(model_name);
  return r;
}

std::vector<Setting> Settings(int layers) {
  std::vector<Setting> settings;
  for (bool trained : {false, true}) {
    settings.push_back({0.0, 1.0, 0, 15, 1, trained});  // exit at layer 0
    settings.push_back({1.0, 1.0, 0, 15, 1, trained});  // never exits
    settings.push_back({0.5, 2.0, 1, 1, 1, trained});   // depth 1, width 1
    settings.push_back({0.5, 2.0, 0, 1, 1, trained});   // width 1
    settings.push_back({0.6, 1.5, 0, 15, 1, trained});  // wide
    settings.push_back({0.8, 3.0, layers / 2, 6, 2, trained});
    settings.push_back({0.3, 1.0, layers, 15, 3, trained});
    settings.push_back({0.9, 1.5, 0, 6, 1, trained});
  }
  return settings;
}

// Greedy SpecBound output equals --spec off, for every setting and prompt.
void ExpectGreedyLossless(const std::string& name, int64_t max_new) {
  const LlamaModel* model = CachedModel(name);
  ASSERT_NE(model, nullptr);
  ASSERT_NE(TrainedHeads(name), nullptr);
  int64_t drafted = 0;
  int64_t accepted = 0;
  for (const std::vector<int32_t>& prompt : Prompts(*model)) {
    auto off = Generate(*model, *StoriesTokenizer(), Request(prompt, max_new));
    ASSERT_TRUE(off.ok()) << off.status();
    for (const Setting& s : Settings(model->num_layers())) {
      SCOPED_TRACE(name + ": " + Describe(s));
      auto spec = Generate(*model, *StoriesTokenizer(),
                           WithSpecBound(Request(prompt, max_new), s, name));
      ASSERT_TRUE(spec.ok()) << spec.status();
      EXPECT_EQ(spec->output_ids, off->output_ids);
      EXPECT_EQ(spec->text, off->text);
      const SpeculationStats& st = spec->speculation;
      drafted += st.draft_tokens;
      accepted += st.accepted_tokens;
      // Every drafted token exited somewhere within the depth bound.
      int64_t exits = 0;
      for (int64_t n : st.exit_depths) exits += n;
      EXPECT_EQ(exits, st.draft_tokens);
      const int bound = s.depth_bound > 0 ? s.depth_bound : model->num_layers();
      EXPECT_LE(static_cast<int>(st.exit_depths.size()), bound);
      EXPECT_LE(st.draft_tokens, st.drafts * s.width);
      EXPECT_EQ(spec->stats.completion_tokens,
                1 + spec->stats.steps + st.accepted_tokens);
      if (s.lambda == 0.0) {
        // Every check exits: the first check depth, width-long runs.
        ASSERT_FALSE(st.exit_depths.empty());
        EXPECT_EQ(st.mean_exit_depth(), std::min(s.check_every, bound));
        EXPECT_EQ(st.depth_bound_stops, 0);
        EXPECT_GT(st.width_bound_stops, 0);
      }
      if (s.lambda == 1.0 && s.trained) {
        EXPECT_GT(st.depth_bound_stops, 0);
      }
    }
  }
  // The settings do draft, accept and reject.
  EXPECT_GT(drafted, 0);
  EXPECT_GT(accepted, 0);
  EXPECT_LT(accepted, drafted);
}

TEST(SpecBoundTest, Stories260kGreedyEqualsOff) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  ExpectGreedyLossless("stories260k", 40);
}

TEST(SpecBoundTest, Stories24lGreedyEqualsOff) {
  KNAPSERVE_SKIP_WITHOUT_SHARED_MODEL("stories-24l");
  ExpectGreedyLossless("stories-24l", 32);
}

TEST(SpecBoundTest, ExitTemperatureFallsLinearlyToOne) {
  EXPECT_DOUBLE_EQ(ExitTemperature(3.0, 0, 5), 3.0);
  EXPECT_DOUBLE_EQ(ExitTemperature(3.0, 2, 5), 2.0);
  EXPECT_DOUBLE_EQ(ExitTemperature(3.0, 4, 5), 1.0);
  EXPECT_DOUBLE_EQ(ExitTemperature(1.0, 1, 5), 1.0);
  EXPECT_EQ(NextCheckDepth(0, 1, 5), 1);
  EXPECT_EQ(NextCheckDepth(0, 3, 5), 3);
  EXPECT_EQ(NextCheckDepth(3, 3, 5), 5);  // the depth bound is checked
  EXPECT_EQ(NextCheckDepth(0, 3, 2), 2);
}

// Depth bound 1 and a lambda no exit reaches: no drafts at all, every step
// that may draft ends at the depth bound, the output is still off's.
TEST(SpecBoundTest, DepthBoundOneWithoutExitsDecodesPlainly) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  const GenerationRequest plain = Request({1, 410, 469, 347}, 20);
  auto off = Generate(*model, *StoriesTokenizer(), plain);
  ASSERT_TRUE(off.ok());
  GenerationRequest r = plain;
  r.speculation.mode = SpeculationMode::kSpecBound;
  r.speculation.specbound.lambda = 1.0;
  r.speculation.specbound.t0 = 1e6;  // softmax(z / T) is nearly flat
  r.speculation.specbound.depth_bound = 1;
  auto spec = Generate(*model, *StoriesTokenizer(), r);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->output_ids, off->output_ids);
  EXPECT_EQ(spec->speculation.draft_tokens, 0);
  // Every step but the last (whose budget is 0: one token left) drafted
  // until the depth bound.
  EXPECT_EQ(spec->speculation.depth_bound_stops, spec->stats.steps - 1);
}

TEST(SpecBoundTest, ValidationNamesTheField) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  GenerationRequest r = Request({1, 2}, 4);
  r.speculation.mode = SpeculationMode::kSpecBound;
  auto expect = [&](GenerationRequest bad, const std::string& field,
                    absl::StatusCode code) {
    absl::Status status = ValidateGenerationRequest(bad, *model);
    EXPECT_EQ(status.code(), code) << status;
    EXPECT_NE(status.message().find(field), std::string::npos) << status;
  };
  EXPECT_TRUE(ValidateGenerationRequest(r, *model).ok());
  GenerationRequest bad = r;
  bad.speculation.specbound.lambda = 1.5;
  expect(bad, "specbound.lambda", absl::StatusCode::kInvalidArgument);
  bad = r;
  bad.speculation.specbound.t0 = 0.5;
  expect(bad, "specbound.t0", absl::StatusCode::kInvalidArgument);
  bad = r;
  bad.speculation.specbound.depth_bound = model->num_layers() + 1;
  expect(bad, "specbound.depth_bound", absl::StatusCode::kInvalidArgument);
  bad = r;
  bad.speculation.specbound.check_every = 0;
  expect(bad, "specbound.check_every", absl::StatusCode::kInvalidArgument);
  bad = r;
  bad.speculation.specbound.trained_heads = true;
  expect(bad, "specbound.trained_heads", absl::StatusCode::kFailedPrecondition);
  bad = r;
  bad.speculation.max_draft = 16;
  expect(bad, "max_draft", absl::StatusCode::kInvalidArgument);
}

// The mixed batch of the batched tests: SpecBound greedy and sampled, with
// both kinds of heads, static and off, and a longer prompt.
std::vector<GenerationRequest> MixedBatch() {
  std::vector<GenerationRequest> requests;
  const Setting free_heads = {0.5, 1.5, 0, 6, 1, false};
  const Setting trained = {0.6, 2.0, 3, 15, 1, true};
  const Setting every2 = {0.4, 1.0, 0, 4, 2, false};
  requests.push_back(WithSpecBound(Request({1, 410, 469, 347}, 30), free_heads,
                                   "stories260k"));
  requests.push_back(
      WithSpecBound(Request({1, 22, 33, 44, 55}, 26), trained, "stories260k"));
  GenerationRequest sampled =
      WithSpecBound(Request({1, 410, 469}, 28), every2, "stories260k");
  sampled.sampling.temperature = 1.0;
  sampled.sampling.seed = 7;
  requests.push_back(sampled);
  GenerationRequest sampled_trained =
      WithSpecBound(Request({1, 300, 200}, 24), trained, "stories260k");
  sampled_trained.sampling.temperature = 0.8;
  sampled_trained.sampling.top_p = 0.9;
  sampled_trained.sampling.seed = 8;
  requests.push_back(sampled_trained);
  GenerationRequest fixed = Request({1, 50, 60}, 25);
  fixed.speculation.mode = SpeculationMode::kStatic;
  fixed.speculation.skip = "m1,a3";
  fixed.speculation.max_draft = 3;
  requests.push_back(fixed);
  requests.push_back(Request({1, 70}, 20));  // off
  GenerationRequest long_prompt = Request({}, 22);
  for (int j = 0; j < 70; ++j)
    long_prompt.prompt_ids.push_back(3 + (j * 7) % 500);
  long_prompt = WithSpecBound(long_prompt, free_heads, "stories260k");
  requests.push_back(long_prompt);
  return requests;
}

std::vector<std::vector<int32_t>> AloneIds(
    const LlamaModel& model, const std::vector<GenerationRequest>& requests) {
  std::vector<std::vector<int32_t>> alone;
  for (const GenerationRequest& r : requests) {
    auto result = Generate(model, *StoriesTokenizer(), r);
    EXPECT_TRUE(result.ok()) << result.status();
    alone.push_back(result.ok() ? result->output_ids : std::vector<int32_t>());
  }
  return alone;
}

TEST(SpecBoundTest, SharedPassesGiveEachSequenceItsOwnOutput) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  const std::vector<GenerationRequest> requests = MixedBatch();
  const std::vector<std::vector<int32_t>> alone = AloneIds(*model, requests);
  // Greedy SpecBound equals off too.
  auto off =
      Generate(*model, *StoriesTokenizer(), Request({1, 410, 469, 347}, 30));
  ASSERT_TRUE(off.ok());
  EXPECT_EQ(alone[0], off->output_ids);

  std::vector<std::unique_ptr<Sequence>> seqs;
  std::vector<std::vector<LayerKv>> kv(requests.size());
  std::vector<Sequence*> batch;
  for (size_t i = 0; i < requests.size(); ++i) {
    auto seq = Sequence::Create(*model, *StoriesTokenizer(), requests[i],
                                nullptr, nullptr, nullptr, nullptr);
    ASSERT_TRUE(seq.ok()) << seq.status();
    kv[i] = model->AllocateKv((*seq)->max_positions());
    (*seq)->UseKv(&kv[i]);
    batch.push_back(seq->get());
    seqs.push_back(std::move(*seq));
  }
  BatchStepOptions options;
  options.max_batch_tokens = 24;  // the long prompt loads in chunks
  options.min_prefill_rows = 8;
  int64_t draft_passes = 0;
  for (int step = 0; step < 500; ++step) {
    bool all_done = true;
    for (Sequence* s : batch) all_done = all_done && s->done();
    if (all_done) break;
    draft_passes += RunBatchStep(*model, batch, options).draft_passes;
  }
  EXPECT_GT(draft_passes, 0);
  for (size_t i = 0; i < seqs.size(); ++i) {
    auto result = seqs[i]->TakeResult();
    ASSERT_TRUE(result.ok()) << i << ": " << result.status();
    EXPECT_EQ(result->output_ids, alone[i]) << "request " << i;
    if (requests[i].speculation.mode == SpeculationMode::kSpecBound) {
      EXPECT_GT(result->speculation.draft_tokens, 0) << "request " << i;
    }
  }
}

TEST(SpecBoundTest, BatchEngineWithPagedKvGivesTheSameIds) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  const std::vector<GenerationRequest> requests = MixedBatch();
  const std::vector<std::vector<int32_t>> alone = AloneIds(*model, requests);
  auto pool = KvPool::Create(
      *model, KvPoolOptions{200 * model->KvBytesPerBlock(16), 16});
  ASSERT_TRUE(pool.ok()) << pool.status();
  BatchEngineOptions options;
  options.max_batch_tokens = 24;
  BatchEngine engine(*model, *StoriesTokenizer(), **pool, nullptr,
                     PlanningShared(), options);
  std::vector<absl::StatusOr<GenerationResult>> results(requests.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < requests.size(); ++i) {
    threads.emplace_back(
        [&, i] { results[i] = engine.Generate(requests[i], nullptr); });
  }
  for (std::thread& t : threads) t.join();
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(results[i].ok()) << i << ": " << results[i].status();
    EXPECT_EQ(results[i]->output_ids, alone[i]) << "request " << i;
  }
  EXPECT_EQ((*pool)->used_blocks(), 0);
}

}  // namespace
}  // namespace knapserve
