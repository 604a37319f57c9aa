#!/usr/bin/python3
"""Renders chat templates with jinja2 the way Hugging Face transformers does.

The reference for tests/common/text/chat_template_test.cc: an independent
implementation (Debian's python3-jinja2) of what ChatTemplate
(common/text/chat_template.h, the engine in common/text/jinja/) renders. The
environment is transformers' (chat_template_utils.py, _compile_jinja_template):
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True) with the
loopcontrols extension and HF's {% generation %} block, the globals
raise_exception(msg) and strftime_now(fmt), and tojson replaced by
json.dumps(x, ensure_ascii=False, indent=..., separators=..., sort_keys=...).

Usage: render_chat_template.py CASES.json
CASES.json: {"templates": {"<name>": "<jinja source>", ...},
             "cases": [{"template": "<name>", "context": {...}}, ...]}
Prints a JSON list, one entry per case, in order:
  {"ok": true, "text": "<rendering>"} or
  {"ok": false, "error": "<str(exception)>", "type": "<exception class>"}.
Exits 1 (with a message on stderr) if the input cannot be read.
"""

import json
import sys
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class GenerationBlock(Extension):
    """transformers' AssistantTracker, less the tracking: renders the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        call = self.call_method("_render_body")
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


def make_environment():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None,
               sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: render_chat_template.py CASES.json")
    with open(sys.argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    env = make_environment()
    compiled = {}
    results = []
    for case in spec["cases"]:
        name = case["template"]
        try:
            if name not in compiled:
                compiled[name] = env.from_string(spec["templates"][name])
            text = compiled[name].render(**case["context"])
            results.append({"ok": True, "text": text})
        except Exception as e:  # Every failure is a result to compare.
            results.append({"ok": False, "error": str(e),
                            "type": type(e).__name__})
    json.dump(results, sys.stdout, ensure_ascii=True)


if __name__ == "__main__":
    main()
