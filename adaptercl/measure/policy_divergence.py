"""Full-vocabulary divergences between two policies on the same responses, with memory bounded by a chunk of tokens:
what the end-of-stage diagnostics measure (`drift.response_drift`: KL and JS to the base and the policy's entropy;
`run.diagnostics.stage_kl`: KL from the previous stage's policy).

    p, q = token_scores(model, batch, ["stage-01"]), token_scores(model, batch, None)   # one forward each
    sums = divergence_sums(p, q, ("kl", "js", "entropy"))   # Σ over the batch's response tokens, float64

A forward of a few responses (`ROWS_PER_FORWARD`, the callers' batch) keeps, per policy, only the final hidden
states of its T real response tokens, [T, H] in the model's dtype (T ≤ rows × R). The full-vocabulary float32 logits
exist for one chunk of `token_chunk(V)` tokens at a time: the LM head applied to the chunk's hidden states, as
`train/token_terms.py` does for the training loss. Per-token terms are the pure functions of `metrics.py`
(`kl_per_token`, `js_per_token`, `entropy_per_token`) on the chunk's log-probs; the sums are taken in float64, so
the means equal the whole-tensor `metrics.token_kl` / `token_js` / `mean_entropy` up to float rounding
(tests/measure/test_policy_divergence.py).

Peak memory of the measurement beyond the forward itself (which is an ordinary no-grad forward of the rows):
2 × T × H × b (hidden states of both policies, b bytes per element of the model's dtype) + PEAK_CHUNK_COPIES × c × V
× 4 bytes, with c = min(token_chunk(V), T). Before, the whole [rows, R, V] float32 logits and about nine copies of
them (logits, log-probs and the terms' temporaries of both policies) were alive at once. A model whose LM head is
more than a linear map of the hidden states (logit soft-capping, LoRA on lm_head: `model.base.decoder_and_head` refuses
them) falls back to the full logits of its rows, masked to [T, V], per policy: 2 × T × V × 4 bytes more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from adaptercl.adapters import active_adapters
from adaptercl.measure.metrics import as_float, entropy_per_token, js_per_token, kl_per_token
from adaptercl.model import TokenBatch, decoder_and_head, response_hidden, response_logits
from adaptercl.recipe import RecipeError

ROWS_PER_FORWARD = 4  # responses per forward of each policy (the callers' batches; progress is reported per batch)
CHUNK_ELEMENTS = 2**24  # float32 elements of one [c, V] copy: 64 MiB (c = 341 tokens at SmolLM2's V, 110 at Qwen2.5's)
PEAK_CHUNK_COPIES = (
    6  # [c, V] float32 copies alive at once in `divergence_sums` (tests/measure/test_policy_divergence.py)
)

Term = Literal["kl", "js", "entropy"]
# per-token term [c] of the chunk's log-probs of p and q [c, V]: KL(p‖q), JS(p, q), the entropy of p
TERMS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "kl": kl_per_token,
    "js": js_per_token,
    "entropy": lambda logp_p, logp_q: entropy_per_token(logp_p),
}


def token_chunk(vocab: int) -> int:
    """Tokens per chunk: one [c, V] float32 copy holds at most CHUNK_ELEMENTS elements."""
    return max(1, CHUNK_ELEMENTS // vocab)


@dataclass
class TokenScores:
    """One policy's scores of a batch's T real response tokens (row by row, in order): the final hidden states
    [T, H] and the plain LM head, or (for a head that is not a plain linear map) the logits [T, V] themselves."""

    hidden: Tensor | None = None  # [T, H], the model's dtype
    head: torch.nn.Module | None = None
    logits: Tensor | None = None  # [T, V] float32

    @property
    def tokens(self) -> int:
        return (self.hidden if self.hidden is not None else self.logits).shape[0]

    @property
    def vocab(self) -> int:
        return self.logits.shape[1] if self.logits is not None else self.head.out_features

    def chunk_logits(self, rows: slice) -> Tensor:
        """The logits of tokens `rows`: [c, V], float32 (as transformers' `logits.float()`; float64 stays)."""
        if self.logits is not None:
            return self.logits[rows]
        return as_float(self.head(self.hidden[rows]))  # [c, H] -> [c, V]


@torch.no_grad()
def token_scores(model: torch.nn.Module, batch: TokenBatch, adapters: list[str] | None) -> TokenScores:
    """The `TokenScores` of `batch`'s response tokens under exactly `adapters` (None or []: the base)."""
    mask = batch.response_mask.bool()  # [N, R]
    with active_adapters(model, adapters or None):
        try:
            _, head = decoder_and_head(model)
        except RecipeError:  # soft-capped logits, LoRA on lm_head: only the model's own forward gives them
            return TokenScores(logits=response_logits(model, batch)[mask])  # [N, R, V] -> [T, V]
        return TokenScores(hidden=response_hidden(model, batch)[mask], head=head)  # [N, R, H] -> [T, H]


@torch.no_grad()
def divergence_sums(
    p: TokenScores, q: TokenScores, terms: Sequence[Term], chunk: int | None = None
) -> dict[str, float]:
    """Σ over the T tokens of each per-token term (`TERMS`) between policies p and q, in float64; `chunk` tokens at
    a time (default `token_chunk(V)`)."""
    if p.tokens != q.tokens or p.vocab != q.vocab:
        raise ValueError(f"the policies score different tokens: {p.tokens} x {p.vocab} vs {q.tokens} x {q.vocab}")
    chunk = chunk or token_chunk(p.vocab)
    sums = dict.fromkeys(terms, 0.0)
    for start in range(0, p.tokens, chunk):
        rows = slice(start, start + chunk)
        logp_p = p.chunk_logits(rows).log_softmax(-1)  # [c, V]
        logp_q = q.chunk_logits(rows).log_softmax(-1)  # [c, V]
        for term in terms:
            sums[term] += TERMS[term](logp_p, logp_q).double().sum().item()  # [c] -> scalar
        del logp_p, logp_q
    return sums
