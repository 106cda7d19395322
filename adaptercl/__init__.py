"""adaptercl: continual post-training of LLMs with LoRA adapters (GRPO, SDPO, SDFT, hybrid) on a 4-bit base.

The Python API (the same functions the CLI calls):

    import adaptercl
    recipe = adaptercl.load_recipe("recipes/quickstart.yaml", ["optim.steps=4"])   # validated RecipeConfig
    result = adaptercl.run_recipe(recipe)          # RunResult: run_dir, domains, accuracy matrix (row 0 = before)
    adaptercl.export_run(result.run_dir, "ship/")  # one shippable PEFT adapter folder per stage + the combined one

Names are imported on first use, so `import adaptercl` (and `adaptercl recipe validate`) loads neither torch nor
transformers.
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from adaptercl.system import prefer_fast_mkl_path, silence_bitsandbytes_kernels_notice

silence_bitsandbytes_kernels_notice()  # before any module here imports PEFT, which imports bitsandbytes
prefer_fast_mkl_path()  # MKL's branch for this CPU, measured once and cached, when unset (system/cpu_kernels.py)

try:
    __version__ = version("adaptercl")
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"

# public name -> the module that is its home
_API: dict[str, str] = {
    "load_recipe": "adaptercl.recipe.load",
    "RecipeConfig": "adaptercl.recipe.grammar",
    "RecipeError": "adaptercl.recipe.errors",
    "run_recipe": "adaptercl.run.sequence",
    "RunResult": "adaptercl.run.sequence",
    "export_run": "adaptercl.ship.export",
}

__all__ = ["RecipeConfig", "RecipeError", "RunResult", "__version__", "export_run", "load_recipe", "run_recipe"]


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(import_module(_API[name]), name)
    raise AttributeError(f"module 'adaptercl' has no attribute {name!r}")
