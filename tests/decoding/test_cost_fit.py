"""adaptive.fit_costs: the cost table Engine.calibrate keeps from its measurements,
checked against the known line that noisy synthetic measurements were drawn from."""

import numpy as np
import pytest

from specjax.decoding import adaptive

CHOICES = (0, 1, 2, 3, 5, 7)


def test_an_exact_line_is_kept():
    ms = [6.0] + [8.0 + 1.5 * g for g in CHOICES[1:]]
    assert adaptive.fit_costs(CHOICES, ms) == pytest.approx(ms)


def test_noisy_measurements_land_nearer_the_truth_than_the_running_maximum():
    """Against the line the noise was added to: the fit's error is smaller than that of
    the table made non-decreasing entry by entry (the rule before), and it prices the
    longest draft like a shorter one far less often (only where noise flattens the whole
    line) than the running maximum, which did so whenever one entry dipped."""
    rng = np.random.default_rng(0)
    g = np.asarray(CHOICES[1:], float)
    fit_err, max_err, ties_fit, ties_max = [], [], 0, 0
    for _ in range(300):
        a, b = rng.uniform(5, 20), rng.uniform(0.2, 2.0)
        truth = a + b * g
        noisy = truth * (1 + rng.normal(0, 0.06, g.shape))
        measured = [a * 0.7] + noisy.tolist()
        fit = np.asarray(adaptive.fit_costs(CHOICES, measured))[1:]
        mono = np.maximum.accumulate(noisy)
        fit_err.append(np.abs(fit - truth).mean() / truth.mean())
        max_err.append(np.abs(mono - truth).mean() / truth.mean())
        ties_fit += fit[-1] <= fit[-2]
        ties_max += mono[-1] <= mono[-2]
    assert np.mean(fit_err) < 0.7 * np.mean(max_err)
    assert ties_max > 20 and ties_fit <= ties_max / 10


def test_a_falling_fit_is_flat_and_the_table_never_falls():
    out = adaptive.fit_costs(CHOICES, [9.0, 14.0, 13.0, 12.5, 12.0, 11.0])
    assert out[1:] == pytest.approx([12.5] * 5)  # the mean of the speculative entries
    assert out[0] == 9.0
    assert out == sorted(out)


def test_the_autoregressive_entry_is_capped_at_the_shortest_draft():
    out = adaptive.fit_costs(CHOICES, [30.0, 10.0, 11.0, 12.0, 14.0, 16.0])
    assert out[0] == pytest.approx(out[1]) and out[1] < 30.0


def test_one_speculative_choice_keeps_its_measurement():
    assert adaptive.fit_costs((0, 4), [7.0, 11.0]) == [7.0, 11.0]
    assert adaptive.fit_costs((0, 4), [12.0, 11.0]) == [11.0, 11.0]


@pytest.mark.parametrize("ms", [[1.0, 2.0], [1.0, 0.0, 2.0, 3.0, 4.0, 5.0]])
def test_bad_measurements_raise(ms):
    with pytest.raises(ValueError, match="fit_costs"):
        adaptive.fit_costs(CHOICES, ms)


def test_calibration_doc_quotes_the_results_file():
    """docs/adaptive.md's repeatability table is what `--render-only` makes of the
    committed benchmarks/results/adaptive_calibration.json (a figure edited by hand
    fails), and that record compares the two orders on every row."""
    import json

    from benchmarks import adaptive as bench

    res = json.load(open(bench.CALIB_RESULTS))
    assert bench.render_calibration(res) in open(bench.DOC).read()
    assert all(set(r["methods"]) == {"rounds", "one after another"} for r in res["runs"])


def test_calibration_baseline_doc_quotes_the_results_file():
    """The same for the table of the autoregressive program measured in the rounds or
    after the table (benchmarks/results/adaptive_calibration_baseline.json), whose rows
    carry the ratio the fallback decides by: each fitted entry / that calibration's
    autoregressive step, recomputed here from the record's own columns."""
    import json

    import numpy as np

    from benchmarks import adaptive as bench

    res = json.load(open(bench.CALIB_BASELINE_RESULTS))
    assert bench.render_calibration(res) in open(bench.DOC).read()
    for r in res["runs"]:
        assert set(r["methods"]) == {"AR program in the rounds", "AR program after the table"}
        for v in r["methods"].values():
            q = np.asarray(v["fitted"]) / np.asarray(v["ar_ms_per_step"])[:, None]
            np.testing.assert_allclose(v["ratio"], q, rtol=1e-3)


def test_calibration_rounds_doc_quotes_the_results_file():
    """The same for three rounds against rounds added for 20 s
    (benchmarks/results/adaptive_calibration_rounds.json): the doc's table is the
    record's, three-round calibrations ran three rounds and the others at least as many,
    and each calibration's two margins lie in the clamp."""
    import json

    from benchmarks import adaptive as bench
    from specjax.decoding import adaptive

    res = json.load(open(bench.CALIB_ROUNDS_RESULTS))
    assert bench.render_calibration(res) in open(bench.DOC).read()
    lo, hi = adaptive.MARGIN_RANGE
    for r in res["runs"]:
        three, more = (r["methods"][k]["margins"] for k in r["methods"])
        assert all(m[0] == 3 for m in three) and all(m[0] >= 3 for m in more)
        for _, rng, tb in three + more:
            assert lo <= rng <= hi and lo <= tb <= hi


def test_calibration_batch_is_the_median_prompt_length():
    """The batch of lower-median mean prompt length, against numpy's own ordering."""
    import numpy as np

    from specjax.decoding import adaptive

    rng = np.random.default_rng(5)
    for n, size in [(1, 1), (2, 1), (7, 1), (8, 1), (5, 4), (6, 3)]:
        batches = [[[1] * int(rng.integers(1, 400)) for _ in range(size)] for _ in range(n)]
        means = np.array([np.mean([len(p) for p in b]) for b in batches])
        want = np.argsort(means, kind="stable")[(n - 1) // 2]
        assert adaptive.calibration_batch(batches) == want
    # the bundled demo's first eight prompts at batch 1: not the 30-token first one
    lengths = [30, 8, 384, 176, 219, 279, 305, 281]
    assert adaptive.calibration_batch([[[0] * k] for k in lengths]) == 4  # 219 tokens
    for bad in ([], [[]]):
        with pytest.raises(ValueError, match="non-empty"):
            adaptive.calibration_batch(bad)
