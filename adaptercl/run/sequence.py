"""The continual run: every stage of a recipe in order, top to bottom, into its run directory (`run_dir/layout.py`).

    result = run_recipe(load_recipe("recipes/quickstart.yaml"))   # the accuracy matrix, row 0 = before training

`_run_recipe` is the run's steps, each a function here or a method of `LiveRun` (`live_run.py`): claim the run
directory -> load the domains, the stacking plan (`adapters.stacking`), the rollout engine and the base -> evaluate
before training -> per stage: attach its adapter (new, continue or merge), its context and self-teacher, its micro-
batch (`train/micro_batch.py`), the teacher lift (`diagnostics.py`), train (`train.stage.run_stage`), save the
adapters, evaluate every domain, diagnose (drift, forward KL from the previous stage), done.json last -> summarise. A
finished stage is skipped (its adapter loaded from disk); an interrupted one resumes from its checkpoint (one killed
after its last step, from the checkpoint that marks it trained: no step runs again). A recipe that appends stages or
domains grows the run (`run_dir/growth.py`); any other different recipe is refused. The run's identity is its stages
and domains, not its folder: a copied or moved run directory resumes there. done.json's `seconds`, the wall time of
each part (teacher_lift, train, eval, lm_eval, parameter_drift, response_drift, stage_kl), are a resumed stage's as an
uninterrupted one's: `train` sums its kept steps' `time_step_s` (metrics.jsonl) whichever process ran them, and a part
done before the resume counts as its file recorded it (teacher_lift.json, lm_eval.json `seconds`).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from adaptercl.measure import tracking
from adaptercl.model import check_lora_layers, check_lora_targets
from adaptercl.recipe import RecipeConfig
from adaptercl.rollout import resolve_engine
from adaptercl.run.live_run import load_run
from adaptercl.run.preflight_checks import check_world, preflight
from adaptercl.run_dir import RunDir, StageDir
from adaptercl.system import distributed, phased, read_jsonl


@dataclass
class RunResult:
    run_dir: Path
    domains: list[str]
    accuracy: list[list[float]]  # [stages + 1, domains]; row 0 = before training
    stage_adapters: list[list[str]] = field(default_factory=list)  # adapters making up the model after stage k


def run_recipe(recipe: RecipeConfig, on_event: Callable[..., Any] | None = None) -> RunResult:
    """Run (or resume) every stage of `recipe`; return the accuracy matrix. `on_event(kind, **info)` is told of
    progress: load (before the base loads), model (loaded), engine, eval (done of total domains, once at 0 before
    the first), evaluated (the stage's eval.json row), drift (part parameter: done of total modules; part response:
    done of total probes; part stage_kl: done of total responses), lm_eval (before lm-eval's tasks run on a stage's
    model), stage, step (with the step's kept rollout samples), note (a line the stage has to say: a damaged
    checkpoint it starts over from), skip, finished (summary.json). With `report_to`, the trackers get them too
    (`measure/trackers.py`).

    Launched as N processes (torchrun, accelerate launch) it trains data-parallel (`system/distributed.py`): rank 0
    alone writes the run directory and reports events; the other ranks train, evaluate and measure alongside it.

    `rollout.engine: auto` is decided first (`rollout.engine_choice.resolve_engine`) and reported as the first event,
    rollout_engine (engine, reason); the run directory keeps the recipe as written. Before the run directory is
    claimed, the base's architecture and every stage's LoRA targets and layers are checked on its weightless skeleton
    (`model.check_lora_targets`): a bad one is one line, and nothing is written."""
    written = recipe
    recipe, choice = resolve_engine(recipe)
    preflight(recipe)  # missing files, rewards that do not import, no vLLM: one line before anything loads
    check_lora_layers(recipe, download=True)  # a hub model not in the local cache: its config.json alone, first
    check_lora_targets(recipe, download=True)  # the architecture and every stage's LoRA targets, on a weightless model
    with distributed.process_group() as world:
        check_world(recipe, world)
        if not world.is_main:  # events, progress and trackers are rank 0's
            return _run_recipe(recipe, written, None, world)
        with tracking(recipe, on_event or (lambda kind, **info: None)) as notify:
            if choice.decided:  # an engine the recipe names is what the user wrote: nothing to say
                notify("rollout_engine", engine=choice.engine, reason=choice.reason)
            return _run_recipe(recipe, written, notify, world)


def _run_recipe(
    recipe: RecipeConfig, written: RecipeConfig, on_event: Callable[..., Any] | None, world: distributed.World
) -> RunResult:
    """The run's steps, top to bottom: `recipe` with its engine resolved; `written` as the user wrote it (what the run
    directory keeps). Every rank takes each step; rank 0 alone writes (`system.distributed.on_main`)."""
    notify = on_event or (lambda kind, **info: None)
    run = RunDir(Path(recipe.output_dir), written)
    distributed.on_main(run.claim)  # a new directory, this recipe's, or one it grows; any other is refused
    if run.is_finished():  # every stage is done: nothing to load, nothing to write
        for stage_dir in run.stages():
            notify("skip", stage=stage_dir.name)
        return _result(run)
    live = load_run(recipe, run, notify, world)
    live.evaluate_before_training()
    for i, plan in enumerate(live.plans):
        stage_dir = run.stage(i)
        if stage_dir.is_done():  # finished earlier: bring its adapter back, frozen, and move on
            live.reload_finished_stage(stage_dir, plan)
            continue
        seconds: dict[str, float] = {}  # the wall time of each part of the stage, resumed or not (module docstring)
        init_report = live.attach_adapters(i)
        ctx = live.stage_context(i)
        live.size_micro_batch(ctx)
        live.measure_teacher_lift(ctx, seconds)
        final = phased("train", live.train, ctx)  # a stage killed after training resumes with no step
        steps = [r for r in read_jsonl(stage_dir.metrics) if "event" not in r]  # also those run before a resume
        seconds["train"] = round(sum(r["time_step_s"] for r in steps), 3)
        t0 = time.perf_counter()
        combined = phased("save", live.save, ctx)
        stage_eval = live.evaluate_stage(ctx, seconds)
        stage_drift = live.diagnose(ctx)
        seconds.update(stage_drift.get("seconds", {}))
        done = {
            "adapters": plan.model_adapters,  # the adapters making up the evaluated model, in order
            "init": plan.init,
            "init_merge": init_report,  # merge init: task vectors, weights, relative Frobenius error per module
            "combined_adapter": combined,  # combined_adapter/: one PEFT adapter, ΔW = sum of `adapters`
            # the stage: its teacher lift and training steps (as recorded), then saving, evaluating and diagnosing
            "train_seconds": seconds.get("teacher_lift", 0.0) + seconds["train"] + time.perf_counter() - t0,
            "final_step": final,
            "seconds": seconds,  # each part: teacher_lift, train, eval, lm_eval, drift parts (module docstring)
        }
        distributed.on_main(partial(_finish_stage, stage_dir, stage_eval, stage_drift, done))
    live.engines.close()
    distributed.on_main(live.summarise)
    return _result(run)


def _finish_stage(stage_dir: StageDir, stage_eval: dict, stage_drift: dict, done: dict) -> None:
    """Write a trained stage's evaluation, drift and done.json (last), and drop its resume point."""
    stage_dir.write_eval(stage_eval)
    stage_dir.write_drift(stage_drift)
    stage_dir.mark_done(done)
    shutil.rmtree(stage_dir.checkpoint, ignore_errors=True)  # the finished stage needs no resume point


def _result(run: RunDir) -> RunResult:
    summary = run.read_summary(needs=("stage_adapters",))
    return RunResult(run.path, summary["domains"], summary["accuracy"], summary["stage_adapters"])
