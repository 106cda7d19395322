"""What each method's training saw, stage by stage: the evidence for *why* a method does or does not learn a stage.

Issue 25 asks, where no method beats GRPO, for the component that fails, shown by the teacher lift per domain and
the SRPO route share over steps, not by a retuned number. The teacher lift is `analysis.teacher_lift_table`; this
module reads the per-step training log (each stage's metrics.jsonl, `collect.collect_run` keeps the traces of
`SIGNALS`) and summarises each trace over the stage's first and last third of steps, mean over seeds (a step
without the key, e.g. an SRPO step without an SDPO row lacks the teacher statistics, does not count), and for the
teacher's refreshes the count per stage. Descriptive: no interval (the figures are training-batch shares, not eval
accuracies; the seeds' spread is in results.json, `signals` per run).
"""

from __future__ import annotations

import math
import statistics

SIGNALS = {  # metrics.jsonl key -> what it measures (every one a per-step share, but the refresh flag)
    "reward_mean": "training reward",
    "correct_frac": "rollouts judged correct",
    "sdpo_route_frac": "SRPO: rollouts routed to the SDPO term (wrong, with a correct sibling)",
    "all_wrong_group_frac": "groups with no correct rollout (GRPO has no signal there; SRPO routes them to GRPO)",
    "distill_token_frac": "response tokens the distillation term acts on",
    "teacher_refresh": "teacher refreshes (gated, restart_freeze: 1 at a copy)",
}
COUNTED = ("teacher_refresh",)  # summed over the stage's steps, not averaged over a third


def stage_traces(steps: list[dict]) -> dict[str, list[float | None]]:
    """The per-step values [steps] of every `SIGNALS` key that some step of the stage logged (None where a step did
    not); `steps`: the stage's metrics.jsonl lines without its guard events."""
    keys = [k for k in SIGNALS if any(k in r for r in steps)]
    return {k: [r.get(k) for r in steps] for k in keys}


def thirds(trace: list[float | None]) -> tuple[float | None, float | None]:
    """Mean of the first and of the last third of a trace's steps (ceil(steps / 3) each), over the steps that have
    a value; None for a third without one."""
    size = max(1, math.ceil(len(trace) / 3))
    return _mean(trace[:size]), _mean(trace[-size:])


def signal_table(runs: dict[str, dict[int, dict]]) -> list[dict]:
    """One row per method and stage: for each signal its (first third, last third) means over the seeds, or the
    mean count per seed for `COUNTED` signals."""
    rows = []
    for method, by_seed in runs.items():
        first = next(iter(by_seed.values()))
        for k, stage in enumerate(first["stages"][1:]):
            row: dict = {"method": method, "stage": stage.split("-", 2)[-1], "seeds": len(by_seed), "signals": {}}
            for key in SIGNALS:
                traces = [r["signals"][k][key] for r in by_seed.values() if key in r["signals"][k]]
                if not traces:
                    continue
                if key in COUNTED:
                    row["signals"][key] = statistics.fmean(sum(v or 0.0 for v in t) for t in traces)
                    continue
                firsts, lasts = zip(*(thirds(t) for t in traces))
                row["signals"][key] = [_mean(firsts), _mean(lasts)]
            rows.append(row)
    return rows


def _mean(values: list[float | None] | tuple[float | None, ...]) -> float | None:
    """The mean of the values that are not None; None when none is."""
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def signals_md(rows: list[dict]) -> list[str]:
    """The table of `signal_table` for results.md."""
    keys = [k for k in SIGNALS if any(k in r["signals"] for r in rows)]
    out = [
        "## Training signals per stage (the training log: first third → last third of the stage's steps)",
        "",
        "Mean over seeds of each third's mean (refreshes: count per stage). "
        + "; ".join(f"{k}: {SIGNALS[k]}" for k in keys)
        + ". Shares of the training batches, descriptive (no interval).",
        "",
        "| method | stage | " + " | ".join(keys) + " |",
        "|---|---|" + "---|" * len(keys),
    ]
    for r in rows:
        cells = []
        for k in keys:
            value = r["signals"].get(k)
            if value is None:
                cells.append("–")
            elif k in COUNTED:
                cells.append(f"{value:.1f}")
            else:
                cells.append(" → ".join("–" if v is None else f"{v:.2f}" for v in value))
        out.append(f"| {r['method']} | {r['stage']} | " + " | ".join(cells) + " |")
    return out + [""]
