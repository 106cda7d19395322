"""benchmarks/perf/rehearse_24gb.py at a tiny shape on CPU: the real run of recipes/hybrid.yaml goes through every
phase it measures, and its JSON holds each phase beside the plan's prediction for the very recipe that ran."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import adaptercl.run.sequence as run
import adaptercl.train.stage as stage
from adaptercl.plan.memory import plan_recipe
from adaptercl.recipe.grammar import resolve_recipe
from adaptercl.rollout.engine_choice import with_engine

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "perf"))
import rehearse_24gb  # noqa: E402


def test_tiny_rehearsal_measures_every_phase_beside_the_plan(tmp_path, monkeypatch):
    import adaptercl.model.batching as batching

    originals = (run.run_stage, stage.train_on_batch, run.evaluate_all, run.response_drift)
    replayable, prefill = [], batching.prefill
    monkeypatch.setattr(batching, "prefill", lambda *a, **k: replayable.append(k["replayable"]) or prefill(*a, **k))
    argv = ["--tiny", "--steps", "1", "--prompts-per-step", "1", "--prompt-tokens", "96", "--out", str(tmp_path)]
    assert rehearse_24gb.main([*argv, "--checkpoint-dir", str(tmp_path / "checkpoint")]) == 0
    assert True in replayable  # CUDA's path: the training forwards share the group's prompt under checkpointing
    result = json.loads((tmp_path / "rehearse_24gb-tiny.json").read_text())
    assert result["failed"] is None
    assert list(result["phases"]) == list(rehearse_24gb.PHASES)
    for name in ("load", "rollout", "train", "eval", "diagnostics"):  # each phase was entered and took time
        assert result["phases"][name]["seconds"] > 0, name
    # without vLLM (no CUDA here) auto runs the transformers engine, and the JSON says so
    assert result["engine"]["engine"] == "hf" and "transformers engine was measured" in result["engine"]["note"]
    # the plan's prediction is the plan of the recipe that ran (its engine), phase by phase
    raw, _ = rehearse_24gb.rehearsal_raw(
        argparse.Namespace(
            recipe=REPO / "recipes" / "hybrid.yaml",
            probes=False,
            prompt_tokens=96,
            steps=1,
            prompts_per_step=1,
            eval_examples=2,
            eval_new_tokens=8,
            tiny=True,
            tiny_new_tokens=8,
        ),
        tmp_path / "checkpoint",
        tmp_path / "again",
    )
    plan = plan_recipe(with_engine(resolve_recipe(raw), "hf"), gpu_memory_gib=24.0, prompt_tokens=96)
    assert plan.phases and {p.name for p in plan.phases} <= set(result["phases"])
    for phase in plan.phases:
        assert result["phases"][phase.name]["planned_gib"] == phase.gib
        assert result["plan_as_run"]["phases"][phase.name]["gib"] == phase.gib
    # every stage's step was timed, and the decode steps of the rollouts
    assert {name: len(steps) for name, steps in result["step_times"].items()} == {
        "math": 1,
        "science": 1,
        "tooluse": 1,
    }
    assert result["decode_step_s"]["rollout"]["n"] == 3
    assert (run.run_stage, stage.train_on_batch, run.evaluate_all, run.response_drift) == originals  # restored


def test_an_out_of_memory_error_is_reported_with_its_phase(tmp_path, monkeypatch):
    import torch

    def no_memory(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(stage, "train_on_batch", no_memory)
    argv = ["--tiny", "--steps", "1", "--prompts-per-step", "1", "--prompt-tokens", "96", "--out", str(tmp_path)]
    assert rehearse_24gb.main([*argv, "--checkpoint-dir", str(tmp_path / "checkpoint")]) == 1
    result = json.loads((tmp_path / "rehearse_24gb-tiny.json").read_text())
    assert result["failed"] == {
        "phase": "train",
        "error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    }
    assert result["phases"]["rollout"]["seconds"] > 0  # the first rollout ran, then its training step failed
    assert result["step_times"] == {"math": [], "science": [], "tooluse": []}  # no step finished
    assert stage.train_on_batch is no_memory  # the meter's patches are undone
