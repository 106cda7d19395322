"""Named LoRA adapters on one base: attach, activate, freeze, copy, save and load.

One PeftModel holds every adapter of a run: the trainable student (named after its stage, e.g.
`stage-02-science`), frozen earlier stages, and the teacher. Only adapter-sized tensors are ever duplicated.
PEFT's `set_adapter` also flips `requires_grad`, so every activation here goes through `active_adapters`, which
restores both the active set and the trainable flags afterwards; `set_trainable` says which single adapter
learns.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model

from adaptercl.model import decoder_layer_count, layer_types, lora_layer_indices, resolve_lora_targets
from adaptercl.recipe import LoraConfig
from adaptercl.system import atomic_dir, peft_wraps_quietly


def peft_lora_config(cfg: LoraConfig, model: torch.nn.Module) -> PeftLoraConfig:
    """PEFT's LoraConfig of a `lora` block for `model`: `lora.layers` (negative from the top) as 0-based indices of
    its decoder layers (`model/lora_layers.py`) and `lora.target_modules` resolved on it (`model/lora_targets.py`:
    auto = the family's attention and MLP projections); a RecipeError for either that does not fit the model."""
    layers = None
    if cfg.layers is not None:
        count = decoder_layer_count(model)
        if count is None:
            raise ValueError("lora.layers needs the model's number of layers")
        layers = lora_layer_indices(cfg.layers, count, types=layer_types(model))
    return PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=resolve_lora_targets(model, cfg.target_modules, layers),
        layers_to_transform=layers,
        task_type="CAUSAL_LM",
    )


def attach_adapter(model: torch.nn.Module, name: str, cfg: LoraConfig) -> PeftModel:
    """Add a fresh LoRA adapter `name` (B = 0, so the model is unchanged); wraps the base on first use."""
    peft_cfg = peft_lora_config(cfg, model)
    if isinstance(model, PeftModel):
        model.add_adapter(name, peft_cfg)
        return model
    with peft_wraps_quietly():
        return get_peft_model(model, peft_cfg, adapter_name=name)


def load_adapter(model: torch.nn.Module, path: str | Path, name: str) -> PeftModel:
    """Load a saved PEFT adapter folder as adapter `name` (frozen)."""
    if isinstance(model, PeftModel):
        model.load_adapter(str(path), adapter_name=name, is_trainable=False)
        return model
    with peft_wraps_quietly():
        return PeftModel.from_pretrained(model, str(path), adapter_name=name, is_trainable=False)


def adapter_names(model: torch.nn.Module) -> list[str]:
    return list(model.peft_config) if isinstance(model, PeftModel) else []


def lora_parameters(model: torch.nn.Module, name: str) -> dict[str, torch.nn.Parameter]:
    """The LoRA parameters of adapter `name`, keyed by their full parameter name."""
    marker = f".{name}."
    return {n: p for n, p in model.named_parameters() if "lora_" in n and marker in n}


def set_trainable(model: torch.nn.Module, name: str | None) -> None:
    """Make exactly the LoRA parameters of adapter `name` trainable (None: nothing)."""
    marker = None if name is None else f".{name}."
    for n, p in model.named_parameters():
        p.requires_grad_(marker is not None and "lora_" in n and marker in n)


@contextmanager
def active_adapters(model: torch.nn.Module, names: list[str] | None) -> Iterator[None]:
    """Run the block with exactly `names` active (None or [] = adapters disabled, i.e. the base model)."""
    if not isinstance(model, PeftModel):
        yield
        return
    if not names:
        with model.disable_adapter():
            yield
        return
    previous = list(model.base_model.active_adapters)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    model.base_model.set_adapter(list(names))
    try:
        yield
    finally:
        model.base_model.set_adapter(previous)
        for n, p in model.named_parameters():
            p.requires_grad_(flags[n])


def use_adapters(model: torch.nn.Module, names: list[str], trainable: str | None) -> None:
    """Set the active adapters for training and rollouts, with only `trainable` learning."""
    if isinstance(model, PeftModel):
        model.base_model.set_adapter(list(names))
    set_trainable(model, trainable)


def adapter_state(model: torch.nn.Module, name: str) -> dict[str, torch.Tensor]:
    """A detached copy of adapter `name`'s LoRA tensors, keyed with the adapter name removed."""
    marker = f".{name}."
    return {n.replace(marker, "."): p.detach().clone() for n, p in lora_parameters(model, name).items()}


@torch.no_grad()
def load_adapter_state(model: torch.nn.Module, name: str, state: dict[str, torch.Tensor]) -> None:
    """Copy tensors from `adapter_state` (of any adapter with the same shapes) into adapter `name`."""
    params = lora_parameters(model, name)
    marker = f".{name}."
    for n, p in params.items():
        p.copy_(state[n.replace(marker, ".")])


@torch.no_grad()
def copy_adapter(model: torch.nn.Module, source: str, target: str) -> None:
    load_adapter_state(model, target, adapter_state(model, source))


def save_adapter(model: PeftModel, name: str, path: str | Path) -> None:
    """Write adapter `name` alone to `path` in PEFT format (atomic); loadable by PeftModel.from_pretrained."""
    with atomic_dir(path) as tmp:
        model.save_pretrained(str(tmp), selected_adapters=[name])
        written = tmp if name == "default" else tmp / name  # PEFT puts non-default adapters in a subfolder
        if written != tmp:
            for item in written.iterdir():
                shutil.move(str(item), tmp / item.name)
            written.rmdir()
