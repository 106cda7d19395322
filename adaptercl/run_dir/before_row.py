"""Row 0 shared between runs: `eval.before_from` names a run whose before-training row this run takes instead of
evaluating the base again.

Row 0 (`stage-00-before`) is the untrained base evaluated on every domain; it depends on the model, its quantization,
the seed (which eval examples are drawn), the domains, the evaluation settings that shape it and the engine that
decodes it (greedy rows can move with the batch a float32 kernel sums over), never on the methods or the stages. So
runs that differ only in how they train (a method sweep on one seed) can evaluate the base once. `before_row_inputs`
is that dependency, written out; a run may take another's row 0 only when the two agree on all of it (checked before
the model loads, one line naming the first field that differs), and the copy says where it came from (done.json
`copied_from`, its `seconds` the source's, `copy_seconds` this run's).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from adaptercl.recipe import RecipeConfig, RecipeError
from adaptercl.run_dir.growth import first_difference
from adaptercl.run_dir.layout import BEFORE_DIR, RunDir, open_run_dir

# rollout fields that only shape sampled rollouts: row 0 is greedy
SAMPLING_ONLY = ("group_size", "temperature", "top_p")
# eval fields that shape row 0 (the rest configure diagnostics measured after a stage)
ROW_FIELDS = ("examples_per_domain", "retention_probes", "choice_scoring", "lm_eval")


def before_row_inputs(recipe: RecipeConfig) -> dict[str, Any]:
    """Everything row 0 depends on (module docstring), as plain data."""
    dump = recipe.model_dump(mode="json")
    rollout = recipe.stages[0].rollout.model_dump(mode="json")  # one engine serves every stage
    return {
        "model": dump["model"],
        "quantization": dump["quantization"],
        "seed": dump["seed"],
        "domains": dump["domains"],
        "eval": {**{k: dump["eval"][k] for k in ROW_FIELDS}, "max_new_tokens": recipe.eval_max_new_tokens},
        "rollout": {k: v for k, v in rollout.items() if k not in SAMPLING_ONLY},
    }


def before_source(recipe: RecipeConfig) -> RunDir | None:
    """The run `eval.before_from` names, checked: it has a finished row 0 measured with everything row 0 depends on
    equal to this recipe's. None when the field is unset. Bad: one RecipeError line."""
    path = recipe.eval.before_from
    if path is None:
        return None
    source = open_run_dir(path, "eval.before_from")
    if not source.before.is_done():
        raise RecipeError(f"eval.before_from: {path!r} has no finished row 0 ({BEFORE_DIR}/done.json); run it first")
    found = first_difference(before_row_inputs(source.recipe), before_row_inputs(recipe))
    if found is not None:
        field, theirs, ours = found
        raise RecipeError(
            f"eval.before_from: {path!r} measured row 0 with {field} = {theirs!r}, this recipe has {ours!r}; a row 0 "
            "is shared only between runs that agree on the model, quantization, seed, domains, the evaluation "
            "settings and the rollout engine (unset eval.before_from to evaluate the base here)"
        )
    return source


def copy_before_row(source: RunDir, run: RunDir) -> None:
    """Copy `source`'s row 0 (eval.json, lm_eval.json when there is one, then done.json, last) into `run`."""
    t0 = time.perf_counter()
    run.before.path.mkdir(parents=True, exist_ok=True)
    src = source.before
    shutil.copyfile(src.eval, run.before.eval)
    if src.lm_eval.is_file():
        shutil.copyfile(src.lm_eval, run.before.lm_eval)
    done = src.read_done()
    copied = {"copied_from": str(Path(source.path)), "copy_seconds": round(time.perf_counter() - t0, 3)}
    run.before.mark_done({**done, **copied})
