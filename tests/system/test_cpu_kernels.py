"""MKL's code path chosen by measurement (`system/cpu_kernels.py`): the user's MKL_CBWR is kept, a CPU without AVX-512
has nothing to choose, a measurement (injected here) decides AVX2 only where MKL honours it and it is faster by the
margin, is cached per CPU and torch version and read back without measuring again; the real probe runs in child
processes; and `import adaptercl` applies a cached choice before MKL computes. The CPU's bf16 units by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version

import pytest

from adaptercl.system import cpu_kernels

AMD_512 = (
    "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"
)
AMD_AVX2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD Ryzen\nflags\t\t: fpu sse2 avx2 fma\n"
INTEL_AMX = (
    "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel Xeon 8480\nflags\t\t: avx2 avx512f amx_bf16\n"
)
FASTER = {"effective": "AVX2", "seconds": {"AVX2": [0.8], "AUTO": [1.0]}, "ratio": 0.8}


def never() -> dict:
    raise AssertionError("measured, but the choice was known")


def choose(env: dict, cpuinfo: str | None, tmp_path, measure=never, torch_version: str | None = "2.13.0+cpu") -> dict:
    return cpu_kernels.choose_mkl_branch(env, cpuinfo, tmp_path, torch_version, measure)


def test_the_users_setting_is_kept_and_nothing_is_measured(tmp_path):
    env = {"MKL_CBWR": "AUTO"}
    assert choose(env, INTEL_AMX, tmp_path) == {"mkl_cbwr": "AUTO", "source": "set by the user"}
    assert env == {"MKL_CBWR": "AUTO"}


@pytest.mark.parametrize(("cpuinfo", "torch_version"), [(AMD_AVX2, "2.13.0"), (None, "2.13.0"), (INTEL_AMX, None)])
def test_nothing_to_choose_without_avx512_cpu_information_or_torch(tmp_path, cpuinfo, torch_version):
    env: dict[str, str] = {}
    decision = choose(env, cpuinfo, tmp_path, torch_version=torch_version)
    assert decision["mkl_cbwr"] is None and decision["source"].startswith("MKL's own") and env == {}


def test_a_faster_avx2_is_chosen_cached_and_read_back_without_measuring(tmp_path):
    env: dict[str, str] = {}
    decision = choose(env, INTEL_AMX, tmp_path, lambda: FASTER)
    assert env == {"MKL_CBWR": "AVX2"} and decision["mkl_cbwr"] == "AVX2" and decision["source"] == "measured now"
    assert decision["ratio"] == 0.8 and decision["cpu"] == "Intel Xeon 8480"
    again: dict[str, str] = {}
    decision = choose(again, INTEL_AMX, tmp_path)  # `never` measures: the cache answers
    assert again == {"MKL_CBWR": "AVX2"} and decision["source"].startswith("measured earlier")
    other: dict[str, str] = {}  # another torch: measured again (here: MKL's own is faster)
    slower = {**FASTER, "ratio": 1.1}
    assert choose(other, INTEL_AMX, tmp_path, lambda: slower, torch_version="2.14.0")["mkl_cbwr"] is None
    assert other == {} and len(list(tmp_path.iterdir())) == 2


@pytest.mark.parametrize(
    ("measurement", "branch"),
    [
        (FASTER, "AVX2"),
        ({**FASTER, "ratio": 0.96}, None),  # within the margin: MKL's own choice stays
        ({**FASTER, "ratio": 1.3}, None),
        ({"effective": "AUTO"}, None),  # MKL ignores the request (its AMD CPUs)
        ({"error": "TimeoutError: ..."}, None),
    ],
)
def test_the_branch_a_measurement_chooses(measurement, branch):
    assert cpu_kernels.branch_from(measurement) == branch


def test_mkl_ignoring_the_request_and_a_failed_measurement_are_said(tmp_path):
    env: dict[str, str] = {}
    ignored = choose(env, AMD_512, tmp_path, lambda: {"effective": "AUTO"})
    assert env == {} and ignored["source"] == "measured now: MKL ignores MKL_CBWR=AVX2"

    def broken() -> dict:
        raise RuntimeError("the MKL probe exited (1) before it was ready")

    failed = choose(env, INTEL_AMX, tmp_path, broken)
    assert env == {} and failed["mkl_cbwr"] is None and failed["source"] == "measured now: error"
    assert failed["error"] == "RuntimeError: the MKL probe exited (1) before it was ready"


def test_under_a_launcher_only_a_cached_choice_is_applied(tmp_path):
    env = {"WORLD_SIZE": "2"}
    assert choose(env, INTEL_AMX, tmp_path)["source"] == "MKL's own: not measured under a multi-process launcher"
    choose({}, INTEL_AMX, tmp_path, lambda: FASTER)  # measured once, by a single process
    assert choose(env, INTEL_AMX, tmp_path)["mkl_cbwr"] == "AVX2" and env["MKL_CBWR"] == "AVX2"


def test_the_cache_key_is_the_cpus_model_flags_and_torch():
    key = cpu_kernels.cache_key(INTEL_AMX, "2.13.0")
    assert key == cpu_kernels.cache_key(INTEL_AMX.replace("processor\t: 0\n", ""), "2.13.0")  # same CPU, same key
    assert key != cpu_kernels.cache_key(INTEL_AMX, "2.14.0")
    assert key != cpu_kernels.cache_key(INTEL_AMX.replace("amx_bf16", ""), "2.13.0")
    assert key != cpu_kernels.cache_key(INTEL_AMX.replace("8480", "8580"), "2.13.0")


def test_cpu_fields_tell_two_cpus_of_one_name_apart_by_hand():
    """/proc/cpuinfo as Linux writes it: "model" (the number) is not "model name"; the first processor's values."""
    zen5 = (
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n"
        "flags\t\t: fpu avx2 avx512f\n\nprocessor\t: 1\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
    )
    fields = cpu_kernels.cpu_fields(zen5)
    assert fields == {
        "vendor": "AuthenticAMD",
        "model": "AMD EPYC",
        "family": "26",
        "model_number": "2",
        "flags": ["fpu", "avx2", "avx512f"],
    }
    assert cpu_kernels.cpu_fields(INTEL_AMX)["model_number"] == ""  # a field the text lacks stays empty


def test_bf16_units_by_hand():
    assert cpu_kernels.bf16_units(AMD_512) == ["avx512_bf16"]
    assert cpu_kernels.bf16_units(INTEL_AMX) == ["amx_bf16"]
    assert cpu_kernels.bf16_units(AMD_AVX2) == [] and cpu_kernels.bf16_units("") == []


def test_the_real_probe_reports_mkls_mode_and_times_where_it_differs():
    """Child processes with torch on this machine: MKL's reported mode under MKL_CBWR=AVX2 (AUTO where MKL ignores
    it, as on AMD CPUs); where it is AVX2, two turns of each and the ratio of their medians' pairs."""
    measurement = cpu_kernels.measure_mkl_branches(rounds=2)
    assert measurement["effective"] in ("AVX2", "AUTO"), measurement
    if measurement["effective"] == "AVX2":
        seconds = measurement["seconds"]
        assert len(seconds["AVX2"]) == len(seconds["AUTO"]) == 2 and min(seconds["AVX2"] + seconds["AUTO"]) > 0
        pairs = sorted(a / b for a, b in zip(seconds["AVX2"], seconds["AUTO"]))
        assert measurement["ratio"] == pytest.approx((pairs[0] + pairs[1]) / 2, rel=1e-12)
    else:
        assert set(measurement) == {"effective"}


@pytest.mark.skipif(not cpu_kernels.CPUINFO.is_file(), reason="no /proc/cpuinfo (not Linux)")
def test_import_adaptercl_applies_the_cached_choice_before_mkl_computes(tmp_path):
    """A fresh process (`import torch`, then `import adaptercl`) on this CPU with a cache holding AVX2 for it:
    MKL_CBWR is AVX2 on a CPU with AVX-512 (nothing is chosen without), and a user's value is kept."""
    branch = "AVX2"
    cpuinfo = cpu_kernels.CPUINFO.read_text()
    record = {"cpu": "here", "torch": version("torch"), "branch": branch, "effective": "AVX2", "ratio": 0.5}
    cache = tmp_path / "cpu-kernels"
    cache.mkdir()
    (cache / f"{cpu_kernels.cache_key(cpuinfo, version('torch'))}.json").write_text(json.dumps(record))
    code = "import torch, os, adaptercl; print(os.environ.get('MKL_CBWR'))"
    env = {k: v for k, v in os.environ.items() if k not in ("MKL_CBWR", "WORLD_SIZE")} | {
        "ADAPTERCL_CACHE": str(tmp_path)
    }
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    has_avx512 = "avx512f" in cpu_kernels.cpu_fields(cpuinfo)["flags"]
    assert out.strip() == str(branch if has_avx512 else None)
    kept = subprocess.run([sys.executable, "-c", code], env={**env, "MKL_CBWR": "COMPATIBLE"}, capture_output=True,
                          text=True, check=True).stdout  # fmt: skip
    assert kept.strip() == "COMPATIBLE"
