"""Data-parallel training (`adaptercl/system/distributed.py`) on the CPU with gloo: a 2-process torchrun run equals a
1-process run of the same recipe and global batch, only rank 0 writes, the global-denominator loss split over ranks
sums to the 1-process loss, and a rank that dies ends the others with one line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adaptercl.recipe.grammar import RecipeError, resolve_recipe
from adaptercl.run.preflight_checks import check_world
from adaptercl.run.sequence import run_recipe
from adaptercl.system.distributed import World, shard_bounds
from adaptercl.train.losses import aggregate, aggregate_denominator, micro_batch_aggregate

REPO = Path(__file__).resolve().parents[2]
SUPPORT = Path(__file__).resolve().parents[1] / "support"


def ddp_recipe(out: Path) -> dict:
    """Tiny GRPO stage: 4 prompts x group 2 per step = 8 rows, 4 per rank, generated in batches of 4 rows (so a
    rank's share is whole generate batches and samples exactly the rows one process samples). In float64: the claim is
    the same update, and the arrangements (padding, micro-batches, the all-reduce) sum in another order."""
    return {
        "model": {"name": "tiny-random", "dtype": "float64"},
        "quantization": "none",
        "output_dir": str(out),
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "optim": {"lr": 5e-3, "steps": 2, "prompts_per_step": 4, "grad_accum": 2},
        "rollout": {"group_size": 2, "max_new_tokens": 6, "batch_size": 4},
        "eval": {"examples_per_domain": 3, "parameter_drift": False, "drift_probes": 2},
        "domains": [{"name": "arith", "source": "builtin:arithmetic", "reward": "tiny_rewards:digit_fraction"}],
        "stages": [{"name": "one", "domain": "arith"}],
    }


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(REPO), str(SUPPORT)]))
    env.update(extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_mean_all", "seq_mean_token_sum_norm"]
)
def test_ranks_losses_with_global_denominators_sum_to_the_one_process_loss(mode):
    g = torch.Generator().manual_seed(0)
    values = torch.randn(8, 5, generator=g, dtype=torch.float64)  # [N, T]
    mask = (torch.rand(8, 5, generator=g) > 0.4).double()
    mask[3] = 0.0  # a sequence without a token
    whole = aggregate(values, mask, mode, max_len=5)
    shares = [shard_bounds(8, World(rank=r, size=2)) for r in range(2)]
    denominator = sum(aggregate_denominator(mask[lo:hi], mode) for lo, hi in shares)  # the all-reduced one
    total = 0.0
    for lo, hi in shares:  # each rank: two micro-batches of its rows, over the global denominator
        for rows in (slice(lo, lo + 2), slice(lo + 2, hi)):
            total = total + micro_batch_aggregate(values[rows], mask[rows], mask[lo:hi], mode, 5, denominator)
    torch.testing.assert_close(total, whole, rtol=1e-6, atol=0)  # the share is float32
    # with each rank's own denominator instead, the parts do not add up (the point of the all-reduce)
    local = sum(micro_batch_aggregate(values[lo:hi], mask[lo:hi], mask[lo:hi], mode, 5) for lo, hi in shares)
    assert not torch.isclose(local, whole)


def test_prompts_per_step_must_split_evenly_over_the_ranks(tmp_path):
    recipe = resolve_recipe({**ddp_recipe(tmp_path), "optim": {"prompts_per_step": 3}})
    check_world(recipe, World(rank=0, size=1))
    with pytest.raises(RecipeError, match=r"stages\.one\.optim\.prompts_per_step: 3 prompts .* multiple of 2"):
        check_world(recipe, World(rank=0, size=2))


def test_two_process_run_equals_one_process_run_and_only_rank_0_writes(tmp_path):
    from ddp_worker import assert_adapters_equal_after_training, run_rank

    one, two = tmp_path / "one", tmp_path / "two"
    run_recipe(resolve_recipe(ddp_recipe(one)))  # also fills the tiny-random cache before the 2 processes start
    writes = tmp_path / "writes"
    writes.mkdir()
    # spawned ranks (a fork of a test process that has run threads, vLLM say, can crash), gloo over the loopback
    args = (2, _free_port(), ddp_recipe(two), str(writes))
    torch.multiprocessing.start_processes(run_rank, args=args, nprocs=2, start_method="spawn")

    stage = "stage-01-one"
    assert_adapters_equal_after_training(one, two, stage)

    m1 = [json.loads(line) for line in (one / stage / "metrics.jsonl").read_text().splitlines()]
    m2 = [json.loads(line) for line in (two / stage / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in m2] == [1, 2]  # one writer: one line per step
    for r1, r2 in zip(m1, m2):  # the step metrics are the whole step's, as with one process
        for key in ("reward_mean", "reward_std", "correct_frac", "response_len_mean", "repetition_rate"):
            assert r2[key] == r1[key], key
        for key in ("loss", "grad_norm", "entropy"):  # float32 sums in another order
            assert r2[key] == pytest.approx(r1[key], rel=1e-4, abs=1e-6), key
    e1, e2 = (json.loads((d / stage / "eval.json").read_text())["arith"] for d in (one, two))
    assert e2["n"] == e1["n"] == 3 and e2["accuracy"] == e1["accuracy"]
    assert (two / "summary.json").is_file() and (two / stage / "done.json").is_file()

    rank0, rank1 = (json.loads((writes / f"rank-{r}.json").read_text()) for r in (0, 1))
    assert rank1 == []  # rank 1 wrote nothing under the run directory
    assert any("metrics.jsonl" in w for w in rank0) and any("summary.json" in w for w in rank0)


def test_two_process_srpo_step_equals_one_process_step(tmp_path):
    """SRPO's shared token denominator and its DW-SDPO weights' mean are the whole batch's: 2 gloo ranks, each with 2
    of the hand-built batch's 4 groups (rank 0: 5 SDPO-routed rows, rank 1: 1), make one process's step. A
    per-rank denominator or mean would not: the ranks' shares of the routes differ."""
    from ddp_worker import srpo_step_rank

    from tests.train.test_srpo import DDP_BLOCKS, TOL, assert_same_grads, recorded_step, srpo_context

    ctx, batch, advantages, targets, _, _ = srpo_context(tmp_path / "one", optim={"grad_accum": 4})
    grads, stats = recorded_step(ctx, batch, advantages, targets)  # also fills the tiny-random cache
    assert DDP_BLOCKS["optim"]["grad_accum"] * 2 == 4  # the same micro-batches of 4 rows
    torch.multiprocessing.start_processes(
        srpo_step_rank, args=(2, _free_port(), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    ranks = [torch.load(tmp_path / f"rank-{r}.pt") for r in (0, 1)]
    assert [r["rows"] for r in ranks] == [8, 8]
    for rank in ranks:  # the gradients are all-reduced: every rank holds the whole batch's
        assert_same_grads(grads, rank["grads"])
        for key in ("loss", "policy_loss", "distill_loss", "teacher_entropy_mean", "dw_weight_min", "dw_weight_max"):
            assert rank["stats"][key] == pytest.approx(stats[key], rel=TOL), key
        assert rank["stats"]["teacher_rows"] == stats["teacher_rows"] == 6


def test_a_nonfinite_step_on_one_rank_rolls_every_rank_back_together(tmp_path, monkeypatch):
    """Rank 1's rewards turn NaN from step 2 on: its loss, and through the all-reduce every rank's gradient, are
    non-finite, so every rank skips the step and rolls back to the step-1 checkpoint together (twice, then the
    stage stops there, as one process would). The shipped adapter is step 1's, equal to a 1-step 1-process run;
    no rank hangs and rank 1 writes nothing."""
    from ddp_worker import assert_adapters_equal_after_training, run_rank

    one, two, writes = tmp_path / "one", tmp_path / "two", tmp_path / "writes"
    raw_one = ddp_recipe(one)
    raw_one["optim"]["steps"] = 1
    run_recipe(resolve_recipe(raw_one))
    raw_two = ddp_recipe(two)
    raw_two["optim"]["steps"] = 3
    raw_two["monitor"] = {"checkpoint_every": 1, "max_rollbacks": 2}
    raw_two["domains"][0]["reward"] = "tiny_rewards:poisoned_on_rank_1_after_step_1"
    stage = two / "stage-01-one"
    monkeypatch.setenv("ADAPTERCL_TEST_POISON_AFTER", str(stage / "metrics.jsonl"))  # the spawned ranks inherit it
    writes.mkdir()
    args = (2, _free_port(), raw_two, str(writes))
    torch.multiprocessing.start_processes(run_rank, args=args, nprocs=2, start_method="spawn")

    rows = [json.loads(line) for line in (stage / "metrics.jsonl").read_text().splitlines()]
    events = [(r["event"], r["step"], r["action"]) for r in rows if "event" in r]
    assert events == [("nonfinite", 2, "rollback"), ("nonfinite", 2, "rollback"), ("nonfinite", 2, "stop")]
    assert [r["step"] for r in rows if "event" not in r] == [1]  # the poisoned steps were cut back
    assert_adapters_equal_after_training(one, two)  # the shipped adapter is the step-1 checkpoint's
    assert (two / "summary.json").is_file() and json.loads((writes / "rank-1.json").read_text()) == []


DYING_RANK = """
import os, sys, torch
from adaptercl.system import distributed
try:
    with distributed.process_group() as world:  # left through its finally: the group is torn down, no hang
        distributed.barrier()
        if world.rank == 1:
            os._exit(3)
        distributed.all_reduce_sum(torch.ones(1))
except distributed.RankLost as err:
    print(f"error: {err}", file=sys.stderr)  # what the CLI prints
    sys.exit(1)
"""


def test_a_rank_that_dies_ends_the_other_with_one_line(tmp_path):
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", DYING_RANK],
            env=_env(
                RANK=str(r),
                WORLD_SIZE="2",
                LOCAL_RANK=str(r),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                ADAPTERCL_DIST_TIMEOUT_S="30",
            ),
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    _, err0 = procs[0].communicate(timeout=90)
    procs[1].communicate(timeout=30)
    assert procs[1].returncode == 3 and procs[0].returncode == 1
    assert "Traceback" not in err0
    lines = [line for line in err0.splitlines() if line.startswith("error:")]  # (bitsandbytes may log a warning)
    assert len(lines) == 1 and lines[0].startswith("error: rank 0 of 2: all_reduce failed")
    assert "Rerun the same command to resume" in lines[0]
