#include "common/text/jinja/args.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/text/jinja/errors.h"

namespace knapserve::jinja {

// Binds `args` to the parameters `names` (the first `required` of them must
// be given), as Python binds a call's arguments. `what` names the callee.
absl::StatusOr<std::vector<std::optional<Value>>> Bind(
    std::string_view what, const Args& args,
    const std::vector<std::string_view>& names, size_t required) {
  if (args.pos.size() > names.size()) {
    return Problem(absl::StrCat(Sv(what), " takes at most ", names.size(),
                                " argument(s) (", args.pos.size(), " given)"));
  }
  std::vector<std::optional<Value>> out(names.size());
  for (size_t k = 0; k < args.pos.size(); ++k) out[k] = args.pos[k];
  for (const auto& [key, value] : args.kw) {
    const auto it = std::find(names.begin(), names.end(), key);
    if (it == names.end()) {
      return Problem(absl::StrCat(
          Sv(what), " got an unexpected keyword argument '", key, "'"));
    }
    auto& slot = out[it - names.begin()];
    if (slot) {
      return Problem(
          absl::StrCat(Sv(what), " got multiple values for '", key, "'"));
    }
    slot = value;
  }
  for (size_t k = 0; k < required; ++k) {
    if (!out[k]) {
      return Problem(absl::StrCat(Sv(what), " is missing its argument '",
                                  Sv(names[k]), "'"));
    }
  }
  return out;
}

// An optional argument that is absent or None.
bool IsNone(const std::optional<Value>& v) {
  return !v || v->kind == Kind::kNone;
}

absl::StatusOr<int64_t> IntArg(std::string_view what, const Value& v) {
  if (!v.is_integral()) {
    return Problem(
        absl::StrCat(Sv(what), " must be an integer, not '", TypeName(v), "'"));
  }
  return v.i;
}

absl::StatusOr<std::string> StrArg(std::string_view what, const Value& v) {
  if (!v.is_string()) {
    return Problem(
        absl::StrCat(Sv(what), " must be a string, not '", TypeName(v), "'"));
  }
  return v.s;
}

bool Among(std::string_view name, std::initializer_list<std::string_view> set) {
  return std::find(set.begin(), set.end(), name) != set.end();
}

}  // namespace knapserve::jinja
