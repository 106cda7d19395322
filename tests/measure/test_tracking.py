"""Experiment tracking (TensorBoard, trackio, wandb offline), rollout samples and plain progress lines, on one tiny
two-stage run shown by the command line's console on a stream that is not a terminal (a log file, a job scheduler)."""

from __future__ import annotations

import io
import json
import os
from contextlib import contextmanager
from pathlib import Path

import pytest

from adaptercl.console import PlainProgress, run_with_progress
from adaptercl.measure import trackers as tracking
from adaptercl.recipe.grammar import RecipeError, resolve_recipe
from adaptercl.run.preflight_checks import preflight
from adaptercl.run_dir.samples import SAMPLE_COLUMNS, sample_indices, table_cell
from adaptercl.system.atomic import read_jsonl


def tracked_recipe(out: Path) -> dict:
    return {
        "model": {"name": "tiny-random"},
        "output_dir": str(out),
        "report_to": ["tensorboard", "trackio", "wandb"],
        "log": {"samples_per_step": 3, "run_name": "tiny", "print_every": 2},
        "lora": {"r": 4, "alpha": 8},
        "optim": {"lr": 5e-3, "steps": 3, "prompts_per_step": 2},
        "rollout": {"group_size": 2, "max_new_tokens": 6},
        "eval": {"examples_per_domain": 2, "drift_probes": 2, "teacher_lift_prompts": 2, "stage_kl_prompts": 0},
        "domains": [
            {"name": "arith", "source": "builtin:arithmetic", "reward": "tiny_rewards:digit_fraction"},
            {"name": "mcq", "source": "builtin:mcq", "reward": "tiny_rewards:digit_fraction"},
        ],
        "stages": [
            {"name": "one", "domain": "arith", "method": "grpo"},
            {"name": "two", "domain": "mcq", "method": "sdpo", "adapter": {"init": "new"}},
        ],
    }


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """The CLI's console on a captured stream (not a terminal), trackio's local store and wandb's offline run under
    tmp. Returns (tmp, run directory, what the console printed)."""
    from rich.console import Console

    tmp = tmp_path_factory.mktemp("tracked")
    with trackers_under(tmp):
        out = io.StringIO()
        run_with_progress(resolve_recipe(tracked_recipe(tmp / "run")), Console(file=out))
    return tmp, tmp / "run", out.getvalue()


@contextmanager
def trackers_under(tmp: Path):
    """wandb offline without a key or login, and trackio's local store, both under `tmp`."""
    from trackio import sqlite_storage

    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("WANDB_")]:
            mp.delenv(key)  # no key, no mode: wandb must go offline by itself
        mp.setenv("WANDB_CONSOLE", "off")  # wandb leaves pytest's output capture alone
        mp.setenv("ADAPTERCL_CACHE", os.environ.get("ADAPTERCL_CACHE", str(Path.home() / ".cache" / "adaptercl")))
        mp.setenv("HOME", str(tmp))  # no ~/.netrc (wandb login) here
        mp.setenv("TRACKIO_DIR", str(tmp / "trackio"))
        mp.setattr(sqlite_storage, "TRACKIO_DIR", tmp / "trackio")  # read at import: trackio may be imported
        yield


def test_tensorboard_event_files_read_back_with_the_logged_values(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run, _ = tracked_run
    events = EventAccumulator(str(run / "tensorboard" / "tiny"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    for stage, offset in (("stage-01-one", 0), ("stage-02-two", 3)):  # one global step across stages
        rows = [r for r in read_jsonl(run / stage / "metrics.jsonl") if "event" not in r]
        logged = events.Scalars(f"{stage}/reward_mean")
        assert [e.step for e in logged] == [offset + r["step"] for r in rows] == [offset + 1, offset + 2, offset + 3]
        assert [e.value for e in logged] == pytest.approx([r["reward_mean"] for r in rows], rel=1e-6)
        samples = read_jsonl(run / stage / "samples.jsonl")
        text = events.Tensors(f"{stage}/samples/text_summary")
        assert [t.step for t in text] == [offset + 1, offset + 2, offset + 3]
        assert table_cell(samples[-1]["completion"], 300) in text[-1].tensor_proto.string_val[0].decode()
    summary = json.loads((run / "summary.json").read_text())
    for j, domain in enumerate(summary["domains"]):  # each stage's evaluation row at its last global step
        logged = events.Scalars(f"eval/{domain}")
        assert [e.step for e in logged] == [0, 3, 6]
        assert [e.value for e in logged] == pytest.approx([row[j] for row in summary["accuracy"]])
    assert events.Scalars("cl/acc")[0].value == pytest.approx(summary["cl_metrics"]["acc"])


def test_trackio_local_store_reads_back_with_the_logged_values(tracked_run, monkeypatch):
    from trackio import sqlite_storage

    tmp, run, _ = tracked_run
    monkeypatch.setattr(sqlite_storage, "TRACKIO_DIR", tmp / "trackio")  # the store the run wrote
    logs = sqlite_storage.SQLiteStorage.get_logs("adaptercl", "tiny")
    rows = [r for r in read_jsonl(run / "stage-02-two" / "metrics.jsonl") if "event" not in r]
    logged = [(log["step"], log["stage-02-two/loss"]) for log in logs if "stage-02-two/loss" in log]
    assert logged == [(3 + r["step"], pytest.approx(r["loss"])) for r in rows]
    summary = json.loads((run / "summary.json").read_text())
    assert [log["cl/acc"] for log in logs if "cl/acc" in log] == [pytest.approx(summary["cl_metrics"]["acc"])]
    tables = [log["stage-01-one/samples"] for log in logs if "stage-01-one/samples" in log]
    assert len(tables) == 3


def test_wandb_writes_an_offline_run_without_a_key(tracked_run):
    _, run, _ = tracked_run
    offline = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline) == 1 and offline[0].stat().st_size > 0


def test_a_grown_run_goes_on_in_the_same_wandb_and_trackio_runs(tmp_path):
    """A run started again on its output_dir (here grown by a stage) continues its tracker runs: wandb's offline
    runs share the first one's id, trackio has one run with both stages' steps, and tracking.json names them."""
    from trackio import sqlite_storage

    from adaptercl.run.sequence import run_recipe

    raw = {**tracked_recipe(tmp_path / "run"), "report_to": ["wandb", "trackio"]}
    with trackers_under(tmp_path):
        run_recipe(resolve_recipe({**raw, "stages": raw["stages"][:1]}))
        first = json.loads((tmp_path / "run" / tracking.TRACKING_FILE).read_text())
        run_recipe(resolve_recipe(raw))  # the second stage appended: the run resumes and grows
        runs = sqlite_storage.SQLiteStorage.get_runs("adaptercl")
        logs = sqlite_storage.SQLiteStorage.get_logs("adaptercl", "tiny")
    grown = json.loads((tmp_path / "run" / tracking.TRACKING_FILE).read_text())
    assert {k: v for k, v in grown.items() if k != "logged"} == {k: v for k, v in first.items() if k != "logged"}
    assert first["logged"]["step"] == 3 and grown["logged"]["step"] == 6  # stage one's steps, then stage two's
    offline = sorted((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline) == 2 and {p.name for p in offline} == {f"run-{first['wandb']['id']}.wandb"}
    assert first["trackio"] == {"name": "tiny"} and runs == ["tiny"]  # one trackio run, not a second "tiny"
    steps = [log["step"] for log in logs if "stage-01-one/loss" in log or "stage-02-two/loss" in log]
    assert steps == [1, 2, 3, 4, 5, 6]  # stage one's steps, then stage two's, in the one trackio run


def event_counts(log_dir: Path) -> dict[tuple[str, int], int]:
    """How often each (tag, step) was written across every event file of a TensorBoard folder, read raw (the
    accumulator TensorBoard shows would hide a step written twice)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    counts: dict[tuple[str, int], int] = {}
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                counts[(value.tag, event.step)] = counts.get((value.tag, event.step), 0) + 1
    return counts


def test_a_resumed_run_logs_each_step_to_tensorboard_once(tmp_path, monkeypatch):
    """A stage killed in its fourth step (checkpoint after step 2, step 3 logged) and resumed redoes step 3: the
    resumed process skips it (tracking.json `logged`), so the event files hold every step, evaluation row and the
    recipe exactly once, with the values of metrics.jsonl."""
    from adaptercl.run.sequence import run_recipe
    from adaptercl.train import stage as stage_module

    raw = {**tracked_recipe(tmp_path / "run"), "report_to": ["tensorboard"], "monitor": {"checkpoint_every": 2}}
    raw["domains"], raw["stages"] = raw["domains"][:1], raw["stages"][:1]
    raw["optim"] = {**raw["optim"], "steps": 4}
    calls, original = [], stage_module.train_on_batch

    def killed_in_step_4(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("killed in step 4")
        return original(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(stage_module, "train_on_batch", killed_in_step_4)
        with pytest.raises(RuntimeError, match="killed in step 4"):
            run_recipe(resolve_recipe(raw))
    assert json.loads((tmp_path / "run" / tracking.TRACKING_FILE).read_text())["logged"] == {"eval": 0, "step": 3}
    run_recipe(resolve_recipe(raw))
    log_dir = tmp_path / "run" / "tensorboard" / "tiny"
    counts = event_counts(log_dir)
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 2  # the resumed process's own file, in the same run
    assert sorted(step for tag, step in counts if tag == "stage-01-one/reward_mean") == [1, 2, 3, 4]
    assert sorted(step for tag, step in counts if tag == "eval/arith") == [0, 4]
    assert sorted(step for tag, step in counts if tag.startswith("stage-01-one/samples")) == [1, 2, 3, 4]
    assert sorted(step for tag, step in counts if tag.startswith("recipe")) == [0]
    assert set(counts.values()) == {1}, {k: n for k, n in counts.items() if n > 1}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    rows = [r for r in read_jsonl(tmp_path / "run" / "stage-01-one" / "metrics.jsonl") if "event" not in r]
    logged = [e.value for e in events.Scalars("stage-01-one/reward_mean")]
    assert logged == pytest.approx([r["reward_mean"] for r in rows], rel=1e-6)


def test_samples_jsonl_keeps_the_chosen_samples_of_every_step_and_the_report_shows_them(tracked_run):
    _, run, _ = tracked_run
    for stage, has_teacher in (("stage-01-one", False), ("stage-02-two", True)):
        samples = read_jsonl(run / stage / "samples.jsonl")
        assert [r["step"] for r in samples] == [1, 1, 1, 2, 2, 2, 3, 3, 3]  # samples_per_step 3 of 2 x 2
        assert all(set(r) == {*SAMPLE_COLUMNS, "id"} for r in samples)
        assert all(isinstance(r["teacher_target"], bool) == has_teacher for r in samples)  # null without a teacher
        first = samples[:3]  # the first response of prompt 0, of prompt 1, then the second of prompt 0
        assert first[0]["id"] == first[2]["id"] != first[1]["id"]
    report = (run / "report.md").read_text()
    assert "## Rollout samples" in report and "### stage-02-two, step 3" in report
    assert table_cell(read_jsonl(run / "stage-01-one" / "samples.jsonl")[0]["prompt"], 300) in report


def test_progress_without_a_terminal_is_complete_lines(tracked_run):
    _, _, printed = tracked_run
    lines = printed.splitlines()
    assert "loading tiny-random" in lines
    assert "[stage-00-before] eval: 2/2 domains" in lines
    assert any(line.startswith("[stage-00-before] accuracy: arith ") for line in lines)
    steps = [line for line in lines if line.startswith("[stage-02-two] step ")]
    assert [line.split()[2] for line in steps] == ["2/3", "3/3"]  # print_every 2, and the last step
    assert all(" reward " in line and " loss " in line and line.endswith(" s/step") for line in steps)
    assert any(line.startswith("[stage-01-one] parameter drift: ") and line.endswith(" modules") for line in lines)
    assert "[stage-02-two] response drift: 4/4 probes" in lines  # 2 probes of each of 2 domains
    assert not any("━" in line or "…" in line for line in lines)  # no progress bar, nothing cut


def test_plain_progress_lines_give_seconds_per_step_since_the_last_line(tmp_path):
    raw = tracked_recipe(tmp_path)
    raw["log"] = {"print_every": 2}
    clock = iter([100.0, 104.0, 110.0])
    out = io.StringIO()
    progress = PlainProgress(resolve_recipe(raw), out, clock=lambda: next(clock))
    progress("stage", stage="stage-01-one", steps=3, method="grpo", init="new")  # t = 100
    metrics = {"reward_mean": 0.25, "correct_frac": 0.5, "loss": 0.125, "response_len_mean": 6.0}
    for step in (1, 2, 3):  # lines at step 2 (t = 104) and at the last step (t = 110)
        progress("step", stage="stage-01-one", step=step, metrics=metrics, samples=[])
    assert out.getvalue().splitlines() == [
        "[stage-01-one] grpo, init new, 3 steps",
        "[stage-01-one] step 2/3 reward 0.250 correct 0.50 loss 0.125 len 6 2.0 s/step",
        "[stage-01-one] step 3/3 reward 0.250 correct 0.50 loss 0.125 len 6 6.0 s/step",
    ]


def test_sample_choice_covers_prompts_first():
    assert sample_indices(8, 4, 3) == [0, 4, 1]  # 2 prompts x 4: first of each group, then the second
    assert sample_indices(4, 2, 10) == [0, 2, 1, 3]  # fewer samples than asked: all of them


@pytest.mark.parametrize(
    "value, message",
    [
        ("all", "report_to: unknown tracker 'all'; allowed: tensorboard, wandb, trackio or 'none'"),
        (["none", "wandb"], "report_to: 'none' cannot be combined with other trackers, got ['none', 'wandb']"),
    ],
)
def test_report_to_errors_are_one_line(tmp_path, value, message):
    with pytest.raises(RecipeError) as err:
        resolve_recipe({**tracked_recipe(tmp_path), "report_to": value})
    assert str(err.value) == message


def test_report_to_accepts_trl_spellings(tmp_path):
    for value, expected in (("none", []), ("wandb", ["wandb"]), ("tensorboard,trackio", ["tensorboard", "trackio"])):
        assert resolve_recipe({**tracked_recipe(tmp_path), "report_to": value}).report_to == expected


def test_a_missing_tracker_package_names_the_extra(tmp_path, monkeypatch):
    real = tracking.importlib.util.find_spec
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name))
    with pytest.raises(RecipeError, match=r"^report_to: wandb is not installed; pip install 'adaptercl\[wandb\]'$"):
        preflight(resolve_recipe(tracked_recipe(tmp_path)))


def test_wandb_goes_offline_without_a_key_or_login(tmp_path, monkeypatch):
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert tracking.wandb_mode() == "offline"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai login user password secret\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert tracking.wandb_mode() is None  # logged in: wandb decides (online)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert tracking.wandb_mode() is None
