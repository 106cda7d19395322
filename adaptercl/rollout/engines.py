"""The run's rollout engine, chosen once from `rollout.engine` (the same in every stage): `Engines`, which the
continual run and `adaptercl eval` both use.

    engines = Engines(recipe, notify)   # before the base loads: one line of error when vLLM is missing
    engines.base = load_base(...)
    engine = engines.for_model(model)   # per stage: the engine for the model as it is now
    engines.close()
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any

import torch

from adaptercl.recipe import ENGINES, RecipeConfig
from adaptercl.rollout.hf import HFEngine


class Engines:
    """The run's rollout engine: the hf engine runs on the live training model; a vllm engine (in process) or
    vllm_server engine (a client of a running server) is one per run, created on first use and closed at the end."""

    def __init__(self, recipe: RecipeConfig, notify: Callable[..., Any]):
        self.recipe, self.notify = recipe, notify
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
            tok = self.base.tokenizer
            return HFEngine(model, tok, batch_size=self.rollout.batch_size, fold_lora=self.rollout.fold_lora)
        if self.vllm is None:
            module, name = self.kind.home.split(":")
            self.vllm = getattr(import_module(module), name).from_recipe(self.recipe, self.base, model)
            self.notify("engine", description=self.vllm.description)
        self.vllm.model = model  # the first adapter wraps the base in a PeftModel
        return self.vllm

    def close(self) -> None:
        if self.vllm is not None:
            self.vllm.close()
