// Tests of LayerMask: the text form ("a3,m3,m7" names the skipped sublayers),
// its round trip, model-order printing, whitespace tolerance and the errors
// for malformed entries, unknown layers and duplicates.
#include "common/model/layer_mask.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace knapserve {
namespace {

TEST(LayerMaskTest, DefaultSkipsNothing) {
  LayerMask mask(4);
  EXPECT_EQ(mask.num_layers(), 4);
  EXPECT_EQ(mask.num_sublayers(), 8);
  EXPECT_EQ(mask.num_skipped(), 0);
  EXPECT_EQ(mask.num_kept(), 8);
  EXPECT_TRUE(mask.empty());
  EXPECT_EQ(mask.ToString(), "");
  EXPECT_EQ(LayerMask().num_layers(), 0);
}

TEST(LayerMaskTest, EmptyTextSkipsNothing) {
  for (const std::string text : {"", " ", "\t \n"}) {
    SCOPED_TRACE("text '" + text + "'");
    auto mask = LayerMask::Parse(text, 3);
    ASSERT_TRUE(mask.ok()) << mask.status();
    EXPECT_EQ(*mask, LayerMask(3));
    EXPECT_TRUE(mask->empty());
    EXPECT_EQ(mask->num_layers(), 3);
  }
}

TEST(LayerMaskTest, ParsesEntriesIntoSublayers) {
  auto mask = LayerMask::Parse("a3,m3,m7", 8);
  ASSERT_TRUE(mask.ok()) << mask.status();
  EXPECT_EQ(mask->num_layers(), 8);
  EXPECT_EQ(mask->num_skipped(), 3);
  EXPECT_EQ(mask->num_kept(), 13);
  EXPECT_TRUE(mask->skip_attention(3));
  EXPECT_TRUE(mask->skip_mlp(3));
  EXPECT_TRUE(mask->skip_mlp(7));
  EXPECT_FALSE(mask->skip_attention(7));
  EXPECT_TRUE(mask->skipped(6));   // a3 = sublayer 2*3
  EXPECT_TRUE(mask->skipped(7));   // m3 = sublayer 2*3+1
  EXPECT_TRUE(mask->skipped(15));  // m7 = sublayer 2*7+1
  for (int s : {0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13, 14}) {
    EXPECT_FALSE(mask->skipped(s)) << "sublayer " << s;
  }
  // Layer 0 and the last layer are legal entries.
  auto edges = LayerMask::Parse("a0,m7", 8);
  ASSERT_TRUE(edges.ok()) << edges.status();
  EXPECT_TRUE(edges->skipped(0));
  EXPECT_TRUE(edges->skipped(15));
}

TEST(LayerMaskTest, ToStringListsEntriesInModelOrder) {
  auto mask = LayerMask::Parse("m7,a3,m0,m3,a0", 8);
  ASSERT_TRUE(mask.ok()) << mask.status();
  EXPECT_EQ(mask->ToString(), "a0,m0,a3,m3,m7");
  // Equal masks print equally whatever the input order.
  auto other = LayerMask::Parse("a0,a3,m0,m3,m7", 8);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(*mask, *other);
  EXPECT_EQ(mask->ToString(), other->ToString());
  // set_skipped builds the same value.
  LayerMask built(8);
  for (int s : {15, 7, 1, 6, 0}) built.set_skipped(s, true);
  EXPECT_EQ(built, *mask);
  EXPECT_EQ(built.ToString(), "a0,m0,a3,m3,m7");
  built.set_skipped(15, false);
  EXPECT_EQ(built.ToString(), "a0,m0,a3,m3");
  EXPECT_NE(built, *mask);
}

TEST(LayerMaskTest, ToleratesWhitespaceAroundEntries) {
  auto mask = LayerMask::Parse("  m3 ,a1,\ta2  ,  m0\n", 4);
  ASSERT_TRUE(mask.ok()) << mask.status();
  EXPECT_EQ(mask->ToString(), "m0,a1,a2,m3");
}

TEST(LayerMaskTest, MasksOfDifferentModelsDiffer) {
  EXPECT_NE(LayerMask(2), LayerMask(3));
  auto a = LayerMask::Parse("a1", 2);
  auto b = LayerMask::Parse("a1", 3);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(*a, *b);
  EXPECT_EQ(a->ToString(), b->ToString());
}

TEST(LayerMaskTest, RoundTripsEveryMaskOfASmallModelAndRandomLargeOnes) {
  // Every subset of the 6 sublayers of a 3-layer model.
  for (int bits = 0; bits < (1 << 6); ++bits) {
    LayerMask mask(3);
    for (int s = 0; s < 6; ++s) mask.set_skipped(s, (bits >> s) & 1);
    const std::string text = mask.ToString();
    SCOPED_TRACE("mask '" + text + "'");
    auto parsed = LayerMask::Parse(text, 3);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, mask);
    EXPECT_EQ(parsed->ToString(), text);
    EXPECT_EQ(parsed->num_skipped(), __builtin_popcount(bits));
  }
  // Random masks of a 40-layer model (two-digit layer numbers), fixed seed.
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 200; ++trial) {
    LayerMask mask(40);
    for (int s = 0; s < 80; ++s) mask.set_skipped(s, rng() % 3 == 0);
    const std::string text = mask.ToString();
    SCOPED_TRACE("mask '" + text + "'");
    auto parsed = LayerMask::Parse(text, 40);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, mask);
    EXPECT_EQ(parsed->ToString(), text);
  }
}

TEST(LayerMaskTest, RejectsMalformedEntriesNamingThem) {
  const std::vector<std::string> bad = {"x3",
                                        "a",
                                        "a-1",
                                        "3",
                                        "m",
                                        "a1,",
                                        ",a1",
                                        "a1,,m1",
                                        "A1",
                                        "a 1",
                                        "a1m1",
                                        "a+1",
                                        "am1",
                                        "a1.0",
                                        "a0x1",
                                        "mm0",
                                        "a99999999999999999999"};
  for (const std::string& text : bad) {
    SCOPED_TRACE("text '" + text + "'");
    auto mask = LayerMask::Parse(text, 4);
    ASSERT_FALSE(mask.ok()) << "parsed as '" << mask->ToString() << "'";
    EXPECT_EQ(mask.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(mask.status().message().find("layer mask"), std::string::npos)
        << mask.status();
  }
  // The bad entry is quoted.
  auto mask = LayerMask::Parse("a1,x3,m2", 4);
  ASSERT_FALSE(mask.ok());
  EXPECT_NE(mask.status().message().find("'x3'"), std::string::npos)
      << mask.status();
}

TEST(LayerMaskTest, RejectsLayersTheModelDoesNotHave) {
  for (const std::string text : {"a4", "m4", "a0,m9", "m100"}) {
    SCOPED_TRACE("text '" + text + "'");
    auto mask = LayerMask::Parse(text, 4);
    ASSERT_FALSE(mask.ok());
    EXPECT_EQ(mask.status().code(), absl::StatusCode::kInvalidArgument);
    // Names the model's layer count.
    EXPECT_NE(mask.status().message().find("4 layers"), std::string::npos)
        << mask.status();
  }
  // Any entry is out of range for a model without layers; "" is fine.
  EXPECT_FALSE(LayerMask::Parse("a0", 0).ok());
  EXPECT_TRUE(LayerMask::Parse("", 0).ok());
}

TEST(LayerMaskTest, RejectsASublayerNamedTwice) {
  for (const std::string text : {"a1,a1", "m0,a1,m0", "a1, a1", "a01,a1"}) {
    SCOPED_TRACE("text '" + text + "'");
    auto mask = LayerMask::Parse(text, 4);
    ASSERT_FALSE(mask.ok());
    EXPECT_EQ(mask.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(mask.status().message().find("twice"), std::string::npos)
        << mask.status();
  }
  // Attention and MLP of one layer are two different sublayers.
  EXPECT_TRUE(LayerMask::Parse("a1,m1", 4).ok());
}

}  // namespace
}  // namespace knapserve
