"""A run while its stages train (`LiveRun`): what each step of `sequence._run_recipe` does, and `load_run`, which
loads what the steps share (the domains, the adapters' stacking plan, the rollout engine and the base).

`sequence.py` reads top to bottom as the run's steps; each is a method here: evaluate before training (or take row
0 from another run: `eval.before_from`), reload a finished stage, attach a stage's adapter (new, continue or merge:
`adapters.stacking`), its context and self-teacher, its micro-batch (`train/micro_batch.py`), the teacher lift
(`diagnostics.py`), train (`train.stage.run_stage`), save the adapters, evaluate every domain, diagnose (drift,
forward KL from the previous stage), summarise.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import torch

from adaptercl.adapters import AdapterPlan, init_adapter_from_merge, plan_adapters, write_combined_adapter
from adaptercl.adapters import live as ad
from adaptercl.domains import Domain, load_domain
from adaptercl.measure import (
    BaseWeights,
    cl_metrics,
    evaluate_all,
    loglikelihood_domains,
    parameter_drift_report,
    response_drift,
    write_report,
)
from adaptercl.model import load_base
from adaptercl.recipe import METHODS, RecipeConfig
from adaptercl.rollout import Engines, falls_back
from adaptercl.run.diagnostics import STAGE_KL_SEED, stage_kl, teacher_lift
from adaptercl.run_dir import BEFORE_DIR, RunDir, StageDir, before_source, copy_before_row
from adaptercl.system import distributed, phased
from adaptercl.teacher import create_teacher
from adaptercl.train import StageContext, choose_micro_batch, has_checkpoint, run_stage, step_seed

T = TypeVar("T")


def load_run(recipe: RecipeConfig, run: RunDir, notify: Callable[..., Any], world: distributed.World) -> LiveRun:
    """The domains, the adapters' stacking plan, the rollout engine and the base model, after seeding torch's RNG
    with the recipe's seed (the adapters' initialisation draws from it)."""
    torch.manual_seed(recipe.seed)
    domains = [load_domain(d, recipe.seed, recipe.eval.examples_per_domain) for d in recipe.domains]
    plans = plan_adapters(recipe)
    # before the base: a missing vLLM is one line; under auto (the recipe as written, run.recipe) a vLLM that fails
    # goes on as hf, the switch recorded by rank 0
    on_switch = (run.record_engine_switch if world.is_main else lambda r: None) if falls_back(run.recipe) else None
    engines = Engines(recipe, notify, on_switch)
    notify("load", model=recipe.model.name)
    base = phased("load", load_base, recipe.model, recipe.quantization, world.device())
    notify("model", description=base.description)
    engines.base = base
    if world.is_main:  # MKL's branch, the packed-weight path, the rollout dtype: cpu_paths.jsonl
        run.record_cpu_paths(engines.cpu_paths(base.model))
    return LiveRun(recipe, run, notify, world, domains, plans, engines, base.model, base.tokenizer)


@dataclass
class LiveRun:
    """A run while its stages train: the recipe, its directory and what `_load` loaded. `model` is the one model
    of the run (the first adapter wraps the base in a PeftModel); its methods are the steps of `_run_recipe`."""

    recipe: RecipeConfig
    run: RunDir
    notify: Callable[..., Any]
    world: distributed.World
    domains: list[Domain]
    plans: list[AdapterPlan]
    engines: Engines
    model: torch.nn.Module
    tokenizer: Any
    base_weights: BaseWeights = field(default_factory=BaseWeights)  # dequantised W0 for drift, cached across stages

    @property
    def main(self) -> bool:
        """Rank 0, the one that writes."""
        return self.world.is_main

    # ------------------------------------------------------------------------------------------ the steps

    def evaluate_before_training(self) -> None:
        """Row 0 of the accuracy matrix: every domain on the base (and the lm-eval probes), once."""
        before = self.run.before
        source = before_source(self.recipe) if not before.is_done() else None
        if source is not None:  # eval.before_from: another run's row 0, checked to depend on the same inputs
            distributed.on_main(partial(copy_before_row, source, self.run))
        elif not before.is_done():
            seconds: dict[str, float] = {}
            row = timed(seconds, "eval", self.evaluate, BEFORE_DIR, None)  # sharded over the ranks, gathered on each
            distributed.on_main(lambda: before.write_eval(row))
            if self.recipe.eval.lm_eval.tasks:
                seconds["lm_eval"] = self.probe_lm_eval(before, None)
            distributed.on_main(lambda: before.mark_done({"adapters": [], "seconds": seconds}))
        self.complete_row(before, None)

    def reload_finished_stage(self, stage_dir: StageDir, plan: AdapterPlan) -> None:
        """A stage finished earlier: its adapter loaded from disk (frozen), its row completed (a grown run)."""
        stage_dir.read_adapter_config()  # one that does not parse is named in one line, not PEFT's traceback
        self.model = ad.load_adapter(self.model, stage_dir.adapter, plan.adapter)
        self.complete_row(stage_dir, stage_dir.read_done()["adapters"])
        self.notify("skip", stage=stage_dir.name)

    def attach_adapters(self, i: int) -> dict[str, Any] | None:
        """Stage `i`'s adapter attached and initialised as its plan says (new, continue or merge:
        `adapters/stacking.py`), the one trainable adapter over the frozen ones; its folder made, and a fresh start's
        step logs cleared. Returns the merge report (merge init)."""
        stage, plan, stage_dir = self.recipe.stages[i], self.plans[i], self.run.stage(i)
        self.model = ad.attach_adapter(self.model, plan.adapter, stage.lora)  # the first wraps the base in a PeftModel
        init_report = None
        if plan.copy_from is not None:  # continue
            ad.copy_adapter(self.model, plan.copy_from, plan.adapter)
        if plan.init == "merge":  # of the earlier stages' task vectors (adapters/stacking.py)
            inits = [s.adapter for s in self.recipe.stages[: i + 1]]
            init_report = init_adapter_from_merge(self.model, self.plans[: i + 1], inits, self.recipe.seed)
        ad.use_adapters(self.model, plan.model_adapters, trainable=plan.adapter)
        if self.main:
            stage_dir.path.mkdir(parents=True, exist_ok=True)
            if not has_checkpoint(stage_dir.checkpoint):  # a fresh start; with a checkpoint the stage resumes
                stage_dir.metrics.unlink(missing_ok=True)
                stage_dir.samples.unlink(missing_ok=True)
        return init_report

    def stage_context(self, i: int) -> StageContext:
        """What stage `i` is handed, with its self-teacher when the method has one: the teacher starts from the
        student as it is now, is saved with the stage, then removed from the model (`save`)."""
        stage, plan, stage_dir = self.recipe.stages[i], self.plans[i], self.run.stage(i)
        teacher = None
        if METHODS[stage.method].needs_teacher:
            teacher = create_teacher(self.model, plan.adapter, list(plan.frozen), stage.distill.teacher)
        by_name = {d.name: d for d in self.domains}
        earlier_domains = dict.fromkeys(s.domain for s in self.recipe.stages[:i] if s.domain != stage.domain)
        replayed = stage.regularizers.replay_domains
        earlier_domains = earlier_domains if replayed is None else dict.fromkeys(replayed)
        return StageContext(
            recipe=self.recipe,
            index=i,
            model=self.model,
            tokenizer=self.tokenizer,
            engine=self.engines.for_model(self.model),
            domain=by_name[stage.domain],
            student=plan.adapter,
            frozen=list(plan.frozen),
            previous=list(plan.previous),
            replay_domains=[by_name[d] for d in earlier_domains],  # replay_fraction draws from these
            stage_dir=stage_dir.path,
            base_weights=self.base_weights,
            on_step=lambda step, m, kept, _n=stage_dir.name: self.notify(
                "step", stage=_n, step=step, metrics=m, samples=kept
            ),
            on_note=lambda line, _n=stage_dir.name: self.notify("note", stage=_n, line=line),
            teacher=teacher,
        )

    def size_micro_batch(self, ctx: StageContext) -> None:
        """`optim.micro_batch_size` (`train/micro_batch.py`; auto: sized to the card; None: grad_accum's split), said
        and written to the stage's micro_batch.json."""
        stage_dir, domains = self.run.stage(ctx.index), [ctx.domain, *ctx.replay_domains]
        chosen = choose_micro_batch(self.recipe, ctx.index, self.model, self.tokenizer, domains, self.world.size)
        ctx.micro_batch = chosen.rows
        if chosen.record is not None:
            distributed.on_main(partial(stage_dir.write_micro_batch, chosen.record))
            self.notify("micro_batch", stage=stage_dir.name, line=chosen.line(), record=chosen.record)

    def measure_teacher_lift(self, ctx: StageContext, seconds: dict[str, float]) -> None:
        """Before the first step, with `eval.teacher_lift_prompts`: the teacher's lift over the student
        (`diagnostics.teacher_lift`); every rank measures, rank 0 writes. A resumed stage keeps its file."""
        stage_dir, lift_prompts = self.run.stage(ctx.index), self.recipe.eval.teacher_lift_prompts
        if ctx.teacher is None or not lift_prompts:
            return
        if distributed.broadcast_object(not stage_dir.teacher_lift.is_file()):
            max_tokens = self.recipe.eval_max_new_tokens
            lift = timed(seconds, "teacher_lift", teacher_lift, ctx, lift_prompts, max_tokens)
            distributed.on_main(partial(stage_dir.write_teacher_lift, {**lift, "seconds": seconds["teacher_lift"]}))
            self.notify("teacher_lift", stage=stage_dir.name, lift=stage_dir.read_teacher_lift())
        else:  # measured before a resume
            seconds["teacher_lift"] = stage_dir.read_teacher_lift().get("seconds", 0.0)

    def train(self, ctx: StageContext) -> int:
        """The stage's steps (`train.stage.run_stage`, from its checkpoint when there is one); returns the last
        step."""
        stage, plan = ctx.stage, self.plans[ctx.index]
        self.notify(
            "stage", stage=self.run.stage(ctx.index).name, steps=stage.optim.steps, method=stage.method, init=plan.init
        )
        final = run_stage(ctx)
        ad.set_trainable(self.model, None)
        return final

    def save(self, ctx: StageContext) -> dict:
        """Rank 0 writes the stage's adapter, its teacher and the combined adapter (every rank holds the same
        adapters); then the teacher leaves the model. Returns the combined adapter's report."""
        plan, stage_dir, teacher = self.plans[ctx.index], self.run.stage(ctx.index), ctx.teacher
        combined: dict = {}
        if self.main:
            ad.save_adapter(self.model, plan.adapter, stage_dir.adapter)
            if teacher is not None:
                teacher.save(self.model, stage_dir.teacher)
            combined = write_combined_adapter(self.model, plan.model_adapters, stage_dir.combined_adapter)
        if teacher is not None:
            teacher.remove(self.model)
        return combined

    def evaluate_stage(self, ctx: StageContext, seconds: dict[str, float]) -> dict:
        """The stage's row of the accuracy matrix (sharded over the ranks), then the lm-eval probes (rank 0)."""
        stage_dir, model_adapters = self.run.stage(ctx.index), self.plans[ctx.index].model_adapters
        row = timed(seconds, "eval", self.evaluate, stage_dir.name, model_adapters)
        if self.recipe.eval.lm_eval.tasks:
            seconds["lm_eval"] = self.probe_lm_eval(stage_dir, model_adapters)  # before done.json
        return row

    def diagnose(self, ctx: StageContext) -> dict:
        """Parameter and response drift vs the base, and the forward KL from the previous stage's policy, with the
        wall time of each (`seconds`); whole on every rank (same weights, same seeds), written by rank 0."""
        i, plan, cfg, model, tok = ctx.index, self.plans[ctx.index], self.recipe.eval, self.model, self.tokenizer
        out, seconds, model_adapters, stage_name = {}, {}, plan.model_adapters, self.run.stage(i).name
        self.engines.for_model(model).sleep()  # awake since the evaluation: a colocated vLLM gives the card back
        if cfg.parameter_drift:
            on_module = self.progress("drift", stage_name, part="parameter")
            out["parameter"] = timed(
                seconds, "parameter_drift", parameter_drift_report,
                model, model_adapters, self.base_weights, cfg.drift_top_k, cfg.drift_method, on_module,
            )  # fmt: skip
        if cfg.drift_probes:
            engine, n, max_tokens = self.engines.for_model(model), cfg.drift_probes, self.recipe.eval_max_new_tokens
            on_probe = self.progress("drift", stage_name, part="response")
            out["response"] = timed(
                seconds, "response_drift", response_drift,
                model, tok, engine, self.domains, model_adapters, n, max_tokens, on_probe,
            )  # fmt: skip
        if cfg.stage_kl_prompts:  # diagnostics.stage_kl: forward KL from the previous stage's policy
            stage, seed = self.recipe.stages[i], step_seed(self.recipe.seed, i, STAGE_KL_SEED)
            engine, n, previous = self.engines.for_model(model), cfg.stage_kl_prompts, list(plan.previous)
            max_tokens, on_response = stage.rollout.max_new_tokens, self.progress("drift", stage_name, part="stage_kl")
            out["stage_kl"] = timed(
                seconds, "stage_kl", stage_kl,
                model, tok, engine, ctx.domain, previous, model_adapters, n, max_tokens, seed, on_response,
            )  # fmt: skip
        return {**out, "seconds": seconds} if seconds else out

    def summarise(self) -> None:
        """summary.json (the accuracy matrix and the continual-learning metrics), then the report (rank 0)."""
        run, names = self.run, [d.name for d in self.recipe.domains]
        rows = [s.read_eval() for s in [run.before, *run.stages()]]
        accuracy = [[row[n]["accuracy"] for n in names] for row in rows]
        run.write_summary(
            {
                "domains": names,
                "stages": [BEFORE_DIR] + [s.name for s in run.stages()],
                "accuracy": accuracy,
                "stage_adapters": [[]] + [p.model_adapters for p in self.plans],
                "cl_metrics": cl_metrics(accuracy, [names.index(s.domain) for s in self.recipe.stages]),
            }
        )
        self.notify("finished", summary=run.read_summary())
        write_report(run.path)

    # ---------------------------------------------------------------------------- what the steps share

    def progress(self, kind: str, stage_name: str, **info: Any) -> Callable[[int, int], None]:
        """An on_module / on_domain callback telling `notify` of `kind` progress."""
        return lambda done, total: self.notify(kind, stage=stage_name, done=done, total=total, **info)

    def evaluate(self, stage_name: str, model_adapters: list[str] | None, only: list[Domain] | None = None) -> dict:
        """Accuracy of every domain (or `only` these) under `model_adapters`, sharded over the ranks."""
        engine, n, max_tokens = (
            self.engines.for_model(self.model),
            self.recipe.eval.examples_per_domain,
            self.recipe.eval_max_new_tokens,
        )
        todo = self.domains if only is None else only
        self.notify("eval", stage=stage_name, done=0, total=len(todo))
        on_domain = self.progress("eval", stage_name)
        cfg = self.recipe.eval
        by_loglikelihood = loglikelihood_domains(todo, cfg.retention_probes, cfg.choice_scoring)
        row = evaluate_all(
            engine, self.tokenizer, todo, model_adapters, max_tokens, n, on_domain, by_loglikelihood, self.model
        )
        if only is None:
            self.notify("evaluated", stage=stage_name, row=row)
        return row

    def probe_lm_eval(self, stage_dir: StageDir, model_adapters: list[str] | None) -> float:
        """eval.lm_eval.tasks: lm-eval's metrics on the model as evaluated (`measure/lm_eval.py`) and their wall time
        (`seconds`, returned; a resume keeps the file and returns what it recorded)."""
        lm_eval = self.recipe.eval.lm_eval
        if stage_dir.lm_eval.is_file():
            return stage_dir.read_lm_eval().get("seconds", 0.0)
        from adaptercl.measure import lm_eval_probes

        seconds = {"lm_eval": 0.0}  # rank 0's; the other ranks only wait

        def probe() -> None:  # rank 0 alone: lm-eval runs whole there while the other ranks wait
            self.engines.for_model(self.model).sleep()  # lm-eval's forwards: a colocated vLLM gives the card back
            self.notify("lm_eval", stage=stage_dir.name, tasks=list(lm_eval.tasks))
            result = timed(seconds, "lm_eval", lm_eval_probes, self.model, self.tokenizer, model_adapters, lm_eval)
            stage_dir.write_lm_eval({**result, "seconds": seconds["lm_eval"]})

        distributed.on_main(probe)
        return seconds["lm_eval"]

    def complete_row(self, stage_dir: StageDir, model_adapters: list[str] | None) -> None:
        """A grown run (`run_dir/growth.py`): evaluate the domains it added on a finished stage's model."""
        row = stage_dir.read_eval()
        missing = distributed.broadcast_object([d for d in self.domains if d.name not in row])  # rank 0's view
        if missing:
            row.update(self.evaluate(stage_dir.name, model_adapters, missing))  # sharded over the ranks
            distributed.on_main(lambda: stage_dir.write_eval({d.name: row[d.name] for d in self.domains}))


def timed(seconds: dict[str, float], name: str, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args), its wall time recorded as seconds[name] (the stage files' `seconds`)."""
    t0 = time.perf_counter()
    out = phased(name, fn, *args)  # a named phase, for whoever watches (system/phases.py: the rehearsal)
    seconds[name] = round(time.perf_counter() - t0, 3)
    return out
