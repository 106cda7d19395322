"""What adaptercl needs from the machine it runs on: files and folders that appear whole or not at all, and the one
reader of the records written so (`atomic.py`: `read_record`, a record that does not parse named in one line),
the data-parallel process group and its few collectives (`distributed.py`, used whole as a namespace), one line
saying why a hub model, dataset or URL could not be had (`offline.py`), and the libraries' notices a user can do
nothing about, silenced one message at a time (`library_notices.py`); the run's named phases, for whoever watches
them (`phases.py`: the rehearsal); the CPU's kernels: MKL's code path chosen by measurement, the cache of such
choices per CPU (`read_choice`, `write_choice`) and the CPU's bf16 matrix units (`cpu_kernels.py`). Above the
grammar only for `RecipeError`.
"""

from importlib import import_module

# name other folders use -> the module of this folder that defines it; a name equal to its module's is the module
# itself. Imported on first use: importing the folder loads nothing.
_EXPORTS = {
    "append_line": "atomic",
    "atomic_dir": "atomic",
    "check_new_folder": "atomic",
    "read_jsonl": "atomic",
    "read_record": "atomic",
    "recover_dir": "atomic",
    "write_json": "atomic",
    "write_text": "atomic",
    "BF16_UNITS": "cpu_kernels",
    "CPUINFO": "cpu_kernels",
    "bf16_matmul_available": "cpu_kernels",
    "bf16_units": "cpu_kernels",
    "cpu_fields": "cpu_kernels",
    "cpu_kernels": "cpu_kernels",
    "prefer_fast_mkl_path": "cpu_kernels",
    "read_choice": "cpu_kernels",
    "write_choice": "cpu_kernels",
    "RankLost": "distributed",
    "World": "distributed",
    "distributed": "distributed",
    "launched_world": "distributed",
    "peft_wraps_quietly": "library_notices",
    "silence_bitsandbytes_kernels_notice": "library_notices",
    "dataset_message": "offline",
    "first_line": "offline",
    "hub_model_message": "offline",
    "is_network_failure": "offline",
    "phased": "phases",
    "watching": "phases",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = import_module(f"{__name__}.{_EXPORTS[name]}")
        return module if _EXPORTS[name] == name else getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
