"""Science benchmark: the continual trade-off of GRPO, SDPO, SDFT and the hybrid on SmolLM2-135M-Instruct over three
built-in domains (arithmetic -> mcq -> toolcall), the same budget per method, several seeds, with intervals.

One command runs every method and seed that is not finished yet and collects everything into results.json,
results.md and results.png beside this file:

    env OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/science/run.py --runs /work/science-runs --jobs 2
    python benchmarks/science/run.py --runs /work/science-runs --collect-only     # rebuild the results only

Each method/seed is `base.yaml` with the method's blocks (METHODS) merged over it, run as its own
`adaptercl recipe run` process (peak memory and crashes stay separate; a finished run returns at once, an
interrupted one resumes). The modules beside this one: `collect.py` reads a run directory, `analysis.py` takes the
statistics (intervals over examples and seeds, KL against forgetting, the paper's directions, the hybrid's goal),
`results.py` writes the tables and the figure. `--set KEY=VALUE` overrides base.yaml (dotted keys, YAML values),
for a smoke test: `--set optim.steps=2 eval.examples_per_domain=8 --out /tmp/science-smoke`.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/, for the shared provenance.py
sys.path.insert(0, str(HERE))

from provenance import git_revision  # noqa: E402

from adaptercl.atomic import write_json  # noqa: E402

# The methods: each a block merged over base.yaml (the method name goes to every stage). The self-teacher methods
# run the teacher's forward in bf16 where the CPU has bf16 matrix instructions (`autocast: auto`, as the shipped CPU
# recipes); the student and the evaluation stay float32.
AUTOCAST = {"teacher": {"autocast": "auto"}}
METHODS: dict[str, dict] = {
    # GRPO as the toolkit's defaults (Dr.GRPO advantages, clip 0.2 / 0.28, token mean)
    "grpo": {"method": "grpo"},
    # SDPO with the reference defaults (methods.py): EMA teacher τ 0.05, JSD α 0.5, student's top-100 + tail,
    # shown a successful sibling or format feedback; the per-sequence mean over every sample (no target = 0)
    "sdpo": {"method": "sdpo", "distill": AUTOCAST},
    # SDPO's sparse variant: the sampled token only (needs α 1, reverse KL); otherwise as sdpo
    "sdpo_sampled": {"method": "sdpo", "distill": {"support": "sampled", "alpha": 1.0, **AUTOCAST}},
    # SDFT with the reference defaults: one sample per prompt, teacher shown the example's demonstration, EMA τ
    # 0.01, forward KL over the full vocabulary, first 3 tokens skipped. 24 prompts x 1 sample per step: the same
    # 24 sequences per step as the others' 4 x 6.
    "sdft": {
        "method": "sdft",
        "distill": AUTOCAST,
        "rollout": {"group_size": 1},
        "optim": {"prompts_per_step": 24},
    },
    # The hybrid as shipped (recipes/hybrid-cpu.yaml): GRPO + 0.1 x sampled-token reverse KL to the stage-start
    # policy on failed groups only (shown the demonstration or format feedback), L2 0.01 to the stage-start ΔW,
    # 1 of the 4 prompts per step replayed from earlier domains from stage 2 on
    "hybrid": {
        "method": "hybrid",
        "distill": {"support": "sampled", "alpha": 1.0, "teacher": {"kind": "stage_start", "autocast": "auto"}},
        "hybrid": {"distill_weight": 0.1, "distill_on": "failed_groups"},
        "regularizers": {"l2_prev": 0.01, "replay_fraction": 0.25},
    },
}
SDPO_VARIANTS = ("sdpo", "sdpo_sampled")  # the hybrid's gain is held against the best of these


def merge(base: dict, update: dict) -> dict:
    """`base` with `update` merged in, nested dicts key by key (neither is modified)."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def apply_overrides(recipe: dict, overrides: list[str]) -> dict:
    """`KEY=VALUE` overrides (dotted keys into nested dicts, YAML values) applied to a copy of `recipe`."""
    out = copy.deepcopy(recipe)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE, e.g. optim.steps=2")
        *path, last = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[last] = yaml.safe_load(value)
    return out


def method_recipe(method: str, seed: int, runs: Path, overrides: list[str] = ()) -> dict:
    """base.yaml (with `overrides`) and `method`'s blocks: the method on every stage, its blocks at recipe level."""
    recipe = apply_overrides(yaml.safe_load((HERE / "base.yaml").read_text()), list(overrides))
    spec = dict(METHODS[method])
    name = spec.pop("method")
    for stage in recipe["stages"]:
        stage["method"] = name
    recipe = merge(recipe, spec)
    recipe["seed"] = seed
    recipe["output_dir"] = str(runs / f"{method}-s{seed}")
    return recipe


def run_one(method: str, seed: int, runs: Path, overrides: list[str]) -> None:
    """Run one method/seed as a subprocess (a finished run returns at once: adaptercl resumes it).

    Writes `<method>-s<seed>.run.json` beside the run: the git revision it ran at (taken before it starts), the
    command, the load average at its start, its exit code and wall time; the collection reports them per run.
    """
    recipe = method_recipe(method, seed, runs, overrides)
    Path(recipe["output_dir"]).mkdir(parents=True, exist_ok=True)
    recipe_path = runs / f"{method}-s{seed}.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    record_path = runs / f"{method}-s{seed}.run.json"
    if (Path(recipe["output_dir"]) / "summary.json").is_file() and record_path.is_file():
        print(f"{method} seed {seed}: finished earlier", flush=True)
        return
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "adaptercl.cli", "recipe", "run", str(recipe_path)]
    record = {
        "git": git_revision(short=True),
        "command": f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} nice={os.nice(0)} " + " ".join(cmd),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    t0 = time.perf_counter()
    with open(runs / f"{method}-s{seed}.log", "a") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    wall = time.perf_counter() - t0
    write_json(record_path, {**record, "exit": rc, "wall_s": round(wall, 1)})
    print(f"{method} seed {seed}: exit {rc}, {wall / 60:.1f} min", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "science", help="where the run dirs go")
    parser.add_argument("--out", type=Path, default=HERE, help="where results.json/.md/.png go")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each with OMP_NUM_THREADS=1)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="base.yaml overrides")
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples of the intervals")
    parser.add_argument("--collect-only", action="store_true", help="only collect the finished runs")
    args = parser.parse_args()
    args.runs.mkdir(parents=True, exist_ok=True)
    jobs = [(m, s) for s in args.seeds for m in args.methods]
    if not args.collect_only:
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(lambda job: run_one(*job, args.runs, args.set), jobs))

    from collect import collect_runs
    from results import write_results

    runs, missing = collect_runs(args.runs, args.methods, args.seeds)
    for name in missing:
        print(f"{name}: not finished (no summary.json; see {args.runs}/{name}.log)")
    if not runs:
        raise SystemExit(f"no finished run under {args.runs}")
    setting = {"base": str((HERE / "base.yaml").relative_to(ROOT)), "overrides": args.set, "runs_dir": str(args.runs)}
    write_results(runs, args.out, setting, METHODS, SDPO_VARIANTS, args.resamples)
    print((args.out / "results.md").read_text())
    print(json.dumps({"results": str(args.out)}))


if __name__ == "__main__":
    main()
