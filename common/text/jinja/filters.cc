#include "common/text/jinja/filters.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/text/jinja/errors.h"
#include "common/text/jinja/json.h"
#include "common/text/jinja/methods.h"
#include "common/text/jinja/py_string.h"
#include "common/text/jinja/tests.h"
#include "common/text/unicode_util.h"

namespace knapserve::jinja {

bool IsKnownFilter(std::string_view name) {
  static constexpr std::string_view kFilters[] = {
      "abs",     "attr",  "capitalize", "count",      "d",      "default",
      "first",   "float", "int",        "items",      "join",   "last",
      "length",  "list",  "lower",      "map",        "reject", "rejectattr",
      "replace", "safe",  "select",     "selectattr", "string", "title",
      "tojson",  "trim",  "upper"};
  return std::find(std::begin(kFilters), std::end(kFilters), name) !=
         std::end(kFilters);
}

namespace {

// Jinja's title filter: each word (split at -, whitespace, (, {, [, <)
// starts upper case and goes on lower case.
std::string JinjaTitle(std::string_view s) {
  const std::u32string cps = Decode(s);
  std::string out;
  bool word_start = true;
  for (size_t i = 0; i < cps.size(); ++i) {
    const char32_t c = cps[i];
    if (c == '-' || c == '(' || c == '{' || c == '[' || c == '<' ||
        IsPySpace(c)) {
      AppendUtf8(c, &out);
      word_start = true;
    } else if (word_start) {
      AppendUpper(c, false, &out);
      word_start = false;
    } else {
      AppendLower(cps, i, &out);
    }
  }
  return out;
}

// make_attrgetter: `attribute` is "a.b.0" (dotted, digits are indexes) or
// an integer; each step is a getitem.
absl::StatusOr<Value> AttrGetter(const Value& item, const Value& attribute) {
  if (attribute.is_integral()) return GetItem(item, attribute);
  ASSIGN_OR_RETURN(std::string path, Str(attribute));
  Value v = item;
  size_t start = 0;
  while (true) {
    const size_t dot = path.find('.', start);
    const std::string part = path.substr(
        start, dot == std::string::npos ? std::string::npos : dot - start);
    const bool digits =
        !part.empty() && std::all_of(part.begin(), part.end(), IsDigit);
    if (digits && part.size() < 18) {
      ASSIGN_OR_RETURN(v, GetItem(v, Int(std::stoll(part))));
    } else {
      ASSIGN_OR_RETURN(v, GetItem(v, String(part)));
    }
    if (dot == std::string::npos) return v;
    start = dot + 1;
  }
}

absl::StatusOr<Value> FilterToJson(const Value& v, const Args& args) {
  ASSIGN_OR_RETURN(
      auto a, Bind("the filter 'tojson'", args,
                   {"ensure_ascii", "indent", "separators", "sort_keys"}, 0));
  JsonStyle style;
  style.ensure_ascii = a[0] && Truthy(*a[0]);
  if (!IsNone(a[1])) {
    if (a[1]->is_integral()) {
      // json.dumps indents by ' ' * indent (nothing when negative).
      const int64_t n = std::max<int64_t>(0, a[1]->i);
      RETURN_IF_ERROR(CheckSize(static_cast<uint64_t>(n)));
      style.indent = std::string(static_cast<size_t>(n), ' ');
    } else if (a[1]->is_string()) {
      style.indent = a[1]->s;
    } else {
      return Problem("tojson: indent must be an integer or a string");
    }
    style.item_separator = ",";
  }
  if (!IsNone(a[2])) {
    const Value& seps = *a[2];
    if (!seps.is_sequence() || seps.list->items.size() != 2 ||
        !seps.list->items[0].is_string() || !seps.list->items[1].is_string()) {
      return Problem("tojson: separators must be a pair of strings");
    }
    style.item_separator = seps.list->items[0].s;
    style.key_separator = seps.list->items[1].s;
  }
  style.sort_keys = a[3] && Truthy(*a[3]);
  std::string out;
  RETURN_IF_ERROR(AppendJson(v, style, 0, &out));
  return String(std::move(out));
}

absl::StatusOr<Value> FilterMap(const Value& v, const Args& args) {
  std::optional<Value> attribute;
  std::optional<Value> fallback;
  std::string filter;
  Args rest;
  if (args.pos.empty()) {
    for (const auto& [key, value] : args.kw) {
      if (key == "attribute") {
        attribute = value;
      } else if (key == "default") {
        fallback = value;
      } else {
        return Problem(
            absl::StrCat("map: unexpected keyword argument '", key, "'"));
      }
    }
    if (!attribute) return Problem("map requires a filter argument");
  } else {
    ASSIGN_OR_RETURN(filter, StrArg("map's filter name", args.pos[0]));
    rest.pos.assign(args.pos.begin() + 1, args.pos.end());
    rest.kw = args.kw;
  }
  return LazyGenerator([&]() -> absl::StatusOr<std::vector<Value>> {
    std::vector<Value> out;
    if (!Truthy(v)) return out;
    ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v));
    for (const Value& item : items) {
      if (attribute) {
        ASSIGN_OR_RETURN(Value mapped, AttrGetter(item, *attribute));
        if (mapped.is_undefined() && fallback) mapped = *fallback;
        out.push_back(std::move(mapped));
      } else {
        ASSIGN_OR_RETURN(Value mapped, ApplyFilter(filter, item, rest));
        out.push_back(std::move(mapped));
      }
    }
    return out;
  }());
}

absl::StatusOr<Value> FilterSelect(const std::string& name, const Value& v,
                                   const Args& args) {
  const bool by_attribute = name == "selectattr" || name == "rejectattr";
  const bool keep_when = name == "select" || name == "selectattr";
  size_t off = 0;
  if (by_attribute) {
    if (args.pos.empty()) {
      return Problem(absl::StrCat(name, ": missing the attribute name"));
    }
    off = 1;
  }
  std::string test;
  Args test_args;
  if (args.pos.size() > off) {
    ASSIGN_OR_RETURN(test,
                     StrArg(absl::StrCat(name, "'s test name"), args.pos[off]));
    test_args.pos.assign(args.pos.begin() + off + 1, args.pos.end());
    test_args.kw = args.kw;
  }
  return LazyGenerator([&]() -> absl::StatusOr<std::vector<Value>> {
    std::vector<Value> out;
    if (!Truthy(v)) return out;
    ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v));
    for (const Value& item : items) {
      Value subject = item;
      if (by_attribute) {
        ASSIGN_OR_RETURN(subject, AttrGetter(item, args.pos[0]));
      }
      bool passes = false;
      if (test.empty()) {
        passes = Truthy(subject);
      } else {
        ASSIGN_OR_RETURN(passes, ApplyTest(test, subject, test_args));
      }
      if (passes == keep_when) out.push_back(item);
    }
    return out;
  }());
}

}  // namespace

absl::StatusOr<Value> ApplyFilter(const std::string& name, const Value& v,
                                  const Args& args) {
  if (!IsKnownFilter(name)) {
    return Problem(absl::StrCat("unknown filter '", name, "'"));
  }
  const std::string what = absl::StrCat("the filter '", name, "'");
  if (name == "map") return FilterMap(v, args);
  if (name == "select" || name == "reject" || name == "selectattr" ||
      name == "rejectattr") {
    return FilterSelect(name, v, args);
  }
  if (name == "default" || name == "d") {
    ASSIGN_OR_RETURN(auto a, Bind(what, args, {"default_value", "boolean"}, 0));
    const Value fallback = a[0] ? *a[0] : String("");
    if (v.is_undefined() || (a[1] && Truthy(*a[1]) && !Truthy(v))) {
      return fallback;
    }
    return v;
  }
  if (name == "join") {
    ASSIGN_OR_RETURN(auto a, Bind(what, args, {"d", "attribute"}, 0));
    std::string separator;
    if (a[0]) {
      ASSIGN_OR_RETURN(separator, Str(*a[0]));
    }
    ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v));
    std::string out;
    for (size_t k = 0; k < items.size(); ++k) {
      if (k > 0) out += separator;
      if (!IsNone(a[1])) {
        ASSIGN_OR_RETURN(Value item, AttrGetter(items[k], *a[1]));
        RETURN_IF_ERROR(AppendStr(item, &out));
      } else {
        RETURN_IF_ERROR(AppendStr(items[k], &out));
      }
    }
    return String(std::move(out));
  }
  if (name == "replace") {
    ASSIGN_OR_RETURN(auto a, Bind(what, args, {"old", "new", "count"}, 2));
    ASSIGN_OR_RETURN(std::string s, Str(v));
    ASSIGN_OR_RETURN(std::string old, Str(*a[0]));
    ASSIGN_OR_RETURN(std::string repl, Str(*a[1]));
    int64_t count = -1;
    if (!IsNone(a[2])) {
      ASSIGN_OR_RETURN(count, IntArg(what, *a[2]));
    }
    ASSIGN_OR_RETURN(std::string out, PyReplace(s, old, repl, count));
    return String(std::move(out));
  }
  if (name == "tojson") return FilterToJson(v, args);
  if (name == "trim") {
    ASSIGN_OR_RETURN(auto a, Bind(what, args, {"chars"}, 0));
    ASSIGN_OR_RETURN(std::string s, Str(v));
    std::string chars;
    if (!IsNone(a[0])) {
      ASSIGN_OR_RETURN(chars, StrArg(what, *a[0]));
    }
    return String(PyStrip(s, IsNone(a[0]) ? nullptr : &chars, true, true),
                  v.is_string() && v.markup);
  }
  if (name == "attr") {
    ASSIGN_OR_RETURN(auto a, Bind(what, args, {"name"}, 1));
    ASSIGN_OR_RETURN(std::string attr, Str(*a[0]));
    if (v.is_undefined()) return UndefinedError(v);
    if (std::optional<Value> real = RealAttribute(v, attr)) return *real;
    return NoAttribute(v, attr);
  }
  if (name == "int") {
    ASSIGN_OR_RETURN(auto a, Bind(what, args, {"default", "base"}, 0));
    const Value fallback = a[0] ? *a[0] : Int(0);
    int64_t base = 10;
    if (a[1]) {
      ASSIGN_OR_RETURN(base, IntArg(what, *a[1]));
    }
    if (v.is_undefined()) return UndefinedError(v);
    if (v.is_integral()) return Int(v.i);
    if (v.kind == Kind::kFloat) {
      if (std::isnan(v.f)) return fallback;
      if (!(std::fabs(v.f) < 9.2e18)) return Overflow();
      return Int(static_cast<int64_t>(v.f));
    }
    if (v.is_string()) {
      if (base >= 2 && base <= 16) {
        if (auto i = ParsePyInt(v.s, static_cast<int>(base))) return Int(*i);
      }
      if (auto d = ParsePyFloat(v.s)) {
        if (std::isfinite(*d) && std::fabs(*d) < 9.2e18) {
          return Int(static_cast<int64_t>(*d));
        }
      }
    }
    return fallback;
  }
  if (name == "float") {
    ASSIGN_OR_RETURN(auto a, Bind(what, args, {"default"}, 0));
    const Value fallback = a[0] ? *a[0] : Float(0.0);
    if (v.is_undefined()) return UndefinedError(v);
    if (v.is_number()) return Float(v.as_double());
    if (v.is_string()) {
      if (auto d = ParsePyFloat(v.s)) return Float(*d);
    }
    return fallback;
  }
  // The rest take no arguments.
  RETURN_IF_ERROR(Bind(what, args, {}, 0).status());
  if (name == "length" || name == "count") {
    ASSIGN_OR_RETURN(int64_t n, Length(v));
    return Int(n);
  }
  if (name == "string") {
    if (v.is_string()) return v;
    ASSIGN_OR_RETURN(std::string s, Str(v));
    return String(std::move(s));
  }
  // As markupsafe.Markup's methods do, these keep a |safe string safe.
  const bool markup = v.is_string() && v.markup;
  if (name == "safe") {
    ASSIGN_OR_RETURN(std::string s, Str(v));
    return String(std::move(s), true);
  }
  if (name == "lower" || name == "upper" || name == "capitalize" ||
      name == "title") {
    ASSIGN_OR_RETURN(std::string s, Str(v));
    if (name == "lower") return String(PyLower(s), markup);
    if (name == "upper") return String(PyUpper(s), markup);
    if (name == "capitalize") return String(PyCapitalize(s), markup);
    return String(JinjaTitle(s));
  }
  if (name == "first" && v.kind == Kind::kGenerator) {
    if (!v.s.empty()) return Problem(v.s);
    size_t& next = *v.cursor;
    if (next >= v.list->items.size()) {
      return Undefined("No first item, sequence was empty.");
    }
    return v.list->items[next++];
  }
  if (name == "first" || name == "list") {
    ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v));
    if (name == "list") return MakeList(std::move(items));
    if (items.empty()) return Undefined("No first item, sequence was empty.");
    return items.front();
  }
  if (name == "last") {
    if (v.kind != Kind::kUndefined && v.kind != Kind::kString &&
        !v.is_sequence() && v.kind != Kind::kDict &&
        v.kind != Kind::kDictView) {
      return Problem(
          absl::StrCat("'", TypeName(v), "' object is not reversible"));
    }
    ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v));
    if (items.empty()) return Undefined("No last item, sequence was empty.");
    return items.back();
  }
  if (name == "items") {
    return LazyGenerator([&]() -> absl::StatusOr<std::vector<Value>> {
      std::vector<Value> items;
      if (v.is_undefined()) return items;
      if (v.kind != Kind::kDict) {
        return Problem("Can only get item pairs from a mapping.");
      }
      for (const auto& [key, value] : v.dict->entries) {
        ASSIGN_OR_RETURN(Value pair, MakeList({String(key), value}, true));
        items.push_back(std::move(pair));
      }
      return items;
    }());
  }
  if (name == "abs") {
    if (v.is_integral()) {
      if (v.i == std::numeric_limits<int64_t>::min()) return Overflow();
      return Int(v.i < 0 ? -v.i : v.i);
    }
    if (v.kind == Kind::kFloat) return Float(std::fabs(v.f));
    return Problem(
        absl::StrCat("bad operand type for abs(): '", TypeName(v), "'"));
  }
  return Problem(absl::StrCat("internal error: filter '", name, "'"));
}

}  // namespace knapserve::jinja
