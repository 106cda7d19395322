"""GRPO's frontier and issue 43's headline (README "Issue 43: ... pre-registration"): does a method lie above GRPO's
own plasticity/forgetting trade-off, does it retain anything worth having, and which part of the hybrid does it.

- `attainable(points, x, lower_is_better)`: F(x), the best value of a figure (forgetting: lowest; retention_ratio:
  highest) GRPO's knob settings attain at a plasticity of at least x: over the settings whose plasticity is ≥ x
  their own value, and over every pair of settings with x between their plasticities the straight line between
  them at x (the pre-registered interpolation; where it beats every single point it is the convex hull's value).
  Where no setting reaches x, the most plastic setting's value, flagged `beyond`.
- `frontier_gap`: y_M − F(x_M) for forgetting (negative: above the frontier, it forgets less than GRPO can at its
  plasticity), F(x_M) − y_M for retention_ratio (negative likewise), per bootstrap draw (paired: the same seed and
  example draws for the method and every setting, over the seeds all of them share: `resampling.Draws`), with the
  point estimate from the per-seed means over those seeds, the seed-level Student-t interval of the per-seed gaps
  and the exact one-sided sign-flip p over them.
- `headline_43`: per method, its frontier gaps, whether it beats `stage_skip` on ACC ("retains"), where its ACC sits
  between `stage_skip` and `joint`, its plasticity against GRPO (the cost, stated first); and the hybrid's ablations
  (hybrid_no_X − hybrid) with whether the distillation adds anything at equal plasticity (the gap of `hybrid` minus
  that of `hybrid_no_distill`).
Pure: the summary and draws of `analysis.summarise` in, numbers out.
"""

from __future__ import annotations

import statistics

from headline import paired
from resampling import Draws, percentile, sign_flip_p

from adaptercl.measure.stats import t_interval

# GRPO's knob settings (method_recipes.py METHODS) and the reference that stops after stage 1: the frontier's points
FRONTIER = ("grpo", "grpo_lr050", "grpo_lr025", "grpo_replay10", "grpo_replay25", "grpo_l2", "hybrid_no_distill",
            "stage_skip")  # fmt: skip
ABLATIONS = ("hybrid_no_distill", "hybrid_no_replay", "hybrid_no_l2")  # the hybrid with one part removed (each)
GAP_FIGURES = {"forgetting": True, "retention_ratio": False}  # figure -> lower is better
ABLATION_FIGURES = (("forgetting", "≤ 0"), ("plasticity", "≥ 0"), ("retention_ratio", "≥ 0"), ("acc", "≥ 0"))


def attainable(points: list[tuple[float, float]], x: float, lower_is_better: bool) -> tuple[float, bool]:
    """F(x) of the module docstring and whether x lies beyond every point's plasticity. points: (plasticity, value)."""
    best = min if lower_is_better else max
    candidates = [y for px, y in points if px >= x]
    for x1, y1 in points:
        for x2, y2 in points:
            if x1 < x <= x2 and x2 > x1:
                candidates.append(y1 + (y2 - y1) * (x - x1) / (x2 - x1))
    if candidates:
        return best(candidates), False
    return max(points)[1], True  # the most plastic setting's value


def gap_of(method_point: tuple[float, float], points: list[tuple[float, float]], lower_is_better: bool) -> tuple:
    """(gap, beyond): the method's value minus F at its plasticity, signed so that negative is better."""
    x, y = method_point
    f, beyond = attainable(points, x, lower_is_better)
    return (y - f if lower_is_better else f - y), beyond


def side(ci: list[float] | None) -> str:
    """The pre-registered reading of a frontier gap's interval: `above` the frontier when it lies strictly below 0,
    `below` when strictly above 0, `on` when it holds 0 (a gap of exactly 0 is on the frontier, not above it)."""
    if ci is None:
        return "–"
    return "above" if ci[1] < 0 else "below" if ci[0] > 0 else "on"


def seed_point(summary: dict, method: str, seed: int, figure: str) -> tuple[float, float]:
    """(plasticity, figure) of one seed's own run of the method."""
    cell = summary[method]["per_seed"][seed]
    return cell["plasticity"]["value"], cell[figure]["value"]


def frontier_gap(summary: dict, draws: Draws, method: str, figure: str = "forgetting") -> dict | None:
    """The method's frontier gap in `figure` (module docstring), over the seeds it shares with every frontier
    setting present; None without at least two settings."""
    lower = GAP_FIGURES[figure]
    settings = [s for s in FRONTIER if s in summary and s != method]
    if len(settings) < 2 or method not in summary:
        return None
    seeds = set(summary[method]["seeds"])
    for s in settings:
        seeds &= set(summary[s]["seeds"])
    seeds = tuple(sorted(seeds))
    if not seeds:
        return None
    over = draws.over(seeds)
    gaps, beyond_draws = [], 0
    for i in range(len(over[method])):
        pts = [(over[s][i]["plasticity"], over[s][i][figure]) for s in settings]
        if any(v is None for p in pts for v in p) or None in (over[method][i]["plasticity"], over[method][i][figure]):
            continue
        g, beyond = gap_of((over[method][i]["plasticity"], over[method][i][figure]), pts, lower)
        gaps.append(g)
        beyond_draws += beyond

    def mean_point(m: str) -> tuple[float, float]:
        xs, ys = zip(*(seed_point(summary, m, s, figure) for s in seeds))
        return statistics.fmean(xs), statistics.fmean(ys)

    estimate, beyond = gap_of(mean_point(method), [mean_point(s) for s in settings], lower)
    per_seed = {}
    for s in seeds:
        pts = [seed_point(summary, m, s, figure) for m in settings]
        per_seed[s] = gap_of(seed_point(summary, method, s, figure), pts, lower)[0]
    ci, seed_ci = percentile(gaps), t_interval(list(per_seed.values()))
    return {
        "figure": figure,
        "settings": settings,
        "seeds": list(seeds),
        "gap": estimate,
        "beyond": beyond,
        "beyond_share_of_draws": beyond_draws / len(gaps) if gaps else None,
        "ci95": ci,
        "state": side(ci),
        "per_seed": per_seed,
        "seed_t95": None if seed_ci is None else list(seed_ci),
        "seed_state": side(None if seed_ci is None else list(seed_ci)),
        "sign_flip_p": sign_flip_p(list(per_seed.values()), "< 0"),
    }


def gap_difference(summary: dict, draws: Draws, left: str, right: str) -> dict | None:
    """The forgetting frontier gap of `left` minus `right`'s, paired draw by draw over the seeds both share with every
    frontier setting (right is itself a frontier setting: it is left out of the frontier for both)."""
    settings = [s for s in FRONTIER if s in summary and s not in (left, right)]
    if len(settings) < 2 or left not in summary or right not in summary:
        return None
    seeds = set(summary[left]["seeds"]) & set(summary[right]["seeds"])
    for s in settings:
        seeds &= set(summary[s]["seeds"])
    over = draws.over(tuple(sorted(seeds)))
    diffs = []
    for i in range(len(over[left])):
        pts = [(over[s][i]["plasticity"], over[s][i]["forgetting"]) for s in settings]
        gl = gap_of((over[left][i]["plasticity"], over[left][i]["forgetting"]), pts, True)[0]
        gr = gap_of((over[right][i]["plasticity"], over[right][i]["forgetting"]), pts, True)[0]
        diffs.append(gl - gr)
    per_seed = {}
    for s in sorted(seeds):
        pts = [seed_point(summary, m, s, "forgetting") for m in settings]
        left_gap = gap_of(seed_point(summary, left, s, "forgetting"), pts, True)[0]
        per_seed[s] = left_gap - gap_of(seed_point(summary, right, s, "forgetting"), pts, True)[0]
    ci, seed_ci = percentile(diffs), t_interval(list(per_seed.values()))
    return {
        "left": left,
        "right": right,
        "difference": statistics.fmean(per_seed.values()) if per_seed else None,
        "ci95": ci,
        "state": side(ci),
        "per_seed": per_seed,
        "seed_t95": None if seed_ci is None else list(seed_ci),
        "sign_flip_p": sign_flip_p(list(per_seed.values()), "< 0"),
    }


def position(summary: dict, method: str) -> float | None:
    """Where the method's ACC sits between stage_skip's (0) and joint's (1): point estimate over each one's seeds."""
    if not {"stage_skip", "joint", method} <= set(summary):
        return None
    acc = {m: summary[m]["figures"]["acc"]["mean"] for m in ("stage_skip", "joint", method)}
    span = acc["joint"] - acc["stage_skip"]
    return None if span == 0 else (acc[method] - acc["stage_skip"]) / span


def with_exact(row: dict | None, good: str) -> dict | None:
    """A `headline.paired` row with the exact sign-flip p over its per-seed differences beside its intervals."""
    if row is not None:
        row["sign_flip_p"] = sign_flip_p(list(row["per_seed"].values()), "> 0" if good == "≥ 0" else "< 0")
    return row


def headline_43(summary: dict, draws: Draws, reference: str = "grpo") -> dict:
    """Per method (every one but the references and GRPO itself): the cost (plasticity − GRPO's), the frontier gaps,
    retains (ACC − stage_skip's ≥ 0), the position between stage_skip and joint; then the hybrid's ablations."""
    rows = []
    for method in summary:
        if method in (reference, "base", "stage_skip", "joint"):
            continue
        rows.append(
            {
                "method": method,
                "cost": with_exact(paired(summary, draws, method, reference, "plasticity", "≥ 0"), "≥ 0"),
                "gap": {figure: frontier_gap(summary, draws, method, figure) for figure in GAP_FIGURES},
                "retains": with_exact(
                    paired(summary, draws, method, "stage_skip", "acc", "≥ 0") if "stage_skip" in summary else None,
                    "≥ 0",
                ),
                "position": position(summary, method),
            }
        )
    ablations = []
    if "hybrid" in summary:
        for part in ABLATIONS:
            if part not in summary:
                continue
            row = {"without": part.removeprefix("hybrid_no_")}
            for key, good in ABLATION_FIGURES:  # hybrid_no_X − hybrid
                row[key] = with_exact(paired(summary, draws, part, "hybrid", key, good), good)
            ablations.append(row)
    return {
        "reference": reference,
        "rows": rows,
        "ablations": ablations,
        "distill_at_equal_plasticity": gap_difference(summary, draws, "hybrid", "hybrid_no_distill"),
    }


def frontier_points(summary: dict) -> list[dict]:
    """GRPO's frontier settings present (the collection's `frontier` block): each one's mean plasticity, forgetting
    and retention_ratio over its seeds with their bootstrap intervals."""
    out = []
    for setting in FRONTIER:
        if setting in summary:
            f = summary[setting]["figures"]
            out.append({"setting": setting, "seeds": len(summary[setting]["seeds"]),
                        **{k: f[k] for k in ("plasticity", "forgetting", "retention_ratio", "acc")}})  # fmt: skip
    return out


def frontier_curve(points: list[dict], steps: int = 50) -> list[tuple[float, float]]:
    """F(x) of the settings' mean points (forgetting), sampled over their plasticity range: the line pareto.png
    draws."""
    pts = [(p["plasticity"]["mean"], p["forgetting"]["mean"]) for p in points]
    if len(pts) < 2:
        return []
    lo, hi = min(x for x, _ in pts), max(x for x, _ in pts)
    xs = [lo + (hi - lo) * i / steps for i in range(steps + 1)]
    return [(x, attainable(pts, x, True)[0]) for x in xs]


def _cell(row: dict | None, key: str = "difference") -> str:
    if row is None:
        return "–"
    lo_hi = "" if row.get("ci95") is None else f" [{row['ci95'][0]:+.3f}, {row['ci95'][1]:+.3f}]"
    seed = "" if row.get("seed_t95") is None else f"; t [{row['seed_t95'][0]:+.3f}, {row['seed_t95'][1]:+.3f}]"
    p = "" if row.get("sign_flip_p") is None else f"; p {row['sign_flip_p']:.3f}"
    return f"{row[key]:+.3f}{lo_hi}{seed}{p}"


def direction(row: dict | None, raises: str, lowers: str) -> str:
    """`raises` / `lowers` / undecided from the bootstrap interval of a difference."""
    if row is None or row.get("ci95") is None:
        return "–"
    lo, hi = row["ci95"]
    return raises if lo > 0 else lowers if hi < 0 else "undecided"


def _mean_ci(cell: dict) -> str:
    """A bootstrap cell of the summary as `mean [lo, hi]`."""
    return f"{cell['mean']:.3f} [{cell['ci95'][0]:.3f}, {cell['ci95'][1]:.3f}]"


def retention_md(data: dict) -> list[str]:
    """Issue 43 item 1's figures per trained domain and averaged, for every method and reference: retention_ratio
    (`retention_ratio c`, then the mean) and gain_over_base (likewise), from the summary's bootstrap cells."""
    first = data["runs"][0]
    columns = first["trained_columns"]
    names = [*(first["domains"][c] for c in columns), "(mean)"]
    figures = ("retention_ratio", "gain_over_base")
    keys = [key for figure in figures for key in [*(f"{figure} {c}" for c in columns), figure]]
    head = [f"{label} {name}" for label in ("retention", "gain") for name in names]
    L = ["## Retention and gain over base, per trained domain (issue 43 item 1; mean over seeds [95 %])", "",
         "retention = a[T, c] / max(a[0, c], max over the stages from c's own on of a[k, c]): the final accuracy "
         "relative to the best the domain reached from its own stage on or the base's own, whichever is higher (a "
         "domain the base already answers counts as something an earlier stage can destroy); gain = a[T, c] − "
         "a[0, c]. (mean): over the trained domains.", "",
         "| method | seeds | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(head)]  # fmt: skip
    for method, s in data["summary"].items():
        f = s["figures"]
        text = [_mean_ci(f[k]) if f[k].get("ci95") else f"{f[k]['mean']:.3f}" for k in keys]
        L.append(f"| {method} | {len(s['seeds'])} | " + " | ".join(text) + " |")
    return L + [""]


def frontier_md(data: dict) -> list[str]:
    """Issue 43's sections of results.md: retention and gain over base, the frontier, the references, the headline
    per method, the ablations."""
    h = data.get("frontier_headline")
    if not h:
        return []
    L = retention_md(data)
    L += ["## Issue 43: GRPO's frontier (its knob settings; stage_skip = GRPO stopped after stage 1)", ""]
    L += ["| setting | seeds | plasticity [95 %] | forgetting [95 %] | retention_ratio [95 %] | ACC [95 %] |"]
    L += ["|---|---|---|---|---|---|"]
    for p in data["frontier"]:
        cells = " | ".join(
            _mean_ci(p[k]) if p[k]["ci95"] else "–" for k in ("plasticity", "forgetting", "retention_ratio", "acc")
        )
        L.append(f"| {p['setting']} | {p['seeds']} | {cells} |")
    L += [
        "",
        '## Issue 43 headline: above GRPO\'s frontier? retains? (pre-registered rule: README "Issue 43")',
        "",
        "Each cell: estimate [paired bootstrap 95 %]; t [seed-level Student-t 95 %]; p (exact one-sided sign-flip "
        "over the shared seeds). Cost: plasticity − grpo. Gap: forgetting − F(plasticity), F the least forgetting "
        "GRPO's settings attain at that plasticity (negative: above the frontier); the retention gap likewise with "
        "retention_ratio (negative: retains more than GRPO can at that plasticity). Retains: ACC − stage_skip's. "
        "Position: (ACC − stage_skip's) / (joint's − stage_skip's).",
        "",
        "| method | cost: plasticity − grpo | forgetting gap | above? | retention gap | retains: ACC − stage_skip "
        "| position |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in h["rows"]:
        gap, rgap = r["gap"]["forgetting"], r["gap"]["retention_ratio"]
        above = "–" if gap is None else {"above": "**above**", "below": "below", "on": "on", "–": "–"}[gap["state"]]
        if gap is not None and gap["beyond"]:
            above += " (beyond GRPO's plasticity range)"
        retains = direction(r["retains"], "**yes**", "no")
        pos = "–" if r["position"] is None else f"{r['position']:.2f}"
        L.append(
            f"| {r['method']} | {_cell(r['cost'])} | {_cell(gap, 'gap')} | {above} | {_cell(rgap, 'gap')} | "
            f"{_cell(r['retains'])} {retains} | {pos} |"
        )
    if h["ablations"]:
        L += [
            "",
            "## The hybrid taken apart (hybrid_no_X − hybrid, paired over the shared seeds)",
            "",
            "| part removed | forgetting | plasticity | retention_ratio | ACC | removing it |",
            "|---|---|---|---|---|---|",
        ]
        for a in h["ablations"]:
            verdict = direction(a["forgetting"], "raises forgetting", "lowers forgetting")
            L.append(
                f"| {a['without']} | {_cell(a['forgetting'])} | {_cell(a['plasticity'])} | "
                f"{_cell(a['retention_ratio'])} | {_cell(a['acc'])} | {verdict} |"
            )
        d = h["distill_at_equal_plasticity"]
        if d is not None:
            L += [
                "",
                "Does the distillation add anything at equal plasticity? Forgetting gap of hybrid − hybrid_no_distill "
                f"(each against the other GRPO settings): {_cell(d)} → "
                + direction(d, "no (the hybrid's gap is larger)", "**yes**"),
            ]
    return L + [""]
