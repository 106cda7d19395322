"""Prompt templates and option answers: a dataset row used as it is, without preprocessing.

A domain with `prompt_template: "{question}\\n\\n{options}"` builds its user turn from the row's columns
(`render_prompt`); a column holding options, a dict `{"A": "red", "B": "blue"}` or a list `["red", "blue"]`, is
rendered as lettered lines, one per option:

    A. red
    B. blue

A dict whose keys are the letters A, B, ... in order keeps them; any other dict (keys "1", "2" or words) and every
list are lettered by position. The Hugging Face choices form `{"text": [...], "label": [...]}` (ARC, OpenBookQA,
CommonsenseQA) is read as the dict label -> text. `answer_options: options` then turns the answer column into that
option's letter (`gold_answers.py`: a letter, a 0-based or 1-based index, a dict key, or the option's own text). A
missing column raises `MalformedRow` naming it (the loader adds the file and row). Used by the generic format
(`datasets_formats.py`).
"""

from __future__ import annotations

import string
from typing import Any

from adaptercl.domains.domain import MalformedRow
from adaptercl.recipe import template_fields

LETTERS = "ABCDEFGHIJ"  # option letters, here and in the probe formats (`datasets_formats.lettered`)


def choices_form(options: Any) -> Any:
    """`{"text": [...], "label": [...]}` as the dict label -> text; any other value as it is."""
    if isinstance(options, dict) and set(options) == {"text", "label"}:
        texts, labels = options["text"], options["label"]
        if isinstance(texts, list) and isinstance(labels, list) and len(texts) == len(labels):
            return dict(zip(labels, texts))
    return options


def option_items(options: Any, column: str) -> list[tuple[str, str]]:
    """(letter, text) of each option of a dict or list column, in order."""
    options = choices_form(options)
    if isinstance(options, dict):
        keys = [str(k).strip() for k in options]
        letters = keys if keys == list(LETTERS[: len(keys)]) else list(LETTERS[: len(keys)])
        texts = list(options.values())
    elif isinstance(options, list):
        letters, texts = list(LETTERS[: len(options)]), options
    else:
        raise MalformedRow(column, f"must hold options (a dict or a list), got {type(options).__name__}")
    if not texts:
        raise MalformedRow(column, "has no options")
    if len(texts) > len(LETTERS):
        raise MalformedRow(column, f"has {len(texts)} options; at most {len(LETTERS)} can be lettered")
    return [(letter, str(text).strip()) for letter, text in zip(letters, texts)]


def lettered_lines(options: Any, column: str) -> str:
    return "\n".join(f"{letter}. {text}" for letter, text in option_items(options, column))


def render_prompt(template: str, row: dict) -> str:
    """The template with each `{column}` replaced by the row's value (options as lettered lines)."""
    values = {}
    for name in template_fields(template):
        if name not in row or row[name] is None:
            raise MalformedRow(name, "is missing (prompt_template uses it)")
        value = row[name]
        values[name] = lettered_lines(value, name) if isinstance(value, dict | list) else str(value)
    return string.Formatter().vformat(template, (), values)
