"""`rollout.dtype` (`rollout/precision.py`, `hf.py`): the sampler's own logprobs are the trainer's definition, the
bf16 engine samples on bf16 weights (an unfolded LoRA kept float32) and hands its logprobs to the trainer, greedy
decoding stays float32, `auto` resolves by the CPU, a bf16 request on a CPU without bf16 units or with a vLLM engine
is one line, and the run records what it computed with in cpu_paths.jsonl."""

from __future__ import annotations

import json

import pytest
import torch

from adaptercl.adapters.live import attach_adapter, use_adapters
from adaptercl.recipe import RecipeError
from adaptercl.recipe.grammar import LoraConfig, resolve_recipe
from adaptercl.rollout import SamplingParams, packed_weights, precision
from adaptercl.rollout import hf as hf_engine
from adaptercl.rollout.hf import HFEngine, response_logprobs
from adaptercl.system import cpu_kernels

PROMPTS = [[5, 6, 7, 8, 9], [20, 21], [5, 6, 7, 30]]
ADAPTER = ["policy"]  # rolled out under the adapter, as the trainer's logprobs are computed (it stays active)
INTEL_NO_BF16 = "vendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) X\nflags\t\t: fpu avx2 avx512f amx_tile\n"
AMD_BF16 = "vendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9004\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"


@pytest.fixture(scope="module")
def tiny():
    """tiny-random with a LoRA adapter whose B is not zero (so the adapter changes the policy)."""
    from adaptercl.model.base import load_base
    from adaptercl.recipe.grammar import ModelConfig

    base = load_base(ModelConfig(name="tiny-random"), "none")
    torch.manual_seed(0)
    lora = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    model = attach_adapter(base.model, "policy", lora)
    use_adapters(model, ["policy"], trainable="policy")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    model.eval()
    return model, base.tokenizer


def tokens_and_logprobs(groups):
    rows = [c for g in groups for c in g]
    return rows, [c.token_ids for c in rows], [c.logprobs for c in rows]


def test_the_samplers_own_logprobs_are_the_trainers_definition(tiny):
    """In float64 (no packing, no batch-size rounding to speak of): the logprobs the bf16-mode engine returns from its
    decoding loop equal `response_logprobs`' teacher-forced ones under logits / T cut to the top-p nucleus. Bound: the
    logits of the loop's cached forward and the teacher-forced one differ by float64 summation order, n·u·Σ|terms|
    ~ 64 x 1.1e-16 x 1e2 ~ 1e-12 (hidden size 64, terms O(1e2) at most), twice that after the log-softmax; 1e-10."""
    model, tokenizer = tiny
    model.double()
    try:
        engine = HFEngine(model, tokenizer, dtype=torch.bfloat16)  # a float64 model packs nothing: plain float64
        params = SamplingParams(10, temperature=1.3, top_p=0.9, n=2, seed=3)
        rows, _, own = tokens_and_logprobs(engine.generate(PROMPTS, ADAPTER, params))
        reference = response_logprobs(model, rows, tokenizer.pad_token_id, 1.3, 0.9)
    finally:
        model.float()
    assert all(len(lp) == len(c.token_ids) for lp, c in zip(own, rows))
    assert max(abs(a - b) for lp, ref in zip(own, reference) for a, b in zip(lp, ref)) < 1e-10


@pytest.mark.parametrize("fold", [True, False])
def test_a_bf16_engine_samples_on_bf16_weights_and_returns_its_own_logprobs(tiny, monkeypatch, fold):
    """The engine asks for bf16 packing (the LoRA folded in first, or kept float32 beside), and its rows carry the
    sampler's own logprobs, another policy's than the trainer's where oneDNN's bf16 product runs (float32's where it
    does not)."""
    model, tokenizer = tiny
    seen = []
    original = hf_engine.packed_linears

    def recording(m, dtype=torch.float32, keep_float32=frozenset()):
        seen.append((dtype, keep_float32))
        return original(m, dtype, keep_float32)

    monkeypatch.setattr(hf_engine, "packed_linears", recording)
    params = SamplingParams(8, temperature=1.0, n=2, seed=5)
    folds = []
    monkeypatch.setattr(hf_engine, "folded_lora", lambda m, real=hf_engine.folded_lora: folds.append(m) or real(m))
    engine = HFEngine(model, tokenizer, fold_lora=fold, dtype=torch.bfloat16)
    rows, _, own = tokens_and_logprobs(engine.generate(PROMPTS, ADAPTER, params))
    (dtype, kept), *_ = seen
    assert len(folds) == int(fold)
    lora = {id(m) for name, m in model.named_modules() if ".lora_A." in name or ".lora_B." in name}
    assert dtype == torch.bfloat16 and kept == lora and len(lora) == 2 * 3 * model.config.num_hidden_layers
    trainer = response_logprobs(model, rows, tokenizer.pad_token_id, 1.0)  # float32, unpacked: the trainer's
    assert all(lp is not None and len(lp) == len(c.token_ids) for lp, c in zip(own, rows))
    # float32 in another summation order moves a logprob by ~n·u·|logits| ~ 64 x 6e-8 x 10 ~ 4e-5 at most here
    # (hidden 64, logits O(10)); bf16 rounds every weight and activation by up to 2^-9 ~ 2e-3 of it: 1e-4 between
    gap = max(abs(a - b) for lp, ref in zip(own, trainer) for a, b in zip(lp, ref))
    if packed_weights.onednn_available(torch.bfloat16):
        assert gap > 1e-4  # another policy: the trainer's mismatch weights have something to correct
    else:  # oneDNN's bf16 product does not run here (CI's AVX2 emulation): float32 plain, the trainer's own policy
        assert gap < 1e-4


def test_greedy_decoding_stays_float32_in_a_bf16_engine(tiny):
    model, tokenizer = tiny
    params = SamplingParams(8, greedy=True)
    fp32 = HFEngine(model, tokenizer).generate(PROMPTS, ADAPTER, params)
    bf16 = HFEngine(model, tokenizer, dtype=torch.bfloat16).generate(PROMPTS, ADAPTER, params)
    assert tokens_and_logprobs(bf16)[1] == tokens_and_logprobs(fp32)[1]
    assert all(c.logprobs is None for g in bf16 for c in g)  # none asked for, none needed: on-policy


def test_auto_is_bfloat16_only_for_a_float32_cpu_model_where_the_units_and_the_kernel_run(tiny, monkeypatch):
    model, _ = tiny
    assert precision.rollout_dtype("float32", model) == torch.float32
    assert precision.rollout_dtype("bfloat16", model) == torch.bfloat16
    for units, kernel, expected in [(True, True, torch.bfloat16), (False, True, torch.float32), (True, False, torch.float32)]:  # fmt: skip
        monkeypatch.setattr(cpu_kernels, "bf16_matmul_available", lambda u=units: u)
        monkeypatch.setattr(packed_weights, "onednn_available", lambda dtype, k=kernel: k)
        assert precision.rollout_dtype("auto", model) == expected, (units, kernel)
    monkeypatch.setattr(cpu_kernels, "bf16_matmul_available", lambda: True)
    monkeypatch.setattr(packed_weights, "onednn_available", lambda dtype: True)
    assert precision.rollout_dtype("auto", torch.nn.Linear(2, 2).double()) == torch.float32  # not float32: no gain


def quickstart(**rollout) -> object:
    from adaptercl.recipe.load import load_recipe

    return load_recipe("recipes/quickstart.yaml", [f"rollout.{k}={v}" for k, v in rollout.items()])


def test_bfloat16_on_a_cpu_without_bf16_units_is_one_line_naming_them(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    monkeypatch.setattr(precision, "CPUINFO", info)
    info.write_text(INTEL_NO_BF16)
    with pytest.raises(RecipeError) as refused:
        precision.check_rollout_dtype(quickstart(dtype="bfloat16"), cuda_devices=0)
    line = str(refused.value)
    assert "\n" not in line and "rollout.dtype: bfloat16" in line and "amx_bf16 or avx512_bf16" in line
    assert "Intel(R) Xeon(R) X has neither" in line and "set rollout.dtype: float32" in line
    precision.check_rollout_dtype(quickstart(dtype="auto"), cuda_devices=0)  # auto picks float32 there: fine
    precision.check_rollout_dtype(quickstart(dtype="bfloat16"), cuda_devices=1)  # a GPU run: model.dtype there
    info.write_text(AMD_BF16)
    precision.check_rollout_dtype(quickstart(dtype="bfloat16"), cuda_devices=0)


@pytest.mark.parametrize("engine", ["vllm", "vllm_server"])
def test_rollout_dtype_with_a_vllm_engine_is_one_line(engine):
    from adaptercl.recipe.load import load_recipe

    server = ["rollout.server.url=http://127.0.0.1:8000"] if engine == "vllm_server" else []
    with pytest.raises(RecipeError, match=rf"dtype is the transformers engine's .* engine {engine} .* remove rollout"):
        load_recipe("recipes/quickstart.yaml", [f"rollout.engine={engine}", "rollout.dtype=float32", *server])
    recipe = load_recipe("recipes/quickstart.yaml", [f"rollout.engine={engine}", *server])  # the quickstart's auto
    assert recipe.stages[0].rollout.dtype == "auto"  # fine: the engine's own dtype


def test_a_run_records_what_it_computed_with(tmp_path):
    """A one-step run with rollout.dtype auto: cpu_paths.jsonl's line holds MKL's decision (this
    process's), the packed path per dtype and the dtype auto chose here; on bf16 rollouts the step logs the
    rollout-mismatch weight (the engine's own logprobs reached the trainer)."""
    from adaptercl.run.sequence import run_recipe

    raw = {
        "model": {"name": "tiny-random"},
        "output_dir": str(tmp_path / "run"),
        "lora": {"r": 4, "alpha": 8},
        "optim": {"lr": 5e-3, "steps": 1, "prompts_per_step": 2},
        "rollout": {"group_size": 2, "max_new_tokens": 6, "dtype": "auto"},
        "eval": {"examples_per_domain": 2, "drift_probes": 0, "stage_kl_prompts": 0},
        "domains": [{"name": "arith", "source": "builtin:arithmetic", "reward": "tiny_rewards:digit_fraction"}],
        "stages": [{"name": "one", "domain": "arith"}],
    }
    run_recipe(resolve_recipe(raw))
    (record,) = [json.loads(line) for line in (tmp_path / "run" / "cpu_paths.jsonl").read_text().splitlines()]
    assert not (tmp_path / "run" / "rollout_engine.jsonl").exists()  # no engine switch
    assert record["mkl"] == cpu_kernels.decision() and record["mkl"]["source"]
    on = "on" if packed_weights.onednn_available(torch.bfloat16) else record["packed_weights"]["bfloat16"]
    assert record["packed_weights"]["bfloat16"] == on
    on32 = packed_weights.onednn_available(torch.float32)
    assert record["training_base_products"] == ("oneDNN, packed" if on32 else "F.linear (MKL)")
    assert record["decode_products"] == record["training_base_products"]  # the suite sets the packs (conftest.py)
    set_by = {"packed": True, "source": "set by ADAPTERCL_PACKED_WEIGHTS"}
    assert record["packed_choice"] == ({"decode": set_by, "sequences": set_by} if on32 else {})
    expected = "bfloat16" if cpu_kernels.bf16_matmul_available() and on == "on" else "float32"
    assert record["rollout_dtype"] == expected
    steps = [
        json.loads(line) for line in (tmp_path / "run" / "stage-01-one" / "metrics.jsonl").read_text().splitlines()
    ]
    weights = [r["rollout_is_weight"] for r in steps if "rollout_is_weight" in r]
    assert len(weights) == (1 if expected == "bfloat16" else 0)
