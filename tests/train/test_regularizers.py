"""Continual regularisers and the hybrid method: pure-math directions, weight-0 exactness, replay, hybrid stages."""

from __future__ import annotations

import json

import pytest
import torch

from adaptercl.adapters.live import attach_adapter, lora_parameters, use_adapters
from adaptercl.model.base import load_base
from adaptercl.recipe.grammar import DistillConfig, resolve_recipe
from adaptercl.rollout.hf import HFEngine
from adaptercl.teacher.kinds import create_teacher
from adaptercl.teacher.prompts import hybrid_teacher_prompts
from adaptercl.train import regularizers as regs_mod
from adaptercl.train.context import StageContext, prompts_for_step, step_seed
from adaptercl.train.losses import kl_to_previous
from adaptercl.train.regularizers import (
    REPLAY_COUNT_SEED,
    lora_delta_distance_sq,
    lora_overlap_sq,
    replay_count,
    replay_examples,
    replay_plan,
)
from adaptercl.train.sparse_targets import top_entropy_mask
from adaptercl.train.stage import run_stage
from tests.train.test_distill_stage import ToyDomain, ToyExample, recipe

PREV, STUDENT = "stage-01-prev", "stage-02-now"

# ------------------------------------------------------------------------------------------------- pure math


def test_l2_distance_matches_the_dense_delta_and_its_gradient_pulls_towards_the_previous_delta():
    g = torch.Generator().manual_seed(0)
    A, B = torch.randn(3, 7, generator=g, dtype=torch.float64), torch.randn(5, 3, generator=g, dtype=torch.float64)
    A0, B0 = torch.randn(3, 7, generator=g, dtype=torch.float64), torch.randn(5, 3, generator=g, dtype=torch.float64)
    dense = (1.5 * B @ A - 1.5 * B0 @ A0).square().sum()
    A.requires_grad_(True), B.requires_grad_(True)
    value = lora_delta_distance_sq(A, B, A0, B0, 1.5)
    assert value.item() == pytest.approx(dense.item(), rel=1e-10)
    value.backward()
    with torch.no_grad():
        after = lora_delta_distance_sq(A - 1e-3 * A.grad, B - 1e-3 * B.grad, A0, B0, 1.5)
    assert after < value  # a gradient step moves ΔW towards ΔW_0
    assert lora_delta_distance_sq(A0, B0, A0, B0, 1.5).item() == pytest.approx(0.0, abs=1e-10)


def test_orthogonality_gradient_reduces_the_overlap():
    g = torch.Generator().manual_seed(1)
    A, A_old = torch.randn(4, 9, generator=g).requires_grad_(True), torch.randn(2, 9, generator=g)
    value = lora_overlap_sq(A, A_old)
    assert value.item() == pytest.approx((A @ A_old.T).square().sum().item(), rel=1e-6)
    value.backward()
    assert lora_overlap_sq(A.detach() - 1e-2 * A.grad, A_old) < value
    assert lora_overlap_sq(torch.eye(4, 9), torch.eye(9)[4:6]).item() == 0.0  # orthogonal rows: no overlap


def test_kl_gradient_pulls_the_policy_towards_the_previous_one():
    g = torch.Generator().manual_seed(2)
    logits, prev = torch.randn(2, 3, 11, generator=g).requires_grad_(True), torch.randn(2, 3, 11, generator=g)
    kl = kl_to_previous(logits, prev)  # [2, 3]
    p, q = logits.softmax(-1), prev.softmax(-1)
    torch.testing.assert_close(kl, (p * (p.log() - q.log())).sum(-1))
    kl.sum().backward()
    assert kl_to_previous(logits.detach() - 0.5 * logits.grad, prev).sum() < kl.sum()
    assert float(kl_to_previous(prev, prev).abs().max()) < 1e-6


def test_replay_count_and_draws_are_deterministic():
    assert replay_count(0.0, 4, 2) == 0 and replay_count(0.5, 4, 0) == 0 and replay_count(0.5, 1, 2) == 0
    assert replay_count(0.5, 4, 1) == 2 and replay_count(0.01, 4, 1) == 1 and replay_count(0.9, 4, 1) == 3
    domains = [ToyDomain(), ToyDomain()]
    a, b = replay_examples(domains, 5, seed=7), replay_examples(domains, 5, seed=7)
    assert [(ex.id, id(d)) for ex, d in a] == [(ex.id, id(d)) for ex, d in b]


def test_stochastic_replay_count_is_the_fraction_in_expectation_and_fixed_by_the_step_seed():
    # 1 % of 4 prompts: at_least_one replays 1 every step (25 %); stochastic 1 on about 1 step in 25
    counts = [replay_count(0.01, 4, 1, "stochastic", seed) for seed in range(4000)]
    assert set(counts) == {0, 1} and 0.03 < sum(counts) / 4000 < 0.05
    assert counts == [replay_count(0.01, 4, 1, "stochastic", seed) for seed in range(4000)]  # the same draws
    tenth = [replay_count(0.6, 4, 1, "stochastic", seed) for seed in range(4000)]  # 2.4 prompts: 2 or 3
    assert set(tenth) == {2, 3} and 2.35 < sum(tenth) / 4000 < 2.45
    assert max(replay_count(0.9, 4, 1, "stochastic", seed) for seed in range(200)) == 3  # 3.6: capped at 3
    assert replay_count(0.01, 4, 0, "stochastic", 0) == 0 and replay_count(0.5, 1, 2, "stochastic", 0) == 0

    class Cfg:
        replay_fraction, replay_rounding = 0.5, "at_least_one"

    assert replay_plan(Cfg, 4, 1, 0) == (2, 2)  # the own prompts take a 2-wide slice of the data order
    Cfg.replay_rounding = "stochastic"
    assert replay_plan(Cfg, 4, 1, 0) == (2, 4)  # their step's full slice, its last two left out


def test_hybrid_teacher_prompts_only_failed_groups_with_demonstration_or_feedback():
    cfg = DistillConfig(alpha=1.0)
    prompts = [[{"role": "user", "content": f"q{i // 2}"}] for i in range(4)]  # 2 groups of 2
    succeeded, feedbacks = [True, False, False, False], [None, "fb", "fb", None]
    demos = [None, None, "DEMO", "DEMO"]
    out = hybrid_teacher_prompts(prompts, ["r0", "r1", "r2", "r3"], succeeded, feedbacks, demos, 2, cfg, True)
    assert out.has_target == [False, False, True, True]  # group 1 has a success: GRPO handles it
    assert "DEMO" in out.messages[2][-1]["content"] and "fb" in out.messages[2][-1]["content"]
    assert "fb" not in out.messages[3][-1]["content"] and out.used_feedback == [False, False, True, False]
    everywhere = hybrid_teacher_prompts(prompts, ["r0", "r1", "r2", "r3"], succeeded, feedbacks, demos, 2, cfg, False)
    assert everywhere.has_target == [False, True, True, True] and "r0" in everywhere.messages[1][-1]["content"]


def test_top_entropy_mask_keeps_the_top_q_tokens_of_the_masked_ones():
    entropy = torch.tensor([[0.1, 0.9, 0.5, 9.0], [0.8, 0.2, 0.7, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    out = top_entropy_mask(entropy, mask, 0.3)  # ceil(0.3 * 7) = 3 tokens
    assert out.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0]]


# ------------------------------------------------------------------------------------------------ stages


def context(tmp_path, method: str, domain, replay=(), **blocks) -> StageContext:
    """Stage 2 of a run: a frozen earlier adapter (random, non-zero) under a fresh student, as `init: new`."""
    rec = recipe(tmp_path, method, **blocks)
    base = load_base(rec.model, "none")
    torch.manual_seed(rec.seed)
    model = attach_adapter(base.model, PREV, rec.stages[0].lora)
    with torch.no_grad():
        for p in lora_parameters(model, PREV).values():
            p.copy_(0.1 * torch.randn_like(p))
    model = attach_adapter(model, STUDENT, rec.stages[0].lora)
    use_adapters(model, [PREV, STUDENT], trainable=STUDENT)
    teacher = create_teacher(model, STUDENT, [PREV], rec.stages[0].distill.teacher)
    tmp_path.mkdir(parents=True, exist_ok=True)
    return StageContext(
        rec,
        0,
        model,
        base.tokenizer,
        HFEngine(model, base.tokenizer),
        domain,
        STUDENT,
        [PREV],
        tmp_path,
        teacher=teacher,
        previous=[PREV],
        replay_domains=list(replay),
    )


def trained(ctx) -> dict[str, torch.Tensor]:
    run_stage(ctx)
    return {n: p.detach().clone() for n, p in lora_parameters(ctx.model, STUDENT).items()}


def rows(ctx) -> list[dict]:
    return [json.loads(line) for line in (ctx.stage_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def plain_grpo(tmp_path_factory):
    """GRPO with no regulariser object at all: the code path as it was before regularisers existed."""
    tmp = tmp_path_factory.mktemp("plain")
    original = regs_mod.StageRegularizers.start
    import adaptercl.train.stage as stage_mod

    stage_mod.StageRegularizers.start = classmethod(lambda cls, *a, **k: None)
    try:
        ctx = context(tmp, "grpo", ToyDomain())
        return trained(ctx)
    finally:
        stage_mod.StageRegularizers.start = original


@pytest.mark.parametrize("term", ["kl_prev", "l2_prev", "orthogonal"])
def test_weight_zero_is_the_plain_method_bit_for_bit_and_a_weight_changes_it(tmp_path, plain_grpo, term):
    zero = context(tmp_path / "zero", "grpo", ToyDomain(), regularizers={term: 0.0})
    assert all(torch.equal(v, plain_grpo[k]) for k, v in trained(zero).items())
    on = context(tmp_path / "on", "grpo", ToyDomain(), regularizers={term: 50.0})
    state = trained(on)
    assert any(not torch.equal(v, plain_grpo[k]) for k, v in state.items())
    logged = [r[term] for r in rows(on)]
    assert all(v >= 0 for v in logged) and (term != "orthogonal" or logged[0] > 0)  # A is random from the start
    if term == "l2_prev":  # B starts at 0: ΔW_0 = 0, and the first step leaves the grad of the L2 term at 0
        assert logged[0] == 0.0 and logged[1] > 0


def test_replay_mixes_earlier_domain_prompts_scored_by_their_own_reward(tmp_path):
    calls = []

    class Recording(ToyDomain):
        def reward(self, text, example):
            calls.append(example.id)
            return super().reward(text, example)

    earlier = Recording()
    earlier.train = [ToyExample(f"old{i}", ex.messages, ex.answer) for i, ex in enumerate(earlier.train)]
    ctx = context(tmp_path, "grpo", ToyDomain(), replay=[earlier], regularizers={"replay_fraction": 0.5})
    run_stage(ctx)
    assert [r["replay_frac"] for r in rows(ctx)] == [0.5, 0.5]
    assert len(calls) == 2 * 4 and all(c.startswith("old") for c in calls)  # 1 replayed prompt x G=4, per step


def test_stochastic_replay_varies_per_step_and_never_repeats_the_stage_s_own_prompts(tmp_path):
    calls: dict[str, list[str]] = {"own": [], "old": []}

    class Recording(ToyDomain):
        def reward(self, text, example):
            calls["old" if example.id.startswith("old") else "own"].append(example.id)
            return super().reward(text, example)

    earlier = Recording()
    earlier.train = [ToyExample(f"old{i}", ex.messages, ex.answer) for i, ex in enumerate(earlier.train)]
    regularizers = {"replay_fraction": 0.3, "replay_rounding": "stochastic"}  # 1.2 of 4 prompts: 1 or 2 a step
    ctx = context(tmp_path, "grpo", Recording(), replay=[earlier], regularizers=regularizers,
                  optim={"steps": 6, "prompts_per_step": 4})  # fmt: skip
    run_stage(ctx)
    seeds = [step_seed(ctx.recipe.seed, 0, REPLAY_COUNT_SEED + step) for step in range(6)]
    replayed = [replay_count(0.3, 4, 1, "stochastic", seed) for seed in seeds]
    assert set(replayed) == {1, 2}  # the draws this test relies on: both counts occur
    assert [r["replay_frac"] for r in rows(ctx)] == [n / 4 for n in replayed]
    assert len(calls["old"]) == 4 * sum(replayed)  # G = 4 samples of each replayed prompt
    # the own prompts: each step's first 4 − n of its full 4-wide slice of the data order, so none repeats within an
    # epoch (12 examples: steps 0-2), as a slice as wide as each step's own count would (overlapping slices)
    slices = [prompts_for_step(12, 4, ctx.recipe.seed, 0, step)[: 4 - n] for step, n in enumerate(replayed)]
    assert calls["own"][::4] == [str(i) for own in slices for i in own]
    first_epoch = [i for own in slices[:3] for i in own]
    assert len(set(first_epoch)) == len(first_epoch)


def test_hybrid_with_zero_lambda_makes_grpos_update_exactly(tmp_path, plain_grpo):
    hybrid = {"distill_weight": 0.0, "distill_on": "all"}
    ctx = context(tmp_path / "h0", "hybrid", ToyDomain(), hybrid=hybrid, distill={"support": "sampled"})
    assert all(torch.equal(v, plain_grpo[k]) for k, v in trained(ctx).items())
    assert all(r["distill_token_frac"] > 0 and "distill_loss" in r for r in rows(ctx))  # computed, not added
    ctx = context(tmp_path / "h1", "hybrid", ToyDomain(), hybrid={**hybrid, "distill_weight": 1.0})
    assert any(not torch.equal(v, plain_grpo[k]) for k, v in trained(ctx).items())


def test_hybrid_failed_groups_distils_only_where_nothing_succeeded(tmp_path):
    ctx = context(tmp_path / "never", "hybrid", ToyDomain(succeed="never", feedback=True), optim={"steps": 1})
    run_stage(ctx)
    row = rows(ctx)[0]
    assert row["teacher_target_frac"] == 1.0 and row["distill_token_frac"] > 0 and "policy_loss" in row
    ctx = context(tmp_path / "ent", "hybrid", ToyDomain(), hybrid={"distill_on": "high_entropy"}, optim={"steps": 1})
    run_stage(ctx)
    assert 0 < rows(ctx)[0]["distill_token_frac"] <= 0.25  # ceil(0.2 x response tokens)


def test_hybrid_recipe_runs_end_to_end_with_a_conservative_regulariser(tmp_path):
    from adaptercl.run.sequence import run_recipe

    raw = {
        "model": {"name": "tiny-random"},
        "output_dir": str(tmp_path / "run"),
        "lora": {"r": 4, "alpha": 8},
        "optim": {"lr": 5e-3, "steps": 1, "prompts_per_step": 2},
        "rollout": {"group_size": 2, "max_new_tokens": 8},
        "eval": {"examples_per_domain": 2},
        "hybrid": {"distill_weight": 0.5, "distill_on": "failed_groups"},
        "distill": {"support": "topk", "topk": 5, "alpha": 1.0},
        "regularizers": {"kl_prev": 0.1, "l2_prev": 0.1, "replay_fraction": 0.5},
        "domains": [
            {"name": "arith", "source": "builtin:arithmetic", "reward": "tiny_rewards:digit_fraction"},
            {"name": "mcq", "source": "builtin:mcq", "reward": "tiny_rewards:digit_fraction"},
        ],
        "stages": [
            {"name": "one", "domain": "arith", "method": "hybrid"},
            {"name": "two", "domain": "mcq", "method": "hybrid", "adapter": {"init": "new"}},
        ],
    }
    run_recipe(resolve_recipe(raw))
    row = json.loads((tmp_path / "run" / "stage-02-two" / "metrics.jsonl").read_text().splitlines()[0])
    for key in ("policy_loss", "kl_prev", "l2_prev", "orthogonal", "replay_frac", "teacher_target_frac"):
        assert key in row and row[key] == row[key], key
    assert row["replay_frac"] == 0.5
