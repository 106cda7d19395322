"""Tests for adaptercl's distillation losses: divergences over full / top-k / sampled support, importance weights,
token masks, by hand computation and against TRL 1.16's experimental SDPO/SDFT
loss_utils."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from adaptercl.train.loss_terms import distill_term
from adaptercl.train.losses import (
    distillation_divergence,
    distillation_token_mask,
    gather_logprobs,
    importance_weights,
)

D = torch.float64


def _kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """KL(a‖b) over the last dim for probability tensors."""
    return (a * (a.log() - b.log())).sum(-1)


def _logits(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=D)


# ------------------------------------------------------------------------------------------ distillation

V = 5


def _pq(seed: int = 0):
    """Student and teacher logits [2, 3, V] and their probabilities."""
    s, t = _logits(2, 3, V, seed=seed), 1.5 * _logits(2, 3, V, seed=seed + 100)
    return s, t, torch.softmax(s, -1), torch.softmax(t, -1)


def test_full_divergences_match_hand_computation():
    s, t, p, q = _pq()
    torch.testing.assert_close(distillation_divergence(s, t, alpha=0.0), _kl(q, p))  # forward KL(q‖p)
    torch.testing.assert_close(distillation_divergence(s, t, alpha=1.0), _kl(p, q))  # reverse KL(p‖q)
    m = 0.5 * p + 0.5 * q
    torch.testing.assert_close(distillation_divergence(s, t, alpha=0.5), 0.5 * _kl(q, m) + 0.5 * _kl(p, m))
    # alpha=0.3 pins which distribution gets which weight: m = 0.7p + 0.3q, L = 0.3·KL(q‖m) + 0.7·KL(p‖m)
    m = 0.7 * p + 0.3 * q
    torch.testing.assert_close(distillation_divergence(s, t, alpha=0.3), 0.3 * _kl(q, m) + 0.7 * _kl(p, m))


def test_jsd_branch_tends_to_the_kls_at_the_ends():
    s, t, p, q = _pq(seed=1)
    a = 1e-5  # L(a)/a -> KL(q‖p) and L(1-a)/a -> KL(p‖q); relative error is O(a)
    torch.testing.assert_close(distillation_divergence(s, t, alpha=a) / a, _kl(q, p), rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(distillation_divergence(s, t, alpha=1 - a) / a, _kl(p, q), rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_topk_with_tail_is_nonnegative_and_equals_full_when_k_is_vocab(alpha):
    s, t, _, _ = _pq(seed=2)
    for k in range(1, V + 1):
        assert (distillation_divergence(s, t, alpha, "topk", topk=k) >= -1e-12).all()
    full = distillation_divergence(s, t, alpha)
    torch.testing.assert_close(distillation_divergence(s, t, alpha, "topk", topk=V), full, atol=1e-6, rtol=0)
    torch.testing.assert_close(distillation_divergence(s, t, alpha, "topk", topk=1000), full, atol=1e-6, rtol=0)


def test_topk_hand_computation_with_and_without_tail():
    s, t, p, q = _pq(seed=3)
    idx = torch.topk(s, k=2, dim=-1).indices  # student's top-2
    pk, qk = p.gather(-1, idx), q.gather(-1, idx)
    with_tail_p = torch.cat([pk, 1 - pk.sum(-1, keepdim=True)], -1)
    with_tail_q = torch.cat([qk, 1 - qk.sum(-1, keepdim=True)], -1)
    got = distillation_divergence(s, t, 0.0, "topk", topk=2, tail=True)
    torch.testing.assert_close(got, _kl(with_tail_q, with_tail_p))
    renorm_p, renorm_q = pk / pk.sum(-1, keepdim=True), qk / qk.sum(-1, keepdim=True)
    got = distillation_divergence(s, t, 0.0, "topk", topk=2, tail=False)
    torch.testing.assert_close(got, _kl(renorm_q, renorm_p))
    got = distillation_divergence(s, t, 1.0, "topk", topk=2, tail=False)
    torch.testing.assert_close(got, _kl(renorm_p, renorm_q))


def test_sampled_token_value_and_alpha_check():
    s, t, p, q = _pq(seed=4)
    ids = torch.randint(0, V, (2, 3), generator=torch.Generator().manual_seed(0))
    lp, lq = p.log().gather(-1, ids[..., None])[..., 0], q.log().gather(-1, ids[..., None])[..., 0]
    torch.testing.assert_close(distillation_divergence(s, t, 1.0, "sampled", sampled_ids=ids), (lp - lq) * lp)
    with pytest.raises(ValueError):
        distillation_divergence(s, t, 0.5, "sampled", sampled_ids=ids)
    with pytest.raises(ValueError):
        distillation_divergence(s, t, 1.0, "sampled")


def test_sampled_token_gradient_is_unbiased_for_reverse_kl():
    theta, teacher = _logits(V, seed=5).requires_grad_(True), 2.0 * _logits(V, seed=6)
    distillation_divergence(theta.view(1, 1, V), teacher.view(1, 1, V), 1.0).sum().backward()
    full_grad, theta.grad = theta.grad.clone(), None
    p = torch.softmax(theta, -1).detach()

    # Exact expectation by enumerating the vocabulary: sum_y p(y) * grad l(y) == grad KL(p‖q).
    all_ids = torch.arange(V).view(1, V)
    per_y = distillation_divergence(
        theta.expand(1, V, V), teacher.expand(1, V, V), 1.0, "sampled", sampled_ids=all_ids
    )
    (per_y[0] * p).sum().backward()
    torch.testing.assert_close(theta.grad, full_grad)
    theta.grad = None

    # Monte Carlo: 200k samples y ~ p (fixed seed). Per-coordinate estimator std here is < 1, so the standard error
    # is < 0.003; tolerance 0.02 absolute.
    m = 200_000
    ids = torch.multinomial(p, m, replacement=True, generator=torch.Generator().manual_seed(0)).view(1, m)
    mc = distillation_divergence(theta.expand(1, m, V), teacher.expand(1, m, V), 1.0, "sampled", sampled_ids=ids)
    mc.mean().backward()
    assert full_grad.abs().max() > 0.1  # the check is not vacuous
    torch.testing.assert_close(theta.grad, full_grad, atol=0.02, rtol=0)


@pytest.mark.parametrize(
    ("alpha", "support"), [(0.0, "full"), (0.5, "full"), (1.0, "full"), (0.5, "topk"), (1.0, "sampled")]
)
def test_teacher_gets_no_gradient(alpha, support):
    s, t, _, _ = _pq(seed=7)
    s, t = s.clone().requires_grad_(True), t.clone().requires_grad_(True)
    ids = torch.zeros(2, 3, dtype=torch.long)
    distillation_divergence(s, t, alpha, support, topk=3, sampled_ids=ids).sum().backward()
    assert t.grad is None
    assert s.grad is not None and s.grad.abs().sum() > 0


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("tail", [True, False])
def test_divergences_equal_trl_sdpo_sdft_loss_utils(alpha, tail):
    s, t, _, _ = _pq(seed=8)
    ids = torch.randint(0, V, (2, 3), generator=torch.Generator().manual_seed(1))
    for module in ("trl.experimental.sdpo.loss_utils", "trl.experimental.sdft.loss_utils"):
        lu = pytest.importorskip(module)
        full = lu.compute_full_logit_self_distillation_loss(s, t, distillation_alpha=alpha)
        torch.testing.assert_close(distillation_divergence(s, t, alpha), full)
        topk = lu.compute_topk_self_distillation_loss(
            s, t, distillation_topk=3, distillation_alpha=alpha, distillation_add_tail=tail
        )
        torch.testing.assert_close(distillation_divergence(s, t, alpha, "topk", topk=3, tail=tail), topk)
        if alpha == 1.0:
            sampled = lu.compute_sampled_token_self_distillation_loss(s, t, ids, distillation_alpha=1.0)
            torch.testing.assert_close(distillation_divergence(s, t, 1.0, "sampled", sampled_ids=ids), sampled)


@pytest.mark.parametrize("support", ["full", "topk", "sampled"])
def test_distill_term_equals_trl_loss_with_importance_clipping(support):
    """The term the training step adds (train.loss_terms.distill_term) is TRL's per-token loss times its clipped IS
    weight."""
    lu = pytest.importorskip("trl.experimental.sdpo.loss_utils")
    s, t, _, _ = _pq(seed=9)
    ids = torch.randint(0, V, (2, 3), generator=torch.Generator().manual_seed(2))
    alpha = 1.0 if support == "sampled" else 0.5
    logp = gather_logprobs(s, ids)
    old = logp - 0.3 * _logits(2, 3, seed=4)  # stale rollouts: weights on both sides of the cap
    if support == "full":
        trl = lu.compute_full_logit_self_distillation_loss(s, t, distillation_alpha=alpha)
    elif support == "topk":
        trl = lu.compute_topk_self_distillation_loss(
            s, t, distillation_topk=3, distillation_alpha=alpha, distillation_add_tail=True
        )
    else:
        trl = lu.compute_sampled_token_self_distillation_loss(s, t, ids, distillation_alpha=alpha)
    ours, stats = distill_term(s, t, logp, old, ids, alpha, support, topk=3, is_cap=2.0)
    torch.testing.assert_close(ours, lu.apply_importance_sampling_clipping(trl, logp, old, 2.0))
    assert set(stats) == {"teacher_divergence", "is_weight_mean"}


def test_importance_weights_match_trl_clipping():
    lu = pytest.importorskip("trl.experimental.sdpo.loss_utils")
    logp, old = _logits(3, 4), _logits(3, 4, seed=1)
    loss = _logits(3, 4, seed=2)
    torch.testing.assert_close(
        loss * importance_weights(logp, old, cap=2.0), lu.apply_importance_sampling_clipping(loss, logp, old, 2.0)
    )


# ------------------------------------------------------------------------------- weights, masks, teacher mix


def test_importance_weights_cap_and_rollout_factor():
    logp = torch.log(torch.tensor([[3.0, 0.5, 1.0]])).requires_grad_(True)
    old = torch.zeros(1, 3)
    torch.testing.assert_close(importance_weights(logp, old), torch.tensor([[2.0, 0.5, 1.0]]))
    rollout = -torch.log(torch.tensor([[1.5, 4.0, 0.25]]))  # exp(old - rollout) = [1.5, 4 -> 2, 0.25]
    got = importance_weights(logp, old, rollout, cap=2.0)
    torch.testing.assert_close(got, torch.tensor([[3.0, 1.0, 0.25]]))
    assert not got.requires_grad


def test_distillation_token_mask_skips_first_response_tokens_any_padding():
    right = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    assert distillation_token_mask(right, skip_first=2).tolist() == [[0, 0, 1, 1, 0], [0] * 5, [0, 0, 1, 0, 0]]
    left = torch.tensor([[0, 1, 1, 1, 1]])
    assert distillation_token_mask(left, skip_first=3).tolist() == [[0, 0, 0, 0, 1]]
    assert distillation_token_mask(right).tolist() == right.float().tolist()


def test_distillation_token_mask_ratio_statistics_and_seeding():
    response = torch.ones(200, 500)
    response[:, 400:] = 0
    mask = distillation_token_mask(response, mask_ratio=0.3, generator=torch.Generator().manual_seed(0))
    assert mask[:, 400:].sum() == 0
    kept = mask[:, :400].mean().item()
    assert kept == pytest.approx(0.7, abs=0.01)  # 80k Bernoulli(0.7) draws: std 0.0016
    again = distillation_token_mask(response, mask_ratio=0.3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(mask, again)
    with pytest.raises(ValueError):
        distillation_token_mask(response, mask_ratio=1.0)


# ------------------------------------------------------------- aggregated loss against TRL's SDPO / SDFT trainers


def _trl_self_distillation_loss(trainer_path, student, teacher, ids, loss_mask, old_logp, mode, alpha, is_cap):
    """Run TRL 1.16 `{SDPO,SDFT}Trainer._compute_self_distillation_loss` on a stub `self` (1 process): its divergence,
    clipped importance weight and aggregation `(l·m).sum(-1) / m.sum(-1).clamp(min=1)` then `.mean()` over ALL
    sequences (sdpo_trainer.py:1252-1255, sdft_trainer.py:890-893), unmodified."""
    module_name, class_name = trainer_path.rsplit(".", 1)
    trainer = getattr(pytest.importorskip(module_name), class_name)
    args = SimpleNamespace(
        distillation_mode=mode,
        distillation_topk=3,
        distillation_alpha=alpha,
        distillation_add_tail=True,
        distillation_is_clip=is_cap,
    )
    stub = SimpleNamespace(
        args=args,
        accelerator=SimpleNamespace(gather=lambda x: x),
        _log_self_distillation_metric=lambda mode, value: None,
    )
    logits = SimpleNamespace(
        completion_ids=ids,
        completion_mask=(loss_mask > 0).long(),
        loss_mask=loss_mask,
        student_logits=student,
        teacher_logits=teacher,
    )
    model = SimpleNamespace(training=True)
    return trainer._compute_self_distillation_loss(stub, model, {"old_per_token_logps": old_logp}, logits)


@pytest.mark.parametrize(
    ("trainer_path", "alpha"),
    [("trl.experimental.sdpo.sdpo_trainer.SDPOTrainer", 0.5), ("trl.experimental.sdft.sdft_trainer.SDFTTrainer", 0.0)],
)
@pytest.mark.parametrize(("mode", "support"), [("full_logits", "full"), ("topk_logits", "topk")])
def test_distillation_step_equals_trl_trainer_with_rows_without_target(trainer_path, alpha, mode, support):
    """What train_step does for sdpo/sdft (default `seq_mean_token_mean_all`): per micro-batch, the distillation term
    of the rows with a target only, aggregated with the whole batch's mask as denominator; rows 1 and 4 have no
    target and micro-batches of 2 and 4 rows (grad_accum) are summed. Equal to TRL's value and student gradient."""
    from adaptercl.train.loss_terms import distill_term
    from adaptercl.train.losses import gather_logprobs, micro_batch_aggregate

    n, t = 6, 4
    student_base, teacher = _logits(n, t, V, seed=20), 1.5 * _logits(n, t, V, seed=21)
    ids = torch.randint(0, V, (n, t), generator=torch.Generator().manual_seed(22))
    lengths = torch.tensor([4, 2, 3, 1, 4, 2]).unsqueeze(1)
    has_target = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=D).unsqueeze(1)
    mask = (torch.arange(t) < lengths).to(D) * has_target  # [N, T], rows 1 and 4 all 0
    old_logp = gather_logprobs(student_base, ids) + 0.5 * _logits(n, t, seed=23)  # weights on both sides of the cap

    student_trl = student_base.clone().requires_grad_(True)
    trl_loss = _trl_self_distillation_loss(trainer_path, student_trl, teacher, ids, mask, old_logp, mode, alpha, 2.0)
    trl_loss.backward()

    student = student_base.clone().requires_grad_(True)
    ours = student.new_zeros(())
    for rows in (slice(0, 2), slice(2, 6)):
        keep = (mask[rows].sum(-1) > 0).nonzero().squeeze(-1)  # as train.step._distillation
        s_mb = student[rows][keep]
        per_token, _ = distill_term(
            s_mb,
            teacher[rows][keep],
            gather_logprobs(s_mb, ids[rows][keep]),
            old_logp[rows][keep],
            ids[rows][keep],
            alpha,
            support,
            topk=3,
            tail=True,
            is_cap=2.0,
        )
        ours = ours + micro_batch_aggregate(per_token, mask[rows][keep], mask, "seq_mean_token_mean_all")
    ours.backward()

    torch.testing.assert_close(ours, trl_loss)
    torch.testing.assert_close(student.grad, student_trl.grad)
    assert student.grad[1].abs().sum() == 0 and student.grad[0].abs().sum() > 0
    # the departure the reference mode replaces: verl's seq_mean_token_mean averages over the 4 rows with a target
    verl = micro_batch_aggregate(
        distill_term(student, teacher, gather_logprobs(student, ids), old_logp, ids, alpha, support, 3)[0],
        mask,
        mask,
        "seq_mean_token_mean",
    )
    torch.testing.assert_close(verl * 4 / 6, trl_loss)
