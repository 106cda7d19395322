"""The run's rollout engine, chosen once from `rollout.engine` (the same in every stage): `Engines`, which the
continual run and `adaptercl eval` both use.

    engines = Engines(recipe, notify, on_switch)   # before the base loads: one line of error when vLLM is missing
    engines.base = load_base(...)
    engine = engines.for_model(model)   # per stage: the engine for the model as it is now
    engines.close()

The in-process vLLM engine comes guarded (`fallback.GuardedEngine`): where the recipe said `rollout.engine: auto`
(`engine_choice.falls_back`), the caller passes `on_switch` and a vLLM that fails goes on as the hf engine, said as
the `rollout_engine` event and recorded by `on_switch(record)`; where it named vllm, the failure is one RecipeError
line before any training (starting, the first generate, sleep and wake) or at the rollout that hit it.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any

import torch

from adaptercl.recipe import ENGINES, RecipeConfig, RecipeError
from adaptercl.rollout.fallback import EngineFailure, GuardedEngine
from adaptercl.rollout.hf import HFEngine
from adaptercl.rollout.precision import cpu_paths, rollout_dtype


class Engines:
    """The run's rollout engine: the hf engine runs on the live training model; a vllm engine (in process) or
    vllm_server engine (a client of a running server) is one per run, created on first use and closed at the end."""

    def __init__(
        self,
        recipe: RecipeConfig,
        notify: Callable[..., Any],
        on_switch: Callable[[dict[str, Any]], None] | None = None,
    ):
        self.recipe, self.notify, self.on_switch = recipe, notify, on_switch
        self.rollout = recipe.stages[0].rollout  # the engine settings are the same in every stage (config validates)
        self.kind = ENGINES[self.rollout.engine]
        self.base = None
        self.vllm = None  # the per-run engine (vllm, vllm_server)
        if self.kind.needs_local_vllm:
            from adaptercl.rollout.vllm_settings import require_vllm

            require_vllm()  # a one-line error before the base loads

    def for_model(self, model: torch.nn.Module) -> Any:
        """The engine for the model as it is now (the base loaded first: `self.base`)."""
        if self.kind.home is None:  # hf: generate on the live training model
            return self._hf(model)
        if self.vllm is None:
            start = lambda: self._start(model)  # noqa: E731
            self.vllm = GuardedEngine(start, self._hf, self._failed) if self.kind.needs_local_vllm else start()
        self.vllm.model = model  # the first adapter wraps the base in a PeftModel
        return self.vllm

    def close(self) -> None:
        if self.vllm is not None:
            self.vllm.close()

    def cpu_paths(self, model: torch.nn.Module) -> dict[str, Any]:
        """What the run computes with on the CPU, for its record (`rollout.precision.cpu_paths`); the rollout dtype
        is the hf engine's (None for a vLLM engine)."""
        return cpu_paths(rollout_dtype(self.rollout.dtype, model) if self.kind.home is None else None, model)

    def _hf(self, model: torch.nn.Module) -> HFEngine:
        return HFEngine(
            model,
            self.base.tokenizer,
            batch_size=self.rollout.batch_size,
            fold_lora=self.rollout.fold_lora,
            dtype=rollout_dtype(self.rollout.dtype, model),
        )

    def _start(self, model: torch.nn.Module) -> Any:
        module, name = self.kind.home.split(":")
        engine = getattr(import_module(module), name).from_recipe(self.recipe, self.base, model)
        self.notify("engine", description=engine.description)
        return engine

    def _failed(self, failure: EngineFailure) -> None:
        """auto: say it and record it, then the guarded engine goes on as hf; a named vllm: the one line."""
        if self.on_switch is None:
            raise RecipeError(failure.refusal())
        self.notify("rollout_engine", engine="hf", reason=failure.reason())
        self.on_switch(failure.record())
