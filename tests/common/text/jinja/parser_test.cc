// Tests of the template engine's parser (common/text/jinja/parser.h): the
// trees of expressions (Jinja's operator precedence) and statements, and
// the syntax errors with their line and column.
#include "common/text/jinja/parser.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/testing/test_util.h"

namespace knapserve::jinja {
namespace {

using testing::Message;

// `e` as an S-expression: constants as repr, names bare, operators first.
std::string Dump(const Expr* e) {
  if (e == nullptr) return "_";
  auto all = [&](size_t first) {
    std::string out;
    for (size_t k = first; k < e->args.size(); ++k) {
      absl::StrAppend(&out, " ", Dump(e->args[k].get()));
    }
    for (const auto& [key, value] : e->kwargs) {
      absl::StrAppend(&out, " ", key, "=", Dump(value.get()));
    }
    return out;
  };
  switch (e->kind) {
    case ExprKind::kConst: {
      std::string out;
      EXPECT_TRUE(AppendRepr(e->value, &out).ok());
      return out;
    }
    case ExprKind::kName:
      return e->name;
    case ExprKind::kList:
      return "(list" + all(0) + ")";
    case ExprKind::kTuple:
      return "(tuple" + all(0) + ")";
    case ExprKind::kDict:
      return "(dict" + all(0) + ")";
    case ExprKind::kGetattr:
      return absl::StrCat("(. ", Dump(e->args[0].get()), " ", e->name, ")");
    case ExprKind::kGetitem:
      return "([]" + all(0) + ")";
    case ExprKind::kSlice:
      return "(slice" + all(0) + ")";
    case ExprKind::kCall:
      return "(call" + all(0) + ")";
    case ExprKind::kFilter:
      return absl::StrCat("(|", e->name, all(0), ")");
    case ExprKind::kTest:
      return absl::StrCat("(is-", e->name, all(0), ")");
    case ExprKind::kNot:
      return "(not" + all(0) + ")";
    case ExprKind::kNeg:
      return "(neg" + all(0) + ")";
    case ExprKind::kPos:
      return "(pos" + all(0) + ")";
    case ExprKind::kBinary:
      return absl::StrCat("(", std::string(BinOpText(e->op)), all(0), ")");
    case ExprKind::kConcat:
      return "(~" + all(0) + ")";
    case ExprKind::kAnd:
      return "(and" + all(0) + ")";
    case ExprKind::kOr:
      return "(or" + all(0) + ")";
    case ExprKind::kCompare: {
      std::string out = "(cmp " + Dump(e->args[0].get());
      for (size_t k = 0; k < e->compare_ops.size(); ++k) {
        absl::StrAppend(&out, " ",
                        std::string(CompareOpText(e->compare_ops[k])), " ",
                        Dump(e->args[k + 1].get()));
      }
      return out + ")";
    }
    case ExprKind::kCondExpr:
      return "(if" + all(0) + ")";
  }
  return "?";
}

// The tree of the expression in "{{ <expr> }}", or "error: <message>".
std::string ParseExpr(std::string_view expr) {
  const auto body = ParseTemplate("{{ " + std::string(expr) + " }}");
  if (!body.ok()) return "error: " + Message(body.status());
  if (body->size() != 1 || (*body)[0].kind != NodeKind::kOutput) {
    return "not one output";
  }
  return Dump((*body)[0].expr.get());
}

// The message of the error parsing `source` gives ("" if it parses).
std::string ParseError(std::string_view source) {
  const auto body = ParseTemplate(source);
  EXPECT_FALSE(body.ok()) << source;
  if (body.ok()) return "";
  EXPECT_EQ(body.status().code(), absl::StatusCode::kInvalidArgument);
  return Message(body.status());
}

TEST(JinjaParserTest, ArithmeticPrecedence) {
  EXPECT_EQ(ParseExpr("1 + 2 * 3 ** 2"), "(+ 1 (* 2 (** or pow() 3 2)))");
  EXPECT_EQ(ParseExpr("1 - 2 - 3"), "(- (- 1 2) 3)");
  EXPECT_EQ(ParseExpr("2 ** 3 ** 2"), "(** or pow() (** or pow() 2 3) 2)");
  EXPECT_EQ(ParseExpr("a // b % c / d"), "(/ (% (// a b) c) d)");
  // ~ binds tighter than + and -, looser than * and /.
  EXPECT_EQ(ParseExpr("a ~ b + c"), "(+ (~ a b) c)");
  EXPECT_EQ(ParseExpr("a + b ~ c * d ~ e"), "(+ a (~ b (* c d) e))");
  // A filter after a unary minus applies to the negated value, and ** binds
  // looser than unary minus, as in Jinja: (-x)|abs, (-2) ** 2.
  EXPECT_EQ(ParseExpr("-x|abs"), "(|abs (neg x))");
  EXPECT_EQ(ParseExpr("-2 ** 2"), "(** or pow() (neg 2) 2)");
}

TEST(JinjaParserTest, LogicAndComparisons) {
  EXPECT_EQ(ParseExpr("not a == b and c or d"),
            "(or (and (not (cmp a == b)) c) d)");
  EXPECT_EQ(ParseExpr("a or b and c"), "(or a (and b c))");
  EXPECT_EQ(ParseExpr("1 < x <= 3"), "(cmp 1 < x <= 3)");
  EXPECT_EQ(ParseExpr("a not in b"), "(cmp a not in b)");
  EXPECT_EQ(ParseExpr("not not a"), "(not (not a))");
  EXPECT_EQ(ParseExpr("a if b else c if d"), "(if a b (if c d _))");
}

TEST(JinjaParserTest, FiltersTestsAndPostfix) {
  EXPECT_EQ(ParseExpr("x.y[0](1, k=2) | join(', ') | upper"),
            "(|upper (|join (call ([] (. x y) 0) 1 k=2) ', '))");
  EXPECT_EQ(ParseExpr("x is defined"), "(is-defined x)");
  EXPECT_EQ(ParseExpr("x is not none"), "(not (is-none x))");
  EXPECT_EQ(ParseExpr("x is divisibleby 3"), "(is-divisibleby x 3)");
  EXPECT_EQ(ParseExpr("x is sameas(y) and z"), "(and (is-sameas x y) z)");
  EXPECT_EQ(ParseExpr("x[1:-1]"), "([] x (slice 1 (neg 1) _))");
  EXPECT_EQ(ParseExpr("x[::2]"), "([] x (slice _ _ 2))");
  EXPECT_EQ(ParseExpr("x.0"), "([] x 0)");
  EXPECT_EQ(ParseExpr("[1, (2,), {'a': ()}]"),
            "(list 1 (tuple 2) (dict 'a' (tuple)))");
  EXPECT_EQ(ParseExpr("'a' 'b' ~ true ~ None"), "(~ 'ab' True None)");
}

TEST(JinjaParserTest, Statements) {
  const auto body = ParseTemplate(
      "{% for k, v in d.items() if v %}{{ k }}{% else %}none{% endfor %}"
      "{% set ns.count = 1 %}"
      "{% if a %}1{% elif b %}2{% else %}3{% endif %}"
      "{% set block | trim %} x {% endset %}");
  ASSERT_TRUE(body.ok()) << body.status();
  ASSERT_EQ(body->size(), 4u);
  const Node& loop = (*body)[0];
  EXPECT_EQ(loop.kind, NodeKind::kFor);
  EXPECT_TRUE(loop.target.tuple);
  EXPECT_EQ(loop.target.names, (std::vector<std::string>{"k", "v"}));
  EXPECT_EQ(Dump(loop.expr.get()), "(call (. d items))");
  ASSERT_EQ(loop.conditions.size(), 1u);
  EXPECT_EQ(Dump(loop.conditions[0].get()), "v");
  ASSERT_EQ(loop.bodies.size(), 1u);
  EXPECT_EQ(loop.bodies[0].size(), 1u);
  ASSERT_EQ(loop.else_body.size(), 1u);
  EXPECT_EQ(loop.else_body[0].text, "none");
  const Node& set = (*body)[1];
  EXPECT_EQ(set.kind, NodeKind::kSet);
  EXPECT_EQ(set.target.names, (std::vector<std::string>{"ns"}));
  EXPECT_EQ(set.target.ns_attr, "count");
  const Node& branch = (*body)[2];
  EXPECT_EQ(branch.kind, NodeKind::kIf);
  EXPECT_EQ(branch.conditions.size(), 2u);
  EXPECT_EQ(branch.bodies.size(), 2u);
  EXPECT_EQ(branch.else_body.size(), 1u);
  const Node& block = (*body)[3];
  EXPECT_EQ(block.kind, NodeKind::kSetBlock);
  ASSERT_EQ(block.filters.size(), 1u);
  EXPECT_EQ(Dump(block.filters[0].get()), "(|trim _)");
}

TEST(JinjaParserTest, LinesOfNodes) {
  const auto body = ParseTemplate("a\n{{ x }}\n\n{% if y %}{% endif %}");
  ASSERT_TRUE(body.ok());
  ASSERT_EQ(body->size(), 4u);
  EXPECT_EQ((*body)[1].line, 2);
  EXPECT_EQ((*body)[1].expr->line, 2);
  EXPECT_EQ((*body)[3].line, 4);
}

TEST(JinjaParserTest, SyntaxErrorsSayWhatAndWhere) {
  EXPECT_EQ(ParseError("{% for x in %}"),
            "line 1, column 13: expected an expression, got end of statement "
            "block ('%}')");
  EXPECT_EQ(ParseError("{% for x y %}"),
            "line 1, column 10: expected 'in', got 'y'");
  EXPECT_EQ(ParseError("a\n{{ 1 + }}"),
            "line 2, column 8: unexpected end of print statement ('}}')");
  EXPECT_EQ(ParseError("{% if x %}\nyes"),
            "line 1, column 4: {% if %} is not closed: expected {% elif %} or "
            "{% else %} or {% endif %} before the end of the template");
  EXPECT_EQ(ParseError("{% endfor %}"),
            "line 1, column 4: unexpected {% endfor %} (no open block it could "
            "close)");
  EXPECT_EQ(ParseError("{% break %}"),
            "line 1, column 4: {% break %} outside of a for loop");
  EXPECT_EQ(ParseError("{{ f(a=1, 2) }}"),
            "line 1, column 5: invalid syntax for function call expression (a "
            "positional argument after a keyword one)");
  EXPECT_EQ(ParseError("{% set (a) = 1 %}{% set a.b %}{% endset %}"),
            "line 1, column 21: a block {% set %} must assign to one name");
  EXPECT_EQ(ParseError("{% set 1 = 2 %}"),
            "line 1, column 8: can only assign to names (or a namespace "
            "attribute, or a tuple of names)");
  EXPECT_EQ(ParseError("{{ x is defined is none }}"),
            "line 1, column 17: you cannot chain multiple tests with 'is'");
  EXPECT_EQ(ParseError("é\xff"), "line 1, column 2: not valid UTF-8");
}

TEST(JinjaParserTest, UnsupportedConstructsAreNamed) {
  EXPECT_EQ(ParseError("{% macro m() %}x{% endmacro %}"),
            "line 1, column 4: {% macro %} is not supported");
  EXPECT_EQ(ParseError("{% include 'x' %}"),
            "line 1, column 4: {% include %} is not supported");
  EXPECT_EQ(ParseError("{{ x | nope }}"),
            "line 1, column 8: unknown filter 'nope'");
  EXPECT_EQ(ParseError("{{ x is nope }}"),
            "line 1, column 9: unknown test 'nope'");
  EXPECT_EQ(ParseError("{% frobnicate %}"),
            "line 1, column 4: unknown tag 'frobnicate'");
  EXPECT_EQ(ParseError("{% for x in y recursive %}{% endfor %}"),
            "line 1, column 15: recursive for loops are not supported");
  EXPECT_EQ(ParseError("{{ f(*args) }}"),
            "line 1, column 6: *args and **kwargs in calls are not supported");
}

TEST(JinjaParserTest, NestingIsBounded) {
  std::string deep;
  for (int k = 0; k < 150; ++k) deep += "(";
  deep += "1";
  for (int k = 0; k < 150; ++k) deep += ")";
  EXPECT_THAT(ParseExpr(deep),
              ::testing::EndsWith("expression nested more than 100 levels "
                                  "deep"));
  std::string blocks;
  for (int k = 0; k < 101; ++k) blocks += "{% if x %}";
  EXPECT_EQ(ParseError(blocks),
            "line 1, column 1004: blocks nested more than 100 levels deep");
}

}  // namespace
}  // namespace knapserve::jinja
