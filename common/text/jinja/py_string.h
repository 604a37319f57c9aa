// Python's str semantics for the template engine: what str.lower(),
// str.split(), repr(str), float.__repr__, int(text, base) and markupsafe's
// escape do, on UTF-8 strings, so a template renders byte for byte what
// jinja2 renders. Internal to the template engine (common/text/jinja/, the
// renderer behind common/text/chat_template.h); other code uses ChatTemplate
// or common/text/unicode_util.h.
//
// Strings are valid UTF-8 in std::string / std::string_view (the engine
// checks its inputs); "character" means code point, as in Python. Case
// mappings are utf8proc's simple ones plus Python's full mappings for the
// characters people meet (sharp s, the Latin ligatures, dotted capital I,
// final sigma); Python has a few more, for rare Greek and Armenian letters.
//
// Every function is pure (results are new strings owned by the caller) and
// safe to call from any thread. The StatusOr ones fail with the engine's
// unlocated InvalidArgument problems (errors.h).
#ifndef KNAPSERVE_COMMON_TEXT_JINJA_PY_STRING_H_
#define KNAPSERVE_COMMON_TEXT_JINJA_PY_STRING_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace knapserve::jinja {

// ---- Characters.

// '0' to '9'.
bool IsDigit(char c);
// The value of the hexadecimal digit `c` (either case), or -1.
int HexValue(char c);
// str.isspace() for one character.
bool IsPySpace(char32_t c);
// Whether `c` is cased (lower, upper or title case).
bool IsCased(char32_t c);
// str.isprintable() for one character.
bool IsPrintable(char32_t c);

// ---- Code points.

// The code points of `s`, and back.
std::u32string Decode(std::string_view s);
std::string Encode(std::u32string_view cps);
// len(s): the number of code points.
size_t CodePointCount(std::string_view s);

// ---- Case mapping.

// Appends the upper case of `c` (its title case if `title`), which may be
// several characters ("ß" -> "SS" / "Ss").
void AppendUpper(char32_t c, bool title, std::string* out);
// Appends the lower case of cps[i] (it needs its neighbours for final sigma).
void AppendLower(std::u32string_view cps, size_t i, std::string* out);
// str.lower(), str.upper().
std::string PyLower(std::string_view s);
std::string PyUpper(std::string_view s);
// str.title(): cased runs start with title case, the rest is lower case.
std::string PyTitle(std::string_view s);
// str.capitalize(): the first character in title case, the rest lower.
std::string PyCapitalize(std::string_view s);
// str.islower() (upper = false) / str.isupper() (upper = true).
bool PyIsCase(std::string_view s, bool upper);

// ---- str methods.

// str.strip / lstrip / rstrip (`left` / `right` say which ends): the
// characters in `chars`, or whitespace when `chars` is nullptr.
std::string PyStrip(std::string_view s, const std::string* chars, bool left,
                    bool right);
// str.split (from_right = false) / str.rsplit: at `sep`, or at whitespace runs
// when `sep` is nullptr; at most `maxsplit` splits (< 0: all). An empty `sep`
// is a problem ("empty separator").
absl::StatusOr<std::vector<std::string>> PySplit(std::string_view s,
                                                 const std::string* sep,
                                                 int64_t maxsplit,
                                                 bool from_right);
// str.replace(old, new, count); count < 0 replaces all. A problem when the
// result would be over kMaxOutputBytes.
absl::StatusOr<std::string> PyReplace(std::string_view s, std::string_view old,
                                      std::string_view repl, int64_t count);

// ---- Printing and parsing.

// markupsafe.escape: & < > " ' as HTML entities (&#34; and &#39; for quotes).
std::string HtmlEscape(std::string_view s);
// float.__repr__: the shortest digits that round-trip, in fixed notation for
// exponents -4 to 15, else scientific ("1e+16", "1.5e-07"); "nan", "inf".
std::string PyFloatRepr(double d);
// repr(s) appended to `out`: quoted as Python quotes it ('a', "it's"), with
// Python's escapes for unprintable characters.
void AppendStringRepr(std::string_view s, std::string* out);
// repr(name), for messages: 'name'.
std::string QuotedName(std::string_view name);
// Python's int(text, base) for a base of 2 to 16 (surrounding whitespace, a
// sign, single underscores between digits, 0x for base 16); nullopt if `text`
// is not one or it does not fit in 64 bits.
std::optional<int64_t> ParsePyInt(std::string_view text, int base);
// Python's float(text) (surrounding whitespace and underscores allowed, as
// strtod reads the rest); nullopt if `text` is not one.
std::optional<double> ParsePyFloat(std::string_view text);

}  // namespace knapserve::jinja

#endif  // KNAPSERVE_COMMON_TEXT_JINJA_PY_STRING_H_
