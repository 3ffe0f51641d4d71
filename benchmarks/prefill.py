"""Prefill settings compared in one process: whole chunks against pieces
(`LoopConfig.prefill_chunk` / `prefill_min_chunk`, `specjax.models.prefill.scan_prompt_pieces`).

    python benchmarks/prefill.py                   # chunks of 64 against the default
    python benchmarks/prefill.py --settings 64:64 256:64 256:32 --new-tokens 1 128

A setting CHUNK:MIN prefills whole chunks of CHUNK while they fit, then the rest of the
longest prompt as one piece of the smallest size in CHUNK, CHUNK/2, ... >= MIN that covers
it; CHUNK:CHUNK is whole chunks only; "default" is the backend's default. Per setting,
an autoregressive Engine and one with the drafter (its init over the prompt takes the
same pieces); every engine runs every prompt in turn, the order reversed on every other
prompt, so all see the same machine state (batch 1, greedy, EOS on unless
--ignore-eos), after one untimed run each. With --new-tokens 1 a run is the prefill and its first token. Prints
compile seconds, run seconds, the speedup over autoregressive decoding with the same
setting, and whether every output equals the first setting's autoregressive one.
"""

from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.lib.prompts import prompt_ids  # noqa: E402
from specjax import cli  # noqa: E402
from specjax.errors import SpecjaxError  # noqa: E402
from specjax.fileio import atomic_write, check_output_file  # noqa: E402


def parse_setting(text: str) -> tuple[int | None, int | None]:
    """"CHUNK:MIN" -> (CHUNK, MIN); "default" -> (None, None). Raises SpecjaxError."""
    if text == "default":
        return None, None
    try:
        chunk, low = (int(x) for x in text.split(":"))
    except ValueError:
        raise SpecjaxError(f"--settings {text!r}: expected CHUNK:MIN or default") from None
    if chunk < 1 or low < 1:
        raise SpecjaxError(f"--settings {text!r}: sizes must be >= 1")
    return chunk, low


def main(argv=None) -> int:
    ap = cli.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=os.path.join(ROOT, "checkpoints/demo/target"))
    ap.add_argument("--drafter", default=None,
                    help="as decode.py --drafter (default: decode.py's default drafter)")
    ap.add_argument("--prompts-file", default=os.path.join(ROOT, "checkpoints/demo/prompts.jsonl"),
                    help="JSONL with a \"prompt\" per line (default: the bundled prompts)")
    ap.add_argument("--prompts", type=int, default=50, help="first N prompts")
    ap.add_argument("--settings", nargs="+", default=["64:64", "default"])
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[1, 128])
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--json", help="write the results here (its directory must exist; "
                    "checked before the run)")
    args = ap.parse_args(argv)
    try:
        return _run(args)
    except SpecjaxError as e:
        print(f"prefill.py: error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    if args.json:  # before any work: a bad path fails now, not after the run
        check_output_file(args.json, "--json")
    settings = {s: parse_setting(s) for s in args.settings}
    if args.prompts < 1 or any(n < 1 for n in args.new_tokens):
        raise SpecjaxError("--prompts and --new-tokens must be >= 1")
    if not os.path.isfile(args.prompts_file):
        raise SpecjaxError(f"--prompts-file {args.prompts_file} does not exist")

    import jax
    from tqdm import tqdm

    from specjax.core.sampling import SamplingParams
    from specjax.decoding.engine import Engine, prompt_width_for
    from specjax.decoding.loading import load_drafter, load_target

    loaded = load_target(args.target, dtype="float32")
    target = loaded.model
    prompts = prompt_ids(args.prompts_file, loaded.tokenizer, target.cfg.vocab_size,
                         args.prompts, args.target)
    drafter, dparams, name, _ = load_drafter(args.drafter, loaded, sampling=SamplingParams())
    if drafter is None:
        raise SpecjaxError("--drafter none: nothing to compare against autoregressive decoding")
    longest = max(map(len, prompts))
    max_length = longest + max(args.new_tokens)
    common = dict(max_length=max_length, prompt_width=prompt_width_for(longest, max_length),
                  eos_token_ids=() if args.ignore_eos else tuple(target.cfg.eos_token_ids))
    # Engines built by hand: prefill_chunk and prefill_min_chunk are Engine settings that no
    # decoding session exposes (this benchmark is their A/B)
    engines = {}
    for s, (chunk, low) in settings.items():
        for kind in ("ar", "drafter"):
            extra = dict(drafter=drafter, drafter_params=dparams) if kind == "drafter" else {}
            engines[s, kind] = Engine(target, prefill_chunk=chunk, prefill_min_chunk=low,
                                      **extra, **common)
    sizes = {s: engines[s, "ar"].cfg.prefill_sizes() for s in settings}
    compile_s = {k: eng.compile() for k, eng in engines.items()}
    for eng in engines.values():  # untimed warm-up
        eng.run([prompts[0]], 1, jax.random.key(0))
    rows = []
    for n in args.new_tokens:
        wall = dict.fromkeys(engines, 0.0)
        outs = {k: [] for k in engines}
        for i, p in enumerate(tqdm(prompts, desc=f"{n} new tokens", file=sys.stderr)):
            order = list(engines) if i % 2 == 0 else list(engines)[::-1]
            for k in order:
                t0 = time.perf_counter()
                outs[k].append(engines[k].run([p], n, jax.random.key(i)).outputs)
                wall[k] += time.perf_counter() - t0
        first = outs[args.settings[0], "ar"]
        for s in settings:
            rows.append({"setting": s, "sizes": sizes[s], "new_tokens": n,
                         "ar_s": wall[s, "ar"], "drafter_s": wall[s, "drafter"],
                         "speedup": wall[s, "ar"] / wall[s, "drafter"],
                         "compile_ar_s": compile_s[s, "ar"],
                         "compile_drafter_s": compile_s[s, "drafter"],
                         "identical": outs[s, "ar"] == first and outs[s, "drafter"] == first})
    print(f"\n{len(prompts)} prompts, drafter {name} (G {drafter.gamma}), batch 1, "
          f"EOS {'off' if args.ignore_eos else 'on'}; seconds for all prompts\n")
    print("| setting | pieces | new tokens | AR s | drafter s | speedup | compile s (AR, "
          "drafter) | identical |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {', '.join(map(str, r['sizes']))} | {r['new_tokens']} | "
              f"{r['ar_s']:.2f} | {r['drafter_s']:.2f} | {r['speedup']:.3f}x | "
              f"{r['compile_ar_s']:.1f}, {r['compile_drafter_s']:.1f} | {r['identical']} |")
    if args.json:
        text = json.dumps({"args": vars(args), "rows": rows}, indent=2).encode()
        atomic_write(args.json, lambda f: f.write(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
