"""MKL's code path (`system/cpu_kernels.py`): AVX2 on an AMD CPU with AVX-512 unless the user set MKL_CBWR, set by
`import adaptercl` early enough that MKL computes on it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from adaptercl.system import cpu_kernels

AMD_512 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n"
AMD_AVX2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 fma\n"
INTEL_512 = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx2 avx512f amx_tile\n"


@pytest.mark.parametrize(("cpuinfo", "branch"), [(AMD_512, "AVX2"), (AMD_AVX2, None), (INTEL_512, None), ("", None)])
def test_the_code_path_by_vendor_and_flags(cpuinfo, branch):
    assert cpu_kernels.mkl_code_path(cpuinfo) == branch


def test_an_amd_avx512_cpu_gets_avx2_unless_the_user_chose(monkeypatch, tmp_path):
    # an environment of its own: the test process's os.environ is never written (tests/support/state_guard.py)
    info = tmp_path / "cpuinfo"
    info.write_text(AMD_512)
    monkeypatch.setattr(cpu_kernels, "CPUINFO", info)
    environ: dict[str, str] = {}
    assert cpu_kernels.prefer_fast_mkl_path(environ) == "AVX2" and environ == {"MKL_CBWR": "AVX2"}
    environ = {"MKL_CBWR": "AUTO"}  # the user's choice stays
    assert cpu_kernels.prefer_fast_mkl_path(environ) is None and environ == {"MKL_CBWR": "AUTO"}
    info.write_text(INTEL_512)
    environ = {}
    assert cpu_kernels.prefer_fast_mkl_path(environ) is None and environ == {}


def test_import_adaptercl_sets_it_before_mkl_computes():
    """In a fresh process: `import torch`, then `import adaptercl` on this machine; the variable is set exactly when
    this CPU is an AMD one with AVX-512 (and an MKL_CBWR from outside is kept)."""
    code = "import torch, os, adaptercl; print(os.environ.get('MKL_CBWR'))"
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    expected = cpu_kernels.mkl_code_path(cpu_kernels.CPUINFO.read_text()) if cpu_kernels.CPUINFO.is_file() else None
    assert out.strip() == str(expected)
    kept = subprocess.run([sys.executable, "-c", code], env={**env, "MKL_CBWR": "COMPATIBLE"}, capture_output=True,
                          text=True, check=True).stdout  # fmt: skip
    assert kept.strip() == "COMPATIBLE"
