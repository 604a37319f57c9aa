#include "common/text/chat_template.h"

#include <utf8proc.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/base/file_util.h"
#include "common/base/json_fields.h"
#include "common/base/status.h"
#include "common/text/unicode_util.h"

namespace knapserve {
namespace {

// How errors travel inside this file (all become InvalidArgument "chat
// template: ..." at the API):
//  - kInvalidArgument: a problem not yet located (helpers do not know the
//    line); the Eval / Exec of the node it happened in adds "line L: " and
//    turns it into
//  - kFailedPrecondition: located, passed up unchanged;
//  - kAborted: raise_exception(msg), passed up unchanged.
absl::Status Problem(std::string what) {
  return absl::InvalidArgumentError(what);
}

absl::Status AtLine(int line, const absl::Status& status) {
  if (status.code() != absl::StatusCode::kInvalidArgument) return status;
  return absl::FailedPreconditionError(
      absl::StrCat("line ", line, ": ", status.message()));
}

// Debian's Abseil has its own string_view type; StrCat needs it.
absl::string_view Sv(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

// Nesting limits: blocks inside blocks and the depth of an expression's tree
// (both bound the recursion of the parser and the renderer), and the depth of
// lists and dicts (bounds repr, tojson and comparisons).
constexpr int kMaxBlockDepth = 100;
constexpr int kMaxExprDepth = 100;
constexpr int kMaxValueDepth = 256;
// jinja2.sandbox.MAX_RANGE.
constexpr int64_t kMaxRange = 100000;
// The longest list `list * n` may make.
constexpr size_t kMaxListItems = 1000000;

std::string OutputTooLarge() {
  return absl::StrCat("the output would be larger than ",
                      ChatTemplate::kMaxOutputBytes >> 20, " MiB");
}

absl::Status CheckSize(size_t size) {
  if (size > ChatTemplate::kMaxOutputBytes) return Problem(OutputTooLarge());
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Unicode, with Python's str semantics (strings here are valid UTF-8).

// str.isspace().
bool IsPySpace(char32_t c) {
  if (c < 0x80) return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20);
  return c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
         c == 0x202F || c == 0x205F || c == 0x3000;
}

std::u32string Decode(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  size_t pos = 0;
  while (pos < s.size()) out.push_back(NextCodePoint(s, &pos));
  return out;
}

std::string Encode(std::u32string_view cps) {
  std::string out;
  out.reserve(cps.size());
  for (char32_t c : cps) AppendUtf8(c, &out);
  return out;
}

size_t CodePointCount(std::string_view s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

bool IsCased(char32_t c) {
  return utf8proc_islower(c) || utf8proc_isupper(c) ||
         utf8proc_category(c) == UTF8PROC_CATEGORY_LT;
}

// Case mappings: utf8proc's simple (one to one) ones, plus the full
// mappings of Python for the characters people meet (sharp s, the Latin
// ligatures, dotted capital I, final sigma). Python has a few more, for rare
// Greek and Armenian letters.
void AppendUpper(char32_t c, bool title, std::string* out) {
  const char* full = nullptr;
  switch (c) {
    case 0xDF:
      full = title ? "Ss" : "SS";
      break;
    case 0x149:
      full = "\u02BCN";
      break;
    case 0xFB00:
      full = title ? "Ff" : "FF";
      break;
    case 0xFB01:
      full = title ? "Fi" : "FI";
      break;
    case 0xFB02:
      full = title ? "Fl" : "FL";
      break;
    case 0xFB03:
      full = title ? "Ffi" : "FFI";
      break;
    case 0xFB04:
      full = title ? "Ffl" : "FFL";
      break;
    case 0xFB05:
    case 0xFB06:
      full = title ? "St" : "ST";
      break;
    default:
      break;
  }
  if (full != nullptr) {
    out->append(full);
  } else {
    AppendUtf8(title ? utf8proc_totitle(c) : utf8proc_toupper(c), out);
  }
}

// The lower case of cps[i] (which needs its neighbours for final sigma).
void AppendLower(std::u32string_view cps, size_t i, std::string* out) {
  const char32_t c = cps[i];
  if (c == 0x130) {  // Capital I with dot above.
    out->append("i\u0307");
    return;
  }
  if (c == 0x3A3) {  // Capital sigma: final form after a cased letter.
    const bool after_cased = i > 0 && IsCased(cps[i - 1]);
    const bool before_cased = i + 1 < cps.size() && IsCased(cps[i + 1]);
    AppendUtf8(after_cased && !before_cased ? 0x3C2 : 0x3C3, out);
    return;
  }
  AppendUtf8(utf8proc_tolower(c), out);
}

std::string PyLower(std::string_view s) {
  const std::u32string cps = Decode(s);
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < cps.size(); ++i) AppendLower(cps, i, &out);
  return out;
}

std::string PyUpper(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t pos = 0;
  while (pos < s.size()) AppendUpper(NextCodePoint(s, &pos), false, &out);
  return out;
}

// str.title(): cased runs start with title case, the rest is lower case.
std::string PyTitle(std::string_view s) {
  const std::u32string cps = Decode(s);
  std::string out;
  bool previous_is_cased = false;
  for (size_t i = 0; i < cps.size(); ++i) {
    if (previous_is_cased) {
      AppendLower(cps, i, &out);
    } else {
      AppendUpper(cps[i], true, &out);
    }
    previous_is_cased = IsCased(cps[i]);
  }
  return out;
}

// str.capitalize(): the first character in title case, the rest lower.
std::string PyCapitalize(std::string_view s) {
  const std::u32string cps = Decode(s);
  std::string out;
  for (size_t i = 0; i < cps.size(); ++i) {
    if (i == 0) {
      AppendUpper(cps[i], true, &out);
    } else {
      AppendLower(cps, i, &out);
    }
  }
  return out;
}

// str.islower() (upper = false) / str.isupper() (upper = true).
bool PyIsCase(std::string_view s, bool upper) {
  bool cased = false;
  size_t pos = 0;
  while (pos < s.size()) {
    const char32_t c = NextCodePoint(s, &pos);
    if (upper ? utf8proc_islower(c) ||
                    utf8proc_category(c) == UTF8PROC_CATEGORY_LT
              : utf8proc_isupper(c) ||
                    utf8proc_category(c) == UTF8PROC_CATEGORY_LT) {
      return false;
    }
    if (!cased) cased = upper ? utf8proc_isupper(c) : utf8proc_islower(c);
  }
  return cased;
}

// str.isprintable() for one character.
bool IsPrintable(char32_t c) {
  if (c == ' ') return true;
  switch (utf8proc_category(c)) {
    case UTF8PROC_CATEGORY_CC:
    case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_CS:
    case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_CN:
    case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP:
    case UTF8PROC_CATEGORY_ZS:
      return false;
    default:
      return true;
  }
}

// str.strip / lstrip / rstrip: `chars` nullptr strips whitespace.
std::string PyStrip(std::string_view s, const std::string* chars, bool left,
                    bool right) {
  std::u32string set;
  if (chars != nullptr) set = Decode(*chars);
  auto strip = [&](char32_t c) {
    return chars == nullptr ? IsPySpace(c)
                            : set.find(c) != std::u32string::npos;
  };
  size_t begin = 0;
  size_t end = s.size();
  if (left) {
    while (begin < end) {
      size_t next = begin;
      if (!strip(NextCodePoint(s, &next))) break;
      begin = next;
    }
  }
  if (right) {
    while (end > begin) {
      size_t prev = end;
      if (!strip(PrevCodePoint(s, &prev))) break;
      end = prev;
    }
  }
  return std::string(s.substr(begin, end - begin));
}

// str.split / str.rsplit. `sep` nullptr splits on whitespace runs.
absl::StatusOr<std::vector<std::string>> PySplit(std::string_view s,
                                                 const std::string* sep,
                                                 int64_t maxsplit,
                                                 bool from_right) {
  std::vector<std::string> parts;
  if (sep != nullptr) {
    if (sep->empty()) return Problem("empty separator");
    if (!from_right) {
      size_t start = 0;
      while (maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit) {
        const size_t at = s.find(*sep, start);
        if (at == std::string_view::npos) break;
        parts.emplace_back(s.substr(start, at - start));
        start = at + sep->size();
      }
      parts.emplace_back(s.substr(start));
    } else {
      size_t end = s.size();
      int64_t splits = 0;
      while (maxsplit < 0 || splits < maxsplit) {
        if (end < sep->size()) break;
        const size_t at = s.rfind(*sep, end - sep->size());
        if (at == std::string_view::npos) break;
        parts.emplace_back(s.substr(at + sep->size(), end - at - sep->size()));
        end = at;
        ++splits;
      }
      parts.emplace_back(s.substr(0, end));
      std::reverse(parts.begin(), parts.end());
    }
    return parts;
  }
  const std::u32string cps = Decode(s);
  const int64_t n = static_cast<int64_t>(cps.size());
  if (!from_right) {
    int64_t i = 0;
    while (true) {
      while (i < n && IsPySpace(cps[i])) ++i;
      if (i == n) break;
      if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
        parts.push_back(Encode(std::u32string_view(cps).substr(i)));
        break;
      }
      int64_t j = i;
      while (j < n && !IsPySpace(cps[j])) ++j;
      parts.push_back(Encode(std::u32string_view(cps).substr(i, j - i)));
      i = j;
    }
  } else {
    int64_t i = n;
    while (true) {
      while (i > 0 && IsPySpace(cps[i - 1])) --i;
      if (i == 0) break;
      if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
        parts.push_back(Encode(std::u32string_view(cps).substr(0, i)));
        break;
      }
      int64_t j = i;
      while (j > 0 && !IsPySpace(cps[j - 1])) --j;
      parts.push_back(Encode(std::u32string_view(cps).substr(j, i - j)));
      i = j;
    }
    std::reverse(parts.begin(), parts.end());
  }
  return parts;
}

// str.replace(old, new, count); count < 0 replaces all.
absl::StatusOr<std::string> PyReplace(std::string_view s, std::string_view old,
                                      std::string_view repl, int64_t count) {
  std::string out;
  int64_t done = 0;
  if (old.empty()) {
    size_t pos = 0;
    while (true) {
      if (count >= 0 && done >= count) break;
      out.append(repl);
      ++done;
      if (pos == s.size()) break;
      const size_t start = pos;
      NextCodePoint(s, &pos);
      out.append(s.substr(start, pos - start));
      RETURN_IF_ERROR(CheckSize(out.size()));
    }
    out.append(s.substr(pos));
    RETURN_IF_ERROR(CheckSize(out.size()));
    return out;
  }
  size_t start = 0;
  while (count < 0 || done < count) {
    const size_t at = s.find(old, start);
    if (at == std::string_view::npos) break;
    out.append(s.substr(start, at - start));
    out.append(repl);
    RETURN_IF_ERROR(CheckSize(out.size()));
    start = at + old.size();
    ++done;
  }
  out.append(s.substr(start));
  RETURN_IF_ERROR(CheckSize(out.size()));
  return out;
}

// markupsafe.escape.
std::string HtmlEscape(std::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// float.__repr__: the shortest digits that round-trip, in fixed notation
// for exponents -4 to 15, else scientific ("1e+16", "1.5e-07").
std::string PyFloatRepr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  const auto result =
      std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string_view text(buf, result.ptr - buf);
  std::string out;
  if (text[0] == '-') {
    out = "-";
    text.remove_prefix(1);
  }
  const size_t e = text.find('e');
  std::string digits;
  for (char c : text.substr(0, e)) {
    if (c != '.') digits += c;
  }
  const int exp = std::atoi(std::string(text.substr(e + 1)).c_str());
  if (exp < -4 || exp >= 16) {
    out += digits[0];
    if (digits.size() > 1) absl::StrAppend(&out, ".", digits.substr(1));
    out += exp < 0 ? "e-" : "e+";
    const int mag = std::abs(exp);
    if (mag < 10) out += '0';
    absl::StrAppend(&out, mag);
  } else if (exp >= 0) {
    const size_t int_digits = static_cast<size_t>(exp) + 1;
    if (digits.size() <= int_digits) {
      out += digits;
      out.append(int_digits - digits.size(), '0');
      out += ".0";
    } else {
      absl::StrAppend(&out, digits.substr(0, int_digits), ".",
                      digits.substr(int_digits));
    }
  } else {
    out += "0.";
    out.append(static_cast<size_t>(-exp - 1), '0');
    out += digits;
  }
  return out;
}

// ---------------------------------------------------------------------------
// Values.

enum class Kind : uint8_t {
  kUndefined,
  kNone,
  kBool,
  kInt,
  kFloat,
  kString,
  kList,
  kTuple,
  kDict,
  kNamespace,
  kLoop,
  kCallable,
  kGenerator,  // What select, map, items... return: iterable once, no len().
  kDictView,   // dict.items() / keys() / values().
};

// Which view a kDictView is (in Value::i).
enum DictViewType : int64_t { kDictItems, kDictKeys, kDictValues };

struct ListData;
struct DictData;
struct Namespace;
struct LoopData;
struct Callable;

// A Python value as a template sees it. Lists and dicts are immutable and
// shared; a namespace is the one mutable object (set ns.x = ...).
struct Value {
  Kind kind = Kind::kUndefined;
  bool markup = false;  // A string made by |safe (markupsafe.Markup).
  int64_t i = 0;        // kBool (0 / 1), kInt.
  double f = 0;         // kFloat.
  // kString: the text. kUndefined: why it is undefined (the message of the
  // error when it is used). kGenerator: the error it raises when used, if
  // any: Jinja's filters are lazy, so `x|map(...)` fails only when iterated.
  std::string s;
  // kList, kTuple, kGenerator, kDictView: the items.
  std::shared_ptr<const ListData> list;
  std::shared_ptr<size_t> cursor;        // kGenerator: the next item.
  std::shared_ptr<const DictData> dict;  // kDict.
  std::shared_ptr<Namespace> ns;         // kNamespace.
  std::shared_ptr<const LoopData> loop;  // kLoop.
  std::shared_ptr<const Callable> fn;    // kCallable.

  bool is_undefined() const { return kind == Kind::kUndefined; }
  bool is_string() const { return kind == Kind::kString; }
  bool is_integral() const { return kind == Kind::kBool || kind == Kind::kInt; }
  bool is_number() const { return is_integral() || kind == Kind::kFloat; }
  bool is_sequence() const {
    return kind == Kind::kList || kind == Kind::kTuple;
  }
  bool has_items() const {
    return is_sequence() || kind == Kind::kGenerator || kind == Kind::kDictView;
  }
  double as_double() const {
    return kind == Kind::kFloat ? f : static_cast<double>(i);
  }
};

struct ListData {
  std::vector<Value> items;
  int depth = 1;  // Nesting of lists and dicts, this one included.
  bool has_namespace = false;
};

struct DictData {
  std::vector<std::pair<std::string, Value>> entries;  // In insertion order.
  int depth = 1;
  bool has_namespace = false;

  const Value* Find(std::string_view key) const {
    for (const auto& [k, v] : entries) {
      if (k == key) return &v;
    }
    return nullptr;
  }
};

struct Namespace {
  std::vector<std::pair<std::string, Value>> attrs;
};

// The `loop` variable of one iteration.
struct LoopData {
  std::shared_ptr<const ListData> items;  // The items iterated over.
  int64_t index0 = 0;
};

struct Callable {
  enum class Type { kGlobal, kMethod, kCycle };
  Type type = Type::kGlobal;
  std::string name;
  Value self;  // kMethod: the object; kCycle: the loop.
};

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
Value String(std::string s, bool markup = false) {
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

absl::StatusOr<Value> MakeList(std::vector<Value> items, bool tuple = false) {
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

void AppendStringRepr(std::string_view s, std::string* out) {
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  *out += quote;
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t start = pos;
    const char32_t c = NextCodePoint(s, &pos);
    char buf[16];
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      *out += '\\';
      *out += static_cast<char>(c);
    } else if (c == '\t') {
      *out += "\\t";
    } else if (c == '\n') {
      *out += "\\n";
    } else if (c == '\r') {
      *out += "\\r";
    } else if (c < 0x20 || c == 0x7F) {
      std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(c));
      *out += buf;
    } else if (c < 0x7F || IsPrintable(c)) {
      out->append(s.substr(start, pos - start));
    } else if (c <= 0xFF) {
      std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(c));
      *out += buf;
    } else if (c <= 0xFFFF) {
      std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
      *out += buf;
    } else {
      std::snprintf(buf, sizeof(buf), "\\U%08x", static_cast<unsigned>(c));
      *out += buf;
    }
  }
  *out += quote;
}

absl::Status AppendRepr(const Value& v, std::string* out);

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

enum class CompareOp { kEq, kNe, kLt, kLe, kGt, kGe, kIn, kNotIn };

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

enum class BinOp { kAdd, kSub, kMul, kDiv, kFloorDiv, kMod, kPow };

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
    if (static_cast<uint64_t>(times) > ChatTemplate::kMaxOutputBytes / size) {
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

// ---------------------------------------------------------------------------
// JSON.

template <typename Json>
absl::StatusOr<Value> FromJson(const Json& j, int depth) {
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
        ASSIGN_OR_RETURN(Value item, FromJson(element, depth + 1));
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
        ASSIGN_OR_RETURN(Value item, FromJson(it.value(), depth + 1));
        entries.emplace_back(it.key(), std::move(item));
      }
      return MakeDict(std::move(entries));
    }
    default:
      return Problem("the context holds a value that is not plain JSON");
  }
}

// json.dumps's options, as HF's tojson passes them.
struct JsonStyle {
  bool ensure_ascii = false;
  std::optional<std::string> indent;  // None: all on one line.
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
};

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

// ---------------------------------------------------------------------------
// Lexer: Jinja's, with trim_blocks and lstrip_blocks.

enum class Tok {
  kData,
  kVarBegin,
  kVarEnd,
  kBlockBegin,
  kBlockEnd,
  kName,
  kString,
  kInt,
  kFloat,
  kOp,
  kEof,
};

struct Token {
  Tok type = Tok::kEof;
  std::string text;  // Data, a name, a string's value, an operator.
  int64_t int_value = 0;
  double float_value = 0;
  size_t offset = 0;  // Where it starts in the (normalized) source.
};

// Line and column (1-based, in characters) of offsets in the source.
class SourceMap {
 public:
  explicit SourceMap(std::string_view source) : source_(source) {
    line_starts_.push_back(0);
    for (size_t k = 0; k < source.size(); ++k) {
      if (source[k] == '\n') line_starts_.push_back(k + 1);
    }
  }

  int Line(size_t offset) const {
    return static_cast<int>(
        std::upper_bound(line_starts_.begin(), line_starts_.end(), offset) -
        line_starts_.begin());
  }

  // InvalidArgument "chat template: line L, column C: <what>".
  absl::Status Error(size_t offset, std::string_view what) const {
    const int line = Line(offset);
    const size_t start = line_starts_[line - 1];
    const size_t column =
        CodePointCount(source_.substr(start, offset - start)) + 1;
    return absl::InvalidArgumentError(absl::StrCat(
        "chat template: line ", line, ", column ", column, ": ", Sv(what)));
  }

 private:
  std::string_view source_;
  std::vector<size_t> line_starts_;
};

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

bool IsDigit(char c) { return c >= '0' && c <= '9'; }
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
int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

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

// ---------------------------------------------------------------------------
// The tree.

enum class ExprKind {
  kConst,
  kName,
  kList,
  kTuple,
  kDict,
  kGetattr,
  kGetitem,
  kSlice,
  kCall,
  kFilter,
  kTest,
  kNot,
  kNeg,
  kPos,
  kBinary,
  kConcat,
  kAnd,
  kOr,
  kCompare,
  kCondExpr,
};

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

// An expression. What `args` holds depends on the kind:
//   kList, kTuple, kConcat: the items; kDict: key, value, key, value, ...
//   kGetattr: {object} (the attribute is `name`); kGetitem: {object, key}
//   kSlice: {start, stop, step}, each may be null; kCall: {callee, args...}
//   kFilter, kTest: {subject, args...} (a block set's filter has no subject)
//   kNot, kNeg, kPos: {operand}; kBinary, kAnd, kOr: {left, right}
//   kCompare: {first, then one per op}; kCondExpr: {then, test, else or null}
struct Expr {
  ExprKind kind = ExprKind::kConst;
  int line = 0;
  int depth = 1;
  Value value;       // kConst.
  std::string name;  // kName, kGetattr, kFilter, kTest.
  BinOp op = BinOp::kAdd;
  std::vector<CompareOp> compare_ops;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
};

enum class NodeKind {
  kText,
  kOutput,
  kIf,
  kFor,
  kSet,
  kSetBlock,
  kBreak,
  kContinue,
  kScope,  // HF's {% generation %}: its body, in a scope of its own.
};

// Where a for loop or a set puts values: one name, a tuple of names, or a
// namespace attribute (names[0].ns_attr).
struct Target {
  std::vector<std::string> names;
  bool tuple = false;
  std::string ns_attr;
};

struct Node {
  NodeKind kind = NodeKind::kText;
  int line = 0;
  std::string text;                 // kText.
  ExprPtr expr;                     // kOutput, kSet: the value; kFor: the
                                    // iterable.
  std::vector<ExprPtr> conditions;  // kIf: one per branch; kFor: its `if`.
  std::vector<std::vector<Node>> bodies;  // kIf: one per branch; kFor,
                                          // kSetBlock, kScope: one.
  std::vector<Node> else_body;            // kIf, kFor.
  Target target;                          // kFor, kSet, kSetBlock.
  std::vector<ExprPtr> filters;           // kSetBlock.
};

// The filters and tests known to the renderer (checked when parsing, as
// Jinja does).
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

// ---------------------------------------------------------------------------
// Parser: Jinja's grammar (jinja2/parser.py), function for function.

class Parser {
 public:
  Parser(const std::vector<Token>& tokens, const SourceMap& map)
      : tokens_(tokens), map_(map) {}

  absl::StatusOr<std::vector<Node>> ParseTemplate() {
    ASSIGN_OR_RETURN(std::vector<Node> body, Subparse({}));
    if (Cur().type != Tok::kEof) {
      return Error(Cur(), absl::StrCat("unexpected ", Describe(Cur())));
    }
    return body;
  }

 private:
  const Token& Cur() const { return tokens_[pos_]; }
  const Token& Look() const {
    return tokens_[std::min(pos_ + 1, tokens_.size() - 1)];
  }
  const Token& Next() {
    const Token& t = tokens_[pos_];
    if (t.type != Tok::kEof) ++pos_;
    return t;
  }
  static bool IsOp(const Token& t, std::string_view op) {
    return t.type == Tok::kOp && t.text == op;
  }
  static bool IsName(const Token& t, std::string_view name) {
    return t.type == Tok::kName && t.text == name;
  }
  int LineOf(const Token& t) const { return map_.Line(t.offset); }
  absl::Status Error(const Token& at, std::string_view what) const {
    return map_.Error(at.offset, what);
  }
  static std::string Describe(const Token& t) {
    switch (t.type) {
      case Tok::kEof:
        return "end of template";
      case Tok::kVarEnd:
        return "end of print statement ('}}')";
      case Tok::kBlockEnd:
        return "end of statement block ('%}')";
      case Tok::kVarBegin:
        return "'{{'";
      case Tok::kBlockBegin:
        return "'{%'";
      case Tok::kData:
        return "template data";
      case Tok::kString:
        return "a string";
      case Tok::kInt:
      case Tok::kFloat:
        return "a number";
      default:
        return absl::StrCat("'", t.text, "'");
    }
  }
  absl::Status ExpectOp(std::string_view op) {
    if (!IsOp(Cur(), op)) {
      return Error(Cur(), absl::StrCat("expected '", Sv(op), "', got ",
                                       Describe(Cur())));
    }
    Next();
    return absl::OkStatus();
  }
  absl::Status ExpectType(Tok type, std::string_view what) {
    if (Cur().type != type) {
      return Error(Cur(), absl::StrCat("expected ", Sv(what), ", got ",
                                       Describe(Cur())));
    }
    Next();
    return absl::OkStatus();
  }
  absl::Status ExpectBlockEnd() {
    return ExpectType(Tok::kBlockEnd, "end of statement block ('%}')");
  }
  absl::StatusOr<std::string> ExpectName() {
    if (Cur().type != Tok::kName) {
      return Error(Cur(),
                   absl::StrCat("expected a name, got ", Describe(Cur())));
    }
    return Next().text;
  }

  // Builds an expression node and checks the depth of the tree.
  absl::StatusOr<ExprPtr> Make(ExprKind kind, const Token& at,
                               std::vector<ExprPtr> args) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = LineOf(at);
    e->args = std::move(args);
    return Finish(std::move(e), at);
  }
  absl::StatusOr<ExprPtr> Finish(ExprPtr e, const Token& at) {
    int depth = 0;
    for (const ExprPtr& arg : e->args) {
      if (arg) depth = std::max(depth, arg->depth);
    }
    for (const auto& kw : e->kwargs) depth = std::max(depth, kw.second->depth);
    e->depth = depth + 1;
    if (e->depth > kMaxExprDepth) {
      return Error(at, absl::StrCat("expression nested more than ",
                                    kMaxExprDepth, " levels deep"));
    }
    return e;
  }

  // Bounds the parser's recursion (parentheses, unary operators, not).
  class DepthGuard {
   public:
    explicit DepthGuard(int* depth) : depth_(depth) { ++*depth_; }
    ~DepthGuard() { --*depth_; }

   private:
    int* depth_;
  };
  absl::Status CheckRecursion() {
    if (recursion_ > kMaxExprDepth) {
      return Error(Cur(), absl::StrCat("expression nested more than ",
                                       kMaxExprDepth, " levels deep"));
    }
    return absl::OkStatus();
  }

  // Template data and tags up to one of `end_names` (a {% name %} tag,
  // left as the current token) or the end of the template.
  absl::StatusOr<std::vector<Node>> Subparse(
      const std::vector<std::string_view>& end_names) {
    std::vector<Node> body;
    while (true) {
      const Token& t = Cur();
      if (t.type == Tok::kEof) return body;
      if (t.type == Tok::kData) {
        Node node;
        node.kind = NodeKind::kText;
        node.line = LineOf(t);
        node.text = t.text;
        body.push_back(std::move(node));
        Next();
      } else if (t.type == Tok::kVarBegin) {
        Next();
        Node node;
        node.kind = NodeKind::kOutput;
        node.line = LineOf(t);
        ASSIGN_OR_RETURN(node.expr, ParseTuple(false, true, {}, false));
        RETURN_IF_ERROR(
            ExpectType(Tok::kVarEnd, "end of print statement ('}}')"));
        body.push_back(std::move(node));
      } else if (t.type == Tok::kBlockBegin) {
        Next();
        for (std::string_view end : end_names) {
          if (IsName(Cur(), end)) return body;
        }
        ASSIGN_OR_RETURN(Node node, ParseStatement());
        body.push_back(std::move(node));
        RETURN_IF_ERROR(ExpectBlockEnd());
      } else {
        return Error(t, absl::StrCat("unexpected ", Describe(t)));
      }
    }
  }

  // A block's body up to one of `end_names`, whose name token is left
  // current; an error naming the block (opened by `opener`) at the end of
  // the template.
  absl::StatusOr<std::vector<Node>> ParseStatements(
      const Token& opener, std::string_view tag,
      const std::vector<std::string_view>& end_names) {
    if (IsOp(Cur(), ":")) Next();
    RETURN_IF_ERROR(ExpectBlockEnd());
    ASSIGN_OR_RETURN(std::vector<Node> body, Subparse(end_names));
    if (Cur().type == Tok::kEof) {
      std::string expected;
      for (std::string_view end : end_names) {
        if (!expected.empty()) expected += " or ";
        absl::StrAppend(&expected, "{% ", Sv(end), " %}");
      }
      return Error(opener,
                   absl::StrCat("{% ", Sv(tag), " %} is not closed: expected ",
                                expected, " before the end of the template"));
    }
    return body;
  }

  absl::StatusOr<Node> ParseStatement() {
    const Token& t = Cur();
    if (t.type != Tok::kName) {
      return Error(t, absl::StrCat("expected a tag name, got ", Describe(t)));
    }
    static constexpr std::string_view kUnsupported[] = {
        "macro", "call",    "filter",   "include", "import",
        "from",  "extends", "block",    "with",    "autoescape",
        "do",    "trans",   "pluralize"};
    for (std::string_view tag : kUnsupported) {
      if (t.text == tag) {
        return Error(t, absl::StrCat("{% ", t.text, " %} is not supported"));
      }
    }
    static constexpr std::string_view kEnds[] = {
        "endfor",        "endif",         "elif",      "else",     "endset",
        "endmacro",      "endcall",       "endfilter", "endblock", "endwith",
        "endautoescape", "endgeneration", "endraw",    "endtrans"};
    for (std::string_view tag : kEnds) {
      if (t.text == tag) {
        return Error(t, absl::StrCat("unexpected {% ", t.text,
                                     " %} (no open block it could close)"));
      }
    }
    if (++block_depth_ > kMaxBlockDepth) {
      return Error(t, absl::StrCat("blocks nested more than ", kMaxBlockDepth,
                                   " levels deep"));
    }
    absl::StatusOr<Node> node;
    if (t.text == "if") {
      node = ParseIf();
    } else if (t.text == "for") {
      node = ParseFor();
    } else if (t.text == "set") {
      node = ParseSet();
    } else if (t.text == "break" || t.text == "continue") {
      if (loop_depth_ == 0) {
        return Error(t,
                     absl::StrCat("{% ", t.text, " %} outside of a for loop"));
      }
      Node n;
      n.kind = t.text == "break" ? NodeKind::kBreak : NodeKind::kContinue;
      n.line = LineOf(t);
      Next();
      node = std::move(n);
    } else if (t.text == "generation") {
      const Token& opener = Next();
      Node n;
      n.kind = NodeKind::kScope;
      n.line = LineOf(opener);
      ASSIGN_OR_RETURN(
          std::vector<Node> body,
          ParseStatements(opener, "generation", {"endgeneration"}));
      Next();
      n.bodies.push_back(std::move(body));
      node = std::move(n);
    } else {
      return Error(t, absl::StrCat("unknown tag '", t.text, "'"));
    }
    --block_depth_;
    return node;
  }

  absl::StatusOr<Node> ParseIf() {
    const Token& opener = Next();
    Node node;
    node.kind = NodeKind::kIf;
    node.line = LineOf(opener);
    while (true) {
      ASSIGN_OR_RETURN(ExprPtr test, ParseTuple(false, false, {}, false));
      ASSIGN_OR_RETURN(
          std::vector<Node> body,
          ParseStatements(opener, "if", {"elif", "else", "endif"}));
      node.conditions.push_back(std::move(test));
      node.bodies.push_back(std::move(body));
      const Token& end = Next();
      if (IsName(end, "elif")) continue;
      if (IsName(end, "else")) {
        ASSIGN_OR_RETURN(node.else_body,
                         ParseStatements(opener, "if", {"endif"}));
        Next();
      }
      return node;
    }
  }

  absl::StatusOr<Node> ParseFor() {
    const Token& opener = Next();
    Node node;
    node.kind = NodeKind::kFor;
    node.line = LineOf(opener);
    ASSIGN_OR_RETURN(node.target, ParseAssignTarget(false, {"in"}));
    if (!IsName(Cur(), "in")) {
      return Error(Cur(), absl::StrCat("expected 'in', got ", Describe(Cur())));
    }
    Next();
    ASSIGN_OR_RETURN(node.expr, ParseTuple(false, false, {"recursive"}, false));
    if (IsName(Cur(), "if")) {
      Next();
      ASSIGN_OR_RETURN(ExprPtr condition, ParseExpression(true));
      node.conditions.push_back(std::move(condition));
    }
    if (IsName(Cur(), "recursive")) {
      return Error(Cur(), "recursive for loops are not supported");
    }
    ++loop_depth_;
    ASSIGN_OR_RETURN(std::vector<Node> body,
                     ParseStatements(opener, "for", {"endfor", "else"}));
    --loop_depth_;
    node.bodies.push_back(std::move(body));
    if (IsName(Next(), "else")) {
      ASSIGN_OR_RETURN(node.else_body,
                       ParseStatements(opener, "for", {"endfor"}));
      Next();
    }
    return node;
  }

  absl::StatusOr<Node> ParseSet() {
    const Token& opener = Next();
    Node node;
    node.line = LineOf(opener);
    ASSIGN_OR_RETURN(node.target, ParseAssignTarget(true, {}));
    if (IsOp(Cur(), "=")) {
      Next();
      node.kind = NodeKind::kSet;
      ASSIGN_OR_RETURN(node.expr, ParseTuple(false, true, {}, false));
      return node;
    }
    node.kind = NodeKind::kSetBlock;
    if (!node.target.ns_attr.empty() || node.target.tuple) {
      return Error(opener, "a block {% set %} must assign to one name");
    }
    while (IsOp(Cur(), "|")) {
      ASSIGN_OR_RETURN(ExprPtr filter, ParseOneFilter(nullptr));
      node.filters.push_back(std::move(filter));
    }
    const int saved_loop_depth = loop_depth_;
    loop_depth_ = 0;  // No break out of a block set.
    ASSIGN_OR_RETURN(std::vector<Node> body,
                     ParseStatements(opener, "set", {"endset"}));
    loop_depth_ = saved_loop_depth;
    Next();
    node.bodies.push_back(std::move(body));
    return node;
  }

  // A name, a tuple of names (for loops and set), or `ns.attr` (set).
  absl::StatusOr<Target> ParseAssignTarget(
      bool with_namespace, const std::vector<std::string_view>& extra_end) {
    Target target;
    const Token& start = Cur();
    if (with_namespace && start.type == Tok::kName && IsOp(Look(), ".")) {
      target.names.push_back(Next().text);
      Next();
      ASSIGN_OR_RETURN(target.ns_attr, ExpectName());
      return target;
    }
    ASSIGN_OR_RETURN(ExprPtr e, ParseTuple(true, true, extra_end, false));
    auto add_name = [&](const Expr& name) -> absl::Status {
      if (name.kind != ExprKind::kName) {
        return Error(start,
                     "can only assign to names (or a namespace "
                     "attribute, or a tuple of names)");
      }
      target.names.push_back(name.name);
      return absl::OkStatus();
    };
    if (e->kind == ExprKind::kTuple) {
      target.tuple = true;
      for (const ExprPtr& item : e->args) RETURN_IF_ERROR(add_name(*item));
    } else {
      RETURN_IF_ERROR(add_name(*e));
    }
    return target;
  }

  bool IsTupleEnd(const std::vector<std::string_view>& extra_end) const {
    const Token& t = Cur();
    if (t.type == Tok::kVarEnd || t.type == Tok::kBlockEnd || IsOp(t, ")")) {
      return true;
    }
    for (std::string_view name : extra_end) {
      if (IsName(t, name)) return true;
    }
    return false;
  }

  // Expressions separated by commas: a tuple if there is a comma.
  // `simplified`: primaries only (assignment targets).
  absl::StatusOr<ExprPtr> ParseTuple(
      bool simplified, bool with_condexpr,
      const std::vector<std::string_view>& extra_end,
      bool explicit_parentheses) {
    const Token& start = Cur();
    std::vector<ExprPtr> args;
    bool is_tuple = false;
    while (true) {
      if (!args.empty()) RETURN_IF_ERROR(ExpectOp(","));
      if (IsTupleEnd(extra_end)) break;
      ExprPtr item;
      if (simplified) {
        ASSIGN_OR_RETURN(item, ParsePrimary());
      } else {
        ASSIGN_OR_RETURN(item, ParseExpression(with_condexpr));
      }
      args.push_back(std::move(item));
      if (IsOp(Cur(), ",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (!is_tuple) {
      if (!args.empty()) return std::move(args[0]);
      if (!explicit_parentheses) {
        return Error(Cur(), absl::StrCat("expected an expression, got ",
                                         Describe(Cur())));
      }
    }
    return Make(ExprKind::kTuple, start, std::move(args));
  }

  absl::StatusOr<ExprPtr> ParseExpression(bool with_condexpr) {
    DepthGuard guard(&recursion_);
    RETURN_IF_ERROR(CheckRecursion());
    if (!with_condexpr) return ParseOr();
    ASSIGN_OR_RETURN(ExprPtr expr, ParseOr());
    while (IsName(Cur(), "if")) {
      const Token& t = Next();
      ASSIGN_OR_RETURN(ExprPtr test, ParseOr());
      ExprPtr otherwise;
      if (IsName(Cur(), "else")) {
        Next();
        ASSIGN_OR_RETURN(otherwise, ParseExpression(true));
      }
      std::vector<ExprPtr> args;
      args.push_back(std::move(expr));
      args.push_back(std::move(test));
      args.push_back(std::move(otherwise));
      ASSIGN_OR_RETURN(expr, Make(ExprKind::kCondExpr, t, std::move(args)));
    }
    return expr;
  }

  // A node of two operands.
  absl::StatusOr<ExprPtr> MakePair(ExprKind kind, const Token& at, ExprPtr a,
                                   ExprPtr b) {
    std::vector<ExprPtr> args;
    args.push_back(std::move(a));
    args.push_back(std::move(b));
    return Make(kind, at, std::move(args));
  }

  // `operand (keyword operand)*`, left-associative: or, and.
  absl::StatusOr<ExprPtr> ParseLogical(
      const char* keyword, ExprKind kind,
      absl::StatusOr<ExprPtr> (Parser::*operand)()) {
    ASSIGN_OR_RETURN(ExprPtr left, (this->*operand)());
    while (IsName(Cur(), keyword)) {
      const Token& t = Next();
      ASSIGN_OR_RETURN(ExprPtr right, (this->*operand)());
      ASSIGN_OR_RETURN(left,
                       MakePair(kind, t, std::move(left), std::move(right)));
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseOr() {
    return ParseLogical("or", ExprKind::kOr, &Parser::ParseAnd);
  }

  absl::StatusOr<ExprPtr> ParseAnd() {
    return ParseLogical("and", ExprKind::kAnd, &Parser::ParseNot);
  }

  absl::StatusOr<ExprPtr> ParseNot() {
    if (IsName(Cur(), "not")) {
      DepthGuard guard(&recursion_);
      RETURN_IF_ERROR(CheckRecursion());
      const Token& t = Next();
      ASSIGN_OR_RETURN(ExprPtr operand, ParseNot());
      std::vector<ExprPtr> args;
      args.push_back(std::move(operand));
      return Make(ExprKind::kNot, t, std::move(args));
    }
    return ParseCompare();
  }

  absl::StatusOr<ExprPtr> ParseCompare() {
    const Token& start = Cur();
    ASSIGN_OR_RETURN(ExprPtr first, ParseMath1());
    std::vector<ExprPtr> args;
    std::vector<CompareOp> ops;
    while (true) {
      const Token& t = Cur();
      CompareOp op;
      if (IsOp(t, "==")) {
        op = CompareOp::kEq;
      } else if (IsOp(t, "!=")) {
        op = CompareOp::kNe;
      } else if (IsOp(t, "<")) {
        op = CompareOp::kLt;
      } else if (IsOp(t, "<=")) {
        op = CompareOp::kLe;
      } else if (IsOp(t, ">")) {
        op = CompareOp::kGt;
      } else if (IsOp(t, ">=")) {
        op = CompareOp::kGe;
      } else if (IsName(t, "in")) {
        op = CompareOp::kIn;
      } else if (IsName(t, "not") && IsName(Look(), "in")) {
        op = CompareOp::kNotIn;
        Next();
      } else {
        break;
      }
      Next();
      ASSIGN_OR_RETURN(ExprPtr operand, ParseMath1());
      if (args.empty()) args.push_back(std::move(first));
      args.push_back(std::move(operand));
      ops.push_back(op);
    }
    if (args.empty()) return first;
    auto e = std::make_unique<Expr>();
    e->kind = ExprKind::kCompare;
    e->line = LineOf(start);
    e->args = std::move(args);
    e->compare_ops = std::move(ops);
    return Finish(std::move(e), start);
  }

  absl::StatusOr<ExprPtr> MakeBinary(BinOp op, const Token& t, ExprPtr left,
                                     ExprPtr right) {
    ASSIGN_OR_RETURN(ExprPtr e, MakePair(ExprKind::kBinary, t, std::move(left),
                                         std::move(right)));
    e->op = op;
    return e;
  }

  absl::StatusOr<ExprPtr> ParseMath1() {
    ASSIGN_OR_RETURN(ExprPtr left, ParseConcat());
    while (IsOp(Cur(), "+") || IsOp(Cur(), "-")) {
      const Token& t = Next();
      ASSIGN_OR_RETURN(ExprPtr right, ParseConcat());
      ASSIGN_OR_RETURN(left,
                       MakeBinary(t.text == "+" ? BinOp::kAdd : BinOp::kSub, t,
                                  std::move(left), std::move(right)));
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseConcat() {
    const Token& start = Cur();
    ASSIGN_OR_RETURN(ExprPtr first, ParseMath2());
    if (!IsOp(Cur(), "~")) return first;
    std::vector<ExprPtr> args;
    args.push_back(std::move(first));
    while (IsOp(Cur(), "~")) {
      Next();
      ASSIGN_OR_RETURN(ExprPtr item, ParseMath2());
      args.push_back(std::move(item));
    }
    return Make(ExprKind::kConcat, start, std::move(args));
  }

  absl::StatusOr<ExprPtr> ParseMath2() {
    ASSIGN_OR_RETURN(ExprPtr left, ParsePow());
    while (true) {
      const Token& t = Cur();
      BinOp op;
      if (IsOp(t, "*")) {
        op = BinOp::kMul;
      } else if (IsOp(t, "/")) {
        op = BinOp::kDiv;
      } else if (IsOp(t, "//")) {
        op = BinOp::kFloorDiv;
      } else if (IsOp(t, "%")) {
        op = BinOp::kMod;
      } else {
        break;
      }
      Next();
      ASSIGN_OR_RETURN(ExprPtr right, ParsePow());
      ASSIGN_OR_RETURN(left,
                       MakeBinary(op, t, std::move(left), std::move(right)));
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParsePow() {
    ASSIGN_OR_RETURN(ExprPtr left, ParseUnary(true));
    while (IsOp(Cur(), "**")) {
      const Token& t = Next();
      ASSIGN_OR_RETURN(ExprPtr right, ParseUnary(true));
      ASSIGN_OR_RETURN(
          left, MakeBinary(BinOp::kPow, t, std::move(left), std::move(right)));
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseUnary(bool with_filter) {
    DepthGuard guard(&recursion_);
    RETURN_IF_ERROR(CheckRecursion());
    const Token& t = Cur();
    ExprPtr node;
    if (IsOp(t, "-") || IsOp(t, "+")) {
      Next();
      ASSIGN_OR_RETURN(ExprPtr operand, ParseUnary(false));
      std::vector<ExprPtr> args;
      args.push_back(std::move(operand));
      ASSIGN_OR_RETURN(node,
                       Make(t.text == "-" ? ExprKind::kNeg : ExprKind::kPos, t,
                            std::move(args)));
    } else {
      ASSIGN_OR_RETURN(node, ParsePrimary());
    }
    ASSIGN_OR_RETURN(node, ParsePostfix(std::move(node)));
    if (with_filter) {
      ASSIGN_OR_RETURN(node, ParseFilterExpr(std::move(node)));
    }
    return node;
  }

  absl::StatusOr<ExprPtr> Const(const Token& t, Value value) {
    auto e = std::make_unique<Expr>();
    e->kind = ExprKind::kConst;
    e->line = LineOf(t);
    e->value = std::move(value);
    return e;
  }

  absl::StatusOr<ExprPtr> ParsePrimary() {
    DepthGuard guard(&recursion_);
    RETURN_IF_ERROR(CheckRecursion());
    const Token& t = Cur();
    switch (t.type) {
      case Tok::kName: {
        Next();
        if (t.text == "true" || t.text == "True") return Const(t, Bool(true));
        if (t.text == "false" || t.text == "False") {
          return Const(t, Bool(false));
        }
        if (t.text == "none" || t.text == "None") return Const(t, None());
        auto e = std::make_unique<Expr>();
        e->kind = ExprKind::kName;
        e->line = LineOf(t);
        e->name = t.text;
        return e;
      }
      case Tok::kString: {
        std::string text;
        while (Cur().type == Tok::kString) text += Next().text;
        return Const(t, String(std::move(text)));
      }
      case Tok::kInt:
        Next();
        return Const(t, Int(t.int_value));
      case Tok::kFloat:
        Next();
        return Const(t, Float(t.float_value));
      default:
        break;
    }
    if (IsOp(t, "(")) {
      Next();
      ASSIGN_OR_RETURN(ExprPtr e, ParseTuple(false, true, {}, true));
      RETURN_IF_ERROR(ExpectOp(")"));
      return e;
    }
    if (IsOp(t, "[")) {
      Next();
      std::vector<ExprPtr> items;
      while (!IsOp(Cur(), "]")) {
        if (!items.empty()) RETURN_IF_ERROR(ExpectOp(","));
        if (IsOp(Cur(), "]")) break;
        ASSIGN_OR_RETURN(ExprPtr item, ParseExpression(true));
        items.push_back(std::move(item));
      }
      RETURN_IF_ERROR(ExpectOp("]"));
      return Make(ExprKind::kList, t, std::move(items));
    }
    if (IsOp(t, "{")) {
      Next();
      std::vector<ExprPtr> items;
      while (!IsOp(Cur(), "}")) {
        if (!items.empty()) RETURN_IF_ERROR(ExpectOp(","));
        if (IsOp(Cur(), "}")) break;
        ASSIGN_OR_RETURN(ExprPtr key, ParseExpression(true));
        RETURN_IF_ERROR(ExpectOp(":"));
        ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
        items.push_back(std::move(key));
        items.push_back(std::move(value));
      }
      RETURN_IF_ERROR(ExpectOp("}"));
      return Make(ExprKind::kDict, t, std::move(items));
    }
    return Error(t, absl::StrCat("unexpected ", Describe(t)));
  }

  absl::StatusOr<ExprPtr> ParsePostfix(ExprPtr node) {
    while (true) {
      if (IsOp(Cur(), ".") || IsOp(Cur(), "[")) {
        ASSIGN_OR_RETURN(node, ParseSubscript(std::move(node)));
      } else if (IsOp(Cur(), "(")) {
        ASSIGN_OR_RETURN(node, ParseCall(std::move(node)));
      } else {
        return node;
      }
    }
  }

  absl::StatusOr<ExprPtr> ParseFilterExpr(ExprPtr node) {
    while (true) {
      if (IsOp(Cur(), "|")) {
        ASSIGN_OR_RETURN(node, ParseOneFilter(std::move(node)));
      } else if (IsName(Cur(), "is")) {
        ASSIGN_OR_RETURN(node, ParseTest(std::move(node)));
      } else if (IsOp(Cur(), "(")) {
        ASSIGN_OR_RETURN(node, ParseCall(std::move(node)));
      } else {
        return node;
      }
    }
  }

  absl::StatusOr<ExprPtr> ParseSubscript(ExprPtr node) {
    const Token& t = Next();
    std::vector<ExprPtr> args;
    args.push_back(std::move(node));
    if (t.text == ".") {
      const Token& attr = Next();
      if (attr.type == Tok::kName) {
        ASSIGN_OR_RETURN(ExprPtr e,
                         Make(ExprKind::kGetattr, t, std::move(args)));
        e->name = attr.text;
        return e;
      }
      if (attr.type != Tok::kInt) {
        return Error(attr, absl::StrCat("expected a name or a number after "
                                        "'.', got ",
                                        Describe(attr)));
      }
      ASSIGN_OR_RETURN(ExprPtr index, Const(attr, Int(attr.int_value)));
      args.push_back(std::move(index));
      return Make(ExprKind::kGetitem, t, std::move(args));
    }
    std::vector<ExprPtr> subscripts;
    while (!IsOp(Cur(), "]")) {
      if (!subscripts.empty()) RETURN_IF_ERROR(ExpectOp(","));
      ASSIGN_OR_RETURN(ExprPtr sub, ParseSubscribed());
      subscripts.push_back(std::move(sub));
    }
    RETURN_IF_ERROR(ExpectOp("]"));
    if (subscripts.size() == 1) {
      args.push_back(std::move(subscripts[0]));
    } else {
      ASSIGN_OR_RETURN(ExprPtr tuple,
                       Make(ExprKind::kTuple, t, std::move(subscripts)));
      args.push_back(std::move(tuple));
    }
    return Make(ExprKind::kGetitem, t, std::move(args));
  }

  // An index or a slice a:b:c (any part may be left out).
  absl::StatusOr<ExprPtr> ParseSubscribed() {
    const Token& start = Cur();
    std::vector<ExprPtr> parts;
    if (IsOp(Cur(), ":")) {
      Next();
      parts.push_back(nullptr);
    } else {
      ASSIGN_OR_RETURN(ExprPtr node, ParseExpression(true));
      if (!IsOp(Cur(), ":")) return node;
      Next();
      parts.push_back(std::move(node));
    }
    if (IsOp(Cur(), ":") || IsOp(Cur(), "]") || IsOp(Cur(), ",")) {
      parts.push_back(nullptr);
    } else {
      ASSIGN_OR_RETURN(ExprPtr stop, ParseExpression(true));
      parts.push_back(std::move(stop));
    }
    if (IsOp(Cur(), ":")) {
      Next();
      if (IsOp(Cur(), "]") || IsOp(Cur(), ",")) {
        parts.push_back(nullptr);
      } else {
        ASSIGN_OR_RETURN(ExprPtr step, ParseExpression(true));
        parts.push_back(std::move(step));
      }
    } else {
      parts.push_back(nullptr);
    }
    return Make(ExprKind::kSlice, start, std::move(parts));
  }

  // (args, name=value, ...) into `e`'s args (after those it has) and kwargs.
  absl::Status ParseCallArgs(Expr* e) {
    const Token& open = Cur();
    RETURN_IF_ERROR(ExpectOp("("));
    bool require_comma = false;
    while (!IsOp(Cur(), ")")) {
      if (require_comma) {
        RETURN_IF_ERROR(ExpectOp(","));
        if (IsOp(Cur(), ")")) break;
      }
      if (IsOp(Cur(), "*") || IsOp(Cur(), "**")) {
        return Error(Cur(), "*args and **kwargs in calls are not supported");
      }
      if (Cur().type == Tok::kName && IsOp(Look(), "=")) {
        std::string key = Next().text;
        Next();
        ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
        e->kwargs.emplace_back(std::move(key), std::move(value));
      } else {
        if (!e->kwargs.empty()) {
          return Error(open,
                       "invalid syntax for function call expression "
                       "(a positional argument after a keyword one)");
        }
        ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
        e->args.push_back(std::move(value));
      }
      require_comma = true;
    }
    return ExpectOp(")");
  }

  absl::StatusOr<ExprPtr> ParseCall(ExprPtr node) {
    const Token& t = Cur();
    auto e = std::make_unique<Expr>();
    e->kind = ExprKind::kCall;
    e->line = LineOf(t);
    e->args.push_back(std::move(node));
    RETURN_IF_ERROR(ParseCallArgs(e.get()));
    return Finish(std::move(e), t);
  }

  // Dotted names, as Jinja allows for filters and tests.
  absl::StatusOr<std::string> ParseDottedName() {
    ASSIGN_OR_RETURN(std::string name, ExpectName());
    while (IsOp(Cur(), ".")) {
      Next();
      ASSIGN_OR_RETURN(std::string part, ExpectName());
      absl::StrAppend(&name, ".", part);
    }
    return name;
  }

  // One `| name(args)`; `subject` is null for a block set's filters.
  absl::StatusOr<ExprPtr> ParseOneFilter(ExprPtr subject) {
    Next();  // |
    const Token& t = Cur();
    ASSIGN_OR_RETURN(std::string name, ParseDottedName());
    if (!IsKnownFilter(name)) {
      return Error(t, absl::StrCat("unknown filter '", name, "'"));
    }
    auto e = std::make_unique<Expr>();
    e->kind = ExprKind::kFilter;
    e->line = LineOf(t);
    e->name = std::move(name);
    e->args.push_back(std::move(subject));
    if (IsOp(Cur(), "(")) RETURN_IF_ERROR(ParseCallArgs(e.get()));
    return Finish(std::move(e), t);
  }

  absl::StatusOr<ExprPtr> ParseTest(ExprPtr subject) {
    const Token& is = Next();
    bool negated = false;
    if (IsName(Cur(), "not")) {
      Next();
      negated = true;
    }
    const Token& t = Cur();
    ASSIGN_OR_RETURN(std::string name, ParseDottedName());
    if (!IsKnownTest(name)) {
      return Error(t, absl::StrCat("unknown test '", name, "'"));
    }
    auto e = std::make_unique<Expr>();
    e->kind = ExprKind::kTest;
    e->line = LineOf(t);
    e->name = std::move(name);
    e->args.push_back(std::move(subject));
    const Token& c = Cur();
    if (IsOp(c, "(")) {
      RETURN_IF_ERROR(ParseCallArgs(e.get()));
    } else if ((c.type == Tok::kName || c.type == Tok::kString ||
                c.type == Tok::kInt || c.type == Tok::kFloat || IsOp(c, "(") ||
                IsOp(c, "[") || IsOp(c, "{")) &&
               !IsName(c, "else") && !IsName(c, "or") && !IsName(c, "and")) {
      if (IsName(c, "is")) {
        return Error(c, "you cannot chain multiple tests with 'is'");
      }
      ASSIGN_OR_RETURN(ExprPtr arg, ParsePrimary());
      ASSIGN_OR_RETURN(arg, ParsePostfix(std::move(arg)));
      e->args.push_back(std::move(arg));
    }
    ASSIGN_OR_RETURN(e, Finish(std::move(e), t));
    if (!negated) return e;
    std::vector<ExprPtr> args;
    args.push_back(std::move(e));
    return Make(ExprKind::kNot, is, std::move(args));
  }

  const std::vector<Token>& tokens_;
  const SourceMap& map_;
  size_t pos_ = 0;
  int block_depth_ = 0;
  int loop_depth_ = 0;
  int recursion_ = 0;
};

// ---------------------------------------------------------------------------
// The renderer.

// Arguments of a call, a filter or a test, evaluated.
struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
};

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

std::string QuotedName(std::string_view name) {
  std::string out;
  AppendStringRepr(name, &out);
  return out;
}

Value NoAttribute(const Value& obj, std::string_view name) {
  return Undefined(absl::StrCat(ObjectTypeRepr(obj), " has no attribute ",
                                QuotedName(name)));
}

bool Among(std::string_view name, std::initializer_list<std::string_view> set) {
  return std::find(set.begin(), set.end(), name) != set.end();
}

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

// Python's index of `i` into a sequence of length `n` (negative counts from
// the end); nullopt when out of range.
std::optional<size_t> Index(int64_t i, size_t n) {
  const int64_t len = static_cast<int64_t>(n);
  if (i < 0) i += len;
  if (i < 0 || i >= len) return std::nullopt;
  return static_cast<size_t>(i);
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

// Python's int(text, base) for the int filter; nullopt if it is not one.
std::optional<int64_t> ParsePyInt(std::string_view text, int base) {
  const std::string s = PyStrip(text, nullptr, true, true);
  size_t k = 0;
  bool negative = false;
  if (k < s.size() && (s[k] == '+' || s[k] == '-')) negative = s[k++] == '-';
  if (base == 16 && s.size() > k + 1 && s[k] == '0' &&
      (s[k + 1] | 0x20) == 'x') {
    k += 2;
  }
  if (k >= s.size()) return std::nullopt;
  int64_t value = 0;
  bool last_underscore = true;
  for (; k < s.size(); ++k) {
    if (s[k] == '_' && !last_underscore) {
      last_underscore = true;
      continue;
    }
    const int d = HexValue(s[k]);
    if (d < 0 || d >= base) return std::nullopt;
    if (__builtin_mul_overflow(value, base, &value) ||
        __builtin_add_overflow(value, d, &value)) {
      return std::nullopt;
    }
    last_underscore = false;
  }
  if (last_underscore) return std::nullopt;
  return negative ? -value : value;
}

// Python's float(text); nullopt if it is not one.
std::optional<double> ParsePyFloat(std::string_view text) {
  std::string s = PyStrip(text, nullptr, true, true);
  s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
  if (s.empty()) return std::nullopt;
  char* end = nullptr;
  const double d = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size()) return std::nullopt;
  return d;
}

enum class Flow { kNormal, kBreak, kContinue };

class Renderer {
 public:
  explicit Renderer(const DictData* context) : context_(context) {
    scopes_.emplace_back();
  }

  absl::Status Run(const std::vector<Node>& body, std::string* out) {
    out_ = out;
    Flow flow = Flow::kNormal;
    return ExecBody(body, &flow);
  }

 private:
  using Scope = std::vector<std::pair<std::string, Value>>;

  Value Lookup(const std::string& name) const {
    for (auto scope = scopes_.rbegin(); scope != scopes_.rend(); ++scope) {
      for (const auto& [key, value] : *scope) {
        if (key == name) return value;
      }
    }
    if (const Value* v = context_->Find(name)) return *v;
    if (Among(name, {"raise_exception", "strftime_now", "range", "dict",
                     "namespace"})) {
      return MakeCallable(Callable::Type::kGlobal, name, Value());
    }
    return Undefined(absl::StrCat(QuotedName(name), " is undefined"));
  }

  absl::Status CountIteration() {
    if (++iterations_ > ChatTemplate::kMaxLoopIterations) {
      return Problem(absl::StrCat(
          "more than ", ChatTemplate::kMaxLoopIterations, " loop iterations"));
    }
    return absl::OkStatus();
  }

  absl::Status Assign(const Target& target, const Value& value) {
    if (!target.ns_attr.empty()) {
      const Value ns = Lookup(target.names[0]);
      if (ns.kind != Kind::kNamespace) {
        return Problem(absl::StrCat("cannot assign attribute '", target.ns_attr,
                                    "' on '", TypeName(ns),
                                    "': not a namespace object"));
      }
      if (HasNamespace(value)) {
        return Problem("a namespace cannot hold a namespace");
      }
      SetEntry(&ns.ns->attrs, target.ns_attr, value);
      return absl::OkStatus();
    }
    if (!target.tuple) {
      SetEntry(&scopes_.back(), target.names[0], value);
      return absl::OkStatus();
    }
    ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(value));
    if (items.size() > target.names.size()) {
      return Problem(absl::StrCat("too many values to unpack (expected ",
                                  target.names.size(), ")"));
    }
    if (items.size() < target.names.size()) {
      return Problem(absl::StrCat("not enough values to unpack (expected ",
                                  target.names.size(), ", got ", items.size(),
                                  ")"));
    }
    for (size_t k = 0; k < items.size(); ++k) {
      SetEntry(&scopes_.back(), target.names[k], std::move(items[k]));
    }
    return absl::OkStatus();
  }

  absl::Status ExecBody(const std::vector<Node>& body, Flow* flow) {
    for (const Node& node : body) {
      RETURN_IF_ERROR(Exec(node, flow));
      if (*flow != Flow::kNormal) break;
    }
    return absl::OkStatus();
  }

  // Runs `body` in a scope of its own.
  absl::Status ExecScoped(const std::vector<Node>& body, Flow* flow,
                          Scope scope = {}) {
    scopes_.push_back(std::move(scope));
    absl::Status status = ExecBody(body, flow);
    scopes_.pop_back();
    return status;
  }

  absl::Status Exec(const Node& node, Flow* flow) {
    return AtLine(node.line, ExecInner(node, flow));
  }

  absl::Status ExecInner(const Node& node, Flow* flow) {
    switch (node.kind) {
      case NodeKind::kText:
        out_->append(node.text);
        return CheckSize(out_->size());
      case NodeKind::kOutput: {
        ASSIGN_OR_RETURN(Value v, Eval(*node.expr));
        return AppendStr(v, out_);
      }
      case NodeKind::kIf:
        for (size_t k = 0; k < node.conditions.size(); ++k) {
          ASSIGN_OR_RETURN(Value test, Eval(*node.conditions[k]));
          if (Truthy(test)) return ExecBody(node.bodies[k], flow);
        }
        return ExecBody(node.else_body, flow);
      case NodeKind::kFor:
        return ExecFor(node);
      case NodeKind::kSet: {
        ASSIGN_OR_RETURN(Value v, Eval(*node.expr));
        return Assign(node.target, v);
      }
      case NodeKind::kSetBlock: {
        std::string captured;
        std::string* saved = out_;
        out_ = &captured;
        Flow inner = Flow::kNormal;
        absl::Status status = ExecScoped(node.bodies[0], &inner);
        out_ = saved;
        RETURN_IF_ERROR(status);
        Value v = String(std::move(captured));
        for (const ExprPtr& filter : node.filters) {
          ASSIGN_OR_RETURN(v, Eval(*filter, &v));
        }
        return Assign(node.target, v);
      }
      case NodeKind::kBreak:
        *flow = Flow::kBreak;
        return absl::OkStatus();
      case NodeKind::kContinue:
        *flow = Flow::kContinue;
        return absl::OkStatus();
      case NodeKind::kScope:
        return ExecScoped(node.bodies[0], flow);
    }
    return absl::OkStatus();
  }

  absl::Status ExecFor(const Node& node) {
    ASSIGN_OR_RETURN(Value iterable, Eval(*node.expr));
    ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(iterable));
    if (!node.conditions.empty()) {
      std::vector<Value> kept;
      for (Value& item : items) {
        RETURN_IF_ERROR(CountIteration());
        scopes_.emplace_back();
        absl::Status status = Assign(node.target, item);
        absl::StatusOr<Value> keep =
            status.ok() ? Eval(*node.conditions[0]) : status;
        scopes_.pop_back();
        RETURN_IF_ERROR(keep.status());
        if (Truthy(*keep)) kept.push_back(std::move(item));
      }
      items = std::move(kept);
    }
    Flow flow = Flow::kNormal;
    if (items.empty()) return ExecScoped(node.else_body, &flow);
    auto list = std::make_shared<ListData>();
    list->items = std::move(items);
    for (size_t k = 0; k < list->items.size(); ++k) {
      RETURN_IF_ERROR(CountIteration());
      auto loop_data = std::make_shared<LoopData>();
      loop_data->items = list;
      loop_data->index0 = static_cast<int64_t>(k);
      Value loop;
      loop.kind = Kind::kLoop;
      loop.loop = std::move(loop_data);
      scopes_.emplace_back();
      absl::Status status = Assign(node.target, list->items[k]);
      if (status.ok()) {
        SetEntry(&scopes_.back(), "loop", std::move(loop));
        flow = Flow::kNormal;
        status = ExecBody(node.bodies[0], &flow);
      }
      scopes_.pop_back();
      RETURN_IF_ERROR(status);
      if (flow == Flow::kBreak) break;
    }
    return absl::OkStatus();
  }

  // Evaluates `e`; a block set's filter (no subject) gets `subject`.
  absl::StatusOr<Value> Eval(const Expr& e, const Value* subject = nullptr) {
    absl::StatusOr<Value> v = EvalInner(e, subject);
    if (!v.ok()) return AtLine(e.line, v.status());
    return v;
  }

  absl::StatusOr<Args> EvalArgs(const Expr& e, size_t first) {
    Args args;
    for (size_t k = first; k < e.args.size(); ++k) {
      ASSIGN_OR_RETURN(Value v, Eval(*e.args[k]));
      args.pos.push_back(std::move(v));
    }
    for (const auto& [key, expr] : e.kwargs) {
      ASSIGN_OR_RETURN(Value v, Eval(*expr));
      args.kw.emplace_back(key, std::move(v));
    }
    return args;
  }

  absl::StatusOr<Value> EvalInner(const Expr& e, const Value* subject) {
    switch (e.kind) {
      case ExprKind::kConst:
        return e.value;
      case ExprKind::kName:
        return Lookup(e.name);
      case ExprKind::kList:
      case ExprKind::kTuple: {
        ASSIGN_OR_RETURN(Args items, EvalArgs(e, 0));
        return MakeList(std::move(items.pos), e.kind == ExprKind::kTuple);
      }
      case ExprKind::kDict: {
        std::vector<std::pair<std::string, Value>> entries;
        for (size_t k = 0; k + 1 < e.args.size(); k += 2) {
          ASSIGN_OR_RETURN(Value key, Eval(*e.args[k]));
          ASSIGN_OR_RETURN(Value value, Eval(*e.args[k + 1]));
          if (!key.is_string()) {
            return Problem(absl::StrCat("dict keys must be strings here, not '",
                                        TypeName(key), "'"));
          }
          SetEntry(&entries, std::move(key.s), std::move(value));
        }
        return MakeDict(std::move(entries));
      }
      case ExprKind::kGetattr: {
        ASSIGN_OR_RETURN(Value obj, Eval(*e.args[0]));
        return GetAttr(obj, e.name);
      }
      case ExprKind::kGetitem: {
        ASSIGN_OR_RETURN(Value obj, Eval(*e.args[0]));
        const Expr& key = *e.args[1];
        if (key.kind == ExprKind::kSlice) {
          std::optional<Value> parts[3];
          for (int k = 0; k < 3; ++k) {
            if (key.args[k]) {
              ASSIGN_OR_RETURN(parts[k], Eval(*key.args[k]));
            }
          }
          return SliceOf(obj, parts);
        }
        ASSIGN_OR_RETURN(Value index, Eval(key));
        return GetItem(obj, index);
      }
      case ExprKind::kSlice:
        return Problem("a slice is only allowed alone inside [...]");
      case ExprKind::kCall:
        return EvalCall(e);
      case ExprKind::kFilter: {
        Value v;
        if (e.args[0]) {
          ASSIGN_OR_RETURN(v, Eval(*e.args[0]));
        } else if (subject != nullptr) {
          v = *subject;
        }
        ASSIGN_OR_RETURN(Args args, EvalArgs(e, 1));
        return ApplyFilter(e.name, v, args);
      }
      case ExprKind::kTest: {
        ASSIGN_OR_RETURN(Value v, Eval(*e.args[0]));
        ASSIGN_OR_RETURN(Args args, EvalArgs(e, 1));
        ASSIGN_OR_RETURN(bool result, ApplyTest(e.name, v, args));
        return Bool(result);
      }
      case ExprKind::kNot: {
        ASSIGN_OR_RETURN(Value v, Eval(*e.args[0]));
        return Bool(!Truthy(v));
      }
      case ExprKind::kNeg:
      case ExprKind::kPos: {
        ASSIGN_OR_RETURN(Value v, Eval(*e.args[0]));
        const bool neg = e.kind == ExprKind::kNeg;
        if (v.is_undefined()) return UndefinedError(v);
        if (v.is_integral()) {
          if (neg && v.i == std::numeric_limits<int64_t>::min()) {
            return Overflow();
          }
          return Int(neg ? -v.i : v.i);
        }
        if (v.kind == Kind::kFloat) return Float(neg ? -v.f : v.f);
        return Problem(absl::StrCat("bad operand type for unary ",
                                    neg ? "-" : "+", ": '", TypeName(v), "'"));
      }
      case ExprKind::kBinary: {
        ASSIGN_OR_RETURN(Value a, Eval(*e.args[0]));
        ASSIGN_OR_RETURN(Value b, Eval(*e.args[1]));
        return Arith(e.op, a, b);
      }
      case ExprKind::kConcat: {
        std::string out;
        for (const ExprPtr& arg : e.args) {
          ASSIGN_OR_RETURN(Value v, Eval(*arg));
          RETURN_IF_ERROR(AppendStr(v, &out));
        }
        return String(std::move(out));
      }
      case ExprKind::kAnd:
      case ExprKind::kOr: {
        ASSIGN_OR_RETURN(Value a, Eval(*e.args[0]));
        if (Truthy(a) == (e.kind == ExprKind::kOr)) return a;
        return Eval(*e.args[1]);
      }
      case ExprKind::kCompare: {
        ASSIGN_OR_RETURN(Value left, Eval(*e.args[0]));
        for (size_t k = 0; k < e.compare_ops.size(); ++k) {
          ASSIGN_OR_RETURN(Value right, Eval(*e.args[k + 1]));
          ASSIGN_OR_RETURN(bool holds, Compare(e.compare_ops[k], left, right));
          if (!holds) return Bool(false);
          left = std::move(right);
        }
        return Bool(true);
      }
      case ExprKind::kCondExpr: {
        ASSIGN_OR_RETURN(Value test, Eval(*e.args[1]));
        if (Truthy(test)) return Eval(*e.args[0]);
        if (e.args[2]) return Eval(*e.args[2]);
        return Undefined(absl::StrCat("the inline if-expression on line ",
                                      e.line,
                                      " evaluated to false and no else "
                                      "section was defined."));
      }
    }
    return Problem("internal error: unknown expression");
  }

  static absl::StatusOr<bool> Compare(CompareOp op, const Value& a,
                                      const Value& b) {
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

  absl::StatusOr<Value> EvalCall(const Expr& e) {
    ASSIGN_OR_RETURN(Value callee, Eval(*e.args[0]));
    ASSIGN_OR_RETURN(Args args, EvalArgs(e, 1));
    if (callee.is_undefined()) {
      if (e.args[0]->kind == ExprKind::kName) {
        const std::string& name = e.args[0]->name;
        if (Among(name, {"cycler", "joiner", "lipsum"})) {
          return Problem(
              absl::StrCat("the function '", name, "' is not supported"));
        }
        return Problem(absl::StrCat("unknown function '", name, "'"));
      }
      return UndefinedError(callee);
    }
    if (callee.kind != Kind::kCallable) {
      return Problem(
          absl::StrCat("'", TypeName(callee), "' object is not callable"));
    }
    const Callable& fn = *callee.fn;
    switch (fn.type) {
      case Callable::Type::kGlobal:
        return CallGlobal(fn.name, args);
      case Callable::Type::kMethod:
        return CallMethod(fn.self, fn.name, args);
      case Callable::Type::kCycle: {
        if (!args.kw.empty() || args.pos.empty()) {
          return Problem("loop.cycle() takes one or more positional arguments");
        }
        const size_t k =
            static_cast<size_t>(fn.self.loop->index0) % args.pos.size();
        return args.pos[k];
      }
    }
    return Problem("internal error: unknown callable");
  }

  absl::StatusOr<Value> CallGlobal(const std::string& name, const Args& args) {
    if (name == "raise_exception") {
      ASSIGN_OR_RETURN(auto a, Bind("raise_exception()", args, {"message"}, 1));
      ASSIGN_OR_RETURN(std::string message, Str(*a[0]));
      return absl::AbortedError(message);
    }
    if (name == "strftime_now") {
      ASSIGN_OR_RETURN(auto a, Bind("strftime_now()", args, {"format"}, 1));
      ASSIGN_OR_RETURN(std::string format, StrArg("strftime_now()", *a[0]));
      const std::time_t now = std::time(nullptr);
      std::tm local{};
      localtime_r(&now, &local);
      if (format.empty()) return String("");
      for (size_t size = 256; size <= 65536; size *= 4) {
        std::string buf(size, '\0');
        const size_t n =
            std::strftime(buf.data(), size, format.c_str(), &local);
        if (n > 0) {
          buf.resize(n);
          return String(std::move(buf));
        }
      }
      return String("");
    }
    if (name == "range") {
      if (!args.kw.empty() || args.pos.empty() || args.pos.size() > 3) {
        return Problem("range() takes 1 to 3 positional arguments");
      }
      int64_t bounds[3] = {0, 0, 1};
      for (size_t k = 0; k < args.pos.size(); ++k) {
        ASSIGN_OR_RETURN(int64_t v, IntArg("range() argument", args.pos[k]));
        bounds[args.pos.size() == 1 ? 1 : k] = v;
      }
      const int64_t start = bounds[0], stop = bounds[1], step = bounds[2];
      if (step == 0) return Problem("range() arg 3 must not be zero");
      const long double count =
          step > 0 ? std::ceil((static_cast<long double>(stop) - start) / step)
                   : std::ceil((static_cast<long double>(start) - stop) /
                               -static_cast<long double>(step));
      if (count > kMaxRange) {
        return Problem(
            absl::StrCat("range too big: the sandbox blocks ranges "
                         "larger than MAX_RANGE (",
                         kMaxRange, ")"));
      }
      std::vector<Value> items;
      int64_t value = start;
      for (int64_t k = 0; k < static_cast<int64_t>(count); ++k) {
        items.push_back(Int(value));
        if (k + 1 < count) value += step;  // Still inside [start, stop).
      }
      return MakeList(std::move(items));
    }
    // dict(...) and namespace(...): an optional mapping, then keywords.
    if (args.pos.size() > 1 ||
        (!args.pos.empty() && args.pos[0].kind != Kind::kDict)) {
      return Problem(absl::StrCat(
          name, "() takes keyword arguments and at most one dict"));
    }
    std::vector<std::pair<std::string, Value>> entries;
    if (!args.pos.empty()) entries = args.pos[0].dict->entries;
    for (const auto& [key, value] : args.kw) SetEntry(&entries, key, value);
    if (name == "dict") return MakeDict(std::move(entries));
    for (const auto& entry : entries) {
      if (HasNamespace(entry.second)) {
        return Problem("a namespace cannot hold a namespace");
      }
    }
    Value v;
    v.kind = Kind::kNamespace;
    v.ns = std::make_shared<Namespace>();
    v.ns->attrs = std::move(entries);
    return v;
  }

  absl::StatusOr<Value> CallMethod(const Value& self, const std::string& name,
                                   const Args& args) {
    const std::string what = absl::StrCat(TypeName(self), ".", name, "()");
    if (self.is_string()) {
      const std::string& s = self.s;
      if (name == "startswith" || name == "endswith") {
        ASSIGN_OR_RETURN(auto a,
                         Bind(what, args, {"prefix", "start", "end"}, 1));
        if (a[1] || a[2]) {
          return Problem(
              absl::StrCat(what, ": start and end are not supported"));
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
        for (std::string& part : parts)
          items.push_back(String(std::move(part)));
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

  // make_attrgetter: `attribute` is "a.b.0" (dotted, digits are indexes) or
  // an integer; each step is a getitem.
  static absl::StatusOr<Value> AttrGetter(const Value& item,
                                          const Value& attribute) {
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
      ASSIGN_OR_RETURN(auto a,
                       Bind(what, args, {"default_value", "boolean"}, 0));
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
          !seps.list->items[0].is_string() ||
          !seps.list->items[1].is_string()) {
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
      ASSIGN_OR_RETURN(
          test, StrArg(absl::StrCat(name, "'s test name"), args.pos[off]));
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
        return k == Kind::kCallable || k == Kind::kUndefined ||
               k == Kind::kLoop;
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

  const DictData* context_;
  std::vector<Scope> scopes_;  // Innermost last.
  std::string* out_ = nullptr;
  int64_t iterations_ = 0;
};

template <typename Json>
absl::StatusOr<std::string> RenderJson(const ChatTemplate::Tree& tree,
                                       const Json& context);

// The token text of "bos_token" / "eos_token": a string or an AddedToken
// object {"content": ...}; "" when absent or null.
absl::StatusOr<std::string> TokenText(const JsonReader& root,
                                      std::string_view key) {
  const JsonReader field = root.Field(key);
  if (field.is_null()) return std::string();
  if (field.value().is_string()) return field.AsString();
  if (field.value().is_object()) return field.RequiredString("content");
  return field.TypeError("a string or an AddedToken object {\"content\": ...}");
}

}  // namespace

struct ChatTemplate::Tree {
  std::vector<Node> body;
};

namespace {

template <typename Json>
absl::StatusOr<std::string> RenderJson(const ChatTemplate::Tree& tree,
                                       const Json& context) {
  if (!context.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("chat template: the context must be a JSON object, not ",
                     context.type_name()));
  }
  absl::StatusOr<Value> root = FromJson(context, 0);
  if (!root.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("chat template: ", root.status().message()));
  }
  Renderer renderer(root->dict.get());
  std::string out;
  const absl::Status status = renderer.Run(tree.body, &out);
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("chat template: ", status.message()));
  }
  return out;
}

}  // namespace

absl::StatusOr<ChatTemplate> ChatTemplate::Parse(std::string_view source) {
  const size_t invalid = FirstInvalidUtf8Offset(source);
  if (invalid != source.size()) {
    return SourceMap(source).Error(invalid, "not valid UTF-8");
  }
  const std::string normalized = NormalizeNewlines(source);
  const SourceMap map(normalized);
  Lexer lexer(normalized, map);
  ASSIGN_OR_RETURN(std::vector<Token> tokens, lexer.Run());
  Parser parser(tokens, map);
  ASSIGN_OR_RETURN(std::vector<Node> body, parser.ParseTemplate());
  auto tree = std::make_shared<Tree>();
  tree->body = std::move(body);
  return ChatTemplate(std::move(tree));
}

absl::StatusOr<std::string> ChatTemplate::Render(
    const nlohmann::json& context) const {
  return RenderJson(*tree_, context);
}

absl::StatusOr<std::string> ChatTemplate::Render(
    const nlohmann::ordered_json& context) const {
  return RenderJson(*tree_, context);
}

absl::StatusOr<ChatTemplateConfig> LoadChatTemplateConfig(
    const std::string& model_dir) {
  const std::string path = model_dir + "/tokenizer_config.json";
  ChatTemplateConfig config;
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (absl::IsNotFound(text.status())) return config;
  if (!text.ok()) return text.status();
  ASSIGN_OR_RETURN(nlohmann::json json, ParseJsonText(*text, path));
  const JsonReader root(json, path);
  RETURN_IF_ERROR(root.ExpectObject());
  const JsonReader field = root.Field("chat_template");
  if (field.value().is_string()) {
    ASSIGN_OR_RETURN(config.source, field.AsString());
  } else if (field.value().is_array()) {
    ASSIGN_OR_RETURN(std::vector<JsonReader> templates, field.AsArray());
    for (const JsonReader& named : templates) {
      RETURN_IF_ERROR(named.ExpectObject());
      ASSIGN_OR_RETURN(std::string name, named.RequiredString("name"));
      ASSIGN_OR_RETURN(std::string source, named.RequiredString("template"));
      if (name == "default") {
        config.source = std::move(source);
        break;
      }
    }
  } else if (!field.is_null()) {
    return field.TypeError(
        "a string or a list of {\"name\", \"template\"} objects");
  }
  ASSIGN_OR_RETURN(config.bos_token, TokenText(root, "bos_token"));
  ASSIGN_OR_RETURN(config.eos_token, TokenText(root, "eos_token"));
  return config;
}

}  // namespace knapserve
