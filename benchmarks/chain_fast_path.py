"""Does the chain's fast path pay? The same speculative loop with a chain verified as a
chain (no tree mask, the chain rule, no compaction) and as the tree with one child per
node (`specjax.decoding.loop.step.step_phases(chain_as_tree=True)`), in ONE process.

    python benchmarks/chain_fast_path.py                 # eagle3, G 7, 8 prompts x 128 tokens
    python benchmarks/chain_fast_path.py --prompts 4 --json out/chain.json

Batch 1, f32 target, EOS on, the bundled prompts (--kernels, --temperature: the
verification path and the sampling); each prompt runs both programs in
alternating order after one untimed warm-up of each; the figure is tokens/s over all
prompts and the ratio fast / tree. Greedy outputs must be identical (both are lossless).
Progress goes to stderr, the result to stdout; --json writes it
(benchmarks/results/studies/redesign_51/chain_fast_path_off_t0.json by default).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

os.environ.pop("JAX_NUM_CPU_DEVICES", None)  # measure ONE CPU device
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)  # uninstalled checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.lib.provenance import environment, usable_cores  # noqa: E402
from specjax import cli  # noqa: E402
from specjax.decoding.engine import prompt_width_for  # noqa: E402
from specjax.decoding.loop import LoopConfig, step_phases  # noqa: E402
from specjax.decoding.options import DecodeConfig  # noqa: E402
from specjax.decoding.session import build  # noqa: E402
from specjax.fileio import atomic_write, check_output_file  # noqa: E402

OUT = os.path.join(ROOT, "benchmarks", "results", "studies", "redesign_51",
                   "chain_fast_path_off_t0.json")


def program(graphdef, drafter, cfg, chain_as_tree: bool):
    phases = step_phases(graphdef, drafter, cfg, chain_as_tree=chain_as_tree)

    @jax.jit
    def loop(params, drafter_params, prompts, lengths, budgets, key):
        s = phases.start(params, drafter_params, prompts, lengths, budgets, key)
        s = jax.lax.while_loop(lambda s: ~jnp.all(s.done),
                               lambda s: phases.step(params, drafter_params, s), s)
        return s.tokens, s.lengths, s.steps
    return loop


def main(argv=None) -> int:
    ap = cli.ArgumentParser(prog="chain_fast_path.py", description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default=os.path.join(ROOT, "checkpoints", "demo", "drafters",
                                                      "eagle3"))
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--kernels", choices=("off", "reference"), default="off",
                    help="the loop's verification path (reference: the fused jnp twin of the "
                         "Pallas verifier, decode.py's default on CPU; chains only)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy; above it block verification (K = 1 trees: the same rule)")
    ap.add_argument("--json", default=OUT)
    args = ap.parse_args(argv)
    check_output_file(args.json, "--json")
    session = build(DecodeConfig(drafter=args.drafter, gamma=args.gamma, compare_ar=False))
    prompts, _ = session.read_prompts()
    prompts = prompts[:args.prompts]
    session.load()
    graphdef, params = nnx.split(session.target.model)
    drafter, dparams = session.drafter, session.loaded.params
    width = prompt_width_for(max(len(p) for _, p in prompts),
                             max(len(p) for _, p in prompts) + args.new_tokens)
    from specjax.core.sampling import SamplingParams

    sampling = SamplingParams(args.temperature)
    if not sampling.greedy:
        drafter = dataclasses.replace(drafter, sampling=sampling)
    cfg = LoopConfig(max_length=width + args.new_tokens, prompt_width=width,
                     eos_token_ids=tuple(session.model_cfg.eos_token_ids), verify="block",
                     sampling=sampling, kernels=args.kernels)
    programs = {"chain": program(graphdef, drafter, cfg, False),
                "tree": program(graphdef, drafter, cfg, True)}
    budgets = jnp.asarray([args.new_tokens], jnp.int32)
    key = jax.random.key(0)
    totals = {name: [0.0, 0, 0] for name in programs}  # seconds, new tokens, steps
    outputs = {name: [] for name in programs}
    for i, (_, ids) in enumerate(prompts):
        toks = np.zeros((1, width), np.int32)
        toks[0, :len(ids)] = ids
        argv_ = (params, dparams, jnp.asarray(toks), jnp.asarray([len(ids)], jnp.int32),
                 budgets, key)
        order = list(programs) if i % 2 == 0 else list(reversed(programs))
        for name in order:
            fn = programs[name]
            if i == 0:
                jax.block_until_ready(fn(*argv_))  # compile + warm-up, untimed
            t0 = time.perf_counter()
            tokens, lengths, steps = jax.block_until_ready(fn(*argv_))
            totals[name][0] += time.perf_counter() - t0
            n = int(lengths[0]) - len(ids)
            totals[name][1] += n
            totals[name][2] += int(steps[0])
            outputs[name].append(np.asarray(tokens[0, len(ids):int(lengths[0])]).tolist())
        print(f"[chain_fast_path] prompt {i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    rate = {name: t[1] / t[0] for name, t in totals.items()}
    result = {"drafter": args.drafter, "gamma": args.gamma, "prompts": len(prompts),
              "kernels": args.kernels, "temperature": args.temperature,
              "new_tokens": args.new_tokens,
              "tokens_per_s": {k: round(v, 2) for k, v in rate.items()},
              "tau": {k: round(t[1] / max(t[2], 1), 3) for k, t in totals.items()},
              "fast_over_tree": round(rate["chain"] / rate["tree"], 3),
              # greedy: identical outputs; sampled: both exact, the draws may differ
              "identical": outputs["chain"] == outputs["tree"],
              "environment": environment([usable_cores()])}
    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=1))
    atomic_write(args.json, lambda f: f.write((json.dumps(result, indent=1) + "\n").encode()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
