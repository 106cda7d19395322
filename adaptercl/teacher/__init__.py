"""The self-teacher of SDPO, SDFT, SRPO and hybrid stages: its kinds on the one base model, never a second base
(`kinds.py`: base, stage_start, ema of ΔW, lag, trust_region, restart_freeze, gated), the EMA of ΔW and the
trust-region mixture as pure tensor functions (`mixing.py`), when a frozen teacher refreshes (`schedule.py`: the
clock, CGTR's gate; pure), and the teacher prompts each method shows it (`prompts.py`: `TEACHER_PROMPTS`, the
reference strings of lasgroup/SDPO and the SDFT trainer, SRPO's routes).
"""

from importlib import import_module

# name other folders use -> the module of this folder that defines it; a name equal to its module's is the module
# itself. Imported on first use: importing the folder loads nothing.
_EXPORTS = {
    "Teacher": "kinds",
    "create_teacher": "kinds",
    "TEACHER_PROMPTS": "prompts",
    "TeacherPrompts": "prompts",
    "may_get_context": "prompts",
    "srpo_route_stats": "prompts",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = import_module(f"{__name__}.{_EXPORTS[name]}")
        return module if _EXPORTS[name] == name else getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
