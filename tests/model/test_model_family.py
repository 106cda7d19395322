"""The model families people fine-tune, offline: for each, a tiny random model built from the family's own config
class (`tests/support/tiny_families.py`: llama, qwen2, qwen3, qwen3_5 (Gated DeltaNet + attention), qwen3_moe,
qwen3_5_moe, gemma3 and gemma4 (sliding windows; Gemma 4's shared key/values), mistral, olmo3, smollm3, phi3), run as a user would
run it. Test ids name the family by its transformers model_type: `python -m pytest -q -k model_family`.

Per family, one test, since the run is what costs: a three-stage recipe (sdpo with a fresh adapter, hybrid with a
fresh adapter over it, grpo continuing the hybrid's), 2 steps each; its stages train the family's attention and MLP
projections in every decoder layer (`lora.target_modules: auto`); a one-stage run of the same first stage killed after
its first step (a checkpoint) resumes to the same adapter and teacher, byte for byte; `export` of the run loads with a
plain `PeftModel.from_pretrained` and gives the run's final model's logits. The rollout checks run the model in
float64, so that no batch-size-dependent rounding can move a greedy or a sampled token: the hf engine's greedy rows
equal `transformers.generate`'s on the plain left-padded batch, and sampled rows end at different lengths (rows
leave the batch, the cache dropping their rows by its layers' rules), each row the prefix of what it samples alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from reference_generate import greedy_generate, left_padded
from safetensors.torch import load_file
from tiny_families import FAMILIES, write_tiny_family
from transformers import AutoConfig, AutoModelForCausalLM

from adaptercl.adapters.live import active_adapters, load_adapter
from adaptercl.model import encode_chat
from adaptercl.model.base import load_base
from adaptercl.recipe.grammar import ModelConfig, resolve_recipe
from adaptercl.rollout import hf
from adaptercl.rollout.protocol import SamplingParams
from adaptercl.run import live_run
from adaptercl.run.sequence import run_recipe
from adaptercl.ship.export import export_run
from adaptercl.train import stage as stage_module

STAGES = [
    {"name": "sdpo", "domain": "arith", "method": "sdpo", "adapter": {"init": "new"}},
    {"name": "hybrid", "domain": "arith", "method": "hybrid", "adapter": {"init": "new"}},
    {"name": "grpo", "domain": "arith", "method": "grpo", "adapter": {"init": "continue"}},
]
# The projections `auto` trains in each decoder layer, by the layer's kind (model/lora_targets.py)
ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}
MLP = {"gate_proj", "up_proj", "down_proj"}
EXPECTED = {
    "phi3": ({"qkv_proj", "o_proj"}, {"gate_up_proj", "down_proj"}),
    "qwen3_moe": (ATTENTION, set()),  # routed experts: fused 3-D weights, not LoRA-wrappable, not trained
}
LINEAR_ATTENTION = {"in_proj_qkv", "in_proj_z", "out_proj"}  # Qwen3.5's linear_attention layers
# Qwen3.5-MoE: the shared expert's gate/up/down_proj are its MLP projections (the routed experts: not trained)


def family_recipe(folder: Path, out: Path, stages: list[dict]) -> dict:
    return {
        "model": {"name": str(folder)},
        "output_dir": str(out),
        "lora": {"r": 2, "alpha": 4},
        "optim": {"lr": 5e-3, "steps": 2, "prompts_per_step": 2},
        "rollout": {"group_size": 2, "max_new_tokens": 6},
        "monitor": {"checkpoint_every": 1},
        # the diagnostics do not depend on the family (tested on tiny-random): off, to keep a family a few seconds
        "eval": {
            "examples_per_domain": 2,
            "drift_probes": 0,
            "parameter_drift": False,
            "teacher_lift_prompts": 0,
            "stage_kl_prompts": 0,
        },
        "domains": [{"name": "arith", "source": "builtin:arithmetic", "reward": "tiny_rewards:digit_fraction"}],
        "stages": stages,
    }


def expected_modules(family: str, text_config, layer: int) -> set[str]:
    """What `auto` must adapt in decoder `layer`: its attention's (or linear attention's) and MLP's projections."""
    attention, mlp = EXPECTED.get(family, (ATTENTION, MLP))
    kinds = getattr(text_config, "layer_types", None) or ["full_attention"] * text_config.num_hidden_layers
    if kinds[layer] == "linear_attention":
        attention = LINEAR_ATTENTION
    shared = getattr(text_config, "num_kv_shared_layers", 0)  # Gemma 4: these reuse earlier layers' keys and values
    if layer >= text_config.num_hidden_layers - shared:
        attention = attention - {"k_proj", "v_proj"}
    return attention | mlp


def adapted_modules(adapter_dir: Path) -> dict[int, set[str]]:
    """Decoder layer -> the module names a saved adapter holds LoRA factors for."""
    out: dict[int, set[str]] = {}
    for key in load_file(str(adapter_dir / "adapter_model.safetensors")):
        parts = key.split(".")
        layer = int(parts[parts.index("layers") + 1])
        lora = next(i for i, part in enumerate(parts) if part.startswith("lora_"))
        out.setdefault(layer, set()).add(parts[lora - 1])
    return out


def plain_generate(model, prompts: list[list[int]], pad_id: int, stop_ids: list[int], n: int) -> list[list[int]]:
    """`transformers.generate`, greedy, on the plain left-padded batch; each row cut after its first stop id."""
    return greedy_generate(model, *left_padded(prompts, pad_id), stop_ids, pad_id, n)


def in_float64(model: torch.nn.Module) -> torch.nn.Module:
    """`model` (loaded in float64) with its MoE experts run one by one: grouped_mm has no float64 kernel."""
    model.set_experts_implementation("eager")
    return model.eval()


def check_rollouts(folder: Path) -> None:
    """Greedy rows equal `generate`'s; sampled rows stop at different lengths, each the prefix of its free sample."""
    base = load_base(ModelConfig(name=str(folder), dtype="float64"), "none")
    model, tok = in_float64(base.model), base.tokenizer
    questions = ["What is 2 + 3?", "Name a prime number above 10 and below 20, please."]
    prompts = [encode_chat(tok, [{"role": "user", "content": q}]) for q in questions]
    engine = hf.HFEngine(model, tok, fold_lora=False)
    greedy = [c.token_ids for g in engine.generate(prompts, None, SamplingParams(10, greedy=True, n=2)) for c in g]
    assert greedy == plain_generate(
        model, [p for p in prompts for _ in range(2)], tok.pad_token_id, engine.stop_ids, 10
    )

    params = SamplingParams(12, temperature=1.5, n=3, seed=7)
    engine.stop_ids = [-1]  # nothing stops: each row's free sample
    free = [c.token_ids for g in engine.generate(prompts, None, params) for c in g]
    engine.stop_ids = sorted({free[0][2], free[-1][8]})  # tokens rows emit at different steps
    sizes = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: sizes.append(kw["input_ids"].shape[0]), with_kwargs=True)
    try:
        sampled = [c.token_ids for g in engine.generate(prompts, None, params) for c in g]
    finally:
        hook.remove()
    for row, alone in zip(sampled, free):
        stop = next((j for j, t in enumerate(alone) if t in engine.stop_ids), None)
        assert row == (alone if stop is None else alone[: stop + 1])
    assert len({len(r) for r in sampled}) > 1  # rows ended at different lengths
    assert min(sizes) < len(sampled)  # finished rows left the batch (every layer of these caches has a rule)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: write_tiny_family(family, root / family) for family in FAMILIES}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_model_family(family, folders, tmp_path, monkeypatch):
    folder = folders[family]
    check_rollouts(folder)
    monkeypatch.setattr(live_run, "write_report", lambda run_dir: None)  # plots of JSON files: not the family's part

    run = tmp_path / "run"
    run_recipe(resolve_recipe(family_recipe(folder, run, STAGES)))
    text_config = AutoConfig.from_pretrained(folder).get_text_config()
    expected = {layer: expected_modules(family, text_config, layer) for layer in range(text_config.num_hidden_layers)}
    for i, stage in enumerate(STAGES):
        stage_dir = run / f"stage-{i + 1:02d}-{stage['name']}"
        assert (stage_dir / "done.json").is_file()
        modules = adapted_modules(stage_dir / "adapter")
        assert modules == expected
        trained = load_file(str(stage_dir / "adapter" / "adapter_model.safetensors"))
        assert any(v.abs().max() > 0 for k, v in trained.items() if "lora_B" in k)  # B starts at 0: it learned

    # a run of the first stage killed after its first step resumes to the same adapter and teacher
    killed, calls, original = tmp_path / "killed", [], stage_module.train_on_batch

    def killed_in_step_2(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("killed in step 2")
        return original(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(stage_module, "train_on_batch", killed_in_step_2)
        with pytest.raises(RuntimeError, match="killed in step 2"):
            run_recipe(resolve_recipe(family_recipe(folder, killed, STAGES[:1])))
    assert (killed / "stage-01-sdpo" / "checkpoint").is_dir()
    run_recipe(resolve_recipe(family_recipe(folder, killed, STAGES[:1])))
    for part in ("adapter/adapter_model.safetensors", "teacher/adapter/adapter_model.safetensors"):
        assert (killed / "stage-01-sdpo" / part).read_bytes() == (run / "stage-01-sdpo" / part).read_bytes(), part

    # export, then a plain PEFT load of the combined adapter: the run's final model's logits
    shipped = export_run(run, tmp_path / "shipped", merged=True)
    plain = in_float64(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64))
    plain = PeftModel.from_pretrained(plain, str(shipped / "combined")).eval()
    ours = in_float64(load_base(ModelConfig(name=str(folder), dtype="float64"), "none").model)
    final = json.loads((run / "stage-03-grpo" / "done.json").read_text())["adapters"]
    for name in final:
        ours = load_adapter(ours, run / name / "adapter", name)
    ids = torch.tensor([encode_chat(load_base(ModelConfig(name=str(folder)), "none").tokenizer, [
        {"role": "user", "content": "What is 7 + 5?"}])])  # fmt: skip
    with torch.no_grad(), active_adapters(ours, final):
        expected = ours(input_ids=ids).logits
    with torch.no_grad():
        got = plain(input_ids=ids).logits
    # alpha / r = 2 is a power of two, so the combined adapter's scale-folded B is exact: the two float64 forwards
    # differ only in how the rank sums group (~1e-15 relative); 1e-9 is that with a wide margin, far below any change
    # a missing or mis-scaled adapter makes (an adapter moves these logits by ~1e-1 of their largest)
    assert (got - expected).abs().max() <= 1e-9 * expected.abs().max()
