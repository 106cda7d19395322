"""Cost of each end-of-stage diagnostic at the quickstart's settings, measured alone (not the whole quickstart), and
its share of the quickstart estimated from a few training steps and one evaluation measured the same way.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/quickstart/diagnostics_cost.py \
        [--out FILE] [--steps N] [key=value ...]

Loads the quickstart's model (recipes/quickstart.yaml, unquantised on CPU), attaches the first stage's adapter and
its teacher as the run does (`run._attach_stage_adapter`, `teacher.kinds.create_teacher`), then times what the run does
in a stage with the recipe's settings: the teacher lift (stage start), `--steps` training steps
(`train.stage.run_stage`), the evaluation of every domain, parameter drift (twice: the first report also decomposes
every W0, as the run's first stage; the second is every later stage), response drift and the stage KL. Overrides as on
the command line of `adaptercl recipe run` (e.g. `eval.stage_kl_prompts=4`).

Writes JSON with the wall and CPU seconds of each (on a shared machine the process's CPU time, with torch on one
thread, is what the work costs), the diagnostics' sum over the quickstart's stages, and their estimated share of
the quickstart: diagnostics / (diagnostics + every stage's steps at the measured cost per step + an evaluation
before training and after each stage), from CPU seconds. Model loading, imports and saving are left out of the
whole, which makes the share an overestimate.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from adaptercl.adapters import live as ad
from adaptercl.adapters.stacking import plan_adapters
from adaptercl.domains import load_domain
from adaptercl.measure.drift import BaseWeights, parameter_drift_report, response_drift
from adaptercl.measure.evaluate import evaluate_all
from adaptercl.model.base import load_base
from adaptercl.recipe.load import load_recipe
from adaptercl.rollout.hf import HFEngine
from adaptercl.run.diagnostics import STAGE_KL_SEED, stage_kl, teacher_lift
from adaptercl.run.sequence import _attach_stage_adapter
from adaptercl.teacher.kinds import create_teacher
from adaptercl.train.context import StageContext, step_seed
from adaptercl.train.stage import run_stage

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the timings as JSON here")
    parser.add_argument("--steps", type=int, default=3, help="training steps measured (cost per step: their mean)")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, key=value")
    args = parser.parse_args()
    recipe = load_recipe(RECIPE, args.overrides)
    seconds: dict[str, float] = {}  # wall time
    cpu_seconds: dict[str, float] = {}  # this process's CPU time: on a shared machine, what the work itself costs

    def timed(name: str, fn):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        seconds[name] = round(time.perf_counter() - t0, 2)
        cpu_seconds[name] = round(time.process_time() - c0, 2)
        print(f"{name}: {seconds[name]:.2f} s wall, {cpu_seconds[name]:.2f} s CPU", flush=True)
        return out

    stage = recipe.stages[0]
    train = load_recipe(RECIPE, [*args.overrides, f"stages.{stage.name}.optim.steps={args.steps}"])
    domains = [load_domain(d, recipe.seed, recipe.eval.examples_per_domain) for d in recipe.domains]
    base = timed("load_model", lambda: load_base(recipe.model, recipe.quantization, torch.device("cpu")))
    torch.manual_seed(recipe.seed)
    plans, inits = plan_adapters(recipe), [s.adapter for s in recipe.stages[:1]]
    model, _ = _attach_stage_adapter(base.model, stage, plans[:1], inits, recipe.seed)
    tok, plan = base.tokenizer, plans[0]
    engine = HFEngine(model, tok, batch_size=stage.rollout.batch_size, fold_lora=stage.rollout.fold_lora)
    teacher = create_teacher(model, plan.adapter, list(plan.frozen), stage.distill.teacher)
    weights, adapters, cfg = BaseWeights(), plan.model_adapters, recipe.eval
    with tempfile.TemporaryDirectory() as stage_dir:
        ctx = StageContext(
            recipe=train, index=0, model=model, tokenizer=tok, engine=engine, domain=domains[0], student=plan.adapter,
            frozen=list(plan.frozen), teacher=teacher, stage_dir=Path(stage_dir), base_weights=weights,
        )  # fmt: skip
        if teacher is not None and cfg.teacher_lift_prompts:
            timed("teacher_lift", lambda: teacher_lift(ctx, cfg.teacher_lift_prompts, recipe.eval_max_new_tokens))
        timed("train_steps", lambda: run_stage(ctx))
    if teacher is not None:
        teacher.remove(model)
    ad.set_trainable(model, None)
    n, max_tokens = cfg.examples_per_domain, recipe.eval_max_new_tokens
    timed("eval", lambda: evaluate_all(engine, tok, domains, adapters, max_tokens, n))
    if cfg.parameter_drift:
        args_ = (model, adapters, weights, cfg.drift_top_k, cfg.drift_method)
        timed("parameter_drift_first_stage", lambda: parameter_drift_report(*args_))
        timed("parameter_drift_later_stage", lambda: parameter_drift_report(*args_))
    if cfg.drift_probes:
        n, max_tokens = cfg.drift_probes, recipe.eval_max_new_tokens
        timed("response_drift", lambda: response_drift(model, tok, engine, domains, adapters, n, max_tokens))
    if cfg.stage_kl_prompts:
        seed, n = step_seed(recipe.seed, 0, STAGE_KL_SEED), cfg.stage_kl_prompts
        max_tokens = stage.rollout.max_new_tokens
        timed("stage_kl", lambda: stage_kl(model, tok, engine, domains[0], [], adapters, n, max_tokens, seed))
    stages, steps = len(recipe.stages), sum(s.optim.steps for s in recipe.stages)

    def per_run(t: dict[str, float]) -> float:  # every stage's diagnostics: the sum the quickstart's wall time holds
        total = t.get("teacher_lift", 0.0) * stages + t.get("parameter_drift_first_stage", 0.0)
        total += t.get("parameter_drift_later_stage", 0.0) * (stages - 1)
        return round(total + (t.get("response_drift", 0.0) + t.get("stage_kl", 0.0)) * stages, 1)

    diagnostics = per_run(cpu_seconds)
    training = cpu_seconds["train_steps"] / args.steps * steps + cpu_seconds["eval"] * (stages + 1)

    result = {
        "recipe": str(RECIPE.relative_to(RECIPE.parents[1])),
        "overrides": args.overrides,
        "eval": cfg.model_dump(mode="json", exclude={"lm_eval"}),
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "diagnostics_per_run_s": per_run(seconds),
        "diagnostics_per_run_cpu_s": diagnostics,
        "training_and_eval_per_run_cpu_s": round(training, 1),  # every stage's steps and every evaluation
        "diagnostics_share_estimate": round(diagnostics / (diagnostics + training), 3),
        "revision": revision(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


def revision() -> str:
    """The git revision of the adaptercl package measured (+ "-dirty" with uncommitted changes), or "unknown"."""
    import adaptercl

    root = Path(adaptercl.__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "."], capture_output=True, text=True)
    except OSError:
        return "unknown"
    return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if rev.returncode == 0 else "unknown"


if __name__ == "__main__":
    main()
