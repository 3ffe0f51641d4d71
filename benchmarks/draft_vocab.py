"""How large should a learned drafter's hot draft vocabulary be? (specjax.drafters.vocab)

    python benchmarks/draft_vocab.py [--drafter DIR] [--prompts 24] [--gamma 7]
        [--sizes 8192 2048 1024] [--matmul-dtype float32|bfloat16] [--json FILE]
        [--tokens-npy runs/data/regen-demo/train.npy ...] [--prompts-file FILE]

One process, one compiled Engine per vocabulary size plus autoregressive decoding, run
interleaved prompt by prompt (batch 1, 128 new tokens, EOS on, greedy) so that every
engine sees the same machine state; the hot set of size Vd is the Vd most frequent ids of
the training split (counted once, cached in --cache-dir), or of the --tokens-npy streams
(as `python -m specjax.drafters.vocab --tokens-npy` counts them for the shipped
draft_vocab.json). Prints tokens/s, the speedup
over autoregressive decoding in the same run, tau, and whether the outputs equal the
autoregressive ones; a size equal to V is the full vocabulary.
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.lib.prompts import prompt_ids  # noqa: E402
from specjax import cli  # noqa: E402
from specjax.errors import SpecjaxError  # noqa: E402
from specjax.fileio import atomic_write, check_output_file  # noqa: E402


def main(argv=None) -> int:
    ap = cli.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=os.path.join(ROOT, "checkpoints/demo/target"))
    ap.add_argument("--drafter", default=os.path.join(ROOT, "checkpoints/demo/drafters/eagle3"))
    ap.add_argument("--prompts", type=int, default=24, help="first N prompts")
    ap.add_argument("--prompts-file", default=os.path.join(ROOT, "checkpoints/demo/prompts.jsonl"),
                    help="JSONL with a \"prompt\" per line (default: the bundled prompts)")
    ap.add_argument("--tokens-npy", nargs="+", default=None,
                    help="count these flat .npy token streams instead of the stdlib corpus")
    ap.add_argument("--gamma", type=int, default=None, help="default: the drafter's G")
    ap.add_argument("--sizes", type=int, nargs="+", default=[8192, 2048, 1024])
    ap.add_argument("--matmul-dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--cache-dir", default=os.path.join(ROOT, "runs/token_cache"))
    ap.add_argument("--json", help="write the results here (its directory must exist; "
                    "checked before the run)")
    args = ap.parse_args(argv)
    try:
        return _run(args)
    except SpecjaxError as e:
        print(f"draft_vocab.py: error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    if args.json:  # before any work: a bad path fails now, not after the run
        check_output_file(args.json, "--json")
    # a missing --target or --drafter: load_model / the drafter loader raise SpecjaxError
    if not os.path.isfile(args.prompts_file):
        raise SpecjaxError(f"--prompts-file {args.prompts_file} does not exist")
    if any(size < 1 for size in args.sizes):
        raise SpecjaxError(f"--sizes {args.sizes}: every size must be >= 1")

    import jax
    import jax.numpy as jnp
    import numpy as np
    from tqdm import tqdm

    from specjax.core.sampling import SamplingParams
    from specjax.decoding.engine import Engine, Stats, prompt_width_for
    from specjax.decoding.loading import load_learned_drafter
    from specjax.drafters import make_drafter
    from specjax.drafters.vocab import corpus_counts, hot_ids, stream_counts
    from specjax.models.checkpoint import load_model, load_tokenizer

    mm = jnp.bfloat16 if args.matmul_dtype == "bfloat16" else None
    target = load_model(args.target, dtype=jnp.float32, matmul_dtype=mm)
    V = target.cfg.vocab_size
    tok = load_tokenizer(args.target)
    prompts = prompt_ids(args.prompts_file, tok, target.cfg.vocab_size, args.prompts,
                         args.target)
    drafter, full = load_learned_drafter(
        args.drafter, target, args.target, args.gamma, SamplingParams(), jnp.float32,
        matmul_dtype=jnp.bfloat16, draft_vocab="full")
    if args.tokens_npy:  # after the drafter: a bad directory fails before any counting
        counts = stream_counts(args.tokens_npy, V)
    else:
        counts = corpus_counts(os.path.join(ROOT, "checkpoints/demo/tokenizer"), args.cache_dir,
                               V)
    longest = max(map(len, prompts))
    common = dict(max_length=longest + args.max_new_tokens, eos_token_ids=(0,),
                  prompt_width=prompt_width_for(longest, longest + args.max_new_tokens))
    # Engines built by hand: each size's hot vocabulary comes from the counts above, and a
    # decoding session reads only the directory's draft_vocab.json or the full vocabulary
    engines = {"ar": Engine(target, **common)}
    for size in args.sizes:
        params = full
        if size < V:
            net = drafter.net(full)
            _, params = make_drafter(drafter.cfg, net, target, gamma=drafter.gamma,
                                     matmul_dtype=jnp.bfloat16,
                                     draft_vocab=hot_ids(counts, size))
        engines[size] = Engine(target, drafter=drafter, drafter_params=params, **common)
    for eng in engines.values():
        eng.compile()
    stats = {k: Stats() for k in engines}
    outs = {k: [] for k in engines}
    for i, p in enumerate(tqdm(prompts, desc="prompts", file=sys.stderr)):
        for k, eng in engines.items():
            out = eng.run([p], args.max_new_tokens, jax.random.key(i))
            stats[k].add(out)
            outs[k].append(out.outputs)
    ar = stats["ar"].tokens_per_s
    rows = []
    for size in args.sizes:
        st = stats[size]
        cover = float(np.sort(counts)[::-1][:size].sum() / counts.sum())
        rows.append({"size": size, "coverage": cover, "tokens_per_s": st.tokens_per_s,
                     "ar_tokens_per_s": ar, "speedup": st.tokens_per_s / ar, "tau": st.tau,
                     "identical_to_ar": outs[size] == outs["ar"]})
    print(f"\n{len(prompts)} prompts, G {drafter.gamma}, target matmuls {args.matmul_dtype}, "
          f"AR {ar:.1f} tokens/s\n")
    print("| Vd | training tokens covered | tokens/s | speedup vs AR | tau | identical to AR |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} | {r['coverage']:.1%} | {r['tokens_per_s']:.1f} | "
              f"{r['speedup']:.2f}x | {r['tau']:.2f} | {r['identical_to_ar']} |")
    if args.json:
        text = json.dumps({"args": vars(args), "rows": rows}, indent=2).encode()
        atomic_write(args.json, lambda f: f.write(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
