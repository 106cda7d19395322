"""One training stage, top to bottom (`stage.py`: rollout -> reward -> teacher -> loss -> step -> guard -> log): what
it is handed (`context.py`), the micro-batch it trains with (`micro_batch.py`) and which rows make each one
(`micro_batch_rows.py`), one optimiser step (`step.py`), the distillation targets of a step (`distill_targets.py`;
the hybrid's sparse choice of tokens, `sparse_targets.py`; SRPO's routed teacher and weights, `srpo.py`), the loss
math (`losses.py`, pure tensors) and the loss terms composed from it (`loss_terms.py`; per-token terms from chunks of
positions, `token_terms.py`), the continual-learning regularisers (`regularizers.py`), the learning-rate schedule
(`lr_schedule.py`), the collapse guard (`collapse_guard.py`), mid-stage checkpoints (`checkpoint.py`), the teacher's
measured lift over the student (`lift.py`, shared with the run's `teacher_lift` diagnostic) and the lift gate built on
it (`lift_gate.py`).
"""

from importlib import import_module

# name other folders use -> the module of this folder that defines it; a name equal to its module's is the module
# itself. Imported on first use: importing the folder loads nothing.
_EXPORTS = {
    "has_checkpoint": "checkpoint",
    "StageContext": "context",
    "rollout_sampling": "context",
    "step_seed": "context",
    "greedy_correct": "lift",
    "isolated": "lift",
    "lift_summary": "lift",
    "paired_answers": "lift",
    "scored_rollout": "lift",
    "seeded_sample": "lift",
    "choose_micro_batch": "micro_batch",
    "run_stage": "stage",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = import_module(f"{__name__}.{_EXPORTS[name]}")
        return module if _EXPORTS[name] == name else getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
