"""Verification scheduled by a trained confidence head (issue 52): the block drafter of
configs/drafters/block_cpu.yaml without and with DSpark's confidence head
(configs/drafters/block_cpu_confidence.yaml), each under --gamma fixed and decode.py's
default --gamma auto (which, for a drafter with a confidence head, picks each step's verify
length from its confidence: docs/adaptive.md, "Verify lengths from the drafter's
confidence"; without one, from the cost table and the running acceptance estimates).

    python benchmarks/studies/block/confidence.py [--prompts N] [--only NAME ...]
    python benchmarks/studies/block/confidence.py --report

Each case is one `python decode.py --drafter DIR --show 0 [--gamma fixed]` run on the first
N bundled prompts (128 new tokens, T = 0, batch 1), its autoregressive reference
interleaved batch by batch in the same run (the speedup is a ratio within one run).
Summaries: benchmarks/results/studies/block/confidence/NAME.json; the table:
benchmarks/results/studies/block/confidence/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
OUT = "benchmarks/results/studies/block/confidence"
PROMPTS = "checkpoints/demo/prompts.jsonl"

# name -> (drafter directory, extra decode.py flags)
CASES = {
    "plain fixed": ("runs/block_cpu/drafter", ["--gamma", "fixed"]),
    "plain auto": ("runs/block_cpu/drafter", []),
    "confidence fixed": ("runs/block_cpu_confidence/drafter", ["--gamma", "fixed"]),
    "confidence auto": ("runs/block_cpu_confidence/drafter", []),
}


def _file(name: str) -> str:
    return os.path.join(ROOT, OUT, name.replace(" ", "_") + ".json")


def measure(names, n_prompts: int) -> None:
    os.makedirs(os.path.join(ROOT, OUT), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="confidence-") as tmp:
        prompts = os.path.join(tmp, "prompts.jsonl")
        with open(os.path.join(ROOT, PROMPTS)) as src, open(prompts, "w") as dst:
            dst.writelines(src.readlines()[:n_prompts])
        for name in names:
            drafter, extra = CASES[name]
            if not os.path.isdir(os.path.join(ROOT, drafter)):
                sys.exit(f"confidence.py: {drafter} is missing: train it first "
                         "(configs/drafters/block_cpu*.yaml)")
            summary = os.path.join(tmp, "s.json")
            cmd = [sys.executable, "decode.py", "--drafter", drafter, "--show", "0",
                   "--prompts", prompts, "--summary", summary, *extra]
            t0 = time.monotonic()
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"confidence.py: {name}: decode.py exit {proc.returncode}: "
                         + (proc.stderr.strip().splitlines() or ["?"])[-1])
            with open(summary) as f:
                rec = json.load(f)
            rec["case"] = {"name": name, "command": " ".join(
                ["python", "decode.py", "--drafter", drafter, "--show", "0",
                 "--prompts", f"FIRST_{n_prompts}", *extra]),
                "wall_s": round(time.monotonic() - t0, 1),
                "load_average": round(os.getloadavg()[0], 2),
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
            with open(_file(name), "w") as f:
                json.dump(rec, f, indent=1)
            print(f"{name}: {rec['speedup']:.2f}x, tau {rec['tau']:.3f}", flush=True)


def report() -> str:
    rows = ["| case | gamma | tau | tokens/s | AR tokens/s | speedup | mean verify length "
            "| identical to AR |", "|---|---|---|---|---|---|---|---|"]
    dates = set()
    for name in CASES:
        if not os.path.exists(_file(name)):
            continue
        r = json.load(open(_file(name)))
        sched = r.get("gamma_schedule") or {}
        mean = sched.get("mean_draft_length")
        rows.append(f"| {name} | {'auto' if sched else r['gamma']} | {r['tau']:.3f} | "
                    f"{r['tokens_per_s']:.1f} | {r['ar_tokens_per_s']:.1f} | "
                    f"{r['speedup']:.2f}x | {'-' if mean is None else f'{mean:.2f}'} | "
                    f"{'yes' if r.get('ar_identical') else 'NO'} |")
        dates.add(r["case"]["date"][:10])
    text = ("# Verification scheduled by a trained confidence head\n\n"
            "`python benchmarks/studies/block/confidence.py` (each row one decode.py run, "
            f"its AR reference interleaved; {', '.join(sorted(dates))}, 2-core CPU):\n\n"
            + "\n".join(rows) + "\n")
    with open(os.path.join(ROOT, OUT, "README.md"), "w") as f:
        f.write(text)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16, help="the first N bundled prompts")
    ap.add_argument("--only", nargs="+", choices=list(CASES), metavar="NAME")
    ap.add_argument("--report", action="store_true", help="the table from the JSON only")
    args = ap.parse_args(argv)
    if not args.report:
        measure(args.only or list(CASES), args.prompts)
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
