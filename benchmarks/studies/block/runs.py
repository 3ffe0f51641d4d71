"""Shared by the block studies that compare drafter directories through decode.py
(confidence.py, soft_selector.py): each case is one `python decode.py --drafter DIR --show 0
...` run on the first N bundled prompts, its autoregressive reference interleaved batch by
batch in the same run (the speedup is a ratio within one run); its summary JSON is kept
with the command, wall time, load average and date."""

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
PROMPTS = "checkpoints/demo/prompts.jsonl"


def result_file(out: str, name: str) -> str:
    return os.path.join(ROOT, out, name.replace(" ", "_").replace("=", "") + ".json")


def measure(prog: str, cases: dict, out: str, names, n_prompts: int) -> None:
    """Runs each named case (name -> (drafter directory, extra decode.py flags)) and writes
    its summary to `result_file(out, name)`. Exits with one line if a drafter is missing
    or decode.py fails."""
    os.makedirs(os.path.join(ROOT, out), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="block-study-") as tmp:
        prompts = os.path.join(tmp, "prompts.jsonl")
        with open(os.path.join(ROOT, PROMPTS)) as src, open(prompts, "w") as dst:
            dst.writelines(src.readlines()[:n_prompts])
        for name in names:
            drafter, extra = cases[name]
            if not os.path.isdir(os.path.join(ROOT, drafter)):
                sys.exit(f"{prog}: {drafter} is missing: train it first (the module "
                         "docstring names the config)")
            summary = os.path.join(tmp, "s.json")
            cmd = [sys.executable, "decode.py", "--drafter", drafter, "--show", "0",
                   "--prompts", prompts, "--summary", summary, *extra]
            t0 = time.monotonic()
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"{prog}: {name}: decode.py exit {proc.returncode}: "
                         + (proc.stderr.strip().splitlines() or ["?"])[-1])
            with open(summary) as f:
                rec = json.load(f)
            rec["case"] = {"name": name, "command": " ".join(
                ["python", "decode.py", "--drafter", drafter, "--show", "0",
                 "--prompts", f"FIRST_{n_prompts}", *extra]),
                "wall_s": round(time.monotonic() - t0, 1),
                "load_average": round(os.getloadavg()[0], 2),
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
            with open(result_file(out, name), "w") as f:
                json.dump(rec, f, indent=1)
            print(f"{name}: {rec['speedup']:.2f}x, tau {rec['tau']:.3f}", flush=True)


def report(cases: dict, out: str, title: str, command: str) -> str:
    """The Markdown table of the cases measured so far, written to out/README.md."""
    rows = ["| case | gamma | tau | tokens/s | AR tokens/s | speedup | mean verify length "
            "| identical to AR |", "|---|---|---|---|---|---|---|---|"]
    dates = set()
    for name in cases:
        if not os.path.exists(result_file(out, name)):
            continue
        r = json.load(open(result_file(out, name)))
        sched = r.get("gamma_schedule") or {}
        mean = sched.get("mean_draft_length")
        same = r.get("ar_identical")
        rows.append(f"| {name} | {'auto' if sched else r['gamma']} | {r['tau']:.3f} | "
                    f"{r['tokens_per_s']:.1f} | {r['ar_tokens_per_s']:.1f} | "
                    f"{r['speedup']:.2f}x | {'-' if mean is None else f'{mean:.2f}'} | "
                    f"{'-' if same is None else 'yes' if same else 'NO'} |")
        dates.add(r["case"]["date"][:10])
    text = (f"# {title}\n\n`{command}` (each row one decode.py run, its AR reference "
            f"interleaved; {', '.join(sorted(dates))}, 2-core CPU):\n\n"
            + "\n".join(rows) + "\n")
    with open(os.path.join(ROOT, out, "README.md"), "w") as f:
        f.write(text)
    return text


def main(argv, doc: str, prog: str, cases: dict, out: str, title: str,
         default_prompts: int, before_measure=None) -> int:
    """The command line of a study script: measure the chosen cases (all by default) on
    the first N bundled prompts, then print and write the table; --report only renders
    it. before_measure(): run once before any decode (e.g. to prepare drafter dirs)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=default_prompts,
                    help="the first N bundled prompts")
    ap.add_argument("--only", nargs="+", choices=list(cases), metavar="NAME")
    ap.add_argument("--report", action="store_true", help="the table from the JSON only")
    args = ap.parse_args(argv)
    if not args.report:
        if before_measure is not None:
            before_measure()
        measure(prog, cases, out, args.only or list(cases), args.prompts)
    print(report(cases, out, title, f"python benchmarks/studies/block/{prog}"))
    return 0
