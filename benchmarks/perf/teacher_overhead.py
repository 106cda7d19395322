"""Teacher overhead: the training time of sdpo, sdft and hybrid relative to grpo on one identical batch.

One batch of rollouts is sampled once (P prompts x G samples, fixed length: `min_new_tokens = max_new_tokens`) and
scored with a fixed success pattern: the first `--failed-group-frac` of the groups have no success, every other
group has one success (its first sample); failures carry the arithmetic reward's feedback string. Then, for each
method, on the same model (one student adapter per method, each with its own self-teacher made by
`teacher.kinds.create_teacher`, as `run_recipe` does), the script times what `train.stage.run_stage` does after the
reward:

- `targets`: `stage.distill_targets` (teacher prompts, tokenisation, the token mask; hybrid's sparse choice);
- `train`: `train.step.train_on_batch` (student forward, teacher forward under no_grad, losses, backward, clip,
  AdamW step);
- `teacher_update`: `Teacher.update` (the EMA of dW for sdpo/sdft; nothing for hybrid's stage-start teacher).

Methods run in a rotated order each repeat; `--warmup` repeats are left out. Each method's distillation settings
are the shipped recipes' `distill:` and `hybrid:` blocks (recipes/sdpo.yaml, sdft.yaml, hybrid.yaml); regularisers
are off everywhere. Each distillation method is also timed as `<method>+bf16`: the same settings with
`distill.teacher.autocast: bfloat16` (the teacher's no-grad forward under bf16 autocast; the student stays fp32),
in the same rotation, so both teacher precisions meet the same machine load. SDFT's config needs one sample per
prompt, so its stage is configured with group size 1 and the same N = P x G sequences count as N prompts (the
batch tensors are identical).

`--full-steps K` also runs K + 1 real `run_stage` steps per method (rollout included, first one left out) from
the same starting adapter, with a deterministic pseudo-reward (success iff crc32(text) % G == 0, so some groups
fail); SDFT gets P x G prompts x 1 sample so every method samples the same number of sequences. These runs are
sequential per method, not interleaved.

    python benchmarks/perf/teacher_overhead.py --model tiny-random
    python benchmarks/perf/teacher_overhead.py --model smollm2-135m-instruct --repeats 5 --full-steps 3

writes benchmarks/perf/results/teacher_overhead-<model>[-<tag>].json and prints a markdown table. SRPO's saving (its
teacher runs on the SDPO-routed rows only: with G samples, a group with one success routes its G - 1 failures, so
the share is (1 - failed_group_frac) (G - 1) / G) against SDPO's teacher on every row:

    python benchmarks/perf/teacher_overhead.py --model smollm2-135m-instruct --variants grpo sdpo srpo --tag srpo
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for the shared provenance.py

import yaml  # noqa: E402
from perf_common import HERE, add_workload_arguments, write_result  # noqa: E402
from provenance import markdown_table, provenance, spread  # noqa: E402

# variant -> (stage method, distill.teacher.autocast)
VARIANTS: dict[str, tuple[str, str]] = {
    "grpo": ("grpo", "none"),
    "sdpo": ("sdpo", "none"),
    "sdft": ("sdft", "none"),
    "hybrid": ("hybrid", "none"),
    "srpo": ("srpo", "none"),  # the method table's paper defaults; its teacher sees the SDPO-routed rows only
    "sdpo+bf16": ("sdpo", "bfloat16"),
    "sdft+bf16": ("sdft", "bfloat16"),
    "hybrid+bf16": ("hybrid", "bfloat16"),
}
RECIPES = {"sdpo": "sdpo.yaml", "sdft": "sdft.yaml", "hybrid": "hybrid.yaml"}  # under recipes/
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ALARMS = ("nonfinite", "divergence_collapse", "target_starvation", "repetition", "entropy_collapse")
MONITOR_OFF = {alarm: "off" for alarm in ALARMS}  # no rollbacks or stops while timing


def method_recipe(args: argparse.Namespace, variant: str, out_dir: Path, prompts: int, group: int, steps: int) -> Any:
    """A one-stage recipe of `variant`'s method with the shipped recipe's distill/hybrid blocks and the variant's
    teacher autocast (validated by adaptercl)."""
    from adaptercl.recipe.grammar import resolve_recipe

    method, autocast = VARIANTS[variant]
    blocks: dict[str, Any] = {}
    if method in RECIPES:
        shipped = yaml.safe_load((HERE.parent.parent / "recipes" / RECIPES[method]).read_text())
        blocks = {k: shipped[k] for k in ("distill", "hybrid") if k in shipped}
        distill = blocks.setdefault("distill", {})
        distill["teacher"] = {**distill.get("teacher", {}), "autocast": autocast}
    return resolve_recipe(
        {
            "model": {"name": args.model},
            "quantization": "none",
            "output_dir": str(out_dir),
            "seed": args.seed,
            "lora": {"r": args.rank, "alpha": 2 * args.rank, "dropout": 0.0, "target_modules": TARGET_MODULES},
            "rollout": {"group_size": group, "max_new_tokens": args.max_new_tokens, "batch_size": prompts * group},
            "optim": {"lr": 1e-5, "steps": steps, "prompts_per_step": prompts, "grad_accum": args.grad_accum},
            "monitor": {"checkpoint_every": 10**6, **MONITOR_OFF},
            **blocks,
            "domains": [{"name": "arithmetic", "source": "builtin:arithmetic"}],
            "stages": [{"name": method, "domain": "arithmetic", "method": method}],
            "eval": {"examples_per_domain": 1},
        }
    )


def sequences_layout(args: argparse.Namespace, variant: str) -> tuple[int, int]:
    """(prompts, group size) of a step: SDFT samples once per prompt, so it gets P x G prompts of one sample."""
    P, G = args.prompts_per_step, args.group_size
    return (P * G, 1) if VARIANTS[variant][0] == "sdft" else (P, G)


def method_context(args: argparse.Namespace, variant: str, model, tokenizer, domain, stage_dir: Path, steps: int):
    """Student adapter `stage_dir.name` with its teacher, optimiser and regularisers, set up as run_recipe does."""
    from adaptercl.adapters.live import attach_adapter, use_adapters
    from adaptercl.recipe.method_table import METHODS
    from adaptercl.rollout.hf import HFEngine
    from adaptercl.teacher.kinds import create_teacher
    from adaptercl.train.context import StageContext
    from adaptercl.train.regularizers import StageRegularizers
    from adaptercl.train.stage import make_optimizer

    stage_dir.mkdir(parents=True)
    prompts, group = sequences_layout(args, variant)
    recipe = method_recipe(args, variant, stage_dir, prompts, group, steps)
    student = stage_dir.name.replace("+", "-")  # a PEFT adapter name
    model = attach_adapter(model, student, recipe.stages[0].lora)
    use_adapters(model, [student], trainable=student)
    teacher = None
    if METHODS[VARIANTS[variant][0]].needs_teacher:
        teacher = create_teacher(model, student, [], recipe.stages[0].distill.teacher)
    engine = HFEngine(model, tokenizer, batch_size=prompts * group)
    ctx = StageContext(recipe, 0, model, tokenizer, engine, domain, student, [], stage_dir, teacher=teacher)
    optimizer = make_optimizer(ctx)
    regs = StageRegularizers.start(model, student, [], [], ctx.stage.regularizers)
    return ctx, optimizer, regs


def fixed_batch(args: argparse.Namespace, ctx, domain):
    """One batch of rollouts from the grpo student and the fixed success pattern (see the module docstring)."""
    import torch

    from adaptercl.domains import RewardResult
    from adaptercl.model.batching import build_batch, encode_chat
    from adaptercl.rollout import SamplingParams
    from adaptercl.train import losses

    P, G = args.prompts_per_step, args.group_size
    examples = domain.train[:P]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, n=G, seed=args.seed)
    groups = ctx.engine.generate([encode_chat(ctx.tokenizer, ex.messages) for ex in examples], [ctx.student], params)
    completions = [c for g in groups for c in g]
    samples = [ex for ex in examples for _ in range(G)]
    n_failed = int(args.failed_group_frac * P + 0.5)  # round half up
    results = []
    for i, (c, ex) in enumerate(zip(completions, samples)):
        if i // G >= n_failed and i % G == 0:
            results.append(RewardResult(1.0, True))
        else:
            results.append(RewardResult(0.0, False, domain.reward(c.text, ex).feedback or "The answer is incorrect."))
    rewards = torch.tensor([r.score for r in results])
    advantages = losses.group_advantages(rewards, G)
    pad = ctx.tokenizer.pad_token_id
    batch = build_batch([c.prompt_ids for c in completions], [c.token_ids for c in completions], pad)
    return samples, completions, results, batch, advantages


def method_contexts(args: argparse.Namespace, model, tokenizer, domain, work: Path) -> dict[str, tuple]:
    """`method_context` of every variant in `args.variants`, each in `work/<variant>`, on the one PeftModel."""
    setups = {}
    for m in args.variants:
        setups[m] = method_context(args, m, model, tokenizer, domain, work / m, 10**6)
        model = setups[m][0].model  # the PeftModel holding every adapter
    return setups


def load_workload(args: argparse.Namespace, work: Path):
    """The base model (fixed-length rollouts: EOS masked until max_new_tokens) and the arithmetic domain."""
    import torch

    from adaptercl.domains import load_domain
    from adaptercl.model.base import load_base

    probe = method_recipe(args, "grpo", work, 1, 2, 1)
    base = load_base(probe.model, "none", torch.device("cpu"))
    base.model.generation_config.min_new_tokens = args.max_new_tokens
    torch.manual_seed(args.seed)
    return base, load_domain(probe.domains[0], args.seed, 1)


def time_training(args: argparse.Namespace, model, tokenizer, domain, work: Path) -> tuple[dict[str, Any], Any]:
    """Every method trains on the same batch, `warmup + repeats` times in rotated order. Returns (results, model)."""
    from adaptercl.adapters.live import use_adapters
    from adaptercl.train.distill_targets import distill_targets
    from adaptercl.train.step import train_on_batch

    variants = args.variants
    setups = method_contexts(args, model, tokenizer, domain, work / "batch")
    model = setups["grpo"][0].model
    samples, completions, results, batch, advantages = fixed_batch(args, setups["grpo"][0], domain)
    parts = ("targets", "train", "teacher_update", "total")
    times: dict[str, dict[str, list[float]]] = {m: {k: [] for k in parts} for m in variants}
    stats: dict[str, dict[str, float]] = {}
    for rep in range(args.warmup + args.repeats):
        order = variants[rep % len(variants) :] + variants[: rep % len(variants)]
        for m in order:
            ctx, optimizer, regs = setups[m]
            use_adapters(model, [ctx.student], trainable=ctx.student)
            t0 = time.perf_counter()
            targets = distill_targets(ctx, rep, samples, completions, results, batch) if ctx.teacher else None
            t1 = time.perf_counter()
            model.train()
            train_stats = train_on_batch(ctx, batch, advantages, optimizer, targets, None, regs)
            t2 = time.perf_counter()
            if ctx.teacher is not None:
                ctx.teacher.update(model)
            t3 = time.perf_counter()
            if rep >= args.warmup:
                for key, value in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                    times[m][key].append(value)
            stats[m] = {**(targets.stats if targets is not None else {}), "loss": train_stats.get("loss", 0.0)}
    grpo = times["grpo"]["total"]
    out: dict[str, Any] = {
        "batch": {
            "sequences": len(completions),
            "response_tokens": int(batch.response_mask.sum()),
            "prompt_width": batch.input_ids.shape[1] - batch.response_ids.shape[1],
            "successes": sum(r.correct for r in results),
        }
    }
    for m in variants:
        out[m] = {
            **{f"{k}_s": spread(v) for k, v in times[m].items()},
            "ratio_to_grpo_of_medians": statistics.median(times[m]["total"]) / statistics.median(grpo),
            "ratio_to_grpo_paired": spread([a / b for a, b in zip(times[m]["total"], grpo)]),
            "batch_stats": stats[m],
        }
    return out, model


def time_full_steps(args: argparse.Namespace, model, tokenizer, domain, work: Path) -> dict[str, Any]:
    """`--full-steps` + 1 real run_stage steps per method (the first left out); time_step_s from metrics.jsonl."""
    from adaptercl.adapters.live import use_adapters
    from adaptercl.domains import Domain, RewardResult
    from adaptercl.train.stage import run_stage

    G = args.group_size

    def pseudo_reward(text: str, _example: Any) -> RewardResult:
        ok = zlib.crc32(text.encode()) % G == 0
        return RewardResult(float(ok), ok, None if ok else "The answer is incorrect.")

    pseudo = Domain(domain.name, domain.train, domain.eval, pseudo_reward, [])
    out: dict[str, Any] = {}
    for m in args.variants:
        steps = args.full_steps + 1
        ctx, optimizer, _ = method_context(args, m, model, tokenizer, pseudo, work / f"full-{m}", steps)
        model = ctx.model
        use_adapters(model, [ctx.student], trainable=ctx.student)
        run_stage(ctx, optimizer=optimizer)
        rows = [json.loads(line) for line in (ctx.stage_dir / "metrics.jsonl").read_text().splitlines()][1:]
        out[m] = {
            "step_s": spread([r["time_step_s"] for r in rows]),
            "rollout_s": spread([r["time_rollout_s"] for r in rows]),
            "teacher_target_frac": statistics.fmean(r.get("teacher_target_frac", 0.0) for r in rows),
            "distill_token_frac": statistics.fmean(r.get("distill_token_frac", 0.0) for r in rows),
            "response_len_mean": statistics.fmean(r["response_len_mean"] for r in rows),
        }
    for m in args.variants:
        out[m]["ratio_to_grpo_of_medians"] = out[m]["step_s"]["median"] / out["grpo"]["step_s"]["median"]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="adaptercl-teacher-overhead-") as tmp:
        return run_in(args, Path(tmp))


def run_in(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    base, domain = load_workload(args, work)
    settings = {}
    for m in args.variants[1:]:
        stage = method_recipe(args, m, work, 1, 1 if VARIANTS[m][0] == "sdft" else 2, 1).stages[0]
        settings[m] = stage.model_dump(include={"distill", "hybrid"}, mode="json")
    keys = ("prompts_per_step", "group_size", "max_new_tokens", "rank", "grad_accum", "failed_group_frac")
    result: dict[str, Any] = {
        "model": args.model,
        "workload": {k: getattr(args, k) for k in keys} | {"warmup": args.warmup, "repeats": args.repeats},
        "variants": {m: {"method": VARIANTS[m][0], "teacher_autocast": VARIANTS[m][1]} for m in args.variants},
        "method_settings": settings,
    }
    result["same_batch"], model = time_training(args, base.model, base.tokenizer, domain, work)
    if args.full_steps > 0:
        result["full_step"] = time_full_steps(args, model, base.tokenizer, domain, work)
    return result


def markdown(result: dict[str, Any]) -> str:
    w, same = result["workload"], result["same_batch"]
    rows = []
    for m in result["variants"]:
        r = same[m]
        full = result.get("full_step", {}).get(m)
        rows.append(
            [
                m,
                r["total_s"]["median"],
                f"{r['total_s']['min']:.3f}-{r['total_s']['max']:.3f}",
                r["targets_s"]["median"],
                r["train_s"]["median"],
                r["teacher_update_s"]["median"],
                r["ratio_to_grpo_of_medians"],
                r["batch_stats"].get("distill_token_frac", "-"),
                "-" if full is None else f"{full['step_s']['median']:.3f} ({full['ratio_to_grpo_of_medians']:.2f}x)",
            ]
        )
    headers = ["method", "median s", "min-max s", "targets s", "train s", "teacher upd s", "x grpo", "distilled"]
    headers.append("full step median s (x grpo)")
    return (
        f"### Teacher overhead, {result['model']}: {same['batch']['sequences']} sequences x {w['max_new_tokens']} "
        f"tokens, LoRA r{w['rank']}, grad_accum {w['grad_accum']}, {w['repeats']} repeats\n\n"
        + markdown_table(headers, rows)
        + "\n"
    )


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the batch every method trains on."""
    add_workload_arguments(parser)
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--failed-group-frac", type=float, default=0.5, help="share of groups without a success")
    parser.add_argument("--seed", type=int, default=0)


def grpo_first(variants: list[str]) -> list[str]:
    """The variants without repeats, GRPO first: it is the baseline, and its student samples the batch."""
    return ["grpo"] + [v for v in dict.fromkeys(variants) if v != "grpo"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_arguments(parser)
    parser.add_argument("--warmup", type=int, default=1, help="rounds over all methods left out")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds over all methods")
    parser.add_argument("--full-steps", type=int, default=0, help="also time this many full run_stage steps")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    parser.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), help="what to time (grpo always)"
    )
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/perf/results)")
    parser.add_argument("--tag", default=None, help="appended to the result's name: teacher_overhead-<model>-<tag>")
    args = parser.parse_args()
    args.variants = grpo_first(args.variants)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    result = {**provenance(), **run(args)}
    name = "teacher_overhead-" + Path(args.model).name + (f"-{args.tag}" if args.tag else "")
    path = write_result(name, result, args.out)
    print(markdown(result))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
