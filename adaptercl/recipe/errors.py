"""How a recipe problem reaches the user: `RecipeError` (one line naming the field and what to change, never a
traceback) and `format_validation_error`, the one-line rendering of a pydantic `ValidationError`. No torch import."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError


class RecipeError(ValueError):
    """A recipe problem, reported to the user as one line (never a traceback)."""


def format_validation_error(
    err: ValidationError, raw: dict, root: type[BaseModel], root_extra_keys: tuple[str, ...] = ()
) -> str:
    """The first pydantic error of validating `raw` as `root` as one line: dotted field path (list items by their
    `name`), problem, allowed values (every member's, for a field of a union type such as `auto | bool`).
    `root_extra_keys` are keys also allowed at the top (recipe-level defaults)."""
    errors = err.errors()
    first = errors[0]
    loc = list(first["loc"])
    path = []
    node: Any = raw
    model: Any = root
    for i, part in enumerate(loc):
        if i and not isinstance(node, (dict, list)):  # past the value: the rest names a member of a union type
            members = [e for e in errors if list(e["loc"][:i]) == loc[:i] and len(e["loc"]) == i + 1]
            texts = [e["msg"].removeprefix("Value error, ") for e in members]
            first = {**first, "msg": " or ".join([texts[0], *(t.removeprefix("Input should be ") for t in texts[1:])])}
            break
        if isinstance(part, int) and isinstance(node, list) and part < len(node):
            item = node[part]
            label = item.get("name") if isinstance(item, dict) and isinstance(item.get("name"), str) else str(part)
            path.append(label)
            node = item
            continue
        path.append(str(part))
        node = node.get(part) if isinstance(node, dict) else None
        if i < len(loc) - 1:
            model = _field_model(model, part)
    where = ".".join(path) or "recipe"
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        keys = list(model.model_fields) if model is not None else []
        if model is root:
            keys += root_extra_keys
        allowed = ", ".join(keys) if keys else "see the README"
        return f"{where}: unknown key; allowed keys here: {allowed}"
    if first["type"] == "missing":
        return f"{where}: required field is missing"
    if first["loc"] and first["type"] not in ("value_error", "assertion_error"):
        return f"{where}: {msg} (got {first.get('input')!r})"
    return f"{where}: {msg}" if where != "recipe" else msg


def _field_model(model: Any, part: Any) -> Any:
    """The pydantic model class of field `part` of `model` (lists unwrapped), or None."""
    if model is None or isinstance(part, int):
        return model
    field = getattr(model, "model_fields", {}).get(part)
    if field is None:
        return None
    annotation = field.annotation
    for candidate in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None
