"""Activation checkpointing of the training forwards: every decoder layer recomputed in backward, non-reentrant.

`activation_checkpointing(model, enabled)` wraps, for the span of a training step, the `forward` of every decoder
layer (transformers' `GradientCheckpointingLayer`s, the layers its own checkpointing would take) in
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`; the layer keeps only its input for backward and
recomputes the rest. Non-reentrant: it needs no `enable_input_require_grads`, under PEFT and NF4 alike, gradients
reach tensors the layer reads from outside its arguments (a shared prefix's keys and values), and LoRA dropout is
replayed with the same RNG state.

Why not transformers' own (`gradient_checkpointing_enable`): it drops the key/value cache of a checkpointed layer
(`past_key_values=None`), because a layer that appends to a cache would append a second time when backward recomputes
it. Prompt-prefix sharing (`prefix_sharing.py`) needs the cache in training forwards: it runs a group's prompt once
and continues every row from its keys and values. Its training caches are *replayable* (`prefix_sharing.
ReplayableCache`: the prefix forward records each layer once and a recompute returns the same states, the rows'
forward reads the prefix without appending), so a recompute gives exactly the first pass's tensors, and the cache
can stay. transformers 5.23 added a per-layer switch for cache readers (`_can_checkpoint_with_cache`), but 5.19 and
5.20 (a CUDA user's vLLM pins) lack it; wrapping the layers ourselves works the same on each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

_FLAG = "_adaptercl_checkpointing"  # set on a layer while its forward is wrapped


def resolve_activation_checkpointing(setting: str | bool, device: torch.device) -> bool:
    """`optim.activation_checkpointing`: auto = on for CUDA, off elsewhere."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


def _checkpointed(layer: torch.nn.Module, forward: Callable) -> Callable:
    def run(*args, **kwargs):
        if layer.training and torch.is_grad_enabled():
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    return run


@contextmanager
def activation_checkpointing(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """The body's training forwards checkpoint every decoder layer (non-reentrant) when `enabled`; off after."""
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)] if enabled else []
    layers = [m for m in layers if not getattr(m, _FLAG, False)]  # a nested use leaves the outer one's wrapping
    for layer in layers:
        layer.forward = _checkpointed(layer, layer.forward)  # an instance attribute over the class's forward
        setattr(layer, _FLAG, True)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward
            delattr(layer, _FLAG)


def checkpointing_active(model: torch.nn.Module) -> bool:
    """Whether a forward of `model` now runs its layers under activation checkpointing (on and training)."""
    return model.training and any(getattr(m, _FLAG, False) for m in model.modules())
