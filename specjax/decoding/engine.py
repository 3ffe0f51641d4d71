"""Host-side driver: pads prompts into fixed-shape batches, compiles each loop once,
runs it, and turns the loop's counters into tau and alpha_k (docs/design.md section 7).

    engine = Engine(target, drafter=drafter, drafter_params=dparams,
                    sampling=SamplingParams(), verify="block", max_length=512,
                    prompt_width=64, batch_size=4, eos_token_ids=(0,))
    batch = engine.run(prompts, max_new_tokens=128, key=jax.random.key(0))

One compiled program serves every batch with the same static settings; the first
call compiles (timed separately in `compile_s`). Adaptive draft length (`--gamma auto`)
drives an Engine from beside it: `specjax.decoding.adaptive.controller`.
"""

from __future__ import annotations

import copy
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.core.sampling import SamplingParams
from specjax.decoding.kernel_policy import resolve_kernels
from specjax.decoding.loop import (
    DraftShape,
    LoopConfig,
    autoregressive_loop,
    phase_programs,
    speculative_loop,
)
from specjax.decoding.loop.extension import EXTENSION
from specjax.decoding.timing import step_timing
from specjax.errors import SpecjaxError
from specjax.models.model import decoding_params


def prompt_width_for(longest: int, max_length: int, multiple: int = 16) -> int:
    """Tp: the longest prompt rounded up to `multiple` (so nearby prompt sets share one
    compiled shape), at most `max_length`."""
    return min(max_length, -(-longest // multiple) * multiple)


@dataclasses.dataclass
class BatchOutput:
    """outputs: new token ids per real row; steps: target forwards after the prefill per
    row (i32[B]); accepted: i32[B,G] accepted drafts per draft position; wall_s: run
    time without compilation (seconds); reached: i32[B,G] steps that drafted position k
    with drafts < k accepted (None: every step drafted G); chosen: i32[n] steps at each
    choice of adaptive draft length (`specjax.decoding.adaptive.controller`; None
    without it); verified: i32[2] steps verified in full and partially under partial
    verification (None without it); reused: i32[4] drafted hidden states reused from the
    previous step's chain and drafted in all (over rows), draft forwards skipped and in
    all (None unless the drafter reuses, medc `--draft-reuse`;
    `specjax.drafters.eagle3.DraftChain`); fallback: True where an adaptive engine
    (`specjax.decoding.adaptive.controller.AdaptiveEngine`) ran the batch with its
    autoregressive program (`specjax.decoding.adaptive.speculation_pays` was False)."""

    outputs: list[list[int]]
    steps: np.ndarray
    accepted: np.ndarray
    wall_s: float
    reached: np.ndarray | None = None
    chosen: np.ndarray | None = None
    verified: np.ndarray | None = None
    reused: np.ndarray | None = None
    fallback: bool = False


@dataclasses.dataclass
class Stats:
    """Totals over batches; `tau` and `alpha` follow docs/design.md section 7."""

    new_tokens: int = 0
    wall_s: float = 0.0
    compile_s: float = 0.0
    steps: int = 0
    accepted: np.ndarray | None = None  # i64[G]
    reached: np.ndarray | None = None  # i64[G]
    chosen: np.ndarray | None = None  # i64[n] steps per draft length (adaptive)
    verified: np.ndarray | None = None  # i64[2] full / partial steps (partial verification)
    reused: np.ndarray | None = None  # i64[4] as BatchOutput.reused (medc reuse)
    batches: int = 0
    fallback_batches: int = 0  # batches an adaptive engine ran autoregressively

    def add(self, batch: BatchOutput):
        self.batches += 1
        self.fallback_batches += int(batch.fallback)
        self.new_tokens += sum(len(o) for o in batch.outputs)
        self.wall_s += batch.wall_s
        self.steps += int(batch.steps.sum())
        acc = batch.accepted.sum(axis=0).astype(np.int64)
        self.accepted = acc if self.accepted is None else self.accepted + acc
        if batch.reached is not None:
            r = batch.reached.sum(axis=0).astype(np.int64)
            self.reached = r if self.reached is None else self.reached + r
        if batch.chosen is not None:
            c = np.asarray(batch.chosen, np.int64)
            self.chosen = c if self.chosen is None else self.chosen + c
        if batch.verified is not None:
            v = np.asarray(batch.verified, np.int64)
            self.verified = v if self.verified is None else self.verified + v
        if batch.reused is not None:
            u = np.asarray(batch.reused, np.int64)
            self.reused = u if self.reused is None else self.reused + u

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def alpha(self) -> list[float | None]:
        """alpha_k = P(draft k accepted | drafts < k accepted), k = 0..G-1; None where no
        step reached position k."""
        if self.accepted is None or self.steps == 0:
            return []
        reached = self.reached
        if reached is None:  # every step drafted G
            reached = np.concatenate([[self.steps], self.accepted[:-1]])
        return [float(a / r) if r else None for a, r in zip(self.accepted, reached, strict=True)]

    @property
    def tau(self) -> float:
        """Mean tokens per verification step, bonus included: 1 + accepted / steps."""
        if self.accepted is None or self.steps == 0:
            return float("nan")
        return 1.0 + float(self.accepted.sum()) / self.steps


def _drafter_heads(drafter, params, target_cfg) -> tuple[int, int]:
    """(N, K) of a drafter's attention: its config's, a draft LM's own model's, else the
    target's (n-gram has no weights)."""
    cfg = getattr(drafter, "cfg", None)
    if cfg is None and hasattr(drafter, "graphdef"):
        cfg = nnx.merge(drafter.graphdef, params).cfg
    cfg = cfg if hasattr(cfg, "num_kv_heads") else target_cfg
    return cfg.num_heads, cfg.num_kv_heads


def _extension_fields(cfg: LoopConfig, owns_step: bool = False) -> dict:
    """{field: None} for the loop extensions set in `cfg` (only those that replace the
    loop's step with `owns_step`): `dataclasses.replace(cfg, **...)` turns them off."""
    return {f.name: None for f in dataclasses.fields(cfg)
            if f.metadata.get(EXTENSION) and getattr(cfg, f.name) is not None
            and (not owns_step or getattr(cfg, f.name).owns_step)}


class Engine:
    """Runs autoregressive (drafter=None) or speculative generation in fixed-shape batches:
    one compiled loop, run and reported (`BatchOutput`).

    Args:
      target: the target `Transformer`.
      drafter, drafter_params: a Drafter (see specjax.core.drafter) and its params, or
        None for autoregressive decoding.
      sampling: SamplingParams for target and drafter.
      verify: "token" or "block" (greedy is used at temperature 0).
      max_length: prompt + new tokens per row, at most.
      prompt_width: padded prompt width Tp (>= the longest prompt).
      batch_size: rows per compiled batch; short batches are padded with empty rows.
      eos_token_ids: ids that end a row (empty for --ignore-eos).
      layer_loop: "auto", "scan" or "unroll" (see `specjax.models.model.decoding_params`).
      kernels: verification path, see `specjax.decoding.kernel_policy.resolve_kernels`.
      mesh: None (one device) or a (data, fsdp, model) mesh (`specjax.decoding.sharding.decode_mesh`):
        the target's and the drafter's weights and the KV cache are sharded over `model`,
        rows over `data` x `fsdp` (`batch_size` must split evenly).
      prefill_chunk, prefill_min_chunk: the prefill's largest and smallest pieces (see
        `LoopConfig`); None: the backend's defaults.
      num_drafts: drafts per step, verified as one draft tree when > 1 (see `LoopConfig`).
      partial: None, or a `specjax.decoding.partial.PartialVerify`: SpecPV partial
        verification, LOSSY (a drafter with one chain of fixed length; ignored without a
        drafter).
      extensions: {`LoopConfig` field: loop extension} (`specjax.decoding.loop.extension`),
        set in the loop's config with a drafter (ignored without one, as `partial`). An
        extension that takes run-time inputs gets them from `run`'s and `compile`'s
        `inputs` (`speculative_loop`'s); adaptive draft length is one, driven from beside
        the engine by `specjax.decoding.adaptive.controller.AdaptiveEngine`.
      exact: batch-invariant target forwards (`LoopConfig.exact`,
        `specjax.models.invariant`): greedy output equal to an exact autoregressive
        engine's bit for bit in any dtype; "auto" kernels then keep the jnp attention.
      constraints: None, or a `specjax.constraints.ConstraintSet`: structured output. A
        prompt given as `specjax.constraints.ConstrainedIds` (token ids with a `regex`)
        decodes under its automaton (docs/structured.md), plain lists unconstrained; the
        loop is compiled once for the set's table shapes.

    Raises: SpecjaxError for a batch size below 1 or one the mesh's data axis does not
    divide, or constraints with a lossy mode; ValueError for an `extensions` key that is not an extension field of
    `LoopConfig`, or "partial" given twice.
    """

    def __init__(self, target, *, drafter=None, drafter_params=None,
                 sampling: SamplingParams = SamplingParams(), verify="block",
                 max_length: int, prompt_width: int, batch_size: int = 1,
                 eos_token_ids: tuple[int, ...] = (), layer_loop: str = "auto",
                 kernels: str = "auto", mesh=None, prefill_chunk: int | None = None,
                 prefill_min_chunk: int | None = None, num_drafts: int = 1,
                 partial=None, extensions: dict | None = None, constraints=None,
                 exact: bool = False):
        if batch_size < 1:
            raise SpecjaxError(f"--batch-size={batch_size} must be >= 1")
        extensions = dict(extensions or {})
        fields = {f.name for f in dataclasses.fields(LoopConfig) if f.metadata.get(EXTENSION)}
        if not set(extensions) <= fields:
            raise ValueError(f"extensions {sorted(set(extensions) - fields)}: not loop "
                             f"extension fields of LoopConfig ({sorted(fields)})")
        if partial is not None:
            if extensions.get("partial") is not None:
                raise ValueError("partial given twice (partial= and extensions)")
            extensions["partial"] = partial
        self.graphdef, self.params = nnx.split(target)
        self.params = decoding_params(self.params, layer_loop)
        self.vocab_size = target.cfg.vocab_size
        self.drafter, self.drafter_params = drafter, drafter_params
        self.mesh = mesh
        cache_sharding = None
        if mesh is not None:
            from specjax.decoding import sharding

            c = target.cfg
            sharding.check_batch(mesh, batch_size)
            self.params = sharding.shard_params(mesh, self.params, c.num_heads, c.num_kv_heads)
            if drafter is not None:
                n, k = _drafter_heads(drafter, drafter_params, c)
                self.drafter_params = sharding.shard_params(mesh, drafter_params, n, k)
            nodes = DraftShape.of(drafter, num_drafts).nodes
            shape = (c.num_layers, batch_size, c.num_kv_heads, max_length + nodes,
                     c.head_dim)
            cache_sharding = sharding.cache_sharding(mesh, shape, c.num_heads)
        resolved = resolve_kernels(kernels)
        if exact and kernels == "auto":  # the exact mode attends with the jnp path
            resolved = {"pallas": "reference", "attention": "off"}.get(resolved, resolved)
        self.cfg = LoopConfig(max_length=max_length, prompt_width=prompt_width,
                              sampling=sampling, eos_token_ids=tuple(eos_token_ids),
                              verify=verify, kernels=resolved, exact=exact,
                              cache_sharding=cache_sharding, prefill_chunk=prefill_chunk,
                              prefill_min_chunk=prefill_min_chunk, num_drafts=num_drafts,
                              **(extensions if drafter is not None else {}))
        if constraints is not None and self.cfg.lossy:
            raise SpecjaxError("structured output (a regex or JSON schema) needs lossless "
                               "verification: drop the lossy --verify fly / --partial-verify")
        self.constraints = constraints
        self.batch_size = batch_size
        self.compiled = None
        self._phases = None  # `run_phases`' two programs, compiled on first use
        self.compile_s = 0.0

    @property
    def gamma(self) -> int:
        return self.drafter.gamma if self.drafter is not None else 0

    def _arrays(self, prompts, max_new_tokens):
        B, Tp = self.batch_size, self.cfg.prompt_width
        if len(prompts) > B:
            raise ValueError(f"{len(prompts)} prompts for a batch of {B}")
        tokens = np.zeros((B, Tp), np.int32)
        lengths = np.ones((B,), np.int32)
        budgets = np.zeros((B,), np.int32)
        for b, ids in enumerate(prompts):
            if not 1 <= len(ids) <= Tp:
                raise ValueError(f"prompt of {len(ids)} tokens does not fit width {Tp}")
            tokens[b, :len(ids)] = ids
            lengths[b] = len(ids)
            budgets[b] = max_new_tokens
        if self.mesh is None:
            return jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(budgets)
        from specjax.decoding.sharding import rows_sharding

        return tuple(jax.device_put(a, rows_sharding(self.mesh, a.shape))
                     for a in (tokens, lengths, budgets))

    def _fn_args(self, args):
        if self.drafter is None:
            return autoregressive_loop, (self.graphdef, self.params, self.cfg, *args)
        return speculative_loop, (self.graphdef, self.params, self.drafter, self.drafter_params,
                                  self.cfg, *args)

    def _constraint(self, prompts) -> dict:
        """The loop's keyword arguments for these prompts: {"constraint": the batch's
        `specjax.constraints.loop.Constraint`} with a ConstraintSet, else {}."""
        if self.constraints is None:
            return {}
        c = self.constraints.rows(prompts, self.batch_size)
        if self.mesh is not None:
            from specjax.decoding.sharding import rows_sharding

            c = c.replace(**{f: jax.device_put(getattr(c, f),
                                               rows_sharding(self.mesh, getattr(c, f).shape))
                             for f in ("automaton", "state")})
        return {"constraint": c}

    def _dynamic(self, args, inputs=None):
        """The compiled loop's arguments: `args` = (prompt arrays..., key) from `_arrays`,
        and with a drafter the loop extensions' run-time `inputs` (None: none)."""
        if self.drafter is None:
            return (self.params, *args)
        extra = () if inputs is None else (inputs,)
        return (self.params, self.drafter_params, *args, *extra)

    def without_drafter(self) -> Engine:
        """The autoregressive engine of the same target weights (shared, not copied),
        shapes, sampling and sharding: no drafter, no loop extensions, one draft; a new
        object, compiled on first use."""
        fb = copy.copy(self)
        fb.drafter = fb.drafter_params = None
        fb.cfg = dataclasses.replace(self.cfg, num_drafts=1, **_extension_fields(self.cfg))
        fb.compiled, fb.compile_s, fb._phases = None, 0.0, None
        return fb

    def _call(self, args, inputs=None, kw=None):
        """The `LoopResult` of one compiled run (compiled already) on `args` = (prompt
        arrays..., key) from `_arrays`, with the loop extensions' run-time `inputs` and
        the constraint keywords `kw` (`_constraint`)."""
        return jax.block_until_ready(self.compiled(*self._dynamic(args, inputs), **(kw or {})))

    def timed(self, prompts, budget, key, inputs=None) -> tuple[float, int]:
        """(seconds, loop iterations) of one run of the compiled loop (compiled already),
        with the loop extensions' run-time `inputs` (the prompts and `inputs` are staged
        before the clock starts): a calibration's measurement."""
        args = (*self._arrays(prompts, budget), key)
        kw = self._constraint(prompts)
        t0 = time.perf_counter()
        res = self._call(args, inputs, kw)
        return time.perf_counter() - t0, int(np.asarray(res.steps).max())

    def compile(self, key=None, inputs=None) -> float:
        """Compiles the loop for this engine's shapes; returns seconds spent (0 if done).
        inputs: the loop extensions' run-time inputs (`speculative_loop`'s; their shapes
        are compiled for, so later runs pass inputs of the same shapes), None for none."""
        if self.compiled is not None:
            return 0.0
        key = jax.random.key(0) if key is None else key
        args = (*self._arrays([], 1), key)
        fn, full = self._fn_args(args)
        if self.drafter is not None and inputs is not None:
            full = (*full, inputs)
        t0 = time.perf_counter()
        self.compiled = fn.lower(*full, **self._constraint([])).compile()
        self.compile_s = time.perf_counter() - t0
        return self.compile_s

    def run(self, prompts: list[list[int]], max_new_tokens: int, key,
            inputs=None) -> BatchOutput:
        """Generates for up to `batch_size` prompts (lists of token ids) in one compiled
        call; `inputs`: the loop extensions' run-time inputs (as compiled with)."""
        return self.run_loop(prompts, max_new_tokens, key, inputs)[0]

    def run_loop(self, prompts: list[list[int]], max_new_tokens: int, key, inputs=None):
        """`run`, also returning the host copy of the loop's `LoopResult` (its `ext`: the
        loop extensions' reports): (BatchOutput, LoopResult)."""
        self.compile(inputs=inputs)
        args = (*self._arrays(prompts, max_new_tokens), key)
        kw = self._constraint(prompts)
        t0 = time.perf_counter()
        res = self.compiled(*self._dynamic(args, inputs), **kw)
        res = jax.tree.map(np.asarray, jax.block_until_ready(res))
        return self._output(res, len(prompts), time.perf_counter() - t0), res

    def run_phases(self, prompts: list[list[int]], max_new_tokens: int, key
                   ) -> tuple[BatchOutput, float, float]:
        """`run`, with the loop compiled as two programs (`generate.phase_programs`, on
        first use) so that the prefill and the decoding are timed apart: (the output, its
        `wall_s` the sum of both; prefill seconds; decode seconds). For benchmarks at long
        context, where the prefill's spread between runs exceeds the decode's time.
        Raises ValueError for a loop extension that replaces the step, such as adaptive
        draft length (fixed draft length only)."""
        if self.drafter is not None and _extension_fields(self.cfg, owns_step=True):
            raise ValueError("run_phases: a fixed draft length only (no loop extension "
                             "that replaces the step)")
        if self.constraints is not None:
            raise ValueError("run_phases: not with constraints (use run)")
        args = (*self._arrays(prompts, max_new_tokens), key)
        if self._phases is None:
            self._phases = phase_programs(self.graphdef, self.params, self.drafter,
                                          self.drafter_params, self.cfg, *args)
        t0 = time.perf_counter()
        state = jax.block_until_ready(self._phases.prefill(self.params, self.drafter_params,
                                                           *args))
        t1 = time.perf_counter()
        res, _ = self._phases.decode(self.params, self.drafter_params, state)
        res = jax.tree.map(np.asarray, jax.block_until_ready(res))
        t2 = time.perf_counter()
        return self._output(res, len(prompts), t2 - t0), t1 - t0, t2 - t1

    def _output(self, res, n: int, wall: float) -> BatchOutput:
        """The BatchOutput of a host copy of `LoopResult` res for the first n rows."""
        outs = [res.tokens[b, res.prompt_lengths[b]:res.lengths[b]].tolist()
                for b in range(n)]
        G = max(self.gamma, 1)
        verified = res.ext["partial"]["verified"] if self.cfg.partial is not None else None
        reused = res.drafter.get("reused")
        return BatchOutput(outs, res.steps[:n], res.accepted[:n, :G], wall,
                           reached=res.reached[:n, :G], verified=verified, reused=reused)

    def step_timing(self, prompts: list[list[int]], max_new_tokens: int, key,
                    repeats: int = 5) -> dict:
        """Milliseconds of one speculative step's parts on this batch's state after the
        prefill: {"draft_ms", "verify_ms", "step_ms"} (`specjax.decoding.timing.step_timing`:
        compiled and timed outside the loop, an estimate; a step at the drafter's G, without
        a loop extension that replaces the step). Raises ValueError without a drafter."""
        if self.drafter is None:
            raise ValueError("step_timing needs a drafter")
        if self.constraints is not None:
            raise ValueError("step_timing: not with constraints")
        args = self._arrays(prompts, max_new_tokens)
        cfg = dataclasses.replace(self.cfg, **_extension_fields(self.cfg, owns_step=True))
        return step_timing(self.graphdef, self.params, self.drafter, self.drafter_params,
                           cfg, *args, key, repeats=repeats)
