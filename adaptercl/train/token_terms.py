"""The per-token quantities of the training loss computed from a forward's response positions, optionally one chunk
of positions at a time so that no full-vocabulary [rows, R, V] float32 logits exist for a whole micro-batch.

A forward's output over the response positions is `model.batching.ResponseScores`: either the full logits [n, R, V]
(float32, already / temperature: today's path, `optim.logits_chunk_size: off`, the CPU default) or the final hidden
states [n, R, H] with the LM head. `token_terms` turns the student's scores (and those of the previous stage's
policy for `kl_prev`, and of the teacher on the distilled rows) into per-token tensors [n, R]: the log-probs of the
sampled tokens, the entropies, KL to the previous policy, the distillation divergence, and under top-p sampling the
log of the mass the sampler kept (`rollout.kept_log_mass`, for the rollout-mismatch ratio: `step.py`). With a
chunk size c, each chunk computes its logits = head(h[:, chunk]).float() / temperature (the model's dtype for the
matmul, float32 after, as transformers' `logits.float()`), the same pure functions of `losses.py` /
`regularizers.py` on them, and is wrapped in non-reentrant `torch.utils.checkpoint`: only the chunk's inputs (hidden
states, a few [n, c, H]) are kept for backward, which recomputes one chunk's logits at a time. Peak logits memory:
~3 × n × c × V × 4 bytes (student, teacher, previous) instead of the same with R. TRL computes its log-probs in
chunks of rows for the same reason; chunking positions also bounds one long row.

Every loss term is a function of these per-token values (the policy term of log-probs, the distillation term of
the divergence times detached importance weights), so the loss and its gradient are those of the unchunked path up
to float rounding (tests/train/test_memory_settings.py). The trust-region teacher mixes hidden states instead of
logits: the LM head is linear (no bias, no soft-capping: `model.base.decoder_and_head` refuses others), so that is the
same mixture of logits.

`auto` (the default) is 1024 positions on CUDA and off on CPU, where the full path is the one the quickstart's
adapters were made with.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from adaptercl.model import ResponseScores
from adaptercl.recipe import DistillConfig
from adaptercl.rollout import kept_log_mass
from adaptercl.train.losses import distillation_divergence, gather_logprobs, kl_to_previous, token_entropy

CUDA_CHUNK = 1024  # `optim.logits_chunk_size: auto` on CUDA: ~0.6 GB of float32 logits at Qwen2.5's V per row


def resolve_logits_chunk_size(setting: str | int, device: torch.device) -> int | None:
    """`optim.logits_chunk_size` for a model on `device`: positions per chunk, or None for the full logits."""
    if setting == "off":
        return None
    if setting == "auto":
        return CUDA_CHUNK if device.type == "cuda" else None
    return int(setting)


@dataclass
class TokenTerms:
    """Per-token quantities of one micro-batch (n rows; n_t distilled rows)."""

    logp: Tensor  # [n, R] log-probs of the sampled tokens (gradient)
    entropy: Tensor  # [n, R] student entropies (no gradient)
    kl_prev: Tensor | None = None  # [n, R] KL(current ‖ previous stage) (gradient), when asked for
    divergence: Tensor | None = None  # [n_t, R] distillation divergence on `target_rows` (gradient)
    teacher_logp: Tensor | None = None  # [n_t, R] teacher log-probs of the sampled tokens (`sampled` support stat)
    log_kept: Tensor | None = None  # [n, R] log of the mass top-p sampling keeps (`rollout.kept_log_mass`), asked for


def token_terms(
    student: ResponseScores,
    response_ids: Tensor,
    chunk_size: int | None,
    previous: ResponseScores | None = None,
    teacher: ResponseScores | None = None,
    target_rows: Tensor | None = None,
    distill: DistillConfig | None = None,
    top_p: float = 1.0,
) -> TokenTerms:
    """The `TokenTerms` of a micro-batch: response_ids [n, R]; `previous` the previous policy's scores on the same
    rows (kl_prev); `teacher` the teacher's on rows `target_rows` [n_t] with the divergence of `distill`; with
    `top_p` < 1, `log_kept` of the student's logits (the rollout-mismatch ratio under truncated sampling)."""
    if chunk_size is None:
        prev, teach = (None if s is None else s.logits for s in (previous, teacher))
        return _terms(student.logits, response_ids, prev, teach, target_rows, distill, top_p)
    parts = []
    for start in range(0, response_ids.shape[1], chunk_size):
        cols = slice(start, start + chunk_size)

        def chunk(
            h_student: Tensor, h_prev: Tensor | None, h_teacher: Tensor | None, cols: slice = cols
        ) -> TokenTerms:
            return _terms(
                student.chunk_logits(h_student),
                response_ids[:, cols],
                None if h_prev is None else previous.chunk_logits(h_prev),
                None if h_teacher is None else teacher.chunk_logits(h_teacher),
                target_rows,
                distill,
                top_p,
            )

        inputs = [None if s is None else s.hidden[:, cols] for s in (student, previous, teacher)]
        if torch.is_grad_enabled() and student.hidden.requires_grad:  # keep [n, c, H], recompute [n, c, V]
            parts.append(checkpoint(chunk, *inputs, use_reentrant=False))
        else:
            parts.append(chunk(*inputs))
    return TokenTerms(
        **{
            f.name: None if getattr(parts[0], f.name) is None else torch.cat([getattr(p, f.name) for p in parts], 1)
            for f in fields(TokenTerms)
        }
    )


def _terms(
    logits: Tensor,
    response_ids: Tensor,
    prev_logits: Tensor | None,
    teacher_logits: Tensor | None,
    target_rows: Tensor | None,
    distill: DistillConfig | None,
    top_p: float = 1.0,
) -> TokenTerms:
    """`TokenTerms` of logits [n, T, V] (a chunk or all of R); teacher_logits [n_t, T, V] on rows `target_rows`.
    The no-gradient values come last, so a checkpointed chunk's backward recompute stops before them."""
    logp = gather_logprobs(logits, response_ids)  # [n, T]
    kl = None if prev_logits is None else kl_to_previous(logits, prev_logits)  # [n, T]
    divergence = teacher_logp = None
    if teacher_logits is not None:
        ids = response_ids[target_rows]  # [n_t, T]
        every_row = torch.equal(target_rows, torch.arange(logits.shape[0], device=target_rows.device))
        student = logits if every_row else logits[target_rows]  # [n_t, T, V]: no copy (nor its backward) of all rows
        divergence = distillation_divergence(
            student, teacher_logits, distill.alpha, distill.support, distill.topk, distill.tail, ids
        )  # [n_t, T]
        if distill.support == "sampled":
            with torch.no_grad():
                teacher_logp = gather_logprobs(teacher_logits, ids)  # [n_t, T]
    with torch.no_grad():
        entropy = token_entropy(logits)  # [n, T]
        log_kept = kept_log_mass(logits, top_p) if top_p < 1.0 else None  # [n, T]
    return TokenTerms(logp, entropy, kl, divergence, teacher_logp, log_kept)


@torch.no_grad()
def token_logprobs(scores: ResponseScores, response_ids: Tensor, chunk_size: int | None) -> Tensor:
    """Log-probs of the response tokens [n, R] (no gradient), a chunk of positions at a time when chunked."""
    if chunk_size is None:
        return gather_logprobs(scores.logits, response_ids)
    parts = []
    for start in range(0, response_ids.shape[1], chunk_size):
        cols = slice(start, start + chunk_size)
        parts.append(gather_logprobs(scores.chunk_logits(scores.hidden[:, cols]), response_ids[:, cols]))
    return torch.cat(parts, dim=1)
