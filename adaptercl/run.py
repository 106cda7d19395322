"""The continual run: every stage of a recipe in order, top to bottom, into its run directory (`run_dir.py`).

    result = run_recipe(load_recipe("recipes/quickstart.yaml"))   # the accuracy matrix, row 0 = before training

For each stage: attach its adapter as the stacking rule says (`continual.plan_adapters`: new, continue or merge),
create its self-teacher when the method has one (and measure the teacher lift, `diagnostics.py`), choose its
micro-batch (`micro_batch.py`: `optim.micro_batch_size`, auto sized to the card, said and written), train
(`stage.run_stage`), save the adapter, the teacher and the combined adapter, evaluate every domain, measure drift,
and write done.json last. Rerunning into the same directory skips finished stages (their adapters are loaded from
disk), so a finished run is a no-op and an interrupted one continues with the first unfinished stage (mid-stage from
its checkpoint). A recipe that appends stages or domains to the run's grows it (`run_growth.py`): only the new
stages train, and the finished rows are completed with the new domains; any other different recipe is refused.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from adaptercl import adapters as ad
from adaptercl import distributed
from adaptercl.adapter_merge import init_adapter_from_merge
from adaptercl.checkpoint import has_checkpoint
from adaptercl.config import AdapterInitConfig, RecipeConfig, RecipeError
from adaptercl.continual import AdapterPlan, plan_adapters
from adaptercl.diagnostics import STAGE_KL_SEED, stage_kl, teacher_lift
from adaptercl.domains import Domain, load_domain
from adaptercl.drift import BaseWeights, parameter_drift_report, response_drift
from adaptercl.engine_choice import resolve_engine
from adaptercl.evaluate import evaluate_all
from adaptercl.lora_factors import write_combined_adapter
from adaptercl.lora_layers import check_lora_layers
from adaptercl.methods import METHODS
from adaptercl.metrics import cl_metrics
from adaptercl.micro_batch import choose_micro_batch
from adaptercl.model import load_base
from adaptercl.preflight import preflight
from adaptercl.report import write_report
from adaptercl.rollout.engines import Engines
from adaptercl.run_dir import BEFORE_DIR, RunDir, StageDir
from adaptercl.stage import run_stage
from adaptercl.stage_context import StageContext, step_seed
from adaptercl.teacher import create_teacher
from adaptercl.tracking import tracking


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
    done of total domains), lm_eval (before lm-eval's tasks run on a stage's model), stage, step (with the step's
    kept rollout samples), skip, finished (summary.json). With `report_to`, the trackers get them too
    (`tracking.py`).

    Launched as N processes (torchrun, accelerate launch) it trains data-parallel (`distributed.py`): rank 0 alone
    writes the run directory and reports events; the other ranks train, evaluate and measure alongside it.

    `rollout.engine: auto` is decided first (`engine_choice.resolve_engine`) and reported as the first event,
    rollout_engine (engine, reason); the run directory keeps the recipe as written."""
    written = recipe
    recipe, choice = resolve_engine(recipe)
    preflight(recipe)  # missing files, rewards that do not import, no vLLM: one line before anything loads
    check_lora_layers(recipe, download=True)  # a hub model not in the local cache: its config.json alone, first
    with distributed.process_group() as world:
        check_world(recipe, world)
        if not world.is_main:  # events, progress and trackers are rank 0's
            return _run_recipe(recipe, written, None, world)
        with tracking(recipe, on_event or (lambda kind, **info: None)) as notify:
            notify("rollout_engine", engine=choice.engine, reason=choice.reason)
            return _run_recipe(recipe, written, notify, world)


def check_world(recipe: RecipeConfig, world: distributed.World) -> None:
    """One-line errors for a recipe that cannot run on `world.size` data-parallel ranks."""
    if world.size == 1:
        return
    rollout = recipe.stages[0].rollout
    if rollout.engine == "vllm" and world.size % rollout.tensor_parallel_size:
        raise RecipeError(
            f"rollout.tensor_parallel_size: {rollout.tensor_parallel_size} GPUs per vLLM engine cannot split "
            f"{world.size} data-parallel ranks (WORLD_SIZE) into whole groups; use a divisor of {world.size}"
        )
    for stage in recipe.stages:
        if stage.optim.prompts_per_step % world.size:
            raise RecipeError(
                f"stages.{stage.name}.optim.prompts_per_step: {stage.optim.prompts_per_step} prompts cannot be split "
                f"evenly over {world.size} data-parallel ranks (WORLD_SIZE); use a multiple of {world.size}"
            )


def _run_recipe(
    recipe: RecipeConfig, written: RecipeConfig, on_event: Callable[..., Any] | None, world: distributed.World
) -> RunResult:
    """`recipe` with its engine resolved; `written` as the user wrote it (what the run directory keeps)."""
    notify = on_event or (lambda kind, **info: None)
    main = world.is_main
    run = RunDir(Path(recipe.output_dir), written)
    distributed.on_main(run.claim)
    if run.is_finished():  # every stage is done: nothing to load, nothing to write
        for stage_dir in run.stages():
            notify("skip", stage=stage_dir.name)
        return _result(run)
    torch.manual_seed(recipe.seed)
    domains = [load_domain(d, recipe.seed, recipe.eval.examples_per_domain) for d in recipe.domains]
    by_name = {d.name: d for d in domains}
    plans = plan_adapters(recipe)
    engines = Engines(recipe, notify)
    notify("load", model=recipe.model.name)
    base = load_base(recipe.model, recipe.quantization, world.device())
    notify("model", description=base.description)
    model, tok = base.model, base.tokenizer
    engines.base = base
    base_weights = BaseWeights()  # dequantised W0 for parameter drift, cached across stages

    def progress(kind: str, stage_name: str, **info: Any) -> Callable[[int, int], None]:  # on_module / on_domain
        return lambda done, total: notify(kind, stage=stage_name, done=done, total=total, **info)

    def evaluate(stage_name: str, model_adapters: list[str] | None, only: list[Domain] | None = None) -> dict:
        engine, n, max_tokens = engines.for_model(model), recipe.eval.examples_per_domain, recipe.eval_max_new_tokens
        todo = domains if only is None else only
        notify("eval", stage=stage_name, done=0, total=len(todo))
        row = evaluate_all(engine, tok, todo, model_adapters, max_tokens, n, progress("eval", stage_name))
        if only is None:
            notify("evaluated", stage=stage_name, row=row)
        return row

    def probe_lm_eval(stage_dir: StageDir, model_adapters: list[str] | None) -> None:
        """eval.lm_eval.tasks: lm-eval's metrics on the model as evaluated (`lm_eval_probes.py`)."""
        if recipe.eval.lm_eval.tasks and not stage_dir.lm_eval.is_file():
            from adaptercl.lm_eval_probes import lm_eval_probes

            def probe() -> None:  # rank 0 alone: lm-eval runs whole there while the other ranks wait
                notify("lm_eval", stage=stage_dir.name, tasks=list(recipe.eval.lm_eval.tasks))
                stage_dir.write_lm_eval(lm_eval_probes(model, tok, model_adapters, recipe.eval.lm_eval))

            distributed.on_main(probe)

    def complete_row(stage_dir: StageDir, model_adapters: list[str] | None) -> None:
        """A grown run (`run_growth.py`): evaluate the domains it added on a finished stage's model."""
        row = stage_dir.read_eval()
        missing = distributed.broadcast_object([d for d in domains if d.name not in row])  # rank 0's view
        if missing:
            row.update(evaluate(stage_dir.name, model_adapters, missing))  # sharded over the ranks
            distributed.on_main(lambda: stage_dir.write_eval({d.name: row[d.name] for d in domains}))

    def drift(i: int, plan: AdapterPlan) -> dict:
        """Parameter and response drift vs the base, and the forward KL from the previous stage's policy."""
        out, cfg, model_adapters, stage_name = {}, recipe.eval, plan.model_adapters, run.stage(i).name
        if cfg.parameter_drift:
            on_module = progress("drift", stage_name, part="parameter")
            out["parameter"] = parameter_drift_report(
                model, model_adapters, base_weights, cfg.drift_top_k, cfg.drift_method, on_module
            )
        if cfg.drift_probes:
            engine, n, max_tokens = engines.for_model(model), cfg.drift_probes, recipe.eval_max_new_tokens
            on_domain = progress("drift", stage_name, part="response")
            out["response"] = response_drift(model, tok, engine, domains, model_adapters, n, max_tokens, on_domain)
        if cfg.stage_kl_prompts:  # diagnostics.stage_kl: forward KL from the previous stage's policy
            stage, seed = recipe.stages[i], step_seed(recipe.seed, i, STAGE_KL_SEED)
            engine, n, domain = engines.for_model(model), cfg.stage_kl_prompts, by_name[stage.domain]
            out["stage_kl"] = stage_kl(
                model, tok, engine, domain, list(plan.previous), model_adapters, n, stage.rollout.max_new_tokens, seed
            )
        return out

    if not run.before.is_done():
        before = evaluate(BEFORE_DIR, None)  # sharded over the ranks, gathered on each
        distributed.on_main(lambda: run.before.write_eval(before))
        probe_lm_eval(run.before, None)
        distributed.on_main(lambda: run.before.mark_done({"adapters": []}))
    complete_row(run.before, None)

    for i, (stage, plan) in enumerate(zip(recipe.stages, plans)):
        stage_dir = run.stage(i)
        if stage_dir.is_done():  # finished earlier: bring its adapter back, frozen, and move on
            model = ad.load_adapter(model, stage_dir.adapter, plan.adapter)
            complete_row(stage_dir, stage_dir.read_done()["adapters"])
            notify("skip", stage=stage_dir.name)
            continue
        inits = [s.adapter for s in recipe.stages[: i + 1]]
        model, init_report = _attach_stage_adapter(model, stage, plans[: i + 1], inits, recipe.seed)
        if main:
            stage_dir.path.mkdir(parents=True, exist_ok=True)
            if not has_checkpoint(stage_dir.checkpoint):  # a fresh start; with a checkpoint the stage resumes
                stage_dir.metrics.unlink(missing_ok=True)
                stage_dir.samples.unlink(missing_ok=True)
        # the self-teacher starts from the student as it is now; saved with the stage, then removed from the model
        teacher = None
        if METHODS[stage.method].needs_teacher:
            teacher = create_teacher(model, plan.adapter, list(plan.frozen), stage.distill.teacher)
        earlier_domains = dict.fromkeys(s.domain for s in recipe.stages[:i] if s.domain != stage.domain)
        ctx = StageContext(
            recipe=recipe,
            index=i,
            model=model,
            tokenizer=tok,
            engine=engines.for_model(model),
            domain=by_name[stage.domain],
            student=plan.adapter,
            frozen=list(plan.frozen),
            previous=list(plan.previous),
            replay_domains=[by_name[d] for d in earlier_domains],  # regularizers.replay_fraction draws from these
            stage_dir=stage_dir.path,
            base_weights=base_weights,
            on_step=lambda step, m, kept, _n=stage_dir.name: notify(
                "step", stage=_n, step=step, metrics=m, samples=kept
            ),
            teacher=teacher,
        )
        chosen = choose_micro_batch(recipe, i, model, tok, [ctx.domain, *ctx.replay_domains], world.size)
        ctx.micro_batch = chosen.rows  # optim.micro_batch_size (auto: sized to the card); None: grad_accum's split
        if chosen.record is not None:
            distributed.on_main(partial(stage_dir.write_micro_batch, chosen.record))
            notify("micro_batch", stage=stage_dir.name, line=chosen.line(), record=chosen.record)
        lift_prompts = recipe.eval.teacher_lift_prompts
        needs_lift = teacher is not None and lift_prompts and not stage_dir.teacher_lift.is_file()
        if distributed.broadcast_object(needs_lift):  # before the first step; every rank measures, rank 0 writes
            lift = teacher_lift(ctx, lift_prompts, recipe.eval_max_new_tokens)
            distributed.on_main(partial(stage_dir.write_teacher_lift, lift))
            notify("teacher_lift", stage=stage_dir.name, lift=stage_dir.read_teacher_lift())
        notify("stage", stage=stage_dir.name, steps=stage.optim.steps, method=stage.method, init=plan.init)
        t0 = time.perf_counter()
        final = run_stage(ctx)
        ad.set_trainable(model, None)
        model_adapters = plan.model_adapters
        combined: dict = {}
        if main:  # every rank holds the same adapters; rank 0 writes them
            ad.save_adapter(model, plan.adapter, stage_dir.adapter)
            if teacher is not None:
                teacher.save(model, stage_dir.teacher)
            combined = write_combined_adapter(model, model_adapters, stage_dir.combined_adapter)
        if teacher is not None:
            teacher.remove(model)
        stage_eval = evaluate(stage_dir.name, model_adapters)  # sharded over the ranks
        probe_lm_eval(stage_dir, model_adapters)  # rank 0, before done.json
        stage_drift = drift(i, plan)  # whole on every rank (same weights, same seeds), written by rank 0
        done = {
            "adapters": model_adapters,  # the adapters making up the evaluated model, in order
            "init": plan.init,
            "init_merge": init_report,  # merge init: task vectors, weights, relative Frobenius error per module
            "combined_adapter": combined,  # combined_adapter/: one PEFT adapter, ΔW = sum of `adapters`
            "train_seconds": time.perf_counter() - t0,
            "final_step": final,
        }
        distributed.on_main(partial(_finish_stage, stage_dir, stage_eval, stage_drift, done))

    engines.close()
    names = [d.name for d in recipe.domains]

    def finish_run() -> None:
        rows = [s.read_eval() for s in [run.before, *run.stages()]]
        accuracy = [[row[n]["accuracy"] for n in names] for row in rows]
        run.write_summary(
            {
                "domains": names,
                "stages": [BEFORE_DIR] + [s.name for s in run.stages()],
                "accuracy": accuracy,
                "stage_adapters": [[]] + [p.model_adapters for p in plans],
                "cl_metrics": cl_metrics(accuracy, [names.index(s.domain) for s in recipe.stages]),
            }
        )
        notify("finished", summary=run.read_summary())
        write_report(run.path)

    distributed.on_main(finish_run)
    return _result(run)


def _finish_stage(stage_dir: StageDir, stage_eval: dict, stage_drift: dict, done: dict) -> None:
    """Write a trained stage's evaluation, drift and done.json (last), and drop its resume point."""
    stage_dir.write_eval(stage_eval)
    stage_dir.write_drift(stage_drift)
    stage_dir.mark_done(done)
    shutil.rmtree(stage_dir.checkpoint, ignore_errors=True)  # the finished stage needs no resume point


def _attach_stage_adapter(
    model: torch.nn.Module, stage: Any, plans: list[AdapterPlan], inits: list[AdapterInitConfig], seed: int
) -> tuple[torch.nn.Module, dict[str, Any] | None]:
    """Attach the stage's adapter (`plans[-1]`; `plans`, `inits`: the stages so far and their `adapter` blocks),
    initialised as its plan says, as the one trainable adapter over the frozen ones. Returns the model (the first
    adapter wraps the base in a PeftModel) and the merge report (merge init)."""
    plan = plans[-1]
    model = ad.attach_adapter(model, plan.adapter, stage.lora)
    init_report = None
    if plan.copy_from is not None:  # continue
        ad.copy_adapter(model, plan.copy_from, plan.adapter)
    if plan.init == "merge":  # of the earlier stages' task vectors (continual.py)
        init_report = init_adapter_from_merge(model, plans, inits, seed)
    ad.use_adapters(model, plan.model_adapters, trainable=plan.adapter)
    return model, init_report


def _result(run: RunDir) -> RunResult:
    summary = run.read_summary()
    return RunResult(run.path, summary["domains"], summary["accuracy"], summary["stage_adapters"])
