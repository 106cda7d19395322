"""`lora_factors`: the combined adapter's ΔW is the exact sum, the stage folder and the vLLM engine's folder hold the
same factors, folders round-trip, and bad folders are refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from safetensors.torch import load_file

from adaptercl.adapters import live as ad
from adaptercl.adapters.factors import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    combine,
    from_model,
    read_adapter_folder,
    served_config,
    snapshot,
    write_adapter_folder,
    write_combined_adapter,
)
from adaptercl.model.base import load_base
from adaptercl.recipe.grammar import LoraConfig, ModelConfig, RecipeError

TINY = ModelConfig(name="tiny-random")


@pytest.fixture(scope="module")
def model():
    """tiny-random with adapter x (r 8, alpha 16, every default module) and y (r 4, alpha 4, two modules)."""
    torch.manual_seed(0)
    model = ad.attach_adapter(load_base(TINY, "none").model, "x", LoraConfig(r=8, alpha=16))
    model = ad.attach_adapter(model, "y", LoraConfig(r=4, alpha=4, target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(0.3 * torch.randn_like(p))
    return model


def test_combined_adapter_folder_holds_the_exact_sum_and_reads_back(model, tmp_path):
    x, y = from_model(model, "x"), from_model(model, "y")
    assert (x.scaling, y.scaling, x.rank, y.rank) == (2.0, 1.0, 8, 4)
    info = write_combined_adapter(model, ["x", "y"], tmp_path / "combined")
    assert info == {"adapters": ["x", "y"], "rank": 12}
    back = read_adapter_folder(tmp_path / "combined")
    assert back.scaling == 1.0 and back.rank == 12 and set(back.modules) == set(x.modules) | set(y.modules)
    dx, dy = x.deltas(), y.deltas()
    for module, delta in back.deltas().items():
        torch.testing.assert_close(delta, dx[module] + dy.get(module, 0), rtol=1e-5, atol=1e-6)
        layer = model.get_submodule(module)  # PEFT's own ΔW of the two adapters
        peft_sum = layer.get_delta_weight("x") + (layer.get_delta_weight("y") if module in dy else 0)
        torch.testing.assert_close(delta, peft_sum, rtol=1e-5, atol=1e-6)
    combined = combine([x, y])  # the factors written are the combined factors, bit for bit, in float32
    for module, (a, b) in back.modules.items():
        assert a.dtype == b.dtype == torch.float32
        assert torch.equal(a, combined.modules[module][0]) and torch.equal(b, combined.modules[module][1])
    q_proj = next(m for m in y.modules if m.endswith("q_proj"))  # both adapters: [A_x; A_y], [s_x B_x, s_y B_y]
    assert torch.equal(back.modules[q_proj][0], torch.cat([x.modules[q_proj][0], y.modules[q_proj][0]]))
    assert torch.equal(back.modules[q_proj][1], torch.cat([2.0 * x.modules[q_proj][1], y.modules[q_proj][1]], 1))
    v_proj = next(m for m in x.modules if m.endswith("v_proj"))  # x only: y's rank-4 block is zero
    assert float(back.modules[v_proj][0][8:].abs().max()) == float(back.modules[v_proj][1][:, 8:].abs().max()) == 0
    # adapter_config.json: x's own PEFT config with scale 1 at the summed rank, every module suffix targeted
    expected = json.loads(json.dumps(x.config, default=str))
    expected.update(r=12, lora_alpha=12, use_rslora=False, use_dora=False, rank_pattern={}, alpha_pattern={})
    expected.update(inference_mode=True, target_modules=sorted({m.rsplit(".", 1)[-1] for m in x.modules}))
    assert json.loads((tmp_path / "combined" / CONFIG_FILE).read_text()) == expected


def test_vllm_snapshots_give_the_stage_folder_factors(model, tmp_path):
    """The engine's path (CPU float32 snapshots, scale folded, `served_config`) writes the same tensor file as
    the stage's combined adapter, and the config vLLM reads."""
    write_combined_adapter(model, ["x", "y"], tmp_path / "combined")
    sx = snapshot(model, "x")
    assert sx.scaling == 1.0 and sx.rank == 8
    for module, (a, b) in from_model(model, "x").modules.items():
        assert torch.equal(sx.modules[module][0], a) and torch.equal(sx.modules[module][1], 2.0 * b)
        assert sx.modules[module][0].data_ptr() != a.data_ptr()  # a copy: later optimiser steps do not reach it
    served = combine([sx, snapshot(model, "y")])
    served.config = served_config("/base", served.modules, served.rank)
    write_adapter_folder(tmp_path / "served", served)
    assert (tmp_path / "served" / WEIGHTS_FILE).read_bytes() == (tmp_path / "combined" / WEIGHTS_FILE).read_bytes()
    config = json.loads((tmp_path / "served" / CONFIG_FILE).read_text())
    assert list(config) == [
        "peft_type",
        "task_type",
        "base_model_name_or_path",
        "r",
        "lora_alpha",
        "lora_dropout",
        "bias",
        "use_rslora",
        "use_dora",
        "fan_in_fan_out",
        "modules_to_save",
        "target_modules",
    ]
    assert (config["base_model_name_or_path"], config["r"], config["lora_alpha"]) == ("/base", 12, 12)
    assert config["target_modules"] == sorted({m.rsplit(".", 1)[-1] for m in served.modules})
    loaded = load_file(str(tmp_path / "served" / WEIGHTS_FILE))
    assert set(loaded) == {f"{m}.lora_{p}.weight" for m in served.modules for p in "AB"}


def test_snapshot_refuses_dora():
    model = get_peft_model(
        load_base(TINY, "none").model, PeftLoraConfig(r=2, target_modules=["q_proj"], use_dora=True), "d"
    )
    with pytest.raises(RecipeError, match="adapter 'd' uses DoRA"):
        snapshot(model, "d")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_dora": True}, "DoRA adapters are not supported"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern/alpha_pattern are not supported"),
        ({"peft_type": "IA3"}, "peft_type 'IA3' is not LORA"),
        ({"r": "four"}, "needs integer r and numeric lora_alpha"),
        ("bin", "only safetensors adapters are supported"),
    ],
)
def test_unsupported_folders_are_refused_in_one_line(model, tmp_path, change, message):
    folder = tmp_path / "adapter"
    ad.save_adapter(model, "y", folder)
    if change == "bin":
        (folder / WEIGHTS_FILE).rename(folder / "adapter_model.bin")
    else:
        config = json.loads((folder / CONFIG_FILE).read_text())
        (folder / CONFIG_FILE).write_text(json.dumps({**config, **change}))
    with pytest.raises(RecipeError, match=message) as err:
        read_adapter_folder(folder)
    assert "\n" not in str(err.value)
