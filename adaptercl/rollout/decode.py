"""Token-by-token decoding for the transformers engine: finished rows leave the batch, each row samples from its own
random stream.

`decode` replaces `transformers.generate` in `rollout/hf.py`. Per step it runs one forward of the rows still
decoding over their key/value cache (one position's logits each), picks every row's next token, and drops the rows
that just stopped (a stop token or the length cap) from the batch and from the cache, so the compute per step follows
the rows still running rather than the batch's longest response (`generate` decodes every row until the last one
stops). A drop copies the kept rows' cache once (`model.select_rows`), about what `DynamicCache`'s concatenation
cost at every step. Rows leave only a cache whose every layer is of a kind with a known rule for it (`ROW_RULES`:
key/value layers, the reserved layer below, linear-attention conv and recurrent states, hybrids of both;
`model/cache_layers.py`); a cache with a layer of another kind keeps all its rows to the end, each finished row fed
the pad token and its outputs thrown away (masked), so an unknown layer never loses a row's state.

The distribution is `generate`'s with `repetition_penalty=1`, `top_k=0`: softmax(logits / temperature), cut to the
nucleus of mass `top_p` as transformers' `TopPLogitsWarper` cuts it (`truncation.truncated_logits`); greedy is the
argmax. A minimum length masks the stop tokens until a row has that many tokens, as `generate`'s
`MinNewTokensLengthLogitsProcessor` / `MinLengthLogitsProcessor` do before temperature and top-p (`min_new_tokens`: the
request's, else the model's `generation_config`). What differs is where the randomness comes from, and that is
deliberate: `generate` draws one `torch.multinomial` for the whole batch from the global generator, so a row's sample
depends on which other rows are still in the batch, and dropping a finished row would change every later draw of every
other row. Here row r draws one uniform per step from its own `torch.Generator` seeded with `row_seeds[r]` and takes
the token where the cumulative distribution (in float64) passes it (`sample_tokens`, inverse-CDF sampling, the method
`torch.multinomial` itself uses on CPU). So a row's response depends on its seed and prompt only, not on the batch
size, the rows beside it, or a data-parallel split; it is not the token `generate` would have drawn under
`torch.manual_seed` (a different stream), and greedy rows are exactly `generate`'s (`tests/rollout/test_decode.py`).

The key/value cache is reserved once for the whole response (`ReservedLayer`): `DynamicCache` appends by
concatenation, copying every row's whole cache at every step (16 % of a decode step's time at 8 rows x 100 prompt
tokens on SmolLM2, more as responses grow), while a reserved layer writes the new position in place and hands the
attention a view of the filled part, the same values. The forward of a step sees each remaining row's same keys,
values, positions and mask as in `generate`; only the batch's size changes, which can change a matmul's rounding in
the last bit (the kernels block by batch size).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from adaptercl.model import CACHE, SELECTS, can_select_rows, output_cache, select_keys, select_rows
from adaptercl.rollout.truncation import sampler_logprobs, truncated_logits


class ReservedLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values live in buffers reserved for `capacity` positions: `update` writes the
    new states in place and returns views of the filled part ([B, heads, L, d]), instead of concatenating."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        super().__init__()
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        batch, heads, length, dim = keys.shape
        self.key_buffer = keys.new_empty(batch, heads, capacity, dim)  # [B, h, capacity, d]
        self.value_buffer = values.new_empty(batch, values.shape[1], capacity, values.shape[-1])
        self.key_buffer[:, :, :length] = keys
        self.value_buffer[:, :, :length] = values
        self.length = length
        self._views()

    def _views(self) -> None:
        self.keys = self.key_buffer[:, :, : self.length]  # [B, h, L, d]
        self.values = self.value_buffer[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        new = key_states.shape[-2]
        if self.length + new > self.key_buffer.shape[-2]:
            raise RuntimeError(f"reserved cache full: {self.length} + {new} > {self.key_buffer.shape[-2]}")
        self.key_buffer[:, :, self.length : self.length + new] = key_states
        self.value_buffer[:, :, self.length : self.length + new] = value_states
        self.length += new
        self._views()
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]
        self._views()


ROW_RULES = {**SELECTS, ReservedLayer: select_keys}  # exact layer type -> how it keeps only some rows


def reserve(cache: Any, extra: int) -> None:
    """Replace every plain `DynamicLayer` of `cache` by a `ReservedLayer` with room for `extra` more positions.
    A layer of another kind (a subclass included: a hybrid's is a DynamicLayer too), or a cache without `layers`,
    is left to grow as it does."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.numel() > 0:
            layers[i] = ReservedLayer(layer.keys, layer.values, layer.keys.shape[-2] + extra)


def min_new_tokens(generation_config: Any, requested: int | None, prompt_lengths: list[int]) -> list[int]:
    """Each row's minimum number of new tokens (its stop tokens are masked until then), as `generate` reads it:
    `requested` (a `min_new_tokens` argument) if given, else `generation_config.min_new_tokens`, else
    `generation_config.min_length` less the row's prompt length (min_length counts the prompt), else 0.

    One departure: `generate` subtracts the batch's padded width from `min_length` (its `input_ids` are padded),
    so a row's minimum there depends on the longest prompt beside it; here it is the row's own prompt length, what
    `generate` gives that row alone (a row's sample depends on its prompt only: the module docstring)."""
    if requested is None:
        requested = getattr(generation_config, "min_new_tokens", None)
    if requested is not None:
        return [int(requested)] * len(prompt_lengths)
    min_length = getattr(generation_config, "min_length", None) or 0
    return [max(min_length - n, 0) for n in prompt_lengths]


def sample_tokens(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row from softmax(logits), by inverse CDF: the first token whose cumulative probability exceeds
    the row's uniform. logits: [B, V] (temperature and truncation applied); uniforms: [B] in [0, 1), float64.
    Returns [B] token ids. The cumulative sum is float64, so a token's chance differs from its float32 probability
    by far less than that probability's own rounding; a token of probability 0 (-inf logit) is never returned."""
    weights = (logits.float() - logits.float().amax(dim=-1, keepdim=True)).exp()  # [B, V] unnormalised
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)  # [B, V]
    thresholds = (uniforms.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)  # [B, 1]
    tokens = torch.searchsorted(cdf, thresholds, right=True).squeeze(-1)  # [B]
    return tokens.clamp_(max=logits.shape[-1] - 1)  # u * total can round to total itself


@torch.no_grad()
def decode(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    cache: Any | None,
    max_new_tokens: int,
    stop_ids: list[int],
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    row_seeds: list[int] | None = None,
    pad_id: int = 0,
    min_tokens: list[int] | None = None,
    logprobs_out: list[list[float]] | None = None,
) -> list[list[int]]:
    """Each row's response tokens (ending with its stop token, if it stopped on one), at most `max_new_tokens`.

    input_ids, attention_mask: [B, W] every row's whole prompt, left-padded or in a prefix-sharing layout (mask
    holes between a shared prefix and the row's own tokens). cache: None, or a `DynamicCache` holding all but the
    last column (the rollout prefill's); positions follow the mask, as in `generate`. row_seeds: [B] one seed per
    row (sampling only). pad_id: what a finished row is fed while a cache that cannot drop rows keeps it.
    min_tokens: [B] each row's minimum length (`min_new_tokens`): its stop tokens are masked
    (-inf, so never sampled nor the argmax) while it has fewer tokens. logprobs_out: an empty list to fill with each
    row's logprob of each of its tokens under the distribution the step's logits give (logits / temperature, cut
    to the top-p nucleus when sampling: `truncation.sampler_logprobs`, the hf engine's `response_logprobs`
    definition; before the minimum-length mask, which the trainer does not know): the sampler's own logprobs, for a
    policy that is not the trainer's (bf16 weights: `hf.py`).
    """
    device = input_ids.device
    rows = input_ids.shape[0]
    if not greedy:
        assert row_seeds is not None and len(row_seeds) == rows, "sampling needs one seed per row"
        generators = [torch.Generator().manual_seed(int(s)) for s in row_seeds]
    stops = torch.tensor(stop_ids, dtype=torch.long, device=device)
    minimum = torch.tensor(min_tokens or [0] * rows)  # [B]
    responses: list[list[int]] = [[] for _ in range(rows)]
    if logprobs_out is not None:
        logprobs_out[:] = [[] for _ in range(rows)]
    alive = torch.arange(rows)  # [b] the original row of each batch row still decoding
    mask = attention_mask  # [b, L]
    if cache is None:
        step_ids, positions = input_ids, (mask.cumsum(-1) - 1).clamp(min=0)  # the whole prompt: [b, W]
    else:
        step_ids, positions = input_ids[:, -1:], mask.sum(-1, keepdim=True) - 1  # its last token: [b, 1]
    running = torch.ones(rows, dtype=torch.bool, device=device)  # [b] not finished (rows kept only by masking)
    first = True
    for step in range(max_new_tokens):  # every row still decoding has `step` tokens
        out = model(
            input_ids=step_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **({} if cache is None else {CACHE: cache}),
        )
        if first:
            cache, first = output_cache(out), False
            reserve(cache, max_new_tokens)  # room for every later position, written in place
            droppable = can_select_rows(cache, ROW_RULES)  # else finished rows stay, masked
        logits = raw = out.logits[:, -1, :]  # [b, V]
        short = minimum[alive] > step  # [b] rows below their minimum length
        if short.any():  # as MinNewTokensLengthLogitsProcessor: the stop tokens at -inf
            is_stop = torch.isin(torch.arange(logits.shape[-1], device=device), stops)  # [V]
            logits = logits.masked_fill(short.to(device).unsqueeze(-1) & is_stop, float("-inf"))  # [b, V]
        live = running.nonzero().squeeze(-1)  # [b'] batch rows still decoding
        if greedy:
            tokens = logits.argmax(dim=-1)  # [b]
        else:
            tokens = torch.full((logits.shape[0],), pad_id, dtype=torch.long, device=device)  # [b]
            draws = [torch.rand(1, generator=generators[r], dtype=torch.float64) for r in alive[live.cpu()].tolist()]
            picked = sample_tokens(truncated_logits(logits[live].float() / temperature, top_p), torch.cat(draws))
            tokens[live] = picked.to(device)
        for row, token in zip(alive[live.cpu()].tolist(), tokens[live].tolist()):
            responses[row].append(token)
        if logprobs_out is not None:  # [b', 1, V] and [b', 1] -> [b'] (the rows still decoding)
            logp = sampler_logprobs(
                (raw[live] / temperature).unsqueeze(1), tokens[live].unsqueeze(1), 1.0 if greedy else top_p
            )
            for row, value in zip(alive[live.cpu()].tolist(), logp[:, 0].tolist()):
                logprobs_out[row].append(value)
        running &= ~torch.isin(tokens, stops)  # [b]
        if step + 1 == max_new_tokens or not running.any():
            break  # every row still here has reached the cap, or none is left
        if droppable and not running.all():  # drop the finished rows from the batch and the cache
            keep = running.nonzero().squeeze(-1)  # [b']
            select_rows(cache, keep, ROW_RULES)
            alive, mask, tokens, positions = alive[keep.cpu()], mask[keep], tokens[keep], positions[keep]
            running = running[keep]
        tokens = tokens.masked_fill(~running, pad_id)  # a finished row kept in the batch: fed padding, never read
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)  # [b, L + 1]
        positions = positions[:, -1:] + 1  # [b, 1]
        step_ids = tokens.unsqueeze(-1)  # [b, 1]
    return responses
