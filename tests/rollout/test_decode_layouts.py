"""The hf engine's prefill and decode loop on cache layouts other than full attention (`rollout/decode.py`,
`model/cache_layers.py`): a tiny Qwen3.5 (Gated DeltaNet linear attention, whose cache layers have no batch methods)
and a tiny Gemma 3 (a 16-position sliding window). Greedy rows equal `transformers.generate`'s on the plain
left-padded batch, prompts sharing a system prompt and groups of 2, while rows stop at different lengths and leave the
batch; a cache with a layer kind the loop has no rule for keeps its rows to the end, masked, with the same tokens.
Models in float64, so that a batch size's rounding cannot move a greedy token."""

from __future__ import annotations

import pytest
import torch
from reference_generate import greedy_generate, left_padded
from tiny_families import write_tiny_family

from adaptercl.model.base import load_base
from adaptercl.model.cache_layers import LinearAttentionLayer
from adaptercl.recipe.grammar import ModelConfig
from adaptercl.rollout import decode as decode_module
from adaptercl.rollout import hf
from adaptercl.rollout.protocol import SamplingParams

# a shared 20-token start (longer than Gemma 3's window) and tails of different lengths: a shared-prefix layout would
# have a gap; raw tokens, since a random model's greedy continuation of a chat template's last line hardly depends on
# the question before it
PROMPTS = [list(range(30, 50)) + tail for tail in ([5], [6, 7, 8, 9], [60, 61])]
FAMILIES = ["qwen3_5", "gemma3"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode-layouts")
    out = {}
    for family in FAMILIES:
        base = load_base(ModelConfig(name=str(write_tiny_family(family, root / family)), dtype="float64"), "none")
        out[family] = (base.model.eval(), base.tokenizer)
    return out


def generate_rows(model, prompts: list[list[int]], pad_id: int, stop_ids: list[int], n: int) -> list[list[int]]:
    """`transformers.generate`, greedy, on the plain left-padded batch; each row cut after its first stop id."""
    return greedy_generate(model, *left_padded(prompts, pad_id), stop_ids, pad_id, n)


def run(engine, prompts, model) -> tuple[list[list[int]], list[int]]:
    """The engine's greedy rows (2 per prompt) and the batch size of every forward."""
    sizes = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: sizes.append(kw["input_ids"].shape[0]), with_kwargs=True)
    try:
        groups = engine.generate(prompts, None, SamplingParams(12, greedy=True, n=2))
    finally:
        hook.remove()
    return [c.token_ids for g in groups for c in g], sizes


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_rows_equal_generate_while_rows_leave_the_batch(tiny, family):
    model, tok = tiny[family]
    prompts = PROMPTS
    rows = [p for p in prompts for _ in range(2)]
    engine = hf.HFEngine(model, tok, fold_lora=False)
    free = generate_rows(model, rows, tok.pad_token_id, [-1], 12)
    engine.stop_ids = sorted({free[0][2], free[-1][7]})  # tokens the rows emit at different steps
    ours, sizes = run(engine, prompts, model)
    assert ours == generate_rows(model, rows, tok.pad_token_id, engine.stop_ids, 12)
    assert len({len(r) for r in ours}) > 1
    assert sizes[0] == len(rows) and min(sizes) < len(rows)  # one prefill of every row, then rows left


def test_a_cache_layer_without_a_rule_keeps_its_rows_masked(tiny, monkeypatch):
    """Qwen3.5 with its linear-attention layers' rule taken away (as a layer kind the loop does not know): no row
    leaves the batch, and every row's tokens are what they were when rows left."""
    model, tok = tiny["qwen3_5"]
    prompts = PROMPTS
    engine = hf.HFEngine(model, tok, fold_lora=False)
    free = generate_rows(model, [p for p in prompts for _ in range(2)], tok.pad_token_id, [-1], 12)
    engine.stop_ids = sorted({free[0][3], free[-1][6]})
    dropping, dropping_sizes = run(engine, prompts, model)
    rules = {kind: rule for kind, rule in decode_module.ROW_RULES.items() if kind is not LinearAttentionLayer}
    monkeypatch.setattr(decode_module, "ROW_RULES", rules)
    masked, masked_sizes = run(engine, prompts, model)
    assert masked == dropping and len({len(r) for r in masked}) > 1
    assert min(dropping_sizes) < 6 and set(masked_sizes) == {6}  # every forward holds all 6 rows


@pytest.mark.parametrize("family", FAMILIES)
def test_the_reservation_takes_only_plain_full_attention_layers(tiny, family):
    """`reserve` swaps exactly the plain DynamicLayers for ReservedLayers: Qwen3.5's linear-attention layers and
    Gemma 3's sliding-window layers are left as they are."""
    model, _ = tiny[family]
    with torch.no_grad():
        cache = model(input_ids=torch.tensor([PROMPTS[0]]), use_cache=True).past_key_values
    before = [type(layer).__name__ for layer in cache.layers]
    decode_module.reserve(cache, 4)
    after = [type(layer).__name__ for layer in cache.layers]
    assert after == [("ReservedLayer" if kind == "DynamicLayer" else kind) for kind in before]
    assert after.count("ReservedLayer") == 1  # each tiny model's one full-attention layer (its last)
