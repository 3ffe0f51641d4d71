"""Long context (issue 33): the long-context demo target's quality by position, and decode
speed against context length for AR, eagle3, and eagle3 with the LOSSY SpecPV partial
verification (`--partial-verify`) and the draft window.

    python benchmarks/long_context.py quality      # NLL by position, both targets
    python benchmarks/long_context.py speed        # decode speed, 2k .. 32k tokens
    python benchmarks/long_context.py all          # both (about 40 min on 2 cores)
    python benchmarks/long_context.py --render-only

quality: rows of `--rows` x 32,768 tokens of the held-out stream (the standard library's
validation split, files concatenated in path order with EOS between them, as training
reads it: `runs/data/stdlib-bpe8192/tokens/val.npy`), teacher-forced through each target in
pieces of 1,024 tokens with its KV cache; the mean NLL (nats per token) in position
buckets. The shipped target (2,048 positions declared, trained on 256-token rows) is
measured past its range to show what the continued training bought.

speed: for each context L, one prompt of L held-out tokens (from the start of the same
stream), `--new-tokens` new tokens, greedy, batch 1, EOS off. Every engine runs the loop
as two compiled programs, the prefill and the decoding (`Engine.run_phases`), and times
each; decode tokens/s = (N - 1) / decode seconds, the fastest of `--repeats` runs, so the
prefill (the same work in every engine) is left out, and speedup = that over AR's. (Until
2026-11-28 the decode was the difference of a run with all N tokens and one with 1; at
32k tokens the prefill's spread between runs, about 7 s of 45-52 s, exceeded the whole
decode and gave rows without a figure.) The runs are interleaved engine by engine (after
a warm-up each), so a speedup is a ratio on one machine state. Lossy settings record how far their
output is from AR's (`specjax.decoding.fly.agreement`) and the target's own NLL of their
text against AR's text (teacher-forced with full attention).

Results: benchmarks/results/long_context.json, and the `<!-- long_context:quality -->`
and `<!-- long_context:speed -->` sections of docs/long_context.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.lib import sessions  # noqa: E402
from benchmarks.lib.provenance import git_rev  # noqa: E402
from benchmarks.lib.report import save_results  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results", "long_context.json")
DOC = os.path.join(ROOT, "docs", "long_context.md")
SHIPPED = os.path.join(ROOT, "checkpoints", "demo", "target")
LONG = os.path.join(ROOT, "checkpoints", "demo", "target_32k")
EAGLE3 = os.path.join(ROOT, "checkpoints", "demo", "drafters_32k", "eagle3")  # re-fitted
TOKENS = os.path.join(ROOT, "runs", "data", "stdlib-bpe8192", "tokens")  # as the trainer
BUCKETS = (0, 256, 2048, 4096, 8192, 16384, 32768)
PIECE = 1024


def val_stream(n: int):
    """n tokens of the held-out stream (tokenized on first use, as training does)."""
    import numpy as np

    from specjax.data.corpus import load_tokens, tokenize_corpus

    paths = tokenize_corpus(os.path.join(ROOT, "checkpoints", "demo", "tokenizer"), TOKENS)
    ids = load_tokens(paths["val"])
    if len(ids) < n:
        raise SystemExit(f"the held-out stream has {len(ids)} tokens, fewer than {n}")
    return np.asarray(ids[:n], np.int32)


@functools.lru_cache(maxsize=4)
def _piece_fn(model):
    """The jitted forward of one PIECE of `token_nll` for this model, built once per model
    (not once per call, which traced it again for every row and every output)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def piece(cache, toks, nxt, start):
        pos = start + jnp.arange(PIECE, dtype=jnp.int32)[None]
        out = model(toks[None], pos, cache)
        logp = jax.nn.log_softmax(out.logits[0].astype(jnp.float32), axis=-1)
        return out.cache, -jnp.take_along_axis(logp, nxt[:, None], axis=-1)[:, 0]

    return piece


def token_nll(model, ids):
    """f32[T-1]: -log p(ids[t+1] | ids[..t]) teacher-forced in pieces of PIECE tokens
    through the model's KV cache (memory follows the piece, not the row)."""
    import jax.numpy as jnp
    import numpy as np

    T = len(ids)
    width = -(-T // PIECE) * PIECE
    padded = np.zeros(width + 1, np.int32)
    padded[:T] = ids
    piece = _piece_fn(model)
    cache = model.init_cache(1, width)
    out = []
    for s in range(0, width, PIECE):
        cache, nll = piece(cache, jnp.asarray(padded[s:s + PIECE]),
                           jnp.asarray(padded[s + 1:s + PIECE + 1]), jnp.int32(s))
        out.append(np.asarray(nll))
    return np.concatenate(out)[:T - 1]


def _targets(long_target: str, also=()) -> list[tuple[str, str]]:
    """(name, HF dir) of every target measured: shipped, long, then `also`'s pairs."""
    return [("shipped", SHIPPED), ("long", long_target), *also]


def quality(rows: int, long_target: str = LONG, log=print, also=()) -> dict:
    import numpy as np

    from specjax.decoding.loading import load_target

    n = BUCKETS[-1]
    stream = val_stream(rows * n)
    res = {}
    for name, path in _targets(long_target, also):
        model = load_target(path, dtype="float32").model
        sums = np.zeros(len(BUCKETS) - 1)
        counts = np.zeros(len(BUCKETS) - 1)
        for r in range(rows):
            t0 = time.perf_counter()
            nll = token_nll(model, stream[r * n:(r + 1) * n])  # position t predicts t + 1
            for i in range(len(BUCKETS) - 1):
                part = nll[BUCKETS[i]:BUCKETS[i + 1]]
                sums[i] += part.sum()
                counts[i] += len(part)
            log(f"[quality] {name} row {r}: {time.perf_counter() - t0:.0f} s")
        res[name] = {"path": os.path.relpath(path, ROOT),
                     "nll": [float(s / c) for s, c in zip(sums, counts, strict=True)]}
    return {"rows": rows, "row_tokens": n, "buckets": list(BUCKETS), "targets": res}


def windowed_control(rows: int, long_target: str = LONG, lo: int = 16384, ctx: int = 4096,
                     log=print, also=()) -> dict:
    """The same tokens as the last bucket (positions lo..32k of each row), each window of
    `ctx` tokens read after only its `ctx` preceding tokens (positions below 2 * ctx, the
    range of the long target's training rows): the NLL the text has at short positions,
    to separate the content of the last bucket from its distance. -> {target: nll}."""

    from specjax.decoding.loading import load_target

    n = BUCKETS[-1]
    stream = val_stream(rows * n)
    out = {}
    for name, path in _targets(long_target, also):
        model = load_target(path, dtype="float32").model
        total, count = 0.0, 0
        for r in range(rows):
            row = stream[r * n:(r + 1) * n]
            for s in range(lo, n, ctx):
                nll = token_nll(model, row[s - ctx:s + ctx])  # predicts s - ctx + 1 ..
                part = nll[ctx - 1:2 * ctx - 1]  # the tokens s .. s + ctx - 1
                total, count = total + float(part.sum()), count + len(part)
        out[name] = total / count
        log(f"[quality] control {name}: {out[name]:.3f}")
    return {"from": lo, "context": ctx, "nll": out}


def nll_of(model, prompt, output) -> float:
    """Mean NLL (nats per token) of `output` after `prompt` under the model."""
    import numpy as np

    ids = np.asarray(list(prompt) + list(output), np.int32)
    return float(token_nll(model, ids)[len(prompt) - 1:].mean())


SYSTEMS = ("eagle3", "window", "partial", "window+partial")  # beside AR, always run
WINDOW = 256  # the draft window of the "window" systems


def system_settings(systems, budgets) -> list[tuple]:
    """(name, partial budget or None, draft window or None) of each system asked for:
    eagle3 (exact), window (exact, `--draft-window` WINDOW), partial (LOSSY, each budget),
    window+partial (LOSSY, the window and the first budget). Raises ValueError for an
    unknown system."""
    bad = [x for x in systems if x not in SYSTEMS]
    if bad:
        raise ValueError(f"unknown systems {bad}; choose from {SYSTEMS}")
    out = []
    if "eagle3" in systems:
        out.append(("eagle3", None, None))
    if "window" in systems:
        out.append(("eagle3", None, WINDOW))
    if "partial" in systems:
        out += [("eagle3", b, None) for b in budgets]
    if "window+partial" in systems:
        out.append(("eagle3", budgets[0], WINDOW))
    return out


def _engine(long_target: str, L: int, new_tokens: int, drafter: str | None = None,
            window: int | None = None, budget: int | None = None):
    """(engine, its session) for one prompt of L tokens and `new_tokens` more, batch 1, EOS
    off: decode.py's engine for `--target LONG_TARGET --dtype float32 --ignore-eos` and
    `--drafter none`, or `--drafter DRAFTER --gamma fixed [--draft-window W]
    [--partial-verify --partial-budget B]`."""
    cfg = sessions.config(target=long_target, drafter=drafter or "none",
                          gamma=None if drafter is None else "fixed", draft_window=window,
                          partial_verify=budget is not None, partial_budget=budget,
                          dtype="float32", ignore_eos=True, max_new_tokens=new_tokens,
                          allow_long_context=True)
    es = sessions.engine_set(cfg, [[0] * L])
    return es.main, es.session


def speed(contexts, budgets, new_tokens: int, long_target: str = LONG, drafter: str = EAGLE3,
          repeats: int = 2, log=print, systems=SYSTEMS) -> dict:
    import jax

    from specjax.decoding.fly import agreement

    stream = val_stream(max(contexts))
    runs = []
    for L in contexts:
        prompt = stream[:L].tolist()
        ar, ar_session = _engine(long_target, L, new_tokens)
        target = ar_session.target  # the NLL of each output
        engines = {"AR": (ar, None)}
        for name, budget, window in system_settings(systems, budgets):
            label = name + ("" if window is None else f" W={window}") + (
                "" if budget is None else f" partial {budget}")
            eng, session = _engine(long_target, L, new_tokens, drafter, window, budget)
            engines[label] = (eng, (eng.gamma, budget, window, session.partial()))
        for label, (e, _) in engines.items():
            t0 = time.perf_counter()
            e.run_phases([prompt], 2, jax.random.key(0))  # compiles both programs; warm-up
            log(f"[speed] L={L} {label}: compiled and warmed in "
                f"{time.perf_counter() - t0:.0f} s")
        prefill = {k: [] for k in engines}
        decode = {k: [] for k in engines}
        outs, res = {}, {}
        for _ in range(repeats):  # the fastest of `repeats`, each phase on its own
            for label, (e, _) in engines.items():
                out, pre_s, dec_s = e.run_phases([prompt], new_tokens, jax.random.key(0))
                prefill[label].append(pre_s)
                decode[label].append(dec_s)
                outs[label], res[label] = out.outputs[0], out
        prefill = {k: min(v) for k, v in prefill.items()}
        decode = {k: min(v) for k, v in decode.items()}
        ar_tps = (new_tokens - 1) / decode["AR"]
        for label, (_, meta) in engines.items():
            tps = (new_tokens - 1) / decode[label]
            rec = {"context": L, "system": label, "prefill_s": prefill[label],
                   "decode_s": decode[label], "decode_tokens_per_s": tps,
                   "speedup": tps / ar_tps, "identical": outs[label] == outs["AR"]}
            if meta is not None:
                G, budget, window, pv = meta
                out = res[label]
                steps = int(out.steps.sum())
                rec.update(gamma=G, budget=budget, window=window,
                           tau=(1 + int(out.accepted.sum()) / steps) if steps else None,
                           lossy=pv is not None)
                if pv is None:  # where the step's time goes at this context (exact only)
                    rec.update(engines[label][0].step_timing([prompt], new_tokens,
                                                             jax.random.key(0)))
                else:
                    rec["threshold"] = pv.threshold_for(G)
                    rec["full_steps"], rec["partial_steps"] = (int(x) for x in out.verified)
                    rec.update(agreement([outs[label]], [outs["AR"]]))
                    rec["nll"] = (None if rec["identical"]
                                  else nll_of(target.model, prompt, outs[label]))
            runs.append(rec)
            log(f"[speed] L={L} {label}: {tps:.1f} tok/s decode, {rec['speedup']:.2f}x, "
                f"tau {rec.get('tau') or 0:.2f}, identical {rec['identical']}")
        ar_nll = nll_of(target.model, prompt, outs["AR"])
        for rec in runs:
            if rec["context"] == L and rec.get("lossy"):
                rec["nll_lossless"] = ar_nll
                if rec["nll"] is None:
                    rec["nll"] = ar_nll
        del engines
    return {"runs": runs, "new_tokens": new_tokens, "contexts": list(contexts),
            "budgets": list(budgets), "repeats": repeats}


def step_timings(speed_res: dict, contexts, long_target: str = LONG, drafter: str = EAGLE3,
                 stamp: dict | None = None, log=print) -> dict:
    """`speed_res` with the draft / verify ms of its exact drafter rows at `contexts`
    measured again (`Engine.step_timing` on the same prompt, after its prefill), each
    row stamped `timing` = {git, date}; the decode figures are left as they are.
    Raises ValueError when a context has no rows in `speed_res`."""
    import jax

    new_tokens = speed_res["new_tokens"]
    stream = val_stream(max(contexts))
    runs = [dict(r) for r in speed_res["runs"]]
    for L in contexts:
        rows = [r for r in runs if r["context"] == L and r.get("tau") is not None
                and not r.get("lossy")]
        if not rows:
            raise ValueError(f"no exact drafter rows at context {L} to time")
        prompt = stream[:L].tolist()
        for r in rows:
            eng, _ = _engine(long_target, L, new_tokens, drafter, r.get("window"))
            r.update(eng.step_timing([prompt], new_tokens, jax.random.key(0)),
                     timing=stamp or {})
            log(f"[timing] L={L} {r['system']}: draft {r['draft_ms']:.1f} ms, verify "
                f"{r['verify_ms']:.1f} ms")
    return {**speed_res, "runs": runs}


def _system_rank(name: str) -> int:
    """The table's order of systems within a context: AR, the exact ones, the lossy."""
    exact = "partial" not in name
    return 0 if name == "AR" else (1 if exact else 3) + (" W=" in name)


def merge_speed(old: dict | None, new: dict) -> dict:
    """The speed results `new` with `old`'s rows for the (context, system) pairs `new`
    did not run.

    Every row is stamped with the git revision and date of the run that made it, so a
    merged table says which code measured which row. Rows are ordered by context, then
    AR, the exact systems and the lossy ones (`_system_rank`).
    """
    def stamped(part):
        return [{"git": part.get("git"), "date": part.get("date"), **r} for r in part["runs"]]

    rows = stamped(new)
    ran = {(r["context"], r["system"]) for r in rows}
    if old:
        rows += [r for r in stamped(old) if (r["context"], r["system"]) not in ran]
    rows.sort(key=lambda r: (r["context"], _system_rank(r["system"])))  # stable
    return {**new, "runs": rows, "contexts": sorted({r["context"] for r in rows})}


def _timing_provenance(s: dict) -> str:
    """", git X, date (`--timing-only`)" when the step timings were measured again."""
    stamps = {(r["timing"].get("git"), r["timing"].get("date")) for r in s["runs"]
              if r.get("timing")}
    return "".join(f"; git {g}, {d} (`--timing-only`)" for g, d in sorted(stamps))


def _speed_provenance(s: dict) -> str:
    """'git X, date' of a speed table, or one such entry per group of rows if merged
    ("L = 8192 (AR, eagle3 W=256)" where a context's rows come from several runs)."""
    groups: dict[tuple, dict[int, list[str]]] = {}
    runs_of: dict[int, set] = {}
    for r in s["runs"]:
        key = (r.get("git") or s.get("git"), r.get("date") or s.get("date"))
        groups.setdefault(key, {}).setdefault(r["context"], []).append(r["system"])
        runs_of.setdefault(r["context"], set()).add(key)
    if len(groups) == 1:
        (git, date), = groups
        return f"git {git}, {date}"

    def where(c, names):
        return str(c) if len(runs_of[c]) == 1 else f"{c} ({', '.join(names)})"

    return "; ".join(f"L = {', '.join(where(c, n) for c, n in cs.items())}: git {git}, {date}"
                     for (git, date), cs in groups.items())


def render_quality(res: dict) -> str:
    q = res["quality"]
    b = q["buckets"]
    heads = [f"{b[i]}-{b[i + 1]}" for i in range(len(b) - 1)]
    lines = [f"Mean NLL (nats per token) of {q['rows']} held-out row(s) of "
             f"{q['row_tokens']:,} tokens by position (git {q.get('git', res['git'])}, "
             f"{q.get('date', res['date'])}; "
             "`python benchmarks/long_context.py quality`):", "",
             "| target | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    for name, t in q["targets"].items():
        cells = " | ".join(f"{x:.3f}" if math.isfinite(x) else "-" for x in t["nll"])
        lines.append(f"| {name} (`{t['path']}`) | {cells} |")
    c = q.get("control")
    if c:
        lines += ["", f"Control: the tokens of the last bucket read in windows of "
                  f"{c['context']:,}, each after only its {c['context']:,} preceding tokens "
                  f"(positions below {2 * c['context']:,}; `python benchmarks/long_context.py "
                  f"control`, git {c['git']}): "
                  + ", ".join(f"{k} {v:.3f}" for k, v in c["nll"].items()) + "."]
    more = q.get("control_by_context")
    if more:
        ctxs = sorted(more["nll"], key=int)
        names = list(more["nll"][ctxs[0]])
        lines += ["", "The same tokens (positions 16,384-32,767), read in windows of C "
                  "tokens, each after only its C preceding tokens (so C to 2C tokens of "
                  f"context; `python benchmarks/long_context.py control --control-contexts "
                  f"{' '.join(ctxs)}`, git {more['git']}), and after all of them (the "
                  "table's last column):", "",
                  "| target | " + " | ".join(f"C = {int(x):,}" for x in ctxs) + " | all |",
                  "|---|" + "---|" * (len(ctxs) + 1)]
        for name in names:
            last = q["targets"].get(name, {}).get("nll", [math.nan])[-1]
            cells = " | ".join(f"{more['nll'][x][name]:.3f}" for x in ctxs)
            lines.append(f"| {name} | {cells} | {last:.3f} |")
    return "\n".join(lines) + "\n"


def render_speed(res: dict) -> str:
    s = res["speed"]
    lines = [f"Decode speed of the long-context target (`checkpoints/demo/target_32k`) with "
             f"eagle3 re-fitted to it (`checkpoints/demo/drafters_32k/eagle3`, fixed G), one "
             f"prompt of L held-out tokens, {s['new_tokens']} new tokens, T = 0, batch 1, on "
             f"this CPU ({res['cores']} cores, {_speed_provenance({'git': res['git'], 'date': res['date'], **s})}; "
             "`python benchmarks/long_context.py speed`). Prefill excluded: the decode is "
             "timed as its own compiled program (`Engine.run_phases`). Draft / verify ms: "
             "one step's parts timed outside the loop after the prefill "
             f"(`Engine.step_timing`{_timing_provenance(s)}), exact rows. Partial rows are LOSSY: agreement and NLL compare them with AR's "
             "output.", "",
             "| L | system | decode tok/s | speedup | tau | draft / verify ms | "
             "full / partial steps | identical to AR | tokens before first difference | "
             "NLL (AR's) |",
             "|" + "---|" * 10]
    for r in s["runs"]:
        tau = "-" if r.get("tau") is None else f"{r['tau']:.2f}"
        steps = (f"{r['full_steps']} / {r['partial_steps']}" if "full_steps" in r else "-")
        pre = f"{r['prefix_tokens']:.0f}" if "prefix_tokens" in r else "-"
        nll = (f"{r['nll']:.3f} ({r['nll_lossless']:.3f})" if r.get("nll") is not None
               else "-")
        ms = f"{r['draft_ms']:.1f} / {r['verify_ms']:.1f}" if "draft_ms" in r else "-"
        lines.append(f"| {r['context']} | {r['system']} | {r['decode_tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {tau} | {ms} | {steps} | "
                     f"{'yes' if r['identical'] else 'NO'} | {pre} | {nll} |")
    return "\n".join(lines) + "\n"


def write_doc(res: dict, doc: str = DOC) -> None:
    from benchmarks.lib.report import replace_doc_section

    if "quality" in res:
        replace_doc_section(doc, "long_context:quality", render_quality(res))
    if "speed" in res:
        replace_doc_section(doc, "long_context:speed", render_speed(res))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", nargs="?", choices=("quality", "control", "speed", "all"),
                    default="all")
    ap.add_argument("--rows", type=int, default=2, help="quality: held-out rows of 32k")
    ap.add_argument("--contexts", type=int, nargs="+",
                    default=[2048, 8192, 16384, 32000])
    ap.add_argument("--budgets", type=int, nargs="+", default=[1024, 4096],
                    help="partial-verification budgets (tokens)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2,
                    help="speed: runs per engine (the fastest counts)")
    ap.add_argument("--long-target", default=LONG, help="the long-context target's HF dir")
    ap.add_argument("--also", nargs="+", default=[], metavar="NAME=DIR",
                    help="quality and control: more targets measured beside the shipped "
                         "and the long one (e.g. an earlier stage of the long target)")
    ap.add_argument("--control-contexts", type=int, nargs="+", default=[], metavar="C",
                    help="control: also read the last bucket's tokens in windows of C, each "
                         "after only its C preceding tokens, for each C (a power of two, "
                         "1,024-16,384)")
    ap.add_argument("--drafter", default=EAGLE3,
                    help="an eagle3 drafter trained against --long-target")
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS,
                    help="speed: the systems beside AR (default all): eagle3, window "
                         f"(exact, --draft-window {WINDOW}), partial (LOSSY, each budget), "
                         "window+partial (LOSSY)")
    ap.add_argument("--merge", action="store_true",
                    help="speed: keep the results file's rows for other contexts (each row "
                         "keeps its own git and date)")
    ap.add_argument("--timing-only", action="store_true",
                    help="speed: measure again only the draft / verify ms of the exact "
                         "drafter rows already in --json at --contexts (no decode runs)")
    ap.add_argument("--render-only", action="store_true")
    ap.add_argument("--json", default=RESULTS)
    args = ap.parse_args(argv)
    also = []
    for item in args.also:
        name, sep, path = item.partition("=")
        if not sep or not name or not os.path.isdir(path):
            ap.error(f"--also {item!r}: give NAME=DIR with an existing HF directory")
        also.append((name, os.path.abspath(path)))
    bad = [c for c in args.control_contexts if c < 1024 or c > 16384 or c & (c - 1)]
    if bad:
        ap.error(f"--control-contexts {bad}: each must be a power of two in 1,024-16,384")
    if args.render_only:
        write_doc(json.load(open(args.json)))
        return 0
    import jax

    res = json.load(open(args.json)) if os.path.exists(args.json) else {}
    stamp = dict(git=git_rev(ROOT), date=time.strftime("%Y-%m-%d"), cores=os.cpu_count(),
                 jax=jax.__version__)
    if args.what in ("quality", "all"):
        res["quality"] = {**quality(args.rows, args.long_target, also=also), **stamp}
        res.update(stamp)
        save_results(args.json, res, RESULTS, write_doc)  # each part as soon as it is done
    if args.what in ("control", "quality", "all"):
        res["quality"]["control"] = {**windowed_control(args.rows, args.long_target,
                                                        also=also), **stamp}
        if args.control_contexts:
            res["quality"]["control_by_context"] = {"nll": {
                str(c): windowed_control(args.rows, args.long_target, ctx=c, also=also)["nll"]
                for c in args.control_contexts}, **stamp}
        save_results(args.json, res, RESULTS, write_doc)
    if args.timing_only:
        if "speed" not in res:
            ap.error(f"--timing-only: {args.json} has no speed table")
        try:
            res["speed"] = step_timings(res["speed"], args.contexts, args.long_target,
                                        args.drafter, stamp={"git": stamp["git"],
                                                             "date": stamp["date"]})
        except ValueError as e:
            ap.error(f"--timing-only: {e}")
        save_results(args.json, res, RESULTS, write_doc)
        print(render_speed(res))
        return 0
    if args.what in ("speed", "all"):
        new = {**speed(args.contexts, args.budgets, args.new_tokens,
                       args.long_target, args.drafter, args.repeats,
                       systems=args.systems), **stamp}
        res["speed"] = merge_speed(res.get("speed"), new) if args.merge else new
        res.update(stamp)
        save_results(args.json, res, RESULTS, write_doc)
    print(render_quality(res) if "quality" in res else "")
    print(render_speed(res) if "speed" in res else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
