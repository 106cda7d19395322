"""The run directory: its layout, how it is claimed, what "finished" means and how its records are read back
(`layout.py`: `RunDir`, `StageDir`; a record that does not parse is one line naming it),
which recipe may grow a run it did not start (`growth.py`), and the rollout samples each step keeps
(`samples.py`: samples.jsonl and its markdown table), and row 0 taken from another run of the same base
(`before_row.py`: eval.before_from).
"""

from importlib import import_module

# name other folders use -> the module of this folder that defines it; a name equal to its module's is the module
# itself. Imported on first use: importing the folder loads nothing.
_EXPORTS = {
    "before_source": "before_row",
    "copy_before_row": "before_row",
    "BEFORE_DIR": "layout",
    "PLOTS_DIR": "layout",
    "RECIPE_FILE": "layout",
    "REPORT_FILE": "layout",
    "RunDir": "layout",
    "SUMMARY_FILE": "layout",
    "StageDir": "layout",
    "open_finished_run": "layout",
    "read_summary": "layout",
    "SAMPLE_COLUMNS": "samples",
    "markdown_table": "samples",
    "sample_rows": "samples",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = import_module(f"{__name__}.{_EXPORTS[name]}")
        return module if _EXPORTS[name] == name else getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
