// Tests of ChatTemplate (common/text/chat_template.h): the real chat
// templates of six model families and the language pieces, each rendered
// both by our renderer and by jinja2 (Debian's python3-jinja2, through
// tests/testing/render_chat_template.py with Hugging Face's environment) and
// compared byte for byte; hand-written expectations for the language pieces;
// the refusals and limits; LoadChatTemplateConfig.
#include "common/text/chat_template.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "nlohmann/json.hpp"
#include "testing/build_paths.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/test_util.h"

namespace knapserve {
namespace {

using nlohmann::ordered_json;
using ::testing::AllOf;
using ::testing::HasSubstr;
using testing::Message;
using testing::ReadFile;
using testing::ScopedTempDir;
using ::testing::StartsWith;
using testing::WriteFile;

std::string TemplatePath(const std::string& stem) {
  std::string path = testing::kSourceDir;
  path.append("/tests/testing/chat_templates/").append(stem).append(".jinja");
  return path;
}

absl::StatusOr<std::string> RenderSource(std::string_view source,
                                         const ordered_json& context) {
  absl::StatusOr<ChatTemplate> tmpl = ChatTemplate::Parse(source);
  if (!tmpl.ok()) return tmpl.status();
  return tmpl->Render(context);
}

// The message of the error Parse gives for `source` ("" and a failure when
// it parses).
std::string ParseError(std::string_view source) {
  absl::StatusOr<ChatTemplate> tmpl = ChatTemplate::Parse(source);
  EXPECT_FALSE(tmpl.ok()) << source;
  if (tmpl.ok()) return "";
  EXPECT_EQ(tmpl.status().code(), absl::StatusCode::kInvalidArgument);
  return Message(tmpl.status());
}

// The message of the error Render gives (the template must parse).
std::string RenderError(std::string_view source,
                        const ordered_json& context = ordered_json::object()) {
  absl::StatusOr<ChatTemplate> tmpl = ChatTemplate::Parse(source);
  EXPECT_TRUE(tmpl.ok()) << tmpl.status();
  if (!tmpl.ok()) return "";
  absl::StatusOr<std::string> out = tmpl->Render(context);
  EXPECT_FALSE(out.ok()) << source << " rendered " << *out;
  if (out.ok()) return "";
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  return Message(out.status());
}

// ---------------------------------------------------------------------------
// The language pieces: each source rendered with UnitContext() gives
// `expected`. The expectations are what jinja2 renders (checked again on
// every run by LanguagePiecesRenderLikeJinja2).

ordered_json UnitContext() {
  return ordered_json::parse(R"json({
    "xs": [1, 2, 3], "d": {"a": 1, "b": "two"}, "s": "Hello", "n": null,
    "e": [], "u": "héllo wörld",
    "msgs": [{"role": "system", "content": " sys "},
             {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "yo"}]})json");
}

struct Expectation {
  std::string source;
  std::string expected;
};

std::vector<Expectation> WhitespaceControlCases() {
  return {
      {"a  {{- 'b' -}}  c", "abc"},
      {"a\n  {%- if true -%}\n  b\n  {%- endif -%}\n  c", "abc"},
      {"a {#- comment -#} b", "ab"},
      {"{{ 'x' }}\n{{ 'y' }}\n", "x\ny"},
      {"  {%+ if true %}a{% endif +%}\nb", "  a\nb"},
      {"x\r\ny\rz\n\n", "x\ny\nz\n"},
  };
}

std::vector<Expectation> TrimAndLstripBlocksCases() {
  return {
      {"a\n    {% if true %}\n    b\n    {% endif %}\n    c",
       "a\n    b\n    c"},
      {"{% for x in xs %}\n  {{ x }}\n{% endfor %}\n", "  1\n  2\n  3\n"},
      {"  {{ 'variables are not lstripped' }}\n",
       "  variables are not lstripped"},
      {"text {% if true %}not at line start{% endif %}\n",
       "text not at line start"},
      {"{# a comment #}\nnext line", "next line"},
      {"\t\t{% set a = 1 %}\n{{ a }}", "1"},
      {"{% raw %}  {{ not rendered }}  {% endraw %}\n!",
       "  {{ not rendered }}  !"},
  };
}

std::vector<Expectation> LoopVariablesCases() {
  return {
      {"{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex "
       "}}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length "
       "}};{% endfor %}",
       "1032TrueFalse3;2121FalseFalse3;3210FalseTrue3;"},
      {"{% for x in xs %}[{{ loop.previtem }}|{{ loop.nextitem }}]{% endfor %}",
       "[|2][1|3][2|]"},
      {"{% for x in xs if x != 2 %}{{ x }}:{{ loop.index }}/{{ loop.length }} "
       "{% endfor %}",
       "1:1/2 3:2/2 "},
      {"{% for x in e %}never{% else %}empty{% endfor %}", "empty"},
      {"{% for x in xs %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 3 "
       "%}{% break %}{% endif %}{{ x }}{% endfor %}",
       "1"},
      {"{% for k, v in d.items() %}{{ k }}={{ v }} {% endfor %}", "a=1 b=two "},
      {"{% for k, v in d|items %}{{ k }}={{ v }} {% endfor %}", "a=1 b=two "},
      {"{% for k in d %}{{ k }}{% endfor %}{% for c in 'ab' %}{{ c }}{% endfor "
       "%}",
       "abab"},
      {"{% for x in xs %}{{ loop.cycle('odd', 'even') }} {% endfor %}",
       "odd even odd "},
      {"{% for m in msgs[::-1] %}{{ m.role }}{% if not loop.last %},{% endif "
       "%}{% endfor %}",
       "assistant,user,system"},
  };
}

std::vector<Expectation> ScopingAndNamespaceCases() {
  return {
      {"{% generation %}{% set g = 1 %}[{{ g }}]{% endgeneration %}[{{ g }}]",
       "[1][]"},
      {"{% set x = 1 %}{% for i in xs %}{% set x = i %}{% endfor %}{{ x }}",
       "1"},
      {"{% for i in xs %}{% if loop.first %}{% set y = 5 %}{% endif %}[{{ y "
       "}}]{% endfor %}",
       "[5][][]"},
      {"{% if true %}{% set z = 3 %}{% endif %}{{ z }}", "3"},
      {"{% set ns = namespace(total=0, seen=[]) %}{% for i in xs %}{% set "
       "ns.total = ns.total + i %}{% set ns.seen = ns.seen + [i] %}{% endfor "
       "%}{{ ns.total }} {{ ns.seen }}",
       "6 [1, 2, 3]"},
      {"{% set a, b = 1, 'two' %}{{ a }} {{ b }}", "1 two"},
      {"{% set block %}  {{ s }}  {% endset %}[{{ block }}]", "[  Hello  ]"},
      {"{% set block | trim | upper %}  {{ s }}  {% endset %}[{{ block }}]",
       "[HELLO]"},
      {"{% set messages = msgs[1:] %}{{ messages|length }} {{ messages[0].role "
       "}}",
       "2 user"},
  };
}

std::vector<Expectation> SubscriptsCases() {
  return {
      {"{{ xs[0] }} {{ xs[-1] }} {{ xs[5] }}|{{ d['a'] }} {{ d.b }} {{ d.zz "
       "}}|{{ msgs[1]['content'] }} {{ msgs.0.role }}",
       "1 3 |1 two |hi system"},
      {"{{ xs[1:] }} {{ xs[:-1] }} {{ xs[::-1] }} {{ xs[::2] }} {{ xs[10:] }} "
       "{{ xs[-10:1] }}",
       "[2, 3] [1, 2] [3, 2, 1] [1, 3] [] [1]"},
      {"{{ s[1:3] }} {{ s[::-1] }} {{ u[1] }} {{ u[-5:] }}",
       "el olleH é wörld"},
      {"{{ (1, 2, 3)[1:] }} {{ [[1, 2], [3]][0][1] }}", "(2, 3) 2"},
  };
}

std::vector<Expectation> FiltersCases() {
  return {
      {"[{{ '  a b  '|trim }}] [{{ 'xxaxx'|trim('x') }}] {{ 5|string }} {{ "
       "xs|string }}",
       "[a b] [a] 5 [1, 2, 3]"},
      {"{{ xs|length }} {{ s|length }} {{ u|count }} {{ d|length }} {{ "
       "e|length }}",
       "3 5 11 2 0"},
      {"{{ 'Ab'|lower }} {{ 'ab'|upper }} {{ 'hELLO wORLD'|capitalize }} {{ "
       "'hello big-world'|title }}",
       "ab AB Hello world Hello Big-World"},
      {"{{ xs|first }} {{ xs|last }} {{ s|first }} {{ s|last }} {{ e|first }}|",
       "1 3 H o |"},
      {"{{ xs|join(', ') }} {{ xs|join }} {{ msgs|join('/', attribute='role') "
       "}}",
       "1, 2, 3 123 system/user/assistant"},
      {"{{ 'a-b-c'|replace('-', '+') }} {{ 'a-b-c'|replace('-', '+', 1) }}",
       "a+b+c a+b-c"},
      {"{{ s|list }} {{ d|list }} {{ d|items|list }}",
       "['H', 'e', 'l', 'l', 'o'] ['a', 'b'] [('a', 1), ('b', 'two')]"},
      {"{{ missing|default('dflt') }} {{ n|default('dflt') }} {{ "
       "n|default('dflt', true) }} {{ ''|d('D', true) }}",
       "dflt None dflt D"},
      {"{{ msgs|selectattr('role', 'equalto', "
       "'user')|map(attribute='content')|list }} {{ msgs|rejectattr('role', "
       "'eq', 'user')|map(attribute='role')|join(',') }}",
       "['hi'] system,assistant"},
      {"{{ xs|select('odd')|list }} {{ xs|reject('equalto', 2)|list }} {{ [0, "
       "1, '', 'a']|select|list }} {{ ['a', 'b']|map('upper')|list }}",
       "[1, 3] [1, 3] [1, 'a'] ['A', 'B']"},
      {"{{ d|tojson }} {{ msgs[0]|tojson(indent=2) }} {{ {'b': 1, 'a': [true, "
       "none, 1.5]}|tojson(sort_keys=true) }} {{ d|tojson(separators=(',', "
       "':')) }}",
       "{\"a\": 1, \"b\": \"two\"} {\n  \"role\": \"system\",\n  \"content\": "
       "\" sys \"\n} {\"a\": [true, null, 1.5], \"b\": 1} "
       "{\"a\":1,\"b\":\"two\"}"},
      {"{{ 'é \"q\" \\n'|tojson }} {{ 'é'|tojson(ensure_ascii=true) }} {{ [] "
       "|tojson(indent=4) }}",
       "\"é \\\"q\\\" \\n\" \"\\u00e9\" []"},
      {"{{ '<b>'|safe + '<i>' }} {{ '<b>' + '<i>'|safe }} {{ ('x'|safe) is "
       "escaped }}",
       "<b>&lt;i&gt; &lt;b&gt;<i> True"},
      {"{{ -3|abs }} {{ '42'|int }} {{ '4.7'|int }} {{ 'x'|int }} {{ "
       "'x'|int(7) }} {{ '2.5'|float }} {{ 3|float }}",
       "3 42 4 0 7 2.5 3.0"},
  };
}

std::vector<Expectation> TestsCases() {
  return {
      {"{{ missing is defined }} {{ xs is defined }} {{ missing is undefined "
       "}} {{ n is none }} {{ s is not none }}",
       "False True True True True"},
      {"{{ s is string }} {{ d is mapping }} {{ xs is iterable }} {{ s is "
       "iterable }} {{ 1 is iterable }} {{ xs is sequence }} {{ d is sequence "
       "}}",
       "True True True True False True True"},
      {"{{ 1 is number }} {{ 1.5 is number }} {{ true is number }} {{ true is "
       "boolean }} {{ 1 is boolean }} {{ true is true }} {{ 0 is false }} {{ "
       "false is false }}",
       "True True True True False True False True"},
      {"{{ 1 is integer }} {{ 1.0 is float }} {{ 3 is odd }} {{ 3 is even }} "
       "{{ 9 is divisibleby 3 }} {{ 2 is in xs }} {{ 'a' is eq 'a' }} {{ 1 is "
       "lt 2 }} {{ 'ab' is lower }} {{ 'AB' is upper }}",
       "True True True False True True True True True True"},
  };
}

std::vector<Expectation> StringMethodsCases() {
  return {
      {"[{{ '  a  '.strip() }}] [{{ '  a  '.lstrip() }}] [{{ '  a  '.rstrip() "
       "}}] [{{ '--a--'.strip('-') }}] [{{ '\\n\\nx\\n'.lstrip('\\n') }}]",
       "[a] [a  ] [  a] [a] [x\n]"},
      {"{{ 'a,b,,c'.split(',') }} {{ ' a  b '.split() }} {{ 'a,b,c'.split(',', "
       "1) }} {{ 'a,b,c'.rsplit(',', 1) }}",
       "['a', 'b', '', 'c'] ['a', 'b'] ['a', 'b,c'] ['a,b', 'c']"},
      {"{{ s.startswith('He') }} {{ s.startswith(('x', 'H')) }} {{ "
       "s.endswith('lo') }} {{ s.endswith('x') }}",
       "True True True False"},
      {"{{ s.upper() }} {{ s.lower() }} {{ 'hello big-world'.title() }} {{ "
       "s.replace('l', 'L') }} {{ s.replace('l', 'L', 1) }}",
       "HELLO hello Hello Big-World HeLLo HeLlo"},
      {"{{ '<think>r</think>\\n\\nans'.split('</think>')[-1].lstrip('\\n') }} "
       "{{ s.find('l') }} {{ s.count('l') }} {{ '-'.join(['a', 'b']) }}",
       "ans 2 2 a-b"},
      {"{{ d.get('a') }} {{ d.get('zz') }} {{ d.get('zz', 0) }} {{ "
       "d.keys()|list }} {{ d.values()|list }} {{ d.items()|list }}",
       "1 None 0 ['a', 'b'] [1, 'two'] [('a', 1), ('b', 'two')]"},
  };
}

std::vector<Expectation> TruthinessAndArithmeticCases() {
  return {
      {"{{ not '' }} {{ not [] }} {{ not {} }} {{ not 0 }} {{ not 0.0 }} {{ "
       "not none }} {{ not 'a' }} {{ not [0] }}",
       "True True True True True True False False"},
      {"{{ 0 or 'x' }} {{ 'a' and 'b' }} {{ '' and 'b' }}| {{ none or [] }} {{ "
       "1 if xs else 2 }} {{ 1 if e else 2 }} [{{ 'a' if false }}]",
       "x b | [] 1 2 []"},
      {"{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 4 / "
       "2 }} {{ 2 ** 10 }} {{ 2 ** -1 }} {{ 7.5 // 2 }} {{ true + 1 }}",
       "3 -4 1 2 3.5 2.0 1024 0.5 3.0 2"},
      {"{{ 1 + 2.0 }} {{ 0.1 + 0.2 }} {{ 1e16 }} {{ 1e15 }} {{ 0.0001 }} {{ "
       "0.00001 }} {{ -0.0 }} {{ 3.0 * 2 }}",
       "3.0 0.30000000000000004 1e+16 1000000000000000.0 0.0001 1e-05 -0.0 "
       "6.0"},
      {"{{ 'ab' * 2 }} {{ [1] * 3 }} {{ xs + [4] }} {{ 'a' ~ 1 ~ none ~ true "
       "}} {{ -(xs|length) }}",
       "abab [1, 1, 1] [1, 2, 3, 4] a1NoneTrue -3"},
      {"{{ 1 == 1.0 }} {{ true == 1 }} {{ [1, 2] == [1, 2] }} {{ [1] == (1,) "
       "}} {{ 1 < 2 < 3 }} {{ 'a' < 'b' }} {{ 2 in xs }} {{ 5 not in xs }} {{ "
       "'el' in s }} {{ 'a' in d }}",
       "True True True False True True True True True True"},
      {"{{ none }} {{ true }} {{ false }} {{ 1.0 }} {{ [1, 'a', none, 2.5, "
       "{'k': (1,)}] }} {{ ('x',) }} {{ [\"it's\", 'say \"hi\"', 'both \\'\"', "
       "'\\n\\t\\x01é'] }}",
       "None True False 1.0 [1, 'a', None, 2.5, {'k': (1,)}] ('x',) [\"it's\", "
       "'say \"hi\"', 'both \\'\"', '\\n\\t\\x01é']"},
  };
}

std::vector<Expectation> UndefinedCases() {
  return {
      {"[{{ missing }}] {{ missing is defined }} {{ missing|length }} {{ "
       "missing|list }} [{{ missing|trim }}] {{ missing == missing }} {{ 'a' "
       "in missing }}",
       "[] False 0 [] [] True False"},
      {"{% for x in missing %}x{% else %}no items{% endfor %} {{ d.nope is "
       "defined }} {{ msgs[0].nope is undefined }} {{ missing ~ 'a' }}",
       "no items False True a"},
      {"{% if missing %}yes{% else %}no{% endif %} {{ "
       "missing|default('fallback') }} {{ (missing if false)|default('F') }}",
       "no fallback F"},
  };
}

// Every group, by name.
std::vector<std::pair<std::string, std::vector<Expectation>>> AllGroups() {
  return {
      {"WhitespaceControl", WhitespaceControlCases()},
      {"TrimAndLstripBlocks", TrimAndLstripBlocksCases()},
      {"LoopVariables", LoopVariablesCases()},
      {"ScopingAndNamespace", ScopingAndNamespaceCases()},
      {"Subscripts", SubscriptsCases()},
      {"Filters", FiltersCases()},
      {"Tests", TestsCases()},
      {"StringMethods", StringMethodsCases()},
      {"TruthinessAndArithmetic", TruthinessAndArithmeticCases()},
      {"Undefined", UndefinedCases()},
  };
}

void ExpectRenders(const std::vector<Expectation>& cases) {
  for (const Expectation& c : cases) {
    SCOPED_TRACE(c.source);
    absl::StatusOr<std::string> out = RenderSource(c.source, UnitContext());
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(*out, c.expected);
  }
}

TEST(ChatTemplateTest, WhitespaceControl) {
  ExpectRenders(WhitespaceControlCases());
}
TEST(ChatTemplateTest, TrimAndLstripBlocks) {
  ExpectRenders(TrimAndLstripBlocksCases());
}
TEST(ChatTemplateTest, LoopVariables) { ExpectRenders(LoopVariablesCases()); }
TEST(ChatTemplateTest, ScopingAndNamespace) {
  ExpectRenders(ScopingAndNamespaceCases());
}
TEST(ChatTemplateTest, Subscripts) { ExpectRenders(SubscriptsCases()); }
TEST(ChatTemplateTest, Filters) { ExpectRenders(FiltersCases()); }
TEST(ChatTemplateTest, Tests) { ExpectRenders(TestsCases()); }
TEST(ChatTemplateTest, StringMethods) { ExpectRenders(StringMethodsCases()); }
TEST(ChatTemplateTest, TruthinessAndArithmetic) {
  ExpectRenders(TruthinessAndArithmeticCases());
}
TEST(ChatTemplateTest, Undefined) { ExpectRenders(UndefinedCases()); }

// ---------------------------------------------------------------------------
// The reference: jinja2 renders the same cases.

// One rendering to compare: a template (by name) and its variables.
struct RenderCase {
  std::string label;
  std::string template_name;
  ordered_json context;
};

struct ReferenceResult {
  bool ok = false;
  std::string text;   // The rendering, when ok.
  std::string error;  // str(exception), when not.
  std::string type;   // The exception's class.
};

// Runs tests/testing/render_chat_template.py over `cases` (templates by
// name in `templates`) and returns its results in order; a test failure
// (and an empty list) if it cannot run.
//
// It runs /usr/bin/python3, not the python3 on PATH: jinja2 is Debian's
// python3-jinja2 (tools/setup.sh installs it), which only Debian's Python
// sees; a pyenv or venv python3 earlier on PATH usually lacks it.
std::vector<ReferenceResult> RenderWithJinja2(
    const std::vector<std::pair<std::string, std::string>>& templates,
    const std::vector<RenderCase>& cases) {
  ScopedTempDir dir("chat_template");
  ordered_json spec = {{"templates", ordered_json::object()},
                       {"cases", ordered_json::array()}};
  for (const auto& [name, source] : templates) spec["templates"][name] = source;
  for (const RenderCase& c : cases) {
    spec["cases"].push_back(
        {{"template", c.template_name}, {"context", c.context}});
  }
  const std::string cases_path = dir.path() + "/cases.json";
  WriteFile(cases_path, spec.dump());

  const std::string hint =
      " (the reference renderer needs Debian's python3 and python3-jinja2: "
      "apt-get install python3-jinja2, as tools/setup.sh does)";
  const testing::ProcessOutcome run =
      testing::RunProcess({"/usr/bin/python3",
                           std::string(testing::kSourceDir) +
                               "/tests/testing/render_chat_template.py",
                           cases_path});
  if (run.exit_code != 0) {
    ADD_FAILURE() << "render_chat_template.py failed: " << run.err << hint;
    return {};
  }
  const ordered_json out = ordered_json::parse(run.out, nullptr, false);
  if (!out.is_array() || out.size() != cases.size()) {
    ADD_FAILURE() << "render_chat_template.py printed no list of "
                  << cases.size() << " results: " << run.out;
    return {};
  }
  std::vector<ReferenceResult> results;
  for (const ordered_json& r : out) {
    ReferenceResult result;
    result.ok = r.value("ok", false);
    result.text = r.value("text", "");
    result.error = r.value("error", "");
    result.type = r.value("type", "");
    results.push_back(std::move(result));
  }
  return results;
}

// Renders every case with ChatTemplate and with jinja2 and compares: the
// same text byte for byte, or both an error; raise_exception("msg") must
// give exactly "chat template: msg", other errors must contain jinja2's
// message. Returns how many cases each side failed.
int CompareWithJinja2(
    const std::vector<std::pair<std::string, std::string>>& templates,
    const std::vector<RenderCase>& cases) {
  const std::vector<ReferenceResult> reference =
      RenderWithJinja2(templates, cases);
  if (reference.size() != cases.size()) return 0;
  int errors = 0;
  for (size_t k = 0; k < cases.size(); ++k) {
    const RenderCase& c = cases[k];
    SCOPED_TRACE(c.label + " " + c.context.dump());
    std::string source;
    for (const auto& [name, text] : templates) {
      if (name == c.template_name) source = text;
    }
    const absl::StatusOr<std::string> ours = RenderSource(source, c.context);
    const ReferenceResult& theirs = reference[k];
    if (theirs.ok) {
      EXPECT_TRUE(ours.ok()) << ours.status();
      if (ours.ok()) {
        EXPECT_EQ(*ours, theirs.text);
      }
      continue;
    }
    ++errors;
    EXPECT_FALSE(ours.ok()) << "jinja2 failed (" << theirs.type << ": "
                            << theirs.error << ") but we rendered " << *ours;
    if (ours.ok()) continue;
    EXPECT_EQ(ours.status().code(), absl::StatusCode::kInvalidArgument);
    if (theirs.type == "TemplateError") {
      EXPECT_EQ(Message(ours.status()), "chat template: " + theirs.error);
    } else {
      EXPECT_THAT(Message(ours.status()), HasSubstr(theirs.error));
    }
  }
  return errors;
}

TEST(ChatTemplateJinja2Test, LanguagePiecesRenderLikeJinja2) {
  std::vector<std::pair<std::string, std::string>> templates;
  std::vector<RenderCase> cases;
  for (const auto& [group, expectations] : AllGroups()) {
    for (size_t k = 0; k < expectations.size(); ++k) {
      const std::string name = group + std::to_string(k);
      templates.emplace_back(name, expectations[k].source);
      cases.push_back({name, name, UnitContext()});
    }
  }
  EXPECT_EQ(CompareWithJinja2(templates, cases), 0);
}

// Conversations (message lists) the real templates are rendered with.
std::vector<std::pair<std::string, ordered_json>> Conversations() {
  return {
      {"single turn", ordered_json::parse(R"json([
          {"role": "user", "content": "Hello!"}])json")},
      {"system and user", ordered_json::parse(R"json([
          {"role": "system", "content": "  You are terse.\n"},
          {"role": "user", "content": "Hi"}])json")},
      {"multi-turn with system", ordered_json::parse(R"json([
          {"role": "system", "content": "You answer in French."},
          {"role": "user", "content": "  Say \"hi\" and 'bye'  "},
          {"role": "assistant", "content": "\n Salut « toi » \n"},
          {"role": "user", "content": "héllo 😀 日本語\n\nsecond line\t"},
          {"role": "assistant", "content": "Ça va ?"},
          {"role": "user", "content": "{{ not a tag }} {% nor this %}"}])json")},
      {"multi-turn without system", ordered_json::parse(R"json([
          {"role": "user", "content": "u1"},
          {"role": "assistant", "content": "a1"},
          {"role": "user", "content": "u2"},
          {"role": "assistant", "content": "a2"},
          {"role": "user", "content": "u3"}])json")},
      {"ends with assistant", ordered_json::parse(R"json([
          {"role": "user", "content": "Write a haiku."},
          {"role": "assistant", "content": "Autumn moonlight"}])json")},
      {"reasoning", ordered_json::parse(R"json([
          {"role": "user", "content": "2+2?"},
          {"role": "assistant",
           "content": "<think>\nAdd them.\n</think>\n\n4"},
          {"role": "user", "content": "And 3+3?"},
          {"role": "assistant", "content": "6",
           "reasoning_content": "Add again."},
          {"role": "user", "content": "Thanks"}])json")},
      {"tool calls", ordered_json::parse(R"json([
          {"role": "system", "content": "Use tools."},
          {"role": "user", "content": "Weather in Paris?"},
          {"role": "assistant", "content": "",
           "tool_calls": [{"type": "function", "function": {
               "name": "get_weather",
               "arguments": {"city": "Paris", "days": 2}}}]},
          {"role": "tool", "content": "{\"temp\": 20, \"sky\": \"clear\"}"},
          {"role": "tool", "content": "second result"},
          {"role": "assistant", "content": "It is 20 °C."}])json")},
      {"roles not alternating", ordered_json::parse(R"json([
          {"role": "user", "content": "one"},
          {"role": "user", "content": "two"}])json")},
  };
}

// The conversation named `label` in Conversations().
ordered_json Conversation(const std::string& label) {
  for (const auto& [name, messages] : Conversations()) {
    if (name == label) return messages;
  }
  ADD_FAILURE() << "no conversation " << label;
  return ordered_json::array();
}

ordered_json WeatherTools() {
  return ordered_json::parse(R"json([{"type": "function", "function": {
      "name": "get_weather",
      "description": "Current weather — «now»",
      "parameters": {"type": "object",
                     "properties": {"city": {"type": "string"},
                                    "days": {"type": "integer"}},
                     "required": ["city"]}}}])json");
}

TEST(ChatTemplateJinja2Test, RealTemplatesRenderLikeJinja2) {
  struct Model {
    std::string stem;
    ordered_json bos;  // null: the model has none (not passed).
    std::string eos;
  };
  const std::vector<Model> models = {
      {"meta-llama-Meta-Llama-3-8B-Instruct", "<|begin_of_text|>",
       "<|eot_id|>"},
      {"meta-llama-Llama-3.3-70B-Instruct", "<|begin_of_text|>", "<|eot_id|>"},
      {"Qwen-Qwen2-7B-Instruct", nullptr, "<|im_end|>"},
      {"Qwen-Qwen3-0.6B", nullptr, "<|im_end|>"},
      {"HuggingFaceTB-SmolLM2-1.7B-Instruct", "<|im_start|>", "<|im_end|>"},
      {"mistralai-Mistral-7B-Instruct-v0.2", "<s>", "</s>"},
  };
  std::vector<std::pair<std::string, std::string>> templates;
  std::vector<RenderCase> cases;
  for (const Model& model : models) {
    const std::string source = ReadFile(TemplatePath(model.stem));
    ASSERT_FALSE(source.empty()) << TemplatePath(model.stem);
    templates.emplace_back(model.stem, source);
    auto add = [&](const std::string& label, const ordered_json& messages,
                   bool generation_prompt, ordered_json extra) {
      // As transformers' apply_chat_template passes them: tools is None
      // when there are none; the special tokens the tokenizer has.
      ordered_json context = {{"messages", messages},
                              {"tools", nullptr},
                              {"add_generation_prompt", generation_prompt}};
      if (!model.bos.is_null()) context["bos_token"] = model.bos;
      context["eos_token"] = model.eos;
      // Llama 3.3 prints today's date unless given one.
      context["date_string"] = "15 Mar 2025";
      for (auto it = extra.begin(); it != extra.end(); ++it) {
        context[it.key()] = it.value();
      }
      cases.push_back({model.stem + ", " + label, model.stem, context});
    };
    for (const auto& [label, messages] : Conversations()) {
      for (bool generation_prompt : {false, true}) {
        add(label, messages, generation_prompt, ordered_json::object());
      }
    }
    const ordered_json single = Conversation("single turn");
    const ordered_json tool_calls = Conversation("tool calls");
    add("tools", single, true, {{"tools", WeatherTools()}});
    add("tools, tool calls", tool_calls, true, {{"tools", WeatherTools()}});
    add("tools in the system message", tool_calls, true,
        {{"tools", WeatherTools()}, {"tools_in_user_message", false}});
    add("tools, only a system message",
        ordered_json::parse(R"([{"role": "system", "content": "S"}])"), true,
        {{"tools", WeatherTools()}});
    add("builtin tools", ordered_json::parse(R"json([
            {"role": "user", "content": "Search for cats"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "function": {
                 "name": "brave_search",
                 "arguments": {"query": "cats", "count": "3"}}}]},
            {"role": "ipython", "content": ["cat 1", "cat 2"]}])json"),
        true,
        {{"builtin_tools",
          {"brave_search", "wolfram_alpha", "code_interpreter"}}});
    add("two tool calls at once", ordered_json::parse(R"json([
            {"role": "user", "content": "Both?"},
            {"role": "assistant", "content": "",
             "tool_calls": [
                 {"function": {"name": "a", "arguments": {}}},
                 {"function": {"name": "b", "arguments": "{}"}}]}])json"),
        false, ordered_json::object());
    add("thinking off", Conversation("reasoning"), true,
        {{"enable_thinking", false}});
    add("null content", ordered_json::parse(R"json([
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": null}])json"),
        false, ordered_json::object());
  }
  const int errors = CompareWithJinja2(templates, cases);
  // Some cases must fail: Mistral's raise_exception on roles that do not
  // alternate, Llama 3.3's on two tool calls at once.
  EXPECT_GT(errors, 0);
  EXPECT_LT(errors, static_cast<int>(cases.size()) / 4);
}

TEST(ChatTemplateTest, MistralRefusesRolesThatDoNotAlternate) {
  absl::StatusOr<ChatTemplate> tmpl = ChatTemplate::Parse(
      ReadFile(TemplatePath("mistralai-Mistral-7B-Instruct-v0.2")));
  ASSERT_TRUE(tmpl.ok()) << tmpl.status();
  const ordered_json context = {
      {"messages", ordered_json::parse(R"([{"role": "user", "content": "a"},
                                           {"role": "user", "content": "b"}])")},
      {"bos_token", "<s>"},
      {"eos_token", "</s>"}};
  const absl::StatusOr<std::string> out = tmpl->Render(context);
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Message(out.status()),
            "chat template: After the optional system message, conversation "
            "roles must alternate user/assistant/user/assistant/...");
}

// ---------------------------------------------------------------------------
// Errors and refusals.

TEST(ChatTemplateTest, RuntimeErrorsSayWhatAndWhere) {
  EXPECT_EQ(RenderError("{{ raise_exception('Bad ' ~ 'role') }}"),
            "chat template: Bad role");
  EXPECT_EQ(RenderError("a\nb\n{{ lipsum(2) }}"),
            "chat template: line 3: the function 'lipsum' is not supported");
  EXPECT_EQ(RenderError("{{ frobnicate(1) }}"),
            "chat template: line 1: unknown function 'frobnicate'");
  EXPECT_EQ(RenderError("\n{{ 'a' + 1 }}"),
            "chat template: line 2: can only concatenate str (not \"int\") to "
            "str");
  EXPECT_EQ(RenderError("{{ x.y }}"),
            "chat template: line 1: 'x' is undefined");
  EXPECT_EQ(
      RenderError("{{ messages[0].content + 1 }}",
                  ordered_json::parse(R"({"messages": [{"role": "user"}]})")),
      "chat template: line 1: 'dict object' has no attribute 'content'");
  EXPECT_EQ(RenderError("{{ 'abc'.center(9) }}"),
            "chat template: line 1: str.center() is not supported");
  EXPECT_EQ(RenderError("{{ [1].append(2) }}"),
            "chat template: line 1: access to attribute 'append' of 'list' "
            "object is unsafe.");
  EXPECT_EQ(RenderError("{{ 1 // 0 }}"),
            "chat template: line 1: integer division or modulo by zero");
  EXPECT_EQ(RenderError("{{ 'a' < 1 }}"),
            "chat template: line 1: '<' not supported between instances of "
            "'str' and 'int'");
  EXPECT_EQ(RenderError("{{ [1]|select }}"),
            "chat template: line 1: cannot print a generator (what select, "
            "map, items... return); add |list");
  EXPECT_EQ(RenderError("{{ missing|tojson }}"),
            "chat template: line 1: Object of type Undefined is not JSON "
            "serializable");
  EXPECT_THAT(RenderError("{% set x = 1 %}{% set x.a = 2 %}"),
              HasSubstr("not a namespace object"));
}

TEST(ChatTemplateTest, RenderNeedsAJsonObject) {
  absl::StatusOr<ChatTemplate> tmpl = ChatTemplate::Parse("x");
  ASSERT_TRUE(tmpl.ok());
  const absl::StatusOr<std::string> out = tmpl->Render(nlohmann::json(3));
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(Message(out.status()),
            "chat template: the context must be a JSON object, not number");
}

TEST(ChatTemplateParseTest, RefusesWhatIsNotSupported) {
  EXPECT_EQ(ParseError("{% macro f() %}x{% endmacro %}"),
            "chat template: line 1, column 4: {% macro %} is not supported");
  EXPECT_EQ(ParseError("a\n  {% include 'other.jinja' %}"),
            "chat template: line 2, column 6: {% include %} is not supported");
  EXPECT_EQ(ParseError("{% extends 'base.jinja' %}"),
            "chat template: line 1, column 4: {% extends %} is not supported");
  EXPECT_EQ(ParseError("{{ x|wordcount }}"),
            "chat template: line 1, column 6: unknown filter 'wordcount'");
  EXPECT_EQ(ParseError("{{ x is prime }}"),
            "chat template: line 1, column 9: unknown test 'prime'");
  EXPECT_EQ(ParseError("{% frob %}"),
            "chat template: line 1, column 4: unknown tag 'frob'");
  EXPECT_EQ(ParseError("{% for x in xs recursive %}{% endfor %}"),
            "chat template: line 1, column 16: recursive for loops are not "
            "supported");
  EXPECT_EQ(ParseError("{{ f(*args) }}"),
            "chat template: line 1, column 6: *args and **kwargs in calls are "
            "not supported");
  EXPECT_EQ(ParseError("{% break %}"),
            "chat template: line 1, column 4: {% break %} outside of a for "
            "loop");
}

TEST(ChatTemplateParseTest, SyntaxErrorsSayWhere) {
  EXPECT_EQ(ParseError("line one\n  éé {{ messages[0]"),
            "chat template: line 2, column 6: unterminated '{{' tag (no "
            "matching '}}')");
  EXPECT_EQ(ParseError("{% if x %}\n{% for y in z %}"),
            "chat template: line 2, column 4: {% for %} is not closed: "
            "expected {% endfor %} or {% else %} before the end of the "
            "template");
  EXPECT_EQ(ParseError("x {# never closed"),
            "chat template: line 1, column 3: unterminated comment (no "
            "matching '#}')");
  EXPECT_EQ(ParseError("{{ 'abc }}"),
            "chat template: line 1, column 4: unterminated string literal");
  EXPECT_EQ(ParseError("{% endif %}"),
            "chat template: line 1, column 4: unexpected {% endif %} (no open "
            "block it could close)");
  EXPECT_EQ(ParseError("{{ (1 + 2 }}"),
            "chat template: line 1, column 11: unexpected '}', expected ')'");
  EXPECT_EQ(ParseError("{{ 1 + }}"),
            "chat template: line 1, column 8: unexpected end of print "
            "statement ('}}')");
  EXPECT_EQ(ParseError("{{ a b }}"),
            "chat template: line 1, column 6: expected end of print "
            "statement ('}}'), got 'b'");
  EXPECT_EQ(ParseError("{% set 1 = 2 %}"),
            "chat template: line 1, column 8: can only assign to names (or a "
            "namespace attribute, or a tuple of names)");
  EXPECT_EQ(ParseError("ok\xff"),
            "chat template: line 1, column 3: not valid UTF-8");
}

// ---------------------------------------------------------------------------
// Limits.

TEST(ChatTemplateLimitsTest, DeepNestingIsRefused) {
  const std::string parens =
      "{{ " + std::string(150, '(') + "1" + std::string(150, ')') + " }}";
  EXPECT_THAT(ParseError(parens),
              HasSubstr("expression nested more than 100 levels deep"));
  std::string filters = "{{ x";
  for (int k = 0; k < 150; ++k) filters += "|trim";
  EXPECT_THAT(ParseError(filters + " }}"),
              HasSubstr("expression nested more than 100 levels deep"));
  std::string blocks;
  for (int k = 0; k < 150; ++k) blocks += "{% if true %}";
  for (int k = 0; k < 150; ++k) blocks += "{% endif %}";
  EXPECT_THAT(ParseError(blocks),
              HasSubstr("blocks nested more than 100 levels deep"));
  ordered_json deep = 1;
  for (int k = 0; k < 300; ++k) deep = ordered_json::array({deep});
  EXPECT_THAT(RenderError("{{ x }}", {{"x", deep}}),
              HasSubstr("nested more than 256 levels deep"));
}

TEST(ChatTemplateLimitsTest, OutputIsCapped) {
  EXPECT_THAT(RenderError("{% set ns = namespace(s='x') %}"
                          "{% for i in range(30) %}"
                          "{% set ns.s = ns.s ~ ns.s %}{% endfor %}"),
              HasSubstr("the output would be larger than 16 MiB"));
  EXPECT_THAT(RenderError("{{ 'ab' * 100000000 }}"),
              HasSubstr("the output would be larger than 16 MiB"));
  EXPECT_THAT(RenderError("{{ range(1000000)|length }}"),
              HasSubstr("range too big"));
  EXPECT_THAT(RenderError("{{ 9223372036854775807 + 1 }}"),
              HasSubstr("integer overflow"));
}

// ---------------------------------------------------------------------------
// The API.

TEST(ChatTemplateTest, KeyOrderFollowsTheJson) {
  absl::StatusOr<ChatTemplate> tmpl =
      ChatTemplate::Parse("{{ tool|tojson }} {{ tool }}");
  ASSERT_TRUE(tmpl.ok());
  const std::string text = R"({"tool": {"type": "function", "name": "f"}})";
  // nlohmann::json sorts object keys; ordered_json keeps a client's order.
  EXPECT_EQ(*tmpl->Render(nlohmann::json::parse(text)),
            "{\"name\": \"f\", \"type\": \"function\"} {'name': 'f', 'type': "
            "'function'}");
  EXPECT_EQ(*tmpl->Render(ordered_json::parse(text)),
            "{\"type\": \"function\", \"name\": \"f\"} {'type': 'function', "
            "'name': 'f'}");
}

TEST(ChatTemplateTest, CopiesRenderConcurrently) {
  absl::StatusOr<ChatTemplate> parsed =
      ChatTemplate::Parse(ReadFile(TemplatePath("Qwen-Qwen3-0.6B")));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  const ChatTemplate tmpl = *parsed;  // Copies share the tree.
  const ordered_json context = {{"messages", Conversation("tool calls")},
                                {"tools", WeatherTools()},
                                {"add_generation_prompt", true}};
  const absl::StatusOr<std::string> expected = tmpl.Render(context);
  ASSERT_TRUE(expected.ok()) << expected.status();
  std::vector<std::thread> threads;
  std::vector<std::string> outputs(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int k = 0; k < 50; ++k) {
        absl::StatusOr<std::string> out = tmpl.Render(context);
        outputs[t] = out.ok() ? *out : Message(out.status());
        if (outputs[t] != *expected) return;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const std::string& out : outputs) EXPECT_EQ(out, *expected);
}

// ---------------------------------------------------------------------------
// LoadChatTemplateConfig.

TEST(LoadChatTemplateConfigTest, StringTemplateAndTokens) {
  ScopedTempDir dir("chat_config");
  WriteFile(dir.path() + "/tokenizer_config.json", R"json({
      "bos_token": "<s>",
      "eos_token": {"__type": "AddedToken", "content": "</s>",
                    "lstrip": false},
      "chat_template": "{{ bos_token }}{{ messages[0].content }}"})json");
  absl::StatusOr<ChatTemplateConfig> config =
      LoadChatTemplateConfig(dir.path());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->source, "{{ bos_token }}{{ messages[0].content }}");
  EXPECT_EQ(config->bos_token, "<s>");
  EXPECT_EQ(config->eos_token, "</s>");
}

TEST(LoadChatTemplateConfigTest, ListOfNamedTemplatesTakesDefault) {
  ScopedTempDir dir("chat_config");
  WriteFile(dir.path() + "/tokenizer_config.json", R"json({
      "bos_token": null,
      "chat_template": [{"name": "tool_use", "template": "T"},
                        {"name": "default", "template": "D"}]})json");
  absl::StatusOr<ChatTemplateConfig> config =
      LoadChatTemplateConfig(dir.path());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->source, "D");
  EXPECT_EQ(config->bos_token, "");
  EXPECT_EQ(config->eos_token, "");

  WriteFile(dir.path() + "/tokenizer_config.json",
            R"({"chat_template": [{"name": "rag", "template": "R"}]})");
  config = LoadChatTemplateConfig(dir.path());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_FALSE(config->source.has_value());
}

TEST(LoadChatTemplateConfigTest, MissingFileOrFieldGivesNoTemplate) {
  ScopedTempDir dir("chat_config");
  absl::StatusOr<ChatTemplateConfig> config =
      LoadChatTemplateConfig(dir.path());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_FALSE(config->source.has_value());

  WriteFile(dir.path() + "/tokenizer_config.json", R"({"eos_token": "E"})");
  config = LoadChatTemplateConfig(dir.path());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_FALSE(config->source.has_value());
  EXPECT_EQ(config->eos_token, "E");
}

TEST(LoadChatTemplateConfigTest, MalformedFileIsAnError) {
  ScopedTempDir dir("chat_config");
  const std::string path = dir.path() + "/tokenizer_config.json";
  WriteFile(path, "{\"chat_template\": ");
  absl::StatusOr<ChatTemplateConfig> config =
      LoadChatTemplateConfig(dir.path());
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(config.status()), StartsWith(path + ": not valid JSON"));

  WriteFile(path, R"({"chat_template": 7})");
  config = LoadChatTemplateConfig(dir.path());
  ASSERT_FALSE(config.ok());
  EXPECT_THAT(Message(config.status()),
              AllOf(StartsWith(path), HasSubstr("chat_template")));

  WriteFile(path, R"({"chat_template": "x", "bos_token": 1})");
  config = LoadChatTemplateConfig(dir.path());
  ASSERT_FALSE(config.ok());
  EXPECT_THAT(Message(config.status()),
              AllOf(StartsWith(path), HasSubstr("bos_token")));

  WriteFile(path, R"({"chat_template": [{"name": "default"}]})");
  config = LoadChatTemplateConfig(dir.path());
  ASSERT_FALSE(config.ok());
  EXPECT_THAT(Message(config.status()), HasSubstr("template"));
}

}  // namespace
}  // namespace knapserve
