"""Training curves of one or more runs as a PNG, from their metrics.jsonl files.

    python -m specjax.train.plot runs/demo_target_continue/metrics.jsonl --out curve.png
    python -m specjax.train.plot first.jsonl second.jsonl --offset-tokens 0 3276800 \
        --labels "first run" "continued" --out curve.png

Left: training loss (mean of each logged window) and validation loss against tokens
seen; right (drafter runs only): validation tau. Several files are drawn on one axis,
each shifted by its --offset-tokens (a continued run starts where the first one ended).
Bad input exits 2 with one line. The command line is `specjax.tools.plot`; `plot` and
`read_metrics` are the library calls.
"""

from __future__ import annotations

import json
import sys

from specjax.errors import SpecjaxError


def read_metrics(path: str) -> dict:
    """{"train": [(tokens, loss)], "val": [(tokens, val_loss)], "tau": [(tokens, tau)]}
    from a metrics.jsonl (tokens of validation lines: step * tokens per step)."""
    train, val, tau = [], [], []
    per_step = None
    try:
        with open(path) as f:
            lines = [json.loads(x) for x in f if x.strip()]
    except (OSError, ValueError) as e:
        raise SpecjaxError(f"{path} is not a readable metrics.jsonl ({e})") from None
    for r in lines:
        if "loss" in r and "tokens" in r and r.get("step"):
            per_step = r["tokens"] / r["step"]
            train.append((r["tokens"], r["loss"]))
    for r in lines:
        if "val_loss" in r and r.get("step") and (per_step or "tokens" in r):
            x = r["tokens"] if "tokens" in r else r["step"] * per_step
            val.append((x, r["val_loss"]))
            if r.get("tau") is not None:
                tau.append((x, r["tau"]))
    if not train and not val:
        raise SpecjaxError(f"{path} holds no loss lines")
    return {"train": train, "val": val, "tau": tau}


def plot(paths, out: str, labels=None, offsets=None, title: str | None = None) -> None:
    """Writes the PNG `out` (atomically) for the metrics files `paths`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = labels or list(paths)
    offsets = offsets or [0] * len(paths)
    runs = [read_metrics(p) for p in paths]
    with_tau = any(r["tau"] for r in runs)
    fig, axes = plt.subplots(1, 2 if with_tau else 1, figsize=(12 if with_tau else 7, 4.5),
                             squeeze=False)
    ax = axes[0][0]
    for i, (run, label, off) in enumerate(zip(runs, labels, offsets, strict=True)):
        color = f"C{i}"
        if run["train"]:
            xs, ys = zip(*run["train"], strict=True)
            ax.plot([(x + off) / 1e6 for x in xs], ys, alpha=0.35, linewidth=0.8, color=color,
                    label=f"{label}: training")
        if run["val"]:
            vx, vy = zip(*run["val"], strict=True)
            ax.plot([(x + off) / 1e6 for x in vx], vy, marker="o", color=color,
                    label=f"{label}: validation")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    if with_tau:
        ax2 = axes[0][1]
        for run, label, off in zip(runs, labels, offsets, strict=True):
            if run["tau"]:
                tx, ty = zip(*run["tau"], strict=True)
                ax2.plot([(x + off) / 1e6 for x in tx], ty, marker="o", label=label)
        ax2.set_xlabel("training tokens (millions)")
        ax2.set_ylabel("validation tau (simulated)")
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=8)
    fig.tight_layout()
    from specjax.fileio import save_figure

    save_figure(fig, out)


if __name__ == "__main__":  # `python -m specjax.train.plot`: specjax.tools.plot
    from specjax.tools.plot import main

    sys.exit(main())
