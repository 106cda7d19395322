"""Named LoRA adapters on the one base: attach, activate, freeze, copy, save and load them on the live model
(`live.py`, used whole as a namespace), their factors, exact ΔW sums and PEFT folders (`factors.py`), ΔW-space merges
(`merge_math.py`, pure tensors) applied to adapter folders and merge-initialised stage adapters (`merge.py`), and the
stacking plan of a continual sequence (`stacking.py`: the adapter each stage trains, over which frozen ones).
"""

from importlib import import_module

# name other folders use -> the module of this folder that defines it; a name equal to its module's is the module
# itself. Imported on first use: importing the folder loads nothing.
_EXPORTS = {
    "LoraFactors": "factors",
    "check_weights": "factors",
    "combine": "factors",
    "served_config": "factors",
    "snapshot": "factors",
    "write_adapter_folder": "factors",
    "write_combined_adapter": "factors",
    "active_adapters": "live",
    "adapter_state": "live",
    "copy_adapter": "live",
    "live": "live",
    "load_adapter_state": "live",
    "lora_parameters": "live",
    "save_adapter": "live",
    "init_adapter_from_merge": "merge",
    "merge_adapter_folders": "merge",
    "AdapterPlan": "stacking",
    "max_served_rank": "stacking",
    "plan_adapters": "stacking",
    "stage_dir_name": "stacking",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = import_module(f"{__name__}.{_EXPORTS[name]}")
        return module if _EXPORTS[name] == name else getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
