"""Tests for adaptercl.train.losses, GRPO side (distillation: test_distillation_losses.py): hand computations on tiny
tensors, and equality with TRL 1.16's GRPO loss via a stub trainer."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from adaptercl.train.loss_terms import policy_term
from adaptercl.train.losses import (
    aggregate,
    clipped_policy_loss,
    gather_logprobs,
    group_advantages,
    k3_kl,
    micro_batch_aggregate,
    token_entropy,
    zero_variance_group_fraction,
)

D = torch.float64


def _logits(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=D)


# ------------------------------------------------------------------------------------------------ advantages


def test_group_advantages_dr_grpo_subtracts_group_mean_only():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    adv = group_advantages(rewards, group_size=4)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]))


def test_group_advantages_scaled_by_bessel_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(rewards, group_size=4, scale_by_std=True)
    std = math.sqrt(4 * 0.25 / 3)  # unbiased std of [1, 0, 0, 1]
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    expected[:4] /= std + 1e-4
    torch.testing.assert_close(adv, expected)


def test_group_advantages_std_matches_trl_nanstd():
    nanstd = pytest.importorskip("trl.trainer.utils").nanstd
    rewards = torch.tensor([0.3, 0.9, 0.1, 0.7, 0.2, 0.2, 0.5, 0.0])
    grouped = rewards.view(-1, 4)
    trl_adv = (grouped - grouped.mean(1, keepdim=True)) / (nanstd(grouped, dim=1).unsqueeze(1) + 1e-4)
    torch.testing.assert_close(group_advantages(rewards, 4, scale_by_std=True), trl_adv.view(-1))


def test_group_advantages_group_of_one_is_zero_not_nan():
    assert torch.equal(group_advantages(torch.tensor([0.3, 1.0]), 1, scale_by_std=True), torch.zeros(2))


def trl_advantages(per_func: torch.Tensor, weights: torch.Tensor, num_generations: int, scale_rewards: str):
    """TRL 1.16 GRPOTrainer._generate_and_score_completions, `sum_then_normalize` with scale_rewards "group" or
    "none" (trl/trainer/grpo_trainer.py lines 2759-2810), line for line; per_func [N, F], NaN where a function
    returned None -> advantages [N]."""
    from trl.trainer.utils import nanstd

    unscorable_mask = torch.isnan(per_func).all(dim=1)
    rewards = (per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if num_generations > 1:
        std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
        std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
    else:
        std_rewards = torch.zeros_like(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def test_trl_advantage_transcript_matches_the_installed_trl():
    """The lines `trl_advantages` transcribes are those of the installed TRL (read, not imported: seconds)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("trl.trainer.grpo_trainer")
    if spec is None:
        pytest.skip("trl is not installed")
    source = Path(spec.origin).read_text()
    for line in (
        "unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)",
        "rewards = (rewards_per_func * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)",
        "rewards[unscorable_mask] = torch.nan",
        "mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)",
        "std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)",
        "advantages = advantages / (std_rewards + 1e-4)",
        "advantages = torch.nan_to_num(advantages, nan=0.0)",
    ):
        assert line in source, line


NAN = math.nan
UNSCORED_GROUPS = {  # per-function rewards [N, F] in groups of 4, NaN = None
    "the issue's [1, 1, None, 0]": [[1.0], [1.0], [NAN], [0.0]],
    "every sample None": [[NAN], [NAN], [NAN], [NAN]],
    "one scored sample": [[NAN], [0.7], [NAN], [NAN]],
    "two functions, partly None": [[1.0, NAN], [NAN, 0.5], [NAN, NAN], [0.0, 0.25]],
    "a scored group beside": [[1.0, 0.0], [0.0, 1.0], [NAN, NAN], [1.0, 1.0], [0.3, 0.1], [0.0, 0.0], [1.0, 0.5],
                              [0.2, NAN]],
}  # fmt: skip


@pytest.mark.parametrize("scale", [False, True])
@pytest.mark.parametrize("name", sorted(UNSCORED_GROUPS))
def test_unscored_samples_get_trls_advantages(name, scale):
    """A sample for which every reward function returned None: out of its group's baseline and std, advantage 0,
    as TRL 1.16 (our rewards come from trl_rewards.weighted_reward, as the stage's)."""
    pytest.importorskip("trl.trainer.utils")
    from adaptercl.domains.trl_rewards import weighted_reward

    per_func = torch.tensor(UNSCORED_GROUPS[name], dtype=D)  # [N, F]
    weights = torch.tensor([1.0, 2.0][: per_func.shape[1]], dtype=D)  # [F]
    rewards, unscorable = weighted_reward(per_func, weights)  # [N], [N]
    ours = group_advantages(rewards, 4, scale_by_std=scale, scored=~unscorable)
    expected = trl_advantages(per_func, weights, 4, "group" if scale else "none")
    # Both in float64, except that TRL's nanstd forms its Bessel factor count / (count - 1) from integer tensors, so
    # in float32: relative error <= 2^-24 (6e-8), halved by the sqrt (3e-8); rtol 1e-7 covers it. The rest is float64
    # roundings on values of order 1 (~1e-15 each), hence atol 1e-12.
    torch.testing.assert_close(ours, expected, rtol=1e-7, atol=1e-12)


def test_unscored_sample_advantages_by_hand():
    rewards, scored = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=D), torch.tensor([True, True, False, True])
    torch.testing.assert_close(group_advantages(rewards, 4, scored=scored), torch.tensor([1, 1, 0, -2], dtype=D) / 3)
    # all scored: the unmasked path, bit for bit
    assert torch.equal(
        group_advantages(rewards, 4, scored=torch.ones(4, dtype=torch.bool)), group_advantages(rewards, 4)
    )
    # a scored NaN reward still poisons its group (the collapse guard's non-finite step)
    poisoned = group_advantages(torch.tensor([NAN, 1.0, 0.0, 0.0]), 4, scored=scored)
    assert poisoned[[0, 1, 3]].isnan().all() and poisoned[2] == 0


def test_group_advantages_rejects_ragged_groups():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(6), group_size=4)


def test_zero_variance_group_fraction():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0])  # groups of 2: [1,1] [0,0] [0,0] [1,0]
    assert zero_variance_group_fraction(rewards, 2) == pytest.approx(0.75)
    assert zero_variance_group_fraction(rewards, 4) == pytest.approx(0.0)


# ------------------------------------------------------------------------------------------------ policy loss

RATIOS = [0.5, 0.9, 1.0, 1.2, 1.5]


def _ratio_inputs(advantages: list[float], ratios: list[float] = RATIOS):
    logp = torch.log(torch.tensor([ratios] * len(advantages), dtype=D)).requires_grad_(True)  # logp_old = 0
    return logp, torch.zeros_like(logp), torch.tensor(advantages, dtype=D)


def test_clipped_policy_loss_hand_values_and_clip_masks():
    logp, logp_old, adv = _ratio_inputs([1.0, -1.0])
    loss, low, high = clipped_policy_loss(logp, logp_old, adv, eps_low=0.2, eps_high=0.28)
    # A>0: -min(rho, clip(rho, 0.8, 1.28)); A<0: max(rho, clip(rho, 0.8, 1.28))
    expected = torch.tensor([[-0.5, -0.9, -1.0, -1.2, -1.28], [0.8, 0.9, 1.0, 1.2, 1.5]], dtype=D)
    torch.testing.assert_close(loss, expected)
    assert high.tolist() == [[False, False, False, False, True], [False] * 5]
    assert low.tolist() == [[False] * 5, [True, False, False, False, False]]
    # d loss / d logp = -A * rho where the unclipped branch is active, 0 where the clip is active.
    loss.sum().backward()
    expected_grad = torch.tensor([[-0.5, -0.9, -1.0, -1.2, 0.0], [0.0, 0.9, 1.0, 1.2, 1.5]], dtype=D)
    torch.testing.assert_close(logp.grad, expected_grad)


def test_clipped_policy_loss_dual_clip_caps_negative_advantages_only():
    logp, logp_old, adv = _ratio_inputs([1.0, -1.0, -2.0], ratios=[0.5, 2.0, 5.0])
    loss, _, _ = clipped_policy_loss(logp, logp_old, adv, dual_clip=3.0)
    expected = torch.tensor(
        [[-0.5, -1.28, -1.28], [0.8, 2.0, 3.0], [1.6, 4.0, 6.0]],  # row 2: -A*rho=10 capped at -A*c=6
        dtype=D,
    )
    torch.testing.assert_close(loss, expected)
    no_dual, _, _ = clipped_policy_loss(logp, logp_old, adv)
    assert no_dual[1, 2].item() == pytest.approx(5.0) and no_dual[2, 2].item() == pytest.approx(10.0)
    with pytest.raises(ValueError):
        clipped_policy_loss(logp, logp_old, adv, dual_clip=0.5)


def test_k3_kl_hand_value():
    logp = torch.log(torch.tensor([[0.5, 0.3]]))
    ref = torch.log(torch.tensor([[0.25, 0.3]]))
    expected = 0.5 - math.log(0.5) - 1.0  # exp(d) - d - 1 with d = log(0.25/0.5)
    torch.testing.assert_close(k3_kl(logp, ref), torch.tensor([[expected, 0.0]]))


# ------------------------------------------------------------------------------------------------ aggregation

VALUES = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "max_len", "expected"),
    [
        ("token_mean", None, (1 + 2 + 3 + 10) / 4),
        ("seq_mean_token_mean", None, ((1 + 2 + 3) / 3 + 10 / 1) / 2),
        ("seq_mean_token_mean_all", None, ((1 + 2 + 3) / 3 + 10 / 1) / 2),
        ("seq_mean_token_sum_norm", None, ((1 + 2 + 3) / 4 + 10 / 4) / 2),
        ("seq_mean_token_sum_norm", 8, ((1 + 2 + 3) / 8 + 10 / 8) / 2),
    ],
)
def test_aggregate_hand_values(mode, max_len, expected):
    assert aggregate(VALUES, MASK, mode, max_len).item() == pytest.approx(expected)


def test_aggregate_empty_sequence_handling():
    values = torch.cat([VALUES, torch.tensor([[7.0, 7.0, 7.0, 7.0]])])
    mask = torch.cat([MASK, torch.zeros(1, 4, dtype=MASK.dtype)])
    # seq_mean_token_mean leaves the empty sequence out of the denominator (verl/SDPO agg_loss) ...
    assert aggregate(values, mask, "seq_mean_token_mean").item() == pytest.approx((2.0 + 10.0) / 2)
    # ... token_mean is unchanged, and seq_mean_token_sum_norm averages over all 3 sequences (TRL dr_grpo).
    assert aggregate(values, mask, "token_mean").item() == pytest.approx(4.0)
    assert aggregate(values, mask, "seq_mean_token_sum_norm").item() == pytest.approx((6.0 + 10.0) / 4 / 3)
    # seq_mean_token_mean_all counts the empty sequence as 0 over all 3 (SDPO/SDFT references, TRL loss_type="grpo")
    assert aggregate(values, mask, "seq_mean_token_mean_all").item() == pytest.approx((2.0 + 10.0) / 3)
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_mean_all", "seq_mean_token_sum_norm"):
        assert aggregate(values, torch.zeros_like(mask), mode).item() == 0.0


def test_reference_distillation_aggregation_on_a_batch_where_few_samples_have_a_target():
    # 4 sequences, 2 with a teacher target: one token of loss 1, three tokens of loss 3 (issue 16's toy batch).
    values = torch.tensor([[1.0, 0.0, 0.0], [3.0, 3.0, 3.0], [5.0, 5.0, 5.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [0, 0, 0], [0, 0, 0]])
    trl_reference = ((values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()  # sdpo_trainer.py:1252-1255
    assert trl_reference.item() == pytest.approx(1.0)
    assert aggregate(values, mask, "seq_mean_token_mean_all").item() == pytest.approx(1.0)
    assert aggregate(values, mask, "token_mean").item() == pytest.approx(2.5)  # the departures it replaces
    assert aggregate(values, mask, "seq_mean_token_mean").item() == pytest.approx(2.0)
    # Micro-batches of 1, 2 and 1 rows (grad_accum) add up to the whole batch's value.
    rows = (slice(0, 1), slice(1, 3), slice(3, 4))
    parts = [micro_batch_aggregate(values[r], mask[r], mask, "seq_mean_token_mean_all") for r in rows]
    assert sum(parts).item() == pytest.approx(1.0)


def test_aggregate_rejects_unknown_mode():
    with pytest.raises(ValueError):
        aggregate(VALUES, MASK, "sum")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_mean_all", "seq_mean_token_sum_norm"]
)
def test_zero_advantage_gives_zero_loss_and_zero_gradient(mode):
    logp = _logits(4, 6).requires_grad_(True)
    logp_old = _logits(4, 6, seed=1)
    token_loss, _ = policy_term(logp, logp_old, torch.zeros(4, dtype=D))
    loss = micro_batch_aggregate(token_loss, torch.ones(4, 6), torch.ones(4, 6), mode)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(logp.grad) == 0


def test_policy_term_stats_and_kl_requires_ref():
    logp, logp_old, adv = _ratio_inputs([1.0, -1.0])
    _, stats = policy_term(logp, logp_old, adv)
    means = {k: aggregate(v, torch.ones(2, 5), "token_mean").item() for k, v in stats.items() if "clip" in k}
    assert means == {"clip_low_frac": pytest.approx(0.1), "clip_high_frac": pytest.approx(0.1)}
    with pytest.raises(ValueError):
        policy_term(logp, logp_old, adv, kl_coef=0.1)


# ------------------------------------------------------------------------------- GRPO against TRL's own code


def _trl_grpo_loss(loss_type, logp, logp_old, logp_ref, advantages, mask, beta, eps_low, eps_high, max_len):
    """Run TRL 1.16 GRPOTrainer._compute_loss on a stub `self`. The model forward is replaced by returning `logp`, so
    what is compared is TRL's ratio, clipping, k3 KL and per-loss-type aggregation code path, unmodified; TRL's
    advantage computation, generation and accelerate scaling (1 process, no accumulation) are not exercised."""
    grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")

    def reduce(x, reduction="sum"):  # single process: nothing to reduce
        return x

    stub = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None),
        loss_type=loss_type,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        use_vllm=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=max_len,
        _entropy_bonus_enabled=False,
        accelerator=SimpleNamespace(reduce=reduce, gather=lambda x: x, num_processes=1),
        _metrics={"train": defaultdict(list)},
    )
    stub.args.steps_per_generation = 1
    n, t = logp.shape
    inputs = {
        "prompt_ids": torch.zeros(n, 1, dtype=torch.long),
        "prompt_mask": torch.ones(n, 1, dtype=torch.long),
        "completion_ids": torch.zeros(n, t, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "old_per_token_logps": logp_old,
        "ref_per_token_logps": logp_ref,
        "num_items_in_batch": mask.sum(),
    }
    return grpo_trainer.GRPOTrainer._compute_loss(stub, None, inputs), stub._metrics["train"]


@pytest.mark.parametrize(
    ("loss_type", "aggregation"),
    [
        ("dapo", "token_mean"),
        ("bnpo", "token_mean"),
        ("grpo", "seq_mean_token_mean"),
        ("grpo", "seq_mean_token_mean_all"),
        ("dr_grpo", "seq_mean_token_sum_norm"),
    ],
)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_loss_equals_trl_grpo_trainer(loss_type, aggregation, beta):
    n, t, max_len = 6, 7, 10
    logp_old = -_logits(n, t).abs()
    logp_ref = -_logits(n, t, seed=2).abs()
    logp_base = logp_old + 0.4 * _logits(n, t, seed=3)  # ratios on both sides of both clip edges
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0], dtype=D), 3)
    mask = (torch.arange(t) < torch.tensor([7, 5, 3, 6, 1, 4]).unsqueeze(1)).long()  # every sequence non-empty

    logp_trl = logp_base.clone().requires_grad_(True)
    trl_loss, trl_metrics = _trl_grpo_loss(
        loss_type, logp_trl, logp_old, logp_ref, advantages, mask, beta, 0.2, 0.28, max_len
    )
    trl_loss.backward()

    # What the training step does (train.step.train_on_batch): the policy term of each micro-batch aggregated with
    # the whole batch's denominator, summed over micro-batches; here micro-batches of 2 and 4 rows.
    logp_ours = logp_base.clone().requires_grad_(True)
    ours, metrics = 0.0, {"clip_low_frac": 0.0, "clip_high_frac": 0.0}
    for rows in (slice(0, 2), slice(2, 6)):
        per_token, stats = policy_term(
            logp_ours[rows], logp_old[rows], advantages[rows], 0.2, 0.28, logp_ref=logp_ref[rows], kl_coef=beta
        )
        ours = ours + micro_batch_aggregate(per_token, mask[rows], mask, aggregation, max_len)
        share = mask[rows].sum() / mask.sum()
        for k in metrics:
            metrics[k] += (aggregate(stats[k], mask[rows], "token_mean") * share).item()
    ours.backward()

    assert metrics["clip_low_frac"] > 0 and metrics["clip_high_frac"] > 0  # both clip edges are exercised
    torch.testing.assert_close(ours, trl_loss)
    torch.testing.assert_close(logp_ours.grad, logp_trl.grad)
    assert metrics["clip_low_frac"] == pytest.approx(trl_metrics["clip_ratio/low_mean"][0])
    assert metrics["clip_high_frac"] == pytest.approx(trl_metrics["clip_ratio/high_mean"][0])


# ------------------------------------------------------------------------------------- per-token quantities


def test_gather_logprobs_matches_log_softmax_and_trl():
    logits, ids = _logits(3, 4, 11), torch.randint(0, 11, (3, 4), generator=torch.Generator().manual_seed(0))
    expected = torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(gather_logprobs(logits, ids), expected)
    selective_log_softmax = pytest.importorskip("trl.trainer.utils").selective_log_softmax
    torch.testing.assert_close(gather_logprobs(logits, ids), selective_log_softmax(logits, ids))
    bf16 = gather_logprobs(logits.to(torch.bfloat16), ids)
    assert bf16.dtype == torch.float32
    torch.testing.assert_close(bf16, expected.float(), atol=0.05, rtol=0.02)


def test_token_entropy_hand_values():
    uniform, peaked = torch.zeros(1, 1, 8, dtype=D), torch.tensor([[[0.0, -100.0, -100.0]]], dtype=D)
    assert token_entropy(uniform).item() == pytest.approx(math.log(8))
    assert token_entropy(peaked).item() == pytest.approx(0.0, abs=1e-12)
    logits = _logits(2, 3, 5)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(token_entropy(logits, chunk_size=4), -(p * p.log()).sum(-1))
