"""The in-process vLLM engine with every call guarded: under `rollout.engine: auto` a vLLM that fails never costs the
run, and under `rollout.engine: vllm` its failure is one line.

    engine = GuardedEngine(start, hf, failed)   # starts vLLM, then a 1-token generate, a sleep and a wake
    engine.model = model                        # the live training model (the hf engine's, once switched)
    engine.generate(prompts, adapters, params)  # vLLM while it works; after a failure the hf engine

vLLM can fail while starting (the engine itself, or the settings checked before it loads: `vllm_memory.check_claim`,
`vllm_settings.served_lora_rank`), while loading an adapter (`add_lora` when a rollout first serves a combination),
while sleeping or waking (around each optimiser step), or while generating. Starting ends with a probe (one greedy
token of the base, then a sleep and a wake), so each of those but the adapter load shows before the first step. At
the first failure the engine is released (closed, CUDA cache emptied) and `failed(EngineFailure)` decides: under
auto (`Engines`) the run says so in one line, the `rollout_engine` event ("rollout engine: hf (auto: vLLM failed while
waking (RuntimeError: ...); transformers instead)"), records the switch in the run directory (`rollout_engine.jsonl`)
and goes on with the hf engine, the call that failed redone by it; a named vllm engine raises `EngineFailure.refusal`,
one RecipeError line naming the setting to change (the full traceback goes to this module's logger at DEBUG). The hf
engine rolls out on the training weights: on-policy, so it is asked for no logprobs (as `rollout_sampling` asks none
of a recipe's hf engine).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any

import torch

from adaptercl.recipe import RecipeError
from adaptercl.rollout.protocol import Completion, SamplingParams
from adaptercl.system import first_line

log = logging.getLogger(__name__)

STARTING, LOADING, SLEEPING, WAKING, GENERATING = "starting", "loading an adapter", "sleeping", "waking", "generating"
# what to change when vLLM named in the recipe fails at each point (auto falls back instead)
REMEDIES = {
    STARTING: "lower rollout.gpu_memory_utilization or rollout.max_model_len",
    LOADING: "check rollout.max_lora_rank, rollout.max_loras and lora.target_modules against vLLM's LoRA support",
    SLEEPING: "set rollout.enable_sleep_mode: false",
    WAKING: "set rollout.enable_sleep_mode: false",
    GENERATING: "lower rollout.max_new_tokens or rollout.gpu_memory_utilization",
}
PROBE = SamplingParams(max_new_tokens=1, greedy=True)
_FAILED = object()  # a guarded call's result when it raised


@dataclass(frozen=True)
class EngineFailure:
    """Where vLLM failed and the error's first line."""

    phase: str  # one of REMEDIES
    error: str  # "<type>: <first line>", or a RecipeError's own line
    recipe_error: bool = False  # one of our checks, already a line naming the setting

    @classmethod
    def of(cls, phase: str, err: Exception) -> EngineFailure:
        if isinstance(err, RecipeError):
            return cls(phase, str(err), recipe_error=True)  # our own check: one line already
        return cls(phase, first_line(err))  # "<type>: <first line>"

    def reason(self) -> str:
        """The `rollout_engine` event's reason under auto."""
        return f"auto: vLLM failed while {self.phase} ({self.error}); transformers instead"

    def refusal(self) -> str:
        """The one line a named vllm engine stops with."""
        if self.recipe_error:
            return self.error
        return (
            f"rollout.engine: vllm failed while {self.phase} ({self.error}); {REMEDIES[self.phase]}, or set "
            "rollout.engine: auto (goes on with transformers when vLLM fails) or hf"
        )

    def record(self) -> dict[str, Any]:
        """The run directory's record of the switch (`run_dir.RunDir.record_engine_switch`)."""
        return {
            "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "from": "vllm",
            "to": "hf",
            "phase": self.phase,
            "error": self.error,
        }


class GuardedEngine:
    """The `RolloutEngine` protocol over a vLLM engine (module docstring). `start()` builds the vLLM engine;
    `hf(model)` the engine that takes over; `failed(failure)` reports a failure or raises it."""

    def __init__(
        self,
        start: Callable[[], Any],
        hf: Callable[[torch.nn.Module], Any],
        failed: Callable[[EngineFailure], None],
    ):
        self._hf, self._failed = hf, failed
        self._model: torch.nn.Module | None = None
        self.failure: EngineFailure | None = None
        self.inner: Any = None
        engine = self._guard(STARTING, start)
        if engine is not _FAILED:
            self.inner = engine
            self._model = engine.model
            self._probe()

    @property
    def model(self) -> torch.nn.Module | None:
        return self._model

    @model.setter
    def model(self, model: torch.nn.Module) -> None:
        self._model = model
        if self.inner is not None:
            self.inner.model = model  # the first adapter wraps the base in a PeftModel

    @property
    def description(self) -> str:
        return self.inner.description if self.inner is not None else "hf (vLLM failed)"

    def generate(
        self, prompts: list[list[int]], adapters: list[str] | None, params: SamplingParams
    ) -> list[list[Completion]]:
        if self.inner is not None and self._guard(WAKING, self.inner.wake) is not _FAILED:
            if self._guard(LOADING, self.inner.prepare, adapters) is not _FAILED:
                out = self._guard(GENERATING, self.inner.generate, prompts, adapters, params)
                if out is not _FAILED:
                    return out
        return self._hf(self._model).generate(prompts, adapters, replace(params, logprobs=False))

    def sync_adapters(self, names: list[str]) -> None:
        if self.inner is not None:
            self._guard(LOADING, self.inner.sync_adapters, names)

    def sleep(self) -> None:
        if self.inner is not None:
            self._guard(SLEEPING, self.inner.sleep)

    def wake(self) -> None:
        if self.inner is not None:
            self._guard(WAKING, self.inner.wake)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
            self.inner = None

    def _probe(self) -> None:
        """The first generate (one greedy token of the base), a sleep and a wake, before any training."""
        if self._guard(GENERATING, self.inner.generate, [[0]], None, PROBE) is not _FAILED:
            if self._guard(SLEEPING, self.inner.sleep) is not _FAILED:
                self._guard(WAKING, self.inner.wake)

    def _guard(self, phase: str, call: Callable[..., Any], *args: Any) -> Any:
        """call(*args), or _FAILED after a failure was handled (`failed` returned: auto goes on with hf)."""
        try:
            return call(*args)
        except Exception as err:  # noqa: BLE001 - any failure of vLLM is the switch's (or the one line's) reason
            log.debug("vLLM failed while %s", phase, exc_info=True)
            failure = EngineFailure.of(phase, err)
        engine, self.inner, self.failure = self.inner, None, failure
        _release(engine)
        self._failed(failure)
        return _FAILED


def _release(engine: Any) -> None:
    """Best effort: close a failed engine and give its memory back (its state may be broken)."""
    if engine is not None:
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - a broken engine may not close; the run goes on either way
            log.debug("closing the failed vLLM engine", exc_info=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
