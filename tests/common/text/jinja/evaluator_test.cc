// Tests of the template engine's evaluator (common/text/jinja/evaluator.h):
// loops and the loop variable, Jinja's scoping and namespace(), block set,
// the globals, and how render errors are reported. The rendered texts are
// what jinja2 3.1 renders with transformers' environment (trim_blocks,
// lstrip_blocks, loopcontrols, the immutable sandbox); the error messages are
// this engine's own (chat_template_test.cc compares them with jinja2's).
#include "common/text/jinja/evaluator.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/text/jinja/json.h"
#include "common/text/jinja/parser.h"
#include "nlohmann/json.hpp"
#include "tests/testing/test_util.h"

namespace knapserve::jinja {
namespace {

using ::testing::HasSubstr;
using testing::Message;

// `source` rendered with `context` (JSON), or "error: <message>" (parse
// errors say "parse error: ").
std::string RenderText(std::string_view source,
                       std::string_view context = "{}") {
  const auto body = ParseTemplate(source);
  if (!body.ok()) return "parse error: " + Message(body.status());
  const auto values = FromJson(nlohmann::ordered_json::parse(context));
  EXPECT_TRUE(values.ok()) << values.status();
  if (!values.ok()) return "";
  const auto out = Render(*body, *values->dict);
  if (!out.ok()) {
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
    return "error: " + Message(out.status());
  }
  return *out;
}

constexpr std::string_view kXs = R"({"xs": [1, 2, 3], "e": []})";

TEST(JinjaEvaluatorTest, LoopVariables) {
  EXPECT_EQ(RenderText("{% for x in xs %}{{ loop.index }}{{ loop.index0 }}"
                       "{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}"
                       "{{ loop.last }}{{ loop.length }};{% endfor %}",
                       kXs),
            "1032TrueFalse3;2121FalseFalse3;3210FalseTrue3;");
  EXPECT_EQ(
      RenderText("{% for x in xs %}[{{ loop.previtem }}|{{ loop.nextitem }}]"
                 "{% endfor %}",
                 kXs),
      "[|2][1|3][2|]");
  EXPECT_EQ(RenderText(
                "{% for x in xs %}{{ loop.cycle('a', 'b') }}{% endfor %}", kXs),
            "aba");
  EXPECT_EQ(RenderText("{% for x in xs %}{{ loop.depth }}{% endfor %}", kXs),
            "111");
}

TEST(JinjaEvaluatorTest, LoopFilterElseBreakContinue) {
  // The loop's `if` filters before loop.length and loop.index are counted.
  EXPECT_EQ(RenderText("{% for x in xs if x != 2 %}{{ x }}:{{ loop.index }}/"
                       "{{ loop.length }} {% endfor %}",
                       kXs),
            "1:1/2 3:2/2 ");
  EXPECT_EQ(RenderText("{% for x in e %}never{% else %}empty{% endfor %}", kXs),
            "empty");
  EXPECT_EQ(
      RenderText("{% for x in xs if x > 5 %}never{% else %}none{% endfor %}",
                 kXs),
      "none");
  EXPECT_EQ(
      RenderText("{% for x in xs %}{% if x == 1 %}{% continue %}{% endif %}"
                 "{{ x }}{% if x == 2 %}{% break %}{% endif %}{% endfor %}",
                 kXs),
      "2");
  EXPECT_EQ(RenderText("{% for a, b in [(1, 'x'), (2, 'y')] %}{{ a }}{{ b }}"
                       "{% endfor %}"),
            "1x2y");
  EXPECT_EQ(RenderText("{% for a, b in [(1, 2, 3)] %}{% endfor %}"),
            "error: line 1: too many values to unpack (expected 2)");
}

TEST(JinjaEvaluatorTest, ScopingAndNamespace) {
  // A set inside a loop is gone after it; a namespace keeps its changes.
  EXPECT_EQ(RenderText("{% set n = 0 %}{% for x in xs %}{% set n = n + x %}"
                       "{% endfor %}{{ n }}",
                       kXs),
            "0");
  EXPECT_EQ(RenderText("{% set ns = namespace(n=0) %}{% for x in xs %}"
                       "{% set ns.n = ns.n + x %}{% endfor %}{{ ns.n }}",
                       kXs),
            "6");
  EXPECT_EQ(
      RenderText("{% set ns = namespace({'a': 1}, b=2) %}{{ ns.a }}{{ ns.b }}"
                 "{{ ns.c is defined }}"),
      "12False");
  EXPECT_EQ(RenderText("{% set x = 1 %}{% set ns = namespace() %}"
                       "{% set ns.inner = namespace() %}"),
            "error: line 1: a namespace cannot hold a namespace");
  EXPECT_EQ(RenderText("{% set x = 1 %}{% set x.y = 2 %}"),
            "error: line 1: cannot assign attribute 'y' on 'int': not a "
            "namespace object");
  // Variables of the context are shadowed, not changed.
  EXPECT_EQ(
      RenderText("{% for x in xs %}{% set xs = 0 %}{% endfor %}{{ xs }}", kXs),
      "[1, 2, 3]");
}

TEST(JinjaEvaluatorTest, BlockSetAndGeneration) {
  EXPECT_EQ(RenderText("{% set x | trim | upper %}  hi {{ 1 + 1 }} {% endset %}"
                       "[{{ x }}]"),
            "[HI 2]");
  EXPECT_EQ(RenderText("a{% generation %}b{% set y = 1 %}{% endgeneration %}"
                       "{{ y is defined }}"),
            "abFalse");
}

TEST(JinjaEvaluatorTest, MacrosAreRefusedWhenParsing) {
  EXPECT_EQ(RenderText("{% macro greet(name) %}hi {{ name }}{% endmacro %}"
                       "{{ greet('x') }}"),
            "parse error: line 1, column 4: {% macro %} is not supported");
  EXPECT_EQ(RenderText("{{ greet('x') }}"),
            "error: line 1: unknown function 'greet'");
  EXPECT_EQ(RenderText("{{ cycler(1) }}"),
            "error: line 1: the function 'cycler' is not supported");
}

TEST(JinjaEvaluatorTest, Globals) {
  EXPECT_EQ(RenderText("{{ range(3)|list }}{{ range(1, 7, 2)|list }}"
                       "{{ range(3, 0, -1)|list }}"),
            "[0, 1, 2][1, 3, 5][3, 2, 1]");
  EXPECT_EQ(RenderText("{{ range(100001) }}"),
            "error: line 1: range too big: the sandbox blocks ranges larger "
            "than MAX_RANGE (100000)");
  EXPECT_EQ(RenderText("{{ dict(a=1, b='x') }}"), "{'a': 1, 'b': 'x'}");
  EXPECT_EQ(RenderText("{{ strftime_now('%%') }}"), "%");
  // raise_exception's message is the whole error, without a line.
  EXPECT_EQ(RenderText("a\n{{ raise_exception('Roles must alternate') }}"),
            "error: Roles must alternate");
}

TEST(JinjaEvaluatorTest, ExpressionsAndUndefined) {
  EXPECT_EQ(RenderText("{{ 1 < 2 < 3 }}{{ 3 > 2 > 2 }}{{ 'a' ~ 1 ~ none }}"),
            "TrueFalsea1None");
  EXPECT_EQ(
      RenderText("{{ 0 or 'x' }}{{ 1 and [] }}{{ 'yes' if e else 'no' }}", kXs),
      "x[]no");
  EXPECT_EQ(RenderText("[{{ missing }}][{{ missing.x is defined }}]"),
            "error: line 1: 'missing' is undefined");
  EXPECT_EQ(RenderText("[{{ missing }}][{{ xs.nope }}][{{ xs[7] }}]", kXs),
            "[][][]");
  EXPECT_EQ(RenderText("{{ 'x' if false }}|{{ ('x' if false) is defined }}"),
            "|False");
}

TEST(JinjaEvaluatorTest, RenderErrorsSayTheLine) {
  EXPECT_EQ(RenderText("ok\n\n{{ 1 + 'a' }}"),
            "error: line 3: unsupported operand type(s) for +: 'int' and "
            "'str'");
  EXPECT_EQ(RenderText("{% for x in xs %}\n{{ x.y.z }}{% endfor %}", kXs),
            "error: line 2: 'int object' has no attribute 'y'");
  EXPECT_EQ(RenderText("{{ xs() }}", kXs),
            "error: line 1: 'list' object is not callable");
  EXPECT_EQ(RenderText("{{ namespace() }}"),
            "error: line 1: cannot print a namespace object");
}

TEST(JinjaEvaluatorTest, LimitsAreErrors) {
  EXPECT_EQ(RenderText("{% for i in range(2000) %}{% for j in range(1000) %}"
                       "{% endfor %}{% endfor %}"),
            "error: line 1: more than 100000 loop iterations");
  // The cap counts every loop of the render: exactly 100,000 pass, one more
  // in a second loop does not.
  EXPECT_EQ(RenderText("{% for i in range(100000) %}{% endfor %}ok"), "ok");
  EXPECT_EQ(RenderText("{% for i in range(100000) %}{% endfor %}"
                       "{% for j in [1] %}{% endfor %}"),
            "error: line 1: more than 100000 loop iterations");
  // Reading a 9 MB string 35 times is over the 256 MiB of strings a render
  // may yield; reading it 25 times is not.
  EXPECT_EQ(
      RenderText("{% set s = 'x' * 9000000 %}{% for i in range(35) %}"
                 "{% set t = s %}{% endfor %}"),
      "error: line 1: the strings built would be more than 256 MiB in all");
  EXPECT_EQ(RenderText("{% set s = 'x' * 9000000 %}{% for i in range(25) %}"
                       "{% set t = s %}{% endfor %}ok"),
            "ok");
  EXPECT_THAT(RenderText("{% set s = 'x' * 9000000 %}{{ s }}{{ s }}"),
              HasSubstr("the output would be larger than 16 MiB"));
}

}  // namespace
}  // namespace knapserve::jinja
