"""Speculative decoding from local HF Qwen3 / Llama-3 checkpoints.

    python decode.py          # the demo: bundled target + draft LM on the bundled prompts
    python decode.py --target DIR [--drafter {none,ngram,DIR}] --prompt TEXT
    python decode.py --target DIR --drafter DIR --prompts prompts.jsonl --output out.jsonl \
        --summary summary.json

With a drafter, autoregressive decoding of the same prompts also runs, interleaved
batch by batch, and the summary reports the speedup and whether greedy outputs are
identical (--no-compare-ar skips it).

Prompt lines are JSON objects with "prompt" (text) or "input_ids" (list of ints) and
an optional "id". Output lines, in input order: id, output_ids (new tokens only),
text (when the target has a tokenizer). Bad input exits with code 2 and one line on
stderr, and writes no output file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from specjax import cli

DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints", "demo")
# The default drafter: the first of these under DEMO_DIR that exists.
DEMO_DRAFTERS = ("drafters/eagle3", "drafters/block", "draft")
DEFAULT_GAMMA = 4  # n-gram and draft LM (learned drafters default to their trained G)
# jax's persistent compilation cache when neither --compile-cache nor
# JAX_COMPILATION_CACHE_DIR names one
DEFAULT_COMPILE_CACHE = os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
    "specjax", "jax")


def build_parser() -> argparse.ArgumentParser:
    ap = cli.ArgumentParser(prog="decode.py",
                            description="Lossless speculative decoding with specjax.")
    ap.add_argument("--target", default=os.path.join(DEMO_DIR, "target"),
                    help="HF checkpoint directory of the target (default: the bundled demo)")
    ap.add_argument("--drafter", default=None,
                    help="none (autoregressive), ngram (prompt lookup), a drafter directory "
                         "written by train.py (eagle3, kv, hybrid, block), or a draft LM "
                         "directory (default: the best bundled demo drafter)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompts", help="JSONL file of prompts (default: the bundled demo prompts)")
    src.add_argument("--prompt", help="a single text prompt")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--gamma", type=int, default=None,
                    help="draft length G (default: the G a learned drafter was trained for, "
                         "else 4)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0, help="0 = off")
    ap.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    ap.add_argument("--verify", choices=("token", "block"), default="block",
                    help="verification rule when sampling (greedy at temperature 0)")
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
                         "slightly different model from the f32 run (README). auto: --dtype")
    ap.add_argument("--drafter-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="matmul inputs of a learned drafter (eagle3, kv, hybrid, block); "
                         "the target and so the output are unaffected. auto: bfloat16 "
                         "(bf16 inputs, f32 accumulation; faster on CPU, the TPU/GPU "
                         "default anyway)")
    ap.add_argument("--draft-vocab", choices=("auto", "full"), default="auto",
                    help="learned drafters: auto = draft over the hot vocabulary in the "
                         "drafter directory's draft_vocab.json when there is one (a smaller "
                         "LM-head matmul per draft step; output unchanged), full = all ids")
    ap.add_argument("--draft-stop", type=float, default=0.0,
                    help="eagle3/hybrid drafters: stop drafting a step once every row's "
                         "chain confidence (product of its drafts' top-1 draft "
                         "probabilities) is below this; the rest of the G positions get a "
                         "filler the target rejects unless it agrees (output unchanged). "
                         "0: always draft G")
    ap.add_argument("--kernels", choices=("auto", "off", "reference", "pallas"),
                    default="auto",
                    help="verification: pallas = the fused Pallas kernel from the target's "
                         "logits (interpret mode on CPU: slow), reference = its jnp twin "
                         "(identical output for a seed), off = specjax.verify on "
                         "probabilities; auto: pallas on TPU, reference elsewhere. pallas "
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


def enable_compile_cache(arg: str | None) -> str | None:
    """Points jax's persistent compilation cache at `arg` ("none": off; None: the
    directory jax already has from JAX_COMPILATION_CACHE_DIR, else DEFAULT_COMPILE_CACHE,
    or off where JAX_ENABLE_COMPILATION_CACHE=false) and returns the directory used, or
    None; a default directory that cannot be created or written turns the cache off
    (raises SpecjaxError for an explicit `arg`). Call before the first compilation: jax
    reads the setting once per process. Programs that compile in under a second are not
    cached (jax's `jax_persistent_cache_min_compile_time_secs`); the cache key holds the
    program, the jax and XLA versions and XLA_FLAGS, so a stale entry is never loaded."""
    import jax

    if arg == "none" or (arg is None and not jax.config.jax_enable_compilation_cache):
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    from specjax.errors import SpecjaxError

    current = jax.config.jax_compilation_cache_dir
    path = arg or current or DEFAULT_COMPILE_CACHE
    try:
        os.makedirs(path, exist_ok=True)
        usable = os.access(path, os.W_OK)
    except OSError:
        usable = False
    if not usable:
        if arg:
            raise SpecjaxError(f"--compile-cache {arg}: cannot create or write that directory; "
                               "pass a writable one or --compile-cache none")
        jax.config.update("jax_enable_compilation_cache", False)  # a read-only home: skip
        return None
    if path != current:
        jax.config.update("jax_compilation_cache_dir", path)
    return path


def validate_flags(args) -> None:
    """Checks the flags that need no file read, and every output path (an existing
    directory, a missing or unwritable parent), before any work.

    Raises: SpecjaxError (one line naming the flag)."""
    from specjax.errors import SpecjaxError

    if args.gamma is not None and args.gamma < 1:
        raise SpecjaxError(f"--gamma={args.gamma} must be >= 1")
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
    from specjax.fileio import check_output_file

    for flag, path in (("--output", args.output), ("--summary", args.summary)):
        if path:
            check_output_file(path, flag)
    if args.output and args.summary and os.path.abspath(args.output) == os.path.abspath(
            args.summary):
        raise SpecjaxError(f"--output and --summary both name {args.output}; pass two files")


def read_prompts(tokenizer, vocab_size: int, *, prompt: str | None = None,
                 path: str | None = None, target: str | None = None
                 ) -> list[tuple[str, list[int]]]:
    """[(id, input_ids)] from the text `prompt` (--prompt) or else the JSONL `path`
    (--prompts; None: the bundled prompts, UTF-8, a leading BOM allowed); `target` names
    the tokenizer's directory in errors.

    Raises: SpecjaxError (one line naming the file and line, or --prompt) for an
      unreadable file, a line that is not UTF-8 or not a JSON object with "prompt" or
      "input_ids", text with lone surrogates (not Unicode: a --prompt argument holding
      bytes that are not UTF-8, or an unpaired \\udXXX JSON escape), an empty prompt
      or a token id outside [0, vocab_size)."""
    from specjax.errors import SpecjaxError

    def check_text(text, where, what="the prompt"):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise SpecjaxError(
                f"{where}: {what} holds a lone surrogate (U+{ord(text[e.start]):04X} at "
                f"character {e.start}), which is not Unicode text; pass UTF-8 text"
                + ("" if where == "--prompt" else " (a JSON \\udXXX escape needs its pair)")
            ) from None

    def encode(text, where):
        check_text(text, where)
        if tokenizer is None:
            raise SpecjaxError(f"{where}: text prompts need a tokenizer in --target "
                               f"{target}; give \"input_ids\" instead")
        return list(tokenizer.encode(text))

    items = []
    if prompt is not None:
        items.append(("0", encode(prompt, "--prompt"), "--prompt"))
    else:
        file = path or os.path.join(DEMO_DIR, "prompts.jsonl")
        try:
            with open(file, "rb") as f:
                lines = f.read().splitlines()
        except OSError as e:
            raise SpecjaxError(f"--prompts {file} is unreadable ({e.strerror}); "
                               "pass a JSONL file or --prompt TEXT") from None
        for n, raw in enumerate(lines, 1):
            where = f"{file} line {n}"
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise SpecjaxError(f"{where}: byte 0x{raw[e.start]:02x} at column "
                                   f"{e.start + 1} is not UTF-8; save the file as UTF-8 "
                                   "JSONL") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SpecjaxError(f"{where}: malformed JSON ({e.msg}); each line must be "
                                   "one JSON object") from None
            if not isinstance(obj, dict) or ("prompt" not in obj and "input_ids" not in obj):
                raise SpecjaxError(f"{where}: needs a \"prompt\" (text) or \"input_ids\" "
                                   "(list of ints) field")
            if "input_ids" in obj:
                ids = obj["input_ids"]
                if not isinstance(ids, list) or not all(
                        isinstance(i, int) and not isinstance(i, bool) for i in ids):
                    raise SpecjaxError(f"{where}: \"input_ids\" must be a list of ints")
            else:
                if not isinstance(obj["prompt"], str):
                    raise SpecjaxError(f"{where}: \"prompt\" must be a string")
                ids = encode(obj["prompt"], where)
            pid = str(obj.get("id", len(items)))
            check_text(pid, where, "the \"id\"")
            items.append((pid, ids, where))
    if not items:
        raise SpecjaxError(f"--prompts {path or os.path.join(DEMO_DIR, 'prompts.jsonl')}: "
                           "no prompts found")
    for _, ids, where in items:
        if not ids:
            raise SpecjaxError(f"{where}: the prompt is empty")
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise SpecjaxError(f"{where}: token id {bad[0]} is outside the vocabulary "
                               f"[0, {vocab_size})")
    return [(pid, ids) for pid, ids, _ in items]


def make_drafter_from_args(args, target, sampling, dtype):
    """(drafter, params, name) for args.drafter (None: the default demo drafter; "none":
    (None, None, "none"); a directory: an EAGLE-3 or DFlash head (`drafters.external`), a
    specjax drafter, or an HF draft LM, told apart by config.json); sets args.gamma to
    the G used (a learned drafter's trained G unless --gamma is given, else
    DEFAULT_GAMMA)."""
    from specjax.checkpoint import load_model
    from specjax.drafters.config import DrafterConfig
    from specjax.drafters.draft_lm import DraftLMDrafter
    from specjax.drafters.external import detect_layout, load_external
    from specjax.drafters.ngram import NgramDrafter
    from specjax.errors import SpecjaxError

    name = args.drafter
    if name is None:
        found = [d for d in DEMO_DRAFTERS if os.path.isdir(os.path.join(DEMO_DIR, d))]
        name = os.path.join(DEMO_DIR, found[0]) if found else "ngram"
    V = target.cfg.vocab_size
    if getattr(args, "draft_stop", 0.0) and not DrafterConfig.is_drafter_dir(name):
        raise SpecjaxError(f"--draft-stop: only learned eagle3 and hybrid drafters stop "
                           f"early, not --drafter {name}")
    if name == "none":
        return None, None, name
    if name == "ngram":
        args.gamma = args.gamma or DEFAULT_GAMMA
        return NgramDrafter(args.gamma, V, sampling=sampling), (), name
    if detect_layout(name):  # EAGLE-3 / DFlash heads trained elsewhere
        drafter, dparams = load_external(
            name, target, gamma=args.gamma, sampling=sampling, dtype=dtype,
            matmul_dtype=drafter_matmul_dtype(getattr(args, "drafter_dtype", "auto")),
            draft_vocab=getattr(args, "draft_vocab", "auto"))
        args.gamma = drafter.gamma
        return drafter, dparams, name
    if DrafterConfig.is_drafter_dir(name):
        drafter, dparams = load_learned_drafter(
            name, target, args.target, args.gamma, sampling, dtype,
            matmul_dtype=drafter_matmul_dtype(getattr(args, "drafter_dtype", "auto")),
            draft_vocab=getattr(args, "draft_vocab", "auto"),
            stop_below=getattr(args, "draft_stop", 0.0))
        args.gamma = drafter.gamma
        return drafter, dparams, name
    args.gamma = args.gamma or DEFAULT_GAMMA
    drafter, dparams = DraftLMDrafter.create(load_model(name, dtype=dtype), args.gamma,
                                             sampling, V)
    return drafter, dparams, name


def flag_dtype(name: str, auto=None):
    """A dtype flag's value ("auto", "float32", "bfloat16") -> a jnp dtype; "auto" -> `auto`.
    --matmul-dtype: auto None (the model's --dtype); --drafter-dtype: auto bfloat16."""
    import jax.numpy as jnp

    return {"auto": auto, "bfloat16": jnp.bfloat16, "float32": jnp.float32}[name]


def drafter_matmul_dtype(name: str):
    """--drafter-dtype -> the matmul dtype for make_drafter (auto: bfloat16)."""
    import jax.numpy as jnp

    return flag_dtype(name, auto=jnp.bfloat16)


def load_learned_drafter(path, target, target_dir, gamma, sampling, dtype, matmul_dtype=None,
                         draft_vocab="full", stop_below=0.0):
    """(drafter, params) from a drafter directory written by train.py, checked against the
    target: same shapes, and trained against these weights (the fingerprint recorded at
    export). draft_vocab: "auto" drafts over the directory's hot vocabulary
    (draft_vocab.json, `specjax.drafters.vocab`) when it has one, "full" over all ids.
    stop_below: early stop of drafting (`specjax.drafters.make_drafter`).
    Raises SpecjaxError naming both directories otherwise."""
    from flax import nnx

    from specjax.checkpoint import fingerprint
    from specjax.drafters import build_network, make_drafter
    from specjax.drafters.io import load_drafter
    from specjax.errors import SpecjaxError

    dcfg, params, record = load_drafter(path, dtype=dtype)
    trained_on = record.get("path", "an unrecorded target")
    recorded = record.get("weights_fingerprint")
    if recorded is not None and recorded != fingerprint(target_dir):
        raise SpecjaxError(f"drafter {path} was trained against target {trained_on}, not "
                           f"--target {target_dir} (other weights); pass --target "
                           f"{trained_on} or train a drafter for this target")
    try:
        dcfg.check_target(target.cfg, where=f"drafter {path}")
    except SpecjaxError as e:
        raise SpecjaxError(f"{e}: it was trained against {trained_on}, not --target "
                           f"{target_dir}") from None
    net = build_network(dcfg, dtype=dtype, rngs=nnx.Rngs(0))
    nnx.update(net, params)
    hot = None
    if draft_vocab == "auto":
        from specjax.drafters.vocab import load_draft_vocab

        hot = load_draft_vocab(path, target.cfg.vocab_size)
    return make_drafter(dcfg, net, target, gamma=gamma, sampling=sampling,
                        matmul_dtype=matmul_dtype, draft_vocab=hot, stop_below=stop_below)


def _format_table(summary: dict) -> str:
    rows = [("new tokens", f"{summary['new_tokens']}"),
            ("wall (s, no compile)", f"{summary['wall_s']:.2f}"),
            ("compile (s)", f"{summary['compile_s']:.2f}"),
            ("tokens/s", f"{summary['tokens_per_s']:.1f}")]
    if summary.get("tau") is not None:
        rows.append(("tau (tokens/step)", f"{summary['tau']:.3f}"))
        rows.append(("alpha_k", " ".join("-" if a is None else f"{a:.2f}" for a in summary["alpha"])))
    if "speedup" in summary:
        rows.append(("AR tokens/s", f"{summary['ar_tokens_per_s']:.1f}"))
        rows.append(("speedup over AR", f"{summary['speedup']:.2f}x"))
        if summary.get("ar_identical") is not None:
            rows.append(("identical to AR", str(summary["ar_identical"])))
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)


def check_memory(args, cfg, dtype, max_length: int, prompt_width: int) -> None:
    """Raises SpecjaxError, before anything is allocated, when the target's weights, the
    KV caches of the engines decode.py builds (speculative and, with --compare-ar,
    autoregressive), the drafter and the prefill's activations need more than the
    device has free (`specjax.plan`; estimates from config.json and file sizes)."""
    from specjax import plan
    from specjax.config import ModelConfig
    from specjax.errors import SpecjaxError

    B = args.batch_size
    S = max_length + (args.gamma or DEFAULT_GAMMA) + 1  # room for a draft block
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
    import jax.numpy as jnp
    from tqdm import tqdm

    from specjax.checkpoint import load_model, load_tokenizer
    from specjax.config import ModelConfig
    from specjax.engine import Engine, Stats, prompt_width_for
    from specjax.errors import SpecjaxError
    from specjax.fileio import atomic_write_all
    from specjax.sampling import SamplingParams

    validate_flags(args)
    enable_compile_cache(args.compile_cache)
    dtype_name = args.dtype
    if dtype_name == "auto":
        dtype_name = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype_name]
    cfg = ModelConfig.from_dir(args.target)  # config.json only: no weights read yet
    tokenizer = load_tokenizer(args.target)
    prompts = read_prompts(tokenizer, cfg.vocab_size, prompt=args.prompt, path=args.prompts,
                           target=args.target)
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
        from specjax.sharding import check_batch, decode_mesh

        mesh = decode_mesh(args.mesh)
        check_batch(mesh, args.batch_size)
    target = load_model(args.target, dtype=dtype, matmul_dtype=flag_dtype(args.matmul_dtype))

    drafter, dparams, drafter_arg = make_drafter_from_args(args, target, sampling, dtype)
    eos = () if args.ignore_eos else cfg.eos_token_ids
    common = dict(sampling=sampling, verify=args.verify, max_length=max_length,
                  prompt_width=prompt_width, batch_size=args.batch_size, eos_token_ids=eos,
                  kernels=args.kernels, mesh=mesh)
    engines = {"main": Engine(target, drafter=drafter, drafter_params=dparams, **common)}
    if args.compare_ar and drafter is not None:
        engines["ar"] = Engine(target, **common)

    batches = [prompts[i:i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
    base_key = jax.random.key(args.seed)
    stats = {name: Stats() for name in engines}
    outputs = {name: [] for name in engines}
    for name, eng in engines.items():
        stats[name].compile_s = eng.compile()
    for i, batch in enumerate(tqdm(batches, desc="decoding", unit="batch",
                                   disable=None, file=sys.stderr)):
        key = jax.random.fold_in(base_key, i)
        for name, eng in engines.items():  # interleaved, so both see the same machine state
            out = eng.run([ids for _, ids in batch], args.max_new_tokens, key)
            stats[name].add(out)
            outputs[name].extend(out.outputs)

    st = stats["main"]
    summary = {"new_tokens": st.new_tokens, "wall_s": st.wall_s, "compile_s": st.compile_s,
               "tokens_per_s": st.tokens_per_s,
               "tau": st.tau if drafter is not None else None,
               "alpha": st.alpha if drafter is not None else [],
               "drafter": drafter_arg, "gamma": args.gamma if drafter is not None else 0,
               "verify": "greedy" if sampling.greedy else args.verify,
               "kernels": engines["main"].cfg.kernels,
               "batch_size": args.batch_size, "prompts": len(prompts),
               "mesh": dict(mesh.shape) if mesh is not None else None}
    if args.compare_ar:
        ar = stats.get("ar", st)
        summary["ar_tokens_per_s"] = ar.tokens_per_s
        summary["speedup"] = st.tokens_per_s / ar.tokens_per_s
        if "ar" in outputs and sampling.greedy:
            summary["ar_identical"] = outputs["ar"] == outputs["main"]

    records = []
    for (pid, _), ids in zip(prompts, outputs["main"], strict=True):
        rec = {"id": pid, "output_ids": ids}
        if tokenizer is not None:
            rec["text"] = tokenizer.decode(ids, skip_special_tokens=True)
        records.append(rec)
    for (_, prompt_ids), rec in zip(prompts[:args.show], records[:args.show], strict=True):
        print(_show(rec, prompt_ids, tokenizer))
    print(f"\nsummary ({drafter_arg}, G={summary['gamma']}, {summary['verify']}):")
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
