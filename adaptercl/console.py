"""Terminal presentation of a run: rich progress bars (loading, each stage, its evaluation and drift) and the
accuracy matrix as a table."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from adaptercl.config import RecipeConfig
from adaptercl.distributed import launched_world
from adaptercl.run import RunResult, run_recipe


def accuracy_table(result: RunResult, stage_names: list[str]) -> Table:
    table = Table(title=f"accuracy matrix ({result.run_dir})")
    table.add_column("after")
    for name in result.domains:
        table.add_column(name, justify="right")
    for label, row in zip(stage_names, result.accuracy):
        table.add_row(label, *(f"{a:.3f}" for a in row))
    return table


def run_with_progress(recipe: RecipeConfig, console: Console | None = None) -> RunResult:
    """Run the recipe with progress bars and the accuracy table; the other data-parallel ranks run silently."""
    if not launched_world().is_main:
        return run_recipe(recipe)
    console = console or Console(stderr=True)
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
        if kind == "load":
            tasks["load"] = progress.add_task(f"loading {info['model']}", total=None, info="")
        elif kind == "model":
            if "load" in tasks:
                progress.update(tasks["load"], total=1, completed=1)
            console.print(f"[bold]base model[/]: {info['description']}")
        elif kind == "skip":
            console.print(f"{info['stage']}: already done, skipped")
        elif kind == "eval":
            advance(f"eval {info['stage']}", f"{info['stage']}: eval (domains)", info["done"], info["total"])
        elif kind == "drift":
            part = info["part"]
            unit = "modules" if part == "parameter" else "domains"
            label = f"{info['stage']}: {part} drift ({unit})"
            advance(f"drift {part} {info['stage']}", label, info["done"], info["total"])
        elif kind == "stage":
            label = f"{info['stage']} ({info['method']}, init {info['init']})"
            tasks[info["stage"]] = progress.add_task(label, total=info["steps"], info="")
        elif kind == "teacher_lift" and info["lift"]["n"]:
            lift = info["lift"]
            lo, hi = lift["lift_ci95"]
            console.print(
                f"{info['stage']}: teacher lift {lift['lift']:+.3f} [95% {lo:+.3f}, {hi:+.3f}] on {lift['n']} prompts "
                f"(teacher {lift['teacher_accuracy']:.3f}, student {lift['student_accuracy']:.3f})"
            )
        elif kind == "teacher_lift":
            console.print(f"{info['stage']}: teacher lift: no sampled prompt got a teacher context")
        elif kind == "step":
            m = info["metrics"]
            text = f"reward {m['reward_mean']:.3f} correct {m['correct_frac']:.2f} len {m['response_len_mean']:.0f}"
            progress.update(tasks[info["stage"]], completed=info["step"], info=text)

    with progress:
        result = run_recipe(recipe, on_event=on_event)
    labels = ["before"] + [s.name for s in recipe.stages]
    Console().print(accuracy_table(result, labels))
    return result
