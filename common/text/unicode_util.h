// Small UTF-8 and Unicode helpers for the tokenizer: validation, lossy repair,
// code point iteration, character classes and normalization forms.
//
// Strings are UTF-8 in std::string / std::string_view. Functions that need
// valid input say so; the others accept any bytes. Normalization and character
// classes come from utf8proc (Debian package libutf8proc-dev). Everything here
// is a pure function and thread-safe.
#ifndef KNAPSERVE_COMMON_TEXT_UNICODE_UTIL_H_
#define KNAPSERVE_COMMON_TEXT_UNICODE_UTIL_H_

#include <cstddef>
#include <string>
#include <string_view>

namespace knapserve {

// The encoding of U+FFFD REPLACEMENT CHARACTER.
inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";

// Length of the valid UTF-8 sequence that starts at text[pos], or 0 if the
// bytes there are not a complete, well-formed sequence (overlongs, surrogates
// and code points above U+10FFFF are ill-formed). `pos` must be < text.size().
size_t ValidUtf8SequenceLength(std::string_view text, size_t pos);

// Offset of the first byte that is not part of a well-formed UTF-8 sequence, or
// text.size() if the whole text is valid.
size_t FirstInvalidUtf8Offset(std::string_view text);
inline bool IsValidUtf8(std::string_view text) {
  return FirstInvalidUtf8Offset(text) == text.size();
}

// `bytes` with each maximal ill-formed subsequence replaced by one U+FFFD (the
// WHATWG / Unicode "substitution of maximal subparts" rule that Rust's
// String::from_utf8_lossy and Python's errors="replace" follow).
std::string Utf8Lossy(std::string_view bytes);

// Decodes the code point at text[*pos] and advances *pos past it. `text` must
// be valid UTF-8 and *pos < text.size() on a character boundary.
char32_t NextCodePoint(std::string_view text, size_t* pos);

// Decodes the code point that ends at text[*end - 1] and moves *end back to its
// first byte. `text` must be valid UTF-8 and 0 < *end on a character boundary.
char32_t PrevCodePoint(std::string_view text, size_t* end);

// Appends the UTF-8 encoding of `cp` (which must be a Unicode scalar value).
void AppendUtf8(char32_t cp, std::string* out);

// Unicode White_Space (Rust's char::is_whitespace).
bool IsUnicodeWhitespace(char32_t cp);
// General category L* or N* (Rust's char::is_alphanumeric).
bool IsUnicodeAlphanumeric(char32_t cp);

enum class NormalizationForm { kNfc, kNfd, kNfkc, kNfkd };

// `text` (valid UTF-8) in the given normalization form.
std::string NormalizeUnicode(std::string_view text, NormalizationForm form);

// `text` (valid UTF-8) with every code point mapped to lower case (simple
// case mapping).
std::string ToLowerUnicode(std::string_view text);

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_TEXT_UNICODE_UTIL_H_
