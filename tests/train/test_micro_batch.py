"""`optim.micro_batch_size` (`adaptercl/train/micro_batch.py`): what a stage trains with where there is no CUDA device,
for each setting, and the one-line errors of a bad value. The auto choice on a card is in
tests/plan/test_memory_plan.py (the plan) and tests/run/test_run.py (a run on a faked card, whose update equals one
micro-batch's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from adaptercl.cli import main
from adaptercl.domains import load_domain
from adaptercl.model.base import load_base
from adaptercl.recipe.grammar import resolve_recipe
from adaptercl.train.micro_batch import choose_micro_batch

QUICKSTART = str(Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml")


def recipe(**optim):
    raw = {
        "model": {"name": "tiny-random"},
        "output_dir": "unused",
        "optim": {"prompts_per_step": 4, "grad_accum": 4, **optim},
        "rollout": {"group_size": 4},
        "domains": [{"name": "arith", "source": "builtin:arithmetic"}],
        "stages": [{"name": "one", "domain": "arith"}],
    }
    return resolve_recipe(raw)


@pytest.fixture(scope="module")
def tiny():
    base = load_base(recipe().model, "none")
    return base.model, base.tokenizer, load_domain(recipe().domains[0], 0, 2)


def test_without_cuda_auto_is_grad_accums_split_and_says_so(tiny):
    model, tok, domain = tiny
    chosen = choose_micro_batch(recipe(micro_batch_size="auto"), 0, model, tok, [domain])
    assert chosen.rows == 4  # 16 sequences in grad_accum's 4 micro-batches
    assert chosen.record == {
        "setting": "auto",
        "sequences": 16,
        "micro_batch_size": 4,
        "why": "auto without a CUDA device: optim.grad_accum's split into 4",
    }
    assert (
        chosen.line()
        == "micro-batch 4 of 16 sequences a step (auto without a CUDA device: optim.grad_accum's split into 4)"
    )
    assert choose_micro_batch(recipe(micro_batch_size="auto"), 0, model, tok, [domain], world_size=2).rows == 2


def test_a_number_is_that_many_sequences_and_unset_is_as_before(tiny):
    model, tok, domain = tiny
    assert choose_micro_batch(recipe(micro_batch_size=3), 0, model, tok, [domain]).rows == 3
    assert choose_micro_batch(recipe(micro_batch_size=64), 0, model, tok, [domain]).rows == 16  # at most a step
    unset = choose_micro_batch(recipe(), 0, model, tok, [domain])
    assert unset.rows is None and unset.record is None  # grad_accum's split; nothing said or written
    assert (
        recipe().stages[0].optim.split_rows(16) == 4 and recipe(micro_batch_size=3).stages[0].optim.split_rows(16) == 3
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.micro_batch_size=0", "stages.arithmetic.optim.micro_batch_size: must be 'auto' or an int >= 1"),
        ("optim.micro_batch_size=most", "stages.arithmetic.optim.micro_batch_size: must be 'auto' or an int >= 1"),
        ("rollout.gpu_memory_utilization=1.2", "stages.arithmetic.rollout.gpu_memory_utilization: must be 'auto' or"),
    ],
)
def test_a_bad_setting_is_one_line_naming_the_field(capsys, override, message):
    assert main(["recipe", "validate", QUICKSTART, override]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1
