"""`adaptercl recipe plan`: a recipe's predicted peak GPU memory per phase (`memory.py`) and wall time
(`wall_time.py`), before anything is downloaded, and the live-tensor-bytes tracer the memory model is checked with
(`memory_trace.py`); with `--rehearsal`, the wall time from a rehearsal on this machine (`rehearsal.py`), and what a
rehearsal measured beside the plan (`rehearsal_table.py`).
"""

from importlib import import_module

# name other folders use -> the module of this folder that defines it; a name equal to its module's is the module
# itself. Imported on first use: importing the folder loads nothing.
_EXPORTS = {
    "MICRO_BATCH_MARGIN": "memory",
    "auto_micro_batch": "memory",
    "plan_recipe": "memory",
    "REHEARSAL_KIND": "rehearsal",
    "REHEARSAL_VERSION": "rehearsal",
    "measured_wall_time": "rehearsal",
    "read_rehearsal": "rehearsal",
    "recipe_hash": "rehearsal",
    "spread": "rehearsal",
    "beside_plan": "rehearsal_table",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = import_module(f"{__name__}.{_EXPORTS[name]}")
        return module if _EXPORTS[name] == name else getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
