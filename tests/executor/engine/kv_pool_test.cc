// Tests of the K/V pool (executor/engine/kv_pool.h): --kv-cache-memory parsing,
// reservations, block accounting, and the contiguous copy of a sequence's
// paged K/V.
#include "executor/engine/kv_pool.h"

#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

using testing::CachedModel;

TEST(ParseKvCacheMemoryTest, BytesUnitsAndFractions) {
  EXPECT_EQ(*ParseKvCacheMemory("1048576", 0), 1048576);
  EXPECT_EQ(*ParseKvCacheMemory("2KiB", 0), 2048);
  EXPECT_EQ(*ParseKvCacheMemory("2kb", 0), 2000);
  EXPECT_EQ(*ParseKvCacheMemory("1.5GiB", 0), int64_t{3} << 29);
  EXPECT_EQ(*ParseKvCacheMemory("512M", 0), 512000000);
  EXPECT_EQ(*ParseKvCacheMemory(" 0.25 ", 4000), 1000);
  for (const char* bad : {"", "abc", "-5", "0", "5X", "0.5", "1e30GB"}) {
    absl::StatusOr<int64_t> parsed =
        ParseKvCacheMemory(bad, bad == std::string("0.5") ? 0 : 4000);
    EXPECT_FALSE(parsed.ok()) << bad;
    if (!parsed.ok()) {
      EXPECT_NE(parsed.status().message().find("kv-cache-memory"),
                std::string::npos);
    }
  }
}

TEST(KvPoolTest, ReservationsTakeBlocksAsSequencesGrowAndGiveThemBack) {
  const LlamaModel* model = CachedModel("tiny-llama");
  ASSERT_NE(model, nullptr);
  const int64_t per_block = model->KvBytesPerBlock(16);
  auto pool = KvPool::Create(*model, KvPoolOptions{10 * per_block + 5, 16});
  ASSERT_TRUE(pool.ok()) << pool.status();
  KvPool& p = **pool;
  EXPECT_EQ(p.total_blocks(), 10);
  EXPECT_EQ(p.BlocksFor(33), 3);
  EXPECT_TRUE(p.CanEverFit(160));
  EXPECT_FALSE(p.CanEverFit(161));
  {
    std::optional<SequenceKv> a = p.TryReserve(100);  // 7 blocks
    ASSERT_TRUE(a.has_value());
    EXPECT_EQ(p.reserved_blocks(), 7);
    EXPECT_EQ(p.free_blocks(), 3);
    EXPECT_EQ(p.used_blocks(), 0);               // nothing taken until it grows
    EXPECT_FALSE(p.TryReserve(49).has_value());  // 4 blocks > 3 free
    std::optional<SequenceKv> b = p.TryReserve(48);
    ASSERT_TRUE(b.has_value());
    EXPECT_EQ(p.free_blocks(), 0);
    ASSERT_TRUE(a->EnsureCapacity(17).ok());
    EXPECT_EQ(a->blocks().size(), 2u);
    EXPECT_EQ(p.used_blocks(), 2);
    ASSERT_TRUE(a->EnsureCapacity(112).ok());
    EXPECT_EQ(p.used_blocks(), 7);
    const absl::Status past = a->EnsureCapacity(113);
    EXPECT_EQ(past.code(), absl::StatusCode::kFailedPrecondition) << past;
    // Moving keeps one owner.
    SequenceKv moved = std::move(*b);
    b.reset();
    EXPECT_EQ(p.sequences(), 2);
    EXPECT_EQ(p.reserved_blocks(), 10);
  }
  EXPECT_EQ(p.used_blocks(), 0);
  EXPECT_EQ(p.reserved_blocks(), 0);
  EXPECT_EQ(p.free_blocks(), 10);
  EXPECT_EQ(p.sequences(), 0);
}

// Prefix sharing (a request's n > 1 choices): the prompt's full blocks are
// held once by every sharer, the partial last block is copied, and the
// accounting stays right whichever sharer ends first.
TEST(KvPoolTest, SharedPrefixBlocksAreHeldOnceAndThePartialOneIsCopied) {
  const LlamaModel* model = CachedModel("tiny-llama");
  ASSERT_NE(model, nullptr);
  const int64_t per_block = model->KvBytesPerBlock(16);
  auto pool = KvPool::Create(*model, KvPoolOptions{20 * per_block, 16});
  ASSERT_TRUE(pool.ok()) << pool.status();
  KvPool& p = **pool;
  std::optional<SequenceKv> first = p.TryReserve(100);  // 7 blocks
  ASSERT_TRUE(first.has_value());
  ASSERT_TRUE(first->EnsureCapacity(40).ok());  // 2 full blocks + 8 rows
  // Mark every block of the prompt: block b holds b + 1 everywhere.
  for (size_t i = 0; i < first->blocks().size(); ++i) {
    for (const LayerKv& layer : p.storage().layers) {
      layer.k[first->blocks()[i]].fill_(static_cast<float>(i + 1));
      layer.v[first->blocks()[i]].fill_(static_cast<float>(-(i + 1)));
    }
  }
  // The other choice reserves without the 2 full blocks: 5.
  std::optional<SequenceKv> second = p.TryReserve(100, /*shared=*/40);
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(p.reserved_blocks(), 12);
  ASSERT_TRUE(second->SharePrefix(*first, 40).ok());
  ASSERT_EQ(second->blocks().size(), 3u);
  EXPECT_EQ(second->blocks()[0], first->blocks()[0]);
  EXPECT_EQ(second->blocks()[1], first->blocks()[1]);
  EXPECT_NE(second->blocks()[2], first->blocks()[2]);
  for (const LayerKv& layer : p.storage().layers) {
    EXPECT_TRUE(torch::equal(layer.k[second->blocks()[2]],
                             layer.k[first->blocks()[2]]));
    EXPECT_TRUE(torch::equal(layer.v[second->blocks()[2]],
                             layer.v[first->blocks()[2]]));
  }
  EXPECT_EQ(p.used_blocks(), 4);   // 2 shared + 2 partial copies
  EXPECT_EQ(p.table_blocks(), 6);  // 3 per table
  EXPECT_EQ(p.shared_saved_blocks(), 2);
  EXPECT_EQ(second->reserved_positions(), 7 * 16);
  ASSERT_TRUE(second->EnsureCapacity(112).ok());
  EXPECT_EQ(p.used_blocks(), 8);
  EXPECT_FALSE(second->EnsureCapacity(113).ok());
  // Sharing twice, or from positions the source does not hold, is refused.
  EXPECT_EQ(second->SharePrefix(*first, 40).code(),
            absl::StatusCode::kFailedPrecondition);
  std::optional<SequenceKv> third = p.TryReserve(100, 40);
  ASSERT_TRUE(third.has_value());
  EXPECT_EQ(third->SharePrefix(*first, 64).code(),
            absl::StatusCode::kFailedPrecondition);
  third.reset();
  // The first choice ends: the shared blocks stay with the second.
  first.reset();
  EXPECT_EQ(p.used_blocks(), 7);
  EXPECT_EQ(p.reserved_blocks(), 7);
  for (const LayerKv& layer : p.storage().layers) {
    EXPECT_EQ(layer.k[second->blocks()[0]].max().item<float>(), 1.0f);
    EXPECT_EQ(layer.k[second->blocks()[1]].max().item<float>(), 2.0f);
  }
  second.reset();
  EXPECT_EQ(p.used_blocks(), 0);
  EXPECT_EQ(p.table_blocks(), 0);
  EXPECT_EQ(p.reserved_blocks(), 0);
  EXPECT_EQ(p.sequences(), 0);
}

// A plan snapshot holds a sequence's blocks by reference: nothing copied,
// the blocks counted as used until it is dropped (also after the sequence
// ended), and its Contiguous() equals the sequence's own copy.
TEST(KvPoolTest, SnapshotsHoldBlocksByReferenceInsideThePool) {
  const LlamaModel* model = CachedModel("tiny-llama");
  ASSERT_NE(model, nullptr);
  const int64_t per_block = model->KvBytesPerBlock(16);
  auto pool = KvPool::Create(*model, KvPoolOptions{10 * per_block, 16});
  ASSERT_TRUE(pool.ok()) << pool.status();
  KvPool& p = **pool;
  std::optional<SequenceKv> seq = p.TryReserve(64);
  ASSERT_TRUE(seq.has_value());
  ASSERT_TRUE(seq->EnsureCapacity(40).ok());
  torch::manual_seed(5);
  for (const LayerKv& layer : p.storage().layers) {
    layer.k.normal_();
    layer.v.normal_();
  }
  const std::vector<LayerKv> copy = seq->ContiguousCopy(37);
  absl::StatusOr<std::shared_ptr<const KvSnapshot>> snapshot =
      seq->Snapshot(37);
  ASSERT_TRUE(snapshot.ok()) << snapshot.status();
  EXPECT_EQ(p.used_blocks(), 3) << "shared, not copied";
  EXPECT_EQ(p.table_blocks(), 3) << "a snapshot is not a table";
  EXPECT_EQ(p.shared_saved_blocks(), 0);
  EXPECT_EQ(p.reserved_blocks(), 4);
  EXPECT_FALSE(seq->Snapshot(49).ok()) << "past the table";
  seq.reset();  // the sequence ends; the snapshot keeps its blocks
  EXPECT_EQ(p.used_blocks(), 3);
  EXPECT_EQ(p.reserved_blocks(), 3);
  EXPECT_EQ(p.sequences(), 1);
  const std::vector<LayerKv> out = (*snapshot)->Contiguous();
  ASSERT_EQ(out.size(), copy.size());
  for (size_t l = 0; l < out.size(); ++l) {
    EXPECT_TRUE(torch::equal(out[l].k, copy[l].k)) << l;
    EXPECT_TRUE(torch::equal(out[l].v, copy[l].v)) << l;
  }
  snapshot->reset();
  EXPECT_EQ(p.used_blocks(), 0);
  EXPECT_EQ(p.reserved_blocks(), 0);
  EXPECT_EQ(p.sequences(), 0);
}

TEST(KvPoolTest, RefusesAPoolThatCannotHoldOneBlock) {
  const LlamaModel* model = CachedModel("tiny-llama");
  ASSERT_NE(model, nullptr);
  auto tiny = KvPool::Create(*model, KvPoolOptions{100, 16});
  EXPECT_EQ(tiny.status().code(), absl::StatusCode::kInvalidArgument);
  auto odd = KvPool::Create(*model, KvPoolOptions{1 << 24, 24});
  EXPECT_EQ(odd.status().code(), absl::StatusCode::kInvalidArgument);
}

// What a forward pass writes into a sequence's blocks comes back in order
// from ContiguousCopy, equal to a contiguous cache fed the same tokens.
TEST(KvPoolTest, ContiguousCopyEqualsAContiguousCache) {
  const LlamaModel* model = CachedModel("tiny-llama");
  ASSERT_NE(model, nullptr);
  auto pool =
      KvPool::Create(*model, KvPoolOptions{8 * model->KvBytesPerBlock(16), 16});
  ASSERT_TRUE(pool.ok()) << pool.status();
  // Take a block first so the sequence's table does not start at 0.
  std::optional<SequenceKv> other = (*pool)->TryReserve(16);
  ASSERT_TRUE(other->EnsureCapacity(16).ok());
  std::optional<SequenceKv> seq = (*pool)->TryReserve(40);
  ASSERT_TRUE(seq->EnsureCapacity(37).ok());
  std::vector<int32_t> tokens;
  for (int i = 0; i < 37; ++i) tokens.push_back(1 + (i * 7) % 250);
  BatchSequence paged;
  paged.tokens = tokens;
  paged.paged = &(*pool)->storage();
  paged.blocks = seq->blocks();
  model->ForwardBatch({paged});
  std::vector<LayerKv> contiguous = model->AllocateKv(37);
  BatchSequence plain;
  plain.tokens = tokens;
  plain.kv = &contiguous;
  model->ForwardBatch({plain});
  std::vector<LayerKv> copy = seq->ContiguousCopy(37);
  ASSERT_EQ(copy.size(), contiguous.size());
  for (size_t l = 0; l < copy.size(); ++l) {
    EXPECT_TRUE(torch::equal(copy[l].k, contiguous[l].k)) << l;
    EXPECT_TRUE(torch::equal(copy[l].v, contiguous[l].v)) << l;
  }
}

}  // namespace
}  // namespace knapserve
