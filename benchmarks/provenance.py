"""What a benchmark result records about the run that made it: command, machine, package versions, git revision.

Shared by the scripts under benchmarks/ (each puts this folder on `sys.path` and imports `provenance`), together
with the spread and markdown-table helpers their reports use.
"""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

BENCHMARKS_DIR = Path(__file__).resolve().parent
# the CPU flags that decide adaptercl's CPU kernels (MKL's branch, oneDNN's packs, bf16 rollouts): kept in `machine()`
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
TRAINING_PACKAGES = ("torch", "transformers", "peft", "trl", "accelerate", "bitsandbytes", "datasets")


def command() -> str:
    """The exact command line of this run, with the environment variables that change its speed or behaviour."""
    env = " ".join(f"{k}={os.environ[k]}" for k in ("HF_HUB_OFFLINE", "OMP_NUM_THREADS") if k in os.environ)
    argv = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
    return f"{env} {argv}".strip()


def machine() -> dict[str, Any]:
    """The CPU (name, family, model number, the flags of ISA_FLAGS it has), core counts, torch threads, load average at
    the start, memory, GPU and platform."""
    import torch

    from adaptercl.system.cpu_kernels import CPUINFO, cpu_fields

    cpu = cpu_fields(CPUINFO.read_text() if CPUINFO.is_file() else "")
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu": cpu["model"] or "unknown",
        "cpu_family": cpu["family"],  # family and model number tell CPUs of one name apart (AMD EPYC family 25:
        "cpu_model_number": cpu["model_number"],  # Zen 3 and Zen 4; family 26: Zen 5)
        "cpu_flags": [flag for flag in ISA_FLAGS if flag in cpu["flags"]],
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "memory_gib": round(memory_gib, 1),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "platform": platform.platform(),
    }


def versions(packages: Iterable[str] = TRAINING_PACKAGES, with_git_revision: bool = True) -> dict[str, str]:
    """Python's version, the adaptercl git revision (as `adaptercl_git`) and the installed ones of `packages`."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    if with_git_revision:
        out["adaptercl_git"] = git_revision()
    for package in packages:
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            pass
    return out


def git_revision(short: bool = False, repo: Path = BENCHMARKS_DIR, exclude: Path | None = None) -> str:
    """The checked-out commit of the repository holding `repo`, `+dirty` when its tree has uncommitted changes (outside
    `exclude`, a folder in it, when given: e.g. the results a benchmark runner writes between its steps); the
    environment's ADAPTERCL_GIT_REVISION when set (a copy of the tree whose .git is not this commit's, e.g. on a rented
    GPU)."""
    if os.environ.get("ADAPTERCL_GIT_REVISION"):
        return os.environ["ADAPTERCL_GIT_REVISION"]
    rev_parse = ["git", "rev-parse", *(["--short"] if short else []), "HEAD"]
    pathspec = [] if exclude is None else ["--", ":(top)", f":(exclude){os.path.relpath(exclude, repo)}"]
    try:
        rev = subprocess.run(rev_parse, cwd=repo, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", *pathspec], cwd=repo, capture_output=True, text=True)
        return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def provenance(packages: Iterable[str] = TRAINING_PACKAGES) -> dict[str, Any]:
    """The command, machine and versions (git revision included) of this run, to merge into a result."""
    return {"command": command(), "machine": machine(), "versions": versions(packages)}


def spread(values: list[float]) -> dict[str, float]:
    """Median, min, max, quartiles and mean of a list of timings (seconds) or sizes."""
    if not values:
        return {"n": 0}
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else (values[0],) * 3
    return {
        "n": len(values),
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "q1": q1,
        "q3": q3,
        "mean": statistics.fmean(values),
    }


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A markdown table; floats with three decimals."""

    def cell(value: Any) -> str:
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
