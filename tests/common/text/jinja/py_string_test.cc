// Tests of the template engine's Python str semantics
// (common/text/jinja/py_string.h). The expectations are what CPython 3.11
// prints for the same calls.
#include "common/text/jinja/py_string.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "common/text/jinja/errors.h"
#include "tests/testing/test_util.h"

namespace knapserve::jinja {
namespace {

using ::testing::ElementsAre;
using testing::Message;

std::string Repr(std::string_view s) {
  std::string out;
  AppendStringRepr(s, &out);
  return out;
}

TEST(JinjaPyStringTest, CaseMappingIsPythons) {
  // Full mappings: sharp s, ligatures; final sigma needs its neighbours.
  EXPECT_EQ(PyUpper("straße ﬁx"), "STRASSE FIX");
  EXPECT_EQ(PyLower("ΣΑΣ ΑΣ"), "σας ας");
  EXPECT_EQ(PyLower("\u0130"), "i\u0307");  // Dotted capital I.
  EXPECT_EQ(PyLower("ÀÉÎ"), "àéî");
  EXPECT_EQ(PyTitle("hello wORLD"), "Hello World");
  EXPECT_EQ(PyTitle("they're bill's"), "They'Re Bill'S");
  EXPECT_EQ(PyTitle("ßa"), "Ssa");
  EXPECT_EQ(PyCapitalize("hELLO wORLD"), "Hello world");
  EXPECT_EQ(PyCapitalize(""), "");
}

TEST(JinjaPyStringTest, IsLowerAndIsUpperNeedACasedCharacter) {
  EXPECT_TRUE(PyIsCase("abc1", /*upper=*/false));
  EXPECT_FALSE(PyIsCase("abC", /*upper=*/false));
  EXPECT_TRUE(PyIsCase("ÉCOLE 2", /*upper=*/true));
  EXPECT_FALSE(PyIsCase("123", /*upper=*/false));
  EXPECT_FALSE(PyIsCase("123", /*upper=*/true));
}

TEST(JinjaPyStringTest, StripTakesWhitespaceOrTheGivenCharacters) {
  EXPECT_EQ(PyStrip(" \t a b \n\u3000", nullptr, true, true), "a b");
  EXPECT_EQ(PyStrip("  a  ", nullptr, true, false), "a  ");
  EXPECT_EQ(PyStrip("  a  ", nullptr, false, true), "  a");
  const std::string chars = "xé";
  EXPECT_EQ(PyStrip("xéxHixéx", &chars, true, true), "Hi");
}

TEST(JinjaPyStringTest, SplitAndRsplit) {
  const std::string comma = ",";
  EXPECT_THAT(*PySplit("a,b,,c", &comma, -1, false),
              ElementsAre("a", "b", "", "c"));
  EXPECT_THAT(*PySplit("a,b,c", &comma, 1, true), ElementsAre("a,b", "c"));
  EXPECT_THAT(*PySplit(" a  b c ", nullptr, -1, false),
              ElementsAre("a", "b", "c"));
  EXPECT_THAT(*PySplit(" a  b c ", nullptr, 1, false),
              ElementsAre("a", "b c "));
  EXPECT_THAT(*PySplit(" a  b c ", nullptr, 1, true),
              ElementsAre(" a  b", "c"));
  EXPECT_THAT(*PySplit("   ", nullptr, -1, false), ElementsAre());
  const std::string empty;
  const auto refused = PySplit("abc", &empty, -1, false);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(Message(refused.status()), "empty separator");
}

TEST(JinjaPyStringTest, ReplaceCountsAndEmptyOld) {
  EXPECT_EQ(*PyReplace("aaa", "a", "b", 2), "bba");
  EXPECT_EQ(*PyReplace("aaa", "a", "bc", -1), "bcbcbc");
  EXPECT_EQ(*PyReplace("ab", "", "-", -1), "-a-b-");
  EXPECT_EQ(*PyReplace("ab", "", "-", 1), "-ab");
  EXPECT_EQ(*PyReplace("éé", "", "|", -1), "|é|é|");
}

TEST(JinjaPyStringTest, ReplaceIsCappedAtTheOutputLimit) {
  const std::string big(kMaxOutputBytes / 2 + 1, 'a');
  const auto result = PyReplace(big, "a", "aa", -1);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(Message(result.status()), "the output would be larger than 16 MiB");
}

TEST(JinjaPyStringTest, HtmlEscapeIsMarkupsafes) {
  EXPECT_EQ(HtmlEscape("<a href=\"x\">'&'</a>"),
            "&lt;a href=&#34;x&#34;&gt;&#39;&amp;&#39;&lt;/a&gt;");
}

TEST(JinjaPyStringTest, FloatReprIsPythons) {
  EXPECT_EQ(PyFloatRepr(1.0), "1.0");
  EXPECT_EQ(PyFloatRepr(0.1), "0.1");
  EXPECT_EQ(PyFloatRepr(-0.0), "-0.0");
  EXPECT_EQ(PyFloatRepr(0.0001), "0.0001");
  EXPECT_EQ(PyFloatRepr(2.5e-5), "2.5e-05");
  EXPECT_EQ(PyFloatRepr(1.5e-7), "1.5e-07");
  EXPECT_EQ(PyFloatRepr(1e15), "1000000000000000.0");
  EXPECT_EQ(PyFloatRepr(123456789012345.0), "123456789012345.0");
  EXPECT_EQ(PyFloatRepr(1e16), "1e+16");
  EXPECT_EQ(PyFloatRepr(12345678901234567.0), "1.2345678901234568e+16");
  EXPECT_EQ(PyFloatRepr(1e22), "1e+22");
  EXPECT_EQ(PyFloatRepr(std::numeric_limits<double>::quiet_NaN()), "nan");
  EXPECT_EQ(PyFloatRepr(-std::numeric_limits<double>::infinity()), "-inf");
}

TEST(JinjaPyStringTest, StringReprQuotesAndEscapesAsPython) {
  EXPECT_EQ(Repr("it's"), "\"it's\"");
  EXPECT_EQ(Repr("a\"b"), "'a\"b'");
  EXPECT_EQ(Repr("it's \"x\""), "'it\\'s \"x\"'");
  EXPECT_EQ(Repr("\n\t\x01\x7f"), "'\\n\\t\\x01\\x7f'");
  EXPECT_EQ(Repr("back\\slash"), "'back\\\\slash'");
  // Printable characters stay; the others are escaped by their size.
  EXPECT_EQ(Repr("é😀"), "'é😀'");
  EXPECT_EQ(Repr("\u0085"), "'\\x85'");
  EXPECT_EQ(Repr("\u200b"), "'\\u200b'");
  EXPECT_EQ(Repr("\U000E0001"), "'\\U000e0001'");
  EXPECT_EQ(QuotedName("messages"), "'messages'");
}

TEST(JinjaPyStringTest, ParsePyIntIsPythonsInt) {
  EXPECT_EQ(ParsePyInt(" 42 ", 10), 42);
  EXPECT_EQ(ParsePyInt("-0x1F", 16), -31);
  EXPECT_EQ(ParsePyInt("1F", 16), 31);
  EXPECT_EQ(ParsePyInt("101", 2), 5);
  EXPECT_EQ(ParsePyInt("1_000", 10), 1000);
  EXPECT_EQ(ParsePyInt("1__0", 10), std::nullopt);
  EXPECT_EQ(ParsePyInt("_1", 10), std::nullopt);
  EXPECT_EQ(ParsePyInt("1_", 10), std::nullopt);
  EXPECT_EQ(ParsePyInt("12", 2), std::nullopt);
  EXPECT_EQ(ParsePyInt("1.5", 10), std::nullopt);
  EXPECT_EQ(ParsePyInt("", 10), std::nullopt);
  EXPECT_EQ(ParsePyInt("9223372036854775807", 10),
            std::numeric_limits<int64_t>::max());
  EXPECT_EQ(ParsePyInt("9223372036854775808", 10), std::nullopt);
}

TEST(JinjaPyStringTest, ParsePyFloatIsPythonsFloat) {
  EXPECT_EQ(ParsePyFloat(" 1.5 "), 1.5);
  EXPECT_EQ(ParsePyFloat("1_0.5"), 10.5);
  EXPECT_EQ(ParsePyFloat("-2e3"), -2000.0);
  EXPECT_EQ(ParsePyFloat("abc"), std::nullopt);
  EXPECT_EQ(ParsePyFloat("1.5x"), std::nullopt);
  EXPECT_EQ(ParsePyFloat("  "), std::nullopt);
}

TEST(JinjaPyStringTest, CodePoints) {
  EXPECT_EQ(CodePointCount("héllo😀"), 6u);
  EXPECT_EQ(Decode("aé😀"), std::u32string(U"aé😀"));
  EXPECT_EQ(Encode(U"aé😀"), "aé😀");
  EXPECT_TRUE(IsPySpace(U'\u3000'));
  EXPECT_TRUE(IsPySpace(U'\x1c'));
  EXPECT_FALSE(IsPySpace(U'\u200b'));
  EXPECT_EQ(HexValue('f'), 15);
  EXPECT_EQ(HexValue('G'), -1);
}

}  // namespace
}  // namespace knapserve::jinja
