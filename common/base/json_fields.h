// JsonReader: typed, checked reading of the fields of a parsed JSON file
// (config.json, generation_config.json, tokenizer.json, latency profiles),
// with one style of error message that names the file and the field:
//
//   config.json: field "num_hidden_layers": expected an integer, got string
//   "12" tokenizer.json: field "model.merges[12]": expected a string or a list
//   of strings, got number 3 profile.json: field "mlp_seconds": required but
//   missing config.json: field "vocab_size": must be positive, got 0
//   (reader.FieldError) config.json: expected an object, got array (the root
//   itself)
//
//   ASSIGN_OR_RETURN(nlohmann::json json, ParseJsonText(text, path));
//   JsonReader root(json, path);
//   RETURN_IF_ERROR(root.ExpectObject());
//   ASSIGN_OR_RETURN(int64_t layers, root.RequiredInt64("num_hidden_layers"));
//   ASSIGN_OR_RETURN(JsonReader model, root.Child("model"));   // path "model"
//   ASSIGN_OR_RETURN(bool fuse_unk, model.OptionalBool("fuse_unk", false));
//
// The rules, the same for every file:
//  - An absent field and a null field are the same: Optional* returns its
//    default for both; Required* says "required but missing" for an absent
//    field and "expected ..., got null" for a null one.
//  - Integers are JSON integers or integral floats (some exporters write
//    512.0); a value outside the target type's range is an error. Doubles are
//    any JSON number. Booleans are true/false only (not 0/1).
//  - Reading a field of a value that is not an object is an error naming that
//    value ("expected an object, got ..."); only Has (false) and Field (a
//    null) are quiet about it.
//  - Errors are InvalidArgument. No exception escapes: nlohmann's are caught in
//    the reader and become errors naming the field.
//
// Ownership and threads: a JsonReader points at a nlohmann::json value that it
// does not own; the document must outlive the reader and every reader made
// from it, and must not change while they are in use. Readers are small values
// (the file name and the path are copied): copy them freely. All methods are
// const and safe to call from any thread.
#ifndef KNAPSERVE_COMMON_BASE_JSON_FIELDS_H_
#define KNAPSERVE_COMMON_BASE_JSON_FIELDS_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace knapserve {

// Parses `text` as JSON. InvalidArgument "<file>: not valid JSON: <the
// parser's reason, with line and column>" when it is not.
absl::StatusOr<nlohmann::json> ParseJsonText(std::string_view text,
                                             std::string_view file);

class JsonReader {
 public:
  // A reader of the document root `value` of the file `file` (the name used
  // in error messages: a path, or just "config.json").
  JsonReader(const nlohmann::json& value, std::string file);

  // The value this reader is at, for checks of its own (is_string(), size()).
  const nlohmann::json& value() const { return *value_; }
  const std::string& file() const { return file_; }
  // Where the value is in the document: "" at the root, else e.g. "model",
  // "model.merges[12]", "special_tokens[\"<s>\"].ids" (keys that are not plain
  // identifiers are quoted).
  const std::string& path() const { return path_; }
  bool is_null() const { return value_->is_null(); }

  // ---- Errors in the one style ----

  // InvalidArgument "<file>: field \"<path>\": <problem>" ("<file>: <problem>"
  // at the root).
  absl::Status Error(std::string_view problem) const;
  // The same for the field `key` of this object: for checks callers make on a
  // value they read (ranges, allowed names).
  absl::Status FieldError(std::string_view key, std::string_view problem) const;
  // "expected <what>, got <this value's type and, for a scalar, its text>",
  // e.g. what = "a token id" gives "expected a token id, got string \"x\"".
  absl::Status TypeError(std::string_view what) const;
  // `status` (not OK) from some other source, e.g. a regex compiler, with this
  // reader's "<file>: field \"<path>\": " prefix; its code is kept. OK stays
  // OK.
  absl::Status Annotate(const absl::Status& status) const;

  // ---- Structure ----

  // OK if this value is an object, else the error "expected an object, got
  // ...".
  absl::Status ExpectObject() const;
  // True when this is an object holding `key` with a non-null value.
  bool Has(std::string_view key) const;
  // The value of `key`, as a reader at path "<path>.<key>": a JSON null when
  // the field is absent (or this value is not an object), for components that
  // may be left out. The Required/Optional getters below check more.
  JsonReader Field(std::string_view key) const;
  // The element `index` of this array, at path "<path>[<index>]": a JSON null
  // when out of range (or this value is not an array).
  JsonReader Element(size_t index) const;
  // The field `key`, which must be present and an object.
  absl::StatusOr<JsonReader> Child(std::string_view key) const;
  // The field `key` if present and not null, which must then be an object.
  absl::StatusOr<std::optional<JsonReader>> OptionalChild(
      std::string_view key) const;

  // ---- This value, converted ----

  // The ranges: int is 32-bit; int64_t is 64-bit.
  absl::StatusOr<int> AsInt() const;
  absl::StatusOr<int64_t> AsInt64() const;
  absl::StatusOr<double> AsDouble() const;
  absl::StatusOr<bool> AsBool() const;
  absl::StatusOr<std::string> AsString() const;
  // A string, as one element, or an array of strings.
  absl::StatusOr<std::vector<std::string>> AsStringOrList() const;
  // An integer, as one element, or an array of integers.
  absl::StatusOr<std::vector<int64_t>> AsInt64OrList() const;
  // Arrays; an element of the wrong type is named by its index.
  absl::StatusOr<std::vector<int64_t>> AsInt64Array() const;
  absl::StatusOr<std::vector<double>> AsDoubleArray() const;
  absl::StatusOr<std::vector<std::string>> AsStringArray() const;
  // An array of anything, as readers of its elements.
  absl::StatusOr<std::vector<JsonReader>> AsArray() const;
  // An object, as (key, reader of the value) pairs in key order.
  absl::StatusOr<std::vector<std::pair<std::string, JsonReader>>> AsMembers()
      const;

  // ---- Fields of this object, converted ----
  // Required*: the field must be present and not null. Optional*: absent or
  // null gives `fallback` (an empty list for the list getters).

  absl::StatusOr<int> RequiredInt(std::string_view key) const;
  absl::StatusOr<int> OptionalInt(std::string_view key, int fallback) const;
  absl::StatusOr<int64_t> RequiredInt64(std::string_view key) const;
  absl::StatusOr<int64_t> OptionalInt64(std::string_view key,
                                        int64_t fallback) const;
  absl::StatusOr<double> RequiredDouble(std::string_view key) const;
  absl::StatusOr<double> OptionalDouble(std::string_view key,
                                        double fallback) const;
  absl::StatusOr<bool> RequiredBool(std::string_view key) const;
  absl::StatusOr<bool> OptionalBool(std::string_view key, bool fallback) const;
  absl::StatusOr<std::string> RequiredString(std::string_view key) const;
  absl::StatusOr<std::string> OptionalString(std::string_view key,
                                             std::string_view fallback) const;
  absl::StatusOr<std::vector<std::string>> RequiredStringOrList(
      std::string_view key) const;
  absl::StatusOr<std::vector<std::string>> OptionalStringOrList(
      std::string_view key) const;
  absl::StatusOr<std::vector<int64_t>> RequiredInt64OrList(
      std::string_view key) const;
  absl::StatusOr<std::vector<int64_t>> OptionalInt64OrList(
      std::string_view key) const;
  absl::StatusOr<std::vector<int64_t>> RequiredInt64Array(
      std::string_view key) const;
  absl::StatusOr<std::vector<int64_t>> OptionalInt64Array(
      std::string_view key) const;
  absl::StatusOr<std::vector<double>> RequiredDoubleArray(
      std::string_view key) const;
  absl::StatusOr<std::vector<double>> OptionalDoubleArray(
      std::string_view key) const;
  absl::StatusOr<std::vector<std::string>> RequiredStringArray(
      std::string_view key) const;
  absl::StatusOr<std::vector<std::string>> OptionalStringArray(
      std::string_view key) const;
  absl::StatusOr<std::vector<JsonReader>> RequiredArray(
      std::string_view key) const;
  absl::StatusOr<std::vector<JsonReader>> OptionalArray(
      std::string_view key) const;

 private:
  JsonReader(const nlohmann::json* value, const std::string& file,
             std::string path);

  std::string ChildPath(std::string_view key) const;

  const nlohmann::json* value_;  // Not owned.
  std::string file_;
  std::string path_;
};

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_BASE_JSON_FIELDS_H_
