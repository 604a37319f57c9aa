#include "common/text/jinja/json.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
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

template <typename Json>
absl::StatusOr<Value> FromJsonImpl(const Json& j, int depth) {
  if (depth > kMaxValueDepth) return TooDeep();
  switch (j.type()) {
    case nlohmann::json::value_t::null:
      return None();
    case nlohmann::json::value_t::boolean:
      return Bool(j.template get<bool>());
    case nlohmann::json::value_t::number_integer:
      return Int(j.template get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: {
      const uint64_t u = j.template get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Problem(absl::StrCat(
            "the context holds the integer ", u,
            ", which is beyond the supported range (64-bit signed)"));
      }
      return Int(static_cast<int64_t>(u));
    }
    case nlohmann::json::value_t::number_float:
      return Float(j.template get<double>());
    case nlohmann::json::value_t::string: {
      const auto& s = j.template get_ref<const std::string&>();
      if (!IsValidUtf8(s)) {
        return Problem("the context holds a string that is not valid UTF-8");
      }
      return String(s);
    }
    case nlohmann::json::value_t::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& element : j) {
        ASSIGN_OR_RETURN(Value item, FromJsonImpl(element, depth + 1));
        items.push_back(std::move(item));
      }
      return MakeList(std::move(items));
    }
    case nlohmann::json::value_t::object: {
      std::vector<std::pair<std::string, Value>> entries;
      entries.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it) {
        if (!IsValidUtf8(it.key())) {
          return Problem("the context holds a key that is not valid UTF-8");
        }
        ASSIGN_OR_RETURN(Value item, FromJsonImpl(it.value(), depth + 1));
        entries.emplace_back(it.key(), std::move(item));
      }
      return MakeDict(std::move(entries));
    }
    default:
      return Problem("the context holds a value that is not plain JSON");
  }
}

void AppendJsonString(std::string_view s, bool ensure_ascii, std::string* out) {
  *out += '"';
  size_t pos = 0;
  char buf[16];
  while (pos < s.size()) {
    const unsigned char b = s[pos];
    if (b >= 0x80) {
      const size_t start = pos;
      const char32_t c = NextCodePoint(s, &pos);
      if (!ensure_ascii) {
        out->append(s.substr(start, pos - start));
      } else if (c < 0x10000) {
        std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
        *out += buf;
      } else {
        const unsigned v = static_cast<unsigned>(c) - 0x10000;
        std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x", 0xD800 + (v >> 10),
                      0xDC00 + (v & 0x3FF));
        *out += buf;
      }
      continue;
    }
    ++pos;
    switch (b) {
      case '"':
        *out += "\\\"";
        break;
      case '\\':
        *out += "\\\\";
        break;
      case '\n':
        *out += "\\n";
        break;
      case '\r':
        *out += "\\r";
        break;
      case '\t':
        *out += "\\t";
        break;
      case '\b':
        *out += "\\b";
        break;
      case '\f':
        *out += "\\f";
        break;
      default:
        if (b < 0x20 || (b == 0x7F && ensure_ascii)) {
          std::snprintf(buf, sizeof(buf), "\\u%04x", b);
          *out += buf;
        } else {
          *out += static_cast<char>(b);
        }
    }
  }
  *out += '"';
}

absl::Status AppendNewlineIndent(const JsonStyle& style, int level,
                                 std::string* out) {
  RETURN_IF_ERROR(CheckSize(out->size() + 1 + level * style.indent->size()));
  *out += '\n';
  for (int k = 0; k < level; ++k) *out += *style.indent;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Value> FromJson(const nlohmann::json& j) {
  return FromJsonImpl(j, 0);
}

absl::StatusOr<Value> FromJson(const nlohmann::ordered_json& j) {
  return FromJsonImpl(j, 0);
}

// json.dumps(v, ...) appended to `out`.
absl::Status AppendJson(const Value& v, const JsonStyle& style, int level,
                        std::string* out) {
  switch (v.kind) {
    case Kind::kNone:
      *out += "null";
      break;
    case Kind::kBool:
      *out += v.i ? "true" : "false";
      break;
    case Kind::kInt:
      absl::StrAppend(out, v.i);
      break;
    case Kind::kFloat:
      if (std::isnan(v.f)) {
        *out += "NaN";
      } else if (std::isinf(v.f)) {
        *out += v.f > 0 ? "Infinity" : "-Infinity";
      } else {
        *out += PyFloatRepr(v.f);
      }
      break;
    case Kind::kString:
      AppendJsonString(v.s, style.ensure_ascii, out);
      break;
    case Kind::kList:
    case Kind::kTuple: {
      const auto& items = v.list->items;
      if (items.empty()) {
        *out += "[]";
        break;
      }
      *out += '[';
      for (size_t k = 0; k < items.size(); ++k) {
        if (k > 0) *out += style.item_separator;
        if (style.indent) {
          RETURN_IF_ERROR(AppendNewlineIndent(style, level + 1, out));
        }
        RETURN_IF_ERROR(AppendJson(items[k], style, level + 1, out));
      }
      if (style.indent) {
        RETURN_IF_ERROR(AppendNewlineIndent(style, level, out));
      }
      *out += ']';
      break;
    }
    case Kind::kDict: {
      const auto& entries = v.dict->entries;
      if (entries.empty()) {
        *out += "{}";
        break;
      }
      std::vector<const std::pair<std::string, Value>*> order;
      for (const auto& entry : entries) order.push_back(&entry);
      if (style.sort_keys) {
        std::sort(order.begin(), order.end(), [](const auto* x, const auto* y) {
          return x->first < y->first;
        });
      }
      *out += '{';
      for (size_t k = 0; k < order.size(); ++k) {
        if (k > 0) *out += style.item_separator;
        if (style.indent) {
          RETURN_IF_ERROR(AppendNewlineIndent(style, level + 1, out));
        }
        AppendJsonString(order[k]->first, style.ensure_ascii, out);
        *out += style.key_separator;
        RETURN_IF_ERROR(AppendJson(order[k]->second, style, level + 1, out));
      }
      if (style.indent) {
        RETURN_IF_ERROR(AppendNewlineIndent(style, level, out));
      }
      *out += '}';
      break;
    }
    default:
      return Problem(absl::StrCat("Object of type ", TypeName(v),
                                  " is not JSON serializable"));
  }
  return CheckSize(out->size());
}

}  // namespace knapserve::jinja
