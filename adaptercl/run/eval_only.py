"""Evaluation without training: a finished run's stages, or shipped PEFT adapter folders, on a recipe's domains.

    adaptercl eval --run RUN_DIR --out DIR                       every row of the run again, with its own recipe
    adaptercl eval RECIPE --run RUN_DIR --out DIR                the run's models on RECIPE's domains and probes
    adaptercl eval RECIPE --adapter A [--adapter B ...] --out DIR   each adapter folder alone on RECIPE's model

    evaluate_run(RUN_DIR, OUT, recipe=None)  /  evaluate_adapters(recipe, [A, B], OUT)

OUT/<label>/eval.json holds the same per-domain rows a run writes (`measure.evaluate.evaluate_all`: accuracy, mean
reward, n, samples), OUT/<label>/lm_eval.json lm-eval's metrics where `eval.lm_eval.tasks` is set
(`measure/lm_eval.py`), and OUT/summary.json the matrix: {"domains", "models" (the labels), "accuracy" [models,
domains], "adapters"}.

A run's labels are its stage folders (stage-00-before: the base). Each stage is evaluated with the adapters its
done.json lists, each loaded from its own stage's adapter/ folder and stacked as the run stacked them, so on the same
machine and engine greedy evaluation reproduces the run's own eval.json rows exactly. (A stage's combined_adapter/
has the same ΔW as one adapter; `--adapter` evaluates it, equal up to float rounding.) An adapter folder's label is
its folder name, made unique with -2, -3 ... . A recipe given with `--run` must name the run's model and
quantization. Inputs are checked before the model loads; OUT is written at the end in one rename, and an existing
non-empty OUT is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from adaptercl.adapters import check_weights
from adaptercl.adapters import live as ad
from adaptercl.domains import load_domain
from adaptercl.measure import evaluate_all, loglikelihood_domains
from adaptercl.model import load_base
from adaptercl.recipe import RecipeConfig, RecipeError
from adaptercl.rollout import (
    Engines,  # the run's engine choice (hf, or one vLLM engine)
    falls_back,
    resolve_engine,
)
from adaptercl.run.preflight_checks import preflight
from adaptercl.run_dir import BEFORE_DIR, SUMMARY_FILE, StageDir, open_finished_run
from adaptercl.system import atomic_dir, check_new_folder, read_record, write_json

ADAPTER_CONFIG = "adapter_config.json"


class EvalModel:
    """One evaluated model: `label`, the adapter folders to load as (name, path), and the names active."""

    def __init__(self, label: str, load: list[tuple[str, Path]], active: list[str] | None):
        self.label, self.load, self.active = label, load, active


def evaluate_run(
    run_dir: str | Path,
    out: str | Path,
    recipe: RecipeConfig | None = None,
    on_event: Callable[..., Any] | None = None,
) -> Path:
    """Evaluate every row of the finished run in `run_dir` (before training and each stage) on `recipe`'s domains
    (default: the run's own recipe); write OUT as the module docstring says and return it."""
    run, _ = open_finished_run(run_dir, "eval")
    if recipe is None:
        recipe = run.recipe
    for field in ("model", "quantization"):
        ours, theirs = getattr(recipe, field), getattr(run.recipe, field)
        if ours != theirs:
            raise RecipeError(f"eval: the recipe's {field} {_short(ours)} is not the run's {_short(theirs)}")
    models = [EvalModel(BEFORE_DIR, [], None)]
    for stage in run.stages():
        active = stage.read_done()["adapters"]
        models.append(EvalModel(stage.name, [(name, run.path / name / "adapter") for name in active], active))
    return _evaluate(recipe, models, out, {"run_dir": str(run.path.resolve())}, on_event)


def evaluate_adapters(
    recipe: RecipeConfig, adapter_dirs: list[str | Path], out: str | Path, on_event: Callable[..., Any] | None = None
) -> Path:
    """Evaluate each PEFT adapter folder alone on `recipe`'s model and domains; write OUT and return it."""
    if not adapter_dirs:
        raise RecipeError("eval: name at least one --adapter folder")
    models, labels = [], set()
    for i, path in enumerate(Path(p) for p in adapter_dirs):
        if not (path / ADAPTER_CONFIG).is_file():
            what = "does not exist" if not path.exists() else f"has no {ADAPTER_CONFIG}"
            raise RecipeError(f"eval: --adapter {str(path)!r} {what}; name a PEFT adapter folder")
        check_weights(path)  # a damaged copy: one line now, not a traceback once the base has loaded
        label, k = path.resolve().name, 2
        while label in labels:
            label, k = f"{path.resolve().name}-{k}", k + 1
        labels.add(label)
        models.append(EvalModel(label, [(f"adapter-{i}", path)], [f"adapter-{i}"]))
    return _evaluate(recipe, models, out, {"adapter_dirs": [str(Path(p).resolve()) for p in adapter_dirs]}, on_event)


def _evaluate(
    recipe: RecipeConfig,
    models: list[EvalModel],
    out: str | Path,
    source: dict[str, Any],
    on_event: Callable[..., Any] | None,
) -> Path:
    notify = on_event or (lambda kind, **info: None)
    out = Path(out)
    check_new_folder(out, "eval")
    on_switch = (lambda record: None) if falls_back(recipe) else None  # auto: a failing vLLM goes on as hf, said
    recipe, choice = resolve_engine(recipe)  # rollout.engine auto: hf or vllm, said first
    preflight(recipe)
    if choice.decided:  # as run_recipe: said only when auto decided it
        notify("rollout_engine", engine=choice.engine, reason=choice.reason)
    torch.manual_seed(recipe.seed)  # as run_recipe before it loads the domains
    domains = [load_domain(d, recipe.seed, recipe.eval.examples_per_domain) for d in recipe.domains]
    engines = Engines(recipe, notify, on_switch)
    notify("load", model=recipe.model.name)
    base = load_base(recipe.model, recipe.quantization)
    notify("model", description=base.description)
    model, tok, loaded = base.model, base.tokenizer, set()
    engines.base = base
    names = [d.name for d in recipe.domains]
    accuracy = []
    try:
        with atomic_dir(out) as tmp:
            for m in models:
                for name, path in m.load:
                    if name not in loaded:
                        model = _load(model, path, name, recipe.model.name)
                        loaded.add(name)
                notify("eval", stage=m.label, done=0, total=len(domains))
                on_domain = lambda done, total, _l=m.label: notify("eval", stage=_l, done=done, total=total)  # noqa: E731
                engine, n, max_tokens = (
                    engines.for_model(model),
                    recipe.eval.examples_per_domain,
                    recipe.eval_max_new_tokens,
                )
                cfg = recipe.eval
                by_loglikelihood = loglikelihood_domains(domains, cfg.retention_probes, cfg.choice_scoring)
                row = evaluate_all(engine, tok, domains, m.active, max_tokens, n, on_domain, by_loglikelihood, model)
                stage_dir = StageDir(tmp / m.label)
                stage_dir.path.mkdir()
                stage_dir.write_eval(row)
                if recipe.eval.lm_eval.tasks:
                    from adaptercl.measure import lm_eval_probes

                    notify("lm_eval", stage=m.label, tasks=list(recipe.eval.lm_eval.tasks))
                    stage_dir.write_lm_eval(lm_eval_probes(model, tok, m.active, recipe.eval.lm_eval))
                accuracy.append([row[name]["accuracy"] for name in names])
            summary = {
                "domains": names,
                "models": [m.label for m in models],
                "accuracy": accuracy,
                "adapters": {m.label: [str(p) for _, p in m.load] for m in models},
                **source,
            }
            write_json(tmp / SUMMARY_FILE, summary)
    finally:
        engines.close()
    return out


def _load(model: torch.nn.Module, path: Path, name: str, model_name: str) -> torch.nn.Module:
    """Load one adapter folder as `name`; a folder that does not fit the base is one line."""
    try:
        return ad.load_adapter(model, path, name)
    except (RuntimeError, ValueError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RecipeError(f"eval: adapter {str(path)!r} does not fit the base {model_name!r}: {first[:200]}") from None


def _short(value: Any) -> str:
    return repr(value.model_dump(exclude_defaults=True) if hasattr(value, "model_dump") else value)


def format_summary(out: str | Path) -> str:
    """The accuracy matrix OUT/summary.json holds, as aligned text (what `adaptercl eval` prints)."""
    summary = read_record(Path(out) / SUMMARY_FILE, f"delete the folder {out} and evaluate again")
    width = max(len(label) for label in summary["models"])
    lines = [f"{'':{width}}  " + "  ".join(f"{d:>8}" for d in summary["domains"])]
    for label, row in zip(summary["models"], summary["accuracy"]):
        lines.append(f"{label:{width}}  " + "  ".join(f"{a:8.3f}" for a in row))
    return "\n".join(lines) + f"\nwrote {out}"
