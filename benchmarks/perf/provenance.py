"""What every benchmarks/perf result records about itself, and how it is written.

Each script in this folder imports this module (Python puts the script's own folder on `sys.path`), so a result
JSON always carries the exact command, the machine (CPU, cores, torch threads, load average at the start, GPU),
the package versions and the adaptercl git revision; results are written to a temporary name in
`benchmarks/perf/results/` and renamed, so a killed run never leaves a half-written file.
"""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
PACKAGES = ("torch", "transformers", "peft", "trl", "accelerate", "bitsandbytes", "datasets")


def command() -> str:
    """The exact command line of this run, with the environment variables that change its speed or behaviour."""
    env = " ".join(f"{k}={os.environ[k]}" for k in ("HF_HUB_OFFLINE", "OMP_NUM_THREADS") if k in os.environ)
    argv = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
    return f"{env} {argv}".strip()


def machine() -> dict[str, Any]:
    import torch

    cpu = "unknown"
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "memory_gib": round(memory_gib, 1),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "platform": platform.platform(),
    }


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "adaptercl_git": git_revision()}
    for pkg in PACKAGES:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def git_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=HERE, capture_output=True, text=True).stdout
        return rev.stdout.strip() + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def provenance() -> dict[str, Any]:
    return {"command": command(), "machine": machine(), "versions": versions()}


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


def write_result(name: str, payload: dict[str, Any], out_dir: Path | None = None) -> Path:
    """Write `payload` as `out_dir/name.json` (default RESULTS_DIR) atomically: temporary file, then rename."""
    from adaptercl.atomic import write_json

    target = (out_dir or RESULTS_DIR) / f"{name}.json"
    write_json(target, payload)
    return target


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    def cell(value: Any) -> str:
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def add_workload_arguments(
    parser, model: str = "tiny-random", prompts_per_step: int = 4, max_new_tokens: int = 48
) -> None:
    """The workload options the CPU scripts share: model, prompts x samples x tokens, LoRA rank."""
    parser.add_argument("--model", default=model, help="tiny-random, smollm2-135m-instruct or a local folder")
    parser.add_argument("--prompts-per-step", type=int, default=prompts_per_step)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
