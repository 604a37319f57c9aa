#include "common/text/jinja/tests.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/text/jinja/errors.h"
#include "common/text/jinja/py_string.h"

namespace knapserve::jinja {

bool IsKnownTest(std::string_view name) {
  static constexpr std::string_view kTests[] = {
      "boolean",  "callable", "defined",  "divisibleby", "eq",    "equalto",
      "==",       "escaped",  "even",     "false",       "float", "ge",
      ">=",       "gt",       ">",        "greaterthan", "in",    "integer",
      "iterable", "le",       "<=",       "lower",       "lt",    "<",
      "lessthan", "mapping",  "ne",       "!=",          "none",  "number",
      "odd",      "sameas",   "sequence", "string",      "true",  "undefined",
      "upper"};
  return std::find(std::begin(kTests), std::end(kTests), name) !=
         std::end(kTests);
}

absl::StatusOr<bool> ApplyTest(const std::string& name, const Value& v,
                               const Args& args) {
  if (!IsKnownTest(name)) {
    return Problem(absl::StrCat("unknown test '", name, "'"));
  }
  const std::string what = absl::StrCat("the test '", name, "'");
  const Kind k = v.kind;
  static const std::initializer_list<std::string_view> kNoArgs = {
      "defined", "undefined", "none",     "boolean",  "false",
      "true",    "integer",   "float",    "number",   "string",
      "mapping", "iterable",  "sequence", "callable", "escaped",
      "lower",   "upper",     "odd",      "even"};
  if (Among(name, kNoArgs)) {
    RETURN_IF_ERROR(Bind(what, args, {}, 0).status());
    if (name == "defined") return k != Kind::kUndefined;
    if (name == "undefined") return k == Kind::kUndefined;
    if (name == "none") return k == Kind::kNone;
    if (name == "boolean") return k == Kind::kBool;
    if (name == "false") return k == Kind::kBool && v.i == 0;
    if (name == "true") return k == Kind::kBool && v.i == 1;
    if (name == "integer") return k == Kind::kInt;
    if (name == "float") return k == Kind::kFloat;
    if (name == "number") return v.is_number();
    if (name == "string") return k == Kind::kString;
    if (name == "mapping") return k == Kind::kDict;
    if (name == "iterable") {
      return k == Kind::kUndefined || k == Kind::kString || v.has_items() ||
             k == Kind::kDict || k == Kind::kLoop;
    }
    if (name == "sequence") {
      return k == Kind::kUndefined || k == Kind::kString || v.is_sequence() ||
             k == Kind::kDict;
    }
    if (name == "callable") {
      return k == Kind::kCallable || k == Kind::kUndefined || k == Kind::kLoop;
    }
    if (name == "escaped") return k == Kind::kString && v.markup;
    if (name == "lower" || name == "upper") {
      ASSIGN_OR_RETURN(std::string s, Str(v));
      return PyIsCase(s, name == "upper");
    }
    ASSIGN_OR_RETURN(Value rem, Arith(BinOp::kMod, v, Int(2)));
    return Equals(rem, Int(name == "odd" ? 1 : 0));
  }
  ASSIGN_OR_RETURN(auto a, Bind(what, args, {"other"}, 1));
  const Value& other = *a[0];
  if (name == "divisibleby") {
    ASSIGN_OR_RETURN(Value rem, Arith(BinOp::kMod, v, other));
    return Equals(rem, Int(0));
  }
  if (name == "in") return Contains(other, v);
  if (name == "sameas") {
    if (k != other.kind) return false;
    switch (k) {
      case Kind::kNone:
      case Kind::kUndefined:
        return k == Kind::kNone;
      case Kind::kBool:
        return v.i == other.i;
      case Kind::kInt:  // CPython caches small ints.
        return v.i == other.i && v.i >= -5 && v.i <= 256;
      case Kind::kList:
      case Kind::kTuple:
        return v.list == other.list;
      case Kind::kDict:
        return v.dict == other.dict;
      case Kind::kNamespace:
        return v.ns == other.ns;
      default:
        return false;
    }
  }
  if (Among(name, {"eq", "equalto", "=="})) return Equals(v, other);
  if (Among(name, {"ne", "!="})) return !Equals(v, other);
  if (Among(name, {"lt", "<", "lessthan"})) {
    return Order(CompareOp::kLt, v, other);
  }
  if (Among(name, {"le", "<="})) return Order(CompareOp::kLe, v, other);
  if (Among(name, {"gt", ">", "greaterthan"})) {
    return Order(CompareOp::kGt, v, other);
  }
  if (Among(name, {"ge", ">="})) return Order(CompareOp::kGe, v, other);
  return Problem(absl::StrCat("internal error: test '", name, "'"));
}

}  // namespace knapserve::jinja
