"""benchmarks/perf/thread_penalty.py: the four settings each timed once a round, in the thread each names (a worker
thread for `worker`, the main thread for the others), and the ratios taken to the main thread's median."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "perf"))
import thread_penalty as tp  # noqa: E402


def test_each_setting_runs_in_its_thread_and_the_ratios_are_to_main(tmp_path, monkeypatch):
    threads: list[tuple[int, bool]] = []
    real = tp.time_adds

    def recorded(calls: int) -> float:
        threads.append((threading.get_ident(), threading.current_thread() is threading.main_thread()))
        return real(calls)

    monkeypatch.setattr(tp, "time_adds", recorded)
    monkeypatch.setattr(tp, "provenance", lambda: {})
    monkeypatch.setattr(sys, "argv", ["thread_penalty.py", "--calls", "20", "--rounds", "2", "--out", str(tmp_path)])
    assert tp.main() == 0
    # per round: main, greenlet, worker, main beside the worker
    assert [on_main for _, on_main in threads] == [True, True, False, True] * 2
    result = json.loads((tmp_path / "thread_penalty.json").read_text())
    settings = result["settings"]
    assert set(settings) == {"main", "worker", "main_beside_worker", "greenlet"}
    assert settings["main"]["ratio_to_main"] == 1.0
    for row in settings.values():
        assert (
            len(row["raw"]) == 2
            and row["ratio_to_main"] == row["us_per_add_median"] / settings["main"]["us_per_add_median"]
        )
