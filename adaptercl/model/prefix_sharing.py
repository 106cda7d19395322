"""Prompt prefixes computed once: rows that begin alike share one key/value cache of their common prefix.

A GRPO group holds one prompt G times, an SDPO teacher batch holds a group's question G times with a different
solution or feedback after it, a few-shot domain repeats its example in every prompt, and every chat prompt starts
with the same template header. `shared_prefix_runs` splits consecutive prompts into runs with a common token
prefix; `prefix_layout` lays a batch out as [U prefixes] + [N rows' own tokens]; `prefill` runs the prefixes once,
repeats their cache for the rows of each run (differentiably) and continues every row from it.

Both the training forward (`batching.response_logits`) and the rollout prefill (`rollout/hf.py`) use it. A row's
own tokens are left-padded, so the cache is followed by masked padding (a gap) and then the row's tokens; positions
follow the attention mask, so each row sees exactly its own prompt and gets the same logits as alone, up to rounding,
where every layer is full attention. The model's cache layers decide which layouts are exact (`cache_layers.
shared_prefix_limit`, passed as `limit`): a sliding window counts cache slots, gap included, so with sliding layers
only a layout without a gap or no wider than the window is taken; a model with linear-attention or other recurrent
layers takes none (its rows are prefilled each alone, as the plain left-padded batch of `generate`). `prefill`
refuses a cache with a layer that cannot repeat its state (`cache_layers.can_repeat`) rather than corrupt it.

Under activation checkpointing (`checkpointing.py`) a training forward's layers are recomputed in backward, and a
cache that appends would append twice. `prefill(..., replayable=True)` (what `batching` passes while the model
trains under checkpointing) uses a `ReplayableCache` instead: the prefix call records each layer's keys and values
once (a recompute returns its own states, as the first pass did with the empty cache), and the rows' call reads
the prefix through a read-only view without appending (returns prefix ‖ own states), so every recompute sees
exactly the first pass's tensors. Its output's cache then holds the prefixes only: the rollout's prefill, which
continues decoding from the cache, keeps the plain appending one.

The key/value cache goes by the name of the installed transformers (`CACHE`): transformers 5.24 renamed
`past_key_values` to `cache`, as the argument of `forward` and `generate` and as the output's field; the old name
still works there but warns (FutureWarning) on every call. `output_cache(out)` reads it from an output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from adaptercl.model.cache_layers import FULL_ATTENTION, PrefixLimit, can_repeat

CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def output_cache(out: Any) -> Any:
    """The key/value cache of a model output (a transformers `Cache`), by this transformers' name for it."""
    return getattr(out, CACHE)


class ReplayableCache(DynamicCache):
    """A key/value cache whose `update` returns the same tensors when a checkpointed layer is recomputed.

    Recording (a fresh cache, the prefix call's): a layer's first update stores its states (as DynamicCache does on
    an empty layer) and a later update of that layer, the recompute, returns its own states unchanged. Read-only
    (`reader()`, the rows' call's, a second object over the same layers, so the prefix call's recompute still
    records): an update returns the stored prefix ‖ the new states ([B, heads, C+T, d]) and stores nothing, so the
    cache's length stays the prefix's on every pass.
    """

    def __init__(self, read_only: bool = False) -> None:
        super().__init__()
        self.read_only = read_only

    def reader(self) -> ReplayableCache:
        """A read-only cache over this one's layers (their keys and values as they are now, e.g. repeated per row)."""
        reader = ReplayableCache(read_only=True)
        reader.layers = list(self.layers)
        return reader

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.read_only:
            layer = self.layers[layer_idx]
            return torch.cat([layer.keys, key_states], dim=-2), torch.cat([layer.values, value_states], dim=-2)
        if layer_idx < len(self.layers) and self.layers[layer_idx].is_initialized:
            return key_states, value_states  # the recompute of the recording call: the layer was empty then
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


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
        counts.append(end - begin)
        prefixes.append(min([len(p) - 1 for p in prompts[begin:end]] + common[begin + 1 : end]))
        end = begin
    return counts[::-1], prefixes[::-1]


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


@dataclass
class PrefixLayout:
    """N prompts as U shared prefixes (left-padded to C) and each row's own remaining tokens (left-padded to S)."""

    counts: torch.Tensor  # [U] rows per run, summing to N
    prefix_ids: torch.Tensor  # [U, C]
    prefix_mask: torch.Tensor  # [U, C]
    own_ids: torch.Tensor  # [N, S], S >= 1: every row keeps its last prompt token
    own_mask: torch.Tensor  # [N, S]
    gap_free: bool = False  # every row's own tokens fill S: no masked gap after its prefix

    def prompt_ids(self) -> torch.Tensor:
        """[N, C+S] every row's whole prompt in this layout (padding between its prefix and its own tokens)."""
        return torch.cat([self.prefix_ids.repeat_interleave(self.counts, dim=0), self.own_ids], dim=1)

    def prompt_mask(self) -> torch.Tensor:
        """[N, C+S] the attention mask of `prompt_ids`."""
        return torch.cat([self.prefix_mask.repeat_interleave(self.counts, dim=0), self.own_mask], dim=1)


def prefix_layout(
    prompts: list[list[int]],
    then: int,
    pad_id: int,
    device: torch.device | None = None,
    limit: PrefixLimit = FULL_ATTENTION,
    after: int = 0,
) -> PrefixLayout | None:
    """The shared-prefix layout of `prompts` when it computes fewer padded tokens than the plain left-padded
    layout and the model's cache reads it exactly (`limit`, the model's `cache_layers.shared_prefix_limit`; the
    default: every layer full attention), else None. `then`: columns every row runs after its prompt in the same call
    (R-1 response tokens for a training forward, -1 for a prefill that leaves the last prompt token to `generate`);
    `after`: positions decoded after that call (a rollout's max_new_tokens), which a window must also cover."""
    if not limit.share:
        return None
    counts, prefixes = shared_prefix_runs(prompts)
    if min(prefixes) < 1:
        return None  # a row with nothing before its own tokens to attend to: keep the plain layout
    row_prefix = [v for v, k in zip(prefixes, counts) for _ in range(k)]  # [N]
    c_width = max(prefixes)
    s_width = max(len(p) - c for p, c in zip(prompts, row_prefix))
    n, p_width = len(prompts), max(map(len, prompts))
    if len(counts) * c_width + n * (s_width + then) >= n * (p_width + then):
        return None
    gap_free = all(len(p) - c == s_width for p, c in zip(prompts, row_prefix))
    if not limit.allows(c_width + s_width + then + after, gap_free):
        return None
    prefix_ids = torch.full((len(counts), c_width), pad_id, dtype=torch.long)  # [U, C]
    prefix_mask = torch.zeros((len(counts), c_width), dtype=torch.long)
    own_ids = torch.full((n, s_width), pad_id, dtype=torch.long)  # [N, S]
    own_mask = torch.zeros((n, s_width), dtype=torch.long)
    first = 0
    for u, (k, c) in enumerate(zip(counts, prefixes)):
        prefix_ids[u, c_width - c :] = torch.tensor(prompts[first][:c])
        prefix_mask[u, c_width - c :] = 1
        first += k
    for i, (p, c) in enumerate(zip(prompts, row_prefix)):
        own_ids[i, s_width - (len(p) - c) :] = torch.tensor(p[c:])
        own_mask[i, s_width - (len(p) - c) :] = 1
    tensors = (torch.tensor(counts), prefix_ids, prefix_mask, own_ids, own_mask)
    return PrefixLayout(*(t.to(device) for t in tensors), gap_free=gap_free)


def prefill(
    model: torch.nn.Module,
    layout: PrefixLayout,
    rest_ids: torch.Tensor,
    rest_mask: torch.Tensor,
    logits_to_keep: int | None,
    replayable: bool = False,
):
    """Run the U prefixes once, repeat their cache for the rows of each run, then run `rest_ids` over it.

    rest_ids, rest_mask: [N, T] what follows each row's prefix: its own tokens and response tokens for a training
    forward, its own tokens but the last for a rollout prefill (T may be 0). Returns the model output of the
    second call, whose cache holds [prefix | rest] per row, or the prefix call's output (its cache
    repeated) when T is 0. `model` may also be the bare decoder (no LM head: `logits_to_keep` None), whose output
    carries `last_hidden_state` instead of logits. `replayable`: a `ReplayableCache` (a training forward under
    activation checkpointing; the second call's cache then holds the prefixes only).
    """
    cache = {CACHE: ReplayableCache()} if replayable else {}
    head = {} if logits_to_keep is None else {"logits_to_keep": 1}  # no logits needed; 1 is the fewest computed
    prefix_mask = layout.prefix_mask  # [U, C]
    prefix_out = model(
        input_ids=layout.prefix_ids,
        attention_mask=prefix_mask,
        position_ids=(prefix_mask.cumsum(-1) - 1).clamp(min=0),
        use_cache=True,
        **cache,
        **head,
    )
    prefix_cache = output_cache(prefix_out)
    if not can_repeat(prefix_cache):  # the caller's limit said it could: a model whose cache differs from its config's
        kinds = sorted({type(layer).__name__ for layer in getattr(prefix_cache, "layers", [])})
        raise RuntimeError(f"shared-prefix prefill: a {type(prefix_cache).__name__} of {kinds} cannot be repeated")
    prefix_cache.batch_repeat_interleave(layout.counts)  # [U, ...] -> [N, ...], differentiable
    if rest_ids.shape[1] == 0:
        return prefix_out
    mask = torch.cat([prefix_mask.repeat_interleave(layout.counts, dim=0), rest_mask], dim=1)  # [N, C+T]
    return model(
        input_ids=rest_ids,
        attention_mask=mask,
        position_ids=(mask.cumsum(-1) - 1).clamp(min=0)[:, prefix_mask.shape[1] :],  # [N, T]
        use_cache=True,
        **{CACHE: prefix_cache.reader() if replayable else prefix_cache},
        **({} if logits_to_keep is None else {"logits_to_keep": logits_to_keep}),
    )
