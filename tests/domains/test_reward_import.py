"""User reward modules (`pkg.module:function`) are imported from the recipe file's folder, then the working
directory, then Python's path (`DomainConfig.import_dirs`, `rewards.resolve_reward`), under the console script too."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from adaptercl.domains.loading import check_domain
from adaptercl.domains.trl_rewards import TrlRewards
from adaptercl.recipe import RecipeError, load_recipe

TRL_STYLE = """
def letter_accuracy(completions, answer, **kwargs):
    return [float(SOURCE == "{source}") for _ in completions]

SOURCE = "{source}"
"""
NATIVE = """
from adaptercl.domains.domain import RewardResult

def native_score(text, example):
    return RewardResult(1.0, True)
"""


def write_recipe(folder: Path, module: str, name: str = "recipe.yaml") -> Path:
    """A tiny recipe whose mcq domain is scored by `module:letter_accuracy` (TRL-style), arith by
    `module:native_score` (native)."""
    raw = {
        "model": {"name": "tiny-random"},
        "output_dir": str(folder / "run"),
        "domains": [
            {"name": "mcq", "source": "builtin:mcq", "reward_funcs": [f"{module}:letter_accuracy"]},
            {"name": "arith", "source": "builtin:arithmetic", "reward": f"{module}:native_score"},
        ],
        "stages": [{"name": "one", "domain": "mcq", "steps": 1}],
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(yaml.safe_dump(raw))
    return folder / name


def write_module(folder: Path, module: str, source: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{module}.py").write_text(TRL_STYLE.format(source=source) + NATIVE)


@pytest.fixture
def fresh_module(request):
    """A module name no other test imported (Python caches a module by name), dropped from the cache afterwards."""
    name = "rewards_" + re.sub(r"\W+", "_", request.node.name)
    yield name
    sys.modules.pop(name, None)


def test_validate_imports_rewards_beside_the_recipe_through_the_console_script(tmp_path, fresh_module):
    recipe = write_recipe(tmp_path / "project" / "recipes", fresh_module)
    write_module(recipe.parent, fresh_module, "recipe folder")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = Path(sys.executable).with_name("adaptercl")  # the console script: its sys.path has neither folder
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [str(script), "recipe", "validate", str(recipe)], cwd=elsewhere, capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert "mcq: correct = letter_accuracy >= 1.0" in proc.stdout
    assert f"arith: correct = the {fresh_module}:native_score reward's own verdict" in proc.stdout


def test_the_recipe_folder_comes_before_the_working_directory(tmp_path, monkeypatch, fresh_module):
    recipe = write_recipe(tmp_path / "recipes", fresh_module)
    write_module(recipe.parent, fresh_module, "recipe folder")
    write_module(tmp_path / "cwd", fresh_module, "working directory")
    monkeypatch.chdir(tmp_path / "cwd")
    path_before = list(sys.path)
    trl, _ = check_domain(load_recipe(recipe).domains[0])
    assert isinstance(trl, TrlRewards) and trl.funcs[0].__module__ == fresh_module
    assert sys.modules[fresh_module].SOURCE == "recipe folder"
    assert sys.path == path_before  # the folders were on it while importing only


def test_the_working_directory_is_searched_when_the_recipe_folder_lacks_the_module(
    tmp_path, monkeypatch, fresh_module
):
    recipe = write_recipe(tmp_path / "recipes", fresh_module)
    write_module(tmp_path / "cwd", fresh_module, "working directory")
    monkeypatch.chdir(tmp_path / "cwd")
    native, _ = check_domain(load_recipe(recipe).domains[1])
    assert native.__name__ == "native_score" and sys.modules[fresh_module].SOURCE == "working directory"


def test_a_missing_module_is_one_line_naming_where_it_was_looked_for(tmp_path, monkeypatch, fresh_module):
    recipe = write_recipe(tmp_path / "recipes", fresh_module)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError) as err:
        check_domain(load_recipe(recipe).domains[0])
    message = str(err.value)
    assert message.startswith(f"domains.mcq.reward_funcs[0] '{fresh_module}:letter_accuracy': cannot import module")
    assert message.endswith(f"; looked in {tmp_path / 'recipes'}, {os.getcwd()} and Python's path")
    assert "\n" not in message


@pytest.mark.parametrize(
    "body, why",
    [
        ("raise RuntimeError('no key set')", "RuntimeError: no key set"),
        ("import no_such_dependency_adaptercl", "No module named 'no_such_dependency_adaptercl'"),
    ],
)
def test_a_module_that_fails_while_importing_is_one_line(tmp_path, fresh_module, body, why):
    recipe = write_recipe(tmp_path, fresh_module)
    (tmp_path / f"{fresh_module}.py").write_text(body + "\n")
    with pytest.raises(RecipeError) as err:
        check_domain(load_recipe(recipe).domains[1])
    assert (
        str(err.value)
        == f"domains.arith.reward '{fresh_module}:native_score': importing module {fresh_module!r} failed: {why}"
    )
