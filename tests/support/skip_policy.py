"""Skip policy: in CI a test may be skipped only for a reason on `ALLOWED_SKIPS`; any other skip fails the session.

A skip is easy to miss in a green run (a module-level `importorskip` once hid a whole test file from CI), so with
the environment variable CI set (CI=true, as `.ci/run` and most CI services set it) every skip, at collection or
at run time, is checked against the allow-list. Each other skip prints one line naming the test and its reason,
and the exit status becomes 1. Outside CI the same lines are printed as a warning and the exit status is kept.

Tests deselected by a marker expression (`-m 'not slow and not gpu'` in pyproject.toml's addopts) are not skipped:
they were never selected, so the policy does not see them. xfail is not a skip either.

`tests/conftest.py` registers this plugin; to use it elsewhere: `python -m pytest -p skip_policy` with tests/support/ on
PYTHONPATH.
"""

from __future__ import annotations

import os

import pytest

# A skip reason starting with one of these is allowed in CI: each names something no `pip install` can provide.
ALLOWED_SKIPS: dict[str, str] = {
    "needs a CUDA GPU": "a `gpu` test selected with -m gpu on a machine without CUDA",
    "real datasets not found": "the local dataset copies in ../shared/data are not part of the install",
}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in {"", "0", "false", "no"}


def skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    """The reason given to pytest.skip / a skip mark / importorskip, without pytest's "Skipped: " prefix."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


def allowed(reason: str) -> bool:
    return reason.startswith(tuple(ALLOWED_SKIPS))


class SkipPolicy:
    """The hooks: collect every skip not on the list, then print them and (in CI) fail the session."""

    def __init__(self) -> None:
        self.disallowed: list[str] = []  # "nodeid: reason"

    def _check(self, report: pytest.CollectReport | pytest.TestReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            reason = skip_reason(report)
            if not allowed(reason):
                self.disallowed.append(f"{report.nodeid}: {reason}")

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._check(report)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._check(report)

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        # a run that failed or was interrupted keeps its own status
        if self.disallowed and in_ci() and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter, exitstatus: int, config: pytest.Config) -> None:
        if not self.disallowed:
            return
        verdict = "fail the run (CI is set)" if in_ci() else "would fail the run in CI"
        terminalreporter.write_line(
            f"skip policy: {len(self.disallowed)} skip(s) for a reason not in ALLOWED_SKIPS "
            f"(tests/support/skip_policy.py: "
            f"{', '.join(map(repr, ALLOWED_SKIPS))}) {verdict}:",
            red=in_ci(),
            yellow=not in_ci(),
        )
        for line in self.disallowed:
            terminalreporter.write_line(f"disallowed skip: {line}")


def pytest_configure(config: pytest.Config) -> None:
    """Register the policy once (this module loaded with -p, or called from tests/conftest.py)."""
    if not config.pluginmanager.has_plugin("adaptercl-skip-policy"):
        config.pluginmanager.register(SkipPolicy(), "adaptercl-skip-policy")
