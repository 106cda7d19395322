"""Self-teachers: SDPO/SDFT teacher prompts (exact strings), the teacher kinds on one shared base, and the refresh
schedules of restart_freeze and gated (CGTR)."""

from __future__ import annotations

import json

import pytest
import torch
from peft.tuners.lora import LoraLayer

from adaptercl.adapters.live import active_adapters, adapter_names, attach_adapter, lora_parameters, use_adapters
from adaptercl.adapters.merge_math import lora_delta, refactorize
from adaptercl.model.base import load_base
from adaptercl.model.batching import build_batch, response_logits
from adaptercl.recipe.grammar import DistillConfig, LoraConfig, ModelConfig, StageConfig, TeacherConfig
from adaptercl.teacher import kinds as teacher_module
from adaptercl.teacher.kinds import Teacher, create_teacher, restore_teacher, teacher_autocast_dtype
from adaptercl.teacher.mixing import ema_lora_factors, trust_region_teacher_logits
from adaptercl.teacher.prompts import sdft_teacher_prompts, sdpo_teacher_prompts, strip_think
from adaptercl.teacher.schedule import GateState, gate_allows_refresh, gate_step, quantile
from adaptercl.train import losses

# ------------------------------------------------------------------------------------------ teacher prompts

SYSTEM = {"role": "system", "content": "You are terse."}


def user(text: str) -> list[dict[str, str]]:
    return [SYSTEM, {"role": "user", "content": text}]


def test_sdpo_first_successful_sibling_self_excluded_exact_strings():
    prompts = [user("What is 2+2?")] * 4 + [user("Capital of France?")] * 4
    responses = ["5", "<think>two and two\nmake four</think> 4", "3", "four", "Paris", "Lyon", "Nice", "Paris!"]
    succeeded = [False, True, False, True, True, False, False, False]
    feedback = ["wrong"] * 8
    out = sdpo_teacher_prompts(prompts, responses, succeeded, feedback, group_size=4, cfg=DistillConfig())
    # sample 0 -> first success of its group is 1 (think stripped); 1 excludes itself -> 3; 3 -> 1
    four = "What is 2+2?\nCorrect solution:\n\n4\n\nCorrectly solve the original question."
    four_self = "What is 2+2?\nCorrect solution:\n\nfour\n\nCorrectly solve the original question."
    paris = "Capital of France?\nCorrect solution:\n\nParis\n\nCorrectly solve the original question."
    # sample 4 is the only success of its group: no sibling, so (as lasgroup/SDPO and TRL) its feedback is used
    own_feedback = (
        "Capital of France?\nThe following is feedback from your unsuccessful earlier attempt:\n\nwrong\n\n"
        "Correctly solve the original question."
    )
    expected_user = [four, four_self, four, four, own_feedback, paris, paris, paris]
    for i, text in enumerate(expected_user):
        assert out.messages[i] == [SYSTEM, {"role": "user", "content": text}], i
        assert out.has_target[i] and out.used_solution[i] == (i != 4) and out.used_feedback[i] == (i == 4)
    stats = out.stats()
    assert stats["teacher_target_frac"] == 1.0 and stats["solution_used_frac"] == 7 / 8
    assert stats["success_frac"] == 3 / 8 and stats["feedback_used_frac"] == 1 / 8
    feedback[4] = None  # then it has no teacher context at all: mask 0
    out = sdpo_teacher_prompts(prompts, responses, succeeded, feedback, group_size=4, cfg=DistillConfig())
    assert out.messages[4] == prompts[4] and not out.has_target[4] and out.stats()["teacher_target_frac"] == 7 / 8


def test_sdpo_feedback_only_when_no_sibling_succeeded():
    prompts = [user("Q1")] * 3 + [user("Q2")] * 3
    responses = ["a", "b", "c", "d", "e", "f"]
    succeeded = [False, False, False, True, False, False]
    feedback = ["expected 7, got 3", None, "  ", None, "expected Paris", None]
    out = sdpo_teacher_prompts(prompts, responses, succeeded, feedback, group_size=3, cfg=DistillConfig())
    fb = "Q1\nThe following is feedback from your unsuccessful earlier attempt:\n\nexpected 7, got 3\n\n"
    assert out.messages[0][-1]["content"] == fb + "Correctly solve the original question."
    assert out.used_feedback[0] and not out.used_solution[0]
    assert not out.has_target[1] and not out.has_target[2]  # no feedback / blank feedback: no target, mask 0
    assert out.messages[1] == prompts[1]
    assert not out.has_target[3]  # the only success of its group, without feedback: nothing to show it
    # sibling succeeded: the solution is used and the feedback is not, even though there is some
    assert out.used_solution[4] and not out.used_feedback[4] and "expected Paris" not in out.messages[4][-1]["content"]
    assert out.stats()["feedback_used_frac"] == 1 / 6
    no_fb = sdpo_teacher_prompts(prompts, responses, succeeded, feedback, 3, DistillConfig(use_feedback=False))
    assert not no_fb.has_target[0]


def test_teacher_message_keeps_earlier_messages_and_replaces_last_user_turn():
    chat = [SYSTEM, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    chat = chat + [{"role": "user", "content": "Q"}]
    out = sdpo_teacher_prompts([chat, chat], ["x", "y"], [True, False], [None, None], 2, DistillConfig())
    assert out.messages[1][:3] == chat[:3] and out.messages[1][3]["role"] == "user"
    assert out.messages[1][3]["content"].startswith("Q\nCorrect solution:\n\nx")
    assert len(out.messages[1]) == 4


def test_strip_think():
    assert strip_think("<think>a\nb</think>\n  Answer: 4 ") == "Answer: 4"
    assert strip_think("x <think>1</think> y <think>2</think>z") == "x  y z"
    unstripped = sdpo_teacher_prompts(
        [user("Q")] * 2, ["<think>t</think>A", "B"], [True, False], [None, None], 2, DistillConfig(strip_think=False)
    )
    assert "<think>t</think>A" in unstripped.messages[1][-1]["content"]


def test_sdft_demonstration_prompt_exact():
    out = sdft_teacher_prompts(
        [user("What is 2+2?"), user("Q")], ["2+2=4, so 4.", None], [False, True], DistillConfig()
    )
    expected = (
        "\nWhat is 2+2?\n\nThis is an example for a response to the question:\n2+2=4, so 4.\n\n"
        "Now answer with a response of your own, including the thinking process.\n"
    )
    assert out.messages[0] == [SYSTEM, {"role": "user", "content": expected}]
    assert out.has_target == [True, False] and out.messages[1] == user("Q")
    assert out.stats()["teacher_target_frac"] == 0.5 and out.stats()["success_frac"] == 0.5


@pytest.mark.parametrize("group", [1, 2, 3])
def test_may_get_context_is_true_exactly_where_some_rollout_gives_a_context(group):
    """For every builder of TEACHER_PROMPTS and its settings (feedback used or not, the hybrid's distill_on, a
    demonstration or none): a prompt may get a context (`may_get_context`) exactly when some outcome of its group (each
    sample a success or not, with feedback or none) gives one of its samples a context."""
    import itertools

    from adaptercl.recipe.grammar import HybridConfig
    from adaptercl.teacher.prompts import TEACHER_PROMPTS, may_get_context

    outcomes = list(itertools.product([False, True], repeat=group))  # which samples succeeded
    feedbacks = list(itertools.product([None, "look again"], repeat=group))
    never = []
    for method, build in TEACHER_PROMPTS.items():
        for use_feedback, distill_on, demo in itertools.product(
            [False, True], ["failed_groups", "all"], [None, "2+2=4"]
        ):
            distill, hybrid = DistillConfig(use_feedback=use_feedback), HybridConfig(distill_on=distill_on)
            some = any(
                any(build([user("Q")] * group, ["4"] * group, list(ok), list(fb), [demo] * group, group, distill, hybrid)
                    .has_target)
                for ok in outcomes
                for fb in feedbacks
            )  # fmt: skip
            assert may_get_context(build, [user("Q")], [demo], group, distill, hybrid) == [some], (method, demo)
            never += [] if some else [(method, use_feedback, distill_on, demo)]
    # the cases no rollout can help, so the teacher lift passes their prompts over: SDFT without a demonstration, the
    # hybrid on failed groups without feedback or a demonstration, and for a group of one SRPO always, SDPO and the
    # hybrid on all groups where neither is shown
    assert ("sdft", False, "all", None) in never and ("sdft", True, "all", "2+2=4") not in never
    assert ("hybrid", False, "failed_groups", None) in never and ("hybrid", True, "failed_groups", None) not in never
    assert (("srpo", True, "all", "2+2=4") in never) == (group == 1)
    assert (("sdpo", False, "all", None) in never) == (group == 1)
    assert (("hybrid", False, "all", None) in never) == (group == 1)


# ------------------------------------------------------------------------ EMA factors, trust-region mix (pure)


def test_ema_lora_factors_match_dense_ema_and_refactorize():
    g = torch.Generator().manual_seed(0)
    t_a, t_b = torch.randn(6, 20, generator=g), torch.randn(12, 6, generator=g)
    s_a, s_b = torch.randn(2, 20, generator=g), torch.randn(12, 2, generator=g)
    dense = 0.9 * lora_delta(t_a, t_b, 1.0) + 0.1 * lora_delta(s_a, s_b, 2.0)  # [12, 20], rank <= 8
    A, B, dropped, norm = ema_lora_factors(t_a, t_b, s_a, s_b, 2.0, 0.1, rank=8)
    torch.testing.assert_close((B @ A).float(), dense, atol=1e-5, rtol=1e-5)
    assert dropped < 1e-5 and abs(norm - dense.norm().item()) < 1e-4
    A4, B4, dropped4, _ = ema_lora_factors(t_a, t_b, s_a, s_b, 2.0, 0.1, rank=4)
    ref_A, ref_B, rel_err = refactorize(dense, 4)
    torch.testing.assert_close((B4 @ A4).float(), ref_B @ ref_A, atol=1e-4, rtol=1e-4)
    assert abs(dropped4 - rel_err * dense.norm().item()) < 1e-4 and dropped4 > 0.1
    # averaging A and B separately is not the EMA of ΔW
    separate = (0.9 * t_b[:, :2] + 0.1 * s_b) @ (0.9 * t_a[:2] + 0.1 * s_a)
    assert not torch.allclose(separate, dense, atol=1e-2)


def test_trust_region_teacher_logits_hand_value_and_detached():
    ref = torch.tensor([[[1.0, 2.0]]])
    student = torch.tensor([[[3.0, 0.0]]], requires_grad=True)
    mixed = trust_region_teacher_logits(ref, student, coef=0.25)
    torch.testing.assert_close(mixed, torch.tensor([[[1.5, 1.5]]]))
    assert not mixed.requires_grad
    with pytest.raises(ValueError):
        trust_region_teacher_logits(ref, student, coef=1.5)


# --------------------------------------------------------------------------------------- teacher kinds (model)

LORA = LoraConfig(r=2, alpha=4, target_modules=["q_proj", "v_proj", "down_proj"])


def tiny_model(frozen: bool = False):
    """tiny-random with a student adapter (random non-zero B) and optionally a frozen earlier adapter under it."""
    base = load_base(ModelConfig(name="tiny-random"), "none")
    names = ["earlier", "student"] if frozen else ["student"]
    model = base.model
    g = torch.Generator().manual_seed(1)
    for name in names:
        model = attach_adapter(model, name, LORA)
        with torch.no_grad():
            for p in lora_parameters(model, name).values():
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    use_adapters(model, names, trainable="student")
    model.train()
    return model, base.tokenizer, names[:-1]


def perturb_student(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_parameters(model, "student").values():
            p.add_(0.1 * torch.randn(p.shape, generator=g))


def token_batch(tok):
    prompts = [tok("<|im_start|>user\nhello there<|im_end|>\n")["input_ids"], tok("abc")["input_ids"]]
    return build_batch(prompts, [tok(" world!")["input_ids"], tok("xyz")["input_ids"]], tok.pad_token_id)


def logits_under(model, names, batch):
    with torch.no_grad(), active_adapters(model, names):
        model.eval()
        out = response_logits(model, batch)
        model.train()
    return out


def delta_w(model, name: str) -> dict[str, torch.Tensor]:
    return {
        n: lora_delta(m.lora_A[name].weight, m.lora_B[name].weight, m.scaling[name])
        for n, m in model.named_modules()
        if isinstance(m, LoraLayer) and name in m.lora_A
    }


def teacher_cfg(kind: str, **kw) -> TeacherConfig:
    return TeacherConfig(kind=kind, tau=kw.pop("tau", 0.3), ema_rank=kw.pop("ema_rank", 8), **kw)


def test_ema_teacher_delta_is_the_true_ema_of_the_student_delta():
    model, _, frozen = tiny_model()
    tau, k = 0.3, 3
    teacher = create_teacher(model, "student", frozen, teacher_cfg("ema", tau=tau, ema_rank=2 * (k + 1)))
    expected = delta_w(model, "student")  # ΔW_T(0) = ΔW_S(0)
    for step in range(k):
        perturb_student(model, seed=10 + step)
        teacher.update(model)
        expected = {n: (1 - tau) * expected[n] + tau * d for n, d in delta_w(model, "student").items()}
    got = delta_w(model, teacher.adapter)
    assert set(got) == set(expected) and len(got) == 6  # 3 modules x 2 layers
    for n in got:
        torch.testing.assert_close(got[n], expected[n], atol=1e-5, rtol=1e-4)
        assert teacher.ema_error[n] < 1e-5  # rank 8 holds the exact EMA of 4 rank-2 deltas
    assert teacher.steps == k


def test_ema_teacher_truncated_rank_stays_within_its_stated_error_bound():
    model, _, frozen = tiny_model()
    tau = 0.5
    teacher = create_teacher(model, "student", frozen, teacher_cfg("ema", tau=tau, ema_rank=2))
    expected = delta_w(model, "student")
    for step in range(3):
        perturb_student(model, seed=20 + step)
        teacher.update(model)
        expected = {n: (1 - tau) * expected[n] + tau * d for n, d in delta_w(model, "student").items()}
    got = delta_w(model, teacher.adapter)
    for n in got:
        error = (got[n] - expected[n]).norm().item()
        assert teacher.ema_error[n] > 1e-3  # rank 2 cannot hold the EMA: truncation happened
        assert error <= teacher.ema_error[n] * (1 + 1e-5) + 1e-6
    assert 0 < teacher.ema_dropped < 1


def test_lag_teacher_copies_the_student_exactly_every_n_steps():
    model, _, frozen = tiny_model()
    teacher = create_teacher(model, "student", frozen, teacher_cfg("lag", lag_steps=2))
    start = {n: p.clone() for n, p in lora_parameters(model, teacher.adapter).items()}

    def teacher_equals_student() -> bool:
        t, s = lora_parameters(model, teacher.adapter), lora_parameters(model, "student")
        return all(torch.equal(t[n], s[n.replace(".student-teacher.", ".student.")]) for n in t)

    assert teacher_equals_student()  # starts as the stage-start copy
    perturb_student(model, 1)
    teacher.update(model)  # step 1: no copy
    assert not teacher_equals_student()
    assert all(torch.equal(p, start[n]) for n, p in lora_parameters(model, teacher.adapter).items())
    perturb_student(model, 2)
    teacher.update(model)  # step 2: copy
    assert teacher_equals_student()
    perturb_student(model, 3)
    teacher.update(model)  # step 3: no copy
    assert not teacher_equals_student()
    perturb_student(model, 4)
    teacher.update(model)  # step 4: copy
    assert teacher_equals_student()


def test_base_teacher_is_the_adapter_disabled_model():
    model, tok, frozen = tiny_model(frozen=True)
    batch = token_batch(tok)
    teacher = create_teacher(model, "student", frozen, teacher_cfg("base"))
    assert teacher.adapter is None and adapter_names(model) == ["earlier", "student"]
    with torch.no_grad(), model.disable_adapter():
        model.eval()
        disabled = response_logits(model, batch)
        model.train()
    got = teacher.logits(model, batch)
    torch.testing.assert_close(got, disabled, atol=0, rtol=0)
    assert not torch.allclose(got, logits_under(model, ["earlier", "student"], batch), atol=1e-4)


def test_stage_start_and_trust_region_teachers_over_frozen_adapters():
    model, tok, frozen = tiny_model(frozen=True)
    batch = token_batch(tok)
    at_start = logits_under(model, ["earlier", "student"], batch)
    stage_start = create_teacher(model, "student", frozen, teacher_cfg("stage_start"))
    with pytest.raises(ValueError, match="already has"):  # one teacher per student, never a duplicate
        create_teacher(model, "student", frozen, teacher_cfg("ema"))
    perturb_student(model, 5)
    now = logits_under(model, ["earlier", "student"], batch)
    assert not torch.allclose(now, at_start, atol=1e-4)
    torch.testing.assert_close(stage_start.logits(model, batch), at_start, atol=1e-6, rtol=1e-6)

    model, _, frozen = tiny_model(frozen=True)  # same initial weights
    trust = create_teacher(model, "student", frozen, teacher_cfg("trust_region", trust_region_coef=0.3))
    perturb_student(model, 5)
    torch.testing.assert_close(logits_under(model, ["earlier", "student"], batch), now, atol=0, rtol=0)
    torch.testing.assert_close(trust.logits(model, batch), 0.7 * at_start + 0.3 * now, atol=1e-6, rtol=1e-6)


def test_trust_region_teacher_defaults_to_the_reference_mix():
    """issue 16: lasgroup/SDPO's teacher_update_rate 0.05, i.e. 95 % reference, 5 % student, unless set."""
    stage = StageConfig(name="s", domain="d", method="hybrid", distill={"teacher": {"kind": "trust_region"}})
    model, tok, frozen = tiny_model(frozen=True)
    batch = token_batch(tok)
    at_start = logits_under(model, ["earlier", "student"], batch)
    trust = create_teacher(model, "student", frozen, stage.distill.teacher)
    perturb_student(model, 5)
    now = logits_under(model, ["earlier", "student"], batch)
    torch.testing.assert_close(trust.logits(model, batch), 0.95 * at_start + 0.05 * now, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", ["base", "stage_start", "ema", "lag", "trust_region", "restart_freeze", "gated"])
def test_one_copy_of_the_base_weights_with_a_teacher_attached(kind):
    model, _, frozen = tiny_model()

    def base_storage():
        params = [p for n, p in model.named_parameters() if "lora_" not in n]
        return {p.data_ptr() for p in params}, sum(p.numel() for p in params), len(params)

    def lora_numel():
        return sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)

    before, student_numel = base_storage(), lora_numel()
    teacher = create_teacher(model, "student", frozen, teacher_cfg(kind, ema_rank=4))
    assert base_storage() == before
    added = lora_numel() - student_numel
    assert added == {"base": 0, "ema": 2 * student_numel}.get(kind, student_numel)  # adapter-sized only
    teacher.remove(model)
    assert adapter_names(model) == ["student"] and lora_numel() == student_numel


@pytest.mark.parametrize("kind", ["stage_start", "ema"])
def test_teacher_gets_no_gradient_and_an_optimiser_step_leaves_it_unchanged(kind):
    model, tok, frozen = tiny_model()
    batch = token_batch(tok)
    teacher = create_teacher(model, "student", frozen, teacher_cfg(kind))
    teacher_params = lora_parameters(model, teacher.adapter)
    before = {n: p.detach().clone() for n, p in teacher_params.items()}
    student_before = {n: p.detach().clone() for n, p in lora_parameters(model, "student").items()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]  # would include the teacher if it were trainable
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    perturb_student(model, 7)
    loss = losses.distillation_divergence(response_logits(model, batch), teacher.logits(model, batch), 0.5).mean()
    loss.backward()
    optimizer.step()
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags  # teacher forward restored them
    assert all(not p.requires_grad and p.grad is None for p in teacher_params.values())
    assert all(torch.equal(p, before[n]) for n, p in teacher_params.items())
    assert any(not torch.equal(p, student_before[n]) for n, p in lora_parameters(model, "student").items())


@pytest.mark.parametrize("kind", ["ema", "base"])
def test_save_restore_round_trip_is_bit_identical_and_never_duplicates(tmp_path, kind):
    model, tok, frozen = tiny_model()
    teacher = create_teacher(model, "student", frozen, teacher_cfg(kind, ema_rank=2))
    for step in range(2):
        perturb_student(model, 30 + step)
        teacher.update(model)
    saved = {n: p.detach().clone() for n, p in lora_parameters(model, teacher.adapter or "none").items()}
    teacher.save(model, tmp_path / "teacher")
    # into the same model: loads in place, twice, never a second adapter
    with torch.no_grad():
        for p in lora_parameters(model, teacher.adapter or "none").values():
            p.add_(1.0)
    for _ in range(2):
        again = restore_teacher(model, tmp_path / "teacher")
        assert again == teacher
        assert adapter_names(model) == ["student"] + ([teacher.adapter] if teacher.adapter else [])
        got = lora_parameters(model, teacher.adapter or "none")
        assert got.keys() == saved.keys() and all(torch.equal(got[n], saved[n]) for n in saved)
    # into a fresh model that has only the student: the adapter is added, frozen, with the same bits and logits
    fresh, _, _ = tiny_model()
    restored = restore_teacher(fresh, tmp_path / "teacher")
    assert restored == teacher
    got = lora_parameters(fresh, teacher.adapter or "none")
    assert all(torch.equal(got[n], saved[n]) and not got[n].requires_grad for n in saved)
    assert [p.requires_grad for p in lora_parameters(fresh, "student").values()] == [True] * 12
    batch = token_batch(tok)
    torch.testing.assert_close(restored.logits(fresh, batch), teacher.logits(model, batch), atol=0, rtol=0)
    restore_teacher(fresh, tmp_path / "teacher")
    assert len(adapter_names(fresh)) == (2 if teacher.adapter else 1)


@pytest.mark.parametrize("kind", ["stage_start", "trust_region"])
def test_bfloat16_autocast_teacher_is_close_to_float32_and_leaves_the_student_in_float32(kind):
    model, tok, frozen = tiny_model(frozen=True)
    batch = token_batch(tok)
    teacher = create_teacher(model, "student", frozen, teacher_cfg(kind, autocast="bfloat16"))
    assert teacher.autocast == "bfloat16" and Teacher(**teacher.state()) == teacher  # checkpoints keep it
    perturb_student(model, 9)
    reduced = teacher.logits(model, batch)  # [N, R, V]
    teacher.autocast = "none"
    exact = teacher.logits(model, batch)
    assert reduced.dtype == exact.dtype == torch.float32
    assert not torch.equal(reduced, exact)  # the matmuls really ran in bfloat16
    mask = batch.response_mask.bool()  # [N, R]
    p, q = exact.log_softmax(-1)[mask], reduced.log_softmax(-1)[mask]  # [T, V]
    kl = (p.exp() * (p - q)).sum(-1)  # [T] per-token KL of the bf16 teacher to the fp32 one
    assert kl.max() < 1e-3, kl
    student = response_logits(model, batch)  # after the teacher forward: no autocast left behind
    assert student.dtype == torch.float32 and student.requires_grad


def test_auto_autocast_is_bfloat16_only_for_a_float32_model_on_a_cpu_with_bf16_instructions(monkeypatch):
    model, _, _ = tiny_model()
    monkeypatch.setattr(teacher_module, "cpu_has_bf16_matmul", lambda: True)
    assert teacher_autocast_dtype(model, "auto") == torch.bfloat16
    assert teacher_autocast_dtype(model, "none") is None
    monkeypatch.setattr(teacher_module, "cpu_has_bf16_matmul", lambda: False)
    assert teacher_autocast_dtype(model, "auto") is None  # emulated bf16 would be no faster
    assert teacher_autocast_dtype(model, "bfloat16") == torch.bfloat16  # asked for explicitly
    monkeypatch.setattr(teacher_module, "cpu_has_bf16_matmul", lambda: True)
    assert teacher_autocast_dtype(model.to(torch.bfloat16), "auto") is None  # a bf16 model: nothing to gain


def test_bf16_instructions_count_only_where_torch_uses_them(monkeypatch, tmp_path):
    """The cpuinfo flag alone is not enough: under ATEN_CPU_CAPABILITY=avx2 (how CI emulates an AVX2-only CPU)
    torch's kernels do not use AVX512-BF16, so `auto` keeps the teacher in float32, as on that CPU."""
    flags = {"amx_bf16": True, "avx512_bf16": True, "avx2 avx512f": False}
    real_read_text = teacher_module.Path.read_text
    for capability in ("AVX512", "AVX2"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        for flag, native in flags.items():
            monkeypatch.setattr(
                teacher_module.Path,
                "read_text",
                lambda self, *a, f=flag, **k: (
                    f"flags\t: fpu {f} sse\n" if str(self) == "/proc/cpuinfo" else real_read_text(self, *a, **k)
                ),
            )
            teacher_module.cpu_has_bf16_matmul.cache_clear()  # cached per process: this CPU's answer
            assert teacher_module.cpu_has_bf16_matmul() is (native and capability == "AVX512"), (capability, flag)
    teacher_module.cpu_has_bf16_matmul.cache_clear()


# ------------------------------------------------------------------------------ refresh schedules (CGTR, StableSDPO)


def test_gate_allows_refresh_is_cgtrs_joint_rule_at_its_boundaries():
    # reward gain >= delta (0.25 exactly passes, just under fails) and p95 <= (1 + eps) x ref (15 exactly passes)
    assert gate_allows_refresh(0.75, 0.5, 15.0, 10.0, delta=0.25, eps=0.5)
    assert not gate_allows_refresh(0.75, 0.5, 15.0, 10.0, delta=0.25 + 1e-9, eps=0.5)  # not enough reward gain
    assert not gate_allows_refresh(0.75, 0.5, 15.0 + 1e-9, 10.0, delta=0.25, eps=0.5)  # the length tail grew
    assert not gate_allows_refresh(0.25, 0.5, 5.0, 10.0, delta=0.0, eps=0.5)  # a reward fall never refreshes
    assert gate_allows_refresh(0.5, 0.5, 10.0, 10.0, delta=0.0, eps=0.0)  # delta 0: no worse is enough


def test_p95_is_numpys_linear_quantile():
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 64, 333):
        values = torch.randint(0, 500, (n,), generator=g).tolist()
        expected = torch.quantile(torch.tensor(values, dtype=torch.float64), 0.95).item()
        assert quantile(values, 0.95) == pytest.approx(expected, rel=1e-12, abs=1e-12)  # float64 rounding only


# A scripted run of 10 steps, 4 rollouts a step, checked every 2 steps over a 2-step window, delta 0.25, eps 0.5:
# (rewards, response lengths) per step. By hand (window = the last 2 steps, pooled):
#   step 2: window {1, 2}: reward 2/8 = 0.25, p95 10 -> the baseline (no check at the baseline's own step)
#   step 4: window {3, 4}: 5/8 = 0.625, gain 0.375 >= 0.25, p95 10 <= 15 -> refresh (refs 0.625, 10)
#   step 6: window {5, 6}: 1.0, gain 0.375, but lengths [10 x 6, 40, 40]: p95 = 40 > 15 -> refused (length tail)
#   step 8: window {7, 8}: 6/8 = 0.75, gain 0.125 < 0.25 -> refused (reward); refs stay those of step 4
#   step 10: window {9, 10}: 1.0, gain 0.375; lengths [12 x 7, 14]: p95 = 12 + 0.65 x 2 = 13.3 <= 15 -> refresh
SCRIPT = [
    ([0, 0, 0, 1], [10] * 4),
    ([0, 0, 1, 0], [10] * 4),
    ([1, 1, 0, 0], [10] * 4),
    ([1, 1, 1, 0], [10] * 4),
    ([1, 1, 1, 1], [10, 10, 10, 40]),
    ([1, 1, 1, 1], [10, 10, 10, 40]),
    ([1, 1, 1, 0], [10] * 4),
    ([1, 1, 1, 0], [10] * 4),
    ([1, 1, 1, 1], [12] * 4),
    ([1, 1, 1, 1], [12, 14, 12, 12]),
]
GATE = {"every": 2, "window": 2, "delta": 0.25, "eps": 0.5}
REFRESH_STEPS = [4, 10]


def test_gate_refreshes_exactly_where_its_rule_says_on_a_scripted_sequence():
    state, refreshed, logs = GateState(), [], {}
    for step, (rewards, lengths) in enumerate(SCRIPT, start=1):
        before = json.dumps(state.__dict__)
        state, refresh, log = gate_step(state, step, [float(r) for r in rewards], lengths, **GATE)
        assert json.dumps(GateState(**json.loads(before)).__dict__) == before  # the input state is not modified
        if refresh:
            refreshed.append(step)
        if log:
            logs[step] = log
    assert refreshed == REFRESH_STEPS
    assert set(logs) == {2, 4, 6, 8, 10}  # the baseline and the four checks; nothing logged between
    assert logs[2] == {"teacher_gate_baseline": 1.0, "teacher_gate_reward": 0.25, "teacher_gate_len_p95": 10.0}
    check = ("teacher_gate_refused", "teacher_gate_reward", "teacher_gate_reward_ref", "teacher_gate_len_p95",
             "teacher_gate_len_p95_ref", "teacher_gate_ref_step")  # fmt: skip
    expected = {
        4: (0.0, 0.625, 0.25, 10.0, 10.0, 2.0),
        6: (1.0, 1.0, 0.625, 40.0, 10.0, 4.0),
        8: (1.0, 0.75, 0.625, 10.0, 10.0, 4.0),
        10: (0.0, 1.0, 0.625, 13.3, 10.0, 4.0),
    }
    for step, values in expected.items():
        assert logs[step]["teacher_gate_check"] == 1.0
        assert tuple(logs[step][k] for k in check) == pytest.approx(values, abs=1e-12), step
    assert (state.reward_ref, state.p95_ref, state.ref_step) == (1.0, pytest.approx(13.3), 10)
    assert len(state.rewards) == len(state.lengths) == 2  # only the window is kept


def teacher_equals_student(model, teacher) -> bool:
    t, s = lora_parameters(model, teacher.adapter), lora_parameters(model, "student")
    return all(torch.equal(t[n], s[n.replace(".student-teacher.", ".student.")]) for n in t)


def teacher_weights(model, teacher) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in lora_parameters(model, teacher.adapter).items()}


def unchanged(model, teacher, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p, before[n]) for n, p in lora_parameters(model, teacher.adapter).items())


def test_gated_teacher_copies_the_student_only_where_the_gate_opens():
    model, _, frozen = tiny_model()
    cfg = teacher_cfg("gated", refresh_every=GATE["every"], gate_window=GATE["window"],
                      gate_reward_delta=GATE["delta"], gate_length_eps=GATE["eps"])  # fmt: skip
    teacher = create_teacher(model, "student", frozen, cfg)
    assert teacher_equals_student(model, teacher)  # the stage-start copy
    for step, (rewards, lengths) in enumerate(SCRIPT, start=1):
        before = teacher_weights(model, teacher)
        perturb_student(model, 100 + step)  # the optimiser step
        teacher.update(model, [float(r) for r in rewards], lengths)
        if step in REFRESH_STEPS:
            assert teacher_equals_student(model, teacher) and not unchanged(model, teacher, before), step
        else:
            assert unchanged(model, teacher, before) and not teacher_equals_student(model, teacher), step
        assert teacher.stats()["teacher_refresh"] == float(step in REFRESH_STEPS)
        assert teacher.stats().get("teacher_gate_refused") == {6: 1.0, 8: 1.0, 4: 0.0, 10: 0.0}.get(step)
    # the whole schedule survives JSON (a checkpoint's state.json) and rebuilds an equal teacher
    again = Teacher(**json.loads(json.dumps(teacher.state())))
    assert again == teacher and isinstance(again.gate, GateState) and again.gate.ref_step == 10
    with pytest.raises(ValueError, match="needs the step's training rewards"):
        teacher.update(model)


def test_restart_freeze_teacher_copies_the_student_exactly_every_n_steps_and_is_frozen_between():
    model, _, frozen = tiny_model()
    teacher = create_teacher(model, "student", frozen, teacher_cfg("restart_freeze", refresh_every=3))
    assert teacher_equals_student(model, teacher)
    for step in range(1, 8):
        before = teacher_weights(model, teacher)
        perturb_student(model, 200 + step)
        teacher.update(model)
        if step % 3 == 0:  # steps 3 and 6: the student as it is after the step
            assert teacher_equals_student(model, teacher) and not unchanged(model, teacher, before), step
        else:
            assert unchanged(model, teacher, before) and not teacher_equals_student(model, teacher), step
        assert teacher.stats() == {"teacher_refresh": float(step % 3 == 0)}
