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


def synthetic_tokenizer(path: str, vocab_size: int = 151_936, seed: int = 0) -> int:
    """Writes a byte-level BPE tokenizer.json of `vocab_size` ids to `path` (the 256 bytes,
    then distinct random strings of 2-12 ASCII code characters, the last id an
    end-of-sequence special token): Qwen3's vocabulary size without its tokenizer, which
    this machine cannot download. Returns the end-of-sequence id."""
    import random

    from transformers.convert_slow_tokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    rng = random.Random(seed)
    alphabet = (b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 _.,:;\"{}[]()"
                b"\n\t-=+*/'#")
    vocab = {b2u[b]: b for b in range(256)}
    while len(vocab) < vocab_size - 1:
        n = rng.choice([2, 3, 3, 4, 4, 5, 6, 7, 8, 10, 12])
        vocab.setdefault("".join(b2u[rng.choice(alphabet)] for _ in range(n)), len(vocab))
    eos = vocab_size - 1
    tok = {"version": "1.0", "added_tokens": [{"id": eos, "content": "<eos>", "special": True}],
           "normalizer": None, "pre_tokenizer": {"type": "ByteLevel"}, "post_processor": None,
           "decoder": {"type": "ByteLevel"},
           "model": {"type": "BPE", "vocab": vocab, "merges": []}}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    return eos


def all_automata(names) -> dict:
    """{"demo": {name: costs} on the demo target's 8,192 ids, "qwen3_size": {name: costs}
    on `synthetic_tokenizer`'s 151,936 ids}."""
    import tempfile

    from specjax.decoding.loading import DEMO_TARGET
    from specjax.models.config import ModelConfig

    mc = ModelConfig.from_dir(DEMO_TARGET)
    out = {"demo": {n: automaton_costs(n, DEMO_TARGET, tuple(mc.eos_token_ids),
                                       mc.vocab_size) for n in names}}
    with tempfile.TemporaryDirectory() as tmp:
        eos = synthetic_tokenizer(tmp)
        out["qwen3_size"] = {n: automaton_costs(n, tmp, (eos,), eos + 1) for n in names}
    for where, rows in out.items():
        for n, a in rows.items():
            print(f"{where} {n}: {a['compile_s']} s, {a['states']} states, "
                  f"{a['token_classes']} classes", file=sys.stderr)
    return out


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
    names = [n for n in CONSTRAINTS if not only or n in only]
    out = {"git": git_rev(ROOT), "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "prompts": n_prompts, "max_new_tokens": new_tokens, "target": "checkpoints/demo/target",
           "vocab_size": mc.vocab_size, "decode": []}
    out.update(automata_record(names))
    for system in SYSTEMS:
        for name in [None, *names]:
            regex = None if name is None else out["automata"]["demo"][name]["regex"]
            row = {"system": system[0], "constraint": name or "none",
                   **decode(system, regex, n_prompts, new_tokens)}
            print(row, file=sys.stderr)
            out["decode"].append(row)
    return out


def automata_record(names) -> dict:
    return {"automata": all_automata(names), "automata_git": git_rev(ROOT),
            "automata_measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def render(res: dict) -> str:
    lines = [f"Automata measured {res['automata_measured_at']} at git {res['automata_git']}: "
             "on the demo target's 8,192-token vocabulary and on a synthetic byte-level "
             "vocabulary of Qwen3's size (151,936 ids, `synthetic_tokenizer`), compiled from "
             "nothing (no cache).\n",
             "| constraint | regex from schema (s) | compile, 8,192 ids (s) | states | "
             "token classes | table bytes | compile, 151,936 ids (s) | states | token classes "
             "| table bytes |", "|---|---|---|---|---|---|---|---|---|---|"]
    big = res["automata"].get("qwen3_size", {})
    for name, a in res["automata"]["demo"].items():
        b = big.get(name)
        tail = ("| - | - | - | - |" if b is None else
                f"| {fmt(b['compile_s'], '.2f')} | {b['states']} | {b['token_classes']} "
                f"| {b['table_bytes']:,} |")
        lines.append(f"| {name}: {CONSTRAINTS[name][0]} | {fmt(a['schema_to_regex_s'], '.3f')} "
                     f"| {fmt(a['compile_s'], '.2f')} | {a['states']} | {a['token_classes']} "
                     f"| {a['table_bytes']:,} " + tail)
    lines += ["", f"Decoding measured {res['measured_at']} at git {res['git']} on the 2-core "
              f"CPU, {res['prompts']} bundled prompts, at most {res['max_new_tokens']} new "
              "tokens, `--gamma fixed` (G = 7), the shipped demo drafters, float32; "
              "`python benchmarks/structured.py`.\n"]
    lines += ["| system | constraint | tau | tok/s | AR tok/s | speedup | identical | "
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
    ap.add_argument("--automata-only", action="store_true",
                    help="measure the automata again and keep the results file's decoding rows")
    a = ap.parse_args(argv)
    if a.render_only:
        write_doc(json.load(open(a.out)))
        return 0
    if a.automata_only:
        res = json.load(open(a.out))
        res.update(automata_record([n for n in CONSTRAINTS if not a.only or n in a.only]))
        save_results(a.out, res, RESULTS, write_doc)
        print(render(res))
        return 0
    res = measure(a.prompts, a.max_new_tokens, a.only)
    save_results(a.out, res, RESULTS, write_doc)
    print(render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
