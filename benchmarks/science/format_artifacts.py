"""The formatting-artifact diagnostic over seeds (issue 37, the "Denser ≠ Better" paper's high-frequency formatting
artifacts): per method and stage, each run's `measure.artifacts.formatting_artifacts` of the stage's greedy eval
responses on its own domain against the base's (collect.py keeps it per run, `artifacts`), summarised over the seeds.

Per row: the mean over seeds of the rate (the share of the responses' n-gram positions holding one of the stage's
top-k n-grams), the base's rate of the same n-grams, and their ratio with a Student-t interval over the seeds; the
ratio minus the reference's (GRPO's) on the same stage, paired over the seeds both have (a t-interval of the per-seed
differences): does a method amplify its favourite phrasing more than GRPO does? And the n-grams most often among the
seeds' most frequent ones. Descriptive with 3 seeds (t with 2 degrees of freedom).
"""

from __future__ import annotations

import statistics
from collections import Counter

from adaptercl.measure.stats import t_interval

NGRAMS_SHOWN = 3


def artifact_table(runs: dict[str, dict[int, dict]], reference: str = "grpo") -> list[dict]:
    """One row per method and stage whose runs kept their eval completions (module docstring)."""
    rows = []
    for method, by_seed in runs.items():
        first = by_seed[min(by_seed)]
        for k in range(len(first["stages"]) - 1):
            found = {s: a for s, r in by_seed.items() if (a := _stage(r, k))}
            if not found:
                continue
            ratios = {s: a["ratio"] for s, a in found.items() if a["ratio"] is not None}
            row = {
                "method": method,
                "stage": k + 1,
                "domain": next(iter(found.values()))["domain"],
                "seeds": len(found),
                "rate": _mean([a["rate"] for a in found.values()]),
                "base_rate": _mean([a["base_rate"] for a in found.values()]),
                "ratio": _with_t(list(ratios.values())),
                "versus_reference": None,
                "ngrams": _common_ngrams(list(found.values())),
            }
            if method != reference and reference in runs:
                theirs = {s: _stage(r, k) for s, r in runs[reference].items()}
                diffs = [
                    ratios[s] - theirs[s]["ratio"] for s in sorted(ratios) if theirs.get(s) and theirs[s]["ratio"]
                ]
                row["versus_reference"] = _with_t(diffs)
            rows.append(row)
    return rows


def _stage(run: dict, k: int) -> dict | None:
    """Stage k's (0-based) artifacts of a run record, None where it has none (a run older than the diagnostic)."""
    found = run.get("artifacts") or []
    return found[k] if k < len(found) else None


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def _with_t(values: list[float]) -> dict | None:
    """Mean with its t-interval over `values` (None for none; no interval for one)."""
    if not values:
        return None
    ci = t_interval(values)
    return {"mean": statistics.fmean(values), "ci95": None if ci is None else list(ci), "n": len(values)}


def _common_ngrams(found: list[dict]) -> list[dict]:
    """The n-grams most often among the runs' kept most frequent ones (ties: the higher mean rate), with the mean over
    those runs of their rate and base rate."""
    seen: Counter = Counter()
    rates: dict[str, list[tuple[float, float | None]]] = {}
    for a in found:
        for t in a["top"]:
            seen[t["ngram"]] += 1
            rates.setdefault(t["ngram"], []).append((t["rate"], t["base_rate"]))
    order = sorted(seen, key=lambda g: (-seen[g], -statistics.fmean(r for r, _ in rates[g]), g))
    return [
        {
            "ngram": g,
            "runs": seen[g],
            "rate": statistics.fmean(r for r, _ in rates[g]),
            "base_rate": _mean([b for _, b in rates[g]]),
        }  # fmt: skip
        for g in order[:NGRAMS_SHOWN]
    ]


def artifacts_md(rows: list[dict], reference: str = "grpo") -> list[str]:
    """The table of `artifact_table` for results.md (nothing when no run kept its completions)."""
    if not rows:
        return []

    def num(value: float | None, digits: int = 3) -> str:
        return "–" if value is None else f"{value:.{digits}f}"

    def cell(value: dict | None) -> str:
        if value is None:
            return "–"
        ci = "" if value["ci95"] is None else f" [{value['ci95'][0]:.2f}, {value['ci95'][1]:.2f}]"
        return f"{value['mean']:.2f}{ci}"

    out = [
        "## Formatting artifacts (each stage's eval responses on its own domain, against the base's)",
        "",
        "Per run (adaptercl/measure/artifacts.py): the top 10 most frequent word/punctuation n-grams (n = 2, 3, 4) of "
        "the stage's greedy eval responses on its own domain; rate = the share of the responses' n-gram positions "
        "holding one of them, base rate = the same n-grams' share in the base model's responses to the same prompts, "
        f"ratio = rate / base rate (1: no change). Mean over seeds with a t-interval; ratio − {reference}'s: paired "
        "over the seeds both have. n-grams: the most frequent, most often among the seeds' top 5 (runs, rate / base "
        "rate). Descriptive.",
        "",
        f"| method | stage (domain) | seeds | rate | base rate | ratio [95 %] | ratio − {reference} [95 %] "
        "| n-grams |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        grams = ", ".join(
            f"`{g['ngram'].replace('|', '/')}` ({g['runs']}: {num(g['rate'])} / {num(g['base_rate'])})"
            for g in r["ngrams"]
        )
        out.append(
            f"| {r['method']} | {r['stage']} ({r['domain']}) | {r['seeds']} | {num(r['rate'])} | "
            f"{num(r['base_rate'])} | {cell(r['ratio'])} | {cell(r['versus_reference'])} | {grams} |"
        )
    return out + [""]
