"""The `report_to:` field and the `log:` block of the recipe grammar: where a run's step metrics, evaluation rows and
sample completions go besides its run directory (TensorBoard, wandb, trackio: `measure/trackers.py`), how many rollout
samples each step keeps in samples.jsonl (`train/stage.py`), and how often a plain progress line is printed when the
output is not a terminal (`console.py`). No torch import; `grammar.py` re-exports it.

`report_to` is spelled as in TRL / transformers' TrainingArguments: one name, a list of names, or "none" (the default,
as in transformers 5: nothing leaves the run directory unless asked). TRL's "all" (every installed integration) is
not offered: a run's destinations should not depend on what happens to be installed.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from adaptercl.recipe.config_block import ConfigBlock

Tracker = Literal["tensorboard", "wandb", "trackio"]
TRACKERS: tuple[str, ...] = ("tensorboard", "wandb", "trackio")


def parse_report_to(value: Any) -> list[str]:
    """`report_to` as TRL accepts it (None, "none", a name, "a,b", or a list) -> the list of tracker names."""
    if value is None:
        return []
    names = [n.strip() for n in value.split(",")] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"must be a tracker name or a list of them ({', '.join(TRACKERS)}) or 'none'")
    if "none" in names:
        if len(names) > 1:
            raise ValueError(f"'none' cannot be combined with other trackers, got {names}")
        return []
    for name in names:
        if name not in TRACKERS:
            raise ValueError(f"unknown tracker {name!r}; allowed: {', '.join(TRACKERS)} or 'none'")
    return list(dict.fromkeys(names))


class LogConfig(ConfigBlock):
    samples_per_step: int = Field(
        4,
        ge=0,
        description="Rollout samples kept per training step in the stage's samples.jsonl (prompt, completion, "
        "reward, feedback, teacher target): the first response of each prompt's group, then the second, ..., in "
        "prompt order; shown in report.md and sent to the trackers. 0 = none.",
    )
    project: str = Field("adaptercl", min_length=1, description="wandb / trackio project name.")
    run_name: str | None = Field(
        None, description="wandb / trackio run name (and TensorBoard folder name); default: the output_dir's name."
    )
    print_every: int | None = Field(
        None,
        ge=1,
        description="When stderr is not a terminal (a log file, a job scheduler), print a plain progress line "
        "every this many steps (and always the last); default: about ten lines per stage.",
    )
