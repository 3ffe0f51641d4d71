"""Markdown tables and the PNG of benchmarks/compare.py, from its result dict (the JSON it
writes): one row per system (tokens/s, tau, alpha_k, speedups, equality), the batch sweep
per drafter, and a plot of tokens/s per system beside alpha_k by draft position."""

from __future__ import annotations

import math


def _fmt(x, spec=".1f", suffix=""):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec) + suffix


def render_tables(result: dict) -> str:
    """The main table and the batch-sweep table, as markdown."""
    systems = result["systems"]
    lines = ["| system | T | verify | G | tokens/s median | spread (min-max) | tau | alpha_k "
             "| speedup vs specjax-ar (same T) | speedup vs transformers-greedy "
             "| equal to transformers greedy (n/N) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in systems.items():
        t = s["tokens_per_s"]
        alpha = " ".join(_fmt(a, ".2f") for a in s["alpha"]) if s.get("alpha") else "-"
        eq = s.get("equal_to_transformers_greedy")
        if name == "transformers-greedy":
            eq_s = "reference"
        elif eq is None:
            eq_s = "-"
        else:
            eq_s = f"{eq['equal']}/{eq['of']} (prefix {eq['mean_common_prefix']:.1f})"
        lines.append(
            f"| {name} | {s['temperature']:g} | {s['verify'] or '-'} | {s['gamma'] or '-'} "
            f"| {t['median']:.1f} | {t['min']:.1f}-{t['max']:.1f} | {_fmt(s['tau'], '.2f')} "
            f"| {alpha} | {_fmt(s.get('speedup_vs_specjax_ar'), '.2f', 'x')} "
            f"| {_fmt(s.get('speedup_vs_transformers_greedy'), '.2f', 'x')} | {eq_s} |")
    sweep = result["batch_sweep"]
    if sweep:
        lines += ["", "| batch | drafter | AR tok/s | spec tok/s | tau | speedup | spec == AR |",
                  "|---|---|---|---|---|---|---|"]
        for b in sweep:
            lines.append(f"| {b['batch_size']} | {b['drafter']} "
                         f"| {b['ar']['tokens_per_s']['median']:.1f} "
                         f"| {b['spec']['tokens_per_s']['median']:.1f} "
                         f"| {_fmt(b['spec']['tau'], '.2f')} | {b['speedup']:.2f}x "
                         f"| {b['spec_equals_ar']} |")
    return "\n".join(lines)


def write_plot(path: str, result: dict) -> None:
    """Left: tokens/s per system (T=0 blue, T=1 orange, transformers hatched); right:
    alpha_k by draft position for every speculative specjax system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    systems = result["systems"]
    names = list(systems)
    med = [systems[n]["tokens_per_s"]["median"] for n in names]
    err = [[m - systems[n]["tokens_per_s"]["min"] for n, m in zip(names, med, strict=True)],
           [systems[n]["tokens_per_s"]["max"] - m for n, m in zip(names, med, strict=True)]]
    colors = ["tab:blue" if systems[n]["temperature"] == 0 else "tab:orange" for n in names]
    hatches = ["//" if systems[n]["kind"] == "transformers" else "" for n in names]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(17, 5.5),
                                   gridspec_kw={"width_ratios": [1.7, 1]})
    bars = ax1.bar(range(len(names)), med, yerr=err, capsize=4, color=colors,
                   edgecolor="black", linewidth=0.6)
    for bar, h, m in zip(bars, hatches, med, strict=True):
        bar.set_hatch(h)
        ax1.annotate(f"{m:.0f}", (bar.get_x() + bar.get_width() / 2, m), ha="center",
                     va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
    ax1.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
    ax1.set_ylabel("new tokens/s (median, min-max bars)")
    ax1.set_title(f"batch 1, {result['prompts']['count']} prompts x {result['new_tokens']} "
                  "tokens")
    ax1.legend(handles=[Patch(color="tab:blue", label="T=0 (greedy)"),
                        Patch(color="tab:orange", label="T=1"),
                        Patch(facecolor="white", edgecolor="black", hatch="//",
                              label="transformers")], fontsize=8)
    longest = 1
    series = [(n, s) for n, s in systems.items() if s["kind"] == "specjax" and s.get("alpha")]
    palette, markers = plt.get_cmap("tab20"), "osD^vP*Xhp<>"
    for i, (n, s) in enumerate(series):  # 20 colours x 12 markers: no two series alike
        alpha = s["alpha"]
        longest = max(longest, len(alpha))
        ax2.plot(range(1, len(alpha) + 1), [math.nan if a is None else a for a in alpha],
                 marker=markers[i % len(markers)], color=palette(i % 20),
                 label=f"{n} (G={len(alpha)})",
                 linestyle="-" if s["temperature"] == 0 else "--")
    ax2.set_xticks(range(1, longest + 1))
    ax2.set_xlabel("draft position k")
    ax2.set_ylabel("alpha_k (accepted | earlier accepted)")
    ax2.set_ylim(0, 1.05)
    ax2.set_title("acceptance by draft position")
    ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    from specjax.fileio import save_figure

    save_figure(fig, path)
