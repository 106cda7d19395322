"""One data-parallel rank of tests/system/test_distributed.py and tests/rollout/test_vllm_server.py, spawned from the
test process (`torch.multiprocessing.start_processes`, as torchrun would start it): the launcher's environment
variables, a record of every write under the run directory (a Python audit hook noting files opened for writing,
folders made, renames and removals there), then the real `run_recipe`; or (`srpo_step_rank`) one SRPO training step on
the rank's share of tests/train/test_srpo.py's hand-built batch.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
PATH_EVENTS = ("os.mkdir", "os.remove", "os.rmdir", "os.truncate", "shutil.rmtree", "os.unlink")


def watch_writes(folder: Path) -> list[str]:
    """Start recording writes under `folder` in this process; returns the (growing) list of 'event path'."""
    watch = os.path.realpath(folder)
    writes: list[str] = []

    def inside(path) -> str | None:
        if path is None or isinstance(path, int):
            return None
        full = os.path.realpath(os.fsdecode(path))
        return full if full == watch or full.startswith(watch + os.sep) else None

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            paths = [path] if (any(c in mode for c in "wax+") if mode else bool((flags or 0) & WRITE_FLAGS)) else []
        elif event in PATH_EVENTS:
            paths = [args[0]]
        elif event == "os.rename":
            paths = [args[0], args[1]]
        else:
            return
        writes.extend(f"{event} {full}" for full in map(inside, paths) if full is not None)

    sys.addaudithook(hook)
    return writes


def launched_as(rank: int, world_size: int, port: int) -> None:
    """The environment torchrun gives rank `rank` of `world_size` (gloo over the loopback address)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        ADAPTERCL_DIST_TIMEOUT_S="120",
    )


def run_rank(rank: int, world_size: int, port: int, raw_recipe: dict, writes_dir: str) -> None:
    """`torch.multiprocessing.start_processes` target: rank `rank` of a gloo run of `raw_recipe`."""
    launched_as(rank, world_size, port)
    import torch
    import torch.distributed as dist

    from adaptercl.recipe.grammar import resolve_recipe
    from adaptercl.run.sequence import run_recipe

    if (
        dist.is_initialized()
    ):  # inherited (a forked start) from a process where an in-process vLLM started a world of 1
        dist.destroy_process_group()
    torch.set_num_threads(1)  # 2 ranks on a shared 2-core machine
    writes = watch_writes(Path(raw_recipe["output_dir"]))
    try:
        run_recipe(resolve_recipe(raw_recipe))
    finally:
        Path(writes_dir, f"rank-{rank}.json").write_text(json.dumps(writes))


def srpo_step_rank(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """`torch.multiprocessing.start_processes` target: rank `rank`'s share (whole groups, `shard_bounds`) of the hand-built
    SRPO batch of tests/train/test_srpo.py, one `train_on_batch` in a gloo process group; writes the (all-reduced)
    gradients and the step's statistics to out_dir/rank-<rank>.pt."""
    launched_as(rank, world_size, port)
    import torch

    from adaptercl.system import distributed
    from tests.train.test_srpo import DDP_BLOCKS, SCORES, G, recorded_step, srpo_context

    torch.set_num_threads(1)
    with distributed.process_group():
        lo, hi = distributed.shard_bounds(len(SCORES) // G)
        ctx, batch, advantages, targets, _, _ = srpo_context(
            Path(out_dir, f"rank-{rank}"), groups=range(lo, hi), **DDP_BLOCKS
        )
        grads, stats = recorded_step(ctx, batch, advantages, targets)
    torch.save({"grads": grads, "stats": stats, "rows": len(targets.has_target)}, Path(out_dir, f"rank-{rank}.pt"))


def assert_adapters_equal_after_training(one: Path, two: Path, stage: str = "stage-01-one") -> float:
    """The stage's adapter of a 1-process run (`one`) and an N-rank run (`two`): it trained (some lora_B moved), and
    every tensor is equal within 1 % of an Adam step at lr 5e-3. The summation order differs (padding, micro-batches,
    the all-reduce), so the runs are in float64 (`ddp_recipe`): Adam turns an element's relative gradient error into
    the same fraction of a step, and in float32 an element whose gradient is small against the terms summed into it
    lost 1.5 % of a step on an AVX2 CPU; in float64 (plus transformers' float32 rotary tables, ~6e-8) that error is
    ~1e-5 of a step. Returns the largest absolute difference."""
    import torch
    from safetensors.torch import load_file

    a, b = (load_file(str(run / stage / "adapter" / "adapter_model.safetensors")) for run in (one, two))
    assert a.keys() == b.keys() and any(a[k].abs().max() > 0 for k in a if "lora_B" in k)  # it trained
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=5e-3 * 1e-2)
    largest = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"largest adapter difference 1 process vs N ranks: {largest:.3g}")
    return largest
