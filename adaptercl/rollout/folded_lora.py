"""Fold the active LoRA adapters into temporary copies of their float32 base weights while generating.

Decoding one token at a time is bound by reading weights, and an unmerged LoRA layer adds two small matmuls, a
scale and an add per token to every adapted linear layer. Folding `W + sum_a scale_a * B_a @ A_a` into a scratch
copy of `W` for the length of a `generate` call removes that work. The original weight tensor is never written: it
is swapped back by reference afterwards, so the base stays bit-identical and training sees the unmerged adapters.

Only float32 `nn.Linear` bases are folded: in bf16/fp16 the sum would round `B @ A` (typically ~1e-3 of `W`) away
and change the policy being sampled, and a 4-bit base has no dense weight to add to. Those layers, and adapter
variants such as DoRA, keep running their LoRA unmerged. The cost is one extra copy of each folded weight during
generation.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.lora.layer import LoraLayer


def foldable_adapters(layer: torch.nn.Module) -> list[str]:
    """The active adapters of `layer` that `folded_lora` would fold into its base weight ([] if none)."""
    if not isinstance(layer, LoraLinear) or layer.disable_adapters or layer.merged:
        return []
    base = layer.base_layer
    if type(base) is not torch.nn.Linear or base.weight.dtype != torch.float32:
        return []
    names = [a for a in layer.active_adapters if a in layer.lora_A]
    if any(a in layer.lora_variant for a in names):  # DoRA and other variants are not a plain B @ A
        return []
    return names


def lora_factor_layers(model: torch.nn.Module) -> frozenset[int]:
    """The `id`s of every LoRA layer's own A and B linear layers in `model` (PEFT's `lora_A` / `lora_B`): what a
    reduced-precision rollout keeps in float32 (`packed_weights.packed_linears`' keep_float32)."""
    return frozenset(
        id(factor)
        for layer in model.modules()
        if isinstance(layer, LoraLayer)
        for factors in (layer.lora_A, layer.lora_B)
        for factor in factors.values()
    )


@contextmanager
def folded_lora(model: torch.nn.Module) -> Iterator[int]:
    """Run the block (inference only) with every foldable LoRA layer folded; yields how many were folded."""
    folded: list[tuple[LoraLinear, torch.Tensor, dict[torch.nn.Parameter, bool]]] = []
    try:
        with torch.no_grad():
            for layer in model.modules():
                names = foldable_adapters(layer)
                if not names:
                    continue
                weight = layer.base_layer.weight  # [out, in]
                original = weight.data
                merged = original.clone()  # [out, in]
                for name in names:
                    merged += layer.get_delta_weight(name)  # scale * B @ A, [out, in]
                flags = {p: p.requires_grad for p in layer.parameters()}
                folded.append((layer, original, flags))
                weight.data = merged
                layer.enable_adapters(False)
        yield len(folded)
    finally:
        for layer, original, flags in reversed(folded):
            layer.base_layer.weight.data = original
            layer.enable_adapters(True)
            for p, requires_grad in flags.items():  # PEFT's toggles reset requires_grad; put ours back
                p.requires_grad_(requires_grad)
