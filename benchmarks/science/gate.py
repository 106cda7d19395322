"""What the lift gate did in each stage of the gated methods (`distill.gate.kind: lift`): the component issue 37's
headline names for "does a lift-gated method reach GRPO's ACC where its ungated version fell below?".

A gated stage logs (adaptercl/train/lift_gate.py) `lift_gate_open` at every step (whether that step distilled) and,
at each check, the measurement that decided it: `lift_gate_n` (train prompts with a teacher context, the pairs),
`lift_gate_lift` with its paired 95 % interval `lift_gate_lift_lo`/`_hi` (absent when n = 0). This module keeps
both per stage (`stage_gate`, from the steps of the stage's metrics.jsonl) and summarises them per method and stage
over the seeds (`gate_table`): the share of the stage's steps that distilled (mean over seeds, and each seed's), the
checks that opened the gate of all checks, the pairs per check, and the checks' lifts. Descriptive: the open share is
a count of training steps, not an eval accuracy (no interval); each check's own interval is in results.json.
"""

from __future__ import annotations

import statistics


def stage_gate(steps: list[dict]) -> dict | None:
    """The gate's record of one stage: `open` [steps] (1.0 where the step distilled) and `checks` (one dict per check:
    its step, pairs n, lift and interval, None where n = 0, and whether it opened the gate); None for a stage
    without a gate (no step logs `lift_gate_open`). `steps`: the stage's metrics.jsonl lines without its guard
    events."""
    if not any("lift_gate_open" in r for r in steps):
        return None
    checks = [
        {
            "step": r["step"],
            "n": int(r["lift_gate_n"]),
            "lift": r.get("lift_gate_lift"),
            "ci95": [r["lift_gate_lift_lo"], r["lift_gate_lift_hi"]] if "lift_gate_lift_lo" in r else None,
            "opened": bool(r["lift_gate_open"]),
        }
        for r in steps
        if r.get("lift_gate_check")
    ]
    return {"open": [float(r.get("lift_gate_open", 0.0)) for r in steps], "checks": checks}


def gate_table(runs: dict[str, dict[int, dict]]) -> list[dict]:
    """One row per gated method and stage over its seeds: `open_share` (mean of the seeds' shares of steps that
    distilled) and `open_share_per_seed`, `checks` and `checks_opened` (counts over the seeds), `pairs` [min, max]
    per check, `lift_mean` (mean of the checks' lifts, over the checks with pairs) and `lift_range` [min, max]."""
    rows = []
    for method, by_seed in runs.items():
        first = next(iter(by_seed.values()))
        for k, stage in enumerate(first["stages"][1:]):
            gates = {seed: r["lift_gate"][k] for seed, r in by_seed.items() if r["lift_gate"][k]}
            if not gates:
                continue
            shares = {seed: statistics.fmean(g["open"]) for seed, g in gates.items()}
            checks = [c for g in gates.values() for c in g["checks"]]
            lifts = [c["lift"] for c in checks if c["lift"] is not None]
            rows.append(
                {
                    "method": method,
                    "stage": stage.split("-", 2)[-1],
                    "seeds": len(gates),
                    "open_share": statistics.fmean(shares.values()),
                    "open_share_per_seed": shares,
                    "checks": len(checks),
                    "checks_opened": sum(c["opened"] for c in checks),
                    "pairs": [min(c["n"] for c in checks), max(c["n"] for c in checks)] if checks else None,
                    "lift_mean": statistics.fmean(lifts) if lifts else None,
                    "lift_range": [min(lifts), max(lifts)] if lifts else None,
                }
            )
    return rows


def gate_md(rows: list[dict]) -> list[str]:
    """The table of `gate_table` for results.md (nothing when no method is gated)."""
    if not rows:
        return []
    out = [
        "## Lift gate per stage (the gated methods: when did they distil, and on what evidence?)",
        "",
        "distilling: the share of the stage's steps whose update distilled (the gate open), mean over seeds, then"
        " each seed's; checks: those that opened the gate, of all checks over the seeds (a check opens it when "
        "its pairs, train prompts with a teacher context, reach min_pairs and its rule holds: the default, the "
        "lower end of the paired 95 % interval of the lift above 0); pairs: fewest and most per check; lift: the "
        "checks' mean (and range) over the checks with pairs. Closed, the step's update is GRPO's on the same "
        "rollouts. Descriptive (a count of training steps); each check's own interval is in results.json.",
        "",
        "| method | stage | seeds | distilling | per seed | checks opened | pairs | lift (range) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per_seed = ", ".join(f"{share:.2f}" for _, share in sorted(r["open_share_per_seed"].items()))
        pairs = "–" if r["pairs"] is None else f"{r['pairs'][0]}–{r['pairs'][1]}"
        lift = "–"
        if r["lift_mean"] is not None:
            lift = f"{r['lift_mean']:+.2f} ({r['lift_range'][0]:+.2f}, {r['lift_range'][1]:+.2f})"
        out.append(
            f"| {r['method']} | {r['stage']} | {r['seeds']} | {r['open_share']:.2f} | {per_seed} | "
            f"{r['checks_opened']} of {r['checks']} | {pairs} | {lift} |"
        )
    return out + [""]
