"""The `optim:` block of the recipe grammar: the optimiser, the learning-rate schedule, and how a step's samples are
split into micro-batches and how much of the forward is kept for backward (micro_batch_size, grad_accum, activation
checkpointing, logits chunks). No torch import; `grammar.py` re-exports it."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator

from adaptercl.recipe.config_block import ConfigBlock


class OptimConfig(ConfigBlock):
    lr: float = Field(
        1e-5,
        gt=0.0,
        description="AdamW learning rate of the LoRA parameters. A stage that does not set it gets its method's "
        "default: 5e-6 for srpo (the SRPO paper's, Table 3), 1e-5 for the others.",
    )
    steps: int = Field(100, ge=1, description="Optimiser steps in the stage (a stage's `steps:` sets this).")
    prompts_per_step: int = Field(4, ge=1, description="Distinct prompts per step; samples = prompts x group_size.")
    grad_accum: int = Field(
        1,
        ge=1,
        description="Micro-batches each step's samples are split into for backward (unless micro_batch_size is set; "
        "also micro_batch_size auto's split where there is no CUDA device).",
    )
    micro_batch_size: Literal["auto"] | int | None = Field(
        None,
        description="Sequences per micro-batch of the training step (per data-parallel rank), instead of grad_accum's "
        "split; any split makes the same update. auto: on a CUDA device, per stage, the fastest micro-batch (the "
        "measured step's model: fewer micro-batches, a group's prompt computed once) among those whose planned "
        "training peak (memory.py, with what a colocated vLLM keeps) times 1.1 fits the card, printed "
        "and written to the stage's micro_batch.json; without CUDA, grad_accum's split. Default: grad_accum's split.",
    )
    warmup_steps: int = Field(
        0,
        ge=0,
        description="Linear warm-up steps of each stage (transformers' warm-up: step 0 has LR 0). A stage that does "
        "not set it gets its method's default: 10 for srpo (the SRPO paper's, Table 3; its one long run warms up "
        "once, here every stage's schedule starts again, so set it for short stages), 0 for the others.",
    )
    schedule: Literal["constant", "linear", "cosine", "cosine_with_restarts", "inverse_sqrt"] = Field(
        "constant",
        description="LR schedule: transformers' scheduler of that name over the stage's steps (lr_schedule.py; "
        "`constant` is transformers' constant_with_warmup), as TRL's lr_scheduler_type.",
    )
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient clipping norm.")
    weight_decay: float = Field(
        0.0,
        ge=0.0,
        description="AdamW weight decay of the LoRA parameters (decoupled, torch.optim.AdamW). A stage that does not "
        "set it gets its method's default: 0.01 for srpo (the SRPO paper's, Table 3), 0.0 for the others (TRL's "
        "GRPOConfig and the HF Trainer's TrainingArguments default).",
    )
    activation_checkpointing: Literal["auto"] | bool = Field(
        "auto",
        description="Recompute each decoder layer's activations in backward instead of keeping them (transformers' "
        "non-reentrant checkpointing, during the training forward only). auto: on for CUDA, off on CPU. Under it the "
        "training forward does not share prompt prefixes (transformers drops the key/value cache inside checkpointed "
        "layers); teacher and other no-grad forwards still do.",
    )
    logits_chunk_size: Literal["auto", "off"] | int = Field(
        "auto",
        description="Response positions whose full-vocabulary logits exist at once in the training step: the loss "
        "takes the model's final hidden states and computes logits, log-probs, entropies and divergences one chunk "
        "of positions at a time, recomputing a chunk's logits in backward (token_terms.py). auto: 1024 on CUDA, "
        "off on CPU (full [rows, R, V] float32 logits per micro-batch, as before). An int >= 1 sets the chunk.",
    )

    def split_rows(self, rows: int) -> int:
        """Sequences per micro-batch of a step's `rows` (a rank's share) where no card is planned for:
        micro_batch_size when it is a number, else grad_accum's split (also micro_batch_size auto's without CUDA)."""
        if isinstance(self.micro_batch_size, int):
            return min(self.micro_batch_size, rows)
        return math.ceil(rows / self.grad_accum)

    @field_validator("logits_chunk_size")
    @classmethod
    def _positive_chunk(cls, value: str | int) -> str | int:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"must be 'auto', 'off' or an int >= 1, got {value}")
        return value

    @field_validator("micro_batch_size", mode="before")
    @classmethod
    def _check_micro_batch(cls, value: Any) -> Any:
        if value is None or value == "auto" or (type(value) is int and value >= 1):
            return value
        raise ValueError(f"must be 'auto' or an int >= 1 (sequences per micro-batch), got {value!r}")
