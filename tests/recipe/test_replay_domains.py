"""regularizers.replay_domains: replay from named domains instead of the earlier stages' (a multitask stage: the
`joint` reference); bad names one line each; a one-stage run replays the named domain's prompts, scored by its own
reward, on every step."""

from __future__ import annotations

import pytest

from adaptercl.recipe import RecipeError
from adaptercl.recipe.grammar import resolve_recipe
from adaptercl.run.sequence import run_recipe
from adaptercl.system import read_jsonl


def joint(out, **regularizers) -> dict:
    return {
        "model": {"name": "tiny-random"},
        "output_dir": str(out),
        "lora": {"r": 4, "alpha": 8},
        "optim": {"lr": 1e-3, "steps": 2, "prompts_per_step": 2},
        "rollout": {"group_size": 2, "max_new_tokens": 4},
        "domains": [
            {"name": "copy", "source": "builtin:copy"},
            {"name": "arith", "source": "builtin:arithmetic"},
            {"name": "probe", "source": "builtin:mcq"},
        ],
        "stages": [{"name": "both", "domain": "copy", "method": "grpo", "regularizers": regularizers}],
        "eval": {"examples_per_domain": 2, "drift_probes": 0, "stage_kl_prompts": 0, "retention_probes": ["probe"]},
    }


@pytest.mark.parametrize(
    ("regularizers", "message"),
    [
        ({"replay_fraction": 0.5, "replay_domains": ["nope"]}, "unknown domain 'nope'"),
        ({"replay_fraction": 0.5, "replay_domains": ["copy"]}, "'copy' is the stage's own domain"),
        ({"replay_fraction": 0.5, "replay_domains": ["probe"]}, "'probe' is a retention probe"),
        ({"replay_domains": ["arith"]}, "set regularizers.replay_fraction > 0 as well"),
    ],
)
def test_bad_replay_domains_are_one_line(tmp_path, regularizers, message):
    with pytest.raises(RecipeError, match=f"^stages.both.regularizers.replay_domains: .*{message}"):
        resolve_recipe(joint(tmp_path / "run", **regularizers))


def test_a_first_stage_replays_the_named_domain_on_every_step(tmp_path):
    events = []
    run_recipe(
        resolve_recipe(joint(tmp_path / "run", replay_fraction=0.5, replay_domains=["arith"])),
        on_event=lambda kind, **info: events.append(info) if kind == "step" else None,
    )
    rows = [r for r in read_jsonl(tmp_path / "run" / "stage-01-both" / "metrics.jsonl") if "event" not in r]
    assert [r["replay_frac"] for r in rows] == [0.5, 0.5]  # 1 of 2 prompts from arith, though no stage trained it
    assert len(events) == 2
