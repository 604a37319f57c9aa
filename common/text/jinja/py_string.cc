#include "common/text/jinja/py_string.h"

#include <utf8proc.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/text/jinja/errors.h"
#include "common/text/unicode_util.h"

namespace knapserve::jinja {

bool IsDigit(char c) { return c >= '0' && c <= '9'; }

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// str.isspace().
bool IsPySpace(char32_t c) {
  if (c < 0x80) return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20);
  return c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
         c == 0x202F || c == 0x205F || c == 0x3000;
}

std::u32string Decode(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  size_t pos = 0;
  while (pos < s.size()) out.push_back(NextCodePoint(s, &pos));
  return out;
}

std::string Encode(std::u32string_view cps) {
  std::string out;
  out.reserve(cps.size());
  for (char32_t c : cps) AppendUtf8(c, &out);
  return out;
}

size_t CodePointCount(std::string_view s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

bool IsCased(char32_t c) {
  return utf8proc_islower(c) || utf8proc_isupper(c) ||
         utf8proc_category(c) == UTF8PROC_CATEGORY_LT;
}

// Case mappings: utf8proc's simple (one to one) ones, plus the full
// mappings of Python for the characters people meet (sharp s, the Latin
// ligatures, dotted capital I, final sigma). Python has a few more, for rare
// Greek and Armenian letters.
void AppendUpper(char32_t c, bool title, std::string* out) {
  const char* full = nullptr;
  switch (c) {
    case 0xDF:
      full = title ? "Ss" : "SS";
      break;
    case 0x149:
      full = "\u02BCN";
      break;
    case 0xFB00:
      full = title ? "Ff" : "FF";
      break;
    case 0xFB01:
      full = title ? "Fi" : "FI";
      break;
    case 0xFB02:
      full = title ? "Fl" : "FL";
      break;
    case 0xFB03:
      full = title ? "Ffi" : "FFI";
      break;
    case 0xFB04:
      full = title ? "Ffl" : "FFL";
      break;
    case 0xFB05:
    case 0xFB06:
      full = title ? "St" : "ST";
      break;
    default:
      break;
  }
  if (full != nullptr) {
    out->append(full);
  } else {
    AppendUtf8(title ? utf8proc_totitle(c) : utf8proc_toupper(c), out);
  }
}

// The lower case of cps[i] (which needs its neighbours for final sigma).
void AppendLower(std::u32string_view cps, size_t i, std::string* out) {
  const char32_t c = cps[i];
  if (c == 0x130) {  // Capital I with dot above.
    out->append("i\u0307");
    return;
  }
  if (c == 0x3A3) {  // Capital sigma: final form after a cased letter.
    const bool after_cased = i > 0 && IsCased(cps[i - 1]);
    const bool before_cased = i + 1 < cps.size() && IsCased(cps[i + 1]);
    AppendUtf8(after_cased && !before_cased ? 0x3C2 : 0x3C3, out);
    return;
  }
  AppendUtf8(utf8proc_tolower(c), out);
}

std::string PyLower(std::string_view s) {
  const std::u32string cps = Decode(s);
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < cps.size(); ++i) AppendLower(cps, i, &out);
  return out;
}

std::string PyUpper(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t pos = 0;
  while (pos < s.size()) AppendUpper(NextCodePoint(s, &pos), false, &out);
  return out;
}

// str.title(): cased runs start with title case, the rest is lower case.
std::string PyTitle(std::string_view s) {
  const std::u32string cps = Decode(s);
  std::string out;
  bool previous_is_cased = false;
  for (size_t i = 0; i < cps.size(); ++i) {
    if (previous_is_cased) {
      AppendLower(cps, i, &out);
    } else {
      AppendUpper(cps[i], true, &out);
    }
    previous_is_cased = IsCased(cps[i]);
  }
  return out;
}

// str.capitalize(): the first character in title case, the rest lower.
std::string PyCapitalize(std::string_view s) {
  const std::u32string cps = Decode(s);
  std::string out;
  for (size_t i = 0; i < cps.size(); ++i) {
    if (i == 0) {
      AppendUpper(cps[i], true, &out);
    } else {
      AppendLower(cps, i, &out);
    }
  }
  return out;
}

// str.islower() (upper = false) / str.isupper() (upper = true).
bool PyIsCase(std::string_view s, bool upper) {
  bool cased = false;
  size_t pos = 0;
  while (pos < s.size()) {
    const char32_t c = NextCodePoint(s, &pos);
    if (upper ? utf8proc_islower(c) ||
                    utf8proc_category(c) == UTF8PROC_CATEGORY_LT
              : utf8proc_isupper(c) ||
                    utf8proc_category(c) == UTF8PROC_CATEGORY_LT) {
      return false;
    }
    if (!cased) cased = upper ? utf8proc_isupper(c) : utf8proc_islower(c);
  }
  return cased;
}

// str.isprintable() for one character.
bool IsPrintable(char32_t c) {
  if (c == ' ') return true;
  switch (utf8proc_category(c)) {
    case UTF8PROC_CATEGORY_CC:
    case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_CS:
    case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_CN:
    case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP:
    case UTF8PROC_CATEGORY_ZS:
      return false;
    default:
      return true;
  }
}

// str.strip / lstrip / rstrip: `chars` nullptr strips whitespace.
std::string PyStrip(std::string_view s, const std::string* chars, bool left,
                    bool right) {
  std::u32string set;
  if (chars != nullptr) set = Decode(*chars);
  auto strip = [&](char32_t c) {
    return chars == nullptr ? IsPySpace(c)
                            : set.find(c) != std::u32string::npos;
  };
  size_t begin = 0;
  size_t end = s.size();
  if (left) {
    while (begin < end) {
      size_t next = begin;
      if (!strip(NextCodePoint(s, &next))) break;
      begin = next;
    }
  }
  if (right) {
    while (end > begin) {
      size_t prev = end;
      if (!strip(PrevCodePoint(s, &prev))) break;
      end = prev;
    }
  }
  return std::string(s.substr(begin, end - begin));
}

// str.split / str.rsplit. `sep` nullptr splits on whitespace runs.
absl::StatusOr<std::vector<std::string>> PySplit(std::string_view s,
                                                 const std::string* sep,
                                                 int64_t maxsplit,
                                                 bool from_right) {
  std::vector<std::string> parts;
  if (sep != nullptr) {
    if (sep->empty()) return Problem("empty separator");
    if (!from_right) {
      size_t start = 0;
      while (maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit) {
        const size_t at = s.find(*sep, start);
        if (at == std::string_view::npos) break;
        parts.emplace_back(s.substr(start, at - start));
        start = at + sep->size();
      }
      parts.emplace_back(s.substr(start));
    } else {
      size_t end = s.size();
      int64_t splits = 0;
      while (maxsplit < 0 || splits < maxsplit) {
        if (end < sep->size()) break;
        const size_t at = s.rfind(*sep, end - sep->size());
        if (at == std::string_view::npos) break;
        parts.emplace_back(s.substr(at + sep->size(), end - at - sep->size()));
        end = at;
        ++splits;
      }
      parts.emplace_back(s.substr(0, end));
      std::reverse(parts.begin(), parts.end());
    }
    return parts;
  }
  const std::u32string cps = Decode(s);
  const int64_t n = static_cast<int64_t>(cps.size());
  if (!from_right) {
    int64_t i = 0;
    while (true) {
      while (i < n && IsPySpace(cps[i])) ++i;
      if (i == n) break;
      if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
        parts.push_back(Encode(std::u32string_view(cps).substr(i)));
        break;
      }
      int64_t j = i;
      while (j < n && !IsPySpace(cps[j])) ++j;
      parts.push_back(Encode(std::u32string_view(cps).substr(i, j - i)));
      i = j;
    }
  } else {
    int64_t i = n;
    while (true) {
      while (i > 0 && IsPySpace(cps[i - 1])) --i;
      if (i == 0) break;
      if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
        parts.push_back(Encode(std::u32string_view(cps).substr(0, i)));
        break;
      }
      int64_t j = i;
      while (j > 0 && !IsPySpace(cps[j - 1])) --j;
      parts.push_back(Encode(std::u32string_view(cps).substr(j, i - j)));
      i = j;
    }
    std::reverse(parts.begin(), parts.end());
  }
  return parts;
}

// str.replace(old, new, count); count < 0 replaces all.
absl::StatusOr<std::string> PyReplace(std::string_view s, std::string_view old,
                                      std::string_view repl, int64_t count) {
  std::string out;
  int64_t done = 0;
  if (old.empty()) {
    size_t pos = 0;
    while (true) {
      if (count >= 0 && done >= count) break;
      out.append(repl);
      ++done;
      if (pos == s.size()) break;
      const size_t start = pos;
      NextCodePoint(s, &pos);
      out.append(s.substr(start, pos - start));
      RETURN_IF_ERROR(CheckSize(out.size()));
    }
    out.append(s.substr(pos));
    RETURN_IF_ERROR(CheckSize(out.size()));
    return out;
  }
  size_t start = 0;
  while (count < 0 || done < count) {
    const size_t at = s.find(old, start);
    if (at == std::string_view::npos) break;
    out.append(s.substr(start, at - start));
    out.append(repl);
    RETURN_IF_ERROR(CheckSize(out.size()));
    start = at + old.size();
    ++done;
  }
  out.append(s.substr(start));
  RETURN_IF_ERROR(CheckSize(out.size()));
  return out;
}

// markupsafe.escape.
std::string HtmlEscape(std::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// float.__repr__: the shortest digits that round-trip, in fixed notation
// for exponents -4 to 15, else scientific ("1e+16", "1.5e-07").
std::string PyFloatRepr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  const auto result =
      std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string_view text(buf, result.ptr - buf);
  std::string out;
  if (text[0] == '-') {
    out = "-";
    text.remove_prefix(1);
  }
  const size_t e = text.find('e');
  std::string digits;
  for (char c : text.substr(0, e)) {
    if (c != '.') digits += c;
  }
  const int exp = std::atoi(std::string(text.substr(e + 1)).c_str());
  if (exp < -4 || exp >= 16) {
    out += digits[0];
    if (digits.size() > 1) absl::StrAppend(&out, ".", digits.substr(1));
    out += exp < 0 ? "e-" : "e+";
    const int mag = std::abs(exp);
    if (mag < 10) out += '0';
    absl::StrAppend(&out, mag);
  } else if (exp >= 0) {
    const size_t int_digits = static_cast<size_t>(exp) + 1;
    if (digits.size() <= int_digits) {
      out += digits;
      out.append(int_digits - digits.size(), '0');
      out += ".0";
    } else {
      absl::StrAppend(&out, digits.substr(0, int_digits), ".",
                      digits.substr(int_digits));
    }
  } else {
    out += "0.";
    out.append(static_cast<size_t>(-exp - 1), '0');
    out += digits;
  }
  return out;
}

void AppendStringRepr(std::string_view s, std::string* out) {
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  *out += quote;
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t start = pos;
    const char32_t c = NextCodePoint(s, &pos);
    char buf[16];
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      *out += '\\';
      *out += static_cast<char>(c);
    } else if (c == '\t') {
      *out += "\\t";
    } else if (c == '\n') {
      *out += "\\n";
    } else if (c == '\r') {
      *out += "\\r";
    } else if (c < 0x20 || c == 0x7F) {
      std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(c));
      *out += buf;
    } else if (c < 0x7F || IsPrintable(c)) {
      out->append(s.substr(start, pos - start));
    } else if (c <= 0xFF) {
      std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(c));
      *out += buf;
    } else if (c <= 0xFFFF) {
      std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
      *out += buf;
    } else {
      std::snprintf(buf, sizeof(buf), "\\U%08x", static_cast<unsigned>(c));
      *out += buf;
    }
  }
  *out += quote;
}

std::string QuotedName(std::string_view name) {
  std::string out;
  AppendStringRepr(name, &out);
  return out;
}

// Python's int(text, base) for the int filter; nullopt if it is not one.
std::optional<int64_t> ParsePyInt(std::string_view text, int base) {
  const std::string s = PyStrip(text, nullptr, true, true);
  size_t k = 0;
  bool negative = false;
  if (k < s.size() && (s[k] == '+' || s[k] == '-')) negative = s[k++] == '-';
  if (base == 16 && s.size() > k + 1 && s[k] == '0' &&
      (s[k + 1] | 0x20) == 'x') {
    k += 2;
  }
  if (k >= s.size()) return std::nullopt;
  int64_t value = 0;
  bool last_underscore = true;
  for (; k < s.size(); ++k) {
    if (s[k] == '_' && !last_underscore) {
      last_underscore = true;
      continue;
    }
    const int d = HexValue(s[k]);
    if (d < 0 || d >= base) return std::nullopt;
    if (__builtin_mul_overflow(value, base, &value) ||
        __builtin_add_overflow(value, d, &value)) {
      return std::nullopt;
    }
    last_underscore = false;
  }
  if (last_underscore) return std::nullopt;
  return negative ? -value : value;
}

// Python's float(text); nullopt if it is not one.
std::optional<double> ParsePyFloat(std::string_view text) {
  std::string s = PyStrip(text, nullptr, true, true);
  s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
  if (s.empty()) return std::nullopt;
  char* end = nullptr;
  const double d = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size()) return std::nullopt;
  return d;
}

}  // namespace knapserve::jinja
