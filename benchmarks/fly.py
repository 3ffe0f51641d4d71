"""FLy loose verification (`--verify fly`, LOSSY; issue 33 section 3): what it gains in
tau and speed and what it costs in fidelity, against greedy verification of the same
drafter, at temperature 0.

    python benchmarks/fly.py                  # the sweep below (about 6 min here)
    python benchmarks/fly.py --render-only    # docs/long_context.md's table from the JSON

For each prompt set (the first --prompts bundled demo prompts, and as many held-out ones
cut from benchmarks/data/study2/val.npy, 96 tokens each) the shipped eagle3 drafter at
G = 7 runs with greedy verification (lossless) and with FLy at several windows W and
entropy thresholds (each system decode.py's engine for its flags, built as a decoding
session); one autoregressive engine runs interleaved with them, prompt by prompt, so
speedups are ratios on the same machine state. Fidelity, against the
autoregressive (= the target's greedy) output of each prompt:
- prefix: tokens before the first difference (mean over prompts);
- agreement: the share of the reference's positions holding the same token;
- NLL: the target's own mean negative log-likelihood (nats per token) of the text each
  system generated, teacher-forced after the prompt; the lossless text's NLL beside it.

Results: benchmarks/results/fly.json and the `<!-- fly:results -->` section of
docs/long_context.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.lib import sessions  # noqa: E402
from benchmarks.lib.prompts import VAL_NPY as VAL  # noqa: E402
from benchmarks.lib.prompts import held_out_prompts  # noqa: E402
from benchmarks.lib.provenance import git_rev, stamp  # noqa: E402
from benchmarks.lib.report import save_results  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results", "fly.json")
DOC = os.path.join(ROOT, "docs", "long_context.md")
TARGET = os.path.join(ROOT, "checkpoints", "demo", "target")
EAGLE3 = os.path.join(ROOT, "checkpoints", "demo", "drafters", "eagle3")
# (label, window, entropy threshold); None = greedy verification (lossless)
SETTINGS = [("greedy", None, None), ("fly W=2", 2, 0.3), ("fly W=3", 3, 0.3),
            ("fly W=4", 4, 0.3), ("fly W=6", 6, 0.3), ("fly W=3, H>=1.0", 3, 1.0)]


def nll(model, prompt: list[int], output: list[int]) -> tuple[float, int]:
    """(sum of -log p_target(token | everything before it) over `output`, its length),
    teacher-forced in one cache-free forward."""
    import jax
    import jax.numpy as jnp

    if not output:
        return 0.0, 0
    ids = jnp.asarray([prompt + output], jnp.int32)
    pos = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
    logits = model(ids, pos, None).logits[0].astype(jnp.float32)  # [T,V]
    logp = jax.nn.log_softmax(logits[len(prompt) - 1:-1], axis=-1)
    tgt = jnp.asarray(output, jnp.int32)
    return float(-jnp.sum(jnp.take_along_axis(logp, tgt[:, None], axis=-1))), len(output)


def measure(n_prompts: int, new_tokens: int, log=print) -> dict:
    import jax
    import numpy as np

    from specjax.decoding.fly import agreement

    # every system is decode.py's: `--drafter EAGLE3 --gamma 7 --dtype float32` with
    # `--verify block` (greedy) or `--verify fly --fly-window W --fly-entropy H`, and
    # `--drafter none` for the reference
    def cfg(**kw):
        return sessions.config(target=TARGET, dtype="float32", max_new_tokens=new_tokens, **kw)

    ar_session = sessions.session(cfg(drafter="none"))
    bundled = [ids for _, ids in ar_session.read_prompts()[0][:n_prompts]]
    eos = ar_session.model_cfg.eos_token_ids
    sets = {"bundled": bundled, "held-out": [ids for _, ids in held_out_prompts(
        VAL, n_prompts, 96, eos=eos[0])]}
    everything = [p for ps in sets.values() for p in ps]  # one shape for both sets
    ar = ar_session.engines(sessions.as_pairs(everything)).main
    target = ar_session.target
    engines = {}
    for label, w, h in SETTINGS:
        rule = dict(verify="block") if w is None else dict(verify="fly", fly_window=w,
                                                           fly_entropy=h)
        engines[label] = sessions.engine(cfg(drafter=EAGLE3, gamma=7, **rule), everything)
    systems = {"AR": ar, **engines}
    sessions.compile_all(systems)
    sessions.warm_up(systems, [bundled[0]], new_tokens)
    rev = git_rev(ROOT)  # the code measured
    runs = []
    for set_name, prompts in sets.items():
        stats, outs = sessions.run_interleaved(systems, [[p] for p in prompts], new_tokens,
                                               [jax.random.key(i) for i in range(len(prompts))])
        ref_nll = [nll(target.model, p, o) for p, o in zip(prompts, outs["AR"], strict=True)]
        ref = sum(a for a, _ in ref_nll) / max(sum(n for _, n in ref_nll), 1)
        for label, w, h in SETTINGS:
            st = stats[label]
            agree = agreement(outs[label], outs["AR"])
            mine = [nll(target.model, p, o) for p, o in zip(prompts, outs[label], strict=True)]
            rec = {"prompts": set_name, "system": label, "window": w, "threshold": h,
                   "tau": st.tau, "alpha": st.alpha, "tokens_per_s": st.tokens_per_s,
                   "ar_tokens_per_s": stats["AR"].tokens_per_s,
                   "speedup": st.tokens_per_s / stats["AR"].tokens_per_s,
                   "prefix_tokens": agree["prefix_tokens"],
                   "token_agreement": agree["token_agreement"],
                   "identical_rows": agree["identical_rows"], "rows": len(prompts),
                   "nll": sum(a for a, _ in mine) / max(sum(n for _, n in mine), 1),
                   "nll_lossless": ref}
            runs.append(rec)
            log(f"[fly] {set_name} {label}: tau {st.tau:.2f} {rec['speedup']:.2f}x prefix "
                f"{rec['prefix_tokens']:.1f} agreement {rec['token_agreement']:.1%} NLL "
                f"{rec['nll']:.3f} (lossless {ref:.3f})")
    return {"runs": runs, "prompts": n_prompts, "new_tokens": new_tokens, "gamma": 7,
            **stamp(), "git": rev, "numpy": np.__version__,
            "weights": os.path.relpath(EAGLE3, ROOT)}


def render(res: dict) -> str:
    lines = [f"Measured on this CPU ({res['cores']} cores, git {res['git']}, {res['date']}; "
             f"weights {res['weights']}, G = {res['gamma']}; {res['prompts']} prompts per set "
             f"x {res['new_tokens']} new tokens, T = 0, batch 1, EOS on). Rows marked fly are "
             "LOSSY. prefix: tokens before the first difference from the target's greedy "
             "output (mean); agreement: share of its positions with the same token; NLL: the "
             "target's mean negative log-likelihood of the generated text (nats/token), the "
             "lossless text's in brackets.", "",
             "| prompts | system | tau | speedup | identical rows | prefix | agreement | "
             "NLL (lossless) |", "|" + "---|" * 8]
    for r in res["runs"]:
        lines.append(f"| {r['prompts']} | {r['system']} | {r['tau']:.2f} | "
                     f"{r['speedup']:.2f}x | {r['identical_rows']}/{r['rows']} | "
                     f"{r['prefix_tokens']:.1f} | {r['token_agreement']:.1%} | "
                     f"{r['nll']:.3f} ({r['nll_lossless']:.3f}) |")
    return "\n".join(lines) + "\n"


def write_doc(res: dict, doc: str = DOC) -> None:
    from benchmarks.lib.report import replace_doc_section

    replace_doc_section(doc, "fly:results", render(res))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--render-only", action="store_true")
    ap.add_argument("--json", default=RESULTS)
    args = ap.parse_args(argv)
    if args.render_only:
        write_doc(json.load(open(args.json)))
        return 0
    res = measure(args.prompts, args.new_tokens)
    save_results(args.json, res, RESULTS, write_doc)
    print(render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
