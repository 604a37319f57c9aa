#!/usr/bin/env python3
"""Prints the README's 16-row speculation table from tools/spec_table.sh's
JSON files (one `bench spec --json` per model, dtype and plan cache), then
the three criteria of the table: every mode at least 0.97x of off, the best
planned or routed mode at least the static mask, knapspec's calibrated
prediction within 10% of what its plans measured.

Best against static: where both decode plainly (the guard holds static's mask
plain at 1000 tokens, the plans choose gamma 0) the two cells are the same
computation and differ by noise alone. A row's noise is the largest gap of
its off runs against each other (off against off, the same row, the same
pairing as the modes); a best mode below static by less than that is a tie.
The strict count is printed beside it.

    tools/spec_table.py DIR
"""
import json
import os
import sys

MODES = ["static", "clasp", "knapspec", "knn", "specbound"]
SETS = [("spec_bench", "short"), ("long_context", "1k")]


def cell(mode):
    if mode is None:
        return "-"
    m = mode["paired_speedup"]["median"]
    text = "%.2fx" % m
    return "**%s**" % text if m < 0.97 else text


def prediction(p):
    if p.get("steps", 0) == 0:
        return "no plan measured", None
    pred, meas = p["calibrated_tpt"], p["calibrated_measured_tpt"]
    se = p.get("calibrated_measured_standard_error", 0)
    err = pred / meas - 1 if meas > 0 else float("nan")
    prof_err = p["predicted_tpt"] / p["measured_tpt"] - 1
    text = "%.0f / %.0f ±%.0f%% (%+.0f%%) (%.0f, %+.0f%%)" % (
        pred, meas, 100 * se / meas if meas else 0, 100 * err,
        p["predicted_tpt"], 100 * prof_err)
    return text, err


def main(folder):
    rows, misses = [], {"cells": [], "static": [], "pred": []}
    errors, draft_errors, cells, strict_misses = [], [], 0, 0
    for model in ["stories-24l", "stories-24l-skip"]:
        for dtype in ["fp32", "bf16"]:
            for key, label in SETS:
                for cache in ["cold", "warm"]:
                    path = os.path.join(folder, "%s_%s_%s.json" %
                                        (model, dtype, cache))
                    try:
                        with open(path) as f:
                            s = json.load(f)["sets"][key]
                    except (OSError, ValueError, KeyError):
                        continue  # not run, or still running
                    modes = s["modes"]
                    name = "%s %s | %s | %s" % (model, dtype, label, cache)
                    oo = s.get("off_against_off", {})
                    ks = modes["knapspec"]
                    text, err = prediction(ks["prediction"])
                    p = ks["prediction"]
                    lossless = all(m.get("same_ids", True)
                                   for m in modes.values())
                    rows.append("| %s | %.0f | %.2f-%.2f | %s | %s | %.2f / "
                                "%.2f | %s |" % (
                                    name, modes["off"]["decode_tokens_per_s"],
                                    oo.get("min", 0), oo.get("max", 0),
                                    " | ".join(cell(modes.get(m)) for m in MODES),
                                    text,
                                    p.get("predicted_tokens_per_step", 0),
                                    p.get("measured_tokens_per_step", 0),
                                    "yes" if lossless else "**NO**"))
                    for m in MODES:
                        if m not in modes:
                            continue
                        cells += 1
                        if modes[m]["paired_speedup"]["median"] < 0.97:
                            misses["cells"].append("%s: %s %.3f" % (
                                name, m, modes[m]["paired_speedup"]["median"]))
                    best = max(modes[m]["paired_speedup"]["median"]
                               for m in ["clasp", "knapspec", "knn"]
                               if m in modes)
                    static = modes["static"]["paired_speedup"]["median"]
                    # Two identical plain runs of the row differ by up to
                    # `noise` (off against off): a gap below it is a tie.
                    noise = max(1 - oo.get("min", 1), oo.get("max", 1) - 1, 0)
                    if best < static:
                        strict_misses += 1
                    if best < static - noise:
                        misses["static"].append(
                            "%s: static %.3f, best %.3f, off against off "
                            "%.3f-%.3f" % (name, static, best,
                                           oo.get("min", 0), oo.get("max", 0)))
                    if err is not None:
                        errors.append(abs(err))
                        if abs(err) > 0.10:
                            misses["pred"].append("%s: %+.1f%%" %
                                                  (name, 100 * err))
                        dm = p.get("draft_calibrated_measured_tpt", 0)
                        if dm > 0:
                            draft_errors.append(
                                abs(p["draft_calibrated_tpt"] / dm - 1))
    print("| model, dtype | set | cache | off tok/s | off against off | " +
          " | ".join(MODES) + " | knapspec pred / meas, calibrated "
          "(profile) | tokens a step | lossless |")
    print("| --- " * 13 + "|")
    print("\n".join(rows))
    n = len(rows)
    print("\ncells at 0.97x or better: %d of %d" %
          (cells - len(misses["cells"]), cells))
    print("best planned or routed mode at least static: %d of %d (within the "
          "row's off-against-off noise; %d of %d strictly)" %
          (n - len(misses["static"]), n, n - strict_misses, n))
    print("calibrated prediction within 10%%: %d of %d measured (mean |error| "
          "%.1f%%; calibrated by drafting steps' cost instead: %d of %d "
          "within 10%%, mean %.1f%%)" %
          (len(errors) - len(misses["pred"]), len(errors),
           100 * sum(errors) / max(len(errors), 1),
           sum(1 for e in draft_errors if e <= 0.10), len(draft_errors),
           100 * sum(draft_errors) / max(len(draft_errors), 1)))
    for kind, items in misses.items():
        for item in items:
            print("  miss (%s) %s" % (kind, item))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "spec_table")
