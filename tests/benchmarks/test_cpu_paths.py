"""benchmarks/perf/cpu_paths.py --part train: each shape's packed variant runs the frozen layer on its oneDNN pack
(the forward and the input gradient through the packed W^T, as `run_stage` trains), the plain one MKL's F.linear,
interleaved, and the record holds every shape's seconds and paired ratio."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pytest
from packing_counts import counting_packs

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "perf"))
import cpu_paths  # noqa: E402

from adaptercl.rollout import packed_weights as pw  # noqa: E402


def test_train_part_times_the_packed_product_and_the_plain_one(monkeypatch):
    if not pw.onednn_available():
        pytest.skip("this torch has no oneDNN packed-linear ops")
    calls = counting_packs(monkeypatch)
    monkeypatch.setattr(cpu_paths, "TRAIN_SHAPES", {"small": (24, 16), "wide": (40, 16)})
    rounds = 3
    result = cpu_paths.run_train(argparse.Namespace(prompts=1, group=2, tokens=3, rounds=rounds))
    assert result["rows"] == 6 and list(result["shapes"]) == ["small [24, 16]", "wide [40, 16]"]
    # per shape: one warm-up and `rounds` timed turns of the packed variant, each a forward and a backward
    assert (calls["product"], calls["grad_input"]) == (2 * (1 + rounds), 2 * (1 + rounds))
    for record in result["shapes"].values():
        assert [record["seconds"][v]["n"] for v in ("plain", "packed")] == [rounds, rounds]
        assert math.isfinite(record["paired_ratio_packed_to_plain"]) and record["paired_ratio_packed_to_plain"] > 0


def test_choice_part_reports_the_runs_measurement_and_its_choice_per_thread_count(monkeypatch):
    """`--part choice` times `packed_choice.measure` (the packed path, counted) at one and two threads, gives each
    use's ratio and the choice `pays_from` makes of it, and puts torch's thread count back."""
    if not pw.onednn_available():
        pytest.skip("this torch has no oneDNN packed-linear ops")
    import torch

    from adaptercl.rollout import packed_choice

    calls = counting_packs(monkeypatch)
    monkeypatch.setattr(packed_choice, "REPEATS", {"decode": 1, "sequences": 1})
    threads = torch.get_num_threads()
    result = cpu_paths.run_choice(argparse.Namespace(rounds=1))
    assert torch.get_num_threads() == threads and list(result) == ["1 thread", "2 threads"]
    assert calls["product"] == 2 * 2 * 2 * 2  # thread counts x uses x shapes x (warm-up + one turn)
    for uses in result.values():
        assert list(uses) == ["decode", "sequences"]
        for record in uses.values():
            assert record["packed"] == packed_choice.pays_from(record) and record["ratio"] > 0
    assert "| 2 threads | sequences |" in cpu_paths.markdown(
        {"cpu": {"model": "m", "flags": [], "torch_cpu_capability": "AVX512"}, "choice": result}
    )


def test_the_summary_names_the_cpu_by_family_and_model_number():
    """Two CPUs of one name (a Zen 4 and a Zen 5 'AMD EPYC') are told apart in the heading; an older result without
    the fields keeps its heading."""
    cpu = {"model": "AMD EPYC", "flags": ["avx2", "avx512f"], "torch_cpu_capability": "AVX512"}
    heading = cpu_paths.markdown({"cpu": cpu | {"family": "26", "model_number": "2"}}).splitlines()[0]
    assert heading == "### CPU paths on AMD EPYC (family 26 model 2; avx2, avx512f; torch AVX512)"
    assert (
        cpu_paths.markdown({"cpu": cpu}).splitlines()[0] == "### CPU paths on AMD EPYC (avx2, avx512f; torch AVX512)"
    )
