"""The rollout-mismatch importance weight under truncated sampling (`train/step.py`, `rollout/truncation.py`).

With `rollout.top_p` < 1 an engine's logprobs are those of the nucleus it sampled from, renormalised (vLLM's
`processed_logprobs`; the hf engine's `response_logprobs`), while the trainer's are under the full softmax. On-policy
rows must weigh 1 all the same (trl#6789: the ratio was the kept mass, ~0.9 at top_p 0.8), and the GRPO update with
the engine's on-policy logprobs must be the update without any correction (the GRPO ratio itself is untouched).
"""

from __future__ import annotations

import pytest
import torch

from adaptercl.adapters.live import lora_parameters
from adaptercl.model.batching import build_batch, encode_chat
from adaptercl.rollout import SamplingParams
from adaptercl.rollout.hf import HFEngine
from adaptercl.train import losses
from adaptercl.train.distill_targets import distill_targets
from adaptercl.train.stage import _rollout_logprobs
from adaptercl.train.step import train_on_batch
from tests.train.test_distill_stage import ToyDomain, stage_context
from tests.train.test_memory_settings import GradRecorder

TOP_P = 0.8


def on_policy_batch(ctx, with_targets: bool = False):
    """Two prompts x 4 samples from the student at TOP_P, with the hf engine's logprobs (the sampler's); with the
    distillation targets of a distilling method."""
    tok = ctx.tokenizer
    examples = ctx.domain.train[:2]
    prompts = [encode_chat(tok, e.messages) for e in examples]
    params = SamplingParams(max_new_tokens=8, temperature=0.7, top_p=TOP_P, n=4, seed=3, logprobs=True)
    completions = [c for g in HFEngine(ctx.model, tok).generate(prompts, ctx.policy_adapters, params) for c in g]
    batch = build_batch([c.prompt_ids for c in completions], [c.token_ids for c in completions], tok.pad_token_id)
    advantages = losses.group_advantages(torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]), 4)
    targets = None
    if with_targets:
        samples = [e for e in examples for _ in range(4)]
        results = [ctx.domain.reward(c.text, e) for c, e in zip(completions, samples)]
        targets = distill_targets(ctx, 0, samples, completions, results, batch)
    return batch, advantages, _rollout_logprobs(completions, batch), targets


@pytest.mark.parametrize(("chunk", "iterations"), [("off", 1), (4, 2)])
def test_on_policy_rows_weigh_one_at_top_p_0_8(tmp_path, chunk, iterations):
    ctx = stage_context(
        tmp_path,
        "grpo",
        ToyDomain(),
        rollout={"top_p": TOP_P, "temperature": 0.7, "max_new_tokens": 8},
        optim={"max_grad_norm": 1e9, "micro_batch_size": 4, "logits_chunk_size": chunk},
        grpo={"iterations": iterations},
    )
    batch, advantages, rollout_logp, _ = on_policy_batch(ctx)
    params = list(lora_parameters(ctx.model, ctx.student).values())
    ctx.model.train()
    corrected = GradRecorder(params)  # the weights never move: each pass sees the rollout policy
    stats = train_on_batch(ctx, batch, advantages, corrected, None, rollout_logp.clone(), None)
    assert stats["rollout_is_weight"] == pytest.approx(1.0, abs=1e-4)  # was the kept mass, ~0.8 here
    plain = GradRecorder(params)
    train_on_batch(ctx, batch, advantages, plain, None, None, None)  # no engine logprobs: no correction at all
    for ours, reference in zip(corrected.grads, plain.grads, strict=True):
        for a, b in zip(ours, reference, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-7)


def test_off_policy_rows_still_weigh_their_ratio(tmp_path):
    """The correction stays: rollout logprobs lower by 0.1 than the sampler's give min(e^0.1, cap) per token."""
    ctx = stage_context(
        tmp_path, "grpo", ToyDomain(), rollout={"top_p": TOP_P, "temperature": 0.7, "max_new_tokens": 8}
    )
    batch, advantages, rollout_logp, _ = on_policy_batch(ctx)
    ctx.model.train()
    recorder = GradRecorder(list(lora_parameters(ctx.model, ctx.student).values()))
    stats = train_on_batch(ctx, batch, advantages, recorder, None, rollout_logp - 0.1, None)
    assert stats["rollout_is_weight"] == pytest.approx(torch.tensor(0.1).exp().item(), abs=1e-4)


def test_the_distillation_weight_of_on_policy_rows_is_one_at_top_p_0_8(tmp_path):
    """SDPO's importance weight min(rho, cap) x the rollout-mismatch factor: both 1 on a single on-policy pass."""
    blocks = {"rollout": {"top_p": TOP_P, "temperature": 0.7, "max_new_tokens": 8}, "distill": {"support": "full"}}
    ctx = stage_context(tmp_path, "sdpo", ToyDomain(), **blocks)
    batch, advantages, rollout_logp, targets = on_policy_batch(ctx, with_targets=True)
    assert targets.mask.sum() > 0  # some rows are distilled
    ctx.model.train()
    recorder = GradRecorder(list(lora_parameters(ctx.model, ctx.student).values()))
    stats = train_on_batch(ctx, batch, advantages, recorder, targets, rollout_logp, None)
    assert stats["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
