"""PoSE skip-wise positions for long-context training (`train.pose`, issue 33).

The rule (Zhu et al., ICLR 2024, arXiv 2309.10400; dwzhu-pku/PoSE src/train_pose.py): a
row's first chunk of l ~ U{1..(T+1)//2} tokens sits at 0..l-1, the rest at t + u for
u ~ U{0..L-T}. Checked here: the support and the frequencies of l and u against the
exact uniform probabilities, the end-to-end lm run with pose on (it learns, and its
losses differ from the same run without), the configuration errors, and (in
tests/models/test_model_golden.py) that the cache-free forward at such positions matches
transformers given the same position_ids.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from specjax.errors import SpecjaxError
from specjax.train import train
from specjax.train.step import pose_positions
from tests.train.test_train import corpus, tiny_cfg  # noqa: F401  (fixture)


def test_pose_positions_follow_the_rule():
    T, L, n = 7, 12, 40_000
    pos = np.asarray(pose_positions(jax.random.key(3), n, T, L))
    assert pos.shape == (n, T) and pos.dtype == np.int32
    assert (np.diff(pos, axis=1) >= 1).all()  # strictly increasing: causal by index
    assert (pos[:, 0] == 0).all() and (pos.max(axis=1) <= L - 1).all()
    jump = np.diff(pos, axis=1) - 1  # one entry per row may be non-zero: the skip u
    assert ((jump > 0).sum(axis=1) <= 1).all()
    # l = the first index whose position is not the index (T when u = 0: l is then hidden)
    skip = jump.sum(axis=1)
    shifted = pos != np.arange(T)[None, :]
    first = np.where(shifted.any(axis=1), shifted.argmax(axis=1), -1)
    # u ~ U{0..L-T}: every value about 1/(L-T+1) of the rows (5 sigma)
    freq = np.bincount(skip, minlength=L - T + 1) / n
    assert len(freq) == L - T + 1
    p = 1 / (L - T + 1)
    assert np.abs(freq - p).max() < 5 * np.sqrt(p * (1 - p) / n)
    # l ~ U{1..(T+1)//2}, seen where u > 0
    seen = first[skip > 0]
    m = (T + 1) // 2
    freq = np.bincount(seen, minlength=m + 1)[1:] / len(seen)
    assert len(freq) == m and np.bincount(seen)[0] == 0
    q = 1 / m
    assert np.abs(freq - q).max() < 5 * np.sqrt(q * (1 - q) / len(seen))


def test_pose_positions_reject_a_window_longer_than_the_range():
    with pytest.raises(ValueError, match="max_position"):
        pose_positions(jax.random.key(0), 2, 16, 8)


def test_lm_run_with_pose(corpus, tmp_path):  # noqa: F811
    """A tiny lm run at PoSE positions (max_position_embeddings 256, rows of 16): it
    learns, and its losses differ from the run at positions 0..15 (the positions are
    used), while its validation loss is measured at 0..15 like the plain run's."""
    runs = {}
    for pose in (False, True):
        cfg = tiny_cfg(corpus, tmp_path / str(pose), (1, 1, 1), f"train.pose={str(pose).lower()}",
                       "export.enabled=false")
        res = train(cfg, progress=False)
        runs[pose] = np.array([res.losses[s] for s in sorted(res.losses)])
    assert np.isfinite(runs[True]).all() and runs[True][-1] < runs[True][0]
    assert runs[True][0] == pytest.approx(runs[False][0], abs=0.5)  # same model, same rows
    assert np.abs(runs[True] - runs[False]).max() > 1e-4


def test_pose_config_errors(corpus, tmp_path):  # noqa: F811
    with pytest.raises(SpecjaxError, match="above data.seq_len"):
        tiny_cfg(corpus, tmp_path, (1, 1, 1), "train.pose=true",
                 "model.max_position_embeddings=16")
    with pytest.raises(SpecjaxError, match="config key train.pose must be true or false"):
        tiny_cfg(corpus, tmp_path, (1, 1, 1), "train.pose=2")


def test_pose_is_refused_for_a_drafter_objective():
    import os

    from specjax.train import load_config

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with pytest.raises(SpecjaxError, match="train.pose trains a target"):
        load_config(os.path.join(root, "configs", "drafters", "eagle3.yaml"),
                    ["train.pose=true"])
