"""Recipes: YAML + `key=value` overrides -> a resolved `RecipeConfig`, and back to YAML (`resolved_yaml`).

    recipe = load_recipe("recipes/quickstart.yaml", ["stages.arithmetic.optim.lr=5e-5", "seed=1"])

The run that executes a recipe's stages is `run.sequence.run_recipe`; the run directory's layout is
`run_dir/layout.py`. No torch import: `adaptercl recipe validate` answers in well under a second.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from adaptercl.recipe.grammar import RecipeConfig, RecipeError, resolve_recipe


def load_recipe(path: str | Path, overrides: list[str] = ()) -> RecipeConfig:
    """Read a recipe file, apply `a.b.c=value` overrides (stages and domains addressed by name), validate; each
    domain remembers the file's folder, where its `pkg.module:function` rewards are looked for first."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file {str(path)!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise RecipeError(f"{path}: not a text file (byte {err.start} is not UTF-8); a recipe is YAML") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise RecipeError(f"{path}: not valid YAML{where}: {getattr(err, 'problem', err)}") from None
    for override in overrides:
        apply_override(raw, override)
    recipe = resolve_recipe(raw)
    for domain in recipe.domains:  # its reward modules import from the recipe's folder (`DomainConfig.import_dirs`)
        domain.read_from(path)
    return recipe


def apply_override(raw: dict, override: str) -> None:
    """Set one dotted path in the raw recipe; list items (stages, domains) are addressed by name or index."""
    if "=" not in override:
        raise RecipeError(f"override {override!r} must look like key.path=value (e.g. stages.math.optim.lr=5e-6)")
    key, _, text = override.partition("=")
    value = yaml.safe_load(text) if text.strip() else ""
    parts = key.strip().split(".")
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            node = _list_item(node, part, ".".join(parts[: i + 1]))
        elif isinstance(node, dict):
            node = node.setdefault(part, {})
        else:
            raise RecipeError(f"override {key!r}: {'.'.join(parts[:i])} is not a mapping")
    last = parts[-1]
    if isinstance(node, list):
        raise RecipeError(f"override {key!r}: name a field of a list item, e.g. {key}.field=value")
    if not isinstance(node, dict):
        raise RecipeError(f"override {key!r}: {'.'.join(parts[:-1])} is not a mapping")
    node[last] = value


def _list_item(items: list, part: str, where: str) -> dict:
    for item in items:
        if isinstance(item, dict) and item.get("name") == part:
            return item
    if part.isdigit() and int(part) < len(items):
        return items[int(part)]
    names = ", ".join(str(i.get("name")) for i in items if isinstance(i, dict))
    raise RecipeError(f"override path {where!r}: no item named {part!r}; names here: {names}")


def resolved_yaml(recipe: RecipeConfig) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, allow_unicode=True)
