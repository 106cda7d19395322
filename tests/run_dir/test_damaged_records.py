"""A run-directory record that does not parse (empty, as a copy onto a full disk leaves it; cut short; a web page; a
list; edited) gets one rule in every command: one line naming the file and what to delete to redo it, exit 2, no
traceback, and `recipe run` never takes an unparsable done.json for a finished stage (`system.read_record`, read
through `run_dir.layout`'s `read_*`)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from adaptercl.cli import main
from adaptercl.recipe.grammar import resolve_recipe
from adaptercl.run.sequence import run_recipe
from adaptercl.ship.export import export_run
from tests.run.test_run import tiny_recipe

LATER = " (and any later stage's folder: each trained on it)"
STAGE_FIX = "delete the folder {stage} to redo the stage" + LATER
OPTIONAL_FIX = "delete it, or the folder {stage} to redo the stage" + LATER
SUMMARY_FIX = "delete it; `adaptercl recipe run` with the run's recipe writes it again from the stages' records"
RECIPE_FIX = "delete it; `adaptercl recipe run` with the run's recipe writes it again"


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "run"
    run_recipe(resolve_recipe(tiny_recipe(out)))
    return out


def commands(run: Path, tmp_path: Path) -> dict[str, list[str]]:
    """Every command that reads a run directory, as a user types it (`recipe run` with the run's recipe)."""
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(tiny_recipe(run)))
    return {
        "run": ["recipe", "run", str(recipe_file)],
        "export": ["export", str(run), "--out", str(tmp_path / "export")],
        "eval": ["eval", "--run", str(run), "--out", str(tmp_path / "eval")],
        "report": ["report", str(run)],
    }


def the_one_line(capsys) -> str:
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0].removeprefix("error: ")


DONE = "stage-02-two/done.json"
DAMAGED = {  # what a damaged record holds -> the reason the line gives
    "": "is not valid JSON (empty)",
    '{"adapters": ["stage-01-one", "stage-0': "is not valid JSON (Unterminated string starting at: line 1 column 31)",
    "<!DOCTYPE html><html>": "is not valid JSON (an HTML or XML page)",
    "[]": "is not valid JSON (a list, not a mapping)",
    "{}": "has no 'adapters' (edited or cut short?)",
}


@pytest.mark.parametrize("text", list(DAMAGED), ids=["empty", "cut", "html", "list", "edited"])
def test_a_damaged_done_json_is_named_by_every_command_and_never_taken_as_done(finished, tmp_path, capsys, text):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    (run / DONE).write_text(text)
    line = f"{run / DONE} {DAMAGED[text]}: " + STAGE_FIX.format(stage=run / "stage-02-two")
    for name, argv in commands(run, tmp_path).items():
        if name == "report":  # the report reads summary.json, not done.json: it stands
            continue
        assert main(argv) == 2, name  # `recipe run` returned 0 here, the stage skipped as done
        assert the_one_line(capsys).endswith(line), name
    assert not (tmp_path / "export").exists() and not (tmp_path / "eval").exists()


@pytest.mark.parametrize(
    "record, text, readers, fix",
    [
        ("summary.json", '{"domains": ["arith", "mcq"], "acc', ("run", "export", "eval", "report"), SUMMARY_FIX),
        ("recipe.resolved.yaml", "", ("run", "export", "eval"), RECIPE_FIX),
        ("stage-01-one/adapter/adapter_config.json", "<html>", ("export", "eval"), STAGE_FIX),
        ("stage-02-two/combined_adapter/adapter_config.json", "", ("export", "eval"), STAGE_FIX),
        ("stage-01-one/drift.json", "{", ("report",), OPTIONAL_FIX),
        ("stage-01-one/teacher_lift.json", "\x00\x01", ("report",), OPTIONAL_FIX),
        ("stage-00-before/lm_eval.json", "[1, 2]", ("report",), OPTIONAL_FIX),
    ],
)
def test_every_record_that_does_not_parse_is_named_in_one_line(finished, tmp_path, capsys, record, text, readers, fix):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    (run / record).write_text(text)
    stage = run / Path(record).parts[0]
    for name in readers:
        assert main(commands(run, tmp_path)[name]) == 2, name
        line = the_one_line(capsys)
        assert line.startswith(f"{run / record} is not valid "), (name, line)
        assert line.endswith(": " + fix.format(stage=stage)), (name, line)


@pytest.mark.parametrize(
    "record, damage",
    [
        ("stage-01-one/eval.json", lambda path: path.write_text('{"arith": {"accuracy": 0.5')),
        ("stage-01-one/adapter/adapter_config.json", lambda path: path.write_text("")),
    ],
)
def test_a_resumed_run_names_a_finished_stage_record_that_does_not_parse(finished, tmp_path, capsys, record, damage):
    # summary.json removed: the run resumes, reloads its finished stages and reads their records
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    (run / "summary.json").unlink()
    damage(run / record)
    assert main(commands(run, tmp_path)["run"]) == 2
    line = the_one_line(capsys)
    assert line.startswith(f"{run / record} is not valid JSON (") and line.endswith(
        STAGE_FIX.format(stage=run / "stage-01-one")
    )


def test_a_damaged_manifest_is_named_by_serve(finished, tmp_path, capsys):
    export_run(finished, tmp_path / "export")
    manifest: Callable[[], Path] = lambda: tmp_path / "export" / "manifest.json"  # noqa: E731
    manifest().write_text("")
    assert main(["serve", str(tmp_path / "export"), "--print-command"]) == 2
    assert the_one_line(capsys) == (
        f"{manifest()} is not valid JSON (empty): export the run again into a new folder "
        "(`adaptercl export RUN_DIR --out DIR`)"
    )
