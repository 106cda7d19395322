"""benchmarks/perf/rehearse_24gb.py at the tiny shape on CPU: a thin caller of `adaptercl recipe rehearse
--random-weights` on recipes/hybrid.yaml with synthetic domains; every stage's real loop runs, measured, and the JSON
is the command's with what the script changed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from adaptercl.plan.rehearsal import read_rehearsal
from adaptercl.run.rehearsal import STEPS

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "perf"))
import rehearse_24gb  # noqa: E402


def test_the_tiny_rehearsal_is_the_commands_on_synthetic_domains(tmp_path, monkeypatch, capsys):
    import adaptercl.model.batching as batching

    replayable, prefill = [], batching.prefill
    monkeypatch.setattr(batching, "prefill", lambda *a, **k: replayable.append(k["replayable"]) or prefill(*a, **k))
    monkeypatch.setenv("ADAPTERCL_CACHE", str(tmp_path / "cache"))  # the random checkpoint is written here
    assert rehearse_24gb.main(["--tiny", "--prompt-tokens", "96", "--out", str(tmp_path / "out")]) == 0
    assert True in replayable  # CUDA's path: the training forwards share the group's prompt under checkpointing
    result = read_rehearsal(tmp_path / "out" / "rehearsal.json")
    assert result["random_weights"] and result["recipe"]["file"] == "recipes/hybrid.yaml"
    assert result["failed"] is None and result["engine"]["engine"] == "hf"  # no vLLM on the CPU: transformers
    assert list(result["stages"]) == ["math", "science", "tooluse"]
    assert all(len(stage["steps"]) == STEPS for stage in result["stages"].values())
    changes = result["benchmark"]["changes"]
    assert changes["domains"] == "math, science, tooluse: synthetic gsm8k-format rows (sums), prompts of 96 tokens"
    assert result["benchmark"]["card"] is None  # no card to cap on the CPU
    assert (tmp_path / "cache" / "random-weights").is_dir()  # the model's shape with random weights, written once
    printed = capsys.readouterr().out
    assert printed == (tmp_path / "out" / "rehearsal.md").read_text().split("```\n")[1]
    assert "math training step" in printed and "/tmp" not in json.dumps(result["recipe"])


def test_the_synthetic_prompts_have_the_length_asked(tmp_path):
    from adaptercl.domains.datasets_formats import GSM8K_SYSTEM, chat
    from adaptercl.model.base import build_byte_tokenizer
    from adaptercl.model.batching import encode_chat

    rehearse_24gb.write_domain(tmp_path, 300)
    tok = build_byte_tokenizer()
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 64 and {len(encode_chat(tok, chat(r["question"], GSM8K_SYSTEM))) for r in rows} == {300}
