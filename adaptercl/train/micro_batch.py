"""`optim.micro_batch_size` at run time: the micro-batch a stage trains with, said and recorded when a recipe sets it.

    chosen = choose_micro_batch(recipe, index, model, tokenizer, [domain, *replay_domains], world_size)
    ctx.micro_batch = chosen.rows; stage_dir.write_micro_batch(chosen.record)

- `auto` on a CUDA device: `plan.memory.auto_micro_batch` for this card (its total memory), this model's shape (its
  config), prompts of the longest the stage can draw (its domain's and its replay domains' train prompts, encoded as
  the stage encodes them), responses at the cap, the device's activation checkpointing and logit chunks, and what the
  run's engine keeps on the card during the step (a colocated vLLM asleep); at most the rank's rows of a step.
- `auto` without CUDA: `optim.grad_accum`'s split, the recipe's fixed one (a CPU run's memory is the machine's, which
  the plan does not model), so a 24 GB recipe behaves on CPU as with micro_batch_size unset.
- a number: that many sequences (fewer when the rank's share is smaller).
- unset (the default): grad_accum's split; nothing is said or written, as before.

Any split makes the same update (each micro-batch's loss uses the whole batch's denominators, `step.py`), so
the choice changes memory and speed only. Ranks choose alone (a rank's card is its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from adaptercl.domains import Domain
from adaptercl.model import card_gib, encode_chat, resolve_activation_checkpointing, shape_from_config
from adaptercl.plan import MICRO_BATCH_MARGIN, auto_micro_batch
from adaptercl.recipe import RecipeConfig
from adaptercl.train.token_terms import resolve_logits_chunk_size


@dataclass(frozen=True)
class MicroBatchChoice:
    rows: int | None  # sequences per micro-batch; None: the recipe's split (`optim.split_rows`)
    record: dict[str, Any] | None  # micro_batch.json; None when the recipe leaves micro_batch_size unset

    def line(self) -> str:
        r = self.record
        return f"micro-batch {r['micro_batch_size']} of {r['sequences']} sequences a step ({r['why']})"


def choose_micro_batch(
    recipe: RecipeConfig,
    index: int,
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    domains: list[Domain],
    world_size: int = 1,
) -> MicroBatchChoice:
    """Stage `index`'s micro-batch (see the module docstring); `domains`: those its prompts come from."""
    stage = recipe.stages[index]
    optim = stage.optim
    sequences = optim.prompts_per_step // world_size * stage.rollout.group_size  # this rank's rows of a step
    if optim.micro_batch_size is None:
        return MicroBatchChoice(None, None)
    record: dict[str, Any] = {"setting": optim.micro_batch_size, "sequences": sequences}
    device = next(model.parameters()).device
    card = card_gib(device)
    if optim.micro_batch_size != "auto" or card is None:
        rows = optim.split_rows(sequences)
        why = (
            "optim.micro_batch_size"
            if optim.micro_batch_size != "auto"
            else f"auto without a CUDA device: optim.grad_accum's split into {optim.grad_accum}"
        )
        return MicroBatchChoice(rows, {**record, "micro_batch_size": rows, "why": why})
    prompt = max(len(encode_chat(tokenizer, ex.messages)) for d in domains for ex in d.train)
    config = model.config.to_dict() if hasattr(model.config, "to_dict") else dict(model.config)
    shape = shape_from_config(config, "the model's config")
    planned = auto_micro_batch(
        shape,
        recipe,
        index,
        prompt,
        card,
        sequences,
        checkpointing=resolve_activation_checkpointing(optim.activation_checkpointing, device),
        chunk=resolve_logits_chunk_size(optim.logits_chunk_size, device),
    )
    fits = planned.peak_gib * (1 + MICRO_BATCH_MARGIN) <= planned.limit_gib
    why = (
        f"auto: planned step peak {planned.peak_gib:.1f} GiB x {1 + MICRO_BATCH_MARGIN:g} "
        f"{'fits' if fits else 'does not fit even so'} the card's {planned.limit_gib:.1f} GiB, prompts <= {prompt} "
        "tokens"
    )
    record.update(
        micro_batch_size=planned.rows,
        why=why,
        card_gib=round(card, 3),
        limit_gib=round(planned.limit_gib, 3),
        planned_peak_gib=round(planned.peak_gib, 3),
        margin=MICRO_BATCH_MARGIN,
        longest_prompt_tokens=prompt,
    )
    return MicroBatchChoice(planned.rows, record)
