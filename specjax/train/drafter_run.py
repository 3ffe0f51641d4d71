"""The run-level pieces of a drafter run (objectives ttt and block) that `loop.train` calls:
the frozen target, validation statistics, the best-tau snapshot, and the export.

Files in `cfg.run_dir` besides the loop's (see loop.py):
  best_drafter/  the drafter with the highest validation tau so far (a drafter directory,
                 specjax.drafters.io, in the training dtype; config.json "train" records
                 {"objective", "step", "val_loss", "alpha", "tau", "gate"?}); rewritten
                 atomically at each new best, deleted when a run starts from scratch
  drafter/       the export (export.dir): the best-tau drafter in export.dtype, written
                 when train.steps is reached (the last state when there is no validation)

With several processes the run dir must be on a filesystem every process sees (as orbax
checkpoints need): process 0 writes the snapshots, every process reads the best record.

Validation (docs/design.md 6): the objective's stats over the fixed validation batches are
summed and summarized (objectives.summarize): alpha_0..alpha_{G-1} (simulated greedy
acceptance per draft position), tau, and the hybrid's mean gate.
"""

from __future__ import annotations

import math
import os
import shutil
import sys

import jax
import numpy as np

from specjax.errors import SpecjaxError
from specjax.train import mesh as mesh_lib
from specjax.train.config import TrainConfig
from specjax.train.drafter_step import DrafterTrainer
from specjax.train.inputs import RunData, global_batch, prepare_data
from specjax.train.objectives import summarize

BEST_DIR = "best_drafter"


def load_target(cfg: TrainConfig, dtype):
    """The frozen target of a drafter run (a Transformer in `dtype`).

    Raises: SpecjaxError for a missing or unreadable target directory."""
    from specjax.models.checkpoint import load_model

    check_target_dir(cfg)
    return load_model(cfg.target_dir, dtype=dtype)


def check_target_dir(cfg: TrainConfig) -> None:
    """Raises SpecjaxError if the drafter run's target directory does not exist."""
    path = cfg.target_dir
    if not os.path.isdir(path):
        raise SpecjaxError(f"target {path} does not exist; pass the frozen target's HF "
                           "directory with --target or the config's target key")


def check_tokenizer(cfg: TrainConfig, data: RunData) -> None:
    """Raises SpecjaxError if the run's tokenizer is not the one the target directory ships
    (compared by vocabulary). Silent when either side has no tokenizer."""
    from specjax.models.checkpoint import load_tokenizer

    mine = data.tokenizer
    if mine is None or os.path.abspath(getattr(mine, "name_or_path", "") or "") == \
            os.path.abspath(cfg.target_dir):
        return
    theirs = load_tokenizer(cfg.target_dir)
    if theirs is not None and theirs.get_vocab() != mine.get_vocab():
        raise SpecjaxError(f"the tokenizer in {mine.name_or_path} is not the one of target "
                           f"{cfg.target_dir} (their vocabularies differ); set "
                           "data.tokenizer_dir to the target's tokenizer")


class DrafterRun:
    """One drafter run: the hooks `loop.train` calls (see `_LMRun` there for lm).

    Args:
      cfg: the validated config (objective ttt or block).
      mesh, tx, schedule, dtype: as for `Trainer`.
    Raises: SpecjaxError for a missing target, data that does not fit the target's
      vocabulary or tokenizer, or a drafter setting the target cannot take.
    """

    resume_keys = ("objective", "target", "drafter")

    def __init__(self, cfg: TrainConfig, mesh, tx, schedule, dtype):
        loop = cfg.train
        self.cfg, self.dtype = cfg, dtype
        target = load_target(cfg, dtype)
        self.data = prepare_data(cfg, vocab_size=target.cfg.vocab_size)
        check_tokenizer(cfg, self.data)
        self.dcfg = cfg.drafter.for_target(target.cfg)
        T, B, A = cfg.data.seq_len, loop.batch_size, loop.grad_accum
        self.trainer = DrafterTrainer(self.dcfg, target, cfg.objective, cfg.drafter, dtype, tx,
                                      schedule, mesh, seed=loop.seed, grad_accum=A,
                                      micro_batch=loop.micro_batch, eval_batch=B, seq_len=T,
                                      kernels=loop.kernels)
        self.start_info = {"params": self.trainer.num_params,
                           "target_params": int(target.cfg.num_params),
                           "drafter": cfg.drafter.kind}
        self.best_dir = os.path.join(cfg.run_dir, BEST_DIR)
        self.best: dict | None = None  # the best_drafter record: {"step", "tau", ...}

    # ------------------------------------------------------------------ state

    def fresh_state(self):
        """A new drafter state (random, or train.init_from's weights where it has them);
        forgets any best_drafter of an earlier start."""
        if jax.process_index() == 0 and os.path.isdir(self.best_dir):
            shutil.rmtree(self.best_dir)
        init_from = self.cfg.train.init_from
        if not init_from:
            return self.trainer.init_state()
        params, loaded, kept = self.trainer.load_init_params(
            init_from, None if self.cfg.train.init_from_other_target else self.cfg.target_dir)
        if jax.process_index() == 0:
            print(f"[train] init_from {init_from}: {len(loaded)} tensors loaded, "
                  f"{len(kept)} kept random ({', '.join(kept) or 'none'})", file=sys.stderr,
                  flush=True)
        self.start_info["init_from"] = init_from
        return self.trainer.init_state(params)

    def resumed(self) -> None:
        """Picks up the best_drafter record of the run being resumed (if any)."""
        from specjax.drafters.io import read_config

        if os.path.isdir(self.best_dir):
            try:
                self.best = read_config(self.best_dir).get("train")
            except SpecjaxError:
                self.best = None

    # ------------------------------------------------------------------ validation

    def validate(self, state) -> dict | None:
        """{"val_loss", "alpha": [G floats or None], "tau", "gate"?} over the fixed
        validation batches, or None without validation data."""
        cfg = self.cfg
        B = cfg.train.batch_size
        positions = self.data.eval_positions(B, cfg.train.eval_batches)
        if not positions:
            return None
        outs = []
        for i, pos in enumerate(positions):
            batch, _ = global_batch(self.data.val, pos, B, self.trainer.eval_batch_sharding)
            outs.append(self.trainer.eval_step(state.params, batch, i))
        outs = jax.device_get(outs)
        stats = {k: np.sum([np.asarray(s[k], np.float64) for _, s in outs], axis=0)
                 for k in outs[0][1]}
        record = {"val_loss": float(np.mean([loss for loss, _ in outs])), **summarize(stats)}
        return record

    @staticmethod
    def describe(record: dict) -> str:
        """One line for the progress bar: val_loss, tau, alpha (and the gate)."""
        alpha = " ".join("-" if a is None else f"{a:.2f}" for a in record["alpha"])
        gate = f", gate {record['gate']:.3f}" if "gate" in record else ""
        return f"val_loss {record['val_loss']:.4f}, tau {record['tau']:.3f}, alpha [{alpha}]{gate}"

    @staticmethod
    def postfix(record: dict) -> dict:
        return {"tau": f"{record['tau']:.3f}"}

    def on_validation(self, step: int, state, record: dict) -> None:
        """Snapshots the drafter into best_drafter/ when its tau beats the best so far
        (a tie goes to the lower validation loss, then to the earlier step)."""
        tau = record["tau"]
        if not math.isfinite(tau):
            return
        if self.best is not None and (tau, -record["val_loss"]) <= (
                self.best["tau"], -self.best.get("val_loss", math.inf)):
            return
        self.best = {"objective": self.cfg.objective, "step": step, **record}
        self._save(self.best_dir, state.params, self.dtype, self.best)

    def _save(self, path: str, params, dtype, record: dict, gathered: bool = False) -> None:
        """save_drafter of `params` (device arrays, gathered here on every process, or
        host arrays with gathered=True) into `path` on process 0."""
        from specjax.drafters.io import save_drafter

        host = params if gathered else mesh_lib.host_tree(params)
        if jax.process_index() == 0:
            save_drafter(path, self.dcfg, host, self.cfg.target_dir, dtype,
                         train_record=record)

    # ------------------------------------------------------------------ export

    def export(self, state, step: int, record: dict | None) -> str | None:
        """Writes the export directory (process 0): the best-tau snapshot, or the last
        state when no validation ran; returns its path, or None if disabled."""
        cfg = self.cfg
        if not cfg.export.enabled:
            return None
        from specjax.drafters.io import load_drafter
        from specjax.models.checkpoint import parse_dtype

        dtype = parse_dtype(cfg.export.dtype)
        if self.best is not None:  # the same on every process: no collective inside
            if jax.process_index() == 0:
                _, params, _ = load_drafter(self.best_dir, dtype=self.dtype)
                self._save(cfg.export_dir, params, dtype, self.best, gathered=True)
        else:
            last = {"objective": cfg.objective, "step": step, **(record or {})}
            self._save(cfg.export_dir, state.params, dtype, last)
        return cfg.export_dir

    def done_info(self) -> dict:
        """Extra fields of the "done" event: the exported drafter's step and tau."""
        if self.best is None:
            return {}
        return {"best_step": self.best["step"], "best_tau": self.best["tau"]}
