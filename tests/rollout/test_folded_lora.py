"""Folding LoRA into float32 base weights while generating: same outputs, same rollouts, and the base weights,
active adapters and trainable flags come back bit-identical, also after an error; quantised and half-precision
bases are left unfolded."""

from __future__ import annotations

import pytest
import torch

from adaptercl.adapters.live import active_adapters, attach_adapter, lora_parameters, set_trainable
from adaptercl.model.base import load_base
from adaptercl.recipe.grammar import LoraConfig, ModelConfig
from adaptercl.rollout import SamplingParams
from adaptercl.rollout.folded_lora import folded_lora
from adaptercl.rollout.hf import HFEngine


def two_adapter_model(quantization: str = "none"):
    base = load_base(ModelConfig(name="tiny-random"), quantization)
    model = attach_adapter(base.model, "student", LoraConfig(r=4, alpha=8))
    attach_adapter(model, "earlier", LoraConfig(r=2, alpha=2, target_modules=["q_proj", "v_proj"]))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name in ("student", "earlier"):
            for p in lora_parameters(model, name).values():
                p.add_(0.2 * torch.randn(p.shape, generator=g))  # B != 0: both adapters change the logits
    set_trainable(model, "student")
    return model.eval(), base.tokenizer


def base_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


def test_folded_forward_matches_unfolded_and_everything_is_restored():
    model, tok = two_adapter_model()
    ids = torch.tensor([tok("what is two plus two?")["input_ids"]])
    before = base_weights(model)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    with active_adapters(model, ["student", "earlier"]), torch.no_grad():
        unfolded = model(ids).logits
        with folded_lora(model) as count:
            folded = model(ids).logits
            changed = [n for n, p in model.named_parameters() if n in before and not torch.equal(p, before[n])]
        after = model(ids).logits
    assert count == 7 * model.config.num_hidden_layers  # every adapted linear layer of the student
    assert changed and all("base_layer" in n for n in changed)  # W really held W + BA inside the block
    torch.testing.assert_close(folded, unfolded, rtol=1e-5, atol=1e-5)
    assert torch.equal(after, unfolded)  # LoRA runs unmerged again
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert list(model.base_model.active_adapters) == ["student"]


def test_weights_are_restored_when_the_block_raises():
    model, _ = two_adapter_model()
    before = base_weights(model)
    with pytest.raises(RuntimeError, match="boom"), folded_lora(model) as count:
        assert count > 0
        raise RuntimeError("boom")
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)
    assert all(not layer.disable_adapters for layer in model.modules() if hasattr(layer, "lora_A"))


@pytest.mark.parametrize("precision", ["nf4", "bf16"])
def test_quantised_and_half_precision_bases_are_not_folded(precision):
    model, _ = two_adapter_model("nf4" if precision == "nf4" else "none")
    if precision == "bf16":
        model.to(torch.bfloat16)
    with folded_lora(model) as count:
        assert count == 0
        assert all(not layer.disable_adapters for layer in model.modules() if hasattr(layer, "lora_A"))


@pytest.mark.parametrize("greedy", [True, False])
def test_rollouts_with_folded_lora_equal_rollouts_without(greedy):
    model, tok = two_adapter_model()
    prompts = [tok(t)["input_ids"] for t in ["what is two plus two?", "abc"]]
    params = SamplingParams(max_new_tokens=10, n=3, greedy=greedy, seed=3, logprobs=True)
    folded = HFEngine(model, tok, fold_lora=True).generate(prompts, ["student", "earlier"], params)
    plain = HFEngine(model, tok, fold_lora=False).generate(prompts, ["student", "earlier"], params)
    assert [[c.token_ids for c in g] for g in folded] == [[c.token_ids for c in g] for g in plain]
    assert [[c.logprobs for c in g] for g in folded] == [[c.logprobs for c in g] for g in plain]  # both unfolded
    assert all(len(c.token_ids) > 0 for g in folded for c in g)


def raw_recipe(out, stage_two_rollout=None):
    return {
        "model": {"name": "tiny-random"},
        "output_dir": str(out),
        "quantization": "none",
        "rollout": {"fold_lora": False, "group_size": 2, "max_new_tokens": 4},
        "optim": {"steps": 1, "prompts_per_step": 1},
        "domains": [{"name": "arith", "source": "builtin:arithmetic"}, {"name": "mcq", "source": "builtin:mcq"}],
        "stages": [
            {"name": "one", "domain": "arith"},
            {"name": "two", "domain": "mcq", **({"rollout": stage_two_rollout} if stage_two_rollout else {})},
        ],
    }


def test_recipe_fold_lora_reaches_the_engine_and_must_agree_across_stages(tmp_path, monkeypatch):
    import adaptercl.rollout.engines as engines_module  # the run builds its hf engine there
    from adaptercl.recipe.grammar import RecipeError, resolve_recipe
    from adaptercl.run.sequence import run_recipe

    with pytest.raises(RecipeError, match=r"stages\.two\.rollout\.fold_lora"):
        resolve_recipe(raw_recipe(tmp_path, {"fold_lora": True}))

    class EngineBuilt(Exception):
        pass

    def recording_engine(model, tokenizer, **kwargs):
        raise EngineBuilt(kwargs)

    monkeypatch.setattr(engines_module, "HFEngine", recording_engine)
    with pytest.raises(EngineBuilt) as built:
        run_recipe(resolve_recipe(raw_recipe(tmp_path / "run")))
    assert built.value.args[0]["fold_lora"] is False
