"""`transformers.generate` as the reference the decode loop's rows are tested against: greedy, each row cut after its
first stop id. Shared by the decode tests (tests/rollout/test_decode*.py, test_min_new_tokens.py, the model-family
matrix); `reference_generate` on the hf engine's own prompt layout (its shared-prefix prefill cache included)."""

from __future__ import annotations

import torch


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain left-padded batch of `prompts`: input ids and attention mask, [B, W]."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    return ids, mask


def greedy_generate(
    model, ids: torch.Tensor, mask: torch.Tensor, stop_ids: list[int], pad_id: int, max_new_tokens: int, **kwargs
) -> list[list[int]]:
    """Greedy `generate` on the batch `ids` / `mask` [B, W] (`kwargs`: generate's own, e.g. min_new_tokens or a
    cache); each row's new tokens, cut after its first stop id."""
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=stop_ids, pad_token_id=pad_id, **kwargs,
        )  # fmt: skip
    rows = []
    for row in out[:, ids.shape[1] :].tolist():
        stop = next((j for j, t in enumerate(row) if t in stop_ids), None)
        rows.append(row if stop is None else row[: stop + 1])
    return rows


def reference_generate(model, engine, prompts, max_new_tokens, **lengths):
    """transformers.generate, greedy, on the engine's own prompt layout (`lengths`: generate's min_new_tokens or
    min_length); each row cut after its first stop id."""
    from adaptercl.model import CACHE
    from adaptercl.rollout import hf

    ids, mask, cache = hf._prompt_inputs(model, prompts, engine.tokenizer.pad_token_id, torch.device("cpu"))
    pad_id = engine.tokenizer.pad_token_id
    return greedy_generate(model, ids, mask, engine.stop_ids, pad_id, max_new_tokens, **lengths, **{CACHE: cache})
