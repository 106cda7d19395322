"""The hf engine's decoding loop (`rollout/decode.py`): greedy rows equal `transformers.generate`'s, finished rows
leave the batch, a row's sample depends on its seed and prompt only, and the sampler draws from the softmax (the
nucleus cut it samples from is tests/rollout/test_truncation.py's)."""

from __future__ import annotations

import math

import pytest
import torch
from reference_generate import reference_generate

from adaptercl.rollout import hf
from adaptercl.rollout.decode import sample_tokens
from adaptercl.rollout.protocol import SamplingParams, row_seed

PROMPTS = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 10, 11, 12], [20, 21], [5, 6, 7, 30], [40, 41, 42, 43, 44, 45]]


@pytest.fixture(scope="module")
def tiny():
    from adaptercl.model.base import load_base
    from adaptercl.recipe.grammar import ModelConfig

    base = load_base(ModelConfig(name="tiny-random"), "none")
    base.model.eval()
    return base


def stopping_engine(tiny, prompts, n):
    """An engine whose stop ids are tokens the greedy rows emit at different steps, so rows end at different lengths."""
    engine = hf.HFEngine(tiny.model, tiny.tokenizer, batch_size=64, fold_lora=False)
    free = reference_generate(tiny.model, engine, [p for p in prompts for _ in range(n)], 12)
    engine.stop_ids = sorted({free[0][3], free[-1][6]})
    return engine


@pytest.mark.parametrize("n", [1, 3])  # n 3: a group's rows share their prompt, prefilled from one cache
def test_greedy_rows_equal_transformers_generate(tiny, n):
    engine = stopping_engine(tiny, PROMPTS, n)
    ours = [
        c.token_ids for group in engine.generate(PROMPTS, None, SamplingParams(12, greedy=True, n=n)) for c in group
    ]
    reference = reference_generate(tiny.model, engine, [p for p in PROMPTS for _ in range(n)], 12)
    assert ours == reference
    assert len({len(r) for r in ours}) > 1  # rows did stop at different lengths


def test_finished_rows_leave_the_batch(tiny):
    engine = stopping_engine(tiny, PROMPTS, 1)
    sizes = []
    record = lambda module, args, kwargs: sizes.append(kwargs["input_ids"].shape[0])  # noqa: E731
    hook = tiny.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        groups = engine.generate(PROMPTS, None, SamplingParams(12, greedy=True))
    finally:
        hook.remove()
    lengths = [len(c.token_ids) for group in groups for c in group]
    decode_sizes = sizes[-max(lengths) :]  # after the prefill's calls: one forward per decoding step
    assert decode_sizes == sorted(decode_sizes, reverse=True) and decode_sizes[-1] < len(PROMPTS)
    # each step computes exactly the rows still decoding: a row of length L takes part in L forwards
    assert sum(decode_sizes) == sum(lengths)


def test_a_rows_sample_depends_on_its_seed_and_prompt_only(tiny):
    """In float64 (so that no batch-size-dependent rounding can move a token): the same rows sampled in one batch,
    in batches of 2, and each alone are the same tokens, row j seeded row_seed(seed, first_row + j)."""
    model = tiny.model.double()
    try:
        params = SamplingParams(10, temperature=1.3, top_p=0.9, n=2, seed=11)
        whole = hf.HFEngine(model, tiny.tokenizer, batch_size=64, fold_lora=False).generate(PROMPTS, None, params)
        pairs = hf.HFEngine(model, tiny.tokenizer, batch_size=2, fold_lora=False).generate(PROMPTS, None, params)
        alone = [
            hf.HFEngine(model, tiny.tokenizer, batch_size=1, fold_lora=False).generate(
                [p], None, SamplingParams(10, temperature=1.3, top_p=0.9, n=1, seed=11, first_row=2 * i + j)
            )[0][0]
            for i, p in enumerate(PROMPTS)
            for j in range(2)
        ]
    finally:
        tiny.model.float()
    tokens = lambda groups: [c.token_ids for g in groups for c in g]  # noqa: E731
    assert tokens(whole) == tokens(pairs) == [c.token_ids for c in alone]
    assert len({tuple(t) for t in tokens(whole)}) > 1
    other_seed = hf.HFEngine(tiny.model, tiny.tokenizer, fold_lora=False).generate(
        PROMPTS, None, SamplingParams(10, temperature=1.3, top_p=0.9, n=2, seed=12)
    )
    assert tokens(other_seed) != tokens(whole)


def test_the_engine_passes_each_row_its_own_seed(tiny, monkeypatch):
    seen = []
    monkeypatch.setattr(hf, "decode", lambda *a, row_seeds, **kw: seen.append(row_seeds) or [[1]] * len(row_seeds))
    engine = hf.HFEngine(tiny.model, tiny.tokenizer, batch_size=4, fold_lora=False)
    engine.generate([[1, 2], [3, 4], [5, 6]], None, SamplingParams(2, n=4, seed=5, first_row=8))  # 12 rows
    assert seen == [[row_seed(5, 8 + j) for j in range(b, b + 4)] for b in (0, 4, 8)]


def test_sample_tokens_by_hand():
    """Inverse CDF over p = (0.2, 0.5, 0.3, 0): cumulative 0.2, 0.7, 1.0, 1.0, each uniform just inside a boundary."""
    probs = [0.2, 0.5, 0.3, 0.0]
    logits = torch.tensor([probs]).log().expand(8, 4)  # [8, 4], the last token at -inf
    # How far the boundaries the sampler computes can lie from 0.2 and 0.7. Each weight is float32
    # exp(fl(log p_i) - fl(log p_max)): log rounds to within 1 ulp (vectorised log and exp differ between CPUs and
    # instruction sets in the last bits, within SLEEF's / MKL's 1-ulp bounds; allow 2 each), the subtraction adds
    # half an ulp of the difference, and an error d in the exponent is a relative error d in the weight. So a weight's
    # relative error is at most rel = u * (2|log p_i| + 2|log p_max| + |log p_i - log p_max| + 2), u = 2^-24 (float32
    # unit roundoff). A boundary c_k = S_k / S_n (float64 sums of the weights, whose own rounding is negligible) then
    # moves by at most 2 * rel * c_k <= 2 * rel. The margin: twice that bound over the tokens, so an honest float32
    # exp on any CPU stays on the intended side, and the sampler's rule (first cumulative > u) is still what decides.
    u, logs = 2.0**-24, [math.log(p) for p in probs[:3]]
    rel = max(u * (2 * abs(a) + 2 * abs(max(logs)) + abs(a - max(logs)) + 2) for a in logs)
    margin = 2 * (2 * rel)
    assert margin < 1e-5  # far inside the gaps between the boundaries the test places uniforms around
    points = [0.0, 0.19, 0.2 - margin, 0.2 + margin, 0.7 - margin, 0.7 + margin, 0.95, 1.0 - 1e-12]
    uniforms = torch.tensor(points, dtype=torch.float64)
    assert sample_tokens(logits, uniforms).tolist() == [0, 0, 0, 1, 1, 2, 2, 2]


def test_sample_tokens_frequencies_match_the_softmax():
    """20,000 draws from one row: every token's frequency within 5 standard errors of its probability."""
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, -3.0])
    probs = logits.softmax(-1)
    draws = 20_000
    generator = torch.Generator().manual_seed(0)
    uniforms = torch.rand(draws, generator=generator, dtype=torch.float64)
    counts = torch.bincount(sample_tokens(logits.expand(draws, 5), uniforms), minlength=5).double() / draws
    stderr = (probs * (1 - probs) / draws).sqrt().double()
    assert ((counts - probs.double()).abs() <= 5 * stderr).all()
