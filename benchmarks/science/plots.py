"""The science benchmark's figures, from the data `results.write_results` collects: results.png (accuracy per domain
over the stages, the trade-off, the teacher lift, KL against forgetting) and pareto.png (the figure a reader wants
first: plasticity against forgetting, one point per method with both intervals, the reference marked).
"""

from __future__ import annotations

import os
from pathlib import Path


def seeds(n: int) -> str:
    """A legend's count: "1 seed", "2 seeds"."""
    return f"{n} seed" + ("s" if n != 1 else "")


def save(fig, path: Path) -> None:
    """Write `fig` to `path` through a temporary name (never a half-written figure) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)
    plt.close(fig)


def pareto(points: list[dict], path: Path, frontier: list[tuple[float, float]] = ()) -> None:
    """Plasticity (x) against forgetting (y), one point per method with its two 95 % intervals as error bars
    (`headline.pareto_points`); the reference (GRPO) drawn as a large star with dashed lines through it: up-left of
    it is worse on both, down-right better on both. `frontier`: GRPO's frontier F(x) (`frontier.frontier_curve`),
    drawn as a line: below it is above the frontier (less forgetting than GRPO attains at that plasticity)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 5.2))
    for i, p in enumerate(points):
        color = "k" if p["reference"] else plt.cm.tab10(i % 10)
        label = f"{p['method']} ({seeds(p['seeds'])})" + (", the reference" if p["reference"] else "")
        ax.errorbar(
            p["x"],
            p["y"],
            xerr=[[p["x_err"][0]], [p["x_err"][1]]],
            yerr=[[p["y_err"][0]], [p["y_err"][1]]],
            fmt="*" if p["reference"] else "o",
            markersize=16 if p["reference"] else 7,
            color=color,
            capsize=3,
            label=label,
            zorder=3 if p["reference"] else 2,
        )
        offset = (6, 6) if i % 2 == 0 else (6, -12)  # neighbours' names above and below their points
        ax.annotate(p["method"], (p["x"], p["y"]), textcoords="offset points", xytext=offset, fontsize=8, color=color)
        if p["reference"]:
            ax.axvline(p["x"], color="k", lw=0.8, ls="--")
            ax.axhline(p["y"], color="k", lw=0.8, ls="--")
    if frontier:
        xs, ys = zip(*frontier)
        ax.plot(xs, ys, color="0.4", lw=1.5, ls="-", label="GRPO's frontier F(x)", zorder=1)
    ax.set(
        xlabel="plasticity: mean gain on each stage's own domain (higher is better)",
        ylabel="forgetting (Chaudhry; lower is better)",
        title="plasticity vs forgetting (mean over seeds, 95 % intervals)",
    )
    ax.legend(fontsize=7)
    save(fig, path)


def plot(data: dict, runs: dict[str, dict[int, dict]], path: Path) -> None:
    """2 x D panels: accuracy per domain over the stages (mean over seeds, 95 % band); plasticity against
    forgetting (error bars); the teacher lift per stage; the forgetting a stage caused against its KL (fit, R²)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = data["summary"]
    first = next(iter(next(iter(runs.values())).values()))
    domains = first["domains"]
    stages = ["before"] + [s.split("-", 2)[-1] for s in first["stages"][1:]]
    width = max(3, len(domains))
    fig, axes = plt.subplots(2, width, figsize=(4.6 * width, 8.2))
    colors = {m: plt.cm.tab10(i) for i, m in enumerate(summary)}
    x = list(range(len(stages)))
    for d, domain in enumerate(domains):
        ax = axes[0][d]
        for m, s in summary.items():
            cells = [s["figures"][f"cell {k} {d}"] for k in x]
            ax.plot(
                x, [c["mean"] for c in cells], marker="o", color=colors[m], label=f"{m} ({seeds(len(s['seeds']))})"
            )
            ax.fill_between(
                x, [c["ci95"][0] for c in cells], [c["ci95"][1] for c in cells], color=colors[m], alpha=0.12
            )
        ax.set_xticks(x, [f"{k}\n{name}" for k, name in enumerate(stages)])
        ax.set(title=f"{domain} (n = {first['n'][d]} per seed)", xlabel="after stage", ylabel="greedy accuracy")
    axes[0][0].legend(fontsize=7)
    ax = axes[1][0]
    for m, s in summary.items():
        p, f = s["figures"]["plasticity"], s["figures"]["forgetting"]
        ax.errorbar(
            p["mean"],
            f["mean"],
            xerr=[[p["mean"] - p["ci95"][0]], [p["ci95"][1] - p["mean"]]],
            yerr=[[f["mean"] - f["ci95"][0]], [f["ci95"][1] - f["mean"]]],
            fmt="o",
            color=colors[m],
            capsize=3,
            label=m,
        )
    ax.axhline(0, color="grey", lw=0.5)
    ax.axvline(0, color="grey", lw=0.5)
    ax.set(
        xlabel="plasticity (mean gain on the stage's domain)",
        ylabel="forgetting (Chaudhry)",
        title="trade-off (mean over seeds, 95 %)",
    )
    ax.legend(fontsize=7)
    lift_panel(axes[1][1], data["teacher_lift"], colors, len(stages) - 1)
    kl_panel(axes[1][2], data["kl_vs_forgetting"], colors)
    for row, used in ((0, len(domains)), (1, 3)):
        for extra in range(used, width):
            axes[row][extra].axis("off")
    save(fig, path)


def lift_panel(ax, rows: list[dict], colors: dict, num_stages: int) -> None:
    methods = list(dict.fromkeys(r["method"] for r in rows))
    bar = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        mine = [r for r in rows if r["method"] == m]
        xs = [r["stage"] + (i - (len(methods) - 1) / 2) * bar for r in mine]
        pooled = [r["pooled"] or {"lift": r["mean"] or 0.0, "ci95": None} for r in mine]
        means = [p["lift"] for p in pooled]
        lo = [p["lift"] - p["ci95"][0] if p["ci95"] else 0.0 for p in pooled]
        hi = [p["ci95"][1] - p["lift"] if p["ci95"] else 0.0 for p in pooled]
        ax.bar(xs, means, bar, yerr=[lo, hi], color=colors[m], capsize=3, label=m)
    ax.axhline(0, color="grey", lw=0.5)
    labels = {r["stage"]: f"{r['stage']}\n{r['domain']}" for r in rows}
    ax.set_xticks(list(range(1, num_stages + 1)), [labels.get(k, str(k)) for k in range(1, num_stages + 1)])
    ax.set(xlabel="stage", ylabel="teacher − student accuracy", title="teacher lift at stage start (pooled, 95 %)")
    if methods:
        ax.legend(fontsize=7)


def kl_panel(ax, kl: dict, colors: dict) -> None:
    markers = {2: "o", 3: "s", 4: "^", 5: "D"}
    shown = set()
    for p in kl["points"]:
        err = [[p["forgetting"] - p["ci95"][0]], [p["ci95"][1] - p["forgetting"]]] if p["ci95"] else None
        label = p["method"] if p["method"] not in shown else None
        shown.add(p["method"])
        ax.errorbar(
            p["kl_token"],
            p["forgetting"],
            yerr=err,
            fmt=markers.get(p["stage"], "o"),
            color=colors.get(p["method"], "k"),
            capsize=2,
            alpha=0.8,
            label=label,
        )
    fit = kl["fits"].get("kl_token, all stages")
    title = "forgetting a stage caused vs its KL"
    if fit is not None:
        xs = sorted(p["kl_token"] for p in kl["points"])
        ax.plot([xs[0], xs[-1]], [fit["intercept"] + fit["slope"] * v for v in (xs[0], xs[-1])], color="k", lw=1)
        r2 = "–" if fit["r2"] is None else f"{fit['r2']:.2f}"
        r2_ci = "" if fit["r2_ci95"] is None else " [{:.2f}, {:.2f}]".format(*fit["r2_ci95"])
        title += f"\nR² = {r2}{r2_ci}, {fit['n']} points (o: stage 2, □: 3)"
    ax.axhline(0, color="grey", lw=0.5)
    ax.set(
        xlabel="forward KL from the previous stage's policy (nats/token)",
        ylabel="forgetting caused (a[k−1] − a[k])",
        title=title,
    )
    if kl["points"]:
        ax.legend(fontsize=7)
