#include "common/text/unicode_util.h"

#include <utf8proc.h>

#include <cstdint>
#include <cstdlib>

namespace knapserve {

size_t ValidUtf8SequenceLength(std::string_view text, size_t pos) {
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(text[i]); };
  const uint8_t b0 = byte(pos);
  if (b0 < 0x80) return 1;
  size_t len;
  uint8_t lo = 0x80, hi = 0xBF;  // Allowed range of the second byte.
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    len = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    len = 3;
    if (b0 == 0xE0) lo = 0xA0;  // No overlongs.
    if (b0 == 0xED) hi = 0x9F;  // No surrogates.
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    len = 4;
    if (b0 == 0xF0) lo = 0x90;  // No overlongs.
    if (b0 == 0xF4) hi = 0x8F;  // Nothing above U+10FFFF.
  } else {
    return 0;
  }
  if (pos + len > text.size()) return 0;
  if (byte(pos + 1) < lo || byte(pos + 1) > hi) return 0;
  for (size_t i = 2; i < len; ++i) {
    if ((byte(pos + i) & 0xC0) != 0x80) return 0;
  }
  return len;
}

size_t FirstInvalidUtf8Offset(std::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    if (static_cast<uint8_t>(text[pos]) < 0x80) {
      ++pos;
      continue;
    }
    const size_t len = ValidUtf8SequenceLength(text, pos);
    if (len == 0) return pos;
    pos += len;
  }
  return text.size();
}

std::string Utf8Lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t pos = 0;
  while (pos < bytes.size()) {
    const size_t len = ValidUtf8SequenceLength(bytes, pos);
    if (len > 0) {
      out.append(bytes.substr(pos, len));
      pos += len;
      continue;
    }
    // Skip the maximal prefix of a well-formed sequence (at least one byte).
    const uint8_t b0 = static_cast<uint8_t>(bytes[pos]);
    size_t want = 0;
    uint8_t lo = 0x80, hi = 0xBF;
    if (b0 >= 0xC2 && b0 <= 0xDF) {
      want = 2;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
      want = 3;
      if (b0 == 0xE0) lo = 0xA0;
      if (b0 == 0xED) hi = 0x9F;
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
      want = 4;
      if (b0 == 0xF0) lo = 0x90;
      if (b0 == 0xF4) hi = 0x8F;
    }
    size_t skip = 1;
    for (size_t i = 1; i < want && pos + i < bytes.size(); ++i) {
      const uint8_t b = static_cast<uint8_t>(bytes[pos + i]);
      const bool ok = i == 1 ? (b >= lo && b <= hi) : (b & 0xC0) == 0x80;
      if (!ok) break;
      skip = i + 1;
    }
    out.append(kReplacementChar);
    pos += skip;
  }
  return out;
}

char32_t NextCodePoint(std::string_view text, size_t* pos) {
  const auto byte = [&](size_t i) {
    return static_cast<char32_t>(static_cast<uint8_t>(text[i]));
  };
  const size_t p = *pos;
  const char32_t b0 = byte(p);
  if (b0 < 0x80) {
    *pos = p + 1;
    return b0;
  }
  if (b0 < 0xE0) {
    *pos = p + 2;
    return ((b0 & 0x1F) << 6) | (byte(p + 1) & 0x3F);
  }
  if (b0 < 0xF0) {
    *pos = p + 3;
    return ((b0 & 0x0F) << 12) | ((byte(p + 1) & 0x3F) << 6) |
           (byte(p + 2) & 0x3F);
  }
  *pos = p + 4;
  return ((b0 & 0x07) << 18) | ((byte(p + 1) & 0x3F) << 12) |
         ((byte(p + 2) & 0x3F) << 6) | (byte(p + 3) & 0x3F);
}

char32_t PrevCodePoint(std::string_view text, size_t* end) {
  size_t start = *end - 1;
  while (start > 0 && (static_cast<uint8_t>(text[start]) & 0xC0) == 0x80)
    --start;
  *end = start;
  return NextCodePoint(text, &start);
}

void AppendUtf8(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool IsUnicodeWhitespace(char32_t cp) {
  switch (cp) {
    case 0x09:
    case 0x0A:
    case 0x0B:
    case 0x0C:
    case 0x0D:
    case 0x20:
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

bool IsUnicodeAlphanumeric(char32_t cp) {
  if (cp < 0x80) {
    return (cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') ||
           (cp >= 'A' && cp <= 'Z');
  }
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_NO:
      return true;
    default:
      return false;
  }
}

std::string NormalizeUnicode(std::string_view text, NormalizationForm form) {
  if (text.empty()) return std::string();
  int options = UTF8PROC_STABLE;
  switch (form) {
    case NormalizationForm::kNfc:
      options |= UTF8PROC_COMPOSE;
      break;
    case NormalizationForm::kNfd:
      options |= UTF8PROC_DECOMPOSE;
      break;
    case NormalizationForm::kNfkc:
      options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
      break;
    case NormalizationForm::kNfkd:
      options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
      break;
  }
  utf8proc_uint8_t* result = nullptr;
  const utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                   static_cast<utf8proc_ssize_t>(text.size()), &result,
                   static_cast<utf8proc_option_t>(options));
  if (n < 0 || result == nullptr) {
    // Only on invalid UTF-8 or out of memory; callers pass valid text.
    std::free(result);
    return std::string(text);
  }
  std::string out(reinterpret_cast<const char*>(result),
                  static_cast<size_t>(n));
  std::free(result);
  return out;
}

std::string ToLowerUnicode(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) {
    const char32_t cp = NextCodePoint(text, &pos);
    if (cp < 0x80) {
      out.push_back(
          static_cast<char>(cp >= 'A' && cp <= 'Z' ? cp + ('a' - 'A') : cp));
    } else {
      AppendUtf8(static_cast<char32_t>(
                     utf8proc_tolower(static_cast<utf8proc_int32_t>(cp))),
                 &out);
    }
  }
  return out;
}

}  // namespace knapserve
