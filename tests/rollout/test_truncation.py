"""What top-p / top-k sampling keeps (`adaptercl/rollout/truncation.py`): the kept mass and the sampled tokens'
logprobs equal those of transformers' own warpers (the hf engine's sampler) and of vLLM's sampler, and the hf
engine's `response_logprobs` are the distribution `generate` sampled from."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import TopKLogitsWarper, TopPLogitsWarper

from adaptercl.rollout.truncation import BLOCK_POSITIONS, kept_log_mass, sampler_logprobs, truncated_logits


def warped(logits, top_p, top_k):
    """The logits transformers' generate samples from: top-k, then top-p (-inf outside the kept set). [N, T, V]"""
    flat = logits.reshape(-1, logits.shape[-1])
    if top_k:
        flat = TopKLogitsWarper(top_k)(None, flat)
    if top_p < 1:
        flat = TopPLogitsWarper(top_p)(None, flat)
    return flat.reshape(logits.shape)


def warped_logprobs(logits, ids, top_p, top_k):
    """log softmax of the warped logits at `ids`. [N, T]"""
    return warped(logits, top_p, top_k).log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def sampled(logits, top_p, top_k, generator):
    """A token per position drawn as generate draws it. [N, T]"""
    probs = warped(logits, top_p, top_k).softmax(-1).reshape(-1, logits.shape[-1])
    return torch.multinomial(probs, 1, generator=generator).reshape(logits.shape[:-1])


def test_the_kept_mass_of_a_known_distribution():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    # ascending cumulative mass 0.05, 0.20, 0.50, 1.0: top_p 0.75 drops what stays <= 0.25, keeping 0.5 + 0.3
    assert kept_log_mass(logits, top_p=0.75).exp().item() == pytest.approx(0.8)
    assert kept_log_mass(logits, top_p=0.3).exp().item() == pytest.approx(0.5)  # at least the most likely token
    assert kept_log_mass(logits, top_k=3).exp().item() == pytest.approx(0.95)
    assert kept_log_mass(logits, top_p=0.9, top_k=2).exp().item() == pytest.approx(0.8)  # top-k first, then top-p
    assert kept_log_mass(logits).item() == 0.0  # nothing cut


@pytest.mark.parametrize(("top_p", "top_k"), [(0.8, 0), (0.5, 0), (1.0, 20), (0.9, 50)])
def test_sampled_logprobs_are_those_of_the_transformers_warpers(top_p, top_k):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, BLOCK_POSITIONS + 44, 97, generator=g) * 3  # more positions than one block
    ids = sampled(logits, top_p, top_k, g)  # [2, T]
    expected = warped_logprobs(logits, ids, top_p, top_k)
    torch.testing.assert_close(sampler_logprobs(logits, ids, top_p, top_k), expected, rtol=0, atol=1e-5)
    full = logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert (sampler_logprobs(logits, ids, top_p, top_k) - full).mean() > 0.02  # renormalised: not the full softmax


@pytest.mark.parametrize(("top_p", "top_k"), [(0.3, 0), (0.8, 0), (0.95, 0), (1.0, 0), (1.0, 20), (0.9, 50)])
def test_the_truncated_logits_the_hf_engine_samples_from_are_the_transformers_warpers(top_p, top_k):
    logits = torch.randn(6, 97, generator=torch.Generator().manual_seed(1)) * 2  # [6, 97]
    assert torch.equal(truncated_logits(logits, top_p, top_k), warped(logits, top_p, top_k))


def test_half_precision_logits_are_compared_in_float32():
    logits = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(1))
    ids = logits.argmax(-1)
    wide = sampler_logprobs(logits, ids, 0.8)
    half = sampler_logprobs(logits.bfloat16(), ids, 0.8)
    assert half.dtype == torch.float32 and torch.allclose(wide, half, atol=0.05)


@pytest.mark.vllm
def test_the_kept_set_is_vllms():
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    logits = torch.randn(64, 211, generator=torch.Generator().manual_seed(2)) * 2
    for top_p, top_k in ((0.8, None), (0.95, 30), (None, 10)):
        p = None if top_p is None else torch.full((64,), top_p)
        k = None if top_k is None else torch.full((64,), top_k)
        masked = apply_top_k_top_p_pytorch(logits.clone(), k, p)  # -inf outside vLLM's kept set
        expected = torch.logsumexp(masked, -1) - torch.logsumexp(logits, -1)
        torch.testing.assert_close(kept_log_mass(logits, top_p or 1.0, top_k or 0), expected)


def test_the_hf_engines_logprobs_are_the_nucleus_generate_sampled_from(tmp_path):
    from adaptercl.adapters.live import attach_adapter
    from adaptercl.model.base import load_base
    from adaptercl.model.batching import build_batch, response_logits
    from adaptercl.recipe.grammar import LoraConfig, ModelConfig
    from adaptercl.rollout import SamplingParams
    from adaptercl.rollout.hf import HFEngine

    base = load_base(ModelConfig(name="tiny-random"), "none")
    model = attach_adapter(base.model, "x", LoraConfig(r=4, alpha=8))
    tok = base.tokenizer
    prompts = [
        tok("hello world", add_special_tokens=False)["input_ids"],
        tok("2+2=", add_special_tokens=False)["input_ids"],
    ]
    params = SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.8, n=3, seed=5, logprobs=True)
    completions = [c for g in HFEngine(model, tok).generate(prompts, ["x"], params) for c in g]
    batch = build_batch([c.prompt_ids for c in completions], [c.token_ids for c in completions], tok.pad_token_id)
    with torch.no_grad():
        logits = response_logits(model, batch, temperature=0.7)  # [N, R, V]
    expected = warped_logprobs(logits, batch.response_ids, 0.8, 0)
    full = logits.log_softmax(-1).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    gaps = []
    for i, c in enumerate(completions):
        n = len(c.token_ids)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected[i, :n], rtol=0, atol=1e-5)
        gaps += (torch.tensor(c.logprobs) - full[i, :n]).tolist()
    assert math.exp(-sum(gaps) / len(gaps)) < 0.9  # the kept mass: what the trainer's full softmax is off by
