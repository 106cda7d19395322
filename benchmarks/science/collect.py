"""Reading the science benchmark's run directories: one JSON-ready record per finished run (method, seed).

What a record holds, and where from (layout: adaptercl/run_dir/layout.py):
- correct[k][d]: each eval example's greedy correctness on domain d after stage k (row 0 before training), from the
  stages' eval.json `correct`; accuracy[k][d] its mean, n[d] the examples. The intervals over examples start here.
- stage_kl[k−1]: drift.json `stage_kl` of stage k (forward KL from the previous stage's policy on stage k's train
  prompts), None where it was off.
- teacher_lift[k−1]: stage k's teacher_lift.json (None for a method without a self-teacher).
- signals[k−1]: stage k's per-step training traces of `signals.SIGNALS` (reward, route shares, refreshes).
- lift_gate[k−1]: stage k's lift gate, each step's open flag and each check's evidence (`gate.stage_gate`; None for a
  stage without a gate).
- artifacts[k−1]: stage k's formatting artifacts on its own domain against the base (`measure.artifacts`, from the
  eval.json `completions`; None for a run older than them), its `top` cut to `TOP_KEPT` n-grams.
- the final stage's parameter and response drift, the collapse guard's events, the largest in-stage reward drop,
  training minutes, and the run's provenance (`<run>.run.json`, written by run.py: revision, command, wall time).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from gate import stage_gate
from signals import stage_traces

from adaptercl.measure.artifacts import stage_artifacts

TOP_KEPT = 5  # n-grams of each stage's artifact diagnostic kept in the record (the most frequent first)


def collect_runs(
    runs_dir: Path, methods: list[str], seeds: list[int] | dict[str, list[int]]
) -> tuple[list[dict], list[str]]:
    """The records of the finished runs `<method>-s<seed>` under `runs_dir`, and the names of those not finished.
    `seeds`: every method's, or each method's own."""
    records, missing = [], []
    for method in methods:
        for seed in seeds[method] if isinstance(seeds, dict) else seeds:
            record = collect_run(runs_dir / f"{method}-s{seed}", method, seed)
            if record is None:
                missing.append(f"{method}-s{seed}")
            else:
                records.append(record)
    return records, missing


def collect_run(run_dir: Path, method: str, seed: int) -> dict | None:
    """The record of one finished run (see the module docstring), or None when it has no summary.json."""
    if not (run_dir / "summary.json").is_file():
        return None
    summary = json.loads((run_dir / "summary.json").read_text())
    domains, stage_dirs = summary["domains"], summary["stages"]
    rows = [json.loads((run_dir / stage / "eval.json").read_text()) for stage in stage_dirs]
    missing = [stage for stage, row in zip(stage_dirs, rows) if any("correct" not in row[d] for d in domains)]
    if missing:
        raise SystemExit(f"{run_dir}: eval.json of {missing[0]} has no per-example `correct` (a run older than it)")
    stage_kl, lift, events, drops, signals, gates, train_seconds = [], [], [], [], [], [], 0.0
    for stage in stage_dirs[1:]:
        drift = json.loads((run_dir / stage / "drift.json").read_text())
        stage_kl.append(drift.get("stage_kl"))
        lift_path = run_dir / stage / "teacher_lift.json"
        lift.append(json.loads(lift_path.read_text()) if lift_path.is_file() else None)
        lines = (run_dir / stage / "metrics.jsonl").read_text().splitlines()
        metrics = [json.loads(line) for line in lines if line]
        events += [f"{stage} step {r['step']}: {r['event']} ({r['action']})" for r in metrics if "event" in r]
        steps = [r for r in metrics if "event" not in r]  # guard events (lines with `event`) are not steps
        drops.append(reward_drop([r["reward_mean"] for r in steps]))
        signals.append(stage_traces(steps))
        gates.append(stage_gate(steps))
        train_seconds += json.loads((run_dir / stage / "done.json").read_text())["train_seconds"]
    parameter = drift.get("parameter", {}).get("aggregate", {})  # the final stage's drift vs the base
    response = drift.get("response", {})
    record_path = run_dir.with_name(run_dir.name + ".run.json")
    provenance = json.loads(record_path.read_text()) if record_path.is_file() else {}

    def response_mean(key: str) -> float | None:
        return statistics.fmean(d[key] for d in response.values()) if response else None

    artifacts = stage_artifacts(rows, domains, summary["cl_metrics"]["trained_columns"])
    return {
        "method": method,
        "seed": seed,
        "run": run_dir.name,
        "domains": domains,
        "stages": stage_dirs,
        "trained_columns": summary["cl_metrics"]["trained_columns"],
        "correct": [[[bool(c) for c in row[d]["correct"]] for d in domains] for row in rows],  # [K+1][D][n]
        "accuracy": [[row[d]["accuracy"] for d in domains] for row in rows],  # [K+1][D]
        "n": [rows[0][d]["n"] for d in domains],
        "stage_kl": stage_kl,
        "teacher_lift": lift,
        "parameter_drift": parameter.get("relative_delta_norm_mean"),
        "response_kl_to_base": response_mean("kl_to_base"),
        "foreign_format_rate": response_mean("foreign_format_rate"),
        "guard_events": events,
        "reward_drop": max(drops),
        "signals": signals,  # [K][key] -> per-step values (signals.SIGNALS)
        "lift_gate": gates,  # [K] gate.stage_gate: open flags per step, checks (None: no gate)
        "artifacts": [None if a is None else {**a, "top": a["top"][:TOP_KEPT]} for a in artifacts],  # [K]
        "train_minutes": train_seconds / 60,
        "provenance": provenance,  # git, command, started_at, load_average_at_start, exit, wall_s
    }


def reward_drop(rewards: list[float], window: int = 5) -> float:
    """Instability of a stage: its best sliding-window mean training reward minus its last window's mean."""
    if not rewards:
        return 0.0
    means = [statistics.fmean(rewards[i : i + window]) for i in range(max(1, len(rewards) - window + 1))]
    return max(means) - means[-1]
