"""specjax against transformers on one target model: autoregressive, draft-LM and n-gram
speculative decoding, greedy and sampled, and a batch-size sweep, in ONE process.

    python benchmarks/compare.py                 # demo target + draft LM, 8 prompts x 128 tokens
    python benchmarks/compare.py --json out/compare.json --plot out/compare.png
    python benchmarks/compare.py --target DIR --draft DIR --prompts FILE.jsonl --gamma 4 \
        --num-prompts 8 --new-tokens 128 --repeats 3 --batch-sizes 1 4 16
    python benchmarks/compare.py --quick --target T --draft D --prompts P.jsonl   # smoke run

Systems (batch 1, f32, EOS disabled everywhere so every system generates exactly
--new-tokens per prompt and does the same work):
  transformers-greedy         `AutoModelForCausalLM.generate(do_sample=False)` (torch, use_cache)
  transformers-assisted       the same with the draft LM as `assistant_model`; the assistant's
                              generation_config drafts G tokens per step
                              (num_assistant_tokens=G, num_assistant_tokens_schedule="constant",
                              assistant_confidence_threshold=0 so it never stops early)
  transformers-prompt-lookup  the same with `prompt_lookup_num_tokens=G` and
                              `max_matching_ngram_size=3` (specjax's n-gram n_max)
  specjax-ar                  `Engine` without a drafter (one jitted while_loop), T=0
  specjax-draft               `Engine` + `DraftLMDrafter` (the same draft LM), G tokens, T=0
  specjax-ngram               `Engine` + `NgramDrafter` (prompt lookup, n = 3..1), T=0
  specjax-ar-T1               `Engine` without a drafter, temperature 1
  specjax-draft-T1-token      draft LM at temperature 1, token-level rejection sampling
  specjax-draft-T1-block      draft LM at temperature 1, block verification
Batch sweep: specjax-ar and specjax-draft (T=0) at each --batch-sizes B over the same first
--num-prompts prompts, repeated cyclically to fill every batch (B=1 reuses the rows above);
throughput = new tokens summed over the batch / wall.

The same prompts (encoded once with the target's tokenizer) and the same weights (the
--target and --draft directories, loaded by specjax and by transformers) are used
everywhere. The T=1 runs use one PRNG key per prompt, the same for every T=1 system.

Timing: each system first compiles (specjax `Engine.compile()`, reported separately and
excluded) and runs once untimed (warm-up); then --repeats timed runs per system, interleaved
(one run of every system per repeat, in rotating order). A run generates for every prompt;
its wall is the sum of `time.perf_counter()` around each generate call (prefill included,
for every system alike); tokens/s = new tokens of all prompts / that wall (median, min and
max over repeats). tau = 1 + accepted / target steps and alpha_k = accepted at draft
position k / steps reaching k (engine.Stats, DESIGN.md section 7); for transformers'
speculative systems tau = new tokens / target forwards (counted in the warm-up).
Progress goes to stderr, markdown tables to stdout; --json writes every raw figure and
--plot a PNG. Bad input exits with code 2 and one line on stderr, writing nothing.

CPU figures do not predict accelerator speedups (DESIGN.md section 9): on CPU a
(G+1)-token verification costs 2-2.5x a one-token step.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import os
import statistics
import sys
import time
import types

# The benchmark measures ONE CPU device; a simulated multi-device setting (tests set
# JAX_NUM_CPU_DEVICES=8) would split the host's threads. Set before jax is imported.
os.environ.pop("JAX_NUM_CPU_DEVICES", None)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)  # uninstalled checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks._common import (  # noqa: E402
    common_prefix,
    environment,
    load_transformers,
    summary,
    usable_cores,
)
from specjax.errors import SpecjaxError  # noqa: E402

DEMO_DIR = os.path.join(ROOT, "checkpoints", "demo")
DEFAULTS = dict(num_prompts=8, repeats=3, new_tokens=128, batch_sizes=[1, 4, 16])
QUICK = dict(num_prompts=2, repeats=1, new_tokens=16, batch_sizes=[1, 2])
JSON_KEYS = ("args", "environment", "load_average", "models", "prompts", "gamma",
             "new_tokens", "repeats", "threads", "systems", "lossless", "batch_sweep")
TRANSFORMERS_SYSTEMS = ("transformers-greedy", "transformers-assisted",
                        "transformers-prompt-lookup")
SPECJAX_SYSTEMS = ("specjax-ar", "specjax-draft", "specjax-ngram", "specjax-ar-T1",
                   "specjax-draft-T1-token", "specjax-draft-T1-block")
T0_SPECULATIVE = ("specjax-draft", "specjax-ngram")  # must equal specjax-ar token for token
ALPHA_SYSTEMS = ("specjax-draft", "specjax-ngram", "specjax-draft-T1-token",
                 "specjax-draft-T1-block")


def log(msg: str) -> None:
    print(f"[compare] {msg}", file=sys.stderr, flush=True)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, no usage dump
        self.exit(2, f"compare.py: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(description="specjax (AR, draft LM, n-gram; T=0 and T=1; batch sweep) "
                              "against transformers generate on one target model.")
    ap.add_argument("--target", default=os.path.join(DEMO_DIR, "target"),
                    help="HF checkpoint directory of the target (default: the demo target)")
    ap.add_argument("--draft", default=os.path.join(DEMO_DIR, "draft"),
                    help="HF checkpoint directory of the draft LM (default: the demo draft)")
    ap.add_argument("--prompts", default=os.path.join(DEMO_DIR, "prompts.jsonl"),
                    help='JSONL, one object a line with "prompt" (text) or "input_ids"')
    ap.add_argument("--num-prompts", type=int, default=None,
                    help=f"first N prompts (default {DEFAULTS['num_prompts']}, "
                         f"--quick {QUICK['num_prompts']})")
    ap.add_argument("--new-tokens", type=int, default=None,
                    help=f"new tokens per prompt, exactly (default {DEFAULTS['new_tokens']}, "
                         f"--quick {QUICK['new_tokens']})")
    ap.add_argument("--gamma", type=int, default=4, help="draft length G of every drafter")
    ap.add_argument("--repeats", type=int, default=None,
                    help=f"timed runs per system (default {DEFAULTS['repeats']}, "
                         f"--quick {QUICK['repeats']})")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                    help="batch sizes of the sweep (default 1 4 16, --quick 1 2)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: the cores this process may use)")
    ap.add_argument("--seed", type=int, default=0, help="PRNG seed of the T=1 runs")
    ap.add_argument("--no-transformers", action="store_true",
                    help="skip the transformers systems (no torch needed)")
    ap.add_argument("--json", help="write every raw figure to this JSON file")
    ap.add_argument("--plot", help="write a PNG (tokens/s per system, alpha_k per position)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 2 prompts, 16 tokens, 1 repeat, batch sizes 1 2 "
                         "(explicit flags still win)")
    return ap


def validate(args) -> None:
    """Fills the --quick/default values and checks every flag; SpecjaxError on bad input."""
    preset = QUICK if args.quick else DEFAULTS
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, list(v) if isinstance(v, list) else v)
    for flag, value in (("--num-prompts", args.num_prompts), ("--new-tokens", args.new_tokens),
                        ("--gamma", args.gamma), ("--repeats", args.repeats)):
        if value < 1:
            raise SpecjaxError(f"{flag}={value} must be >= 1")
    if any(b < 1 for b in args.batch_sizes):
        raise SpecjaxError(f"--batch-sizes {' '.join(map(str, args.batch_sizes))}: "
                           "each must be >= 1")
    args.batch_sizes = sorted(set(args.batch_sizes))
    if args.threads is not None and args.threads < 1:
        raise SpecjaxError(f"--threads={args.threads} must be >= 1")
    for flag, path in (("--target", args.target), ("--draft", args.draft)):
        if not os.path.isdir(path):
            raise SpecjaxError(f"{flag} {path} does not exist; pass a local HF model directory")
    if not os.path.isfile(args.prompts):
        raise SpecjaxError(f"--prompts {args.prompts} does not exist; pass a JSONL file")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SpecjaxError("--plot needs matplotlib (pip install matplotlib)") from None
    if not args.no_transformers:
        try:
            import torch  # noqa: F401
            import transformers  # noqa: F401
        except ImportError as e:
            raise SpecjaxError(f"the transformers systems need torch and transformers ({e}); "
                               "install them or pass --no-transformers") from None
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if not path:
            continue
        if os.path.isdir(path):
            raise SpecjaxError(f"{flag} {path} is a directory; pass a file name")
        parent = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise SpecjaxError(f"{flag} {path}: cannot create {parent} ({e.strerror})") from None
        if not os.access(parent, os.W_OK):
            raise SpecjaxError(f"{flag} {path}: {parent} is not writable")


def read_prompts(path: str, tokenizer, vocab_size: int, n: int, target_dir: str
                 ) -> list[list[int]]:
    """The first `n` prompts of `path` as token ids (decode.py's reader and checks)."""
    import decode

    ns = types.SimpleNamespace(prompt=None, prompts=path, target=target_dir)
    return [ids for _, ids in decode.read_prompts(ns, tokenizer, vocab_size)[:n]]


@dataclasses.dataclass
class RunResult:
    outputs: list[list[int]]  # new tokens per row
    call_walls: list[float]  # seconds per generate call
    stats: object | None = None  # engine.Stats (specjax)
    target_forwards: int | None = None  # transformers, counted when asked

    @property
    def wall(self) -> float:
        return sum(self.call_walls)

    @property
    def new_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


class SpecjaxSystem:
    kind = "specjax"

    def __init__(self, name, engine, rows, new_tokens, *, temperature, verify, seed):
        self.name, self.engine, self.rows, self.new_tokens = name, engine, rows, new_tokens
        self.temperature, self.verify, self.seed = temperature, verify, seed
        self.gamma = engine.gamma or None
        self.batch_size = engine.batch_size
        self.compile_s = None

    def compile(self) -> float:
        self.compile_s = self.engine.compile()
        return self.compile_s

    def run(self, count: bool = False) -> RunResult:
        from specjax.engine import Stats

        stats, outputs, walls = Stats(), [], []
        base = jax.random.key(self.seed)
        B = self.batch_size
        for i in range(0, len(self.rows), B):
            key = jax.random.fold_in(base, i // B)  # batch 1: one key per prompt
            t0 = time.perf_counter()
            out = self.engine.run(self.rows[i:i + B], self.new_tokens, key)
            walls.append(time.perf_counter() - t0)
            stats.add(out)
            outputs.extend(out.outputs)
        return RunResult(outputs, walls, stats=stats)


class TransformersSystem:
    kind = "transformers"
    temperature = 0.0
    batch_size = 1
    compile_s = None

    def __init__(self, name, model, rows, new_tokens, threads, *, gamma=None, verify=None,
                 **generate_kwargs):
        import torch

        self.name, self.model, self.new_tokens, self.threads = name, model, new_tokens, threads
        self.gamma, self.verify, self.kwargs, self.torch = gamma, verify, generate_kwargs, torch
        self.ids = [torch.tensor([r], dtype=torch.long) for r in rows]

    def compile(self) -> float:
        return 0.0

    def run(self, count: bool = False) -> RunResult:
        torch = self.torch
        torch.set_num_threads(self.threads)  # process-wide: set before every run
        forwards = [0]
        handle = None
        if count:
            def hook(module, inputs):
                forwards[0] += 1
            handle = self.model.register_forward_pre_hook(hook)
        outputs, walls = [], []
        try:
            with torch.inference_mode():
                for ids in self.ids:
                    mask = torch.ones_like(ids)
                    t0 = time.perf_counter()
                    out = self.model.generate(
                        ids, attention_mask=mask, do_sample=False,
                        max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens,
                        eos_token_id=None, use_cache=True, **self.kwargs)
                    walls.append(time.perf_counter() - t0)
                    outputs.append(out[0, ids.shape[1]:].tolist())
        finally:
            if handle is not None:
                handle.remove()
        return RunResult(outputs, walls, target_forwards=forwards[0] if count else None)


def measure(systems, repeats: int, new_tokens: int) -> dict:
    """Compile + one untimed warm-up per system, then `repeats` interleaved timed runs."""
    res = {}
    for s in systems:
        c = s.compile()
        log(f"{s.name}: compile {c:.2f} s; warm-up run" if c else f"{s.name}: warm-up run")
        ref = s.run(count=True)
        short = [len(o) for o in ref.outputs if len(o) != new_tokens]
        if short:
            log(f"WARNING: {s.name} generated {short[0]} tokens for a row, not {new_tokens}")
        res[s.name] = {"ref": ref, "runs": [], "stable": True}
    for r in range(repeats):
        k = r % len(systems)
        for s in systems[k:] + systems[:k]:
            run = s.run()
            entry = res[s.name]
            if run.outputs != entry["ref"].outputs:
                entry["stable"] = False
                log(f"WARNING: {s.name}: output changed between runs")
            entry["runs"].append(run)
            log(f"repeat {r + 1}/{repeats} {s.name}: {run.new_tokens} tokens in "
                f"{run.wall:.2f} s, {run.new_tokens / run.wall:.1f} tok/s")
    return res


def system_record(s, m: dict) -> dict:
    """Raw figures of one measured system."""
    ref, runs = m["ref"], m["runs"]
    rec = {
        "kind": s.kind, "temperature": s.temperature, "verify": s.verify, "gamma": s.gamma,
        "batch_size": s.batch_size, "rows": len(ref.outputs),
        "new_tokens_per_run": ref.new_tokens,
        "wall_s": [r.wall for r in runs],
        "call_wall_s": [r.call_walls for r in runs],
        "tokens_per_s": summary([r.new_tokens / r.wall for r in runs]),
        "compile_s": s.compile_s,
        "tau": None, "alpha": None, "steps": None, "accepted": None, "target_forwards": None,
        "outputs_stable": m["stable"],
        "outputs": ref.outputs,
    }
    if ref.stats is not None:
        rec["engine_wall_s"] = [r.stats.wall_s for r in runs]
        rec["steps"] = ref.stats.steps
        if s.gamma:
            rec["accepted"] = ref.stats.accepted.tolist()
            rec["tau"] = ref.stats.tau
            rec["alpha"] = ref.stats.alpha
    if ref.target_forwards is not None:
        rec["target_forwards"] = ref.target_forwards
        if s.gamma:
            rec["tau"] = ref.new_tokens / ref.target_forwards
    return rec


def equality(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    same = [a == b for a, b in zip(outputs, reference, strict=True)]
    prefixes = [common_prefix(a, b) for a, b in zip(outputs, reference, strict=True)]
    return {"equal": sum(same), "of": len(same), "per_prompt": same,
            "mean_common_prefix": statistics.mean(prefixes), "common_prefix": prefixes}


def _compact(rec: dict, name: str) -> dict:
    """A sweep entry: the record without its outputs (equality is recorded instead)."""
    return {"system": name} | {k: v for k, v in rec.items() if k != "outputs"}


def _fmt(x, spec=".1f", suffix=""):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec) + suffix


def render_tables(result: dict) -> str:
    systems = result["systems"]
    lines = ["| system | T | verify | tokens/s median | spread (min-max) | tau | alpha_k "
             "| speedup vs specjax-ar (same T) | speedup vs transformers-greedy "
             "| equal to transformers greedy (n/N) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in systems.items():
        t = s["tokens_per_s"]
        alpha = " ".join(_fmt(a, ".2f") for a in s["alpha"]) if s.get("alpha") else "-"
        eq = s.get("equal_to_transformers_greedy")
        if name == "transformers-greedy":
            eq_s = "reference"
        elif eq is None:
            eq_s = "-"
        else:
            eq_s = f"{eq['equal']}/{eq['of']} (prefix {eq['mean_common_prefix']:.1f})"
        lines.append(
            f"| {name} | {s['temperature']:g} | {s['verify'] or '-'} | {t['median']:.1f} "
            f"| {t['min']:.1f}-{t['max']:.1f} | {_fmt(s['tau'], '.2f')} | {alpha} "
            f"| {_fmt(s.get('speedup_vs_specjax_ar'), '.2f', 'x')} "
            f"| {_fmt(s.get('speedup_vs_transformers_greedy'), '.2f', 'x')} | {eq_s} |")
    sweep = result["batch_sweep"]
    if sweep:
        lines += ["", "| batch | AR tok/s | spec tok/s | tau | speedup | spec == AR |",
                  "|---|---|---|---|---|---|"]
        for b in sweep:
            lines.append(f"| {b['batch_size']} | {b['ar']['tokens_per_s']['median']:.1f} "
                         f"| {b['spec']['tokens_per_s']['median']:.1f} "
                         f"| {_fmt(b['spec']['tau'], '.2f')} | {b['speedup']:.2f}x "
                         f"| {b['spec_equals_ar']} |")
    return "\n".join(lines)


def write_plot(path: str, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    systems = result["systems"]
    names = list(systems)
    med = [systems[n]["tokens_per_s"]["median"] for n in names]
    err = [[m - systems[n]["tokens_per_s"]["min"] for n, m in zip(names, med, strict=True)],
           [systems[n]["tokens_per_s"]["max"] - m for n, m in zip(names, med, strict=True)]]
    colors = ["tab:blue" if systems[n]["temperature"] == 0 else "tab:orange" for n in names]
    hatches = ["//" if systems[n]["kind"] == "transformers" else "" for n in names]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5),
                                   gridspec_kw={"width_ratios": [1.6, 1]})
    bars = ax1.bar(range(len(names)), med, yerr=err, capsize=4, color=colors,
                   edgecolor="black", linewidth=0.6)
    for bar, h, m in zip(bars, hatches, med, strict=True):
        bar.set_hatch(h)
        ax1.annotate(f"{m:.0f}", (bar.get_x() + bar.get_width() / 2, m), ha="center",
                     va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
    ax1.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
    ax1.set_ylabel("new tokens/s (median, min-max bars)")
    ax1.set_title(f"batch 1, {result['prompts']['count']} prompts x {result['new_tokens']} "
                  f"tokens, G={result['gamma']}")
    ax1.legend(handles=[Patch(color="tab:blue", label="T=0 (greedy)"),
                        Patch(color="tab:orange", label="T=1"),
                        Patch(facecolor="white", edgecolor="black", hatch="//",
                              label="transformers")], fontsize=8)
    G = result["gamma"]
    for n in ALPHA_SYSTEMS:
        alpha = systems.get(n, {}).get("alpha")
        if alpha:
            ax2.plot(range(1, G + 1), [math.nan if a is None else a for a in alpha],
                     marker="o", label=n)
    ax2.set_xticks(range(1, G + 1))
    ax2.set_xlabel("draft position k")
    ax2.set_ylabel("alpha_k (accepted | earlier accepted)")
    ax2.set_ylim(0, 1.05)
    ax2.set_title("acceptance by draft position")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    from specjax.fileio import atomic_write

    data = buf.getvalue()
    atomic_write(path, lambda f: f.write(data))


def run(args) -> dict:
    from specjax.checkpoint import load_model, load_tokenizer
    from specjax.drafters.draft_lm import DraftLMDrafter
    from specjax.drafters.ngram import NgramDrafter
    from specjax.engine import Engine, prompt_width_for
    from specjax.fileio import atomic_write
    from specjax.sampling import SamplingParams

    validate(args)
    cores = usable_cores()
    threads = args.threads or cores
    G, N_new = args.gamma, args.new_tokens
    load0 = os.getloadavg()

    target = load_model(args.target, dtype=jnp.float32)
    draft = load_model(args.draft, dtype=jnp.float32)
    V = target.cfg.vocab_size
    tokenizer = load_tokenizer(args.target)
    prompts = read_prompts(args.prompts, tokenizer, V, args.num_prompts, args.target)
    n = len(prompts)
    longest = max(len(p) for p in prompts)
    max_length = longest + N_new
    prompt_width = prompt_width_for(longest, max_length)
    greedy, t1 = SamplingParams(), SamplingParams(temperature=1.0)
    draft0, dparams0 = DraftLMDrafter.create(draft, G, greedy, V)  # checks the vocabulary
    draft1, dparams1 = DraftLMDrafter.create(draft, G, t1, V)
    ngram = NgramDrafter(G, V, sampling=greedy)
    # Input is checked: from here on stderr carries progress, not one error line.
    if load0[0] > 0.5 * cores:
        log(f"WARNING: load average {load0[0]:.2f} on {cores} cores: timings are indicative")
        if threads >= cores and not args.no_transformers:
            log("WARNING: torch on every core slows down badly when other processes share "
                "the CPUs; compare with --threads 1")
    if len(prompts) < args.num_prompts:
        log(f"{args.prompts} holds {len(prompts)} prompts, fewer than --num-prompts "
            f"{args.num_prompts}: using them all")
    log(f"target {target.cfg.num_params / 1e6:.2f}M params, draft "
        f"{draft.cfg.num_params / 1e6:.2f}M, {n} prompts ({longest} tokens at most), "
        f"{N_new} new tokens, G={G}, {args.repeats} repeats, {cores} cores, torch threads "
        f"{threads}, load average {load0[0]:.2f}")

    def engine(batch_size=1, drafter=None, dparams=None, sampling=greedy, verify="block"):
        return Engine(target, drafter=drafter, drafter_params=dparams, sampling=sampling,
                      verify=verify, max_length=max_length, prompt_width=prompt_width,
                      batch_size=batch_size, eos_token_ids=())

    def spec(name, eng, rows=prompts, temperature=0.0, verify=None):
        return SpecjaxSystem(name, eng, rows, N_new, temperature=temperature, verify=verify,
                             seed=args.seed)

    systems = []
    if not args.no_transformers:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        hf_target = load_transformers(args.target)
        hf_draft = load_transformers(args.draft)
        agc = hf_draft.generation_config
        agc.num_assistant_tokens = G
        agc.num_assistant_tokens_schedule = "constant"
        agc.assistant_confidence_threshold = 0.0  # never stop drafting before G tokens
        systems += [
            TransformersSystem("transformers-greedy", hf_target, prompts, N_new, threads),
            TransformersSystem("transformers-assisted", hf_target, prompts, N_new, threads,
                               gamma=G, verify="greedy", assistant_model=hf_draft),
            TransformersSystem("transformers-prompt-lookup", hf_target, prompts, N_new, threads,
                               gamma=G, verify="greedy", prompt_lookup_num_tokens=G,
                               max_matching_ngram_size=ngram.n_max),
        ]
    systems += [
        spec("specjax-ar", engine()),
        spec("specjax-draft", engine(drafter=draft0, dparams=dparams0), verify="greedy"),
        spec("specjax-ngram", engine(drafter=ngram, dparams=()), verify="greedy"),
        spec("specjax-ar-T1", engine(sampling=t1), temperature=1.0),
        spec("specjax-draft-T1-token",
             engine(drafter=draft1, dparams=dparams1, sampling=t1, verify="token"),
             temperature=1.0, verify="token"),
        spec("specjax-draft-T1-block",
             engine(drafter=draft1, dparams=dparams1, sampling=t1, verify="block"),
             temperature=1.0, verify="block"),
    ]
    sweep_systems = {}
    for B in args.batch_sizes:
        if B == 1:
            continue
        rows = [prompts[i % n] for i in range(-(-n // B) * B)]
        sweep_systems[B] = (
            spec(f"specjax-ar-B{B}", engine(batch_size=B), rows=rows),
            spec(f"specjax-draft-B{B}", engine(B, draft0, dparams0), rows=rows,
                 verify="greedy"))
    all_systems = systems + [s for pair in sweep_systems.values() for s in pair]
    measured = measure(all_systems, args.repeats, N_new)

    # ---- main table
    records = {s.name: system_record(s, measured[s.name]) for s in systems}
    outs = {name: measured[name]["ref"].outputs for name in records}
    hf = outs.get("transformers-greedy")
    med = {name: r["tokens_per_s"]["median"] for name, r in records.items()}
    lossless = {}
    for name, rec in records.items():
        ar_ref = "specjax-ar-T1" if rec["temperature"] else "specjax-ar"
        rec["speedup_vs_specjax_ar"] = med[name] / med[ar_ref]
        rec["speedup_vs_transformers_greedy"] = (med[name] / med["transformers-greedy"]
                                                 if hf is not None else None)
        rec["equal_to_transformers_greedy"] = (equality(outs[name], hf)
                                               if hf is not None and rec["temperature"] == 0
                                               else None)
        rec["equals_specjax_ar"] = None
        if name in T0_SPECULATIVE:
            rec["equals_specjax_ar"] = lossless[name] = outs[name] == outs["specjax-ar"]

    # ---- batch sweep
    sweep = []
    ar1 = outs["specjax-ar"]
    for B in args.batch_sizes:
        if B == 1:
            ar_rec, sp_rec = records["specjax-ar"], records["specjax-draft"]
            ar_out, sp_out = ar1, outs["specjax-draft"]
        else:
            s_ar, s_sp = sweep_systems[B]
            ar_rec = system_record(s_ar, measured[s_ar.name])
            sp_rec = system_record(s_sp, measured[s_sp.name])
            ar_out, sp_out = ar_rec["outputs"], sp_rec["outputs"]
            lossless[s_sp.name] = sp_out == ar_out
        sweep.append({
            "batch_size": B, "rows": len(ar_out),
            "ar": _compact(ar_rec, "specjax-ar" if B == 1 else s_ar.name),
            "spec": _compact(sp_rec, "specjax-draft" if B == 1 else s_sp.name),
            "speedup": sp_rec["tokens_per_s"]["median"] / ar_rec["tokens_per_s"]["median"],
            "spec_equals_ar": sp_out == ar_out,
            "ar_equals_batch1_ar": all(o == ar1[i % n] for i, o in enumerate(ar_out)),
        })

    env = environment([threads])
    result = {
        "args": vars(args),
        "environment": env,
        "load_average": {"start": load0, "end": os.getloadavg()},
        "models": {
            "target": {"path": os.path.abspath(args.target),
                       "num_params": target.cfg.num_params, "family": target.cfg.family,
                       "vocab_size": V},
            "draft": {"path": os.path.abspath(args.draft), "num_params": draft.cfg.num_params,
                      "family": draft.cfg.family},
        },
        "prompts": {"path": os.path.abspath(args.prompts), "count": n,
                    "lengths": [len(p) for p in prompts], "prompt_width": prompt_width,
                    "max_length": max_length},
        "gamma": G, "new_tokens": N_new, "repeats": args.repeats, "threads": threads,
        "systems": records, "lossless": lossless, "batch_sweep": sweep,
    }
    assert set(result) == set(JSON_KEYS), sorted(set(result) ^ set(JSON_KEYS))

    end = result["load_average"]["end"][0]
    print(f"## specjax vs transformers: target {target.cfg.num_params / 1e6:.2f}M params, "
          f"draft LM {draft.cfg.num_params / 1e6:.2f}M, f32, G={G}, {n} prompts x {N_new} "
          f"new tokens, {args.repeats} interleaved repeats\n")
    print(f"{jax.default_backend()} backend, jax {env['jax']}, torch {env.get('torch', '-')}, "
          f"transformers {env.get('transformers', '-')}, {cores} cores, torch threads {threads}, "
          f"load average {load0[0]:.2f} -> {end:.2f}\n")
    print(render_tables(result))
    print()
    comp = ", ".join(f"{s.name} {s.compile_s:.1f}" for s in all_systems if s.compile_s)
    print(f"compile s (excluded from tokens/s): {comp}")
    for name, ok in lossless.items():
        print(f"lossless: {name} output == AR output (T=0): {ok}")
    if hf is not None:
        eq = records["specjax-ar"]["equal_to_transformers_greedy"]
        print(f"parity: specjax-ar == transformers-greedy on {eq['equal']}/{eq['of']} prompts "
              f"(mean common prefix {eq['mean_common_prefix']:.1f} of {N_new})")
    distinct = len({t for o in ar1 for t in o})
    if distinct < 4:
        print(f"NOTE: greedy outputs hold only {distinct} distinct tokens: the equality "
              "checks compare little")
    if load0[0] > 0.5 * cores:
        print(f"NOTE: load average {load0[0]:.2f} on {cores} cores before the run: other "
              "processes were using the CPUs, so these timings are only indicative")
    if args.json:
        text = (json.dumps(result, indent=1) + "\n").encode()
        atomic_write(args.json, lambda f: f.write(text))
        log(f"wrote {args.json}")
    if args.plot:
        write_plot(args.plot, result)
        log(f"wrote {args.plot}")
    return result


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except SpecjaxError as e:
        print(f"compare.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
