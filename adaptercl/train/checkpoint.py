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

A resumed stage says where it resumes, in one line (`resume_line`): `resuming at step N (checkpoint of step N-1)`,
or `starting over: no checkpoint yet (checkpoint_every 10, 3 steps were done)` when the kill came before the first
checkpoint after the stage's start (a stage of fewer steps than checkpoint_every checkpoints only at its end).

A checkpoint is read whole (`read_checkpoint`) before anything of it is restored (`restore_checkpoint`): a file
that does not read (cut short, emptied, overwritten) or does not fit the stage's adapters and optimiser is a
`DamagedCheckpoint` naming it, raised while the model, the optimiser and the RNG are still untouched, so the stage
can start over from step 0 instead (`train.stage`; `discard_checkpoint` moves the damaged one aside, then removes it).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
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


class DamagedCheckpoint(Exception):
    """A checkpoint that cannot be restored; the message names the file and why."""


@dataclass
class Checkpoint:
    """A checkpoint's files, read into memory."""

    state: dict[str, Any]  # state.json: next_step, adapters, and the stage's extra bookkeeping
    adapters: dict[str, dict[str, torch.Tensor]]  # adapters.safetensors: adapter -> its `adapter_state`
    optimizer: dict[str, Any]  # optimizer.pt: the optimiser's state dict
    rng: dict[str, Any]  # rng.pt: torch (CPU, CUDA) and Python RNG states


def read_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Checkpoint:
    """Every file of the checkpoint at `path`, read whole and checked against the model's adapters and the optimiser
    it will be restored into; a file that does not read or does not fit is a DamagedCheckpoint. Changes nothing."""
    path = Path(path)
    state = _read(path / "state.json", lambda p: json.loads(p.read_text()), {"next_step", "adapters"})
    tensors = _read(path / "adapters.safetensors", lambda p: load_file(str(p)), None)
    saved = _read(path / "optimizer.pt", lambda p: torch.load(p, weights_only=False), {"state", "param_groups"})
    rng = _read(path / "rng.pt", lambda p: torch.load(p, weights_only=False), {"torch", "python"})
    if not isinstance(state["adapters"], list) or not all(isinstance(n, str) for n in state["adapters"]):
        raise DamagedCheckpoint(f"{path / 'state.json'} is not what the stage wrote (adapters)")
    adapters = {}
    for name in state["adapters"]:
        prefix = f"{name}{SEPARATOR}"
        adapters[name] = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        shapes = {k: v.shape for k, v in adapters[name].items()}
        if not shapes or shapes != {k: v.shape for k, v in adapter_state(model, name).items()}:
            raise DamagedCheckpoint(f"{path / 'adapters.safetensors'} does not hold the stage's adapter {name!r}")
    groups, ours = saved["param_groups"], optimizer.param_groups
    if len(groups) != len(ours) or any(len(g["params"]) != len(o["params"]) for g, o in zip(groups, ours)):
        raise DamagedCheckpoint(f"{path / 'optimizer.pt'} does not fit the stage's optimiser")
    return Checkpoint(state, adapters, saved, rng)


def _read(file: Path, load: Callable[[Path], Any], keys: set[str] | None) -> Any:
    """`load(file)`, a mapping holding `keys`; anything else is a DamagedCheckpoint naming the file."""
    try:
        value = load(file)
    except Exception as err:  # each library says "damaged" its own way: SafetensorError, UnpicklingError,
        # EOFError, RuntimeError (a zip cut short), JSONDecodeError, OSError (a file missing)
        text = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise DamagedCheckpoint(f"{file} does not read ({text})") from None
    missing = sorted(keys - set(value)) if isinstance(value, dict) and keys else []
    if not isinstance(value, dict) or missing:
        raise DamagedCheckpoint(f"{file} is not what the stage wrote ({', '.join(missing) or 'no mapping'})")
    return value


def restore_checkpoint(checkpoint: Checkpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Restore adapters, optimiser and RNG from a checkpoint `read_checkpoint` read and checked; return state.json
    (with `next_step`)."""
    for name, values in checkpoint.adapters.items():
        load_adapter_state(model, name, values)
    optimizer.load_state_dict(checkpoint.optimizer)
    rng = checkpoint.rng
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return checkpoint.state


def load_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> dict[str, Any]:
    """Restore adapters, optimiser and RNG from `path`; return state.json (with `next_step`)."""
    return restore_checkpoint(read_checkpoint(path, model, optimizer), model, optimizer)


def discard_checkpoint(path: str | Path) -> None:
    """Remove a damaged checkpoint: renamed first (one atomic step) to a temp name that `system.recover_dir` deletes
    if a kill comes before the removal, never to a parked name it would put back."""
    path = Path(path)
    aside = path.with_name(f".{path.name}.tmp-damaged-{os.getpid()}")
    os.replace(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def resume_line(state: dict[str, Any], steps_done: int, checkpoint_every: int) -> str:
    """What a resumed stage says it does, from its checkpoint's state.json and the steps its log had recorded
    (`steps_done`, before the log is cut back to the checkpoint): where it resumes, or that it starts over."""
    next_step = state["next_step"]
    if state.get("trained"):
        return f"resuming after its last step (checkpoint of step {next_step}): no step runs again"
    if next_step == 0:
        were = "step was" if steps_done == 1 else "steps were"
        return f"starting over: no checkpoint yet (checkpoint_every {checkpoint_every}, {steps_done} {were} done)"
    lost = steps_done - next_step  # steps the log recorded after the checkpoint: they run again
    again = "; the step done after it runs again" if lost == 1 else f"; the {lost} steps done after it run again"
    again = again if lost > 0 else ""
    return f"resuming at step {next_step + 1} (checkpoint of step {next_step}{again})"


def has_checkpoint(path: str | Path) -> bool:
    """Whether a checkpoint is at `path`, after putting back one that a kill left parked mid-replacement
    (`system.atomic.recover_dir`): the previous checkpoint, complete, rather than none and a fresh start."""
    recover_dir(path)
    return (Path(path) / "state.json").is_file()
