"""The recipe grammar, torch-free: a YAML recipe and `key=value` overrides -> a validated `RecipeConfig` (`load.py`),
every block typed and documented per field (`grammar.py` assembles the blocks of `method_blocks.py`,
`domain_block.py`, `rollout_block.py`, `optim_block.py`, `eval_block.py` and `log_block.py`), the table of training
methods (`method_table.py`: `METHODS`) and `RecipeError`, the one-line user error (`errors.py`).

The bottom floor: it imports nothing else of adaptercl, and neither torch, transformers nor peft
(tests/test_layering.py), so validating a recipe loads nothing heavy.
"""

from importlib import import_module

# name other folders use -> the module of this folder that defines it; a name equal to its module's is the module
# itself. Imported on first use: importing the folder loads nothing.
_EXPORTS = {
    "AnswerKind": "domain_block",
    "DATA_SUFFIXES": "domain_block",
    "DomainConfig": "domain_block",
    "FeedbackKind": "domain_block",
    "HUB_ID": "domain_block",
    "RewardFuncSpec": "domain_block",
    "hub_id": "domain_block",
    "is_url": "domain_block",
    "source_kind": "domain_block",
    "template_fields": "domain_block",
    "url_suffix": "domain_block",
    "RecipeError": "errors",
    "LmEvalConfig": "eval_block",
    "AdapterInitConfig": "grammar",
    "LoraConfig": "grammar",
    "ModelConfig": "grammar",
    "RecipeConfig": "grammar",
    "StageConfig": "grammar",
    "resolve_recipe": "grammar",
    "load_recipe": "load",
    "resolved_yaml": "load",
    "Action": "method_blocks",
    "DistillConfig": "method_blocks",
    "HybridConfig": "method_blocks",
    "LIFT_GATE_LEVEL": "method_blocks",
    "LiftGateConfig": "method_blocks",
    "MonitorConfig": "method_blocks",
    "TeacherAutocast": "method_blocks",
    "TeacherConfig": "method_blocks",
    "TeacherKind": "method_blocks",
    "METHODS": "method_table",
    "OptimConfig": "optim_block",
    "ENGINES": "rollout_block",
    "RolloutServerConfig": "rollout_block",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = import_module(f"{__name__}.{_EXPORTS[name]}")
        return module if _EXPORTS[name] == name else getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
