"""Time and peak memory of each phase of a run, measured while it runs (`adaptercl recipe rehearse`).

    meter = PhaseMeter(cuda=False, deadline_s=240)
    with watching(meter):          # system/phases.py: the run tells it each phase it enters and leaves
        run_recipe(recipe)
    meter.close(); meter.spans     # every phase's (name, start, end, depth), in order

The run's phases (`PHASE_GROUPS`) nest; the innermost open one owns each moment, and each belongs to one of the
memory groups load, rollout, train, eval, diagnostics, save (a moment outside every phase: other). Peak memory per
group: on CUDA torch's peak allocated and reserved (reset as each phase opens or closes) and the device's used memory
(total - free, polled every 20 ms: a colocated vLLM's pool and the CUDA context included); on the CPU the process's
resident memory (polled every 20 ms). Past `deadline_s` (seconds after the meter started) entering a phase raises
`DeadlineReached`: the run stops there and what was measured is the result.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

GIB = 2**30
POLL_S = 0.02
# phase (system/phases.py names, as run/sequence.py and train/stage.py call them) -> its memory group
PHASE_GROUPS = {
    "load": "load",
    "rollout": "rollout",
    "train": "train",
    "update": "train",
    "eval": "eval",
    "lm_eval": "eval",
    "teacher_lift": "diagnostics",
    "parameter_drift": "diagnostics",
    "response_drift": "diagnostics",
    "stage_kl": "diagnostics",
    "checkpoint": "save",
    "save": "save",
}
GROUPS = ("load", "rollout", "train", "eval", "diagnostics", "save", "other")


class DeadlineReached(Exception):
    """The rehearsal's time is up: the run stops before the next phase opens, and what was measured is reported."""


@dataclass
class Span:
    name: str
    start: float  # seconds since the meter started
    end: float
    depth: int  # 0: a phase no other holds


def resident_bytes() -> int:
    """This process's resident memory now (Linux), else its peak so far."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


class PhaseMeter:
    """Time and peak memory per phase (see the module docstring); an observer of `system.phases`."""

    def __init__(self, cuda: bool, deadline_s: float | None = None):
        self.cuda, self.deadline_s = cuda, deadline_s
        self.t0 = time.perf_counter()
        self.stack: list[str] = []
        self.spans: list[Span] = []
        self.opened: list[float] = []  # start of each open phase
        self.peaks: dict[str, dict[str, float]] = {}
        self.failed_in: str | None = None  # the innermost phase an error (not the deadline) left
        self.stopped: str | None = None
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._used_peak = 0
        if cuda:
            import torch

            self.torch = torch
            torch.cuda.reset_peak_memory_stats()
        threading.Thread(target=self._poll, daemon=True).start()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    @property
    def group(self) -> str:
        return PHASE_GROUPS.get(self.stack[-1], "other") if self.stack else "other"

    def _keep(self, group: str, key: str, value: float) -> None:
        peaks = self.peaks.setdefault(group, {})
        peaks[key] = max(peaks.get(key, 0.0), value)

    def _poll(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                if self.cuda:
                    free, total = self.torch.cuda.mem_get_info()
                    self._used_peak = max(self._used_peak, total - free)
                else:
                    self._keep(self.group, "peak_resident_gib", resident_bytes() / GIB)
            time.sleep(POLL_S)

    def _close_interval(self) -> None:
        """The moment since the last transition belongs to the innermost open phase's group."""
        with self._lock:
            group = self.group
            if not self.cuda:
                self._keep(group, "peak_resident_gib", resident_bytes() / GIB)
                return
            cuda = self.torch.cuda
            cuda.synchronize()
            free, total = cuda.mem_get_info()
            self._keep(group, "peak_allocated_gib", cuda.max_memory_allocated() / GIB)
            self._keep(group, "peak_reserved_gib", cuda.max_memory_reserved() / GIB)
            self._keep(group, "device_used_peak_gib", max(self._used_peak, total - free) / GIB)
            cuda.reset_peak_memory_stats()
            self._used_peak = 0

    def enter(self, name: str) -> None:
        if self.deadline_s is not None and self.now() > self.deadline_s:
            self.stopped = self.stopped or f"the time limit came before the next phase ({name})"
            raise DeadlineReached(self.stopped)
        self._close_interval()
        self.stack.append(name)
        self.opened.append(self.now())

    def leave(self, name: str, error: BaseException | None) -> None:
        self._close_interval()
        if error is not None and not isinstance(error, DeadlineReached) and self.failed_in is None:
            self.failed_in = name
        start = self.opened.pop()
        self.stack.pop()
        self.spans.append(Span(name, start, self.now(), len(self.stack)))

    def close(self) -> dict[str, Any]:
        """Stop polling; the peaks per group, in GiB."""
        self._close_interval()
        self._stop.set()
        return {
            group: {k: round(v, 3) for k, v in self.peaks[group].items()} for group in GROUPS if group in self.peaks
        }
