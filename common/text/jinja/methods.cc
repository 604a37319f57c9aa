#include "common/text/jinja/methods.h"

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/text/jinja/errors.h"
#include "common/text/jinja/py_string.h"

namespace knapserve::jinja {

Value NoAttribute(const Value& obj, std::string_view name) {
  return Undefined(absl::StrCat(ObjectTypeRepr(obj), " has no attribute ",
                                QuotedName(name)));
}

namespace {

// The methods of Python's str.
bool IsStrMethod(std::string_view name) {
  return Among(
      name,
      {"capitalize",   "casefold",     "center",    "count",     "encode",
       "endswith",     "expandtabs",   "find",      "format",    "format_map",
       "index",        "isalnum",      "isalpha",   "isascii",   "isdecimal",
       "isdigit",      "isidentifier", "islower",   "isnumeric", "isprintable",
       "isspace",      "istitle",      "isupper",   "join",      "ljust",
       "lower",        "lstrip",       "maketrans", "partition", "removeprefix",
       "removesuffix", "replace",      "rfind",     "rindex",    "rjust",
       "rpartition",   "rsplit",       "rstrip",    "split",     "splitlines",
       "startswith",   "strip",        "swapcase",  "title",     "translate",
       "upper",        "zfill"});
}

// Python's index of `i` into a sequence of length `n` (negative counts from
// the end); nullopt when out of range.
std::optional<size_t> Index(int64_t i, size_t n) {
  const int64_t len = static_cast<int64_t>(n);
  if (i < 0) i += len;
  if (i < 0 || i >= len) return std::nullopt;
  return static_cast<size_t>(i);
}

}  // namespace

// The attribute `name` of `obj` that is a method (or, for a namespace and
// the loop, a field), as Python's getattr finds it; nullopt if there is none.
// Mutating methods of lists and dicts are "unsafe" in Jinja's immutable
// sandbox: undefined, and an error when called.
std::optional<Value> RealAttribute(const Value& obj, const std::string& name) {
  auto method = [&]() {
    return MakeCallable(Callable::Type::kMethod, name, obj);
  };
  auto unsafe = [&]() {
    return Undefined(absl::StrCat("access to attribute '", name, "' of '",
                                  TypeName(obj), "' object is unsafe."));
  };
  switch (obj.kind) {
    case Kind::kString:
      if (IsStrMethod(name)) return method();
      break;
    case Kind::kDict:
      if (Among(name, {"copy", "fromkeys", "get", "items", "keys", "values"})) {
        return method();
      }
      if (Among(name, {"clear", "pop", "popitem", "setdefault", "update"})) {
        return unsafe();
      }
      break;
    case Kind::kList:
      if (Among(name, {"copy", "count", "index"})) return method();
      if (Among(name, {"append", "clear", "extend", "insert", "pop", "remove",
                       "reverse", "sort"})) {
        return unsafe();
      }
      break;
    case Kind::kTuple:
      if (Among(name, {"count", "index"})) return method();
      break;
    case Kind::kNamespace:
      for (const auto& [key, value] : obj.ns->attrs) {
        if (key == name) return value;
      }
      break;
    case Kind::kLoop: {
      const int64_t i = obj.loop->index0;
      const auto& items = obj.loop->items->items;
      const int64_t n = static_cast<int64_t>(items.size());
      if (name == "index") return Int(i + 1);
      if (name == "index0") return Int(i);
      if (name == "revindex") return Int(n - i);
      if (name == "revindex0") return Int(n - i - 1);
      if (name == "first") return Bool(i == 0);
      if (name == "last") return Bool(i == n - 1);
      if (name == "length") return Int(n);
      if (name == "depth") return Int(1);
      if (name == "depth0") return Int(0);
      if (name == "previtem") {
        if (i > 0) return items[i - 1];
        return Undefined("there is no previous item");
      }
      if (name == "nextitem") {
        if (i + 1 < n) return items[i + 1];
        return Undefined("there is no next item");
      }
      if (name == "cycle") {
        return MakeCallable(Callable::Type::kCycle, "loop.cycle", obj);
      }
      if (name == "changed") return method();
      break;
    }
    default:
      break;
  }
  return std::nullopt;
}

// obj.name, as jinja2's sandboxed getattr: a real attribute, else the item
// `name`, else undefined. An attribute of undefined is an error.
absl::StatusOr<Value> GetAttr(const Value& obj, const std::string& name) {
  if (obj.is_undefined()) return UndefinedError(obj);
  if (std::optional<Value> attr = RealAttribute(obj, name)) return *attr;
  if (obj.kind == Kind::kDict) {
    if (const Value* v = obj.dict->Find(name)) return *v;
  }
  return NoAttribute(obj, name);
}

// obj[key], as jinja2's sandboxed getitem: the item, else the attribute
// named `key`, else undefined. An item of undefined is an error.
absl::StatusOr<Value> GetItem(const Value& obj, const Value& key) {
  if (obj.is_undefined()) return UndefinedError(obj);
  switch (obj.kind) {
    case Kind::kDict:
      if (key.is_string()) {
        if (const Value* v = obj.dict->Find(key.s)) return *v;
      }
      break;
    case Kind::kList:
    case Kind::kTuple:
      if (key.is_integral()) {
        if (auto k = Index(key.i, obj.list->items.size())) {
          return obj.list->items[*k];
        }
      }
      break;
    case Kind::kString:
      if (key.is_integral()) {
        const std::u32string cps = Decode(obj.s);
        if (auto k = Index(key.i, cps.size())) {
          return String(Encode(std::u32string_view(&cps[*k], 1)));
        }
      }
      break;
    default:
      break;
  }
  if (key.is_string()) {
    if (std::optional<Value> attr = RealAttribute(obj, key.s)) return *attr;
    return NoAttribute(obj, key.s);
  }
  std::string shown;
  RETURN_IF_ERROR(AppendRepr(key, &shown));
  return Undefined(
      absl::StrCat(ObjectTypeRepr(obj), " has no element ", shown));
}

// seq[start:stop:step] with Python's semantics; any part may be absent.
// Jinja subscripts slices directly (not through the sandbox's getitem), so
// every failure is an error.
absl::StatusOr<Value> SliceOf(const Value& obj,
                              const std::optional<Value> parts[3]) {
  if (obj.is_undefined()) return UndefinedError(obj);
  if (obj.kind == Kind::kDict) return Problem("unhashable type: 'slice'");
  if (obj.kind != Kind::kString && !obj.is_sequence()) {
    return Problem(
        absl::StrCat("'", TypeName(obj), "' object is not subscriptable"));
  }
  std::optional<int64_t> bound[3];
  for (int k = 0; k < 3; ++k) {
    if (!parts[k] || parts[k]->kind == Kind::kNone) continue;
    if (!parts[k]->is_integral()) {
      return Problem(
          "slice indices must be integers or None or have an __index__ "
          "method");
    }
    bound[k] = parts[k]->i;
  }
  const int64_t step = bound[2].value_or(1);
  if (step == 0) return Problem("slice step cannot be zero");
  std::u32string cps;
  size_t length = 0;
  if (obj.is_string()) {
    cps = Decode(obj.s);
    length = cps.size();
  } else {
    length = obj.list->items.size();
  }
  const int64_t len = static_cast<int64_t>(length);
  const int64_t lower = step > 0 ? 0 : -1;
  const int64_t upper = step > 0 ? len : len - 1;
  auto adjust = [&](std::optional<int64_t> v, int64_t fallback) {
    if (!v) return fallback;
    int64_t x = *v;
    if (x < 0) {
      x += len;
      if (x < lower) x = lower;
    } else if (x > upper) {
      x = upper;
    }
    return x;
  };
  const int64_t start = adjust(bound[0], step < 0 ? upper : lower);
  const int64_t stop = adjust(bound[1], step < 0 ? lower : upper);
  std::vector<size_t> picked;
  for (int64_t i = start; step > 0 ? i < stop : i > stop;) {
    picked.push_back(static_cast<size_t>(i));
    if (__builtin_add_overflow(i, step, &i)) break;
  }
  if (obj.is_string()) {
    std::u32string out;
    for (size_t k : picked) out += cps[k];
    return String(Encode(out));
  }
  std::vector<Value> items;
  items.reserve(picked.size());
  for (size_t k : picked) items.push_back(obj.list->items[k]);
  return MakeList(std::move(items), obj.kind == Kind::kTuple);
}

absl::StatusOr<Value> CallMethod(const Value& self, const std::string& name,
                                 const Args& args) {
  const std::string what = absl::StrCat(TypeName(self), ".", name, "()");
  if (self.is_string()) {
    const std::string& s = self.s;
    if (name == "startswith" || name == "endswith") {
      ASSIGN_OR_RETURN(auto a, Bind(what, args, {"prefix", "start", "end"}, 1));
      if (a[1] || a[2]) {
        return Problem(absl::StrCat(what, ": start and end are not supported"));
      }
      std::vector<std::string> options;
      if (a[0]->is_string()) {
        options.push_back(a[0]->s);
      } else if (a[0]->kind == Kind::kTuple) {
        for (const Value& item : a[0]->list->items) {
          ASSIGN_OR_RETURN(std::string option, StrArg(what, item));
          options.push_back(std::move(option));
        }
      } else {
        return Problem(absl::StrCat(name,
                                    " first arg must be str or a tuple of "
                                    "str, not ",
                                    TypeName(*a[0])));
      }
      for (const std::string& option : options) {
        if (option.size() > s.size()) continue;
        if (name == "startswith" ? s.compare(0, option.size(), option) == 0
                                 : s.compare(s.size() - option.size(),
                                             option.size(), option) == 0) {
          return Bool(true);
        }
      }
      return Bool(false);
    }
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      ASSIGN_OR_RETURN(auto a, Bind(what, args, {"chars"}, 0));
      std::string chars;
      if (!IsNone(a[0])) {
        ASSIGN_OR_RETURN(chars, StrArg(what, *a[0]));
      }
      return String(PyStrip(s, IsNone(a[0]) ? nullptr : &chars,
                            name != "rstrip", name != "lstrip"));
    }
    if (name == "split" || name == "rsplit") {
      ASSIGN_OR_RETURN(auto a, Bind(what, args, {"sep", "maxsplit"}, 0));
      std::string sep;
      if (!IsNone(a[0])) {
        ASSIGN_OR_RETURN(sep, StrArg(what, *a[0]));
      }
      int64_t maxsplit = -1;
      if (a[1]) {
        ASSIGN_OR_RETURN(maxsplit, IntArg(what, *a[1]));
      }
      ASSIGN_OR_RETURN(std::vector<std::string> parts,
                       PySplit(s, IsNone(a[0]) ? nullptr : &sep, maxsplit,
                               name == "rsplit"));
      std::vector<Value> items;
      for (std::string& part : parts) items.push_back(String(std::move(part)));
      return MakeList(std::move(items));
    }
    if (name == "upper" || name == "lower" || name == "title" ||
        name == "capitalize") {
      RETURN_IF_ERROR(Bind(what, args, {}, 0).status());
      if (name == "upper") return String(PyUpper(s));
      if (name == "lower") return String(PyLower(s));
      if (name == "title") return String(PyTitle(s));
      return String(PyCapitalize(s));
    }
    if (name == "replace") {
      ASSIGN_OR_RETURN(auto a, Bind(what, args, {"old", "new", "count"}, 2));
      ASSIGN_OR_RETURN(std::string old, StrArg(what, *a[0]));
      ASSIGN_OR_RETURN(std::string repl, StrArg(what, *a[1]));
      int64_t count = -1;
      if (a[2]) {
        ASSIGN_OR_RETURN(count, IntArg(what, *a[2]));
      }
      ASSIGN_OR_RETURN(std::string out, PyReplace(s, old, repl, count));
      return String(std::move(out));
    }
    if (name == "find" || name == "count" || name == "removeprefix" ||
        name == "removesuffix") {
      ASSIGN_OR_RETURN(auto a, Bind(what, args, {"sub"}, 1));
      ASSIGN_OR_RETURN(std::string sub, StrArg(what, *a[0]));
      if (name == "find") {
        const size_t at = s.find(sub);
        if (at == std::string::npos) return Int(-1);
        return Int(static_cast<int64_t>(CodePointCount(s.substr(0, at))));
      }
      if (name == "count") {
        if (sub.empty()) {
          return Int(static_cast<int64_t>(CodePointCount(s)) + 1);
        }
        int64_t n = 0;
        for (size_t at = s.find(sub); at != std::string::npos;
             at = s.find(sub, at + sub.size())) {
          ++n;
        }
        return Int(n);
      }
      if (name == "removeprefix") {
        if (s.compare(0, sub.size(), sub) == 0)
          return String(s.substr(sub.size()));
        return String(s);
      }
      if (sub.size() <= s.size() &&
          s.compare(s.size() - sub.size(), sub.size(), sub) == 0) {
        return String(s.substr(0, s.size() - sub.size()));
      }
      return String(s);
    }
    if (name == "join") {
      ASSIGN_OR_RETURN(auto a, Bind(what, args, {"iterable"}, 1));
      ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(*a[0]));
      std::string out;
      for (size_t k = 0; k < items.size(); ++k) {
        if (!items[k].is_string()) {
          return Problem(absl::StrCat("sequence item ", k,
                                      ": expected str instance, ",
                                      TypeName(items[k]), " found"));
        }
        if (k > 0) out += s;
        out += items[k].s;
        RETURN_IF_ERROR(CheckSize(out.size()));
      }
      return String(std::move(out));
    }
  } else if (self.kind == Kind::kDict) {
    const auto& entries = self.dict->entries;
    if (name == "get") {
      ASSIGN_OR_RETURN(auto a, Bind(what, args, {"key", "default"}, 1));
      if (a[0]->is_string()) {
        if (const Value* v = self.dict->Find(a[0]->s)) return *v;
      }
      return a[1] ? *a[1] : None();
    }
    if (name == "items" || name == "keys" || name == "values") {
      RETURN_IF_ERROR(Bind(what, args, {}, 0).status());
      std::vector<Value> items;
      for (const auto& [key, value] : entries) {
        if (name == "keys") {
          items.push_back(String(key));
        } else if (name == "values") {
          items.push_back(value);
        } else {
          ASSIGN_OR_RETURN(Value pair, MakeList({String(key), value}, true));
          items.push_back(std::move(pair));
        }
      }
      return MakeDictView(std::move(items), name == "items"  ? kDictItems
                                            : name == "keys" ? kDictKeys
                                                             : kDictValues);
    }
    if (name == "copy") {
      RETURN_IF_ERROR(Bind(what, args, {}, 0).status());
      return self;
    }
  } else if (self.is_sequence()) {
    const auto& items = self.list->items;
    if (name == "count" || name == "index") {
      ASSIGN_OR_RETURN(auto a, Bind(what, args, {"value"}, 1));
      int64_t n = 0;
      for (size_t k = 0; k < items.size(); ++k) {
        if (!Equals(items[k], *a[0])) continue;
        if (name == "index") return Int(static_cast<int64_t>(k));
        ++n;
      }
      if (name == "index") {
        return Problem(
            absl::StrCat(what, ": value is not in the ", TypeName(self)));
      }
      return Int(n);
    }
    if (name == "copy") {
      RETURN_IF_ERROR(Bind(what, args, {}, 0).status());
      return self;
    }
  }
  return Problem(absl::StrCat(what, " is not supported"));
}

}  // namespace knapserve::jinja
