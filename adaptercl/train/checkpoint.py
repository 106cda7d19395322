"""Mid-stage checkpoints: everything needed to continue a stage bit-identically (on CPU) after a kill.

A checkpoint folder (written whole, atomically, replacing the previous one) holds:
- `adapters.safetensors`: the LoRA tensors of every adapter that changes during the stage (student, teacher);
- `optimizer.pt`: its state dict (the learning rate needs none: the stage derives it from the step);
- `rng.pt`: torch (CPU and CUDA) and Python RNG states;
- `state.json`: the next step to run and any extra bookkeeping (rollbacks used, LR scale, teacher counters).

A checkpoint is also written at the end of the stage's training with `trained: true` in state.json: a run killed
while the stage saves, evaluates or measures its diagnostics resumes from it straight to saving, without a step.

Data order and sampling seeds are functions of (seed, stage, step), so restoring these is enough for a resumed
stage to draw the same prompts and samples and end with the same adapters as an uninterrupted one.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from adaptercl.adapters import adapter_state, load_adapter_state
from adaptercl.system import atomic_dir, recover_dir

SEPARATOR = "::"


def save_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    adapters: list[str],
    optimizer: torch.optim.Optimizer,
    next_step: int,
    extra: dict[str, Any] | None = None,
) -> None:
    tensors = {
        f"{name}{SEPARATOR}{key}": value.contiguous()
        for name in adapters
        for key, value in adapter_state(model, name).items()
    }
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    with atomic_dir(path) as tmp:
        save_file(tensors, str(tmp / "adapters.safetensors"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(rng, tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps({"next_step": next_step, "adapters": adapters, **(extra or {})}))


def load_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> dict[str, Any]:
    """Restore adapters, optimiser and RNG from `path`; return state.json (with `next_step`)."""
    path = Path(path)
    state = json.loads((path / "state.json").read_text())
    tensors = load_file(str(path / "adapters.safetensors"))
    for name in state["adapters"]:
        prefix = f"{name}{SEPARATOR}"
        load_adapter_state(model, name, {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)})
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    rng = torch.load(path / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return state


def has_checkpoint(path: str | Path) -> bool:
    """Whether a checkpoint is at `path`, after putting back one that a kill left parked mid-replacement
    (`system.atomic.recover_dir`): the previous checkpoint, complete, rather than none and a fresh start."""
    recover_dir(path)
    return (Path(path) / "state.json").is_file()
