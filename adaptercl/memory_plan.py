"""Predicted peak GPU memory and wall time of a recipe, before anything is downloaded (`adaptercl recipe plan`).

    plan = plan_recipe(load_recipe("recipes/hybrid.yaml"), gpu_memory_gib=24)
    print(plan.render()); plan.fits

Owns the analytic memory model of the three GPU phases of a stage and the wall-time estimate of a recipe. No torch:
the model's shape comes from `SHAPES` (known architectures) or a local folder's config.json, never from the hub.

Training step (peak of one micro-batch of `rows = ceil(prompts_per_step x group_size / grad_accum)` sequences of
T = prompt + response tokens, R = response tokens):

    base       NF4 linears at 4.127 bits/param (4-bit codes + 8-bit absmax per 64 + fp32 absmax per 256, double
               quantisation) + bf16 embeddings, lm_head (when untied) and norms; bf16 everywhere with `none`
    adapters   trainable LoRA x (4 weight + 4 grad + 8 AdamW) bytes, frozen earlier adapters and the teacher's
               adapter (stage_start/lag/trust_region: a copy, ema: rank ema_rank) x 4 bytes
    activ.     no checkpointing: rows x T x layers x (hidden + intermediate) x 2 bytes x C_ACT;
               checkpointing: rows x T x layers x hidden x 2 bytes (the layer inputs) + one layer's worth recomputed
    logits     rows x min(R, chunk) x vocab x 4 bytes x (student copies + teacher copies of the divergence support)
    overhead   C0 (cuBLAS workspaces, allocator slack at small sizes)

The free constants (C_ACT, the logit copies and C0) are fitted, by least squares of the relative error, to the
14 variants measured on an H100 at the Qwen2.5-7B shape (benchmarks/perf/results/cuda_7b_memory.json, peak =
max_memory_reserved; `benchmarks/perf/fit_memory_plan.py` refits them; tests/test_memory_plan.py: each within 15%).
Activations are fitted at one shape only: other shapes scale by (hidden + intermediate) x layers, an assumption.

Rollouts and evaluation are not measured; their terms are first principles. hf engine: the trainer's resident
memory (base, adapters, AdamW state; gradients freed) + bf16 KV cache of `rollout.batch_size` sequences of prompt +
max_new_tokens (2 x layers x kv_heads x head_dim x 2 bytes a token) + one prefill layer + decode logits. vLLM: the
trainer's resident memory + the engine's claim, gpu_memory_utilization x the card, which must hold its NF4 weights,
max_loras x max_lora_rank LoRA slots (bf16), VLLM_RUNTIME_GIB of activations/graphs and the KV of one group.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from adaptercl.config import RecipeConfig, RecipeError, StageConfig
from adaptercl.continual import max_served_rank
from adaptercl.methods import METHODS
from adaptercl.vllm_settings import vllm_lora_rank
from adaptercl.wall_time import WallTime, estimate_wall_time

GIB = 2**30
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NF4_BITS = 4 + 8 / 64 + 32 / (64 * 256)  # bitsandbytes NF4 with double quantisation: 4.127 bits per parameter
CUDA_CONTEXT_GIB = 0.5  # CUDA context + kernels, outside torch's allocator (assumption, typical of torch 2.x)
VLLM_RUNTIME_GIB = 1.5  # vLLM's profiled activations, sampler and CUDA graphs at its defaults (assumption)

# Fitted on benchmarks/perf/results/cuda_7b_memory.json (see the module docstring; fit_memory_plan.py refits).
# Largest residual of the fit: +6.7% (sdpo, micro-batch 1); the others within 6%.
C_ACT = 7.34  # kept activations of one layer per token, in units of (hidden + intermediate) bf16 values
C0_GIB = 0.97  # fixed overhead
STUDENT_LOGIT_COPIES = {"chunked": 1.86, "full": 2.56}  # [rows, positions, V] float32 tensors alive at the peak
TEACHER_LOGIT_COPIES = {"none": 0.0, "sampled": 2.05, "topk": 3.64, "full": 6.74}  # same, added by the teacher


@dataclass(frozen=True)
class Shape:
    """What the memory model needs of a decoder-only transformer (Llama/Qwen2 layout)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tie_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each projection of one layer."""
        h, i, kv = self.hidden, self.intermediate, self.kv_heads * self.head_dim
        return {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip

    def linear_params(self) -> int:
        return self.layers * sum(a * b for a, b in self.linear_shapes().values())

    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tie_embeddings else 2)


# Hub ids (lower case, without "-instruct") -> shape, from each model's config.json.
SHAPES: dict[str, Shape] = {
    "qwen/qwen2.5-0.5b": Shape(896, 4864, 24, 14, 2, 151936, True),
    "qwen/qwen2.5-1.5b": Shape(1536, 8960, 28, 12, 2, 151936, True),
    "qwen/qwen2.5-3b": Shape(2048, 11008, 36, 16, 2, 151936, True),
    "qwen/qwen2.5-7b": Shape(3584, 18944, 28, 28, 4, 152064, False),
    "qwen/qwen2.5-14b": Shape(5120, 13824, 48, 40, 8, 152064, False),
    "huggingfacetb/smollm2-135m": Shape(576, 1536, 30, 9, 3, 49152, True),
}
SHAPES["smollm2-135m"] = SHAPES["huggingfacetb/smollm2-135m"]  # the built-in alias smollm2-135m-instruct
SHAPES["tiny-random"] = Shape(64, 128, 2, 2, 1, 320, False)  # model.py's built-in 2-layer Qwen2


def shape_of(model_name: str) -> Shape:
    """The shape of a known hub id or of a local folder's config.json; RecipeError otherwise (no download)."""
    folder = Path(model_name)
    if (folder / "config.json").is_file():
        cfg = json.loads((folder / "config.json").read_text())
        try:
            return Shape(cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"],
                         cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
                         cfg["vocab_size"], bool(cfg.get("tie_word_embeddings", False)))  # fmt: skip
        except KeyError as err:
            missing = err.args[0]
            raise RecipeError(f"model.name: {folder}/config.json lacks {missing!r} (Llama/Qwen2 layout)") from None
    key = model_name.lower().removesuffix("-instruct")
    if key not in SHAPES:
        raise RecipeError(
            f"model.name: {model_name!r} is not in the plan's table of shapes ({', '.join(sorted(SHAPES))}); "
            "point model.name at a local folder with its config.json (nothing is downloaded)"
        )
    return SHAPES[key]


def base_bytes(shape: Shape, quantization: str) -> float:
    """The frozen base: NF4 linears + bf16 embeddings/lm_head, or all bf16."""
    bits = NF4_BITS if quantization in ("nf4", "auto") else 16
    norms = (2 * shape.layers + 1) * shape.hidden
    return shape.linear_params() * bits / 8 + (shape.embedding_params() + norms) * 2


def lora_params(shape: Shape, stage: StageConfig, rank: int | None = None) -> int:
    """LoRA parameters of one adapter: r x (in + out) per adapted projection per adapted layer."""
    targets = ALL_LINEAR if stage.lora.target_modules == "all-linear" else stage.lora.target_modules
    layers = len(stage.lora.layers) if stage.lora.layers is not None else shape.layers
    per_layer = sum(a + b for name, (a, b) in shape.linear_shapes().items() if name in targets)
    return (rank or stage.lora.r) * per_layer * layers


@dataclass(frozen=True)
class TrainWorkload:
    """One micro-batch of the training step, in the terms the memory model needs."""

    rows: int
    prompt: int
    response: int
    checkpointing: bool
    chunk: int | None  # positions of full-vocabulary logits at once (None: all)
    support: str  # teacher divergence support: none, sampled, topk, full
    trainable: int  # LoRA parameters trained
    frozen: int  # frozen LoRA parameters on the GPU (earlier adapters, the teacher's adapter)


def train_terms(shape: Shape, quantization: str, w: TrainWorkload) -> dict[str, float]:
    """Peak bytes of one training micro-batch, by term."""
    tokens = w.rows * (w.prompt + w.response)
    layer = tokens * (shape.hidden + shape.intermediate) * 2 * C_ACT  # one layer's kept activations, bf16
    activ = tokens * shape.layers * shape.hidden * 2 + layer if w.checkpointing else layer * shape.layers
    positions = min(w.response, w.chunk) if w.chunk else w.response
    one_logits = w.rows * positions * shape.vocab * 4  # [rows, positions, V] float32
    copies = STUDENT_LOGIT_COPIES["chunked" if w.chunk else "full"] + TEACHER_LOGIT_COPIES[w.support]
    return {
        "base": base_bytes(shape, quantization),
        "adapters": w.trainable * 16 + w.frozen * 4,
        "activations": activ,
        "logits": copies * one_logits,
        "overhead": C0_GIB * GIB,
    }


@dataclass
class Phase:
    name: str
    stage: str
    gib: float
    limit_gib: float
    detail: str
    suggestions: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.gib <= self.limit_gib


@dataclass
class Plan:
    model: str
    gpu_memory_gib: float
    prompt_tokens: int
    phases: list[Phase]
    wall_time: WallTime

    @property
    def fits(self) -> bool:
        return all(p.fits for p in self.phases)

    def render(self) -> str:
        lines = [
            f"plan: {self.model} on a {self.gpu_memory_gib:g} GiB GPU ({CUDA_CONTEXT_GIB:g} GiB kept for the CUDA "
            f"context); prompts assumed <= {self.prompt_tokens} tokens (--prompt-tokens), responses at the cap",
            f"{'phase':<10} {'worst stage':<14} {'peak GiB':>9}  verdict        terms",
        ]
        for p in self.phases:
            verdict = "fits" if p.fits else "does not fit"
            lines.append(f"{p.name:<10} {p.stage:<14} {p.gib:>9.2f}  {verdict:<14} {p.detail}")
        for p in self.phases:
            lines += [f"  to fit {p.name}: {s}" for s in p.suggestions]
        return "\n".join(lines + [self.wall_time.render()])


def _gib(terms: dict[str, float]) -> float:
    return sum(terms.values()) / GIB


def _detail(terms: dict[str, float]) -> str:
    return ", ".join(f"{k} {v / GIB:.2f}" for k, v in terms.items())


def _frozen_params(shape: Shape, stage: StageConfig, index: int) -> int:
    """Earlier adapters kept frozen on the GPU (stacked `init: new`) + the teacher's adapter."""
    earlier = index * lora_params(shape, stage) if stage.adapter.init == "new" else 0
    kind = stage.distill.teacher.kind if _has_teacher(stage) else None
    # no teacher or `base`: nothing; `ema`: its own rank; every other kind: a copy of the student's adapter
    teacher = {None: 0, "base": 0, "ema": lora_params(shape, stage, stage.distill.teacher.ema_rank or 2 * stage.lora.r)
               }.get(kind, lora_params(shape, stage))  # fmt: skip
    return earlier + teacher


def _has_teacher(stage: StageConfig) -> bool:
    return METHODS[stage.method].needs_teacher


def train_workload(shape: Shape, stage: StageConfig, index: int, prompt: int, grad_accum: int | None = None,
                   checkpointing: bool | None = None, chunk: int | str | None = "recipe") -> TrainWorkload:  # fmt:skip
    """The stage's training micro-batch on CUDA (auto = checkpointing on, 1024-position chunks); overrides for
    the suggestions' searches."""
    optim = stage.optim
    sequences = optim.prompts_per_step * stage.rollout.group_size
    ckpt = optim.activation_checkpointing in ("auto", True) if checkpointing is None else checkpointing
    if chunk == "recipe":
        setting = optim.logits_chunk_size
        chunk = 1024 if setting == "auto" else None if setting == "off" else setting
    return TrainWorkload(
        rows=math.ceil(sequences / (grad_accum or optim.grad_accum)),
        prompt=prompt,
        response=stage.rollout.max_new_tokens,
        checkpointing=ckpt,
        chunk=chunk,
        support=stage.distill.support if _has_teacher(stage) else "none",
        trainable=lora_params(shape, stage),
        frozen=_frozen_params(shape, stage, index),
    )


def _resident(shape: Shape, recipe: RecipeConfig, stage: StageConfig, index: int) -> dict[str, float]:
    """What the trainer keeps on the GPU between steps: base, adapters, AdamW state (gradients are freed)."""
    return {
        "base": base_bytes(shape, recipe.quantization),
        "adapters": lora_params(shape, stage) * 12 + _frozen_params(shape, stage, index) * 4,
        "overhead": C0_GIB * GIB,
    }


def kv_bytes(shape: Shape, tokens: int) -> float:
    """bf16 keys and values of `tokens` tokens over every layer."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * 2 * tokens


def hf_generate_terms(shape: Shape, recipe: RecipeConfig, stage: StageConfig, index: int, batch: int, prompt: int,
                      new_tokens: int) -> dict[str, float]:  # fmt: skip
    """transformers generate on the training model: resident + KV + one prefill layer + decode logits. A no-grad
    layer holds at most gate, up and their product (3 x intermediate) and ~4 hidden-sized tensors per token."""
    prefill = batch * prompt * (3 * shape.intermediate + 4 * shape.hidden) * 2
    return {
        **_resident(shape, recipe, stage, index),
        "kv_cache": kv_bytes(shape, batch * (prompt + new_tokens)),
        "prefill": prefill,
        "logits": 2 * batch * shape.vocab * 4,  # last-position logits and their softmax, float32
    }


def vllm_need_terms(shape: Shape, recipe: RecipeConfig, stage: StageConfig, prompt: int) -> dict[str, float]:
    """What the vLLM engine must hold inside its gpu_memory_utilization claim."""
    r = stage.rollout
    rank = vllm_lora_rank(r.max_lora_rank or max_served_rank(recipe), "rollout.max_lora_rank")
    slots = (r.max_loras or 2) * lora_params(shape, stage, rank)
    return {
        "weights": base_bytes(shape, recipe.quantization),
        "lora_slots": slots * 2,
        "runtime": VLLM_RUNTIME_GIB * GIB,
        "kv_cache": kv_bytes(shape, r.group_size * (prompt + r.max_new_tokens)),
    }


def _worst(rows: list[tuple[str, dict[str, float]]]) -> tuple[str, dict[str, float]]:
    return max(rows, key=lambda row: _gib(row[1]))  # the first stage of the largest


def _train_phase(shape: Shape, recipe: RecipeConfig, prompt: int, limit: float) -> Phase:
    def peak(i: int, stage: StageConfig, **kw) -> float:
        return _gib(train_terms(shape, recipe.quantization, train_workload(shape, stage, i, prompt, **kw)))

    rows = [(s.name, train_terms(shape, recipe.quantization, train_workload(shape, s, i, prompt)))
            for i, s in enumerate(recipe.stages)]  # fmt: skip
    name, terms = _worst(rows)
    vllm_awake = sum(
        s.rollout.gpu_memory_utilization * (limit + CUDA_CONTEXT_GIB) * GIB
        for s in recipe.stages[:1]
        if s.rollout.engine == "vllm" and not s.rollout.enable_sleep_mode
    )
    if vllm_awake:
        terms = {**terms, "vllm_awake": vllm_awake}
    phase = Phase("train", name, _gib(terms), limit, _detail(terms))
    if phase.fits:
        return phase
    for i, stage in enumerate(recipe.stages):
        if peak(i, stage) + vllm_awake / GIB <= limit:
            continue
        where, kw = f"stages.{stage.name}.", {}  # suggestions are cumulative: each predicted with the ones above
        sequences = stage.optim.prompts_per_step * stage.rollout.group_size
        if stage.optim.activation_checkpointing is False:
            kw["checkpointing"] = True
            phase.suggestions.append(
                f"{where}optim.activation_checkpointing=true (then {peak(i, stage, **kw):.1f} GiB)"
            )
        for accum in range(stage.optim.grad_accum + 1, sequences + 1):
            if sequences % accum == 0 and peak(i, stage, grad_accum=accum, **kw) + vllm_awake / GIB <= limit:
                kw["grad_accum"] = accum
                phase.suggestions.append(f"{where}optim.grad_accum={accum} (then {peak(i, stage, **kw):.1f} GiB)")
                break
        if peak(i, stage, chunk=256, **kw) < peak(i, stage, **kw):
            kw["chunk"] = 256
            phase.suggestions.append(f"{where}optim.logits_chunk_size=256 (then {peak(i, stage, **kw):.1f} GiB)")
        phase.suggestions.append(f"{where}rollout.max_new_tokens (shorter responses: activations and logits shrink "
                                 "linearly)")  # fmt: skip
        if vllm_awake:
            phase.suggestions.append(f"{where}rollout.enable_sleep_mode=true (frees vLLM's claim during the step)")
    return phase


def _rollout_phase(shape: Shape, recipe: RecipeConfig, prompt: int, limit: float) -> Phase:
    rows, need_rows = [], []
    for i, s in enumerate(recipe.stages):
        if s.rollout.engine == "hf":
            rows.append((s.name, hf_generate_terms(shape, recipe, s, i, s.rollout.batch_size, prompt,
                                                   s.rollout.max_new_tokens)))  # fmt: skip
        elif s.rollout.engine == "vllm_server":  # the server's GPUs are not this one
            rows.append((s.name, _resident(shape, recipe, s, i)))
        else:
            claim = s.rollout.gpu_memory_utilization * (limit + CUDA_CONTEXT_GIB) * GIB
            rows.append((s.name, {**_resident(shape, recipe, s, i), "vllm_claim": claim}))
            need_rows.append((s, claim, vllm_need_terms(shape, recipe, s, prompt)))
    name, terms = _worst(rows)
    phase = Phase("rollout", name, _gib(terms), limit, _detail(terms))
    for s, claim, need in need_rows:
        if _gib(need) > claim / GIB:
            total = limit + CUDA_CONTEXT_GIB
            phase.suggestions.append(
                f"rollout.gpu_memory_utilization={math.ceil(100 * _gib(need) / total) / 100:g} (vLLM needs "
                f"{_gib(need):.1f} GiB: {_detail(need)}; it may claim {claim / GIB:.1f})"
            )
            phase.gib = max(phase.gib, _gib(_resident(shape, recipe, s, 0)) + _gib(need))
    if not phase.fits:
        stage = next(s for s in recipe.stages if s.name == name)
        if stage.rollout.engine == "hf":
            i = recipe.stages.index(stage)
            for batch in range(stage.rollout.batch_size - 1, 0, -1):
                smaller = hf_generate_terms(shape, recipe, stage, i, batch, prompt, stage.rollout.max_new_tokens)
                if _gib(smaller) <= limit:
                    phase.suggestions.append(f"rollout.batch_size={batch}")
                    break
        else:
            phase.suggestions.append("rollout.gpu_memory_utilization (lower: the trainer and vLLM share the card)")
        phase.suggestions.append("rollout.max_new_tokens (a shorter KV cache)")
    return phase


def _eval_phase(shape: Shape, recipe: RecipeConfig, prompt: int, limit: float) -> Phase:
    new = recipe.eval_max_new_tokens
    rows = [(s.name, hf_generate_terms(shape, recipe, s, i, s.rollout.batch_size, prompt, new))
            for i, s in enumerate(recipe.stages)]  # fmt: skip
    name, terms = _worst(rows)
    phase = Phase("eval", name, _gib(terms), limit, _detail(terms))
    if not phase.fits:
        phase.suggestions.append("rollout.batch_size (fewer greedy sequences per generate call)")
        phase.suggestions.append("eval.max_new_tokens (a shorter KV cache)")
    return phase


def plan_recipe(recipe: RecipeConfig, gpu_memory_gib: float = 24.0, prompt_tokens: int = 1024) -> Plan:
    """Predicted peak GPU memory of each phase (training step, rollouts, evaluation) and the wall time."""
    shape = shape_of(recipe.model.name)
    limit = gpu_memory_gib - CUDA_CONTEXT_GIB
    phases = [build(shape, recipe, prompt_tokens, limit) for build in (_train_phase, _rollout_phase, _eval_phase)]
    return Plan(
        recipe.model.name, gpu_memory_gib, prompt_tokens, phases, estimate_wall_time(recipe, shape_params(shape))
    )


def shape_params(shape: Shape) -> float:
    """Parameters of the model, in billions (the wall-time estimate scales decode time with it)."""
    return (shape.linear_params() + shape.embedding_params()) / 1e9
