"""train/token_terms: the distillation divergence on the rows with a teacher target is the pure function's on
exactly those rows, bit for bit, and so is its gradient: when every row has a target the student's logits are used as
they are (no copy of the whole [n, R, V] tensor, nor of its gradient), otherwise the selected rows."""

from __future__ import annotations

import pytest
import torch

from adaptercl.recipe.method_blocks import DistillConfig
from adaptercl.train.losses import distillation_divergence
from adaptercl.train.token_terms import _terms


@pytest.mark.parametrize("rows", [[0, 1, 2], [0, 2], [1]])
@pytest.mark.parametrize("support", ["topk", "full"])
def test_the_divergence_is_the_pure_functions_on_the_target_rows(rows, support):
    torch.manual_seed(0)
    n, t, v = 3, 5, 40
    logits = torch.randn(n, t, v, requires_grad=True)
    teacher = torch.randn(len(rows), t, v)
    ids = torch.randint(v, (n, t))
    target_rows = torch.tensor(rows)
    distill = DistillConfig(alpha=0.5, support=support, topk=7, tail=True)
    terms = _terms(logits, ids, None, teacher, target_rows, distill)
    (grad,) = torch.autograd.grad(terms.divergence.sum(), logits)

    reference = logits.detach().clone().requires_grad_(True)
    expected = distillation_divergence(reference[target_rows], teacher, 0.5, support, 7, True, ids[target_rows])
    (expected_grad,) = torch.autograd.grad(expected.sum(), reference)
    assert torch.equal(terms.divergence, expected) and torch.equal(grad, expected_grad)
    others = [r for r in range(n) if r not in rows]
    assert torch.all(grad[others] == 0)  # rows without a target get no distillation gradient
