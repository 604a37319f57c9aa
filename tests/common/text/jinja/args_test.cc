// Tests of argument binding for the template engine's calls, filters and
// tests (common/text/jinja/args.h), with Python's TypeError wording.
#include "common/text/jinja/args.h"

#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "tests/testing/test_util.h"

namespace knapserve::jinja {
namespace {

using testing::Message;

// The message of Bind's error ("" and a failure if it binds).
std::string BindError(const Args& args, size_t required) {
  const auto bound = Bind("f()", args, {"a", "b"}, required);
  EXPECT_FALSE(bound.ok());
  return bound.ok() ? "" : Message(bound.status());
}

TEST(JinjaArgsTest, BindsPositionalThenKeywordArguments) {
  Args args;
  args.pos = {Int(1)};
  args.kw = {{"c", String("x")}};
  const auto bound = Bind("f()", args, {"a", "b", "c"}, 1);
  ASSERT_TRUE(bound.ok()) << bound.status();
  ASSERT_EQ(bound->size(), 3u);
  EXPECT_EQ((*bound)[0]->i, 1);
  EXPECT_FALSE((*bound)[1].has_value());
  EXPECT_EQ((*bound)[2]->s, "x");
  EXPECT_TRUE(IsNone((*bound)[1]));
  EXPECT_TRUE(IsNone(None()));
  EXPECT_FALSE(IsNone(Int(0)));
}

TEST(JinjaArgsTest, BindingErrorsNameTheCallee) {
  Args too_many;
  too_many.pos = {Int(1), Int(2), Int(3)};
  EXPECT_EQ(BindError(too_many, 0),
            "f() takes at most 2 argument(s) (3 given)");
  Args unknown;
  unknown.kw = {{"z", Int(1)}};
  EXPECT_EQ(BindError(unknown, 0),
            "f() got an unexpected keyword argument 'z'");
  Args twice;
  twice.pos = {Int(1)};
  twice.kw = {{"a", Int(2)}};
  EXPECT_EQ(BindError(twice, 0), "f() got multiple values for 'a'");
  Args missing;
  missing.kw = {{"a", Int(2)}};
  EXPECT_EQ(BindError(missing, 2), "f() is missing its argument 'b'");
}

TEST(JinjaArgsTest, TypedArguments) {
  EXPECT_EQ(*IntArg("n", Bool(true)), 1);
  EXPECT_EQ(Message(IntArg("n", Float(1.0)).status()),
            "n must be an integer, not 'float'");
  EXPECT_EQ(*StrArg("s", String("x")), "x");
  EXPECT_EQ(Message(StrArg("s", None()).status()),
            "s must be a string, not 'NoneType'");
  EXPECT_TRUE(Among("b", {"a", "b"}));
  EXPECT_FALSE(Among("c", {"a", "b"}));
}

}  // namespace
}  // namespace knapserve::jinja
