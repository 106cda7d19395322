"""The merge commands: ΔW merges of adapter folders (`adaptercl merge`) and merge-initialised stage adapters.

The math lives in `merge_math.py` (pure tensors) and the factor I/O (live models, PEFT folders, the one folder
writer) in `factors.py`; this module only strings them together.

- `merge_adapter_folders` (`adaptercl merge`): ΔW-space merge of PEFT adapter folders (each ΔW = scale·B·A, per
  module, union of modules), truncated-SVD re-factorisation to `rank`, written as a PEFT folder with
  lora_alpha = r (scale 1: the factors hold the merged ΔW itself) plus `merge_report.json` (relative Frobenius
  error of the re-factorisation per module, mean and max) and its `warnings`: an input that already holds another
  input's ΔW (a run's `init: merge` stage merged with a stage its start merged: `counted_twice`). Refused in one line
  before any weight is read: adapters whose adapter_config.json name different base models (`base_model_name_or_path`,
  compared as written: ΔW of two bases added together means nothing; `allow_different_bases` for a base and its
  fine-tune, or one base under two names), an `out` that is one of the inputs, a file, or a non-empty folder other
  than an earlier merge's (an earlier merge is replaced whole, atomically), non-finite weights, a rank below 1.
- `init_adapter_from_merge` (`adapter.init: merge`): the same merge of the earlier stages' task vectors
  (`stage_task_vectors`: each stage adapter's ΔW minus the ΔW it started from, the rule in `stacking.py`) in a live
  model, written into the stage's freshly attached adapter. An earlier merge stage's start is not kept as an
  adapter: it is recomputed the same way (same task vectors, method, seed and rank), so it equals the start that
  stage had up to float rounding. The stage keeps its own lora.alpha / r (so training behaves
  as for any other stage): its scale s is folded into B (B = B_svd / s), so s·B·A equals the re-factorised merge.
  Rank directions the SVD leaves empty (merged rank < r: singular values below 1e-6 x the largest, i.e. float
  noise) get the fresh adapter's random A row and a zero B column: ΔW is unchanged (up to that noise) and those
  directions can still learn (A = B = 0 would give them no gradient, ever). The reported error is the SVD's.

Unsupported inputs are refused by `read_adapter_folder` (see `factors.py`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from adaptercl.adapters.factors import (
    LoraFactors,
    from_model,
    read_adapter_config,
    read_adapter_folder,
    scale_one_config,
    write_adapter_folder,
)
from adaptercl.adapters.merge_math import MERGE_METHODS, merge_module_deltas, refactorize
from adaptercl.adapters.stacking import AdapterPlan
from adaptercl.recipe import AdapterInitConfig, RecipeError
from adaptercl.system import check_new_folder

REPORT_FILE = "merge_report.json"
EMPTY_DIRECTION_TOL = 1e-6  # a singular value below this x the largest is numerical noise of a lower-rank merge
SUM_METHODS = ("task_arithmetic", "dare_linear")  # methods whose result is a weighted sum (default weights 1/n)


def default_merge_weights(method: str, n: int) -> list[float]:
    """Equal weights: 1/n for the summing methods (the mean of the deltas), 1 for TIES/DARE-TIES (whose disjoint
    mean already averages)."""
    return [1.0 / n] * n if method in SUM_METHODS else [1.0] * n


def merge_adapter_folders(
    paths: list[str | Path],
    out: str | Path,
    method: str = "task_arithmetic",
    weights: list[float] | None = None,
    density: float = 1.0,
    rank: int | None = None,
    seed: int = 0,
    allow_different_bases: bool = False,
) -> dict[str, Any]:
    """ΔW-space merge of PEFT adapter folders into a new PEFT folder `out`; returns (and writes) the report.

    rank defaults to the largest input rank. The report holds the relative Frobenius error of the rank-`rank`
    re-factorisation per module, ‖ΔW − B A‖_F / ‖ΔW‖_F, and its mean and max. Bad input is refused first (see the
    module docstring).
    """
    if not paths:
        raise RecipeError("merge: give at least one adapter folder")
    if method not in MERGE_METHODS:
        raise RecipeError(f"merge: unknown method {method!r}; choose one of {', '.join(MERGE_METHODS)}")
    weights = default_merge_weights(method, len(paths)) if weights is None else list(weights)
    if len(weights) != len(paths):
        raise RecipeError(f"merge: {len(weights)} weights for {len(paths)} adapters; give one weight per adapter")
    if not all(math.isfinite(w) for w in weights):
        raise RecipeError(f"merge: --weights must be finite numbers, got {','.join(f'{w:g}' for w in weights)}")
    if not 0.0 < density <= 1.0:
        raise RecipeError(f"merge: density must be in (0, 1], got {density}")
    if rank is not None and rank < 1:
        raise RecipeError(f"merge: rank must be >= 1, got {rank}")
    check_merge_out(paths, out)
    configs = [read_adapter_config(p) for p in paths]
    if not allow_different_bases:
        check_one_base(paths, configs)
    adapters = [read_adapter_folder(p) for p in paths]
    warnings = counted_twice(paths)
    rank = rank or max(a.rank for a in adapters)
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
        "warnings": warnings,
        **error_summary(errors),
    }
    merged_factors = LoraFactors(modules, 1.0, scale_one_config(adapters[0].config, modules, rank))
    write_adapter_folder(out, merged_factors, dtype, {REPORT_FILE: json.dumps(report, indent=2) + "\n"})
    return report


def counted_twice(paths: list[str | Path]) -> list[str]:
    """One line per input that already holds another input's ΔW: the adapter of a run's stage trained with
    `adapter.init: merge` (its folder's stage done.json lists the stages its start merged, `init_merge.sources`)
    merged with the adapter (or combined adapter) of one of those stages of the same run. Merging both counts that
    stage's ΔW twice; the merge still runs (a user may mean it), said in the report and by `adaptercl merge`."""
    folders = [Path(p).resolve() for p in paths]
    lines = []
    for folder in folders:
        done = folder.parent / "done.json"
        try:
            record = json.loads(done.read_text()) if done.is_file() else {}
        except (OSError, json.JSONDecodeError):
            continue  # not a finished stage's folder as the run wrote it: nothing to tell
        sources = (record.get("init_merge") or {}).get("sources") or []
        for other in folders:
            if other != folder and other.parent.parent == folder.parent.parent and other.parent.name in sources:
                lines.append(
                    f"{folder.parent.name}'s adapter started from a merge of {', '.join(sources)} (adapter.init: "
                    f"merge), so it already holds {other.parent.name}'s ΔW: merging it with {other} counts that ΔW "
                    f"twice; leave {other} out to count it once"
                )
    return lines


def check_merge_out(paths: list[str | Path], out: str | Path) -> None:
    """`out` may be new, empty or an earlier merge's folder (it holds REPORT_FILE), never one of the inputs `paths`
    (it is replaced whole), a file or under one."""
    if any(Path(out).resolve() == Path(p).resolve() for p in paths):
        raise RecipeError(f"merge: --out {str(out)!r} is one of the adapters it merges; choose a new folder")
    check_new_folder(out, "merge", replaceable=REPORT_FILE)


def check_one_base(paths: list[str | Path], configs: list[dict[str, Any]]) -> None:
    """The adapters' adapter_config.json must name one base model (`base_model_name_or_path`; an adapter naming
    none is not compared)."""
    named = [(str(p), c.get("base_model_name_or_path")) for p, c in zip(paths, configs)]
    named = [(p, base) for p, base in named if base]
    for path, base in named[1:]:
        if base != named[0][1]:
            raise RecipeError(
                f"merge: the adapters name different base models, {named[0][1]!r} ({named[0][0]}) and {base!r} "
                f"({path}): their ΔW do not add up on one base; merge adapters of one base, or pass "
                "--allow-different-bases when they are one base under two names or a base and its fine-tune"
            )


def error_summary(errors: dict[str, float]) -> dict[str, Any]:
    values = list(errors.values()) or [0.0]
    return {"rel_error_mean": sum(values) / len(values), "rel_error_max": max(values), "rel_error": errors}


def _merge_factors(
    model: torch.nn.Module, target: str, vectors: list[dict[str, Tensor]], init: AdapterInitConfig, seed: int
) -> tuple[dict[str, tuple[Tensor, Tensor, float]], list[float], dict[str, float]]:
    """The factors of adapter `target` holding the re-factorised merge of `vectors` (see the module docstring):
    {module: (A [r, in], B [out, r], scale)} with s·B·A = the merge, the weights used, the relative errors."""
    from peft.tuners.lora import LoraLayer

    weights = init.merge_weights
    weights = default_merge_weights(init.merge_method, len(vectors)) if weights is None else list(weights)
    merged = merge_module_deltas(vectors, weights, init.merge_method, init.merge_density, seed)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer) and target in m.lora_A}
    missing = sorted(set(merged) - set(layers))
    if missing:
        raise RecipeError(
            f"adapter.init merge: earlier adapters have LoRA on {missing[0]} but stage adapter {target!r} does not; "
            "give the stage the same lora.target_modules"
        )
    factors, errors = {}, {}
    for module, delta in merged.items():
        layer = layers[module]
        a_param = layer.lora_A[target].weight  # [r, in]
        a, b, errors[module] = refactorize(delta.to(a_param.device), a_param.shape[0])  # [r, in], [out, r]
        scale = layer.scaling[target]
        b = b / scale  # fold the stage's scale: s·B·A = the re-factorised merge
        sigma = a.square().sum(1)  # [r] singular values of the merge (A rows are √σ_i v_iᵀ)
        empty = sigma <= EMPTY_DIRECTION_TOL * sigma.max()  # [r] directions the merge does not use (rank < r)
        a[empty] = a_param[empty].to(a.dtype)  # keep the fresh random A row there and zero the B column
        b[:, empty] = 0.0
        factors[module] = (a, b, scale)
    return factors, weights, errors


def _zero_start(model, plan, init, vectors, seed) -> dict[str, Tensor]:
    return {}


def _copy_start(model, plan, init, vectors, seed) -> dict[str, Tensor]:
    return from_model(model, plan.copy_from).deltas()


def _merge_start(model, plan, init, vectors, seed) -> dict[str, Tensor]:
    factors, _, _ = _merge_factors(model, plan.adapter, vectors, init, seed)
    return {m: scale * (b @ a) for m, (a, b, scale) in factors.items()}  # [out, in] each


StartFn = Callable[[torch.nn.Module, AdapterPlan, AdapterInitConfig, list[dict[str, Tensor]], int], dict[str, Tensor]]
STARTS: dict[str, StartFn] = {"zero": _zero_start, "copy": _copy_start, "merge": _merge_start}  # by AdapterPlan.start


@torch.no_grad()
def stage_task_vectors(
    model: torch.nn.Module, plans: list[AdapterPlan], inits: list[AdapterInitConfig], seed: int
) -> list[dict[str, Tensor]]:
    """The task vector {module: ΔW [out, in]} of each stage of `plans` (in order, from the first stage on; `inits`
    their `adapter` blocks): its adapter's ΔW in `model` minus the ΔW it started from (`AdapterPlan.start`). A
    module only one side has counts as zero on the other."""
    vectors: list[dict[str, Tensor]] = []
    for plan, init in zip(plans, inits, strict=True):
        own = from_model(model, plan.adapter).deltas()
        start = STARTS[plan.start](model, plan, init, vectors, seed)
        vectors.append({m: own.get(m, 0.0) - start.get(m, 0.0) for m in dict.fromkeys([*own, *start])})
    return vectors


@torch.no_grad()
def init_adapter_from_merge(
    model: torch.nn.Module, plans: list[AdapterPlan], inits: list[AdapterInitConfig], seed: int
) -> dict[str, Any]:
    """Set the adapter of the merge stage `plans[-1]` (freshly attached) to the re-factorised merge of the task
    vectors of the earlier stages `plans[:-1]` (see the module docstring; `inits`: every stage's `adapter` block);
    return the report (sources, relative Frobenius error per module, mean, max)."""
    plan, init = plans[-1], inits[-1]
    vectors = stage_task_vectors(model, plans[:-1], inits[:-1], seed)
    factors, weights, errors = _merge_factors(model, plan.adapter, vectors, init, seed)
    layers = dict(model.named_modules())
    for module, (a, b, _) in factors.items():
        layers[module].lora_A[plan.adapter].weight.copy_(a)
        layers[module].lora_B[plan.adapter].weight.copy_(b)
    starts = {"zero": "", "copy": " - {copy_from}", "merge": " - its merge start"}
    return {
        "sources": list(plan.merge_sources),
        "task_vectors": [p.adapter + starts[p.start].format(copy_from=p.copy_from) for p in plans[:-1]],
        "method": init.merge_method,
        "weights": weights,
        "density": init.merge_density,
        **error_summary(errors),
    }
