"""Collapse guard rollbacks, exact kill-and-resume, and the run report, on tiny-random."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from adaptercl.adapters.live import adapter_state
from adaptercl.measure.report import PLOTS, write_report
from adaptercl.recipe.grammar import resolve_recipe
from adaptercl.run.sequence import run_recipe
from adaptercl.system.atomic import read_jsonl
from adaptercl.train import stage as stage_module

SUPPORT = Path(__file__).resolve().parents[1] / "support"


def one_stage(out: Path, steps: int = 4, reward: str = "tiny_rewards:digit_fraction", **monitor) -> dict:
    return {
        "model": {"name": "tiny-random"},
        "output_dir": str(out),
        "lora": {"r": 4, "alpha": 8},
        "optim": {"lr": 5e-3, "steps": steps, "prompts_per_step": 2},
        "rollout": {"group_size": 4, "max_new_tokens": 8},
        "monitor": {"checkpoint_every": 1, **monitor},
        "eval": {"examples_per_domain": 2, "drift_probes": 2},
        "domains": [{"name": "arith", "source": "builtin:arithmetic", "reward": reward}],
        "stages": [{"name": "one", "domain": "arith", "method": "sdpo", "distill": {"teacher": {"kind": "ema"}}}],
    }


def test_guard_catches_an_injected_collapse_and_rolls_back_to_the_checkpoint(tmp_path, monkeypatch):
    restored = []
    original = stage_module._restore

    def spying_restore(ctx, path, optimizer, guard, *args, **kwargs):
        result = original(ctx, path, optimizer, guard, *args, **kwargs)
        saved = load_file(str(path / "adapters.safetensors"))
        live = {f"{ctx.student}::{k}": v for k, v in adapter_state(ctx.model, ctx.student).items()}
        restored.append((result[0], all(torch.equal(saved[k], v) for k, v in live.items()), len(live)))
        return result

    monkeypatch.setattr(stage_module, "_restore", spying_restore)
    raw = one_stage(tmp_path / "run", steps=5, reward="tiny_rewards:poisoned", max_rollbacks=2)
    raw["stages"][0]["method"] = "grpo"
    run_recipe(resolve_recipe(raw))
    events = [r for r in read_jsonl(tmp_path / "run" / "stage-01-one" / "metrics.jsonl") if "event" in r]
    assert events and events[0]["event"] == "nonfinite" and events[0]["step"] <= 5
    assert [e["action"] for e in events] == ["rollback", "rollback", "stop"]  # budget of 2, then the stage stops
    assert len(restored) == 3 and all(same and n > 0 for _, same, n in restored)  # adapter == checkpoint, exactly
    weights = load_file(str(tmp_path / "run" / "stage-01-one" / "adapter" / "adapter_model.safetensors"))
    assert all(torch.isfinite(v).all() for v in weights.values())  # the shipped adapter is the clean one


@pytest.mark.parametrize("action", ["rollback", "warn"])
def test_a_nonfinite_sdpo_step_with_the_ema_teacher_is_skipped_and_the_guard_acts(tmp_path, monkeypatch, action):
    # A NaN in the distillation loss from the 2nd call on: the step must make no update (as verl), so the EMA
    # teacher's re-factorisation never sees NaN weights, and the guard's nonfinite rule rolls back, then stops
    # (or, under `warn`, the stage goes on, every poisoned step skipped).
    from adaptercl.train import step as train_step

    calls, original_term = [], train_step.weighted_distillation

    def poisoned_term(*args, **kwargs):
        calls.append(1)
        per_token, stats = original_term(*args, **kwargs)
        return (per_token * float("nan") if len(calls) > 1 else per_token), stats

    monkeypatch.setattr(train_step, "weighted_distillation", poisoned_term)
    raw = one_stage(tmp_path / "run", steps=5, max_rollbacks=2, nonfinite=action)
    resolved = resolve_recipe(raw)
    assert (resolved.stages[0].method, resolved.stages[0].distill.teacher.kind) == ("sdpo", "ema")
    run_recipe(resolved)  # no exception from the EMA teacher's SVD
    stage_dir = tmp_path / "run" / "stage-01-one"
    rows = read_jsonl(stage_dir / "metrics.jsonl")
    events, steps = [r for r in rows if "event" in r], [r for r in rows if "event" not in r]
    assert len(calls) > 1 and events and all(e["event"] == "nonfinite" for e in events)
    if action == "rollback":
        assert [e["action"] for e in events] == ["rollback", "rollback", "stop"]
        assert all(r["nonfinite_step"] == 0.0 for r in steps)  # only clean steps are kept
        samples = read_jsonl(stage_dir / "samples.jsonl")  # and only their samples
        assert steps and [r["step"] for r in samples] == [r["step"] for r in steps for _ in range(4)]
    else:
        poisoned = [r for r in steps if r["nonfinite_step"] == 1.0]
        assert len(steps) == 5 and len(poisoned) == len(events) >= 3
        assert all(r["skipped_step"] == 1.0 and r["grad_norm"] != r["grad_norm"] for r in poisoned)  # NaN logged
        teacher = json.loads((stage_dir / "teacher" / "teacher.json").read_text())
        assert teacher["steps"] == 5 - len(poisoned)  # the teacher followed only the steps that updated
    for part in ("adapter", "teacher/adapter"):
        weights = load_file(str(stage_dir / part / "adapter_model.safetensors"))
        assert weights and all(torch.isfinite(v).all() for v in weights.values()), part


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted 4-step run of `one_stage` in this process, for the in-process resumes to equal."""
    out = tmp_path_factory.mktemp("reference")
    run_recipe(resolve_recipe(one_stage(out, steps=4)))
    return out


# A run resumed after its process was killed is compared with an uninterrupted run made the same way: every run of
# such a comparison is its own `adaptercl recipe run` process started from this environment, so that both compute on
# the same kernels (an in-process reference against a subprocess could differ in low bits wherever the two processes
# chose different MKL code paths; tests/support/state_guard.py).
SUBPROCESS_ENV = {"PYTHONPATH": f"{SUPPORT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def start_run(recipe: dict, recipe_file: Path, script: str | None = None) -> subprocess.Popen:
    """`recipe` (written to `recipe_file`) run by `adaptercl recipe run` in a new process, or by `script` (python -c)
    given the recipe file's path."""
    recipe_file.write_text(yaml.safe_dump(recipe))
    args = ["-m", "adaptercl.cli", "recipe", "run"] if script is None else ["-c", script]
    return subprocess.Popen(
        [sys.executable, *args, str(recipe_file)],
        env={**os.environ, **SUBPROCESS_ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish_run(recipe: dict, recipe_file: Path, script: str | None = None) -> str:
    """`start_run` to its end, which must be a success; its standard output."""
    proc = start_run(recipe, recipe_file, script)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return out


@pytest.fixture(scope="module")
def cli_reference(tmp_path_factory) -> Path:
    """The uninterrupted 4-step run of `one_stage` as its own process, for the killed processes' resumes to equal."""
    out = tmp_path_factory.mktemp("cli_reference")
    finish_run(one_stage(out / "run", steps=4), out / "recipe.yaml")
    return out / "run"


def assert_same_adapters(a_run: Path, b_run: Path) -> None:
    """The student's and the teacher's saved adapters of the two runs are byte-identical (and so are their tensors)."""
    for part in ("adapter/adapter_model.safetensors", "teacher/adapter/adapter_model.safetensors"):
        a, b = a_run / "stage-01-one" / part, b_run / "stage-01-one" / part
        assert a.read_bytes() == b.read_bytes(), part


# The teachers whose state a resume must restore: the EMA (its adapter), restart_freeze (its clock: copies at steps 2
# and 4) and gated (its window and references: a 2-step baseline, then a check at step 4; a lost window would leave
# step 4 without a full window, so without its check, and a lost baseline would take the baseline again, which the
# teacher_* metrics show whatever the rewards are).
TEACHERS = {
    "ema": {"kind": "ema"},
    "restart_freeze": {"kind": "restart_freeze", "refresh_every": 2},
    "gated": {"kind": "gated", "refresh_every": 2, "gate_window": 2, "gate_reward_delta": 0.0, "gate_length_eps": 1.0},
    "ema, lift gate": {"kind": "ema"},
}
# ... and the lift gate's decision (distill.gate), measured for real at steps 1 and 3 (0-based 0 and 2)
GATES = {"ema, lift gate": {"kind": "lift", "every": 2, "prompts": 4, "min_pairs": 1, "rule": "mean"}}


def with_teacher(raw: dict, kind: str) -> dict:
    raw["stages"][0]["distill"] = {"teacher": TEACHERS[kind], **({"gate": GATES[kind]} if kind in GATES else {})}
    return raw


def teacher_metrics(run: Path) -> list[dict]:
    """The teacher's and the lift gate's logged decisions and evidence (not the gate's wall time)."""
    rows = read_jsonl(run / "stage-01-one" / "metrics.jsonl")
    logged = ("teacher_", "lift_gate_")
    return [
        {k: v for k, v in r.items() if k.startswith(logged) and k != "lift_gate_seconds"}
        for r in rows
        if "event" not in r
    ]


@pytest.mark.parametrize("kind", list(TEACHERS))
def test_killed_run_resumes_to_bit_identical_adapters(tmp_path, kind):
    # the uninterrupted run, the killed one and its resume: each its own process (SUBPROCESS_ENV)
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    finish_run(with_teacher(one_stage(reference, steps=4), kind), tmp_path / "reference.yaml")
    proc = start_run(with_teacher(one_stage(killed, steps=4), kind), tmp_path / "killed.yaml")
    kill_after = random.Random(os.getpid()).randint(1, 3)  # a step boundary somewhere inside the stage
    metrics = killed / "stage-01-one" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if sum("event" not in r for r in read_jsonl(metrics)) >= kill_after:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert not (killed / "stage-01-one" / "done.json").exists(), "the run finished before it could be killed"

    finish_run(with_teacher(one_stage(killed, steps=4), kind), tmp_path / "killed.yaml")
    assert_same_adapters(reference, killed)
    steps = [r["step"] for r in read_jsonl(metrics) if "event" not in r]
    assert steps == [1, 2, 3, 4]
    samples = read_jsonl(killed / "stage-01-one" / "samples.jsonl")  # resume = uninterrupted, sample for sample
    assert samples == read_jsonl(reference / "stage-01-one" / "samples.jsonl") and len(samples) == 4 * 4
    assert not (killed / "stage-01-one" / "checkpoint").exists()
    logged = teacher_metrics(reference)  # the schedule's decisions and evidence, step for step
    assert teacher_metrics(killed) == logged
    if kind == "restart_freeze":
        assert [r["teacher_refresh"] for r in logged] == [0.0, 1.0, 0.0, 1.0]
    if kind == "gated":
        assert "teacher_gate_baseline" in logged[1] and logged[3]["teacher_gate_check"] == 1.0
        teacher = json.loads((reference / "stage-01-one" / "teacher" / "teacher.json").read_text())
        assert (
            teacher["gate"] == json.loads((killed / "stage-01-one" / "teacher" / "teacher.json").read_text())["gate"]
        )
    if kind in GATES:
        assert [r.get("lift_gate_check") for r in logged] == [1.0, None, 1.0, None] and "lift_gate_n" in logged[2]


def test_a_run_killed_after_training_resumes_without_a_step(tmp_path, reference, monkeypatch):
    # killed while the trained stage measures its diagnostics (here: response drift raises): the resume goes
    # straight to saving and evaluating, from the checkpoint that marks the stage trained
    from adaptercl.run import live_run as run_module

    def killed(*args, **kwargs):
        raise RuntimeError("killed during response drift")

    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(run_module, "response_drift", killed)
        with pytest.raises(RuntimeError, match="killed during response drift"):
            run_recipe(resolve_recipe(one_stage(out, steps=4)))
    stage_dir = out / "stage-01-one"
    assert not (stage_dir / "done.json").exists() and (stage_dir / "checkpoint" / "state.json").is_file()
    trained_metrics, trained_samples = (
        (stage_dir / "metrics.jsonl").read_bytes(),
        read_jsonl(stage_dir / "samples.jsonl"),
    )

    steps_run, original = [], stage_module.train_on_batch
    monkeypatch.setattr(stage_module, "train_on_batch", lambda *a, **k: steps_run.append(1) or original(*a, **k))
    events = []
    run_recipe(resolve_recipe(one_stage(out, steps=4)), on_event=lambda kind, **info: events.append(kind))
    assert steps_run == [] and "step" not in events and "stage" in events  # no training step ran on resume
    assert_same_adapters(reference, out)  # byte-identical to the uninterrupted run's
    assert (stage_dir / "metrics.jsonl").read_bytes() == trained_metrics  # the training's lines, kept as they were
    assert (
        read_jsonl(stage_dir / "samples.jsonl")
        == trained_samples
        == read_jsonl(reference / "stage-01-one" / "samples.jsonl")
    )
    done = json.loads((stage_dir / "done.json").read_text())
    assert done["final_step"] == read_jsonl(stage_dir / "metrics.jsonl")[-1] and done["final_step"]["step"] == 4
    for name in ("eval.json", "drift.json"):  # the measurements equal the uninterrupted run's
        ours, theirs = (json.loads((d / "stage-01-one" / name).read_text()) for d in (out, reference))
        ours.pop("seconds", None), theirs.pop("seconds", None)
        assert ours == theirs, name
    assert not (stage_dir / "checkpoint").exists()


KILL_BETWEEN_RENAMES = """
import os, sys
from pathlib import Path

import yaml

from adaptercl.system import atomic
from adaptercl.recipe.grammar import resolve_recipe
from adaptercl.run.sequence import run_recipe


class KilledOs:
    # `os` as atomic.py sees it: the process dies where the 3rd checkpoint (after step 2) would take the name of the
    # 2nd, which is already parked as .checkpoint.old-PID: between atomic_dir's two renames
    renames = 0

    def __getattr__(self, name):
        return getattr(os, name)

    def replace(self, src, dst):
        if Path(dst).name == "checkpoint" and Path(src).name.startswith(".checkpoint.tmp-"):
            KilledOs.renames += 1
            if KilledOs.renames == 3:
                os._exit(9)
        os.replace(src, dst)


atomic.os = KilledOs()
run_recipe(resolve_recipe(yaml.safe_load(open(sys.argv[1]))))
"""


# The resume of a killed process, in a process of its own (as the killed one): run_recipe with each step event
# printed as a line of JSON
RESUME_WITH_EVENTS = """
import json, sys

import yaml

from adaptercl.recipe.grammar import resolve_recipe
from adaptercl.run.sequence import run_recipe

def on_event(kind, **info):
    if kind == "step":
        print(json.dumps({"step": info["step"]}), flush=True)

run_recipe(resolve_recipe(yaml.safe_load(open(sys.argv[1]))), on_event=on_event)
"""


def test_a_run_killed_between_the_checkpoint_renames_resumes_from_the_parked_checkpoint(tmp_path, cli_reference):
    out, recipe_file = tmp_path / "killed", tmp_path / "recipe.yaml"
    proc = start_run(one_stage(out, steps=4), recipe_file, KILL_BETWEEN_RENAMES)
    proc.communicate(timeout=600)
    assert proc.returncode == 9
    stage_dir = out / "stage-01-one"
    assert not (stage_dir / "checkpoint").exists() and len(list(stage_dir.glob(".checkpoint.old-*"))) == 1
    lines = (stage_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]

    printed = finish_run(one_stage(out, steps=4), recipe_file, RESUME_WITH_EVENTS)
    assert [json.loads(line)["step"] for line in printed.splitlines()] == [2, 3, 4]  # from the parked checkpoint
    assert (stage_dir / "metrics.jsonl").read_text().splitlines()[0] == lines[0]  # kept, not started afresh
    assert [r["step"] for r in read_jsonl(stage_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    assert read_jsonl(stage_dir / "samples.jsonl") == read_jsonl(cli_reference / "stage-01-one" / "samples.jsonl")
    assert_same_adapters(cli_reference, out)
    assert not [p.name for p in stage_dir.iterdir() if p.name.startswith(".checkpoint")]  # nothing left behind
    assert not (stage_dir / "checkpoint").exists()


def test_report_renders_every_plot(tmp_path):
    run_recipe(resolve_recipe(one_stage(tmp_path / "run", steps=2, drift_every=1)))
    step_rows = [r for r in read_jsonl(tmp_path / "run" / "stage-01-one" / "metrics.jsonl") if "event" not in r]
    assert [r["drift_relative_delta_norm_mean"] > 0 for r in step_rows] == [True, True]  # drift every step
    report = write_report(tmp_path / "run")
    text = report.read_text()
    for plot in PLOTS:
        path = tmp_path / "run" / "plots" / plot
        assert path.is_file() and path.stat().st_size > 1000 and path.read_bytes()[:4] == b"\x89PNG"
        assert f"plots/{plot}" in text
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["cl_metrics"]["acc"] == summary["accuracy"][-1][0]
    drift = json.loads((tmp_path / "run" / "stage-01-one" / "drift.json").read_text())
    assert drift["parameter"]["aggregate"]["relative_delta_norm_mean"] > 0
    assert set(drift["response"]["arith"]) >= {"kl_to_base", "js_to_base", "entropy", "repetition_rate"}
