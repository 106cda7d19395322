"""Gold answers as datasets write them (issue 47): an MMLU-shaped CSV (one column per option, the answer a 0-based
index) scores right with a scripted model when its kind is declared or read off its values, and is refused in one
line, never scored 0.000, when a letter reward would compare the reply's letter with an index; hand-written rows of
each answer kind; the column-level reading of an undeclared kind and its refusals."""

from __future__ import annotations

import csv
import json

import pytest

from adaptercl.domains import Domain, load_domain
from adaptercl.domains.gold_answers import RowOptions, infer_answer_kind, row_options
from adaptercl.measure.evaluate import evaluate_domain
from adaptercl.recipe.grammar import DomainConfig, RecipeError
from adaptercl.rollout import Completion

TEMPLATE = "{question}\n\nA. {choice0}\nB. {choice1}\nC. {choice2}\nD. {choice3}\n\nAnswer with the letter."
CHOICES = ["choice0", "choice1", "choice2", "choice3"]
# question, the four options, the gold as MMLU writes it (0-based index)
MMLU_ROWS = [
    ("Which selection favours the mean?", "directional", "stabilizing", "disruptive", "sexual", 1),
    ("What is 2 + 2?", "3", "4", "5", "22", 1),
    ("The capital of France?", "Paris", "Rome", "Madrid", "Berlin", 0),
    ("The largest planet?", "Mars", "Venus", "Earth", "Jupiter", 3),
    ("The formula of water?", "CO2", "NaCl", "H2O", "O2", 2),
    ("The speed of light in km/s?", "3e5", "3e3", "3e8", "300", 0),
]


def mmlu_csv(path) -> str:
    """MMLU's per-subject CSV as distributed: header question,choice0..choice3,answer; answers 0-based indices."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["question", *CHOICES, "answer"])
        writer.writerows(MMLU_ROWS)
    return str(path)


class KnowingEngine:
    """Greedy 'generation' by a model that answers as the issue's did ("B. stabilizing"): `replies` maps a question
    to the reply; the prompt is read back from its token ids, so evaluation's encoding and scoring run for real."""

    def __init__(self, tokenizer, replies: dict[str, str]):
        self.tokenizer, self.replies = tokenizer, replies

    def generate(self, prompts, adapters, params):
        out = []
        for ids in prompts:
            text = self.tokenizer.decode(ids)
            reply = next(r for question, r in self.replies.items() if question in text)
            out.append([Completion(ids, self.tokenizer.encode(reply, add_special_tokens=False), reply, "stop")])
        return out


@pytest.fixture(scope="module")
def tokenizer():
    from adaptercl.model.base import load_base
    from adaptercl.recipe.grammar import ModelConfig

    return load_base(ModelConfig(name="tiny-random"), "none").tokenizer


def reply(row: tuple, letter: str) -> str:
    """The reply that chooses `letter`, worded as the issue's model did: "B. stabilizing"."""
    return f"{letter}. {row[1 + 'ABCD'.index(letter)]}"


def evaluated_accuracy(tokenizer, domain: Domain, chosen: dict[str, str]) -> dict:
    domain.eval = sorted(domain.eval + domain.train, key=lambda ex: int(ex.id.rsplit("/", 1)[1]))
    replies = {row[0]: reply(row, chosen[row[0]]) for row in MMLU_ROWS}
    return evaluate_domain(KnowingEngine(tokenizer, replies), tokenizer, domain, None, 8, len(domain.eval))


@pytest.mark.parametrize(
    "declared",
    [
        {"answer_kind": "index0"},  # the kind alone: the letters the prompt shows
        {"answer_options": CHOICES, "answer_kind": "index0"},
        {"answer_options": CHOICES},  # undeclared: read off the column (a 0 is there: 0-based)
    ],
)
def test_an_mmlu_csv_with_index_answers_scores_right_on_a_scripted_model(tmp_path, tokenizer, declared):
    cfg = DomainConfig(
        name="mmlu",
        source=mmlu_csv(tmp_path / "bio.csv"),
        prompt_template=TEMPLATE,
        reward="choice_letter",
        **declared,
    )
    domain = load_domain(cfg, seed=0, num_eval=0)
    golds = {ex.columns["question"]: ex.answer for ex in domain.train}
    assert golds == {row[0]: "ABCD"[row[-1]] for row in MMLU_ROWS}  # index i -> the i-th letter
    # right on rows 1, 3, 4, 6 (their gold letter), wrong on 2 and 5 (the next letter): 4 of 6 by hand
    chosen = {row[0]: "ABCD"[(row[-1] + (i in (1, 4))) % 4] for i, row in enumerate(MMLU_ROWS)}
    row = evaluated_accuracy(tokenizer, domain, chosen)
    assert row["correct"] == [True, False, True, True, False, True]
    assert row["accuracy"] == 4 / 6


def test_an_mmlu_csv_scored_against_letters_without_its_kind_is_refused_in_one_line(tmp_path, capsys):
    """The issue's recipe (choice_letter on index answers, no kind): refused when loading, never 0.000."""
    source = mmlu_csv(tmp_path / "bio.csv")
    cfg = DomainConfig(name="mmlu", source=source, prompt_template=TEMPLATE, reward="choice_letter")
    expected = (
        r"^domains\.mmlu\.answer_kind: column 'answer' holds 1, 0, 3 \(6 of 6 rows read\), not option letters "
        r"\(A-D, as the prompt lists them\), which reward choice_letter compares the reply's chosen letter with; "
        r"say how the column is written: answer_kind: index0 \(0-based\), index1 \(1-based\), letter or text"
    )
    with pytest.raises(RecipeError, match=expected):
        load_domain(cfg, seed=0, num_eval=2)


def test_a_final_number_reward_on_rationale_golds_names_fields_answer(tmp_path):
    path = tmp_path / "math.jsonl"
    rows = [{"prompt": f"{i} + {i}?", "answer": f"Add them: {i} + {i} = {2 * i}.\n#### {2 * i}"} for i in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(RecipeError, match=r"^domains\.m\.fields\.answer: column 'answer' holds 'Add them: 0 \+ 0"):
        load_domain(DomainConfig(name="m", source=str(path), reward="final_number"), seed=0, num_eval=0)


# ------------------------------------------------------------------------------------------ each kind, by hand

OPTIONS = ["red", "dog", "run"]


@pytest.mark.parametrize(
    ("kind", "options", "answers"),
    [
        ("letter", OPTIONS, ["A", "b", "C"]),
        ("index0", OPTIONS, [0, 1, 2]),
        ("index1", OPTIONS, ["1", "2", "3"]),  # Winogrande writes "1"/"2"
        ("key", {"x1": "red", "x2": "dog", "x3": "run"}, ["x1", "x2", "x3"]),
        ("text", OPTIONS, ["red", " dog ", "run"]),
    ],
)
def test_hand_written_rows_of_each_kind_become_the_right_letter_and_score(tmp_path, kind, options, answers):
    path = tmp_path / "mc.jsonl"
    questions = ["Which is a colour?", "Which is an animal?", "Which is a verb?"]
    rows = [{"question": q, "options": options, "answer": a} for q, a in zip(questions, answers)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    template = "{question}\n\n{options}\n\nAnswer with the letter."
    for declared in (kind, None):  # declared, and read off the column: the same golds
        cfg = DomainConfig(
            name="mc", source=str(path), prompt_template=template, answer_options="options", answer_kind=declared,
            reward="choice_letter",
        )  # fmt: skip
        domain = load_domain(cfg, seed=0, num_eval=0)
        by_id = {ex.id: ex for ex in domain.train}
        assert [by_id[f"mc/train/{i}"].answer for i in (1, 2, 3)] == ["A", "B", "C"]
        animal = by_id["mc/train/2"]
        assert animal.messages[-1]["content"].endswith("A. red\nB. dog\nC. run\n\nAnswer with the letter.")
        assert [r.correct for r in domain.score(["B. dog", "A. red"], [[], []], [animal, animal])] == [True, False]


def test_a_declared_index_out_of_range_is_one_line_naming_the_file_row_and_column(tmp_path):
    path = mmlu_csv(tmp_path / "bio.csv")
    with open(path, "a", newline="") as f:
        csv.writer(f).writerow(["An extra question?", "a", "b", "c", "d", 4])
    cfg = DomainConfig(
        name="mmlu", source=path, prompt_template=TEMPLATE, answer_kind="index0", reward="choice_letter"
    )
    with pytest.raises(RecipeError, match=r"bio\.csv: row 7: field 'answer' 4 is not a 0-based option index of the 4"):
        load_domain(cfg, seed=0, num_eval=0)


# ------------------------------------------------------------------------------------------ reading a column


def options(n: int) -> RowOptions:
    return row_options({"o": [f"option {i}" for i in range(n)]}, "o")


@pytest.mark.parametrize(
    ("golds", "kind"),
    [
        ([0, 1, 3, 2], "index0"),  # a 0: 0-based
        (["1", "4", "2"], "index1"),  # a 4 of 4 options: 1-based
        (["a", "D"], "letter"),
        (["option 2", "option 0"], "text"),
    ],
)
def test_an_undeclared_kind_is_the_one_every_value_fits(golds, kind):
    assert infer_answer_kind([(g, options(4)) for g in golds], "answer") == kind


def test_a_dicts_own_keys_come_first():
    numbered = row_options({"c": {"text": ["x", "y", "z"], "label": ["1", "2", "3"]}}, "c")  # ARC's numbered rows
    assert infer_answer_kind([("2", numbered), ("3", numbered)], "answerKey") == "key"


def test_indices_that_read_both_ways_are_refused_naming_answer_kind():
    with pytest.raises(ValueError, match=r"^column 'answer' holds 1, 3, 2, which read as index0 and as index1 alike"):
        infer_answer_kind([(g, options(4)) for g in (1, 3, 2, 1)], "answer")


def test_values_that_fit_no_kind_are_refused_with_three_of_them(tmp_path):
    rows = [{"q": f"q{i}?", "o": ["x", "y"], "answer": v} for i, v in enumerate(["maybe", "x", "never", "often"])]
    path = tmp_path / "mc.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DomainConfig(name="mc", source=str(path), prompt_template="{q}\n{o}", answer_options="o", reward="mcq")
    expected = r"^domains\.mc\.answer_kind: column 'answer' holds 'maybe', 'never', 'often': not the options' letters"
    with pytest.raises(RecipeError, match=expected):
        load_domain(cfg, seed=0, num_eval=0)
