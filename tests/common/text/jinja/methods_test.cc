// Tests of attributes, items, slices and methods of the template engine's
// values (common/text/jinja/methods.h), as jinja2's immutable sandbox finds
// and calls them. The results are what jinja2 3.1 gives for the same
// expressions; the error messages are this engine's own.
#include "common/text/jinja/methods.h"

#include <gtest/gtest.h>

#include <optional>
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

// repr of a result (undefined shows its message), or "error: <message>".
std::string Show(const absl::StatusOr<Value>& v) {
  if (!v.ok()) return "error: " + Message(v.status());
  if (v->is_undefined()) return "Undefined(" + v->s + ")";
  std::string out;
  const absl::Status status = AppendRepr(*v, &out);
  return status.ok() ? out : "error: " + Message(status);
}

// repr(self.name(pos...)), or "error: <message>".
std::string Call(const Value& self, const std::string& name,
                 std::vector<Value> pos = {}) {
  Args args;
  args.pos = std::move(pos);
  return Show(CallMethod(self, name, args));
}

std::string Slice(const Value& v, std::optional<Value> start,
                  std::optional<Value> stop, std::optional<Value> step) {
  const std::optional<Value> parts[3] = {std::move(start), std::move(stop),
                                         std::move(step)};
  return Show(SliceOf(v, parts));
}

TEST(JinjaMethodsTest, GetAttrPrefersMethodsThenItems) {
  const Value d = J(R"({"role": "user", "items": 1})");
  EXPECT_EQ(Show(GetAttr(d, "role")), "'user'");
  EXPECT_EQ(GetAttr(d, "items")->kind, Kind::kCallable);
  EXPECT_EQ(Show(GetAttr(d, "nope")),
            "Undefined('dict object' has no attribute 'nope')");
  EXPECT_EQ(Show(GetAttr(Int(1), "nope")),
            "Undefined('int object' has no attribute 'nope')");
  EXPECT_EQ(Show(GetAttr(Undefined("'x' is undefined"), "y")),
            "error: 'x' is undefined");
  // Mutating methods are unsafe in the immutable sandbox.
  EXPECT_EQ(Show(GetAttr(J("[]"), "append")),
            "Undefined(access to attribute 'append' of 'list' object is "
            "unsafe.)");
  EXPECT_FALSE(RealAttribute(d, "role").has_value());
  EXPECT_TRUE(RealAttribute(String("x"), "format").has_value());
}

TEST(JinjaMethodsTest, GetItem) {
  EXPECT_EQ(Show(GetItem(J("[1, 2, 3]"), Int(-1))), "3");
  EXPECT_EQ(Show(GetItem(J("[1, 2, 3]"), Bool(true))), "2");
  EXPECT_EQ(Show(GetItem(String("hé😀"), Int(1))), "'é'");
  EXPECT_EQ(Show(GetItem(J(R"({"a": 1})"), String("a"))), "1");
  EXPECT_EQ(Show(GetItem(J("[1]"), Int(5))),
            "Undefined('list object' has no element 5)");
  EXPECT_EQ(GetItem(J(R"({"a": 1})"), String("get"))->kind, Kind::kCallable);
}

TEST(JinjaMethodsTest, SlicesArePythons) {
  const Value xs = J("[0, 1, 2, 3, 4]");
  EXPECT_EQ(Slice(xs, Int(1), Int(-1), std::nullopt), "[1, 2, 3]");
  EXPECT_EQ(Slice(xs, std::nullopt, std::nullopt, Int(-2)), "[4, 2, 0]");
  EXPECT_EQ(Slice(xs, Int(10), None(), None()), "[]");
  EXPECT_EQ(Slice(String("hé😀!"), std::nullopt, std::nullopt, Int(-1)),
            "'!😀éh'");
  EXPECT_EQ(Slice(*MakeList({Int(1), Int(2)}, true), Int(1), std::nullopt,
                  std::nullopt),
            "(2,)");
  EXPECT_EQ(Slice(xs, std::nullopt, std::nullopt, Int(0)),
            "error: slice step cannot be zero");
  EXPECT_EQ(Slice(xs, String("a"), std::nullopt, std::nullopt),
            "error: slice indices must be integers or None or have an "
            "__index__ method");
  EXPECT_EQ(Slice(J("{}"), std::nullopt, std::nullopt, std::nullopt),
            "error: unhashable type: 'slice'");
}

TEST(JinjaMethodsTest, StrMethods) {
  const Value s = String("  Hello, World  ");
  EXPECT_EQ(Call(s, "strip"), "'Hello, World'");
  EXPECT_EQ(Call(s, "lstrip"), "'Hello, World  '");
  EXPECT_EQ(Call(String("a,b,,c"), "split", {String(",")}),
            "['a', 'b', '', 'c']");
  EXPECT_EQ(Call(String("a b  c"), "rsplit", {None(), Int(1)}), "['a b', 'c']");
  EXPECT_EQ(Call(String("<think>x"), "startswith",
                 {*MakeList({String("<t"), String("x")}, true)}),
            "True");
  EXPECT_EQ(Call(String("abc"), "endswith", {String("bc")}), "True");
  EXPECT_EQ(Call(String("héllo"), "find", {String("l")}), "2");
  EXPECT_EQ(Call(String("aaa"), "count", {String("aa")}), "1");
  EXPECT_EQ(Call(String("prefix-x"), "removeprefix", {String("prefix-")}),
            "'x'");
  EXPECT_EQ(Call(String(", "), "join", {J(R"(["a", "b"])")}), "'a, b'");
  EXPECT_EQ(Call(String(", "), "join", {J(R"(["a", 1])")}),
            "error: sequence item 1: expected str instance, int found");
  EXPECT_EQ(Call(String("x"), "format"),
            "error: str.format() is not supported");
  EXPECT_EQ(Call(String("x"), "upper", {Int(1)}),
            "error: str.upper() takes at most 0 argument(s) (1 given)");
}

TEST(JinjaMethodsTest, DictAndListMethods) {
  const Value d = J(R"({"a": 1, "b": 2})");
  EXPECT_EQ(Call(d, "get", {String("a")}), "1");
  EXPECT_EQ(Call(d, "get", {String("z")}), "None");
  EXPECT_EQ(Call(d, "get", {String("z"), Int(0)}), "0");
  EXPECT_EQ(Call(d, "items"), "dict_items([('a', 1), ('b', 2)])");
  EXPECT_EQ(Call(d, "keys"), "dict_keys(['a', 'b'])");
  EXPECT_EQ(Call(d, "values"), "dict_values([1, 2])");
  const Value xs = J(R"([1, "a", 1])");
  EXPECT_EQ(Call(xs, "count", {Int(1)}), "2");
  EXPECT_EQ(Call(xs, "index", {String("a")}), "1");
  EXPECT_EQ(Call(xs, "index", {Int(7)}),
            "error: list.index(): value is not in the list");
  EXPECT_EQ(Call(xs, "append", {Int(7)}),
            "error: list.append() is not supported");
}

}  // namespace
}  // namespace knapserve::jinja
