"""`adaptercl recipe plan --rehearsal`: the wall time from a rehearsal's figures (`plan/rehearsal.py`), pinned on a
hand-written rehearsal of a tiny two-stage recipe against figures computed by hand."""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from adaptercl.cli import main
from adaptercl.plan.rehearsal import measured_wall_time, read_rehearsal, recipe_hash
from adaptercl.recipe import RecipeError
from adaptercl.recipe.grammar import resolve_recipe

RAW = {
    "model": {"name": "tiny-random"},
    "output_dir": "runs/tiny",
    "optim": {"steps": 10, "prompts_per_step": 2},  # n = 2 x 4 = 8 sequences a step
    "rollout": {"group_size": 4, "max_new_tokens": 8},
    "monitor": {"checkpoint_every": 5},  # checkpoints at the start, after step 5 and at the end: 3
    "eval": {"examples_per_domain": 6, "drift_probes": 3, "stage_kl_prompts": 4, "teacher_lift_prompts": 2},
    "domains": [{"name": "arith", "source": "builtin:arithmetic"}, {"name": "mcq", "source": "builtin:mcq"}],
    "stages": [{"name": "one", "domain": "arith"}, {"name": "two", "domain": "mcq", "adapter": {"init": "new"}}],
}


def rehearsal(recipe) -> dict:
    """A rehearsal of RAW that reached stage one only (three steps, the first the warm-up), by hand."""
    return {
        "kind": "adaptercl rehearsal",
        "version": 1,
        "recipe": {"hash": recipe_hash(recipe)},
        "machine": {"label": "a 2-core test CPU"},
        "random_weights": False,
        "stopped": None,
        "seconds": {"startup": 5.0, "load": 1.0, "other": 2.0},
        "stages": {
            "one": {
                "method": "grpo",
                "steps": [
                    {"rollout_s": 3.0, "train_s": 5.0, "sequences": 8, "tokens": 48},
                    {"rollout_s": 1.0, "train_s": 2.0, "sequences": 8, "tokens": 40},
                    {"rollout_s": 1.4, "train_s": 2.4, "sequences": 8, "tokens": 56},
                ],
                "checkpoint_s": [0.5, 0.7],
                "stage_overhead_s": 0.3,
                "save_s": 0.2,
                "parameter_drift": {"seconds": 1.5},
                "stage_kl": {"seconds": 2.0, "prompts": 2},
                "response_drift": {"seconds": 3.0, "prompts": 4},
                "teacher_lift": {"seconds": 9.0, "prompts": 1},  # grpo has no teacher: never counted
                "eval": {"arith": {"seconds": 1.2, "examples": 4}, "mcq": {"seconds": 0.8, "examples": 4}},
            }
        },
        "eval_before": {"arith": {"seconds": 2.0, "examples": 4}, "mcq": {"seconds": 1.0, "examples": 4}},
        "eval_sizes": {"arith": 6, "mcq": 5},  # mcq's eval set holds 5 of the 6 asked
        "eval_sizes_at": 6,
    }


# Stage one, by hand (stage two takes stage one's figures: the same seconds):
#   rollouts: steady 2.4 s / 96 tokens = 0.025 s a token; sampled mean 144 / 24 = 6 tokens; warm-up 3.0 - 0.025 x 48
#             = 1.8 s; 1.8 + 10 x 8 x 6 x 0.025 = 13.8 s
#   training: steady (2.0 + 2.4) / 2 = 2.2 s, warm-up 5.0 - 2.2 = 2.8 s: 2.8 + 10 x 2.2 = 24.8 s; checkpoints 3 x 0.6
#             = 1.8 s; set-up 0.3 s; saving 0.2 s
#   diagnostics: parameter drift 1.5 s; stage KL 4 x 2.0 / 2 = 4.0 s; response drift 3 probes x 2 domains x 3.0 / 4 =
#             4.5 s; no teacher lift (grpo)
STAGE = {"rollout": 13.8, "train": 24.8, "train_other": 1.8 + 0.3 + 0.2, "parameter_drift": 1.5, "stage_kl": 4.0,
         "response_drift": 4.5}  # fmt: skip
# evaluation: 0.3 s an arith example, 0.2 s an mcq one (stage one's); the run takes 6 and 5: 2.8 s an evaluation, x 3
# (before and after each stage) + the first's warm-up 3.0 - (4 x 0.3 + 4 x 0.2) = 1.0 s: 9.4 s; once: 5 + 1 + 2 = 8 s
EVAL, ONCE = 9.4, 8.0
TOTAL = 2 * sum(STAGE.values()) + EVAL + ONCE  # 119.2 s
CAP_EXTRA = 2 * 10 * 8 * (8 - 6) * 0.025  # every rollout response at the cap: 8 s more


def test_the_wall_time_scales_each_measured_term_as_computed_by_hand():
    recipe = resolve_recipe(copy.deepcopy(RAW))
    wall = measured_wall_time(recipe, rehearsal(recipe))
    by_part: dict[tuple[str, str | None], float] = {}
    for term in wall.terms:
        assert term.measured
        by_part[term.part, term.stage] = by_part.get((term.part, term.stage), 0.0) + term.seconds
    for stage in ("one", "two"):
        for part, seconds in STAGE.items():
            assert by_part[part, stage] == pytest.approx(seconds, abs=1e-9), (part, stage)
    assert ("teacher_lift", "one") not in by_part
    assert by_part["eval", None] == pytest.approx(EVAL) and by_part["once", None] == pytest.approx(ONCE)
    assert wall.total_s == pytest.approx(TOTAL) and TOTAL == pytest.approx(119.2)
    assert wall.cap_s == pytest.approx(TOTAL + CAP_EXTRA)
    text = wall.render()
    assert text.startswith("wall time measured on a 2-core test CPU (responses at the rehearsal's sampled mean length")
    assert "~2.0 min = " in text.splitlines()[0] and "at the cap: ~2.1 min" in text.splitlines()[0]
    assert "two rollouts (as one): 10 steps x 8 sequences x 6.0 tokens" in text
    assert "another recipe" not in text  # the rehearsal's hash is this recipe's


def test_a_different_recipe_is_scaled_and_said():
    recipe = resolve_recipe(copy.deepcopy(RAW))
    other = resolve_recipe({**copy.deepcopy(RAW), "optim": {"steps": 10, "prompts_per_step": 4}})  # n = 16
    wall = measured_wall_time(other, rehearsal(recipe))
    rollout = sum(t.seconds for t in wall.terms if t.part == "rollout" and t.stage == "one")
    train = next(t for t in wall.terms if t.part == "train" and t.stage == "one" and "steps" in t.how)
    assert rollout == pytest.approx(1.8 + 10 * 16 * 6 * 0.025)  # tokens scale with the sequences
    assert train.seconds == pytest.approx(2.8 + 10 * 2.2 * 16 / 8) and "x 16/8 sequences" in train.how
    assert "the rehearsal was of another recipe" in wall.render()


def test_plan_with_a_rehearsal_prints_the_measured_wall_time(tmp_path, capsys):
    recipe_file = tmp_path / "tiny.yaml"
    recipe_file.write_text(yaml.safe_dump(RAW))
    data = rehearsal(resolve_recipe(copy.deepcopy(RAW)))
    (tmp_path / "rehearsal.json").write_text(json.dumps(data))
    assert main(["recipe", "plan", str(recipe_file), "--rehearsal", str(tmp_path / "rehearsal.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    wall = [line for line in lines if line.startswith("wall time")]
    assert len(wall) == 1 and wall[0].startswith("wall time measured on a 2-core test CPU") and "~2.0 min =" in wall[0]
    # without a rehearsal the wall time is the 24 GB card's model, as before
    assert main(["recipe", "plan", str(recipe_file)]) == 0
    assert any(line.startswith("wall time on an RTX 4090-class card") for line in capsys.readouterr().out.splitlines())


def test_a_file_that_is_not_a_rehearsal_is_one_line(tmp_path, capsys):
    (tmp_path / "other.json").write_text(json.dumps({"kind": "something else"}))
    with pytest.raises(RecipeError, match="is not a rehearsal"):
        read_rehearsal(tmp_path / "other.json")
    recipe_file = tmp_path / "tiny.yaml"
    recipe_file.write_text(yaml.safe_dump(RAW))
    assert main(["recipe", "plan", str(recipe_file), "--rehearsal", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --rehearsal:") and "does not exist" in err


def damage(data: dict, how: str) -> dict:
    """A rehearsal edited or cut short the way `how` says (a statement on `data` and its stage `one`)."""
    one = data["stages"]["one"]
    exec(how, {"data": data, "one": one})
    return data


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("del data['stages']", "(stages: Field required)"),
        ("data['stages'] = []", "(stages: Input should be a valid dictionary)"),
        ("del one['steps'][1]['tokens']", "(stages.one.steps.1.tokens: Field required)"),
        ("one['steps'][0]['sequences'] = 0", "(stages.one.steps.0.sequences: Input should be greater than 0)"),
        ("one['stage_kl'] = {'seconds': 2.0}", "(stages.one.stage_kl.prompts: Field required)"),
        ("data['eval_before']['arith']['examples'] = 'four'", "(eval_before.arith.examples: Input should be a valid"),
        ("data['seconds'] = {'load': 'slow'}", "(seconds.load: Input should be a valid number"),
    ],
)
def test_a_rehearsal_edited_or_cut_short_is_one_line(tmp_path, capsys, how, message):
    # each used to be a KeyError / TypeError / ZeroDivisionError traceback from the wall time's arithmetic
    recipe_file = tmp_path / "tiny.yaml"
    recipe_file.write_text(yaml.safe_dump(RAW))
    data = damage(rehearsal(resolve_recipe(copy.deepcopy(RAW))), how)
    (tmp_path / "rehearsal.json").write_text(json.dumps(data))
    assert main(["recipe", "plan", str(recipe_file), "--rehearsal", str(tmp_path / "rehearsal.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --rehearsal: ") and "is damaged " + message in err and err.count("\n") == 1


def test_a_rehearsal_folder_is_named_as_one(tmp_path, capsys):
    recipe_file = tmp_path / "tiny.yaml"
    recipe_file.write_text(yaml.safe_dump(RAW))
    assert main(["recipe", "plan", str(recipe_file), "--rehearsal", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --rehearsal: {str(tmp_path)!r} is a folder; pass the rehearsal.json in it\n"


def test_a_part_nothing_rehearsed_is_the_time_models_and_labelled_so():
    from adaptercl.plan import plan_recipe

    recipe = resolve_recipe(copy.deepcopy(RAW))
    data = rehearsal(recipe)
    del data["stages"]["one"]["steps"]  # stopped before its first step, say
    model = plan_recipe(recipe).wall_time
    wall = measured_wall_time(recipe, data, model)
    from_model = {t.part: t for t in wall.terms if not t.measured}
    assert set(from_model) == {"rollout", "train"}
    assert from_model["train"].seconds == model.parts["train_step"].seconds > 0
    assert from_model["rollout"].seconds == model.parts["rollout_step"].seconds > 0
    text = wall.render()
    assert "model    train: not rehearsed; the time model's" in text
    assert "time figures (adaptercl/plan/wall_time.py):" in text  # the model's figures, each with its kind and source
    assert wall.total_s == pytest.approx(TOTAL - 2 * (STAGE["rollout"] + STAGE["train"]) + from_model["train"].seconds
                                         + from_model["rollout"].seconds)  # fmt: skip
