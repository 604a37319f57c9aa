#include "executor/engine/kv_cache.h"

#include <gtest/gtest.h>

#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

TEST(KvCacheTest, PreallocatesAndMovesLengthWithoutCopying) {
  auto model =
      LlamaModel::Load(testing::RandomModelDir("tiny-llama"), ModelOptions());
  ASSERT_TRUE(model.ok()) << model.status();
  KvCache cache(**model, 32);
  EXPECT_EQ(cache.capacity(), 32);
  EXPECT_EQ(cache.length(), 0);
  ASSERT_EQ(static_cast<int>(cache.layers().size()), (*model)->num_layers());
  const ModelConfig& c = (*model)->config();
  EXPECT_EQ(cache.layers()[0].k.sizes(),
            torch::IntArrayRef({c.num_key_value_heads, 32, c.head_dim}));
  void* storage = cache.layers()[0].k.data_ptr();
  cache.Commit(10);
  EXPECT_EQ(cache.length(), 10);
  EXPECT_EQ(cache.remaining(), 22);
  cache.Truncate(4);
  EXPECT_EQ(cache.length(), 4);
  EXPECT_EQ(cache.layers()[0].k.data_ptr(), storage);
  EXPECT_EQ(cache.BytesUsed(), 4 * 2 * c.num_key_value_heads * c.head_dim * 4 *
                                   c.num_hidden_layers);
  EXPECT_THROW(cache.Truncate(5), c10::Error);
  EXPECT_THROW(cache.Commit(33), c10::Error);
}

}  // namespace
}  // namespace knapserve
