"""TRL-style rewards (`domains/trl_rewards.py`): TRL's own functions, weights and None as TRL combines them, extra
columns, signature detection, one-line errors, and a real run whose domain is scored by trl.rewards."""

from __future__ import annotations

import functools
import json
import logging
import math

import pytest
import tiny_rewards
import torch

from adaptercl.domains import load_domain
from adaptercl.domains.loading import check_domain
from adaptercl.domains.rewards import boxed_math
from adaptercl.domains.trl_rewards import TrlRewards, reward_component_stats, reward_style, weighted_reward
from adaptercl.recipe.grammar import DomainConfig, RecipeError, resolve_recipe
from adaptercl.run.sequence import run_recipe
from adaptercl.system.atomic import read_jsonl
from tests.run.test_run import tiny_recipe

pytest.importorskip("trl.rewards")
from trl.rewards import accuracy_reward, get_soft_overlong_punishment, think_format_reward  # noqa: E402

ROWS = [  # conversational prompts, TRL's `solution` column, and an extra column only some rows have
    {"prompt": [{"role": "user", "content": "Half of 1?"}], "solution": "\\frac{1}{2}", "bonus": 0.25},
    {"prompt": [{"role": "user", "content": "2+2?"}], "solution": "4"},
    {"prompt": [{"role": "user", "content": "3+3?"}], "solution": "6", "bonus": 1},
]


def write_rows(path, rows=ROWS):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def domain(tmp_path, **kw):
    cfg = DomainConfig(name="m", source=write_rows(tmp_path / "rows.jsonl"), **kw)
    d = load_domain(cfg, seed=0, num_eval=0)
    return d, sorted(d.train, key=lambda e: e.id)  # file order


def test_trl_rewards_weights_and_none_combine_as_trl(tmp_path):
    tiny_rewards.TRL_CALLS.clear()
    funcs = ["accuracy_reward", "trl.rewards.think_format_reward", "tiny_rewards:recorded"]
    d, examples = domain(tmp_path, reward_funcs=funcs, reward_weights=[1.0, 0.5, 2.0])
    texts = ["<think>a</think> \\boxed{0.5}", "\\boxed{5}", "<think>b</think> The answer is \\boxed{6}"]
    results = d.score(texts, [[1, 2], [3], [4, 5, 6]], examples)
    # by hand: accuracy (math-verify: 0.5 = 1/2) x 1 + think format x 0.5 + bonus column x 2, None left out
    assert [r.score for r in results] == [1.0 + 0.5 + 0.5, 0.0, 1.0 + 0.5 + 2.0]
    assert [r.correct for r in results] == [True, False, True]  # weighted reward >= correct_threshold 1.0
    assert all(r.feedback is None for r in results)
    # TRL's own functions, called as its trainer calls them, give the same columns
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    assert accuracy_reward(completions, [r["solution"] for r in ROWS]) == [1.0, 0.0, 1.0]
    assert think_format_reward(completions) == [1.0, 0.0, 1.0]


def test_per_function_reward_log_is_trls_nanmean_and_nanstd(tmp_path):
    """`rewards/<name>/mean|std` as TRL's GRPOTrainer logs them (torch.nanmean, trl's nanstd), a None left out,
    over the samples of each name only (a replayed native-reward sample has none); names as TRL's
    get_callable_name, a partial unwrapped and a repeated name numbered."""
    from trl.trainer.utils import get_callable_name, nanstd

    d, examples = domain(tmp_path, reward_funcs=["accuracy_reward", "tiny_rewards:recorded"])
    results = d.score(["\\boxed{0.5}", "\\boxed{4}", "\\boxed{7}"], [[1], [2], [3]], examples)
    assert [name for name, _ in results[0].components] == ["accuracy_reward", "recorded"]
    columns = torch.tensor(
        [[v for _, v in r.components] for r in results]
    )  # [N, F]: accuracy 1, 1, 0; recorded 0.25, None, 1
    stats = reward_component_stats([r.components for r in results] + [()])  # + a native-reward sample
    for f, name in enumerate(["accuracy_reward", "recorded"]):
        assert stats[f"rewards/{name}/mean"] == pytest.approx(torch.nanmean(columns[:, f]).item())
        assert stats[f"rewards/{name}/std"] == pytest.approx(nanstd(columns[:, f]).item())
    assert stats["rewards/recorded/mean"] == pytest.approx(0.625)  # (0.25 + 1) / 2: the None is left out
    # a function with no value in the step (None for every sample) is absent, one with a single value has no std:
    # TRL logs NaN for them, which metrics.jsonl (strict JSON) and the charts cannot hold
    few = reward_component_stats(
        [(("none", float("nan")), ("one", 0.5)), (("none", float("nan")), ("one", float("nan")))]
    )
    assert few == {"rewards/one/mean": 0.5}
    funcs = [functools.partial(accuracy_reward), accuracy_reward, tiny_rewards.text_length]
    named = TrlRewards("m", ["a", "b", "c"], funcs, ["trl"] * 3, [1.0] * 3, 1.0, "auto").metric_names()
    assert [get_callable_name(f) for f in funcs] == ["accuracy_reward", "accuracy_reward", "text_length"]
    assert named == ["accuracy_reward_0", "accuracy_reward_1", "text_length"]


def test_weighted_reward_is_a_nansum_and_all_none_is_unscorable():
    nan = math.nan
    per_func = torch.tensor([[1.0, nan], [nan, nan], [0.0, -1.0]])  # [N=3, F=2]
    rewards, unscorable = weighted_reward(per_func, torch.tensor([2.0, 0.5]))
    assert rewards.tolist() == [2.0, 0.0, -0.5] and unscorable.tolist() == [False, True, False]


def test_every_extra_column_arrives_aligned_in_the_dataset_format(tmp_path):
    tiny_rewards.TRL_CALLS.clear()
    d, examples = domain(tmp_path, reward_funcs=["tiny_rewards:recorded"])
    d.score(["x", "y", "z"], [[7], [8, 9], []], examples)
    (call,) = tiny_rewards.TRL_CALLS
    assert call["solution"] == ["\\frac{1}{2}", "4", "6"] and call["bonus"] == [0.25, None, 1]
    assert "prompt" not in call  # as TRL: the prompt is `prompts`
    assert call["prompts"] == [r["prompt"] for r in ROWS]  # conversational rows: message lists
    assert call["completions"] == [[{"role": "assistant", "content": t}] for t in "xyz"]
    assert call["completion_ids"] == [[7], [8, 9], []]
    tiny_rewards.TRL_CALLS.clear()
    d, examples = domain(tmp_path, reward_funcs=["tiny_rewards:recorded"], reward_format="standard")
    d.score(["x", "y", "z"], [[7], [8, 9], []], examples)
    assert tiny_rewards.TRL_CALLS[0]["completions"] == ["x", "y", "z"]
    assert tiny_rewards.TRL_CALLS[0]["prompts"] == ["Half of 1?", "2+2?", "3+3?"]


def test_string_prompts_are_standard_format_and_a_factory_gets_its_args(tmp_path):
    rows = [{"question": "q1", "solution": "1"}, {"question": "q2", "solution": "2"}]
    path = write_rows(tmp_path / "std.jsonl", rows)
    overlong = {
        "func": "trl.rewards:get_soft_overlong_punishment",
        "args": {"max_completion_len": 4, "soft_punish_cache": 2},
    }
    cfg = DomainConfig(
        name="s", source=path, fields={"prompt": "question"}, reward_funcs=["tiny_rewards:text_length", overlong]
    )
    d = load_domain(cfg, seed=0, num_eval=0)
    examples = sorted(d.train, key=lambda e: e.id)
    results = d.score(["abc", "abcdefg"], [[1, 2, 3], [1, 2, 3, 4, 5]], examples)
    expected = get_soft_overlong_punishment(4, 2)([[1, 2, 3], [1, 2, 3, 4, 5]])  # [-0.5, -1.0]
    assert [r.score for r in results] == [3.0 + expected[0], 7.0 + expected[1]]


def test_a_reward_with_trls_signature_in_reward_is_detected(tmp_path):
    d, examples = domain(tmp_path, reward="tiny_rewards:recorded")
    assert isinstance(d.batch_reward, TrlRewards)
    assert [r.score for r in d.score(["a", "b", "c"], [[], [], []], examples)] == [0.25, 0.0, 1.0]
    native = load_domain(
        DomainConfig(name="a", source="builtin:arithmetic", reward="tiny_rewards:digit_fraction"), 0, 2
    )
    assert native.batch_reward is None


def test_a_native_reward_may_sit_among_reward_funcs(tmp_path):
    d, examples = domain(tmp_path, reward_funcs=["boxed_math", "think_format_reward"], fields={"answer": "solution"})
    results = d.score(["<think>.</think>\\boxed{4}", "\\boxed{4}", "\\boxed{7}"], [[], [], []], examples)
    assert [r.score for r in results] == [boxed_math("\\boxed{4}", examples[0]).score + 1.0, 1.0, 0.0]


def test_reward_style_by_signature():
    assert reward_style(accuracy_reward) == reward_style(think_format_reward) == "trl"
    assert reward_style(get_soft_overlong_punishment(10, 2)) == "trl"  # a callable object: its __call__
    assert reward_style(tiny_rewards.recorded) == reward_style(lambda **kw: []) == "trl"
    assert reward_style(boxed_math) == reward_style(tiny_rewards.digit_fraction) == "native"
    assert reward_style(tiny_rewards.three_args) is None and reward_style(lambda x: x) is None


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (
            {"reward_funcs": ["accuracy_reward", "no_such_module_adaptercl:f"]},
            "domains.m.reward_funcs[1] 'no_such_module_adaptercl:f': cannot import module",
        ),
        (
            {"reward_funcs": ["trl.rewards.nope"]},
            "domains.m.reward_funcs[0] 'trl.rewards:nope': module 'trl.rewards' has no",
        ),
        (
            {"reward_funcs": ["tiny_rewards:three_args"]},
            "domains.m.reward_funcs[0] 'tiny_rewards:three_args': three_args(",
        ),
        (
            {"reward": "tiny_rewards:three_args"},
            "domains.m.reward 'tiny_rewards:three_args': three_args(a, b, c) is neither",
        ),
        (
            {"reward_funcs": [{"func": "trl.rewards:get_soft_overlong_punishment", "args": {"max_len": 3}}]},
            "domains.m.reward_funcs[0] 'trl.rewards:get_soft_overlong_punishment': calling it with args",
        ),
    ],
)
def test_a_bad_reward_is_one_line_naming_the_field(tmp_path, kw, message):
    cfg = DomainConfig(name="m", source=write_rows(tmp_path / "rows.jsonl"), **kw)
    with pytest.raises(RecipeError) as err:
        check_domain(cfg)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_reward_returning_the_wrong_count_is_one_line(tmp_path):
    d, examples = domain(tmp_path, reward_funcs=["tiny_rewards:two_values"])
    with pytest.raises(
        RecipeError, match=r"^domains.m.reward_funcs\[0\] 'tiny_rewards:two_values' returned 2 values, "
    ):
        d.score(["a", "b", "c"], [[], [], []], examples)


def test_a_conversational_reward_on_standard_completions_names_the_fix(tmp_path):
    d, examples = domain(tmp_path, reward_funcs=["think_format_reward"], reward_format="standard")
    with pytest.raises(RecipeError, match="set reward_format: conversational"):
        d.score(["a", "b", "c"], [[], [], []], examples)


@pytest.mark.parametrize(
    ("domain_kw", "message"),
    [
        ({"reward_funcs": ["accuracy_reward"], "reward_weights": [1.0, 2.0]}, "reward_weights has 2 weights for 1"),
        ({"reward_funcs": ["accuracy_reward"], "reward": "boxed_math"}, "either reward"),
    ],
)
def test_recipe_checks_reward_weights(tmp_path, domain_kw, message):
    raw = tiny_recipe(tmp_path / "run")
    raw["domains"][0] = {"name": "arith", "source": "builtin:arithmetic", **domain_kw}
    with pytest.raises(RecipeError, match=message) as err:
        resolve_recipe(raw)
    assert "domains.arith" in str(err.value) and "\n" not in str(err.value)


def test_a_run_scored_by_trl_rewards(tmp_path):
    """A real run (tiny model, 2 steps): the domain's rewards are TRL's accuracy_reward and think_format_reward,
    weighted, plus a recorder, reading a local file with a `solution` column."""
    tiny_rewards.TRL_CALLS.clear()
    rows = [{"prompt": [{"role": "user", "content": f"What is {i}+{i}?"}], "solution": str(2 * i)} for i in range(8)]
    raw = tiny_recipe(tmp_path / "run")
    raw["domains"] = [
        {
            "name": "math",
            "source": write_rows(tmp_path / "math.jsonl", rows),
            "reward_funcs": [
                "trl.rewards:accuracy_reward",
                "trl.rewards:think_format_reward",
                "tiny_rewards:recorded",
            ],
            "reward_weights": [1.0, 0.5, 1.0],
        }
    ]
    raw["stages"] = [{"name": "one", "domain": "math"}]
    raw["eval"] = {"examples_per_domain": 2}
    run_recipe(resolve_recipe(raw))
    steps = [r for r in read_jsonl(tmp_path / "run" / "stage-01-one" / "metrics.jsonl") if "event" not in r]
    assert [r["step"] for r in steps] == [1, 2] and all(math.isfinite(r["reward_mean"]) for r in steps)
    for r in steps:  # TRL's per-function log; `recorded` returned None for every row (no bonus column): absent
        acc, think = r["rewards/accuracy_reward/mean"], r["rewards/think_format_reward/mean"]
        assert 0.0 <= acc <= 1.0 and 0.0 <= think <= 1.0
        assert "rewards/recorded/mean" not in r and "rewards/recorded/std" not in r  # TRL logs NaN: no NaN here
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float))
        assert r["reward_mean"] == pytest.approx(1.0 * acc + 0.5 * think, abs=1e-6)  # no None: mean is linear
    assert "NaN" not in (tmp_path / "run" / "stage-01-one" / "metrics.jsonl").read_text()  # strict JSON lines
    train_calls = [c for c in tiny_rewards.TRL_CALLS if len(c["completions"]) == 2 * 4]  # prompts_per_step x G
    assert len(train_calls) == 2  # one batch call per step
    for call in train_calls:
        assert call["solution"] == [s for s in call["solution"][::4] for _ in range(4)]  # whole groups, aligned
        assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in call["completions"])
        assert all(len(ids) <= 8 for ids in call["completion_ids"])  # rollout.max_new_tokens


def test_fields_rename_no_column_for_trl_functions_and_a_reader_of_the_role_is_warned_once(tmp_path, caplog):
    rows = [{"prompt": "Which planet is red? A. Venus B. Mars", "answer": "Mars", "answer_idx": "B"}]
    source = write_rows(tmp_path / "planets.jsonl", rows)

    def load(**kw):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="adaptercl"):
            d = load_domain(DomainConfig(name="q", source=source, **kw), seed=0, num_eval=0)
        return d, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    d, warnings = load(fields={"answer": "answer_idx"}, reward_funcs=["tiny_rewards:letter_accuracy"])
    assert warnings == [
        "domains.q: reward function letter_accuracy reads answer=, which is the row's own 'answer' column (TRL passes "
        "columns as they are), not 'answer_idx' that fields.answer names; to score against 'answer_idx', name the "
        "parameter answer_idx"
    ]
    results = d.score(["Mars", "B"], [[], []], d.train * 2)  # as TRL: answer= is the row's `answer` column
    assert [r.score for r in results] == [1.0, 0.0]
    assert load(reward_funcs=["tiny_rewards:letter_accuracy"])[1] == []  # no mapping: nothing to say
    assert load(fields={"answer": "answer_idx"}, reward_funcs=["tiny_rewards:recorded"])[1] == []  # reads no answer=
