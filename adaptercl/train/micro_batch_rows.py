"""Which rows make each micro-batch of a training step, so that little of its forward is spent on padding.

A step's batch is laid out [pad.. prompt | response ..pad] (`model/batching.py`), padded to its longest prompt and
its longest response. The training step cuts every micro-batch to its own rows' longest
(`model.batching.trim_padding`), and `micro_batch_rows` chooses which rows go together, the cheapest of `ORDERS`:

- `rollout`: the rows as the rollout returned them, a GRPO group's G samples side by side (prefix sharing then
  computes their common prompt once);
- `length`: sorted by real length (prompt + response tokens), longest first, so rows of like length share a
  micro-batch and little of it is padding;
- `response_length`: sorted by response length, longest first (rows of one group stay together when their responses
  are alike).

"Cheapest" counts the positions the student's forward computes (`forward_positions`: the plain [n, P'+R'] layout,
or the prefix-shared one when `model.batching.response_logits` would take it: `share_prompts` is the model's
`cache_layers.shared_prefix_limit`, True for a model of full-attention layers), ties going to the earlier order; the
attention's quadratic part and the teacher's forward are not counted. One micro-batch keeps the rollout order (the
batch as it is). An order is taken only if none of its micro-batches computes more positions than the rollout
order's largest: the memory plan (`plan/step_memory.py`) sizes a micro-batch by the groups a run of rows in rollout
order spans, and a sorted order that puts rows of many prompts together could need more than that.

The order does not change the update: each micro-batch's loss uses the whole batch's denominators and every
aggregation is a sum of per-sequence terms (`train.losses.micro_batch_aggregate`), so the micro-batches' gradients
sum to the same total whichever rows they hold, up to float rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from adaptercl.model import (
    FULL_ATTENTION,
    NO_SHARING,
    PrefixLimit,
    TokenBatch,
    prefix_layout,
    prompt_lists,
    trim_padding,
)

Rows = slice | torch.Tensor  # the rows of one micro-batch: a slice in rollout order, else indices [n_mb]
Sharing = bool | PrefixLimit  # whether the training forward shares prompt prefixes, and which layouts (True: any)


def _rollout(batch: TokenBatch) -> list[int]:
    return list(range(batch.input_ids.shape[0]))


def _by_length(batch: TokenBatch) -> list[int]:
    lengths = batch.attention_mask.sum(-1).tolist()  # [N] prompt + response tokens
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep the rollout order


def _by_response_length(batch: TokenBatch) -> list[int]:
    lengths = batch.response_mask.sum(-1).tolist()  # [N]
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


ORDERS: dict[str, Callable[[TokenBatch], list[int]]] = {
    "rollout": _rollout,
    "length": _by_length,
    "response_length": _by_response_length,
}


def forward_positions(batch: TokenBatch, share_prompts: Sharing) -> int:
    """Positions the student's forward computes on `batch` as given (trim it first): N x (P+R) in the plain layout,
    or U x C + N x (S+R-1) in the prefix-shared one (`prefix_sharing.prefix_layout`) where that one is taken."""
    n, width = batch.input_ids.shape
    r_width = batch.response_ids.shape[1]
    limit = (
        share_prompts if isinstance(share_prompts, PrefixLimit) else FULL_ATTENTION if share_prompts else NO_SHARING
    )
    layout = prefix_layout(prompt_lists(batch), r_width - 1, pad_id=0, limit=limit)
    if layout is None:
        return n * width
    return layout.prefix_ids.numel() + n * (layout.own_ids.shape[1] + r_width - 1)


def split_order(order: list[int], micro: int) -> list[Rows]:
    """`order` cut into micro-batches of `micro` rows: slices where the order is the rollout's, else index tensors."""
    if order == list(range(len(order))):
        return [slice(start, min(len(order), start + micro)) for start in range(0, len(order), micro)]
    return [torch.tensor(order[start : start + micro]) for start in range(0, len(order), micro)]


def part_positions(batch: TokenBatch, parts: list[Rows], share_prompts: Sharing) -> list[int]:
    """Positions the student's forward computes in each of the micro-batches `parts`, each cut to its own rows."""
    return [forward_positions(trim_padding(batch.select(rows)), share_prompts) for rows in parts]


def order_cost(batch: TokenBatch, parts: list[Rows], share_prompts: Sharing) -> int:
    """Positions the student's forwards compute over the micro-batches `parts`."""
    return sum(part_positions(batch, parts, share_prompts))


def cut(batch: TokenBatch, rows: Rows, parts: int, response_width: int | None = None) -> TokenBatch:
    """Rows `rows` of `batch` cut to their own width (`trim_padding`; `response_width`: a teacher batch cut to its
    student micro-batch's), or as they are when the step has one micro-batch (`parts` 1): a step without
    micro-batches computes exactly what it computed before, bit for bit."""
    selected = batch.select(rows)
    return trim_padding(selected, response_width) if parts > 1 else selected


def micro_batch_rows(batch: TokenBatch, micro: int, share_prompts: Sharing) -> tuple[str, list[Rows]]:
    """The name of the cheapest of `ORDERS` for micro-batches of `micro` rows of `batch` (see the module docstring),
    and its micro-batches' rows. `share_prompts`: whether the training forward shares prompt prefixes (the step's
    does, with or without activation checkpointing, where the model's cache reads the layout: its
    `shared_prefix_limit`)."""
    n = batch.input_ids.shape[0]
    if micro >= n:
        return "rollout", [slice(0, n)]
    candidates = {name: split_order(order(batch), micro) for name, order in ORDERS.items()}
    positions = {name: part_positions(batch, parts, share_prompts) for name, parts in candidates.items()}
    bound = max(positions["rollout"])  # what the memory plan sizes a micro-batch for
    admissible = [name for name in candidates if max(positions[name]) <= bound]
    name = min(admissible, key=lambda key: sum(positions[key]))  # ties: first
    return name, candidates[name]
