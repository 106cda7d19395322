"""Time and peak GPU memory per phase of a run, measured from outside it: `PhaseMeter` wraps the run's functions (each
opens its phase; the innermost open phase owns each moment), polls the device's used memory, times each generate
call per token, and writes its figures as each phase closes. Used by rehearse_24gb.py (its docstring has what each
phase holds); on the CPU it keeps the seconds only.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from provenance import spread

from adaptercl.model.shapes import GIB


class DeadlineReached(Exception):
    """`--deadline-s` passed: the rehearsal stops before the next phase opens and reports what it measured."""


class PhaseMeter:
    """Time and peak memory per phase; the innermost open phase owns each moment (see the module docstring).

    `deadline`: seconds after `start` (default: now) past which opening a phase raises `DeadlineReached` (a lent
    GPU's call has a time limit); `progress`: a JSON file rewritten with the figures so far each time a phase closes
    (kept if the call is killed)."""

    def __init__(
        self, cuda: bool, deadline: float | None = None, progress: Path | None = None, start: float | None = None
    ):
        import torch

        self.torch, self.cuda = torch, cuda
        self.stack = ["load"]
        self.seconds: dict[str, float] = defaultdict(float)
        self.peaks: dict[str, dict[str, float]] = defaultdict(dict)
        self.decode: dict[str, list[float]] = defaultdict(list)
        self.t = time.perf_counter()
        self.used_peak, self._stop = 0, threading.Event()
        self.undo: list[tuple[Any, str, Any]] = []  # (owner, name, original) of every patch, restored by `close`
        self.failed_in: str | None = None  # the innermost phase an exception left
        self.t0, self.deadline, self.progress = start or self.t, deadline, progress
        self.calls: dict[str, dict[str, float]] = defaultdict(lambda: {"n": 0, "seconds": 0.0})  # per wrapped function
        if cuda:
            self.torch.cuda.reset_peak_memory_stats()
            threading.Thread(target=self._poll, daemon=True).start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            free, total = self.torch.cuda.mem_get_info()
            self.used_peak = max(self.used_peak, total - free)
            time.sleep(0.02)

    def _close_interval(self) -> None:
        phase, now = self.stack[-1], time.perf_counter()
        self.seconds[phase] += now - self.t
        self.t = now
        if not self.cuda:
            return
        cuda = self.torch.cuda
        cuda.synchronize()
        free, total = cuda.mem_get_info()
        measured = {
            "peak_allocated_gib": cuda.max_memory_allocated() / GIB,
            "peak_reserved_gib": cuda.max_memory_reserved() / GIB,
            "device_used_peak_gib": max(self.used_peak, total - free) / GIB,
        }
        for key, value in measured.items():
            self.peaks[phase][key] = max(self.peaks[phase].get(key, 0.0), value)
        cuda.reset_peak_memory_stats()
        self.used_peak = 0

    def figures(self) -> dict[str, Any]:
        return {
            "elapsed_s": time.perf_counter() - self.t0,
            "seconds": dict(self.seconds),
            "calls": dict(self.calls),
            "peaks": dict(self.peaks),
            "decode_step_s": {phase: spread(values) for phase, values in self.decode.items()},
        }

    def enter(self, phase: str) -> None:
        self._close_interval()
        if self.deadline is not None and time.perf_counter() - self.t0 > self.deadline:
            raise DeadlineReached(f"{self.deadline:.0f} s passed before a {phase} phase")
        self.stack.append(phase)

    def leave(self) -> None:
        self._close_interval()
        self.stack.pop()
        if self.progress is not None:
            self.progress.write_text(json.dumps(self.figures(), indent=1))

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def inside(*a: Any, **k: Any) -> Any:
            self.enter(phase)
            t0 = time.perf_counter()
            try:
                return original(*a, **k)
            except DeadlineReached:
                raise
            except BaseException:
                self.failed_in = self.failed_in or phase
                raise
            finally:
                self.calls[name]["n"] += 1
                self.calls[name]["seconds"] += time.perf_counter() - t0
                self.leave()

        self.patch(owner, name, inside)

    def patch(self, owner: Any, name: str, value: Any) -> None:
        self.undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def time_generate(self, cls: type) -> None:
        """Each generate call's seconds ÷ its longest response, kept under the phase that called it."""
        original = cls.generate

        def generate(engine: Any, *a: Any, **k: Any) -> Any:
            if self.cuda:
                self.torch.cuda.synchronize()
            t0 = time.perf_counter()
            groups = original(engine, *a, **k)
            if self.cuda:
                self.torch.cuda.synchronize()
            longest = max((len(c.token_ids) for g in groups for c in g), default=0)
            if longest:
                self.decode[self.stack[-1]].append((time.perf_counter() - t0) / longest)
            return groups

        self.patch(cls, "generate", generate)

    def close(self) -> None:
        self._close_interval()
        self._stop.set()
        for owner, name, original in reversed(self.undo):
            setattr(owner, name, original)
