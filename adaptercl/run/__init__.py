"""The continual run over a recipe's stages, top to bottom (`sequence.py`: `run_recipe`, `RunResult`), what a recipe
names that must be on this machine before a model loads (`preflight_checks.py`: `preflight`), evaluation without
training (`eval_only.py`: `adaptercl eval`), the per-stage diagnostics (`diagnostics.py`: teacher lift, forward KL
from the previous stage's policy) and the rehearsal, the run for a few minutes measured (`rehearsal.py`: `adaptercl
recipe rehearse`, with `phase_meter.py` and `rehearsal_figures.py`).
"""

from importlib import import_module

# name other folders use -> the module of this folder that defines it; a name equal to its module's is the module
# itself. Imported on first use: importing the folder loads nothing.
_EXPORTS = {
    "evaluate_adapters": "eval_only",
    "evaluate_run": "eval_only",
    "format_summary": "eval_only",
    "data_lines": "preflight_checks",
    "decision_lines": "preflight_checks",
    "preflight": "preflight_checks",
    "rehearse": "rehearsal",
    "RunResult": "sequence",
    "run_recipe": "sequence",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = import_module(f"{__name__}.{_EXPORTS[name]}")
        return module if _EXPORTS[name] == name else getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
