"""Lower the compiled decoding loops for TPU and GPU from a target's config.json alone.

    python -m specjax.export --config CONFIG.json [--drafter none|ngram|DIR]
        [--platforms tpu,cuda] [--kernels pallas|reference|off] [--batch 1]
        [--max-length 2048] [--gamma G] [--temperature 0] [--layer-loop scan] [--exact]

Builds the target (and a learned drafter from its directory's config.json) as abstract
shapes (`jax.eval_shape`: no weights are read or allocated, so Qwen3-8B or a 70B model
lowers on a laptop), then `jax.export`s the autoregressive loop and, with a drafter, the
speculative loop, for each platform. With `--kernels pallas` the Pallas kernels are
inside: Mosaic (`tpu_custom_call`) on TPU, Triton on GPU. The target's attention into its
KV cache (`pallas_kernels.attention`) is in both loops, once per target forward after
the prefill (inside the scan over layers; `--layer-loop unroll`: once per layer), and
the speculative loop adds the verification kernel (`pallas_kernels.verify`: one call
for greedy, two for sampled block or token verification). So the report reads 1 custom
call for the autoregressive loop and 2 (T=0) or 3 (T>0) for the speculative one, with
scan. This checks what lowering checks (shapes, the Pallas lowering rules such as TPU's
(8, 128) block tiling), not the final libtpu / ptxas compile.

Prints one line per (platform, loop) and exits 0; exits 2 with one line naming the loop,
the platform and the error when something does not lower or the input is bad.

The lowering itself, for a platform the host lacks, is `specjax.export.export_for`.
"""

from __future__ import annotations

import os
import sys

from specjax import cli
from specjax.export import TRITON_CHECK, export_for

os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

PLATFORMS = ("tpu", "cuda", "cpu")


def build_parser() -> cli.ArgumentParser:
    ap = cli.ArgumentParser(prog="python -m specjax.export",
                            description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True,
                    help="the target's HF config.json (or its directory)")
    ap.add_argument("--drafter", default="ngram",
                    help="none (autoregressive only), ngram, or a drafter directory "
                         "written by train.py (its config.json only is read)")
    ap.add_argument("--platforms", default="tpu,cuda", help="comma-separated: tpu, cuda, cpu")
    ap.add_argument("--kernels", choices=("pallas", "reference", "off"), default="pallas")
    ap.add_argument("--batch", type=int, default=1, help="rows per compiled batch (B)")
    ap.add_argument("--max-length", type=int, default=2048, help="cache capacity S")
    ap.add_argument("--prompt-width", type=int, default=None,
                    help="padded prompt width Tp (default: min(128, max-length / 2))")
    ap.add_argument("--gamma", type=int, default=None, help="draft length G (default: the "
                    "drafter's, 4 for ngram)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy verification; > 0: --verify with sampling")
    ap.add_argument("--verify", choices=("token", "block"), default="block")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="weights and activations (bfloat16, as on TPU/GPU)")
    ap.add_argument("--layer-loop", choices=("scan", "unroll"), default="scan")
    ap.add_argument("--exact", action="store_true",
                    help="the exact mode (decode.py --exact: batch-invariant target forwards; "
                         "takes --kernels reference or off)")
    return ap


def abstract_engine(args):
    """Builds the abstract target (and drafter) once; returns loops_for(pallas_backend)
    -> the requested decoding loops, a list of (name, jitted fn, args tuple) where arrays
    are jax.ShapeDtypeStruct, with the verification kernel's layout for that backend."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from specjax.core.sampling import SamplingParams
    from specjax.decoding.loop import LoopConfig, autoregressive_loop, speculative_loop
    from specjax.drafters.config import DrafterConfig
    from specjax.drafters.io import read_config
    from specjax.drafters.ngram import NgramDrafter
    from specjax.dtypes import parse_dtype
    from specjax.errors import SpecjaxError
    from specjax.models.config import ModelConfig
    from specjax.models.model import Transformer, decoding_params

    cfg_dir = args.config if os.path.isdir(args.config) else os.path.dirname(args.config) or "."
    cfg = ModelConfig.from_dir(cfg_dir)
    dcfg = None
    if args.drafter not in ("none", "ngram"):
        if not DrafterConfig.is_drafter_dir(args.drafter):
            raise SpecjaxError(f"--drafter {args.drafter}: not a drafter directory written "
                               "by train.py (config.json with format specjax-drafter)")
        dcfg = DrafterConfig.from_json_dict(read_config(args.drafter),
                                            where=f"drafter {args.drafter}")
        dcfg.check_target(cfg, where=f"drafter {args.drafter}")
    dtype = parse_dtype(args.dtype)
    sampling = SamplingParams(temperature=args.temperature)
    held = {}

    def build():
        target = Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(target)
        held["graphdef"] = graphdef
        params = decoding_params(params, args.layer_loop)
        dparams = None
        if dcfg is not None:
            from specjax.drafters import build_network, make_drafter

            net = build_network(dcfg, dtype=dtype, rngs=nnx.Rngs(0))
            drafter, dparams = make_drafter(dcfg, net, target, gamma=args.gamma,
                                            sampling=sampling)
            held["drafter"] = drafter
        return params, dparams

    params, dparams = jax.eval_shape(build)
    S, B = args.max_length, args.batch
    Tp = args.prompt_width or min(128, max(1, S // 2))
    i32 = jnp.int32
    arrays = (jax.ShapeDtypeStruct((B, Tp), i32), jax.ShapeDtypeStruct((B,), i32),
              jax.ShapeDtypeStruct((B,), i32),
              jax.ShapeDtypeStruct((), jax.random.key(0).dtype))
    if args.drafter == "ngram":
        drafter, dparams = NgramDrafter(args.gamma or 4, cfg.vocab_size, sampling=sampling), ()
    else:
        drafter = held.get("drafter")

    def loops_for(pallas_backend: str):
        lc = LoopConfig(max_length=S, prompt_width=Tp, sampling=sampling,
                        eos_token_ids=tuple(cfg.eos_token_ids), verify=args.verify,
                        kernels=args.kernels, pallas_backend=pallas_backend,
                        pallas_interpret=False, exact=args.exact)
        loops = [("autoregressive", autoregressive_loop,
                  (held["graphdef"], params, lc, *arrays))]
        if args.drafter != "none":
            loops.append(("speculative", speculative_loop,
                          (held["graphdef"], params, drafter, dparams, lc, *arrays)))
        return loops

    return loops_for


def export_loops(args) -> list[str]:
    """Lowers every loop for every platform; returns one report line each.
    Raises SpecjaxError naming the loop and platform that failed."""

    from specjax.errors import SpecjaxError

    platforms = [p.strip() for p in args.platforms.split(",") if p.strip()]
    for p in platforms:
        if p not in PLATFORMS:
            raise SpecjaxError(f"--platforms: {p!r} is not one of {', '.join(PLATFORMS)}")
    backend = {"tpu": "tpu", "cuda": "triton"}
    loops_for = abstract_engine(args)
    lines = []
    for platform in platforms:
        # The kernels' layout and compiler parameters follow the platform.
        for name, fn, fargs in loops_for(backend.get(platform, "tpu")):
            try:
                exp = export_for(fn, platform, *fargs)
            except Exception as e:  # noqa: BLE001 - reported as one line, exit 2
                msg = " ".join(str(e).split())[:400]
                raise SpecjaxError(f"{name} loop does not lower for {platform} "
                                   f"(--kernels {args.kernels}): {type(e).__name__}: {msg}") from None
            text = exp.mlir_module()
            kernels = []
            if "tpu_custom_call" in text:
                kernels.append(f"{text.count('tpu_custom_call')} Mosaic custom calls")
            if TRITON_CHECK in text:
                kernels.append(f"{text.count(TRITON_CHECK)} Triton custom calls")
            lines.append(f"{platform:5s} {name:15s} lowered: {len(text) / 1e6:.2f} MB of "
                         f"StableHLO, {', '.join(kernels) or 'no Pallas kernels'}")
    return lines


def main(argv=None) -> int:
    from specjax.errors import SpecjaxError

    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        for flag in ("batch", "max_length"):
            if getattr(args, flag) < 1:
                raise SpecjaxError(f"--{flag.replace('_', '-')} must be >= 1")
        if args.exact and args.kernels == "pallas":
            raise SpecjaxError("--exact takes the jnp attention: --kernels reference or off")
        if not os.path.exists(args.config):
            raise SpecjaxError(f"--config {args.config}: no such file or directory")
        for line in export_loops(args):
            print(line)
    except SpecjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
