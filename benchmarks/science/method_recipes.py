"""The science benchmark's runs as recipes: each method's blocks (METHODS) merged over base.yaml with a collection's
sequence (sweeps.SEQUENCES), `--set` overrides and the retention probes (PROBES), one recipe per method and seed
(`method_recipe`; `joint_recipe`, the multitask reference). run.py launches them; nothing here runs anything.
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml
from sweeps import COLLECTIONS, with_sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def merge(base: dict, update: dict) -> dict:
    """`base` with `update` merged in, nested dicts key by key (neither is modified)."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


# The methods: each a block merged over base.yaml (the method name goes to every stage). The self-teacher methods
# run the teacher's forward in bf16 where the CPU has bf16 matrix instructions (`autocast: auto`, as the shipped CPU
# recipes); the student and the evaluation stay float32. Every method gets base.yaml's budget (steps, sequences,
# tokens, learning rate); nothing here was chosen on the eval sets. Nothing is chosen during a run either: each stage
# ships its final adapter (no best checkpoint), and the gated teacher's refresh decisions read the training rollouts'
# reward on train prompts (fact-disjoint from the eval sets), never an eval set.
AUTOCAST = {"teacher": {"autocast": "auto"}}
CONSERVATIVE = {"l2_prev": 0.01, "replay_fraction": 0.25}  # the hybrid's continual terms (recipes/hybrid-cpu.yaml)
HYBRID = {
    "method": "hybrid",
    "distill": {"support": "sampled", "alpha": 1.0, "teacher": {"kind": "stage_start", "autocast": "auto"}},
    "hybrid": {"distill_weight": 0.1, "distill_on": "failed_groups"},
    "regularizers": CONSERVATIVE,
}
# The lift gate (recipe distill.gate) with its default rule (lower end of the lift's 95 % interval > 0, at least 8
# prompts with a context) checked every 4 steps, as sdpo_gated's period: at steps 0, 4 and 8 of a 12-step stage (the
# default 10 would check at 0 and 10 only)
LIFT_GATE = {"kind": "lift", "every": 4}
SRPO_OPTIM = {"warmup_steps": 0}  # the srpo row's warm-up off (see "srpo" below)
METHODS: dict[str, dict] = {
    # GRPO as the toolkit's defaults (Dr.GRPO advantages, clip 0.2 / 0.28, token mean)
    "grpo": {"method": "grpo"},
    # GRPO with a KL of weight 0.01 to the stage start (the previous stage's policy; token mean on the rollouts)
    "grpo_kl": {"method": "grpo", "regularizers": {"kl_prev": 0.01}},
    # SDPO with the reference defaults (recipe/method_table.py): EMA teacher τ 0.05, JSD α 0.5, student's top-100 +
    # tail, shown a successful sibling or format feedback; the per-sequence mean over every sample (no target = 0)
    "sdpo": {"method": "sdpo", "distill": AUTOCAST},
    # SDPO with the gated teacher (CGTR): frozen, refreshed only on reward gain with a safe length tail. The default
    # 10-step period cannot check within a 12-step stage: a 4-step window and period (baseline after step 4, checks
    # at 8 and 12, toolcall on to 24); δ and ε the defaults (recipe.method_blocks.TeacherConfig)
    "sdpo_gated": {
        "method": "sdpo",
        "distill": {"teacher": {"kind": "gated", "refresh_every": 4, "autocast": "auto"}},
    },
    # SRPO (arXiv 2604.02288) with the method table's paper defaults (the srpo row of recipe/method_table.py: lr 5e-6,
    # weight decay 0.01) but no warm-up: the paper's 10 warm-up steps were for a run of hundreds of steps and would
    # take most of a 12-step stage; every method here trains without one (base.yaml). (Issue 25's collection ran at
    # 4abe294, before the table had the weight decay: its srpo runs had none.)
    "srpo": {"method": "srpo", "distill": AUTOCAST, "optim": SRPO_OPTIM},
    # continual SRPO: SRPO's routing with the stage-start teacher and the hybrid's conservative terms (L2 0.01 to the
    # stage-start ΔW, 1 of 4 prompts replayed from earlier domains); `gated` is the other teacher the issue names
    "srpo_continual": {
        "method": "srpo",
        "optim": SRPO_OPTIM,
        "distill": {"teacher": {"kind": "stage_start", "autocast": "auto"}},
        "regularizers": CONSERVATIVE,
    },
    # The hybrid as shipped (recipes/hybrid-cpu.yaml): GRPO + 0.1 x sampled-token reverse KL to the stage-start
    # policy on failed groups only (shown the demonstration or format feedback), L2 0.01 to the stage-start ΔW,
    # 1 of the 4 prompts per step replayed from earlier domains from stage 2 on
    "hybrid": HYBRID,
    # Issue 37's baselines (the `forgetting` collection, sweeps.py):
    # GRPO with on-policy replay of 1 % / 10 % of each step's prompts from earlier domains (rolled out by the current
    # policy, trained with GRPO's loss, in place of as many of the stage's own prompts). 4 prompts a step make 0.04 /
    # 0.4 prompts: `stochastic` rounding replays 1 prompt on a step with that probability, drawn from the step's seed
    # (about 1 step in 25 / 2 in 5; regularizers.replay_rounding), so the share replayed is 1 % / 10 % in expectation
    "grpo_replay01": {"method": "grpo", "regularizers": {"replay_fraction": 0.01, "replay_rounding": "stochastic"}},
    "grpo_replay10": {"method": "grpo", "regularizers": {"replay_fraction": 0.1, "replay_rounding": "stochastic"}},
    # SRPO and the hybrid with the lift gate: each distils only while its self-teacher's lift, measured on the stage's
    # train prompts, passes the gate's rule, and makes GRPO's update otherwise (recipe distill.gate)
    "srpo_gated": {"method": "srpo", "distill": {**AUTOCAST, "gate": LIFT_GATE}, "optim": SRPO_OPTIM},
    "hybrid_gated": merge(HYBRID, {"distill": {"gate": LIFT_GATE}}),
    # Issue 43 (README "Issue 43: ... pre-registration"): GRPO's knob settings, the points of its frontier
    "grpo_lr050": {"method": "grpo", "optim": {"lr": 1.5e-4}},
    "grpo_lr025": {"method": "grpo", "optim": {"lr": 7.5e-5}},
    "grpo_replay25": {"method": "grpo", "regularizers": {"replay_fraction": 0.25}},  # at_least_one: 1 of 4 prompts
    "grpo_l2": {"method": "grpo", "regularizers": {"l2_prev": 0.01}},
    # ... and the hybrid taken apart: its conservative terms alone (also a frontier setting), and without each part
    "hybrid_no_distill": {"method": "grpo", "regularizers": CONSERVATIVE},
    "hybrid_no_replay": merge(HYBRID, {"regularizers": {"replay_fraction": 0.0}}),
    "hybrid_no_l2": merge(HYBRID, {"regularizers": {"l2_prev": 0.0}}),
    # the multitask reference: GRPO on the union of the sequence's domains, one stage of the sequence's total steps
    # (`joint_recipe`: the first domain's prompts and the others' through regularizers.replay_domains)
    "joint": {"method": "grpo"},
    # Not in the default sweep (the earlier collection's; run them with --methods):
    # SDPO's sparse variant: the sampled token only (needs α 1, reverse KL); otherwise as sdpo
    "sdpo_sampled": {"method": "sdpo", "distill": {"support": "sampled", "alpha": 1.0, **AUTOCAST}},
    # SDFT with the reference defaults: one sample per prompt, teacher shown the example's demonstration, EMA τ
    # 0.01, forward KL over the full vocabulary, first 3 tokens skipped. 24 prompts x 1 sample per step: the same
    # 24 sequences per step as the others' 4 x 6.
    "sdft": {
        "method": "sdft",
        "distill": AUTOCAST,
        "rollout": {"group_size": 1},
        "optim": {"prompts_per_step": 24},
    },
}
DEFAULT_METHODS = list(COLLECTIONS["issue25"].seeds)  # issue 25's list
SDPO_VARIANTS = ("sdpo", "sdpo_sampled", "sdpo_gated")  # the hybrid's gain is held against the best of these
REFERENCE = "grpo"  # the method every other is compared with (the headline, the Pareto plot's marked point)

# Retention probes (general ability; no stage trains them): evaluated before training and after every stage, as
# recipes/grpo.yaml's, from local copies: (file under --data, row format). ARC-Challenge test, BoolQ / PIQA /
# Winogrande validation. Each file is one source; its first examples_per_domain rows after a seeded shuffle are the
# eval set (the rest, the "train" rows, are never used), so every method of a seed sees the same probe items.
PROBES = {
    "arc": ("arc/challenge_test.jsonl", "arc"),
    "boolq": ("boolq/test.json", "boolq"),
    "piqa": ("piqa/piqa.jsonl", "piqa"),
    "winogrande": ("winogrande/winogrande.jsonl", "winogrande"),
}
DEFAULT_DATA = "../shared/data"  # relative to the repo root, where the runs start


def apply_overrides(recipe: dict, overrides: list[str]) -> dict:
    """`KEY=VALUE` overrides (dotted keys into nested dicts, a list's entry by its name; YAML values) applied to a
    copy of `recipe`."""
    out = copy.deepcopy(recipe)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE, e.g. optim.steps=2")
        *path, last = key.split(".")
        node = out
        for part in path:
            if isinstance(node, list):  # a stage or domain by its name: stages.toolcall.optim.steps=2
                named = [item for item in node if isinstance(item, dict) and item.get("name") == part]
                if not named:
                    raise SystemExit(f"--set {item!r}: no entry named {part!r} in that list")
                node = named[0]
            else:
                node = node.setdefault(part, {})
        node[last] = yaml.safe_load(value)
    return out


def with_probes(recipe: dict, data: str) -> dict:
    """`recipe` with the PROBES as domains (files under `data`; relative = to the repo root) and retention probes."""
    out = copy.deepcopy(recipe)
    out["domains"] += [
        {"name": name, "source": f"{data}/{file}", "format": fmt} for name, (file, fmt) in PROBES.items()
    ]
    out.setdefault("eval", {})["retention_probes"] = list(PROBES)
    return out


def missing_probe_files(data: str) -> list[str]:
    """The PROBES files not found under `data` (relative = to the repo root)."""
    root = ROOT / data
    return [file for file, _ in PROBES.values() if not (root / file).is_file()]


def base_recipe(overrides: list[str] = (), data: str | None = DEFAULT_DATA, sequence: str | None = None) -> dict:
    """base.yaml with sequence `sequence`'s domains and stages (sweeps.SEQUENCES; None: base.yaml's own), then the
    `overrides`, then the retention probes from `data` (None: none)."""
    recipe = yaml.safe_load((HERE / "base.yaml").read_text())
    if sequence is not None:
        recipe = with_sequence(recipe, sequence)
    recipe = apply_overrides(recipe, list(overrides))
    return recipe if data is None else with_probes(recipe, data)


def method_recipe(
    method: str,
    seed: int,
    runs: Path,
    overrides: list[str] = (),
    data: str | None = DEFAULT_DATA,
    sequence: str | None = None,
    row0_from: str | None = None,
) -> dict:
    """`base_recipe` and `method`'s blocks: the method on every stage, its blocks at recipe level (`joint`: one
    multitask stage, `joint_recipe`). `row0_from`: the method whose run of this seed (in `runs`) evaluates row 0 for
    this one (eval.before_from; not for that method itself)."""
    recipe = base_recipe(overrides, data, sequence)
    if method == "joint":
        recipe = joint_recipe(recipe)
    spec = dict(METHODS[method])
    name = spec.pop("method")
    for stage in recipe["stages"]:
        stage["method"] = name
    recipe = merge(recipe, spec)
    recipe["seed"] = seed
    recipe["output_dir"] = str(runs / f"{method}-s{seed}")
    if row0_from is not None and row0_from != method:
        recipe["eval"]["before_from"] = str(runs / f"{row0_from}-s{seed}")
    return recipe


def joint_recipe(recipe: dict) -> dict:
    """The `joint` reference of a sequence recipe: one stage on the first domain with the sequence's other trained
    domains replayed (regularizers.replay_domains) at (T − 1)/T of the prompts, `stochastic` rounding (each domain
    1/T of the prompts in expectation; 2 + 2 of 4 on every step for T = 2), for the sequence's total steps."""
    out = copy.deepcopy(recipe)
    stages = out["stages"]
    trained = list(dict.fromkeys(s["domain"] for s in stages))
    steps = sum(s.get("optim", {}).get("steps", recipe["optim"]["steps"]) for s in stages)
    regularizers = {
        "replay_domains": trained[1:],
        "replay_fraction": (len(trained) - 1) / len(trained),
        "replay_rounding": "stochastic",
    }
    out["stages"] = [
        {"name": "joint", "domain": trained[0], "method": stages[0]["method"], "optim": {"steps": steps},
         "regularizers": regularizers}
    ]  # fmt: skip
    return out
