"""The exact mode's cost and identity on this machine: decode.py on the bundled demo with a
bf16 target, with and without --exact (and the f32 default beside them).

    python benchmarks/exact_mode.py            # -> benchmarks/results/exact_mode.json

Each run is one `python decode.py --max-new-tokens 64 --gamma 7 --summary ...` (the
bundled prompts and eagle3 drafter, its autoregressive comparison interleaved), in the
order f32, bf16, bf16 --exact; the table gives each run's speculative and autoregressive
tokens/s, tau, the speedup and whether the outputs equal autoregressive decoding's.
Machines are noisy: compare runs of one invocation.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)  # uninstalled checkout

from benchmarks.lib.report import write_json  # noqa: E402

OUT = os.path.join(ROOT, "benchmarks", "results", "exact_mode.json")
BASE = ["--max-new-tokens", "64", "--gamma", "7", "--show", "0"]
RUNS = {"float32": ["--dtype", "float32"], "bfloat16": ["--dtype", "bfloat16"],
        "bfloat16 --exact": ["--dtype", "bfloat16", "--exact"]}
FIELDS = ("tokens_per_s", "ar_tokens_per_s", "speedup", "tau", "ar_identical",
          "ar_identity", "new_tokens")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=OUT, help="results JSON (default: %(default)s)")
    ap.add_argument("--max-new-tokens", default="64", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    base = list(BASE)
    base[1] = args.max_new_tokens
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in RUNS.items():
            path = os.path.join(tmp, "s.json")
            cmd = [sys.executable, os.path.join(ROOT, "decode.py"), *base, *flags,
                   "--summary", path]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                print(f"exact_mode: {name} failed: {p.stderr.strip()[-500:]}", file=sys.stderr)
                return 1
            with open(path) as f:
                s = json.load(f)
            rows[name] = {k: s.get(k) for k in FIELDS}
            rows[name]["flags"] = " ".join(base + flags)
            print(f"{name:18s} {s['tokens_per_s']:7.1f} tok/s  AR {s['ar_tokens_per_s']:6.1f}"
                  f"  {s['speedup']:.2f}x  tau {s['tau']:.2f}  identical to AR "
                  f"{s['ar_identical']} ({s['ar_identity']})", flush=True)
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    result = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python "
                         f"{platform.python_version()}", "commit": commit,
              "command": "python benchmarks/exact_mode.py", "runs": rows}
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
