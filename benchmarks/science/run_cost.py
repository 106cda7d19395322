"""What a science run costs now against before issue 43's cheaper evaluation, measured side by side on one machine:
GRPO seed 0 on calc_hash → calc_says, the same run in both (base.yaml's budget, the four retention probes).

- old: the forgetting collection's `grpo-s0` at revision 89404e5 (before issue 43: probes scored by generation, row 0
  evaluated by every run, diagnostics on 4 probes per domain and 32 prompts), from a worktree of that revision;
- new: the frontier collection's `grpo-s0` at this revision (probes by log-likelihood, the cheaper diagnostics), which
  evaluates the seed's row 0 itself, as the first run of a seed does;
- new, row 0 shared: the same recipe taking that row 0 (`eval.before_from`), as every other run of the seed does.

Phase 1 runs old and new side by side (two processes, one thread each, as the sweep runs at `--jobs 2`); phase 2 runs
the row-0-sharing run beside another run of the same seed (the sweep's `hybrid-s0`, real work), so every timed run
had one neighbour. Written to run_cost.json: each run's wall time and the load beside it, `ratio_own_row0` = new /
old, `ratio_shared_row0` = shared / old, and `ratio` = the cost of a run in the sweep, (new + (k − 1) × shared) / k
over old, k the runs that share one seed's row 0 in the frontier collection (row 0 is evaluated once a seed).

    env OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/science/run_cost.py --scratch ../run-cost \
        --runs runs/science-frontier          # the sweep's runs folder: its grpo-s0 and hybrid-s0 are kept
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from provenance import git_revision, machine, versions  # noqa: E402
from sweeps import COLLECTIONS  # noqa: E402

from adaptercl.system.atomic import write_json  # noqa: E402

OLD_REVISION = "89404e5"  # the last revision before issue 43 (the forgetting collection's code)


def timed(commands: list[tuple[str, list[str], dict, Path]]) -> dict[str, dict]:
    """Start every (name, argv, env, cwd) at once, wait for all; each one's wall time (to its own end, polled every
    0.5 s: waiting on them in turn gave a run that ended first the wall time of the one waited on before it), exit
    code and the load average when it started and ended."""
    started = {}
    for name, argv, env, cwd in commands:
        log = open(Path(env["RUN_COST_LOGS"]) / f"{name}.log", "w")
        started[name] = (subprocess.Popen(argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT),
                         time.perf_counter(), os.getloadavg())  # fmt: skip
    out: dict[str, dict] = {}
    while len(out) < len(started):  # each one's wall time taken when it ends, whichever ends first
        for name, (proc, t0, load) in started.items():
            if name in out or proc.poll() is None:
                continue
            out[name] = {"wall_s": round(time.perf_counter() - t0, 1), "exit": proc.returncode,
                         "load_at_start": [round(x, 2) for x in load],
                         "load_at_end": [round(x, 2) for x in os.getloadavg()]}  # fmt: skip
            if proc.returncode != 0:
                raise SystemExit(f"{name} failed (exit {proc.returncode}); see its log")
        time.sleep(0.5)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scratch", type=Path, required=True, help="for the old worktree and the throwaway runs")
    parser.add_argument("--runs", type=Path, default=ROOT / COLLECTIONS["frontier"].runs, help="the sweep's runs")
    args = parser.parse_args()
    scratch, runs = args.scratch.resolve(), args.runs.resolve()
    (scratch / "logs").mkdir(parents=True, exist_ok=True)
    old_tree = scratch / "old-tree"
    if not old_tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(old_tree), OLD_REVISION], cwd=ROOT, check=True)
    data = str((ROOT.parent / "shared" / "data").resolve())
    base_env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "RUN_COST_LOGS": str(scratch / "logs")}
    py = sys.executable
    old = (
        "old",
        [py, "benchmarks/science/run.py", "--collection", "forgetting", "--methods", "grpo", "--seeds", "0",
         "--runs", str(scratch / "old-runs"), "--data", data, "--resamples", "10"],
        {**base_env, "PYTHONPATH": str(old_tree)}, old_tree,
    )  # fmt: skip
    new = (
        "new",
        [py, "benchmarks/science/run.py", "--collection", "frontier", "--methods", "grpo", "--seeds", "0",
         "--runs", str(runs), "--resamples", "10", "--out", str(scratch / "new-out")],
        {**base_env, "PYTHONPATH": str(ROOT)}, ROOT,
    )  # fmt: skip
    phase1 = timed([old, new])
    recipe = yaml.safe_load((runs / "grpo-s0.yaml").read_text())
    recipe["output_dir"] = str(scratch / "shared-grpo-s0")
    recipe["eval"]["before_from"] = str(runs / "grpo-s0")
    (scratch / "shared-grpo-s0.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    shared = ("shared", [py, "-m", "adaptercl.cli", "recipe", "run", str(scratch / "shared-grpo-s0.yaml")],
              {**base_env, "PYTHONPATH": str(ROOT)}, ROOT)  # fmt: skip
    neighbour = (
        "neighbour_hybrid",
        [py, "benchmarks/science/run.py", "--collection", "frontier", "--methods", "grpo", "hybrid", "--seeds", "0",
         "--runs", str(runs), "--resamples", "10", "--out", str(scratch / "new-out")],
        {**base_env, "PYTHONPATH": str(ROOT)}, ROOT,
    )  # fmt: skip
    phase2 = timed([shared, neighbour])
    k = sum(0 in seeds for seeds in COLLECTIONS["frontier"].seeds.values())  # runs sharing seed 0's row 0
    old_s, new_s, shared_s = phase1["old"]["wall_s"], phase1["new"]["wall_s"], phase2["shared"]["wall_s"]
    result = {
        "what": "GRPO seed 0 on calc_hash -> calc_says with the four retention probes, old (89404e5) against new "
        "(this revision), side by side; wall times of whole runs (run.py launches one adaptercl process each)",
        "old_revision": OLD_REVISION,
        "new_revision": git_revision(short=True),
        "runs_per_seed_sharing_row0": k,
        "wall_s": {"old": old_s, "new_own_row0": new_s, "new_shared_row0": shared_s},
        "ratio_own_row0": round(new_s / old_s, 3),
        "ratio_shared_row0": round(shared_s / old_s, 3),
        "ratio": round((new_s + (k - 1) * shared_s) / k / old_s, 3),
        "phases": {"1 (old beside new)": phase1, "2 (shared beside the sweep's hybrid-s0)": phase2},
        "seconds_by_part": {
            name: parts(path)
            for name, path in (
                ("old", scratch / "old-runs" / "grpo-s0"),
                ("new_own_row0", runs / "grpo-s0"),
                ("new_shared_row0", scratch / "shared-grpo-s0"),
            )
        },  # fmt: skip
        "command": "env OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/science/run_cost.py --scratch "
        "<scratch> --runs <runs>",
        "machine": machine(),
        "versions": versions(with_git_revision=False),
    }
    write_json(HERE / "run_cost.json", result)
    print(json.dumps({k: result[k] for k in ("wall_s", "ratio_own_row0", "ratio_shared_row0", "ratio")}, indent=1))


def parts(run: Path) -> dict[str, dict]:
    """Each stage's recorded wall time per part (done.json `seconds`): where a run's time goes."""
    out = {}
    for stage in sorted(p for p in run.glob("stage-*") if (p / "done.json").is_file()):
        out[stage.name] = json.loads((stage / "done.json").read_text()).get("seconds", {})
    return out


if __name__ == "__main__":
    main()
