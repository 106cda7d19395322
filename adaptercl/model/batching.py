"""Token batches for the trainer: left-padded prompts, right-padded responses, response-aligned logits.

Every sequence is laid out as [pad.. prompt | response ..pad] so all responses start at the same column and
`logits_to_keep` computes logits for response positions only. A teacher batch (a different prompt, the same
responses) therefore yields logits aligned token-for-token with the student's. `response_hidden` is the same forward
stopped before the LM head (the final hidden states of those positions), for losses that compute logits a chunk of
positions at a time (`train/token_terms.py`); `response_scores` returns one or the other as `ResponseScores`, the
student's, the teacher's and the previous stage's policy's alike.

Prefix sharing runs the prefixes with a key/value cache; while the model trains under activation checkpointing
(`checkpointing.py`) that cache is a `prefix_sharing.ReplayableCache`, whose recompute in backward gives the first
pass's tensors. It is taken only where the model's cache layers read the layout exactly (`cache_layers.
shared_prefix_limit`: not on a hybrid linear-attention model, not across a sliding window's gap).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from adaptercl.model.base import decoder_and_head
from adaptercl.model.cache_layers import shared_prefix_limit
from adaptercl.model.checkpointing import checkpointing_active
from adaptercl.model.prefix_sharing import prefill, prefix_layout


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """float16/bfloat16 -> float32; float32/float64 unchanged (as `train.losses._upcast`): logits and log-probs are
    never computed in half precision, and a float64 model (`model.dtype: float64`, the numerical checks) stays
    float64."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # [N, P+R]
    attention_mask: torch.Tensor  # [N, P+R]
    position_ids: torch.Tensor  # [N, P+R]
    response_ids: torch.Tensor  # [N, R]
    response_mask: torch.Tensor  # [N, R] float, 1 on real response tokens

    def to(self, device: torch.device) -> TokenBatch:
        return TokenBatch(*(t.to(device) for t in vars(self).values()))

    def select(self, rows: slice | torch.Tensor | list[int]) -> TokenBatch:
        return TokenBatch(*(t[rows] for t in vars(self).values()))


def build_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> TokenBatch:
    """Pack prompt/response pairs; an empty response still gets one (masked) column."""
    n = len(prompts)
    p_width = max(len(p) for p in prompts)
    r_width = max(1, max(len(r) for r in responses))
    input_ids = torch.full((n, p_width + r_width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, p_width + r_width), dtype=torch.long)
    response_mask = torch.zeros((n, r_width))
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, p_width - len(p) : p_width] = torch.tensor(p, dtype=torch.long)
        attention[i, p_width - len(p) : p_width + len(r)] = 1
        if r:
            input_ids[i, p_width : p_width + len(r)] = torch.tensor(r, dtype=torch.long)
            response_mask[i, : len(r)] = 1.0
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    return TokenBatch(input_ids, attention, position_ids, input_ids[:, p_width:].clone(), response_mask)


def trim_padding(batch: TokenBatch, response_width: int | None = None) -> TokenBatch:
    """`batch` without the columns that are padding in every row: the leading prompt columns and the response columns
    after the longest response (one column kept at least, as `build_batch`), or after `response_width` when given (a
    teacher batch cut to its student micro-batch's width). Every row keeps its tokens, attention mask and positions, so
    its logits are the same up to rounding; the forward costs [N, P'+R'] instead of [N, P+R]."""
    r_width = batch.response_ids.shape[1]
    p_width = batch.input_ids.shape[1] - r_width
    first = p_width - int(batch.attention_mask[:, :p_width].sum(-1).max())  # left padding: the longest prompt's start
    if response_width is None:
        response_width = max(1, int(batch.attention_mask[:, p_width:].sum(-1).max()))
    end = p_width + response_width
    return TokenBatch(
        batch.input_ids[:, first:end],
        batch.attention_mask[:, first:end],
        batch.position_ids[:, first:end],
        batch.response_ids[:, :response_width],
        batch.response_mask[:, :response_width],
    )


def prompt_lists(batch: TokenBatch) -> list[list[int]]:
    """Each row's prompt tokens (its left padding removed), as `build_batch` was given them."""
    p_width = batch.input_ids.shape[1] - batch.response_ids.shape[1]
    lengths = batch.attention_mask[:, :p_width].sum(-1).tolist()  # [N]
    return [row[p_width - length :] for row, length in zip(batch.input_ids[:, :p_width].tolist(), lengths)]


def response_logits(
    model: torch.nn.Module, batch: TokenBatch, share_prompts: bool = True, temperature: float = 1.0
) -> torch.Tensor:
    """Logits predicting each response token, divided by `temperature`: [N, R, V] (float32).

    Rows of a batch often begin alike: a GRPO group holds one prompt G times, an SDPO teacher batch holds a
    group's question G times with a different solution or feedback after it, and every chat prompt starts with
    the same template header. With `share_prompts` the rows are split into runs of consecutive rows with a common
    token prefix (`prefix_sharing`); each run's prefix is run once and its key/value cache repeated for the run's
    rows (gradients flow back through the repeat), then every row continues from it with the rest of its prompt
    and its response. That path is taken when it computes fewer (padded) tokens than the plain forward and the
    model's cache reads it exactly (`cache_layers.shared_prefix_limit`); both give the same logits up to float
    rounding.
    """
    logits = _prefix_shared_logits(model, batch) if share_prompts else None
    if logits is None:
        logits = _plain_response_logits(model, batch)
    # At temperature 1 (the default) this skips a pass over [N, R, V] forward and another in backward.
    return logits if temperature == 1.0 else logits / temperature


def response_hidden(model: torch.nn.Module, batch: TokenBatch, share_prompts: bool = True) -> torch.Tensor:
    """The final hidden states (after the last norm) at the positions predicting each response token: [N, R, H]
    in the model's dtype; `response_logits` = LM head of these, / temperature, in float32."""
    r_width = batch.response_ids.shape[1]
    decoder, _ = decoder_and_head(model)
    hidden = _prefix_shared_hidden(decoder, batch) if share_prompts else None
    if hidden is not None:
        return hidden
    out = decoder(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    )
    return out.last_hidden_state[:, -(r_width + 1) : -1]  # position P-1+t predicts response token t


@dataclass
class ResponseScores:
    """A forward's output at the response positions: full `logits` [n, R, V] (float32, / temperature), or `hidden`
    [n, R, H] with the LM `head` that turns a chunk of them into those logits."""

    logits: Tensor | None = None
    hidden: Tensor | None = None
    head: torch.nn.Module | None = None
    temperature: float = 1.0

    def chunk_logits(self, hidden: Tensor) -> Tensor:
        """head(hidden) / temperature in float32 for hidden [n, c, H] -> [n, c, V] (as `response_logits`)."""
        logits = at_least_float32(self.head(hidden))
        return logits if self.temperature == 1.0 else logits / self.temperature


def response_scores(
    model: torch.nn.Module, batch: TokenBatch, temperature: float, chunk_size: int | None
) -> ResponseScores:
    """The scores of `batch`'s response positions: full logits when `chunk_size` is None, else hidden states."""
    if chunk_size is None:
        return ResponseScores(logits=response_logits(model, batch, temperature=temperature))
    _, head = decoder_and_head(model)
    return ResponseScores(hidden=response_hidden(model, batch), head=head, temperature=temperature)


def _plain_response_logits(model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
    r_width = batch.response_ids.shape[1]
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        logits_to_keep=r_width + 1,
        use_cache=False,
    )
    return at_least_float32(out.logits[:, :-1])  # position P-1+t predicts response token t


def _prefix_shared_logits(model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor | None:
    """`response_logits` through `prefix_sharing` ([N, R, V]), or None when that layout would not be cheaper."""
    r_width = batch.response_ids.shape[1]
    out = _prefix_shared_forward(model, batch, logits_to_keep=r_width)
    return None if out is None else at_least_float32(out.logits)


def _prefix_shared_hidden(decoder: torch.nn.Module, batch: TokenBatch) -> torch.Tensor | None:
    """`response_hidden` through `prefix_sharing` ([N, R, H]), or None when that layout would not be cheaper."""
    out = _prefix_shared_forward(decoder, batch, logits_to_keep=None)
    return None if out is None else out.last_hidden_state[:, -batch.response_ids.shape[1] :]


def _prefix_shared_forward(model: torch.nn.Module, batch: TokenBatch, logits_to_keep: int | None):
    """The `prefix_sharing.prefill` output of `batch`, or None when that layout would not be cheaper.

    After its prefix each row runs its own prompt tokens and response tokens 0..R-2; the last R positions (the
    last prompt token, then the response tokens) predict the R response tokens.
    """
    r_width = batch.response_ids.shape[1]
    p_width = batch.input_ids.shape[1] - r_width
    limit = shared_prefix_limit(model)
    layout = prefix_layout(prompt_lists(batch), r_width - 1, pad_id=0, device=batch.input_ids.device, limit=limit)
    if layout is None:
        return None
    rest_ids = torch.cat([layout.own_ids, batch.input_ids[:, p_width:-1]], dim=1)  # [N, S+R-1]
    rest_mask = torch.cat([layout.own_mask, batch.attention_mask[:, p_width:-1]], dim=1)
    replayable = checkpointing_active(model)  # a training forward whose layers backward recomputes
    return prefill(model, layout, rest_ids, rest_mask, logits_to_keep=logits_to_keep, replayable=replayable)


def encode_chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` rendered by the chat template, ending with the assistant generation prompt."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
