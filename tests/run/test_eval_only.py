"""`adaptercl eval` (run/eval_only.py): a finished run's rows reproduced exactly, exported adapter folders evaluated,
and bad input answered in one line."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from adaptercl.cli import main
from adaptercl.recipe.grammar import resolve_recipe
from adaptercl.run.sequence import run_recipe
from adaptercl.ship.export import export_run
from tests.run_dir.test_grow_run import ARITH, MCQ, ONE, TWO, recipe


def tiny_recipe(out) -> dict:
    """Two stages, the second a new adapter stacked on the first (the model is both adapters)."""
    return recipe(out, [ARITH, MCQ], [ONE, TWO])


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    run_recipe(resolve_recipe(tiny_recipe(out)))
    return out


def test_eval_of_a_finished_run_reproduces_its_rows(finished, tmp_path, capsys):
    assert main(["eval", "--run", str(finished), "--out", str(tmp_path / "ev")]) == 0
    summary = json.loads((tmp_path / "ev" / "summary.json").read_text())
    run_summary = json.loads((finished / "summary.json").read_text())
    assert summary["models"] == run_summary["stages"] and summary["domains"] == ["arith", "mcq"]
    assert summary["accuracy"] == run_summary["accuracy"]
    for label in summary["models"]:  # the whole row: accuracy, reward, n, the greedy sample completions
        assert json.loads((tmp_path / "ev" / label / "eval.json").read_text()) == json.loads(
            (finished / label / "eval.json").read_text()
        )
    assert summary["adapters"]["stage-02-two"] == [
        str(finished / "stage-01-one" / "adapter"),
        str(finished / "stage-02-two" / "adapter"),
    ]
    assert "stage-02-two" in capsys.readouterr().out


def test_eval_of_exported_adapter_folders_writes_rows(finished, tmp_path):
    export_run(finished, tmp_path / "export", merged=True)
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(tiny_recipe(tmp_path / "unused")))
    folders = [str(tmp_path / "export" / "combined"), str(tmp_path / "export" / "arith")]
    args = ["eval", str(recipe_file), "eval.examples_per_domain=2"]
    assert main([*args, "--adapter", folders[0], "--adapter", folders[1], "--out", str(tmp_path / "ev")]) == 0
    summary = json.loads((tmp_path / "ev" / "summary.json").read_text())
    assert summary["models"] == ["combined", "arith"] and summary["adapter_dirs"] == folders
    for label in ("combined", "arith"):
        row = json.loads((tmp_path / "ev" / label / "eval.json").read_text())
        assert list(row) == ["arith", "mcq"] and all(row[d]["n"] == 2 for d in row)
        assert [row[d]["accuracy"] for d in row] == summary["accuracy"][summary["models"].index(label)]


def test_bad_input_is_one_line(finished, tmp_path, capsys):
    def error(argv: list[str]) -> str:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: eval")
        return err

    out = ["--out", str(tmp_path / "ev")]
    assert "is not a run directory" in error(["eval", "--run", str(tmp_path / "missing"), *out])
    unfinished = tmp_path / "unfinished"
    shutil.copytree(finished, unfinished)
    (unfinished / "stage-02-two" / "done.json").unlink()
    assert "is unfinished (stage-02-two has no done.json)" in error(["eval", "--run", str(unfinished), *out])
    empty = tmp_path / "not-an-adapter"
    empty.mkdir()
    recipe_file = finished / "recipe.resolved.yaml"
    assert "has no adapter_config.json" in error(["eval", str(recipe_file), "--adapter", str(empty), *out])
    assert "does not exist" in error(["eval", str(recipe_file), "--adapter", str(tmp_path / "nope"), *out])
    (tmp_path / "ev").mkdir()
    (tmp_path / "ev" / "x").write_text("")
    assert "exists and is not empty" in error(["eval", "--run", str(finished), *out])
    assert "name a recipe" in error(["eval", "--adapter", str(empty), *out])
    # issue 45: an --out under a file (was a traceback after every evaluation), an adapter whose weights a copy cut
    # short (was a traceback once the base had loaded)
    (tmp_path / "file").write_text("mine")
    assert "lies under" in error(["eval", "--run", str(finished), "--out", str(tmp_path / "file" / "x")])
    cut = tmp_path / "cut"
    shutil.copytree(finished / "stage-01-one" / "adapter", cut)
    (cut / "adapter_model.safetensors").write_bytes((cut / "adapter_model.safetensors").read_bytes()[:100])
    assert main(["eval", str(recipe_file), "--adapter", str(cut), "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {cut / 'adapter_model.safetensors'} is damaged (") and err.count("\n") == 1
    other = tiny_recipe(tmp_path)
    other["model"]["dtype"] = "bfloat16"
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(other))
    assert "model" in error(
        ["eval", str(tmp_path / "other.yaml"), "--run", str(finished), "--out", str(tmp_path / "o")]
    )
    assert not (tmp_path / "o").exists()  # nothing half-written
