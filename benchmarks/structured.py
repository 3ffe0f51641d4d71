"""Structured output measured on the demo target (issue 55, docs/structured.md): for a few
realistic constraints, what the automaton costs to build and hold, and what decoding under
it costs and gains, each a decode.py session (`specjax.decoding.session`, the speculative
and the autoregressive run interleaved per batch in one process, as decode.py reports).

    python benchmarks/structured.py                    # writes the results and the doc's table
    python benchmarks/structured.py --prompts 4 --out /tmp/s.json   # a quick look
    python benchmarks/structured.py --render-only

Per constraint: the time to turn it into a regex (JSON schemas) and to compile the token
automaton from nothing (no cache: `compile_regex`), its states, token classes and table
bytes; then per system (drafter, temperature): speculative and autoregressive tokens/s
under the constraint, speedup, tau, whether greedy output equals AR, and how many outputs
completed their pattern; the same system without a constraint on the same prompts is the
"none" row. Results: benchmarks/results/structured.json and the
`<!-- structured:results -->` section of docs/structured.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.lib.provenance import git_rev  # noqa: E402
from benchmarks.lib.report import fmt, replace_doc_section, save_results  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results", "structured.json")
DOC = os.path.join(ROOT, "docs", "structured.md")

# name -> (what, regex or None, JSON schema or None)
CONSTRAINTS = {
    "anything": ("any non-empty text (regex): close to none's outputs, the mask's cost",
                 r"[\s\S]+", None),
    "statement": ("a function body's first statement (regex)",
                  r"( {4}| {8})(return|if|for|raise|with|self\.[a-z_]+ =) [^\n]+\n", None),
    "signature": ("a Python function signature (regex)",
                  r"def [a-z_][a-z0-9_]{0,30}\(([a-z_][a-z0-9_]{0,15}(, [a-z_][a-z0-9_]{0,15})"
                  r"{0,4})?\):", None),
    "record": ("a JSON record (schema)", None, {
        "type": "object", "properties": {
            "name": {"type": "string", "maxLength": 24},
            "line": {"type": "integer"},
            "kind": {"enum": ["function", "class", "method"]}},
        "required": ["name", "line", "kind"], "additionalProperties": False}),
    "tool_call": ("a tool call (schema)", None, {
        "type": "object", "properties": {
            "tool": {"enum": ["read_file", "search", "run_tests"]},
            "arguments": {"type": "object", "properties": {
                "path": {"type": "string", "maxLength": 40},
                "line": {"type": "integer"}},
                "required": ["path"], "additionalProperties": False}},
        "required": ["tool", "arguments"], "additionalProperties": False}),
}
# (label, drafter, temperature, verify)
SYSTEMS = (("eagle3 T=0", "eagle3", 0.0, "block"),
           ("block T=0", "block", 0.0, "block"),
           ("eagle3 T=1", "eagle3", 1.0, "block"))
DRAFTERS = os.path.join(ROOT, "checkpoints", "demo", "drafters")


def automaton_costs(name: str, target: str, eos, vocab_size: int) -> dict:
    from specjax.constraints import compile_regex, regex_from_json_schema

    _, regex, schema = CONSTRAINTS[name]
    t0 = time.perf_counter()
    if schema is not None:
        regex = regex_from_json_schema(schema)
    t1 = time.perf_counter()
    auto = compile_regex(regex, target, eos, vocab_size)
    t2 = time.perf_counter()
    return {"regex": regex, "schema_to_regex_s": round(t1 - t0, 4),
            "compile_s": round(t2 - t1, 4), "states": auto.num_states,
            "token_classes": auto.num_classes, "table_bytes": auto.table_bytes}


def decode(system, regex, n_prompts: int, new_tokens: int) -> dict:
    """One decode.py session of `system` on the first n bundled prompts (regex None:
    unconstrained) -> the summary's figures."""
    from specjax.decoding.options import DecodeConfig
    from specjax.decoding.session import build

    label, drafter, temp, verify = system
    cfg = DecodeConfig(drafter=os.path.join(DRAFTERS, drafter), gamma="fixed",
                       temperature=temp, verify=verify, max_new_tokens=new_tokens,
                       regex=regex, compare_ar=True)
    session = build(cfg)
    prompts, chat = session.read_prompts()
    prompts = prompts[:n_prompts]
    session.run(prompts[:1], chat)  # warm-up: compiles, first calls
    rep = session.run(prompts, chat)
    s = rep.summary
    return {"tokens_per_s": s["tokens_per_s"], "ar_tokens_per_s": s["ar_tokens_per_s"],
            "speedup": s["speedup"], "tau": s["tau"], "new_tokens": s["new_tokens"],
            "ar_identical": s.get("ar_identical"),
            "complete": None if regex is None else s["constraint"]["matched"],
            "prompts": len(prompts)}


def measure(n_prompts: int, new_tokens: int, only=None) -> dict:
    from specjax.decoding.loading import DEMO_TARGET
    from specjax.models.config import ModelConfig

    mc = ModelConfig.from_dir(DEMO_TARGET)
    eos = tuple(mc.eos_token_ids)
    names = [n for n in CONSTRAINTS if not only or n in only]
    out = {"git": git_rev(ROOT), "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "prompts": n_prompts, "max_new_tokens": new_tokens, "target": "checkpoints/demo/target",
           "vocab_size": mc.vocab_size, "automata": {}, "decode": []}
    for name in names:
        out["automata"][name] = automaton_costs(name, DEMO_TARGET, eos, mc.vocab_size)
        print(f"{name}: {out['automata'][name]}", file=sys.stderr)
    for system in SYSTEMS:
        for name in [None, *names]:
            regex = None if name is None else out["automata"][name]["regex"]
            row = {"system": system[0], "constraint": name or "none",
                   **decode(system, regex, n_prompts, new_tokens)}
            print(row, file=sys.stderr)
            out["decode"].append(row)
    return out


def render(res: dict) -> str:
    lines = [f"Measured {res['measured_at']} at git {res['git']} on the 2-core CPU, "
             f"{res['prompts']} bundled prompts, at most {res['max_new_tokens']} new tokens, "
             f"`--gamma fixed` (G = 7), the shipped demo drafters, float32; "
             "`python benchmarks/structured.py`.\n",
             "| constraint | regex from schema (s) | automaton compile (s) | states | "
             "token classes | table bytes |", "|---|---|---|---|---|---|"]
    for name, a in res["automata"].items():
        lines.append(f"| {name}: {CONSTRAINTS[name][0]} | {fmt(a['schema_to_regex_s'], '.3f')} "
                     f"| {fmt(a['compile_s'], '.3f')} | {a['states']} | {a['token_classes']} "
                     f"| {a['table_bytes']:,} |")
    lines += ["", "| system | constraint | tau | tok/s | AR tok/s | speedup | identical | "
              "complete | new tokens |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["decode"]:
        same = "-" if r["ar_identical"] is None else str(r["ar_identical"])
        done = "-" if r["complete"] is None else f"{r['complete']}/{r['prompts']}"
        lines.append(f"| {r['system']} | {r['constraint']} | {fmt(r['tau'], '.2f')} | "
                     f"{fmt(r['tokens_per_s'], '.1f')} | {fmt(r['ar_tokens_per_s'], '.1f')} | "
                     f"{fmt(r['speedup'], '.2f', 'x')} | {same} | {done} | {r['new_tokens']} |")
    return "\n".join(lines) + "\n"


def write_doc(res: dict, doc: str = DOC) -> None:
    replace_doc_section(doc, "structured:results", render(res))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--only", nargs="*", choices=sorted(CONSTRAINTS))
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--render-only", action="store_true")
    a = ap.parse_args(argv)
    if a.render_only:
        write_doc(json.load(open(a.out)))
        return 0
    res = measure(a.prompts, a.max_new_tokens, a.only)
    save_results(a.out, res, RESULTS, write_doc)
    print(render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
