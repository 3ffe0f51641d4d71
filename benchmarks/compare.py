"""specjax against transformers on one target model: autoregressive, draft-LM, n-gram and
learned-drafter speculative decoding, greedy and sampled, and a batch-size sweep, in ONE
process.

    python benchmarks/compare.py                 # demo target + drafters, 8 prompts x 128 tokens
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
  specjax-<name>[-T1-token|-T1-block]   each learned drafter directory of --drafters (train.py
                              exports: eagle3, kv, hybrid, block), named by its directory,
                              at the G it was trained for, T=0 and T=1 (token and block)
Batch sweep: specjax-ar and every T=0 model drafter (draft LM and learned) at each
--batch-sizes B over the same first --num-prompts prompts, repeated cyclically to fill
every batch (B=1 reuses the rows above); throughput = new tokens summed over the batch /
wall.

The same prompts (encoded once with the target's tokenizer) and the same weights (the
--target and --draft directories, loaded by specjax and by transformers) are used
everywhere. The T=1 runs use one PRNG key per prompt, the same for every T=1 system.

Timing: each system first compiles (specjax `Engine.compile()`, reported separately and
excluded) and runs once untimed (warm-up); then --repeats timed runs per system, interleaved
(one run of every system per repeat, in rotating order). A run generates for every prompt;
its wall is the sum of `time.perf_counter()` around each generate call (prefill included,
for every system alike); tokens/s = new tokens of all prompts / that wall (median, min and
max over repeats). tau = 1 + accepted / target steps and alpha_k = accepted at draft
position k / steps reaching k (engine.Stats, docs/design.md section 7); for transformers'
speculative systems tau = new tokens / target forwards (counted in the warm-up).
Progress goes to stderr, markdown tables to stdout; --json writes every raw figure and
--plot a PNG. Bad input exits with code 2 and one line on stderr, writing nothing.

CPU figures do not predict accelerator speedups (docs/design.md section 9): on CPU a
(G+1)-token f32 verification costs about 1.8x a one-token step (2-2.5x before
`specjax.models.model.linear` took few-row products weight-major, 2026-11-25).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# The benchmark measures ONE CPU device; a simulated multi-device setting (tests set
# JAX_NUM_CPU_DEVICES=8) would split the host's threads. Set before jax is imported.
os.environ.pop("JAX_NUM_CPU_DEVICES", None)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)  # uninstalled checkout

import jax  # noqa: E402

from benchmarks.lib import sessions  # noqa: E402
from benchmarks.lib.compare_tables import render_tables, write_plot  # noqa: E402
from benchmarks.lib.prompts import prompt_ids  # noqa: E402
from benchmarks.lib.provenance import environment, usable_cores  # noqa: E402
from benchmarks.lib.stats import equality  # noqa: E402
from benchmarks.lib.systems import (  # noqa: E402
    SpecjaxSystem,
    TransformersSystem,
    compact,
    load_transformers,
    measure,
    system_record,
)
from specjax import cli  # noqa: E402
from specjax.errors import SpecjaxError  # noqa: E402

DEMO_DIR = os.path.join(ROOT, "checkpoints", "demo")
DEFAULTS = dict(num_prompts=8, repeats=3, new_tokens=128, batch_sizes=[1, 4, 16])
QUICK = dict(num_prompts=2, repeats=1, new_tokens=16, batch_sizes=[1, 2])
JSON_KEYS = ("args", "environment", "load_average", "models", "prompts", "gamma",
             "new_tokens", "repeats", "threads", "systems", "lossless", "batch_sweep")
TRANSFORMERS_SYSTEMS = ("transformers-greedy", "transformers-assisted",
                        "transformers-prompt-lookup")


def log(msg: str) -> None:
    print(f"[compare] {msg}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    ap = cli.ArgumentParser(
        prog="compare.py",
        description="specjax (AR, draft LM, n-gram; T=0 and T=1; batch sweep) "
                    "against transformers generate on one target model.")
    ap.add_argument("--target", default=os.path.join(DEMO_DIR, "target"),
                    help="HF checkpoint directory of the target (default: the demo target)")
    ap.add_argument("--draft", default=os.path.join(DEMO_DIR, "draft"),
                    help="HF checkpoint directory of the draft LM (default: the demo draft)")
    ap.add_argument("--drafters", nargs="*", default=None,
                    help="learned drafter directories written by train.py (default: every "
                         "one in drafters/ beside --target, as checkpoints/demo/ ships them); "
                         "each runs at its trained G")
    ap.add_argument("--draft-vocab", choices=("auto", "full"), default="auto",
                    help="learned drafters: draft over the directory's hot vocabulary "
                         "(draft_vocab.json) or all ids; default auto, as decode.py")
    ap.add_argument("--prompts", default=os.path.join(DEMO_DIR, "prompts.jsonl"),
                    help='JSONL, one object a line with "prompt" (text) or "input_ids"')
    ap.add_argument("--num-prompts", type=int, default=None,
                    help=f"first N prompts (default {DEFAULTS['num_prompts']}, "
                         f"--quick {QUICK['num_prompts']})")
    ap.add_argument("--new-tokens", type=int, default=None,
                    help=f"new tokens per prompt, exactly (default {DEFAULTS['new_tokens']}, "
                         f"--quick {QUICK['new_tokens']})")
    ap.add_argument("--gamma", type=int, default=4,
                    help="draft length G of the draft LM and n-gram drafters")
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
    if args.drafters is None:
        beside = os.path.join(os.path.dirname(os.path.abspath(args.target)), "drafters")
        found = sorted(os.listdir(beside)) if os.path.isdir(beside) else []
        args.drafters = [os.path.join(beside, d) for d in found
                         if os.path.isdir(os.path.join(beside, d))]
    from specjax.drafters.config import DrafterConfig

    for path in args.drafters:
        if not DrafterConfig.is_drafter_dir(path):
            raise SpecjaxError(f"--drafters {path} is not a drafter directory written by "
                               "train.py (no specjax-drafter config.json)")
    names = [os.path.basename(os.path.normpath(p)) for p in args.drafters]
    if len(set(names)) < len(names) or {"ar", "draft", "ngram"} & set(names):
        raise SpecjaxError(f"--drafters names {names} must be distinct and not ar, draft or "
                           "ngram (the directory name names the system)")
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
    from specjax.fileio import check_output_file

    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if not path:
            continue
        parent = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise SpecjaxError(f"{flag} {path}: cannot create {parent} ({e.strerror})") from None
        check_output_file(path, flag)


def _transformers_systems(args, prompts, N_new: int, threads: int, G: int, n_max: int
                          ) -> list:
    """transformers' greedy, assisted (the draft LM, G tokens a round, never stopping
    early) and prompt-lookup generation of the same prompts."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    hf_target = load_transformers(args.target)
    hf_draft = load_transformers(args.draft)
    agc = hf_draft.generation_config
    agc.num_assistant_tokens = G
    agc.num_assistant_tokens_schedule = "constant"
    agc.assistant_confidence_threshold = 0.0  # never stop drafting before G tokens
    return [
        TransformersSystem("transformers-greedy", hf_target, prompts, N_new, threads),
        TransformersSystem("transformers-assisted", hf_target, prompts, N_new, threads,
                           gamma=G, verify="greedy", assistant_model=hf_draft),
        TransformersSystem("transformers-prompt-lookup", hf_target, prompts, N_new, threads,
                           gamma=G, verify="greedy", prompt_lookup_num_tokens=G,
                           max_matching_ngram_size=n_max),
    ]


def _main_records(systems, measured) -> tuple[dict, dict, dict]:
    """The main table: (records by system name, with speedups and equality checks filled
    in; outputs by name; lossless: T=0 speculative name -> output == specjax-ar's)."""
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
        if rec["kind"] == "specjax" and rec["temperature"] == 0 and rec["drafter"]:
            rec["equals_specjax_ar"] = lossless[name] = outs[name] == outs["specjax-ar"]
    return records, outs, lossless


def _batch_sweep(batch_sizes, sweep_drafters, sweep_systems, records, outs, measured,
                 lossless: dict, n: int) -> list:
    """The batch sweep's rows: per batch size and model drafter, AR and speculative
    tokens/s and whether their outputs agree (B > 1 adds its T=0 check to `lossless`)."""
    sweep = []
    ar1 = outs["specjax-ar"]
    for B in batch_sizes:
        if B == 1:
            ar_rec, ar_out, ar_name = records["specjax-ar"], ar1, "specjax-ar"
        else:
            s_ar = sweep_systems[B]["ar"]
            ar_rec = system_record(s_ar, measured[s_ar.name])
            ar_out, ar_name = ar_rec["outputs"], s_ar.name
        for name in sweep_drafters:
            if B == 1:
                sp_name = f"specjax-{name}"
                sp_rec, sp_out = records[sp_name], outs[sp_name]
            else:
                s_sp = sweep_systems[B][name]
                sp_name = s_sp.name
                sp_rec = system_record(s_sp, measured[sp_name])
                sp_out = sp_rec["outputs"]
                lossless[sp_name] = sp_out == ar_out
            sweep.append({
                "batch_size": B, "drafter": name, "rows": len(ar_out),
                "ar": compact(ar_rec, ar_name), "spec": compact(sp_rec, sp_name),
                "speedup": sp_rec["tokens_per_s"]["median"] / ar_rec["tokens_per_s"]["median"],
                "spec_equals_ar": sp_out == ar_out,
                "ar_equals_batch1_ar": all(o == ar1[i % n] for i, o in enumerate(ar_out)),
            })
    return sweep


def _print_report(result: dict, args, target, draft, learned: dict, cores: int,
                  all_systems, ar1) -> None:
    """target, draft: their ModelConfigs; learned: name -> G."""
    """The Markdown tables and the notes under them (compile times, lossless and parity
    checks, warnings about few distinct tokens or a loaded machine) on stdout."""
    env, records, lossless = result["environment"], result["systems"], result["lossless"]
    G, N_new, n, threads = result["gamma"], result["new_tokens"], result["prompts"]["count"], \
        result["threads"]
    load0, end = result["load_average"]["start"], result["load_average"]["end"][0]
    print(f"## specjax vs transformers: target {target.num_params / 1e6:.2f}M params, "
          f"draft LM {draft.num_params / 1e6:.2f}M (G={G}), learned drafters "
          f"{', '.join(f'{k} (G={g})' for k, g in learned.items()) or 'none'} "
          f"(draft vocabulary {args.draft_vocab}), f32, "
          f"{n} prompts x {N_new} new tokens, {args.repeats} interleaved repeats\n")
    print(f"{jax.default_backend()} backend, jax {env['jax']}, torch {env.get('torch', '-')}, "
          f"transformers {env.get('transformers', '-')}, {cores} cores, torch threads {threads}, "
          f"load average {load0[0]:.2f} -> {end:.2f}\n")
    print(render_tables(result))
    print()
    comp = ", ".join(f"{s.name} {s.compile_s:.1f}" for s in all_systems if s.compile_s)
    print(f"compile s (excluded from tokens/s): {comp}")
    for name, ok in lossless.items():
        print(f"lossless: {name} output == AR output (T=0): {ok}")
    if "transformers-greedy" in records:
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


def run(args) -> dict:
    from specjax.fileio import atomic_write
    from specjax.models.config import ModelConfig

    validate(args)
    cores = usable_cores()
    threads = args.threads or cores
    G, N_new = args.gamma, args.new_tokens
    load0 = os.getloadavg()

    # ---- models, prompts and drafters (every input is checked here)
    # every specjax system is a decoding session (decode.py's loading and engines): f32
    # target, EOS off, the draft LM and n-gram at G, learned drafters at their own G
    ar0 = sessions.session(sessions.config(target=args.target, drafter="none",
                                           dtype="float32", ignore_eos=True,
                                           max_new_tokens=N_new))
    target = ar0.model_cfg
    draft = ModelConfig.from_dir(args.draft)
    prompts = prompt_ids(args.prompts, ar0.tokenizer, target.vocab_size, args.num_prompts,
                         args.target)
    n = len(prompts)
    longest = max(len(p) for p in prompts)
    max_length = longest + N_new

    def engine(drafter="none", batch_size=1, temperature=0.0, verify="block"):
        gamma = None if drafter == "none" else G if drafter in (args.draft, "ngram") \
            else "fixed"
        cfg = sessions.config(target=args.target, drafter=drafter, gamma=gamma,
                              dtype="float32", ignore_eos=True, max_new_tokens=N_new,
                              batch_size=batch_size, temperature=temperature, verify=verify,
                              draft_vocab=args.draft_vocab)
        return sessions.engine(cfg, prompts)

    # T=0 speculative systems: drafter name -> its --drafter; each must equal specjax-ar
    learned_dirs = {os.path.basename(os.path.normpath(p)): p for p in args.drafters}
    t0 = {"draft": args.draft, "ngram": "ngram", **learned_dirs}
    t0_engines = {name: engine(d) for name, d in t0.items()}  # checks every drafter
    learned = {name: t0_engines[name].drafter for name in learned_dirs}
    prompt_width = t0_engines["draft"].cfg.prompt_width
    # Input is checked: from here on stderr carries progress, not one error line.
    if load0[0] > 0.5 * cores:
        log(f"WARNING: load average {load0[0]:.2f} on {cores} cores: timings are indicative")
        if threads >= cores and not args.no_transformers:
            log("WARNING: torch on every core slows down badly when other processes share "
                "the CPUs; compare with --threads 1")
    if len(prompts) < args.num_prompts:
        log(f"{args.prompts} holds {len(prompts)} prompts, fewer than --num-prompts "
            f"{args.num_prompts}: using them all")
    log(f"target {target.num_params / 1e6:.2f}M params, draft "
        f"{draft.num_params / 1e6:.2f}M, learned drafters {list(learned) or 'none'}, "
        f"{n} prompts ({longest} tokens at most), {N_new} new tokens, G={G} (draft LM, "
        f"n-gram), {args.repeats} repeats, {cores} cores, torch threads {threads}, load "
        f"average {load0[0]:.2f}")

    # ---- the systems, measured interleaved
    def spec(name, eng, rows=prompts, temperature=0.0, verify=None, drafter=None):
        return SpecjaxSystem(name, eng, rows, N_new, temperature=temperature, verify=verify,
                             seed=args.seed, drafter=drafter)

    systems = []
    if not args.no_transformers:
        systems += _transformers_systems(args, prompts, N_new, threads, G,
                                         t0_engines["ngram"].drafter.n_max)
    t1_drafters = {name: d for name, d in t0.items() if name != "ngram"}
    systems.append(spec("specjax-ar", engine()))
    systems += [spec(f"specjax-{name}", eng, verify="greedy", drafter=name)
                for name, eng in t0_engines.items()]
    systems.append(spec("specjax-ar-T1", engine(temperature=1.0), temperature=1.0))
    for name, d in t1_drafters.items():
        for rule in ("token", "block"):
            systems.append(spec(f"specjax-{name}-T1-{rule}",
                                engine(d, temperature=1.0, verify=rule),
                                temperature=1.0, verify=rule, drafter=name))
    sweep_drafters = [name for name in t0 if name != "ngram"]  # model drafters
    sweep_systems = {}
    for B in args.batch_sizes:
        if B == 1:
            continue
        rows = [prompts[i % n] for i in range(-(-n // B) * B)]
        sweep_systems[B] = {"ar": spec(f"specjax-ar-B{B}", engine(batch_size=B), rows=rows)}
        for name in sweep_drafters:
            sweep_systems[B][name] = spec(f"specjax-{name}-B{B}", engine(t0[name], B),
                                          rows=rows, verify="greedy", drafter=name)
    all_systems = systems + [s for group in sweep_systems.values() for s in group.values()]
    measured = measure(all_systems, args.repeats, N_new, log=log)

    records, outs, lossless = _main_records(systems, measured)
    sweep = _batch_sweep(args.batch_sizes, sweep_drafters, sweep_systems, records, outs,
                         measured, lossless, n)

    env = environment([threads])
    result = {
        "args": vars(args),
        "environment": env,
        "load_average": {"start": load0, "end": os.getloadavg()},
        "models": {
            "target": {"path": os.path.abspath(args.target),
                       "num_params": target.num_params, "family": target.family,
                       "vocab_size": target.vocab_size},
            "draft": {"path": os.path.abspath(args.draft), "num_params": draft.num_params,
                      "family": draft.family},
            "drafters": {name: {"path": os.path.abspath(learned_dirs[name]),
                                "kind": d0.cfg.kind, "gamma": d0.gamma,
                                "context": d0.cfg.context}
                         for name, d0 in learned.items()},
        },
        "prompts": {"path": os.path.abspath(args.prompts), "count": n,
                    "lengths": [len(p) for p in prompts], "prompt_width": prompt_width,
                    "max_length": max_length},
        "gamma": G, "new_tokens": N_new, "repeats": args.repeats, "threads": threads,
        "systems": records, "lossless": lossless, "batch_sweep": sweep,
    }
    assert set(result) == set(JSON_KEYS), sorted(set(result) ^ set(JSON_KEYS))

    _print_report(result, args, target, draft, {k: d.gamma for k, d in learned.items()},
                  cores, all_systems, outs["specjax-ar"])
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
