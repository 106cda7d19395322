"""The documented Python API (README "Python API"): load a recipe file, run it, export it, through `adaptercl.*`."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version

import yaml

import adaptercl
from tests.run.test_run import tiny_recipe


def test_load_run_and_export_through_the_package_names(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(tmp_path / "run")))
    recipe = adaptercl.load_recipe(path, ["optim.steps=1"])
    assert isinstance(recipe, adaptercl.RecipeConfig) and recipe.stages[0].optim.steps == 1
    result = adaptercl.run_recipe(recipe)
    assert isinstance(result, adaptercl.RunResult)
    assert result.domains == ["arith", "mcq"] and len(result.accuracy) == 3  # before + two stages
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert result.accuracy == summary["accuracy"]
    out = adaptercl.export_run(result.run_dir, tmp_path / "shipped")
    manifest = json.loads((out / "manifest.json").read_text())
    assert {"arith", "mcq"} <= {entry["name"] for entry in manifest["adapters"]}


def test_a_bad_recipe_raises_the_exported_error_naming_the_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(tmp_path / "run", optim={"lr": -1.0})))
    try:
        adaptercl.load_recipe(path)
    except adaptercl.RecipeError as err:
        assert "lr" in str(err)
    else:
        raise AssertionError("a negative learning rate was accepted")


def test_version_is_the_installed_distributions_and_import_loads_no_torch():
    assert adaptercl.__version__ == version("adaptercl")
    code = "import sys, adaptercl; adaptercl.load_recipe; print('torch' in sys.modules, adaptercl.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", version("adaptercl")]


def test_every_name_in_all_resolves():
    assert all(getattr(adaptercl, name) is not None for name in adaptercl.__all__)
