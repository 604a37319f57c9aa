// Tests of JSON in and out of the template engine's values
// (common/text/jinja/json.h): the context as Values, and json.dumps as
// Python's json module writes it (what the tojson filter prints).
#include "common/text/jinja/json.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "nlohmann/json.hpp"
#include "tests/testing/test_util.h"

namespace knapserve::jinja {
namespace {

using testing::Message;

std::string Dumps(const Value& v, const JsonStyle& style = {}) {
  std::string out;
  const absl::Status status = AppendJson(v, style, 0, &out);
  return status.ok() ? out : "error: " + Message(status);
}

std::string Repr(const Value& v) {
  std::string out;
  EXPECT_TRUE(AppendRepr(v, &out).ok());
  return out;
}

TEST(JinjaJsonTest, ContextBecomesValuesInItsKeyOrder) {
  const auto ordered = nlohmann::ordered_json::parse(
      R"({"z": 1, "a": [true, null, 2.5, "é"], "m": {"k": -3}})");
  const absl::StatusOr<Value> v = FromJson(ordered);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(Repr(*v), "{'z': 1, 'a': [True, None, 2.5, 'é'], 'm': {'k': -3}}");
  // nlohmann::json sorts its keys.
  const absl::StatusOr<Value> sorted =
      FromJson(nlohmann::json::parse(R"({"z": 1, "a": 2})"));
  ASSERT_TRUE(sorted.ok());
  EXPECT_EQ(Repr(*sorted), "{'a': 2, 'z': 1}");
}

TEST(JinjaJsonTest, ContextLimits) {
  const auto big = FromJson(nlohmann::json::parse("18446744073709551615"));
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(Message(big.status()),
            "the context holds the integer 18446744073709551615, which is "
            "beyond the supported range (64-bit signed)");
  const auto bad_utf8 = FromJson(nlohmann::json(std::string("\xff")));
  ASSERT_FALSE(bad_utf8.ok());
  EXPECT_EQ(Message(bad_utf8.status()),
            "the context holds a string that is not valid UTF-8");
  nlohmann::json deep = 1;
  for (int k = 0; k < 300; ++k) deep = nlohmann::json::array({deep});
  const auto too_deep = FromJson(deep);
  ASSERT_FALSE(too_deep.ok());
  EXPECT_EQ(Message(too_deep.status()),
            "lists and dicts nested more than 256 levels deep");
}

TEST(JinjaJsonTest, DumpsLikePython) {
  const Value v = *FromJson(nlohmann::ordered_json::parse(
      R"({"b": [1, 2.0, null, true], "a": "é\"\n", "e": {}, "l": []})"));
  EXPECT_EQ(Dumps(v),
            R"({"b": [1, 2.0, null, true], "a": "é\"\n", "e": {}, "l": []})");
  JsonStyle sorted;
  sorted.sort_keys = true;
  EXPECT_EQ(Dumps(v, sorted),
            R"({"a": "é\"\n", "b": [1, 2.0, null, true], "e": {}, "l": []})");
  // indent: newlines, and "," without a trailing space.
  JsonStyle indented;
  indented.indent = "  ";
  indented.item_separator = ",";
  EXPECT_EQ(Dumps(*FromJson(nlohmann::ordered_json::parse(
                      R"({"a": [1, {"b": null}], "c": {}})")),
                  indented),
            "{\n  \"a\": [\n    1,\n    {\n      \"b\": null\n    }\n  ],\n"
            "  \"c\": {}\n}");
  JsonStyle compact;
  compact.item_separator = ",";
  compact.key_separator = ":";
  EXPECT_EQ(Dumps(*FromJson(nlohmann::ordered_json::parse(R"({"a":[1,2]})")),
                  compact),
            R"({"a":[1,2]})");
}

TEST(JinjaJsonTest, EnsureAsciiEscapesAsPython) {
  JsonStyle ascii;
  ascii.ensure_ascii = true;
  EXPECT_EQ(Dumps(String("é😀\x7f"), ascii), R"("\u00e9\ud83d\ude00\u007f")");
  EXPECT_EQ(Dumps(String("é😀\x7f")), "\"é😀\x7f\"");
  EXPECT_EQ(Dumps(String("\x01\t\b\f")), R"("\u0001\t\b\f")");
}

TEST(JinjaJsonTest, SpecialFloatsAndWhatIsNotJson) {
  EXPECT_EQ(Dumps(Float(std::numeric_limits<double>::quiet_NaN())), "NaN");
  EXPECT_EQ(Dumps(Float(-std::numeric_limits<double>::infinity())),
            "-Infinity");
  EXPECT_EQ(Dumps(Float(1e16)), "1e+16");
  EXPECT_EQ(Dumps(*MakeList({Int(1)}, /*tuple=*/true)), "[1]");
  EXPECT_EQ(Dumps(Undefined("u")),
            "error: Object of type Undefined is not JSON serializable");
  EXPECT_EQ(Dumps(*MakeGenerator({})),
            "error: Object of type generator is not JSON serializable");
}

}  // namespace
}  // namespace knapserve::jinja
