"""Several processes training one run (`train.py --distributed`): start-up and agreement.

    initialize(coordinator="10.0.0.1:1234", num_processes=4, process_id=2)
    initialize()                                  # TPU pods, SLURM, ...: auto-detected
    error = agree(None if ok else "message")      # the first process's error, on every process

One process runs per host (per machine), each driving its local devices; together they
form one global mesh (`jax.devices()` lists every process's devices). Each process reads
the same token files and computes the same global batch, then hands its devices only
their own rows (`mesh.host_to_global`). Process 0 writes metrics, config.yaml, the
progress bar and the export; every process writes its shards of the orbax checkpoints,
so the run dir must be on a filesystem all of them see.

On CPU (tests, several processes on one machine) the cross-process collectives go
through gloo (docs/design.md 9).
"""

from __future__ import annotations

import jax
import numpy as np

from specjax.errors import SpecjaxError

_MESSAGE_BYTES = 512  # an agreed error message is cut to this many UTF-8 bytes


def check_flags(coordinator: str | None, num_processes: int | None,
                process_id: int | None) -> None:
    """Raises SpecjaxError (one line) unless the explicit cluster flags are all given
    (and consistent) or all absent (auto-detection)."""
    given = [coordinator is not None, num_processes is not None, process_id is not None]
    if any(given) and not all(given):
        raise SpecjaxError("--coordinator HOST:PORT, --num-processes N and --process-id I go "
                           "together: pass all three, or none to let "
                           "jax.distributed.initialize() detect the cluster")
    if not any(given):
        return
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SpecjaxError(f"--coordinator {coordinator!r} is not HOST:PORT (e.g. "
                           "10.0.0.1:1234, the address of process 0)")
    if num_processes < 1:
        raise SpecjaxError(f"--num-processes {num_processes} must be >= 1")
    if not 0 <= process_id < num_processes:
        raise SpecjaxError(f"--process-id {process_id} must be in [0, {num_processes}) "
                           f"for --num-processes {num_processes}")


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    """`jax.distributed.initialize` for this process; call it before any other jax
    operation. Without arguments the cluster is detected (TPU pods, SLURM, Open MPI, ...).

    Raises: SpecjaxError for inconsistent flags (`check_flags`), or when the cluster
      cannot be joined (no coordinator detected, coordinator unreachable within
      300 s, jax already started)."""
    check_flags(coordinator, num_processes, process_id)
    try:  # CPU collectives across processes (a no-op for TPU/GPU devices)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError):  # a jax without this option
        pass
    # Explicit flags name the whole cluster: no detection, which under SLURM would also
    # limit each process to one local device (jax assumes a process per GPU there).
    detect = None if coordinator is None else "deactivate"
    try:
        jax.distributed.initialize(coordinator_address=coordinator,
                                   num_processes=num_processes, process_id=process_id,
                                   cluster_detection_method=detect)
    except (RuntimeError, ValueError) as e:
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise SpecjaxError(f"--distributed: cannot join the cluster ({msg}); pass "
                           "--coordinator, --num-processes and --process-id where it is "
                           "not detected, and start every process") from None


def agree(error: str | None) -> str | None:
    """The first error (by process index) among every process's `error`, on every
    process (a collective: every process must call it), so that all of them stop
    together instead of leaving the others waiting in a collective."""
    if jax.process_count() == 1:
        return error
    from jax.experimental import multihost_utils

    raw = (error or "").encode()[:_MESSAGE_BYTES]
    mine = np.zeros(_MESSAGE_BYTES + 1, np.uint8)
    mine[0] = error is not None
    mine[1:1 + len(raw)] = np.frombuffer(raw, np.uint8)
    every = np.asarray(multihost_utils.process_allgather(mine))  # [P, 1 + bytes]
    for row in every:
        if row[0]:
            return bytes(row[1:]).rstrip(b"\0").decode(errors="replace")
    return None


def barrier(name: str) -> None:
    """Waits until every process reaches the barrier `name` (nothing with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
