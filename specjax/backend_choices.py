"""What "auto" means on each backend: the layer loop, the target's attention path and the
verification path that decode.py takes by default (`--kernels auto`, `layer_loop="auto"`).

A backend's entry is measured where a device round measured it: `python
benchmarks/kernel_choice.py` derives each choice from the committed rounds under
benchmarks/results/device/ (the loop's own timings where a round has them, the kernels'
standalone timings otherwise; the rule is in that script) and `--check` (run by
tests/decoding/test_kernel_paths.py) fails when this table and the results disagree.
An entry without a measurement says so and gives its reason instead.

  layer_loop: "unroll" | "scan"      (`specjax.models.model.decoding_params`)
  attention:  "pallas" | "jnp"       (the target's decode / verify attention)
  verify:     "fused" | "unfused"    (pallas_kernels.verify, or specjax.decoding.verify)
"""

from __future__ import annotations

CHOICES = {
    "gpu": {"layer_loop": "unroll", "attention": "pallas", "verify": "unfused",
            "measured": True,
            "why": "measured on GPU rounds: `python benchmarks/kernel_choice.py` derives "
                   "each choice from benchmarks/results/device/"},
    "tpu": {"layer_loop": "scan", "attention": "pallas", "verify": "fused",
            "measured": False,
            "why": "no TPU has run a round: the Mosaic kernels lower (tests/decoding/"
                   "test_export.py) and the scan compiles one layer whatever L; "
                   "scripts/big_round.sh measures both on the first TPU"},
    "cpu": {"layer_loop": "unroll", "attention": "jnp", "verify": "fused",
            "measured": False,
            "why": "interpret mode is no speed path, so the kernels' jnp twin "
                   "(`--kernels reference`): verification fused in jnp, chunked jnp "
                   "attention; unrolled layers (benchmarks/decode_speed.py)"},
}


def choice(backend: str) -> dict:
    """The entry for `backend` ("gpu", "tpu", "cpu"; any other backend: the TPU's, the
    choice made without a measurement)."""
    return CHOICES.get(backend, CHOICES["tpu"])


def kernels_setting(entry: dict) -> str:
    """The `--kernels` setting that runs an entry's attention and verification paths:
    "pallas" (both kernels), "attention" (attention kernel, unfused verification),
    "reference" (fused verification in jnp: what CPU takes, where the kernels would run in
    interpret mode) or "off" (neither)."""
    fused, kernel = entry["verify"] == "fused", entry["attention"] == "pallas"
    if kernel:
        return "pallas" if fused else "attention"
    return "reference" if fused else "off"
