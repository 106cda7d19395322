"""Growing a finished run by a stage and a domain (`run_dir/growth.py`): only the new stage trains, the earlier rows
gain the new domain, and the result equals the uninterrupted run; a changed earlier stage is refused naming the
field."""

from __future__ import annotations

import copy
import json
import re
import shutil

import pytest

from adaptercl.recipe.grammar import RecipeError, resolve_recipe
from adaptercl.run.sequence import run_recipe
from adaptercl.run_dir.growth import growth_refusal
from adaptercl.run_dir.layout import RunDir
from adaptercl.system.atomic import write_json

ARITH = {"name": "arith", "source": "builtin:arithmetic", "reward": "tiny_rewards:digit_fraction"}
MCQ = {"name": "mcq", "source": "builtin:mcq", "reward": "tiny_rewards:digit_fraction"}
ONE = {"name": "one", "domain": "arith"}
TWO = {"name": "two", "domain": "mcq", "adapter": {"init": "new"}}


def recipe(out, domains: list[dict], stages: list[dict], **overrides) -> dict:
    raw = {
        "model": {"name": "tiny-random"},
        "output_dir": str(out),
        "lora": {"r": 4, "alpha": 8},
        "optim": {"lr": 5e-3, "steps": 1, "prompts_per_step": 2},
        "rollout": {"group_size": 4, "max_new_tokens": 8},
        "eval": {"examples_per_domain": 4, "drift_probes": 0, "stage_kl_prompts": 0},
        "domains": copy.deepcopy(domains),
        "stages": copy.deepcopy(stages),
    }
    raw.update(overrides)
    return raw


@pytest.fixture(scope="module")
def grown(tmp_path_factory):
    """A one-stage run on arith, moved to another folder (a run is its stages, not its path), then grown there by
    the mcq domain and a stage training it; and the same two stages run uninterrupted in a third folder."""
    first = tmp_path_factory.mktemp("first")
    run_recipe(resolve_recipe(recipe(first, [ARITH], [ONE])))
    out = tmp_path_factory.mktemp("grown") / "moved"
    shutil.move(first, out)
    adapter = (out / "stage-01-one" / "adapter" / "adapter_model.safetensors").read_bytes()
    before_row = json.loads((out / "stage-01-one" / "eval.json").read_text())
    events = []
    on_event = lambda kind, **info: events.append((kind, info.get("stage")))  # noqa: E731
    result = run_recipe(resolve_recipe(recipe(out, [ARITH, MCQ], [ONE, TWO])), on_event=on_event)
    fresh_out = tmp_path_factory.mktemp("fresh")
    fresh = run_recipe(resolve_recipe(recipe(fresh_out, [ARITH, MCQ], [ONE, TWO])))
    return out, adapter, before_row, events, result, fresh


def test_growing_trains_only_the_new_stage(grown):
    out, adapter, before_row, events, result, _ = grown
    assert ("skip", "stage-01-one") in events and ("stage", "stage-02-two") in events
    assert f"output_dir: {out}" in (out / "recipe.resolved.yaml").read_text()  # the moved run, recorded where it is
    assert ("stage", "stage-01-one") not in events
    assert (out / "stage-01-one" / "adapter" / "adapter_model.safetensors").read_bytes() == adapter  # untouched
    assert (out / "stage-02-two" / "done.json").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["domains"] == ["arith", "mcq"] and len(summary["accuracy"]) == 3  # before + 2 stages
    assert summary["stages"] == ["stage-00-before", "stage-01-one", "stage-02-two"]
    assert summary["cl_metrics"]["fwt"] is not None  # the earlier rows hold the new domain: FWT is defined
    row = json.loads((out / "stage-01-one" / "eval.json").read_text())
    assert list(row) == ["arith", "mcq"] and row["arith"] == before_row["arith"]  # completed, not re-evaluated
    assert "mcq" in json.loads((out / "stage-00-before" / "eval.json").read_text())
    assert result.accuracy == summary["accuracy"]


def test_grown_run_equals_the_uninterrupted_run(grown):
    out, _, _, _, result, fresh = grown
    assert result.accuracy == fresh.accuracy  # greedy evaluation, per-stage seeds: the same matrix
    for stage in ("stage-00-before", "stage-01-one", "stage-02-two"):
        grown_row = json.loads((out / stage / "eval.json").read_text())
        fresh_row = json.loads((fresh.run_dir / stage / "eval.json").read_text())
        assert grown_row == fresh_row


def test_rerun_of_the_grown_recipe_is_a_no_op(grown):
    out, *_ = grown
    events = []
    run_recipe(resolve_recipe(recipe(out, [ARITH, MCQ], [ONE, TWO])), on_event=lambda k, **i: events.append(k))
    assert "step" not in events and "eval" not in events


def test_a_tracker_may_be_added_to_a_finished_run_without_retraining(grown):
    out, adapter, *_ = grown
    events = []
    tracked = recipe(out, [ARITH, MCQ], [ONE, TWO], report_to="tensorboard", log={"samples_per_step": 2})
    run_recipe(resolve_recipe(tracked), on_event=lambda k, **i: events.append(k))
    assert "step" not in events and "eval" not in events  # finished: nothing trained or evaluated again
    assert "report_to:\n- tensorboard" in (out / "recipe.resolved.yaml").read_text()  # recorded as the run's recipe
    assert (out / "stage-01-one" / "adapter" / "adapter_model.safetensors").read_bytes() == adapter
    run_recipe(resolve_recipe(recipe(out, [ARITH, MCQ], [ONE, TWO])))  # and taken away again


def test_what_the_run_has_not_started_may_still_change(tmp_path):
    """A failed attempt to grow a run (say, a new domain's reward raised before its stage began) records the grown
    recipe; the corrected recipe is accepted, because nothing was produced for the changed parts yet."""
    RunDir(tmp_path, resolve_recipe(recipe(tmp_path, [ARITH, MCQ], [ONE, TWO]))).claim()
    fixed = resolve_recipe(recipe(tmp_path, [ARITH, {**MCQ, "num_train": 20}], [ONE, {**TWO, "optim": {"lr": 1e-3}}]))
    RunDir(tmp_path, fixed).claim()  # nothing started: accepted, and recorded
    (tmp_path / "stage-00-before").mkdir()
    write_json(tmp_path / "stage-00-before" / "eval.json", {"arith": {}, "mcq": {}})  # both domains evaluated
    (tmp_path / "stage-01-one").mkdir()  # stage 1 started
    changed_domain = resolve_recipe(recipe(tmp_path, [ARITH, MCQ], [ONE, {**TWO, "optim": {"lr": 1e-3}}]))
    with pytest.raises(RecipeError, match=r"domains\.mcq differs .*num_train"):
        RunDir(tmp_path, changed_domain).claim()
    changed_stage = resolve_recipe(
        recipe(tmp_path, [ARITH, {**MCQ, "num_train": 20}], [{**ONE, "optim": {"lr": 1e-4}}, TWO])
    )
    with pytest.raises(RecipeError, match=r"stage 1 'one' differs from the run's: optim\.lr"):
        RunDir(tmp_path, changed_stage).claim()
    RunDir(tmp_path, resolve_recipe(recipe(tmp_path, [ARITH, {**MCQ, "num_train": 20}], [ONE, TWO]))).claim()


def test_a_changed_earlier_stage_is_refused_naming_the_field(grown):
    out, *_ = grown
    changed = recipe(out, [ARITH, MCQ], [{**ONE, "optim": {"lr": 1e-4}}, TWO])
    with pytest.raises(RecipeError, match=r"stage 1 'one' differs from the run's: optim\.lr 0\.0001 here vs 0\.005"):
        run_recipe(resolve_recipe(changed))
    with pytest.raises(RecipeError, match="the run has 2 stages"):  # shrinking is not growing
        run_recipe(resolve_recipe(recipe(out, [ARITH, MCQ], [ONE])))


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda r: r.update(seed=3), r"seed 3 here vs 0 in the run"),
        (lambda r: r["domains"].reverse(), r"domains: item 1 is 'mcq' here but 'arith' in the run"),
        (lambda r: r["domains"][0].update(num_train=20), r"domains\.arith differs .*num_train 20 here"),
        (lambda r: r["eval"].update(examples_per_domain=5), r"eval\.examples_per_domain 5 here vs 4"),
        (lambda r: r["stages"][1].update(domain="arith"), r"stage 2 'two' differs .*domain 'arith' here vs 'mcq'"),
    ],
)
def test_growth_refusal_names_what_differs(tmp_path, change, named):
    run = resolve_recipe(recipe(tmp_path, [ARITH, MCQ], [ONE, TWO]))
    raw = recipe(tmp_path, [ARITH, MCQ], [ONE, TWO])
    change(raw)
    assert re.search(named, growth_refusal(run, resolve_recipe(raw)))


def test_a_removed_domain_is_refused(tmp_path):
    run = resolve_recipe(recipe(tmp_path, [ARITH, MCQ], [ONE]))
    assert "domains: the run's mcq is missing" in growth_refusal(run, resolve_recipe(recipe(tmp_path, [ARITH], [ONE])))


def test_appended_stage_and_domain_and_probe_are_growth(tmp_path):
    run = resolve_recipe(recipe(tmp_path, [ARITH], [ONE]))
    grown = recipe(tmp_path, [ARITH, MCQ], [ONE, TWO])
    grown["eval"]["retention_probes"] = []
    assert growth_refusal(run, resolve_recipe(grown)) is None
    assert growth_refusal(run, run) is None
