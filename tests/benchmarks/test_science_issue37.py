"""benchmarks/science for issue 37: the collections and sequences (sweeps.py), the new baselines' recipes, paired
comparisons over the seeds two methods share, the formatting-artifact table, and the pilots (pilot.py), on synthetic
run directories whose figures are known by hand (no model runs)."""

from __future__ import annotations

import importlib
import json
import sys

import pytest

from adaptercl.recipe.grammar import resolve_recipe
from tests.benchmarks.test_science import STAGES, N, method_recipes, science_run, write_run

analysis = importlib.import_module("analysis")
collect = importlib.import_module("collect")
headline = importlib.import_module("headline")
results = importlib.import_module("results")
format_artifacts = importlib.import_module("format_artifacts")
gate = importlib.import_module("gate")
sweeps = importlib.import_module("sweeps")
pilot = importlib.import_module("pilot")

CANDIDATE = "mcq-mcq_text"

# ------------------------------------------------------------------------------------ collections and recipes


def test_every_sequence_makes_a_valid_recipe_with_one_evolving_adapter(tmp_path):
    for name, stages in sweeps.SEQUENCES.items():
        recipe = resolve_recipe(method_recipes.method_recipe("grpo", 0, tmp_path, sequence=name))
        assert [(s.domain, s.optim.steps) for s in recipe.stages] == stages
        assert [s.adapter.init for s in recipe.stages][1:] == ["continue"] * (len(stages) - 1)
        assert {s.rollout.group_size * s.optim.prompts_per_step for s in recipe.stages} == {24}  # base.yaml's budget
        assert recipe.eval.retention_probes == ["arc", "boolq", "piqa", "winogrande"]
    # the override of a candidate's stage by its name, as the pilots' variants do
    longer = method_recipes.method_recipe("grpo", 0, tmp_path, ["stages.mcq_text.optim.steps=24"], None, CANDIDATE)
    assert [s.optim.steps for s in resolve_recipe(longer).stages] == [12, 24]
    with pytest.raises(SystemExit, match="unknown sequence 'nope'"):
        method_recipes.method_recipe("grpo", 0, tmp_path, sequence="nope")


def test_the_forgetting_collection_has_the_baselines_and_more_seeds_where_the_question_is(tmp_path):
    forgetting = sweeps.COLLECTIONS["forgetting"]
    seeds = forgetting.seeds
    assert set(seeds) == {"grpo", "grpo_replay01", "grpo_replay10", "srpo", "srpo_gated", "hybrid", "hybrid_gated",
                          "sdpo"}  # fmt: skip
    assert all(len(v) >= 3 for v in seeds.values()) and all(
        len(seeds[m]) >= 5 for m in ("grpo", "grpo_replay10", "hybrid")
    )
    assert not set().union(*seeds.values()) & {pilot.PILOT_SEED}  # the pilots' seed is never a sweep's
    for method in seeds:  # every method validates on every candidate sequence
        for sequence in pilot.CANDIDATES:
            resolve_recipe(method_recipes.method_recipe(method, 0, tmp_path, sequence=sequence))
    replay = resolve_recipe(method_recipes.method_recipe("grpo_replay10", 0, tmp_path, sequence=CANDIDATE)).stages[1]
    assert (replay.method, replay.regularizers.replay_fraction, replay.regularizers.replay_rounding) == (
        "grpo", 0.1, "stochastic")  # fmt: skip
    for gated, plain in (("srpo_gated", "srpo"), ("hybrid_gated", "hybrid")):
        stage = resolve_recipe(method_recipes.method_recipe(gated, 0, tmp_path, sequence=CANDIDATE)).stages[1]
        assert (stage.method, stage.distill.gate.kind, stage.distill.gate.every) == (plain, "lift", 4)
        # the gate is the one difference from the ungated method
        ungated = method_recipes.method_recipe(plain, 0, tmp_path / "x", sequence=CANDIDATE)
        with_gate = method_recipes.method_recipe(gated, 0, tmp_path / "x", sequence=CANDIDATE)
        with_gate["distill"].pop("gate")
        assert with_gate == {**ungated, "output_dir": with_gate["output_dir"]}
    # the earlier collection is as it ran: its methods and seeds
    assert sweeps.COLLECTIONS["issue25"].seeds == {m: [0, 1, 2] for m in method_recipes.DEFAULT_METHODS}


def test_runs_go_seed_by_seed_and_the_forgetting_collection_waits_for_its_sequence(tmp_path, monkeypatch):
    assert sweeps.jobs({"a": [0, 1, 2], "b": [0, 1]}) == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2)]
    monkeypatch.setattr(science_run, "run_one", lambda *a: pytest.fail("a run started"))
    monkeypatch.setattr(sys, "argv", ["run.py", "--collection", "forgetting", "--runs", str(tmp_path)])
    if sweeps.COLLECTIONS["forgetting"].sequence is None:
        with pytest.raises(SystemExit, match="collection 'forgetting' has no sequence yet: run the pilots"):
            science_run.main()
    with pytest.raises(SystemExit, match="^grpo-s0: .*optim.steps"):  # per-method seeds, validated before any run
        science_run.preflight(["grpo", "sdpo"], {"grpo": [0, 3], "sdpo": [0]}, tmp_path, ["optim.steps=0"], None)


# ------------------------------------------------------------------ paired comparisons over the seeds both have


def by_method(runs_dir, seeds: dict[str, list[int]]) -> dict[str, dict[int, dict]]:
    records, missing = collect.collect_runs(runs_dir, list(seeds), seeds)
    assert not missing
    out: dict[str, dict[int, dict]] = {}
    for r in records:
        out.setdefault(r["method"], {})[r["seed"]] = r
    return out


def test_a_method_with_more_seeds_keeps_them_and_each_comparison_pairs_the_shared_ones(tmp_path):
    # grpo forgets a (0.8 -> final) by 0.4, 0.2, 0.8 on seeds 0, 1, 2; "better" keeps a (0.8) on seeds 0 and 1 only
    for seed, final_a in ((0, 4), (1, 6), (2, 0)):
        write_run(tmp_path, "grpo", seed, [(2, 3, 6), (8, 3, 6), (final_a, 7, 6)])
    for seed in (0, 1):
        write_run(tmp_path, "better", seed, [(2, 3, 6), (8, 3, 6), (8, 7, 6)])
    runs = by_method(tmp_path, {"grpo": [0, 1, 2], "better": [0, 1]})
    summary, draws, seeds = analysis.summarise(runs, resamples=200)
    assert seeds == [0, 1, 2] and summary["grpo"]["seeds"] == [0, 1, 2] and summary["better"]["seeds"] == [0, 1]
    assert summary["grpo"]["figures"]["forgetting"]["mean"] == pytest.approx(1.4 / 3)  # all three of its seeds
    row = headline.versus_reference(summary, draws, "grpo")["rows"][0]["forgetting"]
    # the comparison is over seeds 0 and 1: grpo's 0.3 there, not its 0.467 over three seeds
    assert (row["left"], row["right"], row["difference"]) == pytest.approx((0.0, 0.3, -0.3))
    # its interval is the paired bootstrap of exactly those two seeds: the one of a collection without grpo's seed 2
    two = {"grpo": {s: runs["grpo"][s] for s in (0, 1)}, "better": runs["better"]}
    summary2, draws2, _ = analysis.summarise(two, resamples=200)
    assert row["ci95"] == headline.versus_reference(summary2, draws2, "grpo")["rows"][0]["forgetting"]["ci95"]
    assert row["state"] == "met" and row["ci95"][1] < 0
    # the seed-level check: each shared seed's difference (0 − 0.4, 0 − 0.2) and the t-interval over those two seeds,
    # mean −0.3 ± t(1) 12.706 × sd 0.1414 / √2 = ± 1.2706: undecided where the bootstrap says met
    assert row["per_seed"] == {0: pytest.approx(-0.4), 1: pytest.approx(-0.2)}
    assert row["seed_t95"] == pytest.approx([-0.3 - 1.2706, -0.3 + 1.2706], abs=1e-4)
    assert row["seed_state"] == "undecided"
    md = "\n".join(results.seed_check_md(headline.versus_reference(summary, draws, "grpo")))
    # ACC (mean final over a, b): better 0.75 against grpo's 0.55 and 0.65: +0.20, +0.10, 0.15 ± 12.706 × 0.05
    assert (
        "| better | 2 | +0.20, +0.10 | 0.150 [-0.485, 0.785] undecided | -0.40, -0.20 | -0.300 [-1.571, 0.971] " in md
    )


# ------------------------------------------------------------------------------------- formatting artifacts


def with_completions(run_dir, texts: dict[str, list[list[str]]]) -> None:
    """Add `completions` per stage row (texts[domain][k]) to a synthetic run's eval.json files."""
    for k, stage in enumerate(STAGES):
        path = run_dir / stage / "eval.json"
        rows = json.loads(path.read_text())
        for domain, per_row in texts.items():
            rows[domain]["completions"] = per_row[k]
        path.write_text(json.dumps(rows))


def test_artifacts_are_collected_per_stage_and_summarised_against_grpo(tmp_path):
    # The base answers a with "x y" and "p q" (one bigram each, no trigram). grpo's stage-1 answers are the base's:
    # ratio exactly 1. sdpo's are "x y z": bigrams "x y", "y z" and trigram "x y z", all among the top: rate 1.0; in the
    # base's answers those are 5 of 10 bigram positions (every "x y") and no trigram position: base rate 0.5, ratio 2.
    base = ["x y", "p q"] * (N // 2)
    for method, stage_a in (("grpo", base), ("sdpo", ["x y z"] * N)):
        for seed in (0, 1):
            write_run(tmp_path, method, seed, [(2, 3, 6), (8, 3, 6), (6, 7, 6)])
            with_completions(tmp_path / f"{method}-s{seed}", {"a": [base, stage_a, stage_a], "b": [base] * 3})
    runs = by_method(tmp_path, {"grpo": [0, 1], "sdpo": [0, 1]})
    art = runs["sdpo"][0]["artifacts"]
    assert art[0]["domain"] == "a" and (art[0]["rate"], art[0]["base_rate"], art[0]["ratio"]) == (1.0, 0.5, 2.0)
    assert [t["ngram"] for t in art[0]["top"]] == ["x y z", "x y", "y z"]  # by rate: 1 of 1 trigram, 1 of 2 bigrams
    assert art[1]["domain"] == "b" and art[1]["ratio"] == 1.0  # stage 2 answers b as the base did
    assert runs["grpo"][0]["artifacts"][0]["ratio"] == 1.0
    rows = {(r["method"], r["stage"]): r for r in format_artifacts.artifact_table(runs)}
    assert rows["grpo", 1]["ratio"] == {"mean": 1.0, "ci95": [1.0, 1.0], "n": 2}
    assert rows["grpo", 1]["versus_reference"] is None and rows["sdpo", 1]["seeds"] == 2
    assert rows["sdpo", 1]["versus_reference"] == {"mean": 1.0, "ci95": [1.0, 1.0], "n": 2}  # 2 − 1 on both seeds
    assert rows["sdpo", 2]["versus_reference"]["mean"] == 0.0
    md = "\n".join(format_artifacts.artifacts_md(list(rows.values())))
    assert (
        "| sdpo | 1 (a) | 2 | 1.000 | 0.500 | 2.00 [2.00, 2.00] | 1.00 [1.00, 1.00] | `x y z` (2: 1.000 / –), "
        "`x y` (2: 0.500 / 0.500), `y z` (2: 0.500 / 0.000) |" in md
    )
    for r in runs["grpo"].values():  # runs older than the diagnostic: no row, no table
        r["artifacts"] = [None, None]
    assert format_artifacts.artifact_table({"grpo": runs["grpo"]}) == [] and format_artifacts.artifacts_md([]) == []


# ---------------------------------------------------------------------------------------------------- pilots


def test_pilot_recipes_are_grpo_on_the_candidate_at_the_pilot_seed_without_diagnostics(tmp_path):
    assert pilot.KNOWN not in pilot.CANDIDATES and set(pilot.CANDIDATES) < set(sweeps.SEQUENCES)
    for candidate in pilot.CANDIDATES:
        raw = pilot.pilot_recipe(candidate, pilot.PILOT_SEED, tmp_path)
        recipe = resolve_recipe(raw)
        assert raw["output_dir"] == str(tmp_path / f"{candidate}-s100") and recipe.seed == 100
        assert {s.method for s in recipe.stages} == {"grpo"} and not recipe.eval.retention_probes
        assert [(s.domain, s.optim.steps) for s in recipe.stages] == sweeps.SEQUENCES[candidate]
        assert (recipe.eval.examples_per_domain, recipe.eval.drift_probes, recipe.eval.teacher_lift_prompts) == (
            100, 0, 0)  # fmt: skip
        assert not recipe.eval.parameter_drift and recipe.eval.stage_kl_prompts == 0
    small = pilot.pilot_recipe(CANDIDATE, 100, tmp_path, ["optim.steps=2"])
    assert resolve_recipe(small).stages[0].optim.steps == 2


def test_pilot_verdict_and_report_by_hand(tmp_path):
    # a: 2 -> 8 -> 4 of 10 (forgets 0.4); b: 3 -> 3 -> 7 (gain 0.4): GRPO forgets and both stages are learnable
    write_run(tmp_path, "forgets", 100, [(2, 3, 6), (8, 3, 6), (4, 7, 6)])
    write_run(tmp_path, "keeps", 100, [(2, 3, 6), (8, 3, 6), (8, 7, 6)])  # forgets nothing
    records = [collect.collect_run(tmp_path / f"{m}-s100", m, 100) for m in ("forgets", "keeps")]
    summary, _, _ = analysis.summarise({r["method"]: {100: r} for r in records}, resamples=200)
    assert pilot.verdict(summary["forgets"]["figures"], 2) == {"forgets": True, "learnable": True,
                                                               "chosen_by_criterion": True}  # fmt: skip
    assert pilot.verdict(summary["keeps"]["figures"], 2)["forgets"] is False  # its interval is [0, 0]
    text = pilot.report(records, 200)
    assert "## forgets (seed 100, n = 10, 10, 10 per domain)" in text
    assert "| after | a | b | p |" in text and "| before | 0.200 [0.057, 0.510] | 0.300 [" in text  # Wilson, n 10
    assert "| forgets | a, b | 1 (a) 0.600 [" in text and "| 0.400 [" in text and text.rstrip().endswith("above 0.")
    rows = [line for line in text.splitlines() if line.startswith(("| forgets | a, b", "| keeps | a, b"))]
    assert rows[0].endswith("| yes |") and rows[1].endswith("| no |")


def test_results_of_a_collection_with_unequal_seeds_and_artifacts(tmp_path):
    runs_dir = tmp_path / "runs"
    base = ["x y", "p q"] * (N // 2)
    for method, seeds, stage_a in (("grpo", (0, 1, 2), base), ("hybrid", (0, 1), ["x y z"] * N)):
        for seed in seeds:
            write_run(runs_dir, method, seed, [(2, 3, 6), (8, 3, 6), (6, 7, 6)])
            with_completions(runs_dir / f"{method}-s{seed}", {"a": [base, stage_a, stage_a]})
    seeds = {"grpo": [0, 1, 2], "hybrid": [0, 1]}
    records, _ = collect.collect_runs(runs_dir, list(seeds), seeds)
    setting = {"base": "benchmarks/science/base.yaml", "collection": "forgetting", "seeds": seeds, "overrides": [],
               "runs_dir": "<runs>", "reference": "grpo"}  # fmt: skip
    data = results.write_results(records, tmp_path / "out", setting, method_recipes.METHODS, (), 50, {})
    md = (tmp_path / "out" / "results.md").read_text()
    assert "mean over each method's seeds ([0, 1, 2] in all; the seeds column)" in md and "With 2 to 3 seeds" in md
    assert "| grpo | 3 | " in md and "| hybrid | 2 | " in md  # the per-method table's seeds column
    assert "| hybrid | 1 (a) | 2 | 1.000 | 0.500 | 2.00 [2.00, 2.00] | 1.00 [1.00, 1.00] |" in md
    assert data["meta"]["setting"]["seeds"] == seeds and data["formatting_artifacts"][0]["method"] == "grpo"


# -------------------------------------------------------------------------------------------------- lift gate


def gated_metrics(opens: list[int], checks: dict[int, tuple[int, float | None]]) -> str:
    """A stage's metrics.jsonl: `lift_gate_open` per step; at the steps in `checks` a check with (n, lift) and an
    interval of lift ± 0.1 (none when n = 0), plus a guard event line that is not a step."""
    lines = []
    for i, is_open in enumerate(opens):
        row = {"step": i + 1, "reward_mean": 0.5, "lift_gate_open": float(is_open)}
        if i + 1 in checks:
            n, lift = checks[i + 1]
            row.update(lift_gate_check=1.0, lift_gate_prompts=16.0, lift_gate_n=float(n))
            if n:
                row.update(lift_gate_lift=lift, lift_gate_lift_lo=lift - 0.1, lift_gate_lift_hi=lift + 0.1)
        lines.append(json.dumps(row))
    lines.append(json.dumps({"event": "reward_collapse", "action": "warn", "step": 2, "message": "m"}))
    return "\n".join(lines)


def test_the_lift_gate_per_stage_is_collected_and_summarised_by_hand(tmp_path):
    # hybrid_gated, 6 steps a stage, checks at steps 1 and 4. Stage 1 (a): seed 0 opens at step 1 (lift 0.5 over 9
    # pairs) and closes at step 4 (0.1 over 8): 3 of 6 steps distil; seed 1 opens at 1 and again at 4 (0.3 over 10,
    # 0.4 over 12): 6 of 6. Stage 2 (b): never open; seed 0's first check has no pairs (n 0, no lift), its second
    # lift -0.2 over 5; seed 1's 0.0 over 3 and 0.2 over 7. grpo logs no gate: no rows.
    stage_a = {0: ([1, 1, 1, 0, 0, 0], {1: (9, 0.5), 4: (8, 0.1)}), 1: ([1] * 6, {1: (10, 0.3), 4: (12, 0.4)})}
    stage_b = {0: ([0] * 6, {1: (0, None), 4: (5, -0.2)}), 1: ([0] * 6, {1: (3, 0.0), 4: (7, 0.2)})}
    for seed in (0, 1):
        write_run(tmp_path, "grpo", seed, [(2, 3, 6), (8, 3, 6), (6, 7, 6)])
        write_run(tmp_path, "hybrid_gated", seed, [(2, 3, 6), (8, 3, 6), (8, 7, 6)])
        for stage, script in ((STAGES[1], stage_a[seed]), (STAGES[2], stage_b[seed])):
            (tmp_path / f"hybrid_gated-s{seed}" / stage / "metrics.jsonl").write_text(gated_metrics(*script))
    runs = by_method(tmp_path, {"grpo": [0, 1], "hybrid_gated": [0, 1]})
    assert runs["grpo"][0]["lift_gate"] == [None, None]
    first = runs["hybrid_gated"][0]["lift_gate"][0]
    assert first["open"] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]  # the guard event is not a step
    assert first["checks"] == [
        {"step": 1, "n": 9, "lift": 0.5, "ci95": [0.4, 0.6], "opened": True},
        {"step": 4, "n": 8, "lift": 0.1, "ci95": [pytest.approx(0.0), pytest.approx(0.2)], "opened": False},
    ]
    assert runs["hybrid_gated"][0]["lift_gate"][1]["checks"][0] == {
        "step": 1, "n": 0, "lift": None, "ci95": None, "opened": False
    }  # fmt: skip
    rows = {(r["method"], r["stage"]): r for r in gate.gate_table(runs)}
    assert set(rows) == {("hybrid_gated", "a"), ("hybrid_gated", "b")}
    a, b = rows["hybrid_gated", "a"], rows["hybrid_gated", "b"]
    assert (a["open_share"], a["open_share_per_seed"]) == (0.75, {0: 0.5, 1: 1.0})
    assert (a["checks"], a["checks_opened"], a["pairs"]) == (4, 3, [8, 12])
    assert a["lift_mean"] == pytest.approx(0.325) and a["lift_range"] == [0.1, 0.5]
    assert (b["open_share"], b["checks"], b["checks_opened"], b["pairs"]) == (0.0, 4, 0, [0, 7])
    assert b["lift_mean"] == pytest.approx(0.0) and b["lift_range"] == [-0.2, 0.2]  # the n = 0 check has no lift
    md = "\n".join(gate.gate_md(gate.gate_table(runs)))
    assert "| hybrid_gated | a | 2 | 0.75 | 0.50, 1.00 | 3 of 4 | 8–12 | +0.33 (+0.10, +0.50) |" in md
    assert "| hybrid_gated | b | 2 | 0.00 | 0.00, 0.00 | 0 of 4 | 0–7 | +0.00 (-0.20, +0.20) |" in md
    assert gate.gate_md(gate.gate_table({"grpo": runs["grpo"]})) == []
