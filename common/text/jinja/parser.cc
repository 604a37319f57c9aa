#include "common/text/jinja/parser.h"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/text/jinja/errors.h"
#include "common/text/jinja/filters.h"
#include "common/text/jinja/tests.h"
#include "common/text/unicode_util.h"

namespace knapserve::jinja {

namespace {

// A recursive descent parser over one template's tokens (Cur() is the token
// at hand); it keeps references to the tokens and the map.
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

}  // namespace

absl::StatusOr<std::vector<Node>> ParseTokens(const std::vector<Token>& tokens,
                                              const SourceMap& map) {
  Parser parser(tokens, map);
  return parser.ParseTemplate();
}

absl::StatusOr<std::vector<Node>> ParseTemplate(std::string_view source) {
  const size_t invalid = FirstInvalidUtf8Offset(source);
  if (invalid != source.size()) {
    return SourceMap(source).Error(invalid, "not valid UTF-8");
  }
  const std::string normalized = NormalizeNewlines(source);
  const SourceMap map(normalized);
  ASSIGN_OR_RETURN(std::vector<Token> tokens, Lex(normalized, map));
  return ParseTokens(tokens, map);
}

}  // namespace knapserve::jinja
