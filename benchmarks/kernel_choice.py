"""What "auto" should choose on each backend, derived from the committed device rounds.

    python benchmarks/kernel_choice.py            # the evidence and the choices
    python benchmarks/kernel_choice.py --check    # exit 1 if specjax/backend_choices.py
                                                  # disagrees with a measured backend

Reads every round under benchmarks/results/device/*/ (device_round.py's round*.json and
big_round.py's big_round*.json), groups them by backend, and per choice takes the
geometric mean of paired speed ratios (same batch, same other settings, same round):

  layer_loop  AR ms per step, scan / unroll (big_target and ar rows): > 1 -> "unroll"
  attention   the loop's own evidence first: AR ms per step, jnp / kernel ("reference" or
              "off" against "pallas" or "attention", same B and layer loop); without
              any, decode_attention's standalone calls (attention_time,
              speedup_vs_reference): > 1 -> "pallas"
  verify      the loop's own evidence first: decode_demo's tokens/s with "pallas" against
              "attention" (they differ in verification only); without it the standalone
              calls (verify_time, speedup_vs_off): > 1 -> "fused"

A choice with no pair on a backend keeps the table's stated reason.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)

from specjax.backend_choices import CHOICES  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results", "device")
JNP, KERNEL = ("reference", "off"), ("pallas", "attention")


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def _ar_rows(steps: dict) -> list[dict]:
    """(B, kernels, layer_loop, ms) of every AR measurement in a round."""
    out = []
    for r in (steps.get("big_target") or {}).get("rows", []):
        if "ar_ms_per_step" in r:
            out.append({"B": r["B"], "kernels": r["kernels"],
                        "layer_loop": r.get("layer_loop", "scan"), "ms": r["ar_ms_per_step"]})
    for r in (steps.get("ar") or {}).get("rows", []):
        if "ms_per_step" in r:
            out.append({"B": r["B"], "kernels": r["kernels"], "layer_loop": r["layer_loop"],
                        "ms": r["ms_per_step"]})
    return out


def evidence(results_dir: str = RESULTS) -> dict:
    """{backend: {choice: [(ratio, where), ...]}} and the standalone ratios, from the
    rounds under results_dir."""
    ev: dict = {}
    files = sorted(glob.glob(os.path.join(results_dir, "*", "round*.json"))
                   + glob.glob(os.path.join(results_dir, "*", "big_round*.json")))
    for f in files:
        with open(f) as fh:
            steps = json.load(fh)["steps"]
        backend = (steps.get("environment") or {}).get("backend")
        if backend is None:
            continue
        where = os.path.relpath(f, ROOT)
        e = ev.setdefault(backend, {k: [] for k in ("layer_loop", "attention",
                                                    "attention_calls", "verify",
                                                    "verify_calls")})
        ar = _ar_rows(steps)
        for a in ar:
            for b in ar:
                same_b = a["B"] == b["B"]
                if (same_b and a["kernels"] == b["kernels"] and a["layer_loop"] == "scan"
                        and b["layer_loop"] == "unroll"):
                    e["layer_loop"].append((a["ms"] / b["ms"], where))
                if (same_b and a["layer_loop"] == b["layer_loop"] and a["kernels"] in JNP
                        and b["kernels"] in KERNEL):
                    e["attention"].append((a["ms"] / b["ms"], where))
        for r in (steps.get("attention_time") or {}).get("rows", []):
            if r.get("speedup_vs_reference"):
                e["attention_calls"].append((r["speedup_vs_reference"], where))
        for r in (steps.get("verify_time") or {}).get("rows", []):
            if r.get("speedup_vs_off"):
                e["verify_calls"].append((r["speedup_vs_off"], where))
        runs = (steps.get("decode_demo") or {}).get("runs") or {}
        tps = {k: (v.get("summary") or {}).get("tokens_per_s") for k, v in runs.items()}
        if tps.get("pallas") and tps.get("attention"):
            e["verify"].append((tps["pallas"] / tps["attention"], where))
    return ev


def derive(ev: dict) -> dict:
    """{backend: {choice: (value, geometric mean ratio, pairs, source)}} for the choices
    with evidence."""
    out = {}
    for backend, e in ev.items():
        got = {}
        if e["layer_loop"]:
            g = _geomean([r for r, _ in e["layer_loop"]])
            got["layer_loop"] = ("unroll" if g > 1 else "scan", g, len(e["layer_loop"]), "loop")
        for name, yes, no in (("attention", "pallas", "jnp"), ("verify", "fused", "unfused")):
            pairs, source = e[name], "loop"
            if not pairs:
                pairs, source = e[name + "_calls"], "calls"
            if pairs:
                g = _geomean([r for r, _ in pairs])
                got[name] = (yes if g > 1 else no, g, len(pairs), source)
        out[backend] = got
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if specjax/backend_choices.py disagrees")
    ap.add_argument("--results", default=RESULTS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    derived = derive(evidence(args.results))
    bad = []
    for backend, got in sorted(derived.items()):
        table = CHOICES.get(backend)
        for name, (value, g, n, source) in got.items():
            print(f"{backend} {name}: {value} (geometric mean ratio {g:.2f} over {n} "
                  f"{'in-loop pairs' if source == 'loop' else 'standalone calls'})")
            if table is None or table.get(name) != value or not table.get("measured"):
                bad.append(f"{backend} {name}: measured {value}, the table says "
                           f"{None if table is None else table.get(name)}"
                           f"{'' if table and table.get('measured') else ' (unmeasured)'}")
    for backend, entry in sorted(CHOICES.items()):
        if entry.get("measured") and backend not in derived:
            bad.append(f"{backend}: the table says measured, but no round is for {backend}")
    if args.check and bad:
        for b in bad:
            print(f"kernel_choice: {b}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
