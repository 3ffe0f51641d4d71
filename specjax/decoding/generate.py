"""Autoregressive and speculative generation, each ONE jitted `lax.while_loop`.

State lives in fixed-size buffers (gemma's sampler is the template): the token
buffer i32[B,S'], per-row lengths, the target KV cache, the drafter state, the RNG
key and the counters. Row b's committed tokens are tokens[b, :lengths[b]]; the last
one is *pending*: its target K/V is not cached yet, so the next target forward
starts with it (docs/design.md section 3). Rows that stopped (EOS or budget) keep
running inside the batch but write nothing more.

Per speculative step: the drafter proposes G tokens and their q; the target
verifies [pending, x_1..x_G] at positions lengths-1 .. lengths-1+G in one forward;
the verifier picks tau and the next token; the row emits x_1..x_tau and the next
token, cut at its first EOS and at its budget; the target cache is rewound by
length; the drafter updates.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx, struct

from specjax.core.drafter import Drafter, LoopView, take_rows
from specjax.core.sampling import SamplingParams, filtered_probs, sample_logits
from specjax.core.tree import DraftTree, ancestor_mask, path_tokens, tree_from_drafts
from specjax.decoding import kernel_policy
from specjax.decoding import partial as partial_lib
from specjax.decoding.verify import VERIFIERS, Verdict
from specjax.models.kv_cache import KVCache
from specjax.models.matmul import vmapped_copies
from specjax.models.prefill import pad_rows, padded_width, prefill_pieces, scan_prompt_pieces

VerifyFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], Verdict]
KERNEL_CHOICES = kernel_policy.LOOP_KERNELS
_log = logging.getLogger("specjax")


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """Static settings of one compiled loop.

    max_length: prompt + new tokens per row, at most (positions).
    prompt_width: Tp, the padded prompt width of the prefill (static shape).
    sampling: target (and drafter) filtering.
    eos_token_ids: tokens that stop a row (empty: only budgets stop rows).
    verify: "greedy", "token", "block", or a VerifyFn (tests inject biased ones);
      with temperature 0 every rule is replaced by greedy, except a LOSSY rule
      (`specjax.decoding.fly.FlyVerify`, temperature 0 only: ValueError otherwise), which
      reads the target's softmax through its `probs` and replaces greedy.
    kernels: how verification runs. "off": `specjax.decoding.verify` on the filtered
      probabilities; "reference" / "pallas": `pallas_kernels.verify.verify_logits`
      straight from the target's logits, as jnp or as Pallas kernels (interpret mode on
      CPU); the two give identical output for the same seed. Top-k / top-p and custom
      VerifyFns are not fused: they take the "off" path (one log line). "pallas" also
      runs the target's attention into its KV cache in decode and verify forwards
      through `pallas_kernels.attention` (see `target_attention`); "off" and
      "reference" keep the chunked jnp attention (`specjax.models.attention`).
    pallas_backend: "auto" (Triton on GPU, Mosaic TPU layout elsewhere), "tpu" or
      "triton": the kernels' layout and compiler parameters (specjax.export sets it).
    pallas_interpret: None (interpret mode on the CPU backend only) or a bool.
    prefill_chunk: prompts wider than this many tokens are prefilled in pieces of at
      most this many (`specjax.models.prefill.scan_prompt_pieces`: whole chunks in a `lax.scan`,
      then the rest as one piece of the smallest size in `prefill_pieces` that covers
      it), each writing its K/V before the next attends to them, so activation memory
      follows the chunk, not the prompt: a 32k-token prompt needs scores for one chunk
      of tokens against one chunk of cache slots at a time. Pieces wholly past every
      row's prompt are skipped, so a short prompt padded to a wide Tp pays for its own
      pieces only. None: `specjax.models.prefill.default_prefill_chunk()` (256 on the CPU
      backend, 512 elsewhere).
    prefill_min_chunk: the smallest piece: the sizes are prefill_chunk and its exact
      halves down to the smallest >= this (`specjax.models.prefill.prefill_pieces`). None:
      `specjax.models.prefill.default_prefill_min_chunk(prefill_chunk)` (64 on the CPU backend;
      elsewhere the chunk itself, whole chunks only).
    num_drafts: K >= 1 drafts per step. K = 1: one chain of G drafts (the drafter's
      propose). K > 1: K drafts of G tokens from the same state (at temperature 0 the
      top-K first tokens, each continued greedily; above it K independent samples),
      verified as one draft tree of N = 1 + K*G nodes in one target forward with a tree
      mask (`specjax.core.tree`, `specjax.decoding.tree_verify`); the accepted path's
      K/V are compacted into place (`compact_path`).
    cache_sharding: None (one device, or whatever XLA propagates), or the NamedSharding of
      the target cache's k and v [L,B,K,S,H] on a mesh (`specjax.decoding.sharding.cache_sharding`),
      applied where the cache is created.
    schedule: None (every step drafts G), or a `specjax.decoding.adaptive.GammaSchedule`:
      each step picks its draft length from `schedule.choices` (chains only; the
      speculative loop then takes a cost table, see `speculative_loop`).
    partial: None, or a `specjax.decoding.partial.PartialVerify`: SpecPV partial
      verification, LOSSY (chains with a fixed draft length only; ValueError otherwise):
      past a context threshold most verify forwards attend to a partial KV cache, with a
      full verification whenever its buffer fills (`specjax.decoding.partial`).
    """

    max_length: int
    prompt_width: int
    sampling: SamplingParams = SamplingParams()
    eos_token_ids: tuple[int, ...] = ()
    verify: str | VerifyFn = "block"
    kernels: str = "off"
    pallas_backend: str = "auto"
    pallas_interpret: bool | None = None
    prefill_chunk: int | None = None
    prefill_min_chunk: int | None = None
    cache_sharding: Any = None
    num_drafts: int = 1
    schedule: Any = None
    partial: Any = None

    def __post_init__(self):
        if self.num_drafts < 1:
            raise ValueError(f"num_drafts={self.num_drafts} must be >= 1")
        if self.schedule is not None and self.num_drafts > 1:
            raise ValueError("an adaptive schedule drafts chains: num_drafts must be 1")
        for name in ("prefill_chunk", "prefill_min_chunk"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels={self.kernels!r}: expected one of {KERNEL_CHOICES}")
        if getattr(self.verify, "lossy", False) and not self.sampling.greedy:
            raise ValueError("a lossy verification rule (FLy) runs at temperature 0 only")
        if self.partial is not None and (self.num_drafts > 1 or self.schedule is not None):
            raise ValueError("partial verification verifies one chain of a fixed draft "
                             "length: num_drafts must be 1 and schedule None")

    def prefill_sizes(self) -> tuple[int, ...]:
        """The prefill's static piece sizes, largest first (`specjax.models.prefill.prefill_pieces`)."""
        return prefill_pieces(self.prefill_chunk, self.prefill_min_chunk)

    def fused_verify(self) -> Callable | None:
        """fn(target_logits [B,G+1,V], draft i32[B,G], q f32[B,G,V], key) -> Verdict
        through pallas_kernels.verify, or None where this config takes the "off" path."""
        if self.kernels == "off":
            return None
        sp = self.sampling
        if not isinstance(self.verify, str) or (not sp.greedy and (sp.top_k or sp.top_p < 1)):
            _log.info("kernels=%s: top-k/top-p or a custom verify rule is not fused; "
                      "verifying with specjax.decoding.verify", self.kernels)
            return None
        from pallas_kernels.verify import verify_logits

        rule = "greedy" if sp.greedy else self.verify
        impl, temperature = self.kernels, sp.temperature

        def fn(logits, draft, q, key):
            return verify_logits(logits, draft, key, rule=rule, temperature=temperature,
                                 draft_probs=None if rule == "greedy" else q, impl=impl,
                                 backend=self.pallas_backend,
                                 interpret=self.pallas_interpret)

        return fn

    def target_attention(self) -> Callable | None:
        """The `attention=` argument of the target's decode and verify forwards
        (`specjax.models.model.Transformer.__call__`): None (the chunked jnp
        `specjax.models.attention.cache_attention`) unless kernels == "pallas", then the causal
        `pallas_kernels.attention.decode_attention` over the layer-major cache, read in
        place, whose cost follows each row's length, not the capacity.

        The jnp path, not the kernel's own jnp reference, is the non-Pallas twin: that
        reference scores all S slots ([B, K, R, T, S]), which would slow the default CPU
        path as the cache grows. The kernel and the chunked path agree up to f32 summation
        order (tests/test_target_attention.py). The prefill (T = prompt width) always takes
        the jnp path: the kernel holds a [T*R, H] query block on chip and is meant for few
        queries. With `cache_sharding` (a mesh) the jnp path runs too, with one log line:
        the kernel is not partitioned over the mesh (XLA would gather the cache)."""
        if self.kernels == "pallas" and self.cache_sharding is not None:
            _log.info("kernels=pallas: the attention kernel does not run on a mesh; the "
                      "target attends with specjax.models.attention")
        return kernel_policy.target_attention(self.kernels, self.cache_sharding,
                                              self.pallas_backend, self.pallas_interpret)

    def drafter_attention(self) -> Callable | None:
        """The kernel a learned drafter attends with (its `attention` field, set by
        `speculative_loop` through `specjax.decoding.kernel_policy.with_drafter_attention`; the
        `kernel` of `specjax.drafters.attend.attend`): None (the drafters' jnp attention)
        unless kernels == "pallas", then `pallas_kernels.attention.packed_attention` for
        every source given by a per-query limit (the drafter's own cache, the merged
        target memory, the block drafter's context); the block drafter's own block and
        the TTT-style diagonals stay jnp (a few entries per query) and are merged by
        log-sum-exp. On a mesh (`cache_sharding`) the jnp path runs, as for
        `target_attention`."""
        return kernel_policy.drafter_attention(self.kernels, self.cache_sharding,
                                               self.pallas_backend, self.pallas_interpret)

    def tree_nodes(self, gamma: int, drafter=None) -> int:
        """N, the verify forward's tokens per row: G + 1 for a chain, 1 + K*G for K drafts,
        a tree drafter's own `tree_nodes` (`specjax.core.drafter.TreeDrafter`)."""
        if drafter is not None and hasattr(drafter, "propose_tree"):
            return drafter.tree_nodes
        return gamma + 1 if self.num_drafts == 1 else 1 + self.num_drafts * gamma

    def tree_verifier(self, gamma: int, drafter=None) -> Callable:
        """fn(tree, p f32[B,N,V], key) -> `specjax.decoding.tree_verify.TreeVerdict` for the
        num_drafts > 1 loop: greedy at temperature 0, else the tree form of `verify`
        ("token": recursive rejection sampling over siblings; "block": multi-draft block
        verification). A custom VerifyFn has no tree form (ValueError)."""
        from specjax.decoding import tree_verify

        if self.sampling.greedy:
            return functools.partial(tree_verify.verify_tree_greedy, max_depth=gamma)
        own = drafter is not None and hasattr(drafter, "propose_tree")
        if self.verify == "token":
            return functools.partial(
                tree_verify.verify_tree_token, max_depth=gamma,
                max_children=drafter.max_children if own else self.num_drafts)
        if self.verify == "block":
            if own:
                raise ValueError("verify='block' needs K independent drafts (num_drafts); "
                                 "a tree drafter's tree is verified with verify='token'")
            return functools.partial(tree_verify.verify_tree_block, max_depth=gamma)
        raise ValueError(f"verify={self.verify!r} has no draft-tree form (num_drafts > 1)")

    def verifier(self) -> VerifyFn:
        if getattr(self.verify, "lossy", False):  # FLy (specjax.decoding.fly): T = 0 only
            return self.verify
        if self.sampling.greedy:
            return VERIFIERS["greedy"]
        return VERIFIERS[self.verify] if isinstance(self.verify, str) else self.verify


@struct.dataclass
class LoopState:
    tokens: jax.Array  # i32[B,S'] prompt + output
    lengths: jax.Array  # i32[B] committed tokens; tokens[b, lengths-1] is pending
    prompt_lengths: jax.Array  # i32[B]
    budgets: jax.Array  # i32[B] max new tokens
    done: jax.Array  # bool[B]
    cache: KVCache  # target cache; positions 0..lengths-2 valid
    drafter_state: Any
    key: jax.Array
    steps: jax.Array  # i32[B] target forwards after the prefill while the row was active
    accepted: jax.Array  # i32[B,G] accepted draft tokens per draft position
    reached: jax.Array  # i32[B,G] steps that drafted position k with drafts < k accepted
    adapt: Any = None  # specjax.decoding.adaptive.AdaptState under a schedule
    partial: Any = None  # specjax.decoding.partial.PartialState under partial verification


@struct.dataclass
class LoopResult:
    """tokens i32[B,S']; lengths, prompt_lengths i32[B]; steps i32[B]; accepted,
    reached i32[B,G] (alpha_k = accepted[k] / reached[k]); chosen i32[n]: steps at each
    draft length of an adaptive schedule (i32[0] without one); alpha f32[B,G]: the
    schedule's acceptance estimates at the end (f32[0, 0] without one; the next run can
    start from them, `speculative_loop`'s alpha0); verified i32[2]: the steps verified
    in full and partially under partial verification (zeros without it); reused i32[4]:
    under a drafter that reuses its drafted hidden states (medc `--draft-reuse`,
    `specjax.drafters.eagle3.DraftChain.counts`; zeros otherwise) the drafted hidden
    states taken from the previous step's chain and drafted in all, summed over the rows
    that drafted, then the draft forwards the batch skipped and ran in all."""

    tokens: jax.Array
    lengths: jax.Array
    prompt_lengths: jax.Array
    steps: jax.Array
    accepted: jax.Array
    reached: jax.Array
    chosen: jax.Array
    alpha: jax.Array
    verified: jax.Array
    reused: jax.Array


def _is_eos(tokens, eos_ids):
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))


def _prefill(model, cfg: LoopConfig, prompts, prompt_lengths, budgets, key, gamma, capture,
             drafter=None):
    """Prefill, first token, and the initial loop state (shared by both loops)."""
    B, Tp = prompts.shape
    capacity = cfg.max_length + cfg.tree_nodes(gamma, drafter)
    positions = jnp.broadcast_to(jnp.arange(Tp, dtype=jnp.int32), (B, Tp))
    cache = model.init_cache(B, capacity)
    if cfg.cache_sharding is not None:
        constrain = functools.partial(jax.lax.with_sharding_constraint,
                                      shardings=cfg.cache_sharding)
        cache = cache.replace(k=constrain(cache.k), v=constrain(cache.v))
    sizes = cfg.prefill_sizes()
    with jax.named_scope("prefill"):  # benchmarks/profile_step.py reads the scope
        if Tp <= sizes[0]:
            out = model(prompts, positions, cache, capture=capture,
                        logits_at=(prompt_lengths - 1)[:, None])
            last_logits, hidden, cache = out.logits[:, 0], out.hidden, out.cache
        else:
            last_logits, hidden, cache = _chunked_prefill(model, sizes, prompts,
                                                          prompt_lengths, cache, capture)
    key, k_first = jax.random.split(key)
    first, _ = sample_logits(k_first, last_logits, cfg.sampling)
    tokens = jnp.zeros((B, capacity), jnp.int32).at[:, :Tp].set(prompts)
    active = budgets > 0
    rows = jnp.arange(B)
    tokens = tokens.at[rows, jnp.where(active, prompt_lengths, capacity)].set(first, mode="drop")
    lengths = prompt_lengths + active.astype(jnp.int32)
    done = ~active | (budgets <= 1) | _is_eos(first, cfg.eos_token_ids)
    state = LoopState(
        tokens=tokens, lengths=lengths, prompt_lengths=prompt_lengths, budgets=budgets,
        done=done, cache=cache.rewind(prompt_lengths), drafter_state=(), key=key,
        steps=jnp.zeros((B,), jnp.int32), accepted=jnp.zeros((B, max(gamma, 1)), jnp.int32),
        reached=jnp.zeros((B, max(gamma, 1)), jnp.int32),
    )
    view = LoopView(tokens, lengths, state.cache, hidden, positions, sizes, last_logits)
    return state, view


def _chunked_prefill(model, sizes, prompts, prompt_lengths, cache, capture):
    """The prefill forward over Tp > sizes[0] prompt tokens, in the pieces of
    `specjax.models.prefill.scan_prompt_pieces` (whole chunks of sizes[0], then the rest as one
    piece of the smallest size in `sizes` that covers it).

    Returns (logits f32[B,V] at each row's last prompt token, hidden [C,B,Tp,D] or None,
    cache). A piece's padding past the longest prompt writes slots past it, which the
    caller's rewind to the prompt lengths makes stale, as it does for the prompts' own
    padding; writes past the capacity are dropped. Positions past the pieces that ran
    (past the longest prompt, rounded up to a piece) are not processed: they write
    nothing and their hidden states are zeros."""
    B, Tp = prompts.shape
    last = prompt_lengths - 1  # [B]
    V = model.cfg.vocab_size
    width = padded_width(Tp, sizes)
    padded = pad_rows(prompts, 1, width)

    def run(toks, start, size, cache):
        pos = start + jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), (B, size))
        at = jnp.clip(last - start, 0, size - 1)[:, None]
        return model(toks, pos, cache, capture=capture, logits_at=at)

    def forward(carry, start, size):
        cache, logits, hidden = carry
        out = run(jax.lax.dynamic_slice_in_dim(padded, start, size, 1), start, size, cache)
        mine = (last >= start) & (last < start + size)
        logits = jnp.where(mine[:, None], out.logits[:, 0], logits)
        if hidden is not None:  # [C, B, width, D]
            hidden = jax.lax.dynamic_update_slice_in_dim(hidden, out.hidden, start, 2)
        return out.cache, logits, hidden

    one = jax.eval_shape(lambda: run(prompts[:, :1], 0, 1, cache).hidden)
    hidden = None if one is None else jnp.zeros(one.shape[:2] + (width,) + one.shape[3:],
                                                one.dtype)
    cache, logits, hidden = scan_prompt_pieces(
        forward, (cache, jnp.zeros((B, V), jnp.float32), hidden), Tp, sizes, last)
    return logits, None if hidden is None else hidden[:, :, :Tp], cache


def _result(s: LoopState) -> LoopResult:
    chosen = jnp.zeros((0,), jnp.int32) if s.adapt is None else s.adapt.chosen
    alpha = jnp.zeros((0, 0), jnp.float32) if s.adapt is None else s.adapt.alpha
    verified = (jnp.zeros((2,), jnp.int32) if s.partial is None
                else jnp.stack([s.partial.full, s.partial.partial]))
    chain = getattr(s.drafter_state, "chain", None)  # eagle3.DraftChain (medc reuse)
    reused = jnp.zeros((4,), jnp.int32) if chain is None else chain.counts
    return LoopResult(s.tokens, s.lengths, s.prompt_lengths, s.steps, s.accepted, s.reached,
                      chosen, alpha, verified, reused)


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg"))
def autoregressive_loop(graphdef, params, cfg: LoopConfig, prompts, prompt_lengths, budgets, key):
    """Plain decoding of the target, one token per forward, as one `lax.while_loop`.

    Args:
      graphdef, params: `nnx.split(target)`.
      prompts: i32[B,Tp] left-aligned, right-padded prompts; prompt_lengths: i32[B] >= 1.
      budgets: i32[B] max new tokens per row (0: the row is padding and emits nothing).
      key: PRNG key.
    Returns: LoopResult.
    """
    start, step = _fixed_phases(graphdef, None, cfg)
    state = start(params, None, prompts, prompt_lengths, budgets, key)
    final = jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: step(params, None, s),
                               state)
    return _result(final)


def _whole_step(propose, finish):
    """step(params, drafter_params, s) -> LoopState: `finish` of `propose`."""
    def step(params, drafter_params, s: LoopState) -> LoopState:
        return finish(params, drafter_params, s, propose(params, drafter_params, s))
    return step


def _fixed_phases(graphdef, drafter: Drafter | None, cfg: LoopConfig):
    """The two phases of a loop without an adaptive schedule, the same for autoregressive
    decoding (drafter None; drafter_params ignored) and a fixed draft length:
    start(params, drafter_params, prompts, prompt_lengths, budgets, key) -> LoopState
    (prefill, first token, drafter init) and step(params, drafter_params, s) -> LoopState
    (one token per row, or propose then finish: `_speculative_phases`)."""
    if drafter is not None:
        start, propose, finish = _speculative_phases(graphdef, drafter, cfg)
        return start, _whole_step(propose, finish)
    attention = cfg.target_attention()

    def start_ar(params, drafter_params, prompts, prompt_lengths, budgets, key) -> LoopState:
        model = nnx.merge(graphdef, params)
        return _prefill(model, cfg, prompts, prompt_lengths, budgets, key, 0, ())[0]

    def step_ar(params, drafter_params, s: LoopState) -> LoopState:
        model = nnx.merge(graphdef, params)
        rows = jnp.arange(s.tokens.shape[0])
        key, k = jax.random.split(s.key)
        pos = (s.lengths - 1)[:, None]
        pending = jnp.take_along_axis(s.tokens, pos, axis=1)
        out = model(pending, pos, s.cache, attention=attention)
        nxt, _ = sample_logits(k, out.logits[:, 0], cfg.sampling)
        active = ~s.done
        tokens = s.tokens.at[rows, jnp.where(active, s.lengths, s.tokens.shape[1])].set(
            nxt, mode="drop")
        lengths = s.lengths + active.astype(jnp.int32)
        stop = _is_eos(nxt, cfg.eos_token_ids) | (lengths - s.prompt_lengths >= s.budgets)
        return s.replace(tokens=tokens, lengths=lengths, done=s.done | (active & stop),
                         cache=out.cache.rewind(lengths - 1), key=key,
                         steps=s.steps + active.astype(jnp.int32))

    return start_ar, step_ar


def _emit(s: LoopState, cfg: LoopConfig, draft, tau, nxt):
    """Writes each active row's x_1..x_tau and the correction/bonus token `nxt`, cut at
    its first EOS and at its budget. draft i32[B,G]; tau, nxt i32[B].
    -> (tokens, lengths, done, act i32[B] = 1 for rows that were active)."""
    B, G = draft.shape
    offsets = jnp.arange(G + 1, dtype=jnp.int32)
    cand = jnp.concatenate([draft, jnp.zeros((B, 1), jnp.int32)], axis=1)
    cand = jnp.where(offsets[None, :] == tau[:, None], nxt[:, None], cand)
    in_block = offsets[None, :] <= tau[:, None]
    eos = _is_eos(cand, cfg.eos_token_ids) & in_block
    first_eos = jnp.where(jnp.any(eos, axis=1), jnp.argmax(eos, axis=1), G + 1)
    remaining = s.budgets - (s.lengths - s.prompt_lengths)
    active = ~s.done
    n_emit = jnp.minimum(jnp.minimum(tau + 1, remaining), first_eos + 1)
    n_emit = jnp.where(active, n_emit, 0).astype(jnp.int32)
    write_pos = jnp.where(offsets[None, :] < n_emit[:, None], s.lengths[:, None] + offsets,
                          s.tokens.shape[1])
    tokens = s.tokens.at[jnp.arange(B)[:, None], write_pos].set(cand, mode="drop")
    lengths = s.lengths + n_emit
    stop = (first_eos < n_emit) | (lengths - s.prompt_lengths >= s.budgets)
    return tokens, lengths, s.done | (active & stop), active.astype(jnp.int32)


def _advance(s: LoopState, tokens, lengths, done, act, cache, dstate, key, tau,
             drafted: int | None = None) -> LoopState:
    """The next loop state; counts the step, the accepted drafts per position, and the
    positions reached among the `drafted` (default G) drafts of this step."""
    G = s.accepted.shape[1]
    drafted = G if drafted is None else drafted
    k = jnp.arange(G)[None, :]
    accepted = s.accepted + act[:, None] * (k < tau[:, None])
    reached = s.reached + act[:, None] * ((k < drafted) & (k <= tau[:, None]))
    return s.replace(tokens=tokens, lengths=lengths, done=done, cache=cache,
                     drafter_state=dstate, key=key, steps=s.steps + act,
                     accepted=accepted.astype(jnp.int32), reached=reached.astype(jnp.int32))


def compact_path(cache: KVCache, base, path) -> KVCache:
    """Moves the accepted path's K/V into place after a draft tree's verify forward: node
    path[b, j] was written at slot base[b] + path[b, j]; it goes to slot base[b] + j
    (j = 0..G, every layer), so the cache holds the committed tokens contiguously again
    and the rejected branches' entries sit past the row's length, stale.
    cache k, v [L,B,K,S,H]; base i32[B]; path i32[B,G+1] (`specjax.core.tree`)."""
    B, P = path.shape
    rows = jnp.arange(B)[:, None]
    src = base[:, None] + path
    dst = base[:, None] + jnp.arange(P, dtype=jnp.int32)[None, :]
    # advanced indices around a slice: the gathered block is [B,P,L,K,H]
    k = cache.k.at[:, rows, :, dst].set(cache.k[:, rows, :, src], mode="drop")
    v = cache.v.at[:, rows, :, dst].set(cache.v[:, rows, :, src], mode="drop")
    return cache.replace(k=k, v=v)


def propose_drafts(drafter: Drafter, params, state, view: LoopView, key, num_drafts: int,
                   pending) -> DraftTree:
    """K = num_drafts drafts of G tokens from one drafter state, as a tree of 1 + K*G nodes
    (`specjax.core.tree.tree_from_drafts`): `drafter.propose` vmapped over K keys and
    first_rank = (0..K-1, K): at temperature 0 the top-K first tokens, each continued
    greedily (`specjax.core.sampling.ranked_choice`), above it K independent samples
    (a deterministic drafter such as n-gram uses the rank at every temperature). The proposals' drafter states are
    dropped: the loop updates the drafter from the state before the step
    (`update_after_tree` where a drafter has it). pending: i32[B] the root tokens."""
    keys = jax.random.split(key, num_drafts)
    ranks = jnp.arange(num_drafts, dtype=jnp.int32)

    def one(k, r):
        draft, q, _ = drafter.propose(params, state, view, k, first_rank=(r, num_drafts))
        return draft, (None if drafter.sampling.greedy else q)
    with vmapped_copies(num_drafts):  # tells the CPU matmul tuning about the vmap
        drafts, q = jax.vmap(one)(keys, ranks)  # [K,B,G], [K,B,G,V] or None
    if q is None:
        return tree_from_drafts(pending, jnp.moveaxis(drafts, 0, 1))
    return tree_from_drafts(pending, jnp.moveaxis(drafts, 0, 1), jnp.moveaxis(q, 0, 1))


def _speculative_phases(graphdef, drafter: Drafter, cfg: LoopConfig):
    """The speculative loop's three phases, as functions of the (traced) weights:

      start(params, drafter_params, prompts, prompt_lengths, budgets, key) -> LoopState
        (prefill, first token, drafter init);
      propose(params, drafter_params, s) -> proposal: (draft i32[B,G], q, drafter state)
        for one chain, a `DraftTree` for a tree step;
      finish(params, drafter_params, s, proposal) -> LoopState: the target's verify
        forward, the rule, emission, rewind or compaction, drafter update.

    `speculative_loop` runs finish(propose(s)) in a `lax.while_loop`; `step_timing`
    compiles propose and the whole step separately to time them."""
    if cfg.schedule is not None:
        raise ValueError("cfg.schedule: use _adaptive_phases")
    G = drafter.gamma
    verify = cfg.verifier()
    fused = cfg.fused_verify()
    attention = cfg.target_attention()
    # the drafter's attention: the kernel or jnp, fixed by cfg (part of this trace's key)
    drafter = kernel_policy.with_drafter_attention(drafter, cfg.drafter_attention())
    offsets = jnp.arange(G + 1, dtype=jnp.int32)
    own_tree = hasattr(drafter, "propose_tree")  # a TreeDrafter (e.g. LogitSpec)
    wants_logits = getattr(drafter, "reads_logits", False)
    tree_mode = cfg.num_drafts > 1 or own_tree
    if tree_mode and cfg.partial is not None:
        raise ValueError("partial verification verifies one chain, not a draft tree")
    if tree_mode:
        tree_verify = cfg.tree_verifier(G, drafter)
        update_after_tree = getattr(drafter, "update_after_tree", drafter.update)

    def start(params, drafter_params, prompts, prompt_lengths, budgets, key) -> LoopState:
        model = nnx.merge(graphdef, params)
        state, view = _prefill(model, cfg, prompts, prompt_lengths, budgets, key, G,
                               drafter.capture, drafter)
        key, k_init = jax.random.split(state.key)
        with jax.named_scope("drafter_init"):
            dstate = drafter.init(drafter_params, view, k_init)
        pstate = None
        if cfg.partial is not None:
            c = model.cfg
            pstate = partial_lib.init_state(cfg.partial, c.num_layers, prompts.shape[0],
                                            c.num_kv_heads)
        return state.replace(drafter_state=dstate, key=key, partial=pstate)

    def keys(s: LoopState):
        return jax.random.split(s.key, 3)  # next loop key, drafting, verification

    def propose(params, drafter_params, s: LoopState):
        del params
        _, k_draft, _ = keys(s)
        view = LoopView(s.tokens, s.lengths, s.cache, None, (s.lengths - 1)[:, None])
        # Named scopes label the HLO ops for benchmarks/profile_step.py (no run-time cost).
        with jax.named_scope("drafter_propose"):
            if own_tree:
                return drafter.propose_tree(drafter_params, s.drafter_state, view, k_draft)[0]
            if tree_mode:
                pending = jnp.take_along_axis(s.tokens, (s.lengths - 1)[:, None], 1)[:, 0]
                return propose_drafts(drafter, drafter_params, s.drafter_state, view,
                                      k_draft, cfg.num_drafts, pending)
            return drafter.propose(drafter_params, s.drafter_state, view, k_draft)

    def finish_chain(params, drafter_params, s: LoopState, proposal) -> LoopState:
        model = nnx.merge(graphdef, params)
        key, _, k_verify = keys(s)
        draft, q, dstate = proposal
        pos = s.lengths[:, None] - 1 + offsets[None, :]  # [B,G+1]
        pending = jnp.take_along_axis(s.tokens, pos[:, :1], axis=1)
        chain = jnp.concatenate([pending, draft], axis=1)
        pstate = s.partial
        with jax.named_scope("target_verify_forward"):
            if cfg.partial is None:
                out = model(chain, pos, s.cache, capture=drafter.capture, attention=attention)
                logits, hidden, cache = out.logits, out.hidden, out.cache
            else:  # SpecPV (lossy): plain, full or partial, chosen per step
                logits, hidden, cache, pstate = partial_lib.verify_forward(
                    model, cfg.partial, s.partial, s.tokens, s.lengths, s.cache, chain,
                    ~s.done, drafter.capture, attention)
        with jax.named_scope("verify_rule"):
            if fused is not None:
                tau, nxt = fused(logits, draft, q, k_verify)
            else:
                p = (verify.probs(logits) if hasattr(verify, "probs")
                     else filtered_probs(logits, cfg.sampling))
                tau, nxt = verify(draft, q, p, k_verify)
        tokens, lengths, done, act = _emit(s, cfg, draft, tau, nxt)
        cache = cache.rewind(lengths - 1)
        after = LoopView(tokens, lengths, cache, hidden, pos,
                         logits=take_rows(logits, tau) if wants_logits else None)
        with jax.named_scope("drafter_update"):
            dstate = drafter.update(drafter_params, dstate, after, tau)
        return _advance(s, tokens, lengths, done, act, cache, dstate, key, tau,
                        drafted=draft.shape[1]).replace(partial=pstate)

    def finish_tree(params, drafter_params, s: LoopState, tree: DraftTree) -> LoopState:
        model = nnx.merge(graphdef, params)
        key, _, k_verify = keys(s)
        base = s.lengths - 1  # the root's (pending token's) position and slot
        pos = base[:, None] + tree.depths  # [B,N]
        with jax.named_scope("target_verify_forward"):
            out = model(tree.tokens, pos, s.cache, capture=drafter.capture,
                        attention=attention, tree_mask=ancestor_mask(tree, G))
        with jax.named_scope("verify_rule"):
            p = filtered_probs(out.logits, cfg.sampling)  # [B,N,V]
            tau, nxt, path = tree_verify(tree, p, k_verify)
        draft = path_tokens(tree, path)[:, 1:]  # [B,G] the accepted path's drafts
        tokens, lengths, done, act = _emit(s, cfg, draft, tau, nxt)
        cache = compact_path(out.cache, base, path).rewind(lengths - 1)
        hidden = None
        if out.hidden is not None:  # [C,B,N,D] -> the path's [C,B,G+1,D]
            hidden = jnp.take_along_axis(out.hidden, path[None, :, :, None], axis=2)
        last = jnp.take_along_axis(path, tau[:, None], axis=1)[:, 0]  # the last accepted node
        after = LoopView(tokens, lengths, cache, hidden, base[:, None] + offsets[None, :],
                         logits=take_rows(out.logits, last) if wants_logits else None)
        with jax.named_scope("drafter_update"):
            dstate = update_after_tree(drafter_params, s.drafter_state, after, tau)
        return _advance(s, tokens, lengths, done, act, cache, dstate, key, tau)

    return start, propose, finish_tree if tree_mode else finish_chain


@struct.dataclass
class Deferred:
    """The drafter update that autoregressive steps under an adaptive schedule put off
    (`_adaptive_phases`): hidden [C,B,M,D] the target features those steps captured
    (None for a drafter that captures none), slot i at position start[b] + i (i32[B]),
    count i32[] slots filled, M = G + 1."""

    hidden: jax.Array | None
    start: jax.Array
    count: jax.Array


def _adaptive_phases(graphdef, drafter: Drafter, cfg: LoopConfig):
    """The loop's phases under an adaptive schedule (`cfg.schedule`,
    specjax.decoding.adaptive):

      start(params, drafter_params, prompts, prompt_lengths, budgets, key) -> LoopState
        (as `_speculative_phases`' at the drafter's G, plus the schedule's state);
      branch(params, drafter_params, s, index) -> LoopState: one step at draft length
        choices[index] (one branch per choice, each with its own static shapes; choice 0
        is an autoregressive step that still feeds the drafter its hidden states);
      step(params, drafter_params, s, costs) -> LoopState: `branch` at the index the
        schedule chooses from costs f32[n] (ms per step at each choice).

    An autoregressive step does not feed the drafter at once: it keeps the captured
    target features in a buffer (`Deferred`, M = G + 1 steps), and the drafter's update
    runs once over the whole buffer, as after a speculative step that accepted M - 1
    drafts, when the buffer is full or before the next speculative step. A run of
    autoregressive steps then costs the drafter one update per M steps instead of one
    per step. The drafter's state after the catch-up is what the per-step updates
    would have left (its entries depend on each position's features and the committed
    tokens only). Not for a drafter that reads the target's logits in `update`: it is
    updated every step.
    """
    from specjax.decoding import adaptive

    sched = cfg.schedule
    if hasattr(drafter, "propose_tree"):
        raise ValueError("an adaptive schedule drafts chains; this drafter proposes trees")
    if sched.gamma > drafter.gamma:
        raise ValueError(f"schedule choices {sched.choices} exceed the drafter's G "
                         f"{drafter.gamma}")
    fixed = dataclasses.replace(cfg, schedule=None)
    start_full, _, _ = _speculative_phases(graphdef, drafter, fixed)
    attention = cfg.target_attention()
    wants_logits = getattr(drafter, "reads_logits", False)
    full = kernel_policy.with_drafter_attention(drafter, cfg.drafter_attention())

    M = drafter.gamma + 1  # the deferred updates' window, as a speculative step's
    defer = sched.defer_update and not wants_logits

    def start(params, drafter_params, prompts, prompt_lengths, budgets, key,
              alpha0=None) -> LoopState:
        s = start_full(params, drafter_params, prompts, prompt_lengths, budgets, key)
        adapt = adaptive.init_state(sched, prompts.shape[0], alpha0)
        if defer:
            model = nnx.merge(graphdef, params)
            pos = (s.lengths - 1)[:, None]
            one = jax.eval_shape(lambda: model(pos, pos, s.cache, capture=drafter.capture,
                                               attention=attention).hidden)
            hidden = None if one is None else jnp.zeros(
                one.shape[:2] + (M,) + one.shape[3:], one.dtype)
            adapt = adapt.replace(deferred=Deferred(hidden, jnp.zeros_like(s.lengths),
                                                    jnp.int32(0)))
        return s.replace(adapt=adapt)

    def catch_up(drafter_params, s: LoopState, need: int = 1) -> LoopState:
        """The deferred update, if at least `need` slots are filled (once or never: a
        conditional would copy the loop state in and out)."""
        if not defer:
            return s

        def run(c):
            s = c[0]
            d = s.adapt.deferred
            pos = d.start[:, None] + jnp.arange(M, dtype=jnp.int32)[None, :]
            view = LoopView(s.tokens, s.lengths, s.cache, d.hidden, pos)
            with jax.named_scope("drafter_update"):
                dstate = full.update(drafter_params, s.drafter_state, view,
                                     jnp.full_like(s.lengths, d.count - 1))
            adapt = s.adapt.replace(deferred=d.replace(count=jnp.int32(0)))
            return s.replace(drafter_state=dstate, adapt=adapt), False

        return jax.lax.while_loop(lambda c: c[1], run,
                                  (s, s.adapt.deferred.count >= need))[0]

    def autoregressive(params, drafter_params, s: LoopState) -> LoopState:
        model = nnx.merge(graphdef, params)
        key, _, k_verify = jax.random.split(s.key, 3)
        pos = (s.lengths - 1)[:, None]
        pending = jnp.take_along_axis(s.tokens, pos, axis=1)
        with jax.named_scope("target_verify_forward"):
            out = model(pending, pos, s.cache, capture=drafter.capture, attention=attention)
        nxt, _ = sample_logits(k_verify, out.logits[:, 0], cfg.sampling)
        tau = jnp.zeros_like(s.lengths)
        tokens, lengths, done, act = _emit(s, cfg, jnp.zeros((len(nxt), 0), jnp.int32), tau,
                                           nxt)
        cache = out.cache.rewind(lengths - 1)
        if defer:  # keep the features; the drafter catches up when the buffer is full
            d = s.adapt.deferred
            hidden = d.hidden
            if hidden is not None:
                hidden = jax.lax.dynamic_update_slice_in_dim(
                    hidden, out.hidden.astype(hidden.dtype), d.count, axis=2)
            d = Deferred(hidden, jnp.where(d.count == 0, pos[:, 0], d.start), d.count + 1)
            new = _advance(s, tokens, lengths, done, act, cache, s.drafter_state, key, tau,
                           drafted=0)
            new = new.replace(adapt=new.adapt.replace(deferred=d))
            return catch_up(drafter_params, new, need=M)  # once the buffer is full
        after = LoopView(tokens, lengths, cache, out.hidden, pos,
                         logits=out.logits[:, 0] if wants_logits else None)
        with jax.named_scope("drafter_update"):
            dstate = full.update(drafter_params, s.drafter_state, after, tau)
        return _advance(s, tokens, lengths, done, act, cache, dstate, key, tau, drafted=0)

    def make_branch(index: int, g: int):
        if g == 0:
            run = autoregressive
        else:
            _, propose, finish = _speculative_phases(
                graphdef, adaptive.with_gamma(drafter, g), fixed)

            def run(params, drafter_params, s):
                s = catch_up(drafter_params, s)  # what autoregressive steps put off
                return finish(params, drafter_params, s, propose(params, drafter_params, s))

        def branch(params, drafter_params, s: LoopState) -> LoopState:
            new = run(params, drafter_params, s)
            tau = jnp.sum(new.accepted - s.accepted, axis=1)
            # new.adapt: alpha as before the step, the deferred buffer as after it
            return new.replace(adapt=adaptive.observe(sched, new.adapt, index, g, tau, ~s.done))
        return branch

    branches = [make_branch(i, g) for i, g in enumerate(sched.choices)]

    def branch(params, drafter_params, s: LoopState, index) -> LoopState:
        # Not `lax.switch`: XLA copies the KV cache in and out of a conditional's branches
        # (every step, the whole cache); a while loop that runs once or not at all updates
        # its carry in place, as the outer loop does. One runs per step.
        for i, b in enumerate(branches):
            s, index = jax.lax.while_loop(
                lambda c, i=i: c[1] == i,
                lambda c, b=b: (b(params, drafter_params, c[0]), jnp.int32(-1)),
                (s, index))
        return s

    def step(params, drafter_params, s: LoopState, costs) -> LoopState:
        k_choose = jax.random.fold_in(s.key, 0x5EED)  # its own stream (policy "random")
        remaining = s.budgets - (s.lengths - s.prompt_lengths)
        index = adaptive.choose(sched, s.adapt, costs, ~s.done, remaining, k_choose)
        return branch(params, drafter_params, s, index)

    return start, branch, step


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "drafter"))
def speculative_loop(graphdef, params, drafter: Drafter, drafter_params, cfg: LoopConfig,
                     prompts, prompt_lengths, budgets, key, costs=None, alpha0=None):
    """Speculative decoding (draft G, verify G+1 positions in one target forward) as one
    `lax.while_loop`; same arguments as `autoregressive_loop` plus the drafter (static)
    and its params. Lossless: greedy output equals `autoregressive_loop`'s; sampled
    output follows the filtered target distribution (docs/design.md section 4).
    With `cfg.num_drafts` K > 1, or a drafter that proposes trees itself
    (`specjax.core.drafter.TreeDrafter`), each step verifies a draft tree
    (`propose_drafts`, a tree-masked target forward, `LoopConfig.tree_verifier`,
    `compact_path`). The phases are `_speculative_phases`'.
    With `cfg.schedule` (an adaptive draft length, `_adaptive_phases`), costs f32[n] are
    the milliseconds per step at each of the schedule's choices (the cost table: a
    run-time input, so a new table needs no recompilation), and alpha0 f32[G] (or
    f32[B,G]) the acceptance estimates the schedule starts from (None: its prior; a
    previous run's `LoopResult.alpha` carries what it learned).
    """
    if cfg.schedule is not None:
        start_adaptive, _, adaptive_step = _adaptive_phases(graphdef, drafter, cfg)
        costs = jnp.ones((len(cfg.schedule.choices),), jnp.float32) if costs is None else costs

        def start(*args):
            return start_adaptive(*args, alpha0=alpha0)

        def step(s: LoopState) -> LoopState:
            return adaptive_step(params, drafter_params, s, costs)
    else:
        start, one_step = _fixed_phases(graphdef, drafter, cfg)

        def step(s: LoopState) -> LoopState:
            return one_step(params, drafter_params, s)
    state = start(params, drafter_params, prompts, prompt_lengths, budgets, key)

    final = jax.lax.while_loop(lambda s: ~jnp.all(s.done), step, state)
    return _result(final)


class PhasePrograms(NamedTuple):
    """The loop as two compiled programs (`phase_programs`): prefill(dynamic...) ->
    LoopState, and decode(params, drafter_params, state) -> (LoopResult, the final
    LoopState): the state's buffers are donated and become the final state's, so the
    loop runs in them without a copy of the KV cache."""

    prefill: Callable
    decode: Callable


def phase_programs(graphdef, params, drafter: Drafter | None, drafter_params,
                   cfg: LoopConfig, prompts, prompt_lengths, budgets, key) -> PhasePrograms:
    """The same loop as `autoregressive_loop` (drafter None) or `speculative_loop` (fixed
    draft length: `cfg.schedule` None), compiled as two programs so that a caller can time
    the prefill and the decoding apart: at long context the prefill takes ten times the
    decode of a few hundred tokens, and its run-to-run spread is larger than the whole
    decode (benchmarks/long_context.py). The arguments are those of the loops (shapes
    only matter: they are compiled for). The decode program takes the state's buffers
    (donated) and returns them as the final state (`PhasePrograms`). Raises ValueError
    for an adaptive schedule."""
    if drafter is not None and cfg.schedule is not None:
        raise ValueError("phase_programs: a fixed draft length only (cfg.schedule None)")
    prefill, one = _fixed_phases(graphdef, drafter, cfg)

    def decode(params, drafter_params, state):
        final = jax.lax.while_loop(lambda s: ~jnp.all(s.done),
                                   lambda s: one(params, drafter_params, s), state)
        return _result(final), final  # the final state: the donated buffers' outputs

    pre = jax.jit(prefill).lower(params, drafter_params, prompts, prompt_lengths, budgets,
                                 key).compile()
    state = jax.eval_shape(prefill, params, drafter_params, prompts, prompt_lengths,
                           budgets, key)
    dec = jax.jit(decode, donate_argnums=2).lower(params, drafter_params, state).compile()
    return PhasePrograms(pre, dec)


def step_timing(graphdef, params, drafter: Drafter, drafter_params, cfg: LoopConfig,
                prompts, prompt_lengths, budgets, key, repeats: int = 5) -> dict:
    """Milliseconds of one speculative step's parts, measured outside the loop: the
    drafter's proposal alone and the whole step (proposal + the target's verify forward +
    the rule + the drafter's update), each compiled on its own and run `repeats` times
    on the state after the prefill of these prompts (median wall time, after one
    untimed call). -> {"draft_ms", "step_ms", "verify_ms" = step_ms - draft_ms}.
    An estimate of where the loop's time goes: inside the loop XLA may fuse across the
    parts, and the context grows as decoding proceeds.

    Neither program copies what the loop does not: the proposal's program returns the
    drafts and q only (not the drafter state, whose caches grow with the context), and
    the whole step takes the state donated (a fresh copy per call, made before the clock
    starts), so it writes the KV cache in place as the loop does: a returned copy grows
    with the context (`python benchmarks/long_context.py speed --timing-only` times it at
    32k tokens)."""
    import time

    start, propose, finish = _speculative_phases(graphdef, drafter, cfg)
    state = jax.jit(start)(params, drafter_params, prompts, prompt_lengths, budgets, key)

    def draft_only(p, d, s):
        proposal = propose(p, d, s)
        return proposal[:2] if isinstance(proposal, tuple) else proposal  # drop the state

    copy = jax.jit(lambda s: jax.tree.map(jnp.copy, s))
    fns = {"draft_ms": (jax.jit(draft_only), False),
           "step_ms": (jax.jit(_whole_step(propose, finish), donate_argnums=2), True)}
    out = {}
    for name, (fn, donates) in fns.items():
        def arg(donates=donates):
            return jax.block_until_ready(copy(state)) if donates else state
        jax.block_until_ready(fn(params, drafter_params, arg()))
        times = []
        for _ in range(repeats):
            s = arg()
            t0 = time.perf_counter()
            jax.block_until_ready(fn(params, drafter_params, s))
            times.append(time.perf_counter() - t0)
        out[name] = 1e3 * sorted(times)[len(times) // 2]
    out["verify_ms"] = out["step_ms"] - out["draft_ms"]
    return out

