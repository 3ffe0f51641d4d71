"""The training loop: resume, step, log, validate, checkpoint, stop on SIGTERM, export.

    result = train(load_config("configs/demo_target.yaml"))

Files in `cfg.run_dir`:
  config.yaml      the resolved config of the latest start
  metrics.jsonl    one JSON object per line: {"step", "loss", "grad_norm", "lr",
                   "tokens_per_s", "tokens", "epoch"}, {"step", "val_loss"}, and
                   {"event": "start" | "resume" | "preempted" | "done", "step"}
  checkpoints/<s>  orbax checkpoints (see checkpointing.py)
  hf/              the exported HF directory (export.dir), once train.steps is reached

Determinism: a run stopped at step s (SIGTERM, `stop_at`) and resumed continues with
bit-identical losses and parameters, because the step is a pure function of the
TrainState and of the rows at the checkpointed data position.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import jax
import numpy as np
import yaml

from specjax.errors import SpecjaxError
from specjax.train import mesh as mesh_lib
from specjax.train.checkpointing import Checkpoints, Preemption
from specjax.train.config import TrainConfig, dump_config
from specjax.train.inputs import RunData, prepare_data, special_ids
from specjax.train.optim import make_optimizer
from specjax.train.step import Trainer, TrainState


@dataclasses.dataclass
class RunResult:
    """What `train` did. losses / val_losses: step -> loss (nats per token) for the
    steps of THIS call; tokens_per_s: training throughput after the first step
    (compile excluded); compile_s: wall time of the first step, compile included."""

    step: int
    losses: dict[int, float]
    val_losses: dict[int, float]
    preempted: bool
    state: TrainState
    trainer: Trainer
    tokens_per_s: float | None
    compile_s: float | None
    export_dir: str | None


class _MetricsLog:
    """Appends JSON lines to `<run_dir>/metrics.jsonl` (process 0 only)."""

    def __init__(self, path: str, enabled: bool):
        self.f = open(path, "a") if enabled else None

    def write(self, **record) -> None:
        if self.f is not None:
            self.f.write(json.dumps(record) + "\n")
            self.f.flush()

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


def _check_resume_config(cfg: TrainConfig, path: str) -> None:
    """Raises SpecjaxError if the run dir's saved config trains a different model."""
    try:
        with open(path) as f:
            saved = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError):
        return
    if saved.get("model") != cfg.to_dict()["model"]:
        raise SpecjaxError(f"run_dir {cfg.run_dir} holds checkpoints of a different model "
                           f"(see {path}); use a new run_dir or the same model section")


def _host_params(state: TrainState):
    """The parameters as host numpy arrays (gathered from every process if needed)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(state.params, tiled=True)
    return jax.device_get(state.params)


def export(cfg: TrainConfig, trainer: Trainer, state: TrainState, tokenizer) -> str | None:
    """Writes the HF directory (process 0); returns its path, or None if disabled."""
    if not cfg.export.enabled:
        return None
    from specjax.checkpoint import parse_dtype, save_model

    params = _host_params(state)
    if jax.process_index() == 0:
        save_model(trainer.model(params), cfg.export_dir, dtype=parse_dtype(cfg.export.dtype),
                   tokenizer=tokenizer)
    return cfg.export_dir


def evaluate(trainer: Trainer, state: TrainState, data: RunData, batch_size: int,
             max_batches: int) -> float | None:
    """Mean validation loss over the fixed validation batches (None without val data)."""
    positions = data.eval_positions(batch_size, max_batches)
    if not positions:
        return None
    losses = []
    for pos in positions:
        rows, _ = data.val.batch(pos, batch_size)
        batch = mesh_lib.host_to_global(rows, trainer.eval_batch_sharding, 0)
        losses.append(trainer.eval_step(state.params, batch))
    return float(np.mean(jax.device_get(losses)))


def _progress(cfg: TrainConfig, start: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=cfg.train.steps, initial=start, desc="train", unit="step",
                file=sys.stderr, dynamic_ncols=True, mininterval=1.0, disable=not enabled)


def train(cfg: TrainConfig, *, stop_at: int | None = None, progress: bool = True) -> RunResult:
    """Trains (or resumes) the run in `cfg.run_dir` up to `cfg.train.steps`.

    Args:
      cfg: the validated config.
      stop_at: checkpoint and return after this step (the schedule still spans
        `train.steps`; for tests and for splitting a run into sessions).
      progress: show the tqdm bar (process 0).

    Returns: RunResult. On SIGTERM the current step is checkpointed and the result has
      preempted=True; the export is written only when train.steps is reached.
    Raises: SpecjaxError for a bad mesh, batch, data path, or a run_dir that holds
      another model's checkpoints.
    """
    import jax.numpy as jnp

    loop, is_main = cfg.train, jax.process_index() == 0
    mesh = mesh_lib.make_mesh(cfg.mesh)
    mesh_lib.check_batch(mesh, loop)
    data = prepare_data(cfg)
    model_cfg = special_ids(cfg, data.tokenizer)
    os.makedirs(cfg.run_dir, exist_ok=True)
    ckpts = Checkpoints(os.path.join(cfg.run_dir, "checkpoints"), loop.keep_checkpoints,
                        loop.async_checkpointing)
    latest = ckpts.latest_step()
    config_path = os.path.join(cfg.run_dir, "config.yaml")
    if latest is not None:
        _check_resume_config(cfg, config_path)
    if is_main:
        dump_config(cfg, config_path)

    tx, schedule = make_optimizer(cfg.optim, loop.steps)
    dtype = jnp.bfloat16 if loop.dtype == "bfloat16" else jnp.float32
    T, B, A = cfg.data.seq_len, loop.batch_size, loop.grad_accum
    trainer = Trainer(model_cfg, dtype, tx, schedule, mesh, seed=loop.seed, grad_accum=A,
                      micro_batch=loop.micro_batch, eval_batch=B, seq_len=T)
    if latest is None:
        init = trainer.load_init_params(loop.init_from) if loop.init_from else None
        state, position = trainer.init_state(init), 0
    else:
        state, meta = ckpts.restore(latest, trainer.abstract_target())
        position = int(meta["data_position"])
    start = step = int(jax.device_get(state.step))
    last = loop.steps if stop_at is None else min(loop.steps, stop_at)

    log = _MetricsLog(os.path.join(cfg.run_dir, "metrics.jsonl"), is_main)
    log.write(event="resume" if latest is not None else "start", step=step,
              params=model_cfg.num_params, devices=int(mesh.size),
              mesh=dict(zip(mesh.axis_names, map(int, mesh.devices.shape), strict=True)))
    losses, val_losses, pending = {}, {}, []
    preempted, compile_s, tok_s = False, None, None
    timed_steps, timed_s = 0, 0.0
    t_last = time.perf_counter()

    def flush():
        nonlocal t_last, timed_steps, timed_s, compile_s, tok_s
        fetched = jax.device_get([m for _, m in pending])
        now = time.perf_counter()
        steps_done = [s for s, _ in pending]
        for s, m in zip(steps_done, fetched, strict=True):
            losses[s] = float(m.loss)
        if compile_s is None:  # the first flush comes right after the first step
            compile_s, rate = now - t_last, None
        else:
            timed_steps += len(pending)
            timed_s += now - t_last
            rate = len(pending) * B * T / (now - t_last)
            tok_s = timed_steps * B * T / timed_s
        m = fetched[-1]
        record = dict(step=step, loss=float(np.mean([f.loss for f in fetched])),
                      grad_norm=float(m.grad_norm), lr=float(m.lr),
                      tokens_per_s=None if rate is None else round(rate, 1),
                      tokens=step * B * T, epoch=round(data.train.epoch(position), 4))
        log.write(**record)
        bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                        tok_s="-" if rate is None else f"{rate:.0f}", refresh=False)
        pending.clear()
        t_last = time.perf_counter()

    def save():
        ckpts.save(step, state, {"step": step, "data_position": position,
                                 "tokens_seen": step * B * T})

    bar = _progress(cfg, step, progress and is_main)
    try:
        with Preemption() as preemption:
            while step < last:
                if preemption.should_stop(step):
                    preempted = True
                    break
                rows, position = data.train.batch(position, B)
                batch = mesh_lib.host_to_global(rows.reshape(A, B // A, T + 1),
                                                trainer.batch_sharding, 1)
                state, metrics = trainer.train_step(state, batch)
                step += 1
                pending.append((step, metrics))
                bar.update(1)
                if step == start + 1 or step % loop.log_every == 0 or step == last:
                    flush()
                if loop.eval_every and step % loop.eval_every == 0 and step < loop.steps:
                    val_losses[step] = evaluate(trainer, state, data, B, loop.eval_batches)
                    if val_losses[step] is not None:
                        log.write(step=step, val_loss=val_losses[step])
                        bar.write(f"step {step}: val_loss {val_losses[step]:.4f}")
                if loop.checkpoint_every and step % loop.checkpoint_every == 0:
                    save()
                if not pending:  # keep eval and checkpoint time out of tokens/s
                    t_last = time.perf_counter()
            if pending:
                flush()
            save()
            ckpts.wait()
            export_dir = None
            if preempted:
                log.write(event="preempted", step=step)
            elif step >= loop.steps:
                val = evaluate(trainer, state, data, B, loop.eval_batches)
                if val is not None:
                    val_losses[step] = val
                    log.write(step=step, val_loss=val)
                export_dir = export(cfg, trainer, state, data.tokenizer)
                log.write(event="done", step=step, tokens_per_s=tok_s, compile_s=compile_s,
                          val_loss=val, export_dir=export_dir)
    finally:
        bar.close()
        log.close()
        ckpts.close()
    return RunResult(step=step, losses=losses, val_losses=val_losses, preempted=preempted,
                     state=state, trainer=trainer, tokens_per_s=tok_s, compile_s=compile_s,
                     export_dir=export_dir)
