// Tests of continuous batching (executor/engine/batch_engine.h, sequence.h):
// concurrent streams in one batch produce exactly their single-stream output
// (fp32 and bf16, mixed speculation modes), a long prompt is prefilled in
// chunks while other streams keep decoding, admission waits for K/V blocks
// and refuses what can never fit, and no block leaks after cancellation,
// Abort-style stops or errors.
#include "executor/engine/batch_engine.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "planner/batch_cost.h"
#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

using testing::CachedModel;
using testing::StoriesTokenizer;

std::unique_ptr<KvPool> Pool(const LlamaModel& model, int64_t blocks) {
  auto pool = KvPool::Create(
      model, KvPoolOptions{blocks * model.KvBytesPerBlock(16), 16});
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? std::move(*pool) : nullptr;
}

// A short greedy prompt that decodes `new_tokens` tokens.
GenerationRequest Runner(int64_t new_tokens) {
  GenerationRequest r;
  r.prompt_ids = {1, 410, 469, 347};
  r.max_new_tokens = new_tokens;
  r.ignore_eos = true;
  return r;
}

// A `tokens`-token prompt that decodes `new_tokens` tokens.
GenerationRequest LongPrompt(int tokens, int64_t new_tokens) {
  GenerationRequest r;
  for (int j = 0; j < tokens; ++j) r.prompt_ids.push_back(3 + (j * 7) % 500);
  r.max_new_tokens = new_tokens;
  return r;
}

// Prompts of different lengths, some speculative, all greedy.
std::vector<GenerationRequest> MixedRequests(const LlamaModel& model, int n) {
  std::vector<GenerationRequest> requests;
  for (int i = 0; i < n; ++i) {
    GenerationRequest r;
    r.prompt_ids = {1};
    for (int j = 0; j < 3 + 11 * (i % 4); ++j)
      r.prompt_ids.push_back(3 + (i * 31 + j * 17) % 400);
    r.max_new_tokens = 24 + 9 * (i % 3);
    r.ignore_eos = i % 2 == 0;
    if (i % 3 == 1) {
      r.speculation.mode = SpeculationMode::kStatic;
      r.speculation.skip = "m1,a3";
      r.speculation.max_draft = 1 + i % 5;
    }
    // The tests count drafts and plain steps: no guard verdict
    // (guard_test.cc) may change them with this machine's timings.
    r.speculation.guard = false;
    requests.push_back(std::move(r));
  }
  return requests;
}

// Runs `requests` through `engine` at once, one caller thread each.
std::vector<absl::StatusOr<GenerationResult>> RunConcurrently(
    BatchEngine& engine, const std::vector<GenerationRequest>& requests) {
  std::vector<absl::StatusOr<GenerationResult>> results(requests.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < requests.size(); ++i) {
    threads.emplace_back(
        [&, i] { results[i] = engine.Generate(requests[i], nullptr); });
  }
  for (std::thread& t : threads) t.join();
  return results;
}

// Runs every request alone (Generate: batch of one, contiguous K/V) and then
// all at once through `engine`; the ids must be equal.
void ExpectBatchedEqualsAlone(const LlamaModel& model, BatchEngine& engine,
                              const std::vector<GenerationRequest>& requests) {
  std::vector<std::vector<int32_t>> alone;
  for (const GenerationRequest& r : requests) {
    GenerationRequest plain = r;
    plain.speculation = SpeculationConfig();  // off: the model's own output
    auto result = Generate(model, *StoriesTokenizer(), plain);
    ASSERT_TRUE(result.ok()) << result.status();
    alone.push_back(result->output_ids);
  }
  std::vector<absl::StatusOr<GenerationResult>> batched =
      RunConcurrently(engine, requests);
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(batched[i].ok()) << i << ": " << batched[i].status();
    EXPECT_EQ(batched[i]->output_ids, alone[i]) << "request " << i;
  }
  EXPECT_EQ(engine.pool().used_blocks(), 0);
  EXPECT_EQ(engine.pool().reserved_blocks(), 0);
}

TEST(BatchEngineTest, ConcurrentStreamsEqualTheirSingleStreamOutputFp32Bf16) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  for (const char* name : {"stories260k", "stories260k/bf16"}) {
    const LlamaModel* model = CachedModel(name);
    ASSERT_NE(model, nullptr);
    std::unique_ptr<KvPool> pool = Pool(*model, 200);
    BatchEngineOptions options;
    options.max_batch_tokens = 24;  // prompts arrive in chunks
    BatchEngine engine(*model, *StoriesTokenizer(), *pool, nullptr,
                       PlanningShared(), options);
    SCOPED_TRACE(name);
    ExpectBatchedEqualsAlone(*model, engine, MixedRequests(*model, 10));
    EXPECT_GT(engine.stats().steps, 0);
    EXPECT_GT(engine.stats().prefill_chunks, 10);
  }
}

TEST(BatchEngineTest, Stories24lBatchedEqualsAlone) {
  if (!testing::HaveSharedModel("stories-24l"))
    GTEST_SKIP() << testing::NeedsSharedMessage("models/stories-24l");
  const LlamaModel* model = CachedModel("stories-24l");
  ASSERT_NE(model, nullptr);
  std::unique_ptr<KvPool> pool = Pool(*model, 100);
  BatchEngine engine(*model, *StoriesTokenizer(), *pool, nullptr,
                     PlanningShared(), BatchEngineOptions());
  std::vector<GenerationRequest> requests = MixedRequests(*model, 6);
  for (GenerationRequest& r : requests) {
    if (r.speculation.mode == SpeculationMode::kStatic)
      r.speculation.skip = "a6,m6,a7,m7,a8,m8,a9,m9,a10,m10,a11,m11";
  }
  ExpectBatchedEqualsAlone(*model, engine, requests);
}

// A long prompt arriving while three streams decode is prefilled in chunks
// of the token budget; the running streams get tokens between its chunks,
// and everyone's output is still its single-stream output.
TEST(BatchEngineTest, LongPromptIsChunkedWhileOthersKeepDecoding) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  std::unique_ptr<KvPool> pool = Pool(*model, 200);
  BatchEngineOptions options;
  options.max_batch_tokens = 32;
  options.min_prefill_rows = 16;
  BatchEngine engine(*model, *StoriesTokenizer(), *pool, nullptr,
                     PlanningShared(), options);
  const GenerationRequest runner = Runner(220);
  const GenerationRequest longer = LongPrompt(300, 8);
  auto alone_long = Generate(*model, *StoriesTokenizer(), longer);
  auto alone_runner = Generate(*model, *StoriesTokenizer(), runner);
  ASSERT_TRUE(alone_long.ok() && alone_runner.ok());

  std::atomic<int> per_runner[3] = {0, 0, 0};
  std::atomic<int> during_prefill{0};  // runner tokens while `longer` loads
  std::atomic<bool> long_submitted{false};
  std::atomic<bool> long_started{false};
  absl::StatusOr<GenerationResult> long_run;
  std::thread long_client;
  std::vector<absl::StatusOr<GenerationResult>> runs(3);
  std::vector<std::thread> threads;
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back([&, i] {
      runs[i] =
          engine.Generate(runner, [&](absl::Span<const int32_t> ids,
                                      std::string_view, const StepLogprobs&) {
            // On the step thread: the long prompt is sent once all three
            // runners have streamed 10 tokens (each has 210 more to go).
            per_runner[i] += static_cast<int>(ids.size());
            const bool all_going = per_runner[0] >= 10 && per_runner[1] >= 10 &&
                                   per_runner[2] >= 10;
            if (all_going && !long_submitted) {
              long_submitted = true;
              long_client = std::thread([&] {
                long_run = engine.Generate(
                    longer, [&](absl::Span<const int32_t>, std::string_view,
                                const StepLogprobs&) {
                      long_started = true;
                      return true;
                    });
              });
            }
            if (long_submitted && !long_started)
              during_prefill += static_cast<int>(ids.size());
            return true;
          });
    });
  }
  for (std::thread& t : threads) t.join();
  ASSERT_TRUE(long_client.joinable());
  long_client.join();
  ASSERT_TRUE(long_run.ok()) << long_run.status();
  EXPECT_EQ(long_run->output_ids, alone_long->output_ids);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(runs[i].ok()) << runs[i].status();
    EXPECT_EQ(runs[i]->output_ids, alone_runner->output_ids) << i;
  }
  // 300 prompt tokens at most 32 - 3 rows per step: >= 10 chunks, in each
  // of which the three runners decoded.
  EXPECT_GE(during_prefill.load(), 3 * 9);
}

// Runs three 200-token streams and, once each has 10 tokens, a 400-token
// prompt, through an engine with `budget`; checks every output against
// its single-stream run and returns the engine's counters.
BatchEngineStats RunLongPromptBesideStreams(double budget) {
  const LlamaModel* model = CachedModel("stories260k");
  std::unique_ptr<KvPool> pool = Pool(*model, 200);
  BatchEngineOptions options;
  options.max_batch_tokens = 256;
  options.prefill_step_budget = budget;
  BatchEngine engine(*model, *StoriesTokenizer(), *pool, nullptr,
                     PlanningShared(), options);
  const GenerationRequest runner = Runner(200);
  const GenerationRequest longer = LongPrompt(400, 4);
  auto alone_long = Generate(*model, *StoriesTokenizer(), longer);
  auto alone_runner = Generate(*model, *StoriesTokenizer(), runner);
  EXPECT_TRUE(alone_long.ok() && alone_runner.ok());
  std::atomic<int> per_runner[3] = {0, 0, 0};
  std::atomic<bool> submitted{false};
  absl::StatusOr<GenerationResult> long_run;
  std::thread long_client;
  std::vector<absl::StatusOr<GenerationResult>> runs(3);
  std::vector<std::thread> threads;
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back([&, i] {
      runs[i] = engine.Generate(runner, [&](absl::Span<const int32_t> ids,
                                            std::string_view,
                                            const StepLogprobs&) {
        per_runner[i] += static_cast<int>(ids.size());
        if (per_runner[0] >= 10 && per_runner[1] >= 10 && per_runner[2] >= 10 &&
            !submitted.exchange(true)) {
          long_client =
              std::thread([&] { long_run = engine.Generate(longer, nullptr); });
        }
        return true;
      });
    });
  }
  for (std::thread& t : threads) t.join();
  if (long_client.joinable()) long_client.join();
  EXPECT_TRUE(long_run.ok()) << long_run.status();
  if (long_run.ok()) {
    EXPECT_EQ(long_run->output_ids, alone_long->output_ids);
  }
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(runs[i].ok()) << runs[i].status();
    if (runs[i].ok()) {
      EXPECT_EQ(runs[i]->output_ids, alone_runner->output_ids);
    }
  }
  return engine.stats();
}

// The step-time budget: while streams decode, a long prompt loads in more,
// smaller chunks than max_batch_tokens would give (without a budget it needs
// two), the steps it cut are counted, and every output is unchanged.
TEST(BatchEngineTest, PrefillStepBudgetLoadsALongPromptInSmallerChunks) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const BatchEngineStats unbudgeted = RunLongPromptBesideStreams(0);
  const BatchEngineStats budgeted = RunLongPromptBesideStreams(1.5);
  EXPECT_EQ(unbudgeted.budgeted_prefill_steps, 0);
  EXPECT_GT(budgeted.budgeted_prefill_steps, 0);
  // Three 4-token prompts (one chunk each) plus the 400-token prompt.
  EXPECT_LE(unbudgeted.prefill_chunks, 3 + 2);
  EXPECT_GT(budgeted.prefill_chunks, unbudgeted.prefill_chunks);
}

TEST(BatchEngineTest, AdmissionWaitsForBlocksAndRefusesWhatCanNeverFit) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  // 6 blocks of 16: two sequences of up to 48 positions at a time.
  std::unique_ptr<KvPool> pool = Pool(*model, 6);
  BatchEngine engine(*model, *StoriesTokenizer(), *pool, nullptr,
                     PlanningShared(), BatchEngineOptions());
  GenerationRequest r;
  r.prompt_ids = {1, 410, 469, 347};
  r.max_new_tokens = 40;
  r.ignore_eos = true;
  absl::Mutex mu;
  int active = 0;
  int most_active = 0;
  std::vector<absl::StatusOr<GenerationResult>> runs(5);
  std::vector<std::thread> threads;
  for (int i = 0; i < 5; ++i) {
    threads.emplace_back([&, i] {
      size_t seen = 0;
      // Callbacks run on the step thread in step order, so a sequence's last
      // token is counted before any sequence admitted after it streams.
      runs[i] = engine.Generate(r, [&](absl::Span<const int32_t> ids,
                                       std::string_view, const StepLogprobs&) {
        absl::MutexLock lock(&mu);
        if (seen == 0) most_active = std::max(most_active, ++active);
        seen += ids.size();
        if (seen == 40) --active;
        return true;
      });
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(runs[i].ok()) << runs[i].status();
    EXPECT_EQ(runs[i]->output_ids.size(), 40u);
  }
  EXPECT_LE(most_active, 2);
  // 97 positions need 7 blocks: more than the pool has, ever.
  GenerationRequest huge = r;
  huge.max_new_tokens = 93;
  auto refused = engine.Generate(huge, nullptr);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("kv-cache-memory"),
            std::string::npos)
      << refused.status();
  EXPECT_EQ(engine.stats().refused_never_fit, 1);
  EXPECT_EQ(pool->reserved_blocks(), 0);
}

// n = 4 choices of one request: the first prefills the prompt, the other
// three share its full blocks (the pool holds them once: table entries minus
// blocks in use is 3 x the prompt's full blocks while they decode) and each
// samples with its own seed stream, so choice i's text equals a single
// request seeded with ChoiceSeed(seed, i), speculation included.
TEST(BatchEngineTest, ChoicesShareThePromptsBlocksAndSampleTheirOwnStreams) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  std::unique_ptr<KvPool> pool = Pool(*model, 64);
  BatchEngineOptions options;
  options.max_running = 6;
  BatchEngine engine(*model, *StoriesTokenizer(), *pool, nullptr,
                     PlanningShared(), options);
  GenerationRequest r = LongPrompt(100, 24);  // 6 full blocks + 4 rows
  r.ignore_eos = true;
  r.sampling.temperature = 1.0;
  r.sampling.seed = 7;
  r.speculation.mode = SpeculationMode::kStatic;
  r.speculation.skip = "m1,a3";
  r.speculation.max_draft = 3;
  r.logprobs = true;
  absl::Mutex mu;
  int64_t most_saved = 0;
  std::vector<std::vector<int32_t>> streamed(4);
  auto results = engine.GenerateChoices(r, 4, [&](int i) -> StreamCallback {
    return [&, i](absl::Span<const int32_t> ids, std::string_view,
                  const StepLogprobs&) {
      absl::MutexLock lock(&mu);
      streamed[i].insert(streamed[i].end(), ids.begin(), ids.end());
      most_saved = std::max(most_saved, pool->shared_saved_blocks());
      return true;
    };
  });
  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_EQ(results->size(), 4u);
  EXPECT_EQ(most_saved, 3 * 6);
  std::set<std::vector<int32_t>> distinct;
  for (int i = 0; i < 4; ++i) {
    const GenerationResult& choice = (*results)[i];
    EXPECT_EQ(choice.output_ids.size(), 24u);
    EXPECT_EQ(streamed[i], choice.output_ids) << "choice " << i;
    EXPECT_EQ(choice.output_logprobs.size(), 24u);
    GenerationRequest alone = r;
    alone.sampling.seed = ChoiceSeed(7, i);
    auto single = engine.Generate(alone, nullptr);
    ASSERT_TRUE(single.ok()) << single.status();
    EXPECT_EQ(choice.output_ids, single->output_ids) << "choice " << i;
    EXPECT_EQ(choice.output_logprobs, single->output_logprobs);
    distinct.insert(choice.output_ids);
  }
  EXPECT_EQ(distinct.size(), 4u) << "every choice draws its own stream";
  EXPECT_EQ(ChoiceSeed(7, 0), 7u) << "n = 1 keeps its text";
  EXPECT_EQ(pool->used_blocks(), 0);
  EXPECT_EQ(pool->reserved_blocks(), 0);
  EXPECT_EQ(engine.running(), 0);

  // n is bounded by max_running; a group that could never fit is refused
  // as a whole; a stopped group gives every block back.
  EXPECT_EQ(engine.GenerateChoices(r, 7, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine.GenerateChoices(r, 0, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  GenerationRequest big = LongPrompt(100, 900);
  EXPECT_EQ(engine.GenerateChoices(big, 6, nullptr).status().code(),
            absl::StatusCode::kResourceExhausted);
  std::atomic<int> polls{0};
  auto stopped = engine.GenerateChoices(r, 3, nullptr,
                                        [&] { return polls.fetch_add(1) > 8; });
  ASSERT_TRUE(stopped.ok()) << stopped.status();
  for (const GenerationResult& choice : *stopped) {
    EXPECT_EQ(choice.finish_reason, FinishReason::kAborted);
  }
  EXPECT_EQ(pool->used_blocks(), 0);
  EXPECT_EQ(pool->reserved_blocks(), 0);
}

// Keeps every plan request it gets (never answers) until DropAll.
class KeepingPlanner : public PlannerClient {
 public:
  void Submit(PlanRequest request, PlanCallback done) override {
    absl::MutexLock lock(&mu_);
    kept_.push_back(std::move(request));
    dones_.push_back(std::move(done));
  }
  void Forget(uint64_t) override {}
  std::vector<PlanRequest> Kept() {
    absl::MutexLock lock(&mu_);
    return kept_;
  }
  void DropAll() {
    absl::MutexLock lock(&mu_);
    kept_.clear();
    dones_.clear();
  }

 private:
  absl::Mutex mu_;
  std::vector<PlanRequest> kept_ ABSL_GUARDED_BY(mu_);
  std::vector<PlanCallback> dones_ ABSL_GUARDED_BY(mu_);
};

// Plan snapshots of sequences in the paged pool hold their blocks by
// reference: the step thread copies no K/V (the planner copies it out,
// Contiguous(), on its own thread), the blocks stay counted in the pool's
// memory (used and reserved) while a planner holds a snapshot, also after
// its sequence ended, and they come back when it drops them. Many
// long-prompt knapspec requests at once stay inside the pool.
TEST(BatchEngineTest, PlanSnapshotsHoldTheirBlocksInsideThePool) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  std::unique_ptr<KvPool> pool = Pool(*model, 160);
  KeepingPlanner planner;
  BatchEngineOptions options;
  options.max_running = 6;
  BatchEngine engine(*model, *StoriesTokenizer(), *pool, &planner,
                     PlanningShared(), options);
  std::vector<GenerationRequest> requests;
  for (int i = 0; i < 6; ++i) {
    // Each in a context bucket of its own, so each asks for its own plan
    // (sequences of one bucket share a solve).
    GenerationRequest r = LongPrompt(180 + 40 * i, 24);
    r.ignore_eos = true;
    r.speculation.plan_bucket_tokens = 32;
    r.speculation.mode = SpeculationMode::kKnapSpec;
    r.speculation.max_draft = 3;
    r.speculation.skip = "a2,m2";
    r.speculation.reference_steps = 3;
    r.speculation.plan_interval = 8;
    r.speculation.planner_budget = 0;
    r.speculation.guard = false;
    // The planner prices the drafts' confidence stop of the request.
    r.speculation.exit_threshold = 0.625;
    requests.push_back(std::move(r));
  }
  for (const auto& result : RunConcurrently(engine, requests)) {
    ASSERT_TRUE(result.ok()) << result.status();
  }
  std::vector<PlanRequest> kept = planner.Kept();  // copies hold them too
  ASSERT_GE(kept.size(), 6u);
  int64_t snapshot_blocks = 0;
  for (const PlanRequest& request : kept) {
    EXPECT_TRUE(request.kv.empty()) << "no copy on the step thread";
    EXPECT_EQ(request.exit_threshold, 0.625);
    ASSERT_NE(request.kv_snapshot, nullptr);
    EXPECT_GT(request.kv_length, 180);
    snapshot_blocks =
        std::max(snapshot_blocks, pool->BlocksFor(request.kv_length));
  }
  // Every sequence ended; its snapshots still hold prompt blocks, counted.
  EXPECT_GE(pool->used_blocks(), snapshot_blocks);
  EXPECT_EQ(pool->reserved_blocks(), pool->used_blocks());
  EXPECT_LE(pool->used_blocks(), pool->total_blocks());
  // The planner's copy is the K/V a contiguous run of the same request
  // hands its planner (batch-invariant passes: bit for bit).
  KeepingPlanner contiguous;
  auto alone = Generate(*model, *StoriesTokenizer(), requests[0], nullptr,
                        nullptr, &contiguous, nullptr);
  ASSERT_TRUE(alone.ok()) << alone.status();
  const std::vector<PlanRequest> reference = contiguous.Kept();
  ASSERT_FALSE(reference.empty());
  const PlanRequest& want = reference.front();
  ASSERT_FALSE(want.kv.empty());
  bool compared = false;
  for (const PlanRequest& got : kept) {
    if (got.kv_length != want.kv_length ||
        got.first_position != want.first_position) {
      continue;
    }
    const std::vector<LayerKv> copied = ResolvedKv(got);
    ASSERT_EQ(copied.size(), static_cast<size_t>(model->num_layers()));
    for (size_t l = 0; l < copied.size(); ++l) {
      EXPECT_TRUE(
          torch::equal(copied[l].k, want.kv[l].k.narrow(1, 0, want.kv_length)));
      EXPECT_TRUE(
          torch::equal(copied[l].v, want.kv[l].v.narrow(1, 0, want.kv_length)));
    }
    compared = true;
    break;
  }
  EXPECT_TRUE(compared) << "the same request's snapshot";
  planner.DropAll();
  EXPECT_GT(pool->used_blocks(), 0) << "this test's copies still hold them";
  kept.clear();
  EXPECT_EQ(pool->used_blocks(), 0);
  EXPECT_EQ(pool->reserved_blocks(), 0);
}

// Stops (as cancellation, deadlines and Abort do), stops while still waiting
// for blocks, and errors thrown inside one sequence's step: every block comes
// back, and the others finish with their own output.
TEST(BatchEngineTest, NoBlockLeaksAfterStopsAndErrors) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  std::unique_ptr<KvPool> pool = Pool(*model, 12);
  BatchEngine engine(*model, *StoriesTokenizer(), *pool, nullptr,
                     PlanningShared(), BatchEngineOptions());
  GenerationRequest r;
  r.prompt_ids = {1, 410, 469, 347};
  r.max_new_tokens = 60;
  r.ignore_eos = true;
  auto alone = Generate(*model, *StoriesTokenizer(), r);
  ASSERT_TRUE(alone.ok());
  std::vector<absl::StatusOr<GenerationResult>> runs(24);
  std::vector<std::thread> threads;
  for (int i = 0; i < 24; ++i) {
    threads.emplace_back([&, i] {
      GenerationRequest mine = r;
      std::atomic<int> seen{0};
      std::function<bool()> stop;
      switch (i % 4) {
        case 0:  // stopped after a few tokens (cancel, deadline, Abort)
          stop = [&seen, i] { return seen > i % 7; };
          break;
        case 1:  // an exception inside this sequence's step
          mine.before_step_for_tests = [i](int64_t step) {
            if (step == i % 5) throw std::runtime_error("injected");
          };
          break;
        case 2:  // stopped at once, possibly still waiting for blocks
          stop = [] { return true; };
          break;
        default:
          break;
      }
      runs[i] = engine.Generate(
          mine,
          [&seen](absl::Span<const int32_t> ids, std::string_view,
                  const StepLogprobs&) {
            seen += static_cast<int>(ids.size());
            return true;
          },
          nullptr, stop);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < 24; ++i) {
    switch (i % 4) {
      case 0:
      case 2:
        ASSERT_TRUE(runs[i].ok()) << runs[i].status();
        EXPECT_EQ(runs[i]->finish_reason, FinishReason::kAborted) << i;
        break;
      case 1:
        EXPECT_EQ(runs[i].status().code(), absl::StatusCode::kInternal) << i;
        EXPECT_NE(runs[i].status().message().find("injected"),
                  std::string::npos);
        break;
      default:
        ASSERT_TRUE(runs[i].ok()) << runs[i].status();
        EXPECT_EQ(runs[i]->output_ids, alone->output_ids) << i;
    }
  }
  EXPECT_EQ(pool->used_blocks(), 0);
  EXPECT_EQ(pool->reserved_blocks(), 0);
  EXPECT_EQ(pool->sequences(), 0);
  EXPECT_EQ(engine.running(), 0);
  EXPECT_EQ(engine.waiting(), 0);
}

// Above plain_batch_size decoding sequences, steps run without drafts; the
// output is the same either way.
TEST(BatchEngineTest, PlainBatchSizeSwitchesSpeculationOff) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  std::unique_ptr<KvPool> pool = Pool(*model, 100);
  BatchEngineOptions options;
  options.plain_batch_size = 2;
  BatchEngine engine(*model, *StoriesTokenizer(), *pool, nullptr,
                     PlanningShared(), options);
  std::vector<GenerationRequest> requests = MixedRequests(*model, 6);
  for (GenerationRequest& r : requests) {
    r.speculation.mode = SpeculationMode::kStatic;
    r.speculation.skip = "m1";
    r.speculation.max_draft = 3;
  }
  std::vector<absl::StatusOr<GenerationResult>> runs =
      RunConcurrently(engine, requests);
  int64_t plain_steps = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(runs[i].ok()) << runs[i].status();
    plain_steps += runs[i]->stats.steps - runs[i]->speculation.drafts;
    GenerationRequest off = requests[i];
    off.speculation = SpeculationConfig();
    auto alone = Generate(*model, *StoriesTokenizer(), off);
    ASSERT_TRUE(alone.ok());
    EXPECT_EQ(runs[i]->output_ids, alone->output_ids) << i;
  }
  // Without the switch only a last step (one token left) drafts nothing.
  EXPECT_GT(plain_steps, static_cast<int64_t>(requests.size()));
}

// With the profile's cost model, a batch of speculating sequences drops its
// drafts on steps where they would not pay (here: a hand profile where every
// extra verified row costs 2% of a step), and the output is unchanged; a
// lone sequence keeps drafting.
TEST(BatchEngineTest, TheCostModelDropsDraftsThatDoNotPayInTheBatch) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  std::unique_ptr<KvPool> pool = Pool(*model, 200);
  const ProfileBatchCost cost(testing::HandLatencyProfile(*model),
                              model->num_layers());
  BatchEngineOptions options;
  options.cost_model = &cost;
  BatchEngine engine(*model, *StoriesTokenizer(), *pool, nullptr,
                     PlanningShared(), options);
  std::vector<GenerationRequest> requests = MixedRequests(*model, 8);
  for (GenerationRequest& r : requests) {
    r.speculation.mode = SpeculationMode::kStatic;
    r.speculation.skip = "a0,m0,a1,m1,a2,m2,a3";
    r.speculation.max_draft = 4;
  }
  std::vector<absl::StatusOr<GenerationResult>> runs =
      RunConcurrently(engine, requests);
  EXPECT_GT(engine.stats().plain_steps, 0);
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(runs[i].ok()) << runs[i].status();
    GenerationRequest off = requests[i];
    off.speculation = SpeculationConfig();
    auto alone = Generate(*model, *StoriesTokenizer(), off);
    ASSERT_TRUE(alone.ok());
    EXPECT_EQ(runs[i]->output_ids, alone->output_ids) << i;
  }
  const int64_t plain_before = engine.stats().plain_steps;
  auto lone = engine.Generate(requests[0], nullptr);
  ASSERT_TRUE(lone.ok());
  EXPECT_GT(lone->speculation.drafts, 0);
  EXPECT_EQ(engine.stats().plain_steps, plain_before);
}

}  // namespace
}  // namespace knapserve
