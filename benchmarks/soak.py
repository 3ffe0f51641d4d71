"""Soak run: thousands of mixed-length prompts through decode.py's engines, checking
that nothing recompiles, host memory stays flat and every output row is complete.

    python benchmarks/soak.py                                   # 2,000 prompts, greedy + sampled
    python benchmarks/soak.py --prompts 200 --json out/soak.json  # a shorter run
    python benchmarks/soak.py --drafter ngram                   # or none, or a drafter directory

What runs (one process, CPU by default):
  prompts   held-out text: windows of the VALIDATION files of the standard library
            (`specjax.data.corpus.split_of`, the files the demo models never trained on),
            tokenized with the target's tokenizer, lengths log-uniform in
            [--min-prompt, --max-prompt] tokens; a share (--eos-share) of the windows
            ends at the end of its file, where the target tends to emit EOS.
            Deterministic for a --seed and a standard library.
  shapes    each prompt goes to the smallest --buckets width that holds it; one engine
            (decode.py's, built as a decoding session: fixed batch --batch-size, prompt
            width Tp = the bucket rounded up to 16 as decode.py pads, max_length = the
            bucket + --max-new-tokens) per (mode, bucket), plus an autoregressive engine
            per bucket for the T=0 check. Batches of one bucket are
            --batch-size prompts (the last one padded), in a seeded random order across
            buckets, as a server would see them.
  modes     greedy (T=0) and sampled (--temperature, block verification), EOS on.

Phases: compile every engine; warm-up (each compiled program runs one batch, untimed);
decode (every batch of every mode, timed; at T=0 every --ar-every'th batch of each bucket
also runs autoregressively and must give the same rows).

Checks, each reported and all required for exit code 0:
  (a) compilations: jax's backend-compile monitoring event
      ("/jax/core/compile/backend_compile_duration", one per XLA compilation, persistent
      cache hits counted too) is counted by function name; the decoding loops must compile
      exactly once per distinct program (mode x loop x shape) and nothing at all may
      compile in the decode phase.
  (b) host memory: VmRSS from /proc/self/status at the process start, after loading,
      after warm-up, after every batch and at the end, and VmHWM (peak). RSS swings by
      a few hundred MiB between batches of different shapes, so "flat" is measured
      against warm-up, which ran every program: after warm-up, no batch may leave RSS
      more than --rss-slack-mib above the highest RSS seen during warm-up, the peak
      (VmHWM) may not rise by more than that, and for each program the median RSS after
      the last quarter of its batches may not exceed that after the first quarter by
      more than that.
  (c) rows: each row is either cut at its first EOS (the EOS is its last token) or has
      exactly --max-new-tokens tokens, every id in the vocabulary; at T=0 the sampled rows
      equal autoregressive decoding.

Progress goes to stderr (tqdm), a markdown table to stdout, and --json writes every figure.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
import time

if __name__ == "__main__":  # one CPU device, as decode.py runs (tests that import this
    os.environ.pop("JAX_NUM_CPU_DEVICES", None)  # module keep their own setting)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)  # an uninstalled checkout

import jax  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.lib import sessions  # noqa: E402
from benchmarks.lib.provenance import usable_cores  # noqa: E402
from specjax import cli  # noqa: E402
from specjax.decoding.engine import Stats  # noqa: E402
from specjax.decoding.loading import DEMO_TARGET  # noqa: E402
from specjax.errors import SpecjaxError  # noqa: E402
from specjax.fileio import atomic_write, check_output_file  # noqa: E402

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch, jax 0.10.2
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # persistent-cache hit: no backend compile
LOOPS = ("speculative_loop", "autoregressive_loop")  # the jitted functions Engine compiles
JSON_KEYS = ("config", "environment", "load_average", "prompts", "shapes", "compilations",
             "memory", "modes", "checks", "load_while_decoding", "ok", "wall_s")


# ----------------------------------------------------------------------------- probes

def memory() -> dict:
    """{"rss": VmRSS, "hwm": VmHWM} of this process in bytes, from /proc/self/status."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key[2:].lower()] = int(value.split()[0]) * 1024  # kB
    return out


class CompileCounter:
    """Records every XLA compilation in this process while active, tagged with a phase.

    Listens to jax's monitoring events: `COMPILE_EVENT` (jax._src.dispatch, recorded
    by `pxla._cached_compilation` around each backend compile, with the jitted
    function's name) and `CACHE_HIT_EVENT` (a persistent compilation-cache hit, which
    skips the backend compile but is still a compilation request for a program not in
    memory). An executable reused from jax's in-memory caches records neither.
    """

    def __init__(self):
        self.phase = "setup"
        self.events: list[dict] = []  # {"phase", "name", "seconds"}

    def _duration(self, event: str, seconds: float, **kw):
        if event == COMPILE_EVENT:
            self.events.append({"phase": self.phase, "name": str(kw.get("fun_name", "?")),
                                "seconds": float(seconds)})

    def _event(self, event: str, **kw):
        if event == CACHE_HIT_EVENT:
            self.events.append({"phase": self.phase, "name": "persistent-cache-hit",
                                "seconds": 0.0})

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)
        return self

    def __exit__(self, *exc):
        from jax._src import monitoring  # the public module has no unregister in 0.10.2

        monitoring.unregister_event_duration_listener(self._duration)
        monitoring.unregister_event_listener(self._event)

    def loop_compiles(self) -> int:
        """Compilations of the decoding loops (any phase)."""
        return sum(any(loop in e["name"] for loop in LOOPS) for e in self.events)

    def in_phase(self, phase: str) -> list[str]:
        return [e["name"] for e in self.events if e["phase"] == phase]


def compile_check(counter: CompileCounter, programs: int) -> dict:
    """(a): loop compilations == distinct programs, and nothing compiled while decoding."""
    loops, late = counter.loop_compiles(), counter.in_phase("decode")
    return {"programs": programs, "loop_compilations": loops,
            "compilations_while_decoding": len(late), "late_names": sorted(set(late)),
            "compile_s": sum(e["seconds"] for e in counter.events
                             if any(loop in e["name"] for loop in LOOPS)),
            "ok": loops == programs and not late}


def row_problem(ids: list[int], max_new: int, eos: tuple[int, ...], vocab: int) -> str | None:
    """None when a row is complete (cut at its first EOS, which is its last token, or
    exactly `max_new` tokens without one), else what is wrong."""
    if not ids:
        return "empty"
    if len(ids) > max_new:
        return f"{len(ids)} tokens > budget {max_new}"
    if any(not 0 <= t < vocab for t in ids):
        return "id outside the vocabulary"
    first = next((i for i, t in enumerate(ids) if t in eos), None)
    if first is not None:
        return None if first == len(ids) - 1 else f"{len(ids) - 1 - first} tokens after EOS"
    return None if len(ids) == max_new else f"{len(ids)} tokens, no EOS, budget {max_new}"


# ----------------------------------------------------------------------------- prompts

def held_out_windows(encode, n: int, seed: int, min_len: int, max_len: int,
                     eos_share: float, root: str | None = None) -> list[list[int]]:
    """`n` token windows of validation files (see the module docstring), by `seed`.

    encode: text -> list of token ids. Lengths are log-uniform in [min_len, max_len];
    a share `eos_share` of the windows ends at its file's last token.
    Raises ValueError when no validation file has `max_len` tokens.
    """
    from specjax.data.corpus import corpus_files, read_source, split_of, stdlib_root

    root = root or stdlib_root()
    streams = [encode(read_source(root, rel)) for rel in corpus_files(root)
               if split_of(rel) == "val"]
    streams = [s for s in streams if len(s) >= max_len]
    if not streams:
        raise ValueError(f"no validation file has {max_len} tokens; lower --max-prompt")
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(np.log(min_len), np.log(max_len + 1), n)).astype(int)
    out = []
    for length in np.clip(lengths, min_len, max_len):
        s = streams[rng.integers(len(streams))]
        end = len(s) if rng.random() < eos_share else int(rng.integers(length, len(s) + 1))
        out.append(list(s[end - length:end]))
    return out


def plan_batches(prompts: list[list[int]], buckets: list[int], batch_size: int,
                 seed: int) -> list[tuple[int, list[int]]]:
    """[(prompt width, prompt indices)]: prompts grouped by the smallest bucket that holds
    them, cut into batches of `batch_size`, in a seeded random order.
    Raises ValueError for a prompt longer than the largest bucket."""
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        width = next((b for b in sorted(buckets) if b >= len(p)), None)
        if width is None:
            raise ValueError(f"prompt {i} has {len(p)} tokens > the largest bucket "
                             f"{max(buckets)}")
        groups.setdefault(width, []).append(i)
    batches = [(w, idx[j:j + batch_size]) for w, idx in sorted(groups.items())
               for j in range(0, len(idx), batch_size)]
    order = np.random.default_rng(seed + 1).permutation(len(batches))
    return [batches[k] for k in order]


# ----------------------------------------------------------------------------- the run

MODES = {"greedy": 0.0, "sampled": None}  # None: --temperature


def soak(make_engine, prompts: list[list[int]], *, vocab_size: int, buckets: list[int],
         batch_size: int, max_new_tokens: int, eos_token_ids: tuple[int, ...],
         modes: dict[str, float], ar_every: int = 8, seed: int = 0,
         rss_slack_mib: float = 128.0, start_memory: dict | None = None,
         progress: bool = True, log=lambda msg: None) -> dict:
    """Runs the three phases over `prompts` (lists of token ids) and returns the result
    dict (JSON_KEYS minus config, environment, load_average, wall_s).

    make_engine: (temperature, prompt width, speculative) -> the engine of that mode and
      bucket (batch_size rows, prompt width >= the bucket, max_length = that width +
      max_new_tokens); speculative False: the autoregressive one of the T=0 check. `main`
      builds them as decoding sessions (decode.py's engines); its drafter is None for
      autoregressive decoding.
    modes: {name: temperature}.
    ar_every: at T=0 every ar_every'th batch of each bucket (its first included) also
      runs autoregressively and must give the same rows; 0 skips the check.
    start_memory: `memory()` at the process start (default: now).
    """
    mem = {"start": start_memory or memory()}
    V = vocab_size
    plan = plan_batches(prompts, buckets, batch_size, seed)
    widths = sorted({w for w, _ in plan})
    engines = {}
    drafter = None
    for name, temperature in modes.items():
        for w in widths:
            engines[name, w] = make_engine(temperature, w, True)
            drafter = engines[name, w].drafter if drafter is None else drafter
    greedy_modes = [m for m, t in modes.items() if t == 0]
    if ar_every and greedy_modes and drafter is not None:
        for w in widths:
            engines["ar", w] = make_engine(0.0, w, False)
    mem["after_loading"] = memory()  # weights loaded, engines built (not compiled)
    shapes = sorted({(batch_size, e.cfg.prompt_width, e.cfg.max_length) for e in engines.values()})

    jax.clear_caches()  # programs compiled before this run would not be counted
    base_key = jax.random.key(seed)
    with CompileCounter() as counter:
        counter.phase = "compile"
        log(f"compiling {len(engines)} programs ({len(shapes)} shapes)")
        for eng in engines.values():
            eng.compile()
        counter.phase = "warmup"
        first = {w: idx for w, idx in reversed(plan)}  # each bucket's first batch
        warm_rss = []
        for (_, w), eng in engines.items():
            eng.run([prompts[i] for i in first[w]], max_new_tokens, jax.random.fold_in(base_key, 0))
            warm_rss.append(memory()["rss"])
        mem["after_warmup"] = memory()
        counter.phase = "decode"
        rss_trace, load, results, by_program = [], [], {}, {}
        bar = tqdm(total=len(plan) * len(modes), desc="soak", unit="batch",
                   disable=not progress, file=sys.stderr, mininterval=10)
        for name, temperature in modes.items():
            st, problems, ended_eos, rows = Stats(), [], 0, 0
            seen: dict[int, int] = {}
            ar = {"rows": 0, "equal": 0, "batches": 0}
            for b, (w, idx) in enumerate(plan):
                batch = [prompts[i] for i in idx]
                key = jax.random.fold_in(base_key, b)
                out = engines[name, w].run(batch, max_new_tokens, key)
                st.add(out)
                for i, ids in zip(idx, out.outputs, strict=True):
                    rows += 1
                    why = row_problem(ids, max_new_tokens, eos_token_ids, V)
                    if why:
                        problems.append({"prompt": i, "problem": why})
                    ended_eos += bool(ids) and ids[-1] in eos_token_ids
                k = seen[w] = seen.get(w, -1) + 1
                if temperature == 0 and ("ar", w) in engines and k % ar_every == 0:
                    ref = engines["ar", w].run(batch, max_new_tokens, key)
                    ar["batches"] += 1
                    ar["rows"] += len(batch)
                    ar["equal"] += sum(a == r for a, r in zip(out.outputs, ref.outputs,
                                                              strict=True))
                rss_trace.append(memory()["rss"])
                by_program.setdefault((name, w), []).append(rss_trace[-1])
                load.append(os.getloadavg()[0])
                bar.update()
            results[name] = {
                "temperature": temperature, "batches": len(plan), "rows": rows,
                "new_tokens": st.new_tokens, "wall_s": st.wall_s,
                "tokens_per_s": st.tokens_per_s,
                "tau": st.tau if drafter is not None else None,
                "alpha": st.alpha if drafter is not None else [],
                "complete_rows": rows - len(problems), "ended_by_eos": ended_eos,
                "incomplete": problems[:20],
                "ar_check": ar if temperature == 0 and ar["rows"] else None}
        bar.close()
    mem["end"] = memory()

    def drift(trace):  # median of the last quarter - median of the first quarter
        q = max(1, len(trace) // 4)
        return float(np.median(trace[-q:])) - float(np.median(trace[:q]))

    flat = {"end_minus_after_warmup_mib": (mem["end"]["rss"] - mem["after_warmup"]["rss"]) / 2**20,
            "max_over_warmup_max_mib": (max(rss_trace) - max(warm_rss)) / 2**20,
            "peak_rise_mib": (mem["end"]["hwm"] - mem["after_warmup"]["hwm"]) / 2**20,
            "drift_per_program_mib": max(drift(t) for t in by_program.values()) / 2**20}
    flat["ok"] = max(flat["max_over_warmup_max_mib"], flat["peak_rise_mib"],
                     flat["drift_per_program_mib"]) <= rss_slack_mib
    mem.update({"warmup_max_rss": max(warm_rss), "decode_max_rss": max(rss_trace),
                "decode_min_rss": min(rss_trace), "slack_mib": rss_slack_mib,
                "rss_per_batch_mib": [round(r / 2**20) for r in rss_trace]})
    checks = {
        "compilations": compile_check(counter, len(engines)),
        "memory_flat": flat,
        "rows_complete": {"ok": all(r["complete_rows"] == r["rows"] for r in results.values())},
        "equal_to_ar": {"ok": all(r["ar_check"]["equal"] == r["ar_check"]["rows"]
                                  for r in results.values() if r["ar_check"])},
    }
    return {"prompts": {"n": len(prompts), "min_len": min(map(len, prompts)),
                        "max_len": max(map(len, prompts)),
                        "mean_len": float(np.mean([len(p) for p in prompts])),
                        "per_bucket": {str(w): sum(len(idx) for v, idx in plan if v == w)
                                       for w in widths}},
            "shapes": [list(s) for s in shapes],
            "compilations": {"programs": [f"{m}/{w}" for m, w in engines],
                             "events": counter.events},
            "memory": mem, "modes": results, "checks": checks,
            "load_while_decoding": {"mean": float(np.mean(load)), "min": min(load),
                                    "max": max(load)},
            "ok": all(c["ok"] for c in checks.values())}


# ----------------------------------------------------------------------------- report

def _mib(x: float) -> str:
    return f"{x / 2**20:.0f} MiB"


def render(result: dict) -> str:
    """The markdown tables of a result dict."""
    c, m, p = result["checks"], result["memory"], result["prompts"]
    f = c["memory_flat"]
    checked = [r["ar_check"] for r in result["modes"].values() if r["ar_check"]]
    ar_rows = (f"{sum(a['equal'] for a in checked)}/{sum(a['rows'] for a in checked)}"
               if checked else "not run")
    comp = c["compilations"]
    lines = [f"{p['n']} prompts of {p['min_len']}-{p['max_len']} tokens (mean "
             f"{p['mean_len']:.0f}), per bucket {p['per_bucket']}; {len(result['shapes'])} "
             f"shapes (B, Tp, max_length) {result['shapes']}", "",
             "| mode | batches | new tokens | tokens/s | tau | rows complete | ended by EOS "
             "| equal to AR (rows) |", "|---|---|---|---|---|---|---|---|"]
    for name, r in result["modes"].items():
        ar = "-" if r["ar_check"] is None else f"{r['ar_check']['equal']}/{r['ar_check']['rows']}"
        lines.append(f"| {name} (T={r['temperature']:g}) | {r['batches']} | {r['new_tokens']} "
                     f"| {r['tokens_per_s']:.1f} | "
                     f"{'-' if r['tau'] is None else format(r['tau'], '.2f')} "
                     f"| {r['complete_rows']}/{r['rows']} | {r['ended_by_eos']} "
                     f"| {ar} |")
    lines += ["", "| check | figure | ok |", "|---|---|---|",
              f"| compilations of the decoding loops / distinct programs | "
              f"{comp['loop_compilations']} / {comp['programs']} "
              f"({comp['compile_s']:.1f} s) | {comp['ok']} |",
              f"| compilations while decoding (any function) | "
              f"{comp['compilations_while_decoding']} | {comp['compilations_while_decoding'] == 0} |",
              f"| RSS process start / after loading / after warm-up / end / peak (VmHWM) | "
              f"{_mib(m['start']['rss'])} / {_mib(m['after_loading']['rss'])} / "
              f"{_mib(m['after_warmup']['rss'])} / {_mib(m['end']['rss'])} / "
              f"{_mib(m['end']['hwm'])} | {c['memory_flat']['ok']} |",
              f"| RSS while decoding (min-max) against warm-up's max | {_mib(m['decode_min_rss'])}"
              f"-{_mib(m['decode_max_rss'])} / {_mib(m['warmup_max_rss'])} | - |",
              f"| rise after warm-up: batch max over warm-up max / peak / largest drift of one "
              f"program (slack {m['slack_mib']:g} MiB) | {f['max_over_warmup_max_mib']:+.1f} / "
              f"{f['peak_rise_mib']:+.1f} / {f['drift_per_program_mib']:+.1f} MiB "
              f"| {f['ok']} |",
              f"| every row complete | {sum(r['complete_rows'] for r in result['modes'].values())}"
              f"/{sum(r['rows'] for r in result['modes'].values())} | "
              f"{c['rows_complete']['ok']} |",
              f"| T=0 rows equal to autoregressive (sampled batches) | {ar_rows} | "
              f"{c['equal_to_ar']['ok']} |"]
    return "\n".join(lines)


def parse_args(argv=None):
    ap = cli.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=DEMO_TARGET)
    ap.add_argument("--drafter", default=None,
                    help="none, ngram or a drafter directory (default: decode.py's, the "
                         "bundled eagle3)")
    ap.add_argument("--gamma", type=int, default=None, help="default: the drafter's own")
    ap.add_argument("--prompts", type=int, default=2000)
    ap.add_argument("--min-prompt", type=int, default=8, help="shortest prompt (tokens)")
    ap.add_argument("--max-prompt", type=int, default=300, help="longest prompt (tokens)")
    ap.add_argument("--eos-share", type=float, default=0.25,
                    help="share of prompts that end at their file's end")
    ap.add_argument("--buckets", type=int, nargs="+", default=[64, 128, 192, 320],
                    help="prompt widths Tp; each prompt goes to the smallest that holds it")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES))
    ap.add_argument("--temperature", type=float, default=1.0, help="of the sampled mode")
    ap.add_argument("--verify", choices=("token", "block"), default="block")
    ap.add_argument("--ar-every", type=int, default=8,
                    help="at T=0, every N-th batch of a bucket is also decoded "
                         "autoregressively and compared (0: never)")
    ap.add_argument("--rss-slack-mib", type=float, default=128.0,
                    help="largest RSS rise after warm-up that counts as flat (module docstring)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "soak.json"),
                    help="write every figure here (default %(default)s; checked before the "
                         "run; a missing directory is created when the file is written)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if min(args.prompts, args.min_prompt, args.batch_size, args.max_new_tokens) < 1:
        ap.error("--prompts, --min-prompt, --batch-size and --max-new-tokens must be >= 1")
    if args.max_prompt < args.min_prompt or args.max_prompt > max(args.buckets):
        ap.error("need --min-prompt <= --max-prompt <= the largest of --buckets")
    if args.json:
        try:
            check_output_file(args.json, "--json", create_parent=True)
        except SpecjaxError as e:
            ap.error(str(e))
    return args


def main(argv=None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    load_start = os.getloadavg()

    def log(msg):
        print(f"[soak] {msg}", file=sys.stderr, flush=True)

    start_mem = memory()
    from tokenizers import Tokenizer

    from specjax.models.config import ModelConfig

    try:
        cfg = ModelConfig.from_dir(args.target)
        tok = Tokenizer.from_file(os.path.join(args.target, "tokenizer.json"))
        prompts = held_out_windows(lambda text: tok.encode(text, add_special_tokens=False).ids,
                                   args.prompts, args.seed, args.min_prompt, args.max_prompt,
                                   args.eos_share)
        log(f"{len(prompts)} prompts; loading {args.target}")
        # decode.py's options for every engine (f32 target, its defaults otherwise)
        common = dict(target=args.target, verify=args.verify, batch_size=args.batch_size,
                      max_new_tokens=args.max_new_tokens, dtype="float32")
        sessions.config(drafter=args.drafter, gamma=args.gamma or "fixed", **common)  # checks
    except (SpecjaxError, ValueError, OSError) as e:
        print(f"soak.py: error: {e}", file=sys.stderr)
        return 2
    resolved = {"path": None, "gamma": args.gamma}
    by_mode = {}  # one session per (temperature, speculative): its engines per bucket

    def make_engine(temperature, width, speculative):
        """decode.py's engine for one mode and bucket: the session of `--drafter DRAFTER
        --gamma G|fixed --temperature T` (or `--drafter none`) for one prompt of the
        bucket's width."""
        if (temperature, speculative) not in by_mode:
            drafter = args.drafter if speculative else "none"
            gamma = (args.gamma or "fixed") if drafter != "none" else None
            by_mode[temperature, speculative] = sessions.session(sessions.config(
                drafter=drafter, gamma=gamma, temperature=temperature, **common))
        session = by_mode[temperature, speculative]
        eng = session.engines([(0, [0] * width)]).main
        if speculative:
            resolved.update(path=session.loaded.name, gamma=session.loaded.gamma)
        return eng

    modes = {m: (args.temperature if MODES[m] is None else MODES[m]) for m in args.modes}
    try:
        result = soak(make_engine, prompts, vocab_size=cfg.vocab_size, buckets=args.buckets,
                      batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                      eos_token_ids=tuple(cfg.eos_token_ids), modes=modes,
                      ar_every=args.ar_every, seed=args.seed,
                      rss_slack_mib=args.rss_slack_mib, start_memory=start_mem,
                      progress=not args.no_progress, log=log)
    except SpecjaxError as e:  # a drafter that does not load, a shape that does not fit
        print(f"soak.py: error: {e}", file=sys.stderr)
        return 2
    result = {
        "config": {k: getattr(args, k) for k in (
            "target", "prompts", "min_prompt", "max_prompt", "eos_share", "buckets",
            "batch_size", "max_new_tokens", "modes", "temperature", "verify", "ar_every",
            "rss_slack_mib", "seed")} | {"drafter": args.drafter or "default",
                                        "drafter_path": resolved["path"],
                                        "gamma": resolved["gamma"] or 0},
        "environment": {"python": platform.python_version(), "jax": jax.__version__,
                        "backend": jax.default_backend(), "cpu_count": os.cpu_count(),
                        "usable_cores": usable_cores(), "machine": platform.machine(),
                        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())},
        "load_average": {"start": load_start, "end": os.getloadavg()},
        **result, "wall_s": time.perf_counter() - t_start}
    print(render(result))
    ld = result["load_while_decoding"]
    print(f"\nload average (1 min) {result['load_average']['start'][0]:.2f} at the start, "
          f"{ld['mean']:.2f} on average while decoding ({ld['min']:.2f}-{ld['max']:.2f}), "
          f"{result['load_average']['end'][0]:.2f} at the end; {result['wall_s']:.0f} s in all; "
          f"{'all checks passed' if result['ok'] else 'CHECKS FAILED'}")
    if args.json:
        text = (json.dumps(result, indent=1) + "\n").encode()
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        atomic_write(args.json, lambda f: f.write(text))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
