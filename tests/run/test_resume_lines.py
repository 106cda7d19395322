"""A resume says what it does (issue 47): one line per resumed stage, `resuming at step N (checkpoint of step N-1)`
or `starting over: no checkpoint yet (...)`, said through the run's `note` event; `monitor.checkpoint_every` above a
stage's steps is capped to them, which `recipe validate` says in one line."""

from __future__ import annotations

import pytest
import yaml

from adaptercl.cli import main
from adaptercl.recipe.grammar import resolve_recipe
from adaptercl.run.sequence import run_recipe
from adaptercl.system.atomic import read_jsonl
from adaptercl.train.checkpoint import resume_line
from tests.run.test_run import tiny_recipe


@pytest.mark.parametrize(
    ("state", "done", "line"),
    [
        ({"next_step": 0}, 3, "starting over: no checkpoint yet (checkpoint_every 10, 3 steps were done)"),
        ({"next_step": 0}, 1, "starting over: no checkpoint yet (checkpoint_every 10, 1 step was done)"),
        ({"next_step": 20}, 20, "resuming at step 21 (checkpoint of step 20)"),
        ({"next_step": 20}, 21, "resuming at step 21 (checkpoint of step 20; the step done after it runs again)"),
        ({"next_step": 20}, 23, "resuming at step 21 (checkpoint of step 20; the 3 steps done after it run again)"),
        (
            {"next_step": 5, "trained": True},
            5,
            "resuming after its last step (checkpoint of step 5): no step runs again",
        ),
    ],
)
def test_the_resume_line_says_where_the_stage_resumes(state, done, line):
    assert resume_line(state, done, 10) == line


def one_stage(out, steps: int, monitor: dict | None = None) -> dict:
    raw = tiny_recipe(out, stages=[{"name": "one", "domain": "arith"}])
    raw["domains"], raw["optim"] = raw["domains"][:1], {**raw["optim"], "steps": steps}
    raw["eval"] = {"examples_per_domain": 2, "drift_probes": 1, "stage_kl_prompts": 1}
    return {**raw, "monitor": monitor} if monitor else raw


def killed_then_resumed(out, raw: dict, kill_in_step: int, monkeypatch) -> list[str]:
    """Run `raw`, killed in step `kill_in_step` (its training step raises), then rerun it to the end; return the
    notes the rerun said."""
    from adaptercl.train import stage as stage_module

    calls, original = [], stage_module.train_on_batch

    def killed(*args, **kwargs):
        calls.append(1)
        if len(calls) == kill_in_step:
            raise RuntimeError("killed")
        return original(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(stage_module, "train_on_batch", killed)
        with pytest.raises(RuntimeError, match="killed"):
            run_recipe(resolve_recipe(raw))
    notes = []
    run_recipe(resolve_recipe(raw), on_event=lambda kind, **i: notes.append(i["line"]) if kind == "note" else None)
    steps = [r["step"] for r in read_jsonl(out / "stage-01-one" / "metrics.jsonl") if "event" not in r]
    assert steps == list(range(1, raw["optim"]["steps"] + 1))  # every step once, whatever was lost
    return notes


def test_a_stage_killed_after_its_checkpoint_resumes_there_and_says_so(tmp_path, monkeypatch):
    raw = one_stage(tmp_path / "run", steps=4, monitor={"checkpoint_every": 2})
    notes = killed_then_resumed(tmp_path / "run", raw, kill_in_step=4, monkeypatch=monkeypatch)
    assert notes == ["resuming at step 3 (checkpoint of step 2; the step done after it runs again)"]


def test_a_short_stage_is_capped_at_validation_and_a_kill_starts_it_over_saying_so(tmp_path, monkeypatch, capsys):
    """The issue's case: checkpoint_every 10 (the default) on a 3-step stage killed in its third step."""
    raw = one_stage(tmp_path / "run", steps=3)
    assert resolve_recipe(raw).stages[0].monitor.checkpoint_every == 3
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(raw))
    assert main(["recipe", "validate", str(tmp_path / "recipe.yaml")]) == 0
    assert (
        "  stages.one.monitor.checkpoint_every: 10 is more than the stage's 3 steps; capped to 3 (a checkpoint at the "
        "stage's end only: a kill before it starts the stage over)\n"
    ) in capsys.readouterr().out
    notes = killed_then_resumed(tmp_path / "run", raw, kill_in_step=3, monkeypatch=monkeypatch)
    assert notes == ["starting over: no checkpoint yet (checkpoint_every 3, 2 steps were done)"]
