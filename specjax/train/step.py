"""Train state, the `lm` loss, and the jitted train and eval steps.

The model is split once (`nnx.split(model, nnx.Param, ...)`): the parameters live in
the TrainState; the graph definition and the non-trainable rest (RoPE frequencies)
are closed over, and a pure loss function `nnx.merge`s them inside `jax.jit`
(docs/design.md 9: nnx.jit would copy every weight per call).

The `lm` objective is next-token cross-entropy averaged over all B*T target tokens:
inputs rows[:, :-1], targets rows[:, 1:] (with a loss mask, over the targets whose mask
is 1; a batch is rows or (rows, mask): `split_batch`). The forward is cache-free causal
self-attention over the row at positions 0..T-1, or, with `pose_max_position`, at PoSE's
skip-wise positions (`pose_positions`), which let rows of T tokens train the RoPE
distances of a longer context window.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from specjax.models.model import Transformer
from specjax.train import mesh as mesh_lib


def split_batch(batch):
    """(rows i32[..., T+1], mask f32[..., T+1] | None) of a batch that is rows alone or the
    pair (rows, mask) (`specjax.train.inputs.global_batch`); mask entry i is 1 where token
    i of the row is a training target."""
    if isinstance(batch, (tuple, list)):
        rows, mask = batch
        return rows, mask.astype(jnp.float32)
    return batch, None


def masked_mean(values: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Mean of `values` over the entries where `mask` is 1 (all entries when mask is None;
    0 when the mask holds no 1)."""
    if mask is None:
        return values.mean()
    return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def pose_positions(key: jax.Array, batch: int, length: int, max_position: int) -> jax.Array:
    """i32[batch, length]: PoSE's skip-wise position ids (Zhu et al., "PoSE: Efficient
    Context Window Extension of LLMs via Positional Skip-wise Training", ICLR 2024,
    arXiv 2309.10400, section 3.2, in the two-chunk form of its code,
    dwzhu-pku/PoSE src/train_pose.py `train_preprocess_function_pose`).

    Each row is cut in two chunks: the first holds l ~ U{1, ..., (length + 1) // 2}
    tokens at positions 0..l-1; the second continues at t + u for a skip
    u ~ U{0, ..., max_position - length}, so the last position is at most max_position - 1
    and relative distances up to max_position - 1 occur while the row holds `length`
    tokens. Positions increase strictly along a row, so index-causal attention stays
    causal. The row's text stays contiguous (the code also samples the second chunk's
    text from further on in the document; here the rows are already cut).

    Raises: ValueError if max_position < length or length < 2."""
    if length < 2 or max_position < length:
        raise ValueError(f"pose_positions needs 2 <= length <= max_position, got "
                         f"length={length}, max_position={max_position}")
    k_cut, k_skip = jax.random.split(key)
    first = jax.random.randint(k_cut, (batch, 1), 1, (length + 1) // 2 + 1)
    skip = jax.random.randint(k_skip, (batch, 1), 0, max_position - length + 1)
    t = jnp.arange(length, dtype=jnp.int32)[None, :]
    return jnp.where(t < first, t, t + skip).astype(jnp.int32)


def micro_batches(batch):
    """(A, first): the leading micro-batch count of a batch [A, B/A, T+1] (rows or a
    (rows, mask) pair, or any tree of them, such as (batch, positions); None leaves stay
    None) and its first micro-batch."""
    return jax.tree.leaves(batch)[0].shape[0], jax.tree.map(lambda x: x[0], batch)


@struct.dataclass
class TrainState:
    """Everything a step changes; checkpointed as one tree.

    step: i32[] optimizer steps taken; params: nnx.State of the Transformer's
    nnx.Param leaves; opt_state: optax state; rng: u32[2] raw PRNG key, split once
    per step (the `lm` objective draws its PoSE positions from it, when set).
    """

    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState
    rng: jax.Array


class Metrics(NamedTuple):
    """f32[] each: mean loss over the step's tokens, global gradient norm before
    clipping, and the learning rate the update used."""

    loss: jax.Array
    grad_norm: jax.Array
    lr: jax.Array


class Trainer:
    """Builds the sharded train state and the jitted steps for one model and mesh.

    Args:
      model_cfg: the ModelConfig to train.
      dtype: parameter dtype (jnp.float32 / jnp.bfloat16).
      tx: the optax optimizer; schedule: its learning-rate schedule.
      mesh: the (data, fsdp, model) mesh.
      seed: parameter initialisation and the step RNG.
      grad_accum: A, micro-steps per optimizer step.
      kernels: "auto", "pallas", "reference" or "chunked": the attention of the training
        forward (`specjax.train.kernels`).
      pose_max_position: train at PoSE positions (`pose_positions`) spread over
        [0, pose_max_position), drawn from the step's key; None: positions 0..T-1.
        Validation always uses 0..T-1.
    """

    # The lm objective's only attention is the target's causal forward over its own row,
    # so "chunked" may skip the key blocks after each query chunk.
    causal_self_attention = True

    def __init__(self, model_cfg, dtype, tx, schedule, mesh, *, seed: int, grad_accum: int,
                 micro_batch: int, eval_batch: int, seq_len: int, kernels: str = "auto",
                 pose_max_position: int | None = None):
        self.model_cfg, self.dtype, self.tx, self.schedule = model_cfg, dtype, tx, schedule
        self.pose_max_position = pose_max_position
        self.set_kernels(kernels, mesh)
        self.mesh, self.seed, self.grad_accum = mesh, seed, grad_accum
        abstract = nnx.eval_shape(lambda: Transformer(model_cfg, dtype=dtype,
                                                      rngs=nnx.Rngs(seed)))
        # The one non-trainable variable, the RoPE frequencies, follows from the config.
        abstract.inv_freq.set_value(jnp.asarray(model_cfg.inv_freq(), jnp.float32))
        self.graphdef, _, self.rest = nnx.split(abstract, nnx.Param, ...)
        for leaf in jax.tree.leaves(self.rest):
            if isinstance(leaf, jax.ShapeDtypeStruct):
                raise NotImplementedError("Transformer has non-Param state besides inv_freq")
        self.abstract_state = jax.eval_shape(self._init)
        self.state_shardings = mesh_lib.tree_shardings(mesh, self.abstract_state)
        self.param_shardings = self.state_shardings.params
        self.batch_sharding = mesh_lib.batch_sharding(mesh, (grad_accum, micro_batch,
                                                             seq_len + 1))
        self.eval_batch_sharding = mesh_lib.batch_sharding(mesh, (eval_batch, seq_len + 1))
        self._metric_sharding = Metrics(*(mesh_lib.replicated(mesh),) * 3)

    def set_kernels(self, kernels: str, mesh) -> None:
        """Resolves `kernels` ("auto" by platform) and builds `self.attention`, the packed
        attention function of the training forwards, or None for the jnp path."""
        from specjax.train import kernels as kernels_lib

        self.kernels = kernels_lib.resolve(kernels)
        self.attention = kernels_lib.attention_fn(self.kernels, mesh,
                                                  causal=self.causal_self_attention)

    # ------------------------------------------------------------------ state

    def _init(self) -> TrainState:
        model = Transformer(self.model_cfg, dtype=self.dtype, rngs=nnx.Rngs(self.seed))
        _, params, _ = nnx.split(model, nnx.Param, ...)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          opt_state=self.tx.init(params),
                          rng=jax.random.PRNGKey(self.seed + 1))

    def init_state(self, params: nnx.State | None = None) -> TrainState:
        """A fresh state, created directly in its shardings (no host copy of a random
        init). `params`: starting weights (an nnx.State like `abstract_state.params`,
        e.g. from `load_init_params`) instead of the random initialisation; the
        optimizer state is fresh either way."""
        if params is None:
            return jax.jit(self._init, out_shardings=self.state_shardings)()
        params = jax.device_put(params, self.param_shardings)

        def from_params(p):
            return TrainState(step=jnp.zeros((), jnp.int32), params=p,
                              opt_state=self.tx.init(p),
                              rng=jax.random.PRNGKey(self.seed + 1))

        return jax.jit(from_params, out_shardings=self.state_shardings)(params)

    def load_init_params(self, path: str) -> nnx.State:
        """The parameters of the HF checkpoint at `path`, cast to the training dtype.

        Raises: SpecjaxError if the directory is unreadable or its model differs from
          the one being trained (another shape, family or vocabulary)."""
        from specjax.errors import SpecjaxError
        from specjax.models.checkpoint import load_model
        from specjax.models.config import ModelConfig

        theirs = ModelConfig.from_dir(path)
        fields = ("family", "vocab_size", "hidden_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "intermediate_size", "tie_word_embeddings")
        diff = [f"{f} {getattr(theirs, f)} != {getattr(self.model_cfg, f)}"
                for f in fields if getattr(theirs, f) != getattr(self.model_cfg, f)]
        if diff:
            raise SpecjaxError(f"train.init_from {path} holds another model ({', '.join(diff)}); "
                               "make the model section match it")
        _, params, _ = nnx.split(load_model(path, dtype=self.dtype), nnx.Param, ...)
        return params

    def abstract_target(self) -> TrainState:
        """ShapeDtypeStructs with shardings: the restore target for orbax."""
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            self.abstract_state, self.state_shardings)

    def model(self, params) -> Transformer:
        """The Transformer with `params` (arrays as they are: sharded or on host)."""
        return nnx.merge(self.graphdef, params, self.rest)

    # ------------------------------------------------------------------ loss

    def loss(self, params, batch, positions: jax.Array | None = None) -> jax.Array:
        """Mean next-token cross-entropy (nats per token) of rows i32[B, T+1] (or of the
        targets with mask 1 of a (rows, mask) pair); positions i32[B, T] of the inputs
        (strictly increasing along a row), default 0..T-1."""
        rows, mask = split_batch(batch)
        model = self.model(params)
        tokens, targets = rows[:, :-1], rows[:, 1:]
        B, T = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        logits = model(tokens, positions, None,  # f32[B,T,V], cache-free
                       self_attention=self.attention).logits
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return masked_mean(ce, None if mask is None else mask[:, 1:])

    def _grads(self, params, batch, key: jax.Array | None = None):
        """Mean loss and gradient over A micro-batches: batch i32[A, B/A, T+1] (or a
        (rows, mask) pair of them; each micro-batch's loss is its own masked mean). `key`
        draws the PoSE positions when `pose_max_position` is set."""
        grad_fn = jax.value_and_grad(self.loss)
        positions = None  # i32[A, B/A, T] or None: 0..T-1 in `loss`
        if self.pose_max_position is not None:
            A, Bm, T1 = jax.tree.leaves(batch)[0].shape
            positions = pose_positions(key, A * Bm, T1 - 1,
                                       self.pose_max_position).reshape(A, Bm, T1 - 1)
        num_micro, (first, first_positions) = micro_batches((batch, positions))
        if num_micro == 1:
            return grad_fn(params, first, first_positions)

        def micro(carry, xs):
            loss_sum, grad_sum = carry
            rows, pos = xs
            loss, grads = grad_fn(params, rows, pos)
            grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
            grad_sum = jax.lax.with_sharding_constraint(grad_sum, self.param_shardings)
            return (loss_sum + loss, grad_sum), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        (loss, grads), _ = jax.lax.scan(micro, (jnp.zeros((), jnp.float32), zeros),
                                        (batch, positions))
        scale = 1.0 / num_micro
        return loss * scale, jax.tree.map(lambda g: g * scale, grads)

    def _train_step(self, state: TrainState, batch: jax.Array):
        rng, step_key = jax.random.split(state.rng)  # PoSE positions (and later objectives)
        loss, grads = self._grads(state.params, batch, step_key)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = Metrics(loss=loss, grad_norm=optax.tree.norm(grads),
                          lr=jnp.asarray(self.schedule(state.step), jnp.float32))
        new = TrainState(step=state.step + 1, params=params, opt_state=opt_state, rng=rng)
        return new, metrics

    # ------------------------------------------------------------------ jitted steps

    @functools.cached_property
    def train_step(self):
        """(TrainState, i32[A, B/A, T+1]) -> (TrainState, Metrics); donates the state."""
        return jax.jit(
            self._train_step,
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, self._metric_sharding),
            donate_argnums=0,
        )

    @functools.cached_property
    def eval_step(self):
        """(params, i32[B, T+1]) -> f32[] mean loss."""
        return jax.jit(self.loss, in_shardings=(self.param_shardings, self.eval_batch_sharding),
                       out_shardings=mesh_lib.replicated(self.mesh))

