"""Which version of the trainer's adapters a vLLM engine serves: snapshots, combined versions, their folders.

Both vLLM engines (`rollout.vllm`, in process; `rollout.vllm_server`, over HTTP) serve ONE LoRA per request, while
a policy is base + frozen earlier adapters + the student: they serve a combined adapter per set of active adapters
(`adapters.factors.combine`, the exact ΔW sum), written as a PEFT folder under a **new name and integer id per
version**, e.g. `stage-01-math+stage-02-code@7`. vLLM keeps serving cached weights when an id or name is reused
(and may serve stale prefix-cache blocks after a same-name reload, vLLM #42125), so a version is never reloaded in
place: the new one is loaded and the one it replaces unloaded and its folder deleted.

    versions = AdapterVersions(serve_path, workdir, max_served, load=..., unload=...)
    versions.sync(model, names)            after an optimiser step: snapshot these adapters' current weights
    served = versions.prepare(model, ["a", "b"])   the `Served` version of that combination (loaded on first use)

`load(served)` makes the engine hold the folder under `served.name` / `served.lora_id` and returns the engine's
handle (kept as `served.handle`); `unload(served)` removes it. A safety net: an adapter whose tensors changed in
place since its last sync (torch's version counter) is re-synced at the next `prepare`, so a missing `sync` costs a
sync, never a stale rollout (writes through `.data` bypass that counter: call `sync` after every step).
"""

from __future__ import annotations

import shutil
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adaptercl.adapters import LoraFactors, combine, served_config, snapshot, write_adapter_folder


@dataclass
class _Snapshot:
    version: int  # increases with every sync of this adapter
    factors: LoraFactors
    fingerprint: tuple  # (data_ptr, in-place version) of every LoRA tensor at snapshot time


@dataclass
class Served:
    """One combined adapter version held by the engine."""

    name: str  # "<adapters joined by +>@<lora_id>"
    lora_id: int  # unique per version, never reused
    folder: Path  # the PEFT folder the engine loaded
    versions: tuple[int, ...]  # the members' snapshot versions it was built from
    handle: Any = None  # what `load` returned (the in-process engine's LoRARequest)


class AdapterVersions:
    """The adapter versions one engine serves, least recently used evicted beyond `max_served`."""

    def __init__(
        self,
        serve_path: str,
        workdir: Path,
        max_served: int,
        load: Callable[[Served], Any],
        unload: Callable[[Served], None],
    ):
        self.serve_path = serve_path  # the base's name in the written adapter configs
        self.workdir = workdir
        self.max_served = max_served
        self._load, self._unload = load, unload
        self._snapshots: dict[str, _Snapshot] = {}
        self._served: OrderedDict[tuple[str, ...], Served] = OrderedDict()  # least recently used first
        self._next_id = 1

    def sync(self, model: torch.nn.Module, names: list[str]) -> None:
        """Snapshot the current weights of these adapters; the next `prepare` under them builds a new version."""
        for name in names:
            self._snapshot(model, name)

    def prepare(self, model: torch.nn.Module, adapters: list[str] | None) -> Served | None:
        """The version serving exactly `adapters` (None for the base), loaded into the engine.

        Syncs adapters never synced or changed in place since their sync; builds a new combined version (new
        name and id) when any member changed, and unloads the version it replaces.
        """
        if not adapters:
            return None
        key = tuple(dict.fromkeys(adapters))  # active-set order, duplicates dropped
        for name in key:
            snap = self._snapshots.get(name)
            if snap is None or snap.fingerprint != _fingerprint(model, name):
                self._snapshot(model, name)
        versions = tuple(self._snapshots[n].version for n in key)
        served = self._served.get(key)
        if served is not None and served.versions == versions:
            self._served.move_to_end(key)
            return served
        if served is not None:
            self._drop(key)
        while len(self._served) >= self.max_served:
            self._drop(next(iter(self._served)))
        lora_id = self._next_id
        self._next_id += 1
        folder = self.workdir / str(lora_id)
        factors = combine([self._snapshots[n].factors for n in key])
        factors.config = served_config(self.serve_path, factors.modules, factors.rank)
        write_adapter_folder(folder, factors)
        served = Served(f"{'+'.join(key)}@{lora_id}", lora_id, folder, versions)
        served.handle = self._load(served)
        self._served[key] = served
        return served

    def served(self) -> dict[str, int]:
        """Name -> id of every adapter version the engine currently holds."""
        return {s.name: s.lora_id for s in self._served.values()}

    def close(self) -> None:
        """Unload every version and delete the folders."""
        for key in list(self._served):
            self._drop(key)

    def _snapshot(self, model: torch.nn.Module, name: str) -> None:
        previous = self._snapshots.get(name)
        self._snapshots[name] = _Snapshot(
            version=0 if previous is None else previous.version + 1,
            factors=snapshot(model, name),
            fingerprint=_fingerprint(model, name),
        )

    def _drop(self, key: tuple[str, ...]) -> None:
        served = self._served.pop(key)
        try:
            self._unload(served)
        finally:
            shutil.rmtree(served.folder, ignore_errors=True)


def _fingerprint(model: torch.nn.Module, name: str) -> tuple:
    marker = f".{name}."
    return tuple((p.data_ptr(), p._version) for n, p in model.named_parameters() if "lora_" in n and marker in n)
