"""The `rollout:` block of the recipe grammar: how a stage samples its groups and which engine does it (`hf`, `vllm`
in process, or `vllm_server`, a running vLLM server whose address is the nested `rollout.server` block). No torch
import; `grammar.py` re-exports it. The engine fields (`ENGINE_FIELDS`) configure the run's one engine, so
`RecipeConfig` checks that every stage agrees on them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from adaptercl.recipe.config_block import ConfigBlock


@dataclass(frozen=True)
class EngineKind:
    """What the run needs to know of a rollout engine before it imports one."""

    home: str | None  # "module:Class" with a `from_recipe(recipe, base, model)`, one per run; None: hf, per model
    needs_local_vllm: bool  # vLLM must be importable in the trainer's process (preflight's one-line check)
    needs_server: bool = False  # rolls out from `rollout.server` (the run's preflight contacts it before loading)


# rollout.engine -> its kind (`rollout.engines.Engines` builds from this table; no engine name is compared elsewhere
# in the run). `auto` is not an engine: `rollout.engine_choice.resolve_engine` replaces it with hf or vllm before the
# run starts.
ENGINES: dict[str, EngineKind] = {
    "hf": EngineKind(home=None, needs_local_vllm=False),
    "vllm": EngineKind(home="adaptercl.rollout.vllm:VLLMEngine", needs_local_vllm=True),
    "vllm_server": EngineKind(
        home="adaptercl.rollout.vllm_server:VLLMServerEngine", needs_local_vllm=False, needs_server=True
    ),
}


class RolloutServerConfig(ConfigBlock):
    """Where the `vllm_server` engine finds its server (`adaptercl.rollout.vllm_server` says how to start one)."""

    url: str | None = Field(
        None,
        description="Base URL of a running vLLM OpenAI-compatible server, e.g. http://10.0.0.2:8000 (a trailing /v1 "
        "is allowed). Required by `rollout.engine: vllm_server`.",
    )
    model: str | None = Field(
        None, description="The server's name for the base model; default: the one base model it lists (/v1/models)."
    )
    api_key_env: str | None = Field(
        None,
        description="Name of an environment variable holding the server's API key (`vllm serve --api-key`), sent as "
        "a Bearer token; the key itself never goes into the recipe or the run directory.",
    )
    timeout_s: float = Field(600.0, gt=0.0, description="Seconds one HTTP request may take (a whole group's rollout).")
    retries: int = Field(
        3, ge=0, description="Retries of a request that failed to connect, timed out or got a 5xx answer."
    )
    backoff_s: float = Field(2.0, gt=0.0, description="Wait before the first retry; doubled before each further one.")
    adapter_dir: str | None = Field(
        None,
        description="Where the combined adapter versions are written for the server to load: a folder the server "
        "can read at `server_adapter_dir` (a shared filesystem when it runs on another host). Default: "
        "<output_dir>/rollout-adapters.",
    )
    server_adapter_dir: str | None = Field(
        None,
        description="The same folder as the server sees it (a different mount point or container path); default: "
        "adapter_dir's absolute path.",
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str | None) -> str | None:
        if url is None:
            return None
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise ValueError(f"must be an http(s) URL such as http://127.0.0.1:8000, got {url!r}")
        try:
            parts.port  # noqa: B018 - raises on a port that is not a number in 0-65535
        except ValueError:
            raise ValueError(f"the port of {url!r} is not a number in 0-65535") from None
        return url.rstrip("/")


class RolloutConfig(ConfigBlock):
    engine: Literal["hf", "vllm", "vllm_server", "auto"] = Field(
        "hf",
        description="Rollout and evaluation engine: plain transformers (reference), vLLM in this process, a running "
        "vLLM server (`rollout.server`) on other GPUs or hosts, or auto: vLLM in this process where a CUDA device "
        "is visible and vLLM imports and can load the base, else transformers; decided when the run starts, which "
        "says which and why (engine_choice.py). Under auto a vLLM that fails while starting, loading an adapter, "
        "sleeping, waking or generating hands the run to transformers with one line, recorded in the run "
        "directory's rollout_engine.jsonl; vllm named here stops with one line instead (rollout/fallback.py).",
    )
    group_size: int = Field(
        8,
        ge=1,
        description="Samples per prompt (G). SDFT uses 1 sample per prompt; GRPO and SRPO need 2 or more (their "
        "advantages are centred on the group, SRPO distils from a successful sibling: method_table.needs_siblings).",
    )
    max_new_tokens: int = Field(256, ge=1, description="Longest sampled response, in tokens.")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature; logits are divided by it in losses.")
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Nucleus sampling mass (1: the full distribution). Below 1 every engine samples from the "
        "renormalised nucleus and its logprobs are that distribution's (vLLM's processed_logprobs, the hf engine's "
        "response_logprobs), while the trainer's are under the full softmax: the rollout-mismatch weight compares "
        "them after adding the log of the mass the trainer's own nucleus keeps to the engine's, so on-policy rows "
        "weigh 1, not the kept mass (trl#6789); the GRPO ratio stays under the full softmax (rollout/truncation.py).",
    )
    batch_size: int = Field(64, ge=1, description="Sequences per generate call (hf engine).")
    fold_lora: bool = Field(
        True,
        description="hf engine: while decoding, fold the active LoRA into a temporary copy of each float32 base "
        "weight (exact to fp32 rounding; one extra copy of the adapted weights meanwhile). Quantised and "
        "half-precision bases are never folded (a bfloat16 rollout, `dtype`, folds in float32, then rounds).",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "float32",
        description="hf engine on a CPU: the precision of the sampled rollouts' linear weights. float32: the "
        "trainer's own weights, exactly on-policy. bfloat16: bf16 copies of the linear weights (packed for oneDNN; "
        "the LoRA folded in first in float32 where fold_lora), for CPUs with bf16 matrix units (AMX-BF16, "
        "AVX512-BF16; elsewhere one line at validation): faster decoding from a slightly different policy, "
        "which the engine's own logprobs and the trainer's rollout-mismatch weights correct, as for vLLM (the "
        "trade measured: benchmarks/perf/README.md, cpu_paths.py); greedy evaluation stays float32. auto: "
        "bfloat16 where those units are used by torch and oneDNN's bf16 product passes its probe, float32 "
        "elsewhere (rollout/precision.py); recipes/quickstart.yaml uses auto (the quickstart learns as much on bf16 "
        "rollouts, at two seeds, and its run is 8 % shorter on an AVX512-BF16 EPYC: benchmarks/quickstart/results.md)."
        " On a GPU the hf engine samples in model.dtype; the vLLM engines have their own dtype (model.dtype), so "
        "float32 or bfloat16 with them is an error (auto is theirs).",
    )
    gpu_memory_utilization: float | Literal["auto"] = Field(
        0.3,
        description="vLLM on CUDA: the share of the whole card it may claim (weights, LoRA slots, runtime, KV cache). "
        "auto: the share the memory plan gives its NF4 weights, LoRA slots, runtime and the KV cache of one step's "
        "rollouts at the cap (1024-token prompts), rounded up to 0.01 (vllm_memory.vllm_utilization). A share above "
        "the card's free memory when vLLM starts, or too small for its weights, LoRA slots, runtime and one sequence, "
        "is one line before it loads (vllm_memory.check_claim).",
    )
    vllm_base: str | None = Field(
        None,
        description="vLLM: a rollout-side base (e.g. an AWQ checkpoint of the same model) when the vLLM "
        "version cannot load the trainer's bitsandbytes base; rollouts become slightly off-policy.",
    )
    max_loras: int | None = Field(
        None,
        ge=1,
        description="vLLM: GPU adapter slots (each request serves one combined adapter, so 1 serves a stage); "
        "default 2. Slots that do not fit vLLM's claim on the card are one line before it loads.",
    )
    max_lora_rank: int | None = Field(
        None,
        ge=1,
        description="vLLM: largest adapter rank served, rounded up to a rank vLLM accepts (1, 8, 16, 32, 64, 128, "
        "256, 320, 512); default: the largest combined rank the recipe needs (the ranks stacked under a stage's "
        "policy or teacher add up). A value below that need is one line at `recipe validate`.",
    )
    enable_sleep_mode: bool = Field(
        True, description="vLLM on CUDA: free the engine's GPU memory around each optimiser step (sleep level 1)."
    )
    max_model_len: int | None = Field(
        None, ge=1, description="vLLM: longest prompt + response in tokens; default the model's own, at most 8192."
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="vLLM in process: GPUs the rollout engine shards the base over (vLLM's tensor parallelism). "
        "Under N data-parallel ranks each group of this many ranks shares one engine (it must divide N; "
        "`rollout/colocate.py`); for replicas on other GPUs, `adaptercl serve --data-parallel-size` and "
        "`engine: vllm_server`.",
    )
    server: RolloutServerConfig = Field(default_factory=RolloutServerConfig)

    @field_validator("gpu_memory_utilization", mode="before")
    @classmethod
    def _auto_or_number(cls, value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):  # as every float field (ConfigBlock), not a union
            raise PydanticCustomError("finite_number", "Input should be a finite number")
        if isinstance(value, str) and value != "auto":
            raise ValueError(f"must be 'auto' or a fraction of the card between 0 and 1, got {value!r}")
        return value

    @field_validator("gpu_memory_utilization")
    @classmethod
    def _fraction(cls, value: float | str) -> float | str:
        if value != "auto" and not 0 < value < 1:
            raise ValueError(f"must be 'auto' or a fraction of the card between 0 and 1, got {value!r}")
        return value

    @model_validator(mode="after")
    def _check_server(self) -> RolloutConfig:
        if self.engine == "vllm_server" and self.server.url is None:
            raise ValueError(
                "engine vllm_server needs server.url, the address of a running vLLM server "
                "(e.g. http://127.0.0.1:8000)"
            )
        return self

    @model_validator(mode="after")
    def _check_dtype(self) -> RolloutConfig:
        explicit = "dtype" in self.model_fields_set and self.dtype != "auto"  # auto: the engine's own choice
        if explicit and self.engine in ("vllm", "vllm_server"):
            raise ValueError(
                f"dtype is the transformers engine's (hf, on a CPU); engine {self.engine} computes in vLLM's own "
                "dtype (model.dtype): remove rollout.dtype (or leave it auto)"
            )
        return self


# Rollout fields that configure the run's one engine, so they must agree across stages.
ENGINE_FIELDS = (
    "engine",
    "dtype",
    "fold_lora",
    "gpu_memory_utilization",
    "vllm_base",
    "max_loras",
    "max_lora_rank",
    "enable_sleep_mode",
    "max_model_len",
    "tensor_parallel_size",
    "server",
)
