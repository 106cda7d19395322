"""Recipe grammar: resolution of defaults into stages, overrides, and one-line errors naming the field."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from adaptercl.recipe.grammar import RecipeError, resolve_recipe
from adaptercl.recipe.load import apply_override, load_recipe

REPO = Path(__file__).resolve().parents[2]
BASE = {
    "model": {"name": "tiny-random"},
    "output_dir": "runs/x",
    "optim": {"lr": 1e-3, "steps": 3},
    "domains": [{"name": "arith", "source": "builtin:arithmetic"}, {"name": "mcq", "source": "builtin:mcq"}],
    "stages": [
        {"name": "a", "domain": "arith", "optim": {"lr": 5e-3}},
        {"name": "b", "domain": "mcq", "steps": 7, "method": "sdpo"},
    ],
}


def test_recipe_level_blocks_are_deep_merged_into_each_stage():
    recipe = resolve_recipe(copy.deepcopy(BASE))
    a, b = recipe.stages
    assert a.optim.lr == 5e-3 and a.optim.steps == 3  # stage override wins, the rest comes from the recipe
    assert b.optim.lr == 1e-3 and b.optim.steps == 7  # `steps:` on a stage sets optim.steps
    assert a.distill.teacher.kind == "base" and b.distill.teacher.kind == "ema"  # method defaults filled
    assert b.distill.teacher.tau == 0.05 and b.distill.teacher.ema_rank == 2 * b.lora.r


def test_sdft_defaults_follow_the_reference():
    raw = copy.deepcopy(BASE)
    raw["stages"][1].update(method="sdft", rollout={"group_size": 1})
    stage = resolve_recipe(raw).stages[1]
    assert (stage.distill.alpha, stage.distill.skip_first_tokens, stage.distill.teacher.tau) == (0.0, 3, 0.01)


@pytest.mark.parametrize(
    ("method", "support", "topk"), [("sdft", "full", 100), ("sdpo", "topk", 100), ("hybrid", "topk", 100)]
)
def test_default_support_follows_the_method(method, support, topk):
    """issue 16: `method: sdft` alone distils over the full vocabulary (the SDFT trainer), sdpo over top-100 + tail."""
    raw = copy.deepcopy(BASE)
    raw["stages"][1].update(method=method, rollout={"group_size": 1 if method == "sdft" else 4})
    stage = resolve_recipe(raw).stages[1]
    assert (stage.distill.support, stage.distill.topk, stage.distill.tail) == (support, topk, True)
    raw["distill"] = {"support": "topk", "topk": 20}  # an explicit choice, here at recipe level, wins
    stage = resolve_recipe(raw).stages[1]
    assert (stage.distill.support, stage.distill.topk) == ("topk", 20)


@pytest.mark.parametrize(
    ("method", "expected"),
    [("sdpo", "seq_mean_token_mean_all"), ("sdft", "seq_mean_token_mean_all"), ("hybrid", "token_mean")],
)
def test_distillation_aggregation_defaults_per_method_and_an_explicit_one_wins(method, expected):
    raw = copy.deepcopy(BASE)
    raw["stages"][1].update(method=method, rollout={"group_size": 1 if method == "sdft" else 4})
    assert resolve_recipe(raw).stages[1].distill.aggregation == expected  # SDPO/SDFT references: all sequences
    raw["stages"][1]["distill"] = {"aggregation": "seq_mean_token_mean"}
    assert resolve_recipe(raw).stages[1].distill.aggregation == "seq_mean_token_mean"


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (
            lambda r: r["stages"][0].update(method="ppo"),
            "stages.a.method: Input should be 'grpo', 'sdpo', 'sdft', 'hybrid' or 'srpo'",
        ),
        (
            lambda r: r["stages"][1].update(domain="chem"),
            "stages.b.domain: unknown domain 'chem'; defined: arith, mcq",
        ),
        (lambda r: r["optim"].update(lrate=1), "stages.a.optim.lrate: unknown key; allowed keys here: lr, steps"),
        (lambda r: r["stages"][0]["optim"].update(lr="fast"), "stages.a.optim.lr: Input should be a valid number"),
        (lambda r: r.update(modell=1), "modell: unknown key; allowed keys here: model, quantization"),
        (lambda r: r.pop("output_dir"), "output_dir: required field is missing"),
        (lambda r: r["stages"].append({"name": "a", "domain": "arith"}), "stages: name 'a' is used twice"),
        (lambda r: r["stages"][0].update(method="sdft"), "stages.a: sdft samples one response per prompt"),
        (lambda r: r.update(eval={"retention_probes": ["boolq"]}), "eval.retention_probes: unknown domain 'boolq'"),
        (lambda r: r.update(quantization="int8"), "quantization: Input should be 'nf4', 'none' or 'auto'"),
        (  # auto is nf4 on CUDA
            lambda r: r.update(model={**r["model"], "dtype": "float64"}),
            "model.dtype: float64 needs an unquantised base (bitsandbytes computes in 16 or 32 bit); set "
            "quantization: none (it is auto)",
        ),
        (
            lambda r: r.update(eval={"drift_method": "svd"}),
            "eval.drift_method: Input should be 'auto', 'exact' or 'lowrank'",
        ),
        (lambda r: r.update(eval={"drift_top_k": 0}), "eval.drift_top_k: Input should be greater than or equal to 1"),
        (
            lambda r: r["stages"][1].update(distill={"teacher": {"autocast": "fp8"}}),
            "stages.b.distill.teacher.autocast: Input should be 'none', 'bfloat16' or 'auto'",
        ),
        (
            lambda r: r["stages"][1].update(distill={"support": "sampled"}),
            "stages.b: distill.support 'sampled' is reverse KL only: set distill.alpha to 1.0",
        ),
        (  # stage b has 7 steps: a restart every 8 would never happen
            lambda r: r["stages"][1].update(distill={"teacher": {"kind": "restart_freeze", "refresh_every": 8}}),
            "stages.b: distill.teacher.refresh_every (8) is more than optim.steps (7): the restart_freeze teacher "
            "would never refresh",
        ),
        (  # baseline after 4 steps, then a check every 4: the first at step 8
            lambda r: r["stages"][1].update(distill={"teacher": {"kind": "gated", "refresh_every": 4}}),
            "stages.b: distill.teacher: the gated teacher's first check would be at step 8 (gate_window 4 steps of "
            "baseline, then every refresh_every 4), after optim.steps (7)",
        ),
        (  # a 4-step window checked every 2 steps: each check's window repeats 2 steps of the one it is compared with
            lambda r: r["stages"][1].update(
                distill={"teacher": {"kind": "gated", "refresh_every": 2, "gate_window": 4}}
            ),
            "stages.b: distill.teacher.gate_window (4) is longer than refresh_every (2): each check's window would "
            "share 2 steps with the window it is compared with; set gate_window <= refresh_every",
        ),
        (
            lambda r: r["stages"][1].update(distill={"gate": {"kind": "lift", "prompts": 4}}),
            "stages.b.distill.gate: min_pairs (8) is more than prompts (4): the gate could never open; "
            "lower min_pairs or raise prompts",
        ),
        (  # the exact test needs 6 teacher-only wins (2^-6 <= 0.025 < 2^-5): 5 prompts can never open it
            lambda r: r["stages"][1].update(distill={"gate": {"kind": "lift", "prompts": 5, "min_pairs": 5}}),
            "stages.b.distill.gate: prompts (5) is below 6, the fewest teacher-only wins on which the rule "
            "lower_bound (an exact one-sided test at 0.025) can open the gate: it could never open; raise prompts "
            "to 6 or more, or use rule: mean",
        ),
        (
            lambda r: r["stages"][1].update(distill={"gate": {"kind": "lift", "rule": "median"}}),
            "stages.b.distill.gate.rule: Input should be 'lower_bound' or 'mean'",
        ),
        (
            lambda r: r["stages"][1].update(distill={"teacher": {"kind": "gated", "gate_length_eps": -0.1}}),
            "stages.b.distill.teacher.gate_length_eps: Input should be greater than or equal to 0",
        ),
        (
            lambda r: r["stages"][1].update(distill={"teacher": {"kind": "gated", "refresh_every": 0}}),
            "stages.b.distill.teacher.refresh_every: Input should be greater than or equal to 1",
        ),
    ],
)
def test_malformed_recipes_give_one_line_naming_the_field(mutate, expected):
    raw = copy.deepcopy(BASE)
    mutate(raw)
    with pytest.raises(RecipeError) as err:
        resolve_recipe(raw)
    message = str(err.value)
    assert message.startswith(expected), message
    assert "\n" not in message


def test_refresh_schedules_validate_where_they_can_refresh_and_the_window_defaults_to_the_period():
    raw = copy.deepcopy(BASE)
    raw["stages"][1]["distill"] = {"teacher": {"kind": "gated", "refresh_every": 3}}  # baseline at 3, check at 6
    teacher = resolve_recipe(raw).stages[1].distill.teacher
    assert (teacher.kind, teacher.refresh_every, teacher.gate_window) == ("gated", 3, 3)
    assert (teacher.gate_reward_delta, teacher.gate_length_eps) == (0.05, 0.1)
    raw["stages"][1]["distill"] = {"teacher": {"kind": "restart_freeze", "refresh_every": 7}}
    assert resolve_recipe(raw).stages[1].distill.teacher.refresh_every == 7
    raw["stages"][0]["distill"] = {"teacher": {"kind": "gated", "refresh_every": 50}}  # grpo: no teacher, no check
    assert resolve_recipe(raw).stages[0].distill.teacher.kind == "gated"


def test_overrides_address_stages_by_name_and_parse_values():
    raw = copy.deepcopy(BASE)
    apply_override(raw, "stages.b.optim.lr=5e-6")
    apply_override(raw, "seed=3")
    apply_override(raw, "rollout.group_size=2")
    recipe = resolve_recipe(raw)
    assert recipe.stages[1].optim.lr == 5e-6 and recipe.stages[0].optim.lr == 5e-3
    assert recipe.seed == 3 and all(s.rollout.group_size == 2 for s in recipe.stages)
    with pytest.raises(RecipeError, match="no item named 'zz'; names here: a, b"):
        apply_override(copy.deepcopy(BASE), "stages.zz.optim.lr=1")
    with pytest.raises(RecipeError, match="must look like key.path=value"):
        apply_override(copy.deepcopy(BASE), "seed")


def test_bad_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {name: tiny\n")
    with pytest.raises(RecipeError, match="not valid YAML at line"):
        load_recipe(bad)
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")


def test_cli_validate_error_is_one_line_exit_2(tmp_path):
    raw = copy.deepcopy(BASE)
    raw["stages"][0]["method"] = "ppo"
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    proc = subprocess.run(
        [sys.executable, "-m", "adaptercl.cli", "recipe", "validate", str(path)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: stages.a.method: Input should be 'grpo', 'sdpo', 'sdft', 'hybrid' or 'srpo' (got 'ppo')"
    ]
    ok = subprocess.run(
        [sys.executable, "-m", "adaptercl.cli", "recipe", "show", str(path), "stages.a.method=grpo"],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    assert yaml.safe_load(ok.stdout)["stages"][0]["method"] == "grpo"


@pytest.mark.parametrize("path", sorted((REPO / "recipes").rglob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_validates(path):
    recipe = load_recipe(path)
    assert recipe.stages and recipe.domains


def test_recipes_are_found():
    assert len(list((REPO / "recipes").rglob("*.yaml"))) >= 1


# ------------------------------------------------------------------------- on/off fields as YAML writes them

SWITCH_FIELDS = {  # every stage field whose values are words off/on/auto (with or without an int or a bool)
    "optim.activation_checkpointing": {"off": False, "on": True, "auto": "auto"},
    "optim.logits_chunk_size": {"off": "off", "auto": "auto"},
    **{f"monitor.{action}": {"off": "off"} for action in
       ("nonfinite", "divergence_collapse", "target_starvation", "repetition", "reward_collapse", "entropy_collapse")},
}  # fmt: skip


def switch_fields() -> set[str]:
    """The stage fields whose type has the literal word off, on or auto next to a bool, or off/on alone (walked
    from StageConfig), so a switch field added later is tested too."""
    from typing import Literal, get_args, get_origin

    from pydantic import BaseModel

    from adaptercl.recipe.grammar import StageConfig

    def kinds(annotation):
        if get_origin(annotation) is Literal:
            return set(get_args(annotation))
        return {annotation} if not get_args(annotation) else set().union(*map(kinds, get_args(annotation)))

    found = set()
    for block, field in StageConfig.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            for name, sub in field.annotation.model_fields.items():
                values = kinds(sub.annotation)
                if values & {"off", "on"} or (bool in values and values & {"auto"}):
                    found.add(f"{block}.{name}")
    return found


def test_the_switch_fields_are_all_tested():
    assert switch_fields() == set(SWITCH_FIELDS)


def switch_recipe_text(block: str, field: str, word: str) -> str:
    """A recipe file whose recipe-level `block` sets `field` to `word` written as a user writes it (unquoted)."""
    return (
        "model: {name: tiny-random}\noutput_dir: runs/x\n"
        "domains: [{name: arith, source: 'builtin:arithmetic'}]\nstages: [{name: a, domain: arith}]\n"
        f"{block}:\n  {field}: {word}\n"
    )


@pytest.mark.parametrize(
    ("path", "word"), [(p, w) for p, words in SWITCH_FIELDS.items() for w in words], ids=lambda x: str(x)
)
def test_switch_words_load_as_written_in_a_file_and_an_override(tmp_path, path, word):
    """YAML 1.1 reads an unquoted off/on as a boolean: `optim.logits_chunk_size: off`, the form the messages
    suggest, must still mean "off" (it failed: False is not 'auto', 'off' or an int), in a file and on the command
    line alike."""
    block, field = path.split(".")
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(switch_recipe_text(block, field, word))
    assert getattr(getattr(load_recipe(recipe_file).stages[0], block), field) == SWITCH_FIELDS[path][word]
    recipe_file.write_text(switch_recipe_text(block, "checkpoint_every" if block == "monitor" else "lr", 3))
    overridden = load_recipe(recipe_file, [f"{path}={word}"])
    assert getattr(getattr(overridden.stages[0], block), field) == SWITCH_FIELDS[path][word]


@pytest.mark.parametrize(
    ("path", "word", "expected"),
    [
        ("optim.logits_chunk_size", "on", "Input should be 'auto' or 'off' or a valid integer"),  # was chunk 1
        ("optim.logits_chunk_size", "yes", "Input should be 'auto' or 'off' or a valid integer"),
        ("optim.logits_chunk_size", "0", "must be 'auto', 'off' or an int >= 1, got 0"),
        ("optim.activation_checkpointing", "maybe", "Input should be 'auto' or a valid boolean"),
        ("monitor.repetition", "on", "Input should be 'off', 'warn', 'stop' or 'rollback'"),
    ],
)
def test_a_bad_switch_value_is_one_line_naming_the_field(tmp_path, path, word, expected):
    block, field = path.split(".")
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(switch_recipe_text(block, field, word))
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe_file)
    assert str(err.value).startswith(f"stages.a.{path}: {expected}"), str(err.value)
    assert "\n" not in str(err.value)
