"""Model families vLLM cannot serve with the run's LoRA (`adaptercl/rollout/vllm_lora_support.py`): `rollout.engine:
auto` picks transformers for them before anything is probed or loaded, `recipe plan` plans that, and a recipe naming
a vLLM engine for one is refused in one line. The table's reason is re-read in the source of the vLLM it was read in.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path

import pytest

from adaptercl.cli import main
from adaptercl.model import shapes
from adaptercl.recipe import RecipeError
from adaptercl.recipe.grammar import resolve_recipe
from adaptercl.rollout import engine_choice
from adaptercl.rollout.vllm_lora_support import VLLM_CHECKED, vllm_lora_blocker
from tests.run.test_run import tiny_recipe

REPO = Path(__file__).resolve().parents[2]


def recipe_of(tmp_path, model: str, engine: str = "auto"):
    raw = tiny_recipe(tmp_path / "out")
    raw["model"] = {"name": model}
    raw["rollout"] = {**raw["rollout"], "engine": engine}
    if engine == "vllm_server":
        raw["rollout"]["server"] = {"url": "http://127.0.0.1:8000"}
    return resolve_recipe(raw)


def qwen3_5_folder(tmp_path) -> str:
    """A local model folder whose config.json is a Qwen3.5 checkpoint's (multimodal: the text model nested)."""
    folder = tmp_path / "qwen3_5"
    folder.mkdir()
    text = {"model_type": "qwen3_5_text", "num_hidden_layers": 4}
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture
def no_probe(monkeypatch):
    """A CUDA card with vLLM would be probed: the family is decided before any of that."""
    monkeypatch.setattr(engine_choice, "cuda_device_count", lambda: pytest.fail("the family decides first"))


@pytest.mark.parametrize("where", ["hub id", "local folder"])
def test_auto_picks_transformers_for_qwen3_5_before_probing_anything(tmp_path, no_probe, where):
    model = "Qwen/Qwen3.5-4B" if where == "hub id" else qwen3_5_folder(tmp_path)
    recipe = recipe_of(tmp_path, model)
    resolved, choice = engine_choice.resolve_engine(recipe)
    assert choice.engine == "hf" and choice.decided and {s.rollout.engine for s in resolved.stages} == {"hf"}
    assert choice.reason == f"auto: {vllm_lora_blocker('qwen3_5')}; transformers instead"
    assert "Qwen3_5ForConditionalGeneration" in choice.reason and "\n" not in choice.reason
    assert {s.rollout.engine for s in engine_choice.planned(recipe).stages} == {"hf"}
    assert engine_choice.auto_plan_note(recipe).startswith("rollout.engine auto planned as transformers: vLLM (")


def test_families_vllm_serves_are_planned_as_vllm(tmp_path):
    for model in ("Qwen/Qwen3-8B", "Qwen/Qwen3-4B-Instruct-2507", "Qwen/Qwen2.5-7B-Instruct", "tiny-random"):
        recipe = recipe_of(tmp_path, model)
        assert engine_choice.family_blocker(recipe) is None, model
        assert {s.rollout.engine for s in engine_choice.planned(recipe).stages} == {"vllm"}
        assert engine_choice.auto_plan_note(recipe).startswith("rollout.engine auto planned as vLLM")
    assert shapes.model_type_of("Qwen/Qwen3-8B") == "qwen3" and shapes.model_type_of("someone/not-cached") is None
    assert shapes.model_type_of("some one/bad id") is None  # not a repo id: nothing to look up, no error here


@pytest.mark.parametrize("engine", ["vllm", "vllm_server"])
def test_naming_a_vllm_engine_for_qwen3_5_is_one_line(tmp_path, engine, capsys):
    with pytest.raises(RecipeError) as err:
        engine_choice.resolve_engine(recipe_of(tmp_path, "Qwen/Qwen3.5-9B", engine))
    line = str(err.value)
    assert line.startswith(f"rollout.engine: {engine} cannot serve Qwen/Qwen3.5-9B: vLLM (read in {VLLM_CHECKED})")
    assert line.endswith("use rollout.engine: hf (or auto, which picks it)") and "\n" not in line
    hybrid = str(REPO / "recipes" / "hybrid.yaml")
    server = ["rollout.server.url=http://127.0.0.1:8000"] if engine == "vllm_server" else []
    for action in ("validate", "plan"):
        assert main(["recipe", action, hybrid, "model.name=Qwen/Qwen3.5-4B", f"rollout.engine={engine}", *server]) == 2
        err_out = capsys.readouterr().err.strip()
        assert err_out.count("\n") == 0 and f"rollout.engine: {engine} cannot serve Qwen/Qwen3.5-4B" in err_out


def test_validate_says_the_family_reason_in_its_engine_line(capsys, no_probe):
    hybrid = str(REPO / "recipes" / "hybrid.yaml")
    assert main(["recipe", "validate", hybrid, "model.name=Qwen/Qwen3.5-4B"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.endswith(f"rollout engine: hf (auto: {vllm_lora_blocker('qwen3_5')}; transformers instead)")


def _vllm_source() -> Path | None:
    spec = importlib.util.find_spec("vllm")
    return Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None


def _class_block(source: str, name: str) -> str:
    start = source.index(f"\nclass {name}(")
    end = source.find("\nclass ", start + 1)
    return source[start : end if end > 0 else None]


@pytest.mark.vllm
def test_the_reason_holds_in_the_vllm_it_was_read_in():
    root = _vllm_source()
    version = re.search(r"__version__ = version = '([^']+)'", (root / "_version.py").read_text()).group(1)
    if version != VLLM_CHECKED:
        pytest.skip(f"vLLM {version} installed; the table was read in {VLLM_CHECKED}")
    models = root / "model_executor" / "models"
    qwen3_5 = (models / "qwen3_5.py").read_text()
    # hub checkpoints name the multimodal class, which takes its LoRA name mapper from the Qwen3-VL wrapper
    assert "class Qwen3_5ForConditionalGeneration(Qwen3VLForConditionalGeneration" in qwen3_5
    assert "hf_to_vllm_mapper =" not in _class_block(qwen3_5, "Qwen3_5ForConditionalGeneration")
    vl = _class_block((models / "qwen3_vl.py").read_text(), "Qwen3VLForConditionalGeneration")
    mapping = ast.literal_eval(re.search(r"orig_to_new_prefix=(\{.*?\})", vl, re.S).group(1))
    assert mapping["model.language_model."] == "language_model.model."
    # the trainer's adapter (transformers' Qwen3_5ForCausalLM) names model.layers.*: no prefix of the mapper matches
    assert not any("model.layers.0.self_attn.q_proj".startswith(prefix) for prefix in mapping)
