"""Why step_time.py runs both systems in one OS thread: torch's OpenMP regions started from a second Python thread.

Times the same small elementwise operation (a [8, 48, 1536] float32 add, the size of an MLP activation of step_time's
short workload, one OpenMP region per call) in four settings, interleaved round by round so that a drifting machine
shifts them alike: in the main thread alone (`main`); in a worker thread while the main thread, which has computed
before, waits (`worker`: the old step_time.py's adaptercl side); in the main thread while a worker thread that has
computed waits (`main_beside_worker`: the old TRL side); and in a second greenlet of the main thread, handed over by
step_time.py's own `Alternation` (`greenlet`: the step_time.py of now). Reports each setting's median microseconds
per add and its ratio to `main`.

    python benchmarks/perf/thread_penalty.py [--calls 5000] [--rounds 5]

writes benchmarks/perf/results/thread_penalty.json (the machine, torch's threads and versions with it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for the shared provenance.py

from perf_common import write_result  # noqa: E402
from provenance import provenance  # noqa: E402
from step_time import Alternation  # noqa: E402 - the greenlet setting times step_time.py's own hand-over


def time_adds(calls: int) -> float:
    """Microseconds per [8, 48, 1536] add, over `calls` adds after 100 unmeasured ones."""
    x, y = torch.randn(8, 48, 1536), torch.randn(8, 48, 1536)
    for _ in range(100):
        x + y
    t0 = time.perf_counter()
    for _ in range(calls):
        x + y
    return 1e6 * (time.perf_counter() - t0) / calls


class Worker:
    """A thread that computes when asked (`run`) and waits on an event in between, as the old step_time.py's did."""

    def __init__(self, calls: int):
        self.calls, self.result = calls, 0.0
        self.go, self.done, self.stop = threading.Event(), threading.Event(), False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            self.go.wait()
            self.go.clear()
            if self.stop:
                return
            self.result = time_adds(self.calls)
            self.done.set()

    def run(self) -> float:
        self.done.clear()
        self.go.set()
        self.done.wait()
        return self.result

    def close(self) -> None:
        self.stop = True
        self.go.set()
        self.thread.join()


def measure(calls: int, rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"main": [], "worker": [], "main_beside_worker": [], "greenlet": []}

    def stage() -> None:  # as step_time.py's adaptercl side: compute, then hand back to the main greenlet
        while True:
            times["greenlet"].append(time_adds(calls))
            turns.to_trainer()

    turns = Alternation(stage)
    for _ in range(rounds):
        times["main"].append(time_adds(calls))  # before any second thread exists in this round
        turns.to_stage()
        worker = Worker(calls)
        times["worker"].append(worker.run())
        times["main_beside_worker"].append(time_adds(calls))
        worker.close()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/perf/results)")
    args = parser.parse_args()
    info = provenance()
    times = measure(args.calls, args.rounds)
    base = statistics.median(times["main"])
    settings = {
        name: {"us_per_add_median": statistics.median(v), "ratio_to_main": statistics.median(v) / base, "raw": v}
        for name, v in times.items()
    }
    result = {**info, "torch_threads": torch.get_num_threads(), "calls": args.calls, "settings": settings}
    path = write_result("thread_penalty", result, args.out)
    for name, row in settings.items():
        print(f"{name:>20}: {row['us_per_add_median']:7.1f} us per add, {row['ratio_to_main']:.2f}x main")
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
