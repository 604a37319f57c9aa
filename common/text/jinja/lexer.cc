#include "common/text/jinja/lexer.h"

#include <utf8proc.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/text/jinja/errors.h"
#include "common/text/jinja/py_string.h"
#include "common/text/unicode_util.h"

namespace knapserve::jinja {

namespace {

bool IsNameStart(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}
bool IsNameChar(char c) { return IsNameStart(c) || IsDigit(c); }

// Python identifiers beyond ASCII (close to XID_Start / XID_Continue).
bool IsUnicodeNameChar(char32_t c, bool start) {
  switch (utf8proc_category(c)) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_NL:
      return true;
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_PC:
      return !start;
    default:
      return false;
  }
}

// The tokens of one (normalized) source: Run() walks it once, from data to
// tag to data; the source and the map must outlive the Lexer.
class Lexer {
 public:
  Lexer(std::string_view source, const SourceMap& map)
      : src_(source), map_(map) {}

  absl::StatusOr<std::vector<Token>> Run() {
    size_t pos = 0;
    bool line_starting = true;
    const size_t n = src_.size();
    while (pos < n) {
      const size_t q = FindTagStart(pos);
      if (q == std::string_view::npos) {
        AddData(src_.substr(pos), pos);
        break;
      }
      const char kind = src_[q + 1];
      size_t p = q + 2;
      char sign = 0;
      if (p < n && (src_[p] == '-' || src_[p] == '+')) sign = src_[p++];
      AddData(StripBefore(src_.substr(pos, q - pos), sign, kind != '{',
                          line_starting),
              pos);
      if (kind == '#') {
        const size_t e = src_.find("#}", p);
        if (e == std::string_view::npos) {
          // Jinja ends quietly when "{#" is the very end of the template.
          if (p == n) break;
          return map_.Error(q, "unterminated comment (no matching '#}')");
        }
        size_t end = e + 2;
        if (e > p && src_[e - 1] == '-') {
          end = SkipSpace(end);
        } else if (!(e > p && src_[e - 1] == '+')) {
          if (end < n && src_[end] == '\n') ++end;  // trim_blocks
        }
        line_starting = src_[end - 1] == '\n';
        pos = end;
        continue;
      }
      if (kind == '%') {
        const size_t r = SkipSpace(p);
        if (src_.substr(r, 3) == "raw") {
          const size_t r2 = SkipSpace(r + 3);
          size_t body = std::string_view::npos;
          if (src_.substr(r2, 3) == "-%}") body = SkipSpace(r2 + 3);
          if (src_.substr(r2, 2) == "%}") body = r2 + 2;
          if (body != std::string_view::npos) {
            ASSIGN_OR_RETURN(pos, LexRaw(q, body, &line_starting));
            continue;
          }
        }
      }
      ASSIGN_OR_RETURN(pos, LexTag(kind, q, p, &line_starting));
    }
    Token eof;
    eof.type = Tok::kEof;
    eof.offset = n;
    tokens_.push_back(eof);
    return std::move(tokens_);
  }

 private:
  // The next "{{", "{%" or "{#" at or after `pos`.
  size_t FindTagStart(size_t pos) const {
    while (true) {
      pos = src_.find('{', pos);
      if (pos == std::string_view::npos || pos + 1 >= src_.size()) {
        return std::string_view::npos;
      }
      const char c = src_[pos + 1];
      if (c == '{' || c == '%' || c == '#') return pos;
      ++pos;
    }
  }

  // `text`, the data before a tag, with the tag's whitespace control
  // applied: "-" strips all whitespace before it; otherwise, for a block or
  // comment tag (not "{{"), lstrip_blocks removes spaces and tabs between the
  // start of its line and the tag, unless the tag says "+".
  std::string_view StripBefore(std::string_view text, char sign, bool is_block,
                               bool line_starting) const {
    if (sign == '-') return RStripSpace(text);
    if (sign == '+' || !is_block) return text;
    const size_t newline = text.rfind('\n');
    const size_t l_pos = newline == std::string_view::npos ? 0 : newline + 1;
    if ((l_pos > 0 || line_starting) && l_pos < text.size() &&
        AllSpace(text.substr(l_pos))) {
      return text.substr(0, l_pos);
    }
    return text;
  }

  // The body of {% raw %} (opened at `q`, its text starting at `body`) up
  // to {% endraw %}, as data. Returns where the text after it starts.
  absl::StatusOr<size_t> LexRaw(size_t q, size_t body, bool* line_starting) {
    const size_t n = src_.size();
    *line_starting = src_[body - 1] == '\n';
    for (size_t k = src_.find("{%", body); k != std::string_view::npos;
         k = src_.find("{%", k + 1)) {
      size_t p = k + 2;
      char sign = 0;
      if (p < n && (src_[p] == '-' || src_[p] == '+')) sign = src_[p++];
      p = SkipSpace(p);
      if (src_.substr(p, 6) != "endraw") continue;
      p = SkipSpace(p + 6);
      size_t end = std::string_view::npos;
      if (src_.substr(p, 3) == "+%}") {
        end = p + 3;
      } else if (src_.substr(p, 3) == "-%}") {
        end = SkipSpace(p + 3);
      } else if (src_.substr(p, 2) == "%}") {
        end = p + 2;
        if (end < n && src_[end] == '\n') ++end;  // trim_blocks
      }
      if (end == std::string_view::npos) continue;
      AddData(
          StripBefore(src_.substr(body, k - body), sign, true, *line_starting),
          body);
      *line_starting = src_[end - 1] == '\n';
      return end;
    }
    return map_.Error(q, "unterminated {% raw %} (no matching {% endraw %})");
  }

  void AddData(std::string_view text, size_t offset) {
    if (text.empty()) return;
    Token t;
    t.type = Tok::kData;
    t.text = std::string(text);
    t.offset = offset;
    tokens_.push_back(std::move(t));
  }

  // Python's \s (str.isspace) at `pos`: its length in bytes, or 0.
  size_t SpaceAt(size_t pos) const {
    if (pos >= src_.size()) return 0;
    size_t next = pos;
    return IsPySpace(NextCodePoint(src_, &next)) ? next - pos : 0;
  }
  size_t SkipSpace(size_t pos) const {
    while (size_t len = SpaceAt(pos)) pos += len;
    return pos;
  }
  static std::string_view RStripSpace(std::string_view text) {
    size_t end = text.size();
    while (end > 0) {
      size_t prev = end;
      if (!IsPySpace(PrevCodePoint(text, &prev))) break;
      end = prev;
    }
    return text.substr(0, end);
  }
  static bool AllSpace(std::string_view text) {
    size_t pos = 0;
    while (pos < text.size()) {
      if (!IsPySpace(NextCodePoint(text, &pos))) return false;
    }
    return true;
  }

  // The tokens of the tag that opens at `q` ("{{" or "{%"), whose content
  // starts at `p`. Returns where the text after the tag starts.
  absl::StatusOr<size_t> LexTag(char kind, size_t q, size_t p,
                                bool* line_starting) {
    const size_t n = src_.size();
    Token begin;
    begin.type = kind == '{' ? Tok::kVarBegin : Tok::kBlockBegin;
    begin.offset = q;
    tokens_.push_back(begin);
    std::vector<char> balance;  // The closing brackets expected.
    while (true) {
      if (balance.empty()) {
        size_t end = std::string_view::npos;
        if (kind == '%') {
          if (src_.substr(p, 3) == "+%}") {
            end = p + 3;
          } else if (src_.substr(p, 3) == "-%}") {
            end = SkipSpace(p + 3);
          } else if (src_.substr(p, 2) == "%}") {
            end = p + 2;
            if (end < n && src_[end] == '\n') ++end;  // trim_blocks
          }
        } else if (src_.substr(p, 3) == "-}}") {
          end = SkipSpace(p + 3);
        } else if (src_.substr(p, 2) == "}}") {
          end = p + 2;
        }
        if (end != std::string_view::npos) {
          Token t;
          t.type = kind == '%' ? Tok::kBlockEnd : Tok::kVarEnd;
          t.offset = p;
          tokens_.push_back(t);
          *line_starting = src_[end - 1] == '\n';
          return end;
        }
      }
      if (p >= n) {
        return map_.Error(q, kind == '%'
                                 ? "unterminated '{%' tag (no matching '%}')"
                                 : "unterminated '{{' tag (no matching '}}')");
      }
      if (size_t len = SpaceAt(p)) {
        p = SkipSpace(p + len);
        continue;
      }
      const char c = src_[p];
      Token t;
      t.offset = p;
      if (IsDigit(c)) {
        ASSIGN_OR_RETURN(p, LexNumber(p, &t));
      } else if (IsNameStart(c) || NameCharAt(p, true) > 0) {
        size_t end = p;
        while (size_t len = NameCharAt(end, end == p)) end += len;
        t.type = Tok::kName;
        t.text = std::string(src_.substr(p, end - p));
        p = end;
      } else if (c == '\'' || c == '"') {
        ASSIGN_OR_RETURN(p, LexString(p, &t));
      } else {
        static constexpr std::string_view kTwo[] = {
            "//", "**", "==", "!=", ">=", "<="};
        size_t len = 0;
        for (std::string_view op : kTwo) {
          if (src_.substr(p, 2) == op) len = 2;
        }
        if (len == 0 && std::string_view("+-/*%~[](){}><=.:|,;").find(c) !=
                            std::string_view::npos) {
          len = 1;
        }
        if (len == 0) {
          size_t next = p;
          const char32_t cp = NextCodePoint(src_, &next);
          std::string shown;
          AppendUtf8(cp, &shown);
          return map_.Error(p,
                            absl::StrCat("unexpected character '", shown, "'"));
        }
        t.type = Tok::kOp;
        t.text = std::string(src_.substr(p, len));
        if (len == 1 && (c == '(' || c == '[' || c == '{')) {
          balance.push_back(c == '(' ? ')' : c == '[' ? ']' : '}');
        } else if (len == 1 && (c == ')' || c == ']' || c == '}')) {
          if (balance.empty()) {
            return map_.Error(p, absl::StrCat("unexpected '", t.text, "'"));
          }
          if (balance.back() != c) {
            return map_.Error(
                p, absl::StrCat("unexpected '", t.text, "', expected '",
                                std::string(1, balance.back()), "'"));
          }
          balance.pop_back();
        }
        p += len;
      }
      tokens_.push_back(std::move(t));
    }
  }

  // The length in bytes of the identifier character at `pos` (the first one
  // if `start`), or 0.
  size_t NameCharAt(size_t pos, bool start) const {
    if (pos >= src_.size()) return 0;
    const char c = src_[pos];
    if (static_cast<unsigned char>(c) < 0x80) {
      return (start ? IsNameStart(c) : IsNameChar(c)) ? 1 : 0;
    }
    size_t next = pos;
    return IsUnicodeNameChar(NextCodePoint(src_, &next), start) ? next - pos
                                                                : 0;
  }

  // End of (\d+_)*\d+ at `p`, or `p` if there is no digit.
  size_t MatchDigits(size_t p) const {
    const size_t n = src_.size();
    if (p >= n || !IsDigit(src_[p])) return p;
    size_t q = p;
    while (q < n && IsDigit(src_[q])) ++q;
    while (q + 1 < n && src_[q] == '_' && IsDigit(src_[q + 1])) {
      ++q;
      while (q < n && IsDigit(src_[q])) ++q;
    }
    return q;
  }

  absl::StatusOr<size_t> LexNumber(size_t p, Token* t) {
    const size_t n = src_.size();
    // Floats: digits, then a fraction and / or an exponent (not right
    // after a '.', as in Jinja: x.0.1 is not x[0.1]).
    const bool after_dot = p > 0 && src_[p - 1] == '.';
    size_t end = std::string_view::npos;
    if (!after_dot) {
      const size_t a = MatchDigits(p);
      size_t frac_end = a;
      if (a < n && src_[a] == '.' && MatchDigits(a + 1) > a + 1) {
        frac_end = MatchDigits(a + 1);
      }
      if (frac_end < n && (src_[frac_end] == 'e' || src_[frac_end] == 'E')) {
        size_t j = frac_end + 1;
        if (j < n && (src_[j] == '+' || src_[j] == '-')) ++j;
        if (MatchDigits(j) > j) end = MatchDigits(j);
      }
      if (end == std::string_view::npos && frac_end > a) end = frac_end;
    }
    if (end != std::string_view::npos) {
      std::string text;
      for (char c : src_.substr(p, end - p)) {
        if (c != '_') text += c;
      }
      t->type = Tok::kFloat;
      t->float_value = std::strtod(text.c_str(), nullptr);
      return end;
    }
    // Integers: 0b / 0o / 0x prefixes, or decimal.
    int base = 10;
    size_t digits_start = p;
    if (src_[p] == '0' && p + 1 < n) {
      const char x = src_[p + 1] | 0x20;
      if (x == 'b') base = 2;
      if (x == 'o') base = 8;
      if (x == 'x') base = 16;
      if (base != 10) digits_start = p + 2;
    }
    auto is_digit = [&](char c) {
      const int v = HexValue(c);
      return v >= 0 && v < base;
    };
    size_t q = digits_start;
    std::string digits;
    if (base == 10) {
      // [1-9](_?\d)* or 0(_?0)*.
      const bool zero = src_[p] == '0';
      digits += src_[q++];
      while (q < n) {
        const size_t k = q < n && src_[q] == '_' ? q + 1 : q;
        if (k >= n || !IsDigit(src_[k]) || (zero && src_[k] != '0')) break;
        digits += src_[k];
        q = k + 1;
      }
    } else {
      while (q < n) {
        const size_t k = src_[q] == '_' ? q + 1 : q;
        if (k >= n || !is_digit(src_[k])) break;
        digits += src_[k];
        q = k + 1;
      }
      if (digits.empty()) {
        // "0x" without digits: Jinja lexes the 0 alone.
        digits = "0";
        base = 10;
        q = p + 1;
      }
    }
    uint64_t value = 0;
    for (char c : digits) {
      const uint64_t d = static_cast<uint64_t>(HexValue(c));
      if (value > (std::numeric_limits<uint64_t>::max() - d) / base) {
        return map_.Error(p, "integer literal too large");
      }
      value = value * base + d;
    }
    if (value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return map_.Error(p, "integer literal too large");
    }
    t->type = Tok::kInt;
    t->int_value = static_cast<int64_t>(value);
    return q;
  }

  // A string literal, unescaped as Python's unicode-escape codec does it.
  absl::StatusOr<size_t> LexString(size_t p, Token* t) {
    const size_t n = src_.size();
    const char quote = src_[p];
    size_t end = p + 1;
    while (end < n && src_[end] != quote) end += src_[end] == '\\' ? 2 : 1;
    if (end >= n) return map_.Error(p, "unterminated string literal");
    const std::string_view raw = src_.substr(p + 1, end - p - 1);
    std::string out;
    size_t k = 0;
    while (k < raw.size()) {
      if (raw[k] != '\\') {
        out += raw[k++];
        continue;
      }
      const size_t at = p + 1 + k;
      if (k + 1 >= raw.size()) return map_.Error(at, "\\ at end of string");
      const char c = raw[k + 1];
      k += 2;
      char32_t cp = 0;
      int hex_digits = 0;
      switch (c) {
        case '\n':
          break;  // A line continuation.
        case '\\':
        case '\'':
        case '"':
          out += c;
          break;
        case 'a':
          out += '\a';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'v':
          out += '\v';
          break;
        case 'x':
          hex_digits = 2;
          break;
        case 'u':
          hex_digits = 4;
          break;
        case 'U':
          hex_digits = 8;
          break;
        case 'N':
          return map_.Error(at, "\\N{...} escapes are not supported");
        default:
          if (c >= '0' && c <= '7') {
            cp = c - '0';
            for (int d = 0;
                 d < 2 && k < raw.size() && raw[k] >= '0' && raw[k] <= '7';
                 ++d) {
              cp = cp * 8 + (raw[k++] - '0');
            }
            AppendUtf8(cp, &out);
          } else if (static_cast<unsigned char>(c) >= 0x80) {
            // Jinja first writes non-ASCII characters as \x.. / \u.. /
            // \U........ escapes; after a backslash that text stays.
            size_t next = k - 1;
            cp = NextCodePoint(raw, &next);
            k = next;
            char buf[16];
            std::snprintf(buf, sizeof(buf),
                          cp < 0x100     ? "\\x%02x"
                          : cp < 0x10000 ? "\\u%04x"
                                         : "\\U%08x",
                          static_cast<unsigned>(cp));
            out += buf;
          } else {
            out += '\\';
            out += c;
          }
      }
      if (hex_digits > 0) {
        for (int d = 0; d < hex_digits; ++d) {
          const int v = k < raw.size() ? HexValue(raw[k]) : -1;
          if (v < 0) {
            return map_.Error(
                at, absl::StrCat("truncated \\", std::string(1, c), " escape"));
          }
          cp = cp * 16 + v;
          ++k;
        }
        if (cp > 0x10FFFF) {
          return map_.Error(at, "illegal Unicode character");
        }
        if (cp >= 0xD800 && cp <= 0xDFFF) {
          return map_.Error(at, "surrogate code points are not supported");
        }
        AppendUtf8(cp, &out);
      }
    }
    t->type = Tok::kString;
    t->text = std::move(out);
    return end + 1;
  }

  std::string_view src_;
  const SourceMap& map_;
  std::vector<Token> tokens_;
};

}  // namespace

SourceMap::SourceMap(std::string_view source) : source_(source) {
  line_starts_.push_back(0);
  for (size_t k = 0; k < source.size(); ++k) {
    if (source[k] == '\n') line_starts_.push_back(k + 1);
  }
}

int SourceMap::Line(size_t offset) const {
  return static_cast<int>(
      std::upper_bound(line_starts_.begin(), line_starts_.end(), offset) -
      line_starts_.begin());
}

absl::Status SourceMap::Error(size_t offset, std::string_view what) const {
  const int line = Line(offset);
  const size_t start = line_starts_[line - 1];
  const size_t column =
      CodePointCount(source_.substr(start, offset - start)) + 1;
  return absl::InvalidArgumentError(
      absl::StrCat("line ", line, ", column ", column, ": ", Sv(what)));
}
// What Jinja's lexer does first: \r\n and \r become \n, and one trailing
// newline goes (keep_trailing_newline=False).
std::string NormalizeNewlines(std::string_view source) {
  std::string out;
  out.reserve(source.size());
  for (size_t k = 0; k < source.size(); ++k) {
    if (source[k] == '\r') {
      out += '\n';
      if (k + 1 < source.size() && source[k + 1] == '\n') ++k;
    } else {
      out += source[k];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

absl::StatusOr<std::vector<Token>> Lex(std::string_view source,
                                       const SourceMap& map) {
  Lexer lexer(source, map);
  return lexer.Run();
}

}  // namespace knapserve::jinja
