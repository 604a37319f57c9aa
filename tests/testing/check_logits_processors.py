#!/usr/bin/env python3
"""An independent check of knapserve's logits processors under greedy decoding.

`knapserve generate --temperature 0 --dump-logits FILE` writes the full
model's raw logits at every generated position, with the prompt and output
ids. This script recomputes, from those raw logits and the history alone, what
the processors must make of each position (logit_bias, bad_words, min_tokens,
repetition_penalty, then frequency_penalty and presence_penalty: vLLM's order,
the definitions of executor/engine/logits_processors.h) and the greedy choice,
and asserts that it is the id knapserve generated. It is written from the
definitions, not from the C++ code, in plain Python (no numpy): float32
arithmetic is emulated by rounding every result to float32 with struct, so
the comparison is exact, ties included (the lowest id wins).

  check_logits_processors.py DUMP.json [--repetition-penalty R]
      [--presence-penalty P] [--frequency-penalty F] [--logit-bias ID:BIAS,...]
      [--min-tokens N] [--bad-words "ID ID,ID"] [--ignore-eos]

The processor flags take the values given to `knapserve generate` (the dump
holds only logits, ids and the model's EOS ids, never the settings), so a
flag knapserve misread shows as a mismatch. Exit 0 with a JSON summary on
stdout ({"positions", "changed"}: positions checked, and positions where the
processors changed the choice); exit 1 naming the first mismatch.
"""

import argparse
import json
import struct
import sys


def f32(x):
    """x rounded to the nearest float32 (as a Python float)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def parse_bias(text):
    bias = {}
    for item in filter(None, text.split(",")):
        token, value = item.split(":")
        bias[int(token)] = float(value)
    return bias


def parse_bad_words(text):
    return [[int(t) for t in word.split()] for word in text.split(",") if word.strip()]


def process(raw, prompt, history, args, end_ids):
    """The processed logits of the position after `history` (generated ids)."""
    logits = list(raw)
    vocab = len(logits)
    # 1. logit_bias
    for token, bias in args.logit_bias.items():
        logits[token] = f32(logits[token] + f32(bias))
    # 2. bad_words, 3. min_tokens: bans, unless they would ban everything.
    banned = set()
    for word in args.bad_words:
        prefix = word[:-1]
        if len(prefix) > len(history):
            continue
        if not prefix or history[len(history) - len(prefix):] == prefix:
            banned.add(word[-1])
    if len(history) < args.min_tokens:
        banned.update(end_ids)
    banned = {t for t in banned if 0 <= t < vocab}
    if len(banned) < vocab:
        for token in banned:
            logits[token] = float("-inf")
    # 4. repetition_penalty over prompt and generated ids; 5. frequency and
    # presence over generated ids.
    counts = {}
    for token in history:
        counts[token] = counts.get(token, 0) + 1
    r = f32(args.repetition_penalty)
    seen = set(counts)
    if r != 1.0:
        seen.update(prompt)
    for token in seen:
        value = logits[token]
        if r != 1.0:
            value = f32(value / r) if value > 0 else f32(value * r)
        count = counts.get(token, 0)
        if count > 0:
            value = f32(value - f32(args.frequency_penalty * count + args.presence_penalty))
        logits[token] = value
    return logits


def argmax(values):
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dump")
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--logit-bias", type=parse_bias, default={})
    parser.add_argument("--min-tokens", type=int, default=0)
    parser.add_argument("--bad-words", type=parse_bad_words, default=[])
    parser.add_argument("--ignore-eos", action="store_true")
    args = parser.parse_args()
    with open(args.dump) as f:
        dump = json.load(f)
    prompt = dump["prompt_ids"]
    output = dump["output_ids"]
    rows = dump["logits"]
    if len(rows) != len(output) or not output:
        print(f"{len(rows)} logit rows for {len(output)} output ids", file=sys.stderr)
        return 1
    end_ids = [] if args.ignore_eos else list(dump["eos_token_ids"])
    changed = 0
    for i, (raw, chosen) in enumerate(zip(rows, output)):
        raw = [f32(v) for v in raw]
        want = argmax(process(raw, prompt, output[:i], args, end_ids))
        if want != chosen:
            print(f"position {i}: knapserve chose {chosen}, the processed "
                  f"logits' argmax is {want} (raw argmax {argmax(raw)})",
                  file=sys.stderr)
            return 1
        changed += want != argmax(raw)
    print(json.dumps({"positions": len(output), "changed": changed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
