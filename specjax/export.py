"""Lowering for a platform the host does not have: `export_for` runs `jax.export` for
TPU or GPU from a CPU host (`lowering_target`: the GPU's device kind where a Triton
kernel asks for it; the Triton custom call allowed).

`python -m specjax.export` (`specjax.tools.export`) lowers the compiled decoding loops
for TPU and GPU from a target's config.json alone with it; the kernel tests lower their
Pallas kernels with it.
"""

from __future__ import annotations

import sys

TRITON_CHECK = "__gpu$xla.gpu.triton"


def lowering_target(platform: str):
    """A context for lowering to `platform` on a host without it: for cuda, an abstract
    one-device mesh of an H100, since jax 0.12 asks the default device for the GPU's
    compute capability when lowering a Triton kernel with dots ("No supported GPU devices
    found" on a CPU host); elsewhere nothing."""
    import contextlib

    import jax

    if platform != "cuda":
        return contextlib.nullcontext()
    gpu = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None,
                                      platform="gpu")
    return jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("x",), abstract_device=gpu))


def export_for(fn, platform: str, *args):
    """`jax.export.export(fn, platforms=[platform])(*args)` from a host without that
    platform: inside `lowering_target`, with the Triton custom call allowed (jax's
    export rejects it as not guaranteed stable). Returns the jax.export.Exported."""
    import jax

    checks = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CHECK)]
    with lowering_target(platform):
        return jax.export.export(fn, platforms=[platform], disabled_checks=checks)(*args)


if __name__ == "__main__":  # `python -m specjax.export`: specjax.tools.export
    from specjax.tools.export import main

    sys.exit(main())
