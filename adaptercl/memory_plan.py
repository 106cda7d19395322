"""Predicted peak GPU memory and wall time of a recipe, before anything is downloaded (`adaptercl recipe plan`).

    plan = plan_recipe(load_recipe("recipes/hybrid.yaml"), gpu_memory_gib=24)
    print(plan.render()); plan.fits

Owns the analytic memory model of the three GPU phases of a stage, the `auto` micro-batch, and the wall-time
estimate of a recipe. No torch: the model's shape comes from `model_shapes.py` (known architectures or a local
folder's config.json, never the hub); what a colocated vLLM engine takes is `vllm_memory.py`'s. `rollout.engine:
auto` is planned as vLLM (`engine_choice.planned`).

Training step (peak of one micro-batch of `rows` sequences of T = prompt + response tokens, R = response tokens;
rows = `optim.split_rows` of the step's prompts_per_step x group_size, or with `optim.micro_batch_size: auto` the
largest micro-batch whose peak x (1 + MICRO_BATCH_MARGIN) fits the card, `auto_micro_batch`):

    base       NF4 linears at 4.127 bits/param (4-bit codes + 8-bit absmax per 64 + fp32 absmax per 256, double
               quantisation) + bf16 embeddings, lm_head (when untied) and norms; bf16 everywhere with `none`
    adapters   trainable LoRA x (4 weight + 4 grad + 8 AdamW) bytes, frozen earlier adapters and the teacher's
               adapter (stage_start/lag/trust_region: a copy, ema: rank ema_rank) x 4 bytes
    activ.     no checkpointing: rows x T x layers x (hidden + intermediate) x 2 bytes x C_ACT;
               checkpointing: rows x T x layers x hidden x 2 bytes (the layer inputs) + one layer's worth recomputed
    logits     rows x min(R, chunk) x vocab x 4 bytes x (student copies + teacher copies of the divergence support)
    overhead   C0 (cuBLAS workspaces, allocator slack at small sizes)
    vllm_*     a colocated vLLM engine: asleep (sleep mode, level 1) what its sleep keeps, else its whole claim

The free constants (C_ACT, the logit copies and C0) are fitted, by least squares of the relative error, to the
14 variants measured on an H100 at the Qwen2.5-7B shape (benchmarks/perf/results/cuda_7b_memory.json, peak =
max_memory_reserved; `benchmarks/perf/fit_memory_plan.py` refits them; tests/test_memory_plan.py: each within 15%).
Activations are fitted at one shape only: other shapes scale by (hidden + intermediate) x layers, an assumption.

Rollouts and evaluation (both run on the recipe's engine) are not measured; their terms are first principles. hf
engine: the trainer's resident memory (base, adapters, AdamW state; gradients freed) + bf16 KV cache of
`rollout.batch_size` sequences of prompt + max_new_tokens + one prefill layer + decode logits. vLLM: the trainer's
resident memory + the engine's claim, gpu_memory_utilization x the card (`vllm_memory.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from adaptercl.config import RecipeConfig, StageConfig
from adaptercl.engine_choice import planned
from adaptercl.methods import METHODS
from adaptercl.model_shapes import GIB, Shape, base_bytes, gib, kv_bytes, lora_params, shape_of
from adaptercl.rollout_config import ENGINES
from adaptercl.vllm_memory import (
    PROMPT_TOKENS,
    VLLM_ASLEEP_GIB,
    step_companions,
    vllm_need_terms,
    vllm_utilization,
)
from adaptercl.wall_time import WallTime, estimate_wall_time

CUDA_CONTEXT_GIB = 0.5  # CUDA context + kernels, outside torch's allocator (assumption, typical of torch 2.x)
MICRO_BATCH_MARGIN = 0.10  # auto micro-batch: planned peak x 1.10 must fit; the fit's largest underestimate is 5.7%

# Fitted on benchmarks/perf/results/cuda_7b_memory.json (see the module docstring; fit_memory_plan.py refits).
# Largest residual of the fit: +6.7% (sdpo, micro-batch 1); the others within 6%.
C_ACT = 7.34  # kept activations of one layer per token, in units of (hidden + intermediate) bf16 values
C0_GIB = 0.97  # fixed overhead
STUDENT_LOGIT_COPIES = {"chunked": 1.86, "full": 2.56}  # [rows, positions, V] float32 tensors alive at the peak
TEACHER_LOGIT_COPIES = {"none": 0.0, "sampled": 2.05, "topk": 3.64, "full": 6.74}  # same, added by the teacher


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
    notes: list[str] = field(default_factory=list)  # what the plan chose or assumed for `auto` settings

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
        return "\n".join(lines + self.notes + [self.wall_time.render()])


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


def train_workload(shape: Shape, stage: StageConfig, index: int, prompt: int, rows: int | None = None,
                   grad_accum: int | None = None, checkpointing: bool | None = None,
                   chunk: int | str | None = "recipe") -> TrainWorkload:  # fmt: skip
    """The stage's training micro-batch on CUDA (auto = checkpointing on, 1024-position chunks) of `rows` sequences
    (default: `optim.split_rows`, the split without a card); overrides for the searches."""
    optim = stage.optim
    sequences = optim.prompts_per_step * stage.rollout.group_size
    ckpt = optim.activation_checkpointing in ("auto", True) if checkpointing is None else checkpointing
    if chunk == "recipe":
        setting = optim.logits_chunk_size
        chunk = 1024 if setting == "auto" else None if setting == "off" else setting
    if rows is None:
        rows = math.ceil(sequences / grad_accum) if grad_accum else optim.split_rows(sequences)
    return TrainWorkload(
        rows=rows,
        prompt=prompt,
        response=stage.rollout.max_new_tokens,
        checkpointing=ckpt,
        chunk=chunk,
        support=stage.distill.support if _has_teacher(stage) else "none",
        trainable=lora_params(shape, stage),
        frozen=_frozen_params(shape, stage, index),
    )


@dataclass(frozen=True)
class MicroBatchPlan:
    """`optim.micro_batch_size: auto` for one stage on one card."""

    rows: int  # sequences per micro-batch
    peak_gib: float  # the planned training step at `rows`, with what shares the card (step_companions)
    limit_gib: float  # the card less the CUDA context


def auto_micro_batch(shape: Shape, recipe: RecipeConfig, index: int, prompt: int, card_gib: float,
                     sequences: int | None = None, checkpointing: bool | None = None,
                     chunk: int | str | None = "recipe") -> MicroBatchPlan:  # fmt: skip
    """The largest micro-batch (at most `sequences`, default the step's) of stage `index` whose planned training
    peak plus what shares the card during the step (`step_companions`) times 1 + MICRO_BATCH_MARGIN fits the card
    less the CUDA context; 1 when none does (the plan then says the step does not fit)."""
    stage = recipe.stages[index]
    sequences = sequences or stage.optim.prompts_per_step * stage.rollout.group_size
    limit = card_gib - CUDA_CONTEXT_GIB
    extra = gib(step_companions(shape, recipe, card_gib))

    def peak(rows: int) -> float:
        workload = train_workload(shape, stage, index, prompt, rows, checkpointing=checkpointing, chunk=chunk)
        return gib(train_terms(shape, recipe.quantization, workload)) + extra

    rows = 1
    while rows < sequences and peak(rows + 1) * (1 + MICRO_BATCH_MARGIN) <= limit:
        rows += 1
    return MicroBatchPlan(rows, peak(rows), limit)


def planned_rows(shape: Shape, recipe: RecipeConfig, index: int, prompt: int, card_gib: float) -> int:
    """Sequences per micro-batch of stage `index` on a CUDA card of `card_gib`."""
    optim = recipe.stages[index].optim
    if optim.micro_batch_size == "auto":
        return auto_micro_batch(shape, recipe, index, prompt, card_gib).rows
    return optim.split_rows(optim.prompts_per_step * recipe.stages[index].rollout.group_size)


def _resident(shape: Shape, recipe: RecipeConfig, stage: StageConfig, index: int) -> dict[str, float]:
    """What the trainer keeps on the GPU between steps: base, adapters, AdamW state (gradients are freed)."""
    return {
        "base": base_bytes(shape, recipe.quantization),
        "adapters": lora_params(shape, stage) * 12 + _frozen_params(shape, stage, index) * 4,
        "overhead": C0_GIB * GIB,
    }


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


def _worst(rows: list[tuple[str, dict[str, float]]]) -> tuple[str, dict[str, float]]:
    return max(rows, key=lambda row: gib(row[1]))  # the first stage of the largest


def _train_phase(shape: Shape, recipe: RecipeConfig, prompt: int, card: float) -> Phase:
    limit, companions = card - CUDA_CONTEXT_GIB, step_companions(shape, recipe, card)
    extra = gib(companions)

    def peak(i: int, stage: StageConfig, **kw) -> float:
        return gib(train_terms(shape, recipe.quantization, train_workload(shape, stage, i, prompt, **kw))) + extra

    rows = [(s.name, {**train_terms(shape, recipe.quantization, train_workload(
             shape, s, i, prompt, planned_rows(shape, recipe, i, prompt, card))), **companions})
            for i, s in enumerate(recipe.stages)]  # fmt: skip
    name, terms = _worst(rows)
    phase = Phase("train", name, gib(terms), limit, _detail(terms))
    if phase.fits:
        return phase
    for i, stage in enumerate(recipe.stages):
        kw = {"rows": planned_rows(shape, recipe, i, prompt, card)}
        if peak(i, stage, **kw) <= limit:
            continue
        where = f"stages.{stage.name}."  # suggestions are cumulative: each predicted with the ones above
        sequences = stage.optim.prompts_per_step * stage.rollout.group_size
        if stage.optim.activation_checkpointing is False:
            kw["checkpointing"] = True
            phase.suggestions.append(
                f"{where}optim.activation_checkpointing=true (then {peak(i, stage, **kw):.1f} GiB)"
            )
        for rows_ in range(kw["rows"] - 1, 0, -1):
            if sequences % rows_ == 0 and peak(i, stage, **{**kw, "rows": rows_}) <= limit:
                kw["rows"] = rows_
                split = (f"optim.grad_accum={sequences // rows_}" if stage.optim.micro_batch_size is None
                         else f"optim.micro_batch_size={rows_}")  # fmt: skip
                phase.suggestions.append(f"{where}{split} (then {peak(i, stage, **kw):.1f} GiB)")
                break
        if peak(i, stage, chunk=256, **kw) < peak(i, stage, **kw):
            kw["chunk"] = 256
            phase.suggestions.append(f"{where}optim.logits_chunk_size=256 (then {peak(i, stage, **kw):.1f} GiB)")
        phase.suggestions.append(f"{where}rollout.max_new_tokens (shorter responses: activations and logits shrink "
                                 "linearly)")  # fmt: skip
        if "vllm_awake" in companions:
            phase.suggestions.append(f"{where}rollout.enable_sleep_mode=true (frees vLLM's claim during the step)")
    return phase


def _generate_terms(shape: Shape, recipe: RecipeConfig, index: int, prompt: int, new_tokens: int,
                    card: float) -> dict[str, float]:  # fmt: skip
    """The card while stage `index` generates `new_tokens` a sequence with the run's engine."""
    stage = recipe.stages[index]
    engine = ENGINES[stage.rollout.engine]
    if engine.home is None:  # hf: generate on the training model
        return hf_generate_terms(shape, recipe, stage, index, stage.rollout.batch_size, prompt, new_tokens)
    resident = _resident(shape, recipe, stage, index)
    if not engine.needs_local_vllm:  # a vLLM server: its GPUs are not this one
        return resident
    return {**resident, "vllm_claim": vllm_utilization(shape, recipe, card) * card * GIB}


def _generate_phase(name: str, shape: Shape, recipe: RecipeConfig, prompt: int, new_tokens: int, card: float) -> Phase:
    limit = card - CUDA_CONTEXT_GIB
    rows = [(s.name, _generate_terms(shape, recipe, i, prompt, new_tokens, card)) for i, s in enumerate(recipe.stages)]
    stage_name, terms = _worst(rows)
    phase = Phase(name, stage_name, gib(terms), limit, _detail(terms))
    stage = next(s for s in recipe.stages if s.name == stage_name)
    if ENGINES[stage.rollout.engine].needs_local_vllm:
        worst = max(recipe.stages, key=lambda s: gib(vllm_need_terms(shape, recipe, s, prompt)))
        need, claim = vllm_need_terms(shape, recipe, worst, prompt), terms["vllm_claim"]
        if gib(need) > claim / GIB:  # vLLM would start with a smaller KV cache than a step's rollouts need
            phase.suggestions.append(
                f"rollout.gpu_memory_utilization={math.ceil(100 * gib(need) / card) / 100:g} (vLLM needs "
                f"{gib(need):.1f} GiB: {_detail(need)}; it may claim {claim / GIB:.1f})"
            )
    if not phase.fits:
        i = recipe.stages.index(stage)
        if ENGINES[stage.rollout.engine].home is None:
            for batch in range(stage.rollout.batch_size - 1, 0, -1):
                smaller = hf_generate_terms(shape, recipe, stage, i, batch, prompt, new_tokens)
                if gib(smaller) <= limit:
                    phase.suggestions.append(f"rollout.batch_size={batch}")
                    break
        else:
            phase.suggestions.append("rollout.gpu_memory_utilization (lower: the trainer and vLLM share the card)")
        phase.suggestions.append(f"{'rollout' if name == 'rollout' else 'eval'}.max_new_tokens (a shorter KV cache)")
    return phase


def _notes(shape: Shape, recipe: RecipeConfig, written: RecipeConfig, prompt: int, card: float) -> list[str]:
    """What the plan chose or assumed for the recipe's `auto` settings."""
    notes = []
    if written.stages[0].rollout.engine == "auto":
        notes.append("rollout.engine auto planned as vLLM (what it picks on a CUDA card with vLLM installed); "
                     "without vLLM it is transformers: plan that with rollout.engine=hf")  # fmt: skip
    auto = [i for i, s in enumerate(recipe.stages) if s.optim.micro_batch_size == "auto"]
    if auto:
        chosen = [auto_micro_batch(shape, recipe, i, prompt, card) for i in auto]
        each = ", ".join(f"{recipe.stages[i].name} {c.rows} ({c.peak_gib:.1f} GiB)" for i, c in zip(auto, chosen))
        notes.append(f"optim.micro_batch_size auto (the largest micro-batch whose planned step x "
                     f"{1 + MICRO_BATCH_MARGIN:g} fits {chosen[0].limit_gib:g} GiB): {each}")  # fmt: skip
    rollout = recipe.stages[0].rollout
    if ENGINES[rollout.engine].needs_local_vllm:
        share = vllm_utilization(shape, recipe, card)
        need = max((vllm_need_terms(shape, recipe, s, PROMPT_TOKENS) for s in recipe.stages), key=gib)
        how = "auto: its needs, " if rollout.gpu_memory_utilization == "auto" else ""
        sleep = (f"asleep in each optimiser step (sleep level 1: weights to CPU RAM, KV cache dropped) it keeps "
                 f"{VLLM_ASLEEP_GIB:g} GiB" if rollout.enable_sleep_mode else "awake in the optimiser step (no "
                 "sleep mode): its whole claim stays")  # fmt: skip
        notes.append(f"vLLM claims {share:g} of the card = {share * card:.1f} GiB ({how}{_detail(need)} with "
                     f"{PROMPT_TOKENS}-token prompts); {sleep}")  # fmt: skip
    return notes


def plan_recipe(recipe: RecipeConfig, gpu_memory_gib: float = 24.0, prompt_tokens: int = PROMPT_TOKENS) -> Plan:
    """Predicted peak GPU memory of each phase (training step, rollouts, evaluation) and the wall time."""
    written, recipe = recipe, planned(recipe)  # rollout.engine auto: vLLM, what it picks on a CUDA card with vLLM
    shape = shape_of(recipe.model.name)
    card = gpu_memory_gib
    phases = [
        _train_phase(shape, recipe, prompt_tokens, card),
        _generate_phase("rollout", shape, recipe, prompt_tokens, recipe.stages[0].rollout.max_new_tokens, card),
        _generate_phase("eval", shape, recipe, prompt_tokens, recipe.eval_max_new_tokens, card),
    ]
    notes = _notes(shape, recipe, written, prompt_tokens, card)
    wall = estimate_wall_time(recipe, shape_params(shape))
    return Plan(recipe.model.name, gpu_memory_gib, prompt_tokens, phases, wall, notes)


def shape_params(shape: Shape) -> float:
    """Parameters of the model, in billions (the wall-time estimate scales decode time with it)."""
    return (shape.linear_params() + shape.embedding_params()) / 1e9
