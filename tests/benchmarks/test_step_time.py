"""benchmarks/perf/step_time.py: a fixed-length workload whose lengths differ is refused (no ratio), the rollout's
time per generated token is each step's rollout time over its tokens, a real run of the short workload on the tiny
model has every completion at the cap on both sides (the decode loop honours min_new_tokens), and the SDPO comparison
gives TRL's SDPOTrainer the teacher prompts adaptercl's sdpo stage builds, distils every row on both sides and lists
what it could not make equal in its docstring and its result alike; the two sides alternate in one OS thread, each
keeping its own grad mode, and a stage's error surfaces on the trainer's side."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "perf"))
import step_time as st  # noqa: E402
import step_time_trl as st_trl  # noqa: E402
import step_time_workload as st_workload  # noqa: E402


@pytest.fixture
def trl_environ_restored():
    """TRL's trainers import vLLM where it is installed, and vLLM writes os.environ when imported (LD_LIBRARY_PATH,
    TORCHINDUCTOR_*, ...): the environment as it was, afterwards."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_the_alternation_runs_both_sides_in_one_thread_with_their_own_grad_mode():
    """The stage runs in this OS thread (not a worker: OpenMP regions run slower there), a switch hands back after
    each of its steps, each side finds its grad mode as it left it, and after its last step the stage is done."""
    seen = []

    def stage():
        for step in range(2):
            seen.append(("stage", step, threading.get_ident(), torch.is_grad_enabled()))
            torch.set_grad_enabled(False)  # the stage's own mode, which the trainer must not see
            turns.to_trainer()
            assert not torch.is_grad_enabled()  # its own again after the trainer ran with grad on
            torch.set_grad_enabled(True)

    turns = st.Alternation(stage)
    for _ in range(3):
        assert torch.is_grad_enabled()
        turns.to_stage()
        seen.append(("trainer", threading.get_ident(), torch.is_grad_enabled()))
    me = threading.get_ident()
    assert seen == [
        ("stage", 0, me, True), ("trainer", me, True), ("stage", 1, me, True), ("trainer", me, True),
        ("trainer", me, True),
    ]  # fmt: skip
    assert turns.stage.dead


def test_an_error_in_the_stage_surfaces_where_the_trainer_handed_over():
    def stage():
        raise ValueError("the stage failed")

    turns = st.Alternation(stage)
    with pytest.raises(ValueError, match="the stage failed"):
        turns.to_stage()


def test_equal_lengths_pass_and_any_other_length_is_refused_naming_both_sides():
    st.check_fixed_lengths(48, [48.0, 48.0], [[48] * 8, [48] * 8])
    with pytest.raises(st.LengthMismatch, match=r"adaptercl's mean per step \[48.0, 24.9\]"):
        st.check_fixed_lengths(48, [48.0, 24.9], [[48] * 8, [48] * 8])
    with pytest.raises(st.LengthMismatch, match=r"TRL's 17-48 \(1 of 16 not 48\)"):
        st.check_fixed_lengths(48, [48.0, 48.0], [[48] * 8, [48] * 7 + [17]])
    with pytest.raises(st.LengthMismatch, match="0 of 0"):  # TRL recorded nothing: nothing shows equal work
        st.check_fixed_lengths(48, [48.0], [])


def test_rollout_time_per_token_by_hand():
    """2.4 s for 8 x 48 = 384 tokens is 6.25 ms a token; 1 s for 200 tokens, 5 ms."""
    assert st.ms_per_token([2.4, 1.0], [384, 200]) == pytest.approx([6.25, 5.0], rel=1e-12)


def test_the_workloads():
    assert st.WORKLOADS["long-fixed"] == ("domain", 256, True)  # the long prompts, exactly 256 tokens
    assert st.WORKLOADS["long"][2] is False and st.WORKLOADS["short"] == ("arithmetic", 48, True)


def test_result_names_keep_grpo_files_and_mark_sdpo_ones():
    def name(**kw):
        base = {"method": "grpo", "model": "smollm2-135m-instruct", "workload": "short", "rollout_dtype": "float32"}
        return st.result_name(argparse.Namespace(**(base | kw)))

    assert name() == "step_time-smollm2-135m-instruct"  # the committed GRPO results keep their names
    assert name(workload="long-fixed", rollout_dtype="bfloat16") == (
        "step_time-smollm2-135m-instruct-long-fixed-rollout-bfloat16"
    )
    assert name(method="sdpo", workload="long") == "step_time-sdpo-smollm2-135m-instruct-long"


def test_every_sdpo_difference_is_in_the_scripts_docstring_word_for_word():
    words = " ".join(st.__doc__.split())
    for difference in st_trl.SDPO_DIFFERENCES:
        assert " ".join(difference.split()) in words, difference[:40]


def tiny_args(tmp_path: Path, method: str, *extra: str) -> list[str]:
    """step_time.py's arguments for 2 prompts x 2 samples x 8 tokens on the tiny model, results in tmp_path."""
    argv = ["--method", method, "--model", "tiny-random", "--steps", "1", "--warmup", "0", "--max-new-tokens", "8"]
    return [*argv, "--group-size", "2", "--out", str(tmp_path), *extra]


def test_trl_sdpo_teacher_prompts_are_adaptercls(tmp_path, trl_environ_restored):
    """The SDPOTrainer the script builds, given 2 groups of 2 completions with rewards [0.4, 0.6] and [1.0, 1.0],
    shows each sample the same teacher prompt token for token as adaptercl's sdpo stage (`sdpo_teacher_prompts` with
    the stage's distill block, `encode_chat`): sample 0 its successful sibling 1, sample 1 nothing (its only sibling
    scored 0.4, under the 0.5 threshold; itself excluded), samples 2 and 3 each other."""
    import torch

    from adaptercl.model.batching import encode_chat
    from adaptercl.teacher.prompts import sdpo_teacher_prompts

    args = argparse.Namespace(
        method="sdpo", workload="short", domain=None, prompts_per_step=2, group_size=2, max_new_tokens=8, rank=4,
        lr=1e-5, rollout_dtype="float32", warmup=0, steps=1, seed=0,
    )  # fmt: skip
    model_path, _ = st_workload.plain_model_folder("tiny-random", tmp_path)
    ctx = st_workload.adaptercl_context(args, tmp_path, model_path)
    trainer = st_trl.sdpo_trainer(args, tmp_path, model_path, ctx)
    tok = ctx.tokenizer
    prompts = [ex.messages for ex in ctx.domain.train[:2] for _ in range(2)]
    answers = ["12 + 5 = 17", "<think>hm</think> 17", "The answer is 9.", "9"]
    ids = [tok(a, add_special_tokens=False)["input_ids"] for a in answers]
    width = max(map(len, ids))
    completion_ids = torch.tensor([i + [tok.pad_token_id] * (width - len(i)) for i in ids])  # [4, R] right-padded
    completion_mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])
    rewards = torch.tensor([0.4, 0.6, 1.0, 1.0])
    out = trainer.teacher_context_builder.build(
        {"completion_ids": completion_ids, "completion_mask": completion_mask}, prompts, rewards
    )
    texts = [tok.decode(i, skip_special_tokens=True) for i in ids]
    succeeded = [r >= ctx.stage.distill.success_threshold for r in rewards.tolist()]
    ours = sdpo_teacher_prompts(prompts, texts, succeeded, [None] * 4, 2, ctx.stage.distill)
    assert ours.has_target == [True, False, True, True]
    assert out["self_distillation_mask"].tolist() == [1.0, 0.0, 1.0, 1.0]
    for row in range(4):
        prompt_part = out["teacher_input_ids"][row, :-width][out["teacher_attention_mask"][row, :-width].bool()]
        assert prompt_part.tolist() == encode_chat(tok, ours.messages[row]), row
    assert "<think>" not in tok.decode(out["teacher_input_ids"][0])  # the shown sibling's think block is stripped


@pytest.mark.slow
def test_the_short_workload_is_fixed_length_on_both_sides(tmp_path, monkeypatch, trl_environ_restored):
    """The real script on the tiny model (1 timed step of 2 x 2 rows x 8 tokens): it writes a result, so neither
    side's lengths differed from the cap; the per-token figures are the rollout time over 4 x 8 tokens."""
    monkeypatch.setattr(sys, "argv", ["step_time.py", *tiny_args(tmp_path, "grpo")])
    monkeypatch.setattr(st, "provenance", lambda: {})  # the command, git and machine: not what is tested
    assert st.main() == 0
    result = json.loads((tmp_path / "step_time-tiny-random.json").read_text())
    assert result["fixed_length_ok"] is True
    assert result["completion_len"]["adaptercl_mean"] == 8 and result["completion_len"]["trl_min"] == 8
    assert result["raw"]["adaptercl_rollout_tokens"] == [32] and result["raw"]["trl_rollout_tokens"] == [32]
    expected = 1000 * result["raw"]["adaptercl_rollout_s"][0] / 32
    assert result["rollout_ms_per_token"]["adaptercl"]["median"] == pytest.approx(expected, rel=1e-12)


@pytest.mark.slow
def test_sdpo_distils_every_row_on_both_sides_at_fixed_length(tmp_path, monkeypatch, trl_environ_restored):
    """`--method sdpo` on the tiny model, 2 steps: both sides at the cap, every row of every step with a teacher
    target on both sides (the full-marks reward), teacher prompts longer than the students' (they hold a sibling),
    the same distillation settings, the training part = step - rollout, and the differences recorded."""
    monkeypatch.setattr(sys, "argv", ["step_time.py", *tiny_args(tmp_path, "sdpo", "--steps", "2")])
    monkeypatch.setattr(st, "provenance", lambda: {})
    assert st.main() == 0
    result = json.loads((tmp_path / "step_time-sdpo-tiny-random.json").read_text())
    assert result["method"] == "sdpo" and result["fixed_length_ok"] is True
    assert result["raw"]["adaptercl_rollout_tokens"] == [32, 32] and result["raw"]["trl_rollout_tokens"] == [32, 32]
    teacher = result["teacher"]
    assert teacher["adaptercl"]["rows_with_target"] == [1.0, 1.0] == teacher["trl"]["rows_with_target"]
    for side in ("adaptercl", "trl"):
        assert min(teacher[side]["prompt_tokens_mean"]) > result["workload"]["prompt_tokens"]["max"]
    ours, trl = result["settings"]["adaptercl"], result["settings"]["trl"]
    assert (ours["alpha"], ours["topk"], ours["tail"]) == (0.5, 100, True)
    assert (trl["distillation_alpha"], trl["distillation_topk"], trl["distillation_add_tail"]) == (0.5, 100, True)
    assert ours["teacher"]["tau"] == trl["teacher_update_rate"] == 0.05
    assert ours["success_threshold"] == trl["success_reward_threshold"]
    raw = result["raw"]
    training = [s - r for s, r in zip(raw["trl_step_s"], raw["trl_rollout_s"])]
    assert result["trl_training_s"]["median"] == pytest.approx(statistics.median(training), rel=1e-12)  # same sums
    assert result["differences"] == st_trl.SDPO_DIFFERENCES
