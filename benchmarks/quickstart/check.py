"""Does the code still give the committed quickstart result? CI runs this after the tests (`.ci/run`).

    python benchmarks/quickstart/check.py            # runs recipes/quickstart.yaml into a temporary folder
    python benchmarks/quickstart/check.py --run DIR  # or compares a finished run

The run's summary.json (accuracy matrix, CL metrics, stages and their adapters) must equal the committed one for
the numeric path this process takes: the quickstart samples its rollouts, so float32 rounding that differs between
CPUs' kernels can change a sampled token and with it the run (results.md: the same revision gives mcq 0.300 on an
AVX512-BF16 CPU, 0.267 as an AVX2 CPU computes). Where torch's CPU capability is AVX2 (an AVX2-only CPU, or any x86
CPU under `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_CBWR=AVX2`, as CI runs it) the result is
summary-avx2.json, elsewhere summary.json. Both were computed on the packed linear weights, so the run it makes
takes them (`ADAPTERCL_PACKED_WEIGHTS=on`) whatever this CPU's measurement would choose (`rollout/packed_choice.py`:
a CPU where they do not pay computes in another summation order). A change that moves the quickstart's learning
fails here until the committed file is regenerated (`--update` writes it from the run) and results.md says why it
moved. Prints the wall time of the run it made (a figure, never a pass/fail criterion: machines differ).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def committed_file() -> Path:
    """The committed summary for this process's numeric path (module docstring)."""
    import torch

    return HERE / ("summary-avx2.json" if torch.backends.cpu.get_cpu_capability() == "AVX2" else "summary.json")


def run_quickstart(out: Path) -> float:
    """`adaptercl recipe run recipes/quickstart.yaml output_dir=OUT` as a user runs it; its wall time in seconds."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ADAPTERCL_PACKED_WEIGHTS": "on"}  # the committed results' path
    cmd = [sys.executable, "-m", "adaptercl.cli", "recipe", "run", str(REPO / "recipes" / "quickstart.yaml")]
    start = time.perf_counter()
    subprocess.run([*cmd, f"output_dir={out}"], check=True, env=env, cwd=REPO)
    return time.perf_counter() - start


def differences(committed: dict, produced: dict) -> list[str]:
    """One line per top-level key whose value differs (the accuracy matrix printed in full)."""
    lines = []
    for key in sorted(committed.keys() | produced.keys()):
        if committed.get(key) != produced.get(key):
            lines.append(
                f"{key}: committed {json.dumps(committed.get(key))}\n{' ' * len(key)}  produced  "
                f"{json.dumps(produced.get(key))}"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, help="a finished quickstart run directory to compare instead of running")
    parser.add_argument("--update", action="store_true", help="write the run's summary.json over the committed one")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="quickstart-check-") as tmp:
        run = args.run
        if run is None:
            run = Path(tmp) / "run"
            print(f"quickstart wall time: {run_quickstart(run):.0f} s", flush=True)
        produced_text = (run / "summary.json").read_text()
        committed = committed_file()
        if args.update:
            committed.write_text(produced_text)
            print(f"wrote {committed.relative_to(REPO)}")
            return 0
        diff = differences(json.loads(committed.read_text()), json.loads(produced_text))
    if diff:
        print(f"the quickstart no longer gives the committed result ({committed.relative_to(REPO)}):")
        print("\n".join(diff))
        return 1
    print(f"quickstart result equals {committed.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
