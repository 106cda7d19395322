"""Rollout samples: the bounded sample of each training step's completions kept in the stage's samples.jsonl.

Each step keeps `log.samples_per_step` of its N = prompts x G completions: the first response of every prompt's
group in prompt order, then the second of every group, and so on, so a small sample covers as many prompts as it
can and the choice needs no random state (a resumed stage keeps the same ones). A row:

    {"step": 3, "domain": "math", "id": "...", "prompt": "<the last user turn>", "completion": "...",
     "reward": 0.0, "correct": false, "feedback": "...", "teacher_target": true}

`teacher_target` is whether the sample had a teacher context (so distillation targets; `train/distill_targets.py`),
null for methods without a teacher. `train/stage.py` appends a step's rows together with its metrics.jsonl line and
cuts them back with it on resume and rollback; `measure/report.py` shows a few (`markdown_table`);
`measure/trackers.py` sends them to the trackers.
"""

from __future__ import annotations

from typing import Any

from adaptercl.domains import Domain, Example, RewardResult
from adaptercl.rollout import Completion

SAMPLE_COLUMNS = ("step", "domain", "prompt", "completion", "reward", "correct", "feedback", "teacher_target")


def sample_indices(n: int, group: int, k: int) -> list[int]:
    """Indices of the `k` kept samples among `n` group-contiguous ones (groups of `group`): rank-major order."""
    groups = n // group
    return [g * group + j for j in range(group) for g in range(groups)][:k]


def sample_rows(
    step: int,
    examples: list[Example],
    domains: list[Domain],
    completions: list[Completion],
    results: list[RewardResult],
    has_target: list[bool] | None,
    group: int,
    k: int,
) -> list[dict]:
    """The kept rows of one step (1-based `step`); the per-sample lists are [N] group-contiguous."""
    rows = []
    for i in sample_indices(len(completions), group, k):
        rows.append(
            {
                "step": step,
                "domain": domains[i].name,
                "id": examples[i].id,
                "prompt": examples[i].messages[-1]["content"],
                "completion": completions[i].text,
                "reward": results[i].score,
                "correct": bool(results[i].correct),
                "feedback": results[i].feedback,
                "teacher_target": None if has_target is None else bool(has_target[i]),
            }
        )
    return rows


def markdown_table(rows: list[dict], width: int = 300) -> str:
    """Samples as a markdown table (one line per row; long texts cut to `width` characters)."""
    lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + " --- |" * len(SAMPLE_COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(table_cell(row.get(c), width) for c in SAMPLE_COLUMNS) + " |")
    return "\n".join(lines)


def table_cell(value: Any, width: int) -> str:
    """One markdown table cell: numbers to 3 decimals, newlines shown as ⏎, pipes escaped, cut to `width`."""
    if isinstance(value, float):
        return f"{value:.3f}"
    text = "" if value is None else str(value)
    text = text.replace("\n", " ⏎ ").replace("|", "\\|")
    return text if len(text) <= width else text[: width - 1] + "…"
