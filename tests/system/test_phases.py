"""The run's named phases (`system/phases.py`): observers see each phase enter and leave, nested, with the error
that ended it; an observer that refuses a phase stops the call before it runs; nothing is told when none watches."""

from __future__ import annotations

import pytest

from adaptercl.system.phases import phased, watching


class Stop(Exception):
    pass


class Recorder:
    def __init__(self, refuse: str | None = None):
        self.seen: list[tuple] = []
        self.refuse = refuse

    def enter(self, name):
        if name == self.refuse:
            raise Stop(name)
        self.seen.append(("enter", name))

    def leave(self, name, error):
        self.seen.append(("leave", name, type(error).__name__ if error else None))


def test_phases_nest_and_each_leave_gets_its_error():
    recorder = Recorder()

    def step():
        phased("rollout", lambda: None)
        phased("update", lambda: 1 / 0)

    with watching(recorder):
        with pytest.raises(ZeroDivisionError):
            phased("train", step)
    assert recorder.seen == [
        ("enter", "train"),
        ("enter", "rollout"),
        ("leave", "rollout", None),
        ("enter", "update"),
        ("leave", "update", "ZeroDivisionError"),
        ("leave", "train", "ZeroDivisionError"),
    ]
    assert phased("train", lambda x: x + 1, 1) == 2 and len(recorder.seen) == 6  # no longer watched


def test_a_refused_phase_does_not_run_and_those_that_entered_leave_it():
    ran, first, second = [], Recorder(), Recorder(refuse="eval")
    with watching(first), watching(second):
        with pytest.raises(Stop):
            phased("eval", ran.append, 1)
    assert ran == [] and first.seen == [("enter", "eval"), ("leave", "eval", "Stop")] and second.seen == []
