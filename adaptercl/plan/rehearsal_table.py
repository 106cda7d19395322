"""What a rehearsal measured beside what `adaptercl recipe plan` predicts for the same recipe, as `adaptercl recipe
rehearse` prints it: per stage the steady rollout and training step, the decode rate and the sampled response length;
per phase the peak memory; then the wall time from the rehearsal (`rehearsal.py`) beside the time model's.

The plan is of the recipe as written with the engine that ran, on the card that ran (its memory; its time model when
it is a card the model knows, else the RTX 4090's) or, on the CPU, a 24 GiB RTX 4090: there the planned column is a
GPU's, shown for scale. No torch.
"""

from __future__ import annotations

from typing import Any

from adaptercl.model import shape_of
from adaptercl.plan.memory import plan_recipe, planned_rows
from adaptercl.plan.rehearsal import duration, measured_wall_time
from adaptercl.plan.throughputs import CARDS, H100, H200, Card
from adaptercl.plan.wall_time import Timer
from adaptercl.recipe import RecipeConfig, RecipeError

KNOWN_CARDS = {"NVIDIA H200": H200, "NVIDIA H100 80GB HBM3": H100}  # torch's device name -> the time model's card
PLANNED_PHASES = {"train": "train", "rollout": "rollout", "eval": "eval", "diagnostics": "diagnostics"}
MEMORY_KEYS = {  # measured peak -> its label
    "peak_resident_gib": "resident",
    "peak_allocated_gib": "allocated",
    "peak_reserved_gib": "reserved",
    "device_used_peak_gib": "device used",
}


def as_engine(recipe: RecipeConfig, engine: str) -> RecipeConfig:
    """`recipe` with every stage rolling out on `engine` (what the rehearsal ran)."""
    stages = [s.model_copy(update={"rollout": s.rollout.model_copy(update={"engine": engine})}) for s in recipe.stages]
    return recipe.model_copy(update={"stages": stages})


def _measured(figure: dict[str, float], fmt: str, unit: str) -> str:
    if not figure.get("n"):
        return "-"
    return f"{figure['median']:{fmt}} {unit} (n {figure['n']}: {figure['min']:{fmt}}-{figure['max']:{fmt}})"


def beside_plan(recipe: RecipeConfig, rehearsal: dict[str, Any]) -> str:
    """The rehearsal's figures beside the plan's, and the wall time from both (see the module docstring)."""
    gpu_gib = rehearsal["machine"].get("gpu_memory_gib")
    card: Card = KNOWN_CARDS.get(rehearsal["machine"].get("gpu") or "", CARDS["rtx4090"])
    written, recipe = recipe, as_engine(recipe, rehearsal["engine"]["engine"])
    try:
        shape = shape_of(recipe.model.name)
        plan = plan_recipe(recipe, gpu_gib or 24.0)
        timer = Timer(recipe, shape, gpu_gib or 24.0, card)
    except RecipeError as err:  # a model the plan cannot size: measured figures only
        plan = timer = shape = None
        note = f"no plan beside it: {err}"
    where = f"{card.name.split(' (')[0]} time model, {gpu_gib or 24:g} GiB"
    lines = [f"{'measured on ' + rehearsal['machine']['label']:<73} {'planned (' + where + ')'}"]
    for index, stage in enumerate(recipe.stages):
        got = rehearsal["stages"].get(stage.name, {}).get("figures")
        if not got:
            lines.append(f"  {stage.name}: not rehearsed")
            continue
        n, cap = stage.optim.prompts_per_step * stage.rollout.group_size, stage.rollout.max_new_tokens
        rows = rehearsal["stages"][stage.name].get("micro_batch")
        planned = {}
        if timer is not None:
            prompt = timer.prompt(stage.domain)
            rollout = timer.generate_s(n, round(prompt), cap, batch=n)
            rows = rows or planned_rows(shape, recipe, index, round(prompt), gpu_gib or 24.0)
            planned = {"rollout": f"{rollout:.3g} s", "decode": f"{n * cap / rollout:.0f} tokens/s",
                       "train": f"{timer.train_step_s(stage, rows):.3g} s (micro-batch {rows})"}  # fmt: skip
        rows_ = [
            ("rollout step", _measured(got["rollout_s"], ".2f", "s"), planned.get("rollout", "-")),
            (f"decode at {n} sequences", _measured(got["decode_tokens_per_s"], ".0f", "tokens/s"),
             planned.get("decode", "-")),
            ("response length", _measured(got["response_len_mean"], ".1f", "tokens"), f"{cap} (the cap)"),
            ("training step", _measured(got["train_step_s"], ".2f", "s"), planned.get("train", "-")),
        ]  # fmt: skip
        lines += [f"  {stage.name + ' ' + what:<36} {value:<34} {plan_value}" for what, value, plan_value in rows_]
    planned_gib = {p.name: p.gib for p in plan.phases} if plan is not None else {}
    lines.append("peak memory GiB")
    for group, peaks in rehearsal.get("memory", {}).items():
        value = ", ".join(f"{MEMORY_KEYS[k]} {v:.2f}" for k, v in peaks.items() if k in MEMORY_KEYS)
        planned_value = planned_gib.get(PLANNED_PHASES.get(group, ""))
        lines.append(f"  {group:<36} {value:<34} {'-' if planned_value is None else f'{planned_value:.2f}'}")
    wall = measured_wall_time(written, rehearsal, plan.wall_time if plan is not None else None)
    model = f"~{duration(plan.wall_time.total_s)} on an {plan.wall_time.card}-class card" if plan else "-"
    lines.append(f"  {'wall time':<36} {'~' + duration(wall.total_s):<34} {model}")
    if plan is None:
        lines.append(f"  {note}")
    return "\n".join([*lines, wall.render()])
