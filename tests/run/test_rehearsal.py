"""`adaptercl recipe rehearse` end to end on tiny-random: the real loop of every stage runs, measured, into
rehearsal.json, and nothing is left that `recipe run` would resume; a phase that fails is one line."""

from __future__ import annotations

import json
import tempfile
from importlib.metadata import version

import pytest
import torch
import yaml

import adaptercl.train.stage as stage_module
from adaptercl.cli import main
from adaptercl.plan.rehearsal import measured_wall_time, read_rehearsal, recipe_hash
from adaptercl.recipe.load import load_recipe
from adaptercl.run.phase_meter import DeadlineReached, PhaseMeter
from adaptercl.run.rehearsal import STEPS
from adaptercl.system import phased, watching


def tiny_recipe(tmp_path) -> str:
    raw = {
        "model": {"name": "tiny-random"},
        "output_dir": str(tmp_path / "run"),
        "lora": {"r": 4, "alpha": 8},
        "optim": {"lr": 5e-3, "steps": 5, "prompts_per_step": 2},
        "rollout": {"group_size": 4, "max_new_tokens": 8},
        "eval": {"examples_per_domain": 3, "drift_probes": 2, "stage_kl_prompts": 2},
        "domains": [{"name": "arith", "source": "builtin:arithmetic"}, {"name": "mcq", "source": "builtin:mcq"}],
        "stages": [{"name": "one", "domain": "arith"}, {"name": "two", "domain": "mcq", "adapter": {"init": "new"}}],
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """The temporary folder the rehearsal runs in (tempfile's), to see that it is gone after."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def test_a_rehearsal_runs_every_stage_and_writes_its_figures_and_nothing_to_resume(tmp_path, scratch, capsys):
    recipe_file, out = tiny_recipe(tmp_path), tmp_path / "out"
    assert main(["recipe", "rehearse", recipe_file, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    data = read_rehearsal(out / "rehearsal.json")
    recipe = load_recipe(recipe_file)
    assert data["recipe"] == {
        "file": recipe_file,
        "overrides": [],
        "hash": recipe_hash(recipe),
        "model": "tiny-random",
    }
    assert data["failed"] is None and data["stopped"] is None and data["engine"]["engine"] == "hf"
    assert data["machine"]["label"] and data["versions"]["torch"] == version("torch")
    assert data["rehearsed"]["steps"] == {"one": STEPS, "two": STEPS}
    for name in ("one", "two"):  # every stage: its steps (the first the warm-up), checkpoints, saving, diagnostics
        stage = data["stages"][name]
        assert len(stage["steps"]) == STEPS and all(s["rollout_s"] > 0 and s["train_s"] > 0 for s in stage["steps"])
        assert all(s["sequences"] == 8 and 0 < s["tokens"] <= 8 * 8 for s in stage["steps"])
        assert stage["figures"]["train_step_s"]["n"] == STEPS - 1 and stage["figures"]["rollout_s"]["n"] == STEPS - 1
        assert len(stage["checkpoint_s"]) == 2 and stage["save_s"] > 0  # the stage's first and its trained one
        assert stage["stage_kl"]["prompts"] == 2 and stage["response_drift"]["prompts"] == 2 * 2
        assert stage["parameter_drift"]["seconds"] > 0
        assert {d: e["examples"] for d, e in stage["eval"].items()} == {"arith": 3, "mcq": 3}
    assert {d: e["examples"] for d, e in data["eval_before"].items()} == {"arith": 3, "mcq": 3}
    assert data["eval_sizes"] == {"arith": 3, "mcq": 3} and data["seconds"]["load"] > 0
    for group in ("load", "rollout", "train", "eval", "diagnostics"):
        assert data["memory"][group]["peak_resident_gib"] > 0.1, group
    # nothing to resume: the run went into a temporary folder, gone; only rehearsal.json stays
    assert not (tmp_path / "run").exists() and list(scratch.iterdir()) == []
    assert [p.name for p in out.iterdir()] == ["rehearsal.json"]
    # every term of the estimate is measured, both stages' training and rollouts their own
    wall = measured_wall_time(recipe, data)
    assert all(t.measured for t in wall.terms) and "(as " not in wall.render()
    assert {(t.part, t.stage) for t in wall.terms} >= {(p, s) for p in ("rollout", "train") for s in ("one", "two")}
    # measured beside planned, then the wall time line
    assert "one training step" in printed and "peak memory GiB" in printed
    assert any(line.startswith("wall time measured on ") for line in printed.splitlines())


def test_a_phase_that_runs_out_of_memory_is_one_line_naming_it_and_the_setting(tmp_path, scratch, capsys, monkeypatch):
    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    monkeypatch.setattr(stage_module, "train_on_batch", no_memory)
    recipe_file, out = tiny_recipe(tmp_path), tmp_path / "out"
    assert main(["recipe", "rehearse", recipe_file, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == (
        "error: rehearsal failed in train (stage one: a training step of 8 sequences, micro-batch 8): "
        "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB; to fit, try "
        "stages.one.optim.micro_batch_size=4"
    )
    data = json.loads((out / "rehearsal.json").read_text())
    assert data["failed"]["phase"] == "update" and data["failed"]["line"] in err
    assert data["stages"]["one"]["steps"] == []  # the first rollout ran; its training step failed
    assert not (tmp_path / "run").exists() and list(scratch.iterdir()) == []


def test_the_meter_stops_at_its_deadline_and_keeps_each_span():
    meter = PhaseMeter(cuda=False, deadline_s=3600.0)
    with watching(meter):
        phased("train", lambda: phased("rollout", lambda: None))
        meter.deadline_s = 0.0
        with pytest.raises(DeadlineReached):
            phased("eval", lambda: None)
    memory = meter.close()
    assert [(s.name, s.depth) for s in meter.spans] == [("rollout", 1), ("train", 0)]
    assert meter.stopped == "the time limit came before the next phase (eval)" and meter.failed_in is None
    assert memory["rollout"]["peak_resident_gib"] > 0 and meter.stack == []


def test_the_minutes_count_from_the_command_not_from_a_long_lived_process(monkeypatch):
    from adaptercl.run import rehearsal

    monkeypatch.setattr(rehearsal, "process_age_s", lambda: 2.5)  # a console script: its process began with it
    assert rehearsal.startup_s(0.4) == 2.5  # interpreter and imports count
    monkeypatch.setattr(rehearsal, "process_age_s", lambda: 300.0)  # the tests, a notebook: the process is older
    assert rehearsal.startup_s(0.4) == 0.4  # only the command's own time (it used to be 300 s: no phase would open)
    monkeypatch.setattr(rehearsal, "process_age_s", lambda: None)  # no /proc
    assert rehearsal.startup_s(0.4) == 0.4


# ------------------------------------------------------------------------------------- bad input (issue 45)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--minutes", "0"], "rehearse: --minutes must be a finite number of minutes above 0, got 0"),
        (["--minutes", "-3"], "rehearse: --minutes must be a finite number of minutes above 0, got -3"),
        (["--minutes", "nan"], "got nan"),
        (["--minutes", "inf"], "got inf"),
        (["--out", "FILE"], "--out: 'FILE' is a file, not a folder; choose another --out"),
        (["--out", "FILE/sub"], "--out: 'FILE/sub' lies under 'FILE', which is a file, not a folder"),
    ],
)
def test_a_bad_limit_or_out_is_one_line_before_anything_loads(tmp_path, scratch, capsys, monkeypatch, flags, message):
    from adaptercl.run import rehearsal

    def loads(*args, **kwargs):
        raise AssertionError("the rehearsal started")

    monkeypatch.setattr(rehearsal, "run_recipe", loads)  # the first thing that would load the model
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("mine")
    recipe_file = tiny_recipe(tmp_path)
    assert main(["recipe", "rehearse", recipe_file, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert (tmp_path / "FILE").read_text() == "mine" and not (tmp_path / "run-rehearsal").exists()
    assert list(scratch.iterdir()) == []  # no temporary run folder either
