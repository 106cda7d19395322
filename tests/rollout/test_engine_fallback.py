"""A vLLM that fails never costs an `auto` run, and stops a run that names vllm with one line before it trains
(`adaptercl/rollout/fallback.py`, `engines.py`; the settings vLLM would refuse: `vllm_memory.check_claim`).

A stand-in `vllm` module (no vLLM needed: `sys.modules`) fails at one point each: while starting (`LLM(...)`), while
loading an adapter (`add_lora`), on its first generate, while sleeping, while waking. Its platform has sleep mode, so
the engine sleeps and wakes on the CPU too. This machine has no CUDA device, so `auto`'s choice of vLLM is faked
(`engine_choice._vllm_blocker`); everything after it runs as on a card.
"""

from __future__ import annotations

import importlib.machinery
import io
import json
import sys
from types import ModuleType, SimpleNamespace

import pytest
import yaml

from adaptercl.cli import main
from adaptercl.console import PlainProgress
from adaptercl.model.shapes import Shape
from adaptercl.recipe.grammar import RecipeError, resolve_recipe
from adaptercl.rollout import engine_choice
from adaptercl.rollout.vllm_memory import check_claim
from adaptercl.run.sequence import run_recipe
from tests.run.test_run import tiny_recipe

POINTS = {  # where the stand-in fails -> the phase the run names
    "start": "starting",
    "adapter": "loading an adapter",
    "generate": "generating",
    "sleep": "sleeping",
    "wake": "waking",
}
ERROR = "CUDA out of memory. Tried to allocate 2.00 GiB"


class StandInLLM:
    """`vllm.LLM`: answers every request with two tokens (logprob -0.5 each); raises at `fail_at`."""

    fail_at: str | None = None
    built: list = []

    def __init__(self, **kwargs):
        self._fail("start")
        self.kwargs = kwargs
        self.built.append(kwargs)
        self.llm_engine = SimpleNamespace(add_lora=self._add_lora, remove_lora=lambda i: None, list_loras=set)

    def _fail(self, point: str) -> None:
        if self.fail_at == point:
            raise RuntimeError(f"{ERROR} ({point})\nTraceback lines the run must not print")

    def _add_lora(self, request) -> None:
        self._fail("adapter")

    def generate(self, prompts, sampling, lora_request=None, use_tqdm=False):
        self._fail("generate")
        tokens = [7, 8]
        return [
            SimpleNamespace(
                outputs=[
                    SimpleNamespace(
                        token_ids=tokens,
                        logprobs=None if s.logprobs is None else [{t: SimpleNamespace(logprob=-0.5)} for t in tokens],
                    )
                ]
            )
            for s in sampling
        ]

    def sleep(self, level):
        self._fail("sleep")

    def wake_up(self):
        self._fail("wake")


@pytest.fixture
def stand_in(monkeypatch):
    """Install the stand-in vLLM; returns a function setting where it fails."""
    vllm = ModuleType("vllm")
    vllm.__spec__ = importlib.machinery.ModuleSpec("vllm", None)  # `require_vllm` finds it installed
    vllm.__version__ = "0.0-stand-in"
    vllm.LLM = type("LLM", (StandInLLM,), {"built": []})
    vllm.SamplingParams = lambda **kwargs: SimpleNamespace(**kwargs)
    platforms = ModuleType("vllm.platforms")
    platforms.current_platform = SimpleNamespace(is_sleep_mode_available=lambda: True)
    lora, request = ModuleType("vllm.lora"), ModuleType("vllm.lora.request")
    request.LoRARequest = lambda **kwargs: SimpleNamespace(**kwargs)
    vllm.platforms, vllm.lora, lora.request = platforms, lora, request
    for name, module in {
        "vllm": vllm,
        "vllm.platforms": platforms,
        "vllm.lora": lora,
        "vllm.lora.request": request,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(engine_choice, "_vllm_blocker", lambda needs: (None, "CUDA device, a stand-in vLLM imports"))
    from adaptercl.rollout.vllm import VLLM_ENV_DEFAULTS

    for key, value in VLLM_ENV_DEFAULTS.items():  # what the engine sets in the process when it builds vLLM: taken
        monkeypatch.setenv(key, value)  # back after the test

    def fail_at(point: str | None):
        vllm.LLM.fail_at = point
        return vllm.LLM

    return fail_at


def one_step_recipe(out, engine: str, **rollout) -> dict:
    raw = tiny_recipe(out)
    raw.update(
        rollout={"engine": engine, "group_size": 2, "max_new_tokens": 4, **rollout},
        optim={"lr": 5e-3, "steps": 1, "prompts_per_step": 1},
        eval={"examples_per_domain": 1, "drift_probes": 0, "stage_kl_prompts": 0, "parameter_drift": False},
        domains=raw["domains"][:1],
        stages=raw["stages"][:1],
    )
    return raw


@pytest.mark.parametrize("point", list(POINTS))
def test_auto_falls_back_to_transformers_when_vllm_fails(tmp_path, stand_in, point):
    stand_in(point)
    recipe = resolve_recipe(one_step_recipe(tmp_path / "run", "auto"))
    out = io.StringIO()
    run_recipe(recipe, on_event=PlainProgress(recipe, out))
    lines = out.getvalue().splitlines()
    assert lines[0] == "rollout engine: vllm (auto: CUDA device, a stand-in vLLM imports)"
    said = [line for line in lines if line.startswith("rollout engine: hf")]
    assert said == [
        f"rollout engine: hf (auto: vLLM failed while {POINTS[point]} (RuntimeError: {ERROR} ({point})); "
        "transformers instead)"
    ]
    (record,) = [json.loads(line) for line in (tmp_path / "run" / "rollout_engine.jsonl").read_text().splitlines()]
    assert (record["from"], record["to"], record["phase"]) == ("vllm", "hf", POINTS[point])
    assert record["error"] == f"RuntimeError: {ERROR} ({point})"
    assert (tmp_path / "run" / "summary.json").is_file()  # the run went on and finished
    metrics = (tmp_path / "run" / "stage-01-one" / "metrics.jsonl").read_text().splitlines()
    assert "rollout_is_weight" not in json.loads(metrics[-1])  # hf after the switch: on-policy, no engine logprobs


@pytest.mark.parametrize("point", list(POINTS))
def test_a_named_vllm_fails_with_one_line_before_any_training_not_a_fallback(tmp_path, stand_in, point):
    stand_in(point)
    with pytest.raises(RecipeError) as err:
        run_recipe(resolve_recipe(one_step_recipe(tmp_path / "run", "vllm")))
    message = str(err.value)
    assert "\n" not in message and message.startswith(
        f"rollout.engine: vllm failed while {POINTS[point]} (RuntimeError: {ERROR} ({point})); "
    )
    assert message.endswith("or set rollout.engine: auto (goes on with transformers when vLLM fails) or hf")
    stage = tmp_path / "run" / "stage-01-one"
    assert not (stage / "metrics.jsonl").is_file() or not (stage / "metrics.jsonl").read_text().strip()  # no step
    if (stage / "checkpoint").exists():  # the stage's starting point, saved before its first rollout
        assert json.loads((stage / "checkpoint" / "state.json").read_text())["next_step"] == 0
    assert not (tmp_path / "run" / "rollout_engine.jsonl").exists()


def test_the_command_line_says_a_named_vllm_failure_in_one_line_not_a_fallback(tmp_path, stand_in, capsys):
    stand_in("start")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(one_step_recipe(tmp_path / "run", "vllm")))
    assert main(["recipe", "run", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "must not print" not in err
    assert err.strip().splitlines()[-1].startswith("error: rollout.engine: vllm failed while starting (RuntimeError: ")


def test_fallback_checks_before_loading_name_the_setting_vllm_would_refuse(tmp_path, stand_in, monkeypatch):
    """On a card (faked): a gpu_memory_utilization above the free memory is one line before vLLM loads; under auto
    the run goes on with transformers, saying that line."""
    import adaptercl.rollout.vllm as vllm_engine

    llm = stand_in(None)
    monkeypatch.setattr(vllm_engine, "card_memory", lambda: (24.0, 6.0))  # total, free GiB
    raw = one_step_recipe(tmp_path / "run", "vllm", gpu_memory_utilization=0.5)
    with pytest.raises(
        RecipeError, match=r"^rollout\.gpu_memory_utilization: 0\.5 of the 24\.0 GiB card is 12\.0 GiB"
    ):
        run_recipe(resolve_recipe(raw))
    assert llm.built == []  # refused before vLLM was asked to load
    auto = one_step_recipe(tmp_path / "auto", "auto", gpu_memory_utilization=0.5)
    recipe = resolve_recipe(auto)
    out = io.StringIO()
    run_recipe(recipe, on_event=PlainProgress(recipe, out))
    assert (
        "rollout engine: hf (auto: vLLM failed while starting (rollout.gpu_memory_utilization: 0.5" in out.getvalue()
    )


TINY = Shape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=1000, tie_embeddings=True)
SEVEN_B = Shape(hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4, vocab=152064, tie_embeddings=False)


def test_the_claim_checks_are_one_line_each(tmp_path):
    recipe = resolve_recipe(one_step_recipe(tmp_path, "vllm", max_new_tokens=512))
    check_claim(TINY, recipe, 0.3, card_gib=24.0, free_gib=20.0)  # fits: nothing to say
    with pytest.raises(RecipeError, match=r"^rollout\.gpu_memory_utilization: 0\.9 .* set it to at most 0\.83 "):
        check_claim(TINY, recipe, 0.9, card_gib=24.0, free_gib=20.0)
    seven = resolve_recipe(one_step_recipe(tmp_path, "vllm", max_new_tokens=512) | {"quantization": "nf4"})
    with pytest.raises(
        RecipeError, match=r"^rollout\.gpu_memory_utilization: 0\.1 of the 24\.0 GiB card \(2\.4 GiB\) "
    ):
        check_claim(SEVEN_B, seven, 0.1, card_gib=24.0, free_gib=20.0)  # the NF4 weights alone are ~5.4 GiB
    slots = resolve_recipe(
        one_step_recipe(tmp_path, "vllm", max_new_tokens=512, max_loras=64) | {"quantization": "nf4"}
    )
    with pytest.raises(RecipeError, match=r"^rollout\.max_loras: 64 LoRA slots at rank 8 take "):
        check_claim(SEVEN_B, slots, 0.3, card_gib=24.0, free_gib=20.0)
    check_claim(SEVEN_B, seven, 0.3, card_gib=24.0, free_gib=20.0)  # 7.2 GiB holds the weights, slots and one sequence
