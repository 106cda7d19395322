"""Prompt templates (`domains/prompt_template.py`): a multiple-choice dataset (question, options, answer) used as it
is, rendered into lettered options and scored by the existing `choice_letter` reward."""

from __future__ import annotations

import json

import pytest

from adaptercl.domains import load_domain
from adaptercl.domains.domain import MalformedRow
from adaptercl.domains.prompt_template import option_letter, render_prompt
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
    assert option_letter("2", numbered, "answerKey", "choices") == "B"  # a label, not an index
    assert option_letter("B", arc, "answerKey", "choices") == "B"


def test_a_missing_column_names_it():
    with pytest.raises(MalformedRow, match="field 'options' is missing"):
        render_prompt(TEMPLATE, {"question": "q"})


@pytest.mark.parametrize(
    ("answer", "options", "letter"),
    [
        ("b", {"A": "x", "B": "y"}, "B"),  # a letter
        (1, ["x", "y", "z"], "B"),  # a 0-based index
        ("2", {"1": "x", "2": "y"}, "B"),  # a dict key (not an index)
        ("y", ["x", "y"], "B"),  # the option's text
    ],
)
def test_the_answer_becomes_its_options_letter(answer, options, letter):
    assert option_letter(answer, options, "answer", "options") == letter


def test_an_answer_that_is_no_option_names_the_column():
    with pytest.raises(MalformedRow, match="field 'answer' index 5 is out of range for 2 options"):
        option_letter(5, ["x", "y"], "answer", "options")


def test_a_multiple_choice_file_loads_as_it_is_and_is_scored(tmp_path):
    rows = [
        {"question": "Which is a colour?", "options": {"A": "red", "B": "dog", "C": "run"}, "answer": "A"},
        {"question": "Which is an animal?", "options": ["red", "dog", "run"], "answer": 1},
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
