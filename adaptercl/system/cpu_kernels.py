"""Which of MKL's code paths torch's float32 matmuls take on the CPU: AVX2 on an AMD CPU with AVX-512, unless the
user chose one (`MKL_CBWR`).

MKL (linked into torch's CPU build) picks its code path for the processor it finds; on AMD's AVX-512 cores its
AVX-512 float32 GEMM is slower than its AVX2 one for the shapes adaptercl runs on a CPU. On a 2-core AMD EPYC with
AVX-512 (Zen 5), SmolLM2-135M's decode step of 24 rows took 77 ms on the AVX2 path against 101 ms natively, and the
quickstart 2 min 10 s against 2 min 25 s (benchmarks/quickstart/results.md). So `import adaptercl` sets
`MKL_CBWR=AVX2` (MKL's conditional numerical reproducibility: the AVX2 branch, whatever the processor) on such a
CPU when the variable is unset. MKL reads it when it first computes, which is after `import torch` but before any
matmul in every adaptercl entry point (the CLI, the API's `import adaptercl`); a process that multiplied before it
imported adaptercl keeps MKL's own choice.

It changes float32 rounding, not the computation: results are those any AVX2 CPU gives with MKL_CBWR=AVX2 (as CI's
AVX2 environment runs). Set `MKL_CBWR` yourself (e.g. `MKL_CBWR=AUTO`, MKL's default) to keep MKL's choice. Intel
CPUs and AMD CPUs without AVX-512 are left alone.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def mkl_code_path(cpuinfo: str) -> str | None:
    """The MKL_CBWR branch adaptercl prefers on the CPU `cpuinfo` (the text of /proc/cpuinfo) describes: "AVX2" on an
    AMD CPU with AVX-512, else None (MKL's own choice)."""
    vendor = flags = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id" and not vendor:
            vendor = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = value
    return "AVX2" if vendor == "AuthenticAMD" and "avx512f" in flags.split() else None


def prefer_fast_mkl_path(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Set `MKL_CBWR` in `environ` (the process's environment) to `mkl_code_path`'s choice for this machine when
    unset; return what was set (None: nothing)."""
    if "MKL_CBWR" in environ:
        return None
    try:
        branch = mkl_code_path(CPUINFO.read_text())
    except OSError:  # not Linux: no /proc/cpuinfo
        return None
    if branch is not None:
        environ["MKL_CBWR"] = branch
    return branch
