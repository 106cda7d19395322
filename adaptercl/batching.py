"""Token batches for the trainer: left-padded prompts, right-padded responses, response-aligned logits.

Every sequence is laid out as [pad.. prompt | response ..pad] so all responses start at the same column and
`logits_to_keep` computes logits for response positions only. A teacher batch (a different prompt, the same
responses) therefore yields logits aligned token-for-token with the student's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adaptercl.rollout import Completion


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


def response_logits(model: torch.nn.Module, batch: TokenBatch, share_prompts: bool = True) -> torch.Tensor:
    """Logits predicting each response token: [N, R, V] (float32).

    GRPO and SDPO batches hold each prompt G times in consecutive rows. With `share_prompts` such a prompt is run
    once and its key/value cache repeated for its rows (gradients flow back through the repeat), so the forward
    and backward cost of the prompt tokens is divided by G; a batch without repeated consecutive prompts takes
    the plain path. Both paths give the same logits up to float rounding.
    """
    r_width = batch.response_ids.shape[1]
    if share_prompts:
        counts = _consecutive_prompt_counts(batch)  # [U]
        if counts is not None:
            return _shared_prompt_logits(model, batch, counts)
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        logits_to_keep=r_width + 1,
        use_cache=False,
    )
    return out.logits[:, :-1].float()  # position P-1+t predicts response token t


def _consecutive_prompt_counts(batch: TokenBatch) -> torch.Tensor | None:
    """Run lengths of identical consecutive prompts ([U], summing to N), or None when no prompt repeats."""
    p_width = batch.input_ids.shape[1] - batch.response_ids.shape[1]
    return prompt_runs(batch.input_ids[:, :p_width], batch.attention_mask[:, :p_width])


def prompt_runs(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor | None:
    """Run lengths ([U], summing to B) of identical consecutive rows of left-padded prompts [B, P], or None when
    no row repeats its predecessor. A group's samples are consecutive, so each run is one prompt's group."""
    rows = torch.cat([input_ids, attention_mask], dim=1)  # [B, 2P]
    _, counts = torch.unique_consecutive(rows, dim=0, return_counts=True)
    return counts if len(counts) < len(rows) else None


def run_starts(counts: torch.Tensor) -> torch.Tensor:
    """[U] index of the first row of each run."""
    return counts.cumsum(0) - counts


def _shared_prompt_logits(model: torch.nn.Module, batch: TokenBatch, counts: torch.Tensor) -> torch.Tensor:
    """`response_logits` with each run of identical prompts computed once. counts: [U] rows per unique prompt."""
    n, total = batch.input_ids.shape
    r_width = batch.response_ids.shape[1]
    p_width = total - r_width
    first = run_starts(counts)  # [U]
    prompt_out = model(
        input_ids=batch.input_ids[first, :p_width],  # [U, P]
        attention_mask=batch.attention_mask[first, :p_width],
        position_ids=batch.position_ids[first, :p_width],
        logits_to_keep=1,  # the last prompt position (never padding: prompts are left-padded)
        use_cache=True,
    )
    first_logits = prompt_out.logits[:, -1:].float().repeat_interleave(counts, dim=0)  # [N, 1, V]
    if r_width == 1:
        return first_logits
    cache = prompt_out.past_key_values
    cache.batch_repeat_interleave(counts.to(batch.input_ids.device))  # [U, ...] -> [N, ...], differentiable
    rest = model(
        input_ids=batch.input_ids[:, p_width:-1],  # [N, R-1]: response tokens 0..R-2 predict tokens 1..R-1
        attention_mask=batch.attention_mask[:, :-1],  # [N, P+R-1]
        position_ids=batch.position_ids[:, p_width:-1],
        past_key_values=cache,
        use_cache=True,
    )
    return torch.cat([first_logits, rest.logits.float()], dim=1)  # [N, R, V]


@torch.no_grad()
def response_logprobs(
    model: torch.nn.Module, completions: list[Completion], pad_id: int, temperature: float
) -> list[list[float]]:
    """Per-token logprobs of each completion's tokens under logits / temperature (teacher-forced, no grad)."""
    batch = build_batch([c.prompt_ids for c in completions], [c.token_ids for c in completions], pad_id)
    batch = batch.to(next(model.parameters()).device)
    logits = response_logits(model, batch) / temperature  # [N, R, V]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)  # [N, R]
    return [logp[i, : len(c.token_ids)].tolist() for i, c in enumerate(completions)]


def encode_chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` rendered by the chat template, ending with the assistant generation prompt."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
