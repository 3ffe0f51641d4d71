"""The drafter trainer (objectives ttt and block): a drafter network learns against a
frozen target that runs inside the same jitted step (docs/design.md section 6).

    trainer = DrafterTrainer(dcfg, target, "ttt", opts, dtype, tx, schedule, mesh, ...)
    state, metrics = trainer.train_step(state, batch)        # as `Trainer.train_step`
    loss, stats = trainer.eval_step(state.params, rows, i)   # stats: objectives/__init__

TrainState.params holds only the drafter network's nnx.Param leaves (the optimizer sees
nothing else). The target's parameters are a separate argument of the jitted steps,
sharded by the same mesh rules (mesh.PARAM_AXES), never donated, with no optimizer
state. Each step runs the target's cache-free forward on rows[:, :T] at positions
0..T-1 (capturing the hidden states `dcfg.capture` and the K/V of `dcfg.kv_layers`),
wrapped in `jax.lax.stop_gradient`, then the objective's loss of the merged network:

    ttt:   ttt_loss(net, tgt, rows, frozen, steps=G, soft=..., decay=...)  (objectives/ttt.py)
    block: block_loss(net, tgt, rows, frozen, key, num_anchors=A, soft=..., gamma_w=...,
                      gamma=G)                                             (objectives/block.py)

`key` is the step key split off TrainState.rng (one per micro-batch under gradient
accumulation), so a resumed run draws the same anchors. Validation uses fixed keys
(batch i: fold_in(PRNGKey(seed + 2), i)), so every evaluation sees the same blocks.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from specjax.errors import SpecjaxError
from specjax.train import mesh as mesh_lib
from specjax.train.objectives import Frozen
from specjax.train.step import Metrics, Trainer, TrainState, micro_batches, split_batch


def objective_fn(objective: str, opts, gamma: int, evaluation: bool = False,
                 kernel=None):
    """The loss of `objective` as f(net, tgt, rows, frozen, key) -> (f32[] loss, stats).

    Args:
      objective: "ttt" or "block".
      opts: the run's DrafterTrainConfig (soft_labels, num_anchors, gamma_w, ttt_decay).
      gamma: G (TTT unroll steps; block: mask tokens per block).
      evaluation: the validation variant: TTT unrolls every position (no ttt_positions
        sampling), so alpha_k and tau do not depend on the anchors drawn.
      kernel: the drafter's attention kernel, passed to every `attend` of the loss
        (`specjax.train.kernels.packed_attention_fn`, or None: the jnp path).
    """
    if objective == "ttt":
        from specjax.train.objectives.ttt import ttt_loss

        return functools.partial(ttt_loss, steps=gamma, soft=opts.soft_labels,
                                 decay=opts.ttt_decay,
                                 num_positions=None if evaluation else opts.ttt_positions,
                                 kernel=kernel)
    if objective == "block":
        from specjax.train.objectives.block import block_loss

        return functools.partial(block_loss, num_anchors=opts.num_anchors,
                                 soft=opts.soft_labels, gamma_w=opts.gamma_w, gamma=gamma,
                                 kernel=kernel, confidence_alpha=opts.confidence_alpha,
                                 selector_soft=opts.selector_soft_labels)
    raise ValueError(f"objective {objective!r} does not train a drafter")


class DrafterTrainer(Trainer):
    """Builds the sharded drafter train state and the jitted steps for one target and mesh.

    Args:
      dcfg: the DrafterConfig of the network (`specjax.drafters.build_network`).
      target: the frozen target, a `specjax.models.model.Transformer` in the training dtype
        (its arrays are copied into their shardings once).
      objective: "ttt" or "block"; opts: the DrafterTrainConfig (loss options).
      dtype, tx, schedule, mesh, seed, grad_accum, micro_batch, eval_batch, seq_len,
        kernels: as for `Trainer` (with "pallas" the kernel serves both the frozen target's
        forward and the drafter's attention).
    """

    causal_self_attention = False  # the kernel also serves the drafters' other limits

    def __init__(self, dcfg, target, objective: str, opts, dtype, tx, schedule, mesh, *,
                 seed: int, grad_accum: int, micro_batch: int, eval_batch: int, seq_len: int,
                 kernels: str = "auto"):
        from specjax import drafters

        self.set_kernels(kernels, mesh)
        self.dcfg, self.objective, self.dtype, self.tx = dcfg, objective, dtype, tx
        self.schedule, self.mesh, self.seed, self.grad_accum = schedule, mesh, seed, grad_accum
        self.model_cfg = target.cfg
        self.loss_fn = objective_fn(objective, opts, dcfg.gamma, kernel=self.attention)
        self.eval_fn = objective_fn(objective, opts, dcfg.gamma, evaluation=True,
                                    kernel=self.attention)

        # The drafter's final norm starts as the target's: its output then meets the
        # target's LM head at the scale that head was trained for (a ones init gave an
        # initial block loss of ~30 nats against ln V = 9 on the demo target).
        final_norm = jnp.asarray(jax.device_get(target.final_norm[...]), dtype)

        def build():
            net = drafters.build_network(dcfg, dtype=dtype, rngs=nnx.Rngs(seed))
            net.final_norm.set_value(final_norm)
            return net

        self._build = build
        self.graphdef, _, rest = nnx.split(nnx.eval_shape(build), nnx.Param, ...)
        # Non-trainable network state (if any) is computed once, under jit (the random
        # parameters that come with it are dead code there).
        self.rest = rest
        if jax.tree.leaves(rest):
            self.rest = jax.jit(lambda: nnx.split(build(), nnx.Param, ...)[2],
                                out_shardings=mesh_lib.replicated(mesh))()
        self.abstract_state = jax.eval_shape(self._init)
        self.state_shardings = mesh_lib.tree_shardings(mesh, self.abstract_state)
        self.param_shardings = self.state_shardings.params

        self.target_graphdef, target_params, self.target_rest = nnx.split(target, nnx.Param,
                                                                          ...)
        self.target_shardings = mesh_lib.tree_shardings(mesh, target_params)
        self.target_params = jax.device_put(target_params, self.target_shardings)
        self.batch_sharding = mesh_lib.batch_sharding(mesh, (grad_accum, micro_batch,
                                                             seq_len + 1))
        self.eval_batch_sharding = mesh_lib.batch_sharding(mesh, (eval_batch, seq_len + 1))
        self._metric_sharding = Metrics(*(mesh_lib.replicated(mesh),) * 3)

    # ------------------------------------------------------------------ state

    def _init(self) -> TrainState:
        _, params, _ = nnx.split(self._build(), nnx.Param, ...)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          opt_state=self.tx.init(params),
                          rng=jax.random.PRNGKey(self.seed + 1))

    def load_init_params(self, path: str, target_dir: str | None = None):
        """Starting weights from the exported drafter directory `path`: each of its tensors
        replaces the random init of the parameter with the same name (shapes must match);
        parameters it lacks keep their random init. Returns (nnx.State like
        `abstract_state.params`, names of the loaded tensors, names kept random).

        Raises: SpecjaxError for an unreadable directory, a drafter trained against other
          target weights than `target_dir` (when given), a tensor this drafter has no
          parameter for or of another shape, or no tensor in common."""
        from safetensors import safe_open

        from specjax.drafters.io import WEIGHTS_NAME, read_config
        from specjax.models.checkpoint import fingerprint

        raw = read_config(path)
        recorded = (raw.get("target") or {}).get("weights_fingerprint")
        if target_dir is not None and recorded is not None and \
                recorded != fingerprint(target_dir):
            raise SpecjaxError(f"train.init_from {path} was trained against "
                               f"{raw['target'].get('path')}, not against target {target_dir} "
                               "(their weights differ)")
        # the random init as init_state makes it (under jit: eager rounding differs)
        params = jax.jit(lambda: nnx.split(self._build(), nnx.Param, ...)[1])()
        mine = {".".join(map(str, p)): var for p, var in nnx.to_flat_state(params)}
        file = os.path.join(path, WEIGHTS_NAME)
        loaded = []
        try:
            handle = safe_open(file, framework="numpy")
        except Exception as e:  # safetensors raises its own error types; a missing file too
            raise SpecjaxError(f"train.init_from {file} is not a readable safetensors file "
                               f"({e})") from None
        with handle as f:
            for name in f.keys():
                var = mine.get(name)
                if var is None:
                    raise SpecjaxError(f"train.init_from {path}: tensor {name} ({raw.get('kind')}"
                                       f" drafter) has no counterpart in a {self.dcfg.kind} "
                                       "drafter")
                arr = f.get_tensor(name)
                want = tuple(var.get_value().shape)
                if tuple(arr.shape) != want:
                    raise SpecjaxError(f"train.init_from {path}: tensor {name} has shape "
                                       f"{tuple(arr.shape)}, this drafter's is {want}")
                var.set_value(jnp.asarray(arr.astype(np.float32)).astype(self.dtype))
                loaded.append(name)
        if not loaded:
            raise SpecjaxError(f"train.init_from {path} holds no tensor")
        return params, sorted(loaded), sorted(set(mine) - set(loaded))

    def network(self, params) -> nnx.Module:
        """The drafter network with `params` (arrays as they are)."""
        return nnx.merge(self.graphdef, params, self.rest)

    @property
    def num_params(self) -> int:
        """Trainable parameters of the drafter."""
        return sum(int(x.size) for x in jax.tree.leaves(self.abstract_state.params))

    # ------------------------------------------------------------------ loss

    def loss_and_stats(self, params, batch, target_params, key: jax.Array,
                       evaluation: bool = False):
        """(f32[] loss, stats dict) of the drafter on rows i32[B, T+1] (or a (rows, mask)
        pair: loss and stats over the targets with mask 1); the target runs on rows[:, :T],
        cache-free, under stop_gradient."""
        rows, mask = split_batch(batch)
        target = nnx.merge(self.target_graphdef, target_params, self.target_rest)
        tokens = rows[:, :-1]
        B, T = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        tgt = target(tokens, positions, None, capture=self.dcfg.capture,
                     capture_kv=self.dcfg.kv_layers, self_attention=self.attention)
        tgt = jax.lax.stop_gradient(tgt)
        frozen = jax.lax.stop_gradient(Frozen.from_target(target))
        fn = self.eval_fn if evaluation else self.loss_fn
        if mask is None:  # the unmasked graph exactly as before masks existed
            return fn(self.network(params), tgt, rows, frozen, key)
        return fn(self.network(params), tgt, rows, frozen, key, mask=mask)

    def loss(self, params, rows, target_params, key) -> jax.Array:
        """The training loss only (f32[])."""
        return self.loss_and_stats(params, rows, target_params, key)[0]

    def _grads(self, params, batch, target_params, key):
        """Mean loss and gradient over A micro-batches: batch i32[A, B/A, T+1]; micro-batch
        a draws from split(key, A)[a] (A = 1: key itself)."""
        grad_fn = jax.value_and_grad(self.loss)
        num_micro, first = micro_batches(batch)
        if num_micro == 1:
            return grad_fn(params, first, target_params, key)

        def micro(carry, xs):
            loss_sum, grad_sum = carry
            rows, k = xs
            loss, grads = grad_fn(params, rows, target_params, k)
            grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
            grad_sum = jax.lax.with_sharding_constraint(grad_sum, self.param_shardings)
            return (loss_sum + loss, grad_sum), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        keys = jax.random.split(key, num_micro)
        (loss, grads), _ = jax.lax.scan(micro, (jnp.zeros((), jnp.float32), zeros),
                                        (batch, keys))
        scale = 1.0 / num_micro
        return loss * scale, jax.tree.map(lambda g: g * scale, grads)

    def _drafter_step(self, state: TrainState, batch: jax.Array, target_params):
        rng, step_key = jax.random.split(state.rng)
        loss, grads = self._grads(state.params, batch, target_params, step_key)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = Metrics(loss=loss, grad_norm=optax.tree.norm(grads),
                          lr=jnp.asarray(self.schedule(state.step), jnp.float32))
        new = TrainState(step=state.step + 1, params=params, opt_state=opt_state, rng=rng)
        return new, metrics

    # ------------------------------------------------------------------ jitted steps

    @functools.cached_property
    def train_step(self):
        """(TrainState, i32[A, B/A, T+1]) -> (TrainState, Metrics); donates the state (the
        target's parameters are passed in, never donated)."""
        step = jax.jit(
            self._drafter_step,
            in_shardings=(self.state_shardings, self.batch_sharding, self.target_shardings),
            out_shardings=(self.state_shardings, self._metric_sharding),
            donate_argnums=0,
        )
        return lambda state, batch: step(state, batch, self.target_params)

    def _eval(self, params, rows, target_params, index):
        key = jax.random.fold_in(jax.random.PRNGKey(self.seed + 2), index)
        return self.loss_and_stats(params, rows, target_params, key, evaluation=True)

    @functools.cached_property
    def eval_step(self):
        """(params, i32[B, T+1], batch index i) -> (f32[] loss, stats dict of f32 arrays),
        with the fixed key fold_in(PRNGKey(seed + 2), i)."""
        replicated = mesh_lib.replicated(self.mesh)
        step = jax.jit(self._eval,
                       in_shardings=(self.param_shardings, self.eval_batch_sharding,
                                     self.target_shardings, replicated),
                       out_shardings=replicated)
        return lambda params, rows, i: step(params, rows, self.target_params, np.int32(i))
