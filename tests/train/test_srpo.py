"""SRPO (`method: srpo`, adaptercl/train/srpo.py, docs/design.md §4a) on tiny-random: the route table, the teacher's
entropy and the DW-SDPO weights, the loss against a hand computation with one shared token denominator, the same update
under any micro-batch split, the teacher forward on the SDPO-routed rows only, the paper's defaults in the grammar, and
recipes/srpo-cpu.yaml end to end.

The hand-built batch: 4 prompts x G = 4 rollouts of unequal lengths with scripted rewards (>= 0.5 is correct):

    group 0  [1.0, 0.0, 1.0, 0.0]   correct with a correct sibling -> GRPO; wrong with one -> SDPO
    group 1  [0.0, 1.0, 0.4, 0.0]   the only correct one -> GRPO; the wrong ones (0.4 too) -> SDPO
    group 2  [0.0, 0.0, 0.0, 0.0]   all wrong -> GRPO (advantage 0)
    group 3  [1.0, 1.0, 0.0, 1.0]   -> GRPO, GRPO, SDPO, GRPO
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adaptercl.adapters.live import lora_parameters
from adaptercl.domains import RewardResult
from adaptercl.model.batching import build_batch, encode_chat, response_logits
from adaptercl.recipe.grammar import RecipeError, resolve_recipe
from adaptercl.recipe.load import load_recipe
from adaptercl.recipe.method_table import METHODS
from adaptercl.rollout import Completion
from adaptercl.run.sequence import run_recipe
from adaptercl.teacher.prompts import TEACHER_PROMPTS, sdpo_teacher_prompts, srpo_route_stats, srpo_routes
from adaptercl.train import losses
from adaptercl.train.distill_targets import distill_targets
from adaptercl.train.micro_batch_rows import split_order
from adaptercl.train.srpo import routed_step, teacher_entropy
from adaptercl.train.step import train_on_batch
from adaptercl.train.token_terms import ResponseScores
from tests.train.test_distill_stage import ToyDomain, stage_context
from tests.train.test_memory_settings import GradRecorder

REPO = Path(__file__).resolve().parents[2]
G = 4
SCORES = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.4, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]
ROUTES = [False, True, False, True, True, False, True, True, False, False, False, False, False, False, True, False]
LENGTHS = [3, 7, 5, 2, 6, 4, 8, 1, 5, 3, 7, 2, 4, 6, 5, 3]  # unequal response lengths
# Blocks of the stages below: temperature 0.1 sharpens tiny-random's near-uniform logits so that the teacher's
# entropies, hence the DW-SDPO weights, differ between tokens; no clipping of the gradients compared; float64, as the
# claims are exactness across arrangements that sum in other orders (see TOL).
SHARP = {
    "rollout": {"temperature": 0.1, "max_new_tokens": 8},
    "optim": {"max_grad_norm": 1e9},
    "model": {"dtype": "float64"},
    "quantization": "none",
}


# ------------------------------------------------------------------------------------------------ the routes


def test_route_table_on_a_hand_built_batch():
    succeeded = [s >= 0.5 for s in SCORES]
    assert srpo_routes(succeeded, G) == ROUTES
    assert srpo_route_stats(succeeded, ROUTES, G) == {"sdpo_route_frac": 6 / 16, "all_wrong_group_frac": 1 / 4}
    with pytest.raises(ValueError, match="groups of 4"):
        srpo_routes(succeeded[:6], G)


def test_srpo_teacher_prompts_show_the_first_correct_sibling_to_the_sdpo_route_only():
    distill = resolve_recipe(recipe_raw("srpo")).stages[0].distill
    prompts = [[{"role": "system", "content": "S"}, {"role": "user", "content": f"Q{i // G}"}] for i in range(16)]
    responses = [f"answer-{i}" for i in range(16)]
    feedback = ["that is wrong"] * 16  # SRPO routes by siblings: feedback never makes a target
    succeeded = [s >= 0.5 for s in SCORES]
    shown = TEACHER_PROMPTS["srpo"](prompts, responses, succeeded, feedback, [None] * 16, G, distill, None)
    assert shown.has_target == ROUTES
    sdpo = sdpo_teacher_prompts(prompts, responses, succeeded, [None] * 16, G, distill)
    assert sdpo.has_target[0] and not shown.has_target[0]  # SDPO distils a success with a correct sibling; SRPO not
    first_correct = {0: 0, 1: 5, 3: 12}  # group -> its first correct rollout
    for i, routed in enumerate(ROUTES):
        if routed:  # exactly SDPO's reprompt, with the group's first correct sibling
            assert shown.messages[i] == sdpo.messages[i]
            assert f"answer-{first_correct[i // G]}" in shown.messages[i][-1]["content"]
            assert shown.messages[i][0] == {"role": "system", "content": "S"}
        else:
            assert shown.messages[i] == prompts[i]
    assert shown.succeeded == succeeded and not any(shown.used_feedback)


def test_with_trl_style_rewards_correct_is_the_domains_correctness_never_the_score(tmp_path):
    """A TRL-style result (per-function components) scoring 1.0 for a wrong answer in the right format is wrong for
    the route and never shown as a sibling (`domains.is_success`: the domain's `correct_from` decision)."""
    ctx = stage_context(tmp_path, "srpo", ToyDomain(), **SHARP)
    # group 0 as the module's group 0 by correctness, but rollout 2 is "wrong with a high format reward"
    correct = [True, False, False, False, True, True, False, True]
    scores = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    batch, _, targets, _, results = hand_batch(ctx, scores, correct=correct)
    assert all(r.from_reward_funcs for r in results)
    assert targets.has_target == [False, True, True, True, False, False, True, False]
    assert targets.stats["sdpo_route_frac"] == 4 / 8


# --------------------------------------------------------------------------------------------- the grammar


def recipe_raw(method: str, **blocks) -> dict:
    raw = {
        "model": {"name": "tiny-random"},
        "output_dir": "unused",
        "domains": [{"name": "arith", "source": "builtin:arithmetic"}],
        "stages": [{"name": "a", "domain": "arith", "method": method}],
    }
    return {**raw, **blocks}


def test_srpo_defaults_are_the_papers():
    stage = resolve_recipe(recipe_raw("srpo")).stages[0]
    assert stage.optim.lr == 5e-6 and stage.grpo.epsilon_high == 0.28 and stage.grpo.aggregation == "token_mean"
    distill = stage.distill
    assert (distill.teacher.kind, distill.teacher.tau) == ("ema", 0.05)
    assert (distill.support, distill.topk, distill.tail, distill.alpha) == ("topk", 100, True, 0.5)
    assert distill.is_cap == 2.0 and distill.aggregation == "token_mean" and stage.srpo.entropy_beta == 1.0
    assert (stage.optim.weight_decay, stage.optim.warmup_steps) == (0.01, 10)  # Table 3: AdamW wd 0.01, warm-up 10
    for method in ("grpo", "sdpo", "hybrid"):  # the other methods keep optim's defaults
        optim = resolve_recipe(recipe_raw(method)).stages[0].optim
        assert (optim.lr, optim.weight_decay, optim.warmup_steps) == (1e-5, 0.0, 0)
    own = resolve_recipe(recipe_raw("srpo", optim={"lr": 2e-5, "weight_decay": 0.0, "warmup_steps": 2})).stages[0]
    assert (own.optim.lr, own.optim.weight_decay, own.optim.warmup_steps) == (2e-5, 0.0, 2)  # a recipe's own win
    stage_set = recipe_raw("srpo")  # also when set only at recipe level, or only on the stage
    stage_set["optim"] = {"warmup_steps": 0}
    stage_set["stages"][0]["optim"] = {"weight_decay": 0.1}
    optim = resolve_recipe(stage_set).stages[0].optim
    assert (optim.lr, optim.weight_decay, optim.warmup_steps) == (5e-6, 0.1, 0)


def test_srpo_trains_with_the_papers_weight_decay(tmp_path):
    from adaptercl.recipe import OptimConfig
    from adaptercl.train.stage import make_optimizer

    ctx = srpo_context(tmp_path)[0]
    assert [g["weight_decay"] for g in make_optimizer(ctx).param_groups] == [0.01]  # AdamW gets the default
    ctx.stage.optim = OptimConfig(weight_decay=0.0)
    assert [g["weight_decay"] for g in make_optimizer(ctx).param_groups] == [0.0]


@pytest.mark.parametrize("block", ["grpo", "distill"])
def test_a_second_denominator_is_refused_naming_the_field(block):
    with pytest.raises(RecipeError, match=rf"stages\.a: srpo .* set {block}\.aggregation to token_mean"):
        resolve_recipe(recipe_raw("srpo", **{block: {"aggregation": "seq_mean_token_mean"}}))
    with pytest.raises(RecipeError, match=r"srpo\.entropy_beta"):
        resolve_recipe(recipe_raw("srpo", srpo={"entropy_beta": -1.0}))


# ---------------------------------------------------------------------------------------- a hand-built step


def srpo_context(tmp_path, scores=SCORES, groups: range | None = None, **blocks):
    """An srpo stage on tiny-random whose student and teacher differ (random LoRA B of both, seeded), and the
    hand-built batch of `scores` (see the module docstring), or of its `groups` only (a data-parallel rank's share):
    (ctx, batch, advantages, targets, samples, results)."""
    blocks = {**SHARP, **blocks, "optim": {**SHARP["optim"], **blocks.get("optim", {})}}
    blocks["model"] = {**SHARP["model"], **blocks.get("model", {})}
    ctx = stage_context(tmp_path, blocks.pop("method", "srpo"), ToyDomain(), **blocks)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for adapter in (ctx.student, ctx.teacher.adapter):  # grpo's `base` teacher has no adapter
            for name, p in lora_parameters(ctx.model, adapter).items() if adapter else ():
                if "lora_B" in name:
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return (ctx, *hand_batch(ctx, scores, groups))


def hand_batch(ctx, scores, groups: range | None = None, correct: list[bool] | None = None):
    """The completions of `scores` (group-contiguous, G each) for the first prompts of the toy domain, response tokens
    drawn from a seeded generator with lengths LENGTHS; only the groups in `groups` (a data-parallel rank's). Native
    results (correct: score >= 0.5), or with `correct` TRL-style ones (one reward function's component)."""
    tok = ctx.tokenizer
    g = torch.Generator().manual_seed(11)
    ids = [torch.randint(0, 256, (LENGTHS[i],), generator=g).tolist() for i in range(len(scores))]
    rows = [i for i in range(len(scores)) if groups is None or i // G in groups]
    examples = [ctx.domain.train[i // G] for i in rows]
    completions = [
        Completion(encode_chat(tok, ex.messages), ids[i], tok.decode(ids[i], skip_special_tokens=True), "stop")
        for i, ex in zip(rows, examples)
    ]
    if correct is None:
        results = [RewardResult(scores[i], scores[i] >= 0.5) for i in rows]
    else:
        results = [RewardResult(scores[i], correct[i], components=(("format", scores[i]),)) for i in rows]
    batch = build_batch([c.prompt_ids for c in completions], [c.token_ids for c in completions], tok.pad_token_id)
    advantages = losses.group_advantages(torch.tensor([r.score for r in results]), G)
    targets = None
    if METHODS[ctx.stage.method].needs_teacher:
        targets = distill_targets(ctx, 0, examples, completions, results, batch)
    return batch, advantages, targets, examples, results


def recorded_step(ctx, batch, advantages, targets):
    """The gradients of every pass and the statistics of one `train_on_batch` (the weights never move)."""
    recorder = GradRecorder(list(lora_parameters(ctx.model, ctx.student).values()))
    ctx.model.train()
    stats = train_on_batch(ctx, batch, advantages, recorder, targets, None, None)
    return recorder.grads, stats


def hand_loss(ctx, batch, advantages, targets) -> tuple[torch.Tensor, dict[str, float]]:
    """The SRPO loss of the batch written out (docs/design.md §4a), on one forward of the whole batch: GRPO's
    on-policy token loss -A·ρ (ρ = 1, inside the clip) on the GRPO rows, the top-100 + tail JSD times the importance
    weight (1 on-policy) times w = exp(-H) / mean over the SDPO tokens, H by hand over the full vocabulary from the
    teacher's own forward, all over one count of tokens."""
    temperature, beta = ctx.stage.rollout.temperature, ctx.stage.srpo.entropy_beta
    routed = torch.tensor(targets.has_target)
    mask = batch.response_mask  # [N, R]
    ctx.model.train()
    student = response_logits(ctx.model, batch, temperature=temperature)  # [N, R, V]
    logp = losses.gather_logprobs(student, batch.response_ids)  # [N, R]
    grpo = -advantages[:, None] * torch.exp(logp - logp.detach())  # [N, R]
    sdpo_rows = routed.nonzero().squeeze(-1)
    teacher = ctx.teacher.logits(ctx.model, targets.teacher_batch.select(sdpo_rows), temperature)  # [n_S, R, V]
    q = torch.softmax(teacher, -1)
    entropy = -(q * q.log()).sum(-1)  # [n_S, R]
    d_mask = targets.mask[sdpo_rows]  # [n_S, R]
    raw = torch.exp(-beta * entropy)
    weight = raw / ((raw * d_mask).sum() / d_mask.sum())
    divergence = losses.distillation_divergence(student[sdpo_rows], teacher, 0.5, "topk", 100, True)  # [n_S, R]
    grpo_mask = mask * (~routed)[:, None]
    grpo_sum, sdpo_sum = (grpo * grpo_mask).sum(), (divergence * weight * d_mask).sum()
    loss = (grpo_sum + sdpo_sum) / (grpo_mask.sum() + d_mask.sum())
    valid = weight[d_mask > 0]
    facts = {
        "teacher_entropy_mean": ((entropy * d_mask).sum() / d_mask.sum()).item(),
        "dw_weight_min": valid.min().item(),
        "dw_weight_max": valid.max().item(),
        # what an implementation with a denominator per route, or without the weights, would give instead
        "per_route_means": (grpo_sum / grpo_mask.sum() + sdpo_sum / d_mask.sum()).item(),
        "unweighted": ((grpo_sum + (divergence * d_mask).sum()) / (grpo_mask.sum() + d_mask.sum())).item(),
    }
    return loss, facts


# Tolerance of the comparisons below (as tests/train/test_memory_settings.py): both sides run in float64 in other
# groupings and orders (micro-batches, prefix sharing, padding per rank, the teacher's logits from its hidden states),
# which costs < 1e-12; what remains is transformers' rotary tables, computed in float32 whatever the model's dtype,
# entering the layouts at different points: ~2^-24 ≈ 6e-8 of a tensor's scale, times up to 1/T = 10 through the logits
# at temperature 0.1 (SHARP): ~6e-7. Gradients are compared normwise (rounding scales with the largest terms summed),
# within 2e-6 of the reference's largest entry; a wrong denominator or a missing weight is off by percents (asserted).
TOL = 2e-6


def assert_same_grads(reference, other) -> None:
    assert any(g.abs().max() > 0 for g in reference[0])
    for ref_pass, pass_ in zip(reference, other, strict=True):
        for a, b in zip(ref_pass, pass_, strict=True):
            assert a.dtype == torch.float64
            torch.testing.assert_close(b, a, rtol=0, atol=TOL * a.abs().max().item())


def test_the_loss_equals_a_hand_computation_with_one_shared_denominator(tmp_path):
    ctx, batch, advantages, targets, _, _ = srpo_context(tmp_path)
    assert targets.has_target == ROUTES and targets.stats["sdpo_route_frac"] == 6 / 16
    assert targets.stats["all_wrong_group_frac"] == 1 / 4
    grads, stats = recorded_step(ctx, batch, advantages, targets)
    loss, facts = hand_loss(ctx, batch, advantages, targets)
    assert stats["loss"] == pytest.approx(loss.item(), rel=TOL)
    for key in ("teacher_entropy_mean", "dw_weight_min", "dw_weight_max"):
        assert stats[key] == pytest.approx(facts[key], rel=TOL), key
    assert stats["teacher_rows"] == 6
    assert facts["dw_weight_max"] > 1.2 * facts["dw_weight_min"]  # the weights differ: the batch can tell
    for wrong in ("per_route_means", "unweighted"):
        assert abs(facts[wrong] - loss.item()) > 100 * TOL * abs(loss.item()), wrong
    for p in lora_parameters(ctx.model, ctx.student).values():
        p.grad = None
    loss.backward()
    assert_same_grads(grads, [[p.grad for p in lora_parameters(ctx.model, ctx.student).values()]])


def test_the_update_is_the_same_for_any_micro_batch_split(tmp_path):
    steps = {}
    for accum in (1, 2, 3, 5, 16):  # micro-batches of 16, 8, 6, 4 and 1 rows
        ctx, batch, advantages, targets, _, _ = srpo_context(tmp_path / str(accum), optim={"grad_accum": accum})
        steps[accum] = recorded_step(ctx, batch, advantages, targets)
    grads, stats = steps[1]
    for accum, (other_grads, other_stats) in steps.items():
        assert_same_grads(grads, other_grads)
        for key in ("loss", "policy_loss", "distill_loss", "teacher_entropy_mean", "dw_weight_min", "dw_weight_max"):
            assert other_stats[key] == pytest.approx(stats[key], rel=TOL), (accum, key)


def test_entropy_weights_are_normalised_over_the_batchs_sdpo_tokens_and_uniform_at_beta_0(tmp_path):
    # chunks of 3 positions: the entropy comes from the hidden states 3 positions at a time
    ctx, batch, _, targets, _, _ = srpo_context(tmp_path, optim={"grad_accum": 3, "logits_chunk_size": 3})
    routed = routed_step(ctx, batch, targets, split_order(list(range(16)), 6), chunk_size=3)
    assert [r.tolist() for r in routed.sdpo_rows] == [[1, 3, 4], [0, 1], [2]]  # the SDPO rows of 6, 6 and 4 rows
    weights, masks = [], []
    width = batch.response_mask.shape[1]
    for k, rows in enumerate(
        routed.sdpo_rows
    ):  # each micro-batch's weights [n_t, R'] padded back to R (no token there)
        weights.append(torch.nn.functional.pad(routed.weights[k], (0, width - routed.weights[k].shape[1])))
        masks.append(targets.mask[k * 6 : (k + 1) * 6][rows])
    weights, masks = torch.cat(weights), torch.cat(masks)  # [6, R] in row order
    assert ((weights * masks).sum() / masks.sum()).item() == pytest.approx(1.0, rel=TOL)
    sdpo = torch.tensor(ROUTES).nonzero().squeeze(-1)
    teacher = ctx.teacher.logits(ctx.model, targets.teacher_batch.select(sdpo), ctx.stage.rollout.temperature)
    q = torch.softmax(teacher, -1)
    entropy = -(q * q.log()).sum(-1)  # [6, R] over the whole vocabulary, by hand
    raw = torch.exp(-1.0 * entropy)  # beta 1
    expected = raw / ((raw * masks).sum() / masks.sum())
    torch.testing.assert_close(weights * masks, expected * masks, rtol=TOL, atol=0)
    assert routed.denominator.item() == batch.response_mask.sum().item()  # every token in exactly one route
    assert routed.grpo_tokens.item() + routed.sdpo_tokens.item() == routed.denominator.item()

    uniform = srpo_context(tmp_path / "beta0", srpo={"entropy_beta": 0.0})
    routed = routed_step(uniform[0], uniform[1], uniform[3], [slice(0, 16)], chunk_size=None)
    assert all(torch.equal(w, torch.ones_like(w)) for w in routed.weights if w is not None)
    assert routed.stats["dw_weight_min"] == routed.stats["dw_weight_max"] == 1.0


def test_chunked_teacher_entropy_equals_the_full_vocabulary_hand_computation():
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(2, 7, 50, generator=g, dtype=torch.float64)  # [n, R, V]
    q = torch.softmax(logits, -1)
    hand = -(q * torch.log(q)).sum(-1)  # [n, R]
    for chunk in (1, 3, 7, 64):  # 7 positions: chunks of 3, 3, 1; one chunk wider than R
        torch.testing.assert_close(teacher_entropy(ResponseScores(logits=logits), chunk), hand, rtol=1e-12, atol=0)
    head = torch.nn.Linear(16, 50, bias=False).double()
    hidden = torch.randn(2, 7, 16, generator=g, dtype=torch.float64)  # [n, R, H]
    with torch.no_grad():
        q = torch.softmax(head(hidden) / 0.7, -1)  # the LM head, then the temperature, as the step's logits
        entropy = teacher_entropy(ResponseScores(hidden=hidden, head=head, temperature=0.7), 3)
    torch.testing.assert_close(entropy, -(q * q.log()).sum(-1), rtol=1e-12, atol=0)


@pytest.mark.parametrize("chunk", ["off", 3])
def test_a_bf16_autocast_teacher_gives_the_float32_step_within_bf16_rounding(tmp_path, chunk):
    """srpo-cpu.yaml's `autocast: auto`: the teacher's hidden states come out of a bf16-autocast forward and meet the
    LM head in float32 (`ResponseScores.chunk_logits`). bf16 keeps 8 significant bits (relative rounding 2^-9 ~ 2e-3
    per matmul output); the loss and the teacher's entropy stay within 1e-2 of the float32 step's, not further."""
    float32 = {"model": {"dtype": "float32"}, "optim": {"logits_chunk_size": chunk}}
    autocast = {"distill": {"teacher": {"kind": "ema", "autocast": "bfloat16"}}, **float32}
    _, stats = recorded_step(*srpo_context(tmp_path / "bf16", **autocast)[:4])
    _, reference = recorded_step(*srpo_context(tmp_path / "f32", **float32)[:4])
    for key in ("loss", "teacher_entropy_mean", "dw_weight_min", "dw_weight_max"):
        assert stats[key] == pytest.approx(reference[key], rel=1e-2), key
    assert stats["teacher_entropy_mean"] != reference["teacher_entropy_mean"]  # the teacher did run in bf16


# 2 ranks of 2 groups each, micro-batches of 4 rows as one process with grad_accum 4 (tests/system/test_distributed.py)
DDP_BLOCKS = {"optim": {"grad_accum": 2}}


# ------------------------------------------------------------------------------------ the teacher's rows


def test_the_teacher_forward_runs_on_the_sdpo_routed_rows_only_once_per_step(tmp_path, monkeypatch):
    ctx, batch, advantages, targets, _, _ = srpo_context(tmp_path, optim={"grad_accum": 3}, grpo={"iterations": 2})
    seen, original = [], ctx.teacher.scores
    monkeypatch.setattr(ctx.teacher, "scores", lambda model, b, *a: seen.append(b) or original(model, b, *a))
    _, stats = recorded_step(ctx, batch, advantages, targets)
    assert [b.input_ids.shape[0] for b in seen] == [3, 2, 1]  # micro-batches of 6, 6, 4 rows; two passes, one forward

    def tokens(b):  # each row's tokens without its padding (a micro-batch is cut to its own rows' width)
        return [tuple(ids[mask.bool()].tolist()) for ids, mask in zip(b.input_ids, b.attention_mask)]

    sdpo = torch.tensor(ROUTES).nonzero().squeeze(-1)
    assert sorted(t for b in seen for t in tokens(b)) == sorted(
        tokens(targets.teacher_batch.select(sdpo))
    )  # those rows
    assert stats["teacher_rows"] == 6


def test_without_an_sdpo_route_srpo_is_grpo_and_runs_no_teacher(tmp_path, monkeypatch):
    # every group all correct or all wrong (partial rewards keep the advantages non-zero)
    scores = [0.6, 1.0, 0.8, 0.5, 0.1, 0.3, 0.2, 0.4, 0.0, 0.45, 0.0, 0.2, 0.9, 0.7, 1.0, 0.55]
    ctx, batch, advantages, targets, _, _ = srpo_context(tmp_path / "srpo", scores, optim={"grad_accum": 3})
    monkeypatch.setattr(ctx.teacher, "scores", lambda *a: pytest.fail("the teacher ran without an SDPO row"))
    grads, stats = recorded_step(ctx, batch, advantages, targets)
    assert stats["teacher_rows"] == 0 and "teacher_entropy_mean" not in stats
    grpo = srpo_context(tmp_path / "grpo", scores, method="grpo", optim={"grad_accum": 3})
    grpo_grads, grpo_stats = recorded_step(grpo[0], grpo[1], grpo[2], None)
    for a, b in zip(grpo_grads[0], grads[0], strict=True):
        assert torch.equal(a, b)  # bit for bit: the same terms over the same denominator
    assert stats["loss"] == grpo_stats["loss"]


# ------------------------------------------------------------------------------------------ end to end


def test_srpo_cpu_recipe_runs_end_to_end_on_tiny_random(tmp_path):
    overrides = [
        "model.name=tiny-random",
        f"output_dir={tmp_path / 'run'}",
        "lora.layers=null",  # tiny-random has 2 layers
        "lora.r=4",
        "lora.alpha=8",
        "rollout.group_size=4",
        "rollout.max_new_tokens=8",
        "optim.steps=2",
        "optim.prompts_per_step=2",
        "distill.teacher.autocast=none",
        "eval.examples_per_domain=2",
        "eval.max_new_tokens=8",
        "eval.drift_probes=1",
        "eval.teacher_lift_prompts=1",
        "eval.stage_kl_prompts=1",
    ]
    recipe = load_recipe(REPO / "recipes" / "srpo-cpu.yaml", overrides)
    assert {s.method for s in recipe.stages} == {"srpo"} and recipe.stages[1].regularizers.replay_fraction == 0.25
    run_recipe(recipe)
    for stage in ("stage-01-arithmetic", "stage-02-mcq"):
        rows = [json.loads(line) for line in (tmp_path / "run" / stage / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2]
        for r in rows:
            assert 0.0 <= r["sdpo_route_frac"] <= 1.0 and 0.0 <= r["all_wrong_group_frac"] <= 1.0
            assert r["teacher_rows"] == round(r["sdpo_route_frac"] * 8)  # 2 prompts x 4: only the routed rows
            assert ("teacher_entropy_mean" in r) == (r["teacher_rows"] > 0)
        assert (tmp_path / "run" / stage / "done.json").is_file()
