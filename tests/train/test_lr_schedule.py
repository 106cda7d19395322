"""The LR schedule is transformers' own: the LR adaptercl sets before 0-based step k equals the LR a stepped
transformers scheduler gives the optimiser for its k-th step (HF Trainer order: optimizer.step, then scheduler.step)."""

import pytest
import torch
from transformers import get_scheduler

from adaptercl.recipe.grammar import OptimConfig
from adaptercl.train.lr_schedule import SCHEDULES, learning_rate


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("warmup", [0, 3])
def test_lr_of_each_step_is_the_stepped_transformers_schedulers(schedule, warmup):
    optim = OptimConfig(lr=2e-4, steps=10, warmup_steps=warmup, schedule=schedule)
    param = torch.zeros(1, requires_grad=True)
    opt = torch.optim.AdamW([param], lr=optim.lr)
    sched = get_scheduler(SCHEDULES[schedule], opt, num_warmup_steps=warmup, num_training_steps=optim.steps)
    for step in range(optim.steps):
        assert learning_rate(optim, step) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12, abs=1e-15)
        opt.step()
        sched.step()


def test_constant_keeps_its_warmup_and_the_guard_scale_multiplies():
    optim = OptimConfig(lr=1e-3, steps=8, warmup_steps=4, schedule="constant")
    lrs = [learning_rate(optim, s) for s in range(8)]
    assert lrs == pytest.approx([0.0, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3, 1e-3])  # hand: step / warmup
    assert learning_rate(optim, 6, scale=0.5) == pytest.approx(5e-4)


def test_an_unknown_schedule_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="schedule"):
        OptimConfig(schedule="warmup_stable_decay")
