"""GPU memory and time of one training step on a Qwen2.5-7B-shaped NF4 base: goal <= 16 GiB (hybrid, 8 x 1024).

No download: a random-weight checkpoint with the exact Qwen2.5-7B-Instruct shape (Qwen2, hidden 3584, MLP 18944,
28 layers, 28 query / 4 key-value heads, head dim 128, vocab 152064, untied embeddings, RoPE theta 1e6, RMSNorm eps
1e-6, q/k/v biases) is written once in bfloat16 safetensors shards (~15 GB, one ~2 GB shard in memory at a time)
with adaptercl's byte-level ChatML tokenizer, then loaded by adaptercl's own `model.base.load_base(..., "nf4")` (NF4,
double quant, bf16 compute, lm_head and embeddings bf16, as for the real model). The step is adaptercl's:
`adapters.live.attach_adapter` (LoRA r16 / alpha 32 on q,k,v,o,gate,up,down by default), `teacher.kinds.create_teacher`
(hybrid: a frozen stage-start copy of the adapter on the same base), then exactly what `train.stage.run_stage` does
after the reward: `model.train()`, `train.step.train_on_batch` (student forward and backward per micro-batch, the
teacher forward under no_grad on the teacher prompts, the GRPO and distillation losses) and
`Teacher.update`. The batch is synthetic and of fixed length: `--sequences` rows of `--prompt-len` prompt tokens
and `--response-len` response tokens (default 8 x (128 + 896) = 8 x 1024), random rewards -> advantages, every
row distilled (`--distill-frac`), teacher prompts `--teacher-extra` tokens longer (a demonstration). Method
settings are the shipped recipes' `distill:` / `hybrid:` blocks (recipes/<method>.yaml); the memory knobs are
`--grad-accum` (micro-batches), `--activation-checkpointing` and `--logits-chunk-size` (optim.*; auto = on for CUDA).
`--variants method:grad_accum:checkpointing:chunk ...` measures several settings one after another on one loaded
base (each variant's adapters are removed before the next; an out-of-memory variant is recorded and skipped).

Measured with torch.cuda.max_memory_allocated / max_memory_reserved (reset before each step) and synchronised wall
time; `--warmup` steps (the first builds AdamW's state) are reported but left out of the timing summary.
`--rollout` also times one `HFEngine.generate` of the batch's shape (full length forced).

    python benchmarks/perf/cuda_7b_memory.py                                   # CUDA + bitsandbytes
    python benchmarks/perf/cuda_7b_memory.py --grad-accum 4 --method sdpo --rollout
    python benchmarks/perf/cuda_7b_memory.py --tiny                            # CPU structure check, no NF4
    python benchmarks/perf/cuda_7b_memory.py --variants hybrid:8:true:auto hybrid:8:false:off hybrid:1:true:auto

writes benchmarks/perf/results/cuda_7b_memory[-tiny].json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for the shared provenance.py

from perf_common import HERE, write_result  # noqa: E402
from provenance import markdown_table, provenance, spread  # noqa: E402
from random_checkpoint import QWEN25_7B, TINY, write_random_checkpoint  # noqa: E402

from adaptercl.model.shapes import GIB  # noqa: E402

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def variant_recipe(args: argparse.Namespace, checkpoint: Path, device: Any) -> Any:
    """The recipe of one measured variant: the shipped recipe's `distill:`/`hybrid:`/`srpo:` blocks for the method,
    the workload's shape, and the variant's memory settings (grad_accum, activation checkpointing, logits chunks)."""
    import yaml

    from adaptercl.recipe.grammar import resolve_recipe
    from adaptercl.recipe.method_table import METHODS

    blocks: dict[str, Any] = {}
    recipe_file = HERE.parent.parent / "recipes" / f"{args.method}.yaml"
    if METHODS[args.method].needs_teacher and recipe_file.is_file():
        shipped = yaml.safe_load(recipe_file.read_text())
        blocks = {k: shipped[k] for k in ("distill", "hybrid", "srpo") if k in shipped}
    if args.support:
        blocks.setdefault("distill", {})["support"] = args.support
    group = 1 if args.method == "sdft" else args.sequences
    return resolve_recipe(
        {
            "model": {"name": str(checkpoint), "dtype": "bfloat16" if device.type == "cuda" else "float32"},
            "quantization": args.quantization,
            "output_dir": str(Path(tempfile.gettempdir()) / "adaptercl-7b-unused"),  # nothing is written there
            "lora": {"r": args.rank, "alpha": 2 * args.rank, "dropout": 0.0, "target_modules": TARGET_MODULES},
            "rollout": {"group_size": group, "max_new_tokens": args.response_len, "batch_size": args.sequences},
            "optim": {
                "lr": 1e-5,
                "steps": 10**6,
                "prompts_per_step": args.sequences // group,
                "grad_accum": args.grad_accum,
                "activation_checkpointing": args.activation_checkpointing,
                "logits_chunk_size": args.logits_chunk_size,
            },
            **blocks,
            "domains": [{"name": "synthetic", "source": "builtin:copy"}],
            "stages": [{"name": "bench", "domain": "synthetic", "method": args.method}],
        }
    )


def load(args: argparse.Namespace, checkpoint: Path, device: Any) -> tuple[Any, dict[str, Any]]:
    """The base, loaded once by adaptercl's own `model.base.load_base` (NF4 on CUDA), and what loading it cost."""
    from adaptercl.model.base import load_base

    recipe = variant_recipe(args, checkpoint, device)
    t0 = time.perf_counter()
    base = load_base(recipe.model, recipe.quantization, device)
    info = {"load_s": time.perf_counter() - t0, "model_footprint_gib": base.model.get_memory_footprint() / GIB}
    return base, info | {"base_description": base.description}


def stage_setup(args: argparse.Namespace, recipe: Any, base: Any, model: Any) -> tuple[Any, Any, dict[str, Any]]:
    """Student adapter, teacher, optimiser on the loaded base, as run_recipe + run_stage set them up. `model` is the
    base model or the PeftModel an earlier variant left (its adapters deleted)."""
    from adaptercl.adapters.live import attach_adapter, lora_parameters, use_adapters
    from adaptercl.recipe.method_table import METHODS
    from adaptercl.teacher.kinds import create_teacher
    from adaptercl.train.context import StageContext
    from adaptercl.train.regularizers import StageRegularizers
    from adaptercl.train.stage import make_optimizer

    model = attach_adapter(model, "student", recipe.stages[0].lora)
    use_adapters(model, ["student"], trainable="student")
    teacher = None
    if METHODS[args.method].needs_teacher:
        teacher = create_teacher(model, "student", [], recipe.stages[0].distill.teacher)
    info = {"trainable_parameters": sum(p.numel() for p in lora_parameters(model, "student").values())}
    info["lora_dtype"] = str(next(iter(lora_parameters(model, "student").values())).dtype)
    ctx = StageContext(recipe, 0, model, base.tokenizer, None, None, "student", [], Path(recipe.output_dir))
    ctx.teacher = teacher
    optimizer = make_optimizer(ctx)
    regs = StageRegularizers.start(model, "student", [], [], ctx.stage.regularizers)
    info["settings"] = ctx.stage.model_dump(include={"lora", "optim", "grpo", "distill", "hybrid"}, mode="json")
    return ctx, (optimizer, regs), info


def synthetic_batch(args: argparse.Namespace, tokenizer, device: Any) -> tuple[Any, Any, Any]:
    """Fixed-length student batch, advantages and distillation targets (every `--distill-frac` row distilled)."""
    import torch

    from adaptercl.model.batching import build_batch
    from adaptercl.train import losses
    from adaptercl.train.distill_targets import DistillTargets

    g = torch.Generator().manual_seed(0)
    n, vocab = args.sequences, len(tokenizer)

    def tokens(length: int) -> list[int]:
        return torch.randint(0, vocab, (length,), generator=g).tolist()

    group_of = getattr(args, "group", 1)  # rows side by side that share one prompt (a GRPO group), 1: all distinct
    distinct = [tokens(args.prompt_len) for _ in range(math.ceil(n / group_of))]
    prompts = [distinct[i // group_of] for i in range(n)]
    responses = [tokens(args.response_len) for _ in range(n)]
    batch = build_batch(prompts, responses, tokenizer.pad_token_id)
    group = 1 if args.method == "sdft" else n
    rewards = torch.randint(0, 2, (n,), generator=g).float()
    advantages = losses.group_advantages(rewards, group) if group > 1 else rewards - 0.5
    teacher_prompts = [p + tokens(args.teacher_extra) for p in prompts]
    teacher_batch = build_batch(teacher_prompts, responses, tokenizer.pad_token_id)
    rows = torch.arange(n) < math.ceil(args.distill_frac * n)
    targets = DistillTargets(teacher_batch, batch.response_mask * rows[:, None].float(), {}, rows.tolist())
    return batch.to(device), advantages.to(device), targets.to(device)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Load the base once, then measure each variant of `--variants` (default: the one the flags give) on it."""
    import torch

    device = torch.device("cpu" if args.tiny else "cuda")
    shape = TINY if args.tiny else QWEN25_7B
    t0 = time.perf_counter()
    checkpoint = write_random_checkpoint(shape, Path(args.checkpoint_dir), "cuda" if device.type == "cuda" else "cpu")
    write_s = time.perf_counter() - t0
    base, load_info = load(args, checkpoint, device)
    model, variants = base.model, []
    for spec in args.variants or [None]:
        v_args = apply_variant(args, spec)
        result, model = run_variant(v_args, checkpoint, base, model, device)
        result["variant"] = spec
        variants.append(result)
        print(json.dumps({k: result.get(k) for k in ("variant", "peak_allocated_gib", "peak_reserved_gib")}))
        summary = {"shape": shape, "checkpoint": str(checkpoint), "checkpoint_write_s": write_s, "load": load_info}
        args.write_partial(summary | {"variants": variants})  # what is measured survives a later failure or kill
    return summary | {"variants": variants}


def apply_variant(args: argparse.Namespace, spec: str | None) -> argparse.Namespace:
    """`method:grad_accum:activation_checkpointing:logits_chunk_size`, e.g. `hybrid:8:true:auto` (None: the flags)."""
    if spec is None:
        return args
    method, grad_accum, checkpointing, chunk = spec.split(":")
    out = argparse.Namespace(**vars(args))
    out.method, out.grad_accum = method, int(grad_accum)
    out.activation_checkpointing = {"true": True, "false": False}.get(checkpointing, checkpointing)
    out.logits_chunk_size = int(chunk) if chunk.isdigit() else chunk
    return out


def drop_adapters(model: Any) -> Any:
    """Delete every adapter a variant attached (student, teacher) and free the device memory it held."""
    import gc

    import torch

    if hasattr(model, "peft_config"):
        model = model.unload()  # the base model without any LoRA layer; the next variant wraps it again
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return model


def measure_steps(args, ctx, optimizer, regs, batch, advantages, targets, cuda: bool, steps: list) -> None:
    """`--warmup` + `--steps` training steps as run_stage makes them; each step's time and peak memory into `steps`."""
    import torch

    from adaptercl.train.step import train_on_batch

    for i in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        ctx.model.train()
        stats = train_on_batch(ctx, batch, advantages, optimizer, targets if ctx.teacher else None, None, regs)
        if ctx.teacher is not None:
            ctx.teacher.update(ctx.model)
        if cuda:
            torch.cuda.synchronize()
        step = {"step": i + 1, "warmup": i < args.warmup, "time_s": time.perf_counter() - t0}
        step |= {k: stats[k] for k in ("loss", "grad_norm", "distill_loss") if k in stats}
        if cuda:
            step["max_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
            step["max_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        steps.append(step)
        print(json.dumps(step), flush=True)


def run_variant(args: argparse.Namespace, checkpoint: Path, base: Any, model: Any, device: Any) -> tuple[dict, Any]:
    """One variant on the loaded base; returns its result and the base again (its adapters removed)."""
    import torch

    cuda = device.type == "cuda"
    recipe = variant_recipe(args, checkpoint, device)
    ctx, (optimizer, regs), info = stage_setup(args, recipe, base, model)
    batch, advantages, targets = synthetic_batch(args, base.tokenizer, device)
    if cuda:
        info["allocated_after_setup_gib"] = torch.cuda.memory_allocated() / GIB
    steps: list[dict[str, Any]] = []
    try:
        measure_steps(args, ctx, optimizer, regs, batch, advantages, targets, cuda, steps)
    except torch.cuda.OutOfMemoryError as err:  # recorded; the adapters go and the next variant runs
        model = ctx.model
        del ctx, optimizer, regs, batch, advantages, targets
        return {"out_of_memory": str(err).splitlines()[0], "setup": info}, drop_adapters(model)
    timed = [s for s in steps if not s["warmup"]]
    result = {
        "workload": {k: getattr(args, k) for k in ("method", "sequences", "prompt_len", "response_len")}
        | {k: getattr(args, k) for k in ("teacher_extra", "distill_frac", "grad_accum", "rank", "quantization")}
        | {k: getattr(args, k) for k in ("activation_checkpointing", "logits_chunk_size")},
        "setup": info,
        "steps": steps,
        "step_time_s": spread([s["time_s"] for s in timed]),
    }
    if cuda:
        result["peak_allocated_gib"] = max(s["max_allocated_gib"] for s in steps)
        result["peak_reserved_gib"] = max(s["max_reserved_gib"] for s in steps)
        result["within_10_gib"] = result["peak_reserved_gib"] <= 10.0
    result["process_peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
    if args.rollout:
        result["rollout"] = time_rollout(args, ctx, base.tokenizer, cuda)
    model = ctx.model
    del ctx, optimizer, regs, batch, advantages, targets
    return result, drop_adapters(model)


def time_rollout(args: argparse.Namespace, ctx, tokenizer, cuda: bool) -> dict[str, Any]:
    """One HFEngine.generate of the batch's shape: sequences x response_len new tokens (EOS masked)."""
    import torch

    from adaptercl.rollout import SamplingParams
    from adaptercl.rollout.hf import HFEngine

    ctx.model.get_base_model().generation_config.min_new_tokens = args.response_len
    group = 1 if args.method == "sdft" else args.sequences
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, len(tokenizer), (args.prompt_len,), generator=g).tolist()]
    prompts *= args.sequences // group
    params = SamplingParams(max_new_tokens=args.response_len, n=group, seed=0)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = HFEngine(ctx.model, tokenizer, batch_size=args.sequences).generate(prompts, ["student"], params)
    if cuda:
        torch.cuda.synchronize()
    result = {"time_s": time.perf_counter() - t0, "tokens": sum(len(c.token_ids) for g in out for c in g)}
    if cuda:
        result["max_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        result["max_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    return result


def markdown(result: dict[str, Any]) -> str:
    """One table row per variant."""
    rows = []
    for v in result["variants"]:
        if "out_of_memory" in v:
            rows.append([v["variant"], "out of memory", "-", "-"])
            continue
        w, t = v["workload"], v["step_time_s"]
        label = (
            v["variant"] or f"{w['method']}:{w['grad_accum']}:{w['activation_checkpointing']}:{w['logits_chunk_size']}"
        )
        rows.append([label, v.get("peak_allocated_gib", "-"), v.get("peak_reserved_gib", "-"), f"{t['median']:.2f}"])
    shape = result["shape"]
    return (
        f"### one training step, hidden {shape['hidden_size']} x {shape['num_hidden_layers']} layers, base loaded in "
        f"{result['load']['load_s']:.0f} s ({result['load']['model_footprint_gib']:.2f} GiB)\n\n"
        + markdown_table(
            ["method:grad_accum:checkpointing:chunk", "peak alloc GiB", "peak reserved GiB", "step s"], rows
        )
        + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer Qwen2 on CPU: checks the code path only")
    parser.add_argument("--method", default="hybrid", choices=["grpo", "sdpo", "sdft", "hybrid", "srpo"])
    parser.add_argument(
        "--support", default=None, choices=["full", "topk", "sampled"], help="override distill.support"
    )
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--group", type=int, default=1, help="consecutive sequences sharing one prompt (1: none)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--response-len", type=int, default=896)
    parser.add_argument("--teacher-extra", type=int, default=256, help="extra teacher-prompt tokens (demonstration)")
    parser.add_argument(
        "--distill-frac",
        type=float,
        default=1.0,
        help="share of rows with a distillation target (srpo: routed to SDPO)",
    )
    parser.add_argument("--grad-accum", type=int, default=8, help="micro-batches per step (8: one sequence each)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--quantization", default=None, choices=["nf4", "none"], help="default nf4 (none with --tiny)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rollout", action="store_true", help="also time one generate of the batch's shape")
    parser.add_argument("--activation-checkpointing", default="auto", help="optim.activation_checkpointing")
    parser.add_argument("--logits-chunk-size", default="auto", help="optim.logits_chunk_size (auto, off or an int)")
    parser.add_argument(
        "--variants",
        nargs="*",
        default=None,
        help="method:grad_accum:checkpointing:chunk specs measured one after another on one loaded base",
    )
    parser.add_argument("--checkpoint-dir", default=None, help="where the random checkpoint is written (reused)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/perf/results)")
    args = parser.parse_args()
    args.quantization = args.quantization or ("none" if args.tiny else "nf4")
    args.activation_checkpointing = {"true": True, "false": False}.get(
        args.activation_checkpointing, args.activation_checkpointing
    )
    if args.logits_chunk_size.isdigit():
        args.logits_chunk_size = int(args.logits_chunk_size)
    if args.tiny:
        for key, value in (("sequences", 4), ("prompt_len", 16), ("response_len", 24), ("teacher_extra", 8)):
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
        args.grad_accum = min(args.grad_accum, args.sequences)
    import torch

    if not args.tiny and not torch.cuda.is_available():
        sys.exit("cuda_7b_memory: no CUDA device (torch.cuda.is_available() is False); --tiny checks the code on CPU")
    if args.quantization == "nf4" and importlib.util.find_spec("bitsandbytes") is None:
        sys.exit("cuda_7b_memory: bitsandbytes is not installed; NF4 needs it (pip install bitsandbytes)")
    default_dir = "adaptercl-qwen2-tiny-random" if args.tiny else "adaptercl-qwen2.5-7b-random"
    args.checkpoint_dir = args.checkpoint_dir or str(Path(tempfile.gettempdir()) / default_dir)
    name = "cuda_7b_memory" + ("-tiny" if args.tiny else "")
    prov = provenance()
    args.write_partial = lambda payload: write_result(name, {**prov, **payload, "complete": False}, args.out)
    result = {**prov, **run(args), "complete": True}
    path = write_result(name, result, args.out)
    print(markdown(result))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
