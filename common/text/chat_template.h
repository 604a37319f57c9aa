// ChatTemplate: renders a Hugging Face chat template (the Jinja2 source in a
// checkpoint's tokenizer_config.json, "chat_template") into the prompt text,
// the way transformers' apply_chat_template does, for the OpenAI-style
// /v1/chat/completions front door:
//
//   ASSIGN_OR_RETURN(ChatTemplateConfig config,
//                    LoadChatTemplateConfig(model_dir));
//   if (!config.source) ...;  // the model has no chat template
//   ASSIGN_OR_RETURN(ChatTemplate tmpl, ChatTemplate::Parse(*config.source));
//   nlohmann::json context = {{"messages", messages},
//                             {"tools", nullptr},  // HF passes None if absent
//                             {"add_generation_prompt", true},
//                             {"bos_token", config.bos_token},
//                             {"eos_token", config.eos_token}};
//   ASSIGN_OR_RETURN(std::string prompt, tmpl.Render(context));
//
// There is no C++ Jinja library in Debian, so this is a small renderer of
// its own for the part of Jinja that chat templates use, with the semantics
// of jinja2's ImmutableSandboxedEnvironment(trim_blocks=True,
// lstrip_blocks=True, extensions=[loopcontrols]) as transformers sets it up:
//  - Tags: {{ }}, {% %}, {# #}, {% raw %}, whitespace control with - and +,
//    trim_blocks and lstrip_blocks exactly as Jinja's lexer does them; one
//    trailing newline of the source is dropped; \r\n and \r become \n.
//  - Statements: if / elif / else, for (loop.index, index0, revindex,
//    revindex0, first, last, length, previtem, nextitem, depth, cycle();
//    tuple unpacking; an `if` filter; else), break, continue, set (names,
//    tuples, namespace attributes `ns.x`), block set {% set x %}..{% endset %}
//    (with filters), and HF's {% generation %} block (renders its body).
//    Scoping as Jinja's: a for loop's body gets a fresh scope each iteration,
//    so a set inside a loop is gone after it (hence namespace()).
//  - Expressions: literals (strings with Python escapes, ints, floats,
//    true/false/none in either case, lists, tuples, dicts), names, .attr and
//    [key] (dict key, list and string index incl. negative), slices [a:b:c],
//    calls, filters, tests (`is` / `is not`), not and or, comparisons (chained
//    like Python), in / not in, + - * / // % **, ~, unary - +, `x if c else
//    y`. Python truthiness, int / float arithmetic and str() / repr() output
//    (None, True, 1.0, ['a', 1]).
//  - Filters: abs, attr, capitalize, count, d / default, first, float, int,
//    items, join, last, length, list, lower, map, reject, rejectattr,
//    replace, safe, select, selectattr, string, title, tojson (HF's:
//    json.dumps with ensure_ascii=False, indent, separators, sort_keys),
//    trim, upper.
//    select, reject, selectattr, rejectattr, map and items give one-shot
//    generators, as Jinja's do (always true, no length; add |list).
//  - Tests: boolean, callable, defined, divisibleby, eq / equalto / ==,
//    escaped, even, false, float, ge / >=, gt / >, in, integer, iterable,
//    le / <=, lower, lt / <, mapping, ne / !=, none, number, odd, sameas,
//    sequence, string, true, undefined, upper.
//  - Methods: str.startswith, endswith, strip, lstrip, rstrip, split,
//    rsplit, upper, lower, replace, title, capitalize, find, count, join,
//    removeprefix, removesuffix; dict.items, keys, values (views), get,
//    copy; list.count, index, copy. Mutating methods are undefined, and an
//    error when called, as in the immutable sandbox.
//  - Globals: raise_exception(msg), strftime_now(fmt) (local time), range,
//    dict, namespace.
//  - Undefined as Jinja's default Undefined: renders as "", is falsy,
//    iterates as empty, `is defined` is false; a missing key or attribute of
//    a value is undefined, but an attribute, item or call of an undefined
//    value is an error (as in Jinja).
// Anything else is refused by Parse with InvalidArgument "chat template: line
// L, column C: <what>", naming the construct: "{% macro %} is not supported",
// "unknown filter 'foo'", "unterminated '{{' tag".
//
// Known differences from jinja2, all errors here where Jinja prints
// something: printing a function, a generator or a namespace (Jinja prints
// a Python repr with an address); "%" string formatting; other str methods
// (center, format, ...); integers beyond 64 bits; lists made by `list * n`
// beyond a million items. Case mappings are utf8proc's plus Python's full
// mappings for the common special cases (sharp s, ligatures, final sigma);
// |safe strings escape what is added to them with + as markupsafe.Markup
// does, but only the filters trim, lower, upper, capitalize and string keep
// them safe.
//
// Render errors are InvalidArgument too: raise_exception(msg) gives exactly
// "chat template: msg"; other errors "chat template: line L: <what>" (a type
// error, calling something that is not a function, an undefined value used
// in arithmetic). Limits keep hostile input from crashing the server: the
// output and every string built on the way are capped at kMaxOutputBytes,
// nesting of blocks, expressions and values at a few hundred, and a render
// at kMaxLoopIterations loop iterations and kMaxStringBytes of strings
// yielded by its expressions in all; past them the error says which limit.
//
// Values: the context is JSON. Object keys keep the order of the JSON value
// (nlohmann::json sorts them; pass an nlohmann::ordered_json to keep a
// client's order, which matters for `tojson` of tools, as HF keeps it). JSON
// integers must fit in int64; strings must be valid UTF-8.
//
// Ownership and threads: Parse builds an immutable tree held by shared_ptr;
// ChatTemplate objects are cheap to copy and share it. Render is const and
// safe to call from any number of threads at once.
#ifndef KNAPSERVE_COMMON_TEXT_CHAT_TEMPLATE_H_
#define KNAPSERVE_COMMON_TEXT_CHAT_TEMPLATE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace knapserve {

class ChatTemplate {
 public:
  // The largest output (and the largest string a template may build), 16
  // MiB: four times the default 4 MiB request limit, room for tools rendered
  // with tojson(indent=4).
  static constexpr size_t kMaxOutputBytes = size_t{16} << 20;
  // The bytes of all the strings one render's expressions may yield (values
  // are copied when read, so this bounds the time of a loop over a large
  // string): 256 MiB.
  static constexpr uint64_t kMaxStringBytes = uint64_t{16} * kMaxOutputBytes;
  // Loop iterations one render may run, all loops together. A chat
  // template loops over the messages and the tools' parameters: thousands
  // at most. The cap also bounds a hostile template's time: 100,000 of the
  // slowest iterations take well under a second (a few seconds under the
  // fuzzers' ASan build, whose per-input limit is 10 s).
  static constexpr int64_t kMaxLoopIterations = 100'000;

  // Parses `source`. InvalidArgument "chat template: line L, column C:
  // <what>" for a syntax error or a construct outside the supported subset.
  static absl::StatusOr<ChatTemplate> Parse(std::string_view source);

  // Renders with `context` (a JSON object) as the variables: messages,
  // add_generation_prompt, bos_token, eos_token, tools, anything else.
  // InvalidArgument on an error (see the top of this file).
  absl::StatusOr<std::string> Render(const nlohmann::json& context) const;
  // The same with the context's object keys in the order given.
  absl::StatusOr<std::string> Render(
      const nlohmann::ordered_json& context) const;

  struct Tree;  // The parsed template (chat_template.cc).

 private:
  explicit ChatTemplate(std::shared_ptr<const Tree> tree)
      : tree_(std::move(tree)) {}

  std::shared_ptr<const Tree> tree_;
};

// What a checkpoint's tokenizer_config.json says about chat templating.
struct ChatTemplateConfig {
  // The template source; nullopt when the file or its "chat_template" field
  // is absent (or null).
  std::optional<std::string> source;
  // "bos_token" / "eos_token": a string or an AddedToken object {"content":
  // ...}; "" when absent or null.
  std::string bos_token;
  std::string eos_token;
};

// Reads <model_dir>/tokenizer_config.json. "chat_template" is either a string
// or a list of {"name": ..., "template": ...} objects, of which the one named
// "default" is taken (nullopt when there is none). A missing file gives an
// empty config; a malformed one (not JSON, or a field of the wrong type) is
// InvalidArgument naming the file and the field. Thread-safe.
absl::StatusOr<ChatTemplateConfig> LoadChatTemplateConfig(
    const std::string& model_dir);

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_TEXT_CHAT_TEMPLATE_H_
