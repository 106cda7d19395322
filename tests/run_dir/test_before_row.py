"""Row 0 shared between runs (`run_dir/before_row.py`, eval.before_from): a run of another method on the same base,
seed and evaluation copies the source's row 0 byte for byte and says so; a run that differs in anything row 0 depends
on is refused in one line naming the field, before anything is written."""

from __future__ import annotations

import copy
import json
import re

import pytest

from adaptercl.recipe import RecipeError
from adaptercl.recipe.grammar import resolve_recipe
from adaptercl.run.sequence import run_recipe
from adaptercl.run_dir.before_row import before_row_inputs
from adaptercl.run_dir.growth import first_difference


def recipe(out, method="grpo", **top) -> dict:
    raw = {
        "model": {"name": "tiny-random"},
        "output_dir": str(out),
        "lora": {"r": 4, "alpha": 8},
        "optim": {"lr": 1e-3, "steps": 1, "prompts_per_step": 2},
        "rollout": {"group_size": 2, "max_new_tokens": 4},
        "eval": {"examples_per_domain": 3, "drift_probes": 0, "teacher_lift_prompts": 0, "stage_kl_prompts": 0},
        "domains": [{"name": "copy", "source": "builtin:copy"}],
        "stages": [{"name": "one", "domain": "copy", "method": method}],
    }
    raw.update(top)
    return raw


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    out = tmp_path_factory.mktemp("source") / "run"
    run_recipe(resolve_recipe(recipe(out)))
    return out


def test_a_run_of_another_method_copies_row_0(tmp_path, source):
    raw = recipe(tmp_path / "sdpo", method="sdpo")
    raw["eval"]["before_from"] = str(source)
    raw["rollout"]["temperature"] = 0.7  # sampling only: row 0 is greedy
    result = run_recipe(resolve_recipe(raw))
    before = tmp_path / "sdpo" / "stage-00-before"
    assert (before / "eval.json").read_bytes() == (source / "stage-00-before" / "eval.json").read_bytes()
    done = json.loads((before / "done.json").read_text())
    assert (
        done["copied_from"] == str(source)
        and done["seconds"] == json.loads((source / "stage-00-before" / "done.json").read_text())["seconds"]
    )
    summary = json.loads((source / "summary.json").read_text())
    assert result.accuracy[0] == summary["accuracy"][0]
    assert (tmp_path / "sdpo" / "stage-01-one" / "done.json").is_file()  # and the stage trained as usual


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda r: r.update(seed=1), "seed"),
        (lambda r: r["eval"].update(examples_per_domain=4), "eval.examples_per_domain"),
        (lambda r: r["eval"].update(max_new_tokens=5), "eval.max_new_tokens"),
        (lambda r: r["rollout"].update(batch_size=8), "rollout.batch_size"),
        (lambda r: r["domains"][0].update(num_train=5), "domains[0].num_train"),
    ],
)
def test_a_run_that_differs_in_what_row_0_depends_on_is_refused(tmp_path, source, change, field):
    raw = recipe(tmp_path / "other")
    change(raw)
    raw["eval"]["before_from"] = str(source)
    with pytest.raises(RecipeError, match=r"^eval\.before_from: .* measured row 0 with " + re.escape(field) + " ="):
        run_recipe(resolve_recipe(raw))
    assert not (tmp_path / "other").exists()  # refused before anything was written


def test_a_source_without_a_finished_row_0_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    raw = recipe(tmp_path / "other")
    raw["eval"]["before_from"] = str(tmp_path / "empty")
    with pytest.raises(RecipeError, match="^eval.before_from: .* is not a run directory"):
        run_recipe(resolve_recipe(raw))


def test_first_difference_names_the_path():
    a = {"eval": {"n": 1, "probes": ["x", "y"]}, "seed": 0}
    b = copy.deepcopy(a)
    assert first_difference(a, b) is None
    b["eval"]["probes"][1] = "z"
    assert first_difference(a, b) == ("eval.probes[1]", "y", "z")
    b = {**a, "model": "m"}
    assert first_difference(a, b) == ("model", None, "m")


def test_the_inputs_leave_out_training_and_sampling():
    base = resolve_recipe(recipe("/tmp/x"))
    other = resolve_recipe(
        recipe("/tmp/y", method="sdpo", optim={"lr": 5e-2, "steps": 3, "prompts_per_step": 2})
        | {"rollout": {"group_size": 4, "max_new_tokens": 4, "temperature": 0.5}}
    )
    assert before_row_inputs(base) == before_row_inputs(other)
