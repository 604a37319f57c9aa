#include "common/base/json_fields.h"

#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"

namespace knapserve {
namespace {

using Json = nlohmann::json;

// Debian's Abseil has its own string_view type; StrCat needs it.
absl::string_view Sv(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

// Longest value text quoted in a type error; longer ones are cut.
constexpr size_t kMaxQuotedValue = 40;

const Json& NullJson() {
  static const Json* const kNull = new Json(nullptr);
  return *kNull;
}

// JSON text of `value` that never throws (invalid UTF-8 is replaced).
std::string SafeDump(const Json& value) {
  return value.dump(-1, ' ', false, Json::error_handler_t::replace);
}

// "string \"12\"", "number 12.5", "boolean true", "null", "array", "object".
std::string Describe(const Json& value) {
  if (value.is_null()) return "null";
  if (value.is_array()) return "array";
  if (value.is_object()) return "object";
  std::string text = SafeDump(value);
  if (text.size() > kMaxQuotedValue)
    text = text.substr(0, kMaxQuotedValue) + "...";
  return absl::StrCat(value.type_name(), " ", text);
}

bool IsIdentifier(std::string_view key) {
  if (key.empty()) return false;
  for (size_t i = 0; i < key.size(); ++i) {
    const char c = key[i];
    const bool letter =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    const bool digit = c >= '0' && c <= '9';
    if (!letter && !(digit && i > 0)) return false;
  }
  return true;
}

// Runs `read`, turning a nlohmann exception (a backstop: the readers check
// types first) into an error naming the reader's field.
template <typename T, typename Read>
absl::StatusOr<T> Guarded(const JsonReader& reader, Read read) {
  try {
    return read();
  } catch (const Json::exception& e) {
    return reader.Error(absl::StrCat("unreadable: ", e.what()));
  }
}

// The field `key` of `reader` for a Required* getter: present (perhaps null,
// which the conversion reports), else "required but missing".
absl::StatusOr<JsonReader> PresentField(const JsonReader& reader,
                                        std::string_view key) {
  RETURN_IF_ERROR(reader.ExpectObject());
  if (!reader.value().contains(key))
    return reader.FieldError(key, "required but missing");
  return reader.Field(key);
}

template <typename T>
absl::StatusOr<T> Required(const JsonReader& reader, std::string_view key,
                           absl::StatusOr<T> (JsonReader::*as)() const) {
  ASSIGN_OR_RETURN(JsonReader field, PresentField(reader, key));
  return (field.*as)();
}

template <typename T>
absl::StatusOr<T> Optional(const JsonReader& reader, std::string_view key,
                           T fallback,
                           absl::StatusOr<T> (JsonReader::*as)() const) {
  RETURN_IF_ERROR(reader.ExpectObject());
  if (!reader.Has(key)) return fallback;
  return (reader.Field(key).*as)();
}

// An array of one converted type; elements are named by index.
template <typename T>
absl::StatusOr<std::vector<T>> ArrayOf(const JsonReader& reader,
                                       std::string_view what,
                                       absl::StatusOr<T> (JsonReader::*as)()
                                           const) {
  if (!reader.value().is_array()) {
    return reader.Error(absl::StrCat("expected an array of ", Sv(what),
                                     ", got ", Describe(reader.value())));
  }
  std::vector<T> out;
  out.reserve(reader.value().size());
  for (size_t i = 0; i < reader.value().size(); ++i) {
    ASSIGN_OR_RETURN(T item, (reader.Element(i).*as)());
    out.push_back(std::move(item));
  }
  return out;
}

}  // namespace

absl::StatusOr<nlohmann::json> ParseJsonText(std::string_view text,
                                             std::string_view file) {
  try {
    return Json::parse(text.begin(), text.end());
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(Sv(file), ": not valid JSON: ", e.what()));
  }
}

JsonReader::JsonReader(const nlohmann::json& value, std::string file)
    : value_(&value), file_(std::move(file)) {}

JsonReader::JsonReader(const nlohmann::json* value, const std::string& file,
                       std::string path)
    : value_(value), file_(file), path_(std::move(path)) {}

absl::Status JsonReader::Error(std::string_view problem) const {
  if (path_.empty())
    return absl::InvalidArgumentError(absl::StrCat(file_, ": ", Sv(problem)));
  return absl::InvalidArgumentError(
      absl::StrCat(file_, ": field \"", path_, "\": ", Sv(problem)));
}

absl::Status JsonReader::FieldError(std::string_view key,
                                    std::string_view problem) const {
  return JsonReader(&NullJson(), file_, ChildPath(key)).Error(problem);
}

absl::Status JsonReader::Annotate(const absl::Status& status) const {
  if (status.ok()) return status;
  const absl::Status prefix =
      Error(std::string_view(status.message().data(), status.message().size()));
  return absl::Status(status.code(), prefix.message());
}

absl::Status JsonReader::TypeError(std::string_view what) const {
  return Error(
      absl::StrCat("expected ", Sv(what), ", got ", Describe(*value_)));
}

std::string JsonReader::ChildPath(std::string_view key) const {
  if (IsIdentifier(key))
    return path_.empty() ? std::string(key) : absl::StrCat(path_, ".", Sv(key));
  std::string quoted;
  for (char c : key) {
    if (c == '\'' || c == '\\') quoted.push_back('\\');
    quoted.push_back(c);
  }
  return absl::StrCat(path_, "['", quoted, "']");
}

absl::Status JsonReader::ExpectObject() const {
  if (value_->is_object()) return absl::OkStatus();
  return TypeError("an object");
}

bool JsonReader::Has(std::string_view key) const {
  if (!value_->is_object()) return false;
  auto it = value_->find(key);
  return it != value_->end() && !it->is_null();
}

JsonReader JsonReader::Field(std::string_view key) const {
  const Json* field = &NullJson();
  if (value_->is_object()) {
    auto it = value_->find(key);
    if (it != value_->end()) field = &*it;
  }
  return JsonReader(field, file_, ChildPath(key));
}

JsonReader JsonReader::Element(size_t index) const {
  const Json* element = &NullJson();
  if (value_->is_array() && index < value_->size()) element = &(*value_)[index];
  return JsonReader(element, file_, absl::StrCat(path_, "[", index, "]"));
}

absl::StatusOr<JsonReader> JsonReader::Child(std::string_view key) const {
  ASSIGN_OR_RETURN(JsonReader field, PresentField(*this, key));
  RETURN_IF_ERROR(field.ExpectObject());
  return field;
}

absl::StatusOr<std::optional<JsonReader>> JsonReader::OptionalChild(
    std::string_view key) const {
  RETURN_IF_ERROR(ExpectObject());
  if (!Has(key)) return std::optional<JsonReader>();
  JsonReader field = Field(key);
  RETURN_IF_ERROR(field.ExpectObject());
  return std::optional<JsonReader>(std::move(field));
}

absl::StatusOr<int64_t> JsonReader::AsInt64() const {
  return Guarded<int64_t>(*this, [&]() -> absl::StatusOr<int64_t> {
    const Json& v = *value_;
    if (v.is_number_unsigned()) {
      const uint64_t u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Error(
            absl::StrCat("integer ", u, " is out of the 64-bit range"));
      }
      return static_cast<int64_t>(u);
    }
    if (v.is_number_integer()) return v.get<int64_t>();
    if (v.is_number_float()) {
      const double d = v.get<double>();
      if (std::isfinite(d) && d == std::floor(d)) {
        // 2^63 is exactly representable; every double below it in magnitude
        // converts without overflow.
        if (std::fabs(d) < 9223372036854775808.0)
          return static_cast<int64_t>(d);
        return Error(absl::StrCat("integer ", SafeDump(v),
                                  " is out of the 64-bit range"));
      }
    }
    return TypeError("an integer");
  });
}

absl::StatusOr<int> JsonReader::AsInt() const {
  ASSIGN_OR_RETURN(int64_t v, AsInt64());
  if (v < std::numeric_limits<int>::min() ||
      v > std::numeric_limits<int>::max()) {
    return Error(absl::StrCat("integer ", v, " is out of the 32-bit range"));
  }
  return static_cast<int>(v);
}

absl::StatusOr<double> JsonReader::AsDouble() const {
  return Guarded<double>(*this, [&]() -> absl::StatusOr<double> {
    if (!value_->is_number()) return TypeError("a number");
    return value_->get<double>();
  });
}

absl::StatusOr<bool> JsonReader::AsBool() const {
  return Guarded<bool>(*this, [&]() -> absl::StatusOr<bool> {
    if (!value_->is_boolean()) return TypeError("true or false");
    return value_->get<bool>();
  });
}

absl::StatusOr<std::string> JsonReader::AsString() const {
  return Guarded<std::string>(*this, [&]() -> absl::StatusOr<std::string> {
    if (!value_->is_string()) return TypeError("a string");
    return value_->get<std::string>();
  });
}

absl::StatusOr<std::vector<std::string>> JsonReader::AsStringOrList() const {
  using Result = std::vector<std::string>;
  return Guarded<Result>(*this, [&]() -> absl::StatusOr<Result> {
    if (value_->is_string()) return Result{value_->get<std::string>()};
    if (!value_->is_array()) return TypeError("a string or a list of strings");
    return ArrayOf<std::string>(*this, "strings", &JsonReader::AsString);
  });
}

absl::StatusOr<std::vector<int64_t>> JsonReader::AsInt64OrList() const {
  if (value_->is_array())
    return ArrayOf<int64_t>(*this, "integers", &JsonReader::AsInt64);
  if (!value_->is_number())
    return TypeError("an integer or a list of integers");
  ASSIGN_OR_RETURN(int64_t v, AsInt64());
  return std::vector<int64_t>{v};
}

absl::StatusOr<std::vector<int64_t>> JsonReader::AsInt64Array() const {
  return ArrayOf<int64_t>(*this, "integers", &JsonReader::AsInt64);
}

absl::StatusOr<std::vector<double>> JsonReader::AsDoubleArray() const {
  return ArrayOf<double>(*this, "numbers", &JsonReader::AsDouble);
}

absl::StatusOr<std::vector<std::string>> JsonReader::AsStringArray() const {
  return ArrayOf<std::string>(*this, "strings", &JsonReader::AsString);
}

absl::StatusOr<std::vector<JsonReader>> JsonReader::AsArray() const {
  if (!value_->is_array()) return TypeError("an array");
  std::vector<JsonReader> out;
  out.reserve(value_->size());
  for (size_t i = 0; i < value_->size(); ++i) out.push_back(Element(i));
  return out;
}

absl::StatusOr<std::vector<std::pair<std::string, JsonReader>>>
JsonReader::AsMembers() const {
  RETURN_IF_ERROR(ExpectObject());
  std::vector<std::pair<std::string, JsonReader>> out;
  out.reserve(value_->size());
  for (auto it = value_->begin(); it != value_->end(); ++it) {
    out.emplace_back(it.key(),
                     JsonReader(&it.value(), file_, ChildPath(it.key())));
  }
  return out;
}

absl::StatusOr<int> JsonReader::RequiredInt(std::string_view key) const {
  return Required<int>(*this, key, &JsonReader::AsInt);
}
absl::StatusOr<int> JsonReader::OptionalInt(std::string_view key,
                                            int fallback) const {
  return Optional<int>(*this, key, fallback, &JsonReader::AsInt);
}
absl::StatusOr<int64_t> JsonReader::RequiredInt64(std::string_view key) const {
  return Required<int64_t>(*this, key, &JsonReader::AsInt64);
}
absl::StatusOr<int64_t> JsonReader::OptionalInt64(std::string_view key,
                                                  int64_t fallback) const {
  return Optional<int64_t>(*this, key, fallback, &JsonReader::AsInt64);
}
absl::StatusOr<double> JsonReader::RequiredDouble(std::string_view key) const {
  return Required<double>(*this, key, &JsonReader::AsDouble);
}
absl::StatusOr<double> JsonReader::OptionalDouble(std::string_view key,
                                                  double fallback) const {
  return Optional<double>(*this, key, fallback, &JsonReader::AsDouble);
}
absl::StatusOr<bool> JsonReader::RequiredBool(std::string_view key) const {
  return Required<bool>(*this, key, &JsonReader::AsBool);
}
absl::StatusOr<bool> JsonReader::OptionalBool(std::string_view key,
                                              bool fallback) const {
  return Optional<bool>(*this, key, fallback, &JsonReader::AsBool);
}
absl::StatusOr<std::string> JsonReader::RequiredString(
    std::string_view key) const {
  return Required<std::string>(*this, key, &JsonReader::AsString);
}
absl::StatusOr<std::string> JsonReader::OptionalString(
    std::string_view key, std::string_view fallback) const {
  return Optional<std::string>(*this, key, std::string(fallback),
                               &JsonReader::AsString);
}
absl::StatusOr<std::vector<std::string>> JsonReader::RequiredStringOrList(
    std::string_view key) const {
  return Required<std::vector<std::string>>(*this, key,
                                            &JsonReader::AsStringOrList);
}
absl::StatusOr<std::vector<std::string>> JsonReader::OptionalStringOrList(
    std::string_view key) const {
  return Optional<std::vector<std::string>>(*this, key, {},
                                            &JsonReader::AsStringOrList);
}
absl::StatusOr<std::vector<int64_t>> JsonReader::RequiredInt64OrList(
    std::string_view key) const {
  return Required<std::vector<int64_t>>(*this, key, &JsonReader::AsInt64OrList);
}
absl::StatusOr<std::vector<int64_t>> JsonReader::OptionalInt64OrList(
    std::string_view key) const {
  return Optional<std::vector<int64_t>>(*this, key, {},
                                        &JsonReader::AsInt64OrList);
}
absl::StatusOr<std::vector<int64_t>> JsonReader::RequiredInt64Array(
    std::string_view key) const {
  return Required<std::vector<int64_t>>(*this, key, &JsonReader::AsInt64Array);
}
absl::StatusOr<std::vector<int64_t>> JsonReader::OptionalInt64Array(
    std::string_view key) const {
  return Optional<std::vector<int64_t>>(*this, key, {},
                                        &JsonReader::AsInt64Array);
}
absl::StatusOr<std::vector<double>> JsonReader::RequiredDoubleArray(
    std::string_view key) const {
  return Required<std::vector<double>>(*this, key, &JsonReader::AsDoubleArray);
}
absl::StatusOr<std::vector<double>> JsonReader::OptionalDoubleArray(
    std::string_view key) const {
  return Optional<std::vector<double>>(*this, key, {},
                                       &JsonReader::AsDoubleArray);
}
absl::StatusOr<std::vector<std::string>> JsonReader::RequiredStringArray(
    std::string_view key) const {
  return Required<std::vector<std::string>>(*this, key,
                                            &JsonReader::AsStringArray);
}
absl::StatusOr<std::vector<std::string>> JsonReader::OptionalStringArray(
    std::string_view key) const {
  return Optional<std::vector<std::string>>(*this, key, {},
                                            &JsonReader::AsStringArray);
}
absl::StatusOr<std::vector<JsonReader>> JsonReader::RequiredArray(
    std::string_view key) const {
  return Required<std::vector<JsonReader>>(*this, key, &JsonReader::AsArray);
}
absl::StatusOr<std::vector<JsonReader>> JsonReader::OptionalArray(
    std::string_view key) const {
  return Optional<std::vector<JsonReader>>(*this, key, {},
                                           &JsonReader::AsArray);
}

}  // namespace knapserve
