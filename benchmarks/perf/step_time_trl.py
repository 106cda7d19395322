"""TRL's side of step_time.py: `GRPOTrainer` (grpo) and `trl.experimental.sdpo.SDPOTrainer` (sdpo), each configured to
match adaptercl's stage (step_time_workload.py) as far as the trainer allows; `TRL_SIDES` maps the compared method to
its builder, the trainer method that is its rollout (timed on its own) and its name.

What the SDPO settings could not make equal is `SDPO_DIFFERENCES`, written into each SDPO result and listed, word for
word, in step_time.py's docstring (tests/benchmarks/test_step_time.py checks that they agree).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from step_time_workload import REWARDS, WORKLOADS

SDPO_DIFFERENCES = [
    "EMA teacher: adaptercl averages each module's effective delta s*B*A (tau 0.05, in a rank-2r teacher adapter "
    "re-factorised after every step, teacher/kinds.py); TRL averages the A and B matrices separately in a rank-r "
    "teacher adapter (PEFTAdapterEMACallback, tau 0.05 every step), which is not the average of their product.",
    "Teacher rows: adaptercl's teacher forward runs on the rows with a target only, TRL's on every row (a row "
    "without one on its own prompt, then masked); the workload's reward makes every row a target on both sides, "
    "so both forward the same rows (with a real reward adaptercl would skip rows that TRL computes).",
    "Teacher prompts: each side shows the teacher its own successful sibling, so the teacher prompts differ in "
    "length with the sampled text (the result's teacher prompt_tokens_mean records both).",
    "Importance weights: neither side applies one in float32: TRL computes the rollout's logprobs only when "
    "gradient_accumulation_steps is not a multiple of steps_per_generation x num_iterations (never at 1), so its "
    "distillation_is_clip is inert; with --rollout-dtype bfloat16 adaptercl's side weights its distillation loss "
    "by the bf16 sampler's logprobs (capped at distill.is_cap 2) and TRL's does not.",
    "Prompts and samples: TRL's RepeatSampler shuffles the prompts with its own seed and each side samples from its "
    "own random stream, so the steps see different prompts of the same domain and, at natural length, different "
    "lengths (completion_len records both).",
]


def _record_lengths(lengths: list[list[int]], method: str) -> Callable[..., list[float]]:
    """The shared reward as a TRL reward function that also records each call's completion lengths [steps][rows]."""
    score = REWARDS[method]

    def reward(prompts, completions, completion_ids, **_: Any) -> list[float]:
        lengths.append([len(ids) for ids in completion_ids])
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return [score(t) for t in texts]

    return reward


def _common_config(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The TrainingArguments and sampling fields both TRL trainers get (see step_time.py's docstring)."""
    return {
        "output_dir": str(work / "trl"),
        "use_cpu": True,
        "bf16": False,
        "fp16": False,
        "model_init_kwargs": {"dtype": "float32"},
        "per_device_train_batch_size": args.prompts_per_step * args.group_size,
        "num_generations": args.group_size,
        "gradient_accumulation_steps": 1,
        "num_iterations": 1,
        "max_completion_length": args.max_new_tokens,
        "generation_kwargs": {"min_new_tokens": args.max_new_tokens} if WORKLOADS[args.workload][2] else None,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "learning_rate": args.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "optim": "adamw_torch",
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "beta": 0.0,
        "gradient_checkpointing": False,  # TRL's configs turn it on (transformers >= 5.21 also calls it activation_)
        "use_vllm": False,
        "max_steps": args.warmup + args.steps,
        "save_strategy": "no",
        "eval_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "seed": args.seed,
    }


def _tokenizer(model_path: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # as adaptercl.model.base.load_base
    return tokenizer


def grpo_trainer(args: argparse.Namespace, work: Path, model_path: str, ctx) -> Any:
    """TRL's GRPOTrainer on the same folder, prompts, LoRA, reward, sampling and loss settings."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from adaptercl.adapters.live import peft_lora_config

    lengths: list[list[int]] = []  # per reward call (one per step: steps_per_generation 1), its completions' lengths
    config = GRPOConfig(
        **_common_config(args, work),
        epsilon=0.2,
        epsilon_high=0.28,
        scale_rewards="none",
        loss_type="dapo",
        mask_truncated_completions=False,  # fixed: every completion hits the cap; long: as adaptercl, kept
    )
    trainer = GRPOTrainer(
        model=model_path,
        reward_funcs=_record_lengths(lengths, "grpo"),
        args=config,
        train_dataset=Dataset.from_list([{"prompt": ex.messages} for ex in ctx.domain.train]),
        processing_class=_tokenizer(model_path),
        peft_config=peft_lora_config(ctx.stage.lora, ctx.model),
    )
    trainer.completion_lengths = lengths
    return trainer


def sdpo_trainer(args: argparse.Namespace, work: Path, model_path: str, ctx) -> Any:
    """TRL's experimental SDPOTrainer with adaptercl's sdpo stage's settings: pure distillation
    (`distillation_weight=1`), the student's top-k support with a tail bucket and JSD α (`topk_logits`), an EMA
    teacher of rate τ updated every step, shown the first successful sibling (not itself) with the same templates,
    the same success threshold, `<think>` blocks stripped, no environment feedback, no prompt truncation. Records each
    step's completion lengths and, per step, the teacher's rows with a target and its mean prompt tokens."""
    from datasets import Dataset
    from trl.experimental.sdpo import SDPOConfig, SDPOTrainer

    from adaptercl.adapters.live import peft_lora_config

    distill = ctx.stage.distill
    lengths: list[list[int]] = []
    teacher_rows: list[float] = []  # per step: share of rows with a teacher target
    teacher_prompt_tokens: list[float] = []  # per step: mean teacher prompt tokens per row
    config = SDPOConfig(
        **_common_config(args, work),
        max_prompt_length=None,  # adaptercl does not truncate prompts (TRL's default cuts them at 512 tokens)
        distillation_weight=1.0,
        distillation_mode="topk_logits" if distill.support == "topk" else "full_logits",
        distillation_topk=distill.topk if distill.support == "topk" else None,
        distillation_add_tail=distill.tail,
        distillation_alpha=distill.alpha,
        teacher_model_kind="ema",
        teacher_update_rate=distill.teacher.tau,
        teacher_sync_steps=1,
        use_successful_as_teacher=True,
        success_reward_threshold=distill.success_threshold,
        dont_reprompt_on_self_success=True,
        include_environment_feedback=False,
        remove_thinking_from_demonstration=distill.strip_think,
        reprompt_template=distill.reprompt_template,
        solution_template=distill.solution_template,
        feedback_template=distill.feedback_template,
        diagnostics_warning_interval=0,  # flat rewards are this workload's design, not a problem to warn about
    )
    trainer = SDPOTrainer(
        model=model_path,
        reward_funcs=_record_lengths(lengths, "sdpo"),
        args=config,
        train_dataset=Dataset.from_list([{"prompt": ex.messages} for ex in ctx.domain.train]),
        processing_class=_tokenizer(model_path),
        peft_config=peft_lora_config(ctx.stage.lora, ctx.model),
    )
    build = trainer.teacher_context_builder.build

    def recording_build(output, *a: Any, **k: Any) -> dict[str, Any]:
        context = build(output, *a, **k)
        width = output["completion_ids"].shape[1]  # teacher input = teacher prompt (left-padded) + completion
        prompt_tokens = context["teacher_attention_mask"][:, :-width].sum(-1).float()  # [N]
        teacher_rows.append(context["self_distillation_mask"].float().mean().item())
        teacher_prompt_tokens.append(prompt_tokens.mean().item())
        return context

    trainer.teacher_context_builder.build = recording_build
    trainer.completion_lengths = lengths
    trainer.teacher_rows, trainer.teacher_prompt_tokens = teacher_rows, teacher_prompt_tokens
    return trainer


@dataclass(frozen=True)
class TrlSide:
    """One compared method's TRL trainer: how it is built, which of its methods is the rollout, its name."""

    build: Callable[[argparse.Namespace, Path, str, Any], Any]
    rollout: str  # the trainer method timed as the rollout share
    name: str


TRL_SIDES = {
    "grpo": TrlSide(grpo_trainer, "_generate_single_turn", "TRL GRPOTrainer"),
    # sample_rollouts: prompt tokenisation, generate, padding (as adaptercl's time_rollout_s: encode_chat + generate)
    "sdpo": TrlSide(sdpo_trainer, "sample_rollouts", "TRL SDPOTrainer"),
}
