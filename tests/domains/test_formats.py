"""Retention-probe row formats: the hub datasets' own field layouts next to the lm-eval layout of local copies.

Hand-made rows only (no download): google/boolq (question, passage, answer bool), ybisk/piqa and its parquet copies
(goal, sol1, sol2, label 0/1), allenai/winogrande (sentence with a `_` blank, option1, option2, answer "1"/"2").
"""

from __future__ import annotations

import json

import pytest

from adaptercl.domains import load_domain
from adaptercl.domains.datasets_formats import FORMATS, PROBE_SUFFIX, MalformedRow
from adaptercl.domains.rewards import resolve_reward
from adaptercl.recipe.grammar import DomainConfig, RecipeError


def example(fmt: str, row: dict):
    """(user prompt text, gold letter) of one row under format `fmt`."""
    messages, gold, demo = FORMATS[fmt].to_example(row, DomainConfig(name=fmt, source="x.jsonl", format=fmt))
    assert messages[-1]["role"] == "user" and demo is None
    return messages[-1]["content"], gold


def assert_lettered(prompt: str, options: list[str]) -> None:
    lines = prompt.removesuffix(PROBE_SUFFIX).splitlines()
    assert prompt.endswith(PROBE_SUFFIX)
    assert lines[-len(options) :] == [f"{letter}. {text}" for letter, text in zip("ABCD", options, strict=False)]


def malformed(fmt: str, row: dict) -> MalformedRow:
    with pytest.raises(MalformedRow) as info:
        example(fmt, row)
    return info.value


# ---------------------------------------------------------------------------------------------------- boolq

BOOLQ_HUB = {
    "question": "is the sky blue on a clear day",
    "passage": "Sky -- The daytime sky is blue.",
    "answer": True,
}


def test_boolq_hub_layout_prompt_and_gold():
    prompt, gold = example("boolq", BOOLQ_HUB)
    assert prompt.startswith("Passage: Sky -- The daytime sky is blue.\nQuestion: is the sky blue on a clear day?\n")
    assert_lettered(prompt, ["yes", "no"])
    assert gold == "A"
    assert example("boolq", {**BOOLQ_HUB, "answer": False})[1] == "B"


def test_boolq_hub_and_lm_eval_layouts_give_the_same_prompt():
    local = {"sentence": f"question: {BOOLQ_HUB['question']}\npassage: {BOOLQ_HUB['passage']}", "label": "True"}
    assert example("boolq", local) == example("boolq", BOOLQ_HUB)
    assert example("boolq", {**BOOLQ_HUB, "question": "is the sky blue on a clear day?"}) == example("boolq", local)


@pytest.mark.parametrize(
    ("change", "field", "problem"),
    [
        ({"answer": "True"}, "answer", "must be bool"),
        ({"answer": 1}, "answer", "must be bool"),
        ({"answer": None}, "answer", "is missing"),
        ({"passage": ""}, "passage", "is empty"),
        ({"question": 3}, "question", "must be str"),
    ],
)
def test_boolq_hub_malformed_rows_name_the_field(change, field, problem):
    err = malformed("boolq", {**BOOLQ_HUB, **change})
    assert err.field == field and problem in str(err)


# ---------------------------------------------------------------------------------------------------- piqa

PIQA_HUB = {
    "goal": "How do I open a stuck jar lid?",
    "sol1": "Run the lid under hot water.",
    "sol2": "Freeze the lid.",
    "label": 0,
}


def test_piqa_hub_layout_prompt_and_gold():
    prompt, gold = example("piqa", PIQA_HUB)
    assert prompt.startswith("Question: How do I open a stuck jar lid?\n")
    assert_lettered(prompt, ["Run the lid under hot water.", "Freeze the lid."])
    assert gold == "A"
    assert example("piqa", {**PIQA_HUB, "label": 1})[1] == "B"
    assert example("piqa", {**PIQA_HUB, "label": "1"})[1] == "B"


def test_piqa_hub_and_lm_eval_layouts_give_the_same_prompt():
    local = {"query": f"Question: {PIQA_HUB['goal']}", "choices": [PIQA_HUB["sol1"], PIQA_HUB["sol2"]], "gold": 0}
    assert example("piqa", local) == example("piqa", PIQA_HUB)


@pytest.mark.parametrize(
    ("change", "field", "problem"),
    [
        ({"label": 2}, "label", "out of range"),
        ({"label": -1}, "label", "unlabelled"),  # the hub test split
        ({"label": True}, "label", "must be int or str"),
        ({"label": "first"}, "label", "option index"),
        ({"sol2": None}, "sol2", "is missing"),
        ({"goal": ""}, "goal", "is empty"),
    ],
)
def test_piqa_hub_malformed_rows_name_the_field(change, field, problem):
    err = malformed("piqa", {**PIQA_HUB, **change})
    assert err.field == field and problem in str(err)


# ---------------------------------------------------------------------------------------------------- winogrande

WINO_HUB = {
    "sentence": "Sarah was a much better surgeon than Maria so _ always got the easier cases.",
    "option1": "Sarah",
    "option2": "Maria",
    "answer": "2",
}


def test_winogrande_hub_layout_fills_the_blank():
    prompt, gold = example("winogrande", WINO_HUB)
    assert prompt.startswith("Which sentence makes more sense?\n")
    assert_lettered(
        prompt,
        [
            "Sarah was a much better surgeon than Maria so Sarah always got the easier cases.",
            "Sarah was a much better surgeon than Maria so Maria always got the easier cases.",
        ],
    )
    assert gold == "B"
    assert example("winogrande", {**WINO_HUB, "answer": "1"})[1] == "A"
    assert example("winogrande", {**WINO_HUB, "answer": 1})[1] == "A"
    possessive = example("winogrande", {**WINO_HUB, "sentence": "The cat ate _'s food."})[0]
    assert "A. The cat ate Sarah's food.\nB. The cat ate Maria's food." in possessive


def test_winogrande_hub_and_lm_eval_layouts_give_the_same_prompt():
    # lm-eval's layout: the sentence up to the blank with each option filled in, then the rest.
    local = {
        "context_options": [
            "Sarah was a much better surgeon than Maria so Sarah",
            "Sarah was a much better surgeon than Maria so Maria",
        ],
        "continuation": "always got the easier cases.",
        "gold": 1,
    }
    assert example("winogrande", local) == example("winogrande", WINO_HUB)


@pytest.mark.parametrize(
    ("change", "field", "problem"),
    [
        ({"answer": "3"}, "answer", "must be '1' or '2'"),
        ({"answer": "0"}, "answer", "must be '1' or '2'"),
        ({"answer": ""}, "answer", "unlabelled"),  # the hub test split
        ({"answer": None}, "answer", "is missing"),
        ({"sentence": "No blank here."}, "sentence", "blank"),
        ({"option2": None}, "option2", "is missing"),
    ],
)
def test_winogrande_hub_malformed_rows_name_the_field(change, field, problem):
    err = malformed("winogrande", {**WINO_HUB, **change})
    assert err.field == field and problem in str(err)


# ---------------------------------------------------------------------------------------------------- loader


@pytest.mark.parametrize(
    ("fmt", "row", "gold"), [("boolq", BOOLQ_HUB, "A"), ("piqa", PIQA_HUB, "A"), ("winogrande", WINO_HUB, "B")]
)
def test_hub_layout_rows_load_score_and_report_malformed_rows(tmp_path, fmt, row, gold):
    rows = [{**row, next(iter(row)): f"{row[next(iter(row))]} ({i})"} for i in range(6)]  # distinct prompts
    path = tmp_path / f"{fmt}.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    d = load_domain(DomainConfig(name=fmt, source=str(path), format=fmt), seed=0, num_eval=2)
    assert len(d.eval) == 2 and len(d.train) == 4
    reward = resolve_reward("choice_letter")
    for e in d.eval + d.train:
        assert e.answer == gold
        assert reward(f"The answer is {gold}.", e).correct and not reward("", e).correct
    bad_field = {"boolq": "answer", "piqa": "label", "winogrande": "answer"}[fmt]
    bad = {**rows[0], bad_field: "maybe"}
    path.write_text("\n".join(json.dumps(r) for r in [*rows, bad]) + "\n")
    with pytest.raises(RecipeError, match=rf"row 7: field '{bad_field}'"):
        load_domain(DomainConfig(name=fmt, source=str(path), format=fmt), seed=0, num_eval=2)
