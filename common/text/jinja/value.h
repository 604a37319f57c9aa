// The template engine's value model: a Python value as a Jinja template sees
// it (None, bool, int, float, str, list, tuple, dict, Jinja's Undefined, a
// namespace, the loop variable, a function, a generator, a dict view), and
// what Python does with one: truthiness, str() and repr(), ==, <, `in`,
// iter(), len(), and + - * / // % ** on int, float, str, list and tuple.
// Internal to the template engine (common/text/jinja/, the renderer behind
// common/text/chat_template.h); other code uses ChatTemplate.
//
// Ownership: a Value is a small handle. Scalars are held by value; lists,
// tuples, dicts, dict views, the loop variable's data and functions are
// immutable once made and shared (shared_ptr) by every copy, as Python
// objects are. Two things are mutable and shared by all copies: a namespace
// (`set ns.x = ...`) and a generator's cursor (iterating uses it up). Every
// container records its nesting depth (kMaxValueDepth bounds it) and whether
// it holds a namespace (a namespace may not hold one, so values never form a
// cycle).
//
// Threads: a Value that is or holds a namespace or a generator belongs to the
// render (one thread) that made it. Other values are never written after they
// are made, so they may be read from any number of threads at once (the
// constants of a parsed template are such values). The functions are
// otherwise pure and may be called from any thread.
//
// Errors follow errors.h: functions returning a Status give unlocated
// InvalidArgument problems with Python's message ("unsupported operand
// type(s) for +: 'int' and 'str'"); an undefined value used where a value is
// needed gives the message it carries (Jinja's UndefinedError).
#ifndef KNAPSERVE_COMMON_TEXT_JINJA_VALUE_H_
#define KNAPSERVE_COMMON_TEXT_JINJA_VALUE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace knapserve::jinja {

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
// shared; a namespace is the one mutable object (set ns.x = ...). A
// default-constructed Value is undefined (with no message).
struct Value {
  Kind kind = Kind::kUndefined;
  bool markup = false;  // A string made by |safe (markupsafe.Markup).
  int64_t i = 0;        // kBool (0 / 1), kInt; kDictView: a DictViewType.
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

// A dict. Keys are strings (the only keys JSON and the templates here make).
struct DictData {
  std::vector<std::pair<std::string, Value>> entries;  // In insertion order.
  int depth = 1;
  bool has_namespace = false;

  // The value of `key`, or nullptr; it lives as long as this DictData.
  const Value* Find(std::string_view key) const {
    for (const auto& [k, v] : entries) {
      if (k == key) return &v;
    }
    return nullptr;
  }
};

// namespace(...): attributes in the order they were first set.
struct Namespace {
  std::vector<std::pair<std::string, Value>> attrs;
};

// The `loop` variable of one iteration.
struct LoopData {
  std::shared_ptr<const ListData> items;  // The items iterated over.
  int64_t index0 = 0;
};

// A function a template can call: a global (range, namespace, ...), a
// method bound to its object (str.split, dict.get, ...), or loop.cycle.
struct Callable {
  enum class Type { kGlobal, kMethod, kCycle };
  Type type = Type::kGlobal;
  std::string name;
  Value self;  // kMethod: the object; kCycle: the loop.
};

// ---- Making values.

// An undefined value; using it where a value is needed fails with `why`.
Value Undefined(std::string why);
Value None();
Value Bool(bool b);
Value Int(int64_t i);
Value Float(double f);
// A str; `markup` for a markupsafe.Markup (made by |safe).
Value String(std::string s, bool markup = false);
Value MakeCallable(Callable::Type type, std::string name, Value self);
// A list (a tuple if `tuple`); a problem when it would nest more than
// kMaxValueDepth levels.
absl::StatusOr<Value> MakeList(std::vector<Value> items, bool tuple = false);
// A generator of `items` (iterable once).
absl::StatusOr<Value> MakeGenerator(std::vector<Value> items);
// `items` as a generator; if computing them failed (a problem), a generator
// that fails the same way when it is used, as Jinja's lazy filters do. Other
// errors are returned.
absl::StatusOr<Value> LazyGenerator(absl::StatusOr<std::vector<Value>> items);
// dict.items() / keys() / values() of the given items.
absl::StatusOr<Value> MakeDictView(std::vector<Value> items, DictViewType type);
// A dict; `entries` must have unique keys. A problem when it would nest more
// than kMaxValueDepth levels.
absl::StatusOr<Value> MakeDict(
    std::vector<std::pair<std::string, Value>> entries);
// Sets `key` in `entries`, keeping the position of an existing key (as a
// Python dict does).
void SetEntry(std::vector<std::pair<std::string, Value>>* entries,
              std::string key, Value value);

// The nesting depth of lists and dicts in `v` (0 for anything else).
int DepthOf(const Value& v);
// Whether `v` is or holds a namespace (or the loop, whose items may).
bool HasNamespace(const Value& v);
// The problem of a value nested too deep.
absl::Status TooDeep();

// ---- What Python does with values.

// type(v).__name__ ("int", "NoneType", "dict_items", ...).
std::string TypeName(const Value& v);
// jinja2.utils.object_type_repr, for messages about undefined attributes:
// "None" or "'int object'".
std::string ObjectTypeRepr(const Value& v);
// An undefined value used where a value is needed: Jinja's UndefinedError,
// with the message `v` carries.
absl::Status UndefinedError(const Value& v);

// bool(v). Undefined is false; generators, namespaces, functions are true.
bool Truthy(const Value& v);
// str(v) appended to `out`, as Jinja prints a value: None, True, 1.0,
// [1, 'a'], {'k': (1,)}; undefined prints nothing. A problem for what Jinja
// would print as a Python object with an address (a namespace, the loop, a
// function, a generator) and when `out` grows over kMaxOutputBytes.
absl::Status AppendStr(const Value& v, std::string* out);
// repr(v) appended to `out` ('a', Markup('a'), dict_keys(['a']), ...).
absl::Status AppendRepr(const Value& v, std::string* out);
// str(v).
absl::StatusOr<std::string> Str(const Value& v);

// Python ==: numbers by value across bool, int and float; lists, tuples and
// dicts by their items; mutable objects by identity.
bool Equals(const Value& a, const Value& b);

enum class CompareOp { kEq, kNe, kLt, kLe, kGt, kGe, kIn, kNotIn };

// The operator as written: "==", "not in", ...
std::string_view CompareOpText(CompareOp op);
// Python <, <=, >, >= (`op` is one of those): numbers, strings (code point
// order), lists with lists and tuples with tuples (item by item). A problem
// for other types and for undefined.
absl::StatusOr<bool> Order(CompareOp op, const Value& a, const Value& b);
// Python `needle in haystack` (a substring of a string, an item of a
// sequence, a key of a dict; false in undefined). Uses a generator up to the
// item found.
absl::StatusOr<bool> Contains(const Value& haystack, const Value& needle);
// Python `a op b` for any CompareOp.
absl::StatusOr<bool> Compare(CompareOp op, const Value& a, const Value& b);

// iter(v) as a list: items, dict keys, characters; undefined is empty. A
// generator is used up.
absl::StatusOr<std::vector<Value>> Iterate(const Value& v);
// len(v) (0 for undefined; the loop's length for the loop).
absl::StatusOr<int64_t> Length(const Value& v);

// ---- Arithmetic, as Python does it on int, float, str, list, tuple.

enum class BinOp { kAdd, kSub, kMul, kDiv, kFloorDiv, kMod, kPow };

// The operator as Python's messages name it: "+", "** or pow()", ...
std::string_view BinOpText(BinOp op);
// The problem of an int result beyond 64 bits (Python's ints are unbounded;
// these are not).
absl::Status Overflow();
// `a op b`: int arithmetic exact in 64 bits (Overflow past it), float as
// CPython's (floor division and modulo included), str and list concatenation
// and repetition (bounded by kMaxOutputBytes and kMaxListItems), a |safe
// string escaping a plain one added to it as markupsafe does. Python's
// TypeError and ZeroDivisionError messages as problems; "%" formatting of a
// string is refused.
absl::StatusOr<Value> Arith(BinOp op, const Value& a, const Value& b);

}  // namespace knapserve::jinja

#endif  // KNAPSERVE_COMMON_TEXT_JINJA_VALUE_H_
