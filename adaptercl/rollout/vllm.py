"""The vLLM rollout engine: one `vllm.LLM` per run, serving the run's LoRA adapters on the trainer's base.

Use: `VLLMEngine.from_recipe(recipe, base, model)` (the run does this once when `rollout.engine: vllm`), then the
`RolloutEngine` protocol: `generate(prompts, adapters, params)` and `sync_adapters(names)` after each optimiser
step. `sleep()` / `wake()` free and restore the engine's GPU memory around the optimiser step (no-ops where vLLM
has no sleep mode, e.g. on CPU).

How adapters reach vLLM (`adapter_versions`, shared with the server engine): the adapter is never merged into the
base for rollouts (merging into a 4-bit base and re-quantising is lossy, TRL #3466). Each sync snapshots the
adapter's LoRA factors; the next `generate` writes the combined adapter of the active set (A factors stacked along
the rank, B factors pre-multiplied by their scaling side by side: B_cat·A_cat = Σ_i s_i·B_i·A_i, exactly what PEFT
applies with several adapters active; lora_alpha = r so vLLM's scaling is 1) as a PEFT folder and hands it over as
a `LoRARequest` with a **new name and a new integer id** (`llm_engine.add_lora`); the version it replaces is
removed (`llm_engine.remove_lora`) and its folder deleted. An adapter changed in place since its sync is re-synced
at the next `generate`.

The 4-bit base (docs/design.md §6):
- The engine loads the trainer's own checkpoint with `quantization="bitsandbytes"`, which quantises it in flight
  to NF4 with double quantisation, block size 64: the same 4-bit weights the trainer's `BitsAndBytesConfig` makes
  (LoRA on top in the compute dtype). vLLM <= 0.27 has this built in; from 0.28 it lives in the `vllm-bnb-plugin`
  package, which registers the same `quantization="bitsandbytes"` through vLLM's `vllm.general_plugins` entry
  point (`bitsandbytes_provider` says which one serves; the call is the same).
- A vLLM >= 0.28 without the plugin cannot: the recipe then names a rollout-side base (`rollout.vllm_base`, e.g.
  an AWQ or GPTQ checkpoint of the same model); the log says rollouts are then off-policy by the quantisation
  mismatch and the trainer's rollout-mismatch importance weights correct for it. Without either, the run is
  refused with one line naming both.
- An unquantised trainer base is served as is, in the trainer's compute dtype.

Logprobs: `SamplingParams.logprobs` returns each sampled token's logprob under logits / temperature
(`logprobs_mode="processed_logprobs"`), the trainer's definition; with `top_p < 1` under the nucleus it sampled
from, renormalised (the true behaviour policy), which the trainer puts on its own support before comparing
(`truncation.py`, `train/step.py`); greedy logprobs are at temperature 1. Each sampled row is its own request
(n = 1) seeded `row_seed(params.seed, params.first_row + i*n + j)` for sample j of prompt i (the global row index:
the same rows under N data-parallel ranks as in one process, and no seed shared with another step's row; one request
of n samples would give sample j the request's seed + j, vLLM's parallel sampling). vLLM fans an n-sample request out
into n requests anyway, and its prefix cache shares their prompt the same way.

Engine settings come from the recipe's rollout block (the same in every stage): `gpu_memory_utilization` (auto:
the memory plan's share of this card, `vllm_memory.vllm_utilization`),
`enable_sleep_mode`, `max_loras` (GPU adapter slots; each request carries one combined adapter, so 2 cover the
policy plus one other combination), `max_lora_rank` (default: the largest combined rank the recipe can need,
rounded up to a rank vLLM accepts; a set value below it is one line, `vllm_settings.served_lora_rank`),
`max_model_len`, `tensor_parallel_size` (GPUs the base is sharded over). Before vLLM loads on CUDA, its claim is
checked against the card's free memory and what it must hold (`vllm_memory.check_claim`: one line naming
`gpu_memory_utilization` or `max_loras`); the run guards every call of the engine (`fallback.py`). Under N
data-parallel ranks each rank builds its own engine joined to the training world (`colocate.py`, TRL's colocate
mode: external launcher, tensor-parallel groups of `tensor_parallel_size` ranks). On CPU the KV cache is
`VLLM_CPU_KVCACHE_SPACE` GiB when set, else 1 GiB. `VLLM_ENABLE_V1_MULTIPROCESSING` defaults to 0 (the engine core
runs in this process: on CPU it starts in about half the time) and `VLLM_NO_USAGE_STATS` to 1; a script that builds
the engine needs an `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from adaptercl.model import GIB, servable_base_path, shape_from_config
from adaptercl.recipe import RecipeConfig, RecipeError
from adaptercl.rollout.adapter_versions import AdapterVersions, Served
from adaptercl.rollout.colocate import launcher_kwargs, tensor_parallel_group
from adaptercl.rollout.hf import stop_token_ids  # the same stop tokens as the hf engine
from adaptercl.rollout.protocol import Completion, SamplingParams, row_requests
from adaptercl.rollout.vllm_memory import check_claim, vllm_utilization
from adaptercl.rollout.vllm_settings import (
    BNB_PLUGIN_HINT,
    CPU_KV_CACHE_BYTES,
    bitsandbytes_provider,
    default_max_model_len,
    require_vllm,
    served_lora_rank,
    vllm_lora_rank,
)
from adaptercl.system import distributed

log = logging.getLogger(__name__)

VLLM_ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: faster start, direct access
    "VLLM_NO_USAGE_STATS": "1",  # vLLM otherwise reports usage over the network from its workers
}


def vllm_supports_bitsandbytes() -> bool:
    """Whether the installed vLLM can load a bitsandbytes 4-bit base (0.27.x built in, 0.28+ with the plugin)."""
    return bitsandbytes_provider() is not None


# ------------------------------------------------------------------------------------------- the engine


class VLLMEngine:
    """Rollouts from one in-process `vllm.LLM` with LoRA; `model` is the trainer's PeftModel (read for adapters)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        serve_path: str,
        *,
        tokenizer_path: str | None = None,
        dtype: torch.dtype | str = torch.float32,
        quantization: str | None = None,
        max_loras: int = 2,
        max_cpu_loras: int | None = None,
        max_lora_rank: int = 16,
        gpu_memory_utilization: float = 0.3,
        enable_sleep_mode: bool = True,
        max_model_len: int | None = None,
        tensor_parallel_size: int = 1,
        seed: int = 0,
    ):
        require_vllm()
        for key, value in VLLM_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        from vllm import LLM

        self.model = model
        self.tokenizer = tokenizer
        self.serve_path = serve_path
        world = distributed.world()  # N ranks: this rank's engine, one of N colocated ones (colocate.py)
        # this rank's own scratch folder (never the run directory, which rank 0 alone writes)
        self._workdir = Path(tempfile.mkdtemp(prefix="adaptercl-vllm-", dir=_fast_tmp_dir()))
        serve_path = servable_base_path(serve_path, self._workdir / "base")
        self.stop_ids = stop_token_ids(model, tokenizer)
        on_cuda = torch.cuda.is_available()
        kwargs: dict[str, Any] = {
            "model": serve_path,
            "tokenizer": serve_path if tokenizer_path in (None, self.serve_path) else tokenizer_path,
            "dtype": dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch."),
            "seed": seed,
            "enable_lora": True,
            "max_loras": max_loras,
            "max_cpu_loras": max(max_loras, max_cpu_loras or 0),
            "max_lora_rank": vllm_lora_rank(max_lora_rank, "rollout.max_lora_rank"),
            "logprobs_mode": "processed_logprobs",  # logits / temperature, the trainer's definition
            "generation_config": "vllm",  # no sampling defaults from the model's generation_config.json
            "max_model_len": max_model_len or default_max_model_len(serve_path),
            "tensor_parallel_size": tensor_parallel_size,  # GPUs the engine shards the base over
            **launcher_kwargs(world, tensor_parallel_size, seed),  # N ranks: external launcher, seed per TP group
        }
        if quantization is not None:
            kwargs["quantization"] = quantization
        from vllm.platforms import current_platform

        self.sleep_supported = enable_sleep_mode and current_platform.is_sleep_mode_available()  # CUDA, ROCm, XPU
        if self.sleep_supported:
            kwargs["enable_sleep_mode"] = True
        if on_cuda:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        else:
            kwargs["enforce_eager"] = True  # LoRA disables compilation on CPU anyway
            if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        self.tp_group = tensor_parallel_group(world, tensor_parallel_size)
        self.llm = LLM(**kwargs)
        import vllm

        served = f"NF4 in flight ({quantization}, {bitsandbytes_provider()})" if quantization else kwargs["dtype"]
        self.description = (
            f"vLLM {vllm.__version__} serving {self.serve_path} ({served}); LoRA: {max_loras} slots, rank <= "
            f"{kwargs['max_lora_rank']}; sleep mode {'on' if self.sleep_supported else 'off'}"
        )
        if world.size > 1:
            self.description += f"; one engine per rank ({world.size} ranks, external launcher)"
        self.asleep = False
        self.versions = AdapterVersions(
            self.serve_path, self._workdir, kwargs["max_cpu_loras"], load=self._add_lora, unload=self._remove_lora
        )

    @classmethod
    def from_recipe(cls, recipe: RecipeConfig, base: Any, model: torch.nn.Module) -> VLLMEngine:
        """The run's engine: the rollout block of the first stage (the same in every stage) and the loaded base.

        `base` is the `adaptercl.model.base.LoadedBase` the trainer uses; its folder is what vLLM loads, quantised in
        flight to NF4 when the trainer's base is 4-bit and vLLM still has bitsandbytes.
        """
        require_vllm()
        rollout = recipe.stages[0].rollout
        dtype = _compute_dtype(base.model)
        quantization = None
        serve_path = base.path
        mismatch = None
        if rollout.vllm_base is not None:
            serve_path = rollout.vllm_base
            dtype = "auto"  # the checkpoint's own (e.g. fp16 for AWQ kernels)
            trainer_base = "NF4" if base.quantized else str(_compute_dtype(base.model)).removeprefix("torch.")
            mismatch = (
                f"rollouts come from rollout.vllm_base={rollout.vllm_base} while the trainer uses {base.path} "
                f"({trainer_base}): they are off-policy by the difference between the two bases, which the "
                "trainer's rollout-mismatch importance weights correct for"
            )
            log.warning(mismatch)
        elif base.quantized:
            if not vllm_supports_bitsandbytes():
                import vllm

                raise RecipeError(
                    f"rollout.vllm_base: vLLM {vllm.__version__} cannot load bitsandbytes 4-bit bases (since 0.28 "
                    f"only with the vllm-bnb-plugin package); install it with {BNB_PLUGIN_HINT}, or name a "
                    "rollout-side base (an AWQ/GPTQ or bf16 checkpoint of the same model)"
                )
            if dtype == torch.float32:  # fails in the weight loader (shape assert): vLLM 0.27.1, 0.32 + plugin
                raise RecipeError(
                    "model.dtype: vLLM loads a bitsandbytes 4-bit base only with a 16-bit compute dtype; set "
                    "model.dtype: bfloat16 (`auto` is float32 on CPU), or name a rollout.vllm_base"
                )
            quantization = "bitsandbytes"
        max_loras = rollout.max_loras or 2
        utilization = rollout.gpu_memory_utilization
        memory = card_memory()
        card = None if memory is None else memory[0]
        if card is not None:  # the plan's share on this card for auto (unused without CUDA); a claim vLLM would refuse
            shape = shape_from_config(base.model.config.to_dict(), f"{base.path}/config.json")
            utilization = vllm_utilization(shape, recipe, card) if utilization == "auto" else utilization
            check_claim(shape, recipe, utilization, *memory)
        elif utilization == "auto":
            utilization = 0.3
        engine = cls(
            model,
            base.tokenizer,
            serve_path,
            tokenizer_path=base.path,
            dtype=dtype,
            quantization=quantization,
            max_loras=max_loras,
            max_cpu_loras=max(max_loras, len(recipe.stages) + 2),
            max_lora_rank=served_lora_rank(recipe),
            gpu_memory_utilization=utilization,
            enable_sleep_mode=rollout.enable_sleep_mode,
            max_model_len=rollout.max_model_len,
            tensor_parallel_size=rollout.tensor_parallel_size,
            seed=recipe.seed,
        )
        if card is not None:
            auto = " (auto: the plan's share)" if rollout.gpu_memory_utilization == "auto" else ""
            engine.description += f"; claims {utilization:g} of the {card:.1f} GiB card{auto}"
        if mismatch is not None:
            engine.description += f"; {mismatch}"
        return engine

    # ---- the RolloutEngine protocol

    def sync_adapters(self, names: list[str]) -> None:
        """Snapshot the current weights of these adapters; the next rollout under them serves the new version."""
        self.versions.sync(self.model, names)

    def generate(
        self, prompts: list[list[int]], adapters: list[str] | None, params: SamplingParams
    ) -> list[list[Completion]]:
        from vllm import SamplingParams as VllmSamplingParams

        self.wake()
        request = self.prepare(adapters)
        requests = row_requests(prompts, params)  # one per sampled row, with its row's seed
        mine = slice(0, len(requests))
        if self.tp_group is not None:  # the group's engines run the same requests; this rank keeps its own
            requests, mine = self.tp_group.gather(requests)
        if not requests:  # a data-parallel rank with no share (a short evaluation)
            return []
        sampling = [
            VllmSamplingParams(
                n=1,
                max_tokens=params.max_new_tokens,
                min_tokens=params.min_new_tokens or 0,  # stop tokens masked until then (0: none)
                temperature=0.0 if params.greedy else params.temperature,
                top_p=1.0 if params.greedy else params.top_p,
                top_k=0,
                min_p=0.0,
                repetition_penalty=1.0,
                seed=seed,
                stop_token_ids=self.stop_ids,
                logprobs=0 if params.logprobs else None,  # the sampled token's logprob only
                detokenize=False,  # decoded below with the trainer's tokenizer
            )
            for _, seed in requests
        ]
        outputs = self.llm.generate(
            [{"prompt_token_ids": p} for p, _ in requests], sampling, lora_request=request, use_tqdm=False
        )[mine]
        rows = []
        for (prompt, _), out in zip(requests[mine], outputs):
            (sample,) = out.outputs
            tokens = list(sample.token_ids)
            logprobs = None
            if params.logprobs:
                logprobs = [step[t].logprob for step, t in zip(sample.logprobs, tokens)]
            rows.append(Completion.from_tokens(prompt, tokens, self.tokenizer, self.stop_ids, logprobs))
        return [rows[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    # ---- adapters in the engine

    def prepare(self, adapters: list[str] | None) -> Any:
        """The LoRARequest serving exactly `adapters` (None for the base), registered with the engine
        (`AdapterVersions.prepare`: a new name and id whenever a member changed)."""
        served = self.versions.prepare(self.model, adapters)
        return None if served is None else served.handle

    def served_loras(self) -> dict[str, int]:
        """Name -> id of every adapter version the engine currently holds."""
        return self.versions.served()

    def engine_lora_ids(self) -> set[int]:
        """The LoRA ids vLLM itself lists (`llm_engine.list_loras()`)."""
        return set(self.llm.llm_engine.list_loras())

    def _add_lora(self, served: Served) -> Any:
        from vllm.lora.request import LoRARequest

        request = LoRARequest(lora_name=served.name, lora_int_id=served.lora_id, lora_path=str(served.folder))
        self.llm.llm_engine.add_lora(request)
        return request

    def _remove_lora(self, served: Served) -> None:
        self.llm.llm_engine.remove_lora(served.lora_id)

    # ---- memory around the optimiser step

    def sleep(self) -> None:
        """Free the engine's GPU memory (level 1: weights offloaded to CPU RAM, KV cache dropped; what stays on the
        card is `vllm_memory.VLLM_ASLEEP_GIB`); no-op without sleep mode."""
        if self.sleep_supported and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        """Undo `sleep` (`generate` calls it itself). The trainer's cached blocks go back to the driver first, where
        vLLM maps its weights and KV cache again (TRL empties the cache before `wake_up` too: "required to avoid
        OOM in some cases", trl/generation/vllm_generation.py)."""
        if self.asleep:
            torch.cuda.empty_cache()
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        """Remove every served adapter and the engine's scratch folder, and release the engine."""
        self.versions.close()
        shutil.rmtree(self._workdir, ignore_errors=True)
        del self.llm
        import gc

        gc.collect()


def card_memory() -> tuple[float, float] | None:
    """(total, free) GiB of this rank's CUDA device as vLLM will find it, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info(torch.cuda.current_device())
    return total / GIB, free / GIB


def _compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the trainer computes in: that of its unquantised floating-point parameters."""
    for p in model.parameters():
        if p.is_floating_point() and p.element_size() > 1:
            return p.dtype
    return torch.float32


def _fast_tmp_dir() -> str | None:
    """Adapter folders are written every step: RAM-backed /dev/shm when there is one."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
