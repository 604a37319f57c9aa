// Tests of the template engine's tests (`x is name`,
// common/text/jinja/tests.h), called directly on values. The results are
// what jinja2 3.1's tests give for the same values.
#include "common/text/jinja/tests.h"

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

// "true" / "false" for `v is name(pos...)`, or "error: <message>".
std::string Is(const std::string& name, const Value& v,
               std::vector<Value> pos = {}) {
  Args args;
  args.pos = std::move(pos);
  const absl::StatusOr<bool> result = ApplyTest(name, v, args);
  if (!result.ok()) return "error: " + Message(result.status());
  return *result ? "true" : "false";
}

TEST(JinjaTestsTest, TypeTests) {
  EXPECT_EQ(Is("defined", Undefined("u")), "false");
  EXPECT_EQ(Is("undefined", Undefined("u")), "true");
  EXPECT_EQ(Is("defined", None()), "true");
  EXPECT_EQ(Is("none", None()), "true");
  EXPECT_EQ(Is("boolean", Int(1)), "false");
  EXPECT_EQ(Is("true", Bool(true)), "true");
  EXPECT_EQ(Is("true", Int(1)), "false");
  EXPECT_EQ(Is("integer", Bool(true)), "false");
  EXPECT_EQ(Is("number", Bool(true)), "true");
  EXPECT_EQ(Is("float", Float(1)), "true");
  EXPECT_EQ(Is("string", String("")), "true");
  EXPECT_EQ(Is("mapping", J("{}")), "true");
  EXPECT_EQ(Is("sequence", J("{}")), "true");
  EXPECT_EQ(Is("sequence", Int(1)), "false");
  EXPECT_EQ(Is("iterable", String("ab")), "true");
  EXPECT_EQ(Is("iterable", *MakeGenerator({})), "true");
  EXPECT_EQ(
      Is("callable", MakeCallable(Callable::Type::kGlobal, "range", Value())),
      "true");
  EXPECT_EQ(Is("escaped", String("<b>", /*markup=*/true)), "true");
  EXPECT_EQ(Is("escaped", String("<b>")), "false");
}

TEST(JinjaTestsTest, ValueTests) {
  EXPECT_EQ(Is("odd", Int(3)), "true");
  EXPECT_EQ(Is("even", Int(-2)), "true");
  EXPECT_EQ(Is("even", Float(2.0)), "true");
  EXPECT_EQ(Is("divisibleby", Int(9), {Int(3)}), "true");
  EXPECT_EQ(Is("divisibleby", Int(9), {Int(0)}),
            "error: integer modulo by zero");
  EXPECT_EQ(Is("lower", String("abc 1")), "true");
  EXPECT_EQ(Is("upper", String("abc")), "false");
  EXPECT_EQ(Is("in", String("b"), {J(R"(["a", "b"])")}), "true");
  EXPECT_EQ(Is("in", String("x"), {String("xyz")}), "true");
  EXPECT_EQ(Is("eq", Int(1), {Float(1.0)}), "true");
  EXPECT_EQ(Is("==", Int(1), {Int(2)}), "false");
  EXPECT_EQ(Is("ne", String("a"), {String("b")}), "true");
  EXPECT_EQ(Is("lt", Int(1), {Int(2)}), "true");
  EXPECT_EQ(Is("greaterthan", Int(1), {Int(2)}), "false");
  EXPECT_EQ(Is(">=", Int(2), {Int(2)}), "true");
  EXPECT_EQ(Is("lt", Int(1), {String("a")}),
            "error: '<' not supported between instances of 'int' and 'str'");
}

TEST(JinjaTestsTest, SameasIsIdentity) {
  const Value list = J("[1]");
  EXPECT_EQ(Is("sameas", list, {list}), "true");
  EXPECT_EQ(Is("sameas", list, {J("[1]")}), "false");
  EXPECT_EQ(Is("sameas", None(), {None()}), "true");
  // CPython caches the ints -5 to 256; larger equal ints are other objects.
  EXPECT_EQ(Is("sameas", Int(256), {Int(256)}), "true");
  EXPECT_EQ(Is("sameas", Int(257), {Int(257)}), "false");
  EXPECT_EQ(Is("sameas", Bool(true), {Int(1)}), "false");
}

TEST(JinjaTestsTest, UnknownTestsAndArguments) {
  EXPECT_TRUE(IsKnownTest("defined"));
  EXPECT_TRUE(IsKnownTest("=="));
  EXPECT_FALSE(IsKnownTest("filter"));
  EXPECT_EQ(Is("filter", Int(1)), "error: unknown test 'filter'");
  EXPECT_EQ(Is("defined", Int(1), {Int(2)}),
            "error: the test 'defined' takes at most 0 argument(s) (1 given)");
  EXPECT_EQ(Is("divisibleby", Int(1)),
            "error: the test 'divisibleby' is missing its argument 'other'");
}

}  // namespace
}  // namespace knapserve::jinja
