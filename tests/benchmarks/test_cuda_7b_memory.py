"""benchmarks/perf/cuda_7b_memory.py --tiny: the 7B step's script runs its code path on the CPU (a 2-layer Qwen2 from
random_checkpoint.py, adaptercl's adapter, teacher and training step), the checkpoint has the shape asked for and is
reused, and the step trains."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "perf"))
import random_checkpoint  # noqa: E402


def test_the_tiny_step_runs_on_a_random_checkpoint_of_the_shape_asked(tmp_path):
    script = REPO / "benchmarks" / "perf" / "cuda_7b_memory.py"
    checkpoint = tmp_path / "checkpoint"
    command = [sys.executable, str(script), "--tiny", "--steps", "1", "--out", str(tmp_path),
               "--checkpoint-dir", str(checkpoint)]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run(command, check=True, capture_output=True, env=env, timeout=600)
    result = json.loads((tmp_path / "cuda_7b_memory-tiny.json").read_text())
    assert result["complete"] is True
    config = json.loads((checkpoint / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        assert config[key] == random_checkpoint.TINY[key], key
    (variant,) = result["variants"]
    losses = [step["loss"] for step in variant["steps"]]
    assert len(losses) == 2 and losses[0] != losses[1]  # warm-up + 1 timed step; the first update moved the loss
    written = (checkpoint / "model-00001-of-00001.safetensors").stat().st_mtime_ns
    assert random_checkpoint.write_random_checkpoint(random_checkpoint.TINY, checkpoint, "cpu") == checkpoint
    assert (checkpoint / "model-00001-of-00001.safetensors").stat().st_mtime_ns == written  # reused, not rewritten
