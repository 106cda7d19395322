"""SDPO and SDFT stages on tiny-random: the loss path, its invariances, end-to-end runs and resume."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file

from adaptercl.adapters.live import adapter_names, attach_adapter, lora_parameters, use_adapters
from adaptercl.domains import Domain, RewardResult
from adaptercl.model.base import load_base
from adaptercl.recipe.grammar import resolve_recipe
from adaptercl.rollout.hf import HFEngine
from adaptercl.teacher.kinds import create_teacher, restore_teacher
from adaptercl.train.context import StageContext
from adaptercl.train.stage import run_stage

STUDENT = "stage-01-one"


@dataclass
class ToyExample:
    id: str
    messages: list[dict[str, str]]
    answer: str
    demonstration: str | None = None


class ToyDomain:
    """A stand-in domain with a reward we control: success = even response length (a mix in every group); `rare`:
    a length divisible by 3 (some samples without a successful sibling); `never`."""

    name = "toy"

    def __init__(self, succeed: str = "even", feedback: bool = False):
        self.succeed, self.feedback = succeed, feedback
        self.train = [
            ToyExample(
                str(i),
                [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is {i}+{i}?"}],
                str(2 * i),
                f"{i}+{i}={2 * i}",
            )
            for i in range(12)
        ]
        self.eval = self.train[:2]

    batch_reward = None
    score = Domain.score  # the real batch entry point, over this reward

    def reward(self, text: str, example: ToyExample) -> RewardResult:
        ok = (self.succeed == "even" and len(text) % 2 == 0) or (self.succeed == "rare" and len(text) % 3 == 0)
        return RewardResult(float(ok), ok, f"expected {example.answer}" if self.feedback and not ok else None)


def recipe(tmp_path, method: str, **blocks):
    raw = {
        "model": {"name": "tiny-random"},
        "output_dir": str(tmp_path / "run"),
        "lora": {"r": 4, "alpha": 8},
        "optim": {"lr": 5e-3, "steps": 2, "prompts_per_step": 2},
        "rollout": {"group_size": 1 if method == "sdft" else 4, "max_new_tokens": 8},
        "eval": {"examples_per_domain": 2},
        "domains": [{"name": "arith", "source": "builtin:arithmetic"}, {"name": "mcq", "source": "builtin:mcq"}],
        "stages": [{"name": "one", "domain": "arith", "method": method}],
    }
    for key, value in blocks.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return resolve_recipe(raw)


def stage_context(tmp_path, method: str, domain: ToyDomain, **blocks) -> StageContext:
    """A stage set up as run_recipe does: student adapter on tiny-random, teacher created at stage start."""
    rec = recipe(tmp_path, method, **blocks)
    base = load_base(rec.model, "none")
    torch.manual_seed(rec.seed)  # LoRA A init, as run_recipe
    model = attach_adapter(base.model, STUDENT, rec.stages[0].lora)
    use_adapters(model, [STUDENT], trainable=STUDENT)
    teacher = create_teacher(model, STUDENT, [], rec.stages[0].distill.teacher)
    tmp_path.mkdir(parents=True, exist_ok=True)
    return StageContext(
        rec, 0, model, base.tokenizer, HFEngine(model, base.tokenizer), domain, STUDENT, [], tmp_path, teacher=teacher
    )


def student_state(ctx) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in lora_parameters(ctx.model, STUDENT).items()}


def metrics(ctx) -> list[dict]:
    return [json.loads(line) for line in (ctx.stage_dir / "metrics.jsonl").read_text().splitlines()]


def test_sdpo_stage_trains_the_student_and_the_ema_teacher_follows(tmp_path):
    ctx = stage_context(tmp_path, "sdpo", ToyDomain(), distill={"support": "full"})
    teacher_before = {n: p.clone() for n, p in lora_parameters(ctx.model, ctx.teacher.adapter).items()}
    before = student_state(ctx)
    run_stage(ctx)
    rows = metrics(ctx)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("teacher_target_frac", "distill_token_frac", "teacher_divergence", "success_frac"):
            assert 0.0 <= r[key] and r[key] == r[key], key
        assert r["feedback_used_frac"] == 0.0 and r["skipped_step"] == 0.0 and r["teacher_target_frac"] > 0
        assert "policy_loss" not in r  # SDPO replaces the GRPO loss
    after = student_state(ctx)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    assert ctx.teacher.steps == 2
    assert any(
        not torch.equal(p, teacher_before[n]) for n, p in lora_parameters(ctx.model, ctx.teacher.adapter).items()
    )
    assert all(not p.requires_grad for p in lora_parameters(ctx.model, ctx.teacher.adapter).values())


def test_no_teacher_context_means_no_gradient_and_no_step(tmp_path):
    ctx = stage_context(tmp_path, "sdpo", ToyDomain(succeed="never", feedback=False))
    before = student_state(ctx)
    run_stage(ctx)
    assert all(r["teacher_target_frac"] == 0.0 and r["skipped_step"] == 1.0 for r in metrics(ctx))
    assert all(torch.equal(before[n], p) for n, p in student_state(ctx).items())

    ctx = stage_context(tmp_path / "fb", "sdpo", ToyDomain(succeed="never", feedback=True))  # feedback fallback
    run_stage(ctx)
    assert all(r["teacher_target_frac"] == 1.0 and r["feedback_used_frac"] == 1.0 for r in metrics(ctx))


def test_identical_teacher_prompt_and_stage_start_teacher_give_zero_divergence(tmp_path):
    # SDFT whose demonstration prompt is the plain question, with the student itself as teacher: p == q.
    same = {"teacher": {"kind": "stage_start"}, "demonstration_template": "{question}", "skip_first_tokens": 0}
    ctx = stage_context(tmp_path, "sdft", ToyDomain(), distill={**same, "support": "full"}, optim={"steps": 1})
    run_stage(ctx)
    assert abs(metrics(ctx)[0]["teacher_divergence"]) < 1e-6 and metrics(ctx)[0]["grad_norm"] < 1e-5
    ctx = stage_context(tmp_path / "b", "sdft", ToyDomain(), distill={"teacher": {"kind": "stage_start"}})
    run_stage(ctx)
    assert metrics(ctx)[0]["teacher_divergence"] > 1e-6 and metrics(ctx)[0]["distill_token_frac"] < 1.0  # 3 skipped


@pytest.mark.parametrize(
    ("method", "distill"),
    [
        ("sdpo", {"aggregation": "token_mean", "mask_ratio": 0.3}),
        ("sdft", {"aggregation": "seq_mean_token_mean"}),
        ("sdpo", {}),  # the default, seq_mean_token_mean_all, on a batch with samples without a target
    ],
)
def test_grad_accumulation_gives_the_same_distillation_update(tmp_path, method, distill):
    """One step of 1, 4 micro-batches, and of micro-batches of a set size (3 + 3 + 2 of sdpo's 8 rows, 1 + 1 of sdft's
    2: what `optim.micro_batch_size` or its auto choice sets, `StageContext.micro_batch`)."""
    states = []
    for split in ({"grad_accum": 1}, {"grad_accum": 4}, {"micro_batch": 3 if method == "sdpo" else 1}):
        domain = ToyDomain("rare" if not distill else "even")
        name = "-".join(f"{k}{v}" for k, v in split.items())
        optim = {"steps": 1, "grad_accum": split.get("grad_accum", 1)}
        # float64 (quantization none): the splits sum in another order, and Adam turns an element's relative gradient
        # error into the same fraction of its step; in float32 one element of a small gradient moved by 0.2 % of a
        # step on an AVX2 CPU, in float64 (transformers' rotary tables stay float32, ~6e-8) by ~1e-5 of one
        ctx = stage_context(
            tmp_path / name,
            method,
            domain,
            distill=distill,
            optim=optim,
            model={"dtype": "float64"},
            quantization="none",
            seed=3,  # its rollouts mix rows with and without a successful sibling (asserted below for sdpo's default)
        )
        ctx.micro_batch = split.get("micro_batch")
        run_stage(ctx)
        states.append(student_state(ctx))
        if not distill:
            assert ctx.stage.distill.aggregation == "seq_mean_token_mean_all"
            assert 0.0 < metrics(ctx)[0]["teacher_target_frac"] < 1.0  # some rows count 0 in the denominator
    one = states[0]
    assert any(v.abs().max() > 0 for k, v in one.items() if "lora_B" in k)
    for other in states[1:]:
        for k in one:  # micro-batches share prompt prefixes differently: rounding differs far below the 5e-3 step
            assert one[k].dtype == torch.float64
            torch.testing.assert_close(one[k], other[k], rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------ end to end through run_recipe


def test_sdpo_and_sdft_stages_run_end_to_end_and_resume_with_the_same_teacher(tmp_path):
    from adaptercl.run.sequence import run_recipe

    raw_stages = [
        {"name": "one", "domain": "arith", "method": "sdpo", "distill": {"teacher": {"kind": "ema"}}},
        {"name": "two", "domain": "mcq", "method": "sdft", "rollout": {"group_size": 1}, "adapter": {"init": "new"}},
    ]
    rec = {
        "model": {"name": "tiny-random"},
        "output_dir": str(tmp_path / "run"),
        "lora": {"r": 4, "alpha": 8},
        "optim": {"lr": 5e-3, "steps": 2, "prompts_per_step": 2},
        "rollout": {"group_size": 4, "max_new_tokens": 8},
        "eval": {"examples_per_domain": 2},
        "domains": [{"name": "arith", "source": "builtin:arithmetic"}, {"name": "mcq", "source": "builtin:mcq"}],
        "stages": raw_stages,
    }
    out = tmp_path / "run"
    run_recipe(resolve_recipe(rec))
    for stage, kind in (("stage-01-one", "ema"), ("stage-02-two", "ema")):
        rows = [json.loads(line) for line in (out / stage / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2]
        assert all("teacher_target_frac" in r and "distill_token_frac" in r for r in rows)
        state = json.loads((out / stage / "teacher" / "teacher.json").read_text())
        assert state["kind"] == kind and state["steps"] == 2
        done = json.loads((out / stage / "done.json").read_text())
        assert not any(a.endswith("-teacher") for a in done["adapters"])
    # stage-granular resume: stage two is run again from stage one's saved adapter -> the same teacher, bit for bit
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (copy / "recipe.resolved.yaml").unlink()
    shutil.rmtree(copy / "stage-02-two")
    run_recipe(resolve_recipe({**rec, "output_dir": str(copy)}))
    for folder in ("teacher/adapter", "adapter"):
        a = load_file(str(out / "stage-02-two" / folder / "adapter_model.safetensors"))
        b = load_file(str(copy / "stage-02-two" / folder / "adapter_model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    a, b = (json.loads((d / "stage-02-two" / "teacher" / "teacher.json").read_text()) for d in (out, copy))
    assert a == b
    # the saved teacher restores into a model that holds the stage's adapters, once
    base = load_base(resolve_recipe(rec).model, "none")
    model = attach_adapter(base.model, "stage-02-two", resolve_recipe(rec).stages[1].lora)
    for _ in range(2):
        restore_teacher(model, out / "stage-02-two" / "teacher")
    assert adapter_names(model) == ["stage-02-two", "stage-02-two-teacher"]


def test_the_stage_multiplies_by_the_frozen_base_packed_once(tmp_path, monkeypatch):
    """run_stage packs the frozen base's linear layers once for the stage (`packed_base_linears`): the training
    forward, the input gradients through the base, the teacher's forwards and the decode's unfolded layers (the LM
    head) use those packs; the stage's block packs no LoRA factor; afterwards every layer has its own forward again
    and the base is untouched."""
    from packing_counts import counting, counting_packs

    from adaptercl.rollout import packed_weights as pw
    from adaptercl.train import stage as stage_module

    if not pw.onednn_available():
        pytest.skip("this torch has no oneDNN packed-linear ops")
    ctx = stage_context(tmp_path, "sdpo", ToyDomain())
    base = {n: p.clone() for n, p in ctx.model.named_parameters() if "lora_" not in n}
    factors = {id(m) for n, m in ctx.model.named_modules() if ".lora_A." in n or ".lora_B." in n}
    calls = counting_packs(monkeypatch)
    made = calls["made"]
    stage_blocks: list[int] = []
    monkeypatch.setattr(stage_module, "packed_base_linears", counting(stage_module.packed_base_linears, stage_blocks))
    run_stage(ctx)
    linears = [m for m in ctx.model.modules() if type(m) is torch.nn.Linear and id(m) not in factors]
    assert stage_blocks == [len(linears)]  # one block for the stage, over the base's layers only
    assert set(made[: len(linears)]) == {id(m) for m in linears}
    head = ctx.model.get_output_embeddings()
    assert made.count(id(head)) == 1  # packed once for the stage: the two rollouts reuse it
    assert calls["product"] > 0 and calls["grad_input"] > 0
    assert all(not isinstance(m.__dict__.get("forward"), pw._PackedForward) for m in ctx.model.modules())
    assert all(torch.equal(p, base[n]) for n, p in ctx.model.named_parameters() if "lora_" not in n)
