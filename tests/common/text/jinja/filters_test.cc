// Tests of the template engine's filters (common/text/jinja/filters.h),
// called directly on values. The results are what jinja2 3.1's filters
// (with Hugging Face's tojson) give for the same values; the error messages
// are this engine's own.
#include "common/text/jinja/filters.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "common/text/jinja/json.h"
#include "nlohmann/json.hpp"
#include "tests/testing/test_util.h"

namespace knapserve::jinja {
namespace {

using testing::Message;

Value J(std::string_view json) {
  return *FromJson(nlohmann::ordered_json::parse(json));
}

// repr(v | name(pos..., kw...)), or "error: <message>". A generator's items
// are shown as a list.
std::string Filter(const std::string& name, const Value& v,
                   std::vector<Value> pos = {},
                   std::vector<std::pair<std::string, Value>> kw = {}) {
  Args args;
  args.pos = std::move(pos);
  args.kw = std::move(kw);
  absl::StatusOr<Value> result = ApplyFilter(name, v, args);
  if (result.ok() && result->kind == Kind::kGenerator) {
    absl::StatusOr<std::vector<Value>> items = Iterate(*result);
    result = items.ok() ? MakeList(*std::move(items))
                        : absl::StatusOr<Value>(items.status());
  }
  if (!result.ok()) return "error: " + Message(result.status());
  std::string out;
  const absl::Status status = AppendRepr(*result, &out);
  return status.ok() ? out : "error: " + Message(status);
}

const char kMessages[] = R"([{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Hi"},
                             {"role": "user", "content": "More"}])";

TEST(JinjaFiltersTest, ToJsonIsHuggingFaces) {
  const Value tool = J(
      R"({"name": "get_weather", "args": {"city": "Zürich", "n": [1, 2.5]}})");
  EXPECT_EQ(Filter("tojson", tool),
            R"('{"name": "get_weather", "args": {"city": "Zürich", "n": [1, )"
            R"(2.5]}}')");
  EXPECT_EQ(Filter("tojson", J(R"({"b": 1, "a": [true]})"), {},
                   {{"indent", Int(2)}, {"sort_keys", Bool(true)}}),
            R"('{\n  "a": [\n    true\n  ],\n  "b": 1\n}')");
  EXPECT_EQ(Filter("tojson", String("é"), {}, {{"ensure_ascii", Bool(true)}}),
            R"('"\\u00e9"')");
  EXPECT_EQ(Filter("tojson", J(R"({"a": [1, 2]})"), {},
                   {{"separators", J(R"([",", ":"])")}}),
            R"('{"a":[1,2]}')");
  EXPECT_EQ(Filter("tojson", Undefined("u")),
            "error: Object of type Undefined is not JSON serializable");
  EXPECT_EQ(Filter("tojson", Int(1), {}, {{"indent", J("[1]")}}),
            "error: tojson: indent must be an integer or a string");
}

TEST(JinjaFiltersTest, StringFilters) {
  EXPECT_EQ(Filter("upper", String("straße")), "'STRASSE'");
  EXPECT_EQ(Filter("title", String("hello-world foo(bar)")),
            "'Hello-World Foo(Bar)'");
  EXPECT_EQ(Filter("capitalize", String("hELLO")), "'Hello'");
  EXPECT_EQ(Filter("trim", String("  x \n")), "'x'");
  EXPECT_EQ(Filter("trim", String("xxaxx"), {String("x")}), "'a'");
  EXPECT_EQ(
      Filter("replace", String("a-b-c"), {String("-"), String("+"), Int(1)}),
      "'a+b-c'");
  EXPECT_EQ(Filter("string", Int(3)), "'3'");
  // |safe marks a string; the case filters keep the mark.
  EXPECT_EQ(Filter("safe", String("<b>")), "Markup('<b>')");
  EXPECT_EQ(Filter("upper", String("<b>", /*markup=*/true)), "Markup('<B>')");
}

TEST(JinjaFiltersTest, SequenceFilters) {
  const Value xs = J("[3, 1, 2]");
  EXPECT_EQ(Filter("length", xs), "3");
  EXPECT_EQ(Filter("count", String("héllo")), "5");
  EXPECT_EQ(Filter("first", xs), "3");
  EXPECT_EQ(Filter("last", xs), "2");
  EXPECT_EQ(Filter("list", String("ab")), "['a', 'b']");
  EXPECT_EQ(Filter("join", xs, {String(", ")}), "'3, 1, 2'");
  EXPECT_EQ(Filter("join", J(kMessages), {String("|")},
                   {{"attribute", String("role")}}),
            "'system|user|user'");
  EXPECT_EQ(Filter("items", J(R"({"a": 1, "b": [2]})")),
            "[('a', 1), ('b', [2])]");
  EXPECT_EQ(Filter("first", J("[]")), "Undefined");
  EXPECT_EQ(Filter("last", Int(1)), "error: 'int' object is not reversible");
}

TEST(JinjaFiltersTest, SelectAndMapAreLazyGenerators) {
  const Value messages = J(kMessages);
  EXPECT_EQ(Filter("selectattr", messages,
                   {String("role"), String("equalto"), String("user")}),
            "[{'role': 'user', 'content': 'Hi'}, {'role': 'user', 'content': "
            "'More'}]");
  EXPECT_EQ(Filter("rejectattr", messages,
                   {String("role"), String("equalto"), String("user")}),
            "[{'role': 'system', 'content': 'Be brief.'}]");
  EXPECT_EQ(Filter("map", messages, {}, {{"attribute", String("content")}}),
            "['Be brief.', 'Hi', 'More']");
  EXPECT_EQ(Filter("map", J(R"(["a", "b"])"), {String("upper")}), "['A', 'B']");
  EXPECT_EQ(Filter("select", J("[0, 1, 2, 3]"), {String("odd")}), "[1, 3]");
  EXPECT_EQ(Filter("reject", J("[0, 1, 2, 3]")), "[0]");
  // The result is a generator, which is used up once iterated.
  Args odd;
  odd.pos = {String("odd")};
  const absl::StatusOr<Value> gen = ApplyFilter("select", J("[1, 2]"), odd);
  ASSERT_TRUE(gen.ok());
  EXPECT_EQ(gen->kind, Kind::kGenerator);
  EXPECT_EQ(Iterate(*gen)->size(), 1u);
  EXPECT_TRUE(Iterate(*gen)->empty());
  // A failure inside comes when the generator is used, not before.
  Args bad;
  bad.pos = {String("upper"), Int(1)};
  const absl::StatusOr<Value> lazy = ApplyFilter("map", J(R"(["a"])"), bad);
  ASSERT_TRUE(lazy.ok());
  EXPECT_EQ(Message(Iterate(*lazy).status()),
            "the filter 'upper' takes at most 0 argument(s) (1 given)");
}

TEST(JinjaFiltersTest, NumbersAndDefaults) {
  EXPECT_EQ(Filter("int", String("0x1F"), {Int(0), Int(16)}), "31");
  EXPECT_EQ(Filter("int", String("3.7")), "3");
  EXPECT_EQ(Filter("int", String("abc")), "0");
  EXPECT_EQ(Filter("int", String("abc"), {Int(-1)}), "-1");
  EXPECT_EQ(Filter("float", String("1e3")), "1000.0");
  EXPECT_EQ(Filter("float", None()), "0.0");
  EXPECT_EQ(Filter("abs", Int(-3)), "3");
  EXPECT_EQ(Filter("abs", String("x")),
            "error: bad operand type for abs(): 'str'");
  EXPECT_EQ(Filter("default", Undefined("u"), {String("d")}), "'d'");
  EXPECT_EQ(Filter("d", String(""), {String("d")}), "''");
  EXPECT_EQ(Filter("d", String(""), {String("d"), Bool(true)}), "'d'");
  EXPECT_EQ(Filter("default", None(), {String("d")}), "None");
}

TEST(JinjaFiltersTest, AttrFindsOnlyRealAttributes) {
  const Value d = J(R"({"items": 1})");
  EXPECT_EQ(Filter("attr", d, {String("nope")}), "Undefined");
  Args name;
  name.pos = {String("items")};
  const absl::StatusOr<Value> method = ApplyFilter("attr", d, name);
  ASSERT_TRUE(method.ok());
  EXPECT_EQ(method->kind, Kind::kCallable);  // dict.items, not the key.
}

TEST(JinjaFiltersTest, UnknownFiltersAndBadArguments) {
  EXPECT_FALSE(IsKnownFilter("wordcount"));
  EXPECT_TRUE(IsKnownFilter("tojson"));
  EXPECT_TRUE(IsKnownFilter("d"));
  EXPECT_EQ(Filter("wordcount", String("a b")),
            "error: unknown filter 'wordcount'");
  EXPECT_EQ(Filter("join", J("[1]"), {String(","), None(), Int(3)}),
            "error: the filter 'join' takes at most 2 argument(s) (3 given)");
  EXPECT_EQ(Filter("length", Int(1)),
            "error: object of type 'int' has no len()");
}

}  // namespace
}  // namespace knapserve::jinja
