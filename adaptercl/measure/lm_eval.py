"""lm-evaluation-harness as a retention-probe backend: its tasks scored on the model after every stage.

    eval:
      lm_eval:
        tasks: [arc_easy, boolq]      # lm-eval task or group names, or custom tasks from include_path
        limit: 200                    # items per task (lm-eval's --limit); default all

After each stage (and before training) `lm_eval_probes` runs `lm_eval.simple_evaluate` on the live model with that
stage's adapters active, the same model the accuracy matrix evaluates (its ΔW is the stage's combined_adapter/), and
the stage directory keeps the result as lm_eval.json: per task lm-eval's own metrics, e.g. log-likelihood `acc` and
`acc_norm` with their standard errors, so the numbers are comparable with published lm-eval results (unlike the
generated-letter domain probes of `domains/datasets_formats.py`). `adaptercl eval` writes the same file.

Departures from the `lm_eval` command line: the model is lm-eval's HFLM wrapped around the already loaded PeftModel
(no reload, a quantised base stays quantised), and the global random states that simple_evaluate reseeds are
restored afterwards so a run's later stages do not depend on whether probes ran; its expected warnings (a model
object, custom tasks' default aggregations) are silenced. Metric keys drop lm-eval's
",none" filter suffix (other filters stay as "metric,filter"). lm_eval is imported only here, inside functions.
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from adaptercl.adapters import active_adapters
from adaptercl.recipe import LmEvalConfig, RecipeError

INSTALL_HINT = "pip install 'adaptercl[lm-eval]'"
RESULT_KEYS_SKIPPED = ("name", "alias", "sample_len", " ")


def require_lm_eval() -> None:
    """A one-line error when lm-evaluation-harness is not installed."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise RecipeError(f"eval.lm_eval.tasks: needs lm-evaluation-harness; {INSTALL_HINT}") from None


def check_tasks(cfg: LmEvalConfig) -> None:
    """Every configured task is known to lm-eval (with `include_path`): a typo fails before training, not after."""
    if cfg.include_path is not None and not Path(cfg.include_path).expanduser().is_dir():
        raise RecipeError(f"eval.lm_eval.include_path: folder {cfg.include_path!r} does not exist")
    require_lm_eval()
    known = set(task_manager(cfg).all_tasks) if cfg.tasks else set()
    unknown = [t for t in cfg.tasks if t not in known]
    if unknown:
        where = f" (nor in include_path {cfg.include_path!r})" if cfg.include_path else ""
        raise RecipeError(
            f"eval.lm_eval.tasks: unknown lm-eval task {unknown[0]!r}{where}; `lm_eval ls tasks` lists them, a "
            "custom task YAML goes in eval.lm_eval.include_path"
        )


def task_manager(cfg: LmEvalConfig) -> Any:
    """lm-eval's task index with `include_path`; built once per process (it reads thousands of YAML files)."""
    return _task_manager(cfg.include_path)


@functools.lru_cache(maxsize=4)
def _task_manager(include_path: str | None) -> Any:
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path)


def lm_eval_probes(model: torch.nn.Module, tokenizer: Any, adapters: list[str] | None, cfg: LmEvalConfig) -> dict:
    """Run `cfg.tasks` with lm-eval on `model` with exactly `adapters` active (None: the base); return lm_eval.json:
    {"tasks": {task: {metric: value, ..., "n": items}}, "lm_eval_version", "num_fewshot", "limit"}."""
    require_lm_eval()
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    was_training = model.training
    try:
        with active_adapters(model, adapters), _restored_random_states(), _quiet_lm_eval():
            lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=cfg.batch_size)
            out = lm_eval.simple_evaluate(
                model=lm,
                tasks=list(cfg.tasks),
                num_fewshot=cfg.num_fewshot,
                limit=cfg.limit,
                task_manager=task_manager(cfg),
                log_samples=False,
                random_seed=cfg.seed,
                numpy_random_seed=cfg.seed,
                torch_random_seed=cfg.seed,
                fewshot_random_seed=cfg.seed,
            )
    finally:
        model.train(was_training)  # HFLM puts the model in eval mode
    counts = out.get("n-samples", {})
    tasks = {}
    for task, metrics in out["results"].items():
        row = {_metric_name(k): v for k, v in metrics.items() if k not in RESULT_KEYS_SKIPPED and v != "N/A"}
        if task in counts:
            row["n"] = counts[task]["effective"]
        tasks[task] = row
    return {"tasks": tasks, "lm_eval_version": lm_eval.__version__, "num_fewshot": cfg.num_fewshot, "limit": cfg.limit}


def _metric_name(key: str) -> str:
    return key.removesuffix(",none")


@contextmanager
def _quiet_lm_eval() -> Iterator[None]:
    """lm-eval warns that it got a model object and that custom tasks use default aggregations: expected here."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        logger.setLevel(level)


@contextmanager
def _restored_random_states() -> Iterator[None]:
    """simple_evaluate reseeds Python, NumPy and torch; put their states back afterwards."""
    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
