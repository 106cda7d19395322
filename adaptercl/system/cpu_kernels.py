"""The CPU's kernels as adaptercl uses them: MKL's code path for torch's float32 matmuls (`MKL_CBWR`), chosen on this
CPU by measurement, and the CPU's bf16 matrix units (`bf16_units`).

MKL, linked into torch's CPU build, picks a code path for the processor it finds; `MKL_CBWR=AVX2` forces its AVX2
branch. Whether that is faster than MKL's own choice depends on the CPU and is measured, not assumed from the vendor:
`import adaptercl` (`prefer_fast_mkl_path`), when the user has not set `MKL_CBWR` and the CPU has AVX-512 (without it
MKL's own choice is AVX2 or narrower: nothing to choose), looks up this CPU's choice in adaptercl's cache
(`$ADAPTERCL_CACHE`, default ~/.cache/adaptercl, `cpu-kernels/<key>.json`, keyed by the CPU's model name and flags
and torch's version) and sets it. Without one it measures once (`measure_mkl_branches`, 2-4 s, then cached): a child
process with `MKL_CBWR=AVX2` reports the mode MKL actually computes in (MKL_VERBOSE's `CNR:`); MKL on AMD CPUs
ignores the request (CNR stays AUTO: the same kernels, bit for bit, measured on a Zen 4 EPYC), so nothing changes
there. Where MKL honours it, that child and one on MKL's own path take turns (one computes at a time, single-threaded)
timing a training step's products on SmolLM2's MLP shapes (forward, grad-input, grad-weight of a [512, 576] x
[576, 1536] layer), and AVX2 is chosen when the median of the paired ratios is below `1 - MARGIN`.

MKL reads `MKL_CBWR` when it first computes, which is after `import torch` but before any matmul in every adaptercl
entry point (the CLI, the API's `import adaptercl`); a process that multiplied before it imported adaptercl keeps
MKL's own choice. It changes float32 rounding, not the computation. Set `MKL_CBWR` yourself (e.g. `MKL_CBWR=AUTO`,
MKL's default) to keep MKL's choice and skip the measurement. Under a multi-process launcher (`WORLD_SIZE` > 1) only a
cached choice is applied (ranks measuring at once would disturb each other). What was decided (`decision()`) is
recorded in the run directory's cpu_paths.jsonl (`rollout.precision.cpu_paths`).

No torch import here: `import adaptercl` stays light; the measurement runs torch in child processes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Callable, MutableMapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

CPUINFO = Path("/proc/cpuinfo")
CANDIDATE = "AVX2"  # the branch measured against MKL's own (AUTO)
MARGIN = 0.05  # AVX2 is chosen only when at least 5 % faster: the paired ratios of a quiet core spread ~1-2 %
ROUNDS = 7  # turns of each child; each computes the step's products twice (~30-60 ms a turn on one core)
BF16_UNITS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of native bf16 matrix instructions

# The child's program: report MKL's mode (CNR), then time the products at each "go" until told anything else.
PROBE = r"""
import ctypes, sys, time, torch
torch.set_num_threads(1)
with torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON):  # MKL prints the mode it computes in: CNR:...
    torch.ones(8, 8) @ torch.ones(8, 8)
ctypes.CDLL(None).fflush(None)  # MKL writes through C's stdio buffer
g = torch.Generator().manual_seed(0)
x, w, h = torch.randn(512, 576, generator=g), torch.randn(1536, 576, generator=g), torch.randn(512, 1536, generator=g)
def step():  # forward [512, 1536], grad-input [512, 576], grad-weight [1536, 576]
    return x @ w.T, h @ w, h.T @ x
step(); step()
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() != "go":
        break
    t0 = time.perf_counter(); step(); step()
    print(time.perf_counter() - t0, flush=True)
"""

_DECISION: dict[str, Any] = {"mkl_cbwr": None, "source": "not decided (import adaptercl decides)"}


# /proc/cpuinfo's keys -> cpu_fields' names ("model" there is the model number, "model name" the marketing name)
CPUINFO_FIELDS = {
    "vendor_id": "vendor",
    "model name": "model",
    "cpu family": "family",
    "model": "model_number",
    "flags": "flags",
}


def cpu_fields(cpuinfo: str) -> dict[str, Any]:
    """The first processor's vendor, model name, family and model number (which tell CPUs of one marketing name apart,
    e.g. a Zen 4 and a Zen 5 "AMD EPYC") and flags from the text of /proc/cpuinfo."""
    fields: dict[str, Any] = {"vendor": "", "model": "", "family": "", "model_number": "", "flags": []}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        name = CPUINFO_FIELDS.get(key.strip())
        if name and not fields[name]:
            fields[name] = value.split() if name == "flags" else value.strip()
    return fields


def bf16_units(cpuinfo: str) -> list[str]:
    """The bf16 matrix-unit flags (AMX-BF16, AVX512-BF16) the CPU described by `cpuinfo` has ([] for none)."""
    flags = set(cpu_fields(cpuinfo)["flags"])
    return [flag for flag in BF16_UNITS if flag in flags]


@functools.cache
def bf16_matmul_available() -> bool:
    """Whether the CPU has native bf16 matrix instructions (AMX-BF16 or AVX512-BF16; Linux /proc/cpuinfo flags) and
    torch's kernels use them (its CPU capability is AVX512: `ATEN_CPU_CAPABILITY=avx2`, which emulates an AVX2-only
    CPU, turns them off). Elsewhere bf16 would be emulated and no faster: False. Imports torch."""
    import torch

    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    try:
        return bool(bf16_units(CPUINFO.read_text()))
    except OSError:
        return False


def cache_key(cpuinfo: str, torch_version: str, *more: Any) -> str:
    """This CPU (model name and flags), torch's version and anything else a choice depends on (`more`: JSON values),
    hashed: a choice measured for them holds for them."""
    cpu = cpu_fields(cpuinfo)
    text = json.dumps([cpu["model"], sorted(cpu["flags"]), torch_version, *more])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_dir() -> Path:
    """adaptercl's cache (the model cache's root, `model.base.cache_root`'s default) / cpu-kernels."""
    return Path(os.environ.get("ADAPTERCL_CACHE", "~/.cache/adaptercl")).expanduser() / "cpu-kernels"


def branch_from(measurement: dict[str, Any]) -> str | None:
    """The branch a measurement chooses: CANDIDATE where MKL honours it (`effective`) and the median paired ratio of
    its times to MKL's own is below 1 - MARGIN; else None (MKL's own choice)."""
    if measurement.get("effective") != CANDIDATE or measurement.get("ratio") is None:
        return None
    return CANDIDATE if measurement["ratio"] < 1 - MARGIN else None


def measure_mkl_branches(rounds: int = ROUNDS, timeout_s: float = 120.0) -> dict[str, Any]:
    """Measure CANDIDATE against MKL's own branch in two child processes taking turns (module docstring).

    Returns {"effective": the CNR mode MKL reported under MKL_CBWR=CANDIDATE} and, where that is CANDIDATE,
    {"seconds": {branch: [per turn]}, "ratio": median over turns of CANDIDATE's time / MKL's own}."""
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"} | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    children = {CANDIDATE: _start(env | {"MKL_CBWR": CANDIDATE})}
    try:
        effective = _ready(children[CANDIDATE], timeout_s)
        out: dict[str, Any] = {"effective": effective}
        if effective != CANDIDATE:
            return out
        children["AUTO"] = _start(env)
        _ready(children["AUTO"], timeout_s)
        seconds: dict[str, list[float]] = {name: [] for name in children}
        for turn in range(rounds):
            order = list(children) if turn % 2 == 0 else list(reversed(children))  # A B, B A: drift cancels
            for name in order:
                children[name].stdin.write("go\n")
                children[name].stdin.flush()
                seconds[name].append(float(children[name].stdout.readline()))
        ratios = [a / b for a, b in zip(seconds[CANDIDATE], seconds["AUTO"])]
        return out | {"seconds": seconds, "ratio": statistics.median(ratios)}
    finally:
        for child in children.values():
            child.kill()
            child.wait()


def choose_mkl_branch(
    environ: MutableMapping[str, str],
    cpuinfo: str | None,
    cache: Path,
    torch_version: str | None,
    measure: Callable[[], dict[str, Any]],
) -> dict[str, Any]:
    """Decide MKL's branch for this process and set `environ["MKL_CBWR"]` to it when one is chosen; return the
    decision ({"mkl_cbwr": the value in force or None, "source": why, and what was measured}). The order: the user's
    MKL_CBWR; no CPU information or no AVX-512 (nothing to choose); this CPU's cached choice; under a launcher, MKL's
    own; else `measure()` now, cached."""
    if "MKL_CBWR" in environ:
        return {"mkl_cbwr": environ["MKL_CBWR"], "source": "set by the user"}
    if cpuinfo is None or torch_version is None:
        return {"mkl_cbwr": None, "source": "MKL's own: " + ("no /proc/cpuinfo" if cpuinfo is None else "no torch")}
    cpu = cpu_fields(cpuinfo)
    if "avx512f" not in cpu["flags"]:
        return {"mkl_cbwr": None, "source": "MKL's own: no AVX-512, nothing to choose", "cpu": cpu["model"]}
    path = cache / f"{cache_key(cpuinfo, torch_version)}.json"
    record = read_choice(path, "branch")
    if record is None:
        if int(environ.get("WORLD_SIZE", "1")) > 1:
            return {"mkl_cbwr": None, "source": "MKL's own: not measured under a multi-process launcher"}
        try:
            measurement = measure()
        except Exception as err:  # noqa: BLE001 - a measurement that fails leaves MKL's own choice, said
            measurement = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"}
        record = {"cpu": cpu["model"], "torch": torch_version, "branch": branch_from(measurement), **measurement}
        write_choice(path, record)
        source = "measured now"
    else:
        source = f"measured earlier ({path})"
    if record["branch"] is not None:
        environ["MKL_CBWR"] = record["branch"]
    why = "error" if "error" in record else "" if record.get("effective") == CANDIDATE else "MKL ignores MKL_CBWR=AVX2"
    return {"mkl_cbwr": record["branch"], "source": source + (f": {why}" if why else ""), **record}


def prefer_fast_mkl_path() -> dict[str, Any]:
    """`choose_mkl_branch` for this process (os.environ, /proc/cpuinfo, the cache, the installed torch); kept as
    `decision()`. Called by `import adaptercl`."""
    try:
        cpuinfo = CPUINFO.read_text()
    except OSError:  # not Linux
        cpuinfo = None
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = None
    _DECISION.clear()
    _DECISION.update(choose_mkl_branch(os.environ, cpuinfo, cache_dir(), torch_version, measure_mkl_branches))
    return dict(_DECISION)


def decision() -> dict[str, Any]:
    """What `import adaptercl` decided for MKL's branch in this process, and why (for the run's record)."""
    return dict(_DECISION)


def _start(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PROBE], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)  # fmt: skip


def _ready(child: subprocess.Popen, timeout_s: float) -> str | None:
    """Read the child's lines up to "ready"; the CNR mode MKL reported (None: none seen). A child not ready within
    `timeout_s` is killed (its output then ends: an error)."""
    import threading

    watchdog = threading.Timer(timeout_s, child.kill)
    watchdog.start()
    mode = None
    try:
        for line in child.stdout:
            found = re.search(r"\bCNR:(\S+)", line)
            mode = found.group(1) if found else mode
            if line.strip() == "ready":
                return mode
    finally:
        watchdog.cancel()
    raise RuntimeError(f"the MKL probe exited ({child.wait()}) before it was ready (within {timeout_s:.0f} s?)")


def read_choice(path: Path, field: str) -> dict[str, Any] | None:
    """A cached choice (a JSON object with `field`), or None: absent or damaged, to be measured again."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and field in record else None


def write_choice(path: Path, record: dict[str, Any]) -> None:
    """Cache a choice; a read-only cache keeps nothing (measured again next time)."""
    from adaptercl.system.atomic import write_json  # only when a measurement is new: atomic imports the grammar

    try:
        write_json(path, record)
    except OSError:  # a read-only cache: measured again next time
        pass
