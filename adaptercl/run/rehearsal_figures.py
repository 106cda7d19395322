"""What a rehearsal measured, per stage and per part, from the phase meter's spans and the run's events: the figures
of rehearsal.json that `plan/rehearsal.py` scales to the whole recipe (its docstring has the arithmetic).

    log = EventLog(meter, on_event)          # run_recipe(recipe, log): each event kept with its time
    stages, eval_before, top = stage_figures(recipe, meter.spans, log)

The run's top-level phases come in its order (`run/sequence.py`): load, the evaluation before training, then per
stage [teacher lift], train (its steps, each a rollout and an update, and checkpoints), save, evaluation, [parameter
drift, response drift, stage KL]. A stage begins at its teacher lift, or at its train when it has none; the parts after
its train are its own. A step's rollout and training seconds are its metrics' (`time_rollout_s`, `time_step_s` less
it); an evaluation's seconds per domain are the times between its progress events.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from adaptercl.adapters import stage_dir_name
from adaptercl.plan import spread
from adaptercl.recipe import RecipeConfig
from adaptercl.run.phase_meter import PhaseMeter, Span
from adaptercl.run_dir import BEFORE_DIR

KEPT_EVENTS = ("rollout_engine", "engine", "model", "micro_batch", "step", "eval", "evaluated")
DIAGNOSTICS = {  # top-level phase -> the rehearsed recipe's count of its prompts (a function of the recipe)
    "teacher_lift": lambda r: r.eval.teacher_lift_prompts,
    "stage_kl": lambda r: r.eval.stage_kl_prompts,
    "response_drift": lambda r: r.eval.drift_probes * len(r.domains),
}


@dataclass
class EventLog:
    """An `on_event` that keeps the events the figures need, with the meter's time, and passes every event on."""

    meter: PhaseMeter
    then: Callable[..., Any] | None = None
    events: list[tuple[float, str, dict]] = field(default_factory=list)

    def __call__(self, kind: str, **info: Any) -> None:
        if kind in KEPT_EVENTS:
            self.events.append((self.meter.now(), kind, info))
        if self.then is not None:
            self.then(kind, **info)

    def of(self, kind: str) -> list[tuple[float, dict]]:
        return [(t, info) for t, k, info in self.events if k == kind]


def stage_of_spans(spans: list[Span]) -> list[tuple[Span, int]]:
    """Each top-level span with its stage index (-1: before the first stage), in the run's order."""
    out, index, previous = [], -1, None
    for span in sorted((s for s in spans if s.depth == 0), key=lambda s: s.start):
        if span.name == "teacher_lift" or (span.name == "train" and previous != "teacher_lift"):
            index += 1
        out.append((span, index))
        previous = span.name
    return out


def inside(spans: list[Span], outer: Span, name: str) -> list[Span]:
    return [s for s in spans if s.name == name and s.depth > 0 and outer.start <= s.start <= outer.end]


def eval_seconds(log: EventLog, label: str, recipe: RecipeConfig) -> dict[str, dict[str, float]]:
    """{domain: seconds, examples} of the evaluation of stage folder `label`, from its progress events."""
    times = sorted((info["done"], t) for t, info in log.of("eval") if info["stage"] == label)
    rows = [info["row"] for _, info in log.of("evaluated") if info["stage"] == label]
    out = {}
    for (done, t), (_, t_prev) in zip(times[1:], times):
        domain = recipe.domains[done - 1].name
        n = rows[0][domain]["n"] if rows and domain in rows[0] else recipe.eval.examples_per_domain
        out[domain] = {"seconds": round(t - t_prev, 4), "examples": n}
    return out


def step_figures(steps: list[dict], sequences: int) -> list[dict[str, float]]:
    """Each step's rollout and training seconds, sequences and sampled tokens (its metrics)."""
    return [
        {
            "rollout_s": m["time_rollout_s"],
            "train_s": m["time_step_s"] - m["time_rollout_s"],
            "sequences": sequences,
            "tokens": m["response_len_mean"] * sequences,
            "response_len_mean": m["response_len_mean"],
            "response_len_max": m["response_len_max"],
        }
        for m in steps
    ]


def summary(steps: list[dict]) -> dict[str, dict[str, float]]:
    """The stage's figures with their n and spread: the steady steps (all but the first) of each rate."""
    steady = steps[1:]
    return {
        "rollout_s": spread([s["rollout_s"] for s in steady]),
        "train_step_s": spread([s["train_s"] for s in steady]),
        "decode_tokens_per_s": spread([s["tokens"] / s["rollout_s"] for s in steady if s["rollout_s"] > 0]),
        "response_len_mean": spread([s["response_len_mean"] for s in steps]),
        "first_step": {"rollout_s": steps[0]["rollout_s"], "train_s": steps[0]["train_s"]} if steps else {},
    }


def stage_figures(recipe: RecipeConfig, spans: list[Span], log: EventLog) -> tuple[dict, dict, dict[str, float]]:
    """(per stage name: its figures, the evaluation before training per domain, seconds of each top-level phase
    summed) of the rehearsed `recipe`."""
    labels = {stage_dir_name(recipe, i): i for i in range(len(recipe.stages))}
    micro = {labels[info["stage"]]: info["record"].get("micro_batch_size") for _, info in log.of("micro_batch")}
    steps: dict[int, list[dict]] = {}
    for _, info in log.of("step"):
        steps.setdefault(labels[info["stage"]], []).append(info["metrics"])
    out: dict[str, dict[str, Any]] = {}
    top: dict[str, float] = {}
    for span, index in stage_of_spans(spans):
        seconds = span.end - span.start
        top[span.name] = top.get(span.name, 0.0) + seconds
        if index < 0 or index >= len(recipe.stages):
            continue
        stage = recipe.stages[index]
        n = stage.optim.prompts_per_step * stage.rollout.group_size
        head = {"method": stage.method, "sequences": n, "max_new_tokens": stage.rollout.max_new_tokens}
        figures = out.setdefault(stage.name, {**head, "micro_batch": micro.get(index)})
        if span.name == "train":
            done = step_figures(steps.get(index, []), n)
            checkpoints = [c.end - c.start for c in inside(spans, span, "checkpoint")]
            figures |= {"steps": done, "checkpoint_s": checkpoints, "figures": summary(done)}
            stepped = sum(s["rollout_s"] + s["train_s"] for s in done)
            figures["stage_overhead_s"] = max(0.0, seconds - stepped - sum(checkpoints))
        elif span.name == "save":
            figures["save_s"] = seconds
        elif span.name == "eval":
            figures["eval"] = eval_seconds(log, stage_dir_name(recipe, index), recipe)
        elif span.name == "parameter_drift":
            figures["parameter_drift"] = {"seconds": seconds}
        elif span.name in DIAGNOSTICS:
            figures[span.name] = {"seconds": seconds, "prompts": DIAGNOSTICS[span.name](recipe)}
    return out, eval_seconds(log, BEFORE_DIR, recipe), top
