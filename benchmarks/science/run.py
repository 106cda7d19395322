"""Science benchmark: the continual trade-off of GRPO, SDPO, SRPO, the hybrid and their continual variants on
SmolLM2-135M-Instruct over a sequence of built-in domains, the same budget per method, several seeds, with intervals,
and the general-ability delta on four retention probes (ARC, BoolQ, PIQA, Winogrande).

One command runs every method and seed of a collection (sweeps.COLLECTIONS: `issue25`, the default, arithmetic ->
mcq -> toolcall; `forgetting`, issue 37's, on the sequence its pilots chose) that is not finished yet and collects
everything into results.json, results.md, results.png and pareto.png in the collection's folder:

    env OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/science/run.py --runs ../science-runs --jobs 2
    python benchmarks/science/run.py --runs ../science-runs --collect-only     # rebuild the results only
    env OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/science/run.py --collection forgetting \
        --runs ../science-runs-forgetting --jobs 2                            # issue 37's, into forgetting/

Each method/seed is `base.yaml` (with the collection's sequence, sweeps.SEQUENCES, in place of its stages) with the
method's blocks (method_recipes.METHODS) merged over it and the retention probes (PROBES, files under `--data`,
default ../shared/data from the repo root) added, run as its own `adaptercl recipe run` process from the repo root
(peak memory and crashes stay separate; a finished run is skipped, an interrupted one resumes; a finished run whose
recipe differs from the one it would get now is refused, never mixed in). Every recipe is validated before the first
run starts. The modules beside this one: `method_recipes.py` the methods and each run's recipe, `sweeps.py` the
collections and sequences, `collect.py` reads a run directory, `resampling.py` the bootstrap, `analysis.py` takes the
statistics (intervals over examples and seeds, KL against forgetting, the paper's directions, the hybrid's goal),
`headline.py` the comparison with GRPO (the headline, peak/final/collapse, the general-ability delta, learnable
stages, the Pareto points), `results.py` writes the tables (`format_artifacts.py` the formatting-artifact table) and
`plots.py` the figures; `pilot.py` runs GRPO alone on candidate sequences (issue 37's pilots). Outputs name no path of
the machine: the runs folder is `<runs>`, the repo root `.`. `--set KEY=VALUE` overrides base.yaml (dotted keys, a
list's entry by its name, YAML values), for a smoke test: `--set optim.steps=2 stages.toolcall.optim.steps=2
eval.examples_per_domain=8 --out <scratch>/smoke`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/, for the shared provenance.py
sys.path.insert(0, str(HERE))

from ledger import load_records, restore_row0, save_records, save_row0  # noqa: E402
from method_recipes import (  # noqa: E402
    DEFAULT_DATA,
    METHODS,
    PROBES,
    REFERENCE,
    SDPO_VARIANTS,
    method_recipe,
    missing_probe_files,
)
from provenance import git_revision, machine  # noqa: E402
from sweeps import COLLECTIONS, DEFAULT_COLLECTION, SEQUENCES, interleaved_jobs, jobs  # noqa: E402

from adaptercl.recipe.grammar import RecipeError, resolve_recipe  # noqa: E402
from adaptercl.system.atomic import write_json  # noqa: E402


def run_one(
    method: str,
    seed: int,
    runs: Path,
    overrides: list[str],
    data: str | None = DEFAULT_DATA,
    sequence: str | None = None,
    row0_from: str | None = None,
) -> None:
    """Run one method/seed (`launch`); one that takes its row 0 from another run first waits for it."""
    recipe = method_recipe(method, seed, runs, overrides, data, sequence, row0_from)
    if recipe["eval"].get("before_from"):
        wait_for_row0(Path(recipe["eval"]["before_from"]))
    launch(f"{method}-s{seed}", recipe, runs)


def wait_for_row0(source: Path, poll_s: float = 5.0) -> None:
    """Until `source` (a run directory another job of the sweep is running) has its row 0 done; SystemExit naming
    it when that run ended without one."""
    record = source.with_name(source.name + ".run.json")
    while not (source / "stage-00-before" / "done.json").is_file():
        if record.is_file() and json.loads(record.read_text()).get("exit") not in (0, None):
            raise SystemExit(f"{source.name} ended without its row 0 (see {source.name}.log); its seed cannot run")
        time.sleep(poll_s)


def cpu_description() -> str:
    """The CPU's model and the vector/matrix extensions that change float32 results: what a run record names."""
    cpu = machine()
    if cpu["cpu"] == "unknown" and not cpu["cpu_flags"]:  # no /proc/cpuinfo
        return "unknown"
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in cpu["cpu_flags"]]  # of ISA_FLAGS
    return f"{cpu['cpu']} ({' '.join(shown)})"


CPU = cpu_description()


def launch(name: str, recipe: dict, runs: Path) -> None:
    """Run `recipe` as a subprocess from the repo root; a finished run is skipped (adaptercl would return at once),
    one finished with another recipe is refused (SystemExit naming it), an interrupted one resumes.

    Writes `<name>.yaml` (the recipe) and `<name>.run.json` beside the run: the git revision it ran at (taken before
    it starts), the command (machine paths replaced: `<runs>` for the runs folder), the load average at its start,
    its exit code and wall time; the collection reports them per run.
    """
    recipe_path = runs / f"{name}.yaml"
    record_path = runs / f"{name}.run.json"
    if (Path(recipe["output_dir"]) / "summary.json").is_file() and record_path.is_file():
        if recipe_path.is_file() and yaml.safe_load(recipe_path.read_text()) != recipe:
            raise SystemExit(
                f"{name}: finished earlier with a different recipe ({recipe_path.name}); collect it with the settings "
                "it ran with, or give this setting a new --runs folder"
            )
        print(f"{name}: finished earlier", flush=True)
        return
    Path(recipe["output_dir"]).mkdir(parents=True, exist_ok=True)
    recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "adaptercl.cli", "recipe", "run", str(recipe_path)]
    record = {
        "git": git_revision(short=True),
        "command": f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} nice={os.nice(0)} "
        f"python -m adaptercl.cli recipe run <runs>/{recipe_path.name}",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "cpu": CPU,  # runs of one collection may come from several machines (ledger.py): which one made this
    }
    t0 = time.perf_counter()
    with open(runs / f"{name}.log", "a") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    wall = time.perf_counter() - t0
    write_json(record_path, {**record, "exit": rc, "wall_s": round(wall, 1)})
    print(f"{name}: exit {rc}, {wall / 60:.1f} min", flush=True)


def preflight(
    methods: list[str],
    seeds: list[int] | dict[str, list[int]],
    runs: Path,
    overrides: list[str],
    data: str | None,
    sequence: str | None = None,
    row0_from: str | None = None,
) -> None:
    """Before hours of runs: every recipe validates (one line naming the run and the field, else) and the probe
    files exist. `seeds`: every method's, or per method."""
    if data is not None and missing_probe_files(data):
        raise SystemExit(
            f"retention probe data not found under {data}: {', '.join(missing_probe_files(data))}; pass --data DIR "
            "(the folder holding arc/, boolq/, piqa/, winogrande/; relative = to the repo root) or --no-probes"
        )
    by_method = per_method(methods, seeds)
    if row0_from is not None and any(set(v) - set(by_method.get(row0_from, [])) for v in by_method.values()):
        raise SystemExit(f"every seed needs a {row0_from} run (its row 0 is shared): add {row0_from} to --methods")
    for method, seed in jobs(by_method):
        try:
            resolve_recipe(method_recipe(method, seed, runs, overrides, data, sequence, row0_from))
        except RecipeError as err:
            raise SystemExit(f"{method}-s{seed}: {err}") from None


def per_method(methods: list[str], seeds: list[int] | dict[str, list[int]]) -> dict[str, list[int]]:
    """Each method's seeds: `seeds` itself for every method, or its entry."""
    return {m: list(seeds[m] if isinstance(seeds, dict) else seeds) for m in methods}


def portable(path: Path) -> str:
    """How an output names a folder: relative to the repo root when inside it, else `<runs>`-style by its name."""
    resolved = path.resolve()
    return resolved.relative_to(ROOT).as_posix() if resolved.is_relative_to(ROOT) else f"<{path.name}>"


class Plan(NamedTuple):
    """One collection as this invocation runs it: its sequence, methods' seeds, folders and overrides."""

    name: str
    sequence: str | None
    seeds: dict[str, list[int]]
    runs: Path
    out: Path
    overrides: list[str]
    row0_from: str | None


def plans(args: argparse.Namespace) -> list[Plan]:
    """The collections asked for, each with its settings; with several, those still waiting for their pilots'
    sequence are left out (said once), and --runs / --out, which name one collection's folders, are refused."""
    if len(args.collection) > 1 and (args.runs or args.out or args.sequence):
        raise SystemExit("--runs, --out and --sequence name one collection's: give one --collection with them")
    out = []
    for name in args.collection:
        collection = COLLECTIONS[name]
        sequence = args.sequence or collection.sequence
        if sequence is None and collection.needs_sequence:
            waiting = (
                f"collection {name!r} has no sequence yet: run its pilots (benchmarks/science/pilot.py, its README "
                "section) and set the chosen one in sweeps.py, or pass --sequence NAME for a smoke test"
            )
            if len(args.collection) == 1:
                raise SystemExit(waiting)
            print(f"{waiting}; skipped", flush=True)
            continue
        methods = args.methods or list(collection.seeds)
        seeds = {m: args.seeds or collection.seeds.get(m, [0, 1, 2]) for m in methods}
        runs, results = args.runs or ROOT / collection.runs, args.out or HERE / collection.out
        overrides = [*collection.settings, *args.set]
        out.append(Plan(name, sequence, seeds, runs, results, overrides, collection.shares_row0_from))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = "what to run (sweeps.COLLECTIONS): sequence, methods, seeds, runs and out folders; several: one sweep"
    parser.add_argument("--collection", nargs="+", choices=list(COLLECTIONS), default=[DEFAULT_COLLECTION], help=what)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), help="default: the collection's")
    parser.add_argument(
        "--seeds", nargs="+", type=int, help="every method's seeds (default: each one's in the collection)"
    )
    parser.add_argument("--sequence", choices=list(SEQUENCES), help="another sequence than the collection's")
    parser.add_argument("--runs", type=Path, help="where the run dirs go (default: the collection's, repo-relative)")
    parser.add_argument("--out", type=Path, help="where results.json/.md/.png go (default: the collection's)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each with OMP_NUM_THREADS=1)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="base.yaml overrides")
    parser.add_argument("--data", default=DEFAULT_DATA, help="folder of the retention probes' files (repo-relative)")
    parser.add_argument("--no-probes", action="store_true", help="run without the retention probes")
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples of the intervals")
    parser.add_argument("--collect-only", action="store_true", help="only collect the finished runs")
    args = parser.parse_args()
    data = None if args.no_probes else args.data
    chosen = {plan.name: plan for plan in plans(args)}
    for plan in chosen.values():
        plan.runs.mkdir(parents=True, exist_ok=True)
    if not args.collect_only:
        for plan in chosen.values():
            preflight(list(plan.seeds), plan.seeds, plan.runs, plan.overrides, data, plan.sequence, plan.row0_from)

        committed = {name: load_records(plan.out) for name, plan in chosen.items()}

        def run(job: tuple[str, str, int]) -> None:
            plan, method, seed = chosen[job[0]], job[1], job[2]
            if (method, seed) in committed[plan.name] and not (plan.runs / f"{method}-s{seed}").is_dir():
                git = committed[plan.name][(method, seed)]["provenance"].get("git", "?")
                print(f"{plan.name} {method}-s{seed}: collected earlier (records.json, git {git})", flush=True)
                return
            if plan.row0_from and method != plan.row0_from and (plan.row0_from, seed) in committed[plan.name]:
                restore_row0(plan.out, plan.runs, f"{plan.row0_from}-s{seed}")  # its run folder is gone
            run_one(method, seed, plan.runs, plan.overrides, data, plan.sequence, plan.row0_from)

        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(run, interleaved_jobs({name: plan.seeds for name, plan in chosen.items()})))
    for plan in chosen.values():
        collect(plan, data, args.resamples)


def collect(plan: Plan, data: str | None, resamples: int) -> None:
    """Collect a collection's finished runs into its results files and print them."""
    from collect import collect_runs
    from results import scrub, write_results

    methods = list(plan.seeds)
    runs, missing = collect_runs(plan.runs, methods, plan.seeds)
    committed = load_records(plan.out)
    here = {(r["method"], r["seed"]) for r in runs}
    runs += [
        r for key, r in committed.items() if key not in here and key[0] in plan.seeds and key[1] in plan.seeds[key[0]]
    ]
    missing = [name for name in missing if tuple(name.rsplit("-s", 1)) not in {(m, str(s)) for m, s in committed}]
    for name in missing:
        print(f"{name}: not finished (no summary.json; see {plan.runs}/{name}.log)")
    if not runs:
        print(f"{plan.name}: no finished run under {plan.runs}")
        return
    setting = {
        "base": str((HERE / "base.yaml").relative_to(ROOT)),
        "collection": plan.name,
        "sequence": None if plan.sequence is None else {"name": plan.sequence, "stages": SEQUENCES[plan.sequence]},
        "seeds": plan.seeds,
        "overrides": plan.overrides,
        "row0_from": plan.row0_from,
        "runs_dir": portable(plan.runs),
        "probes": None if data is None else {"data": data, "files": {n: f for n, (f, _) in PROBES.items()}},
        "reference": REFERENCE,
    }
    replacements = {str(plan.runs.resolve()): "<runs>", str(plan.runs): "<runs>", str(ROOT): "."}
    if data is not None:
        replacements[str((ROOT / data).resolve())] = "<data>"
    data = write_results(runs, plan.out, setting, METHODS, SDPO_VARIANTS, resamples, replacements)
    # what a later session on another machine resumes from (ledger.py): the records, and each seed's shared row 0
    save_records(plan.out, scrub(runs, replacements))
    for seed in sorted({r["seed"] for r in runs}) if plan.row0_from else []:
        save_row0(plan.out, plan.runs, f"{plan.row0_from}-s{seed}")
    del data
    print((plan.out / "results.md").read_text())
    print(json.dumps({"results": str(plan.out)}))


if __name__ == "__main__":
    main()
