"""Adaptive draft length (`decode.py --gamma auto`; docs/adaptive.md), as its own package:

  policy      the schedule (`GammaSchedule`, a loop extension), its per-step choice and
              acceptance estimates, the cost model and the fallback's arithmetic
  loop        the schedule inside the compiled loop: one step per draft length, the
              deferred drafter update
  table       the cost table's key and its JSON file
  controller  beside the engine: calibration, the autoregressive fallback, drift

The policy's and the table's public names are importable from here
(`from specjax.decoding import adaptive; adaptive.GammaSchedule`)."""

from specjax.decoding.adaptive.policy import (
    FALLBACK_DRIFT,
    MARGIN_RANGE,
    NOISY_SPREAD,
    POLICIES,
    AdaptState,
    Baseline,
    GammaSchedule,
    calibration_batch,
    calibration_spread,
    choose,
    default_choices,
    drift_to_prior,
    expected_max_normal,
    expected_tokens,
    finish_time,
    fit_costs,
    init_state,
    measured_margin,
    observe,
    predicted_ms,
    speculation_pays,
    token_variance,
    with_gamma,
)
from specjax.decoding.adaptive.table import (
    read_alpha,
    read_baseline,
    read_field,
    read_table,
    table_key,
    write_table,
)

__all__ = ["FALLBACK_DRIFT", "MARGIN_RANGE", "NOISY_SPREAD", "POLICIES", "AdaptState",
           "Baseline", "GammaSchedule", "calibration_batch", "calibration_spread", "choose",
           "default_choices", "drift_to_prior", "expected_max_normal", "expected_tokens",
           "finish_time", "fit_costs", "init_state", "measured_margin", "observe",
           "predicted_ms", "read_alpha", "read_baseline", "read_field", "read_table", "speculation_pays",
           "table_key", "token_variance", "with_gamma", "write_table"]
