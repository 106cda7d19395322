"""Shared-prefix layouts on every cache layout (`model/cache_layers.py`, `prefix_sharing.py`): a tiny Qwen3.5 (Gated
DeltaNet linear attention + full attention) takes no shared prefix and its rows equal each row alone; a tiny Gemma 3
(a 16-position sliding window) takes a layout only without a gap or within the window, and the layout it refuses is
shown wrong; finished rows' states are dropped by each layer kind's rule. Models in float64, so that rounding cannot
hide or fake a difference: a tolerance of 1e-10 on logits of size ~1 is float64's reassociation noise (~1e-15 per
operation) with a wide margin, and the wrong layout misses by ~1e-1."""

from __future__ import annotations

import pytest
import torch
from tiny_families import write_tiny_family
from transformers.cache_utils import DynamicCache, LinearAttentionAndFullAttentionLayer

from adaptercl.model import FULL_ATTENTION, build_batch, encode_chat, prefill, prefix_layout, response_logits
from adaptercl.model import batching as batching_module
from adaptercl.model.base import load_base
from adaptercl.model.cache_layers import select_rows, shared_prefix_limit
from adaptercl.recipe.grammar import ModelConfig

TOLERANCE = {"qwen3_5": 1e-5, "gemma3": 1e-10, "llama": 1e-10}  # see the module docstring
SYSTEM = "You are a careful calculator. Answer briefly."
QUESTIONS = ["What is 1 + 1?", "What is 12 + 30 + 4?", "What is the sum of the first five odd numbers?"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (float64 model, tokenizer) for the tiny qwen3_5, gemma3 and llama."""
    root = tmp_path_factory.mktemp("cache-layers")
    out = {}
    for family in ("qwen3_5", "gemma3", "llama"):
        base = load_base(ModelConfig(name=str(write_tiny_family(family, root / family)), dtype="float64"), "none")
        out[family] = (base.model.eval(), base.tokenizer)
    return out


def chat(tok, question: str) -> list[int]:
    return encode_chat(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])


def alone_logits(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """[R, V] the logits predicting each response token, the row run by itself."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0]
    return logits[len(prompt) - 1 : -1]


def test_the_limit_follows_the_cache_layers(tiny):
    qwen, gemma, llama = (shared_prefix_limit(tiny[f][0]) for f in ("qwen3_5", "gemma3", "llama"))
    assert not qwen.share and "LinearAttentionLayer" in qwen.reason  # layer 0: Gated DeltaNet
    assert (gemma.share, gemma.window) == (True, 16)
    assert llama == FULL_ATTENTION


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3"])
def test_training_logits_equal_each_row_alone(tiny, family):
    """Rows sharing a long system prompt, questions of different lengths (a layout would have a gap): the training
    forward gives each row the logits it has alone."""
    model, tok = tiny[family]
    prompts = [chat(tok, q) for q in QUESTIONS]
    responses = [[40, 41, 42], [43, 44], [45, 46, 47, 48]]
    logits = response_logits(model, build_batch(prompts, responses, tok.pad_token_id).to(torch.device("cpu")))
    for i, (p, r) in enumerate(zip(prompts, responses)):
        assert torch.allclose(logits[i, : len(r)], alone_logits(model, p, r), rtol=0, atol=TOLERANCE[family])


def test_a_gap_across_a_sliding_window_is_refused_because_it_is_wrong(tiny):
    model, tok = tiny["gemma3"]
    prompts = [chat(tok, q) for q in QUESTIONS]
    assert prefix_layout(prompts, 2, tok.pad_token_id, limit=shared_prefix_limit(model)) is None
    forced = prefix_layout(prompts, 2, tok.pad_token_id)  # as if every layer were full attention
    assert forced is not None and not forced.gap_free
    responses = [[40, 41, 42]] * 3
    batch = build_batch(prompts, responses, tok.pad_token_id)
    p_width = batch.input_ids.shape[1] - 3
    rest_ids = torch.cat([forced.own_ids, batch.input_ids[:, p_width:-1]], dim=1)
    rest_mask = torch.cat([forced.own_mask, batch.attention_mask[:, p_width:-1]], dim=1)
    with torch.no_grad():
        wrong = prefill(model, forced, rest_ids, rest_mask, logits_to_keep=3).logits
    misses = [(wrong[i] - alone_logits(model, p, responses[i])).abs().max().item() for i, p in enumerate(prompts)]
    assert max(misses) > 1e-3  # the window counted the gap's slots: what the limit keeps out


def test_a_gap_free_layout_is_shared_on_a_sliding_window(tiny, monkeypatch):
    """A group's samples (one prompt, G responses) need no gap: the sliding-window model shares the prompt."""
    model, tok = tiny["gemma3"]
    prompt = chat(tok, QUESTIONS[1])
    responses = [[40, 41, 42], [43, 44, 45], [46, 47, 48]]
    layouts = []
    original = batching_module.prefix_layout
    monkeypatch.setattr(
        batching_module, "prefix_layout", lambda *a, **k: layouts.append(original(*a, **k)) or layouts[-1]
    )
    logits = response_logits(model, build_batch([prompt] * 3, responses, tok.pad_token_id))
    assert layouts[0] is not None and layouts[0].gap_free and layouts[0].counts.tolist() == [3]
    for i, r in enumerate(responses):
        assert torch.allclose(logits[i], alone_logits(model, prompt, r), rtol=0, atol=1e-10)


def test_prefill_refuses_a_cache_it_cannot_repeat(tiny):
    model, tok = tiny["qwen3_5"]
    prompts = [chat(tok, q) for q in QUESTIONS]
    forced = prefix_layout(prompts, -1, tok.pad_token_id)  # what the limit would have refused
    with pytest.raises(RuntimeError, match=r"LinearAttentionLayer.*cannot be repeated"):
        prefill(model, forced, forced.own_ids[:, :-1], forced.own_mask[:, :-1], logits_to_keep=1)


def test_select_rows_keeps_every_state_of_the_rows_kept(tiny):
    """A Qwen3.5 cache of 3 rows cut to rows 0 and 2: each layer's conv and recurrent states (linear attention) and
    keys and values (full attention) are those rows' own, as the same rows computed without row 1."""
    model, tok = tiny["qwen3_5"]
    ids = torch.tensor([chat(tok, q)[:20] for q in QUESTIONS])  # equal lengths: no padding
    with torch.no_grad():
        three = model(input_ids=ids, use_cache=True).past_key_values
        two = model(input_ids=ids[[0, 2]], use_cache=True).past_key_values
    select_rows(three, torch.tensor([0, 2]))
    for ours, theirs in zip(three.layers, two.layers):
        if hasattr(ours, "conv_states"):
            assert torch.allclose(ours.conv_states[0], theirs.conv_states[0], rtol=0, atol=TOLERANCE["qwen3_5"])
            assert torch.allclose(
                ours.recurrent_states[0], theirs.recurrent_states[0], rtol=0, atol=TOLERANCE["qwen3_5"]
            )
        else:
            assert torch.allclose(ours.keys, theirs.keys, rtol=0, atol=TOLERANCE["qwen3_5"])


def test_a_hybrid_layer_keeps_its_states_with_its_keys():
    """A layer holding both kinds (transformers' LinearAttentionAndFullAttentionLayer) inherits DynamicLayer's
    batch_select_indices, which leaves the states behind; select_rows cuts both."""
    layer = LinearAttentionAndFullAttentionLayer()
    rows = torch.arange(3, dtype=torch.float64)
    layer.update(rows.view(3, 1, 1, 1).expand(3, 1, 2, 4), rows.view(3, 1, 1, 1).expand(3, 1, 2, 4))
    layer.update_conv_state(rows.view(3, 1, 1).expand(3, 2, 4))
    layer.update_recurrent_state(rows.view(3, 1, 1, 1).expand(3, 1, 2, 2))
    inherited = LinearAttentionAndFullAttentionLayer()
    inherited.__dict__.update({k: v for k, v in layer.__dict__.items()})
    inherited.batch_select_indices(torch.tensor([2]))
    assert inherited.keys.shape[0] == 1 and inherited.conv_states[0].shape[0] == 3  # the trap DESIGN.md §6 names
    cache = DynamicCache()
    cache.layers = [layer]
    select_rows(cache, torch.tensor([2]))
    assert layer.keys.shape[0] == layer.conv_states[0].shape[0] == layer.recurrent_states[0].shape[0] == 1
    assert (layer.keys == 2).all() and (layer.conv_states[0] == 2).all() and (layer.recurrent_states[0] == 2).all()
