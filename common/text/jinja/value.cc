#include "common/text/jinja/value.h"

#include <algorithm>
#include <cmath>
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

Value Undefined(std::string why) {
  Value v;
  v.s = std::move(why);
  return v;
}
Value None() {
  Value v;
  v.kind = Kind::kNone;
  return v;
}
Value Bool(bool b) {
  Value v;
  v.kind = Kind::kBool;
  v.i = b;
  return v;
}
Value Int(int64_t i) {
  Value v;
  v.kind = Kind::kInt;
  v.i = i;
  return v;
}
Value Float(double f) {
  Value v;
  v.kind = Kind::kFloat;
  v.f = f;
  return v;
}
Value String(std::string s, bool markup) {
  Value v;
  v.kind = Kind::kString;
  v.s = std::move(s);
  v.markup = markup;
  return v;
}
Value MakeCallable(Callable::Type type, std::string name, Value self) {
  auto fn = std::make_shared<Callable>();
  fn->type = type;
  fn->name = std::move(name);
  fn->self = std::move(self);
  Value v;
  v.kind = Kind::kCallable;
  v.fn = std::move(fn);
  return v;
}

int DepthOf(const Value& v) {
  if (v.has_items()) return v.list->depth;
  if (v.kind == Kind::kDict) return v.dict->depth;
  return 0;
}

bool HasNamespace(const Value& v) {
  if (v.kind == Kind::kNamespace) return true;
  if (v.has_items()) return v.list->has_namespace;
  if (v.kind == Kind::kDict) return v.dict->has_namespace;
  if (v.kind == Kind::kCallable) return HasNamespace(v.fn->self);
  return v.kind == Kind::kLoop;
}

absl::Status TooDeep() {
  return Problem(absl::StrCat("lists and dicts nested more than ",
                              kMaxValueDepth, " levels deep"));
}

absl::StatusOr<Value> MakeList(std::vector<Value> items, bool tuple) {
  auto data = std::make_shared<ListData>();
  for (const Value& item : items) {
    data->depth = std::max(data->depth, DepthOf(item) + 1);
    data->has_namespace = data->has_namespace || HasNamespace(item);
  }
  if (data->depth > kMaxValueDepth) return TooDeep();
  data->items = std::move(items);
  Value v;
  v.kind = tuple ? Kind::kTuple : Kind::kList;
  v.list = std::move(data);
  return v;
}

absl::StatusOr<Value> MakeGenerator(std::vector<Value> items) {
  ASSIGN_OR_RETURN(Value v, MakeList(std::move(items)));
  v.kind = Kind::kGenerator;
  v.cursor = std::make_shared<size_t>(0);
  return v;
}

// `items` as a generator; if computing them failed, a generator that fails
// the same way when it is used (as Jinja's lazy filters do).
absl::StatusOr<Value> LazyGenerator(absl::StatusOr<std::vector<Value>> items) {
  if (items.ok()) return MakeGenerator(*std::move(items));
  if (items.status().code() != absl::StatusCode::kInvalidArgument) {
    return items.status();
  }
  ASSIGN_OR_RETURN(Value v, MakeGenerator({}));
  v.s = std::string(items.status().message());
  return v;
}

absl::StatusOr<Value> MakeDictView(std::vector<Value> items,
                                   DictViewType type) {
  ASSIGN_OR_RETURN(Value v, MakeList(std::move(items)));
  v.kind = Kind::kDictView;
  v.i = type;
  return v;
}

// `entries` must have unique keys.
absl::StatusOr<Value> MakeDict(
    std::vector<std::pair<std::string, Value>> entries) {
  auto data = std::make_shared<DictData>();
  for (const auto& entry : entries) {
    data->depth = std::max(data->depth, DepthOf(entry.second) + 1);
    data->has_namespace = data->has_namespace || HasNamespace(entry.second);
  }
  if (data->depth > kMaxValueDepth) return TooDeep();
  data->entries = std::move(entries);
  Value v;
  v.kind = Kind::kDict;
  v.dict = std::move(data);
  return v;
}

// Sets `key` in `entries`, keeping the position of an existing key (as a
// Python dict does).
void SetEntry(std::vector<std::pair<std::string, Value>>* entries,
              std::string key, Value value) {
  for (auto& entry : *entries) {
    if (entry.first == key) {
      entry.second = std::move(value);
      return;
    }
  }
  entries->emplace_back(std::move(key), std::move(value));
}

// type(v).__name__.
std::string TypeName(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "NoneType";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return "str";
    case Kind::kList:
      return "list";
    case Kind::kTuple:
      return "tuple";
    case Kind::kDict:
      return "dict";
    case Kind::kNamespace:
      return "Namespace";
    case Kind::kLoop:
      return "LoopContext";
    case Kind::kCallable:
      return "builtin_function_or_method";
    case Kind::kGenerator:
      return "generator";
    case Kind::kDictView:
      return v.i == kDictItems  ? "dict_items"
             : v.i == kDictKeys ? "dict_keys"
                                : "dict_values";
  }
  return "object";
}

// jinja2.utils.object_type_repr, for messages about undefined attributes.
std::string ObjectTypeRepr(const Value& v) {
  if (v.kind == Kind::kNone) return "None";
  return absl::StrCat("'", TypeName(v), " object'");
}

// An undefined value used where a value is needed: Jinja's UndefinedError.
absl::Status UndefinedError(const Value& v) { return Problem(v.s); }

bool Truthy(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
    case Kind::kInt:
      return v.i != 0;
    case Kind::kFloat:
      return v.f != 0;
    case Kind::kString:
      return !v.s.empty();
    case Kind::kList:
    case Kind::kTuple:
    case Kind::kDictView:
      return !v.list->items.empty();
    case Kind::kDict:
      return !v.dict->entries.empty();
    default:
      return true;  // Generators too, even exhausted ones.
  }
}

// str(v) appended to `out`, as Jinja prints a value: None, True, 1.0,
// [1, 'a'], {'k': (1,)}; undefined prints nothing.
absl::Status AppendStr(const Value& v, std::string* out) {
  switch (v.kind) {
    case Kind::kUndefined:
      return absl::OkStatus();
    case Kind::kString:
      out->append(v.s);
      break;
    case Kind::kNamespace:
      return Problem("cannot print a namespace object");
    case Kind::kLoop:
      return Problem("cannot print the loop object");
    case Kind::kCallable:
      return Problem(absl::StrCat("cannot print the function '", v.fn->name,
                                  "' (missing parentheses?)"));
    case Kind::kGenerator:
      return Problem(
          "cannot print a generator (what select, map, items... return); "
          "add |list");
    default:
      RETURN_IF_ERROR(AppendRepr(v, out));
  }
  return CheckSize(out->size());
}

// repr(v) appended to `out`.
absl::Status AppendRepr(const Value& v, std::string* out) {
  switch (v.kind) {
    case Kind::kUndefined:
      out->append("Undefined");
      break;
    case Kind::kNone:
      out->append("None");
      break;
    case Kind::kBool:
      out->append(v.i ? "True" : "False");
      break;
    case Kind::kInt:
      absl::StrAppend(out, v.i);
      break;
    case Kind::kFloat:
      out->append(PyFloatRepr(v.f));
      break;
    case Kind::kString:
      if (v.markup) out->append("Markup(");
      AppendStringRepr(v.s, out);
      if (v.markup) out->append(")");
      break;
    case Kind::kDictView: {
      Value list = v;
      list.kind = Kind::kList;
      absl::StrAppend(out, TypeName(v), "(");
      RETURN_IF_ERROR(AppendRepr(list, out));
      out->append(")");
      break;
    }
    case Kind::kList:
    case Kind::kTuple: {
      const bool tuple = v.kind == Kind::kTuple;
      *out += tuple ? '(' : '[';
      const auto& items = v.list->items;
      for (size_t k = 0; k < items.size(); ++k) {
        if (k > 0) out->append(", ");
        RETURN_IF_ERROR(AppendRepr(items[k], out));
      }
      if (tuple && items.size() == 1) *out += ',';
      *out += tuple ? ')' : ']';
      break;
    }
    case Kind::kDict: {
      *out += '{';
      bool first = true;
      for (const auto& [key, value] : v.dict->entries) {
        if (!first) out->append(", ");
        first = false;
        AppendStringRepr(key, out);
        out->append(": ");
        RETURN_IF_ERROR(AppendRepr(value, out));
      }
      *out += '}';
      break;
    }
    default:
      return AppendStr(v, out);
  }
  return CheckSize(out->size());
}

absl::StatusOr<std::string> Str(const Value& v) {
  if (v.kind == Kind::kString) return v.s;
  std::string out;
  RETURN_IF_ERROR(AppendStr(v, &out));
  return out;
}

// Python ==.
bool Equals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_integral() && b.is_integral()) return a.i == b.i;
    if (a.kind == Kind::kFloat && b.kind == Kind::kFloat) return a.f == b.f;
    // int vs float, exactly (long double holds every int64).
    const long double x = a.kind == Kind::kFloat ? a.f : a.i;
    const long double y = b.kind == Kind::kFloat ? b.f : b.i;
    return x == y;
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Kind::kUndefined:
    case Kind::kNone:
      return true;
    case Kind::kString:
      return a.s == b.s;
    case Kind::kList:
    case Kind::kTuple: {
      const auto& x = a.list->items;
      const auto& y = b.list->items;
      if (x.size() != y.size()) return false;
      for (size_t k = 0; k < x.size(); ++k) {
        if (!Equals(x[k], y[k])) return false;
      }
      return true;
    }
    case Kind::kDict: {
      const auto& x = a.dict->entries;
      if (x.size() != b.dict->entries.size()) return false;
      for (const auto& [key, value] : x) {
        const Value* other = b.dict->Find(key);
        if (other == nullptr || !Equals(value, *other)) return false;
      }
      return true;
    }
    case Kind::kNamespace:
      return a.ns == b.ns;
    case Kind::kLoop:
      return a.loop == b.loop;
    case Kind::kCallable:
      return a.fn == b.fn;
    case Kind::kGenerator:
    case Kind::kDictView:
      return a.list == b.list;
    default:
      return false;
  }
}

std::string_view CompareOpText(CompareOp op) {
  switch (op) {
    case CompareOp::kEq:
      return "==";
    case CompareOp::kNe:
      return "!=";
    case CompareOp::kLt:
      return "<";
    case CompareOp::kLe:
      return "<=";
    case CompareOp::kGt:
      return ">";
    case CompareOp::kGe:
      return ">=";
    case CompareOp::kIn:
      return "in";
    case CompareOp::kNotIn:
      return "not in";
  }
  return "?";
}

namespace {

template <typename T>
bool Ordered(CompareOp op, const T& x, const T& y) {
  switch (op) {
    case CompareOp::kLt:
      return x < y;
    case CompareOp::kLe:
      return x <= y;
    case CompareOp::kGt:
      return x > y;
    default:
      return x >= y;
  }
}

}  // namespace

// Python <, <=, >, >= (op is one of those).
absl::StatusOr<bool> Order(CompareOp op, const Value& a, const Value& b) {
  if (a.is_undefined()) return UndefinedError(a);
  if (b.is_undefined()) return UndefinedError(b);
  if (a.is_number() && b.is_number()) {
    if (a.is_integral() && b.is_integral()) return Ordered(op, a.i, b.i);
    const long double x = a.kind == Kind::kFloat ? a.f : a.i;
    const long double y = b.kind == Kind::kFloat ? b.f : b.i;
    return Ordered(op, x, y);
  }
  if (a.is_string() && b.is_string()) {
    // Byte order of UTF-8 is code point order.
    return Ordered(op, a.s.compare(b.s), 0);
  }
  if (a.is_sequence() && a.kind == b.kind) {
    const auto& x = a.list->items;
    const auto& y = b.list->items;
    for (size_t k = 0; k < x.size() && k < y.size(); ++k) {
      if (!Equals(x[k], y[k])) return Order(op, x[k], y[k]);
    }
    return Ordered(op, x.size(), y.size());
  }
  return Problem(absl::StrCat("'", Sv(CompareOpText(op)),
                              "' not supported between instances of '",
                              TypeName(a), "' and '", TypeName(b), "'"));
}

// Python `needle in haystack`.
absl::StatusOr<bool> Contains(const Value& haystack, const Value& needle) {
  switch (haystack.kind) {
    case Kind::kUndefined:
      return false;
    case Kind::kString:
      if (!needle.is_string()) {
        return Problem(
            absl::StrCat("'in <string>' requires string as left operand, not ",
                         TypeName(needle)));
      }
      return haystack.s.find(needle.s) != std::string::npos;
    case Kind::kList:
    case Kind::kTuple:
    case Kind::kDictView:
      for (const Value& item : haystack.list->items) {
        if (Equals(item, needle)) return true;
      }
      return false;
    case Kind::kGenerator: {
      // Consumes the generator up to the item found, as Python does.
      if (!haystack.s.empty()) return Problem(haystack.s);
      const auto& items = haystack.list->items;
      size_t& next = *haystack.cursor;
      while (next < items.size()) {
        if (Equals(items[next++], needle)) return true;
      }
      return false;
    }
    case Kind::kDict:
      if (needle.kind == Kind::kList || needle.kind == Kind::kDict ||
          needle.kind == Kind::kDictView) {
        return Problem(
            absl::StrCat("unhashable type: '", TypeName(needle), "'"));
      }
      return needle.is_string() && haystack.dict->Find(needle.s) != nullptr;
    default:
      return Problem(absl::StrCat("argument of type '", TypeName(haystack),
                                  "' is not iterable"));
  }
}

absl::StatusOr<bool> Compare(CompareOp op, const Value& a, const Value& b) {
  switch (op) {
    case CompareOp::kEq:
      return Equals(a, b);
    case CompareOp::kNe:
      return !Equals(a, b);
    case CompareOp::kIn:
      return Contains(b, a);
    case CompareOp::kNotIn: {
      ASSIGN_OR_RETURN(bool in, Contains(b, a));
      return !in;
    }
    default:
      return Order(op, a, b);
  }
}

// iter(v) as a list: items, dict keys, characters; undefined is empty. A
// generator is used up.
absl::StatusOr<std::vector<Value>> Iterate(const Value& v) {
  std::vector<Value> out;
  switch (v.kind) {
    case Kind::kUndefined:
      return out;
    case Kind::kList:
    case Kind::kTuple:
    case Kind::kDictView:
      return v.list->items;
    case Kind::kGenerator: {
      if (!v.s.empty()) return Problem(v.s);
      const auto& items = v.list->items;
      const size_t next = std::min(*v.cursor, items.size());
      *v.cursor = items.size();
      return std::vector<Value>(items.begin() + next, items.end());
    }
    case Kind::kDict:
      out.reserve(v.dict->entries.size());
      for (const auto& entry : v.dict->entries) {
        out.push_back(String(entry.first));
      }
      return out;
    case Kind::kString: {
      size_t pos = 0;
      while (pos < v.s.size()) {
        const size_t start = pos;
        NextCodePoint(v.s, &pos);
        out.push_back(String(v.s.substr(start, pos - start)));
      }
      return out;
    }
    default:
      return Problem(
          absl::StrCat("'", TypeName(v), "' object is not iterable"));
  }
}

// len(v).
absl::StatusOr<int64_t> Length(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
      return 0;
    case Kind::kString:
      return static_cast<int64_t>(CodePointCount(v.s));
    case Kind::kList:
    case Kind::kTuple:
    case Kind::kDictView:
      return static_cast<int64_t>(v.list->items.size());
    case Kind::kDict:
      return static_cast<int64_t>(v.dict->entries.size());
    case Kind::kLoop:
      return static_cast<int64_t>(v.loop->items->items.size());
    default:
      return Problem(
          absl::StrCat("object of type '", TypeName(v), "' has no len()"));
  }
}

// ---- Arithmetic, as Python does it on int, float, str, list, tuple.

std::string_view BinOpText(BinOp op) {
  switch (op) {
    case BinOp::kAdd:
      return "+";
    case BinOp::kSub:
      return "-";
    case BinOp::kMul:
      return "*";
    case BinOp::kDiv:
      return "/";
    case BinOp::kFloorDiv:
      return "//";
    case BinOp::kMod:
      return "%";
    case BinOp::kPow:
      return "** or pow()";
  }
  return "?";
}

absl::Status Overflow() { return Problem("integer overflow (beyond 64 bits)"); }

namespace {

absl::Status Unsupported(BinOp op, const Value& a, const Value& b) {
  return Problem(absl::StrCat("unsupported operand type(s) for ",
                              Sv(BinOpText(op)), ": '", TypeName(a), "' and '",
                              TypeName(b), "'"));
}

// CPython's float divmod.
void FloatDivMod(double vx, double wx, double* floordiv, double* mod) {
  double m = std::fmod(vx, wx);
  double div = (vx - m) / wx;
  if (m != 0) {
    if ((wx < 0) != (m < 0)) {
      m += wx;
      div -= 1.0;
    }
  } else {
    m = std::copysign(0.0, wx);
  }
  double fd;
  if (div != 0) {
    fd = std::floor(div);
    if (div - fd > 0.5) fd += 1.0;
  } else {
    fd = std::copysign(0.0, vx / wx);
  }
  *floordiv = fd;
  *mod = m;
}

// seq * times for a string, list or tuple.
absl::StatusOr<Value> Repeat(const Value& seq, int64_t times) {
  const size_t size = seq.is_string() ? seq.s.size() : seq.list->items.size();
  if (times <= 0 || size == 0) {
    if (seq.is_string()) return String("");
    return MakeList({}, seq.kind == Kind::kTuple);
  }
  if (seq.is_string()) {
    if (static_cast<uint64_t>(times) > kMaxOutputBytes / size) {
      return Problem(OutputTooLarge());
    }
    std::string out;
    out.reserve(size * times);
    for (int64_t k = 0; k < times; ++k) out += seq.s;
    return String(std::move(out));
  }
  const auto& items = seq.list->items;
  if (static_cast<uint64_t>(times) > kMaxListItems / size) {
    return Problem(
        absl::StrCat("a list of more than ", kMaxListItems, " items"));
  }
  std::vector<Value> out;
  for (int64_t k = 0; k < times; ++k) {
    out.insert(out.end(), items.begin(), items.end());
  }
  return MakeList(std::move(out), seq.kind == Kind::kTuple);
}

}  // namespace

absl::StatusOr<Value> Arith(BinOp op, const Value& a, const Value& b) {
  if (a.is_undefined()) return UndefinedError(a);
  if (b.is_undefined()) return UndefinedError(b);
  if (a.is_number() && b.is_number()) {
    if (a.is_integral() && b.is_integral() && op != BinOp::kDiv) {
      const int64_t x = a.i;
      const int64_t y = b.i;
      int64_t r = 0;
      switch (op) {
        case BinOp::kAdd:
          if (__builtin_add_overflow(x, y, &r)) return Overflow();
          return Int(r);
        case BinOp::kSub:
          if (__builtin_sub_overflow(x, y, &r)) return Overflow();
          return Int(r);
        case BinOp::kMul:
          if (__builtin_mul_overflow(x, y, &r)) return Overflow();
          return Int(r);
        case BinOp::kFloorDiv:
        case BinOp::kMod: {
          if (y == 0) {
            return Problem(op == BinOp::kMod
                               ? "integer modulo by zero"
                               : "integer division or modulo by zero");
          }
          if (x == std::numeric_limits<int64_t>::min() && y == -1) {
            if (op == BinOp::kMod) return Int(0);
            return Overflow();
          }
          int64_t q = x / y;
          int64_t m = x % y;
          if (m != 0 && ((m < 0) != (y < 0))) {
            m += y;
            q -= 1;
          }
          return Int(op == BinOp::kFloorDiv ? q : m);
        }
        case BinOp::kPow: {
          if (y < 0) {
            if (x == 0) {
              return Problem("0.0 cannot be raised to a negative power");
            }
            return Float(std::pow(static_cast<double>(x), y));
          }
          int64_t result = 1;
          int64_t base = x;
          int64_t e = y;
          while (e > 0) {
            if (e & 1) {
              if (__builtin_mul_overflow(result, base, &result)) {
                return Overflow();
              }
            }
            e >>= 1;
            if (e > 0 && __builtin_mul_overflow(base, base, &base)) {
              return Overflow();
            }
          }
          return Int(result);
        }
        default:
          break;
      }
    }
    const double x = a.as_double();
    const double y = b.as_double();
    switch (op) {
      case BinOp::kAdd:
        return Float(x + y);
      case BinOp::kSub:
        return Float(x - y);
      case BinOp::kMul:
        return Float(x * y);
      case BinOp::kDiv:
        if (y == 0) {
          return Problem(a.is_integral() && b.is_integral()
                             ? "division by zero"
                             : "float division by zero");
        }
        return Float(x / y);
      case BinOp::kFloorDiv:
      case BinOp::kMod: {
        if (y == 0) {
          return Problem(op == BinOp::kMod ? "float modulo"
                                           : "float floor division by zero");
        }
        double fd = 0;
        double m = 0;
        FloatDivMod(x, y, &fd, &m);
        return Float(op == BinOp::kFloorDiv ? fd : m);
      }
      case BinOp::kPow:
        if (x == 0 && y < 0) {
          return Problem("0.0 cannot be raised to a negative power");
        }
        if (x < 0 && y != std::floor(y)) {
          return Problem("complex results are not supported");
        }
        return Float(std::pow(x, y));
    }
  }
  if (op == BinOp::kAdd) {
    if (a.is_string() && b.is_string()) {
      RETURN_IF_ERROR(CheckSize(a.s.size() + b.s.size()));
      // markupsafe.Markup escapes a plain string added to it.
      if (a.markup && !b.markup) return String(a.s + HtmlEscape(b.s), true);
      if (b.markup && !a.markup) return String(HtmlEscape(a.s) + b.s, true);
      return String(a.s + b.s, a.markup);
    }
    if (a.is_sequence() && a.kind == b.kind) {
      std::vector<Value> items = a.list->items;
      items.insert(items.end(), b.list->items.begin(), b.list->items.end());
      return MakeList(std::move(items), a.kind == Kind::kTuple);
    }
    if (a.is_string() || a.is_sequence()) {
      return Problem(absl::StrCat("can only concatenate ", TypeName(a),
                                  " (not \"", TypeName(b), "\") to ",
                                  TypeName(a)));
    }
  }
  if (op == BinOp::kMul) {
    if ((a.is_string() || a.is_sequence()) && b.is_integral()) {
      return Repeat(a, b.i);
    }
    if ((b.is_string() || b.is_sequence()) && a.is_integral()) {
      return Repeat(b, a.i);
    }
  }
  if (op == BinOp::kMod && a.is_string()) {
    return Problem("string formatting with % is not supported");
  }
  return Unsupported(op, a, b);
}

}  // namespace knapserve::jinja
