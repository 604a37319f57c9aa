#include "common/text/jinja/evaluator.h"

#include <cmath>
#include <ctime>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/text/jinja/args.h"
#include "common/text/jinja/errors.h"
#include "common/text/jinja/filters.h"
#include "common/text/jinja/methods.h"
#include "common/text/jinja/py_string.h"
#include "common/text/jinja/tests.h"

namespace knapserve::jinja {

namespace {

// How a statement ends: normally, or by {% break %} / {% continue %}.
enum class Flow { kNormal, kBreak, kContinue };

// Renders one template with one context, on one thread: the variables set by
// the template live in scopes_ (innermost last) over the context; the output
// goes to out_. Statements report errors located at their line (AtLine).
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
    if (++iterations_ > kMaxLoopIterations) {
      return Problem(
          absl::StrCat("more than ", kMaxLoopIterations, " loop iterations"));
    }
    return absl::OkStatus();
  }

  // Counts `size` bytes against kMaxStringBytes (every string an expression
  // yields); past it, an unlocated problem.
  absl::Status CountStringBytes(size_t size) {
    string_bytes_ += size;
    if (string_bytes_ > kMaxStringBytes) {
      return Problem(absl::StrCat("the strings built would be more than ",
                                  kMaxStringBytes >> 20, " MiB in all"));
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
    if (v->is_string()) {
      RETURN_IF_ERROR(AtLine(e.line, CountStringBytes(v->s.size())));
    }
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

  const DictData* context_;
  std::vector<Scope> scopes_;  // Innermost last.
  std::string* out_ = nullptr;
  int64_t iterations_ = 0;
  uint64_t string_bytes_ = 0;  // Counted by CountStringBytes.
};

}  // namespace

absl::StatusOr<std::string> Render(const std::vector<Node>& body,
                                   const DictData& context) {
  Renderer renderer(&context);
  std::string out;
  const absl::Status status = renderer.Run(body, &out);
  if (!status.ok()) return absl::InvalidArgumentError(status.message());
  return out;
}

}  // namespace knapserve::jinja
