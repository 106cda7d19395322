"""Prompt templates (`domains/prompt_template.py`): a multiple-choice dataset (question, options, answer) used as it
is, rendered into lettered options and scored by the existing `choice_letter` reward."""

from __future__ import annotations

import json

import pytest

from adaptercl.domains import load_domain
from adaptercl.domains.domain import MalformedRow
from adaptercl.domains.gold_answers import gold_letter, row_options
from adaptercl.domains.prompt_template import render_prompt
from adaptercl.recipe.grammar import DomainConfig, RecipeError

TEMPLATE = "{question}\n\n{options}\n\nAnswer with the letter."


def test_a_dict_of_options_keeps_its_letters():
    row = {"question": "Which is red?", "options": {"A": "a rose", "B": " the sky "}}
    assert render_prompt(TEMPLATE, row) == "Which is red?\n\nA. a rose\nB. the sky\n\nAnswer with the letter."


def test_a_list_and_a_dict_of_other_keys_are_lettered_by_position():
    assert render_prompt("{o}", {"o": ["x", "y", "z"]}) == "A. x\nB. y\nC. z"
    assert render_prompt("{o}", {"o": {"1": "x", "2": "y"}}) == "A. x\nB. y"
    assert render_prompt("Q{{literal}} {n}", {"n": 3}) == "Q{literal} 3"  # other values as text, braces escaped


def test_the_hugging_face_choices_form_is_read_as_label_to_text():
    arc = {"text": ["dry palms", "wet palms"], "label": ["A", "B"]}  # ARC / OpenBookQA / CommonsenseQA
    assert render_prompt("{choices}", {"choices": arc}) == "A. dry palms\nB. wet palms"
    numbered = {"text": ["x", "y", "z"], "label": ["1", "2", "3"]}  # some ARC rows number their options
    assert render_prompt("{choices}", {"choices": numbered}) == "A. x\nB. y\nC. z"
    numbered_options = row_options({"choices": numbered}, "choices")
    assert gold_letter("2", "key", numbered_options, "answerKey") == "B"  # a label, not an index
    assert gold_letter("B", "key", row_options({"choices": arc}, "choices"), "answerKey") == "B"


def test_a_missing_column_names_it():
    with pytest.raises(MalformedRow, match="field 'options' is missing"):
        render_prompt(TEMPLATE, {"question": "q"})


@pytest.mark.parametrize(
    ("answer", "kind", "options", "letter"),
    [
        ("b", "letter", {"A": "x", "B": "y"}, "B"),
        (1, "index0", ["x", "y", "z"], "B"),
        ("2", "index1", ["x", "y", "z"], "B"),
        ("2", "key", {"1": "x", "2": "y"}, "B"),  # a dict key (not an index)
        ("y", "text", ["x", "y"], "B"),
    ],
)
def test_the_answer_becomes_its_options_letter(answer, kind, options, letter):
    assert gold_letter(answer, kind, row_options({"options": options}, "options"), "answer") == letter


def test_an_answer_that_is_no_option_names_the_column():
    options = row_options({"options": ["x", "y"]}, "options")
    with pytest.raises(MalformedRow, match=r"field 'answer' 5 is not a 0-based option index of the 2 options \(A-B\)"):
        gold_letter(5, "index0", options, "answer")


def test_a_multiple_choice_file_loads_as_it_is_and_is_scored(tmp_path):
    rows = [  # the answer column is one kind (here: the options dict's keys) in every row, as a dataset writes it
        {"question": "Which is a colour?", "options": {"A": "red", "B": "dog", "C": "run"}, "answer": "A"},
        {"question": "Which is an animal?", "options": {"A": "red", "B": "dog", "C": "run"}, "answer": "B"},
        {"question": "Which is a verb?", "options": {"A": "red", "B": "dog", "C": "run"}, "answer": "C"},
    ]
    path = tmp_path / "mcq.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DomainConfig(
        name="mc", source=str(path), prompt_template=TEMPLATE, answer_options="options", reward="choice_letter"
    )
    domain = load_domain(cfg, seed=0, num_eval=1)
    examples = {ex.id: ex for ex in domain.eval + domain.train}
    animal = examples["mc/train/2"]
    assert animal.messages == [
        {"role": "user", "content": "Which is an animal?\n\nA. red\nB. dog\nC. run\n\nAnswer with the letter."}
    ]
    assert [examples[f"mc/train/{i}"].answer for i in (1, 2, 3)] == ["A", "B", "C"]
    results = domain.score(["The answer is B.", "A"], [[], []], [animal, animal])
    assert [r.correct for r in results] == [True, False]


def test_a_row_missing_a_template_column_is_one_line_naming_file_row_and_column(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "A"}) + "\n")
    cfg = DomainConfig(name="mc", source=str(path), prompt_template=TEMPLATE, reward="choice_letter")
    with pytest.raises(RecipeError, match=r"^domains.mc: .*bad.jsonl: row 1: field 'options' is missing"):
        load_domain(cfg, seed=0, num_eval=0)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"prompt_template": "{} and {0}"}, "must name a dataset column"),
        (
            {"prompt_template": "{question", "reward": "choice_letter"},
            "expected '}' before end of string \(write {{ and }}",
        ),
        ({"prompt_template": "{q}", "format": "gsm8k"}, "prompt_template needs the generic format"),
        ({"prompt_template": "{q}", "fields": {"prompt": "p"}}, "replaces fields.prompt"),
    ],
)
def test_bad_templates_are_config_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        DomainConfig(name="mc", source="x.jsonl", **kw)
