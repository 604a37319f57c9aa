// Tests of LlamaModel::ForwardBatch (common/model/llama.h): a sequence's
// logits, K/V and boundary states are bit-identical whichever sequences
// share its passes and however its tokens are split into passes, with paged
// K/V against a contiguous cache fed one token at a time; per-sequence masks
// in one pass; bad inputs are refused.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "common/model/layer_mask.h"
#include "common/model/llama.h"
#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

using testing::CachedModel;

// One sequence's tokens and, optionally, a draft mask it runs under.
struct Stream {
  std::vector<int32_t> tokens;
  LayerMask mask;
  bool masked = false;
};

std::vector<Stream> MakeStreams(const LlamaModel& model, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> id(3, model.config().vocab_size - 1);
  const std::vector<int> lengths = {41, 7, 66, 23, 1};
  std::vector<Stream> streams;
  for (size_t s = 0; s < lengths.size(); ++s) {
    Stream stream;
    stream.tokens.push_back(1);
    for (int i = 1; i < lengths[s]; ++i) stream.tokens.push_back(id(rng));
    stream.mask = LayerMask(model.num_layers());
    if (s == 1 || s == 3) {
      // Drafts: skip some attention and MLP sublayers.
      stream.masked = true;
      for (int l = 0; l < model.num_layers(); l += 2)
        stream.mask.set_skipped(2 * l + (s == 1 ? 0 : 1), true);
    }
    streams.push_back(std::move(stream));
  }
  return streams;
}

// Each stream alone, one token per pass, contiguous K/V: logits of every
// position [n, vocab].
torch::Tensor ReferenceLogits(const LlamaModel& model, const Stream& stream) {
  std::vector<LayerKv> kv =
      model.AllocateKv(static_cast<int64_t>(stream.tokens.size()));
  std::vector<torch::Tensor> rows;
  for (size_t p = 0; p < stream.tokens.size(); ++p) {
    BatchSequence seq;
    seq.tokens = absl::MakeConstSpan(&stream.tokens[p], 1);
    seq.start_pos = static_cast<int64_t>(p);
    seq.kv = &kv;
    seq.skip = stream.masked ? &stream.mask : nullptr;
    rows.push_back(model.ForwardBatch({seq})[0]);
  }
  return torch::cat(rows, 0);
}

void ExpectBatchInvariant(const std::string& model_name, uint64_t seed) {
  const LlamaModel* model = CachedModel(model_name);
  ASSERT_NE(model, nullptr);
  const std::vector<Stream> streams = MakeStreams(*model, seed);
  std::vector<torch::Tensor> reference;
  for (const Stream& s : streams)
    reference.push_back(ReferenceLogits(*model, s));

  // All streams in one paged pool, block tables deliberately interleaved
  // (stream s gets blocks s, s + n, s + 2n, ...).
  const int64_t rows = 16;
  const int64_t n = static_cast<int64_t>(streams.size());
  const PagedKvStorage pool = model->AllocatePagedKv(n * 6, rows);
  std::vector<std::vector<int32_t>> tables(n);
  for (int64_t s = 0; s < n; ++s)
    for (int64_t b = 0; b < 6; ++b)
      tables[s].push_back(static_cast<int32_t>(b * n + s));

  // Passes of random composition: each stream still going joins with
  // probability 2/3, with a random chunk of 1..20 tokens.
  std::mt19937_64 rng(seed + 1);
  std::vector<size_t> fed(n, 0);
  std::vector<std::vector<torch::Tensor>> got(n);
  for (int pass = 0; pass < 1000; ++pass) {
    std::vector<BatchSequence> batch;
    std::vector<int64_t> who;
    for (int64_t s = 0; s < n; ++s) {
      const size_t left = streams[s].tokens.size() - fed[s];
      if (left == 0 || rng() % 3 == 0) continue;
      const size_t chunk = std::min<size_t>(left, 1 + rng() % 20);
      BatchSequence seq;
      seq.tokens =
          absl::MakeConstSpan(streams[s].tokens.data() + fed[s], chunk);
      seq.start_pos = static_cast<int64_t>(fed[s]);
      seq.paged = &pool;
      seq.blocks = tables[s];
      seq.skip = streams[s].masked ? &streams[s].mask : nullptr;
      seq.num_logits = -1;
      batch.push_back(seq);
      who.push_back(s);
    }
    if (batch.empty()) {
      bool all_done = true;
      for (int64_t s = 0; s < n; ++s)
        all_done = all_done && fed[s] == streams[s].tokens.size();
      if (all_done) break;
      continue;
    }
    std::vector<torch::Tensor> logits = model->ForwardBatch(batch);
    for (size_t i = 0; i < who.size(); ++i) {
      got[who[i]].push_back(logits[i]);
      fed[who[i]] += batch[i].tokens.size();
    }
  }
  for (int64_t s = 0; s < n; ++s) {
    ASSERT_EQ(fed[s], streams[s].tokens.size()) << "stream " << s;
    const torch::Tensor batched = torch::cat(got[s], 0);
    EXPECT_TRUE(torch::equal(batched, reference[s]))
        << model_name << " stream " << s << ": max difference "
        << (batched - reference[s]).abs().max().item<float>();
  }
}

TEST(ForwardBatchTest, Stories260kRowsDoNotDependOnTheBatchFp32AndBf16) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  ExpectBatchInvariant("stories260k", 7);
  ExpectBatchInvariant("stories260k/bf16", 8);
}

TEST(ForwardBatchTest, Stories24lRowsDoNotDependOnTheBatchFp32AndBf16) {
  if (!testing::HaveSharedModel("stories-24l"))
    GTEST_SKIP() << testing::NeedsSharedMessage("models/stories-24l");
  ExpectBatchInvariant("stories-24l", 9);
  ExpectBatchInvariant("stories-24l/bf16", 10);
}

TEST(ForwardBatchTest, QkNormAndBiasShapesToo) {
  ExpectBatchInvariant("tiny-qwen3", 11);
  ExpectBatchInvariant("tiny-qwen2/bf16", 12);
}

// Boundary states of a sequence in a batch equal Forward's.
TEST(ForwardBatchTest, BoundaryStatesMatchForward) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  const std::vector<int32_t> tokens = {1, 410, 469, 347, 286};
  const std::vector<int32_t> other = {1, 22, 33};
  std::vector<LayerKv> kv_a = model->AllocateKv(8);
  std::vector<LayerKv> kv_b = model->AllocateKv(8);
  torch::Tensor states_forward;
  ForwardOptions options;
  options.boundary_states = &states_forward;
  const torch::Tensor logits_forward = model->Forward(
      torch::tensor(std::vector<int64_t>(tokens.begin(), tokens.end())), 0,
      kv_a, options);
  std::vector<LayerKv> kv_c = model->AllocateKv(8);
  torch::Tensor states_batch;
  BatchSequence a;
  a.tokens = tokens;
  a.kv = &kv_c;
  a.num_logits = -1;
  a.boundary_states = &states_batch;
  BatchSequence b;
  b.tokens = other;
  b.kv = &kv_b;
  std::vector<torch::Tensor> logits = model->ForwardBatch({b, a});
  ASSERT_EQ(states_batch.sizes(), states_forward.sizes());
  EXPECT_TRUE(torch::equal(states_batch, states_forward));
  // The batched pass applies the final norm row by row (row_ops), Forward
  // with LibTorch ops: the same arithmetic up to rounding.
  EXPECT_TRUE(torch::allclose(logits[1], logits_forward, 1e-4, 1e-4));
  EXPECT_EQ(logits[0].size(0), 1);  // num_logits defaults to the last row
}

TEST(ForwardBatchTest, RefusesBadInputs) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  const PagedKvStorage pool = model->AllocatePagedKv(2, 16);
  const std::vector<int32_t> tokens(20, 5);
  const std::vector<int32_t> one_block = {0};
  BatchSequence seq;
  seq.tokens = tokens;
  seq.paged = &pool;
  seq.blocks = one_block;  // 16 positions for 20 tokens
  EXPECT_THROW(model->ForwardBatch({seq}), c10::Error);
  const std::vector<int32_t> outside = {0, 7};
  seq.blocks = outside;
  EXPECT_THROW(model->ForwardBatch({seq}), c10::Error);
  BatchSequence none;
  none.tokens = tokens;
  EXPECT_THROW(model->ForwardBatch({none}), c10::Error);
  EXPECT_THROW(model->AllocatePagedKv(2, 20), c10::Error);
}

}  // namespace
}  // namespace knapserve
