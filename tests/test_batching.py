"""Token batches: shared-prompt logits (each run of identical prompts computed once) equal the plain forward."""

from __future__ import annotations

import pytest
import torch

from adaptercl.adapters import attach_adapter, lora_parameters
from adaptercl.batching import _consecutive_prompt_counts, build_batch, response_logits
from adaptercl.config import LoraConfig, ModelConfig
from adaptercl.model import load_base


def student_model(quantization: str):
    base = load_base(ModelConfig(name="tiny-random"), quantization)
    model = attach_adapter(base.model, "student", LoraConfig(r=4, alpha=8))
    model.set_adapter("student")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in lora_parameters(model, "student").values():
            p.add_(0.2 * torch.randn(p.shape, generator=g))  # B != 0: the adapter changes the logits
    return model, base.tokenizer


def grouped_batch(tok, group: int = 3):
    prompts = ["<|im_start|>user\nwhat is two plus two?<|im_end|>\n", "abc", "a longer prompt than the others"]
    responses = [" four", "xyz!", "", " yes", "q", "12345678", " no", " maybe so", "k"]
    ids = [tok(p)["input_ids"] for p in prompts for _ in range(group)]
    return build_batch(ids, [tok(r)["input_ids"] for r in responses], tok.pad_token_id)


def test_consecutive_prompt_runs_are_found_and_distinct_prompts_fall_back():
    model, tok = student_model("none")
    batch = grouped_batch(tok)
    assert _consecutive_prompt_counts(batch).tolist() == [3, 3, 3]
    distinct = batch.select([0, 3, 6])
    assert _consecutive_prompt_counts(distinct) is None


@pytest.mark.parametrize("quantization", ["none", "nf4"])
def test_shared_prompt_logits_and_gradients_equal_the_plain_forward(quantization):
    model, tok = student_model(quantization)
    model.train()
    batch = grouped_batch(tok)
    weights = torch.randn(
        batch.response_ids.shape + (model.config.vocab_size,), generator=torch.Generator().manual_seed(1)
    )
    params = lora_parameters(model, "student")

    def logits_and_grads(share: bool):
        for p in params.values():
            p.grad = None
        logits = response_logits(model, batch, share_prompts=share)  # [N, R, V]
        (logits * weights * batch.response_mask.unsqueeze(-1)).sum().backward()
        return logits.detach(), {k: p.grad.clone() for k, p in params.items()}

    plain, plain_grads = logits_and_grads(False)
    shared, shared_grads = logits_and_grads(True)
    mask = batch.response_mask.bool()
    assert shared.shape == plain.shape
    torch.testing.assert_close(shared[mask], plain[mask], rtol=1e-4, atol=1e-4)
    assert any(g.abs().max() > 0 for g in plain_grads.values())
    for k in plain_grads:
        torch.testing.assert_close(shared_grads[k], plain_grads[k], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("greedy", [True, False])
def test_rollouts_with_a_shared_prefill_equal_rollouts_without(greedy, monkeypatch):
    from adaptercl.rollout import SamplingParams, hf

    model, tok = student_model("none")
    prompts = [tok(p)["input_ids"] for p in ["what is two plus two?", "abc", "a longer prompt than the others"]]
    params = SamplingParams(max_new_tokens=8, n=3, greedy=greedy, seed=5)
    calls = []
    shared_prefill = hf._shared_prefill
    monkeypatch.setattr(hf, "_shared_prefill", lambda *a: calls.append(1) or shared_prefill(*a))
    shared = hf.HFEngine(model, tok).generate(prompts, ["student"], params)
    assert (
        calls and shared_prefill(model, *_padded(prompts, params.n, tok.pad_token_id)) is not None
    )  # the shared path ran
    monkeypatch.setattr(hf, "_shared_prefill", lambda *a: None)
    plain = hf.HFEngine(model, tok).generate(prompts, ["student"], params)
    assert [[c.token_ids for c in g] for g in shared] == [[c.token_ids for c in g] for g in plain]
    if not greedy:  # different samples within a group, not one repeated
        assert len({tuple(c.token_ids) for g in shared for c in g}) > len(prompts)


def _padded(prompts, n, pad_id):
    rows = [p for p in prompts for _ in range(n)]
    width = max(map(len, rows))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in rows])
    return ids, (ids != pad_id).long() if pad_id is not None else torch.ones_like(ids)
