"""Issue 37's pilots: GRPO alone on candidate sequences, on a seed no sweep uses, to choose a sequence on which GRPO
forgets for the `forgetting` collection (sweeps.py).

    env OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/science/pilot.py --runs ../science-pilots --jobs 2
    python benchmarks/science/pilot.py --runs ../science-pilots --collect-only     # print the finished ones again

A candidate is a sequence of sweeps.SEQUENCES (default: every one but issue 25's arithmetic -> mcq -> toolcall, on
which GRPO forgot nothing). Its run is base.yaml's budget (model, LoRA, 24 sequences of up to 24 new tokens a step,
lr, 100 eval examples per domain) with the candidate's domains and stages and GRPO on every stage, seed 100 (the
sweeps use seeds 0-5: another fact partition and other train and eval examples), without the retention probes and
the drift and teacher diagnostics (`PILOT_EVAL`: they decide nothing here). Each run goes through run.py's `launch`
(`<candidate>-s<seed>/` in `--runs`, a finished run skipped, an interrupted one resumed, one finished with another
recipe refused: give a `--set` variant its own `--runs` folder).

Printed per candidate: the accuracy matrix with each cell's Wilson interval; each stage's gain on its own domain and
GRPO's forgetting (Chaudhry's: best accuracy after stages 1..T−1 minus final, over the domains trained before the
last stage) with a percentile bootstrap over the run's eval examples (one seed: no seed level); and issue 37's
criterion: the forgetting interval lies above 0 (GRPO forgets) and every gain's interval lies above 0 (every stage
is learnable). `--out FILE` also writes the printed tables (markdown, no path of the machine).
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from method_recipes import method_recipe
from run import ROOT, launch, portable
from sweeps import SEQUENCES

PILOT_SEED = 100  # never a sweep seed (sweeps.COLLECTIONS use 0-5); the issue 25 toolcall pilot's seed too
KNOWN = "arithmetic-mcq-toolcall"  # issue 25's sequence: GRPO's forgetting 0.000 [−0.022, 0.028] over 3 seeds
CANDIDATES = [name for name in SEQUENCES if name != KNOWN]
PILOT_EVAL = [  # what a pilot does not need: decided by accuracies alone
    "eval.drift_probes=0",
    "eval.parameter_drift=false",
    "eval.teacher_lift_prompts=0",
    "eval.stage_kl_prompts=0",
]


def pilot_recipe(candidate: str, seed: int, runs: Path, overrides: list[str] = ()) -> dict:
    """GRPO on `candidate` (module docstring): run.py's recipe without probes, PILOT_EVAL, then `overrides`."""
    recipe = method_recipe("grpo", seed, runs, [*PILOT_EVAL, *overrides], data=None, sequence=candidate)
    recipe["output_dir"] = str(runs / f"{candidate}-s{seed}")
    return recipe


def verdict(figures: dict, stages: int) -> dict:
    """Issue 37's criterion on one pilot's figures (analysis.summarise's, one seed): whether the forgetting interval
    lies above 0 and every stage's gain interval does."""
    forgets = figures["forgetting"]["ci95"] is not None and figures["forgetting"]["ci95"][0] > 0
    gains = [figures[f"gain {k}"]["ci95"] for k in range(1, stages + 1)]
    learnable = all(ci is not None and ci[0] > 0 for ci in gains)
    return {"forgets": forgets, "learnable": learnable, "chosen_by_criterion": forgets and learnable}


def report(records: list[dict], resamples: int) -> str:
    """The markdown of every finished pilot: per candidate its matrix, gains, forgetting and verdict, then one row
    each."""
    from analysis import summarise
    from results import ci, num, with_ci

    summary, _, _ = summarise({r["method"]: {r["seed"]: r} for r in records}, resamples)
    lines, rows = ["# Issue 37 pilots: GRPO alone on candidate sequences", ""], []
    for r in records:
        s, name, seed = summary[r["method"]], r["method"], r["seed"]
        f, cells = s["figures"], s["per_seed"][seed]
        trained = [r["domains"][c] for c in r["trained_columns"]]
        v = verdict(f, len(trained))
        lines += [f"## {name} (seed {seed}, n = {', '.join(map(str, r['n']))} per domain)", ""]
        lines += ["| after | " + " | ".join(r["domains"]) + " |", "|---|" + "---|" * len(r["domains"])]
        for k, label in enumerate(["before"] + [st.split("-", 2)[-1] for st in r["stages"][1:]]):
            row = [
                num(cells[f"cell {k} {d}"]["value"]) + ci(cells[f"cell {k} {d}"]["ci95"])
                for d in range(len(r["domains"]))
            ]
            lines.append(f"| {label} | " + " | ".join(row) + " |")
        gains = "; ".join(f"{k} ({d}) {with_ci(f[f'gain {k}'])}" for k, d in enumerate(trained, start=1))
        wall = r["provenance"].get("wall_s")
        lines += [
            "",
            f"Gain per stage on its own domain: {gains}. Forgetting: {with_ci(f['forgetting'])}. GRPO forgets: "
            f"{'yes' if v['forgets'] else 'no'}; every stage learnable: {'yes' if v['learnable'] else 'no'}. Wall "
            f"{'–' if wall is None else f'{wall / 60:.1f}'} min (training {r['train_minutes']:.1f}).",
            "",
        ]
        rows.append(
            f"| {name} | {', '.join(trained)} | {gains} | {with_ci(f['forgetting'])} | "
            f"{'yes' if v['chosen_by_criterion'] else 'no'} |"
        )
    lines += [
        "## All pilots",
        "",
        "| candidate | stages | gain per stage [95 %] | forgetting [95 %] | meets the criterion |",
    ]
    lines += ["|---|---|---|---|---|", *rows, ""]
    lines.append(
        "Intervals: 95 %, each cell Wilson over its n examples; gains and forgetting a percentile bootstrap "
        f"({resamples} resamples) over the run's eval examples. Criterion (issue 37): forgetting interval above 0 "
        "and every gain's interval above 0."
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", nargs="+", choices=list(SEQUENCES), default=CANDIDATES)
    parser.add_argument("--seed", type=int, default=PILOT_SEED)
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "science-pilots", help="where the run dirs go")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each with OMP_NUM_THREADS=1)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides, as run.py's")
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples of the intervals")
    parser.add_argument("--collect-only", action="store_true", help="only print the finished pilots")
    parser.add_argument("--out", type=Path, help="also write the printed markdown to this file")
    args = parser.parse_args()
    args.runs.mkdir(parents=True, exist_ok=True)
    recipes = {c: pilot_recipe(c, args.seed, args.runs, args.set) for c in args.candidates}
    if not args.collect_only:
        from adaptercl.recipe.grammar import RecipeError, resolve_recipe

        for candidate, recipe in recipes.items():  # every recipe validates before the first run starts
            try:
                resolve_recipe(recipe)
            except RecipeError as err:
                raise SystemExit(f"{candidate}: {err}") from None
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(lambda c: launch(f"{c}-s{args.seed}", recipes[c], args.runs), args.candidates))

    from collect import collect_run

    records = [collect_run(args.runs / f"{c}-s{args.seed}", c, args.seed) for c in args.candidates]
    missing = [c for c, r in zip(args.candidates, records) if r is None]
    for c in missing:
        print(f"{c}-s{args.seed}: not finished (no summary.json; see {args.runs}/{c}-s{args.seed}.log)")
    records = [r for r in records if r is not None]
    if not records:
        raise SystemExit(f"no finished pilot under {args.runs}")
    text = report(records, args.resamples)
    text += f"\nRuns in `{portable(args.runs)}`" + (f", overrides `{' '.join(args.set)}`" if args.set else "") + ".\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
