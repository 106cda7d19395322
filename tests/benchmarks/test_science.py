"""benchmarks/science: the per-method recipes, and the collection and statistics on synthetic run directories
whose figures are known by hand (no model runs)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from adaptercl.recipe.grammar import resolve_recipe
from adaptercl.recipe.method_table import METHODS as ADAPTERCL_METHODS

SCIENCE = Path(__file__).resolve().parents[2] / "benchmarks" / "science"
spec = importlib.util.spec_from_file_location("science_run", SCIENCE / "run.py")
science_run = importlib.util.module_from_spec(spec)
spec.loader.exec_module(science_run)  # puts benchmarks/ and benchmarks/science on sys.path
analysis = sys.modules.get("analysis") or importlib.import_module("analysis")
collect = importlib.import_module("collect")
method_recipes = importlib.import_module("method_recipes")
results = importlib.import_module("results")
headline = importlib.import_module("headline")
signals = importlib.import_module("signals")

N = 10  # eval examples per domain
STAGES = ["stage-00-before", "stage-01-a", "stage-02-b"]


def column(k: int) -> list[bool]:
    return [i < k for i in range(N)]  # k of N correct


def make_run(runs: Path, method: str, seed: int, final_a: int, kl: float, drift: float, lift: bool) -> None:
    """Domains a, b trained in that order. a: 2 -> 8 -> final_a of 10; b: 3 -> 3 -> 7 of 10."""
    run = runs / f"{method}-s{seed}"
    counts = [(2, 3), (8, 3), (final_a, 7)]
    for k, (stage, (ca, cb)) in enumerate(zip(STAGES, counts)):
        d = run / stage
        d.mkdir(parents=True)
        rows = {name: {"accuracy": c / N, "n": N, "correct": column(c)} for name, c in (("a", ca), ("b", cb))}
        (d / "eval.json").write_text(json.dumps(rows))
        if k == 0:
            continue
        stage_kl = {"kl_token_mean": kl if k == 2 else 0.5, "kl_sequence_mean": 10 * kl, "prompts": 4}
        response = {"a": {"kl_to_base": drift * 10, "foreign_format_rate": 0.0}}
        parameter = {"aggregate": {"relative_delta_norm_mean": drift}}
        (d / "drift.json").write_text(json.dumps({"stage_kl": stage_kl, "parameter": parameter, "response": response}))
        steps = [{"step": i + 1, "reward_mean": r} for i, r in enumerate([0.2, 0.4, 0.6, 0.6, 0.6, 0.6])]
        if method == "sdpo":  # a route share on every step but the 2nd (0.0 .. 0.5), a teacher refresh at step 4
            for i, row in enumerate(steps):
                row.update({"sdpo_route_frac": i / 10} if i != 1 else {}, teacher_refresh=float(i == 3))
        event = {"event": "reward_collapse", "action": "warn", "step": 6, "message": "m"}
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in steps + [event] * (method == "sdpo")))
        (d / "done.json").write_text(json.dumps({"train_seconds": 60.0}))
        if lift:
            (d / "teacher_lift.json").write_text(
                json.dumps({"lift": 0.5, "lift_ci95": [0.2, 0.8], "n": 6, "teacher_accuracy": 0.7,
                            "student_accuracy": 0.2, "context_frac": 0.5, "by_context": {"sibling": {}}})
            )  # fmt: skip
    accuracy = [[ca / N, cb / N] for ca, cb in counts]
    summary = {
        "domains": ["a", "b"],
        "stages": STAGES,
        "accuracy": accuracy,
        "cl_metrics": {"trained_columns": [0, 1]},
    }
    (run / "summary.json").write_text(json.dumps(summary))
    record = {"git": "abc1234", "exit": 0, "wall_s": 90.0, "command": "x", "load_average_at_start": [1.0, 1, 1]}
    (runs / f"{method}-s{seed}.run.json").write_text(json.dumps(record))


@pytest.fixture
def runs(tmp_path):
    # grpo forgets a (8 -> 4 or 6) with stage-2 KL 0.2 / 0.1; the hybrid forgets nothing (KL 0); sdpo is grpo's
    # data with a teacher lift and a guard alarm: forgetting caused = 2 x KL exactly, so R² = 1
    for seed, (final, kl) in enumerate([(4, 0.2), (6, 0.1)]):
        make_run(tmp_path, "grpo", seed, final, kl, drift=1e-3 * (seed + 1), lift=False)
        make_run(tmp_path, "sdpo", seed, final, kl, drift=1e-3 * (seed + 3), lift=True)
        make_run(tmp_path, "hybrid", seed, 8, 0.0, drift=1e-3, lift=True)
    return tmp_path


def test_collect_reads_correctness_kl_lift_and_provenance(runs):
    records, missing = collect.collect_runs(runs, ["grpo", "sdpo", "hybrid", "sdft"], [0, 1])
    assert missing == ["sdft-s0", "sdft-s1"] and len(records) == 6
    grpo0 = records[0]
    assert (grpo0["method"], grpo0["seed"], grpo0["n"]) == ("grpo", 0, [N, N])
    assert grpo0["correct"][2][0] == column(4) and grpo0["accuracy"][2] == [0.4, 0.7]
    assert [k["kl_token_mean"] for k in grpo0["stage_kl"]] == [0.5, 0.2]
    assert grpo0["teacher_lift"] == [None, None] and records[2]["teacher_lift"][1]["lift"] == 0.5
    assert grpo0["reward_drop"] == 0.0 and grpo0["train_minutes"] == 2.0 and grpo0["provenance"]["wall_s"] == 90.0
    sdpo0 = records[2]
    assert sdpo0["guard_events"] == [f"{s} step 6: reward_collapse (warn)" for s in STAGES[1:]]


def test_training_signals_per_stage_by_hand(runs):
    records, _ = collect.collect_runs(runs, ["grpo", "sdpo"], [0, 1])
    sdpo0 = records[2]
    assert sdpo0["signals"][0]["sdpo_route_frac"] == [0.0, None, 0.2, 0.3, 0.4, 0.5]
    assert "sdpo_route_frac" not in records[0]["signals"][0]  # grpo logs none
    by: dict = {}
    for r in records:
        by.setdefault(r["method"], {})[r["seed"]] = r
    rows = {(r["method"], r["stage"]): r["signals"] for r in signals.signal_table(by)}
    # 6 steps: thirds of 2 steps; reward 0.2, 0.4 | .. | 0.6, 0.6; the route share's 2nd step is missing, not 0
    assert rows["grpo", "a"] == {"reward_mean": [pytest.approx(0.3), 0.6]}
    assert rows["sdpo", "b"]["sdpo_route_frac"] == [0.0, pytest.approx(0.45)]
    assert rows["sdpo", "b"]["teacher_refresh"] == 1.0
    md = "\n".join(signals.signals_md(signals.signal_table(by)))
    assert "| sdpo | b | 0.30 → 0.60 | 0.00 → 0.45 | 1.0 |" in md and "| grpo | a | 0.30 → 0.60 | – | – |" in md


def test_statistics_by_hand(runs):
    records, _ = collect.collect_runs(runs, ["grpo", "sdpo", "hybrid"], [0, 1])
    by = {}
    for r in records:
        by.setdefault(r["method"], {})[r["seed"]] = r
    summary, draws, seeds = analysis.summarise(by, resamples=200)
    assert seeds == [0, 1]
    grpo = summary["grpo"]
    # Chaudhry forgetting: a's best after stage 1 (0.8) minus final: 0.4 and 0.2, mean 0.3; plasticity
    # (0.8 − 0.2 + 0.7 − 0.3) / 2 = 0.5 in every run
    assert grpo["figures"]["forgetting"]["mean"] == pytest.approx(0.3)
    assert grpo["figures"]["plasticity"]["mean"] == pytest.approx(0.5)
    lo, hi = grpo["figures"]["forgetting"]["ci95"]
    assert 0.0 <= lo < 0.3 < hi <= 0.8
    assert grpo["per_seed"][0]["cell 2 0"]["ci95"] == pytest.approx(list(analysis.wilson_interval(4, N)))
    assert grpo["per_seed"][0]["stage_forgetting 2"]["value"] == pytest.approx(0.4)
    assert grpo["scalars"]["parameter_drift"]["values"] == [1e-3, 2e-3]
    assert grpo["figures"]["gain 1"]["mean"] == pytest.approx(0.6)
    assert grpo["figures"]["gain 2"]["mean"] == pytest.approx(0.4)
    lift_rows = analysis.teacher_lift_table(by)
    assert "gain 1: sdpo − grpo > 0" not in {c["measure"] for c in analysis.paper_checks(summary, draws)}
    checks = {c["measure"]: c for c in analysis.paper_checks(summary, draws, lift_rows)}
    premise = checks["gain 2: sdpo − grpo > 0"]  # sdpo's lift is positive on every seed at both stages
    assert premise["claim"] == "sdpo specialises faster than GRPO on stage 2 (b), where its teacher lift is positive"
    assert premise["difference"] == 0.0 and premise["verdict"] == "undecided"
    # sdpo's accuracies are grpo's, resampled with the same draws: the paired difference is exactly 0
    same = checks["forgetting: sdpo − grpo > 0"]
    assert same["ci95"] == [0.0, 0.0] and same["verdict"] == "undecided"
    drift = checks["parameter_drift: sdpo − grpo > 0"]  # paired per seed: 2e-3 both times
    assert drift["difference"] == pytest.approx(2e-3) and drift["verdict"] == "holds"
    assert "sdft" not in " ".join(checks)  # a method that did not run is not compared
    goal = {g["measure"]: g for g in analysis.hybrid_goal(summary, draws, ("sdpo", "sdpo_sampled"))}
    forgetting = goal["forgetting: hybrid − grpo ≤ 0"]
    assert forgetting["difference"] == pytest.approx(-0.3) and forgetting["state"] == "met"
    gain = goal["plasticity: hybrid − 0.9 × sdpo ≥ 0"]
    assert gain["difference"] == pytest.approx(0.05) and gain["state"] == "met"

    kl = analysis.kl_vs_forgetting(summary, by, resamples=50)
    assert len(kl["points"]) == 6  # 3 methods x 2 seeds, stage 2 only
    fit = kl["fits"]["kl_token, all stages"]
    assert (fit["slope"], fit["intercept"], fit["r2"]) == pytest.approx((2.0, 0.0, 1.0))
    assert fit["r2_ci95"] == pytest.approx([1.0, 1.0]) and fit["runs"] == 6

    lift = {(r["method"], r["stage"]): r for r in analysis.teacher_lift_table(by)}
    assert set(lift) == {("sdpo", 1), ("sdpo", 2), ("hybrid", 1), ("hybrid", 2)}
    assert lift["sdpo", 2]["domain"] == "b" and lift["sdpo", 2]["positive_every_seed"]
    assert lift["sdpo", 2]["mean"] == 0.5 and lift["sdpo", 2]["ci95"] == [0.5, 0.5]
    # pooled over the 2 x 6 prompts: mean 0.5; each seed's se 0.6 / 3.92, halved (equal n) and combined
    se = math.sqrt(2 * (0.5 * 0.6 / 3.92) ** 2)
    assert lift["sdpo", 2]["pooled"]["ci95"] == pytest.approx([0.5 - 1.96 * se, 0.5 + 1.96 * se])
    assert lift["sdpo", 2]["pooled"]["n"] == 12 and lift["sdpo", 2]["positive"]
    weak = analysis.pooled_lift(
        [{"lift": 0.1, "lift_ci95": [-0.2, 0.4], "n": 30}, {"lift": 0.4, "lift_ci95": [0.1, 0.7], "n": 10}]
    )
    assert weak["lift"] == pytest.approx(0.175) and weak["ci95"][0] < 0  # one seed's positive lift is not enough


def test_write_results_files(runs, tmp_path):
    records, _ = collect.collect_runs(runs, ["grpo", "sdpo", "hybrid"], [0, 1])
    out = tmp_path / "out"
    setting = {"base": "benchmarks/science/base.yaml", "overrides": ["optim.steps=2"], "runs_dir": str(runs)}
    setting["sequence"] = {"name": "calc_hash-calc_says", "stages": [["calc_hash", 2], ["calc_says", 2]]}
    results.write_results(records, out, setting, method_recipes.METHODS, method_recipes.SDPO_VARIANTS, resamples=50)
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["sequence"] == "calc_hash-calc_says"  # issue 43: each collection names its sequence
    assert data["summary"]["grpo"]["figures"]["forgetting"]["mean"] == pytest.approx(0.3)
    assert data["meta"]["setting"]["overrides"] == ["optim.steps=2"] and "correct" not in data["runs"][0]
    md = (out / "results.md").read_text()
    for heading in ("## Teacher lift", "## Does KL predict forgetting?", "## The hybrid's goal", "## Runs"):
        assert heading in md
    assert "| forgetting no worse than GRPO's | forgetting: hybrid − grpo ≤ 0 |" in md
    assert "| 1 (a) | 2 (b) |" in md and "| grpo | 0.600 [" in md  # the gain per stage, grpo's a: 0.2 -> 0.8
    assert (out / "results.png").stat().st_size > 10_000


def test_method_recipes_are_valid_and_share_the_budget(tmp_path):
    # srpo comes with its own change (issue 25, point 1): until the grammar has it, its two runs are the only ones
    # that cannot validate; every other method must
    pending = {m for m, spec in method_recipes.METHODS.items() if spec["method"] not in ADAPTERCL_METHODS}
    assert pending <= {"srpo", "srpo_continual"}
    assert set(method_recipes.DEFAULT_METHODS) == {"grpo", "grpo_kl", "sdpo", "sdpo_gated", "srpo", "srpo_continual",
                                                "hybrid"}  # fmt: skip
    for method in sorted(set(method_recipes.METHODS) - pending - {"joint"}):  # joint: one stage (issue 43 tests)
        recipe = resolve_recipe(method_recipes.method_recipe(method, 1, tmp_path))
        for stage in recipe.stages:
            sequences = stage.rollout.group_size * stage.optim.prompts_per_step
            assert (stage.method, sequences, recipe.seed) == (method_recipes.METHODS[method]["method"], 24, 1)
        # the toolcall stage trains 24 steps (its learnable budget, README "Learnable stages"), the others 12
        assert [(s.domain, s.optim.steps) for s in recipe.stages] == [
            ("arithmetic", 12),
            ("mcq", 12),
            ("toolcall", 24),
        ]
        assert recipe.eval.examples_per_domain == 100 and recipe.eval.teacher_lift_prompts == 32
        # the retention probes: never trained, read from the shared data folder relative to the repo root
        assert recipe.eval.retention_probes == ["arc", "boolq", "piqa", "winogrande"]
        assert recipe.domain("boolq").source == "../shared/data/boolq/test.json"
        assert recipe.domain("arc").format == "arc" and {s.domain for s in recipe.stages} == {
            "arithmetic",
            "mcq",
            "toolcall",
        }
    sdft = resolve_recipe(method_recipes.method_recipe("sdft", 0, tmp_path)).stages[1]
    assert (sdft.rollout.group_size, sdft.rollout.max_new_tokens, sdft.distill.support) == (1, 24, "full")
    kl = resolve_recipe(method_recipes.method_recipe("grpo_kl", 0, tmp_path)).stages[2]
    assert (kl.method, kl.regularizers.kl_prev, kl.grpo.kl_coef) == ("grpo", 0.01, 0.0)  # KL to the stage start
    for method in ("srpo", "srpo_continual", "srpo_gated"):  # the paper's weight decay, no 10-step warm-up in 12 steps
        optim = resolve_recipe(method_recipes.method_recipe(method, 0, tmp_path)).stages[0].optim
        assert (optim.warmup_steps, optim.weight_decay) == (0, 0.01)
    gated = resolve_recipe(method_recipes.method_recipe("sdpo_gated", 0, tmp_path)).stages[0].distill.teacher
    assert (gated.kind, gated.refresh_every, gated.gate_window) == ("gated", 4, 4)  # checks at steps 8 and 12
    small = method_recipes.method_recipe("grpo", 0, tmp_path, ["optim.steps=2", "eval.examples_per_domain=8"], None)
    assert small["optim"] == {"lr": 3.0e-4, "steps": 2, "prompts_per_step": 4, "max_grad_norm": 1.0}
    assert small["eval"]["examples_per_domain"] == 8 and small["output_dir"] == str(tmp_path / "grpo-s0")
    assert [d["name"] for d in small["domains"]] == ["arithmetic", "mcq", "toolcall"]  # no probes asked for
    with pytest.raises(SystemExit, match="expected KEY=VALUE"):
        method_recipes.apply_overrides({}, ["optim.steps"])
    # a stage by its name: the smoke test's short toolcall stage
    smoke = method_recipes.method_recipe("grpo", 0, tmp_path, ["optim.steps=2", "stages.toolcall.optim.steps=2"], None)
    assert [s["optim"]["steps"] for s in resolve_recipe(smoke).model_dump()["stages"]] == [2, 2, 2]
    with pytest.raises(SystemExit, match="no entry named 'tool'"):
        method_recipes.apply_overrides(smoke, ["stages.tool.optim.steps=2"])


def test_preflight_names_missing_probe_files_and_an_invalid_recipe(tmp_path):
    data = tmp_path / "data"
    for file, _ in list(method_recipes.PROBES.values())[:3]:  # winogrande missing
        (data / file).parent.mkdir(parents=True, exist_ok=True)
        (data / file).write_text("{}")
    assert method_recipes.missing_probe_files(str(data)) == ["winogrande/winogrande.jsonl"]
    with pytest.raises(SystemExit, match=r"retention probe data not found under .*: winogrande/winogrande.jsonl"):
        science_run.preflight(["grpo"], [0], tmp_path, [], str(data))
    with pytest.raises(SystemExit, match=r"^grpo-s0: .*optim.steps"):  # one line naming the run and the field
        science_run.preflight(["grpo"], [0], tmp_path, ["optim.steps=0"], None)
    science_run.preflight(["grpo", "sdpo_gated"], [0, 1], tmp_path, [], None)  # valid: returns


def test_a_finished_run_is_skipped_and_one_finished_with_another_recipe_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(science_run.subprocess, "run", lambda *a, **k: pytest.fail("a finished run was run again"))
    recipe = method_recipes.method_recipe("grpo", 0, tmp_path)
    (tmp_path / "grpo-s0").mkdir()
    (tmp_path / "grpo-s0" / "summary.json").write_text("{}")
    (tmp_path / "grpo-s0.run.json").write_text("{}")
    (tmp_path / "grpo-s0.yaml").write_text(science_run.yaml.safe_dump(recipe))
    science_run.run_one("grpo", 0, tmp_path, [])  # the same recipe: skipped
    with pytest.raises(SystemExit, match="grpo-s0: finished earlier with a different recipe"):
        science_run.run_one("grpo", 0, tmp_path, ["optim.steps=3"])


# ------------------------------------------------------------------ the headline, collapse, probes (hand values)

PROBE_DOMAINS = ["a", "b", "p"]  # a, b trained in that order; p a retention probe


def write_run(runs: Path, method: str, seed: int, counts: list[tuple[int, int, int]]) -> None:
    """A finished run with `counts[k]` correct of N on (a, b, p) after row k (0 = before training)."""
    run = runs / f"{method}-s{seed}"
    for k, (stage, row) in enumerate(zip(STAGES, counts)):
        d = run / stage
        d.mkdir(parents=True)
        evals = {name: {"accuracy": c / N, "n": N, "correct": column(c)} for name, c in zip(PROBE_DOMAINS, row)}
        (d / "eval.json").write_text(json.dumps(evals))
        if k:
            (d / "drift.json").write_text(json.dumps({"stage_kl": None}))
            (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5}))
            (d / "done.json").write_text(json.dumps({"train_seconds": 60.0}))
    summary = {"domains": PROBE_DOMAINS, "stages": STAGES, "cl_metrics": {"trained_columns": [0, 1]}}
    (run / "summary.json").write_text(json.dumps(summary))
    command = f"OMP_NUM_THREADS=1 /usr/local/bin/python3.12 -m adaptercl.cli recipe run {runs}/{method}-s{seed}.yaml"
    record = {"git": "abc1234", "exit": 0, "wall_s": 90.0, "command": command, "load_average_at_start": [1.0]}
    (runs / f"{method}-s{seed}.run.json").write_text(json.dumps(record))


@pytest.fixture
def probe_runs(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    for seed, final_a in ((0, 4), (1, 6)):
        write_run(runs, "grpo", seed, [(2, 3, 6), (8, 3, 6), (final_a, 7, 4)])
    for seed in (0, 1):
        write_run(runs, "better", seed, [(2, 3, 6), (8, 3, 6), (8, 7, 6)])  # keeps a, keeps p
        write_run(runs, "worse", seed, [(2, 3, 6), (8, 3, 6), (0, 3, 2)])  # loses a and p, never learns b
    return runs


def by_method(runs: Path, methods: list[str]) -> dict[str, dict[int, dict]]:
    records, missing = collect.collect_runs(runs, methods, [0, 1])
    assert not missing
    out: dict[str, dict[int, dict]] = {}
    for r in records:
        out.setdefault(r["method"], {})[r["seed"]] = r
    return out


def test_headline_collapse_general_delta_and_learnable_stages_by_hand(probe_runs):
    runs = by_method(probe_runs, ["grpo", "better", "worse"])
    summary, draws, _ = analysis.summarise(runs, resamples=200)
    f = {m: summary[m]["figures"] for m in runs}
    # by hand: ACC = mean final of a, b; forgetting = a's 0.8 − final; the general delta = p's final − before (0.6)
    assert f["grpo"]["acc"]["mean"] == pytest.approx((0.55 + 0.65) / 2) and f["better"]["acc"]["mean"] == 0.75
    assert f["grpo"]["forgetting"]["mean"] == pytest.approx(0.3) and f["worse"]["forgetting"]["mean"] == 0.8
    assert [f[m]["general_delta"]["mean"] for m in ("grpo", "better", "worse")] == pytest.approx([-0.2, 0.0, -0.4])
    assert f["grpo"]["probe_change 2"]["mean"] == pytest.approx(-0.2) and f["worse"]["peak 0"]["mean"] == 0.8

    h = headline.versus_reference(summary, draws, "grpo")
    rows = {r["method"]: r for r in h["rows"]}
    # better's finals are grpo's or more, example by example: every paired draw has ACC ≥ and forgetting ≤
    assert rows["better"]["acc"]["difference"] == pytest.approx(0.15) and rows["better"]["acc"]["state"] == "met"
    assert rows["better"]["forgetting"]["difference"] == pytest.approx(-0.3)
    assert rows["better"]["forgetting"]["state"] == "met" and rows["better"]["both"] == "met"
    assert rows["better"]["general_delta"]["difference"] == pytest.approx(0.2)
    assert rows["worse"]["acc"]["state"] == "not met" and rows["worse"]["both"] == "not met"
    assert (h["answer"], h["meeting_both"]) == ("yes", ["better"])
    without_better = {m: summary[m] for m in ("grpo", "worse")}
    assert headline.versus_reference(without_better, draws, "grpo")["answer"] == "no"

    rows = {(r["method"], r["domain"]): r for r in headline.peak_final(summary, runs)}
    # grpo's a: peak 0.8, finals 0.4 and 0.6: 0.4 is not below 0.5 x 0.8 (the flag is strict): no collapse
    assert rows["grpo", "a"]["per_seed"][0] == {"peak": 0.8, "final": 0.4, "collapsed": False}
    assert rows["grpo", "a"]["final"]["mean"] == pytest.approx(0.5) and rows["grpo", "a"]["collapsed_seeds"] == 0
    assert rows["worse", "a"]["collapsed_seeds"] == 2 and rows["worse", "a"]["collapsed_mean"]  # 0.8 -> 0.0
    assert rows["worse", "p"]["collapsed_mean"] and not rows["worse", "p"]["trained"]  # probe 0.6 -> 0.2
    assert not rows["grpo", "p"]["collapsed_mean"]  # 0.6 -> 0.4
    assert headline.collapsed(0.8, 0.39) and not headline.collapsed(0.8, 0.4) and not headline.collapsed(0.0, 0.0)

    delta = {r["method"]: r for r in headline.general_delta(summary, runs)}
    assert list(delta["grpo"]["probes"]) == ["p"] and delta["grpo"]["before"]["p"]["mean"] == 0.6
    assert delta["worse"]["probes"]["p"]["mean"] == pytest.approx(-0.4)

    learnable = headline.learnable_stages(summary, runs, "grpo")  # grpo: a 0.2 -> 0.8, b 0.3 -> 0.7
    assert [(r["domain"], r["learnable"]) for r in learnable] == [("a", True), ("b", True)]
    assert learnable[1]["gain"]["mean"] == pytest.approx(0.4)
    worse = headline.learnable_stages(summary, runs, "worse")  # b never moves: its gain's interval is [0, 0]
    assert [(r["domain"], r["learnable"]) for r in worse] == [("a", True), ("b", False)]

    points = {p["method"]: p for p in headline.pareto_points(summary, "grpo")}
    assert points["grpo"]["reference"] and not points["better"]["reference"]
    assert (points["worse"]["x"], points["worse"]["y"]) == pytest.approx((0.3, 0.8))
    lo, hi = f["grpo"]["forgetting"]["ci95"]
    assert points["grpo"]["y_err"] == pytest.approx([0.3 - lo, hi - 0.3])


def test_results_carry_the_headline_and_pareto_plot_and_no_machine_path(probe_runs, tmp_path):
    records, _ = collect.collect_runs(probe_runs, ["grpo", "better", "worse"], [0, 1])
    out = tmp_path / "out"
    setting = {"base": "benchmarks/science/base.yaml", "overrides": [], "runs_dir": "<runs>", "reference": "grpo"}
    data = results.write_results(
        records, out, setting, method_recipes.METHODS, method_recipes.SDPO_VARIANTS, 50, {str(probe_runs): "<runs>"}
    )
    assert data["headline"]["answer"] == "yes"
    text = (out / "results.json").read_text() + (out / "results.md").read_text()
    assert str(tmp_path) not in text and "/usr/local/bin" not in text  # no path of the machine
    assert "python3.12 -m adaptercl.cli recipe run <runs>/grpo-s0.yaml" not in text
    assert "OMP_NUM_THREADS=1 python -m adaptercl.cli recipe run <runs>/grpo-s0.yaml" in text
    md = (out / "results.md").read_text()
    assert "## Headline: is there a method with ACC ≥ grpo's and forgetting ≤ grpo's?\n\n**yes** (better)." in md
    for heading in ("## Is every stage learnable?", "## General-ability delta", "## Peak, final and collapse"):
        assert heading in md
    assert "| worse | a | 0.800 [" in md and "| 2 of 2 | **yes** |" in md
    png = (out / "pareto.png").read_bytes()
    assert png[:4] == b"\x89PNG" and len(png) > 10_000
    assert results.scrub({"k": ["/opt/venv/bin/python -m x /r/s"]}, {"/r": "<runs>"}) == {
        "k": ["python -m x <runs>/s"]
    }
