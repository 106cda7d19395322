"""The learning-rate schedule: transformers' scheduler definitions, read as a pure function of the step.

`optim.schedule` names one of transformers' schedulers (`transformers.get_scheduler`, the ones TRL's and the HF
Trainer's `lr_scheduler_type` take), with `optim.warmup_steps` and the stage's `optim.steps` as the warm-up and
training steps. adaptercl does not step a `LambdaLR`: the LR of a step is `optim.lr × factor(step) × scale`, where
`scale` is the collapse guard's rollback factor, set on the optimiser before each step. So a resumed or rolled-back
stage needs no scheduler state, and the factor is transformers' own `lr_lambda` (the LR the HF Trainer uses for its
0-based optimiser step `step`: with warm-up the first step's LR is 0, as there).

`constant` is transformers' `constant_with_warmup` (transformers' `constant` ignores warm-up; a recipe that asks for
warm-up steps means them). Schedulers that need extra arguments (`reduce_lr_on_plateau`, `cosine_with_min_lr`,
`warmup_stable_decay`, `greedy`, ...) are not offered, nor `polynomial` (its
factor depends on the initial LR through its absolute `lr_end`).
"""

from __future__ import annotations

from functools import cache

import torch
from transformers import get_scheduler

from adaptercl.recipe import OptimConfig

# optim.schedule -> the name transformers.get_scheduler takes
SCHEDULES: dict[str, str] = {
    "constant": "constant_with_warmup",
    "linear": "linear",
    "cosine": "cosine",
    "cosine_with_restarts": "cosine_with_restarts",
    "inverse_sqrt": "inverse_sqrt",
}


def learning_rate(optim: OptimConfig, step: int, scale: float = 1.0) -> float:
    """The learning rate of 0-based optimiser `step`: optim.lr × the schedule's factor × `scale` (the guard's)."""
    return optim.lr * scale * lr_factor(optim.schedule, optim.warmup_steps, optim.steps, step)


@cache
def _lr_lambda(schedule: str, warmup_steps: int, steps: int):
    """transformers' multiplicative factor function for the schedule (built once per setting)."""
    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = get_scheduler(SCHEDULES[schedule], dummy, num_warmup_steps=warmup_steps, num_training_steps=steps)
    return scheduler.lr_lambdas[0]


def lr_factor(schedule: str, warmup_steps: int, steps: int, step: int) -> float:
    """The schedule's factor at 0-based `step` of `steps` (transformers' lr_lambda)."""
    return float(_lr_lambda(schedule, warmup_steps, steps)(step))
