"""Where one speculative step's time goes: a `jax.profiler` trace of the compiled decoding
loop, with every XLA op attributed to the part of the step it belongs to.

    python benchmarks/profile_step.py                         # demo target + default drafter
    python benchmarks/profile_step.py --drafter checkpoints/demo/drafters/block --runs 3 \
        --json out/profile.json

`specjax.decoding.loop.speculative_loop` labels its parts with `jax.named_scope`:
drafter_propose, target_verify_forward, verify_rule, drafter_update, and outside the loop
prefill and drafter_init (spread over the steps like the rest). The script compiles
the loop (batch 1, EOS off, exactly --new-tokens per prompt), runs it once untimed, then
traces --runs passes over the prompts. Each op event of the trace (an XLA:CPU thunk: a
fusion, a YNNPACK dot, a copy) is matched by name to its HLO instruction in the compiled
module, whose metadata names the scope; ops of the while-loop body outside those scopes
are the loop's bookkeeping (emission, EOS and budget checks, cache rewinds), other ops
outside the loop are "outside_the_loop". Figures are milliseconds per target step
(per verification), the mean over all steps of the traced runs; "not in any op" is the
wall time of the runs minus the time inside ops (dispatch, thread wake-ups, host work).
Progress goes to stderr, the table to stdout; bad input exits 2 with one line.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

os.environ.pop("JAX_NUM_CPU_DEVICES", None)  # measure ONE CPU device
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)  # uninstalled checkout

import jax  # noqa: E402

from benchmarks.lib import sessions  # noqa: E402
from benchmarks.lib.prompts import prompt_ids  # noqa: E402
from specjax import cli  # noqa: E402
from specjax.decoding.loading import DEMO_PROMPTS, DEMO_TARGET  # noqa: E402
from specjax.errors import SpecjaxError  # noqa: E402
from specjax.fileio import atomic_write, check_output_file  # noqa: E402

SCOPES = ("drafter_propose", "target_verify_forward", "verify_rule", "drafter_update",
          "prefill", "drafter_init")


def log(msg: str) -> None:
    print(f"[profile] {msg}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    ap = cli.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=DEMO_TARGET)
    ap.add_argument("--drafter", default=None,
                    help="drafter directory, draft LM directory or ngram (default: decode.py's)")
    ap.add_argument("--gamma", type=int, default=None, help="G (default: decode.py's)")
    ap.add_argument("--matmul-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="the target's matmul inputs (decode.py's flag)")
    ap.add_argument("--drafter-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="a learned drafter's matmul inputs (decode.py's flag)")
    ap.add_argument("--draft-vocab", choices=("auto", "full"), default="auto",
                    help="as decode.py: the drafter's hot vocabulary (auto) or all ids")
    ap.add_argument("--num-drafts", type=int, default=1,
                    help="K drafts per step, verified as one tree (decode.py's flag)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--verify", choices=("token", "block"), default="block",
                    help="the rule at temperature > 0 (decode.py's flag)")
    ap.add_argument("--prompts", default=DEMO_PROMPTS)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=2, help="traced passes over the prompts")
    ap.add_argument("--top", type=int, default=0,
                    help="also list the N most expensive ops of each part (ms per step)")
    ap.add_argument("--json", help="write the figures to this JSON file (its directory must "
                    "exist; checked before the run)")
    return ap


def _own_scope(op_name: str | None) -> str | None:
    for s in SCOPES:
        if op_name and (f"/{s}/" in op_name or op_name.endswith(f"/{s}")):
            return s
    return None


_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_OPERAND = re.compile(r"%([\w.\-]+)")
_CHILDREN = re.compile(r"(?:body|condition|to_apply)=%?([\w.\-]+)|branch_computations=\{([^}]*)\}")


def instruction_scopes(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> the part of the step it belongs to, from the compiled
    module: its own op_name scope if it has one (an op without metadata, as XLA:CPU's
    ynn_fusion thunks are, takes the scope of an operand's producer, else of a user, in
    the same computation), else the scope of the control-flow op
    whose body it runs in (the main while loop's body: loop_bookkeeping; the entry
    computation: outside_the_loop). Control-flow ops themselves are left out: their
    trace events span the ops inside them."""
    comps: dict[str, list] = {}
    entry, comp = None, None
    for line in hlo_text.splitlines():
        head = _HEADER.match(line)
        if head and not line.startswith(" "):
            comp = head.group(2)
            comps[comp] = []
            if head.group(1):
                entry = comp
            continue
        if comp is None or line.strip() == "}":
            comp = None if line.strip() == "}" else comp
            continue
        m = _NAME.match(line)
        if not m:
            continue
        op = _OP_NAME.search(line)
        children = []
        if " fusion(" not in line:  # a fusion's calls= is its fused body: one thunk
            for body, branches in _CHILDREN.findall(line):
                children += [body] if body else [c.strip().lstrip("%") for c in
                                                  branches.split(",") if c.strip()]
        rhs = line.split("=", 1)[1].split("calls=")[0].split("metadata=")[0]
        operands = _OPERAND.findall(rhs)
        comps[comp].append([m.group(1), _own_scope(op.group(1) if op else None), children,
                            operands])
    for insts in comps.values():  # ops that lost their metadata (XLA:CPU's ynn_fusion):
        own = {i[0]: i[1] for i in insts}  # the scope of a producer, else of a consumer
        users: dict[str, list[str]] = collections.defaultdict(list)
        for name, _, _, operands in insts:
            for o in operands:
                users[o].append(name)
        for inst in insts:
            if inst[1] is None and not inst[2]:
                near = [own.get(o) for o in inst[3]] + [own.get(u) for u in users[inst[0]]]
                inst[1] = next((n for n in near if n), None)
    out: dict[str, str] = {}
    todo = [(entry, "outside_the_loop")] if entry else []
    seen = set()
    while todo:
        name, scope = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for inst, own, children, _ in comps[name]:
            eff = own or scope
            if children:
                inner = eff if (own or name != entry) else "loop_bookkeeping"
                todo += [(c, inner) for c in children]
            else:
                out[inst] = eff
    return out


def instruction_shapes(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> its result type and opcode (e.g. `f32[1,8,512] fusion`), to
    read a --top list."""
    out = {}
    for line in hlo_text.splitlines():
        m = _NAME.match(line)
        if m:
            rhs = line.split("=", 1)[1].strip()
            out[m.group(1)] = rhs.split("(", 1)[0][:80]
    return out


def trace_op_times(log_dir: str, names: dict[str, str],
                   per_op: dict | None = None) -> tuple[dict, float]:
    """Summed op durations (ms) per scope from the perfetto trace in `log_dir`, and the
    time (ms) of op events that matched no instruction. `per_op`, if given, collects the
    summed duration of every matched op name."""
    files = glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not files:
        raise SpecjaxError(f"jax.profiler wrote no perfetto trace under {log_dir}")
    with gzip.open(files[-1]) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    per_scope = collections.defaultdict(float)
    unmatched = 0.0
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        scope = names.get(e.get("name", ""))
        if scope is not None:
            per_scope[scope] += e["dur"] / 1e3
            if per_op is not None:
                per_op[e["name"]] = per_op.get(e["name"], 0.0) + e["dur"] / 1e3
        elif e.get("name", "").startswith(("wrapped_", "ynn_", "fusion", "copy", "dot",
                                           "scatter", "gather", "dynamic")):
            unmatched += e["dur"] / 1e3  # should stay ~0: a name the module lacks
    return dict(per_scope), unmatched


def run(args) -> dict:
    from specjax.decoding.engine import Stats

    if min(args.num_prompts, args.new_tokens, args.runs, args.num_drafts) < 1:
        raise SpecjaxError("--num-prompts, --new-tokens, --runs and --num-drafts must be >= 1")
    if args.temperature < 0:
        raise SpecjaxError(f"--temperature {args.temperature} must be >= 0")
    if args.json:  # before any work: a bad path fails now, not after the run
        check_output_file(args.json, "--json")
    # decode.py's engine for these flags (f32 target, EOS off, a fixed draft length)
    cfg = sessions.config(target=args.target, drafter=args.drafter,
                          gamma=args.gamma or "fixed", num_drafts=args.num_drafts,
                          temperature=args.temperature, verify=args.verify,
                          dtype="float32", matmul_dtype=args.matmul_dtype,
                          drafter_dtype=args.drafter_dtype, draft_vocab=args.draft_vocab,
                          ignore_eos=True, max_new_tokens=args.new_tokens)
    session = sessions.session(cfg)
    prompts = prompt_ids(args.prompts, session.tokenizer, session.model_cfg.vocab_size,
                         args.num_prompts, args.target)
    if cfg.drafter == "none":
        raise SpecjaxError("--drafter none has no speculative step to profile")
    engine = session.engines(sessions.as_pairs(prompts)).main
    drafter, name = engine.drafter, session.loaded.name
    log(f"compiling ({name}, G={drafter.gamma})")
    engine.compile()
    names = instruction_scopes(engine.compiled.as_text())
    key = jax.random.key(0)
    for p in prompts:  # warm-up
        engine.run([p], args.new_tokens, key)
    stats = Stats()
    with tempfile.TemporaryDirectory() as log_dir:
        jax.profiler.start_trace(log_dir, create_perfetto_trace=True)
        t0 = time.perf_counter()
        for _ in range(args.runs):
            for p in prompts:
                stats.add(engine.run([p], args.new_tokens, key))
        wall_ms = (time.perf_counter() - t0) * 1e3
        jax.profiler.stop_trace()
        per_op: dict[str, float] = {}
        per_scope, unmatched = trace_op_times(log_dir, names, per_op)
    steps = stats.steps
    in_ops = sum(per_scope.values()) + unmatched
    rows = {s: per_scope.get(s, 0.0) / steps for s in
            (*SCOPES, "loop_bookkeeping", "outside_the_loop")}
    rows["ops not matched to the module"] = unmatched / steps
    rows["not in any op"] = (wall_ms - in_ops) / steps
    result = {"drafter": name, "gamma": drafter.gamma, "steps": steps,
              "new_tokens": stats.new_tokens, "tau": stats.tau, "alpha": stats.alpha,
              "wall_ms": wall_ms, "ms_per_step": rows, "step_ms": wall_ms / steps,
              "tokens_per_s": stats.new_tokens / (wall_ms / 1e3)}
    print(f"{name}, G={drafter.gamma}: {steps} steps, tau {stats.tau:.2f}, "
          f"{result['tokens_per_s']:.1f} tok/s, {result['step_ms']:.2f} ms per step\n")
    print("| part of the step | ms per step | share |\n|---|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v:.3f} | {100 * v / result['step_ms']:.1f}% |")
    if args.top > 0:
        shapes = instruction_shapes(engine.compiled.as_text())
        for scope in (*SCOPES, "loop_bookkeeping", "outside_the_loop"):
            ops = sorted((v, k) for k, v in per_op.items() if names.get(k) == scope)[::-1]
            if not ops:
                continue
            print(f"\n{scope}: top {min(args.top, len(ops))} of {len(ops)} ops (ms per step)")
            for v, k in ops[:args.top]:
                print(f"  {v / steps:7.3f}  {k}  {shapes.get(k, '')}")
        result["top_ops"] = {k: v / steps for k, v in per_op.items()}
    if args.json:
        text = (json.dumps(result, indent=1) + "\n").encode()
        atomic_write(args.json, lambda f: f.write(text))
    return result


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except SpecjaxError as e:
        print(f"profile_step.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
