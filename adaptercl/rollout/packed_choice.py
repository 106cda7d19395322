"""Whether the packed linear weights (`packed_weights.py`) pay on this CPU: measured once per CPU, not assumed from
the vendor, and cached, for each of the two ways adaptercl multiplies by them.

- `decode`: a decode step's products, a handful of rows (8) by every weight, no gradient (the hf engine's float32
  decode block). Plain `F.linear` calls MKL's sgemm, which re-packs the weight panel on every call.
- `sequences`: whole sequences at once (384 rows), forward and the input's gradient (a training stage's frozen base,
  `packed_base_linears`; the scoring forwards of the evaluation and the diagnostics are its forward half).

Measured on AMD EPYC (Zen 4 and 5), where MKL computes on its AVX2 branch whatever the CPU has and oneDNN on AVX-512,
the packed path is 2.2-2.6x faster in both (a Zen 4 EPYC at 1 and 2 threads, `benchmarks/perf/cpu_paths.py --part
choice`); on a CPU whose MKL runs at the CPU's full width (Intel's, with AVX-512) the many-row products may be as fast
plain. So: at the first float32 block of a use in a process, `packed_weights.packs_pay(use)` looks this CPU's answer up
in adaptercl's cache (`$ADAPTERCL_CACHE`, default ~/.cache/adaptercl, `cpu-kernels/packed-<use>-<key>.json`, keyed by
the CPU's model name and flags, torch's version, torch's thread count, torch's CPU capability, and `ONEDNN_MAX_CPU_ISA`
and `MKL_CBWR` as set: each changes the kernels) and, without one, measures (`measure`, 0.1 s for the decode, 0.35 s
for sequences on that EPYC): SmolLM2-135M's MLP shapes ([1536, 576] and [576, 1536]), plain and packed taking turns (A
B, B A), the median of the paired ratios packed / plain. The plain path is chosen only when the packs are slower by
more than `MARGIN` (the paired ratios of a quiet core spread ~1-2 %): a tie keeps the packs, the path every committed
result was computed on. A process under a multi-process launcher (`WORLD_SIZE` > 1) only reads the cache (ranks
measuring at once would disturb each other), else keeps the packs; a measurement that fails keeps them too, and says
why in the record.

The two paths compute the same products, in a different float32 summation order (`packed_weights.py`): a run's
numbers depend on the path as they depend on the CPU, so the path is recorded in the run's cpu_paths.jsonl
(`rollout.precision.cpu_paths`). `ADAPTERCL_PACKED_WEIGHTS=on` (or `off`) sets both uses and skips the measurement:
the test suite and `benchmarks/quickstart/check.py` set `on`, the path their committed results were computed on.
A bf16 block (`rollout.dtype: bfloat16`) always packs: bf16 products have no plain path here.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal

from adaptercl.recipe import RecipeError

Use = Literal["decode", "sequences"]
USES: dict[str, tuple[int, bool]] = {"decode": (8, False), "sequences": (384, True)}  # use -> (rows, input gradient)
SHAPES = ((1536, 576), (576, 1536))  # [out, in]: SmolLM2-135M's MLP up (and gate) and down projections
REPEATS = {"decode": 20, "sequences": 1}  # products per shape in a turn: a turn of either takes ~5-30 ms on one core
ROUNDS = 7  # turns of each path
MARGIN = 0.05  # the plain path is chosen only when the packs are slower by more than 5 %
ENV = "ADAPTERCL_PACKED_WEIGHTS"
SETTINGS = {"on": True, "off": False}


Block = Callable[..., AbstractContextManager[int]]  # packed_weights.packed_linears (handed in: it asks this module)


def measure(use: Use, packed_linears: Block, rounds: int = ROUNDS) -> dict[str, Any]:
    """Time `use`'s products on SHAPES, plain (`F.linear`) and packed (inside `packed_linears`), taking turns in
    this process with its threads. Returns {"seconds": {"plain": [per turn], "packed": [...]}, "ratio": the median of
    packed / plain over turns}. Outside whatever block the caller is in (a process's first block may be opened under
    no_grad, CPU autocast or inference mode, where the packs would not run), and with torch's global random state
    put back after (building the layers draws from it: a run that measures must draw what one that reads the cache
    draws)."""
    import torch

    with torch.random.fork_rng(devices=[]), torch.inference_mode(False), torch.autocast("cpu", enabled=False):
        return _timed(use, packed_linears, rounds)


def _timed(use: Use, packed_linears: Block, rounds: int) -> dict[str, Any]:
    import torch

    rows, gradient = USES[use]
    generator = torch.Generator().manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(n_in, n_out, bias=False) for n_out, n_in in SHAPES)
    layers.requires_grad_(False)
    inputs = [torch.randn(rows, n_in, generator=generator).requires_grad_(gradient) for _, n_in in SHAPES]  # [rows,in]
    upstream = [torch.randn(rows, n_out, generator=generator) for n_out, _ in SHAPES]  # [rows, out]

    def products(forward: Callable) -> None:
        with torch.set_grad_enabled(gradient):
            for layer, x, up in zip(layers, inputs, upstream):
                for _ in range(REPEATS[use]):
                    y = forward(layer, x)  # [rows, out]
                    if gradient:
                        y.backward(up)
                        x.grad = None

    paths = {
        "plain": lambda layer, x: torch.nn.functional.linear(x, layer.weight),
        "packed": lambda layer, x: layer(x),  # the layer's forward inside the block: its pack's product
    }
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    with packed_linears(layers) as packed:
        if packed == 0:
            raise RuntimeError("the packed path does not run here (packed_weights.onednn_refusal)")
        for forward in paths.values():  # warm-up: kernels built, the packed W and W^T made
            products(forward)
        for turn in range(rounds):
            for name in paths if turn % 2 == 0 else reversed(list(paths)):
                start = time.perf_counter()
                products(paths[name])
                seconds[name].append(time.perf_counter() - start)
    ratios = [p / q for p, q in zip(seconds["packed"], seconds["plain"])]
    return {"seconds": seconds, "ratio": statistics.median(ratios)}


def check_packed_setting(environ: Mapping[str, str]) -> None:
    """`ENV`, where set, is one of SETTINGS: else one RecipeError line (preflight; torch-free)."""
    setting = environ.get(ENV)
    if setting is not None and setting not in SETTINGS:
        raise RecipeError(f"{ENV}={setting!r}: set it to one of {', '.join(SETTINGS)}, or unset it to measure")


def pays_from(measurement: dict[str, Any]) -> bool:
    """Whether a measurement keeps the packs: yes unless they were slower than plain by more than MARGIN (a failed
    measurement, with no ratio, keeps them)."""
    ratio = measurement.get("ratio")
    return ratio is None or ratio <= 1 + MARGIN


def choose(
    use: Use,
    environ: Mapping[str, str],
    cache: Path,
    key: str,
    measure_now: Callable[[], dict[str, Any]],
) -> dict[str, Any]:
    """The decision for `use`: {"packed": bool, "source": why, and what was measured}. The order: `ENV` as set; this
    CPU's cached answer (`cache`/packed-<use>-<key>.json); under a launcher, the packs; else `measure_now()`,
    cached."""
    from adaptercl.system import read_choice, write_choice

    check_packed_setting(environ)
    if ENV in environ:
        return {"packed": SETTINGS[environ[ENV]], "source": f"set by {ENV}"}
    path = cache / f"packed-{use}-{key}.json"
    record = read_choice(path, "packed")
    if record is not None:
        return {**record, "source": f"measured earlier ({path.name})"}
    if int(environ.get("WORLD_SIZE", "1")) > 1:
        return {"packed": True, "source": "the packs: not measured under a multi-process launcher"}
    try:
        measurement = measure_now()
    except Exception as err:  # noqa: BLE001 - a measurement that fails keeps the packs, said
        measurement = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"}
    record = {"packed": pays_from(measurement), **measurement}
    write_choice(path, record)
    return {**record, "source": "measured now"}


def kernel_key() -> str:
    """This process's kernels for the products: the CPU (model, flags), torch's version, thread count and CPU
    capability, and the ISA and MKL settings in force, hashed (`cpu_kernels.cache_key`)."""
    import torch

    from adaptercl.system import cpu_kernels

    return cpu_kernels.cache_key(
        _cpuinfo(),
        torch.__version__,
        torch.get_num_threads(),
        torch.backends.cpu.get_cpu_capability(),
        os.environ.get("ONEDNN_MAX_CPU_ISA"),
        os.environ.get("MKL_CBWR"),
    )


@functools.cache
def _cpuinfo() -> str:
    """/proc/cpuinfo's text, read once ("" where there is none: the rest of the key still holds)."""
    from adaptercl.system import CPUINFO

    try:
        return CPUINFO.read_text()
    except OSError:
        return ""


@functools.cache
def _decision(
    use: Use, packed_linears: Block, setting: str | None, world_size: str | None, key: str, cache: Path
) -> dict[str, Any]:
    environ = {name: value for name, value in ((ENV, setting), ("WORLD_SIZE", world_size)) if value is not None}
    return choose(use, environ, cache, key, lambda: measure(use, packed_linears))


def decision(use: Use, packed_linears: Block) -> dict[str, Any]:
    """This process's decision for `use` (module docstring), made once per setting of `ENV`, kernels and cache;
    `packed_linears` is the block a measurement times (`packed_weights.packed_linears`, which asks through
    `packed_weights.packs_pay`)."""
    from adaptercl.system import cpu_kernels

    cache = cpu_kernels.cache_dir()
    return dict(_decision(use, packed_linears, os.environ.get(ENV), os.environ.get("WORLD_SIZE"), kernel_key(), cache))
