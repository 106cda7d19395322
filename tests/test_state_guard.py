"""The state guard (tests/support/state_guard.py, the autouse fixture in tests/conftest.py): a test that leaves
os.environ, torch's thread count or a torch backend flag changed fails, the state is put back for the tests after it,
and a test that changes state through monkeypatch passes. pytest runs in a subprocess on a tiny test file with this
repository's conftest.py, so the fixture under test is the one every test here runs under."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import state_guard

TESTS = Path(__file__).resolve().parent

LEAKY = """
import os

import torch


def test_leaks_an_environment_variable():
    os.environ["ADAPTERCL_GUARD_PROBE"] = "set"


def test_sees_it_taken_back():
    assert "ADAPTERCL_GUARD_PROBE" not in os.environ


def test_leaks_the_thread_count():
    torch.set_num_threads(torch.get_num_threads() + 1)


def test_leaks_a_backend_flag():
    torch.backends.mkldnn.enabled = not torch.backends.mkldnn.enabled


def test_sees_both_taken_back():
    assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"]) and torch.backends.mkldnn.enabled


def test_changes_state_through_monkeypatch(monkeypatch):
    monkeypatch.setenv("ADAPTERCL_GUARD_PROBE", "set")
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
"""


def test_a_leaking_test_fails_and_the_next_test_finds_the_state_restored(tmp_path):
    (tmp_path / "tests").mkdir()
    shutil.copy(TESTS / "conftest.py", tmp_path / "tests" / "conftest.py")
    (tmp_path / "tests" / "test_leaky.py").write_text(LEAKY)
    (tmp_path / "pytest.ini").write_text(f"[pytest]\npythonpath = {TESTS / 'support'}\n")
    env = {k: v for k, v in os.environ.items() if k not in {"CI", "ADAPTERCL_GUARD_PROBE"}}
    env.update(OMP_NUM_THREADS="1", COLUMNS="400")  # whole summary lines
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", "tests"]
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = result.stdout
    assert result.returncode == 1, out
    assert "6 passed, 3 errors" in out  # the leaking tests pass, then fail at teardown; the others pass
    assert "ERROR tests/test_leaky.py::test_leaks_an_environment_variable - Failed: the test leaked" in out
    assert "os.environ['ADAPTERCL_GUARD_PROBE']: None -> 'set'" in out
    assert "torch.get_num_threads(): 1 -> 2" in out and "torch.backends.mkldnn.enabled: True -> False" in out
    assert "test_changes_state_through_monkeypatch" not in out.split("short test summary")[-1]


def test_restore_lists_and_reverts_each_difference(monkeypatch):
    monkeypatch.setenv("ADAPTERCL_GUARD_PROBE", "before")
    before = state_guard.snapshot()
    os.environ["ADAPTERCL_GUARD_PROBE"] = "after"
    os.environ["ADAPTERCL_GUARD_NEW"] = "x"
    assert state_guard.restore(before) == [
        "os.environ['ADAPTERCL_GUARD_NEW']: None -> 'x'",
        "os.environ['ADAPTERCL_GUARD_PROBE']: 'before' -> 'after'",
    ]
    assert os.environ["ADAPTERCL_GUARD_PROBE"] == "before" and "ADAPTERCL_GUARD_NEW" not in os.environ
    assert state_guard.restore(before) == []
