"""A decoding session: what decode.py does, as a library call that benchmarks and notebooks
share.

    from specjax.decoding.options import DecodeConfig
    from specjax.decoding.session import build

    session = build(DecodeConfig(drafter="checkpoints/demo/drafters/eagle3"))
    prompts, chat = session.read_prompts(path="checkpoints/demo/prompts.jsonl")
    report = session.run(prompts, chat=chat)
    print(format_summary(report.summary))        # specjax.decoding.report

`build` reads configs and the tokenizer only; the first `run` checks memory against the
prompts' shapes, then loads the weights (once per session) and compiles the engines (once
per shape). With a drafter and `compare_ar`, autoregressive decoding of the same prompts
runs too, interleaved batch by batch, and the summary reports the speedup and whether the
outputs are identical.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NamedTuple

from specjax.compile_cache import enable_compile_cache
from specjax.decoding import report as report_lib
from specjax.decoding.loading import DEFAULT_GAMMA, load_drafter, load_target, resolve_dtype
from specjax.decoding.options import DecodeConfig
from specjax.errors import SpecjaxError


class Report(NamedTuple):
    """records: one dict per prompt, in input order (id, prompt_ids, output_ids, text when
    the target has a tokenizer); summary: the run's figures (`specjax.decoding.report`)."""

    records: list[dict]
    summary: dict


def check_memory(cfg: DecodeConfig, model_cfg, dtype, max_length: int, prompt_width: int) -> None:
    """Raises SpecjaxError, before anything is allocated, when the target's weights, the
    KV caches of the engines a session builds (speculative and, with compare_ar,
    autoregressive), the drafter and the prefill's activations need more than the device
    has free (`specjax.plan`; estimates from config.json and file sizes)."""
    from specjax import plan
    from specjax.decoding.loop import DraftShape
    from specjax.models.config import ModelConfig

    B, G = cfg.batch_size, cfg.draft_length or DEFAULT_GAMMA
    S = max_length + DraftShape(G, cfg.num_drafts, cfg.tree_nodes).nodes  # the verified drafts
    c = model_cfg
    cache = plan.kv_cache_bytes(c.num_layers, B, c.num_kv_heads, S, c.head_dim, dtype)
    parts = {"target weights": plan.weight_bytes(c, dtype),
             "KV cache": cache * (2 if cfg.compare_ar and cfg.drafter != "none" else 1),
             "prefill activations": plan.prefill_activation_bytes(c, B, prompt_width, S)}
    d = cfg.drafter
    if d not in ("none", "ngram") and d is not None and os.path.isdir(d):
        files = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".safetensors")]
        parts["drafter"] = 2 * sum(os.path.getsize(f) for f in files)  # bf16 on disk -> f32
        if os.path.isfile(os.path.join(d, "config.json")):
            try:  # a draft LM: its own cache; a learned drafter: about Ld + 1 caches
                dc = ModelConfig.from_dir(d)
                parts["drafter"] += plan.kv_cache_bytes(dc.num_layers, B, dc.num_kv_heads, S,
                                                        dc.head_dim, dtype)
            except SpecjaxError:
                parts["drafter"] += 3 * cache // max(c.num_layers, 1)
    need = sum(parts.values())
    free, where = plan.available_bytes()
    if free is not None and need > free:
        detail = ", ".join(f"{k} {plan.fmt_bytes(v)}" for k, v in parts.items())
        raise SpecjaxError(
            f"decoding needs about {plan.fmt_bytes(need)} ({detail}) but {where} has "
            f"{plan.fmt_bytes(free)} free; lower --max-length (now {max_length}) or "
            f"--batch-size (now {B})")


class Session:
    """One target (and drafter) with the options of a `DecodeConfig`; see the module
    docstring. Attributes: cfg, model_cfg (the target's ModelConfig), tokenizer (or
    None), dtype; after the first run: target, loaded (the `LoadedDrafter`), engines."""

    def __init__(self, cfg: DecodeConfig):
        from specjax.models.checkpoint import load_tokenizer
        from specjax.models.config import ModelConfig

        self.cfg = cfg
        enable_compile_cache(cfg.compile_cache)
        self.dtype = resolve_dtype(cfg.dtype)
        self.model_cfg = ModelConfig.from_dir(cfg.target)  # config.json only: no weights
        self.tokenizer = load_tokenizer(cfg.target)
        self.target = self.loaded = self.drafter = None
        self.constraint_set = None  # the last prompt set's (`constrain`)
        self.constraint_stats: dict | None = None
        self._default_regex = None  # --regex, or --json-schema's regex (checked here)
        if cfg.constrained:
            from specjax.constraints.sets import read_schema_file, regex_of

            schema = None if cfg.json_schema is None else read_schema_file(cfg.json_schema)
            try:
                self._default_regex = regex_of(cfg.regex, schema)
            except SpecjaxError as e:
                flag = "--regex" if cfg.regex is not None else f"--json-schema {cfg.json_schema}"
                raise SpecjaxError(f"{flag}: {e}") from None
        self._engines: dict[tuple, Any] = {}
        self._said: set[str] = set()  # the fallback notes printed so far (once each)

    @property
    def lossy(self) -> bool:
        """A LOSSY mode is on (--verify fly, --partial-verify)."""
        return self.cfg.verify == "fly" or self.cfg.partial_verify

    @property
    def identity_guaranteed(self) -> bool:
        """True when greedy output is guaranteed identical to autoregressive decoding and
        sampled output exactly the target's distribution: a lossless rule with either
        --exact (batch-invariant forwards, any dtype: `specjax.models.invariant`) or the
        target in float32 (--dtype and --matmul-dtype). In float32 a verify forward of
        G+1 rows still rounds a few last bits differently from a one-row forward, far
        below any logit gap seen so far; in bf16 the difference is large enough to flip
        a near-tie, and greedy output can differ on a few prompts (docs/decode.md,
        "Exactness and dtypes")."""
        import jax.numpy as jnp

        return not self.lossy and (self.cfg.exact or (
            self.dtype == jnp.float32 and self.cfg.matmul_dtype in ("auto", "float32")))

    @property
    def identity(self) -> str:
        """How the run relates to autoregressive decoding at T = 0: "bit-identical
        (--exact)", "float32", "not guaranteed (bfloat16)" or "lossy"."""
        import jax.numpy as jnp

        if self.lossy:
            return "lossy"
        if self.cfg.exact:
            return "bit-identical (--exact)"
        if self.dtype == jnp.float32 and self.cfg.matmul_dtype in ("auto", "float32"):
            return "float32"
        return "not guaranteed (bfloat16)"

    def notes(self, plan) -> list[str]:
        """The lines decode.py prints on stderr before decoding: each fallback from the
        kernels asked for (`specjax.decoding.kernel_policy.describe`) and, for a drafter
        in bf16, that the output is not guaranteed identical to autoregressive decoding."""
        from specjax.decoding.kernel_policy import describe

        _, notes = describe(plan.main.cfg, self.drafter)
        if self.drafter is not None and not self.identity_guaranteed and not self.lossy:
            notes.append("note: the target runs in bfloat16 (--dtype/--matmul-dtype): the "
                         "output is the target's up to bf16 rounding, not guaranteed "
                         "identical to autoregressive decoding; --exact (any dtype) or "
                         "--dtype float32 makes it so")
        return notes

    def read_prompts(self, prompt: str | None = None, path: str | None = None,
                     chat: bool = False) -> tuple[list[tuple[Any, list[int]]], bool]:
        """(prompts as (id, token ids), chat: whether they were rendered with the chat
        template) from one text prompt, a JSONL file or the bundled demo prompts
        (`specjax.decoding.prompts.read_prompt_set`)."""
        from specjax.decoding.prompts import read_prompt_set

        return read_prompt_set(self.tokenizer, self.model_cfg.vocab_size, prompt=prompt,
                               path=path, target=self.cfg.target, chat=chat)

    def constrain(self, prompts, chat: bool = False) -> list[tuple[Any, list[int]]]:
        """The prompts with their constraints (a prompt's own "regex"/"json_schema", else
        --regex / --json-schema), each pattern compiled once into a token automaton
        (`specjax.constraints.sets.compile_cached`, cached beside the compilation cache),
        and `constraint_set` the set's stacked table (None when no prompt is constrained).
        Reads the tokenizer only: a bad pattern fails before any weights load.
        Raises SpecjaxError (one line) for a pattern that does not compile, a table over
        the size budget, or a constraint with a lossy mode."""
        import time

        from specjax.constraints.sets import ConstrainedIds, ConstraintSet, compile_cached

        out = []
        for pid, ids in prompts:
            regex = getattr(ids, "regex", None) or self._default_regex
            out.append((pid, ids if regex is None else ConstrainedIds(ids, regex)))
        patterns = list(dict.fromkeys(ids.regex for _, ids in out
                                      if getattr(ids, "regex", None)))
        if not patterns:
            self.constraint_set, self.constraint_stats = None, None
            return out
        if self.lossy:
            raise SpecjaxError("a lossy mode (--verify fly, --partial-verify) cannot run "
                               "under a constraint: the constrained output is lossless only")
        eos = self.eos_ids(chat)
        if not eos:
            raise SpecjaxError("a constraint ends a row at the end-of-sequence token: the "
                               "target's config.json names none (or --ignore-eos)")
        t0 = time.perf_counter()
        autos = [compile_cached(p, self.cfg.target, eos, self.model_cfg.vocab_size,
                                self._constraint_cache()) for p in patterns]
        self.constraint_set = ConstraintSet(autos, eos, self.model_cfg.vocab_size)
        self.constraint_stats = {
            "patterns": len(autos), "prompts": sum(getattr(ids, "regex", None) is not None
                                                   for _, ids in out),
            "states": sum(a.num_states for a in autos),
            "token_classes": max(a.num_classes for a in autos),
            "table_bytes": self.constraint_set.table_bytes,
            "compile_s": round(time.perf_counter() - t0, 3)}
        return out

    def _constraint_cache(self) -> str | None:
        """Where compiled automata are cached: COMPILE_CACHE/specjax-constraints (None with
        --compile-cache none)."""
        from specjax.compile_cache import cache_subdir

        return cache_subdir(self.cfg.compile_cache, "specjax-constraints")

    def _shapes(self, prompts) -> tuple[int, int]:
        """(max_length, prompt_width) for these prompts; SpecjaxError where they do not fit."""
        from specjax.decoding.engine import prompt_width_for

        c, mc = self.cfg, self.model_cfg
        longest = max(len(ids) for _, ids in prompts)
        max_length = c.max_length
        if max_length is None:  # the prompt width's multiple of 16 + the new tokens: prompt
            # sets whose longest prompt rounds to the same width share one compiled shape
            need = longest + c.max_new_tokens
            padded = prompt_width_for(longest, 1 << 62) + c.max_new_tokens
            max_length = max(need, min(padded, mc.max_position_embeddings))
        for pid, ids in prompts:
            if len(ids) + c.max_new_tokens > max_length:
                raise SpecjaxError(
                    f"prompt {pid}: {len(ids)} prompt tokens + --max-new-tokens "
                    f"{c.max_new_tokens} > --max-length {max_length}; raise --max-length or "
                    "shorten the prompt")
        if max_length > mc.max_position_embeddings and not c.allow_long_context:
            raise SpecjaxError(
                f"--max-length {max_length} exceeds the target's max_position_embeddings "
                f"{mc.max_position_embeddings} (positions it was not trained for); lower "
                "--max-length, --max-new-tokens or the prompt length, or pass "
                "--allow-long-context to run anyway")
        return max_length, prompt_width_for(longest, max_length)

    def load(self) -> None:
        """The target's and the drafter's weights, once per session."""
        if self.target is not None:
            return
        c = self.cfg
        self.target = load_target(c.target, dtype=self.dtype, matmul_dtype=c.matmul_dtype,
                                  cfg=self.model_cfg, tokenizer=self.tokenizer)
        self.loaded = load_drafter(
            c.drafter, self.target, gamma=c.draft_length, sampling=self.sampling,
            dtype=self.dtype, matmul_dtype=c.drafter_dtype, draft_vocab=c.draft_vocab,
            draft_stop=c.draft_stop, draft_window=c.draft_window, draft_reuse=c.draft_reuse,
            verify=c.verify, num_drafts=c.num_drafts,
            tree_nodes=c.tree_nodes if c.tree_topk is None else None)
        self.drafter = self.loaded.drafter
        if c.tree_topk is not None:
            if self.drafter is None:
                raise SpecjaxError("--tree-topk needs a drafter (--drafter none decodes "
                                   "autoregressively)")
            from specjax.drafters.dynamic_tree import DynamicTree

            self.drafter = DynamicTree(self.drafter, c.tree_topk, c.tree_nodes)

    @property
    def sampling(self):
        from specjax.core.sampling import SamplingParams

        return SamplingParams(self.cfg.temperature, self.cfg.top_k, self.cfg.top_p)

    def rule(self):
        """The verification rule object of --verify (FLy with its window and threshold)."""
        if self.cfg.verify != "fly":
            return self.cfg.verify
        from specjax.decoding.fly import FlyVerify

        c = self.cfg
        return FlyVerify(window=6 if c.fly_window is None else c.fly_window,
                         threshold=0.3 if c.fly_entropy is None else c.fly_entropy)

    def partial(self):
        """--partial-verify's `PartialVerify`, or None."""
        if not self.cfg.partial_verify:
            return None
        from specjax.decoding.partial import PartialVerify

        b = self.cfg.partial_budget
        return PartialVerify(budget=4096 if b is None else b)

    def eos_ids(self, chat: bool) -> tuple[int, ...]:
        """The tokens that stop a row: the target's EOS and, for chat prompts, the
        template's end of turn (none with ignore_eos)."""
        if self.cfg.ignore_eos:
            return ()
        eos = tuple(self.model_cfg.eos_token_ids)
        if chat:
            from specjax.data.chat import end_of_turn_ids

            eos = eos + tuple(i for i in end_of_turn_ids(self.tokenizer) if i not in eos)
        return eos

    def engines(self, prompts, chat: bool = False):
        """The session's `specjax.decoding.engines.EngineSet` for these prompts' shapes
        (memory checked, weights loaded and engines built on first use of a shape)."""
        from specjax.decoding.engines import build_engines

        shapes = self._shapes(prompts)
        cset = self.constraint_set
        key = (*shapes, chat, None if cset is None else tuple(cset.index))
        if key not in self._engines:
            check_memory(self.cfg, self.model_cfg, self.dtype, *shapes)
            self.load()
            self._engines[key] = build_engines(self, *shapes, self.eos_ids(chat))
        return self._engines[key]

    def run(self, prompts: list[tuple[Any, list[int]]], chat: bool = False) -> Report:
        """Decodes `prompts` ((id, token ids) pairs) in batches of cfg.batch_size; returns the
        `Report`. Raises SpecjaxError for prompts that do not fit or a bad drafter."""
        import jax
        from tqdm import tqdm

        c = self.cfg
        prompts = self.constrain(prompts, chat)
        plan = self.engines(prompts, chat)
        plan.reset()  # a second run of the session reports its own prompts only
        for note in self.notes(plan):
            if note not in self._said:
                self._said.add(note)
                print(note, file=sys.stderr)
        batches = [prompts[i:i + c.batch_size] for i in range(0, len(prompts), c.batch_size)]
        base_key = jax.random.key(c.seed)
        plan.compile()
        plan.calibrate(batches, base_key)
        for i, batch in enumerate(tqdm(batches, desc="decoding", unit="batch", disable=None,
                                       file=sys.stderr)):
            plan.run([ids for _, ids in batch], jax.random.fold_in(base_key, i))
        timing = None
        if c.step_timing and self.drafter is not None:
            timing = plan.main.step_timing([ids for _, ids in batches[0]], c.max_new_tokens,
                                           base_key)
        summary = report_lib.summary(self, plan, len(prompts), chat, timing)
        recs = report_lib.records(prompts, plan.outputs["main"], self.tokenizer,
                                  self.constraint_set)
        if "constraint" in summary:
            summary["constraint"]["matched"] = sum(bool(r.get("matched")) for r in recs)
        return Report(recs, summary)


def build(cfg: DecodeConfig) -> Session:
    """The `Session` of cfg (configs and tokenizer read; weights on the first run)."""
    return Session(cfg)
