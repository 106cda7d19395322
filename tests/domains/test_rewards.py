"""Rewards on real rows of ../shared/data and on hand-made edge cases; the user-reward import."""

from __future__ import annotations

import json
import random
import string
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from adaptercl.domains import Domain, Example, RewardResult, is_success, load_domain
from adaptercl.domains.answers import count_lettered_options, extract_choice_letter
from adaptercl.domains.datasets_formats import PROBE_SUFFIX, lettered
from adaptercl.domains.rewards import (
    BOXED_FORMAT_FEEDBACK,
    REWARDS,
    action_calls,
    answer_tag,
    arithmetic,
    arithmetic_hash,
    boxed_math,
    choice_letter,
    extract_final_number,
    final_number,
    json_call,
    last_boxed,
    math_equal,
    mcq,
    mcq_text,
    resolve_reward,
)
from adaptercl.recipe.grammar import DomainConfig, RecipeError
from adaptercl.recipe.method_blocks import DistillConfig
from adaptercl.teacher.prompts import hybrid_teacher_prompts, sdpo_teacher_prompts


def ex(answer, demonstration=None) -> Example:
    return Example("t/0", [{"role": "user", "content": "q"}], answer, demonstration)


def rows(path: Path, n: int) -> list[dict]:
    with path.open() as f:
        return [json.loads(next(f)) for _ in range(n)]


# ---------------------------------------------------------------------------------------------------- real rows


def test_final_number_on_gsm8k_rows(shared_data):
    for row in rows(shared_data / "gsm8k" / "test.jsonl", 8):
        gold = row["answer"].rsplit("####", 1)[1].strip().replace(",", "")
        e = ex(gold)
        assert final_number(row["answer"], e).correct  # the dataset's own rationale ends in '#### N'
        assert final_number(f"So the total is {gold} dollars.", e).correct
        assert final_number(f"Answer: {gold}", e).correct
        wrong = final_number(f"#### {int(gold) + 1}", e)
        assert not wrong.correct and wrong.score == 0.0 and str(int(gold) + 1) in wrong.feedback


def test_final_number_edge_cases():
    assert final_number("#### 1,000", ex("1000")).correct
    assert final_number("The answer is 5.0", ex("5")).correct
    assert final_number("Answer:   42  ", ex("42")).correct
    assert final_number("We get 12, then 7 more... #### 19", ex("19")).correct  # #### wins over the last number
    assert final_number("Answer: 19. Check: 19 - 7 = 12", ex("19")).correct  # Answer: wins over the last number
    assert final_number("It costs $1,234.50 in total", ex("1234.5")).correct
    assert final_number("-3", ex("-3")).correct
    assert not final_number("#### 10", ex("100")).correct
    none = final_number("I do not know.", ex("3"))
    assert not none.correct and "####" in none.feedback
    assert extract_final_number("3, 4 and 5") == "5"
    assert extract_final_number("To answer 2 questions: 7 + 5 = 12") == "12"  # 'answer' alone is no marker


def test_boxed_math_on_math500_rows(shared_data):
    for row in rows(shared_data / "math500" / "test.jsonl", 12):
        e = ex(row["answer"])
        assert boxed_math(row["solution"], e).correct, row["unique_id"]
        assert boxed_math(f"So the answer is $\\boxed{{{row['answer']}}}$.", e).correct
        assert not boxed_math("\\boxed{definitely wrong 12345}", e).correct
        unboxed = boxed_math(row["answer"], e)
        assert not unboxed.correct and unboxed.feedback == BOXED_FORMAT_FEEDBACK


@pytest.mark.parametrize(
    ("pred", "gold", "equal"),
    [
        ("\\frac{3}{6}", "\\frac{1}{2}", True),
        ("3/6", "\\frac12", True),
        ("\\dfrac{1}{2}", "\\frac{1}{2}", True),
        ("0.5", "\\frac{1}{2}", True),
        (" 5 ", "5", True),
        ("5.0", "5", True),
        ("1,000", "1000", True),
        ("x = 5", "5", True),
        ("10\\%", "10", True),
        ("90^\\circ", "90", True),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})", True),
        ("\\text{(C)}", "(C)", True),
        ("-\\frac{1}{3}", "-1/3", True),
        ("\\frac{1}{3}", "0.33", False),
        ("2", "3", False),
        ("\\frac{1}{2}", "\\frac{2}{1}", False),
    ],
)
def test_math_equal(pred, gold, equal):
    assert math_equal(pred, gold) is equal


# Correct answers in set, interval, radical and other LaTeX forms that the checks before math-verify (normalised
# strings and exact fractions: what math_equal did when math-verify was not installed) marked wrong, checked by
# blocking its import; MATH-500 golds by unique_id. And two near misses that must stay wrong.
MATH_VERIFY_CASES = [
    ("\\{2,1\\}", "\\{1,2\\}", True),
    ("\\sqrt{2}/2", "\\frac{\\sqrt2}{2}", True),
    ("1/\\sqrt{3}", "\\frac{\\sqrt{3}}{3}", True),  # algebra/1519
    ("[-2,7]", "x \\in [-2,7]", True),  # algebra/101
    ("\\{-2, 1+\\sqrt5, 1-\\sqrt5\\}", "\\{1\\pm\\sqrt{5},-2\\}", True),  # intermediate_algebra/2015
    ("(9,36)\\cup(0,9)", "(0,9) \\cup (9,36)", True),  # intermediate_algebra/1992
    ("2\\pi+18", "18+2\\pi", True),  # geometry/686
    ("\\sqrt{20}", "2\\sqrt{5}", True),  # intermediate_algebra/1797
    ("(3,4)", "(3,4]", False),  # intermediate_algebra/558: the closed end matters
    ("\\sqrt{3}/3", "\\sqrt{3}", False),
]


def math500_domain(tmp_path, golds: list[str]) -> Domain:
    path = tmp_path / "math.jsonl"
    rows = [{"problem": f"p{i}", "answer": g} for i, g in enumerate([*golds, "0"])]  # the last one trains
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = DomainConfig(name="math", source=str(path), format="math500", eval_file=str(path))
    return load_domain(cfg, seed=0, num_eval=len(golds))


def test_boxed_math_matches_latex_forms_through_math_verify(tmp_path):
    """The code path a run takes: a math500 domain from a local file, scored by `Domain.score` on the main thread
    (math-verify's signal timeouts on) and from a worker thread (no signal there: timeouts off, same verdicts)."""
    domain = math500_domain(tmp_path, [gold for _, gold, _ in MATH_VERIFY_CASES])
    texts = [f"So the answer is $\\boxed{{{pred}}}$." for pred, _, _ in MATH_VERIFY_CASES]
    expected = [equal for _, _, equal in MATH_VERIFY_CASES]
    assert [ex.answer for ex in domain.eval] == [gold for _, gold, _ in MATH_VERIFY_CASES]
    assert [r.correct for r in domain.score(texts, [[]] * len(texts), domain.eval)] == expected
    with ThreadPoolExecutor(1) as pool:
        in_thread = pool.submit(domain.score, texts, [[]] * len(texts), domain.eval).result()
    assert [r.correct for r in in_thread] == expected


def test_math_verify_is_required_not_silently_skipped(monkeypatch):
    assert math_equal("0.5", "\\frac{1}{2}")  # exact numbers need no math-verify
    monkeypatch.setitem(sys.modules, "math_verify", None)  # as if it were not installed
    with pytest.raises(ImportError):
        math_equal("\\{2,1\\}", "\\{1,2\\}")


def test_last_boxed_nested_and_truncated():
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{1}{\\sqrt{2}}}.") == "\\frac{1}{\\sqrt{2}}"
    assert last_boxed("the answer is \\boxed 7$") == "7"
    assert last_boxed("\\boxed{\\frac{1}{2") is None  # truncated response
    assert boxed_math("\\boxed{\\frac{1}{2", ex("\\frac12")).feedback == BOXED_FORMAT_FEEDBACK
    assert boxed_math("\\fbox{4}", ex("4")).correct


def test_answer_tag_on_sciknoweval_rows(shared_data):
    for row in rows(shared_data / "sciknoweval" / "physics" / "test.jsonl", 6):
        e = ex(row["answer"])
        other = "A" if row["answer"] != "A" else "B"
        assert answer_tag(f"<reasoning>\nsteps\n</reasoning>\n<answer>\n{row['answer']}\n</answer>", e).correct
        wrong = answer_tag(f"<answer>{other}</answer>", e)
        assert not wrong.correct and f"Option {other}" in wrong.feedback
        untagged = answer_tag("I think the second option is right.", e)
        assert not untagged.correct and "<answer>" in untagged.feedback


def test_answer_tag_follows_the_reference_extraction():
    assert answer_tag("<answer> b </answer>", ex("B")).correct  # stripped and upper-cased
    assert answer_tag("<answer>A</answer> no wait <answer>C</answer>", ex("C")).correct  # the last tag
    assert answer_tag("C", ex("C")).correct  # no tag at all: the whole response, as lasgroup/SDPO mcq.py
    assert not answer_tag("<answer>CD</answer>", ex("C")).correct


def test_action_calls_on_tooluse_rows(shared_data):
    data = [json.loads(line) for line in (shared_data / "tooluse" / "test.jsonl").open()]
    multi = next(r for r in data if len(json.loads(r["answer"])) > 1)
    for row in [data[0], multi]:
        gold = json.loads(row["answer"])
        e = ex(gold)
        text = "\n".join(f"Thought: step\nAction: {g['Action']}\nAction Input: {g['Action_Input']}" for g in gold)
        assert action_calls(text, e).correct
        assert action_calls(text, ex(row["answer"])).correct  # gold as the raw JSON string works too
        wrong_name = action_calls(text.replace(f"Action: {gold[0]['Action']}", "Action: notATool", 1), e)
        assert (
            not wrong_name.correct and "Actions mismatch" in wrong_name.feedback and "notATool" in wrong_name.feedback
        )
    gold = json.loads(multi["answer"])
    merged = {}
    for g in gold:
        merged.update(json.loads(g["Action_Input"]))
    # inputs are compared merged over all calls, as the SDFT/SDPO evaluation does
    text = (
        "".join(f"Action: {g['Action']}\nAction Input: {{}}\n" for g in gold) + f"Action Input: {json.dumps(merged)}"
    )
    assert action_calls(text, ex(gold)).correct


def test_action_calls_feedback_names_the_mismatch():
    gold = [{"Action": "getWeather", "Action_Input": '{"city": "Paris"}'}]
    bad_input = action_calls('Action: getWeather\nAction Input: {"city": "Rome"}', ex(gold))
    assert not bad_input.correct
    assert "Action inputs mismatch" in bad_input.feedback and "Rome" in bad_input.feedback
    assert "Actions mismatch" not in bad_input.feedback
    assert not action_calls("Action: getWeather\nAction Input: {not json}", ex(gold)).correct
    assert not action_calls(
        'Action: getWeather\nAction Input: {"city": "Paris"}\nAction: getWeather', ex(gold)
    ).correct


def test_choice_letter_on_arc_rows(shared_data):
    for row in rows(shared_data / "arc" / "challenge_train.jsonl", 6):
        e = ex(row["answerKey"])
        assert choice_letter(row["response"], e).correct  # "... The best answer is C."
        for text in (row["answerKey"], f"{row['answerKey']}. {row['answer']}", f"Answer: ({row['answerKey']})"):
            assert choice_letter(text, e).correct, text
        other = "A" if row["answerKey"] != "A" else "B"
        assert not choice_letter(f"The answer is {other}.", e).correct


def test_choice_letter_edge_cases():
    assert choice_letter("  b) the second one", ex("B")).correct
    assert choice_letter("<answer>D</answer>", ex("D")).correct
    assert choice_letter("The correct answer is option C", ex("C")).correct
    missing = choice_letter("A dog would do that.", ex("A"))  # an article is not a choice
    assert not missing.correct and missing.feedback


@pytest.mark.parametrize(
    ("text", "letter"),
    [
        # issue 16: what the first extractor misread
        ("I think the answer is a tough one, but B", "B"),  # read A before
        ("Answer: I think it is B", "B"),  # read I before
        ("The answer is: B", "B"),  # read nothing before, as the next three
        ("Answer: **B**", "B"),
        ("**B**", "B"),
        ("The correct option is B.", "B"),
        # stated choices
        ("A) Paris, because it is the capital.", "A"),
        ("(C)", "C"),
        ("answer: c", "C"),
        ("Option D is correct", "D"),
        ("I choose B", "B"),
        ("Neither A nor B fits the data, so the answer is C.", "C"),
        ("The answer is A because dogs bark.", "A"),
        ("The answer is B. Wait, that ignores friction: the answer is D.", "D"),  # the last statement
        ("**Final Answer:** (B) the second one", "B"),
        ("$\\boxed{\\text{C}}$", "C"),
        ("Let me think.\n\nD\n", "D"),  # a line holding only the letter
        ("(C) is the best answer.", "C"),
        ("I'd go with option A.", "A"),
        # no choice stated
        ("Neither A nor B is correct.", None),
        ("The answer is not A", None),
        ("A dog would do that.", None),
        ("Answer: A dog would do that.", None),  # the article after a colon
        ("I don't know which one.", None),
        ("It could be plan B or vitamin C, I am not sure", None),
        ("", None),
    ],
)
def test_extract_choice_letter_reads_the_stated_choice(text, letter):
    assert extract_choice_letter(text) == letter


def test_choice_letter_only_counts_the_options_the_probe_lists():
    question = "Which gas do plants take in?\n" + lettered(["oxygen", "carbon dioxide", "nitrogen", "helium"])
    probe = Example("arc/0", [{"role": "user", "content": question + PROBE_SUFFIX}], "B")
    assert count_lettered_options(probe.messages[-1]["content"]) == 4
    assert count_lettered_options("What is 2 + 2?") is None
    assert choice_letter("Answer: I think it is B", probe).correct
    assert choice_letter("Answer: I", probe).feedback == "State the letter of the correct option."  # only A-D
    assert extract_choice_letter("Answer: I") == "I"  # with no option count, I may be a ninth option
    assert extract_choice_letter("The answer is E.", 4) is None
    assert choice_letter("The answer is C.", probe).feedback == "Option C is incorrect."


# ---------------------------------------------------------------------------------------------------- builtins


def test_arithmetic_reward_format_credit():
    assert arithmetic("3 + 4 = 7. The answer is 7.", ex("7")) == RewardResult(1.0, True)
    wrong = arithmetic("The answer is 8.", ex("7"))
    assert wrong.score == 0.2 and not wrong.correct and "8" in wrong.feedback
    unformatted = arithmetic("3 + 4 = 7", ex("7"))
    assert unformatted.score == 0.0 and not unformatted.correct and "The answer is" in unformatted.feedback
    assert arithmetic("The answer is 7. Wait, the answer is 6.", ex("6")).correct  # the last one counts


def test_mcq_reward_format_credit():
    assert mcq("<answer> b </answer>", ex("B")).correct
    assert mcq("<answer>A</answer>", ex("B")).score == 0.2
    assert mcq("B", ex("B")).score == 0.0  # the builtin domain insists on the tags


def test_the_variants_reward_their_own_convention_only():
    # arithmetic_hash: the last `#### N`; arithmetic's "The answer is N." is the other convention: no credit
    assert arithmetic_hash("3 + 4 = 7.\n#### 7", ex("7")).correct
    assert arithmetic_hash("#### 5\n#### 7", ex("7")).correct  # the last one counts
    assert arithmetic_hash("#### 8", ex("7")).score == 0.2 and arithmetic_hash("#### 8", ex("7")).reveals_correctness
    assert arithmetic_hash("The answer is 7.", ex("7")).score == 0.0
    assert arithmetic("3 + 4 = 7.\n#### 7", ex("7")).score == 0.0  # and the other way round
    # mcq_text: the option's text in the last tags, case aside; its letter gets the format credit only
    assert mcq_text("<answer> mars </answer>", ex("Mars")).correct
    letter = mcq_text("<answer>B</answer>", ex("Mars"))
    assert letter.score == 0.2 and not letter.reveals_correctness and "letter" in letter.feedback
    assert mcq_text("<answer>Venus</answer>", ex("Mars")).reveals_correctness
    assert mcq_text("Mars", ex("Mars")).score == 0.0  # the tags are required
    assert mcq("<answer>Mars</answer>", ex("B")).score == 0.0  # and mcq gives a word in its tags nothing


def test_json_call_partial_credit_and_feedback():
    gold = {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}
    assert json_call(
        '```json\n{"name": "get_weather", "arguments": {"city": "paris", "days": "3"}}\n```', ex(gold)
    ).correct
    wrong_value = json_call('{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}', ex(gold))
    assert not wrong_value.correct and wrong_value.score == pytest.approx(0.35)
    assert "'city'" in wrong_value.feedback and "Paris" in wrong_value.feedback
    wrong_name = json_call('{"name": "get_time", "arguments": {"city": "Paris", "days": 3, "x": 1}}', ex(gold))
    assert "get_time" in wrong_name.feedback and "unexpected argument 'x'" in wrong_name.feedback
    assert wrong_name.score < 0.5
    assert json_call("call get_weather(Paris)", ex(gold)).score == 0.0


def test_partial_credit_stays_below_the_sdpo_success_threshold():
    rng = random.Random(0)
    golds = {"arithmetic": "7", "arithmetic_hash": "7", "mcq": "B", "mcq_text": "cat",
             "json_call": {"name": "f", "arguments": {"a": 1, "b": "x"}}}  # fmt: skip
    for name, gold in golds.items():
        for _ in range(200):
            text = "".join(rng.choice(string.printable) for _ in range(rng.randint(0, 60)))
            text += rng.choice(["", "The answer is 8", "<answer>C</answer>", '{"name": "f", "arguments": {"a": 1}}',
                                "#### 8", "<answer>dog</answer>"])  # fmt: skip
            result = REWARDS[name](text, ex(gold))
            assert result.correct or result.score < 0.5


def test_every_reward_survives_garbage():
    rng = random.Random(1)
    golds = {
        "final_number": "12",
        "boxed_math": "\\frac{1}{2}",
        "answer_tag": "A",
        "action_calls": [{"Action": "f", "Action_Input": "{}"}],
        "choice_letter": "A",
        "arithmetic": "3",
        "arithmetic_hash": "3",
        "mcq": "A",
        "mcq_text": "cat",
        "json_call": {"name": "f", "arguments": {}},
        "copy": "apple",
    }
    assert set(golds) == set(REWARDS)
    pieces = [
        "{",
        "}",
        "\\boxed{",
        "<answer>",
        "Action:",
        "Action Input: {",
        "####",
        "The answer is",
        "\x00",
        "∑",
        " ",
    ]
    for name, fn in REWARDS.items():
        for _ in range(100):
            text = "".join(rng.choice(pieces + list(string.printable)) for _ in range(rng.randint(0, 80)))
            result = fn(text, ex(golds[name]))
            assert isinstance(result, RewardResult) and 0.0 <= result.score <= 1.0
            assert result.correct or result.feedback  # every wrong answer says why (SDPO feedback)


# ---------------------------------------------------------------------------------------------------- user rewards


def test_resolve_reward_by_name_and_import(tmp_path, monkeypatch):
    assert resolve_reward("boxed_math") is boxed_math
    (tmp_path / "my_rewards_pkg").mkdir()
    (tmp_path / "my_rewards_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_rewards_pkg" / "scoring.py").write_text(
        "from adaptercl.domains import RewardResult\n"
        "def exact(text, example):\n"
        "    ok = text.strip() == example.answer\n"
        "    return RewardResult(float(ok), ok, None if ok else 'no')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = resolve_reward("my_rewards_pkg.scoring:exact")
    assert fn(" yes ", ex("yes")).correct and not fn("no", ex("yes")).correct


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("not_a_reward", "not a known reward"),
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        ("json:no_such_function", "has no function 'no_such_function'"),
        ("json:", "not a known reward"),
    ],
)
def test_resolve_reward_errors_name_the_spec(spec, says):
    with pytest.raises(RecipeError) as err:
        resolve_reward(spec)
    assert repr(spec) in str(err.value) and says in str(err.value)


# ---------------------------------------------------------------------------------------------------- feedback kind

# format -> (rows file under shared data, a well-formatted wrong answer to example e, a malformed answer)
FEEDBACK_CASES = {
    "gsm8k": ("gsm8k/test.jsonl", lambda e: f"Adding up:\n#### {e.answer}1", "I do not know."),
    "math500": ("math500/test.jsonl", lambda e: "So the answer is $\\boxed{12345}$.", "The answer is 7."),
    "sciknoweval": (
        "sciknoweval/physics/test.jsonl",
        lambda e: f"<answer>\n{'A' if e.answer != 'A' else 'B'}\n</answer>",
        "I think the second option is right.",
    ),
}


def feedback_domain(tmp_path, shared_data, fmt: str, **kw) -> Domain:
    """A domain of the format's first real rows, loaded as a recipe's `domains:` entry would be."""
    path = tmp_path / f"{fmt}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows(shared_data / FEEDBACK_CASES[fmt][0], 6)))
    return load_domain(DomainConfig(name=fmt, source=str(path), format=fmt, **kw), seed=0, num_eval=2)


def sdpo_targets(domain: Domain, answer, group_size: int = 4) -> list[bool]:
    """has_target of SDPO teacher prompts for groups of `group_size` samples answering `answer(e)`."""
    samples = [e for e in domain.eval for _ in range(group_size)]
    texts = [answer(e) for e in samples]
    results = [domain.reward(t, e) for t, e in zip(texts, samples, strict=True)]
    assert not any(r.correct for r in results)
    feedbacks = [r.feedback for r in results]
    succeeded = [is_success(r, DistillConfig().success_threshold) for r in results]
    out = sdpo_teacher_prompts([e.messages for e in samples], texts, succeeded, feedbacks, group_size, DistillConfig())
    return out.has_target


@pytest.mark.parametrize("fmt", sorted(FEEDBACK_CASES))
def test_all_wrong_well_formatted_group_has_no_sdpo_target_by_default(tmp_path, shared_data, fmt):
    """issue 16: as the reference rewards, 'X is incorrect' is not feedback unless the domain opts in."""
    _, wrong, _ = FEEDBACK_CASES[fmt]
    assert sdpo_targets(feedback_domain(tmp_path, shared_data, fmt), wrong) == [False] * 8
    opted_in = feedback_domain(tmp_path, shared_data, fmt, feedback="correctness")
    assert sdpo_targets(opted_in, wrong) == [True] * 8
    assert sdpo_targets(feedback_domain(tmp_path, shared_data, fmt, feedback="format"), wrong) == [False] * 8


@pytest.mark.parametrize("fmt", sorted(FEEDBACK_CASES))
def test_a_malformed_answer_gets_format_feedback(tmp_path, shared_data, fmt):
    def malformed(e: Example) -> str:
        return FEEDBACK_CASES[fmt][2]

    default = feedback_domain(tmp_path, shared_data, fmt)
    assert sdpo_targets(default, malformed) == [fmt != "sciknoweval"] * 8  # as mcq.py, no feedback for sciknoweval
    assert sdpo_targets(feedback_domain(tmp_path, shared_data, fmt, feedback="format"), malformed) == [True] * 8
    assert sdpo_targets(feedback_domain(tmp_path, shared_data, fmt, feedback="none"), malformed) == [False] * 8


def test_tooluse_keeps_the_reference_mismatch_feedback_by_default(tmp_path, shared_data):
    path = tmp_path / "tooluse.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows(shared_data / "tooluse" / "test.jsonl", 4)))
    for kw, shown in (({}, True), ({"feedback": "format"}, False)):
        d = load_domain(DomainConfig(name="t", source=str(path), format="tooluse", **kw), seed=0, num_eval=2)
        result = d.reward("Action: notATool\nAction Input: {}", d.eval[0])
        assert not result.correct and (result.feedback is not None) == shown  # feedback/tooluse.py: "expected ..."


def test_hybrid_failed_groups_still_get_the_demonstration_without_feedback(tmp_path, shared_data):
    d = feedback_domain(tmp_path, shared_data, "gsm8k")
    samples = [e for e in d.eval for _ in range(4)]
    texts = [f"#### {e.answer}1" for e in samples]
    results = [d.reward(t, e) for t, e in zip(texts, samples, strict=True)]
    out = hybrid_teacher_prompts(
        [e.messages for e in samples],
        texts,
        [is_success(r, DistillConfig().success_threshold) for r in results],
        [r.feedback for r in results],
        [e.demonstration for e in samples],
        4,
        DistillConfig(),
        failed_groups_only=True,
    )
    assert out.has_target == [True] * 8 and not any(out.used_feedback)


def test_user_reward_feedback_passes_unless_none():
    def build(**kw) -> Domain:
        cfg = DomainConfig(name="a", source="builtin:arithmetic", reward="tiny_rewards:digit_fraction", **kw)
        return load_domain(cfg, seed=0, num_eval=2)

    e = build().eval[0]
    assert build().reward("no digits", e).feedback == "Use more digits."
    assert build(feedback="correctness").reward("no digits", e).feedback == "Use more digits."
    assert build(feedback="none").reward("no digits", e).feedback is None


def test_feedback_kind_is_checked():
    with pytest.raises(ValueError, match="feedback"):
        DomainConfig(name="a", source="builtin:arithmetic", feedback="always")
