"""`rollout.engine: auto` (`adaptercl/rollout/engine_choice.py`): vLLM where a CUDA device is visible and vLLM imports
and can load the base, transformers otherwise, each with the reason; decided before the run, said as its first line,
and the run directory keeps `auto`.

This machine has no CUDA device; the CUDA cases fake the driver's answer (`cuda_device_count`) and, past the vLLM
import, torch's. The no-vLLM case makes the import fail (`sys.modules["vllm"] = None`), on a machine with vLLM too.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import yaml

from adaptercl.cli import main
from adaptercl.console import PlainProgress
from adaptercl.recipe.grammar import resolve_recipe
from adaptercl.rollout import engine_choice
from adaptercl.run.sequence import run_recipe
from adaptercl.run_dir.layout import RECIPE_FILE
from tests.run.test_run import tiny_recipe

REPO = Path(__file__).resolve().parents[2]
GPU_RECIPES = ("grpo.yaml", "sdpo.yaml", "sdft.yaml", "hybrid.yaml")


def auto_recipe(out, **raw):
    base = tiny_recipe(out)
    base["rollout"] = {**base["rollout"], "engine": "auto"}
    base.update(raw)
    return resolve_recipe(base)


@pytest.fixture
def cuda(monkeypatch):
    """A CUDA driver that reports one device."""
    monkeypatch.setattr(engine_choice, "cuda_device_count", lambda: 1)


def test_without_a_cuda_device_auto_is_transformers(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_choice, "cuda_device_count", lambda: 0)
    recipe = auto_recipe(tmp_path)
    resolved, choice = engine_choice.resolve_engine(recipe)
    assert (choice.engine, choice.reason) == ("hf", "auto: no CUDA device; transformers instead")
    assert [s.rollout.engine for s in resolved.stages] == ["hf", "hf"]
    assert [s.rollout.engine for s in recipe.stages] == ["auto", "auto"]  # the written recipe is left as it is
    rest = lambda r: [s.model_dump(exclude={"rollout": {"engine"}}) for s in r.stages]  # noqa: E731
    assert rest(resolved) == rest(recipe)  # nothing else changes


def test_without_vllm_auto_is_transformers_and_says_why(tmp_path, monkeypatch, cuda):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails, installed or not
    _, choice = engine_choice.resolve_engine(auto_recipe(tmp_path))
    assert choice.engine == "hf"
    assert (
        choice.reason.startswith("auto: vLLM does not import (ModuleNotFoundError: ")
        and "transformers instead" in choice.reason
    )


def test_a_named_engine_is_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_choice, "cuda_device_count", lambda: pytest.fail("a named engine probes nothing"))
    recipe = resolve_recipe(tiny_recipe(tmp_path))  # names none: the default, said so
    resolved, choice = engine_choice.resolve_engine(recipe)
    assert resolved is recipe and choice.line() == "rollout engine: hf (default)"
    assert not choice.decided  # so the run does not say it (a bad input's error stays the only line)
    raw = tiny_recipe(tmp_path)
    raw["rollout"]["engine"] = "hf"
    named = resolve_recipe(raw)
    resolved, choice = engine_choice.resolve_engine(named)
    assert resolved is named and choice.line() == "rollout engine: hf (named in the recipe)" and not choice.decided


def test_the_plan_plans_auto_as_vllm_and_a_named_engine_as_named(tmp_path):
    assert {s.rollout.engine for s in engine_choice.planned(auto_recipe(tmp_path)).stages} == {"vllm"}
    named = resolve_recipe(tiny_recipe(tmp_path))
    assert engine_choice.planned(named) is named


@pytest.mark.vllm
def test_on_cuda_with_vllm_auto_is_vllm_where_it_can_load_the_base(tmp_path, monkeypatch, cuda):
    import torch
    import vllm

    import adaptercl.rollout.vllm_settings as vllm_settings

    assert engine_choice.resolve_engine(auto_recipe(tmp_path))[1].reason.startswith("auto: torch ")  # CPU torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    resolved, choice = engine_choice.resolve_engine(auto_recipe(tmp_path, quantization="nf4"))
    provider = vllm_settings.bitsandbytes_provider()
    assert choice.engine == "vllm" and {s.rollout.engine for s in resolved.stages} == {"vllm"}
    assert choice.reason == f"auto: CUDA device, vLLM {vllm.__version__} imports, bitsandbytes {provider}"
    fp32 = auto_recipe(tmp_path, quantization="nf4", model={"name": "tiny-random", "dtype": "float32"})
    assert engine_choice.resolve_engine(fp32)[1].reason.startswith("auto: vLLM loads a 4-bit base only with a 16-bit")
    monkeypatch.setattr(vllm_settings, "bitsandbytes_provider", lambda: None)  # vLLM >= 0.28 without the plugin
    _, choice = engine_choice.resolve_engine(auto_recipe(tmp_path, quantization="nf4"))
    assert choice.engine == "hf" and "cannot load the 4-bit base without" in choice.reason
    assert "vllm-bnb-plugin" in choice.reason
    # a rollout-side base or an unquantised one needs no bitsandbytes
    _, choice = engine_choice.resolve_engine(auto_recipe(tmp_path, quantization="none"))
    assert choice.reason == f"auto: CUDA device, vLLM {vllm.__version__} imports"


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_the_24gb_recipes_say_auto_and_validate_without_vllm(name, monkeypatch, capsys, cuda):
    raw = yaml.safe_load((REPO / "recipes" / name).read_text())
    assert raw["rollout"]["engine"] == "auto"
    monkeypatch.setitem(sys.modules, "vllm", None)
    assert main(["recipe", "validate", str(REPO / "recipes" / name)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ok: ") and "rollout engine: hf (auto: vLLM does not import (ModuleNotFoundError" in out


def test_an_auto_run_says_its_engine_first_and_keeps_auto_in_its_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_choice, "cuda_device_count", lambda: 0)
    raw = tiny_recipe(tmp_path / "run")
    raw.update(
        rollout={"engine": "auto", "group_size": 2, "max_new_tokens": 4},
        optim={"lr": 5e-3, "steps": 1, "prompts_per_step": 1},
        eval={"examples_per_domain": 1, "drift_probes": 0, "stage_kl_prompts": 0, "parameter_drift": False},
        domains=raw["domains"][:1],
        stages=raw["stages"][:1],
    )
    recipe = resolve_recipe(raw)
    out = io.StringIO()
    run_recipe(recipe, on_event=PlainProgress(recipe, out))
    assert out.getvalue().splitlines()[0] == "rollout engine: hf (auto: no CUDA device; transformers instead)"
    stored = yaml.safe_load((tmp_path / "run" / RECIPE_FILE).read_text())
    assert stored["stages"][0]["rollout"]["engine"] == "auto"
    run_recipe(recipe)  # the same recipe again: the finished run, not "a different recipe"
