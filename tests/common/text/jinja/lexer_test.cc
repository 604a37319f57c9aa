// Tests of the template engine's lexer (common/text/jinja/lexer.h): the
// tokens of small templates, Jinja's whitespace control (trim_blocks,
// lstrip_blocks, - and +), literals, and errors with their line and column.
#include "common/text/jinja/lexer.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/testing/test_util.h"

namespace knapserve::jinja {
namespace {

using testing::Message;

// The tokens of `source` (normalized first, as ParseTemplate does), one
// word each: data(text) {{ }} {% %} name(x) str(x) int(1) float(1.5) op(+)
// eof; or "error: <message>".
std::string Tokens(std::string_view source) {
  const std::string normalized = NormalizeNewlines(source);
  const SourceMap map(normalized);
  const absl::StatusOr<std::vector<Token>> tokens = Lex(normalized, map);
  if (!tokens.ok()) return "error: " + Message(tokens.status());
  std::string out;
  for (const Token& t : *tokens) {
    if (!out.empty()) out += ' ';
    switch (t.type) {
      case Tok::kData:
        absl::StrAppend(&out, "data(", t.text, ")");
        break;
      case Tok::kVarBegin:
        out += "{{";
        break;
      case Tok::kVarEnd:
        out += "}}";
        break;
      case Tok::kBlockBegin:
        out += "{%";
        break;
      case Tok::kBlockEnd:
        out += "%}";
        break;
      case Tok::kName:
        absl::StrAppend(&out, "name(", t.text, ")");
        break;
      case Tok::kString:
        absl::StrAppend(&out, "str(", t.text, ")");
        break;
      case Tok::kInt:
        absl::StrAppend(&out, "int(", t.int_value, ")");
        break;
      case Tok::kFloat:
        absl::StrAppend(&out, "float(", t.float_value, ")");
        break;
      case Tok::kOp:
        absl::StrAppend(&out, "op(", t.text, ")");
        break;
      case Tok::kEof:
        out += "eof";
        break;
    }
  }
  return out;
}

TEST(JinjaLexerTest, TokensOfASmallTemplate) {
  EXPECT_EQ(Tokens("a{{ x.y | f(1, 'b') }}c{% if n >= 2.5 %}d{% endif %}"),
            "data(a) {{ name(x) op(.) name(y) op(|) name(f) op(() int(1) "
            "op(,) str(b) op()) }} data(c) {% name(if) name(n) op(>=) "
            "float(2.5) %} data(d) {% name(endif) %} eof");
  EXPECT_EQ(Tokens("{{ a // b ** c ~ d != e }}"),
            "{{ name(a) op(//) name(b) op(**) name(c) op(~) name(d) op(!=) "
            "name(e) }} eof");
  EXPECT_EQ(Tokens(""), "eof");
  EXPECT_EQ(Tokens("{ not a tag }"), "data({ not a tag }) eof");
}

TEST(JinjaLexerTest, PositionsAreOffsetsInTheSource) {
  const std::string source = "ab{{ x }}";
  const SourceMap map(source);
  const auto tokens = Lex(source, map);
  ASSERT_TRUE(tokens.ok());
  ASSERT_EQ(tokens->size(), 5u);
  EXPECT_EQ((*tokens)[0].offset, 0u);  // ab
  EXPECT_EQ((*tokens)[1].offset, 2u);  // {{
  EXPECT_EQ((*tokens)[2].offset, 5u);  // x
  EXPECT_EQ((*tokens)[4].offset, source.size());
}

TEST(JinjaLexerTest, WhitespaceControl) {
  // trim_blocks: the newline after a block tag goes; lstrip_blocks: the
  // indentation before it.
  EXPECT_EQ(Tokens("a\n  {% if x %}\nb"),
            "data(a\n) {% name(if) name(x) %} data(b) eof");
  // Not for {{ }}, nor for a tag that does not start its line.
  EXPECT_EQ(Tokens("  {{ x }}\nb"), "data(  ) {{ name(x) }} data(\nb) eof");
  EXPECT_EQ(Tokens("a {% if x %}\nb"),
            "data(a ) {% name(if) name(x) %} data(b) eof");
  // - strips all whitespace, + keeps it.
  EXPECT_EQ(Tokens("a \n {{- x -}} \n b"), "data(a) {{ name(x) }} data(b) eof");
  EXPECT_EQ(Tokens("  {%+ if x +%}\nb"),
            "data(  ) {% name(if) name(x) %} data(\nb) eof");
  // Comments go with their whitespace rules; raw bodies are data.
  EXPECT_EQ(Tokens("a{# c #}\nb"), "data(a) data(b) eof");
  EXPECT_EQ(Tokens("{% raw %}{{ x }}{% endraw %}"), "data({{ x }}) eof");
}

TEST(JinjaLexerTest, NewlinesAreNormalized) {
  EXPECT_EQ(NormalizeNewlines("a\r\nb\rc\n"), "a\nb\nc");
  EXPECT_EQ(NormalizeNewlines("a\n\n"), "a\n");
  EXPECT_EQ(NormalizeNewlines(""), "");
}

TEST(JinjaLexerTest, Literals) {
  EXPECT_EQ(Tokens(R"({{ '\x41\u00e9\n' "q\"" 'a' 'b' }})"),
            "{{ str(Aé\n) str(q\") str(a) str(b) }} eof");
  EXPECT_EQ(Tokens("{{ 1_000 0x1F 0o17 0b101 1.5e3 2e-1 007 }}"),
            "{{ int(1000) int(31) int(15) int(5) float(1500) float(0.2) int(0) "
            "int(7) }} eof");
  // x.0.1 is x[0][1], not x[0.1].
  EXPECT_EQ(Tokens("{{ x.0.1 }}"),
            "{{ name(x) op(.) int(0) op(.) int(1) }} eof");
  EXPECT_EQ(Tokens("{{ naïve }}"), "{{ name(naïve) }} eof");
}

TEST(JinjaLexerTest, ErrorsSayLineAndColumn) {
  EXPECT_EQ(Tokens("ab\n{{ x $ }}"),
            "error: line 2, column 6: unexpected character '$'");
  // Columns count characters, not bytes.
  EXPECT_EQ(Tokens("é{{ ¤ }}"),
            "error: line 1, column 5: unexpected character '¤'");
  EXPECT_EQ(Tokens("x\n  {{ a"),
            "error: line 2, column 3: unterminated '{{' tag (no matching "
            "'}}')");
  EXPECT_EQ(Tokens("{% if x"),
            "error: line 1, column 1: unterminated '{%' tag (no matching "
            "'%}')");
  EXPECT_EQ(Tokens("{# never closed"),
            "error: line 1, column 1: unterminated comment (no matching '#}')");
  EXPECT_EQ(Tokens("{{ 'abc }}"),
            "error: line 1, column 4: unterminated string literal");
  EXPECT_EQ(Tokens("{{ (a] }}"),
            "error: line 1, column 6: unexpected ']', expected ')'");
  EXPECT_EQ(Tokens("{{ a) }}"), "error: line 1, column 5: unexpected ')'");
  EXPECT_EQ(Tokens("{{ 99999999999999999999 }}"),
            "error: line 1, column 4: integer literal too large");
  EXPECT_EQ(Tokens(R"({{ '\u12' }})"),
            "error: line 1, column 5: truncated \\u escape");
  EXPECT_EQ(Tokens("{% raw %}x"),
            "error: line 1, column 1: unterminated {% raw %} (no matching {% "
            "endraw %})");
}

TEST(JinjaLexerTest, SourceMapLines) {
  const SourceMap map("a\nbc\n\nd");
  EXPECT_EQ(map.Line(0), 1);
  EXPECT_EQ(map.Line(2), 2);
  EXPECT_EQ(map.Line(5), 3);
  EXPECT_EQ(map.Line(6), 4);
  EXPECT_EQ(Message(map.Error(3, "here")), "line 2, column 2: here");
}

}  // namespace
}  // namespace knapserve::jinja
