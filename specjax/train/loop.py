"""The training loop: resume, step, log, validate, checkpoint, stop on SIGTERM, export.

    result = train(load_config("configs/demo_target.yaml"))

The loop is the same for every objective; what differs lives in a run object:
`_LMRun` below (objective lm: a Transformer, validation loss, HF export) and
`drafter_run.DrafterRun` (ttt, block: a drafter against a frozen target, validation
alpha / tau, best-tau snapshot, drafter export).

Files in `cfg.run_dir`:
  config.yaml      the resolved config of the latest start
  metrics.jsonl    one JSON object per line: {"step", "loss", "grad_norm", "lr",
                   "tokens_per_s", "tokens", "epoch"}, {"step", "val_loss"} (drafters:
                   {"step", "val_loss", "alpha", "acc", "tau", "gate"?}), and
                   {"event": "start" | "resume" | "preempted" | "done", "step"}
  train.lock       the pid of the train.py holding the run dir (an flock; see RunDirLock)
  checkpoints/<s>  orbax checkpoints (see checkpointing.py)
  hf/              the exported HF directory (export.dir), once train.steps is reached
  drafter/         drafters: the exported best-tau drafter instead (see drafter_run.py)

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

from specjax.errors import SpecjaxError
from specjax.train import mesh as mesh_lib
from specjax.train import multihost
from specjax.train.checkpointing import Checkpoints, Preemption
from specjax.train.config import TrainConfig, dump_config
from specjax.train.inputs import RunData, global_batch, prepare_data, special_ids
from specjax.train.optim import make_optimizer
from specjax.train.run_dir import (
    LOCK_NAME,
    NewFiles,
    RunDirLock,
    check_creatable,
    check_resume_config,
    remove_stale_temps,
    writable_dir,
)
from specjax.train.step import Trainer, TrainState


@dataclasses.dataclass
class RunResult:
    """What `train` did. losses / val_losses: step -> loss (nats per token) for the
    steps of THIS call; tokens_per_s: training throughput after the first step
    (compile excluded); compile_s: wall time of the first step, compile included;
    val_metrics: step -> the whole validation record (drafters: val_loss, alpha, tau,
    gate); best: drafters: the exported snapshot's record ({"step", "tau", ...})."""

    step: int
    losses: dict[int, float]
    val_losses: dict[int, float]
    preempted: bool
    state: TrainState
    trainer: Trainer
    tokens_per_s: float | None
    compile_s: float | None
    export_dir: str | None
    val_metrics: dict[int, dict] = dataclasses.field(default_factory=dict)
    best: dict | None = None


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


def _host_params(state: TrainState):
    """The parameters as host numpy arrays (gathered from every process if needed)."""
    return mesh_lib.host_tree(state.params)


def export(cfg: TrainConfig, trainer: Trainer, state: TrainState, tokenizer) -> str | None:
    """Writes the HF directory (process 0); returns its path, or None if disabled."""
    if not cfg.export.enabled:
        return None
    from specjax.models.checkpoint import parse_dtype, save_model

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
        batch, _ = global_batch(data.val, pos, batch_size, trainer.eval_batch_sharding)
        losses.append(trainer.eval_step(state.params, batch))
    return float(np.mean(jax.device_get(losses)))


class _LMRun:
    """objective lm: the run object of `train` (see drafter_run.DrafterRun for drafters):
    data, Trainer, fresh state (random or train.init_from), validation loss, HF export."""

    resume_keys = ("model",)

    def __init__(self, cfg: TrainConfig, mesh, tx, schedule, dtype):
        loop = cfg.train
        self.cfg = cfg
        self.data = prepare_data(cfg)
        model_cfg = special_ids(cfg, self.data.tokenizer)
        T, B, A = cfg.data.seq_len, loop.batch_size, loop.grad_accum
        self.trainer = Trainer(model_cfg, dtype, tx, schedule, mesh, seed=loop.seed,
                               grad_accum=A, micro_batch=loop.micro_batch, eval_batch=B,
                               seq_len=T, kernels=loop.kernels,
                               pose_max_position=(model_cfg.max_position_embeddings
                                                  if loop.pose else None))
        self.start_info = {"params": model_cfg.num_params}
        self.best = None

    def fresh_state(self) -> TrainState:
        init_from = self.cfg.train.init_from
        init = self.trainer.load_init_params(init_from) if init_from else None
        return self.trainer.init_state(init)

    def resumed(self) -> None:
        pass

    def validate(self, state) -> dict | None:
        loop = self.cfg.train
        val = evaluate(self.trainer, state, self.data, loop.batch_size, loop.eval_batches)
        return None if val is None else {"val_loss": val}

    @staticmethod
    def describe(record: dict) -> str:
        return f"val_loss {record['val_loss']:.4f}"

    @staticmethod
    def postfix(record: dict) -> dict:
        return {}

    def on_validation(self, step: int, state, record: dict) -> None:
        pass

    def export(self, state, step: int, record: dict | None) -> str | None:
        return export(self.cfg, self.trainer, state, self.data.tokenizer)

    def done_info(self) -> dict:
        return {}


def _progress(cfg: TrainConfig, start: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=cfg.train.steps, initial=start, desc="train", unit="step",
                file=sys.stderr, dynamic_ncols=True, mininterval=1.0, disable=not enabled)


def preflight(cfg: TrainConfig):
    """Everything about `cfg` that can be checked before anything is written: that the
    run dir and the export directory can be created (process 0), the mesh and the batch
    split, the data files, and the target directory (drafter runs). Returns the device
    mesh.

    Raises: SpecjaxError (one line)."""
    from specjax.train.inputs import check_paths

    if jax.process_index() == 0:
        check_creatable(cfg.run_dir, "run_dir")
        if cfg.export.enabled:
            check_creatable(os.path.dirname(os.path.abspath(cfg.export_dir)),
                             "the export directory's parent")
    mesh = mesh_lib.make_mesh(cfg.mesh)
    mesh_lib.check_batch(mesh, cfg.train)
    check_paths(cfg)
    if cfg.trains_drafter:
        from specjax.train.drafter_run import check_target_dir

        check_target_dir(cfg)
    return mesh


def train(cfg: TrainConfig, *, stop_at: int | None = None, progress: bool = True) -> RunResult:
    """Trains (or resumes) the run in `cfg.run_dir` up to `cfg.train.steps`, holding the
    run dir's lock (`RunDirLock`) for the whole run. The config is checked first
    (`preflight`); a call that fails before its first training step removes everything
    it created (the run dir if it was new, else only the entries it added).

    Args:
      cfg: the validated config.
      stop_at: checkpoint and return after this step (the schedule still spans
        `train.steps`; for tests and for splitting a run into sessions).
      progress: show the tqdm bar (process 0).

    Returns: RunResult. On SIGTERM the current step is checkpointed and the result has
      preempted=True; the export is written only when train.steps is reached.
    Raises: SpecjaxError for a bad mesh, batch, data path, target directory, an
      unwritable run or export directory, a run_dir another train.py holds, or a run_dir
      that holds another model's (or drafter's) checkpoints.
    """
    lock, error, new, mesh = None, None, None, None
    try:
        mesh = preflight(cfg)
    except SpecjaxError as e:
        error = str(e)
    if jax.process_index() == 0 and error is None:  # the others wait for its verdict
        new = NewFiles(cfg)
        try:
            writable_dir(cfg.run_dir, "run_dir")
            export_parent = os.path.dirname(os.path.abspath(cfg.export_dir))
            if cfg.export.enabled and os.path.abspath(export_parent) != os.path.abspath(
                    cfg.run_dir):
                writable_dir(export_parent, "the export directory's parent")
        except SpecjaxError as e:
            error = str(e)
        else:
            lock_existed = os.path.exists(os.path.join(cfg.run_dir, LOCK_NAME))
            try:
                lock = RunDirLock(cfg.run_dir)
            except SpecjaxError as e:  # another train.py holds the run dir: touch nothing
                error, new = str(e), None
            else:
                new.locked(lock_existed)
                remove_stale_temps(cfg.run_dir)
    error = multihost.agree(error)
    try:
        if error is not None:
            raise SpecjaxError(error)
        return _train(cfg, mesh, new, stop_at=stop_at, progress=progress)
    except BaseException:
        if new is not None:
            new.remove()
        raise
    finally:
        if lock is not None:
            lock.release()


def _open_run(cfg: TrainConfig, mesh, new: NewFiles | None, is_main: bool):
    """The first step of `_train`: the objective's run (its data and trainer), the run's
    checkpoints, and the state to start from (fresh, or the newest checkpoint once the
    config it was written with is checked); then writes run_dir/config.yaml.

    Returns: (run, ckpts, state, data position, resumed)."""
    from specjax.dtypes import parse_dtype

    loop = cfg.train
    tx, schedule = make_optimizer(cfg.optim, loop.steps)
    dtype = parse_dtype(loop.dtype)
    if cfg.trains_drafter:
        from specjax.train.drafter_run import DrafterRun

        run = DrafterRun(cfg, mesh, tx, schedule, dtype)
    else:
        run = _LMRun(cfg, mesh, tx, schedule, dtype)
    os.makedirs(cfg.run_dir, exist_ok=True)
    ckpts = Checkpoints(os.path.join(cfg.run_dir, "checkpoints"), loop.keep_checkpoints,
                        loop.async_checkpointing)
    latest = ckpts.latest_step()
    config_path = os.path.join(cfg.run_dir, "config.yaml")
    changed = []
    if latest is not None:
        changed = check_resume_config(cfg, config_path, run.resume_keys)
    multihost.barrier("specjax.train: config checked")  # every process read the old one

    if latest is None:
        state, position = run.fresh_state(), 0
    else:
        def warn(msg):
            if is_main:
                print(f"[train] warning: {msg}", file=sys.stderr, flush=True)

        state, meta, _ = ckpts.restore_newest(run.trainer.abstract_target(), warn)
        if changed:  # after the restore: a refused resume prints its one error line only
            warn(f"resuming with settings that differ from {config_path}: "
                 f"{'; '.join(changed)}")
        position = int(meta["data_position"])
        run.resumed()
    if new is not None:  # started: from here on a failure keeps the run dir's files
        new.keep()
    if is_main:  # only now: a config that fails to restore leaves the old one in place
        dump_config(cfg, config_path)
    return run, ckpts, state, position, latest is not None


def _train(cfg: TrainConfig, mesh, new: NewFiles | None, *, stop_at: int | None,
           progress: bool) -> RunResult:
    loop, is_main = cfg.train, jax.process_index() == 0
    run, ckpts, state, position, resumed = _open_run(cfg, mesh, new, is_main)
    data, trainer = run.data, run.trainer
    T, B, A = cfg.data.seq_len, loop.batch_size, loop.grad_accum
    start = step = int(jax.device_get(state.step))
    last = loop.steps if stop_at is None else min(loop.steps, stop_at)

    log = _MetricsLog(os.path.join(cfg.run_dir, "metrics.jsonl"), is_main)
    log.write(event="resume" if resumed else "start", step=step,
              **run.start_info, devices=int(mesh.size),
              mesh=dict(zip(mesh.axis_names, map(int, mesh.devices.shape), strict=True)))
    losses, val_losses, val_metrics, pending = {}, {}, {}, []
    preempted, compile_s, tok_s = False, None, None
    timed_steps, timed_s = 0, 0.0
    t_last = time.perf_counter()
    postfix_extra = {}

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
                        tok_s="-" if rate is None else f"{rate:.0f}", **postfix_extra,
                        refresh=False)
        pending.clear()
        t_last = time.perf_counter()

    def validate():
        """Validation record of the current state (logged), or None without val data."""
        record = run.validate(state)
        if record is not None:
            val_losses[step], val_metrics[step] = record["val_loss"], record
            log.write(step=step, **record)
            postfix_extra.update(run.postfix(record))
            run.on_validation(step, state, record)
        return record

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
                batch, position = global_batch(data.train, position, B,
                                               trainer.batch_sharding, (A, B // A, T + 1))
                state, metrics = trainer.train_step(state, batch)
                step += 1
                pending.append((step, metrics))
                bar.update(1)
                if step == start + 1 or step % loop.log_every == 0 or step == last:
                    flush()
                if loop.eval_every and step % loop.eval_every == 0 and step < loop.steps:
                    record = validate()
                    if record is not None and is_main:
                        bar.write(f"step {step}: {run.describe(record)}")
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
                record = validate()
                val = None if record is None else record["val_loss"]
                export_dir = run.export(state, step, record)
                log.write(event="done", step=step, tokens_per_s=tok_s, compile_s=compile_s,
                          val_loss=val, export_dir=export_dir, **run.done_info())
    finally:
        bar.close()
        log.close()
        ckpts.close()
    return RunResult(step=step, losses=losses, val_losses=val_losses, preempted=preempted,
                     state=state, trainer=trainer, tokens_per_s=tok_s, compile_s=compile_s,
                     export_dir=export_dir, val_metrics=val_metrics, best=run.best)
