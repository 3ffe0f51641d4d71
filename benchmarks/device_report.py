"""Markdown tables of device rounds (benchmarks/device_round.py results): a summary.md
beside the results and the marked section of docs/kernels.md that quotes them.

    python benchmarks/device_report.py benchmarks/results/device/h100-2026-11-26
    python benchmarks/device_report.py DIR --check     # exit 1 if a file is out of date

DIR holds round*.json (one per device call, in order) and notes.json: {"device": the
machine in words, "rounds": {"round1": {"command": ..., "code": ...}, ...}}. A later
round's step replaces an earlier round's step of the same name in the tables (the later
code); every round's steps stay in its JSON. The section of docs/kernels.md is
`<!-- device:NAME -->` ... `<!-- /device:NAME -->`, NAME = DIR's base name.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)  # uninstalled checkout

from specjax import cli  # noqa: E402
from specjax.errors import SpecjaxError  # noqa: E402

DOC = os.path.join("docs", "kernels.md")


def load(dirname: str) -> tuple[dict, dict, dict]:
    """(notes, {round: results}, {step: (round, record)} with later rounds winning)."""
    paths = sorted(glob.glob(os.path.join(dirname, "round*.json")),
                   key=lambda p: int(re.sub(r"\D", "", os.path.basename(p)) or 0))
    if not paths:
        raise SpecjaxError(f"{dirname}: no round*.json")
    try:
        with open(os.path.join(dirname, "notes.json")) as f:
            notes = json.load(f)
        rounds = {}
        for p in paths:
            with open(p) as f:
                rounds[os.path.splitext(os.path.basename(p))[0]] = json.load(f)
    except (OSError, ValueError) as e:
        raise SpecjaxError(f"cannot read {dirname}: {e}") from None
    steps = {}
    for name, r in rounds.items():
        for step, rec in r["steps"].items():
            if "skipped" not in rec:
                steps[step] = (name, rec)
    return notes, rounds, steps


def _f(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def render(dirname: str) -> str:
    notes, rounds, steps = load(dirname)
    env = steps["environment"][1]
    pk = env["packages"]
    out = [f"Device: {notes['device']} ({env['device_kind']}, {env.get('nvidia_smi', '')}); "
           f"jax {pk.get('jax')}, jaxlib {pk.get('jaxlib')}, "
           + ", ".join(f"{k} {v}" for k, v in pk.items()
                       if k.startswith("jax-cuda") or k in ("triton", "libtpu", "flax"))
           + f"; Python {env['python']}.", ""]
    for name, r in rounds.items():
        n = notes["rounds"].get(name, {})
        out.append(f"- {name} ({r['started'][:16]} UTC, {r['elapsed_s']:.0f} s): "
                   f"`{n.get('command', '?')}`; code: {n.get('code', '?')}.")
    if "bandwidth" in steps:
        b = steps["bandwidth"][1]
        out.append(f"- Copy bandwidth (y = x + 1 over {b['bytes'] / 2**30:.0f} GiB read and "
                   f"written): {b['measured_Bps'] / 1e12:.2f} TB/s, "
                   f"{b.get('fraction_of_vendor', 0):.0%} of the vendor figure "
                   f"({env['vendor_bandwidth_Bps'] / 1e12:.2f} TB/s); the roofline "
                   "fractions below divide by the vendor figure.")
    out += ["", "Checks against the jnp reference (largest error relative to the reference's "
            "largest magnitude; verification: identical verdicts):", "",
            "| kernel | round | cases | passed | worst |", "|---|---|---|---|---|"]
    for step, what in (("verify_check", "verify (greedy, token, block; probs, one-hot)"),
                       ("attention_check", "decode_attention (causal, block, split-S, "
                                           "layer-major)"),
                       ("packed_check", "packed_attention forward + backward")):
        if step not in steps:
            continue
        rnd, rec = steps[step]
        cases = rec.get("cases", [])
        if step == "attention_check":  # the modes this round checked (tree came later)
            modes = sorted({c["mode"] for c in cases if "mode" in c},
                           key=("causal", "block", "tree").index)
            what = f"decode_attention ({', '.join(modes + ['split-S', 'layer-major'])})"
        if "error" in rec:
            out.append(f"| {what} | {rnd} | - | error: {rec['error'][:80]} | - |")
            continue
        ok = sum(bool(c.get("identical", c.get("passed"))) for c in cases)
        errs = [max(c["rel_err"].values()) if isinstance(c.get("rel_err"), dict)
                else c.get("rel_err") for c in cases]
        errs = [e for e in errs if e is not None]
        worst = f"{max(errs):.1e}" if errs else "identical"
        out.append(f"| {what} | {rnd} | {len(cases)} | {ok}/{len(cases)} | {worst} |")
    for rnd, rec in ((n, r["steps"].get("packed_check", {})) for n, r in rounds.items()):
        if "error" in rec:
            out.append(f"\n{rnd}'s packed_check failed: `{rec['error'][:160]}` (fixed "
                       "since: see the later round).")
    if "verify_time" in steps:
        rnd, rec = steps["verify_time"]
        out += ["", f"Verification, Qwen3-8B vocabulary, f32 logits ({rnd}; ms per call):", "",
                "| B | G | rule | off (specjax.decoding.verify) | reference (jnp) | pallas "
                "| pallas vs off | pallas vs reference | roofline fraction |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in rec["rows"]:
            out.append(f"| {r['B']} | {r['G']} | {r['rule']} | {r['off_ms']:.3f} "
                       f"| {r['reference_ms']:.3f} | {r['pallas_ms']:.3f} "
                       f"| {r['off_ms'] / r['pallas_ms']:.2f}x "
                       f"| {r['reference_ms'] / r['pallas_ms']:.2f}x "
                       f"| {_f(r.get('pallas_roofline_fraction'))} |")
    if "attention_time" in steps:
        rnd, rec = steps["attention_time"]
        rows = rec["rows"]
        ps = sorted({int(k[len("pallas_p"):-3]) for r in rows for k in r
                     if re.fullmatch(r"pallas_p\d+_ms", k)})
        out += ["", f"decode_attention, one layer, Qwen3-8B heads, bf16 cache of S = "
                f"{rows[0]['S']} ({rnd}; ms per call; pallas pP = P splits of S):", "",
                "| B | T | context | reference | " + " | ".join(f"pallas p{p}" for p in ps)
                + " | default P | speedup vs reference | roofline fraction |",
                "|---|---|---|---|" + "---|" * len(ps) + "---|---|---|"]
        for r in rows:
            cells = " | ".join(_f(r.get(f"pallas_p{p}_ms"), ".3f") for p in ps)
            out.append(f"| {r['B']} | {r['T']} | {r['context']} | {r['reference_ms']:.3f} "
                       f"| {cells} | {r.get('default_num_splits', '-')} "
                       f"| {r['speedup_vs_reference']:.2f}x "
                       f"| {_f(r.get('pallas_roofline_fraction'))} |")
    if "packed_time" in steps:
        rnd, rec = steps["packed_time"]
        out += ["", f"packed_attention, causal, Qwen3-8B heads, bf16 ({rnd}; ms):", "",
                "| T | jnp fwd | pallas fwd | jnp fwd+bwd | pallas fwd+bwd | speedup fwd+bwd "
                "| roofline fraction |", "|---|---|---|---|---|---|---|"]
        for r in rec["rows"]:
            out.append(f"| {r['T']} | {r['jnp_fwd_ms']:.2f} | {r['pallas_fwd_ms']:.2f} "
                       f"| {r['jnp_fwd_bwd_ms']:.2f} | {r['pallas_fwd_bwd_ms']:.2f} "
                       f"| {r['speedup_fwd_bwd_vs_jnp']:.2f}x "
                       f"| {_f(r.get('pallas_roofline_fraction'))} |")
    if "decode_demo" in steps:
        rnd, rec = steps["decode_demo"]
        runs = rec.get("runs", {})
        out += ["", f"`decode.py` on the demo (first 16 bundled prompts, 128 new tokens, "
                f"default drafter; {rnd}): completions identical between "
                + " and ".join(f"`--kernels {k}`" for k in runs)
                + f": {rec.get('identical')}.", "",
                "| kernels | tokens/s | tau | AR tokens/s | speedup |", "|---|---|---|---|---|"]
        for k, v in runs.items():
            s = v.get("summary", {})
            out.append(f"| {k} | {_f(s.get('tokens_per_s'), '.0f')} | {_f(s.get('tau'))} "
                       f"| {_f(s.get('ar_tokens_per_s'), '.0f')} "
                       f"| {_f(s.get('speedup'), '.2f')}{'x' if s.get('speedup') else ''} |")
    big = [(n, r["steps"]["big_target"]) for n, r in rounds.items()
           if "rows" in r["steps"].get("big_target", {})]
    if big:
        out += ["", "Qwen3-8B-shaped target, random bf16 weights "
                f"({big[0][1]['param_bytes'] / 1e9:.1f} GB), greedy, 128-token prompts, 128 "
                "new tokens; roofline = (weights + KV) / vendor bandwidth per step; "
                "self-draft: the target drafting for itself (G = 4), overhead = its ms per "
                "step - 5 AR steps; self-draft == AR: the same completions (with random "
                "weights the logits are nearly tied, so bf16 rounding that differs between "
                "a 1-token and a 5-token forward can flip an argmax):", "",
                "| round | B | kernels | layer loop | AR tokens/s | AR ms/step | roofline "
                "fraction | self-draft ms/step | overhead ms/step | self-draft == AR |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for rnd, rec in big:
            for r in rec["rows"]:
                if "ar_ms_per_step" not in r:
                    continue
                out.append(f"| {rnd} | {r['B']} | {r['kernels']} "
                           f"| {r.get('layer_loop', 'scan')} | {r['ar_tokens_per_s']:.1f} "
                           f"| {r['ar_ms_per_step']:.2f} | {_f(r.get('ar_roofline_fraction'))} "
                           f"| {_f(r.get('self_draft_ms_per_step'))} "
                           f"| {_f(r.get('self_draft_overhead_ms_per_step'))} "
                           f"| {r.get('self_draft_identical_to_ar', '-')} |")
    return "\n".join(out) + "\n"


def render_doc(text: str, name: str, body: str) -> str:
    pat = re.compile(rf"^<!-- device:{re.escape(name)} -->\n.*?^<!-- /device:{re.escape(name)}"
                     rf" -->$", re.S | re.M)
    if len(pat.findall(text)) != 1:
        raise SpecjaxError(f"{DOC} needs one `<!-- device:{name} -->` ... "
                           f"`<!-- /device:{name} -->` section")
    return pat.sub(lambda m: f"<!-- device:{name} -->\n{body}<!-- /device:{name} -->", text)


def main(argv=None) -> int:
    ap = cli.ArgumentParser(prog="device_report.py", description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="benchmarks/results/device/NAME")
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 if summary.md or docs/kernels.md differ")
    ap.add_argument("--docs-root", default=ROOT, help="where docs/kernels.md is")
    args = ap.parse_args(argv)
    from specjax.fileio import atomic_write_all

    try:
        name = os.path.basename(os.path.normpath(args.dir))
        body = render(args.dir)
        doc_path = os.path.join(args.docs_root, DOC)
        with open(doc_path) as f:
            doc = f.read()
        new_doc = render_doc(doc, name, body)
        summary_path = os.path.join(args.dir, "summary.md")
        old_summary = open(summary_path).read() if os.path.exists(summary_path) else None
        if args.check:
            stale = [p for p, old, new in ((summary_path, old_summary, body),
                                           (doc_path, doc, new_doc)) if old != new]
            for p in stale:
                print(f"device_report.py: {p} is out of date", file=sys.stderr)
            return 1 if stale else 0
        atomic_write_all([(summary_path, lambda f: f.write(body.encode())),
                          (doc_path, lambda f: f.write(new_doc.encode()))])
    except (SpecjaxError, OSError, KeyError) as e:
        print(f"device_report.py: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {summary_path} and {doc_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
