"""`rollout.group_size` against what the method learns from (`METHODS[...].needs_siblings`, beside sdft's
`one_sample_per_prompt`): a method whose whole signal comes from a prompt's other samples is refused a group of one
at validation, in one line, instead of spending its budget training nothing."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import yaml

from adaptercl.cli import main
from adaptercl.recipe import METHODS
from adaptercl.recipe.grammar import RecipeError, resolve_recipe

RAW = {
    "model": {"name": "tiny-random"},
    "output_dir": "runs/x",
    "optim": {"steps": 3},
    "domains": [{"name": "arith", "source": "builtin:arithmetic"}],
    "stages": [{"name": "a", "domain": "arith"}],
}


def with_stage(method: str, group_size: int) -> dict:
    raw = copy.deepcopy(RAW)
    raw["stages"][0].update(method=method, rollout={"group_size": group_size})
    return raw


@pytest.mark.parametrize("method", ["grpo", "srpo"])
def test_a_method_that_learns_from_siblings_is_refused_a_group_of_one_in_one_line(method, tmp_path, capsys):
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(with_stage(method, 1)))
    assert main(["recipe", "validate", str(recipe_file)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err == (
        f"error: stages.a: {method} learns nothing from one response per prompt ({METHODS[method].needs_siblings}): "
        "set rollout.group_size to 2 or more for this stage (default 8)\n"
    )
    assert resolve_recipe(with_stage(method, 2)).stages[0].rollout.group_size == 2  # two is a group


def test_a_group_of_one_is_refused_exactly_where_the_method_learns_only_from_siblings():
    # sdpo keeps the reward's feedback, the hybrid the example's demonstration (its policy term is then 0); sdft
    # samples one response per prompt anyway
    refused = set()
    for method in METHODS:
        try:
            resolve_recipe(with_stage(method, 1))
        except RecipeError:
            refused.add(method)
    assert refused == {"grpo", "srpo"}


def test_the_rule_is_read_from_the_method_table(monkeypatch):
    monkeypatch.setitem(METHODS, "sdpo", dataclasses.replace(METHODS["sdpo"], needs_siblings="no feedback here"))
    with pytest.raises(
        RecipeError, match=r"stages\.a: sdpo learns nothing from one response per prompt \(no feedback"
    ):
        resolve_recipe(with_stage("sdpo", 1))
    monkeypatch.setitem(METHODS, "grpo", dataclasses.replace(METHODS["grpo"], needs_siblings=None))
    assert resolve_recipe(with_stage("grpo", 1)).stages[0].rollout.group_size == 1
