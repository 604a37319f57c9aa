// The template engine's syntax tree: what parser.h builds and evaluator.h
// renders. Internal to the template engine (common/text/jinja/, the renderer
// behind common/text/chat_template.h); other code uses ChatTemplate.
//
// Ownership: a parsed template is a std::vector<Node>, which owns its whole
// tree (child nodes in vectors, expressions by unique_ptr). Nothing in it
// changes after parsing (its constants are none, booleans, numbers and
// strings), so any number of threads may render one tree at once; moving the
// vector keeps it valid.
#ifndef KNAPSERVE_COMMON_TEXT_JINJA_AST_H_
#define KNAPSERVE_COMMON_TEXT_JINJA_AST_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/text/jinja/value.h"

namespace knapserve::jinja {

enum class ExprKind {
  kConst,     // A literal: 1, 'a', true, none.
  kName,      // A variable.
  kList,      // [a, b]
  kTuple,     // (a, b)
  kDict,      // {k: v}
  kGetattr,   // x.name
  kGetitem,   // x[key], x.0
  kSlice,     // a:b:c, only as the key of a kGetitem.
  kCall,      // f(args, name=value)
  kFilter,    // x | name(args)
  kTest,      // x is name(args)
  kNot,       // not x
  kNeg,       // -x
  kPos,       // +x
  kBinary,    // x op y (Expr::op)
  kConcat,    // a ~ b ~ c
  kAnd,       // x and y
  kOr,        // x or y
  kCompare,   // a < b == c (Expr::compare_ops), chained as in Python.
  kCondExpr,  // x if test else y
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
  int line = 0;            // Where it is in the source, for errors.
  int depth = 1;           // Of the tree under it (at most kMaxExprDepth).
  Value value;             // kConst.
  std::string name;        // kName, kGetattr, kFilter, kTest.
  BinOp op = BinOp::kAdd;  // kBinary.
  std::vector<CompareOp> compare_ops;  // kCompare.
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;  // kCall, kFilter,
                                                        // kTest.
};

enum class NodeKind {
  kText,      // Template data.
  kOutput,    // {{ expr }}
  kIf,        // {% if %} ... {% elif %} ... {% else %} ... {% endif %}
  kFor,       // {% for %} ... {% else %} ... {% endfor %}
  kSet,       // {% set target = expr %}
  kSetBlock,  // {% set name | filters %} ... {% endset %}
  kBreak,     // {% break %}
  kContinue,  // {% continue %}
  kScope,     // HF's {% generation %}: its body, in a scope of its own.
};

// Where a for loop or a set puts values: one name, a tuple of names, or a
// namespace attribute (names[0].ns_attr).
struct Target {
  std::vector<std::string> names;
  bool tuple = false;
  std::string ns_attr;
};

// A piece of template data or a statement.
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

}  // namespace knapserve::jinja

#endif  // KNAPSERVE_COMMON_TEXT_JINJA_AST_H_
