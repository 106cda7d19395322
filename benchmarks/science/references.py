"""The references every method of a collection is compared with (issue 43, README "Issue 43: ... pre-registration"),
as run records shaped like a sequence run's, so that the bootstrap, the tables and the frontier treat them as methods:

- `base`: no training. Each seed's row 0 (the untrained base, shared by every run of the seed) repeated after every
  stage: ACC is the base's own accuracy on the trained domains; forgetting and plasticity are 0.
- `stage_skip`: GRPO trained on stage 1 only ("learn, then stop"): GRPO's rows 0 and 1, row 1 repeated after every
  later stage. Its forgetting is 0 by construction and its plasticity is stage 1's gain over T: the point a method
  that stops learning reaches, and the reason Chaudhry forgetting alone cannot be the headline.
- `joint`: GRPO on the union of the sequence's domains for the same total steps (one multitask stage, a run of its
  own): its rows 0 and 1 (after its one stage), row 1 repeated after every later stage, with the sequence's trained
  columns, so its ACC, final cells, retention_ratio and gain_over_base read as the sequence's; its forgetting (0)
  and plasticity (stage 1's column's gain over T) mean nothing and are not used.
Pure: records in, records out; a reference record has `reference: True` and no training traces; `base` and
`stage_skip` are `virtual` (no run of their own: their drift, KL and run figures are None, and the Runs table leaves
them out).
"""

from __future__ import annotations

import copy

REFERENCE_NAMES = ("base", "stage_skip", "joint")


def carried(run: dict, rows_kept: int, stages: int, method: str, trained_columns: list[int]) -> dict:
    """`run`'s first `rows_kept` rows of correctness and accuracy, the last of them repeated up to `stages` stages,
    as the record of `method` with the sequence's `trained_columns`; every per-stage trace empty."""
    out = copy.deepcopy(run)
    for key in ("correct", "accuracy"):
        kept = out[key][:rows_kept]
        out[key] = kept + [copy.deepcopy(kept[-1]) for _ in range(stages + 1 - rows_kept)]
    stage_names = run["stages"][:rows_kept] + [f"(carried) {i}" for i in range(stages + 1 - rows_kept)]
    empty: list = [None] * stages
    virtual = method in ("base", "stage_skip")  # made of GRPO's rows, not a run: no training figures of its own
    scalars = (
        dict.fromkeys(
            ("parameter_drift", "response_kl_to_base", "foreign_format_rate", "reward_drop", "train_minutes")
        )
        if virtual
        else {}
    )
    out.update(
        **scalars,
        virtual=virtual,
        method=method,
        stages=stage_names,
        trained_columns=list(trained_columns),
        reference=True,
        stage_kl=list(empty),
        teacher_lift=list(empty),
        lift_gate=list(empty),
        artifacts=list(empty),
        signals=[{} for _ in range(stages)],
        guard_events=[],
    )
    return out


def with_references(runs: dict[str, dict[int, dict]], reference: str = "grpo") -> dict[str, dict[int, dict]]:
    """`runs` (method -> seed -> record) with `base` and `stage_skip` made from the reference's runs (every seed it
    has) and a `joint` run turned into its sequence-shaped record; unchanged without the reference's runs."""
    if reference not in runs:
        return runs
    out = dict(runs)
    some = next(iter(runs[reference].values()))
    stages, cols = len(some["stages"]) - 1, some["trained_columns"]
    out["base"] = {s: carried(r, 1, stages, "base", cols) for s, r in runs[reference].items()}
    out["stage_skip"] = {s: carried(r, 2, stages, "stage_skip", cols) for s, r in runs[reference].items()}
    if "joint" in runs:
        out["joint"] = {s: carried(r, 2, stages, "joint", cols) for s, r in runs["joint"].items()}
    return out
