"""Data-parallel training over processes with `torch.distributed`: who this process is, the process group, and the
few collectives a run needs.

Launch N processes the usual ways (`torchrun --nproc-per-node N -m adaptercl.cli recipe run X.yaml`, or
`accelerate launch --num_processes N -m adaptercl.cli recipe run X.yaml`); both set RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT, which `process_group` reads. With WORLD_SIZE unset or 1 nothing here starts a process
group and every helper returns its input (the 1-process path is the plain code path).

What each rank does (`run/sequence.py`, `train/stage.py`, `train/step.py`, `measure/evaluate.py`):
- loads the base on its own device (cuda:LOCAL_RANK, or the CPU with the gloo backend);
- rolls out a contiguous 1/N share of each step's prompts (`shard_bounds`; optim.prompts_per_step must be a
  multiple of N), whole groups, so group advantages stay per group;
- computes its loss with the batch-global denominators (`train.losses.aggregate_denominator`, summed over ranks), so
  the ranks' losses sum to the 1-process loss; the gradients of the trainable LoRA parameters are then summed
  (`all_reduce_grads`, one flat all-reduce; the teacher and frozen adapters have none), clipped and stepped
  identically on every rank, so every rank holds the same weights and the EMA/lag teacher follows identically;
- rank 0 alone writes the run directory; the others write nothing (barriers order reads after writes);
- evaluation is sharded by example and gathered; drift and diagnostics run whole on every rank (identical weights
  and seeds give identical results) and rank 0 writes them.

A rank that dies makes the others' next collective fail (the peer's socket closes) or time out after
ADAPTERCL_DIST_TIMEOUT_S seconds (default 1800); that is raised as `RankLost`, one line, and a rerun of the same
command resumes from the stage's last checkpoint. Departures from `torch.nn.parallel.DistributedDataParallel`: the
gradients are reduced once per optimiser step (after all micro-batches), not bucketed during backward, and only the
trainable adapter's; a stage's rollouts dominate its time, so overlapping the reduction would gain little.

Same update as one process: with the same global batch, an N-rank step equals the 1-process step up to float32
summation order when each rank's rows are whole hf generate batches (rollout.batch_size divides
prompts_per_step / N x group_size; `rollout.row_seed`). Draws made over a rank's rows rather than the whole
batch differ from one process's (an equally valid sample, not the same one): LoRA dropout, the distillation mask's
`distill.mask_ratio` draw and the hybrid's high-entropy top-q selection; the logged distillation fractions are the
mean over ranks.

Rollout engines under N ranks: `hf` generates on each rank's own model; the in-process `vllm` engine is one
`vllm.LLM` per rank joined to this world (TRL's colocate mode, `rollout/colocate.py`); `vllm_server` ranks share
one server, rank 0 loading each adapter version (`rollout/vllm_server.py`). Every request is one row, seeded by its
global index (`SamplingParams.first_row`, `rollout.row_seed`), so the vLLM engines sample each row as one process
would.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from adaptercl.recipe import RecipeError

T = TypeVar("T")
TIMEOUT_ENV = "ADAPTERCL_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 1800.0


class RankLost(RuntimeError):
    """A collective failed: another rank died or did not answer within the process-group timeout."""


@dataclass(frozen=True)
class World:
    """This process's place among the launched ones (from the launcher's environment variables)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self) -> torch.device | None:
        """The device this rank trains on: cuda:LOCAL_RANK when CUDA is there, else the CPU; None for 1 process
        (the model's default device, `model.base.pick_device`)."""
        if self.size == 1:
            return None
        return torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")


def launched_world() -> World:
    """The world the launcher describes (torchrun and accelerate set RANK, WORLD_SIZE, LOCAL_RANK)."""
    try:
        size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError:
        raise RecipeError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (set by torchrun / accelerate)") from None
    return World(rank=rank, size=max(1, size), local_rank=local_rank)


def timeout_s() -> float:
    """The process-group timeout: how long a rank waits in a collective for the others (ADAPTERCL_DIST_TIMEOUT_S)."""
    raw = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise RecipeError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}")
    return value


@contextmanager
def process_group() -> Iterator[World]:
    """Join the launched processes for the span of a run (nccl on CUDA, gloo on the CPU) and leave at the end.
    A process group the caller already started is used as it is and left running; 1 process starts none."""
    if dist.is_available() and dist.is_initialized():
        yield world()
        return
    launched = launched_world()
    if launched.size == 1:
        yield launched
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(launched.local_rank)
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s()))
    try:
        yield world()
    finally:
        dist.destroy_process_group()


def world() -> World:
    """This process's world: the process group's when one is running, else 1 process."""
    if not (dist.is_available() and dist.is_initialized()):
        return World()
    local_rank = int(os.environ.get("LOCAL_RANK", str(dist.get_rank())))
    return World(rank=dist.get_rank(), size=dist.get_world_size(), local_rank=local_rank)


def is_main() -> bool:
    """True on rank 0 (and in a 1-process run): the one process that writes the run directory."""
    return world().is_main


def shard_bounds(n: int, w: World | None = None) -> tuple[int, int]:
    """This rank's contiguous share [lo, hi) of n items: rank r gets [r·n // N, (r+1)·n // N)."""
    w = w or world()
    return w.rank * n // w.size, (w.rank + 1) * n // w.size


def _collective(name: str, call: Any) -> Any:
    try:
        return call()
    except RuntimeError as err:  # DistBackendError (a peer closed the connection), timeouts, NCCL aborts
        w = world()
        detail = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise RankLost(
            f"rank {w.rank} of {w.size}: {name} failed ({detail}); another rank died or did not answer within "
            f"{timeout_s():g} s ({TIMEOUT_ENV}). Rerun the same command to resume from the last checkpoint"
        ) from None


def barrier() -> None:
    """Wait for every rank (no-op for 1 process): orders other ranks' reads after rank 0's writes."""
    if world().size > 1:
        _collective("barrier", dist.barrier)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of `tensor` over ranks (a new tensor; the input itself for 1 process)."""
    if world().size == 1:
        return tensor
    out = tensor.detach().clone()
    _collective("all_reduce", lambda: dist.all_reduce(out, op=dist.ReduceOp.SUM))
    return out


def all_reduce_grads(params: list[torch.nn.Parameter]) -> None:
    """Sum the gradients of `params` over ranks in place, in one flat all-reduce. A rank with no gradient for a
    parameter adds zeros; a parameter no rank has a gradient for keeps `.grad = None` (the optimiser skips it, as
    with 1 process)."""
    if world().size == 1 or not params:
        return
    ref = params[0]
    parts = [p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1) for p in params]
    has = torch.tensor([p.grad is not None for p in params], dtype=ref.dtype, device=ref.device)  # [n_params]
    flat = torch.cat([*(x.to(ref.dtype) for x in parts), has])  # [Σ numel + n_params]
    _collective("all_reduce of the LoRA gradients", lambda: dist.all_reduce(flat, op=dist.ReduceOp.SUM))
    grads, has = flat[: -len(params)], flat[-len(params) :]
    offset = 0
    for p, had in zip(params, has.tolist()):
        n = p.numel()
        p.grad = grads[offset : offset + n].view_as(p).to(p.dtype).clone() if had > 0 else None
        offset += n


def broadcast_tensors(tensors: list[torch.Tensor]) -> None:
    """Overwrite `tensors` on every rank with rank 0's, in place (one flat broadcast per dtype)."""
    if world().size == 1 or not tensors:
        return
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        group = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        _collective("broadcast", lambda flat=flat: dist.broadcast(flat, src=0))
        offset = 0
        with torch.no_grad():
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def broadcast_object(obj: T) -> T:
    """Rank 0's `obj` on every rank (picklable; the input itself for 1 process)."""
    if world().size == 1:
        return obj
    box = [obj]
    _collective("broadcast", lambda: dist.broadcast_object_list(box, src=0))
    return box[0]


def all_gather_objects(obj: T, group: Any = None) -> list[T]:
    """Every rank's `obj`, in rank order ([obj] for 1 process); within `group` (a subgroup) when given."""
    if world().size == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    pickle.dumps(obj)  # an unpicklable object fails here, on its own rank, with the real error
    _collective("all_gather", lambda: dist.all_gather_object(out, obj, group=group))
    return out


def gather_lists(items: list[T]) -> list[T]:
    """Every rank's list concatenated in rank order: with `shard_bounds` shares, the whole list in its order."""
    return [x for part in all_gather_objects(items) for x in part]


def sum_dicts(values: dict[str, float]) -> dict[str, float]:
    """Per key, the sum over ranks of rank-additive numbers (keys missing on a rank count 0), in rank order."""
    parts = all_gather_objects(values)
    if len(parts) == 1:
        return values
    keys = dict.fromkeys(k for part in parts for k in part)
    return {k: sum(part.get(k, 0.0) for part in parts) for k in keys}


def mean_dicts(values: dict[str, float]) -> dict[str, float]:
    """Per key, the mean over the ranks that report it (each rank's share of the batch is the same size)."""
    parts = all_gather_objects(values)
    if len(parts) == 1:
        return values
    keys = dict.fromkeys(k for part in parts for k in part)
    return {k: sum(p[k] for p in parts if k in p) / sum(k in p for p in parts) for k in keys}


def on_main(write: Any) -> None:
    """Call `write()` on rank 0 only, then wait for it on every rank. A `RecipeError` it raises (a one-line user
    problem, e.g. an output_dir holding another recipe's run) is raised on every rank, so none waits in vain."""
    if world().size == 1:
        write()
        return
    error = None
    if is_main():
        try:
            write()
        except RecipeError as err:
            error = str(err)
    error = broadcast_object(error)  # also the barrier: rank 0's files are complete
    if error is not None:
        raise RecipeError(error)
