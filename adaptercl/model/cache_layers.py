"""What adaptercl knows of transformers' cache layers: which can repeat their batch for a shared prompt prefix, which
can drop finished rows, and how a layout with a masked gap reads to each.

A model's cache is one layer object per decoder layer, of a kind its config's `layer_types` decides
(`DynamicCache(config=...)`, which every family adaptercl runs builds): keys and values of full attention
(`DynamicLayer`), of a sliding window (`DynamicSlidingWindowLayer`: Gemma 3/4, OLMo 3, a Mistral with a window),
none for a layer that reads another layer's (`DummyLayer`: Gemma 4's shared key/value layers), convolution and
recurrent states of linear attention (`LinearAttentionLayer`: Qwen3.5's and Qwen3-Next's Gated DeltaNet layers, LFM2's
convolutions), or both (the `LinearAttentionAnd...` hybrids). Only the first kinds have a `batch_repeat_interleave`
and a `batch_select_indices` that carry all their state; a linear-attention layer has neither, and a hybrid inherits
`DynamicLayer`'s, which leave its conv and recurrent states behind (DESIGN.md §6). So nothing here calls a layer's
own batch methods on trust: each kind is looked up by its exact type in a table, and a kind not in the table is
never repeated or selected.

- Shared-prefix prefill (`prefix_sharing.py`) lays rows out as [prefix | masked gap | own tokens] and repeats the
  prefix's cache. `shared_prefix_limit(model)` says which layouts give every row the logits it gets alone: any, when
  every layer is full attention (masks follow the attention mask, gaps and all); with sliding-window layers, a
  layout without gaps or one no wider than the smallest window (a window counts cache slots, so a gap inside it hides
  real tokens; measured on tiny Gemma 3: logits 0.3 off); none with linear-attention or other recurrent layers (the
  recurrence would run over the gap, and their states have no repeat here): those rows are prefilled each alone, as
  `generate` would.
- The decode loop (`rollout/decode.py`) drops finished rows with `select_rows`: every layer by its kind's rule (the
  linear-attention layers' states row by row, as their `reorder_cache` does for beams); a cache with a layer of
  another kind keeps its rows (`can_select_rows` False) and the loop masks the finished ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import cache_utils
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer


def _kind(name: str) -> type:
    """A layer class of the installed transformers; one it lacks (an older 5.x) is a class no cache holds."""
    return getattr(cache_utils, name, type(name, (), {}))


DummyLayer = _kind("DummyLayer")
LinearAttentionLayer = _kind("LinearAttentionLayer")
LinearAttentionAndFullAttentionLayer = _kind("LinearAttentionAndFullAttentionLayer")
LinearAttentionAndSlidingWindowAttentionLayer = _kind("LinearAttentionAndSlidingWindowAttentionLayer")
Selects = dict[type, Callable[[Any, torch.Tensor], None]]

# Kinds whose own batch_repeat_interleave carries all their state: a shared prefix may be repeated for them.
REPEATS = (DynamicLayer, DynamicSlidingWindowLayer, DummyLayer)
# Kinds with a sliding (or chunked) window over cache slots: exact in a shared-prefix layout only where no row's
# window reaches over a gap.
SLIDING = (DynamicSlidingWindowLayer,)


def select_keys(layer: Any, keep: torch.Tensor) -> None:
    """A key/value layer's rows, by its own `batch_select_indices`."""
    layer.batch_select_indices(keep)


def _select_states(layer: Any, keep: torch.Tensor) -> None:
    """A linear-attention layer's conv and recurrent states, row by row ([B, ...] each)."""
    for i in range(layer.number_of_states):
        if layer.is_conv_states_initialized[i]:
            layer.conv_states[i] = layer.conv_states[i][keep.to(layer.conv_states[i].device)]
        if layer.is_recurrent_states_initialized[i]:
            layer.recurrent_states[i] = layer.recurrent_states[i][keep.to(layer.recurrent_states[i].device)]


def _select_hybrid(layer: Any, keep: torch.Tensor) -> None:
    _select_states(layer, keep)
    DynamicLayer.batch_select_indices(layer, keep)  # its keys and values (a no-op while they are empty)


# Exact layer type -> how it keeps only the rows `keep` ([b'] indices of the batch). Subclasses are not covered: a
# hybrid is a DynamicLayer too, and DynamicLayer's rule would leave its states behind.
SELECTS: Selects = {
    DynamicLayer: select_keys,
    DynamicSlidingWindowLayer: select_keys,
    DummyLayer: lambda layer, keep: None,  # holds nothing: it reads another layer's keys and values
    LinearAttentionLayer: _select_states,
    LinearAttentionAndFullAttentionLayer: _select_hybrid,
    LinearAttentionAndSlidingWindowAttentionLayer: _select_hybrid,
}


@dataclass(frozen=True)
class PrefixLimit:
    """Which shared-prefix layouts a model's cache reads exactly (`shared_prefix_limit`)."""

    share: bool  # False: no shared prefix at all (a layer kind that cannot repeat, or reads a gap wrongly)
    window: int | None = None  # the smallest sliding window; None: no sliding layer
    reason: str = ""  # why sharing is off or limited, for a log line or a test

    def allows(self, width: int, gap_free: bool) -> bool:
        """Whether a layout `width` cache slots wide (prefix, gap, own tokens and what runs after them) gives every row
        its own logits: no gap, or every window wider than the whole layout."""
        if not self.share:
            return False
        return self.window is None or gap_free or width <= self.window


FULL_ATTENTION = PrefixLimit(True)  # every layer full attention: any layout
NO_SHARING = PrefixLimit(False, reason="prefix sharing off")


def model_config(model: torch.nn.Module) -> Any:
    """The config a model's forward builds its cache from (a PEFT-wrapped model's base's)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.config


def cache_layer_kinds(model: torch.nn.Module) -> list[Any]:
    """The (empty) cache layers `model` builds for a forward: `DynamicCache(config=...)`, as the families do."""
    return list(DynamicCache(config=model_config(model)).layers)


def shared_prefix_limit(model: torch.nn.Module) -> PrefixLimit:
    """Which shared-prefix layouts `model`'s cache reads exactly (module docstring)."""
    windows = []
    for index, layer in enumerate(cache_layer_kinds(model)):
        if type(layer) not in REPEATS:
            return PrefixLimit(
                False, reason=f"layer {index} keeps a {type(layer).__name__} cache, which cannot repeat"
            )
        if type(layer) in SLIDING:
            windows.append(layer.sliding_window)
    if not windows:
        return FULL_ATTENTION
    return PrefixLimit(True, min(windows), reason=f"sliding window of {min(windows)} positions")


def can_repeat(cache: Any) -> bool:
    """Whether every layer of `cache` repeats all of its state for a shared prefix."""
    layers = getattr(cache, "layers", None)
    return layers is not None and all(type(layer) in REPEATS for layer in layers)


def can_select_rows(cache: Any, rules: Selects = SELECTS) -> bool:
    """Whether every layer of `cache` is of a kind `rules` knows (the decode loop adds its reserved layer)."""
    layers = getattr(cache, "layers", None)
    return layers is not None and all(type(layer) in rules for layer in layers)


def select_rows(cache: Any, keep: torch.Tensor, rules: Selects = SELECTS) -> None:
    """Keep only the batch rows `keep` ([b'] indices) of every layer of `cache` (`can_select_rows` must hold)."""
    for layer in cache.layers:
        rules[type(layer)](layer, keep)
