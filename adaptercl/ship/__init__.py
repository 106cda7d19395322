"""Shipping a finished run: one PEFT adapter folder per domain with model cards and a manifest (`export.py`), and
vLLM's OpenAI-compatible server over an export or for a recipe's rollouts (`serving.py`).
"""

from importlib import import_module

# name other folders use -> the module of this folder that defines it; a name equal to its module's is the module
# itself. Imported on first use: importing the folder loads nothing.
_EXPORTS = {
    "export_run": "export",
    "rollout_server_command": "serving",
    "serve": "serving",
    "serve_command": "serving",
    "serve_rollouts": "serving",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = import_module(f"{__name__}.{_EXPORTS[name]}")
        return module if _EXPORTS[name] == name else getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
