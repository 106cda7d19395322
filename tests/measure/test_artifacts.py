"""The formatting-artifact diagnostic (`measure/artifacts.py`) against hand counts, and its report section."""

from __future__ import annotations

import json

import pytest

from adaptercl.measure.artifacts import formatting_artifacts, stage_artifacts, top_ngrams, words

STAGE = ["<answer>B</answer>", "<answer>A</answer>"]
BASE = ["The answer is B.", "<answer>B"]


def test_words_split_markup_into_tokens():
    assert words("<answer>B</answer>") == ["<", "answer", ">", "b", "<", "/", "answer", ">"]
    assert words('{"name": x}') == ["{", '"', "name", '"', ":", "x", "}"]


def test_rates_ratio_and_top_ngrams_by_hand():
    # stage bigrams, 7 per response: (answer, >) x4, (<, answer) (<, /) (/, answer) x2 each, the letters' x1 each.
    # Top 2: (answer, >) and, of the three tied at 2, the first by text: (/, answer) ("/" sorts before "<").
    # Stage rate (4 + 2) / 14. Base: "the answer is b ." 4 bigrams, "< answer > b" 3 bigrams with (answer, >) once:
    # 1 / 7. Ratio 3, difference 2 / 7.
    got = formatting_artifacts(STAGE, BASE, ns=(2,), k=2)
    assert got["rate"] == pytest.approx(6 / 14) and got["base_rate"] == pytest.approx(1 / 7)
    assert got["ratio"] == pytest.approx(3.0) and got["difference"] == pytest.approx(2 / 7)
    assert [t["ngram"] for t in got["top"]] == ["answer >", "/ answer"]
    assert got["top"][0] == {"ngram": "answer >", "rate": pytest.approx(4 / 14), "base_rate": pytest.approx(1 / 7)}
    assert got["top"][1]["base_rate"] == 0.0 and (got["responses"], got["ns"], got["k"]) == (2, [2], 2)


def test_pooled_over_n_and_no_change_is_a_ratio_of_one():
    # n = 1 and 2 pooled: 16 unigram positions, top 1 = "<" (4; tied with ">" and "answer", first by text); 14 bigram
    # positions, top 1 = (answer, >) (4). Base: 9 unigrams with "<" once, 7 bigrams with (answer, >) once.
    got = formatting_artifacts(STAGE, BASE, ns=(1, 2), k=1)
    assert got["rate"] == pytest.approx(8 / 30) and got["base_rate"] == pytest.approx(2 / 16)
    assert [t["ngram"] for t in got["top"]] == ["answer >", "<"]  # by their own rate: 4 / 14, then 4 / 16
    assert formatting_artifacts(BASE, BASE)["ratio"] == 1.0  # nothing trained: exactly 1
    assert formatting_artifacts(STAGE, ["B", "A"], ns=(2,))["ratio"] is None  # the base has no bigram at all
    assert formatting_artifacts(STAGE, ["x y", "x y"], ns=(2,))["ratio"] is None  # ... or none of the chosen ones
    with pytest.raises(ValueError, match="k >= 1"):
        formatting_artifacts(STAGE, BASE, k=0)


def test_top_ngrams_break_ties_by_text():
    from collections import Counter

    assert top_ngrams(Counter({("b",): 2, ("a",): 2, ("c",): 3}), 2) == [("c",), ("a",)]


def test_stage_artifacts_take_each_stage_s_own_domain_against_row_zero():
    rows = [
        {"x": {"completions": BASE}, "y": {"completions": ["a b"]}},
        {"x": {"completions": STAGE}, "y": {"completions": ["a b"]}},
        {"x": {"completions": BASE}, "y": {"completions": ["a b", "a b"]}},
    ]
    got = stage_artifacts(rows, ["x", "y"], [0, 1], ns=(2,), k=2)
    assert got[0]["domain"] == "x" and got[0]["ratio"] == pytest.approx(3.0)
    assert got[1]["domain"] == "y" and got[1]["ratio"] == 1.0 and got[1]["responses"] == 2
    old = [{"x": {"accuracy": 0.5}}] * 3  # eval.json written before it kept the completions
    assert stage_artifacts(old, ["x", "y"], [0, 1]) == [None, None]


def test_report_shows_each_stage_s_artifacts(tmp_path):
    from adaptercl.measure.report import write_report

    stages = ["stage-00-before", "stage-01-x"]
    summary = {"domains": ["x"], "stages": stages, "accuracy": [[0.0], [0.5]], "stage_adapters": [[], ["a"]],
               "cl_metrics": {"trained_columns": [0]}}  # fmt: skip
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    for name, texts in zip(stages, (BASE, STAGE)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "eval.json").write_text(json.dumps({"x": {"accuracy": 0.5, "completions": texts}}))
    text = write_report(tmp_path).read_text()
    assert "## Formatting artifacts (each stage's own domain, against the base)" in text
    # the default ns (2, 3, 4), k 10, on the same texts: the row's numbers are formatting_artifacts'
    art = formatting_artifacts(STAGE, BASE)
    row = next(line for line in text.splitlines() if line.startswith("| stage-01-x | x | 2 |"))
    assert f"| {art['rate']:.3f} | {art['base_rate']:.3f} | {art['ratio']:.2f} |" in row
    assert f"`{art['top'][0]['ngram']}` ({art['top'][0]['rate']:.3f} / " in row


def test_eval_keeps_every_completion_in_eval_set_order():
    from adaptercl.domains import load_domain
    from adaptercl.measure.evaluate import evaluate_domain
    from adaptercl.model.base import load_base
    from adaptercl.recipe.grammar import DomainConfig, ModelConfig
    from adaptercl.rollout import Completion

    tok = load_base(ModelConfig(name="tiny-random"), "none").tokenizer
    domain = load_domain(DomainConfig(name="mcq", source="builtin:mcq"), seed=0, num_eval=5)
    texts = [f"<answer>{letter}</answer>" for letter in "ABCAB"]

    class Scripted:  # greedy "generation" answering the i-th prompt with texts[i]
        def generate(self, prompts, adapters, params):
            return [
                [Completion(p, tok.encode(t, add_special_tokens=False), t, "stop")] for p, t in zip(prompts, texts)
            ]

    row = evaluate_domain(Scripted(), tok, domain, None, 8, 5)
    assert row["completions"] == texts and len(row["samples"]) == 3
    assert row["correct"] == [t == f"<answer>{e.answer}</answer>" for t, e in zip(texts, domain.eval)]
