"""benchmarks/science for issue 43: GRPO's frontier and the gap to it, the references (base, stage_skip, joint), the
exact sign-flip test, the new methods' recipes and the sweep's job order, on synthetic run directories whose figures
are known by hand (no model runs)."""

from __future__ import annotations

import importlib
import json

import pytest

from adaptercl.recipe.grammar import resolve_recipe
from tests.benchmarks.test_science import N, method_recipes, science_run, write_run

analysis = importlib.import_module("analysis")
collect = importlib.import_module("collect")
frontier = importlib.import_module("frontier")
references = importlib.import_module("references")
resampling = importlib.import_module("resampling")
results = importlib.import_module("results")
sweeps = importlib.import_module("sweeps")

# ------------------------------------------------------------------------------------ the frontier by hand


def test_attainable_is_the_best_single_point_or_line_at_or_past_x():
    pts = [(0.1, 0.0), (0.3, 0.5), (0.5, 0.8)]
    # at 0.2: points past it 0.5, 0.8; lines (0.1,0)-(0.3,0.5) → 0.25, (0.1,0)-(0.5,0.8) → 0.2: the hull's 0.2
    assert frontier.attainable(pts, 0.2, True) == (pytest.approx(0.2), False)
    assert frontier.attainable(pts, 0.05, True) == (0.0, False)  # a point past it forgets nothing
    assert frontier.attainable(pts, 0.6, True) == (0.8, True)  # beyond every setting: the most plastic one's
    # higher is better (retention_ratio): the best a setting at or past 0.2 keeps, or a line's value
    assert frontier.attainable([(0.1, 0.9), (0.3, 0.5)], 0.2, False) == (pytest.approx(0.7), False)
    assert frontier.gap_of((0.2, 0.1), pts, True) == (pytest.approx(-0.1), False)  # below F: above the frontier


def test_sign_flip_p_by_hand():
    # 3 positive differences: only the observed signs reach the observed mean, 1 of 2^3
    assert resampling.sign_flip_p([0.1, 0.2, 0.3], "> 0") == 1 / 8
    # one negative (sum 0.3): the sums ≥ 0.3 are (0.1, −0.2, 0.4), (0.1, 0.2, 0.4) and (−0.1, 0.2, 0.4): 3 of 8
    values = [0.1, -0.2, 0.4]
    count = 0
    for mask in range(8):
        signed = [v if mask >> i & 1 else -v for i, v in enumerate(values)]
        count += sum(signed) / 3 >= sum(values) / 3 - 1e-12
    assert resampling.sign_flip_p(values, "> 0") == count / 8 == 3 / 8
    assert resampling.sign_flip_p([-0.1, -0.2], "< 0") == 1 / 4 and resampling.sign_flip_p([], "> 0") is None


# ------------------------------------------------------------------------------------ synthetic collection

# (a, b, p) correct of N after each row; a then b trained, p a retention probe
ROWS = {
    "grpo": [(2, 3, 6), (8, 3, 6), (4, 7, 4)],  # plasticity (0.6 + 0.4) / 2 = 0.5, forgetting 0.4
    "grpo_lr050": [(2, 3, 6), (6, 3, 6), (5, 5, 6)],  # plasticity (0.4 + 0.2) / 2 = 0.3, forgetting 0.1
    "hybrid": [(2, 3, 6), (7, 3, 6), (6, 6, 6)],  # plasticity (0.5 + 0.3) / 2 = 0.4, forgetting 0.1
    "hybrid_no_distill": [(2, 3, 6), (7, 3, 6), (5, 6, 6)],  # plasticity 0.4, forgetting 0.2
}
JOINT = [(2, 3, 6), (7, 7, 6)]  # one multitask stage


def write_joint(runs, seed):
    run = runs / f"joint-s{seed}"
    stages = ["stage-00-before", "stage-01-joint"]
    for k, (stage, row) in enumerate(zip(stages, JOINT)):
        d = run / stage
        d.mkdir(parents=True)
        evals = {n: {"accuracy": c / N, "n": N, "correct": [i < c for i in range(N)]} for n, c in zip("abp", row)}
        (d / "eval.json").write_text(json.dumps(evals))
        if k:
            (d / "drift.json").write_text(json.dumps({"stage_kl": None}))
            (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5}))
            (d / "done.json").write_text(json.dumps({"train_seconds": 60.0}))
    summary = {"domains": ["a", "b", "p"], "stages": stages, "cl_metrics": {"trained_columns": [0]}}
    (run / "summary.json").write_text(json.dumps(summary))


@pytest.fixture
def collection(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    for seed in (0, 1):
        for method, rows in ROWS.items():
            write_run(runs, method, seed, rows)
        write_joint(runs, seed)
    records, missing = collect.collect_runs(runs, [*ROWS, "joint"], [0, 1])
    assert not missing
    out: dict = {}
    for r in records:
        out.setdefault(r["method"], {})[r["seed"]] = r
    return runs, records, references.with_references(out)


def test_references_are_sequence_shaped_records(collection):
    _, _, runs = collection
    skip, base, joint = runs["stage_skip"][0], runs["base"][0], runs["joint"][0]
    assert skip["accuracy"] == [[0.2, 0.3, 0.6], [0.8, 0.3, 0.6], [0.8, 0.3, 0.6]]  # grpo's rows 0, 1, 1
    assert base["accuracy"] == [[0.2, 0.3, 0.6]] * 3 and base["correct"][2] == runs["grpo"][0]["correct"][0]
    assert joint["accuracy"] == [[0.2, 0.3, 0.6], [0.7, 0.7, 0.6], [0.7, 0.7, 0.6]]
    assert joint["trained_columns"] == [0, 1] and all(r["reference"] for r in (skip, base, joint))
    assert "reference" not in runs["grpo"][0]
    # base and stage_skip are GRPO's rows, not runs: no drift, KL or minutes of their own; joint is a run of its own
    assert skip["virtual"] and base["virtual"] and not joint["virtual"]
    assert skip["parameter_drift"] is None and skip["train_minutes"] is None and joint["train_minutes"] == 1.0


def test_frontier_gap_retains_and_position_by_hand(collection):
    _, _, runs = collection
    summary, draws, _ = analysis.summarise(runs, resamples=200)
    # the frontier: grpo (0.5, 0.4), grpo_lr050 (0.3, 0.1), hybrid_no_distill (0.4, 0.2), stage_skip (0.3, 0.0)
    gap = frontier.frontier_gap(summary, draws, "hybrid")
    # F(0.4): hybrid_no_distill's 0.2; the line stage_skip-grpo at 0.4: 0.2; lr050-grpo: 0.25 → 0.2; gap 0.1 − 0.2
    assert gap["gap"] == pytest.approx(-0.1) and gap["per_seed"] == {0: pytest.approx(-0.1), 1: pytest.approx(-0.1)}
    assert not gap["beyond"] and gap["settings"] == ["grpo", "grpo_lr050", "hybrid_no_distill", "stage_skip"]
    assert gap["ci95"][0] <= -0.1 <= gap["ci95"][1] and gap["sign_flip_p"] == 1 / 4  # 2 seeds: p ≥ 1/4
    h = frontier.headline_43(summary, draws)
    row = next(r for r in h["rows"] if r["method"] == "hybrid")
    assert row["retains"]["difference"] == pytest.approx((0.6 + 0.6) / 2 - (0.8 + 0.3) / 2)  # ACC − stage_skip's
    assert row["position"] == pytest.approx((0.6 - 0.55) / (0.7 - 0.55))
    assert row["cost"]["difference"] == pytest.approx(0.4 - 0.5)
    # retention_ratio: hybrid a 6 / max(2, 7, 6), b 6 / max(3, 6); its own figure and the gap in it exist
    assert summary["hybrid"]["figures"]["retention_ratio"]["mean"] == pytest.approx((6 / 7 + 1.0) / 2)
    assert row["gap"]["retention_ratio"] is not None
    (ablation,) = h["ablations"]
    assert ablation["without"] == "distill" and ablation["forgetting"]["difference"] == pytest.approx(0.2 - 0.1)
    # the distillation at equal plasticity: both gaps against grpo, lr050 and stage_skip; F(0.4) = 0.2 for both
    d = h["distill_at_equal_plasticity"]
    assert d["difference"] == pytest.approx((0.1 - 0.2) - (0.2 - 0.2))
    assert not any(r["method"] in ("base", "stage_skip", "joint", "grpo") for r in h["rows"])


def test_results_carry_the_references_the_frontier_and_the_headline(collection, tmp_path):
    runs_dir, records, _ = collection
    setting = {"base": "b.yaml", "overrides": [], "runs_dir": "<runs>", "reference": "grpo"}
    data = results.write_results(records, tmp_path / "out", setting, method_recipes.METHODS, (), 100)
    assert data["references"] == ["base", "stage_skip", "joint"]
    assert [p["setting"] for p in data["frontier"]] == ["grpo", "grpo_lr050", "hybrid_no_distill", "stage_skip"]
    md = (tmp_path / "out" / "results.md").read_text()
    hybrid_row = next(line for line in md.splitlines() if line.startswith("| hybrid | -0.100"))  # its cost
    assert "## Issue 43 headline" in md and "| -0.100 [" in hybrid_row  # and its forgetting gap
    assert "## The hybrid taken apart" in md
    # item 1 per trained domain and averaged, by hand: hybrid a 0.6 / max(0.2, 0.7, 0.6), b 0.6 / max(0.3, 0.6);
    # gain a 0.6 − 0.2, b 0.6 − 0.3; stage_skip a 0.8 / 0.8, b 0.3 / max(0.3, 0.3), gain 0.6 and 0.0
    retention = md.split("## Retention and gain over base")[1].split("## ")[0]
    assert (
        "| method | seeds | retention a | retention b | retention (mean) | gain a | gain b | gain (mean) |"
        in retention
    )

    def means(method):
        row = next(line for line in retention.splitlines() if line.startswith(f"| {method} |"))
        return [cell.split(" [")[0] for cell in row.strip("| ").split(" | ")[1:]]

    assert means("hybrid") == ["2", "0.857", "1.000", "0.929", "0.400", "0.300", "0.350"]
    assert means("stage_skip") == ["2", "1.000", "1.000", "1.000", "0.600", "0.000", "0.300"]
    runs_table = md.split("## Runs")[1]
    assert "| joint-s0 |" in runs_table and "stage_skip" not in runs_table and runs_table.count("| grpo-s0 |") == 1
    assert all(r["method"] not in ("base", "stage_skip", "joint") for r in data["headline"]["rows"])
    assert (tmp_path / "out" / "pareto.png").stat().st_size > 1000
    assert not [r for r in data["training_signals"] if r["method"] in ("base", "stage_skip")]  # no traces tabled


# ------------------------------------------------------------------------------------ recipes and the sweep


def test_the_new_methods_set_their_knobs(tmp_path):
    def stage2(method):
        return resolve_recipe(
            method_recipes.method_recipe(method, 0, tmp_path, sequence="calc_hash-calc_says")
        ).stages[1]

    assert [stage2(m).optim.lr for m in ("grpo", "grpo_lr050", "grpo_lr025")] == [3e-4, 1.5e-4, 7.5e-5]
    r25, l2 = stage2("grpo_replay25").regularizers, stage2("grpo_l2").regularizers
    assert (r25.replay_fraction, r25.replay_rounding, l2.l2_prev) == (0.25, "at_least_one", 0.01)
    hybrid, no_distill = stage2("hybrid"), stage2("hybrid_no_distill")
    assert (no_distill.method, no_distill.regularizers.l2_prev, no_distill.regularizers.replay_fraction) == (
        "grpo", hybrid.regularizers.l2_prev, hybrid.regularizers.replay_fraction)  # fmt: skip
    assert (
        stage2("hybrid_no_replay").regularizers.replay_fraction == 0.0
        and stage2("hybrid_no_replay").method == "hybrid"
    )
    assert (
        stage2("hybrid_no_l2").regularizers.l2_prev == 0.0
        and stage2("hybrid_no_l2").regularizers.replay_fraction == 0.25
    )


@pytest.mark.parametrize(("sequence", "fraction"), [("calc_hash-calc_says", 0.5), ("calc_hash-calc_says-mcq", 2 / 3)])
def test_joint_is_one_multitask_stage_of_the_sequences_total_steps(tmp_path, sequence, fraction):
    recipe = resolve_recipe(method_recipes.method_recipe("joint", 0, tmp_path, sequence=sequence))
    (stage,) = recipe.stages
    domains = [d for d, _ in sweeps.SEQUENCES[sequence]]
    assert (stage.domain, stage.method, stage.optim.steps) == (
        domains[0],
        "grpo",
        sum(s for _, s in sweeps.SEQUENCES[sequence]),
    )
    assert stage.regularizers.replay_domains == domains[1:]
    assert (stage.regularizers.replay_fraction, stage.regularizers.replay_rounding) == (fraction, "stochastic")


def test_every_run_of_a_seed_but_grpo_takes_its_row_0_from_grpo(tmp_path):
    frontier_c = sweeps.COLLECTIONS["frontier"]
    for method in frontier_c.seeds:
        recipe = method_recipes.method_recipe(method, 3, tmp_path, list(frontier_c.settings), None,
                                           frontier_c.sequence, frontier_c.shares_row0_from)  # fmt: skip
        expected = None if method == "grpo" else str(tmp_path / "grpo-s3")
        assert recipe["eval"].get("before_from") == expected
        resolve_recipe(recipe)
    # the issue-43 settings: cheaper diagnostics, probes by log-likelihood; the earlier collections keep generation
    grpo = resolve_recipe(method_recipes.method_recipe("grpo", 0, tmp_path, list(frontier_c.settings)))
    assert (grpo.eval.drift_probes, grpo.eval.stage_kl_prompts, grpo.eval.teacher_lift_prompts) == (2, 16, 16)
    assert grpo.eval.choice_scoring == "loglikelihood"
    old = sweeps.COLLECTIONS["forgetting"]
    assert (
        resolve_recipe(method_recipes.method_recipe("grpo", 0, tmp_path, list(old.settings))).eval.choice_scoring
        == "generate"
    )


def test_the_sweep_runs_seed_by_seed_across_its_collections():
    seeds = {c: sweeps.COLLECTIONS[c].seeds for c in ("frontier", "frontier_reverse")}
    order = sweeps.interleaved_jobs(seeds)
    first_seed = [j for j in order if j[2] == 0]
    assert order[: len(first_seed)] == first_seed  # every seed-0 run before any seed-1 run
    assert [j[:2] for j in first_seed[:2]] == [("frontier", "grpo"), ("frontier", "hybrid")]
    assert {j[0] for j in first_seed} == {"frontier", "frontier_reverse"}
    assert len(order) == sum(len(v) for c in seeds.values() for v in c.values())
    # the pre-registered seeds: the headline methods 6 on both, S1's frontier 6, S2's other settings and joint 3
    assert all(seeds["frontier"][m] == [0, 1, 2, 3, 4, 5] for m in sweeps.HEADLINE_METHODS + sweeps.FRONTIER_SETTINGS)
    assert seeds["frontier_reverse"]["grpo_lr025"] == [0, 1, 2] and seeds["frontier"]["joint"] == [0, 1, 2]


def test_a_seed_waits_for_its_row_0_and_stops_if_that_run_failed(tmp_path):
    source = tmp_path / "grpo-s0"
    (tmp_path / "grpo-s0.run.json").write_text(json.dumps({"exit": 1}))
    with pytest.raises(SystemExit, match="grpo-s0 ended without its row 0"):
        science_run.wait_for_row0(source, poll_s=0.01)
    (source / "stage-00-before").mkdir(parents=True)
    (source / "stage-00-before" / "done.json").write_text("{}")
    science_run.wait_for_row0(source, poll_s=0.01)  # returns at once


# ------------------------------------------------------------------------------------ resuming on another machine


def test_committed_row_0_is_restored_for_the_seeds_remaining_runs(tmp_path):
    from adaptercl.run.sequence import run_recipe
    from adaptercl.run_dir import before_source

    ledger = importlib.import_module("ledger")
    raw = {
        "model": {"name": "tiny-random"},
        "output_dir": str(tmp_path / "runs" / "grpo-s0"),
        "lora": {"r": 4, "alpha": 8},
        "optim": {"lr": 1e-3, "steps": 1, "prompts_per_step": 2},
        "rollout": {"group_size": 2, "max_new_tokens": 4},
        "eval": {"examples_per_domain": 2, "drift_probes": 0, "stage_kl_prompts": 0},
        "domains": [{"name": "copy", "source": "builtin:copy"}],
        "stages": [{"name": "one", "domain": "copy", "method": "grpo"}],
    }
    run_recipe(resolve_recipe(raw))
    out = tmp_path / "out"
    assert ledger.save_row0(out, tmp_path / "runs", "grpo-s0")
    committed = (out / "row0" / "grpo-s0" / "recipe.resolved.yaml").read_text()
    assert str(tmp_path) not in committed and "<runs>/grpo-s0" in committed  # no machine path committed
    fresh = tmp_path / "fresh-runs"  # another machine: the runs folder is empty
    fresh.mkdir()
    assert ledger.restore_row0(out, fresh, "grpo-s0") and not ledger.restore_row0(out, fresh, "grpo-s0")
    other = {
        **raw,
        "output_dir": str(fresh / "hybrid-s0"),
        "eval": {**raw["eval"], "before_from": str(fresh / "grpo-s0")},
    }
    source = before_source(resolve_recipe(other))  # the restored folder is a run with a finished row 0
    assert (source.before.eval).read_bytes() == (
        tmp_path / "runs" / "grpo-s0" / "stage-00-before" / "eval.json"
    ).read_bytes()


def test_records_round_trip_and_a_collection_takes_committed_runs(collection, tmp_path):
    ledger = importlib.import_module("ledger")
    _, records, _ = collection
    out = tmp_path / "out"
    ledger.save_records(out, records)
    loaded = ledger.load_records(out)
    assert set(loaded) == {(r["method"], r["seed"]) for r in records}
    assert (
        loaded[("hybrid", 1)]["correct"]
        == next(r for r in records if r["method"] == "hybrid" and r["seed"] == 1)["correct"]
    )
    assert ledger.load_records(tmp_path / "nothing") == {}


def test_run_cost_times_each_process_to_its_own_end(tmp_path):
    """Two processes started together, the long one listed (and once waited on) first: the short one's wall time is
    its own (about 0.2 s), not the long one's (1.5 s)."""
    import sys

    run_cost = importlib.import_module("run_cost")
    env = {"RUN_COST_LOGS": str(tmp_path), "PATH": ""}
    sleep = [sys.executable, "-c", "import sys, time; time.sleep(float(sys.argv[1]))"]
    out = run_cost.timed([("long", [*sleep, "1.5"], env, tmp_path), ("short", [*sleep, "0.2"], env, tmp_path)])
    assert out["long"]["wall_s"] >= 1.5 and out["short"]["wall_s"] < 1.0, out
    assert out["long"]["exit"] == out["short"]["exit"] == 0
