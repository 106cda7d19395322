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
object, custom tasks' default aggregations) are silenced, and what it records of the machine and lm_eval.json does
not keep is not asked for: the working directory's git hash (`git describe`, which prints "fatal: not a git
repository" outside one) and torch's environment report (~2 s of subprocesses). Metric keys drop lm-eval's
",none" filter suffix (other filters stay as "metric,filter"). lm_eval is imported only here, inside functions, and
so are torch and PEFT: `check_tasks` (recipe validate) loads neither.

`check_tasks` (recipe validate, a run's preflight) finds a task by name in the task YAMLs of include_path and of
lm-eval's tasks folder (a text search, under a second); only a name found in none builds lm-eval's task index, which
parses every YAML (~25 s), before calling it unknown.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import random
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from adaptercl.recipe import LmEvalConfig, RecipeError

if TYPE_CHECKING:
    import torch

INSTALL_HINT = "pip install 'adaptercl[lm-eval]'"
RESULT_KEYS_SKIPPED = ("name", "alias", "sample_len", " ")


def require_lm_eval() -> None:
    """A one-line error when lm-evaluation-harness is not installed."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise RecipeError(f"eval.lm_eval.tasks: needs lm-evaluation-harness; {INSTALL_HINT}") from None


def check_tasks(cfg: LmEvalConfig) -> None:
    """Every configured task is known to lm-eval (with `include_path`): a typo fails before training, not after. A name
    a task YAML gives is known at once; the task index is built only for the others (module docstring)."""
    if cfg.include_path is not None and not Path(cfg.include_path).expanduser().is_dir():
        raise RecipeError(f"eval.lm_eval.include_path: folder {cfg.include_path!r} does not exist")
    require_lm_eval()
    folders = [Path(p).expanduser() for p in [cfg.include_path] if p is not None] + [_lm_eval_tasks_folder()]
    named = _named_in_task_yamls(list(cfg.tasks), folders)
    missing = [t for t in cfg.tasks if t not in named]
    known = set(task_manager(cfg).all_tasks) if missing else set()
    unknown = [t for t in missing if t not in known]
    if unknown:
        where = f" (nor in include_path {cfg.include_path!r})" if cfg.include_path else ""
        raise RecipeError(
            f"eval.lm_eval.tasks: unknown lm-eval task {unknown[0]!r}{where}; `lm_eval ls tasks` lists them, a "
            "custom task YAML goes in eval.lm_eval.include_path"
        )


class _TaskYaml(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # libyaml's parser where PyYAML has it
    """lm-eval's task YAMLs, their tags (`!function utils.process_docs`) read as nothing: only names are wanted."""


_TaskYaml.add_multi_constructor("!", lambda loader, suffix, node: None)


def _lm_eval_tasks_folder() -> Path:
    spec = importlib.util.find_spec("lm_eval")
    return Path(next(iter(spec.submodule_search_locations))) / "tasks"


def _named_in_task_yamls(names: list[str], folders: list[Path]) -> set[str]:
    """Those of `names` that a `*.yaml` under `folders` names as lm-eval's task index reads it: a Python task's
    (`class`) or a task's `task`, a group config's `group`, or one of a task's `tag`s. One pass over the files; only
    those holding a name as a word are parsed."""
    words = {name: re.compile(rf"(?<![\w.-]){re.escape(name)}(?![\w.-])") for name in names}
    found: set[str] = set()
    for path in (p for folder in folders for p in folder.glob("**/*.yaml")):
        text = path.read_text(encoding="utf-8", errors="ignore")
        held = [n for n in names if n not in found and n in text and words[n].search(text)]
        if not held:
            continue
        try:
            cfg = yaml.load(text, Loader=_TaskYaml)  # a SafeLoader that ignores the tags
        except yaml.YAMLError:
            continue
        if isinstance(cfg, dict):
            tags = cfg.get("tag") or []
            named = cfg.get("group") if "group" in cfg and "class" not in cfg else cfg.get("task")
            found |= {n for n in held if n == named or n in ([tags] if isinstance(tags, str) else tags)}
        if found >= set(names):
            break
    return found


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

    from adaptercl.adapters import active_adapters

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
    """lm-eval warns that it got a model object and that custom tasks use default aggregations: expected here. Its
    records of the git hash and of the environment, which lm_eval.json does not keep, are not asked for (module
    docstring): `lm_eval.evaluator`'s two functions are replaced for the call, nothing else."""
    from lm_eval import evaluator

    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(max(level, logging.ERROR))
    unasked = {"get_git_commit_hash": lambda: None, "add_env_info": lambda storage: None}
    saved = {name: getattr(evaluator, name) for name in unasked if hasattr(evaluator, name)}
    for name in saved:
        setattr(evaluator, name, unasked[name])
    try:
        yield
    finally:
        logger.setLevel(level)
        for name, fn in saved.items():
            setattr(evaluator, name, fn)


@contextmanager
def _restored_random_states() -> Iterator[None]:
    """simple_evaluate reseeds Python, NumPy and torch; put their states back afterwards."""
    import numpy as np
    import torch

    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
