"""Speculative decoding from local HF Qwen3 / Llama-3 checkpoints.

    python decode.py          # the demo: bundled target + draft LM on the bundled prompts
    python decode.py --target DIR [--drafter {none,ngram,DIR}] --prompt TEXT
    python decode.py --target DIR --drafter DIR --prompts prompts.jsonl --output out.jsonl \
        --summary summary.json

With a drafter, autoregressive decoding of the same prompts also runs, interleaved
batch by batch, and the summary reports the speedup and whether greedy outputs are
identical (--no-compare-ar skips it).

Prompt lines are JSON objects with "prompt" (text), "input_ids" (list of ints), or a
conversation ("messages" with role/content, or ShareGPT "conversations"), and an
optional "id". Conversations, and with --chat text prompts as one user turn, are rendered
with the target's chat template up to their last user turn (docs/chat.md); decoding then
also stops at the template's end-of-turn token. Output lines, in input order: id,
prompt_ids (the ids decoded from), output_ids (new tokens only), text (when the target
has a tokenizer). Bad input exits with code 2 and one line on
stderr, and writes no output file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from specjax import cli
from specjax.compile_cache import (  # noqa: F401 - re-exported (decode.enable_compile_cache)
    DEFAULT_COMPILE_CACHE,
    enable_compile_cache,
)
from specjax.decoding.loading import (  # noqa: F401 - re-exported for scripts and tests
    DEFAULT_GAMMA,
    DEMO_DIR,
    DEMO_DRAFTERS,
    drafter_matmul_dtype,
    flag_dtype,
    load_learned_drafter,
)
from specjax.decoding.prompts import (  # noqa: F401 - read_prompts re-exported
    read_prompt_set,
    read_prompts,
)


def _gamma_arg(text: str):
    """--gamma: a positive draft length, "auto" or "fixed" (checked in validate_flags)."""
    if text in ("auto", "fixed"):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: a draft length, auto or "
                                         "fixed") from None


def resolve_gamma(args) -> None:
    """The --gamma default: auto for a drafter that proposes one chain, else fixed (draft
    trees, --num-drafts, logitspec, --partial-verify and --drafter none take the drafter's
    own G). Sets args.gamma to an int, "auto" or None (None: the drafter's G)."""
    if args.gamma is None:
        tree = (args.num_drafts > 1 or args.tree_topk is not None
                or args.drafter == "logitspec" or getattr(args, "partial_verify", False))
        args.gamma = None if tree or args.drafter == "none" else "auto"
    elif args.gamma == "fixed":
        args.gamma = None


def build_parser() -> argparse.ArgumentParser:
    from specjax.drafters import registry

    kinds, stoppers = ", ".join(registry.kinds()), "/".join(registry.early_stop_kinds())
    ap = cli.ArgumentParser(prog="decode.py",
                            description="Lossless speculative decoding with specjax.")
    ap.add_argument("--target", default=os.path.join(DEMO_DIR, "target"),
                    help="HF checkpoint directory of the target (default: the bundled demo)")
    ap.add_argument("--drafter", default=None,
                    help="none (autoregressive), ngram (prompt lookup), logitspec (a prompt-"
                         "lookup tree with next-next-token guesses from the target's "
                         "logits; sampling needs --verify token), a drafter directory "
                         f"written by train.py ({kinds}), or a draft LM "
                         "directory (default: the best bundled demo drafter)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompts", help="JSONL file of prompts (default: the bundled demo prompts)")
    src.add_argument("--prompt", help="a single text prompt")
    ap.add_argument("--chat", action="store_true",
                    help="text prompts (--prompt, \"prompt\" lines) are one user turn, "
                         "rendered with the target's chat template (conversation lines "
                         "always are)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--gamma", type=_gamma_arg, default=None, metavar="N|auto|fixed",
                    help="draft length. auto (the default for a drafter of one chain): every "
                         "step picks its length from 0 (an autoregressive step), 1, 2, 3, 5 "
                         "and the drafter's G by expected tokens per ms, from a cost table "
                         "measured once per setting, and a batch runs without the drafter "
                         "when speculation is not predicted to win by more than the timing "
                         "noise (docs/adaptive.md); fixed: always the G "
                         "a learned drafter was trained for (else 4; the default for draft "
                         "trees); N: always N")
    ap.add_argument("--cost-table", default=None, metavar="FILE",
                    help="--gamma auto: ms per step at each draft length and the "
                         "baseline a batch is priced against without the drafter (JSON); "
                         "read if it exists, else measured on the batch of median prompt "
                         "length and written here (default: measured once per setting, "
                         "cached in the compile cache, unless its repeated rounds spread "
                         "more than 50%%: a busy machine)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0, help="0 = off")
    ap.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    ap.add_argument("--verify", choices=("token", "block", "fly"), default="block",
                    help="verification rule when sampling (greedy at temperature 0); fly = "
                         "LOSSY FLy loose verification at temperature 0: a draft token "
                         "that is not the target's choice is accepted where the target is "
                         "unsure and agrees with the drafts after it (the output is NOT the "
                         "target's; docs/long_context.md)")
    ap.add_argument("--fly-window", type=int, default=None, metavar="W",
                    help="--verify fly (LOSSY): a mismatch is accepted when the next W-1 "
                         "drafts match the target (default 6, the authors')")
    ap.add_argument("--fly-entropy", type=float, default=None, metavar="NATS",
                    help="--verify fly (LOSSY): never accept a mismatch where the target's "
                         "top-3 entropy is below this (default 0.3; inf = greedy)")
    ap.add_argument("--partial-verify", action="store_true",
                    help="LOSSY SpecPV partial verification for long contexts: past a "
                         "context threshold most verify forwards attend only to a partial "
                         "KV cache (sink blocks, the blocks that score highest against the "
                         "last full pass's queries, a recent window), with a full "
                         "verification every 20 accepted tokens (the output is NOT the "
                         "target's; docs/long_context.md)")
    ap.add_argument("--partial-budget", type=int, default=None, metavar="TOKENS",
                    help="--partial-verify (LOSSY): KV slots per row and head in the "
                         "partial cache, sink + retrieval + window (default 4096); partial "
                         "steps start once every prompt is longer than this plus 20")
    ap.add_argument("--num-drafts", type=int, default=1, metavar="K",
                    help="drafts per step, verified as one draft tree of 1 + K*G nodes (at "
                         "temperature 0 the drafter's top-K first tokens, each continued "
                         "greedily; above it K independent samples); 1 = one chain")
    ap.add_argument("--tree-topk", type=int, default=None, metavar="K",
                    help="EAGLE-2 dynamic draft tree: expand the top-K children of the K "
                         "best nodes per depth (eagle3, hybrid, kv, block, draft LM); needs "
                         "--tree-nodes; sampling verifies with --verify token")
    ap.add_argument("--tree-nodes", type=int, default=None, metavar="N",
                    help="node budget of the --tree-topk tree (root included): the N-1 "
                         "best candidates by cumulative draft log-probability; alone, "
                         "--drafter logitspec's node budget (default 8)")
    ap.add_argument("--step-timing", action="store_true",
                    help="also time one step's parts (draft ms, verify ms: compiled and run "
                         "outside the loop on the first batch, an estimate; costs two more "
                         "compilations)")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-new-tokens")
    ap.add_argument("--max-length", type=int, default=None,
                    help="prompt + new tokens per row, at most (default: longest prompt + "
                         "--max-new-tokens)")
    ap.add_argument("--allow-long-context", action="store_true",
                    help="allow --max-length beyond the target's max_position_embeddings")
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="auto: float32 on CPU, bfloat16 on TPU/GPU")
    ap.add_argument("--matmul-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="the target's matmul inputs with --dtype float32: bfloat16 keeps "
                         "its weight matrices in bf16 and accumulates in f32 (a few-token "
                         "verification then costs about 1.2 one-token forwards on CPU, not "
                         "2.3); both engines use it, so their outputs match; it is a "
                         "slightly different model from the f32 run (docs/decode.md). auto: --dtype")
    ap.add_argument("--drafter-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help=f"matmul inputs of a learned drafter ({kinds}); "
                         "the target and so the output are unaffected. auto: bfloat16 "
                         "(bf16 inputs, f32 accumulation; faster on CPU, the TPU/GPU "
                         "default anyway)")
    ap.add_argument("--draft-vocab", choices=("auto", "full"), default="auto",
                    help="learned drafters: auto = draft over the hot vocabulary in the "
                         "drafter directory's draft_vocab.json when there is one (a smaller "
                         "LM-head matmul per draft step; output unchanged), full = all ids")
    ap.add_argument("--draft-stop", type=float, default=0.0,
                    help=f"{stoppers} drafters: stop drafting a step once every row's "
                         "chain confidence (product of its drafts' top-1 draft "
                         "probabilities) is below this; the rest of the G positions get a "
                         "filler the target rejects unless it agrees (output unchanged). "
                         "0: always draft G")
    ap.add_argument("--draft-window", type=int, default=None, metavar="W",
                    help="learned drafters: read only the last W context positions of the "
                         "target's hidden states or K/V when drafting (long contexts: the "
                         "drafter's attention stops growing with the context). Output "
                         "unchanged: the target verifies every draft (default: all)")
    ap.add_argument("--draft-reuse", action="store_true",
                    help="medc drafters (Make Every Draft Count, docs/medc.md): start each "
                         "step's draft chain from the previous step's drafted hidden states "
                         "where they cover the new positions, skipping those draft forwards. "
                         "Output unchanged: the target verifies every draft")
    ap.add_argument("--kernels", choices=("auto", "off", "reference", "pallas"),
                    default="auto",
                    help="verification: pallas = the fused Pallas kernel from the target's "
                         "logits (interpret mode on CPU: slow), reference = its jnp twin "
                         "(identical output for a seed), off = specjax.decoding.verify on "
                         "probabilities; auto: pallas on TPU and GPU, reference on CPU. pallas "
                         "also runs the target's and the learned drafters' attention "
                         "through pallas_kernels.attention")
    ap.add_argument("--mesh", default=None,
                    help="data=D,model=M: shard the target's weights and KV cache over M "
                         "devices (heads, F, V) and batch rows over D (--batch-size a "
                         "multiple of D); default: one device")
    ap.add_argument("--output", help="write completions to this JSONL file")
    ap.add_argument("--summary", help="write the summary to this JSON file")
    ap.add_argument("--compare-ar", action=argparse.BooleanOptionalAction, default=True,
                    help="with a drafter, also run autoregressive decoding (interleaved) and "
                         "report the speedup (default: on)")
    ap.add_argument("--show", type=int, default=3, help="completions to print")
    ap.add_argument("--compile-cache", default=None, metavar="DIR|none",
                    help="jax's persistent compilation cache: a later run with the same "
                         "shapes loads the compiled loops instead of compiling them "
                         "(default: $JAX_COMPILATION_CACHE_DIR if set, else "
                         "~/.cache/specjax/jax; none: off)")
    return ap


def validate_flags(args) -> None:
    """Checks the flags that need no file read, and every output path (an existing
    directory, a missing or unwritable parent), before any work.

    Raises: SpecjaxError (one line naming the flag)."""
    from specjax.errors import SpecjaxError

    if args.gamma == "auto" and args.drafter == "none":
        raise SpecjaxError("--gamma auto needs a drafter (--drafter none decodes "
                           "autoregressively)")
    resolve_gamma(args)
    if isinstance(args.gamma, int) and args.gamma < 1:
        raise SpecjaxError(f"--gamma={args.gamma} must be >= 1 (or auto)")
    if args.gamma == "auto" and (args.num_drafts > 1 or args.tree_topk is not None
                                 or args.drafter == "logitspec"):
        raise SpecjaxError("--gamma auto adapts a chain's draft length; draft trees "
                           "(--num-drafts, --tree-topk, logitspec) take a fixed --gamma")
    if args.cost_table is not None and args.gamma != "auto":
        raise SpecjaxError("--cost-table goes with --gamma auto")
    if not args.temperature >= 0:
        raise SpecjaxError(f"--temperature={args.temperature} must be >= 0 (0 = greedy)")
    if not 0 < args.top_p <= 1:
        raise SpecjaxError(f"--top-p={args.top_p} must be in (0, 1]")
    if args.top_k < 0:
        raise SpecjaxError(f"--top-k={args.top_k} must be >= 0 (0 = off)")
    if args.max_new_tokens < 1:
        raise SpecjaxError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
    if args.batch_size < 1:
        raise SpecjaxError(f"--batch-size={args.batch_size} must be >= 1")
    if args.num_drafts < 1:
        raise SpecjaxError(f"--num-drafts={args.num_drafts} must be >= 1 (1 = one chain)")
    if args.tree_topk is None and args.tree_nodes is not None and args.drafter != "logitspec":
        raise SpecjaxError("--tree-topk and --tree-nodes go together (an EAGLE-2 tree of "
                           "N nodes from the top-K children per depth); --tree-nodes alone "
                           "sets --drafter logitspec's node budget")
    if args.tree_topk is not None and args.tree_nodes is None:
        raise SpecjaxError("--tree-topk and --tree-nodes go together (an EAGLE-2 tree of "
                           "N nodes from the top-K children per depth)")
    if args.tree_topk is not None:
        if args.num_drafts > 1:
            raise SpecjaxError("--tree-topk and --num-drafts are two kinds of tree: pass one")
        if args.temperature > 0 and args.verify == "block":
            raise SpecjaxError("--tree-topk with sampling needs --verify token (block "
                               "verification of several drafts needs independent drafts: "
                               "--num-drafts)")
    if args.verify != "fly" and (args.fly_window is not None or args.fly_entropy is not None):
        raise SpecjaxError("--fly-window and --fly-entropy go with --verify fly")
    if args.verify == "fly":
        if args.temperature > 0:
            raise SpecjaxError("--verify fly (lossy) runs at --temperature 0 only")
        if args.num_drafts > 1 or args.tree_topk is not None or args.drafter == "logitspec":
            raise SpecjaxError("--verify fly (lossy) verifies one chain: no --num-drafts, "
                               "--tree-topk or logitspec")
        if args.drafter == "none":
            raise SpecjaxError("--verify fly needs a drafter (--drafter none decodes "
                               "autoregressively)")
        if args.fly_window is not None and args.fly_window < 1:
            raise SpecjaxError(f"--fly-window={args.fly_window} must be >= 1")
        if args.fly_entropy is not None and not args.fly_entropy >= 0:
            raise SpecjaxError(f"--fly-entropy={args.fly_entropy} must be >= 0 (nats)")
    if args.partial_budget is not None and not args.partial_verify:
        raise SpecjaxError("--partial-budget goes with --partial-verify")
    if args.partial_verify:
        if args.num_drafts > 1 or args.tree_topk is not None or args.drafter == "logitspec":
            raise SpecjaxError("--partial-verify (lossy) verifies one chain: no "
                               "--num-drafts, --tree-topk or logitspec")
        if args.drafter == "none":
            raise SpecjaxError("--partial-verify needs a drafter (--drafter none decodes "
                               "autoregressively)")
        if args.gamma == "auto":
            raise SpecjaxError("--partial-verify drafts a fixed length: no --gamma auto")
        if args.partial_budget is not None:
            from specjax.decoding.partial import PartialVerify

            try:
                PartialVerify(budget=args.partial_budget)
            except ValueError as e:
                raise SpecjaxError(f"--partial-budget: {e}") from None
    if args.num_drafts > 1 and args.drafter == "none":
        raise SpecjaxError("--num-drafts needs a drafter (--drafter none decodes "
                           "autoregressively)")
    if args.draft_reuse and (args.num_drafts > 1 or args.tree_topk is not None):
        raise SpecjaxError("--draft-reuse reuses a chain's drafted hidden states: no "
                           "--num-drafts or --tree-topk (medc's trees share one chain "
                           "without it)")
    from specjax.fileio import check_output_file

    for flag, path in (("--output", args.output), ("--summary", args.summary)):
        if path:
            check_output_file(path, flag)
    if args.output and args.summary and os.path.abspath(args.output) == os.path.abspath(
            args.summary):
        raise SpecjaxError(f"--output and --summary both name {args.output}; pass two files")


def _format_table(summary: dict) -> str:
    rows = []
    if summary.get("verify") == "fly":
        rows.append(("verification", "fly: LOSSY, the output is not the target's"))
    pv = summary.get("partial_verify")
    if pv:
        rows.append(("verification", "partial (SpecPV): LOSSY, the output is not the "
                                     "target's"))
        rows.append(("steps full / partial", f"{pv['full_steps']} / {pv['partial_steps']} "
                                             f"(budget {pv['budget']}, from "
                                             f"{pv['threshold']} tokens)"))
    rows += [("new tokens", f"{summary['new_tokens']}"),
            ("wall (s, no compile)", f"{summary['wall_s']:.2f}"),
            ("compile (s)", f"{summary['compile_s']:.2f}"),
            ("tokens/s", f"{summary['tokens_per_s']:.1f}")]
    if summary.get("tau") is not None:
        rows.append(("tau (tokens/step)", f"{summary['tau']:.3f}"))
        sched = summary.get("gamma_schedule")
        if sched:
            mix = ", ".join(f"{g}: {n}" for g, n in zip(sched["choices"], sched["steps"],
                                                         strict=True) if n)
            rows.append(("draft length: steps", f"{mix} (mean {sched['mean_draft_length']:.2f})"))
            if sched.get("autoregressive_batches"):
                rows.append(("autoregressive batches",
                             f"{sched['autoregressive_batches']} of {sched['batches']} "
                             "(speculation would not pay at this batch size)"))
            if sched.get("calibration_s") is None and sched.get("cost_table"):
                rows.append(("cost table", f"read from {sched['cost_table']}"
                             + (f" (measured {sched['measured_at']})"
                                if sched.get("measured_at") else "")
                             + "; delete it to measure again"))
        rows.append(("alpha_k", " ".join("-" if a is None else f"{a:.2f}" for a in summary["alpha"])))
        if summary.get("nodes_per_step", 1) > summary.get("gamma", 0) + 1:
            rows.append(("drafts x nodes/step", f"{summary['num_drafts']} x "
                                                f"{summary['nodes_per_step']}"))
    if "draft_ms" in summary:
        rows.append(("draft / verify ms per step", f"{summary['draft_ms']:.1f} / "
                                                   f"{summary['verify_ms']:.1f} (outside the loop)"))
    if "speedup" in summary:
        rows.append(("AR tokens/s", f"{summary['ar_tokens_per_s']:.1f}"))
        rows.append(("speedup over AR", f"{summary['speedup']:.2f}x"))
        if summary.get("ar_identical") is not None:
            rows.append(("identical to AR", str(summary["ar_identical"])))
        agree = summary.get("ar_agreement")
        if agree:
            rows.append(("LOSSY: agreement", f"{agree['prefix_tokens']:.1f} tokens before the "
                                             f"first difference (mean), "
                                             f"{agree['token_agreement']:.1%} of positions"))
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)


def _default_cost_table(args, cfg, loaded, dtype, schedule, max_length: int,
                        prompt_width: int) -> str | None:
    """Where --gamma auto caches its measured cost table when --cost-table is not given:
    COMPILE_CACHE/specjax-costs/KEY.json, keyed by everything the costs depend on (None:
    no cache, with --compile-cache none)."""
    import jax

    from specjax.decoding import adaptive

    if args.compile_cache == "none":
        return None
    base = args.compile_cache or jax.config.jax_compilation_cache_dir or DEFAULT_COMPILE_CACHE
    key = adaptive.table_key(
        target=cfg, dtype=dtype, drafter=loaded.name, drafter_gamma=loaded.gamma,
        drafter_dtype=args.drafter_dtype, matmul_dtype=args.matmul_dtype,
        draft_vocab=args.draft_vocab, draft_stop=args.draft_stop,
        draft_window=args.draft_window, draft_reuse=args.draft_reuse, batch=args.batch_size,
        max_length=max_length, prompt_width=prompt_width,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, verify=args.verify,
        kernels=args.kernels, mesh=args.mesh, choices=schedule.choices,
        table_version=6, backend=jax.default_backend(), device=jax.devices()[0].device_kind,
        jax=jax.__version__)
    # inside the compile cache: jax reads only its own *-cache files there
    return os.path.join(os.path.abspath(base), "specjax-costs", key + ".json")


def check_memory(args, cfg, dtype, max_length: int, prompt_width: int) -> None:
    """Raises SpecjaxError, before anything is allocated, when the target's weights, the
    KV caches of the engines decode.py builds (speculative and, with --compare-ar,
    autoregressive), the drafter and the prefill's activations need more than the
    device has free (`specjax.plan`; estimates from config.json and file sizes)."""
    from specjax import plan
    from specjax.errors import SpecjaxError
    from specjax.models.config import ModelConfig

    B = args.batch_size
    G = args.gamma if isinstance(args.gamma, int) else DEFAULT_GAMMA
    nodes = G + 1 if args.num_drafts == 1 else 1 + args.num_drafts * G
    S = max_length + max(nodes, args.tree_nodes or 0)  # room for the verified drafts
    cache = plan.kv_cache_bytes(cfg.num_layers, B, cfg.num_kv_heads, S, cfg.head_dim, dtype)
    parts = {"target weights": plan.weight_bytes(cfg, dtype),
             "KV cache": cache * (2 if args.compare_ar and args.drafter != "none" else 1),
             "prefill activations": plan.prefill_activation_bytes(cfg, B, prompt_width, S)}
    d = args.drafter
    if d not in ("none", "ngram") and d is not None and os.path.isdir(d):
        files = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".safetensors")]
        parts["drafter"] = 2 * sum(os.path.getsize(f) for f in files)  # bf16 on disk -> f32
        if os.path.isfile(os.path.join(d, "config.json")):
            try:  # a draft LM: its own cache; a learned drafter: about Ld + 1 caches
                dc = ModelConfig.from_dir(d)
                parts["drafter"] += plan.kv_cache_bytes(dc.num_layers, B, dc.num_kv_heads, S,
                                                        dc.head_dim, dtype)
            except SpecjaxError:
                parts["drafter"] += 3 * cache // max(cfg.num_layers, 1)
    need = sum(parts.values())
    free, where = plan.available_bytes()
    if free is not None and need > free:
        detail = ", ".join(f"{k} {plan.fmt_bytes(v)}" for k, v in parts.items())
        raise SpecjaxError(
            f"decoding needs about {plan.fmt_bytes(need)} ({detail}) but {where} has "
            f"{plan.fmt_bytes(free)} free; lower --max-length (now {max_length}) or "
            f"--batch-size (now {B})")


def _show(rec: dict, prompt_ids: list[int], tokenizer, context_lines: int = 4) -> str:
    """The last lines of the prompt, then the completion, for the terminal."""
    if tokenizer is None:
        return (f"=== {rec['id']}: {len(prompt_ids)} prompt tokens -> "
                f"{' '.join(map(str, rec['output_ids']))}")
    tail = tokenizer.decode(prompt_ids, skip_special_tokens=True).splitlines()[-context_lines:]
    n = len(rec["output_ids"])
    return (f"=== prompt {rec['id']} (last {len(tail)} lines)\n" + "\n".join(tail)
            + f"\n--- completion ({n} tokens)\n{rec['text']}\n")


def run(args) -> int:
    import jax
    from tqdm import tqdm

    from specjax.core.sampling import SamplingParams
    from specjax.decoding.engine import Engine, Stats, prompt_width_for
    from specjax.decoding.loading import load_drafter, load_target, resolve_dtype
    from specjax.errors import SpecjaxError
    from specjax.fileio import atomic_write_all
    from specjax.models.checkpoint import load_tokenizer
    from specjax.models.config import ModelConfig

    validate_flags(args)
    enable_compile_cache(args.compile_cache)
    dtype = resolve_dtype(args.dtype)
    cfg = ModelConfig.from_dir(args.target)  # config.json only: no weights read yet
    tokenizer = load_tokenizer(args.target)
    prompts, chat = read_prompt_set(tokenizer, cfg.vocab_size, prompt=args.prompt,
                                    path=args.prompts, target=args.target, chat=args.chat)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)

    longest = max(len(ids) for _, ids in prompts)
    max_length = args.max_length or longest + args.max_new_tokens
    for pid, ids in prompts:
        if len(ids) + args.max_new_tokens > max_length:
            raise SpecjaxError(
                f"prompt {pid}: {len(ids)} prompt tokens + --max-new-tokens "
                f"{args.max_new_tokens} > --max-length {max_length}; raise --max-length or "
                "shorten the prompt")
    if max_length > cfg.max_position_embeddings and not args.allow_long_context:
        raise SpecjaxError(
            f"--max-length {max_length} exceeds the target's max_position_embeddings "
            f"{cfg.max_position_embeddings} (positions it was not trained for); lower "
            "--max-length, --max-new-tokens or the prompt length, or pass "
            "--allow-long-context to run anyway")
    prompt_width = prompt_width_for(longest, max_length)
    check_memory(args, cfg, dtype, max_length, prompt_width)
    mesh = None
    if args.mesh:
        from specjax.decoding.sharding import check_batch, decode_mesh

        mesh = decode_mesh(args.mesh)
        check_batch(mesh, args.batch_size)
    target = load_target(args.target, dtype=dtype, matmul_dtype=args.matmul_dtype, cfg=cfg,
                         tokenizer=tokenizer)
    auto = args.gamma == "auto"
    loaded = load_drafter(args.drafter, target, gamma=None if auto else args.gamma,
                          sampling=sampling,
                          dtype=dtype, matmul_dtype=args.drafter_dtype,
                          draft_vocab=args.draft_vocab, draft_stop=args.draft_stop,
                          draft_window=args.draft_window, draft_reuse=args.draft_reuse,
                          verify=args.verify, num_drafts=args.num_drafts,
                          tree_nodes=args.tree_nodes if args.tree_topk is None else None)
    drafter, dparams, drafter_arg = loaded.drafter, loaded.params, loaded.name
    if args.tree_topk is not None:
        if drafter is None:
            raise SpecjaxError("--tree-topk needs a drafter (--drafter none decodes "
                               "autoregressively)")
        from specjax.drafters.dynamic_tree import DynamicTree

        drafter = DynamicTree(drafter, args.tree_topk, args.tree_nodes)
    target = target.model
    eos = () if args.ignore_eos else cfg.eos_token_ids
    if chat and not args.ignore_eos:  # the template's end of turn stops an answer too
        from specjax.data.chat import end_of_turn_ids

        eos = eos + tuple(i for i in end_of_turn_ids(tokenizer) if i not in eos)
    partial = None
    if args.partial_verify:
        from specjax.decoding.partial import PartialVerify

        partial = PartialVerify(budget=4096 if args.partial_budget is None
                                else args.partial_budget)
    verify = args.verify
    if verify == "fly":
        from specjax.decoding.fly import FlyVerify

        verify = FlyVerify(window=6 if args.fly_window is None else args.fly_window,
                           threshold=0.3 if args.fly_entropy is None else args.fly_entropy)
    common = dict(sampling=sampling, verify=verify, max_length=max_length,
                  prompt_width=prompt_width, batch_size=args.batch_size, eos_token_ids=eos,
                  kernels=args.kernels, mesh=mesh)
    schedule, costs, table, baseline, alpha = None, None, None, None, None
    # the cost table's provenance, for the report
    measured_at, table_written, relative = None, False, None
    if auto and drafter is not None:
        from specjax.decoding import adaptive

        schedule = adaptive.GammaSchedule(adaptive.default_choices(loaded.gamma))
        table = args.cost_table or _default_cost_table(args, cfg, loaded, dtype, schedule,
                                                       max_length, prompt_width)
        if table is not None and os.path.isfile(table):
            costs = adaptive.read_table(table, schedule.choices)
            baseline = adaptive.read_baseline(table)
            alpha = adaptive.read_alpha(table, schedule.gamma)
            with open(table) as f:  # read_table has checked that it is a JSON object
                measured_at = json.load(f).get("measured_at")
    engines = {"main": Engine(target, drafter=drafter, drafter_params=dparams,
                              num_drafts=args.num_drafts if drafter is not None else 1,
                              schedule=schedule, costs=costs, baseline=baseline,
                              partial=partial, **common)}
    # the acceptance the table's calibration observed: the first run's estimates, and
    # where they drift while batches fall back
    engines["main"].alpha0 = alpha
    engines["main"].alpha_calibrated = None if alpha is None else list(alpha)
    if args.compare_ar and drafter is not None:
        # under --gamma auto the AR reference is the program auto falls back to (one
        # compilation for both)
        engines["ar"] = (engines["main"].fallback_engine() if schedule is not None
                         else Engine(target, **common))

    batches = [prompts[i:i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
    base_key = jax.random.key(args.seed)
    stats = {name: Stats() for name in engines}
    outputs = {name: [] for name in engines}
    for name, eng in engines.items():
        stats[name].compile_s = eng.compile()
    calibrated_s = None
    if schedule is not None and costs is None:  # measure the cost table once
        import time

        t0 = time.perf_counter()
        # on the batch of median prompt length: costs grow with the context
        cal = batches[adaptive.calibration_batch([[ids for _, ids in b] for b in batches])]
        costs = engines["main"].calibrate([ids for _, ids in cal], args.max_new_tokens,
                                          base_key, baseline=True)
        calibrated_s = time.perf_counter() - t0
        measured_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        # each round's AR wall over its speculative walls (the margin's input)
        relative = [round(float(r), 4) for r in engines["main"].calibration_relative]
        spread = adaptive.calibration_spread(engines["main"].calibration_relative)
        noisy = spread > adaptive.NOISY_SPREAD
        if noisy:
            print(f"decode.py: --gamma auto: the calibration's repeated runs spread "
                  f"{spread:.0%} (a busy machine?); its cost table "
                  + ("is written to --cost-table all the same" if args.cost_table
                     else "is used for this run only, not cached")
                  + ": measure it on a quiet machine", file=sys.stderr)
        if table is not None and (args.cost_table is not None or not noisy):
            try:
                adaptive.write_table(table, schedule.choices, costs, {
                    "measured_on": jax.devices()[0].device_kind,
                    "batch_size": args.batch_size, "drafter": drafter_arg,
                    # before adaptive.fit_costs (ms_per_step is the fitted table)
                    "measured_ms_per_step": {
                        str(g): round(float(m), 4) for g, m in zip(
                            schedule.choices, engines["main"].measured_costs, strict=True)},
                    "calibration_relative": relative, "measured_at": measured_at,
                    # the acceptance calibrate observed: the next run starts from it
                    **({} if engines["main"].alpha0 is None else {"alpha": [
                        round(float(a), 4) for a in engines["main"].alpha0]})},
                    baseline=engines["main"].baseline)
                table_written = True
            except OSError as e:
                if args.cost_table is not None:
                    raise SpecjaxError(f"--cost-table {table} cannot be written "
                                       f"({e.strerror})") from None
                # the default place is in the compile cache: where that cannot be written
                # the cache is off, and so is this one (the next run measures again)
    for i, batch in enumerate(tqdm(batches, desc="decoding", unit="batch",
                                   disable=None, file=sys.stderr)):
        key = jax.random.fold_in(base_key, i)
        for name, eng in engines.items():  # interleaved, so both see the same machine state
            out = eng.run([ids for _, ids in batch], args.max_new_tokens, key)
            stats[name].add(out)
            outputs[name].extend(out.outputs)

    timing = None
    if args.step_timing and drafter is not None:
        timing = engines["main"].step_timing([ids for _, ids in batches[0]],
                                             args.max_new_tokens, base_key)
    st = stats["main"]
    summary = {"new_tokens": st.new_tokens, "wall_s": st.wall_s, "compile_s": st.compile_s,
               "tokens_per_s": st.tokens_per_s,
               "tau": st.tau if drafter is not None else None,
               "alpha": st.alpha if drafter is not None else [],
               "drafter": drafter_arg, "gamma": loaded.gamma if drafter is not None else 0,
               "verify": (args.verify if args.verify == "fly"
                          else "greedy" if sampling.greedy else args.verify),
               "lossy": args.verify == "fly" or partial is not None,
               "fly": ({"window": verify.window, "entropy_threshold": verify.threshold}
                       if args.verify == "fly" else None),
               "partial_verify": None if partial is None else {
                   "budget": partial.budget, "block": partial.block,
                   "sink_blocks": partial.sink_blocks, "window": partial.window,
                   "buffer": partial.buffer,
                   "threshold": partial.threshold_for(loaded.gamma),
                   "full_steps": int(st.verified[0]) if st.verified is not None else 0,
                   "partial_steps": int(st.verified[1]) if st.verified is not None else 0},
               "kernels": engines["main"].cfg.kernels,
               "num_drafts": engines["main"].cfg.num_drafts,
               "nodes_per_step": (engines["main"].cfg.tree_nodes(loaded.gamma, drafter)
                                  if drafter is not None else 1),
               "batch_size": args.batch_size, "prompts": len(prompts), "chat": chat,
               "mesh": dict(mesh.shape) if mesh is not None else None,
               "draft_window": args.draft_window,
               "draft_reuse": None if st.reused is None else {
                   "states_reused": int(st.reused[0]), "states_drafted": int(st.reused[1]),
                   "fraction": float(st.reused[0] / max(st.reused[1], 1)),
                   "forwards_skipped": int(st.reused[2]), "forwards": int(st.reused[3])}}
    if timing is not None:
        summary.update(timing)
    if schedule is not None:
        steps = [int(c) for c in st.chosen] if st.chosen is not None else []
        summary["gamma_schedule"] = {
            "choices": list(schedule.choices), "steps": steps,
            "mean_draft_length": (sum(g * c for g, c in zip(schedule.choices, steps,
                                                            strict=True)) / max(sum(steps), 1)),
            "ms_per_step": [round(float(c), 3) for c in engines["main"].costs],
            "baseline": (None if engines["main"].baseline is None
                         else dataclasses.asdict(engines["main"].baseline)),
            "autoregressive_batches": st.fallback_batches, "batches": st.batches,
            "cost_table": table if calibrated_s is None or table_written else None,
            "measured_at": measured_at, "calibration_s": calibrated_s,
            "calibration_relative": relative}
    if args.compare_ar:
        ar = stats.get("ar", st)
        summary["ar_tokens_per_s"] = ar.tokens_per_s
        summary["speedup"] = st.tokens_per_s / ar.tokens_per_s
        if "ar" in outputs and sampling.greedy:
            summary["ar_identical"] = outputs["ar"] == outputs["main"]
            if summary["lossy"]:  # how far the lossy output is from the target's
                from specjax.decoding.fly import agreement

                summary["ar_agreement"] = agreement(outputs["main"], outputs["ar"])

    records = []
    for (pid, prompt_ids), ids in zip(prompts, outputs["main"], strict=True):
        rec = {"id": pid, "prompt_ids": prompt_ids, "output_ids": ids}
        if tokenizer is not None:
            rec["text"] = tokenizer.decode(ids, skip_special_tokens=True)
        records.append(rec)
    for (_, prompt_ids), rec in zip(prompts[:args.show], records[:args.show], strict=True):
        print(_show(rec, prompt_ids, tokenizer))
    g_text = "auto" if schedule is not None else summary["gamma"]
    print(f"\nsummary ({drafter_arg}, G={g_text}, {summary['verify']}):")
    print(_format_table(summary))
    files = []  # both or neither (the paths were checked before any work)
    if args.output:
        lines = "".join(json.dumps(r) + "\n" for r in records).encode()
        files.append((args.output, lambda f: f.write(lines)))
    if args.summary:
        text = (json.dumps(summary, indent=2) + "\n").encode()
        files.append((args.summary, lambda f: f.write(text)))
    try:
        atomic_write_all(files)
    except OSError as e:
        raise SpecjaxError(f"cannot write {e.filename or args.output} ({e.strerror}); "
                           "nothing was written") from None
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from specjax.errors import SpecjaxError

    try:
        return run(args)
    except SpecjaxError as e:
        print(f"decode.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
