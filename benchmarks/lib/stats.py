"""Statistics shared by the benchmarks: medians and spreads of repeated timings, output
agreement, and a crossed (seeds x prompts) bootstrap for paired comparisons."""

from __future__ import annotations

import math
import statistics

import numpy as np

RESAMPLES = 4000
LEVEL = 0.95
BOOT_SEED = 0


def summary(values: list[float]) -> dict:
    """median, min and max of `values`."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def equality(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """How many rows of `outputs` equal `reference`'s, per prompt, and their common
    prefixes."""
    same = [a == b for a, b in zip(outputs, reference, strict=True)]
    prefixes = [common_prefix(a, b) for a, b in zip(outputs, reference, strict=True)]
    return {"equal": sum(same), "of": len(same), "per_prompt": same,
            "mean_common_prefix": statistics.mean(prefixes), "common_prefix": prefixes}


def bootstrap_ci(arrays: dict[str, np.ndarray], stat, *, resamples: int = RESAMPLES,
                 level: float = LEVEL, seed: int = BOOT_SEED) -> dict:
    """Percentile interval of a statistic of totals, by a crossed (two-way) bootstrap over
    seeds and prompts.

    Args:
      arrays: name -> f64[S, P]: one value per (seed, prompt) cell, e.g. accepted drafts and
        verification steps per prompt; every array over the same S seeds and P prompts. To
        compare two drafters, pass both drafters' arrays: they are paired (resampled with
        the same seed indices and the same prompts).
      stat: f(totals) -> f64[...]: the statistic from totals, name -> f64[...] (sums over
        the cells, each cell counted as often as its seed and its prompt were drawn), e.g.
        tau = 1 + totals["accepted"] / totals["steps"]. Called once on the full data
        (scalars) and once on all resamples (f64[R]).
      resamples: R; level: the interval's coverage; seed: the resampling's numpy seed.
    Each resample draws S seed indices and P prompt indices with replacement, independently
    (seeds and prompts are crossed: every seed ran every prompt), so both the spread between
    seeds and the spread between prompts enter the interval; with S = 1 only the prompts'.
    Returns: {"estimate", "lo", "hi", "seeds": S, "prompts": P, "resamples": R} (lo/hi NaN
      where no resample has a finite statistic).
    """
    names = list(arrays)
    xs = {k: np.asarray(arrays[k], np.float64) for k in names}
    shapes = {x.shape for x in xs.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"arrays must all be [S, P], got {sorted(shapes)}")
    S, P = next(iter(shapes))
    rng = np.random.default_rng(seed)
    cs = rng.multinomial(S, np.full(S, 1.0 / S), size=resamples).astype(np.float64)  # [R,S]
    cp = rng.multinomial(P, np.full(P, 1.0 / P), size=resamples).astype(np.float64)  # [R,P]
    with np.errstate(divide="ignore", invalid="ignore"):
        est = float(stat({k: x.sum() for k, x in xs.items()}))
        vals = np.asarray(stat({k: ((cs @ x) * cp).sum(axis=1) for k, x in xs.items()}),
                          np.float64)
    vals = vals[np.isfinite(vals)]
    tail = (1.0 - level) / 2 * 100
    lo, hi = (np.percentile(vals, [tail, 100 - tail]) if len(vals) else (math.nan, math.nan))
    return {"estimate": est, "lo": float(lo), "hi": float(hi), "seeds": int(S),
            "prompts": int(P), "resamples": int(resamples)}


def ratio(num: str, den: str, offset: float = 0.0):
    """stat for `bootstrap_ci`: offset + totals[num] / totals[den]."""
    return lambda t: offset + t[num] / t[den]


def speed_ratio(t):
    """stat for `bootstrap_ci`: (tokens / wall) / (AR tokens / AR wall) over the totals."""
    return (t["tokens"] / t["wall"]) / (t["ar_tokens"] / t["ar_wall"])


def difference(stat_a, stat_b):
    """stat of a paired difference: arrays of drafter a prefixed "a.", of b "b."."""
    def f(t):
        ta = {k[2:]: v for k, v in t.items() if k.startswith("a.")}
        tb = {k[2:]: v for k, v in t.items() if k.startswith("b.")}
        return stat_a(ta) - stat_b(tb)
    return f
