"""Peak GPU memory of one training micro-batch, by term: the training phase of the memory plan (`memory.py`).

    terms = train_terms(shape, "nf4", train_workload(shape, stage, index, prompt=1024, rows=8))

One micro-batch of `rows` sequences of P prompt and R response tokens, holding the rows of `prompts` distinct
prompts (U: the most groups a run of `rows` rows spans in rollout order, `micro_batch_prompts`; what
`train/micro_batch_rows.py` keeps every micro-batch within). When U < rows the training forward takes the
prefix-shared layout (`model/prefix_sharing.py`): each prompt computed once, U x P + rows x R positions instead of
rows x (P + R), with each prompt's key/value cache repeated for its rows (`model.shapes.kv_bytes` of rows x P
tokens, and a hybrid's Gated DeltaNet states, `recurrent_state_bytes` of rows) and kept through the rows' forward and
backward. Without sharing (U = rows: distinct prompts, or SDFT's one
sample a prompt) every term is the plain layout's, the layout the constants below were fitted on:

    base       NF4 linears at 4.127 bits/param (`model.shapes.base_bytes`) + bf16 embeddings, lm_head, norms
    adapters   trainable LoRA x (4 weight + 4 grad + 8 AdamW) bytes, frozen adapters (earlier stages', the
               teacher's: stage_start/lag/trust_region/restart_freeze/gated a copy, ema rank ema_rank) x 4 bytes
    activ.     of the positions computed (N = rows x (P + R), or U x P + rows x R shared): no checkpointing:
               N x layers x (hidden + intermediate) x 2 bytes x C_ACT; checkpointing: N x layers x hidden x 2 bytes
               (the layer inputs) + one layer's worth recomputed, of the larger of the two forwards when shared (the
               prompts' U x P and the rows' rows x R run one after the other), + the repeated key/value cache
    logits     rows x min(R, chunk) x vocab x 4 bytes x (student copies + teacher copies of the divergence support)
    no_grad_forward   the largest forward without gradient run while the student's activations are kept (the
               teacher on its prompt, the previous stage's policy for regularizers.kl_prev, the base for
               grpo.kl_coef): one decoder layer in flight, rows x tokens x (3 x intermediate + 4 x hidden) x 2 bytes
    overhead   C0 (cuBLAS workspaces, allocator slack at small sizes)

and, when the recipe asks for them (first principles, not measured; `ASSUMED_COPIES`):

    previous   regularizers.kl_prev: the previous policy's scores (hidden states [rows, R, H], or full logits) and
               its full-vocabulary KL, taken as the full-support teacher's fitted copies
    reference  grpo.kl_coef: the base model's log-probs, a chunk's logits in bf16 and float32 (2 copies)
    trust_region   the student's scores on the teacher prompt and the mixture's two temporaries (3 copies of the
               teacher's scores: hidden states when chunked, else [rows, R, V] float32)
    teacher_hidden srpo: the teacher's final hidden states of every routed row of the step, [n, R, H], kept across
               the step's micro-batches (train/srpo.py)

The teacher's prompt is the student's plus its context: a sibling response or a demonstration of up to
max_new_tokens and TEACHER_TEMPLATE_TOKENS of template and feedback (an assumption). `hybrid.distill_on:
high_entropy` adds a pass before the step (`entropy_pass_terms`: the student's entropies, a no-grad forward and
ENTROPY_CHUNK_COPIES copies of one token chunk's logits).

The free constants (C_ACT, the logit copies and C0) are fitted, by least squares of the relative error, to the 14
variants measured on an H100 at the Qwen2.5-7B shape (benchmarks/perf/results/cuda_7b_memory.json, peak =
max_memory_reserved; `benchmarks/perf/fit_memory_plan.py` refits them; tests/plan/test_memory_plan.py: each within
15%). Activations are fitted at one shape only: other shapes scale by (hidden + intermediate) x layers, an assumption.
No torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from adaptercl.model import GIB, Shape, base_bytes, kv_bytes, lora_params, recurrent_state_bytes
from adaptercl.recipe import METHODS, StageConfig

# Fitted on benchmarks/perf/results/cuda_7b_memory.json (see the module docstring; fit_memory_plan.py refits).
# Largest residuals of the fit: +6.7% (sdpo, micro-batch 1), -5.8% (grpo, micro-batch 1); the others within 4%.
C_ACT = 7.34  # kept activations of one layer per token, in units of (hidden + intermediate) bf16 values
C0_GIB = 0.97  # fixed overhead
STUDENT_LOGIT_COPIES = {"chunked": 1.86, "full": 2.56}  # [rows, positions, V] float32 tensors alive at the peak
TEACHER_LOGIT_COPIES = {"none": 0.0, "sampled": 1.72, "topk": 3.31, "full": 6.40}  # same, added by the teacher
# Not measured: the previous policy's KL is a full-vocabulary divergence against a no-grad policy, as SDFT's teacher
ASSUMED_COPIES = {"previous": TEACHER_LOGIT_COPIES["full"], "reference": 2.0, "trust_region": 3.0}
TEACHER_TEMPLATE_TOKENS = 128  # teacher prompt beyond the prompt and its context: templates + feedback (assumed)
ENTROPY_CHUNK_COPIES = 4.5  # hybrid high_entropy: bf16 head output, float32 logits, log-softmax, exp, product
ENTROPY_CHUNK_ELEMENTS = 2**24  # float32 elements of one [c, V] copy (measure.policy_divergence.CHUNK_ELEMENTS)


@dataclass(frozen=True)
class TrainWorkload:
    """One micro-batch of the training step, in the terms the memory model needs."""

    rows: int
    prompt: int
    response: int
    prompts: int  # distinct prompts among the rows (U); rows: no prefix sharing
    checkpointing: bool
    chunk: int | None  # positions of full-vocabulary logits at once (None: all)
    support: str  # teacher divergence support: none, sampled, topk, full
    trainable: int  # LoRA parameters trained
    frozen: int  # frozen LoRA parameters on the GPU (earlier adapters, the teacher's adapter)
    teacher_prompt: int = 0  # the teacher's prompt tokens (0: no teacher forward)
    previous: bool = False  # regularizers.kl_prev > 0: the previous stage's policy scores every row
    reference: bool = False  # grpo.kl_coef > 0: the base model's log-probs of every row
    trust_region: bool = False  # distill.teacher.kind trust_region: two teacher-prompt forwards, mixed
    step_hidden_rows: int = 0  # sample_routed (srpo): rows whose teacher hidden states stay alive across the step


def no_grad_layer_bytes(shape: Shape, rows: int, tokens: int, dtype_bytes: int = 2) -> float:
    """One decoder layer of a forward without gradient: gate, up and their product (3 x intermediate) and ~4
    hidden-sized tensors per token."""
    return rows * tokens * (3 * shape.intermediate + 4 * shape.hidden) * dtype_bytes


def train_terms(shape: Shape, quantization: str, w: TrainWorkload) -> dict[str, float]:
    """Peak bytes of one training micro-batch, by term (only the terms the workload has)."""
    shared = w.prompts < w.rows  # the prefix-shared layout (see the module docstring)
    tokens = w.prompts * w.prompt + w.rows * w.response if shared else w.rows * (w.prompt + w.response)
    widest = max(w.prompts * w.prompt, w.rows * w.response) if shared else tokens  # one forward's positions
    layer = (shape.hidden + shape.intermediate) * 2 * C_ACT  # one layer's kept activations per position, bf16
    inputs = tokens * shape.layers * shape.hidden * 2  # each layer's input, kept under checkpointing
    activ = inputs + widest * layer if w.checkpointing else tokens * layer * shape.layers
    # each prompt's cache (a hybrid's Gated DeltaNet states too) repeated for its rows
    activ += kv_bytes(shape, w.rows * w.prompt) + recurrent_state_bytes(shape, w.rows) if shared else 0.0
    positions = min(w.response, w.chunk) if w.chunk else w.response
    one_logits = w.rows * positions * shape.vocab * 4  # [rows, positions, V] float32
    copies = STUDENT_LOGIT_COPIES["chunked" if w.chunk else "full"] + TEACHER_LOGIT_COPIES[w.support]
    forwards = [w.teacher_prompt if w.support != "none" else 0, w.prompt * (w.previous or w.reference)]
    hidden = w.rows * w.response * shape.hidden * 2  # [rows, R, H] bf16: a chunked forward's kept scores
    scores = hidden if w.chunk else w.rows * w.response * shape.vocab * 4  # or its full logits
    terms = {
        "base": base_bytes(shape, quantization),
        "adapters": w.trainable * 16 + w.frozen * 4,
        "activations": activ,
        "logits": copies * one_logits,
        "no_grad_forward": no_grad_layer_bytes(shape, w.rows, max(forwards) + w.response) if max(forwards) else 0.0,
        "previous": (scores + ASSUMED_COPIES["previous"] * one_logits) if w.previous else 0.0,
        "reference": ASSUMED_COPIES["reference"] * one_logits if w.reference else 0.0,
        "trust_region": ASSUMED_COPIES["trust_region"] * scores if w.trust_region else 0.0,
        "teacher_hidden": w.step_hidden_rows * w.response * shape.hidden * 2,
        "overhead": C0_GIB * GIB,
    }
    return {k: v for k, v in terms.items() if v or k in ("base", "adapters", "activations", "logits", "overhead")}


def has_teacher(stage: StageConfig) -> bool:
    return METHODS[stage.method].needs_teacher


def frozen_params(shape: Shape, stage: StageConfig, index: int, teacher: bool = True) -> int:
    """Earlier adapters kept frozen on the GPU (stacked `init: new`) + the teacher's adapter (with `teacher`)."""
    earlier = index * lora_params(shape, stage) if stage.adapter.init == "new" else 0
    kind = stage.distill.teacher.kind if teacher and has_teacher(stage) else None
    # no teacher or `base`: nothing; `ema`: its own rank; every other kind: a copy of the student's adapter
    ema = lora_params(shape, stage, stage.distill.teacher.ema_rank or 2 * stage.lora.r)
    return earlier + {None: 0, "base": 0, "ema": ema}.get(kind, lora_params(shape, stage))


def teacher_prompt_tokens(stage: StageConfig, prompt: int) -> int:
    """The teacher's prompt: the student's, a context (sibling or demonstration) of up to max_new_tokens, and
    TEACHER_TEMPLATE_TOKENS of template and feedback."""
    return prompt + stage.rollout.max_new_tokens + TEACHER_TEMPLATE_TOKENS


def resolved_chunk(stage: StageConfig, chunk: int | str | None = "recipe") -> int | None:
    """Positions per logit chunk on CUDA: `optim.logits_chunk_size` (auto = 1024, off = None) or the override."""
    if chunk != "recipe":
        return chunk
    setting = stage.optim.logits_chunk_size
    return 1024 if setting == "auto" else None if setting == "off" else setting


def train_workload(shape: Shape, stage: StageConfig, index: int, prompt: int, rows: int | None = None,
                   grad_accum: int | None = None, checkpointing: bool | None = None,
                   chunk: int | str | None = "recipe") -> TrainWorkload:  # fmt: skip
    """The stage's training micro-batch on CUDA (auto = checkpointing on, 1024-position chunks) of `rows` sequences
    (default: `optim.split_rows`, the split without a card); overrides for the searches."""
    optim, teacher = stage.optim, has_teacher(stage)
    sequences = optim.prompts_per_step * stage.rollout.group_size
    ckpt = optim.activation_checkpointing in ("auto", True) if checkpointing is None else checkpointing
    if rows is None:
        rows = math.ceil(sequences / grad_accum) if grad_accum else optim.split_rows(sequences)
    return TrainWorkload(
        rows=rows,
        prompt=prompt,
        response=stage.rollout.max_new_tokens,
        prompts=micro_batch_prompts(sequences, rows, stage.rollout.group_size),
        checkpointing=ckpt,
        chunk=resolved_chunk(stage, chunk),
        support=stage.distill.support if teacher else "none",
        trainable=lora_params(shape, stage),
        frozen=frozen_params(shape, stage, index),
        teacher_prompt=teacher_prompt_tokens(stage, prompt) if teacher else 0,
        previous=stage.regularizers.kl_prev > 0,
        reference=stage.grpo.kl_coef > 0 and METHODS[stage.method].policy_term,
        trust_region=teacher and stage.distill.teacher.kind == "trust_region",
        step_hidden_rows=sequences if METHODS[stage.method].sample_routed else 0,
    )


def micro_batch_groups(sequences: int, rows: int, group: int) -> list[int]:
    """The groups (of `group` samples of one prompt, side by side) each micro-batch of `rows` of a step's `sequences`
    in rollout order holds: the prompts its shared-prefix forward computes."""
    return [len({i // group for i in range(s, min(sequences, s + rows))}) for s in range(0, sequences, rows)]


def micro_batch_prompts(sequences: int, rows: int, group: int) -> int:
    """U: the most groups a micro-batch holds (`micro_batch_groups`); `rows` when no two of its rows share a prompt."""
    return max(micro_batch_groups(sequences, rows, group))


def entropy_pass_terms(shape: Shape, quantization: str, w: TrainWorkload) -> dict[str, float]:
    """`hybrid.distill_on: high_entropy`: the student's token entropies before the step
    (`train.sparse_targets.rollout_entropy`), a no-grad forward of each micro-batch and one chunk of tokens' logits at
    a time; AdamW's state is kept, the gradients are not."""
    chunk = min(max(1, ENTROPY_CHUNK_ELEMENTS // shape.vocab), w.rows * w.response)
    tokens = w.prompt + w.response
    return {
        "base": base_bytes(shape, quantization),
        "adapters": w.trainable * 12 + w.frozen * 4,
        "forward": no_grad_layer_bytes(shape, w.rows, tokens) + w.rows * tokens * shape.hidden * 2,
        "entropy_chunk": ENTROPY_CHUNK_COPIES * chunk * shape.vocab * 4,
        "overhead": C0_GIB * GIB,
    }
