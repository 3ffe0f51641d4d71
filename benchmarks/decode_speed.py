"""Decode speed on CPU: specjax autoregressive and self-drafted speculative decoding
against transformers `generate` and the weight-bandwidth floor, in ONE process.

    python benchmarks/decode_speed.py                      # 27.8M Qwen3, 128 tokens, 5 repeats
    python benchmarks/decode_speed.py --quick --repeats 1  # smoke run (seconds)
    python benchmarks/decode_speed.py --threads 2 1 --json out/decode_speed.json

The full run takes under a minute on a quiet 2-core machine (several under load).

Systems (batch 1, f32, greedy, EOS disabled so each generates exactly --new-tokens):
  transformers   `AutoModelForCausalLM.generate` (torch, use_cache) on the same weights
                 (the specjax model is exported with `save_model` and loaded back)
  specjax-ar     decode.py's engine without a drafter (one jitted while_loop)
  specjax-self-G decode.py's engine with the target itself as its draft LM of G tokens:
                 every draft is accepted (tau = G+1), so this bounds the loop's
                 overhead; on CPU it costs MORE than AR (G drafter forwards + one
                 (G+1)-token verification per step, docs/design.md section 9)
  floor          memory bandwidth (jitted sum over a large f32 array, measured in this
                 run) / weight bytes (num_params * 4; a tied embedding is read once
                 per token by the LM head, the embedding gather reads one row)

Timed runs are interleaved (one of each system per repeat, in rotating order) after
one untimed warm-up each; compile time is reported separately. Wall time of a run
includes the prefill of the prompt, for every system alike. Progress goes to stderr,
the markdown table to stdout, and `--json PATH` writes every raw figure.

Weights are random, re-drawn at a scale where greedy decoding does not repeat one token
(`--init varied`), so the parity check (specjax AR tokens == transformers tokens, and
every speculative run == AR) compares a varied sequence. The model is exported once
(`save_model`, f32) to a temporary directory that transformers and the specjax systems
load: each specjax system is a decoding session (`benchmarks.lib.sessions`: `python
decode.py --target DIR [--drafter DIR --gamma G] --ignore-eos --dtype float32`).

CPU figures do not predict accelerator speedups (docs/design.md section 9).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

# The benchmark measures ONE CPU device; a simulated multi-device setting (tests set
# JAX_NUM_CPU_DEVICES=8) would split the host's threads. Set before jax is imported.
os.environ.pop("JAX_NUM_CPU_DEVICES", None)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # uninstalled checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.lib import sessions  # noqa: E402
from benchmarks.lib.provenance import environment, usable_cores  # noqa: E402
from benchmarks.lib.stats import common_prefix, summary  # noqa: E402
from benchmarks.lib.systems import load_transformers  # noqa: E402
from specjax import cli  # noqa: E402
from specjax.errors import SpecjaxError  # noqa: E402
from specjax.fileio import atomic_write, check_output_file  # noqa: E402
from specjax.models.checkpoint import save_model  # noqa: E402
from specjax.models.config import ModelConfig  # noqa: E402
from specjax.models.model import Transformer, layer_shapes  # noqa: E402

FULL = dict(vocab_size=8192, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
            head_dim=64, intermediate_size=1408)
QUICK = dict(vocab_size=1024, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=32, intermediate_size=352)
JSON_KEYS = ("config", "num_params", "weight_bytes", "new_tokens", "prompt_tokens", "repeats",
             "init", "threads", "environment", "bandwidth", "floor_tokens_per_s", "systems",
             "parity", "load_average")


def log(msg: str) -> None:
    print(f"[decode_speed] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None):
    ap = cli.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per system")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens generated per run")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="random prompt length")
    ap.add_argument("--gammas", type=int, nargs="*", default=[4, 8],
                    help="draft lengths G of the self-drafted speculative runs")
    ap.add_argument("--bandwidth-mib", type=int, default=None,
                    help="array size of the bandwidth probe (default 1024, --quick 128)")
    ap.add_argument("--threads", type=int, nargs="+", default=None,
                    help="torch thread counts, one transformers row each (default: the cores "
                         "this process may use); the first is the reference of the ratio column. "
                         "With other processes on the CPUs, torch on every core collapsed "
                         "(2-6 tok/s against ~90 with 1 thread): `--threads 2 1` shows both")
    ap.add_argument("--quick", action="store_true",
                    help="a 0.5M config for a smoke run (it fits in cache: its floor means nothing)")
    ap.add_argument("--no-transformers", action="store_true",
                    help="skip transformers (no torch needed)")
    ap.add_argument("--init", choices=("varied", "specjax"), default="varied",
                    help="varied: weights re-drawn so greedy output is not one repeated token "
                         "(default); specjax: the model's own init (std 0.02)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write all raw figures to this JSON file (checked before "
                    "the run; a missing directory is created when the file is written)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.new_tokens < 1 or args.prompt_tokens < 1:
        ap.error("--repeats, --new-tokens and --prompt-tokens must be >= 1")
    if any(g < 1 for g in args.gammas):
        ap.error("--gammas must be >= 1")
    if args.threads and any(t < 1 for t in args.threads):
        ap.error("--threads must be >= 1")
    if args.json:
        try:
            check_output_file(args.json, "--json", create_parent=True)
        except SpecjaxError as e:
            ap.error(str(e))
    return args


def model_config(quick: bool) -> ModelConfig:
    shape = QUICK if quick else FULL
    return ModelConfig(family="qwen3", rope_theta=1_000_000.0, tie_word_embeddings=True,
                       max_position_embeddings=4096, eos_token_ids=(), **shape)


def redraw_weights(model: Transformer, seed: int, gain: float = 2.0) -> None:
    """Re-draws the embedding (std 1) and every projection (std gain / sqrt(fan_in)) in place,
    norms left at 1. At specjax's default init (std 0.02) greedy decoding of a random model
    repeats one token; these weights give a varied greedy sequence (about 127 distinct
    tokens of 128 for the full config), so the parity check compares something. Speed
    does not depend on the values."""
    key = jax.random.key(seed)
    names = ["embed", *(n for n in layer_shapes(model.cfg) if not n.endswith("norm"))]
    if model.lm_head is not None:
        names.append("lm_head")
    for i, name in enumerate(names):
        var = getattr(model, name)
        w = var[...]
        std = 1.0 if name == "embed" else gain / np.sqrt(w.shape[-1])
        var[...] = (std * jax.random.normal(jax.random.fold_in(key, i), w.shape)).astype(w.dtype)


def measure_bandwidth(mib: int, repeats: int = 5) -> dict:
    """GB/s of a jitted f32 sum over a `mib` MiB array (median of `repeats`)."""
    n = mib * 2**20 // 4
    x = jnp.full((n,), 1.0, jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()  # compile + first touch
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        total(x).block_until_ready()
        samples.append(n * 4 / (time.perf_counter() - t0) / 1e9)
    del x
    return {"array_bytes": n * 4, "samples_gbps": samples, **summary(samples)}


class SpecjaxSystem:
    """decode.py's engine for the exported model `model_dir`: autoregressive, or (gamma >
    0) with the model as its own draft LM of `gamma` tokens; greedy, batch 1, EOS off."""

    def __init__(self, name, model_dir, prompt, new_tokens, gamma=0):
        self.name, self.gamma = name, gamma
        self.prompt, self.new_tokens = prompt, new_tokens
        cfg = sessions.config(target=model_dir, drafter=model_dir if gamma else "none",
                              gamma=gamma or None, dtype="float32", ignore_eos=True,
                              max_new_tokens=new_tokens)
        self.engine = sessions.engine(cfg, [prompt])
        self.compile_s = None
        self.taus: list[float] = []

    def compile(self) -> float:
        self.compile_s = self.engine.compile()
        return self.compile_s

    def run(self):
        out = self.engine.run([self.prompt], self.new_tokens, jax.random.key(0))
        steps = int(out.steps.sum())
        tau = 1.0 + float(out.accepted.sum()) / steps if self.gamma and steps else None
        return out.outputs[0], out.wall_s, tau


class TransformersSystem:
    def __init__(self, name, model, prompt, new_tokens, threads):
        import torch

        self.name, self.model, self.threads, self.torch = name, model, threads, torch
        self.ids = torch.tensor([prompt], dtype=torch.long)
        self.mask = torch.ones_like(self.ids)
        self.new_tokens = new_tokens
        self.compile_s = None
        self.gamma = None

    def compile(self) -> float:
        return 0.0

    def run(self):
        torch = self.torch
        torch.set_num_threads(self.threads)  # process-wide: set before every run
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model.generate(
                self.ids, attention_mask=self.mask, do_sample=False,
                max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens,
                eos_token_id=None, use_cache=True)
            wall = time.perf_counter() - t0
        return out[0, self.ids.shape[1]:].tolist(), wall, None


def render_table(result: dict) -> str:
    systems = result["systems"]
    refs = [s for n, s in systems.items() if n.startswith("transformers")]
    ref = refs[0]["tokens_per_s"]["median"] if refs else None
    floor = result["floor_tokens_per_s"]
    lines = ["| system | tokens/s median | min | max | tau | vs transformers | of floor | compile s |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in systems.items():
        t = s["tokens_per_s"]
        tau = f"{s['tau']:.2f}" if s.get("tau") is not None else "-"
        ratio = f"{t['median'] / ref:.2f}x" if ref else "-"
        comp = f"{s['compile_s']:.1f}" if s.get("compile_s") else "-"
        lines.append(f"| {name} | {t['median']:.1f} | {t['min']:.1f} | {t['max']:.1f} | {tau} "
                     f"| {ratio} | {t['median'] / floor:.2f} | {comp} |")
    lines.append(f"| floor (bandwidth / weight bytes) | {floor:.1f} | - | - | - | "
                 f"{floor / ref:.2f}x | 1.00 | - |" if ref else
                 f"| floor (bandwidth / weight bytes) | {floor:.1f} | - | - | - | - | 1.00 | - |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    cores = usable_cores()
    threads = args.threads or [cores]
    cfg = model_config(args.quick)
    weight_bytes = cfg.num_params * 4
    load0 = os.getloadavg()
    log(f"config {cfg.num_params / 1e6:.2f}M params ({weight_bytes / 1e6:.1f} MB f32), "
        f"{args.new_tokens} new tokens, prompt {args.prompt_tokens}, {args.repeats} repeats, "
        f"{cores} cores, torch threads {threads}, load average {load0[0]:.2f}")
    if load0[0] > 0.5 * cores:
        log(f"WARNING: load average {load0[0]:.2f} on {cores} cores: timings are indicative")

    mib = args.bandwidth_mib or (128 if args.quick else 1024)
    log(f"measuring bandwidth ({mib} MiB jitted sum)")
    bandwidth = measure_bandwidth(mib)
    floor = bandwidth["median"] * 1e9 / weight_bytes
    log(f"bandwidth {bandwidth['median']:.1f} GB/s -> floor {floor:.1f} tokens/s")

    target = Transformer(cfg, rngs=nnx.Rngs(args.seed))
    if args.init == "varied":
        redraw_weights(target, args.seed + 1)
    prompt = np.random.default_rng(args.seed).integers(
        2, cfg.vocab_size, size=args.prompt_tokens).tolist()

    systems = []
    with tempfile.TemporaryDirectory(prefix="decode_speed_") as d:
        path = os.path.join(d, "model")
        save_model(target, path)  # f32: every system reads the same weights
        if not args.no_transformers:
            hf_model = load_transformers(path)
            attn_impl = getattr(hf_model.config, "_attn_implementation", None)
            for t in threads:
                name = "transformers" if len(threads) == 1 else f"transformers-{t}t"
                systems.append(TransformersSystem(name, hf_model, prompt, args.new_tokens, t))
        # sessions load their weights here, while the directory exists
        systems.append(SpecjaxSystem("specjax-ar", path, prompt, args.new_tokens))
        for g in args.gammas:
            systems.append(SpecjaxSystem(f"specjax-self-G{g}", path, prompt, args.new_tokens,
                                         g))

    outputs, samples, taus = {}, {s.name: [] for s in systems}, {s.name: [] for s in systems}
    for s in systems:
        c = s.compile()
        log(f"{s.name}: compile {c:.2f} s; warm-up run")
        outputs[s.name], wall, _ = s.run()
        if len(outputs[s.name]) != args.new_tokens:
            raise RuntimeError(f"{s.name} generated {len(outputs[s.name])} tokens, "
                               f"expected {args.new_tokens}")
    for r in range(args.repeats):
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for s in order:
            toks, wall, tau = s.run()
            if toks != outputs[s.name]:
                raise RuntimeError(f"{s.name}: output changed between runs")
            samples[s.name].append(wall)
            if tau is not None:
                taus[s.name].append(tau)
        log(f"repeat {r + 1}/{args.repeats}: " + ", ".join(
            f"{s.name} {args.new_tokens / samples[s.name][-1]:.1f} tok/s" for s in systems))

    ar = outputs["specjax-ar"]
    parity = {"specjax_ar_tokens": ar, "distinct_tokens": len(set(ar))}
    hf_names = [s.name for s in systems if isinstance(s, TransformersSystem)]
    if hf_names:
        hf = outputs[hf_names[0]]
        parity.update(transformers_tokens=hf, ar_equals_transformers=ar == hf,
                      ar_transformers_common_prefix=common_prefix(ar, hf))
    for s in systems:
        if s.name.startswith("specjax-self"):
            parity[f"{s.name}_equals_ar"] = outputs[s.name] == ar

    result = {
        "config": {k: getattr(cfg, k) for k in ("family", *FULL, "tie_word_embeddings")},
        "num_params": cfg.num_params,
        "weight_bytes": weight_bytes,
        "new_tokens": args.new_tokens,
        "prompt_tokens": args.prompt_tokens,
        "repeats": args.repeats,
        "init": args.init,
        "threads": threads,
        "environment": environment(threads),
        "bandwidth": bandwidth,
        "floor_tokens_per_s": floor,
        "systems": {},
        "parity": parity,
        "load_average": {"start": load0, "end": os.getloadavg()},
    }
    if hf_names:
        result["environment"]["attn_implementation"] = attn_impl
    assert set(result) == set(JSON_KEYS), sorted(set(result) ^ set(JSON_KEYS))
    for s in systems:
        tps = [args.new_tokens / w for w in samples[s.name]]
        result["systems"][s.name] = {
            "wall_s": samples[s.name],
            "tokens_per_s": summary(tps),
            "tau": statistics.median(taus[s.name]) if taus[s.name] else None,
            "compile_s": s.compile_s,
            "gamma": s.gamma or None,
            "torch_threads": getattr(s, "threads", None),
            "fraction_of_floor": statistics.median(tps) / floor,
        }

    print(f"## decode speed: Qwen3 {cfg.num_params / 1e6:.2f}M params, f32, batch 1, "
          f"{args.new_tokens} new tokens, prompt {args.prompt_tokens}, "
          f"{args.repeats} interleaved repeats\n")
    print(f"{jax.default_backend()} backend, {cores} cores, torch threads {threads}, bandwidth "
          f"{bandwidth['median']:.1f} GB/s (min {bandwidth['min']:.1f}, max "
          f"{bandwidth['max']:.1f}), weight bytes {weight_bytes / 1e6:.1f} MB, "
          f"load average {load0[0]:.2f} -> {result['load_average']['end'][0]:.2f}\n")
    print(render_table(result))
    print()
    if load0[0] > 0.5 * cores:  # the end value includes this run's own load
        print(f"NOTE: load average {load0[0]:.2f} on {cores} cores before the run: other "
              "processes were using the CPUs, so these timings are only indicative")
    if len(set(ar)) < 4:
        print(f"NOTE: greedy output has only {len(set(ar))} distinct tokens, so the parity "
              "check below is weak (use --init varied)")
    if hf_names:
        if parity["ar_equals_transformers"]:
            print(f"parity: specjax AR greedy == transformers greedy ({len(ar)} tokens, "
                  f"{len(set(ar))} distinct)")
        else:
            print(f"parity: specjax AR and transformers agree on the first "
                  f"{parity['ar_transformers_common_prefix']} of {len(ar)} tokens")
    for k, v in parity.items():
        if k.endswith("_equals_ar"):
            print(f"lossless: {k[:-len('_equals_ar')]} output == AR: {v}")
    if args.json:
        text = json.dumps(result, indent=2).encode()
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        atomic_write(args.json, lambda f: f.write(text))
        log(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
