"""Rollout engines: prompts + adapters + sampling parameters -> completions with token ids and logprobs.

What every engine implements and returns (`protocol.py`: `RolloutEngine`, `SamplingParams`, `Completion`,
`RolloutServerError`); the engines: `hf` (`hf.py`, transformers `generate` on the training model itself, the CPU
reference and always on-policy), `vllm` (`vllm.py`, multi-LoRA serving in this process; `colocate.py`, one engine per
data-parallel rank) and `vllm_server` (`vllm_server.py`, a running vLLM server over HTTP); which version of the
adapters vLLM serves (`adapter_versions.py`); what top-p / top-k sampling keeps, for logprobs both sides of the
rollout-mismatch ratio share (`truncation.py`); vLLM's settings and limits, torch-free (`vllm_settings.py`), what a
colocated engine takes of the card (`vllm_memory.py`) and which model families it cannot serve with LoRA
(`vllm_lora_support.py`); `rollout.engine: auto` decided (`engine_choice.py`); `rollout.dtype`, the hf engine's
rollout precision on a CPU, and the run's record of its CPU paths (`precision.py`); the linear weights packed for
oneDNN in the hf engine's decode, the scoring forwards and a training stage's frozen base (`packed_weights.py`),
where this CPU's measurement says they pay (`packed_choice.py`);
and the run's engine, built once from the recipe (`engines.py`: `Engines`), vLLM guarded so that a failure under
auto goes on with transformers and a named one stops in one line (`fallback.py`).
"""

from importlib import import_module

# name other folders use -> the module of this folder that defines it; a name equal to its module's is the module
# itself. Imported on first use: importing the folder loads nothing.
_EXPORTS = {
    "auto_plan_note": "engine_choice",
    "falls_back": "engine_choice",
    "planned": "engine_choice",
    "resolve_engine": "engine_choice",
    "Engines": "engines",
    "Completion": "protocol",
    "ROW_SEED_STRIDE": "protocol",
    "RolloutEngine": "protocol",
    "RolloutServerError": "protocol",
    "SEED_MODULUS": "protocol",
    "SamplingParams": "protocol",
    "row_requests": "protocol",
    "row_seed": "protocol",
    "ServerClient": "server_client",
    "ServerUnreachable": "server_client",
    "check_server": "server_client",
    "packed_base_linears": "packed_weights",
    "packed_linears": "packed_weights",
    "check_rollout_dtype": "precision",
    "check_packed_setting": "packed_choice",
    "cpu_paths": "precision",
    "rollout_dtype": "precision",
    "kept_log_mass": "truncation",
    "sampler_logprobs": "truncation",
    "PROMPT_TOKENS": "vllm_memory",
    "VLLM_ASLEEP_GIB": "vllm_memory",
    "step_companions": "vllm_memory",
    "vllm_need_terms": "vllm_memory",
    "vllm_utilization": "vllm_memory",
    "CPU_KV_CACHE_BYTES": "vllm_settings",
    "INSTALL_HINT": "vllm_settings",
    "default_max_model_len": "vllm_settings",
    "require_vllm": "vllm_settings",
    "served_lora_rank": "vllm_settings",
    "vllm_lora_rank": "vllm_settings",
    "vllm_lora_blocker": "vllm_lora_support",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = import_module(f"{__name__}.{_EXPORTS[name]}")
        return module if _EXPORTS[name] == name else getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
