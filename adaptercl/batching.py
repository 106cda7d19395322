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

    Rows of a batch often begin alike: a GRPO group holds one prompt G times, an SDPO teacher batch holds a
    group's question G times with a different solution or feedback after it, and every chat prompt starts with
    the same template header. With `share_prompts` the rows are split into runs of consecutive rows with a common
    token prefix (`shared_prefix_runs`); each run's prefix is run once and its key/value cache repeated for the
    run's rows (gradients flow back through the repeat), then every row continues from it with the rest of its
    prompt and its response. That path is taken when it computes fewer (padded) tokens than the plain forward;
    both give the same logits up to float rounding.
    """
    r_width = batch.response_ids.shape[1]
    if share_prompts:
        plan = _prefix_plan(batch)
        if plan is not None:
            return _prefix_shared_logits(model, batch, *plan)
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        logits_to_keep=r_width + 1,
        use_cache=False,
    )
    return out.logits[:, :-1].float()  # position P-1+t predicts response token t


def prompt_runs(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor | None:
    """Run lengths ([U], summing to B) of identical consecutive rows of left-padded prompts [B, P], or None when
    no row repeats its predecessor. A group's samples are consecutive, so each run is one prompt's group."""
    rows = torch.cat([input_ids, attention_mask], dim=1)  # [B, 2P]
    _, counts = torch.unique_consecutive(rows, dim=0, return_counts=True)
    return counts if len(counts) < len(rows) else None


def run_starts(counts: torch.Tensor) -> torch.Tensor:
    """[U] index of the first row of each run."""
    return counts.cumsum(0) - counts


def shared_prefix_runs(prompts: list[list[int]]) -> tuple[list[int], list[int]]:
    """Split consecutive prompts into runs that share a token prefix, so as to compute the most prompt tokens once.

    Returns (rows per run, shared prefix length per run). A run's prefix is the common prefix of its prompts,
    cut to leave every prompt at least one token of its own (the last prompt token's logits predict the first
    response token); a single-row run keeps all but its last token in the prefix. The partition maximises the
    tokens saved, Σ_runs (rows − 1) · prefix, exactly (dynamic programming over run ends, O(N²)).
    """
    n = len(prompts)
    common = [0] + [_common_prefix_length(prompts[i - 1], prompts[i]) for i in range(1, n)]  # [N]
    best = [0] * (n + 1)  # best[j]: most tokens saved by the first j rows
    cut = [0] * (n + 1)  # cut[j]: the first row of the last run of that best split
    for end in range(1, n + 1):
        best[end], cut[end] = best[end - 1], end - 1  # row end-1 alone
        shared, shortest = len(prompts[end - 1]), len(prompts[end - 1])
        for begin in range(end - 2, -1, -1):  # the run is rows begin .. end-1
            shared = min(shared, common[begin + 1])
            shortest = min(shortest, len(prompts[begin]))
            saved = (end - 1 - begin) * min(shared, shortest - 1)
            if saved <= 0:
                break  # the prefix only shrinks as the run grows
            if best[begin] + saved > best[end]:
                best[end], cut[end] = best[begin] + saved, begin
    counts, prefixes, end = [], [], n
    while end > 0:
        begin = cut[end]
        shared = min([len(p) - 1 for p in prompts[begin:end]] + common[begin + 1 : end])
        counts.append(end - begin)
        prefixes.append(shared)
        end = begin
    return counts[::-1], prefixes[::-1]


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _prefix_plan(batch: TokenBatch) -> tuple[list[int], list[int]] | None:
    """`shared_prefix_runs` of the batch's prompts, or None when the plain forward computes no more tokens."""
    n, total = batch.input_ids.shape
    r_width = batch.response_ids.shape[1]
    p_width = total - r_width
    lengths = batch.attention_mask[:, :p_width].sum(-1).tolist()  # [N]
    ids = batch.input_ids[:, :p_width].tolist()
    prompts = [row[p_width - length :] for row, length in zip(ids, lengths)]
    counts, prefixes = shared_prefix_runs(prompts)
    if min(prefixes) < 1:
        return None  # a row with nothing before it to attend to: keep the plain, left-padded layout
    own = [length - prefix for length, prefix in zip(lengths, _per_row(prefixes, counts))]  # [N]
    shared_cost = len(counts) * max(prefixes) + n * (max(own) + r_width - 1)  # padded tokens of the two calls
    return (counts, prefixes) if shared_cost < n * total else None


def _per_row(values: list[int], counts: list[int]) -> list[int]:
    return [v for v, k in zip(values, counts) for _ in range(k)]


def _prefix_shared_logits(
    model: torch.nn.Module, batch: TokenBatch, counts: list[int], prefixes: list[int]
) -> torch.Tensor:
    """`response_logits` with each run's shared prompt prefix computed once (see `shared_prefix_runs`).

    Call 1 runs the U prefixes, left-padded to C = max prefix, and keeps their cache. Call 2 runs, for every row,
    the rest of its prompt (left-padded to S) followed by response tokens 0..R-2, over the cache repeated per
    row; the padding between a row's prefix and its own tokens is masked, and positions follow the mask, so each
    row sees exactly its own prompt. Its last R positions predict the R response tokens.
    """
    device = batch.input_ids.device
    n, total = batch.input_ids.shape
    r_width = batch.response_ids.shape[1]
    p_width = total - r_width
    lengths = batch.attention_mask[:, :p_width].sum(-1).tolist()  # [N]
    row_prefix = _per_row(prefixes, counts)  # [N]
    firsts = run_starts(torch.tensor(counts)).tolist()  # [U]
    c_width = max(prefixes)
    s_width = max(length - prefix for length, prefix in zip(lengths, row_prefix))
    prefix_ids = torch.full((len(counts), c_width), 0, dtype=torch.long, device=device)  # [U, C]
    prefix_mask = torch.zeros((len(counts), c_width), dtype=torch.long, device=device)  # [U, C]
    own_ids = torch.full((n, s_width), 0, dtype=torch.long, device=device)  # [N, S]
    own_mask = torch.zeros((n, s_width), dtype=torch.long, device=device)  # [N, S]
    for u, (row, prefix) in enumerate(zip(firsts, prefixes)):
        start = p_width - lengths[row]
        prefix_ids[u, c_width - prefix :] = batch.input_ids[row, start : start + prefix]
        prefix_mask[u, c_width - prefix :] = 1
    for i in range(n):
        own = lengths[i] - row_prefix[i]
        own_ids[i, s_width - own :] = batch.input_ids[i, p_width - own : p_width]
        own_mask[i, s_width - own :] = 1
    repeats = torch.tensor(counts, device=device)  # [U]
    prefix_out = model(
        input_ids=prefix_ids,
        attention_mask=prefix_mask,
        position_ids=(prefix_mask.cumsum(-1) - 1).clamp(min=0),
        logits_to_keep=1,  # logits are not needed here; 1 is the fewest the model computes
        use_cache=True,
    )
    cache = prefix_out.past_key_values
    cache.batch_repeat_interleave(repeats)  # [U, ...] -> [N, ...], differentiable
    mask = torch.cat(
        [prefix_mask.repeat_interleave(repeats, dim=0), own_mask, batch.attention_mask[:, p_width:-1]], dim=1
    )  # [N, C+S+R-1]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, c_width:]  # [N, S+R-1]
    out = model(
        input_ids=torch.cat([own_ids, batch.input_ids[:, p_width:-1]], dim=1),  # [N, S+R-1]
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        logits_to_keep=r_width,
        use_cache=True,
    )
    return out.logits.float()  # [N, R, V]: the last prompt token, then response tokens 0..R-2


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
