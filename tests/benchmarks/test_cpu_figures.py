"""benchmarks/perf/cpu_figures.py: the CPU's folder name, the commands in order with the names their scripts write,
resuming (a measured step is skipped, a failed one reported), the quickstart's learning bar by hand, the peak-RSS
wrapper on a real child, and summary.md from the committed Zen 5 results against issue 46's bars."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "perf"))
import cpu_figures  # noqa: E402
import cpu_paths  # noqa: E402
import provenance  # noqa: E402
import step_time  # noqa: E402

ZEN5 = REPO / "benchmarks" / "perf" / "results" / "amd-epyc-zen5"
CPUINFO = "vendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\nflags\t\t: avx2\n"


def test_the_cpus_folder_name_tells_two_cpus_of_one_name_apart():
    assert cpu_figures.cpu_name(CPUINFO) == "amd-epyc-f26-m2"
    assert cpu_figures.cpu_name(CPUINFO.replace(": 26", ": 25").replace(": 2\n", ": 17\n")) == "amd-epyc-f25-m17"
    intel = "model name\t: Intel(R) Xeon(R) Platinum 8480+\ncpu family\t: 6\nmodel\t\t: 143\n"
    assert cpu_figures.cpu_name(intel) == "intel-r-xeon-r-platinum-8480-f6-m143"
    assert cpu_figures.cpu_name("") == "unknown-cpu"


def test_the_steps_write_into_the_folder_under_the_names_their_scripts_give(tmp_path):
    plan = cpu_figures.steps(tmp_path, "AMD EPYC")
    names = [step.name for step in plan]
    workload = dict(method="sdpo", model="smollm2-135m-instruct", workload="long-fixed", rollout_dtype="float32")
    assert (
        names[:2] == ["thread_penalty", cpu_paths.result_name("AMD EPYC")] == ["thread_penalty", "cpu_paths-amd-epyc"]
    )
    assert names[2:] == [
        "step_time-smollm2-135m-instruct",
        "step_time-smollm2-135m-instruct-long-fixed",
        "step_time-smollm2-135m-instruct-long",
        "step_time-sdpo-smollm2-135m-instruct",
        step_time.result_name(argparse.Namespace(**workload)),
    ]
    for step in plan:
        assert step.argv[-2:] == ["--out", str(tmp_path)] and (REPO / step.argv[1]).is_file()
        assert step.argv[1].startswith("benchmarks/perf/")  # relative to the root the steps run in: no machine path
    in_repo = cpu_figures.steps(cpu_figures.RESULTS_DIR / "some-cpu", "AMD EPYC")
    assert all(step.argv[-1] == "benchmarks/perf/results/some-cpu" for step in in_repo)
    assert not any(str(REPO) in arg for step in in_repo for arg in step.argv[1:])  # argv[0]: the interpreter
    assert plan[-1].argv[2:-2] == ["--method", "sdpo", "--model", "smollm2-135m-instruct", "--workload", "long-fixed",
                                   "--steps", "3", "--warmup", "1"]  # fmt: skip


def test_a_measured_step_is_skipped_and_a_failed_one_reported(tmp_path):
    plan = [cpu_figures.Step(name, [name]) for name in ("a", "b", "c")]
    (tmp_path / "a.json").write_text("{}")
    ran = []

    def run(argv):
        ran.append(argv[0])
        return 1 if argv[0] == "c" else 0

    assert cpu_figures.run_steps(plan, tmp_path, redo=False, run=run) == ["c"] and ran == ["b", "c"]
    ran.clear()
    assert cpu_figures.run_steps(plan, tmp_path, redo=True, run=run) == ["c"] and ran == ["a", "b", "c"]


def test_the_steps_revision_ignores_the_results_this_command_writes(tmp_path, monkeypatch):
    """A results JSON written by an earlier step does not make the later steps' revision dirty (provenance's
    git_revision with the results folder excluded, as main reads it); code does."""
    monkeypatch.delenv("ADAPTERCL_GIT_REVISION", raising=False)  # the override would answer for git
    repo, out = tmp_path / "repo", tmp_path / "repo" / "benchmarks" / "perf" / "results" / "cpu"
    out.mkdir(parents=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "code.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "c"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    (out / "step_time-x.json").write_text("{}\n")  # a step's result, uncommitted
    # read from a subfolder, as provenance does from benchmarks/: the whole tree counts
    assert provenance.git_revision(repo=repo / "benchmarks", exclude=out) == head
    (repo / "code.py").write_text("x = 2\n")  # an uncommitted code change, outside that subfolder
    assert provenance.git_revision(repo=repo / "benchmarks", exclude=out) == head + "+dirty"


def test_the_quickstarts_learning_bar_by_hand():
    summary = json.loads((REPO / "benchmarks" / "quickstart" / "summary.json").read_text())
    gains = cpu_figures.gains(summary)
    assert list(gains) == ["arithmetic", "mcq"]
    assert abs(gains["arithmetic"] - (16 / 30 - 5 / 30)) < 1e-12 and abs(gains["mcq"] - (10 / 30 - 5 / 30)) < 1e-12
    assert cpu_figures.learns(gains)
    assert not cpu_figures.learns({"arithmetic": 0.2, "mcq": 0.0})  # mcq must gain
    assert not cpu_figures.learns({"arithmetic": 0.19, "mcq": 0.1})
    assert cpu_figures.learns({"arithmetic": 0.2, "mcq": 1 / 30})


def test_the_peak_rss_wrapper_reports_its_one_childs_peak():
    child = [sys.executable, "-c", "b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096])"]
    done = subprocess.run([sys.executable, "-c", cpu_figures.PEAK_RSS, *child], capture_output=True, text=True)
    assert done.returncode == 0
    peak_kb = int(done.stderr.strip().splitlines()[-1].split()[-1])
    assert 300 * 1024 <= peak_kb < 2 * 1024 * 1024  # the 300 MiB it touched, and not the size of any other process
    failing = subprocess.run([sys.executable, "-c", cpu_figures.PEAK_RSS, sys.executable, "-c", "raise SystemExit(3)"])
    assert failing.returncode == 3  # the child's exit code is passed on


def test_the_summary_holds_each_ratio_and_the_quickstart_against_the_bars(tmp_path):
    for path in ZEN5.glob("step_time-*.json"):
        shutil.copy(path, tmp_path)
    # the committed Zen 5 JSONs as they are, with the fields a row shows set by hand (a rerun keeps the test)
    for name, step, ratio in (("step_time-smollm2-135m-instruct", (3.17, 7.74), 0.409),
                              ("step_time-smollm2-135m-instruct-long", (14.81, 41.99), 0.55)):  # fmt: skip
        result = json.loads((tmp_path / f"{name}.json").read_text())
        result["versions"]["adaptercl_git"] = "e759608a35cb405dec8e8cb3590a180c42ace1cc"
        result["adaptercl_step_s"]["median"], result["trl_step_s"]["median"] = step
        result["ratio_of_medians"], result["rollout_per_token_ratio"] = ratio, 0.384
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    (tmp_path / "step_time-sdpo-smollm2-135m-instruct.json").unlink()
    text = cpu_figures.summary_md(tmp_path)
    assert "AMD EPYC (family 26 model 2; avx2, avx512f, avx512_bf16, avx512_vnni), 2 usable cores" in text
    assert "| GRPO | short | e759608 | 3.17 | 7.74 | **0.409** | 0.384 | met |" in text
    assert "| GRPO | long | e759608 | 14.81 | 41.99 | **0.550** | 0.384 | **not met** |" in text
    assert "| SDPO | short | not measured |" in text and "The quickstart: not measured." in text
    quickstart = {"cloned_revision": "e759608abc", "exit": 0, "wall_s": 181.0, "peak_rss_gib": 3.26,
                  "gains": {"arithmetic": 0.3667, "mcq": 0.0}, "equal_to_committed": False}  # fmt: skip
    (tmp_path / "quickstart.json").write_text(json.dumps(quickstart))
    line = cpu_figures.summary_md(tmp_path).splitlines()[-1]
    assert line.startswith(
        "The quickstart from a fresh clone of e759608 with an empty model cache: exit 0, **181.0 s**"
    )
    assert "(**not met**: <= 180 s)" in line and "arithmetic +0.367, mcq +0.000 (**does not learn**" in line
    assert line.endswith("summary.json differs from the committed benchmarks/quickstart/summary.json.")
