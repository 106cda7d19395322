"""`ConfigBlock`, the base of every recipe block: unknown keys and non-finite numbers are errors, and YAML's booleans
arrive as the switch words `off`/`on` where a field takes those words. No torch import."""

from __future__ import annotations

from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, model_validator


class ConfigBlock(BaseModel):
    """A recipe block: unknown keys are errors, and so are non-finite numbers (`.inf`, `.nan`) in any float field.

    Switch fields (`switch_words`: a field whose values include the word `off` or `on` but not a bool, such as
    `optim.logits_chunk_size: auto | off | N` or a `monitor` action) take YAML's booleans as those words: YAML 1.1
    reads an unquoted off/on (and no/yes, false/true) as a boolean, so `off`, the form the docs and error messages
    write, arrives as False, in a recipe file and in a `key=value` override alike. False becomes "off", True "on"
    (an error naming the field where "on" is not one of its values). Fields typed `auto | bool`
    (`optim.activation_checkpointing`) take the booleans as they are.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _yaml_booleans_as_switch_words(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            key: ("on" if value else "off")
            if isinstance(value, bool) and key in fields and switch_words(fields[key].annotation)
            else value
            for key, value in data.items()
        }


def switch_words(annotation: Any) -> set[str]:
    """The words off/on among a field type's literal values, when the type admits no bool (else the empty set)."""
    literals, stack = set(), [annotation]
    while stack:
        kind = stack.pop()
        if kind is bool:
            return set()
        if get_origin(kind) is Literal:
            literals.update(get_args(kind))
        else:
            stack.extend(get_args(kind))  # unions, Optional, Annotated
    return literals & {"off", "on"}
