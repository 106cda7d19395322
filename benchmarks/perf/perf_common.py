"""What the benchmarks/perf scripts share beyond benchmarks/provenance.py: where results go, the workload options.

Results are written to `benchmarks/perf/results/` through a temporary name and a rename, so a killed run never
leaves a half-written file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"


def name_part(text: str) -> str:
    """`text` as part of a result's file or folder name: lower-case, each run of other characters one dash."""
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


def write_result(name: str, payload: dict[str, Any], out_dir: Path | None = None) -> Path:
    """Write `payload` as `out_dir/name.json` (default RESULTS_DIR) atomically: temporary file, then rename."""
    from adaptercl.system.atomic import write_json

    target = (out_dir or RESULTS_DIR) / f"{name}.json"
    write_json(target, payload)
    return target


def add_workload_arguments(
    parser, model: str = "tiny-random", prompts_per_step: int = 4, max_new_tokens: int = 48
) -> None:
    """The workload options the CPU scripts share: model, prompts x samples x tokens, LoRA rank."""
    parser.add_argument("--model", default=model, help="tiny-random, smollm2-135m-instruct or a local folder")
    parser.add_argument("--prompts-per-step", type=int, default=prompts_per_step)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
