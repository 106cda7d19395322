"""Memory of the 7B training step counted on a CPU without allocating it: live tensor bytes under FakeTensorMode.

The step is the one `cuda_7b_memory.py` measures on a GPU, set up by the same functions (`variant_recipe`,
`stage_setup`, `synthetic_batch`: adaptercl's `attach_adapter`, `create_teacher`, `make_optimizer`, then
`train.step.train_on_batch` and `Teacher.update`), on a Qwen2.5-7B-shaped model built on the meta device whose
parameters and buffers are then made fake (`adaptercl.plan.memory_trace.fakeify`);
`adaptercl.plan.memory_trace.LiveBytes` counts live tensor storage bytes through one step, AdamW's state made
beforehand as its first step makes it (so the one step is a steady-state step, as the GPU run's timed steps are;
`--validate` runs two steps instead, the first building the state). The split of the peak: weights (base parameters and
buffers), LoRA + optimiser (student and teacher adapters, AdamW's two states), logits (tensors whose last dimension is
the vocabulary), activations and the rest (the difference: activations, the LoRA gradients, temporaries).

NF4 stand-in (`NF4Linear`): bitsandbytes' `Params4bit` cannot be created under FakeTensorMode, so every decoder
projection becomes a `bnb.nn.Linear4bit` subclass (PEFT wraps it with its bnb LoRA layer, as on the GPU) holding
what the real one holds: packed uint8 weights [out*in/2, 1], uint8 absmax per 64-block (double quant), its fp32
second-level absmax per 256 blocks, the code tables and a bf16 bias. Its forward is bitsandbytes' `MatMul4Bit` in
the form it runs in training: `dequantize_blockwise` of the absmax, `dequantize_4bit` to a bf16 [out, in] weight,
`F.linear`; nothing of the input saved; backward dequantizes again (`torch.ops.bitsandbytes.*`: their fake kernels).

Differences from the GPU run, by construction: the fake device is CPU (a fake CUDA tensor's attention aborts a
CPU-only torch), so attention is the CPU SDPA kernel (`ops` in the result names the one that ran; CUDA's flash /
memory-efficient kernels also keep only the output and a [B, H, L] logsumexp); AdamW takes its CPU default
(per-parameter loop, not foreach: CUDA's foreach temporaries, at most the LoRA size, come at `optimizer.step`);
the count excludes the CUDA allocator's rounding and cache (`reserved`) and cuBLAS workspaces.

Validation (`--validate`): the same counter on a real CPU run (real tensors, unquantised float32) against the
fake-traced run of the same model and workload: tiny-random and smollm2-135m-instruct.

    python benchmarks/perf/trace_7b_memory.py --validate
    python benchmarks/perf/trace_7b_memory.py --variants hybrid:8:true:1024 hybrid:8:false:off

writes benchmarks/perf/results/trace_7b_memory.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for the shared provenance.py

import torch  # noqa: E402
from cuda_7b_memory import apply_variant, stage_setup, synthetic_batch, variant_recipe  # noqa: E402
from perf_common import write_result  # noqa: E402
from provenance import markdown_table, provenance  # noqa: E402
from random_checkpoint import QWEN25_7B  # noqa: E402

from adaptercl.model.shapes import GIB  # noqa: E402
from adaptercl.plan.memory_trace import LiveBytes, fake_mode, fakeify  # noqa: E402

BLOCK, NESTED_BLOCK = 64, 256  # bitsandbytes NF4 blocksize; double quant's blocksize over the absmax


def nf4_linear_class():
    """`NF4Linear`, defined on first use (bitsandbytes is imported only for the 7B trace)."""
    import bitsandbytes as bnb

    bnb_ops = torch.ops.bitsandbytes

    class NF4Linear(bnb.nn.Linear4bit):
        """Stand-in for a loaded `bnb.nn.Linear4bit` (NF4, double quant, bf16 compute): same storage, same ops."""

        def __init__(self, linear: torch.nn.Linear) -> None:  # noqa: D107 - Linear4bit.__init__ makes Params4bit
            torch.nn.Module.__init__(self)
            self.in_features, self.out_features = linear.in_features, linear.out_features
            self.compute_dtype, self.compute_type_is_set, self.quant_state = torch.bfloat16, True, None
            n = self.in_features * self.out_features
            blocks = -(-n // BLOCK)
            weight = torch.empty(n // 2, 1, dtype=torch.uint8, device="meta")
            self.weight = torch.nn.Parameter(weight, requires_grad=False)
            self.weight.compress_statistics, self.weight.quant_type = True, "nf4"  # read by PEFT's dispatch
            self.bias = linear.bias
            self.register_buffer("absmax", torch.empty(blocks, dtype=torch.uint8, device="meta"))
            self.register_buffer("nested_absmax", torch.empty(-(-blocks // NESTED_BLOCK), device="meta"))
            self.register_buffer("nested_code", torch.empty(256, device="meta"))
            self.register_buffer("code", torch.empty(16, device="meta"))
            self.register_buffer("offset", torch.empty((), device="meta"))

        def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
            """[out, in] weight in `dtype`, as `bitsandbytes.functional.dequantize_4bit` with a nested state."""
            absmax = bnb_ops.dequantize_blockwise(
                self.absmax, self.nested_absmax, self.nested_code, NESTED_BLOCK, torch.float32
            )
            absmax += self.offset
            shape = [self.out_features, self.in_features]
            return bnb_ops.dequantize_4bit(self.weight, absmax, BLOCK, "nf4", shape, dtype)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return MatMulNF4.apply(x, self)

    class MatMulNF4(torch.autograd.Function):
        """`bnb.autograd._functions.MatMul4Bit`: nothing of the input kept; the weight dequantized again."""

        @staticmethod
        def forward(ctx, x: torch.Tensor, layer: NF4Linear) -> torch.Tensor:
            ctx.layer = layer
            return torch.nn.functional.linear(x, layer.dequantize(x.dtype), layer.bias)  # [..., out]

        @staticmethod
        def backward(ctx, grad: torch.Tensor):
            return torch.matmul(grad, ctx.layer.dequantize(grad.dtype)), None  # [..., in]

    return NF4Linear


def meta_qwen_7b() -> torch.nn.Module:
    """Qwen2.5-7B-shaped Qwen2ForCausalLM on the meta device: bf16, decoder projections NF4 stand-ins."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    nf4 = nf4_linear_class()
    config = Qwen2Config(**QWEN25_7B, pad_token_id=0)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, nf4(child))
    model.config.use_cache = True
    return model


def traced_steps(
    args, recipe, model, tokenizer, fake: bool, vocab: int, steps_to_run: int = 2, prebuilt_state: bool = False
) -> dict[str, Any]:
    """`steps_to_run` training steps (the first builds AdamW's state unless `prebuilt_state`: then the state is
    made up front as AdamW's `_init_group` makes it, and one step is the steady state); live-byte peaks per step
    and the split of the last peak."""
    from unittest import mock

    from adaptercl.adapters.live import lora_parameters
    from adaptercl.train.regularizers import StageRegularizers
    from adaptercl.train.stage import make_optimizer
    from adaptercl.train.step import train_on_batch

    # On the meta device there are no values to copy into the teacher's adapter (the values do not matter here).
    with contextlib.ExitStack() as meta_setup:
        if fake:
            meta_setup.enter_context(mock.patch("adaptercl.teacher.kinds.copy_adapter", lambda *_, **__: None))
            meta_setup.enter_context(mock.patch("adaptercl.teacher.kinds.Teacher._ema_step", lambda *_, **__: None))
        ctx, (optimizer, regs), info = stage_setup(args, recipe, SimpleNamespace(tokenizer=tokenizer), model)
    mode = fake_mode() if fake else None
    if fake:  # adapters attached on the meta device; now every parameter and buffer becomes fake
        fakeify(ctx.model, mode)
        optimizer = make_optimizer(ctx)
        regs = StageRegularizers.start(ctx.model, "student", [], [], ctx.stage.regularizers)
    batch, advantages, targets = synthetic_batch(args, tokenizer, torch.device("cpu"))  # small, real
    tracker = LiveBytes(vocab, assume_data=fake)
    for name, p in ctx.model.named_parameters():
        tracker.register(p, "lora_trainable" if p.requires_grad else "lora_frozen" if "lora_" in name else "weights")
    for b in ctx.model.buffers():
        tracker.register(b, "weights")
    if prebuilt_state:
        with mode if fake else contextlib.nullcontext():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    state = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p),
                    }
                    optimizer.state[p] = state
                    for t in state.values():
                        tracker.register(t, "optimiser")
    lora_bytes = sum(p.numel() * p.element_size() for p in lora_parameters(ctx.model, "student").values())
    steps = []
    with mode if fake else contextlib.nullcontext(), tracker:
        for i in range(steps_to_run):
            tracker.reset_peak()
            t0 = time.perf_counter()
            ctx.model.train()
            train_on_batch(ctx, batch, advantages, optimizer, targets if ctx.teacher else None, None, regs)
            if ctx.teacher is not None:
                ctx.teacher.update(ctx.model)
            steps.append({"step": i + 1, "peak_gib": tracker.peak / GIB, "time_s": time.perf_counter() - t0})
            steps[-1]["at_peak_gib"] = {k: v / GIB for k, v in tracker.at_peak.items()}
    last = steps[-1]["at_peak_gib"]
    # AdamW's two states and the gradients of the trainable LoRA parameters are allocated inside the step ("other"):
    # at the second step's peak the states exist (and the gradients once a backward has run), so they are moved to
    # the LoRA + optimiser part by their known size.
    state_gib = last.get("optimiser", 2 * lora_bytes / GIB)
    split = {
        "weights_gib": last.get("weights", 0.0),
        "lora_and_optimiser_gib": last.get("lora_trainable", 0) + last.get("lora_frozen", 0) + state_gib,
        "logits_gib": last.get("logits", 0.0),
    }
    split["activations_and_rest_gib"] = steps[-1]["peak_gib"] - sum(split.values())
    split["note"] = "lora_and_optimiser includes AdamW's exp_avg/exp_avg_sq (2 x LoRA bytes), not the gradients"
    attention = sorted(k for k in tracker.ops if "attention" in k or "flash" in k)
    peak = max(s["peak_gib"] for s in steps)
    return {"peak_gib": peak, "steps": steps, "split_at_last_peak": split, "attention_ops": attention, **info}


def validate(args) -> list[dict[str, Any]]:
    """Real CPU run vs fake trace, same counter, same workload, per model: the traced peak must be within 10 %."""
    from adaptercl.model.base import load_base

    rows = []
    for model_name in args.validate_models:
        for method in args.validate_methods:
            v_args = apply_variant(args, f"{method}:{args.grad_accum}:false:off")
            recipe = variant_recipe(v_args, model_name, torch.device("cpu"))
            base = load_base(recipe.model, "none", torch.device("cpu"))
            vocab = base.model.get_output_embeddings().out_features
            config = base.model.config
            real = traced_steps(v_args, recipe, base.model, base.tokenizer, False, vocab)
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                meta = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            fake = traced_steps(v_args, recipe, meta, base.tokenizer, True, vocab)
            row = {"model": model_name, "method": method, "real_peak_gib": real["peak_gib"]}
            row |= {"traced_peak_gib": fake["peak_gib"], "ratio": fake["peak_gib"] / real["peak_gib"]}
            row |= {"real": real, "traced": fake}
            print(json.dumps({k: row[k] for k in ("model", "method", "real_peak_gib", "traced_peak_gib", "ratio")}))
            rows.append(row)
    return rows


def trace_7b(args) -> list[dict[str, Any]]:
    from adaptercl.model.base import build_byte_tokenizer

    tokenizer = build_byte_tokenizer()
    out = []
    for spec in args.variants:
        v_args = apply_variant(args, spec)
        recipe = variant_recipe(v_args, "tiny-random", torch.device("cuda"))  # "cuda": bf16, as on the GPU
        t0 = time.perf_counter()
        result = traced_steps(v_args, recipe, meta_qwen_7b(), tokenizer, True, QWEN25_7B["vocab_size"], 1, True)
        result |= {"variant": spec, "trace_s": time.perf_counter() - t0}
        print(json.dumps({"variant": spec, "peak_gib": result["peak_gib"], "split": result["split_at_last_peak"]}))
        out.append(result)
        args.write_partial(out)
    return out


def markdown(result: dict[str, Any]) -> str:
    rows = [
        [r["model"], r["method"], f"{r['real_peak_gib'] * 1024:.1f}", f"{r['traced_peak_gib'] * 1024:.1f}"]
        + [f"{r['ratio']:.3f}"]
        for r in result.get("validation", [])
    ]
    text = markdown_table(["model", "method", "real MiB", "traced MiB", "traced/real"], rows) if rows else ""
    rows = []
    for r in result.get("variants", []):
        s = r["split_at_last_peak"]
        rows.append([r["variant"], f"{r['peak_gib']:.2f}"] + [f"{s[k]:.2f}" for k in list(s)[:4]])
    head = ["method:grad_accum:checkpointing:chunk", "peak GiB", "weights", "LoRA+optimiser", "logits", "activations"]
    return text + ("\n" + markdown_table(head, rows) if rows else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--validate", action="store_true", help="real CPU run vs fake trace on small models")
    parser.add_argument("--validate-models", nargs="*", default=["tiny-random", "smollm2-135m-instruct"])
    parser.add_argument("--validate-methods", nargs="*", default=["hybrid", "grpo"])
    parser.add_argument("--variants", nargs="*", default=[], help="7B variants method:grad_accum:checkpointing:chunk")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--group", type=int, default=1, help="consecutive sequences sharing one prompt (1: none)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--response-len", type=int, default=896)
    parser.add_argument("--teacher-extra", type=int, default=256)
    parser.add_argument("--distill-frac", type=float, default=1.0)
    parser.add_argument("--grad-accum", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.method, args.support, args.quantization = "hybrid", None, "nf4"
    args.activation_checkpointing, args.logits_chunk_size = False, "off"
    name = "trace_7b_memory" + ("-validate" if args.validate else "")
    prov = provenance()
    result: dict[str, Any] = {**prov}
    if args.validate:
        result["validation"] = validate(args)
    args.write_partial = lambda variants: write_result(
        name, {**result, "variants": variants, "complete": False}, args.out
    )
    if args.variants:
        result["variants"] = trace_7b(args)
    path = write_result(name, {**result, "complete": True}, args.out)
    print(markdown(result))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
