"""Presentation of a run on the console: rich progress bars (loading, each stage, its evaluation and drift) on a
terminal; plain, complete lines (`PlainProgress`) when the output is not one (a log file, a job scheduler), where a
bar would be cut to its first characters; then the accuracy matrix as a table."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from adaptercl.recipe import RecipeConfig
from adaptercl.run import RunResult, run_recipe
from adaptercl.system import launched_world

# the end-of-stage diagnostics' progress events (run/sequence.py, `drift`): part -> (what is measured, unit of
# done/total)
DRIFT_PARTS = {
    "parameter": ("parameter drift", "modules"),
    "response": ("response drift", "probes"),
    "stage_kl": ("KL from the previous stage", "responses"),
}


def accuracy_table(result: RunResult, stage_names: list[str]) -> Table:
    table = Table(title=f"accuracy matrix ({result.run_dir})")
    table.add_column("after")
    for name in result.domains:
        table.add_column(name, justify="right")
    for label, row in zip(stage_names, result.accuracy):
        table.add_row(label, *(f"{a:.3f}" for a in row))
    return table


def run_with_progress(recipe: RecipeConfig, console: Console | None = None) -> RunResult:
    """Run `recipe` showing its progress on `console` (default stderr): bars on a terminal, else plain lines; the
    other data-parallel ranks run silently."""
    if not launched_world().is_main:
        return run_recipe(recipe)
    console = console or Console(stderr=True)
    if not console.is_terminal:
        result = run_recipe(recipe, on_event=PlainProgress(recipe, console.file))
        Console().print(accuracy_table(result, ["before"] + [s.name for s in recipe.stages]))
        return result
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
        console=console,
        transient=False,
    )
    tasks: dict[str, int] = {}

    def advance(key: str, label: str, done: int, total: int) -> None:  # one bar per (stage, phase)
        if key not in tasks:
            tasks[key] = progress.add_task(label, total=total, info="")
        progress.update(tasks[key], completed=done, total=total)

    def on_event(kind: str, **info) -> None:
        if kind == "rollout_engine":
            console.print(f"[bold]rollout engine[/]: {info['engine']} ({info['reason']})")
        elif kind == "load":
            tasks["load"] = progress.add_task(f"loading {info['model']}", total=None, info="")
        elif kind == "model":
            if "load" in tasks:
                progress.update(tasks["load"], total=1, completed=1)
            console.print(f"[bold]base model[/]: {info['description']}")
        elif kind == "skip":
            console.print(f"{info['stage']}: already done, skipped")
        elif kind in ("micro_batch", "note"):
            console.print(f"{info['stage']}: {info['line']}")
        elif kind == "eval":
            advance(f"eval {info['stage']}", f"{info['stage']}: eval (domains)", info["done"], info["total"])
        elif kind == "drift":
            part = info["part"]
            what, unit = DRIFT_PARTS[part]
            label = f"{info['stage']}: {what} ({unit})"
            advance(f"drift {part} {info['stage']}", label, info["done"], info["total"])
        elif kind == "stage":
            label = f"{info['stage']} ({info['method']}, init {info['init']})"
            tasks[info["stage"]] = progress.add_task(label, total=info["steps"], info="")
        elif kind == "teacher_lift":
            console.print(f"{info['stage']}: {teacher_lift_line(info['lift'])}")
        elif kind == "step":
            m = info["metrics"]
            text = f"reward {m['reward_mean']:.3f} correct {m['correct_frac']:.2f} len {m['response_len_mean']:.0f}"
            progress.update(tasks[info["stage"]], completed=info["step"], info=text)

    with progress:
        result = run_recipe(recipe, on_event=on_event)
    labels = ["before"] + [s.name for s in recipe.stages]
    Console().print(accuracy_table(result, labels))
    return result


def teacher_lift_line(lift: dict) -> str:
    """The stage-start teacher lift (teacher_lift.json) in one line, with the train prompts it tried."""
    tried = f"{lift['prompts_tried']} prompts tried, {lift['prompts']} rolled out"
    if not lift["n"]:
        return f"teacher lift: no prompt got a teacher context ({tried})"
    lo, hi = lift["lift_ci95"]
    return (
        f"teacher lift {lift['lift']:+.3f} [95% {lo:+.3f}, {hi:+.3f}] on {lift['n']} prompts with a context "
        f"(teacher {lift['teacher_accuracy']:.3f}, student {lift['student_accuracy']:.3f}; {tried})"
    )


class PlainProgress:
    """An `on_event` that prints complete lines to `out`: loading, every `log.print_every` steps of a stage (default
    about ten lines per stage, always the last) with reward, correctness, loss, length and seconds per step since the
    previous line; evaluation and drift as they advance, and each stage's evaluation row."""

    def __init__(self, recipe: RecipeConfig, out: TextIO, clock: Callable[[], float] = time.monotonic):
        self.out, self.clock, self.print_every = out, clock, recipe.log.print_every
        self.steps: dict[str, int] = {}  # stage -> its number of steps
        self.mark: dict[str, tuple[float, int | None]] = {}  # stage -> (time, step) of its last line
        self.handlers: dict[str, Callable[..., None]] = {
            "rollout_engine": lambda engine, reason, **_: self.line(f"rollout engine: {engine} ({reason})"),
            "load": lambda model, **_: self.line(f"loading {model}"),
            "model": lambda description, **_: self.line(f"base model: {description}"),
            "engine": lambda description, **_: self.line(f"rollout engine: {description}"),
            "skip": lambda stage, **_: self.line(f"[{stage}] already done, skipped"),
            "micro_batch": lambda stage, line, **_: self.line(f"[{stage}] {line}"),
            "note": lambda stage, line, **_: self.line(f"[{stage}] {line}"),
            "stage": self.stage,
            "step": self.step,
            "eval": self.eval,
            "evaluated": self.evaluated,
            "drift": self.drift,
            "teacher_lift": self.teacher_lift,
        }

    def __call__(self, kind: str, **info: Any) -> None:
        if kind in self.handlers:
            self.handlers[kind](**info)

    def line(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def stage(self, stage: str, steps: int, method: str, init: str, **_: Any) -> None:
        self.steps[stage] = steps
        self.mark[stage] = (self.clock(), None)
        self.line(f"[{stage}] {method}, init {init}, {steps} steps")

    def step(self, stage: str, step: int, metrics: dict, **_: Any) -> None:
        total = self.steps.get(stage, step)
        every = self.print_every or max(1, round(total / 10))
        since, last_step = self.mark[stage] if stage in self.mark else (self.clock(), None)
        if last_step is None:  # the first step this process ran (a resumed stage starts later)
            last_step = step - 1
        if step % every and step != total:
            self.mark[stage] = (since, last_step)
            return
        now = self.clock()
        self.mark[stage] = (now, step)
        shown = [("reward", "reward_mean", ".3f"), ("correct", "correct_frac", ".2f"), ("loss", "loss", ".4g")]
        shown.append(("len", "response_len_mean", ".0f"))
        parts = [f"{label} {metrics[key]:{fmt}}" for label, key, fmt in shown if key in metrics]
        per_step = (now - since) / max(1, step - last_step)
        self.line(f"[{stage}] step {step}/{total} " + " ".join(parts) + f" {per_step:.1f} s/step")

    def eval(self, stage: str, done: int, total: int, **_: Any) -> None:
        noun = "domain" if total == 1 else "domains"
        self.line(f"[{stage}] eval: {total} {noun}" if done == 0 else f"[{stage}] eval: {done}/{total} {noun}")

    def evaluated(self, stage: str, row: dict, **_: Any) -> None:
        accuracy = ", ".join(f"{d} {r['accuracy']:.3f} (n {r['n']})" for d, r in row.items())
        self.line(f"[{stage}] accuracy: {accuracy}")

    def drift(self, stage: str, part: str, done: int, total: int, **_: Any) -> None:
        what, unit = DRIFT_PARTS[part]
        if done == total or done % max(1, total // 4) == 0:  # at most about four lines per part
            self.line(f"[{stage}] {what}: {done}/{total} {unit}")

    def teacher_lift(self, stage: str, lift: dict, **_: Any) -> None:
        self.line(f"[{stage}] {teacher_lift_line(lift)}")
