"""The science benchmark's statistics, from the run records of `collect.py` (pure: numbers in, numbers out).

Intervals (all 95 %):
- one accuracy of one run: the Wilson interval over its n eval examples (`measure.stats.wilson_interval`);
- figures made of accuracies (a cell of the accuracy matrix, ACC, forgetting, plasticity, BWT, FWT, the forgetting
  a stage caused), for one run or averaged over seeds: a two-level percentile bootstrap (`resampling.bootstrap`). Each
  resample draws the seeds with replacement and then, independently for each drawn seed and domain, that seed's eval
  examples with replacement; the figure is computed from the resampled accuracy matrix with
  `measure.metrics.cl_metrics` / `measure.metrics.stage_forgetting` and averaged over the drawn seeds. A seed fixes the
  eval set (the builtin domains draw it from the seed), so every method of a seed is resampled with the same examples:
  a difference between two methods is paired (the same draws for both, over the seeds both have:
  `resampling.Draws`; a method's own figures are over all its seeds). With 3 seeds the seed level has few distinct
  draws, so these intervals are the example noise plus a coarse view of the seed-to-seed spread; the per-seed figures
  are listed beside them;
- per-run figures not made of eval examples (parameter drift, KL to the base, reward drop, the teacher lift's mean
  over seeds, minutes): the Student-t interval over the seeds (`measure.stats.t_interval`), of the paired per-seed
  differences where two methods are compared.
A direction "holds" when its interval excludes 0 on the expected side, is "opposite" when it excludes 0 on the
other, and is "undecided" when it contains 0.
"""

from __future__ import annotations

import math
import statistics

import torch
from resampling import Draws, bootstrap, difference, paired_means, percentile, point

from adaptercl.measure.stats import linear_fit, t_interval, wilson_interval

SCALARS = ("parameter_drift", "response_kl_to_base", "foreign_format_rate", "reward_drop", "train_minutes")


def summarise(
    runs: dict[str, dict[int, dict]], resamples: int, seed: int = 0
) -> tuple[dict[str, dict], Draws, list[int]]:
    """Per method: each figure's mean over its seeds with its two-level bootstrap interval and the per-seed values;
    the per-seed intervals (one-seed bootstrap, Wilson for cells); the SCALARS with t-intervals. Also returns the
    bootstrap draws (`Draws`: paired differences over the seeds two methods share) and every seed of any method."""
    draws = Draws(runs, resamples, seed)
    out = {}
    for m, by_seed in runs.items():
        mean = point(by_seed)
        per_seed = {}
        for s, run in by_seed.items():
            own = bootstrap({m: by_seed}, [s], resamples, seed)[m]
            values = point({s: run})
            per_seed[s] = {
                key: {"value": v, "ci95": percentile([d[key] for d in own if d[key] is not None])}
                for key, v in values.items()
            }
            for k, row in enumerate(run["correct"]):
                for d, col in enumerate(row):
                    per_seed[s][f"cell {k} {d}"]["ci95"] = list(wilson_interval(sum(col), len(col)))
        out[m] = {
            "seeds": sorted(by_seed),
            "bootstrap_seeds": sorted(by_seed),
            "n": by_seed[min(by_seed)]["n"],
            "figures": {
                key: {"mean": v, "ci95": percentile([d[key] for d in draws[m] if d[key] is not None])}
                for key, v in mean.items()
            },
            "per_seed": per_seed,
            "scalars": {key: scalar([by_seed[s][key] for s in sorted(by_seed)]) for key in SCALARS},
        }
    return out, draws, sorted(set().union(*(set(r) for r in runs.values())))


def scalar(values: list[float | None]) -> dict:
    """Mean over seeds, t-interval, the values."""
    vals = [v for v in values if v is not None]
    ci = t_interval(vals)
    return {"mean": statistics.fmean(vals) if vals else None, "ci95": None if ci is None else list(ci), "values": vals}


def verdict(ci: list[float] | None, expect: str) -> str:
    """holds / opposite / undecided for an interval of a difference expected to be `expect` ("> 0" or "< 0")."""
    if ci is None:
        return "–"
    above, below = ci[0] > 0, ci[1] < 0
    if not (above or below):
        return "undecided"
    return "holds" if (above if expect == "> 0" else below) else "opposite"


def compare(summary: dict, draws: Draws, claim: str, left: str, right: str, key: str, expect: str) -> dict | None:
    """A paper direction as a paired difference left − right of a bootstrapped figure or a per-seed scalar."""
    if left not in summary or right not in summary:
        return None
    if key in SCALARS:  # paired t-interval over the seeds both have
        a, b = summary[left]["scalars"][key], summary[right]["scalars"][key]
        common = [s for s in summary[left]["seeds"] if s in summary[right]["seeds"]]
        ia, ib = ([summary[m]["seeds"].index(s) for s in common] for m in (left, right))
        diffs = [a["values"][i] - b["values"][j] for i, j in zip(ia, ib)]
        est, ci = (statistics.fmean(diffs) if diffs else None), t_interval(diffs)
        ci = None if ci is None else list(ci)
        left_v, right_v, how = a["mean"], b["mean"], "paired t over seeds"
    else:
        d = difference(draws, left, right, key)
        left_v, right_v = paired_means(summary, draws, left, right, key)  # over the seeds both have
        est = None if None in (left_v, right_v) else left_v - right_v
        ci, how = percentile(d), "paired two-level bootstrap"
    return {
        "claim": claim,
        "measure": f"{key}: {left} − {right} {expect}",
        "left": left_v,
        "right": right_v,
        "difference": est,
        "ci95": ci,
        "interval": how,
        "verdict": verdict(ci, expect),
    }


def paper_checks(summary: dict, draws: Draws, lift_rows: list[dict] = ()) -> list[dict]:
    """The SDPO-CL paper's directions ("Denser ≠ Better"), each as a difference with its interval. "Specialises
    faster" is also tested stage by stage where its premise holds: on each stage whose teacher lift (`lift_rows`,
    `teacher_lift_table`), pooled over the seeds, is positive, the stage's own gain against GRPO's."""
    specs = []
    for dense in ("sdpo", "sdft"):
        premise = [r for r in lift_rows if r["method"] == dense and r["positive"]]
        specs += [
            (f"{dense} specialises faster than GRPO", dense, "grpo", "plasticity", "> 0"),
            *(
                (
                    f"{dense} specialises faster than GRPO on stage {r['stage']} ({r['domain']}), where its "
                    "teacher lift is positive",
                    dense,
                    "grpo",
                    f"gain {r['stage']}",
                    "> 0",
                )
                for r in premise
            ),
            (f"{dense} forgets more than GRPO", dense, "grpo", "forgetting", "> 0"),
            (f"{dense} drifts further from the base than GRPO (parameters)", dense, "grpo", "parameter_drift", "> 0"),
            (
                f"{dense} drifts further from the base than GRPO (responses)",
                dense,
                "grpo",
                "response_kl_to_base",
                "> 0",
            ),
            (f"{dense} is less stable than GRPO (in-stage reward drop)", dense, "grpo", "reward_drop", "> 0"),
        ]
    specs += [
        (
            "Denser ≠ better: top-100 SDPO forgets more than sampled-token SDPO",
            "sdpo",
            "sdpo_sampled",
            "forgetting",
            "> 0",
        ),
        (
            "Denser drifts more: top-100 > sampled-token SDPO (parameters)",
            "sdpo",
            "sdpo_sampled",
            "parameter_drift",
            "> 0",
        ),
    ]
    return [c for c in (compare(summary, draws, *spec) for spec in specs) if c is not None]


def goal_state(ci: list[float] | None, good: str) -> str:
    """Whether an interval of a difference meets a goal `good` ("≤ 0" or "≥ 0"): met when it lies on the goal's side
    (touching 0 there counts), not met when it lies strictly on the other side, undecided when 0 is inside."""
    if ci is None:
        return "–"
    lo, hi = ci
    if (hi <= 0) if good == "≤ 0" else (lo >= 0):
        return "met"
    if (lo > 0) if good == "≤ 0" else (hi < 0):
        return "not met"
    return "undecided"


def hybrid_goal(summary: dict, draws: Draws, sdpo_variants: tuple[str, ...]) -> list[dict]:
    """The hybrid's goal: forgetting no worse than GRPO's (hybrid − grpo ≤ 0) and in-domain gain at least 90 % of
    the best SDPO variant's (hybrid − 0.9 × best ≥ 0; the best by mean plasticity; when that is ≤ 0 the target is
    the best's gain itself). met: the interval lies on the goal's side (or touches 0 there); not met: it lies on the
    other side; undecided: it contains 0 in its interior."""
    out = []
    if "hybrid" not in summary:
        return out
    state = goal_state

    if "grpo" in summary:
        d = difference(draws, "hybrid", "grpo", "forgetting")
        h, g = paired_means(summary, draws, "hybrid", "grpo", "forgetting")
        ci = percentile(d)
        out.append(
            {
                "goal": "forgetting no worse than GRPO's",
                "measure": "forgetting: hybrid − grpo ≤ 0",
                "left": h,
                "right": g,
                "difference": h - g,
                "ci95": ci,
                "state": state(ci, "≤ 0"),
            }
        )
    present = [m for m in sdpo_variants if m in summary]
    if present:
        best = max(present, key=lambda m: summary[m]["figures"]["plasticity"]["mean"])
        h, b = paired_means(summary, draws, "hybrid", best, "plasticity")
        scale = 0.9 if b > 0 else 1.0
        ci = percentile(difference(draws, "hybrid", best, "plasticity", scale))
        out.append(
            {
                "goal": f"in-domain gain ≥ {round(100 * scale)} % of the best SDPO variant's ({best})",
                "measure": f"plasticity: hybrid − {scale} × {best} ≥ 0",
                "left": h,
                "right": b,
                "difference": h - scale * b,
                "ci95": ci,
                "state": state(ci, "≥ 0"),
            }
        )
    return out


def kl_vs_forgetting(summary: dict, runs: dict[str, dict[int, dict]], resamples: int, seed: int = 0) -> dict:
    """RL's Razor at this scale: one point per run and stage k ≥ 2, x = the forward KL from the previous stage's
    policy on stage k's prompts (nats per token and per response), y = the forgetting stage k caused
    (`measure.metrics.stage_forgetting`, with its one-run bootstrap interval). The least-squares fit and its R², pooled
    and per stage; the R²'s interval from a bootstrap over runs (each run's points together)."""
    points = []
    for m, by_seed in runs.items():
        for s, run in by_seed.items():
            for k, kl in enumerate(run["stage_kl"], start=1):
                if k < 2 or kl is None:
                    continue
                y = summary[m]["per_seed"][s][f"stage_forgetting {k}"]
                points.append(
                    {
                        "method": m,
                        "seed": s,
                        "stage": k,
                        "kl_token": kl["kl_token_mean"],
                        "kl_sequence": kl["kl_sequence_mean"],
                        "forgetting": y["value"],
                        "ci95": y["ci95"],
                    }
                )
    out: dict = {"points": points, "fits": {}}
    gen = torch.Generator().manual_seed(seed)
    for x_key in ("kl_token", "kl_sequence"):
        for stage in [None, *sorted({p["stage"] for p in points})]:
            chosen = [p for p in points if stage is None or p["stage"] == stage]
            name = f"{x_key}, " + ("all stages" if stage is None else f"stage {stage}")
            out["fits"][name] = fit_with_interval(chosen, x_key, resamples, gen)
    return out


def fit_with_interval(points: list[dict], x_key: str, resamples: int, gen: torch.Generator) -> dict | None:
    """linear_fit of forgetting on `x_key` and a percentile interval of its R² over runs resampled with
    replacement; None with fewer than 3 points or a constant x."""
    xs, ys = [p[x_key] for p in points], [p["forgetting"] for p in points]
    if len(points) < 3 or len(set(xs)) < 2:
        return None
    fit = linear_fit(xs, ys)
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(points):
        groups.setdefault((p["method"], p["seed"]), []).append(i)
    keys, r2s = list(groups), []
    for _ in range(resamples):
        idx = [i for j in torch.randint(len(keys), (len(keys),), generator=gen).tolist() for i in groups[keys[j]]]
        bx = [xs[i] for i in idx]
        if len(set(bx)) < 2:
            continue
        r2 = linear_fit(bx, [ys[i] for i in idx])["r2"]
        if r2 is not None:
            r2s.append(r2)
    return {**fit, "r2_ci95": percentile(r2s), "runs": len(keys)}


def teacher_lift_table(runs: dict[str, dict[int, dict]]) -> list[dict]:
    """Per method with a self-teacher and stage: each seed's lift with its own interval (paired bootstrap over
    prompts, run/diagnostics.py) and n, the mean over seeds with a t-interval, the lift pooled over the seeds' prompts
    (`pooled_lift`), and whether it is positive: the pooled interval lies above 0 (`positive`; the premise the
    per-stage "specialises faster" checks require) and every seed's own interval does (`positive_every_seed`)."""
    rows = []
    for m, by_seed in runs.items():
        first = by_seed[min(by_seed)]
        for k in range(len(first["stages"]) - 1):
            lifts = {s: r["teacher_lift"][k] for s, r in by_seed.items() if r["teacher_lift"][k] is not None}
            if not lifts:
                continue
            values = [v["lift"] for v in lifts.values() if v["lift"] is not None]
            kinds = sorted({kind for v in lifts.values() for kind in v["by_context"]})
            rows.append(
                {
                    "method": m,
                    "stage": k + 1,
                    "domain": first["domains"][first["trained_columns"][k]],
                    "per_seed": {
                        s: {
                            key: v[key]
                            for key in (
                                "lift",
                                "lift_ci95",
                                "n",
                                "teacher_accuracy",
                                "student_accuracy",
                                "context_frac",
                            )
                        }
                        for s, v in lifts.items()
                    },
                    "contexts": kinds,
                    "mean": statistics.fmean(values) if values else None,
                    "ci95": None if t_interval(values) is None else list(t_interval(values)),
                    "positive_every_seed": bool(lifts)
                    and all(v["lift_ci95"] is not None and v["lift_ci95"][0] > 0 for v in lifts.values()),
                }
            )
            pooled = pooled_lift(list(lifts.values()))
            rows[-1].update(pooled=pooled, positive=pooled is not None and pooled["ci95"][0] > 0)
    return rows


def pooled_lift(per_seed: list[dict]) -> dict | None:
    """The lift over all seeds' prompts: the n-weighted mean of the seeds' lifts, with a normal interval from each
    seed's bootstrap standard error (its 95 % interval's width / 3.92), the seeds independent. None when a seed has
    no interval."""
    if not per_seed or any(v["lift"] is None or v["lift_ci95"] is None for v in per_seed):
        return None
    n = sum(v["n"] for v in per_seed)
    mean = sum(v["n"] * v["lift"] for v in per_seed) / n
    se = math.sqrt(sum((v["n"] / n * (v["lift_ci95"][1] - v["lift_ci95"][0]) / 3.92) ** 2 for v in per_seed))
    return {"lift": mean, "ci95": [mean - 1.96 * se, mean + 1.96 * se], "n": n}
