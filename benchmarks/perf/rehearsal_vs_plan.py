"""The 24 GB rehearsal's measurements beside the plan's model of the same run: memory per phase and seconds per part.

Reads the committed rehearsal results (`results/rehearse_24gb*.json`, made by rehearse_24gb.py on a lent GPU),
rebuilds the recipe each ran (`recipe_as_run`: the run's recorded changes and the engine that ran,
the model named by its hub id: the random checkpoint has Qwen2.5-7B's shape) and checks that the memory plan of that
recipe is the one the run recorded, phase for phase but the training step, whose model has changed since the runs
(both figures are shown). Then it asks the wall-time model (`plan.wall_time`) for each part of that very run on the
card that ran it (`throughputs.H200` / `H100`, every prompt at the rehearsal's length) and sets the measured figure
beside it:

- training step: a step's seconds less its rollout's (reward, teacher targets, forward and backward, optimiser), the
  steps after each stage's first (the first builds AdamW's state and warms the kernels up; shown apart);
- rollout step: the step's generate call (`time_rollout_s`), the same steps;
- evaluation, teacher lift, stage KL, response drift, parameter drift: the seconds of each call of the function that
  does it (`calls`, recorded from fbd4c6d on);
- decode step: each generate call's seconds ÷ its longest response, the prefill included, against the model's step.

    python benchmarks/perf/rehearsal_vs_plan.py          # writes results/rehearse_24gb.md

Nothing runs on a GPU here and nothing is downloaded; a test regenerates the committed markdown from the committed
JSON (tests/benchmarks/test_rehearsal_vs_plan.py).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for the shared provenance.py
sys.path.insert(0, str(Path(__file__).resolve().parent))

from perf_common import RESULTS_DIR  # noqa: E402
from provenance import markdown_table  # noqa: E402

RESULTS = ("rehearse_24gb.json", "rehearse_24gb-calls.json")
CHANGED_SINCE_THE_RUNS = ("train",)  # phases whose memory model changed after the committed runs (see compare)
MODEL = "Qwen/Qwen2.5-7B-Instruct"  # the random checkpoint's shape (random_checkpoint.QWEN25_7B)
# part of the model -> the instrumented function whose calls measure it
CALLS = {
    "evaluation": "evaluate_all",
    "teacher_lift": "teacher_lift",
    "stage_kl": "stage_kl",
    "response_drift": "response_drift",
    "parameter_drift": "parameter_drift_report",
}


def card_of(device: str):
    """The wall-time model's card for the device a rehearsal ran on."""
    from adaptercl.plan import throughputs

    cards = {"NVIDIA H200": throughputs.H200, "NVIDIA H100 80GB HBM3": throughputs.H100}
    if device not in cards:
        raise SystemExit(f"rehearsal_vs_plan: no spec-sheet card for device {device!r}; add it to plan.throughputs")
    return cards[device]


def recipe_as_run(result: dict[str, Any], work: Path):
    """The recipe the rehearsal ran (its engine, its recorded changes: the committed runs' rehearse_24gb.py shrank the
    recipe itself, before it called `adaptercl recipe rehearse`), model named by hub id."""
    import yaml
    from rehearse_24gb import write_domain

    from adaptercl.recipe.grammar import resolve_recipe

    changes, repo = result["changes"], Path(__file__).resolve().parents[2]
    raw = yaml.safe_load((repo / result["recipe"]).read_text())
    probes = raw.get("eval", {}).get("retention_probes", []) if changes["eval"]["retention_probes"] else []
    trained = {s["domain"] for s in raw["stages"]}
    names = [d["name"] for d in raw["domains"] if d["name"] in trained or d["name"] in probes]
    domains = [
        {"name": name, "source": str(write_domain(work / "data" / name, prompt_tokens(result))), "format": "gsm8k"}
        for name in names
    ]
    raw.update(model={**raw["model"], "name": MODEL}, output_dir=str(work / "run"), domains=domains)
    raw["optim"] = {**raw["optim"], **changes["optim"]}
    raw["eval"] = {**raw.get("eval", {}), **changes["eval"]}
    recipe = resolve_recipe(raw)
    engine = result["engine"]["engine"]
    stages = [s.model_copy(update={"rollout": s.rollout.model_copy(update={"engine": engine})}) for s in recipe.stages]
    return recipe.model_copy(update={"stages": stages})


def prompt_tokens(result: dict[str, Any]) -> int:
    """The rehearsal's prompt length, from its recorded domains line ('... prompts of N tokens')."""
    return int(result["changes"]["domains"].rsplit("prompts of ", 1)[1].split()[0])


def steady_steps(result: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    """(each stage's first step, the later steps) of the rehearsal's metrics."""
    firsts, later = [], []
    for steps in result["step_times"].values():
        firsts += steps[:1]
        later += steps[1:]
    return firsts, later


def measured_parts(result: dict[str, Any]) -> dict[str, list[float]]:
    """Seconds of each occurrence of each part, as measured."""
    firsts, later = steady_steps(result)
    out = {
        "train_step": [s["time_step_s"] - s["time_rollout_s"] for s in later],
        "rollout_step": [s["time_rollout_s"] for s in later],
        "train_step (a stage's first)": [s["time_step_s"] - s["time_rollout_s"] for s in firsts],
        "rollout_step (a stage's first)": [s["time_rollout_s"] for s in firsts],
    }
    for part, function in CALLS.items():
        call = result.get("calls", {}).get(function)
        if call and call["n"]:
            out[part] = [call["seconds"] / call["n"]] * call["n"]  # the mean of its n calls
    return out


def compare(result: dict[str, Any]) -> dict[str, Any]:
    """The rehearsal's memory and time beside the plan's model of the same run."""
    from adaptercl.model.shapes import shape_of
    from adaptercl.plan.memory import plan_recipe
    from adaptercl.plan.wall_time import Timer, estimate_wall_time

    with tempfile.TemporaryDirectory(prefix="adaptercl-rehearsal-plan-") as tmp:
        recipe = recipe_as_run(result, Path(tmp))
        plan = plan_recipe(recipe, gpu_memory_gib=result["card"]["capped_to_gib"], prompt_tokens=prompt_tokens(result))
    planned = {p.name: p.gib for p in plan.phases}
    recorded = {name: p["gib"] for name, p in result["plan_as_run"]["phases"].items()}
    # The recipe is rebuilt right when its plan is the run's (rel 1e-12: the checkpoint's config.json and the table of
    # shapes sum the same terms in two orders), on the phases whose model is the run's: the training step's counts
    # prefix sharing since these runs (plan/step_memory.py), so its figure then and now are both shown instead.
    checked = [k for k in recorded if k not in CHANGED_SINCE_THE_RUNS]
    if planned.keys() != recorded.keys() or not all(
        math.isclose(planned[k], recorded[k], rel_tol=1e-12) for k in checked
    ):
        raise SystemExit(f"rehearsal_vs_plan: the rebuilt recipe's plan {planned} is not the run's {recorded}")
    card, shape = card_of(result["device"]), shape_of(MODEL)
    rows = [int(line.split("micro-batch ")[1].split()[0]) for line in result["micro_batches"]]
    rows += [rows[-1]] * (len(recipe.stages) - len(rows))  # stages the run did not reach: the last one's
    wall = estimate_wall_time(recipe, shape, rows, result["card"]["capped_to_gib"], card, prompt_tokens(result))
    time_rows = []
    for part, values in measured_parts(result).items():
        if not values:
            continue
        model = wall.parts[part.split(" (")[0]].each_s
        median = statistics.median(values)
        time_rows.append([part, len(values), median, model, median / model if model else None])
    timer = Timer(recipe, shape, result["card"]["capped_to_gib"], card, prompt_tokens(result))
    one, more = (timer.generate_s(rows, prompt_tokens(result), 1) for rows in (1, 2))  # one decode step
    decode_rows = []
    for phase, spread in result["decode_step_s"].items():
        model = f"{one:.3f} / {more:.3f}"  # one row / more (dequantising)
        decode_rows.append([phase, spread["n"], spread["median"], spread["min"], spread["max"], model])
    peaks = ("peak_allocated_gib", "peak_reserved_gib", "device_used_peak_gib", "planned_gib")
    memory_rows = [
        [name, *(p.get(k) for k in peaks), planned.get(name)]
        for name, p in result["phases"].items()
        if p["seconds"] > 0
    ]
    return {"card": card.name, "time": time_rows, "decode": decode_rows, "memory": memory_rows}


def cell(value: Any) -> Any:
    return "-" if value is None else value


def markdown(name: str, result: dict[str, Any], comparison: dict[str, Any]) -> str:
    versions = result["versions"]
    head = (
        f"## {name}: {result['recipe']} on {result['device']} capped at {result['card']['capped_to_gib']:g} GiB\n\n"
        f"Command: `{result['command']}` at {versions['adaptercl_git'][:7]}; torch {versions['torch']}, transformers "
        f"{versions['transformers']}, peft {versions['peft']}, bitsandbytes {versions['bitsandbytes']}. Engine: "
        f"{result['engine']['engine']} ({result['engine']['reason']}). Micro-batches: "
        f"{'; '.join(result['micro_batches'])}. "
        + (f"Stopped early: {result['stopped']}. " if result.get("stopped") else "")
        + (f"FAILED in {result['failed']['phase']}: {result['failed']['error']}. " if result.get("failed") else "")
        + f"Total {result['total_s']:.0f} s, of which writing the random checkpoint {result['checkpoint_s']:.0f} s.\n"
    )
    memory = markdown_table(
        [
            "phase",
            "torch peak allocated GiB",
            "torch peak reserved GiB",
            "device used GiB",
            "planned at the run GiB",
            "planned now GiB",
        ],  # fmt: skip
        [[cell(v) for v in row] for row in comparison["memory"]],
    )
    time = markdown_table(
        [
            "part",
            "n",
            "measured s (median)",
            f"model on the {comparison['card'].split(' (')[0]} s",
            "measured / model",
        ],
        [[cell(v) for v in row] for row in comparison["time"]],
    )
    decode = markdown_table(
        ["decode step of", "calls", "median s", "min s", "max s", "model s, batch 1 / above"], comparison["decode"]
    )
    return "\n\n".join([head, "Memory per phase:", memory, "Seconds per part:", time, "Decode step:", decode]) + "\n"


PREAMBLE = """# The 24 GB rehearsal beside the plan (issue 26)

Made by `python benchmarks/perf/rehearsal_vs_plan.py` from the committed rehearsal results; each section names the
command and revision of its run. Memory: torch's peaks per phase (reset as each phase opens; `reserved` keeps the
allocator's cache, which loading the NF4 base fills to ~15.4 GiB, so it stays there) and the device's used memory
(polled; the CUDA context included), against the memory plan of the very recipe that ran. Time: each part of the run
against the wall-time model's figure for that part on the card that ran it (its spec-sheet ratios to the measured
H100), every prompt at the rehearsal's length. Interpretation: benchmarks/perf/README.md, "rehearse_24gb.py".
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "rehearse_24gb.md")
    args = parser.parse_args(argv)
    sections = []
    for name in RESULTS:
        path = args.results / name
        if not path.is_file():
            continue
        result = json.loads(path.read_text())
        sections.append(markdown(name, result, compare(result)))
    if not sections:
        print(f"rehearsal_vs_plan: no rehearsal result in {args.results} ({', '.join(RESULTS)})")
        return 2
    args.out.write_text(PREAMBLE + "\n" + "\n".join(sections))
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
