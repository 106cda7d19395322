"""Gold answers as datasets write them, scored right or refused: how a multiple-choice answer column designates its
option (`answer_kind`), which kind an undeclared column is (`settle_answer_kind`), and whether a domain's gold values
take the form its reward compares them with (`check_golds`). A mismatch is one `RecipeError` line naming the column,
three of its values and the field that fixes it, at `recipe validate` (on the first rows) and when the run loads the
domain (on every row): never an accuracy of 0 because the gold is written another way than the reply.

Options of a row (`row_options`, the generic format's `answer_options`): one column holding a list, a dict or the
hub's `{text, label}` (lettered as `prompt_template.py` renders them), or a list of columns, one per option in order
(`[choice0, choice1, choice2, choice3]`, as MMLU's CSVs). Answer kinds (`gold_letter`):

| answer_kind | the column holds                        | e.g.                         |
|-------------|-----------------------------------------|------------------------------|
| letter      | the option's letter (any case)          | ARC's lm-eval copies, "B"    |
| index0      | its 0-based position                    | MMLU, HellaSwag, PIQA: 1 = B |
| index1      | its 1-based position                    | Winogrande: "2" = B          |
| key         | a key of the dict column (or its label) | ARC's answerKey "2" of 1..4  |
| text        | the option's own text                   | "stabilizing selection"      |

An undeclared kind with `answer_options` is read off the column (`infer_answer_kind`): the kind every gold value fits,
a dict's own keys first (they are what the dataset means: ARC's numbered labels are keys, not indices); none, or
several (indices 1..3 of four options fit index0 and index1 alike), is refused. Without `answer_options` and
`answer_kind` the answer is used as it is, and `check_golds` holds it against the reward.

Gold forms (`GOLD_FORMS`, by native reward name): the letter rewards (choice_letter, answer_tag, mcq) compare the
reply's letter with the gold, which must be one letter, among those the prompt lists when it lists lettered options;
the number rewards (final_number, arithmetic, arithmetic_hash) compare numbers, so the gold must parse as one.
Other rewards (boxed_math, action_calls, user functions) take any gold. Only the generic format is checked: the
presets make their gold themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_args

from adaptercl.domains.answers import count_lettered_options, parse_number
from adaptercl.domains.domain import Example, MalformedRow
from adaptercl.domains.prompt_template import LETTERS, choices_form, option_items
from adaptercl.recipe import AnswerKind, DomainConfig, RecipeError

KINDS: tuple[str, ...] = get_args(AnswerKind)  # letter, index0, index1, key, text
KIND_WORDS = {
    "letter": "an option letter",
    "index0": "a 0-based option index",
    "index1": "a 1-based option index",
    "key": "a key of the options",
    "text": "an option's text",
}


@dataclass(frozen=True)
class RowOptions:
    """The options of one row: (letter, text) of each, in order, and the dict's keys (None for a list)."""

    items: list[tuple[str, str]]
    keys: list[str] | None

    @property
    def letters(self) -> list[str]:
        return [letter for letter, _ in self.items]


def row_options(row: dict, columns: str | list[str]) -> RowOptions:
    """The options `answer_options` names in `row`: one list/dict column, or one column per option."""
    if isinstance(columns, str):
        if columns not in row or row[columns] is None:
            raise MalformedRow(columns, "is missing (answer_options names it)")
        options = choices_form(row[columns])
        keys = [str(k).strip() for k in options] if isinstance(options, dict) else None
        return RowOptions(option_items(options, columns), keys)
    for column in columns:
        if column not in row or row[column] is None:
            raise MalformedRow(column, "is missing (answer_options names it)")
    return RowOptions(option_items([row[c] for c in columns], columns[0]), None)


def as_index(value: Any) -> int | None:
    """An integer written as an int, an integral float (a CSV column with gaps) or digits; else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    text = str(value).strip()
    return int(text) if text.isdigit() else None


def designated(answer: Any, kind: str, options: RowOptions) -> str | None:
    """The letter of the option `answer` designates when read as `kind`, or None when it designates none."""
    text, letters = str(answer).strip(), options.letters
    if kind == "letter":
        return text.upper() if text.upper() in letters else None
    if kind in ("index0", "index1"):
        index = as_index(answer)
        position = None if index is None else index - (kind == "index1")
        return letters[position] if position is not None and 0 <= position < len(letters) else None
    if kind == "key":
        return letters[options.keys.index(text)] if options.keys and text in options.keys else None
    matches = [letter for letter, option in options.items if option == text]  # text
    return matches[0] if matches else None


def gold_letter(answer: Any, kind: str, options: RowOptions, column: str) -> str:
    """The letter of the option `answer` (read as `kind`) designates; MalformedRow naming `column` if none."""
    letter = designated(answer, kind, options)
    if letter is None:
        shown = f"{len(options.items)} options ({options.letters[0]}-{options.letters[-1]})"
        raise MalformedRow(column, f"{answer!r} is not {KIND_WORDS[kind]} of the {shown}")
    return letter


def shown_options(prompt_text: str) -> RowOptions:
    """Options known only by the letters a prompt lists (`A. ...` lines; all ten letters when it lists none): what
    letter, index0 and index1 answers designate without `answer_options`."""
    count = count_lettered_options(prompt_text) or len(LETTERS)
    return RowOptions([(letter, "") for letter in LETTERS[:count]], None)


def infer_answer_kind(samples: list[tuple[Any, RowOptions]], column: str) -> str:
    """The kind every (gold, options) sample fits (a key first; see the module docstring); ValueError naming the
    column, three values and `answer_kind` when none or several fit."""
    fitting = [k for k in KINDS if all(designated(answer, k, options) is not None for answer, options in samples)]
    if "key" in fitting:
        return "key"
    if len(fitting) == 1:
        return fitting[0]
    fix = "set answer_kind: letter, index0 (0-based), index1 (1-based), key or text"
    if fitting:
        values = example_values([answer for answer, _ in samples])
        raise ValueError(
            f"column {column!r} holds {values}, which read as {' and as '.join(fitting)} alike; {fix} to say which"
        )
    unread = [answer for answer, options in samples if not any(designated(answer, k, options) for k in KINDS)]
    values = example_values(unread or [answer for answer, _ in samples])
    raise ValueError(f"column {column!r} holds {values}: not the options' letters, indices, keys or texts; {fix}")


def example_values(values: list[Any], count: int = 3, width: int = 40) -> str:
    """The first `count` distinct values, as a dataset's rows hold them ('1', 0, 3), each cut to `width`."""
    distinct = list(dict.fromkeys(repr(v) for v in values))
    return ", ".join(text if len(text) <= width else text[: width - 3] + "..." for text in distinct[:count])


def settle_answer_kind(cfg: DomainConfig, rows: list[Any]) -> DomainConfig:
    """`cfg` with `answer_kind` read off the answer column of `rows` (raw rows, in order) when it has
    `answer_options` and no declared kind; as it is otherwise. Rows without a readable answer or options are left to
    the format, which names their problem. A column no kind fits is a RecipeError naming `answer_kind`."""
    if cfg.answer_options is None or cfg.answer_kind is not None:
        return cfg
    column = cfg.fields.get("answer", "answer")
    samples = []
    for row in rows:
        if not isinstance(row, dict) or row.get(column) is None:
            continue
        try:
            samples.append((row[column], row_options(row, cfg.answer_options)))
        except MalformedRow:
            continue
    if not samples:
        return cfg
    try:
        kind = infer_answer_kind(samples, column)
    except ValueError as err:
        raise RecipeError(f"domains.{cfg.name}.answer_kind: {err}") from None
    return cfg.model_copy(update={"answer_kind": kind})


def row_gold(row: dict, answer: Any, cfg: DomainConfig, column: str, prompt_text: str) -> str:
    """The generic format's gold when `answer_options` or `answer_kind` is set: the designated option's letter. An
    undeclared kind is read off this row alone (a loader settles it on the whole column first)."""
    options = row_options(row, cfg.answer_options) if cfg.answer_options is not None else shown_options(prompt_text)
    kind = cfg.answer_kind
    if kind is None:
        try:
            kind = infer_answer_kind([(answer, options)], column)
        except ValueError as err:
            raise MalformedRow(None, str(err)) from None
    return gold_letter(answer, kind, options, column)


# ---------------------------------------------------------------------------------------------------- gold forms


@dataclass(frozen=True)
class GoldForm:
    """What a reward compares the reply with: whether a gold `fits` it, how to say it, the field that fixes it."""

    fits: Callable[[Any, Example], bool]
    expected: Callable[[Example], str]  # "option letters (A-D, as the prompt lists them)"
    compared: str  # what of the reply the reward reads
    field: str  # the domain field that fixes a mismatch
    fix: str


def _prompt_text(example: Example) -> str:
    return example.messages[-1]["content"]


def _letter_fits(gold: Any, example: Example) -> bool:
    """One letter (the letter rewards upper-case the gold), among those the prompt lists when it lists some."""
    if not isinstance(gold, str) or len(gold.strip()) != 1 or not gold.strip().isalpha():
        return False
    count = count_lettered_options(_prompt_text(example))
    return count is None or gold.strip().upper() in LETTERS[:count]


def _letters_expected(example: Example) -> str:
    count = count_lettered_options(_prompt_text(example))
    return f"option letters ({LETTERS[0]}-{LETTERS[count - 1]}, as the prompt lists them)" if count else "one letter"


LETTER_FORM = GoldForm(
    _letter_fits,
    _letters_expected,
    "chosen letter",
    "answer_kind",
    "say how the column is written: answer_kind: index0 (0-based), index1 (1-based), letter or text (text needs "
    "answer_options: the options' column, or a list of one column per option)",
)
NUMBER_FORM = GoldForm(
    lambda gold, example: parse_number(gold) is not None,
    lambda example: "numbers",
    "final number",
    "fields.answer",
    "point fields.answer at a column holding the final number (format: gsm8k reads '#### N' rationales)",
)
GOLD_FORMS: dict[str, GoldForm] = {
    "choice_letter": LETTER_FORM,
    "answer_tag": LETTER_FORM,
    "mcq": LETTER_FORM,
    "final_number": NUMBER_FORM,
    "arithmetic": NUMBER_FORM,
    "arithmetic_hash": NUMBER_FORM,
}


def check_golds(cfg: DomainConfig, reward_name: str | None, examples: list[Example]) -> None:
    """A RecipeError when any gold of a generic domain's `examples` does not take the form its native reward
    `reward_name` compares with (`GOLD_FORMS`): one line naming the column, three of its values as the rows hold
    them, and the field that fixes it."""
    form = GOLD_FORMS.get(reward_name or "")
    if form is None or (cfg.format or "generic") != "generic" or cfg.reward_funcs:
        return
    bad = [ex for ex in examples if not form.fits(ex.answer, ex)]
    if not bad:
        return
    column = cfg.fields.get("answer", "answer")
    values = example_values([ex.columns.get(column, ex.answer) for ex in bad])
    raise RecipeError(
        f"domains.{cfg.name}.{form.field}: column {column!r} holds {values} ({len(bad)} of {len(examples)} rows "
        f"read), not {form.expected(bad[0])}, which reward {reward_name} compares the reply's {form.compared} "
        f"with; {form.fix}"
    )
