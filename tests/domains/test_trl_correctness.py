"""What is correct and what is a success with TRL-style rewards (issue 28): the domain's `correct_from` functions
decide it, once, for the accuracy matrix (`measure.evaluate.evaluate_domain`), the SDPO teacher's "Correct solution"
and the hybrid's failed groups (`distill_targets`); a sample every function returned None for is neither, and a stage
gives it TRL 1.16's advantage 0; `recipe validate` prints the rule and refuses a bad name in one line."""

from __future__ import annotations

import json

import pytest
import tiny_rewards
import torch

from adaptercl.cli import main
from adaptercl.domains import Domain, is_success, load_domain
from adaptercl.domains.domain import RewardResult
from adaptercl.domains.loading import check_domain
from adaptercl.measure.evaluate import evaluate_domain
from adaptercl.model.batching import build_batch, encode_chat
from adaptercl.recipe.grammar import DomainConfig, RecipeError
from adaptercl.rollout import Completion
from adaptercl.train import losses
from adaptercl.train.distill_targets import distill_targets
from adaptercl.train.stage import run_stage
from tests.train.test_distill_stage import stage_context
from tests.train.test_losses import trl_advantages

pytest.importorskip("trl.rewards")
from trl.rewards import accuracy_reward, get_soft_overlong_punishment, think_format_reward  # noqa: E402

ROWS = [
    {"prompt": [{"role": "user", "content": f"What is {i}+{i}?"}], "solution": str(2 * i), "demonstration": f"{2 * i}"}
    for i in range(1, 5)
]
# Replies to "What is 2+2?" (gold 4), scored by TRL's own accuracy_reward and think_format_reward below.
RIGHT = "<think>two and two</think> \\boxed{4}"
RIGHT_UNFORMATTED = "\\boxed{4}"
WRONG_FORMATTED = "<think>a guess</think> \\boxed{5}"  # the case: right format, wrong answer
WRONG = "\\boxed{5}"
TRL_PAIR = ["accuracy_reward", "think_format_reward"]  # TRL's usual pair, accuracy first
OVERLONG = "trl.rewards:get_soft_overlong_punishment"


def trl_domain(tmp_path, **kw) -> Domain:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return load_domain(DomainConfig(name="m", source=str(path), **kw), seed=0, num_eval=0)


def two_plus_two(domain: Domain):
    return next(e for e in domain.train if e.columns["solution"] == "4")


def completion(tok, example, text: str) -> Completion:
    return Completion(encode_chat(tok, example.messages), tok.encode(text, add_special_tokens=False), text, "stop")


class ScriptedEngine:
    """Greedy 'generation' that answers the i-th prompt with texts[i]: the scoring and counting of evaluate_domain
    run for real on replies we choose."""

    def __init__(self, tokenizer, texts: list[str]):
        self.tokenizer, self.texts = tokenizer, texts

    def generate(self, prompts, adapters, params):
        assert len(prompts) == len(self.texts)
        return [[Completion(p, self.tokenizer.encode(t, add_special_tokens=False), t, "stop")] for p, t in
                zip(prompts, self.texts)]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    from adaptercl.model.base import load_base
    from adaptercl.recipe.grammar import ModelConfig

    return load_base(ModelConfig(name="tiny-random"), "none").tokenizer


def accuracy(tokenizer, domain: Domain, texts: list[str]) -> dict:
    domain.eval = [two_plus_two(domain)] * len(texts)
    return evaluate_domain(ScriptedEngine(tokenizer, texts), tokenizer, domain, None, 8, len(texts))


# ------------------------------------------------------------------------------------------ the accuracy matrix


def test_a_wrong_answer_in_the_right_format_is_not_correct(tmp_path, tokenizer):
    """[accuracy_reward, think_format_reward] at weights [1, 1]: the weighted sum of a wrong, well-formatted answer
    is 1.0, which the old rule (weighted sum >= correct_threshold 1.0) counted as correct."""
    domain = trl_domain(tmp_path, reward_funcs=TRL_PAIR)
    row = accuracy(tokenizer, domain, [WRONG_FORMATTED, RIGHT, WRONG, RIGHT_UNFORMATTED])
    completions = [[{"role": "assistant", "content": t}] for t in (WRONG_FORMATTED, RIGHT, WRONG, RIGHT_UNFORMATTED)]
    assert accuracy_reward(completions, ["4"] * 4) == [0.0, 1.0, 0.0, 1.0]  # TRL's own verdicts
    assert row["correct"] == [False, True, False, True] and row["accuracy"] == 0.5
    assert row["reward_mean"] == (1.0 + 2.0 + 0.0 + 1.0) / 4  # the training reward is still the weighted sum


def test_a_small_length_penalty_leaves_right_answers_correct(tmp_path, tokenizer):
    """An accuracy reward plus TRL's soft overlong punishment: a right answer's weighted reward is below 1.0, which
    the old rule counted as incorrect (accuracy 0.000 on every stage while the training reward was positive)."""
    punish = {"max_completion_len": 12, "soft_punish_cache": 10}
    domain = trl_domain(tmp_path, reward_funcs=["accuracy_reward", {"func": OVERLONG, "args": punish}])
    texts = [RIGHT_UNFORMATTED, WRONG]
    row = accuracy(tokenizer, domain, texts)
    penalty = get_soft_overlong_punishment(**punish)([tokenizer.encode(t, add_special_tokens=False) for t in texts])
    assert all(-1.0 < p < 0.0 for p in penalty)  # small, and it does push the right answer's reward below 1.0
    assert row["correct"] == [True, False] and row["accuracy"] == 0.5
    assert row["reward_mean"] == pytest.approx((1.0 + penalty[0] + 0.0 + penalty[1]) / 2)


def test_correct_from_names_the_deciding_functions_unweighted(tmp_path):
    texts = [RIGHT, RIGHT_UNFORMATTED, WRONG_FORMATTED, WRONG]
    funcs = ["think_format_reward", "accuracy_reward"]  # format first: then correct_from must name accuracy

    def correct(**kw) -> list[bool]:
        domain = trl_domain(tmp_path, reward_funcs=funcs, **kw)
        example = two_plus_two(domain)
        return [r.correct for r in domain.score(texts, [[1]] * 4, [example] * 4)]

    assert correct() == [True, False, True, False]  # default: the first function, here the format reward
    assert correct(correct_from="accuracy_reward") == [True, True, False, False]
    # the weights shape the training reward, not what counts as right: accuracy at weight 0.5 still decides
    assert correct(correct_from=["accuracy_reward"], reward_weights=[1.0, 0.5]) == [True, True, False, False]
    both = correct(correct_from=["accuracy_reward", "think_format_reward"], correct_threshold=2.0)
    assert both == [True, False, False, False]  # right answer and right format
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    assert think_format_reward(completions) == [1.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (
            {"reward_funcs": TRL_PAIR, "correct_from": ["accuracy"]},
            "domains.m.correct_from: no reward function named 'accuracy'; the domain's functions are "
            "accuracy_reward, think_format_reward",
        ),
        (
            {"reward": "boxed_math", "correct_from": ["boxed_math"]},
            "domains.m.correct_from: only TRL-style rewards (reward_funcs) take it; a native reward sets `correct` "
            "itself",
        ),
    ],
)
def test_a_bad_correct_from_is_one_line_at_validate(tmp_path, capsys, kw, message):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        json.dumps(
            {
                "model": {"name": "tiny-random"},
                "output_dir": str(tmp_path / "run"),
                "domains": [{"name": "m", "source": str(data), "fields": {"answer": "solution"}, **kw}],
                "stages": [{"name": "one", "domain": "m"}],
            }
        )
    )
    assert main(["recipe", "validate", str(recipe)]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    with pytest.raises(RecipeError):
        check_domain(DomainConfig(name="m", source=str(data), fields={"answer": "solution"}, **kw))


def test_validate_prints_how_each_domain_decides_correct_and_success(tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    recipe = tmp_path / "recipe.yaml"
    domains = [
        {"name": "gsm8k", "source": str(data), "reward_funcs": TRL_PAIR},
        {"name": "arith", "source": "builtin:arithmetic"},
    ]
    stages = [{"name": "one", "domain": "gsm8k", "method": "hybrid"}, {"name": "two", "domain": "arith"}]
    raw = {"model": {"name": "tiny-random"}, "output_dir": str(tmp_path / "run"), "domains": domains, "stages": stages}
    recipe.write_text(json.dumps(raw))
    assert main(["recipe", "validate", str(recipe)]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [
        "  gsm8k: correct = accuracy_reward >= 1.0 (of accuracy_reward, think_format_reward); SDPO/hybrid success "
        "= correct",
        "  arith: correct = the arithmetic reward's own verdict; SDPO/hybrid success = reward >= 0.5 "
        "(distill.success_threshold)",
        f"  gsm8k: the first 4 rows of {data} read and rendered as the run reads them",  # what it read (issue 47)
    ]
    raw["stages"] = [{"name": "one", "domain": "gsm8k"}]  # no stage distils: success is not printed
    recipe.write_text(json.dumps(raw))
    assert main(["recipe", "validate", str(recipe)]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        "  gsm8k: correct = accuracy_reward >= 1.0 (of accuracy_reward, think_format_reward)"
    )


# ------------------------------------------------------------------------------------------ SDPO and hybrid success


def targets(tmp_path, method: str, texts: list[str], **blocks):
    """distill_targets of one step whose group of len(texts) samples answers "What is 2+2?" with `texts`, scored by
    TRL's [accuracy_reward, think_format_reward] at weights [1, 1]; and the decoded teacher prompts."""
    domain = trl_domain(tmp_path / "data", reward_funcs=TRL_PAIR)
    blocks = {"rollout": {"group_size": len(texts)}, **blocks}
    ctx = stage_context(tmp_path / "ctx", method, domain, **blocks)
    tok, example = ctx.tokenizer, two_plus_two(domain)
    samples = [example] * len(texts)
    completions = [completion(tok, example, t) for t in texts]
    results = domain.score(texts, [c.token_ids for c in completions], samples)
    batch = build_batch([c.prompt_ids for c in completions], [c.token_ids for c in completions], tok.pad_token_id)
    out = distill_targets(ctx, 0, samples, completions, results, batch)
    teacher, width = out.teacher_batch, out.teacher_batch.input_ids.shape[1] - out.teacher_batch.response_ids.shape[1]
    prompts = [tok.decode(ids[:width][m[:width].bool()]) for ids, m in zip(teacher.input_ids, teacher.attention_mask)]
    return out, prompts, results


def test_sdpo_never_shows_a_wrong_well_formatted_sibling_as_the_correct_solution(tmp_path):
    out, prompts, results = targets(tmp_path, "sdpo", [WRONG_FORMATTED, WRONG, WRONG_FORMATTED, RIGHT])
    assert [r.score for r in results] == [1.0, 0.0, 1.0, 2.0]  # >= success_threshold 0.5 for all but one
    assert out.stats["success_frac"] == 0.25  # only the right answer
    for i in range(3):  # every other sample is shown the right answer, think stripped
        assert "Correct solution:\n\n\\boxed{4}\n\nCorrectly solve" in prompts[i], prompts[i]
        assert "boxed{5}" not in prompts[i]
    assert out.has_target == [True, True, True, False]  # the right answer has no other success to be shown
    wrong_only, _, _ = targets(tmp_path / "b", "sdpo", [WRONG_FORMATTED, WRONG, WRONG_FORMATTED, WRONG])
    assert wrong_only.stats["success_frac"] == 0.0 and wrong_only.has_target == [False] * 4  # no feedback either


def test_hybrid_counts_a_group_of_wrong_well_formatted_answers_as_failed(tmp_path):
    failed, prompts, _ = targets(tmp_path, "hybrid", [WRONG_FORMATTED, WRONG, WRONG_FORMATTED, WRONG])
    assert failed.has_target == [True] * 4  # a failed group: the example's demonstration is the teacher's context
    assert all("Correct solution:\n\n4\n\nCorrectly solve" in p for p in prompts)
    solved, _, _ = targets(tmp_path / "b", "hybrid", [WRONG_FORMATTED, WRONG, RIGHT, WRONG])
    assert solved.has_target == [False] * 4  # a group with a real success is GRPO's


# ------------------------------------------------------------------------------------------ all functions None


def test_a_sample_no_function_scored_is_neither_correct_nor_a_success(tmp_path, tokenizer):
    domain = trl_domain(tmp_path, reward_funcs=["tiny_rewards:even_length_or_none"], correct_threshold=1.0)
    example = two_plus_two(domain)
    texts = ["abcd", "wxyz", "abcde", "abcdef"]  # even_length_or_none: 1, 1, None, 0
    results = domain.score(texts, [[1]] * 4, [example] * 4)
    assert [r.scored for r in results] == [True, True, False, True]
    assert [r.score for r in results] == [1.0, 1.0, 0.0, 0.0]
    assert [r.correct for r in results] == [True, True, False, False]
    assert [is_success(r, 0.0) for r in results] == [True, True, False, False]  # threshold 0 cannot rescue it
    row = accuracy(tokenizer, domain, texts)
    assert row["correct"] == [True, True, False, False]
    # a native result keeps its own rule: score >= distill.success_threshold, whatever `correct` says
    native = RewardResult(0.5, False)
    assert native.scored and is_success(native, 0.5) and not is_success(native, 0.6)


def test_a_stage_gives_unscored_samples_trls_advantage(tmp_path, monkeypatch):
    """A GRPO step on tiny-random scored by a reward that returns None for odd-length replies: the advantages the
    stage trains on are TRL 1.16's for the step's rewards (None -> left out of the baseline, advantage 0)."""
    advantages_seen, values_seen = [], []
    real = losses.group_advantages
    monkeypatch.setattr(
        losses, "group_advantages", lambda *a, **kw: advantages_seen.append(out := real(*a, **kw)) or out
    )
    domain = trl_domain(tmp_path / "data", reward_funcs=["tiny_rewards:even_length_or_none"])
    domain.batch_reward.funcs[0] = lambda completions, **kw: (
        values_seen.append(v := tiny_rewards.even_length_or_none(completions)) or v
    )  # the reward as it is, its values recorded
    ctx = stage_context(tmp_path / "ctx", "grpo", domain, optim={"steps": 1, "prompts_per_step": 4})
    ctx.teacher = None  # a GRPO stage has none
    run_stage(ctx)
    (advantages,), (values,) = advantages_seen, values_seen
    per_func = torch.tensor([[float("nan") if v is None else v] for v in values], dtype=torch.float64)
    assert 0 < sum(v is None for v in values) < len(values), values  # the seed gives a mix (else: pick another)
    expected = trl_advantages(per_func, torch.ones(1, dtype=torch.float64), 4, scale_rewards="none")
    # float32 in the stage (rewards 0/1/2, means of 4 values): |error| <= a few float32 ulps of 2
    torch.testing.assert_close(advantages.double(), expected, rtol=0, atol=1e-6)
    assert all(a == 0 for a, v in zip(advantages.tolist(), values) if v is None)
