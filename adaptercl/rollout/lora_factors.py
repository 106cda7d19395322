"""LoRA factors as vLLM is handed them: snapshots of a PEFT adapter's (A, scaled B), the exact combination of
several adapters into one (A stacked along rank, B side by side: B_cat A_cat = sum_i s_i B_i A_i), and writing
them as a PEFT folder with scaling 1. Pure torch; no vLLM import."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from adaptercl.config import RecipeError

LoraFactors = dict[str, tuple[torch.Tensor, torch.Tensor]]  # module name -> (A [r, in], scaled B [out, r])


def lora_factors(model: torch.nn.Module, name: str) -> LoraFactors:
    """Detached CPU float32 copies of adapter `name`'s factors, B pre-multiplied by the adapter's scaling."""
    from peft.tuners.lora import LoraLayer

    out: LoraFactors = {}
    for module_name, module in model.named_modules():
        if isinstance(module, LoraLayer) and name in module.lora_A:
            if module.use_dora.get(name, False):
                raise RecipeError(f"adapter {name!r} uses DoRA, which the vllm rollout engine does not serve")
            a = module.lora_A[name].weight.detach().float().cpu().clone()  # [r, in]
            b = module.lora_B[name].weight.detach().float().cpu() * module.scaling[name]  # [out, r]
            out[module_name] = (a, b)
    if not out:
        raise ValueError(f"the model has no LoRA adapter named {name!r}")
    return out


def combined_lora_factors(adapters: list[LoraFactors]) -> LoraFactors:
    """One adapter whose ΔW is the exact sum of the adapters' ΔW: A stacked along rank, B side by side.

    Every module gets the full summed rank; an adapter that does not touch a module contributes zero factors
    there, so all modules share one rank (vLLM reads a single `r`).
    """
    ranks = [next(iter(f.values()))[0].shape[0] for f in adapters]
    modules = sorted({m for f in adapters for m in f})
    out: LoraFactors = {}
    for m in modules:
        a_parts, b_parts = [], []
        shape_a, shape_b = next(f[m] for f in adapters if m in f)
        for f, r in zip(adapters, ranks):
            a, b = f[m] if m in f else (shape_a.new_zeros(r, shape_a.shape[1]), shape_b.new_zeros(shape_b.shape[0], r))
            a_parts.append(a)
            b_parts.append(b)
        out[m] = (torch.cat(a_parts, dim=0), torch.cat(b_parts, dim=1))  # [R, in], [out, R]
    return out


def write_lora_folder(factors: LoraFactors, path: Path, base_name: str) -> int:
    """Write `factors` as a PEFT LoRA folder with scaling 1 (lora_alpha = r); return the rank."""
    rank = next(iter(factors.values()))[0].shape[0]
    tensors = {}
    for m, (a, b) in factors.items():
        tensors[f"{m}.lora_A.weight"] = a.contiguous()
        tensors[f"{m}.lora_B.weight"] = b.contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name,
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in factors}),
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return rank
