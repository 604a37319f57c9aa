// Tests of UnguessableId (common/base/random_id.h): the prefix, 32 lowercase
// hex digits, and no repeats (1,000 ids; a counter or a clock-seeded
// generator shared across calls would also pass the format check, not this
// one's spread: every hex digit appears in every position).
#include "common/base/random_id.h"

#include <gtest/gtest.h>

#include <regex>
#include <set>
#include <string>

namespace knapserve {
namespace {

TEST(UnguessableIdTest, PrefixThen32HexDigitsNeverRepeated) {
  const std::regex format("req-[0-9a-f]{32}");
  std::set<std::string> seen;
  std::set<char> digits_at[32];
  for (int i = 0; i < 1000; ++i) {
    const std::string id = UnguessableId("req-");
    ASSERT_TRUE(std::regex_match(id, format)) << id;
    EXPECT_TRUE(seen.insert(id).second) << "repeated: " << id;
    for (int p = 0; p < 32; ++p) digits_at[p].insert(id[4 + p]);
  }
  for (int p = 0; p < 32; ++p) {
    EXPECT_EQ(digits_at[p].size(), 16u) << "position " << p;
  }
  EXPECT_EQ(UnguessableId("").size(), 32u);
}

}  // namespace
}  // namespace knapserve
