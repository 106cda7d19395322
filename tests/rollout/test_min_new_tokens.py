"""A minimum length in the hf engine's decoding loop (`rollout/decode.py`): the stop tokens are masked until a row
has `min_new_tokens` tokens, from the request or the model's generation_config, as `transformers.generate` does
(greedy rows equal `generate`'s with the same minimum); sampled rows never stop before it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from reference_generate import reference_generate

from adaptercl.rollout import hf
from adaptercl.rollout.decode import min_new_tokens
from adaptercl.rollout.protocol import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 10, 11, 12], [20, 21], [5, 6, 7, 30], [40, 41, 42, 43, 44, 45]]
CAP = 12


@pytest.fixture(scope="module")
def tiny():
    from adaptercl.model.base import load_base
    from adaptercl.recipe.grammar import ModelConfig

    base = load_base(ModelConfig(name="tiny-random"), "none")
    base.model.eval()
    return base


def generate_rows(model, engine, prompts, **lengths) -> list[list[int]]:
    """transformers.generate, greedy, on the engine's own prompt layout, with `lengths` (min_new_tokens, min_length)
    passed as generate's own arguments; each row cut after its first stop id."""
    return reference_generate(model, engine, prompts, CAP, **lengths)


@pytest.fixture(scope="module")
def early_stopping(tiny):
    """An engine whose stop ids are tokens the free greedy rows emit early (by step 2 and 4), so a minimum of 6
    changes every row that stops."""
    engine = hf.HFEngine(tiny.model, tiny.tokenizer, batch_size=64, fold_lora=False)
    free = generate_rows(tiny.model, engine, PROMPTS)
    engine.stop_ids = sorted({free[0][1], free[-1][3]})
    free = generate_rows(tiny.model, engine, PROMPTS)
    assert min(len(r) for r in free) < 6  # the minimum below changes something
    return engine, free


def tokens(groups) -> list[list[int]]:
    return [c.token_ids for g in groups for c in g]


def test_greedy_rows_with_a_minimum_equal_generates(tiny, early_stopping):
    engine, free = early_stopping
    ours = tokens(engine.generate(PROMPTS, None, SamplingParams(CAP, greedy=True, min_new_tokens=6)))
    assert ours == generate_rows(tiny.model, engine, PROMPTS, min_new_tokens=6)
    assert ours != free and all(len(r) >= 6 for r in ours)
    assert all(t not in engine.stop_ids for r in ours for t in r[:5])  # no stop token before the minimum
    assert tokens(engine.generate(PROMPTS, None, SamplingParams(CAP, greedy=True))) == free  # none asked: as before


def test_the_models_generation_config_minimum_is_read_as_generate_reads_it(tiny, early_stopping, monkeypatch):
    engine, free = early_stopping
    monkeypatch.setattr(tiny.model.generation_config, "min_new_tokens", 6)
    ours = tokens(engine.generate(PROMPTS, None, SamplingParams(CAP, greedy=True)))
    assert ours == generate_rows(tiny.model, engine, PROMPTS)  # generate reads the same generation_config
    assert all(len(r) >= 6 for r in ours)
    # the request's own minimum wins over the model's, as a generate argument does
    assert tokens(engine.generate(PROMPTS, None, SamplingParams(CAP, greedy=True, min_new_tokens=0))) == free


def test_min_length_counts_each_rows_own_prompt(tiny, early_stopping, monkeypatch):
    """min_length includes the prompt: row r must reach min_length - len(prompt r) new tokens. `generate` counts its
    padded width instead, so the reference is each row generated alone (no padding)."""
    engine, _ = early_stopping
    min_length = 10  # 5 new tokens for the 5-token prompt, 8 for the 2-token one
    monkeypatch.setattr(tiny.model.generation_config, "min_length", min_length)
    ours = tokens(engine.generate(PROMPTS, None, SamplingParams(CAP, greedy=True)))
    alone = [generate_rows(tiny.model, engine, [p], min_length=min_length)[0] for p in PROMPTS]
    assert ours == alone
    assert all(len(r) >= min_length - len(p) for r, p in zip(ours, PROMPTS))


def test_sampled_rows_never_stop_before_their_minimum(tiny):
    """Half the vocabulary stops a row, so free rows end within a step or two; with a minimum of 7 every row is at
    least 7 tokens long and holds no stop token before its 7th."""
    engine = hf.HFEngine(tiny.model, tiny.tokenizer, batch_size=64, fold_lora=False)
    engine.stop_ids = list(range(0, tiny.model.config.vocab_size, 2))
    params = dict(temperature=1.0, n=3, seed=4)
    free = tokens(engine.generate(PROMPTS, None, SamplingParams(CAP, **params)))
    held = tokens(engine.generate(PROMPTS, None, SamplingParams(CAP, **params, min_new_tokens=7)))
    assert min(len(r) for r in free) < 7
    assert all(len(r) >= 7 for r in held)
    assert all(t not in engine.stop_ids for r in held for t in r[:6])


@pytest.mark.parametrize(
    ("config", "requested", "expected"),
    [
        (SimpleNamespace(), None, [0, 0]),
        (SimpleNamespace(min_new_tokens=None, min_length=0), None, [0, 0]),
        (SimpleNamespace(min_new_tokens=4, min_length=50), None, [4, 4]),  # min_new_tokens wins, as in generate
        (SimpleNamespace(min_new_tokens=None, min_length=9), None, [6, 0]),  # 9 - 3, 9 - 12 clamped
        (SimpleNamespace(min_new_tokens=4, min_length=9), 2, [2, 2]),  # the request wins
    ],
)
def test_each_rows_minimum_by_hand(config, requested, expected):
    assert min_new_tokens(config, requested, [3, 12]) == expected
