// Tests of the template engine's value model (common/text/jinja/value.h):
// str() and repr() as Python prints them, truthiness, == and ordering, `in`,
// iteration and len(), and arithmetic. The expectations are what CPython
// 3.11 (and jinja2 3.1, for Undefined and Markup) give for the same values.
#include "common/text/jinja/value.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/text/jinja/errors.h"
#include "tests/testing/test_util.h"

namespace knapserve::jinja {
namespace {

using ::testing::ElementsAre;
using testing::Message;

Value List(std::vector<Value> items) { return *MakeList(std::move(items)); }
Value Tuple(std::vector<Value> items) {
  return *MakeList(std::move(items), /*tuple=*/true);
}
Value Dict(std::vector<std::pair<std::string, Value>> entries) {
  return *MakeDict(std::move(entries));
}
Value Ns() {
  Value v;
  v.kind = Kind::kNamespace;
  v.ns = std::make_shared<Namespace>();
  return v;
}

std::string Repr(const Value& v) {
  std::string out;
  const absl::Status status = AppendRepr(v, &out);
  EXPECT_TRUE(status.ok()) << status;
  return out;
}

// str(v), or the error's message.
std::string StrOrError(const Value& v) {
  absl::StatusOr<std::string> s = Str(v);
  return s.ok() ? *s : "error: " + Message(s.status());
}

// repr(a op b), or the error's message.
std::string Calc(BinOp op, const Value& a, const Value& b) {
  absl::StatusOr<Value> v = Arith(op, a, b);
  return v.ok() ? Repr(*v) : "error: " + Message(v.status());
}

TEST(JinjaValueTest, ReprIsPythons) {
  EXPECT_EQ(Repr(None()), "None");
  EXPECT_EQ(Repr(Bool(true)), "True");
  EXPECT_EQ(Repr(Int(-7)), "-7");
  EXPECT_EQ(Repr(Float(1)), "1.0");
  EXPECT_EQ(Repr(Float(1e100)), "1e+100");
  EXPECT_EQ(Repr(String("it's")), "\"it's\"");
  EXPECT_EQ(Repr(String("<b>", /*markup=*/true)), "Markup('<b>')");
  EXPECT_EQ(Repr(List({Int(1), String("a"), None()})), "[1, 'a', None]");
  EXPECT_EQ(Repr(Tuple({Int(1)})), "(1,)");
  EXPECT_EQ(Repr(Tuple({})), "()");
  EXPECT_EQ(Repr(Dict({{"k", Tuple({Int(1), Float(2.5)})}, {"e", Dict({})}})),
            "{'k': (1, 2.5), 'e': {}}");
  EXPECT_EQ(Repr(*MakeDictView({String("a"), String("b")}, kDictKeys)),
            "dict_keys(['a', 'b'])");
  EXPECT_EQ(Repr(Undefined("x")), "Undefined");
}

TEST(JinjaValueTest, StrPrintsAsJinjaDoes) {
  EXPECT_EQ(StrOrError(Undefined("'x' is undefined")), "");
  EXPECT_EQ(StrOrError(String("it's")), "it's");
  EXPECT_EQ(StrOrError(None()), "None");
  EXPECT_EQ(StrOrError(Bool(false)), "False");
  EXPECT_EQ(StrOrError(List({String("a"), Float(0.5)})), "['a', 0.5]");
  // What Jinja prints as a Python object with an address is an error here.
  EXPECT_EQ(StrOrError(Ns()), "error: cannot print a namespace object");
  EXPECT_EQ(StrOrError(*MakeGenerator({})),
            "error: cannot print a generator (what select, map, items... "
            "return); add |list");
  EXPECT_EQ(StrOrError(MakeCallable(Callable::Type::kGlobal, "range", Value())),
            "error: cannot print the function 'range' (missing parentheses?)");
}

TEST(JinjaValueTest, TruthinessIsPythons) {
  EXPECT_FALSE(Truthy(Undefined("u")));
  EXPECT_FALSE(Truthy(None()));
  EXPECT_FALSE(Truthy(Int(0)));
  EXPECT_FALSE(Truthy(Float(0.0)));
  EXPECT_FALSE(Truthy(String("")));
  EXPECT_FALSE(Truthy(List({})));
  EXPECT_FALSE(Truthy(Dict({})));
  EXPECT_TRUE(Truthy(String("0")));
  EXPECT_TRUE(Truthy(Float(-0.5)));
  EXPECT_TRUE(Truthy(Tuple({None()})));
  EXPECT_TRUE(Truthy(*MakeGenerator({})));  // Even an empty one.
  EXPECT_TRUE(Truthy(Ns()));
}

TEST(JinjaValueTest, EqualityIsPythons) {
  EXPECT_TRUE(Equals(Int(1), Float(1.0)));
  EXPECT_TRUE(Equals(Bool(true), Int(1)));
  EXPECT_TRUE(Equals(List({Int(1), Int(2)}), List({Float(1), Int(2)})));
  EXPECT_FALSE(Equals(List({Int(1)}), Tuple({Int(1)})));
  EXPECT_FALSE(Equals(String("1"), Int(1)));
  EXPECT_FALSE(Equals(None(), Bool(false)));
  // Dicts compare by keys and values, not order.
  EXPECT_TRUE(Equals(Dict({{"a", Int(1)}, {"b", Int(2)}}),
                     Dict({{"b", Int(2)}, {"a", Int(1)}})));
  EXPECT_FALSE(Equals(Dict({{"a", Int(1)}}), Dict({{"a", Int(2)}})));
  // A namespace equals only itself.
  const Value ns = Ns();
  EXPECT_TRUE(Equals(ns, ns));
  EXPECT_FALSE(Equals(ns, Ns()));
}

TEST(JinjaValueTest, OrderingIsPythons) {
  EXPECT_TRUE(*Order(CompareOp::kLt, Int(1), Float(1.5)));
  EXPECT_TRUE(*Order(CompareOp::kLt, String("B"), String("a")));
  EXPECT_TRUE(*Order(CompareOp::kGt, String("é"), String("z")));
  EXPECT_TRUE(
      *Order(CompareOp::kLt, List({Int(1), Int(2)}), List({Int(1), Int(3)})));
  EXPECT_TRUE(*Order(CompareOp::kLe, Tuple({Int(1)}), Tuple({Int(1), Int(0)})));
  EXPECT_FALSE(*Order(CompareOp::kGe, Bool(false), Int(1)));
  const auto mixed = Order(CompareOp::kLt, Int(1), String("a"));
  ASSERT_FALSE(mixed.ok());
  EXPECT_EQ(Message(mixed.status()),
            "'<' not supported between instances of 'int' and 'str'");
  const auto list_tuple = Order(CompareOp::kGe, List({}), Tuple({}));
  ASSERT_FALSE(list_tuple.ok());
  EXPECT_EQ(Message(list_tuple.status()),
            "'>=' not supported between instances of 'list' and 'tuple'");
  const auto undefined =
      Order(CompareOp::kLt, Undefined("'x' is undefined"), Int(1));
  ASSERT_FALSE(undefined.ok());
  EXPECT_EQ(Message(undefined.status()), "'x' is undefined");
}

TEST(JinjaValueTest, CompareChainsTheOperators) {
  EXPECT_TRUE(*Compare(CompareOp::kEq, Int(2), Float(2)));
  EXPECT_TRUE(*Compare(CompareOp::kNe, String("a"), String("b")));
  EXPECT_TRUE(*Compare(CompareOp::kIn, String("ell"), String("hello")));
  EXPECT_TRUE(*Compare(CompareOp::kNotIn, Int(4), List({Int(1), Int(2)})));
}

TEST(JinjaValueTest, ContainsIsPythonsIn) {
  EXPECT_TRUE(*Contains(List({Int(1), Int(2)}), Float(2)));
  EXPECT_TRUE(*Contains(Dict({{"a", Int(1)}}), String("a")));
  EXPECT_FALSE(*Contains(Dict({{"a", Int(1)}}), Int(1)));
  EXPECT_FALSE(*Contains(Undefined("u"), Int(1)));
  const auto not_str = Contains(String("abc"), Int(1));
  ASSERT_FALSE(not_str.ok());
  EXPECT_EQ(Message(not_str.status()),
            "'in <string>' requires string as left operand, not int");
  const auto unhashable = Contains(Dict({}), List({}));
  ASSERT_FALSE(unhashable.ok());
  EXPECT_EQ(Message(unhashable.status()), "unhashable type: 'list'");
  const auto not_iterable = Contains(Int(3), Int(1));
  ASSERT_FALSE(not_iterable.ok());
  EXPECT_EQ(Message(not_iterable.status()),
            "argument of type 'int' is not iterable");
}

TEST(JinjaValueTest, IterateAndLength) {
  EXPECT_THAT(*Iterate(String("hé😀")),
              ElementsAre(::testing::Field(&Value::s, "h"),
                          ::testing::Field(&Value::s, "é"),
                          ::testing::Field(&Value::s, "😀")));
  const auto keys = *Iterate(Dict({{"b", Int(1)}, {"a", Int(2)}}));
  ASSERT_EQ(keys.size(), 2u);
  EXPECT_EQ(keys[0].s, "b");
  EXPECT_EQ(keys[1].s, "a");
  EXPECT_TRUE(Iterate(Undefined("u"))->empty());
  EXPECT_EQ(*Length(String("hé😀")), 3);
  EXPECT_EQ(*Length(Dict({{"a", Int(1)}})), 1);
  const auto no_len = Length(Int(1));
  ASSERT_FALSE(no_len.ok());
  EXPECT_EQ(Message(no_len.status()), "object of type 'int' has no len()");
}

TEST(JinjaValueTest, GeneratorsAreUsedUp) {
  const Value gen = *MakeGenerator({Int(1), Int(2), Int(3)});
  const Value copy = gen;  // Shares the cursor, as Python shares the object.
  EXPECT_TRUE(*Contains(gen, Int(1)));  // Consumes up to the item found.
  EXPECT_EQ(Iterate(copy)->size(), 2u);
  EXPECT_TRUE(Iterate(gen)->empty());
  EXPECT_FALSE(Length(gen).ok());
}

TEST(JinjaValueTest, LazyGeneratorFailsWhenUsed) {
  const absl::StatusOr<Value> gen =
      LazyGenerator(absl::InvalidArgumentError("no good"));
  ASSERT_TRUE(gen.ok());
  EXPECT_TRUE(Truthy(*gen));
  const auto items = Iterate(*gen);
  ASSERT_FALSE(items.ok());
  EXPECT_EQ(Message(items.status()), "no good");
  // Other errors are not deferred.
  EXPECT_EQ(LazyGenerator(absl::AbortedError("raised")).status().code(),
            absl::StatusCode::kAborted);
}

TEST(JinjaValueTest, ArithmeticIsPythons) {
  EXPECT_EQ(Calc(BinOp::kFloorDiv, Int(7), Int(-2)), "-4");
  EXPECT_EQ(Calc(BinOp::kMod, Int(7), Int(-2)), "-1");
  EXPECT_EQ(Calc(BinOp::kMod, Int(-7), Int(2)), "1");
  EXPECT_EQ(Calc(BinOp::kFloorDiv, Float(7.5), Int(2)), "3.0");
  EXPECT_EQ(Calc(BinOp::kMod, Float(-7.5), Int(2)), "0.5");
  EXPECT_EQ(Calc(BinOp::kDiv, Int(1), Int(2)), "0.5");
  EXPECT_EQ(Calc(BinOp::kDiv, Int(4), Int(2)), "2.0");
  EXPECT_EQ(Calc(BinOp::kPow, Int(2), Int(10)), "1024");
  EXPECT_EQ(Calc(BinOp::kPow, Int(2), Int(-1)), "0.5");
  EXPECT_EQ(Calc(BinOp::kAdd, Bool(true), Int(1)), "2");
  EXPECT_EQ(Calc(BinOp::kAdd, Int(1), Float(0.5)), "1.5");
  EXPECT_EQ(Calc(BinOp::kMul, String("ab"), Int(3)), "'ababab'");
  EXPECT_EQ(Calc(BinOp::kMul, Int(2), List({Int(1)})), "[1, 1]");
  EXPECT_EQ(Calc(BinOp::kMul, String("ab"), Int(-1)), "''");
  EXPECT_EQ(Calc(BinOp::kAdd, Tuple({Int(1)}), Tuple({Int(2)})), "(1, 2)");
  // markupsafe: a plain string added to a Markup one is escaped.
  EXPECT_EQ(Calc(BinOp::kAdd, String("<b>", true), String("<i>")),
            "Markup('<b>&lt;i&gt;')");
}

TEST(JinjaValueTest, ArithmeticErrorsArePythons) {
  EXPECT_EQ(Calc(BinOp::kAdd, String("a"), Int(1)),
            "error: can only concatenate str (not \"int\") to str");
  EXPECT_EQ(Calc(BinOp::kSub, List({}), List({})),
            "error: unsupported operand type(s) for -: 'list' and 'list'");
  EXPECT_EQ(Calc(BinOp::kPow, String("a"), Int(2)),
            "error: unsupported operand type(s) for ** or pow(): 'str' and "
            "'int'");
  EXPECT_EQ(Calc(BinOp::kFloorDiv, Int(1), Int(0)),
            "error: integer division or modulo by zero");
  EXPECT_EQ(Calc(BinOp::kMod, Int(1), Int(0)), "error: integer modulo by zero");
  EXPECT_EQ(Calc(BinOp::kDiv, Int(1), Int(0)), "error: division by zero");
  EXPECT_EQ(Calc(BinOp::kDiv, Float(1), Int(0)),
            "error: float division by zero");
  EXPECT_EQ(Calc(BinOp::kAdd, Int(std::numeric_limits<int64_t>::max()), Int(1)),
            "error: integer overflow (beyond 64 bits)");
  EXPECT_EQ(Calc(BinOp::kMod, String("%s"), Int(1)),
            "error: string formatting with % is not supported");
  EXPECT_EQ(Calc(BinOp::kAdd, Undefined("'x' is undefined"), Int(1)),
            "error: 'x' is undefined");
  EXPECT_EQ(Calc(BinOp::kMul, List({Int(1), Int(2)}), Int(600000)),
            "error: a list of more than 1000000 items");
}

TEST(JinjaValueTest, NestingIsBounded) {
  Value v = Int(0);
  for (int k = 1; k < kMaxValueDepth; ++k) v = List({v});
  EXPECT_EQ(DepthOf(v), kMaxValueDepth - 1);
  ASSERT_TRUE(MakeList({v}).ok());
  const absl::StatusOr<Value> deeper = MakeList({*MakeList({v})});
  ASSERT_FALSE(deeper.ok());
  EXPECT_EQ(Message(deeper.status()),
            "lists and dicts nested more than 256 levels deep");
}

TEST(JinjaValueTest, TypeNamesArePythons) {
  EXPECT_EQ(TypeName(None()), "NoneType");
  EXPECT_EQ(TypeName(Bool(true)), "bool");
  EXPECT_EQ(TypeName(Tuple({})), "tuple");
  EXPECT_EQ(TypeName(*MakeDictView({}, kDictItems)), "dict_items");
  EXPECT_EQ(TypeName(*MakeGenerator({})), "generator");
  EXPECT_EQ(ObjectTypeRepr(None()), "None");
  EXPECT_EQ(ObjectTypeRepr(Dict({})), "'dict object'");
}

TEST(JinjaValueTest, SetEntryKeepsThePositionOfAKey) {
  std::vector<std::pair<std::string, Value>> entries;
  SetEntry(&entries, "a", Int(1));
  SetEntry(&entries, "b", Int(2));
  SetEntry(&entries, "a", Int(3));
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_EQ(entries[0].first, "a");
  EXPECT_EQ(entries[0].second.i, 3);
  EXPECT_EQ(entries[1].first, "b");
}

}  // namespace
}  // namespace knapserve::jinja
