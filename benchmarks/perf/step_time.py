"""Step wall time, adaptercl's `run_stage` vs TRL's trainer of one method, same workload, alternating step by step:
GRPO against `GRPOTrainer` (`--method grpo`, the default) and SDPO against `trl.experimental.sdpo.SDPOTrainer`
(`--method sdpo`).

Both systems train the same local HF folder (adaptercl's `resolve_model_path` of the alias), in float32 on CPU,
with the same LoRA (r, alpha, target modules, no dropout), the same prompts per step x group size (TRL:
`per_device_train_batch_size = prompts * group`, `num_generations = group`, `gradient_accumulation_steps = 1`,
`num_iterations = 1`, so one TRL step = one generation batch = one optimiser step; see `GRPOConfig.__post_init__`:
steps_per_generation defaults to gradient_accumulation_steps; SDPOConfig's is the same), the same sampling (T=1,
top_p 1, top_k 0, plain transformers `generate`, no vLLM), the same reward function on both sides (pure Python), AdamW
with a constant LR and grad-norm clipping at 1.0, one micro-batch. Generation is forced to a fixed length on both sides
(`min_new_tokens = max_new_tokens`, which masks the EOS ids until the cap), so every completion has exactly
`max_new_tokens` tokens; the lengths seen by both are recorded (`fixed_length_ok`), and a fixed-length workload whose
lengths differ is refused (exit 1, no ratio, no result file): it would compare different amounts of work.

GRPO: the reward is the fraction of digit characters in the completion; the loss setting is the same (DAPO token mean =
adaptercl `token_mean`, eps 0.2 / 0.28, no KL, no std scaling). TRL settings that differ from its defaults:
`use_cpu=True`, `bf16=False` (fp32 on CPU), `gradient_checkpointing=False` (its alias `activation_checkpointing` from
transformers 5.21; on by GRPOConfig's default; adaptercl has none), `optim="adamw_torch"`,
`lr_scheduler_type="constant"`, `scale_rewards="none"`, `epsilon_high=0.28`, no saving, no evaluation,
`report_to="none"`, `disable_tqdm=True`.
Logging stays at TRL's default (every 10 steps).

SDPO: adaptercl's sdpo stage with the method table's reference defaults (recipe/method_table.py: no policy term, EMA
teacher τ 0.05, the student's top-100 tokens + a tail bucket, JSD α 0.5, the per-sequence mean over every row, the
teacher shown the first successful sibling other than the sample itself) against SDPOTrainer set to the same:
`distillation_weight=1`, `distillation_mode="topk_logits"`, `distillation_topk=100`, `distillation_add_tail=True`,
`distillation_alpha=0.5` (its per-sequence mean over every row is the same aggregation), `teacher_model_kind="ema"`,
`teacher_update_rate=0.05`, `teacher_sync_steps=1`, `success_reward_threshold` = adaptercl's
`distill.success_threshold` (0.5), `dont_reprompt_on_self_success=True`, adaptercl's reprompt, solution and feedback
templates, `remove_thinking_from_demonstration=True`, `include_environment_feedback=False`, `max_prompt_length=None`
(adaptercl does not truncate), `diagnostics_warning_interval=0`, plus the CPU settings above. The reward gives every
completion 1.0, so every sample is a success and every row has a successful sibling to show its teacher: both systems
distil every row, the same teacher work whatever was sampled (`teacher` in the result: rows with a target and teacher
prompt tokens per row, each side). What could not be made equal (also the result's `differences`):
- EMA teacher: adaptercl averages each module's effective delta s*B*A (tau 0.05, in a rank-2r teacher adapter
  re-factorised after every step, teacher/kinds.py); TRL averages the A and B matrices separately in a rank-r teacher
  adapter (PEFTAdapterEMACallback, tau 0.05 every step), which is not the average of their product.
- Teacher rows: adaptercl's teacher forward runs on the rows with a target only, TRL's on every row (a row without one
  on its own prompt, then masked); the workload's reward makes every row a target on both sides, so both forward the
  same rows (with a real reward adaptercl would skip rows that TRL computes).
- Teacher prompts: each side shows the teacher its own successful sibling, so the teacher prompts differ in length with
  the sampled text (the result's teacher prompt_tokens_mean records both).
- Importance weights: neither side applies one in float32: TRL computes the rollout's logprobs only when
  gradient_accumulation_steps is not a multiple of steps_per_generation x num_iterations (never at 1), so its
  distillation_is_clip is inert; with --rollout-dtype bfloat16 adaptercl's side weights its distillation loss by the
  bf16 sampler's logprobs (capped at distill.is_cap 2) and TRL's does not.
- Prompts and samples: TRL's RepeatSampler shuffles the prompts with its own seed and each side samples from its own
  random stream, so the steps see different prompts of the same domain and, at natural length, different lengths
  (completion_len records both).

Alternation: both run in the main OS thread, TRL's `trainer.train()` in the main greenlet and adaptercl's real
`run_stage` in a second one (`greenlet`: each its own Python stack, one OS thread); the two hand over strictly after
every optimiser step (a TRL callback, added last so that SDPOTrainer's EMA teacher update runs inside TRL's step, and
the stage's `on_step` hook), so exactly one of them computes at any time and both see the same machine conditions.
Why not a worker thread (this script until 2026-11-29): torch's OpenMP parallel regions started from a second OS
thread ran at the cost of a passive wait policy, measured on the 2-core EPYC: a [8, 48, 1536] add 0.04 ms in the
main thread, 0.09 ms in another; adaptercl's SDPO step in a worker thread 6.5-7.1 s against 4.6-4.9 s in the main
thread, where both `adaptercl recipe run` and a TRL script run (`thread_penalty.py` measures the effect). Torch's grad
mode is thread-local, so a greenlet switch keeps each side's own (`Alternation`).
What is timed:
- adaptercl: `time_step_s` of metrics.jsonl (rollout, reward, batch, teacher prompts, loss, backward, clip,
  optimiser and scheduler step, teacher update, engine bookkeeping; not the JSON line write);
- TRL: `on_step_begin` -> `on_step_end` (generation, reward, teacher prompts, loss, backward, clip, optimiser and
  scheduler step, zero_grad, the EMA teacher's update; not the periodic logging that follows `on_step_end`). Rollout
  share: `_generate_single_turn` (GRPO), `sample_rollouts` (SDPO: prompt tokenisation, generate, padding).
The training part of each step is its time minus its rollout (`*_training_s`). The first `--warmup` steps of each
are left out.

Three workloads (`--workload`):
- `short` (the default): the built-in arithmetic prompts (~60 tokens), 48 new tokens, generation forced to the cap on
  both sides, as above;
- `long`: the prompts of a shipped domain (`--domain`, default math: GSM8K from ../shared/data/gsm8k, loaded by
  adaptercl's loader with recipes/hybrid.yaml's format, so both systems get the same chat messages), 256 new tokens,
  and responses of their natural length (no forced minimum: each stops at its end token or at the cap), so the
  batch is padded to its longest response as in a real run; the completion lengths of both sides are recorded
  (`completion_len`): they are samples of the same distribution, not the same responses, so the step ratio also
  depends on the draw;
- `long-fixed`: the long workload's prompts with exactly `max_new_tokens` (256) new tokens on both sides (forced as
  `short` forces them): the same work on both sides, so the ratio measures the engines, not the draw.

Beside the step ratio the rollout's time per generated token is reported on each side (`rollout_ms_per_token`: a
step's rollout time over the tokens its completions hold), the figure that compares engines whatever the lengths.

    python benchmarks/perf/step_time.py --model tiny-random
    python benchmarks/perf/step_time.py --model smollm2-135m-instruct --steps 10 --warmup 2
    python benchmarks/perf/step_time.py --model smollm2-135m-instruct --workload long --steps 3 --warmup 1
    python benchmarks/perf/step_time.py --model smollm2-135m-instruct --workload long-fixed --steps 3 --warmup 1
    python benchmarks/perf/step_time.py --method sdpo --model smollm2-135m-instruct --workload long-fixed --steps 3 \
        --warmup 1

`--rollout-dtype bfloat16` (or auto) rolls adaptercl's side out on bf16 weights (`rollout.dtype`, CPUs with bf16
matrix units), its own logprobs feeding the trainer's rollout-mismatch weights; TRL's side is unchanged.

writes benchmarks/perf/results/step_time-[sdpo-]<model>[-long|-long-fixed][-rollout-<dtype>].json and prints a
markdown table. The workload and adaptercl's side are in step_time_workload.py, TRL's in step_time_trl.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import greenlet
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for the shared provenance.py

from padding import DATA  # noqa: E402
from perf_common import add_workload_arguments, write_result  # noqa: E402
from provenance import markdown_table, provenance, spread  # noqa: E402
from step_time_trl import SDPO_DIFFERENCES, TRL_SIDES  # noqa: E402
from step_time_workload import (  # noqa: E402
    LONG_DOMAINS,
    WORKLOADS,
    LengthMismatch,
    TeacherPromptTokens,
    adaptercl_context,
    check_fixed_lengths,
    ms_per_token,
    plain_model_folder,
    portable_path,
    workload_record,
)

NATURAL_LENGTH_NOTE = (
    " At natural length the step ratio also moves with which side happened to sample longer responses: it is honest"
    " only at comparable lengths; the time per generated token and the long-fixed workload compare the engines."
)


class Alternation:
    """Strict turns between the main greenlet (TRL's trainer) and a second greenlet (adaptercl's stage), both in this
    OS thread: `to_stage()` from TRL's side runs the stage until its `to_trainer()` (or its end), and back. Each side
    keeps its own torch grad mode across the switch (thread-local state, which greenlets share)."""

    def __init__(self, stage: Callable[[], Any]):
        self.trainer = greenlet.getcurrent()
        self.stage = greenlet.greenlet(stage, parent=self.trainer)  # an exception in the stage surfaces in to_stage

    @staticmethod
    def _switch(target: greenlet.greenlet) -> None:
        grad = torch.is_grad_enabled()
        target.switch()
        torch.set_grad_enabled(grad)

    def to_stage(self) -> None:
        self._switch(self.stage)

    def to_trainer(self) -> None:
        self._switch(self.trainer)


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="adaptercl-step-time-") as tmp:
        return run_in(args, Path(tmp))


def run_in(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from transformers import TrainerCallback

    from adaptercl.train.stage import run_stage

    model_path, model_note = plain_model_folder(args.model, work)
    ctx = adaptercl_context(args, work, model_path)
    side = TRL_SIDES[args.method]
    trl_times: list[float] = []
    trl_rollout: list[float] = []
    order: list[str] = []  # who finished each step, to check the alternation
    total = args.warmup + args.steps
    turns = Alternation(lambda: run_stage(ctx))

    class StepTimer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kwargs):
            trl_times.append(time.perf_counter() - self.t0)
            order.append("trl")
            turns.to_stage()  # one adaptercl step now (the first call starts the stage), then back here

    def after_adaptercl_step(step: int, _metrics: dict, _samples: list) -> None:
        order.append("adaptercl")
        if step < total:  # after the last step run_stage returns, which hands back too
            turns.to_trainer()

    ctx.on_step = after_adaptercl_step
    trainer = side.build(args, work, model_path, ctx)
    trainer.add_callback(StepTimer())  # the last callback: the trainer's own (SDPO's EMA update) end inside the step
    rollout = getattr(trainer, side.rollout)

    def timed_rollout(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        out = rollout(*a, **k)
        trl_rollout.append(time.perf_counter() - t0)
        return out

    setattr(trainer, side.rollout, timed_rollout)
    with TeacherPromptTokens() as ours_teacher:
        trainer.train()
    if not turns.stage.dead:
        raise RuntimeError(f"adaptercl's stage did not finish with TRL's {total} steps: {order}")
    if order != ["trl", "adaptercl"] * total:
        raise RuntimeError(f"the two systems did not alternate step by step: {order}")
    rows = [r for r in map(json.loads, (ctx.stage_dir / "metrics.jsonl").read_text().splitlines()) if "event" not in r]
    if WORKLOADS[args.workload][2]:
        check_fixed_lengths(args.max_new_tokens, [r["response_len_mean"] for r in rows], trainer.completion_lengths)
    result = timing_result(args, rows, trl_times, trl_rollout, trainer.completion_lengths)
    result = {
        "method": args.method,
        "model": args.model,
        "model_path": portable_path(model_path),
        "model_folder": portable_path(model_note),
        "workload": workload_record(args, ctx),
        **result,
        "trl_activation_checkpointing": bool(trainer.args.gradient_checkpointing)
        or bool(getattr(trainer.model.get_base_model(), "is_activation_checkpointing", False)),
        "attn_implementation": {
            "adaptercl": ctx.model.get_base_model().config._attn_implementation,
            "trl": trainer.model.get_base_model().config._attn_implementation,
        },
    }
    if args.method == "sdpo":
        result |= sdpo_record(ctx, trainer, rows, ours_teacher.per_step)
    return result


def timing_result(
    args: argparse.Namespace, rows: list[dict], trl_times: list[float], trl_rollout: list[float], trl_steps: list
) -> dict[str, Any]:
    """Step, rollout and training times of both sides (warm-up left out), their ratios, the rollout time per
    generated token and the completion lengths. rows: adaptercl's metrics.jsonl steps; trl_steps: TRL's completion
    lengths [steps][rows]."""
    w = args.warmup
    ours, ours_rollout = [r["time_step_s"] for r in rows][w:], [r["time_rollout_s"] for r in rows][w:]
    theirs, theirs_rollout = trl_times[w:], trl_rollout[w:]
    trl_lengths = [n for step in trl_steps for n in step]
    rows_per_step = args.prompts_per_step * args.group_size
    ours_tokens = [r["response_len_mean"] * rows_per_step for r in rows][w:]
    theirs_tokens = [sum(step) for step in trl_steps][w:]
    per_token = {
        "adaptercl": spread(ms_per_token(ours_rollout, ours_tokens)),
        "trl": spread(ms_per_token(theirs_rollout, theirs_tokens)),
    }
    ours_training = [s - r for s, r in zip(ours, ours_rollout)]
    theirs_training = [s - r for s, r in zip(theirs, theirs_rollout)]
    return {
        "completion_len": {
            "adaptercl_mean": statistics.fmean(r["response_len_mean"] for r in rows),
            "adaptercl_batch_max_mean": statistics.fmean(r["response_len_max"] for r in rows),
            "trl_mean": statistics.fmean(trl_lengths) if trl_lengths else None,
            "trl_min": min(trl_lengths, default=None),
            "trl_max": max(trl_lengths, default=None),
        },
        "fixed_length_ok": True if WORKLOADS[args.workload][2] else None,  # else refused (check_fixed_lengths)
        "adaptercl_step_s": spread(ours),
        "trl_step_s": spread(theirs),
        "adaptercl_rollout_s": spread(ours_rollout),
        "trl_rollout_s": spread(theirs_rollout),
        "adaptercl_training_s": spread(ours_training),
        "trl_training_s": spread(theirs_training),
        "ratio_of_medians": statistics.median(ours) / statistics.median(theirs),
        "paired_ratio": spread([a / b for a, b in zip(ours, theirs)]),
        "training_ratio_of_medians": statistics.median(ours_training) / statistics.median(theirs_training),
        "rollout_ms_per_token": per_token,
        "rollout_per_token_ratio": per_token["adaptercl"]["median"] / per_token["trl"]["median"],
        "raw": {
            "adaptercl_step_s": ours,
            "trl_step_s": theirs,
            "adaptercl_rollout_s": ours_rollout,
            "trl_rollout_s": theirs_rollout,
            "adaptercl_rollout_tokens": ours_tokens,
            "trl_rollout_tokens": theirs_tokens,
        },
    }


def sdpo_record(ctx, trainer, rows: list[dict], ours_prompt_tokens: list[float]) -> dict:
    """The SDPO result's extra keys: both sides' distillation settings, their teacher work per step (share of rows
    with a target, mean teacher prompt tokens per row) and the differences that remain."""
    distill = ctx.stage.distill
    trl = trainer.args
    trl_keys = ("distillation_weight", "distillation_mode", "distillation_topk", "distillation_add_tail")
    trl_keys += ("distillation_alpha", "distillation_is_clip", "teacher_model_kind", "teacher_update_rate")
    trl_keys += ("teacher_sync_steps", "success_reward_threshold", "max_prompt_length")
    return {
        "settings": {
            "adaptercl": distill.model_dump(
                mode="json", include={"alpha", "support", "topk", "tail", "aggregation", "is_cap", "success_threshold"}
            )
            | {"teacher": distill.teacher.model_dump(mode="json", include={"kind", "tau", "ema_rank"})},
            "trl": {k: getattr(trl, k) for k in trl_keys},
        },
        "teacher": {
            "adaptercl": {
                "rows_with_target": [r["teacher_target_frac"] for r in rows],
                "prompt_tokens_mean": ours_prompt_tokens,
            },
            "trl": {"rows_with_target": trainer.teacher_rows, "prompt_tokens_mean": trainer.teacher_prompt_tokens},
        },
        "differences": SDPO_DIFFERENCES,
    }


def markdown(result: dict[str, Any]) -> str:
    w = result["workload"]
    rows = []
    for name, key in (("adaptercl", "adaptercl"), (TRL_SIDES[result["method"]].name, "trl")):
        s, r, t = result[f"{key}_step_s"], result[f"{key}_rollout_s"], result[f"{key}_training_s"]
        per_token = result["rollout_ms_per_token"][key]["median"]
        spans = f"{s['q1']:.3f}-{s['q3']:.3f}", f"{s['min']:.3f}-{s['max']:.3f}"
        rows.append([name, s["median"], *spans, r["median"], t["median"], f"{per_token:.2f}"])
    p = result["paired_ratio"]
    prompts = f"{w.get('domain') or 'arithmetic'} prompts (mean {w['prompt_tokens']['mean']:.0f} tokens)"
    fixed = WORKLOADS[w["workload"]][2]
    tokens = f"{w['max_new_tokens']} tokens" + (" exactly" if fixed else " at most (natural length)")
    headers = ["system", "median s", "IQR s", "min-max s", "rollout median s", "training median s", "rollout ms/token"]
    return (
        f"### {result['method'].upper()} step time, {result['model']}, {w['workload']} workload: "
        f"{w['prompts_per_step']} {prompts} x {w['group_size']} samples x {tokens}, LoRA r{w['lora']['r']}, fp32 CPU "
        f"(adaptercl's rollouts {w['rollout_dtype']}), {w['timed_steps']} timed steps\n\n"
        + markdown_table(headers, rows)
        + f"\n\nadaptercl / TRL: ratio of medians {result['ratio_of_medians']:.3f}; paired per-step ratio median "
        f"{p['median']:.3f} (min {p['min']:.3f}, max {p['max']:.3f}); training part "
        f"{result['training_ratio_of_medians']:.3f}; rollout time per generated token "
        f"{result['rollout_per_token_ratio']:.3f}. Completion length: adaptercl "
        f"{result['completion_len']['adaptercl_mean']:.1f}, TRL {result['completion_len']['trl_mean']:.1f}."
        + ("" if fixed else NATURAL_LENGTH_NOTE)
        + "\n"
    )


def result_name(args: argparse.Namespace) -> str:
    """step_time-[sdpo-]<model>[-long|-long-fixed][-rollout-<dtype>]: GRPO's names are those of its committed files."""
    name = "step_time-" + ("" if args.method == "grpo" else f"{args.method}-") + Path(args.model).name
    name += "" if args.workload == "short" else f"-{args.workload}"
    return name + ("" if args.rollout_dtype == "float32" else f"-rollout-{args.rollout_dtype}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=sorted(TRL_SIDES), default="grpo", help="the method both systems train")
    add_workload_arguments(parser, prompts_per_step=2, max_new_tokens=None)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="short", help="see the module docstring")
    parser.add_argument("--domain", choices=sorted(LONG_DOMAINS), default="math", help="--workload long*: its prompts")
    parser.add_argument("--data", type=Path, default=DATA, help="the shared data folder (default ../shared/data)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument(
        "--rollout-dtype", choices=["float32", "bfloat16", "auto"], default="float32", help="adaptercl's rollout.dtype"
    )
    parser.add_argument("--warmup", type=int, default=2, help="steps of each system left out of the statistics")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each system")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/perf/results)")
    args = parser.parse_args()
    prompts, default_tokens, _ = WORKLOADS[args.workload]
    args.max_new_tokens = args.max_new_tokens or default_tokens
    if prompts == "arithmetic":
        args.domain = None
    if args.threads:
        torch.set_num_threads(args.threads)
    info = provenance()
    try:
        result = {**info, **run(args)}
    except LengthMismatch as refusal:
        print(refusal, file=sys.stderr)
        return 1
    path = write_result(result_name(args), result, args.out)
    print(markdown(result))
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
