"""benchmarks/perf/checkpointed_sharing.py at the tiny shape: under activation checkpointing the shared-prefix layout
computes fewer positions than the plain one and gives its gradients (the figures the committed result reports)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "perf"))
import checkpointed_sharing  # noqa: E402


def test_the_shared_layout_computes_fewer_positions_and_the_same_gradients(tmp_path):
    if not (checkpointed_sharing.DATA / "tooluse").is_dir():
        pytest.skip(f"real datasets not found: {checkpointed_sharing.DATA / 'tooluse'}")
    argv = ["--model", "tiny-random", "--response", "4", "--reps", "1", "--out", str(tmp_path)]
    assert checkpointed_sharing.main(argv) == 0
    result = json.loads((tmp_path / "checkpointed_sharing-tiny-random.json").read_text())
    prompt = result["workload"]["prompt_tokens"][0]
    # 4 rows of one prompt: plain 4 x (P + 4); shared: the prefix (P - 1) once + 4 x (1 own + 4 - 1 response)
    assert result["positions"] == {"plain": 4 * (prompt + 4), "shared": prompt - 1 + 4 * 4}
    # float32, two summation orders: within 1e-4 of each tensor's largest entry (tests/model/test_batching.py)
    assert 0 < result["gradient_max_difference_over_scale"] < 1e-4
