"""The draft window (`--draft-window W`, issue 33 section 4): tau, draft milliseconds and
speed of the shipped learned drafters against context length, with and without a window.

    python benchmarks/draft_window.py                 # the sweep below (about 15 min here)
    python benchmarks/draft_window.py --quick         # one drafter, one context, 2 windows
    python benchmarks/draft_window.py --render-only   # docs/long_context.md's table

For each context length L (prompts of L tokens cut from held-out real text: the standard
library's validation split, as benchmarks/context_length.py) one autoregressive engine
and, per drafter and window W, one speculative engine (decode.py's, built as a decoding
session: fixed G, T = 0, batch 1, EOS off) decode the same prompts, interleaved prompt by
prompt, so a speedup is a ratio measured on the same machine state. Draft and verify
milliseconds come from `Engine.step_timing` on the first prompt (one step's parts compiled
and timed outside the loop: an estimate).
Outputs must equal the autoregressive ones (the target verifies every draft; recorded).
The demo target has 2,048 positions, so L + new tokens stays below that.

Results: benchmarks/results/draft_window.json and the `<!-- draft_window:results -->`
section of docs/long_context.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.lib import sessions  # noqa: E402
from benchmarks.lib.prompts import DEMO_TOKENIZER, text_ids  # noqa: E402
from benchmarks.lib.provenance import git_rev, stamp  # noqa: E402
from benchmarks.lib.report import save_results  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results", "draft_window.json")
DOC = os.path.join(ROOT, "docs", "long_context.md")
TARGET = os.path.join(ROOT, "checkpoints", "demo", "target")
DRAFTERS = {name: os.path.join(ROOT, "checkpoints", "demo", "drafters", name)
            for name in ("eagle3", "kv1", "block")}


def _window_label(w):
    return "all" if w is None else str(w)


def measure(drafters, contexts, windows, n_prompts: int, new_tokens: int, log=print) -> dict:
    import jax

    ids = text_ids(DEMO_TOKENIZER, n_prompts * max(contexts))
    rev = git_rev(ROOT)  # the code measured
    runs = []
    for L in contexts:
        prompts = [ids[i * L:(i + 1) * L] for i in range(n_prompts)]
        # decode.py's engines: `--drafter DIR --gamma fixed [--draft-window W] --ignore-eos
        # --dtype float32`, and `--drafter none` for the reference
        common = dict(target=TARGET, dtype="float32", ignore_eos=True,
                      max_new_tokens=new_tokens)
        ar = sessions.engine(sessions.config(drafter="none", **common), prompts)
        ar.compile()
        engines = {}
        for name in drafters:
            for w in windows:
                eng = sessions.engine(sessions.config(drafter=DRAFTERS[name], gamma="fixed",
                                                      draft_window=w, **common), prompts)
                t0 = time.perf_counter()
                eng.compile()
                engines[name, w] = (eng, eng.gamma, time.perf_counter() - t0)
        systems = {"AR": ar, **{k: v[0] for k, v in engines.items()}}
        sessions.warm_up(systems, [prompts[0]], new_tokens)  # first calls are slow
        stats, outs = sessions.run_interleaved(systems, [[p] for p in prompts], new_tokens,
                                               [jax.random.key(i) for i in range(len(prompts))])
        ar_tps = stats["AR"].tokens_per_s
        for (name, w), (eng, G, compile_s) in engines.items():
            st = stats[name, w]
            timing = eng.step_timing([prompts[0]], new_tokens, jax.random.key(0))
            rec = {"drafter": name, "context": L, "window": w, "gamma": G,
                   "tau": st.tau, "alpha": st.alpha, "tokens_per_s": st.tokens_per_s,
                   "ar_tokens_per_s": ar_tps, "speedup": st.tokens_per_s / ar_tps,
                   "identical": outs[name, w] == outs["AR"], "compile_s": compile_s,
                   **timing}
            runs.append(rec)
            log(f"[draft_window] L={L} {name} W={_window_label(w)}: tau {st.tau:.2f} "
                f"{rec['speedup']:.2f}x draft {timing['draft_ms']:.2f} ms "
                f"identical {rec['identical']}")
        del engines, systems
    return {"runs": runs, "prompts": n_prompts, "new_tokens": new_tokens, **stamp(),
            "git": rev, "weights": [os.path.relpath(DRAFTERS[d], ROOT) for d in drafters]}


def render(res: dict) -> str:
    lines = [f"Measured on this CPU ({res['cores']} cores, git {res['git']}, {res['date']}; "
             f"weights {', '.join(res['weights'])}; {res['prompts']} prompts per context "
             f"length x {res['new_tokens']} new tokens, T = 0, batch 1, fixed G, EOS off). "
             "Draft / verify ms: one step's parts timed outside the loop on the first prompt "
             "(`Engine.step_timing`).", "",
             "| drafter | context L | window W | tau | alpha_0..alpha_6 | speedup | "
             "draft ms | verify ms | identical |", "|" + "---|" * 9]
    for r in res["runs"]:
        al = " ".join("-" if a is None else f"{a:.2f}" for a in r["alpha"])
        lines.append(f"| {r['drafter']} | {r['context']} | {_window_label(r['window'])} | "
                     f"{r['tau']:.2f} | {al} | {r['speedup']:.2f}x | {r['draft_ms']:.2f} | "
                     f"{r['verify_ms']:.2f} | {'yes' if r['identical'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def write_doc(res: dict, doc: str = DOC) -> None:
    from benchmarks.lib.report import replace_doc_section

    replace_doc_section(doc, "draft_window:results", render(res))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafters", nargs="+", default=list(DRAFTERS), choices=list(DRAFTERS))
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 1920])
    ap.add_argument("--windows", nargs="+", default=["all", "256", "64", "16"],
                    help="window sizes; 'all' = no window")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--render-only", action="store_true")
    ap.add_argument("--json", default=RESULTS)
    args = ap.parse_args(argv)
    if args.render_only:
        write_doc(json.load(open(args.json)))
        return 0
    if args.quick:
        args.drafters, args.contexts, args.windows = ["eagle3"], [128], ["all", "16"]
        args.prompts, args.new_tokens = 1, 16
    windows = [None if w == "all" else int(w) for w in args.windows]
    res = measure(args.drafters, args.contexts, windows, args.prompts, args.new_tokens)
    save_results(args.json, res, RESULTS, write_doc)
    print(render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
