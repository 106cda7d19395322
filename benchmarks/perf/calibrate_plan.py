"""The rehearsal-calibrated plan against the real run on the same machine (issue 36): rehearse a recipe, ask the plan
for its wall time from that rehearsal, then run the recipe for real and compare.

    python benchmarks/perf/calibrate_plan.py recipes/quickstart.yaml                   # on a quiet machine
    python benchmarks/perf/calibrate_plan.py benchmarks/science/base.yaml --name science-grpo-seed0 seed=0

Each step is the user's command in a process of its own, timed from outside: `adaptercl recipe rehearse FILE
[key=value ...] --out <scratch>/rehearsal`, `adaptercl recipe plan FILE [key=value ...] --rehearsal
<scratch>/rehearsal/rehearsal.json` (its `wall time` line is kept; the predicted seconds are that estimate
unrounded, `plan.rehearsal.measured_wall_time`), then `adaptercl recipe run FILE [key=value ...]
output_dir=<scratch>/run`. The ratio is predicted / measured (the issue's target: 0.8 to 1.25). Beside the totals,
each part as predicted and as the run's records say (done.json `seconds` of every stage and of the evaluation before
training; `train` is the sum of the steps' `time_step_s`, so it holds rollouts and training steps, not checkpoints).
The run directory is deleted after unless `--keep`. Run it on a quiet machine: the start-up of each process and
every step slow down with whatever else runs.

writes benchmarks/perf/results/plan_calibration-<name>.json and .md (command, machine, versions, git revision).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for the shared provenance.py
sys.path.insert(0, str(Path(__file__).resolve().parent))

from perf_common import RESULTS_DIR  # noqa: E402
from provenance import markdown_table, provenance  # noqa: E402

TARGET = (0.8, 1.25)
# the run's done.json parts -> the plan's parts (plan/rehearsal.py PARTS) they are compared with
RUN_PARTS = {
    "train": ("rollout", "train"),
    "eval": ("eval",),
    "teacher_lift": ("teacher_lift",),
    "stage_kl": ("stage_kl",),
    "response_drift": ("response_drift",),
    "parameter_drift": ("parameter_drift",),
}


def adaptercl(*args: str) -> tuple[float, subprocess.CompletedProcess]:
    """(wall seconds, the finished process) of `adaptercl ARGS` in a process of its own."""
    command = [sys.executable, "-m", "adaptercl.cli", *args]
    t0 = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(
            f"calibrate_plan: `adaptercl {' '.join(args)}` exited {done.returncode}: {done.stderr[-2000:]}"
        )
    return seconds, done


def run_parts(run_dir: Path) -> dict[str, float]:
    """Each part's seconds as the run recorded them (every done.json's `seconds`, summed)."""
    out: dict[str, float] = {}
    for done in sorted(run_dir.glob("stage-*/done.json")):
        for part, seconds in json.loads(done.read_text()).get("seconds", {}).items():
            out[part] = out.get(part, 0.0) + seconds
    return out


def calibrate(recipe_file: str, overrides: list[str], scratch: Path) -> dict[str, Any]:
    from adaptercl.plan.rehearsal import measured_wall_time, read_rehearsal
    from adaptercl.recipe.load import load_recipe

    rehearsal_s, _ = adaptercl("recipe", "rehearse", recipe_file, *overrides, "--out", str(scratch / "rehearsal"))
    rehearsal_json = scratch / "rehearsal" / "rehearsal.json"
    _, plan = adaptercl("recipe", "plan", recipe_file, *overrides, "--rehearsal", str(rehearsal_json))
    wall_line = next(line for line in plan.stdout.splitlines() if line.startswith("wall time"))
    rehearsal = read_rehearsal(rehearsal_json)
    wall = measured_wall_time(load_recipe(recipe_file, overrides), rehearsal)
    run_dir = scratch / "run"
    measured_s, _ = adaptercl("recipe", "run", recipe_file, *overrides, f"output_dir={run_dir}")
    recorded = run_parts(run_dir)
    parts = {
        part: {"predicted_s": sum(t.seconds for t in wall.terms if t.part in ours), "run_s": recorded.get(part)}
        for part, ours in RUN_PARTS.items()
    }
    ratio = wall.total_s / measured_s
    return {
        "recipe": recipe_file,
        "overrides": overrides,
        "predicted_s": wall.total_s,
        "measured_s": measured_s,
        "ratio": ratio,
        "within_target": TARGET[0] <= ratio <= TARGET[1],
        "target": list(TARGET),
        "rehearsal_s": rehearsal_s,
        "plan_wall_time_line": wall_line,
        "plan_terms": [t.how for t in wall.terms],
        "parts": parts,
        "rehearsal": rehearsal,
    }


def markdown(name: str, result: dict[str, Any]) -> str:
    machine, versions = result["machine"], result["versions"]
    rows = [[part, p["predicted_s"], "-" if p["run_s"] is None else p["run_s"]] for part, p in result["parts"].items()]
    return (
        f"# Plan calibration: {name}\n\n"
        f"Command: `{result['command']}` at {versions.get('adaptercl_git', '?')}; {machine['cpu']}, "
        f"{machine['cpus_usable']} usable cores, load average at the start {machine['load_average_at_start']}, "
        f"GPU {machine['gpu']}; torch {versions.get('torch')}, transformers {versions.get('transformers')}.\n\n"
        + markdown_table(
            ["recipe", "predicted", "measured (recipe run)", "predicted / measured", "rehearsal took"],
            [
                [
                    result["recipe"] + "".join(f" {o}" for o in result["overrides"]),
                    f"{result['predicted_s']:.0f} s",
                    f"{result['measured_s']:.0f} s",
                    f"{result['ratio']:.2f}",
                    f"{result['rehearsal_s']:.0f} s",
                ]
            ],
        )  # fmt: skip
        + f"\n\nTarget {TARGET[0]}-{TARGET[1]}: {'within' if result['within_target'] else 'NOT within'}. "
        + f"The plan said: `{result['plan_wall_time_line']}`\n\nEach part (the run's done.json seconds):\n\n"
        + markdown_table(["part", "predicted s", "the run's s"], rows)
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", help="recipe file")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, as the commands take them")
    parser.add_argument("--name", help="result name (default: the recipe's stem)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    parser.add_argument("--keep", type=Path, help="keep the rehearsal and the run here instead of a temporary folder")
    args = parser.parse_args(argv)
    name = args.name or Path(args.recipe).stem
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    scratch = args.keep or Path(tempfile.mkdtemp(prefix="adaptercl-calibrate-"))
    try:
        result = {**provenance(), **calibrate(args.recipe, args.overrides, scratch)}
        if args.keep is not None:  # no path of this machine in a committed result
            result["command"] = result["command"].replace(str(args.keep), "<scratch>")
    finally:
        if args.keep is None:
            shutil.rmtree(scratch, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"plan_calibration-{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(name, result)
    (args.out / f"plan_calibration-{name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
