"""LoRA factors in and out of models and PEFT folders: ΔW merges of adapter folders, merge-initialised stage
adapters, and the combined adapter of a stack of stage adapters.

The math lives in `merging.py` (pure tensors); this module only moves factors between PEFT folders, live
PeftModels and those functions. A module is named as in PEFT's saved keys without the `.lora_A.weight` suffix
(`base_model.model.model.layers.0.self_attn.q_proj`), so live adapters and folders use the same names.

- `merge_adapter_folders` (`adaptercl merge`): ΔW-space merge of PEFT adapter folders (each ΔW = scale·B·A, per
  module, union of modules), truncated-SVD re-factorisation to `rank`, written as a PEFT folder with
  lora_alpha = r (scale 1: the factors hold the merged ΔW itself) plus `merge_report.json` (relative Frobenius
  error of the re-factorisation per module, mean and max).
- `init_adapter_from_merge` (`adapter.init: merge`): the same merge of earlier stage adapters of a live model,
  written into the stage's freshly attached adapter. The stage keeps its own lora.alpha / r (so training behaves
  as for any other stage): its scale s is folded into B (B = B_svd / s), so s·B·A equals the re-factorised merge.
  Rank directions the SVD leaves empty (merged rank < r: singular values below 1e-6 x the largest, i.e. float
  noise) get the fresh adapter's random A row and a zero B column: ΔW is unchanged (up to that noise) and those
  directions can still learn (A = B = 0 would give them no gradient, ever). The reported error is the SVD's.
- `write_combined_adapter`: one adapter whose ΔW is the sum of a stack's adapters, exactly, by concatenating the
  A factors along the rank (rows) and the scale-folded B factors along the rank (columns), lora_alpha = r_total.

Unsupported inputs (refused with a one-line `RecipeError`): DoRA adapters (their ΔW is not scale·B·A),
rank_pattern / alpha_pattern, non-LoRA PEFT types, `.bin` weights.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from adaptercl.atomic import atomic_dir
from adaptercl.config import RecipeError
from adaptercl.merging import MERGE_METHODS, lora_delta, merge_module_deltas, refactorize

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
REPORT_FILE = "merge_report.json"
EMPTY_DIRECTION_TOL = 1e-6  # a singular value below this x the largest is numerical noise of a lower-rank merge
SUM_METHODS = ("task_arithmetic", "dare_linear")  # methods whose result is a weighted sum (default weights 1/n)


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


def default_merge_weights(method: str, n: int) -> list[float]:
    """Equal weights: 1/n for the summing methods (the mean of the deltas), 1 for TIES/DARE-TIES (whose disjoint
    mean already averages)."""
    return [1.0 / n] * n if method in SUM_METHODS else [1.0] * n


# ------------------------------------------------------------------------------------------------ folders


def read_adapter_folder(path: str | Path) -> LoraFactors:
    """The LoRA factors of a PEFT adapter folder (adapter_config.json + adapter_model.safetensors)."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise RecipeError(f"{path}: not a PEFT adapter folder (no {CONFIG_FILE})")
    if not (path / WEIGHTS_FILE).is_file():
        raise RecipeError(f"{path}: no {WEIGHTS_FILE} (only safetensors adapters are supported)")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except json.JSONDecodeError as err:
        raise RecipeError(f"{path / CONFIG_FILE}: not valid JSON ({err})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise RecipeError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("use_dora"):
        raise RecipeError(f"{path}: DoRA adapters are not supported (their ΔW is not scale·B·A)")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise RecipeError(f"{path}: adapters with rank_pattern/alpha_pattern are not supported")
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
    modules: dict[str, tuple[Tensor, Tensor]],
    rank: int,
    template: dict[str, Any],
    dtype: torch.dtype,
    extra_files: dict[str, str] | None = None,
) -> None:
    """Write factors with scale 1 (lora_alpha = r) as a PEFT folder, atomically. target_modules = the module
    suffixes (as PEFT writes them); a module of that suffix absent from `modules` loads with B = 0 (ΔW = 0)."""
    config = dict(template)
    config.update(
        r=rank,
        lora_alpha=rank,
        use_rslora=False,
        use_dora=False,
        rank_pattern={},
        alpha_pattern={},
        inference_mode=True,
        target_modules=sorted({m.rsplit(".", 1)[-1] for m in modules}),
    )
    tensors = {}
    for module, (a, b) in modules.items():
        tensors[f"{module}.lora_A.weight"] = a.to(dtype).contiguous()
        tensors[f"{module}.lora_B.weight"] = b.to(dtype).contiguous()
    with atomic_dir(path) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE))
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, default=str) + "\n")
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)


def merge_adapter_folders(
    paths: list[str | Path],
    out: str | Path,
    method: str = "task_arithmetic",
    weights: list[float] | None = None,
    density: float = 1.0,
    rank: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """ΔW-space merge of PEFT adapter folders into a new PEFT folder `out`; returns (and writes) the report.

    rank defaults to the largest input rank. The report holds the relative Frobenius error of the rank-`rank`
    re-factorisation per module, ‖ΔW − B A‖_F / ‖ΔW‖_F, and its mean and max.
    """
    if not paths:
        raise RecipeError("merge: give at least one adapter folder")
    if method not in MERGE_METHODS:
        raise RecipeError(f"merge: unknown method {method!r}; choose one of {', '.join(MERGE_METHODS)}")
    weights = default_merge_weights(method, len(paths)) if weights is None else list(weights)
    if len(weights) != len(paths):
        raise RecipeError(f"merge: {len(weights)} weights for {len(paths)} adapters; give one weight per adapter")
    if not 0.0 < density <= 1.0:
        raise RecipeError(f"merge: density must be in (0, 1], got {density}")
    adapters = [read_adapter_folder(p) for p in paths]
    rank = rank or max(a.rank for a in adapters)
    if rank < 1:
        raise RecipeError(f"merge: rank must be >= 1, got {rank}")
    try:
        merged = merge_module_deltas([a.deltas() for a in adapters], weights, method, density, seed)
    except ValueError as err:  # e.g. one module with different shapes across adapters
        raise RecipeError(f"merge: {err}") from None
    modules, errors = {}, {}
    for module, delta in merged.items():
        a, b, errors[module] = refactorize(delta, rank)
        modules[module] = (a, b)
    dtype = next(iter(adapters[0].modules.values()))[0].dtype
    report = {
        "adapters": [str(p) for p in paths],
        "method": method,
        "weights": weights,
        "density": density,
        "rank": rank,
        "seed": seed,
        **error_summary(errors),
    }
    write_adapter_folder(
        out, modules, rank, adapters[0].config, dtype, {REPORT_FILE: json.dumps(report, indent=2) + "\n"}
    )
    return report


def error_summary(errors: dict[str, float]) -> dict[str, Any]:
    values = list(errors.values()) or [0.0]
    return {"rel_error_mean": sum(values) / len(values), "rel_error_max": max(values), "rel_error": errors}


# ------------------------------------------------------------------------------------------- live models


def model_factors(model: torch.nn.Module, adapter: str) -> LoraFactors:
    """The LoRA factors of adapter `adapter` of a live PeftModel (detached; no copies of the base)."""
    from peft.tuners.lora import LoraLayer

    modules, scaling = {}, None
    for name, layer in model.named_modules():
        if isinstance(layer, LoraLayer) and adapter in layer.lora_A:
            modules[name] = (layer.lora_A[adapter].weight.detach(), layer.lora_B[adapter].weight.detach())
            scaling = layer.scaling[adapter]
    if not modules:
        raise ValueError(f"the model has no LoRA adapter {adapter!r}")
    return LoraFactors(modules, scaling, model.peft_config[adapter].to_dict())


@torch.no_grad()
def init_adapter_from_merge(
    model: torch.nn.Module,
    target: str,
    sources: list[str],
    method: str,
    weights: list[float] | None,
    density: float,
    seed: int,
) -> dict[str, Any]:
    """Set adapter `target` (freshly attached) to the re-factorised ΔW merge of adapters `sources` (see the module
    docstring); return the report (relative Frobenius error per module, mean, max)."""
    from peft.tuners.lora import LoraLayer

    weights = default_merge_weights(method, len(sources)) if weights is None else list(weights)
    merged = merge_module_deltas([model_factors(model, s).deltas() for s in sources], weights, method, density, seed)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer) and target in m.lora_A}
    missing = sorted(set(merged) - set(layers))
    if missing:
        raise RecipeError(
            f"adapter.init merge: earlier adapters have LoRA on {missing[0]} but stage adapter {target!r} does not; "
            "give the stage the same lora.target_modules"
        )
    errors = {}
    for module, delta in merged.items():
        layer = layers[module]
        a_param, b_param = layer.lora_A[target].weight, layer.lora_B[target].weight  # [r, in], [out, r]
        a, b, errors[module] = refactorize(delta.to(a_param.device), a_param.shape[0])
        b = b / layer.scaling[target]  # fold the stage's scale: s·B·A = the re-factorised merge
        sigma = a.square().sum(1)  # [r] singular values of the merge (A rows are √σ_i v_iᵀ)
        empty = sigma <= EMPTY_DIRECTION_TOL * sigma.max()  # [r] directions the merge does not use (rank < r)
        a[empty] = a_param[empty].to(a.dtype)  # keep the fresh random A row there and zero the B column
        b[:, empty] = 0.0
        a_param.copy_(a)
        b_param.copy_(b)
    return {"sources": sources, "method": method, "weights": weights, "density": density, **error_summary(errors)}


def write_combined_adapter(model: torch.nn.Module, adapters: list[str], path: str | Path) -> dict[str, Any]:
    """One PEFT adapter whose ΔW is Σ_i s_i·B_i·A_i over `adapters` (exact: rank concatenation); returns its info."""
    stack = [model_factors(model, name) for name in adapters]
    names: dict[str, None] = {}
    for factors in stack:
        names.update(dict.fromkeys(factors.modules))
    modules = {}
    for module in names:
        a_parts, b_parts = [], []
        shape = next(f.modules[module] for f in stack if module in f.modules)
        for factors in stack:
            if module in factors.modules:
                a, b = factors.modules[module]
                a_parts.append(a.float())
                b_parts.append(factors.scaling * b.float())
            else:  # this adapter has no LoRA here: a zero block of its rank
                a_parts.append(shape[0].new_zeros(factors.rank, shape[0].shape[1], dtype=torch.float32))
                b_parts.append(shape[1].new_zeros(shape[1].shape[0], factors.rank, dtype=torch.float32))
        modules[module] = (torch.cat(a_parts).cpu(), torch.cat(b_parts, dim=1).cpu())  # [R, in], [out, R]
    rank = sum(f.rank for f in stack)
    write_adapter_folder(path, modules, rank, stack[0].config, torch.float32)
    return {"adapters": list(adapters), "rank": rank}
