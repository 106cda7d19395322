"""An adapter's LoRA factors: the one representation (`LoraFactors`), where they come from (a live PeftModel, a
PEFT folder), the exact ΔW sum of a stack of adapters, and the one writer of a PEFT folder.

Use: `from_model(model, adapter)` or `read_adapter_folder(path)` give a `LoraFactors` {module: (A [r, in],
B [out, r])} with its scale s (ΔW = s·B·A per module); `combine(stack)` gives one adapter whose ΔW is the sum of
the stack's; `write_adapter_folder(path, factors)` writes factors and their config as a PEFT folder, atomically.
A module is named as in PEFT's saved keys without the `.lora_A.weight` suffix
(`base_model.model.model.layers.0.self_attn.q_proj`), so live adapters and folders use the same names.

- The exact sum (`combine`): A factors concatenated along the rank (rows), B factors each multiplied by its own
  scale and concatenated along the rank (columns), so B_cat·A_cat = Σ_i s_i·B_i·A_i, in float32 with scale 1
  (lora_alpha = r_total). Every module gets the full summed rank (vLLM reads a single `r`): an adapter that has
  no LoRA on a module contributes a zero block of its rank there.
- Its users: the stage's `combined_adapter/` folder (`write_combined_adapter`), the vLLM rollout engine (it
  serves one combined adapter per set of active adapters, from `snapshot`s: CPU float32 copies with the scale
  folded into B, written with `served_config`), and the ΔW merges of `merge.py`.

Unsupported inputs (refused with a one-line `RecipeError`): DoRA adapters (their ΔW is not scale·B·A) in
folders and in vLLM snapshots, rank_pattern / alpha_pattern, non-LoRA PEFT types, `.bin` weights; and damaged ones:
a weights file whose header does not parse or does not cover the file (a copy cut short, `check_weights`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from adaptercl.adapters.merge_math import lora_delta
from adaptercl.recipe import RecipeError
from adaptercl.system import atomic_dir, read_record

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass
class LoraFactors:
    """One adapter as {module: (A [r, in], B [out, r])} and its scale (alpha / r, or alpha / sqrt(r) with rsLoRA)."""

    modules: dict[str, tuple[Tensor, Tensor]]
    scaling: float
    config: dict[str, Any]  # the PEFT adapter_config.json content (a template for written adapters)

    @property
    def rank(self) -> int:
        return next(iter(self.modules.values()))[0].shape[0]

    def deltas(self) -> dict[str, Tensor]:
        return {m: lora_delta(a, b, self.scaling) for m, (a, b) in self.modules.items()}  # [out, in] each


# ------------------------------------------------------------------------------------------- live models


def from_model(model: torch.nn.Module, adapter: str) -> LoraFactors:
    """The LoRA factors of adapter `adapter` of a live PeftModel (detached; no copies)."""
    from peft.tuners.lora import LoraLayer

    modules, scaling = {}, None
    for name, layer in model.named_modules():
        if isinstance(layer, LoraLayer) and adapter in layer.lora_A:
            modules[name] = (layer.lora_A[adapter].weight.detach(), layer.lora_B[adapter].weight.detach())
            scaling = layer.scaling[adapter]
    if not modules:
        raise ValueError(f"the model has no LoRA adapter {adapter!r}")
    return LoraFactors(modules, scaling, model.peft_config[adapter].to_dict())


def snapshot(model: torch.nn.Module, adapter: str) -> LoraFactors:
    """CPU float32 copies of adapter `adapter`'s factors with its scale folded into B (scaling 1), as the vLLM
    engine keeps them between syncs; DoRA adapters are refused."""
    factors = from_model(model, adapter)
    if factors.config.get("use_dora"):
        raise RecipeError(f"adapter {adapter!r} uses DoRA, which the vllm rollout engine does not serve")
    modules = {
        m: (a.float().cpu().clone(), b.float().cpu() * factors.scaling)  # [r, in], [out, r]
        for m, (a, b) in factors.modules.items()
    }
    return LoraFactors(modules, 1.0, factors.config)


# ------------------------------------------------------------------------------------------ the exact sum


def combine(stack: list[LoraFactors]) -> LoraFactors:
    """One adapter whose ΔW is Σ_i s_i·B_i·A_i over `stack`, exactly (rank concatenation; see the module
    docstring): float32 on the CPU, scale 1, config `scale_one_config` of the first adapter's."""
    names: dict[str, None] = {}
    for factors in stack:
        names.update(dict.fromkeys(factors.modules))
    modules = {}
    for module in names:
        a_parts, b_parts = [], []
        shape_a, shape_b = next(f.modules[module] for f in stack if module in f.modules)
        for factors in stack:
            if module in factors.modules:
                a, b = factors.modules[module]
                a_parts.append(a.float())
                b_parts.append(factors.scaling * b.float())
            else:  # this adapter has no LoRA here: a zero block of its rank
                a_parts.append(shape_a.new_zeros(factors.rank, shape_a.shape[1], dtype=torch.float32))
                b_parts.append(shape_b.new_zeros(shape_b.shape[0], factors.rank, dtype=torch.float32))
        modules[module] = (torch.cat(a_parts).cpu(), torch.cat(b_parts, dim=1).cpu())  # [R, in], [out, R]
    rank = sum(f.rank for f in stack)
    return LoraFactors(modules, 1.0, scale_one_config(stack[0].config, modules, rank))


# ------------------------------------------------------------------------------------------------ folders


def target_modules(modules: dict[str, tuple[Tensor, Tensor]]) -> list[str]:
    """The module suffixes, as PEFT writes target_modules; a module of such a suffix absent from `modules` loads
    with B = 0 (ΔW = 0)."""
    return sorted({m.rsplit(".", 1)[-1] for m in modules})


def scale_one_config(template: dict[str, Any], modules: dict[str, tuple[Tensor, Tensor]], rank: int) -> dict:
    """The PEFT config of factors with scale 1 (lora_alpha = r): `template` (an adapter's config) with the rank,
    target modules and plain-LoRA fields set."""
    config = dict(template)
    config.update(
        r=rank,
        lora_alpha=rank,
        use_rslora=False,
        use_dora=False,
        rank_pattern={},
        alpha_pattern={},
        inference_mode=True,
        target_modules=target_modules(modules),
    )
    return config


def served_config(base_model: str, modules: dict[str, tuple[Tensor, Tensor]], rank: int) -> dict:
    """The minimal PEFT config of factors with scale 1 on base `base_model`: what the vLLM engine writes."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "target_modules": target_modules(modules),
    }


def read_adapter_config(path: str | Path) -> dict[str, Any]:
    """The adapter_config.json of a PEFT adapter folder with safetensors weights, read without the weights."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        inside = sorted(p.name for p in path.iterdir() if (p / CONFIG_FILE).is_file()) if path.is_dir() else []
        hint = f"; it holds adapter folders ({', '.join(inside)}): name those" if inside else ""
        raise RecipeError(f"{path}: not a PEFT adapter folder (no {CONFIG_FILE}){hint}")
    if not (path / WEIGHTS_FILE).is_file():
        raise RecipeError(f"{path}: no {WEIGHTS_FILE} (only safetensors adapters are supported)")
    return read_record(path / CONFIG_FILE, "save or export the adapter again")


def check_weights(path: str | Path) -> None:
    """The adapter folder's adapter_model.safetensors, where there is one, must be whole: its header parses and its
    tensors cover the file exactly (safetensors checks both on opening; a copy cut short or a file overwritten fails).
    Reads the header only; a damaged file is one RecipeError line."""
    file = Path(path) / WEIGHTS_FILE
    if not file.is_file():
        return
    try:
        with safe_open(str(file), framework="pt"):
            pass
    except SafetensorError as err:
        why = str(err).split(": ", 1)[-1]
        raise RecipeError(f"{file} is damaged ({why}): copy, save or export the adapter again") from None


def read_adapter_folder(path: str | Path) -> LoraFactors:
    """The LoRA factors of a PEFT adapter folder (adapter_config.json + adapter_model.safetensors)."""
    path = Path(path)
    config = read_adapter_config(path)
    if config.get("peft_type", "LORA") != "LORA":
        raise RecipeError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("use_dora"):
        raise RecipeError(f"{path}: DoRA adapters are not supported (their ΔW is not scale·B·A)")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise RecipeError(f"{path}: adapters with rank_pattern/alpha_pattern are not supported")
    check_weights(path)
    tensors = load_file(str(path / WEIGHTS_FILE))
    modules: dict[str, tuple[Tensor, Tensor]] = {}
    for key, a in tensors.items():
        if key.endswith(".lora_A.weight"):
            module = key.removesuffix(".lora_A.weight")
            b = tensors.get(f"{module}.lora_B.weight")
            if b is None:
                raise RecipeError(f"{path}: {key} has no matching lora_B weight")
            modules[module] = (a, b)
    if not modules:
        raise RecipeError(f"{path}: {WEIGHTS_FILE} holds no LoRA A/B weights")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or not isinstance(alpha, (int, float)) or r < 1:
        raise RecipeError(f"{path}: adapter_config.json needs integer r and numeric lora_alpha")
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return LoraFactors(modules, scaling, config)


def write_adapter_folder(
    path: str | Path,
    factors: LoraFactors,
    dtype: torch.dtype | None = None,
    extra_files: dict[str, str] | None = None,
) -> None:
    """Write `factors` as a PEFT folder, atomically: its modules (cast to `dtype` when given) and its config as
    adapter_config.json, verbatim (build it with `scale_one_config` or `served_config`), plus `extra_files`."""
    tensors = {}
    for module, (a, b) in factors.modules.items():
        tensors[f"{module}.lora_A.weight"] = (a if dtype is None else a.to(dtype)).contiguous()
        tensors[f"{module}.lora_B.weight"] = (b if dtype is None else b.to(dtype)).contiguous()
    with atomic_dir(path) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE))
        (tmp / CONFIG_FILE).write_text(json.dumps(factors.config, indent=2, default=_json_value) + "\n")
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)


def _json_value(value: Any) -> Any:
    """A config value JSON has no type for: a set as a sorted list, as PEFT's own save writes it (PEFT keeps
    `target_modules` and `target_parameters` as sets: an MoE model's empty `target_parameters` written as the string
    "set()" made `PeftModel.from_pretrained` refuse the folder), anything else as its string."""
    return sorted(value) if isinstance(value, (set, frozenset)) else str(value)


def write_combined_adapter(model: torch.nn.Module, adapters: list[str], path: str | Path) -> dict[str, Any]:
    """One PEFT adapter whose ΔW is Σ_i s_i·B_i·A_i over `adapters` (exact: rank concatenation); returns its info."""
    combined = combine([from_model(model, name) for name in adapters])
    write_adapter_folder(path, combined)
    return {"adapters": list(adapters), "rank": combined.rank}
