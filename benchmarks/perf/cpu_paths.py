"""Which CPU path is faster on this machine, and what bf16 rollouts cost in mismatch: the evidence behind
`system/cpu_kernels.py` (MKL's branch), `rollout/packed_weights.py` (oneDNN packed vs plain) and `rollout.dtype`.

Candidates are compared interleaved (A, B, C, A, B, C, ... one thread), so machine load falls on all alike; each
reports the median of the per-round paired ratios to the reference. Parts (`--part`, default all):

- `mkl`: MKL's AVX2 branch against its own, in two child processes taking turns
  (`cpu_kernels.measure_mkl_branches` with `--rounds`), on a training step's products; or, where MKL ignores
  `MKL_CBWR=AVX2` (its AMD CPUs), the mode it reported (nothing to compare).
- `decode`: the hf engine's sampled rollout (`HFEngine.generate`, the quickstart's LoRA on SmolLM2-135M) per
  variant: `float32-plain` (oneDNN off, `torch.backends.mkldnn.flags(enabled=False)`: MKL's sgemm), `float32-packed`
  (the default), `bfloat16-packed` (`rollout.dtype: bfloat16`); every row forced to `--tokens` new tokens
  (`min_new_tokens`), so every variant decodes the same tokens' worth of work. Reference: float32-packed.
- `train`: a training step's products through a frozen linear layer (LoRA's base, the LM head) on SmolLM2's shapes,
  forward and the input's gradient (`y = layer(x); y.backward(g)`, `--prompts x --group x --tokens` rows), as
  `plain` (F.linear: MKL's sgemm) and `packed` (inside `packed_linears`: what `run_stage` runs since issue 46, the
  packing itself outside the timing, as a stage packs once). Reference: plain.
- `choice`: the measurement a run makes to decide whether the packs pay here (`rollout/packed_choice.measure`, for
  the decode's 8-row products and for whole sequences' forward and input gradient, `--rounds` turns) and what it
  chooses, at one thread and at two.
- `mismatch`: the rollouts of the quickstart's first `--steps` steps (its arithmetic prompts, 4 x 6 rows, 24 tokens,
  T 1) sampled on bf16 weights, their sampler logprobs against the trainer's float32 ones (`hf.response_logprobs`,
  what the trainer computes): mean |log ratio| per token and the spread of the rollout IS weight the trainer applies,
  min(exp(logp_trainer - logp_rollout), 2) (`train/loss_terms.py`). `--adapter` loads a trained adapter (a quickstart
  run's `stage-01-arithmetic/adapter`) instead of the fresh one (B = 0: the base policy).

    python benchmarks/perf/cpu_paths.py                      # all parts, the quickstart's shapes
    python benchmarks/perf/cpu_paths.py --part decode --prompts 2 --group 4 --tokens 256   # the long workload's

writes benchmarks/perf/results/cpu_paths-<cpu>.json and prints a markdown summary, with the CPU's model and flags.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for the shared provenance.py

from perf_common import name_part, write_result  # noqa: E402
from provenance import ISA_FLAGS, markdown_table, provenance, spread  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DECODE_VARIANTS = ("float32-plain", "float32-packed", "bfloat16-packed")
TRAIN_SHAPES = {"q/o": (576, 576), "gate/up": (1536, 576), "down": (576, 1536), "lm_head": (49152, 576)}  # [out, in]
REFERENCE = "float32-packed"


def cpu_summary() -> dict[str, Any]:
    """The CPU's model, vendor, the flags that decide these paths, and torch's kernel capability."""
    import torch

    from adaptercl.system.cpu_kernels import CPUINFO, bf16_units, cpu_fields

    text = CPUINFO.read_text() if CPUINFO.is_file() else ""
    cpu = cpu_fields(text)
    return {
        "model": cpu["model"],
        "vendor": cpu["vendor"],
        "family": cpu["family"],
        "model_number": cpu["model_number"],
        "flags": [f for f in ISA_FLAGS if f in cpu["flags"]],
        "bf16_units": bf16_units(text),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl_cbwr": os.environ.get("MKL_CBWR"),
    }


def quickstart_setup(args: argparse.Namespace):
    """SmolLM2 (or --model) with the quickstart's LoRA as its one active adapter, and the quickstart's arithmetic
    prompts of its first `--steps` steps, chat-encoded (each `--group` times in the rollout)."""
    import torch

    from adaptercl.adapters.live import attach_adapter, load_adapter, use_adapters
    from adaptercl.domains import load_domain
    from adaptercl.model.base import load_base
    from adaptercl.model.batching import encode_chat
    from adaptercl.recipe.load import load_recipe
    from adaptercl.train.context import prompts_for_step

    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml", [f"model.name={args.model}"])
    stage = recipe.stages[0]
    domain = load_domain(recipe.domains[0], recipe.seed, recipe.eval.examples_per_domain)
    base = load_base(recipe.model, "none", torch.device("cpu"))
    torch.manual_seed(recipe.seed)
    if args.adapter:
        model = load_adapter(base.model, args.adapter, "policy")
    else:
        model = attach_adapter(base.model, "policy", stage.lora)
    use_adapters(model, ["policy"], trainable=None)
    model.eval()
    steps = [
        [encode_chat(base.tokenizer, domain.train[i].messages) for i in prompts_for_step(
            len(domain.train), args.prompts, recipe.seed, 0, step)]
        for step in range(args.steps)
    ]  # fmt: skip
    return model, base.tokenizer, steps


def engine_for(model, tokenizer, variant: str):
    import torch

    from adaptercl.rollout.hf import HFEngine

    dtype = torch.bfloat16 if variant.startswith("bfloat16") else torch.float32
    return HFEngine(model, tokenizer, batch_size=64, dtype=dtype)


def run_decode(args: argparse.Namespace, model, tokenizer, steps) -> dict[str, Any]:
    import torch

    from adaptercl.rollout import SamplingParams

    params = SamplingParams(args.tokens, temperature=1.0, n=args.group, seed=1, min_new_tokens=args.tokens)
    engines = {v: engine_for(model, tokenizer, v) for v in DECODE_VARIANTS}

    def one(variant: str) -> float:
        plain = torch.backends.mkldnn.flags(enabled=False) if variant.endswith("plain") else contextlib.nullcontext()
        t0 = time.perf_counter()
        with plain:
            engines[variant].generate(steps[0], None, params)
        return time.perf_counter() - t0

    for variant in DECODE_VARIANTS:  # warm-up: first calls allocate and build kernels
        one(variant)
    seconds: dict[str, list[float]] = {v: [] for v in DECODE_VARIANTS}
    for turn in range(args.rounds):
        order = DECODE_VARIANTS if turn % 2 == 0 else tuple(reversed(DECODE_VARIANTS))
        for variant in order:
            seconds[variant].append(one(variant))
    tokens = len(steps[0]) * args.group * args.tokens
    return {
        "rows": len(steps[0]) * args.group,
        "new_tokens": args.tokens,
        "seconds": {v: spread(s) for v, s in seconds.items()},
        "ms_per_token": {v: 1000 * statistics.median(s) / tokens for v, s in seconds.items()},
        "paired_ratio_to_reference": {
            v: statistics.median(a / b for a, b in zip(s, seconds[REFERENCE])) for v, s in seconds.items()
        },
        "raw": seconds,
    }


def run_train(args: argparse.Namespace) -> dict[str, Any]:
    """Per shape [out, in]: seconds of forward + input gradient, plain and packed, interleaved; the paired ratio."""
    import torch

    generator = torch.Generator().manual_seed(0)
    rows = args.prompts * args.group * args.tokens
    out: dict[str, Any] = {"rows": rows, "shapes": {}}
    for name, (n_out, n_in) in TRAIN_SHAPES.items():
        layer = torch.nn.Linear(n_in, n_out, bias=False).requires_grad_(False)
        x = torch.randn(rows, n_in, generator=generator).requires_grad_(True)  # [rows, in]
        upstream = torch.randn(rows, n_out, generator=generator)  # [rows, out]
        seconds = train_products(layer, x, upstream, args.rounds)
        ratios = [a / b for a, b in zip(seconds["packed"], seconds["plain"])]
        out["shapes"][f"{name} [{n_out}, {n_in}]"] = {
            "seconds": {v: spread(t) for v, t in seconds.items()},
            "paired_ratio_packed_to_plain": statistics.median(ratios),
        }
    return out


def train_products(layer, x, upstream, rounds: int) -> dict[str, list[float]]:
    """Seconds of `layer`'s forward and x's gradient, plain (F.linear) and packed, `rounds` interleaved turns each."""
    import torch.nn.functional as F

    from adaptercl.rollout.packed_weights import packed_linears

    def one(forward) -> float:
        t0 = time.perf_counter()
        forward(x).backward(upstream)
        x.grad = None
        return time.perf_counter() - t0

    variants = {"plain": lambda v: F.linear(v, layer.weight), "packed": layer}
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    with packed_linears(layer):
        for forward in variants.values():  # warm-up, and the packed W^T made at the first backward
            one(forward)
        for turn in range(rounds):
            for v in variants if turn % 2 == 0 else reversed(list(variants)):
                seconds[v].append(one(variants[v]))
    return seconds


def run_mismatch(args: argparse.Namespace, model, tokenizer, steps) -> dict[str, Any]:
    """The bf16 sampler's logprobs against the trainer's float32 ones, per token of every step's rollouts."""
    import torch

    from adaptercl.rollout import SamplingParams
    from adaptercl.rollout.hf import response_logprobs

    engine = engine_for(model, tokenizer, "bfloat16-packed")
    log_ratios: list[float] = []
    for step, prompts in enumerate(steps):
        params = SamplingParams(args.mismatch_tokens, temperature=1.0, n=args.group, seed=100 + step)
        rows = [c for group in engine.generate(prompts, None, params) for c in group]
        trainer = response_logprobs(model, rows, tokenizer.pad_token_id, temperature=1.0)
        for c, lp in zip(rows, trainer):
            log_ratios.extend(t - r for t, r in zip(lp, c.logprobs))  # log p_trainer - log p_rollout
    ratio = torch.tensor(log_ratios, dtype=torch.float64)  # [tokens]
    weight = ratio.exp().clamp(max=2.0)  # the trainer's rollout IS weight (is_cap 2)
    quantiles = torch.tensor([0.01, 0.05, 0.5, 0.95, 0.99], dtype=torch.float64)
    return {
        "tokens": len(log_ratios),
        "adapter": args.adapter or "fresh (B = 0)",
        "mean_abs_log_ratio": ratio.abs().mean().item(),
        "max_abs_log_ratio": ratio.abs().max().item(),
        "is_weight": {
            "mean": weight.mean().item(),
            "std": weight.std().item(),
            "quantiles_1_5_50_95_99": weight.quantile(quantiles).tolist(),
            "clipped_share": (ratio.exp() > 2.0).double().mean().item(),
        },
    }


def run_choice(args: argparse.Namespace) -> dict[str, Any]:
    """Per thread count (1, 2) and use: `packed_choice.measure`'s ratio and whether it keeps the packs."""
    import torch

    from adaptercl.rollout import packed_choice
    from adaptercl.rollout.packed_weights import packed_linears

    out: dict[str, Any] = {}
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            uses: dict[str, Any] = {}
            for use in packed_choice.USES:
                measured = packed_choice.measure(use, packed_linears, args.rounds)
                uses[use] = {
                    "ratio": measured["ratio"],
                    "packed": packed_choice.pays_from(measured),
                    "seconds": {path: spread(t) for path, t in measured["seconds"].items()},
                }
            out[f"{count} thread" + ("s" if count > 1 else "")] = uses
    finally:
        torch.set_num_threads(threads)
    return out


def markdown(result: dict[str, Any]) -> str:
    cpu = result["cpu"]
    family = f"family {cpu['family']} model {cpu['model_number']}; " if cpu.get("family") else ""
    flags = ", ".join(cpu["flags"])
    out = [f"### CPU paths on {cpu['model']} ({family}{flags}; torch {cpu['torch_cpu_capability']})\n"]
    if "mkl" in result:
        mkl = result["mkl"]
        line = f"MKL under MKL_CBWR=AVX2 computes in CNR:{mkl.get('effective')}"
        if "ratio" in mkl:
            line += (
                f"; AVX2 / MKL's own, median paired ratio {mkl['ratio']:.3f} over {len(mkl['seconds']['AVX2'])} turns"
            )
        out.append(line + ".\n")
    if "decode" in result:
        d = result["decode"]
        rows = [
            [v, f"{d['seconds'][v]['median']:.3f}", f"{d['ms_per_token'][v]:.3f}",
             f"{d['paired_ratio_to_reference'][v]:.3f}"]
            for v in DECODE_VARIANTS
        ]  # fmt: skip
        out.append(f"Sampled rollout, {d['rows']} rows x {d['new_tokens']} tokens:\n")
        out.append(markdown_table(["variant", "median s", "ms / token", f"paired ratio to {REFERENCE}"], rows) + "\n")
    if "train" in result:
        t = result["train"]
        rows = [
            [shape, f"{r['seconds']['plain']['median'] * 1000:.2f}", f"{r['seconds']['packed']['median'] * 1000:.2f}",
             f"{r['paired_ratio_packed_to_plain']:.3f}"]
            for shape, r in t["shapes"].items()
        ]  # fmt: skip
        out.append(f"A frozen layer's forward + input gradient, {t['rows']} rows:\n")
        out.append(
            markdown_table(["layer [out, in]", "plain ms", "packed ms", "paired ratio packed / plain"], rows) + "\n"
        )
    if "choice" in result:
        rows = [
            [threads, use, f"{r['seconds']['plain']['median'] * 1000:.2f}",
             f"{r['seconds']['packed']['median'] * 1000:.2f}", f"{r['ratio']:.3f}",
             "packed" if r["packed"] else "plain"]
            for threads, uses in result["choice"].items() for use, r in uses.items()
        ]  # fmt: skip
        out.append("The packs' measured choice (`rollout/packed_choice.py`), a turn's products:\n")
        out.append(markdown_table(["threads", "use", "plain ms", "packed ms", "paired ratio", "chosen"], rows) + "\n")
    if "mismatch" in result:
        m = result["mismatch"]
        w = m["is_weight"]
        out.append(
            f"bf16 rollouts against the float32 trainer ({m['tokens']} tokens, adapter {m['adapter']}): mean |log "
            f"ratio| {m['mean_abs_log_ratio']:.4f} (max {m['max_abs_log_ratio']:.3f}); IS weight mean "
            f"{w['mean']:.4f}, std {w['std']:.4f}, 1/5/50/95/99 % "
            f"{[round(q, 3) for q in w['quantiles_1_5_50_95_99']]}, clipped {w['clipped_share']:.4f}.\n"
        )
    return "\n".join(out)


def result_name(cpu_model: str, part: str = "all") -> str:
    """cpu_paths-<the CPU's model name, lower-case, runs of other characters as one dash>[-<part>]."""
    name = "cpu_paths-" + name_part(cpu_model)
    return name if part == "all" else f"{name}-{part}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["all", "mkl", "decode", "train", "choice", "mismatch"], default="all")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--adapter", default=None, help="a trained adapter folder (default: a fresh one, B = 0)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (the quickstart's 4)")
    parser.add_argument("--group", type=int, default=6, help="samples per prompt (the quickstart's 6)")
    parser.add_argument("--tokens", type=int, default=24, help="decode: new tokens, exactly (the quickstart's 24)")
    parser.add_argument("--mismatch-tokens", type=int, default=24, help="mismatch: the cap (natural lengths)")
    parser.add_argument("--steps", type=int, default=4, help="mismatch: the quickstart steps whose prompts are used")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved turns of each candidate")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/perf/results)")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)  # per-core kernel speed; the candidates take turns on one core
    result: dict[str, Any] = {**provenance(), "cpu": cpu_summary(), "args": vars(args) | {"out": None}}
    if args.part in ("all", "mkl"):
        from adaptercl.system.cpu_kernels import measure_mkl_branches

        result["mkl"] = measure_mkl_branches(rounds=args.rounds)
    if args.part in ("all", "train"):
        result["train"] = run_train(args)
    if args.part in ("all", "choice"):
        result["choice"] = run_choice(args)
    if args.part not in ("mkl", "train", "choice"):
        model, tokenizer, steps = quickstart_setup(args)
        if args.part in ("all", "decode"):
            result["decode"] = run_decode(args, model, tokenizer, steps)
        if args.part in ("all", "mismatch"):
            result["mismatch"] = run_mismatch(args, model, tokenizer, steps)
    path = write_result(result_name(result["cpu"]["model"], args.part), result, args.out)
    print(markdown(result))
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
