// Tests of ForwardBatch's partial passes (BatchSequence::first_layer,
// last_layer, input_states, output_states; common/model/llama.h): running
// layers [0, a) and then [a, L) from the first half's output states gives
// bit-identically the logits and K/V of one full pass (fp32 CPU row path),
// for every split, for chunks of rows split at different layers, beside
// other sequences in the same pass; bad layer ranges are refused.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "common/model/llama.h"
#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

using testing::CachedModel;

std::vector<int32_t> RandomTokens(const LlamaModel& model, int n,
                                  uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> id(3, model.config().vocab_size - 1);
  std::vector<int32_t> tokens = {1};
  for (int i = 1; i < n; ++i) tokens.push_back(id(rng));
  return tokens;
}

// K/V positions [0, n) of every layer, equal bit for bit.
void ExpectKvEqual(const std::vector<LayerKv>& a, const std::vector<LayerKv>& b,
                   int64_t n, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t l = 0; l < a.size(); ++l) {
    EXPECT_TRUE(torch::equal(a[l].k.narrow(1, 0, n), b[l].k.narrow(1, 0, n)))
        << what << ": K of layer " << l;
    EXPECT_TRUE(torch::equal(a[l].v.narrow(1, 0, n), b[l].v.narrow(1, 0, n)))
        << what << ": V of layer " << l;
  }
}

// The prompt's first `prefix` tokens fully, then the rest in chunks: chunk c
// runs [0, split_c) and then [split_c, L), each chunk before the next. The
// logits of the chunk rows and all K/V equal one full pass over everything.
void ExpectSplitsEqualFull(const std::string& name, uint64_t seed) {
  const LlamaModel* model = CachedModel(name);
  ASSERT_NE(model, nullptr);
  const int layers = model->num_layers();
  const std::vector<int32_t> tokens = RandomTokens(*model, 23, seed);
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t prefix = 9;

  std::vector<LayerKv> full_kv = model->AllocateKv(n);
  BatchSequence full;
  full.tokens = tokens;
  full.kv = &full_kv;
  full.num_logits = -1;
  const torch::Tensor full_logits = model->ForwardBatch({full})[0];

  // Every split point, one chunk of all remaining rows.
  for (int a = 0; a <= layers; ++a) {
    std::vector<LayerKv> kv = model->AllocateKv(n);
    BatchSequence head;
    head.tokens = absl::MakeConstSpan(tokens.data(), prefix);
    head.kv = &kv;
    head.num_logits = 0;
    model->ForwardBatch({head});
    torch::Tensor mid;
    BatchSequence lower;
    lower.tokens = absl::MakeConstSpan(tokens.data() + prefix, n - prefix);
    lower.start_pos = prefix;
    lower.kv = &kv;
    lower.last_layer = a;
    lower.num_logits = 0;
    lower.output_states = &mid;
    model->ForwardBatch({lower});
    ASSERT_EQ(mid.size(0), n - prefix);
    BatchSequence upper;
    upper.input_states = mid;
    upper.first_layer = a;
    upper.start_pos = prefix;
    upper.kv = &kv;
    upper.num_logits = -1;
    const torch::Tensor logits = model->ForwardBatch({upper})[0];
    EXPECT_TRUE(torch::equal(logits, full_logits.narrow(0, prefix, n - prefix)))
        << name << " split at layer " << a;
    ExpectKvEqual(kv, full_kv, n,
                  name + " split at layer " + std::to_string(a));
  }

  // Chunks of 1..4 rows, each split at its own layer (some at 0 and L), and
  // the upper half of each chunk in two pieces [a, b) and [b, L); another
  // sequence shares every pass.
  std::mt19937_64 rng(seed + 1);
  std::vector<LayerKv> kv = model->AllocateKv(n);
  std::vector<LayerKv> other_kv = model->AllocateKv(n);
  const std::vector<int32_t> other = RandomTokens(*model, 4, seed + 2);
  std::vector<torch::Tensor> got;
  int64_t at = 0;
  int pass = 0;
  while (at < n) {
    const int64_t rows = std::min<int64_t>(n - at, 1 + rng() % 4);
    const int a = static_cast<int>(rng() % (layers + 1));
    const int b = a + static_cast<int>(rng() % (layers - a + 1));
    BatchSequence bystander;
    bystander.tokens = absl::MakeConstSpan(other.data(), 1);
    bystander.start_pos = pass++ % n;
    bystander.kv = &other_kv;
    torch::Tensor states;
    BatchSequence first;
    first.tokens = absl::MakeConstSpan(tokens.data() + at, rows);
    first.start_pos = at;
    first.kv = &kv;
    first.last_layer = a;
    first.num_logits = 0;
    first.output_states = &states;
    model->ForwardBatch({bystander, first});
    BatchSequence second;
    second.input_states = states;
    second.first_layer = a;
    second.last_layer = b;
    second.start_pos = at;
    second.kv = &kv;
    second.num_logits = 0;
    second.output_states = &states;
    model->ForwardBatch({second, bystander});
    BatchSequence third;
    third.input_states = states;
    third.first_layer = b;
    third.start_pos = at;
    third.kv = &kv;
    third.num_logits = -1;
    got.push_back(model->ForwardBatch({bystander, third})[1]);
    at += rows;
  }
  EXPECT_TRUE(torch::equal(torch::cat(got, 0), full_logits))
      << name << " chunked splits";
  ExpectKvEqual(kv, full_kv, n, name + " chunked splits");
}

TEST(ForwardFromTest, Stories260kSplitsEqualOneFullPass) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  ExpectSplitsEqualFull("stories260k", 3);
}

TEST(ForwardFromTest, Stories24lSplitsEqualOneFullPass) {
  KNAPSERVE_SKIP_WITHOUT_SHARED_MODEL("stories-24l");
  ExpectSplitsEqualFull("stories-24l", 4);
}

// The logits of a pass that stops after layer a are the final norm and LM
// head of the hidden state there (the training-free exit head).
TEST(ForwardFromTest, LogitsOfAPartialPassAreTheHeadOfItsLastState) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  const std::vector<int32_t> tokens = RandomTokens(*model, 6, 5);
  std::vector<LayerKv> kv = model->AllocateKv(6);
  torch::Tensor states;
  BatchSequence seq;
  seq.tokens = tokens;
  seq.kv = &kv;
  seq.last_layer = 2;
  seq.num_logits = -1;
  seq.output_states = &states;
  const torch::Tensor logits = model->ForwardBatch({seq})[0];
  // Bit for bit: a few rows take the same row-wise head in Logits().
  EXPECT_TRUE(torch::equal(logits, model->Logits(states)));
  // An empty range runs no layer: the same logits from the same states.
  BatchSequence none;
  none.input_states = states;
  none.first_layer = 2;
  none.last_layer = 2;
  none.kv = &kv;
  none.num_logits = -1;
  EXPECT_TRUE(torch::equal(model->ForwardBatch({none})[0], logits));
}

// An exit inside the pass (after_layer / stop / reached_layer): a sequence
// told to stop after layer e ends exactly as a pass with last_layer = e + 1
// (states, K/V, logits bit for bit); a second sequence sharing its flag
// stops after the same layer if it joined below it and runs nothing if it
// would join above it; a bystander is untouched.
TEST(ForwardFromTest, AnExitInsideThePassEqualsAPassThatEndsThere) {
  KNAPSERVE_SKIP_WITHOUT_SHARED_MODEL("stories-24l");
  const LlamaModel* model = CachedModel("stories-24l");
  ASSERT_NE(model, nullptr);
  const int layers = model->num_layers();
  const std::vector<int32_t> prompt = RandomTokens(*model, 9, 21);
  const std::vector<int32_t> other = RandomTokens(*model, 7, 22);
  const int exit_after = 9;  // layer index: depth 10
  for (const int join : {4, 15}) {
    // Reference: the prompt fully; row 9 (a lagging row at depth `join`);
    // row 10 from 0 to the exit depth, then row 9 on to the same depth when
    // it lagged below it.
    std::vector<LayerKv> kv_ref = model->AllocateKv(16);
    std::vector<LayerKv> kv = model->AllocateKv(16);
    torch::Tensor lag_states;
    for (std::vector<LayerKv>* store : {&kv_ref, &kv}) {
      BatchSequence head;
      head.tokens = prompt;
      head.kv = store;
      head.num_logits = 0;
      model->ForwardBatch({head});
      BatchSequence lag;
      lag.tokens = absl::MakeConstSpan(&other[0], 1);
      lag.start_pos = 9;
      lag.kv = store;
      lag.last_layer = join;
      lag.num_logits = 0;
      lag.output_states = &lag_states;
      model->ForwardBatch({lag});
    }
    const int depth = exit_after + 1;
    // The lagging row from its depth, and the newest row from layer 0.
    auto lagging = [&](std::vector<LayerKv>* store, torch::Tensor* out) {
      BatchSequence seq;
      seq.input_states = lag_states;
      seq.first_layer = join;
      seq.start_pos = 9;
      seq.kv = store;
      seq.num_logits = 0;
      seq.output_states = out;
      return seq;
    };
    auto fresh = [&](std::vector<LayerKv>* store, torch::Tensor* out) {
      BatchSequence seq;
      seq.tokens = absl::MakeConstSpan(&other[1], 1);
      seq.start_pos = 10;
      seq.kv = store;
      seq.num_logits = 1;
      seq.output_states = out;
      return seq;
    };
    torch::Tensor ref_lag = lag_states, ref_new;
    std::vector<BatchSequence> ref;
    if (join < depth) {
      ref.push_back(lagging(&kv_ref, &ref_lag));
      ref.back().last_layer = depth;
    }
    ref.push_back(fresh(&kv_ref, &ref_new));
    ref.back().last_layer = depth;
    const torch::Tensor ref_logits = model->ForwardBatch(ref).back();

    // The same as one pass to L with the exit found inside it, beside a
    // bystander.
    bool stop = false;
    int reached_lag = -1, reached_new = -1;
    std::vector<int> seen;
    torch::Tensor out_lag, out_new;
    BatchSequence lag = lagging(&kv, &out_lag);
    lag.stop = &stop;
    lag.reached_layer = &reached_lag;
    BatchSequence newest = fresh(&kv, &out_new);
    newest.stop = &stop;
    newest.reached_layer = &reached_new;
    newest.after_layer = [&](int layer, const torch::Tensor& state) {
      seen.push_back(layer);
      EXPECT_EQ(state.size(0), 1);
      if (layer == exit_after) stop = true;
    };
    std::vector<LayerKv> kv_by = model->AllocateKv(8);
    std::vector<LayerKv> kv_by_alone = model->AllocateKv(8);
    BatchSequence bystander;
    bystander.tokens = absl::MakeConstSpan(other.data(), 6);
    bystander.kv = &kv_by;
    bystander.num_logits = -1;
    const std::vector<torch::Tensor> out =
        model->ForwardBatch({lag, newest, bystander});
    std::vector<int> expected_seen;
    for (int l = 0; l <= exit_after; ++l) expected_seen.push_back(l);
    EXPECT_EQ(seen, expected_seen) << "join " << join;
    EXPECT_EQ(reached_new, depth);
    EXPECT_EQ(reached_lag, join < depth ? depth : join) << "join " << join;
    EXPECT_TRUE(torch::equal(out_new, ref_new)) << "join " << join;
    EXPECT_TRUE(torch::equal(out[1], ref_logits)) << "join " << join;
    if (join < depth) {
      EXPECT_TRUE(torch::equal(out_lag, ref_lag)) << "join " << join;
    }
    ExpectKvEqual(kv, kv_ref, 11, "exit inside the pass");
    // Nothing above the exit was written.
    for (int l = depth; l < layers; ++l) {
      EXPECT_TRUE(torch::equal(kv[l].k.narrow(1, 10, 1),
                               torch::zeros_like(kv[l].k.narrow(1, 10, 1))))
          << "layer " << l;
    }
    BatchSequence alone = bystander;
    alone.kv = &kv_by_alone;
    EXPECT_TRUE(torch::equal(out[2], model->ForwardBatch({alone})[0]));
  }
}

TEST(ForwardFromTest, RefusesBadLayerRangesAndStates) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  const int layers = model->num_layers();
  std::vector<LayerKv> kv = model->AllocateKv(8);
  const std::vector<int32_t> tokens = {1, 5, 6};
  const torch::Tensor states =
      torch::zeros({3, model->config().hidden_size}, torch::kFloat32);
  auto run = [&](BatchSequence seq) {
    seq.kv = &kv;
    model->ForwardBatch({seq});
  };
  BatchSequence seq;
  seq.input_states = states;
  seq.first_layer = 3;
  seq.last_layer = 2;  // first > last
  EXPECT_THROW(run(seq), c10::Error);
  seq.first_layer = 0;
  seq.last_layer = layers + 1;  // past L
  EXPECT_THROW(run(seq), c10::Error);
  seq.first_layer = -1;
  seq.last_layer = -1;
  EXPECT_THROW(run(seq), c10::Error);
  BatchSequence from_tokens;
  from_tokens.tokens = tokens;
  from_tokens.first_layer = 1;  // a later layer needs input states
  EXPECT_THROW(run(from_tokens), c10::Error);
  BatchSequence both;
  both.tokens = tokens;
  both.input_states = states;
  EXPECT_THROW(run(both), c10::Error);
  BatchSequence wrong_width;
  wrong_width.input_states = torch::zeros({3, 7}, torch::kFloat32);
  wrong_width.first_layer = 1;
  EXPECT_THROW(run(wrong_width), c10::Error);
  BatchSequence wrong_dtype;
  wrong_dtype.input_states = states.to(torch::kFloat64);
  wrong_dtype.first_layer = 1;
  EXPECT_THROW(run(wrong_dtype), c10::Error);
  torch::Tensor boundary;
  BatchSequence capture;
  capture.tokens = tokens;
  capture.last_layer = 2;
  capture.boundary_states = &boundary;  // not with a partial pass
  EXPECT_THROW(run(capture), c10::Error);
  // A valid partial pass works.
  BatchSequence ok;
  ok.input_states = states;
  ok.first_layer = 1;
  ok.last_layer = 3;
  EXPECT_NO_THROW(run(ok));
}

}  // namespace
}  // namespace knapserve
