"""Checkpoints (orbax CheckpointManager) and preemption (SIGTERM) handling.

A checkpoint at step s is the directory `<run_dir>/checkpoints/<s>` with two items:
  state  the TrainState: parameters, optimizer state, step, RNG (sharded arrays)
  meta   JSON: {"step", "data_position", "tokens_seen"}
orbax writes into `<s>.orbax-checkpoint-tmp-*` and renames when complete, so a
checkpoint is never half-written (docs/design.md 9); a crash leaves only a temporary
directory that `latest_step` ignores. Restoring uses an abstract target of
ShapeDtypeStructs with the run's shardings: the same tree comes back, resharded to
the current mesh (a run may resume on a different mesh).
"""

from __future__ import annotations

import os
import signal

import jax
import orbax.checkpoint as ocp

from specjax.errors import SpecjaxError
from specjax.train import multihost


class Checkpoints:
    """Save / restore TrainStates under `directory`.

    Args:
      directory: where the step directories go (created if missing).
      keep: checkpoints kept; older ones are deleted after a newer one is complete.
      async_save: write in a background thread (the arrays are copied off the devices
        before `save` returns, so the next, donating step is safe).
    """

    def __init__(self, directory: str, keep: int, async_save: bool = True):
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=async_save)
        self.directory = os.path.abspath(directory)
        self._options = options
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self.manager.latest_step()

    def save(self, step: int, state, meta: dict) -> None:
        """Starts writing checkpoint `step` (returns before the files are written when
        async; call `wait` before the process exits)."""
        if step in self.manager.all_steps():
            return
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)

    def restore(self, step: int, abstract_state):
        """(TrainState, meta dict) of checkpoint `step`, placed in the target's shardings.

        Raises: SpecjaxError if the checkpoint does not match the configured model.
        """
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        except (ValueError, KeyError, TypeError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise SpecjaxError(f"checkpoint {self.directory}/{step} does not match this config "
                               f"({msg[:200]}); use a new run_dir or the config it was "
                               "trained with") from None
        return out.state, dict(out.meta)

    def restore_newest(self, abstract_state, warn=None):
        """(TrainState, meta dict, step) of the newest checkpoint that restores; a damaged
        newer one (truncated or missing files, as a crashed disk leaves them) is skipped
        with one `warn` line and renamed to `<step>.damaged` (orbax then ignores it and
        the run writes that step again). None when there is no checkpoint at all.

        Raises: SpecjaxError if no checkpoint restores (a config mismatch, or damage to
          all of them), never a silent start from step 0."""
        steps = sorted(self.manager.all_steps(), reverse=True)
        first_error = None
        for step in steps:
            try:
                state, meta = self.restore(step, abstract_state)
            except Exception as e:  # orbax/tensorstore raise many types for damaged files
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                first_error = first_error or (step, e, msg[:200])
                continue
            if first_error is not None:
                skipped = [s for s in steps if s > step]
                if warn is not None:
                    warn(f"checkpoint {self.directory}/{first_error[0]} cannot be restored "
                         f"({first_error[2]}); resuming from step {step} instead (kept "
                         f"as {', '.join(f'{s}.damaged' for s in skipped)})")
                if jax.process_index() == 0:  # out of orbax's way: the run re-saves them
                    for s in skipped:
                        path = os.path.join(self.directory, str(s))
                        os.replace(path, f"{path}.damaged")
                multihost.barrier("specjax.train: damaged checkpoints moved")
                self.manager.close()
                self.manager = ocp.CheckpointManager(self.directory, options=self._options)
            return state, meta, step
        if first_error is None:
            return None
        step, e, msg = first_error
        raise SpecjaxError(f"no checkpoint in {self.directory} can be restored (newest, "
                           f"step {step}: {msg}); if the config changed, use the one it was "
                           "trained with or a new run_dir; if the files are damaged, move "
                           "the directory away to start over")

    def wait(self) -> None:
        """Blocks until every started save is complete on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


class Preemption:
    """Tells the loop when to save and stop because the job is being preempted.

    One process: a SIGTERM handler sets a flag (the default action, death, is
    replaced while training runs). Several processes (`jax.distributed`): jax's
    preemption service catches SIGTERM on any host and agrees on a step that every
    host reaches (`multihost_utils.reached_preemption_sync_point`), so all save the
    same step and no collective is left waiting.
    """

    def __init__(self):
        self.requested = False
        self._previous = None
        self._multi = jax.process_count() > 1

    def __enter__(self):
        if not self._multi:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
        return False

    def _handle(self, signum, frame):
        del signum, frame
        self.requested = True

    def should_stop(self, step: int) -> bool:
        """True when the loop should checkpoint `step` and exit (call once per step)."""
        if self._multi:
            from jax.experimental import multihost_utils

            self.requested = self.requested or multihost_utils.reached_preemption_sync_point(
                step)
        return self.requested
