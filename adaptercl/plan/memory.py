"""Predicted peak GPU memory and wall time of a recipe, before anything is downloaded (`adaptercl recipe plan`).

    plan = plan_recipe(load_recipe("recipes/hybrid.yaml"), gpu_memory_gib=24)
    print(plan.render()); plan.fits

Owns the four GPU phases of a stage, each the worst over the stages, the `auto` micro-batch and the plan's output:

    train        one training micro-batch (`step_memory.py`, fitted to the H100 7B measurement) with what shares the
                 card during the step (a sleeping vLLM, `rollout.vllm_memory.step_companions`), the spectra parameter
                 drift keeps on the card once it has run, and for `hybrid.distill_on: high_entropy` the entropy pass
                 before the step when that is larger; rows = `optim.split_rows` of the step's sequences, or with
                 `optim.micro_batch_size: auto` the fastest micro-batch whose peak x (1 + MICRO_BATCH_MARGIN) fits
    rollout      generation on the recipe's engine at rollout.max_new_tokens: hf = the trainer's resident memory
                 (base, adapters, AdamW state) + bf16 KV cache of `rollout.batch_size` sequences (and a hybrid's
                 Gated DeltaNet states, `recurrent_state`) + one prefill layer + decode logits; vLLM = the
                 trainer's resident memory + its claim, gpu_memory_utilization x the card
    eval         the same at eval.max_new_tokens
    diagnostics  teacher lift, response drift, stage KL and parameter drift (`diagnostics_memory.py`), the worst part

No torch: the model's shape comes from `model/shapes.py` (known architectures or a local folder's config.json, never
the hub); what a colocated vLLM takes is `rollout/vllm_memory.py`'s; `rollout.engine: auto` is planned as vLLM,
or transformers for a family vLLM cannot serve with LoRA (`rollout.engine_choice.planned`). The wall time is
`wall_time.py`'s, on the plan's micro-batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from adaptercl.model import GIB, Shape, base_bytes, gib, kv_bytes, lora_params, recurrent_state_bytes, shape_of
from adaptercl.plan import rehearsal_check
from adaptercl.plan.diagnostics_memory import diagnostics_parts, drift_cache_bytes, runs_parameter_drift
from adaptercl.plan.step_memory import C0_GIB, entropy_pass_terms, frozen_params, train_terms, train_workload
from adaptercl.plan.wall_time import WallTime, estimate_wall_time, step_s
from adaptercl.recipe import ENGINES, METHODS, RecipeConfig, RecipeError, StageConfig
from adaptercl.rollout import (
    PROMPT_TOKENS,
    VLLM_ASLEEP_GIB,
    auto_plan_note,
    planned,
    step_companions,
    vllm_need_terms,
    vllm_utilization,
)

CUDA_CONTEXT_GIB = 0.5  # CUDA context + kernels, outside torch's allocator (assumption, typical of torch 2.x)
MICRO_BATCH_MARGIN = 0.10  # auto micro-batch: planned peak x 1.10 must fit; the fit's largest underestimate is 5.8%
DIAGNOSTIC_FIELDS = {"response_drift": "drift_probes", "stage_kl": "stage_kl_prompts",
                     "parameter_drift": "parameter_drift", "teacher_lift": "teacher_lift_prompts"}  # fmt: skip


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
            f"{'phase':<12} {'worst stage':<24} {'peak GiB':>9}  verdict        terms (GiB)",
        ]
        for p in self.phases:
            verdict = "fits" if p.fits else "does not fit"
            lines.append(f"{p.name:<12} {p.stage:<24} {p.gib:>9.2f}  {verdict:<14} {p.detail}")
        for p in self.phases:
            lines += [f"  to fit {p.name}: {s}" for s in p.suggestions]
        return "\n".join(lines + self.notes + [self.wall_time.render()])


def _detail(terms: dict[str, float]) -> str:
    return ", ".join(f"{k} {v / GIB:.2f}" for k, v in terms.items())


@dataclass(frozen=True)
class MicroBatchPlan:
    """`optim.micro_batch_size: auto` for one stage on one card."""

    rows: int  # sequences per micro-batch
    peak_gib: float  # the planned training step at `rows`, with what shares the card (step_companions)
    limit_gib: float  # the card less the CUDA context


def step_terms(shape: Shape, recipe: RecipeConfig, index: int, prompt: int, card_gib: float, rows: int,
               **kw) -> dict[str, float]:  # fmt: skip
    """The card at the peak of stage `index`'s training step at `rows` a micro-batch (`kw`: train_workload's
    overrides): the micro-batch or, with hybrid high_entropy, the entropy pass when larger; with what stays beside
    it (a sleeping vLLM, the spectra of parameter drift once it has run)."""
    stage = recipe.stages[index]
    workload = train_workload(shape, stage, index, prompt, rows, **kw)
    terms = train_terms(shape, recipe.quantization, workload)
    if METHODS[stage.method].entropy_pass(stage.hybrid):
        terms = max(terms, entropy_pass_terms(shape, recipe.quantization, workload), key=gib)
    cache = runs_parameter_drift(recipe) and (index > 0 or stage.monitor.drift_every)
    kept = {"drift_cache": drift_cache_bytes(shape, recipe, stage)} if cache else {}
    return {**terms, **kept, **step_companions(shape, recipe, card_gib)}


def auto_micro_batch(shape: Shape, recipe: RecipeConfig, index: int, prompt: int, card_gib: float,
                     sequences: int | None = None, checkpointing: bool | None = None,
                     chunk: int | str | None = "recipe") -> MicroBatchPlan:  # fmt: skip
    """The fastest micro-batch (at most `sequences`, default the step's) of stage `index` among those whose planned
    step peak (`step_terms`: with what shares the card) times 1 + MICRO_BATCH_MARGIN fits the card less the CUDA
    context, the larger of equals; 1 when none fits (the plan then says the step does not fit). Fastest by the
    measured H100 step's model (`wall_time.step_s`, prompts of `prompt` tokens): with a group's prompt computed once
    per micro-batch, a micro-batch that splits groups can be slower than a smaller one that does not (32 rows in
    groups of 8: micro-batches of 8 compute 4 prompts a step, of 9 rows 7), and need more memory too (a micro-batch
    of 9 rows holds 2 prompts, one of 8 rows 1), so every size is tried."""
    stage = recipe.stages[index]
    sequences = sequences or stage.optim.prompts_per_step * stage.rollout.group_size
    limit = card_gib - CUDA_CONTEXT_GIB

    def peak(rows: int) -> float:
        return gib(step_terms(shape, recipe, index, prompt, card_gib, rows, checkpointing=checkpointing, chunk=chunk))

    fitting = [b for b in range(sequences, 0, -1) if peak(b) * (1 + MICRO_BATCH_MARGIN) <= limit]
    rows = min(fitting, key=lambda b: step_s(stage, sequences, b, prompt)) if fitting else 1  # ties: the larger
    return MicroBatchPlan(rows, peak(rows), limit)


def planned_rows(shape: Shape, recipe: RecipeConfig, index: int, prompt: int, card_gib: float) -> int:
    """Sequences per micro-batch of stage `index` on a CUDA card of `card_gib`."""
    optim = recipe.stages[index].optim
    if optim.micro_batch_size == "auto":
        return auto_micro_batch(shape, recipe, index, prompt, card_gib).rows
    return optim.split_rows(optim.prompts_per_step * recipe.stages[index].rollout.group_size)


def resident_terms(shape: Shape, recipe: RecipeConfig, stage: StageConfig, index: int) -> dict[str, float]:
    """What the trainer keeps on the GPU between steps: base, adapters, AdamW state (gradients are freed)."""
    return {
        "base": base_bytes(shape, recipe.quantization),
        "adapters": lora_params(shape, stage) * 12 + frozen_params(shape, stage, index) * 4,
        "overhead": C0_GIB * GIB,
    }


def hfgenerate_terms(shape: Shape, recipe: RecipeConfig, stage: StageConfig, index: int, batch: int, prompt: int,
                      new_tokens: int) -> dict[str, float]:  # fmt: skip
    """transformers generate on the training model: resident + KV (and a hybrid's Gated DeltaNet states) + one
    prefill layer + decode logits. A no-grad layer holds at most gate, up and their product (3 x intermediate) and ~4
    hidden-sized tensors per token."""
    prefill = batch * prompt * (3 * shape.intermediate + 4 * shape.hidden) * 2
    states = {"recurrent_state": recurrent_state_bytes(shape, batch)} if shape.linear else {}
    return {
        **resident_terms(shape, recipe, stage, index),
        "kv_cache": kv_bytes(shape, batch * (prompt + new_tokens)),
        **states,
        "prefill": prefill,
        "logits": 2 * batch * shape.vocab * 4,  # last-position logits and their softmax, float32
    }


def _worst(rows: list[tuple[str, dict[str, float]]]) -> tuple[str, dict[str, float]]:
    return max(rows, key=lambda row: gib(row[1]))  # the first stage of the largest


def _train_phase(shape: Shape, recipe: RecipeConfig, prompt: int, card: float) -> Phase:
    limit, companions = card - CUDA_CONTEXT_GIB, step_companions(shape, recipe, card)

    def peak(i: int, stage: StageConfig, **kw) -> float:
        return gib(step_terms(shape, recipe, i, prompt, card, **kw))

    rows = [(s.name, step_terms(shape, recipe, i, prompt, card, planned_rows(shape, recipe, i, prompt, card)))
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


def generate_terms(shape: Shape, recipe: RecipeConfig, index: int, prompt: int, new_tokens: int,
                    card: float) -> dict[str, float]:  # fmt: skip
    """The card while stage `index` generates `new_tokens` a sequence with the run's engine."""
    stage = recipe.stages[index]
    engine = ENGINES[stage.rollout.engine]
    if engine.home is None:  # hf: generate on the training model
        return hfgenerate_terms(shape, recipe, stage, index, stage.rollout.batch_size, prompt, new_tokens)
    resident = resident_terms(shape, recipe, stage, index)
    if not engine.needs_local_vllm:  # a vLLM server: its GPUs are not this one
        return resident
    return {**resident, "vllm_claim": vllm_utilization(shape, recipe, card) * card * GIB}


def _generate_phase(name: str, shape: Shape, recipe: RecipeConfig, prompt: int, new_tokens: int, card: float) -> Phase:
    limit = card - CUDA_CONTEXT_GIB
    rows = [(s.name, generate_terms(shape, recipe, i, prompt, new_tokens, card)) for i, s in enumerate(recipe.stages)]
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
                smaller = hfgenerate_terms(shape, recipe, stage, i, batch, prompt, new_tokens)
                if gib(smaller) <= limit:
                    phase.suggestions.append(f"rollout.batch_size={batch}")
                    break
        else:
            phase.suggestions.append("rollout.gpu_memory_utilization (lower: the trainer and vLLM share the card)")
        phase.suggestions.append(f"{'rollout' if name == 'rollout' else 'eval'}.max_new_tokens (a shorter KV cache)")
    return phase


def _notes(shape: Shape, recipe: RecipeConfig, written: RecipeConfig, prompt: int, card: float) -> list[str]:
    """What the plan chose or assumed for the recipe's `auto` settings."""
    notes = [note] if (note := auto_plan_note(written)) else []
    auto = [i for i, s in enumerate(recipe.stages) if s.optim.micro_batch_size == "auto"]
    if auto:
        chosen = [auto_micro_batch(shape, recipe, i, prompt, card) for i in auto]
        each = ", ".join(f"{recipe.stages[i].name} {c.rows} ({c.peak_gib:.1f} GiB)" for i, c in zip(auto, chosen))
        notes.append(f"optim.micro_batch_size auto (the fastest micro-batch whose planned step x "
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
    notes.append(rehearsal_check.memory_line())
    return notes


def _diagnostics_phase(shape: Shape, recipe: RecipeConfig, prompt: int, card: float) -> Phase:
    def generate(index: int, prompt_: int, new_tokens: int) -> dict[str, float]:
        return generate_terms(shape, recipe, index, prompt_, new_tokens, card)

    rows = [(f"{s.name}:{part}", terms) for i, s in enumerate(recipe.stages)
            for part, terms in diagnostics_parts(shape, recipe, i, prompt, card, generate).items()]  # fmt: skip
    if not rows:
        return Phase("diagnostics", "-", 0.0, card - CUDA_CONTEXT_GIB, "none (eval: every diagnostic off)")
    name, terms = _worst(rows)
    phase = Phase("diagnostics", name, gib(terms), card - CUDA_CONTEXT_GIB, _detail(terms))
    if not phase.fits:
        phase.suggestions.append(f"eval.{DIAGNOSTIC_FIELDS[name.split(':')[1]]} (off: 0 / false), or a shorter "
                                 "eval.max_new_tokens / rollout.max_new_tokens")  # fmt: skip
    return phase


def plan_recipe(recipe: RecipeConfig, gpu_memory_gib: float = 24.0, prompt_tokens: int = PROMPT_TOKENS,
                card: str = "rtx4090") -> Plan:  # fmt: skip
    """Predicted peak GPU memory of each phase (training step, rollouts, evaluation, diagnostics) and the wall time
    on `card` (`wall_time.CARDS`). A card size that is not a number of GiB above 0, or prompts of fewer than 1
    token, are refused (one RecipeError line naming the flag)."""
    if not (math.isfinite(gpu_memory_gib) and gpu_memory_gib > 0):
        raise RecipeError(f"plan: --gpu-memory must be a number of GiB above 0, got {gpu_memory_gib:g}")
    if prompt_tokens < 1:
        raise RecipeError(f"plan: --prompt-tokens must be at least 1, got {prompt_tokens}")
    written, recipe = recipe, planned(recipe)  # rollout.engine auto: vLLM, what it picks on a CUDA card with vLLM
    shape = shape_of(recipe.model.name)
    gib_ = gpu_memory_gib
    phases = [
        _train_phase(shape, recipe, prompt_tokens, gib_),
        _generate_phase("rollout", shape, recipe, prompt_tokens, recipe.stages[0].rollout.max_new_tokens, gib_),
        _generate_phase("eval", shape, recipe, prompt_tokens, recipe.eval_max_new_tokens, gib_),
        _diagnostics_phase(shape, recipe, prompt_tokens, gib_),
    ]
    notes = _notes(shape, recipe, written, prompt_tokens, gib_)
    rows = [planned_rows(shape, recipe, i, prompt_tokens, gib_) for i in range(len(recipe.stages))]
    wall = estimate_wall_time(recipe, shape, rows, gib_, card)
    return Plan(recipe.model.name, gpu_memory_gib, prompt_tokens, phases, wall, notes)
