"""Token batches: prefix-shared logits (each run of rows' common prompt prefix computed once) equal the plain
forward, for identical prompts, prompts that differ after a shared question, and prompts sharing only a header."""

from __future__ import annotations

import pytest
import torch

from adaptercl.adapters.live import attach_adapter, lora_parameters
from adaptercl.model.base import load_base
from adaptercl.model.batching import build_batch, response_logits
from adaptercl.model.prefix_sharing import prefix_layout, shared_prefix_runs
from adaptercl.recipe.grammar import LoraConfig, ModelConfig


def student_model(quantization: str):
    base = load_base(ModelConfig(name="tiny-random"), quantization)
    model = attach_adapter(base.model, "student", LoraConfig(r=4, alpha=8))
    model.set_adapter("student")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in lora_parameters(model, "student").values():
            p.add_(0.2 * torch.randn(p.shape, generator=g))  # B != 0: the adapter changes the logits
    return model, base.tokenizer


PROMPTS = ["<|im_start|>user\nwhat is two plus two?<|im_end|>\n", "abc", "a longer prompt than the others"]


def grouped_batch(tok, group: int = 3):
    responses = [" four", "xyz!", "", " yes", "q", "12345678", " no", " maybe so", "k"]
    ids = [tok(p)["input_ids"] for p in PROMPTS for _ in range(group)]
    return build_batch(ids, [tok(r)["input_ids"] for r in responses], tok.pad_token_id)


def teacher_like_batch(tok):
    """An SDPO-style teacher batch: each group's question, then a different solution or feedback per row; the
    last row stands alone; every prompt starts with the same header."""
    header = "<|im_start|>user\n"
    tails = [" solution: four", " feedback: wrong, try again", " solution: 4", "?"]
    questions = ["what is two plus two?", "name a colour"]
    texts = [header + q + t for q in questions for t in tails[:3]] + [header + "a lone prompt" + tails[3]]
    responses = [" four", "xyz!", "", " yes", "q", "12345678", " no"]
    return build_batch(
        [tok(t)["input_ids"] for t in texts], [tok(r)["input_ids"] for r in responses], tok.pad_token_id
    )


def test_shared_prefix_runs_maximise_the_tokens_computed_once():
    a, b = [1, 2, 3, 4, 5], [1, 2, 3, 9]
    # identical prompts: one run, every prompt keeps its last token of its own
    assert shared_prefix_runs([a, a, a]) == ([3], [4])
    # a group sharing [1, 2, 3] then a lone prompt sharing only [1]: two runs, not one run sharing [1]
    assert shared_prefix_runs([a, b, a, [1, 7, 7]]) == ([3, 1], [3, 2])
    # nothing in common: single rows, each keeping all but its last token in its prefix
    assert shared_prefix_runs([[5, 6], [7, 8, 9]]) == ([1, 1], [1, 2])
    # a shared header over many rows beats splitting into pairs that share more
    rows = [[1, 2, 3, 4, 10 + i, 20 + i // 2] for i in range(6)]
    assert shared_prefix_runs(rows) == ([6], [4])


def layout_of(batch):
    r_width = batch.response_ids.shape[1]
    p_width = batch.input_ids.shape[1] - r_width
    prompts = [
        row[m.bool()].tolist() for row, m in zip(batch.input_ids[:, :p_width], batch.attention_mask[:, :p_width])
    ]
    return prefix_layout(prompts, r_width - 1, pad_id=0)


def test_the_plain_layout_is_kept_when_sharing_saves_nothing():
    model, tok = student_model("none")
    assert layout_of(grouped_batch(tok).select([0, 3, 6])) is None  # three prompts with no common prefix
    grouped = layout_of(grouped_batch(tok))
    assert grouped.counts.tolist() == [3, 3, 3]
    assert grouped.prefix_mask.sum(-1).tolist() == [len(tok(p)["input_ids"]) - 1 for p in PROMPTS]
    assert grouped.own_mask.sum(-1).tolist() == [1] * 9
    teacher = layout_of(teacher_like_batch(tok))
    header_and_question = len(tok("<|im_start|>user\nwhat is two plus two?")["input_ids"])
    assert teacher.counts[0] == 3 and teacher.prefix_mask[0].sum() >= header_and_question - 1
    # every row's whole prompt is its prefix followed by its own tokens
    batch = teacher_like_batch(tok)
    ids, mask = teacher.prompt_ids(), teacher.prompt_mask()
    for i in range(batch.input_ids.shape[0]):
        p_width = batch.input_ids.shape[1] - batch.response_ids.shape[1]
        expected = batch.input_ids[i, :p_width][batch.attention_mask[i, :p_width].bool()]
        assert ids[i][mask[i].bool()].tolist() == expected.tolist()


@pytest.mark.parametrize(
    ("quantization", "layout"), [("none", "grouped"), ("nf4", "grouped"), ("none", "teacher"), ("nf4", "teacher")]
)
def test_shared_prefix_logits_and_gradients_equal_the_plain_forward(quantization, layout):
    model, tok = student_model(quantization)
    model.train()
    batch = grouped_batch(tok) if layout == "grouped" else teacher_like_batch(tok)
    assert layout_of(batch) is not None  # the shared path runs
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
    # float32, two summation orders: the rounding is ~ n·2^-24 of the largest terms summed, with n up to the response
    # positions (~200) times the sums each layer's backward adds (a few): n·2^-24 ≲ 1,600 x 6e-8 ≈ 1e-4 of a
    # gradient's largest entry (up to 7.6e-6 seen over 12 draws). Compared normwise: elementwise a small entry's
    # relative error can be anything (a 0.02 entry was off by 3e-4 on one draw). A dropped or shifted token moves
    # the gradients by O(1) of their scale.
    for k in plain_grads:
        scale = plain_grads[k].abs().max().item()
        torch.testing.assert_close(shared_grads[k], plain_grads[k], rtol=0, atol=1e-4 * scale)


@pytest.mark.parametrize(("greedy", "n"), [(True, 3), (False, 3), (False, 1)])
def test_rollouts_with_shared_prefixes_equal_rollouts_without(greedy, n, monkeypatch):
    from adaptercl.rollout import SamplingParams, hf

    model, tok = student_model("none")
    header = "<|im_start|>user\n"  # n = 1: distinct prompts that share only this header
    texts = [header + "what is two plus two?", header + "abc", header + "a longer prompt than the others"]
    prompts = [tok(t)["input_ids"] for t in texts]
    params = SamplingParams(max_new_tokens=8, n=n, greedy=greedy, seed=5)
    layouts = []
    layout = hf.prefix_layout
    monkeypatch.setattr(hf, "prefix_layout", lambda *a, **k: layouts.append(layout(*a, **k)) or layouts[-1])
    shared = hf.HFEngine(model, tok).generate(prompts, ["student"], params)
    assert layouts and layouts[0] is not None  # the shared path ran
    assert layouts[0].counts.tolist() == ([n] * 3 if n > 1 else [3])
    monkeypatch.setattr(hf, "prefix_layout", lambda *a, **k: None)
    plain = hf.HFEngine(model, tok).generate(prompts, ["student"], params)
    assert [[c.token_ids for c in g] for g in shared] == [[c.token_ids for c in g] for g in plain]
    if not greedy and n > 1:  # different samples within a group, not one repeated
        assert len({tuple(c.token_ids) for g in shared for c in g}) > len(prompts)


def test_response_logits_are_divided_by_the_temperature():
    model, tok = student_model("none")
    batch = grouped_batch(tok)
    with torch.no_grad():
        plain = response_logits(model, batch)
        hot = response_logits(model, batch, temperature=0.5)
    assert plain.abs().max() > 0
    torch.testing.assert_close(hot, plain * 2.0, rtol=1e-6, atol=1e-6)
