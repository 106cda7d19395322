"""The science benchmark's comparison with GRPO (pure: the summary and bootstrap draws of `analysis.py` in, numbers
out): the headline, each domain's peak, final accuracy and collapse flag, the general-ability delta on the retention
probes, whether every stage is learnable, and the points of the Pareto plot.

- Headline (`versus_reference`): is there a method with ACC ≥ GRPO's **and** forgetting ≤ GRPO's? Each difference
  method − GRPO is a paired two-level bootstrap interval (`resampling.difference`: the same seed and example draws
  for both, over the seeds both have; the point estimate is over the same seeds, `resampling.paired_means`), judged
  by `analysis.goal_state`: met when the interval lies on the goal's side of 0 (touching 0 counts), not met when
  strictly on the other side, undecided otherwise. The answer is "yes" when some method meets both,
  "no" when every method fails at least one, "undecided" otherwise. Plasticity and the general-ability delta are
  compared the same way (reported, not part of the question).
  Seed-level check, beside each verdict (`per_seed`, `seed_t95`): the difference on each shared seed (its own run's
  figure, method − reference) and the Student-t 95 % interval over those seeds. The two-level bootstrap resamples
  the seeds too, but with 3 seeds it has 10 distinct seed draws and its percentile interval is narrower than the
  seed-to-seed spread warrants (the bootstrap's variance is (s − 1)/s of the sample's, and no t quantile); the
  t-interval over seeds (t(2) = 4.30 at 3 seeds) is the conservative reading. A verdict both agree on is robust to
  that; one only the bootstrap reaches says where more seeds would decide.
- Collapse (`peak_final`): per run and domain, peak = the best accuracy over the rows (before training and after
  each stage), final = after the last stage; collapsed when final < 0.5 × peak (`collapsed`). Per method: the mean
  peak and final with their bootstrap intervals, how many seeds collapsed, and the flag on the means.
- General-ability delta (`general_delta`): as TRACE and SDFT report it, the accuracy on retention probes no stage
  trains, after the whole sequence minus before it (`probe_change d`, and `general_delta` their mean), with the
  bootstrap interval; paired against GRPO in the headline rows.
- Learnable stages (`learnable_stages`): a stage is learnable when the reference's gain on its own domain,
  a[k, c_k] − a[k−1, c_k], has an interval above 0 (issue 25: a stage where GRPO does not learn measures nothing).
- Pareto points (`pareto_points`): per method, x = plasticity, y = forgetting, each with its interval as error bars;
  the reference is marked.
"""

from __future__ import annotations

from analysis import goal_state
from resampling import Draws, difference, paired_means, percentile

from adaptercl.measure.stats import t_interval

COLLAPSE_RATIO = 0.5  # final < 0.5 × peak: issue 25's collapse flag
HEADLINE = (("acc", "≥ 0"), ("forgetting", "≤ 0"))  # the question: ACC no lower and forgetting no higher
ALSO = (("plasticity", "≥ 0"), ("general_delta", "≥ 0"))  # compared the same way, reported beside


def collapsed(peak: float, final: float, ratio: float = COLLAPSE_RATIO) -> bool:
    """The collapse flag: the final accuracy fell below `ratio` × the peak."""
    return final < ratio * peak


def paired(summary: dict, draws: Draws, method: str, reference: str, key: str, good: str) -> dict | None:
    """method − reference of a bootstrapped figure: the means over the seeds both have, the difference, its paired
    interval and goal state."""
    if any(summary[m]["figures"].get(key, {}).get("mean") is None for m in (method, reference)):
        return None
    left, right = paired_means(summary, draws, method, reference, key)
    if left is None or right is None:
        return None
    ci = percentile(difference(draws, method, reference, key))
    per_seed = {
        s: summary[method]["per_seed"][s][key]["value"] - summary[reference]["per_seed"][s][key]["value"]
        for s in draws.shared(method, reference)
    }
    seed_ci = t_interval(list(per_seed.values()))
    return {"left": left, "right": right, "difference": left - right, "ci95": ci, "goal": good,
            "state": goal_state(ci, good), "per_seed": per_seed,
            "seed_t95": None if seed_ci is None else list(seed_ci),
            "seed_state": "–" if seed_ci is None else goal_state(list(seed_ci), good)}  # fmt: skip


def versus_reference(summary: dict, draws: Draws, reference: str = "grpo") -> dict:
    """The headline (module docstring): per method, its paired differences with the reference and whether it meets
    both goals; the answer and the methods that meet both."""
    if reference not in summary:
        return {"reference": reference, "rows": [], "answer": "–", "meeting_both": []}
    rows = []
    for method in summary:
        if method in (reference, "base", "stage_skip", "joint"):  # the references (references.py) are not candidates
            continue
        row = {"method": method}
        for key, good in HEADLINE + ALSO:
            row[key] = paired(summary, draws, method, reference, key, good)
        states = [row[key]["state"] if row[key] else "–" for key, _ in HEADLINE]
        row["both"] = "met" if all(s == "met" for s in states) else "not met" if "not met" in states else "undecided"
        rows.append(row)
    meeting = [r["method"] for r in rows if r["both"] == "met"]
    if meeting:
        answer = "yes"
    elif rows and all(r["both"] == "not met" for r in rows):
        answer = "no"
    else:
        answer = "undecided" if rows else "–"
    return {"reference": reference, "rows": rows, "answer": answer, "meeting_both": meeting}


def peak_final(summary: dict, runs: dict[str, dict[int, dict]]) -> list[dict]:
    """Per method and domain (probes included): peak and final accuracy (mean over the seeds, bootstrap interval),
    the seeds whose own run collapsed, and the collapse flag on the means (module docstring)."""
    rows = []
    for method, s in summary.items():
        first = runs[method][min(runs[method])]
        last = len(first["accuracy"]) - 1
        for d, domain in enumerate(first["domains"]):
            per_seed = {}
            for seed, run in sorted(runs[method].items()):
                column = [row[d] for row in run["accuracy"]]
                per_seed[seed] = {"peak": max(column), "final": column[-1],
                                  "collapsed": collapsed(max(column), column[-1])}  # fmt: skip
            peak, final = s["figures"][f"peak {d}"], s["figures"][f"cell {last} {d}"]
            rows.append(
                {
                    "method": method,
                    "domain": domain,
                    "trained": d in first["trained_columns"],
                    "peak": peak,
                    "final": final,
                    "per_seed": per_seed,
                    "collapsed_seeds": sum(v["collapsed"] for v in per_seed.values()),
                    "seeds": len(per_seed),
                    "collapsed_mean": collapsed(peak["mean"], final["mean"]),
                }
            )
    return rows


def general_delta(summary: dict, runs: dict[str, dict[int, dict]]) -> list[dict]:
    """Per method: each retention probe's change over the sequence and their mean, with bootstrap intervals
    (empty without probes)."""
    rows = []
    for method, s in summary.items():
        first = runs[method][min(runs[method])]
        probes = [d for d in range(len(first["domains"])) if d not in first["trained_columns"]]
        if not probes:
            continue
        rows.append(
            {
                "method": method,
                "mean": s["figures"]["general_delta"],
                "probes": {first["domains"][d]: s["figures"][f"probe_change {d}"] for d in probes},
                "before": {first["domains"][d]: s["figures"][f"cell 0 {d}"] for d in probes},
            }
        )
    return rows


def learnable_stages(summary: dict, runs: dict[str, dict[int, dict]], reference: str = "grpo") -> list[dict]:
    """Per stage: the reference's gain on the stage's own domain with its interval, and whether the interval lies
    above 0 (the stage is learnable)."""
    if reference not in summary:
        return []
    first = runs[reference][min(runs[reference])]
    rows = []
    for k, column in enumerate(first["trained_columns"], start=1):
        gain = summary[reference]["figures"][f"gain {k}"]
        rows.append({"stage": k, "domain": first["domains"][column], "gain": gain,
                     "learnable": gain["ci95"] is not None and gain["ci95"][0] > 0})  # fmt: skip
    return rows


def pareto_points(summary: dict, reference: str = "grpo") -> list[dict]:
    """Per method: (plasticity, forgetting) with their intervals as asymmetric error bars; the reference marked."""
    points = []
    for method, s in summary.items():
        x, y = s["figures"]["plasticity"], s["figures"]["forgetting"]
        if x["mean"] is None or y["mean"] is None:
            continue

        def bars(cell: dict) -> list[float]:
            return (
                [0.0, 0.0]
                if cell["ci95"] is None
                else [cell["mean"] - cell["ci95"][0], cell["ci95"][1] - cell["mean"]]
            )

        points.append({"method": method, "x": x["mean"], "x_err": bars(x), "y": y["mean"], "y_err": bars(y),
                       "reference": method == reference, "seeds": len(s["seeds"])})  # fmt: skip
    return points
