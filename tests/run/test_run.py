"""End-to-end runs on tiny-random: a two-stage GRPO sequence, saved adapters, resume, and update invariances."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from adaptercl.domains import load_domain
from adaptercl.model.base import load_base
from adaptercl.model.batching import encode_chat
from adaptercl.recipe.grammar import ModelConfig, resolve_recipe
from adaptercl.rollout import SamplingParams
from adaptercl.rollout.hf import HFEngine
from adaptercl.run.sequence import run_recipe
from adaptercl.run_dir.layout import BEFORE_DIR


def tiny_recipe(out, **overrides) -> dict:
    raw = {
        "model": {"name": "tiny-random"},
        "output_dir": str(out),
        "lora": {"r": 4, "alpha": 8},
        "optim": {"lr": 5e-3, "steps": 2, "prompts_per_step": 2},
        "rollout": {"group_size": 4, "max_new_tokens": 8},
        "eval": {"examples_per_domain": 4},
        "domains": [
            {"name": "arith", "source": "builtin:arithmetic", "reward": "tiny_rewards:digit_fraction"},
            {"name": "mcq", "source": "builtin:mcq", "reward": "tiny_rewards:digit_fraction"},
        ],
        "stages": [
            {"name": "one", "domain": "arith"},
            {"name": "two", "domain": "mcq", "adapter": {"init": "new"}},
        ],
    }
    raw.update(overrides)
    return raw


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    events, detailed = [], []
    on_event = lambda kind, **info: events.append(kind) or detailed.append((kind, info))  # noqa: E731
    result = run_recipe(resolve_recipe(tiny_recipe(out)), on_event=on_event)
    return out, result, events, detailed  # detailed: (kind, info) of every event


def test_two_stage_run_writes_every_output(finished_run):
    out, result, events, _ = finished_run
    assert len(result.accuracy) == 3 and all(len(row) == 2 for row in result.accuracy)  # before + 2 stages
    assert events.count("step") == 4
    for stage in ("stage-01-one", "stage-02-two"):
        assert (out / stage / "done.json").is_file()
        lines = (out / stage / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert json.loads((out / "stage-02-two" / "done.json").read_text())["adapters"] == ["stage-01-one", "stage-02-two"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy"] == result.accuracy and summary["domains"] == ["arith", "mcq"]


def test_run_reports_progress_of_loading_evaluation_and_drift(finished_run):
    out, _, _, detailed = finished_run
    kinds = [kind for kind, _ in detailed]
    assert kinds.index("load") < kinds.index("model")
    for stage in (BEFORE_DIR, "stage-01-one", "stage-02-two"):
        evals = [(i["done"], i["total"]) for k, i in detailed if k == "eval" and i["stage"] == stage]
        assert evals == [(0, 2), (1, 2), (2, 2)]  # two domains
    for stage in ("stage-01-one", "stage-02-two"):
        drift = json.loads((out / stage / "drift.json").read_text())
        n_modules = len(drift["parameter"]["per_module"])

        def progress(part: str, stage: str = stage) -> list[tuple[int, int]]:
            return [
                (i["done"], i["total"])
                for k, i in detailed
                if k == "drift" and (i["stage"], i["part"]) == (stage, part)
            ]

        assert progress("parameter") == [(d, n_modules) for d in range(1, n_modules + 1)]
        # within each: 4 probes of each of the 2 domains (eval sets of 4), 8 stage-KL responses; 4 per forward
        assert progress("response") == [(4, 8), (8, 8)]
        assert progress("stage_kl") == [(4, 8), (8, 8)]
        kinds = [(k, i.get("part")) for k, i in detailed if i.get("stage") == stage and k in ("drift", "evaluated")]
        assert kinds.index(("evaluated", None)) < kinds.index(("drift", "parameter"))
        assert drift["parameter"]["method"] == "exact" and drift["parameter"]["top_k"] == 8
        # each diagnostic's wall time, in drift.json and with the stage's other parts in done.json
        assert set(drift["seconds"]) == {"parameter_drift", "response_drift", "stage_kl"}
        done = json.loads((out / stage / "done.json").read_text())
        assert set(done["seconds"]) == {"train", "eval", "parameter_drift", "response_drift", "stage_kl"}
        assert all(done["seconds"][k] == v > 0 for k, v in drift["seconds"].items())
        assert sum(done["seconds"].values()) <= done["train_seconds"]  # the parts of what train_seconds spans


def test_lora_weights_changed_and_reload_reproduces_the_evaluation(finished_run):
    out, _, _, _ = finished_run
    weights = load_file(str(out / "stage-01-one" / "adapter" / "adapter_model.safetensors"))
    lora_b = [v for k, v in weights.items() if "lora_B" in k]
    assert lora_b and any(v.abs().max() > 0 for v in lora_b)  # B starts at zero: training moved it

    recipe = resolve_recipe(tiny_recipe(out))
    base = load_base(recipe.model, "none")
    model = PeftModel.from_pretrained(base.model, str(out / "stage-01-one" / "adapter"), adapter_name="stage-01-one")
    reloaded = load_file(str(out / "stage-01-one" / "adapter" / "adapter_model.safetensors"))
    for name, param in model.named_parameters():
        if "lora_" in name:
            key = name.replace(".stage-01-one.", ".")
            assert torch.equal(param.detach(), reloaded[key])  # bit-identical tensors in the live model
    # The reloaded adapter reproduces the greedy completions the run recorded after stage 1.
    domain = load_domain(recipe.domain("arith"), recipe.seed, recipe.eval.examples_per_domain)
    row = json.loads((out / "stage-01-one" / "eval.json").read_text())["arith"]
    recorded = row["samples"]
    # per-example correctness, in eval-set order: the accuracy is its mean and the samples agree with it
    assert len(row["correct"]) == row["n"] and sum(row["correct"]) / row["n"] == row["accuracy"]
    assert [s["correct"] for s in recorded] == row["correct"][: len(recorded)]
    engine = HFEngine(model, base.tokenizer)
    prompts = [encode_chat(base.tokenizer, ex.messages) for ex in domain.eval[: len(recorded)]]
    params = SamplingParams(max_new_tokens=recipe.eval_max_new_tokens, greedy=True)
    texts = [g[0].text for g in engine.generate(prompts, ["stage-01-one"], params)]
    assert texts == [s["completion"] for s in recorded]


def test_rerun_of_a_finished_run_does_nothing(finished_run):
    out, result, _, _ = finished_run
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    events = []
    again = run_recipe(resolve_recipe(tiny_recipe(out)), on_event=lambda kind, **info: events.append(kind))
    assert "step" not in events and events.count("skip") == 2
    assert again.accuracy == result.accuracy
    after = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert after == before


def test_resume_reruns_only_the_removed_stage(finished_run, tmp_path):
    # in a copy of the run directory: a run is its stages, not its path, so the copy resumes where it was put
    out, result, _, _ = finished_run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    raw = tiny_recipe(copy)
    shutil.rmtree(copy / "stage-02-two")
    stage_one = (copy / "stage-01-one" / "done.json").stat().st_mtime_ns
    events = []
    resumed = run_recipe(resolve_recipe(raw), on_event=lambda kind, **info: events.append((kind, info.get("stage"))))
    assert ("skip", "stage-01-one") in events and ("stage", "stage-02-two") in events
    assert (copy / "stage-01-one" / "done.json").stat().st_mtime_ns == stage_one
    assert resumed.accuracy == result.accuracy  # deterministic: the re-run stage gives the same evaluation
    a = load_file(str(out / "stage-02-two" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(copy / "stage-02-two" / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert f"output_dir: {copy}" in (copy / "recipe.resolved.yaml").read_text()  # recorded where it now is


GATED = {"kind": "gated", "refresh_every": 1, "gate_window": 1, "gate_reward_delta": 0.0, "gate_length_eps": 1.0}


@pytest.mark.parametrize(
    "method, teacher", [("sdpo", {"kind": "ema"}), ("hybrid", {"kind": "stage_start"}), ("srpo", GATED)]
)
def test_a_distillation_run_resumed_after_its_first_stage_equals_an_uninterrupted_one(tmp_path, method, teacher):
    # The second stage's fresh adapter draws its initialisation from torch's global RNG after the first stage's
    # draws. A resume loads the first stage instead of training it, so every draw the first stage makes beyond its
    # own adapter's (a teacher copy, an EMA's low-rank factors) must be kept out of that RNG, or the resumed second
    # stage starts from another initialisation than the uninterrupted one.
    def recipe(out) -> dict:
        raw = tiny_recipe(out)
        for stage in raw["stages"]:
            stage["method"], stage["distill"] = method, {"teacher": dict(teacher)}
        return raw

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run_recipe(resolve_recipe(recipe(whole)))
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "stage-02-two")
    run_recipe(resolve_recipe(recipe(resumed)))
    stage = "stage-02-two"
    files = sorted(p.relative_to(whole / stage) for p in (whole / stage).rglob("*.safetensors"))
    assert files and files == sorted(p.relative_to(resumed / stage) for p in (resumed / stage).rglob("*.safetensors"))
    for name in files:  # the stage's adapter and, where the teacher keeps one, the teacher's: byte for byte
        assert (whole / stage / name).read_bytes() == (resumed / stage / name).read_bytes(), name
    assert (whole / stage / "samples.jsonl").read_text() == (resumed / stage / "samples.jsonl").read_text()


def test_a_stage_killed_and_resumed_records_the_seconds_of_an_uninterrupted_one(tmp_path, monkeypatch):
    """A one-stage SDPO run killed in its third step (checkpoint after step 2) and resumed: done.json's `seconds` has
    the uninterrupted run's parts, the teacher lift measured before the kill among them (as teacher_lift.json
    recorded it), and `train` is the sum of all four steps' time_step_s, not only of the two the resume ran."""
    from adaptercl.system.atomic import read_jsonl
    from adaptercl.train import stage as stage_module

    def recipe(out) -> dict:
        raw = tiny_recipe(out, stages=[{"name": "one", "domain": "arith", "method": "sdpo"}])
        raw["domains"], raw["optim"] = raw["domains"][:1], {**raw["optim"], "steps": 4}
        raw["monitor"] = {"checkpoint_every": 2}
        raw["eval"] = {"examples_per_domain": 2, "drift_probes": 1, "stage_kl_prompts": 1, "teacher_lift_prompts": 2}
        return resolve_recipe(raw)

    run_recipe(recipe(tmp_path / "whole"))
    calls, original = [], stage_module.train_on_batch

    def killed_in_step_3(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("killed in step 3")
        return original(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(stage_module, "train_on_batch", killed_in_step_3)
        with pytest.raises(RuntimeError, match="killed in step 3"):
            run_recipe(recipe(tmp_path / "resumed"))
    stage_dir = tmp_path / "resumed" / "stage-01-one"
    assert [r["step"] for r in read_jsonl(stage_dir / "metrics.jsonl")] == [1, 2]  # the checkpoint's
    lift_seconds = json.loads((stage_dir / "teacher_lift.json").read_text())["seconds"]
    run_recipe(recipe(tmp_path / "resumed"))
    whole, resumed = (
        json.loads((d / "stage-01-one" / "done.json").read_text()) for d in (tmp_path / "whole", tmp_path / "resumed")
    )
    assert set(resumed["seconds"]) == set(whole["seconds"]) >= {"teacher_lift", "train", "eval"}
    steps = [r for r in read_jsonl(stage_dir / "metrics.jsonl") if "event" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert resumed["seconds"]["train"] == round(sum(r["time_step_s"] for r in steps), 3)
    assert resumed["seconds"]["teacher_lift"] == lift_seconds > 0
    assert sum(resumed["seconds"].values()) <= resumed["train_seconds"]  # the parts of what train_seconds spans


def test_a_different_recipe_is_refused_for_an_existing_run(finished_run):
    out, _, _, _ = finished_run
    from adaptercl.recipe.grammar import RecipeError

    with pytest.raises(RecipeError, match="holds a run of a different recipe"):
        run_recipe(resolve_recipe(tiny_recipe(out, seed=5)))


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_grad_accumulation_gives_the_same_update(tmp_path, aggregation):
    adapters, grad_norms = [], []
    for accum in (1, 4):
        raw = tiny_recipe(tmp_path / f"acc{accum}")
        raw["domains"], raw["stages"] = raw["domains"][:1], raw["stages"][:1]
        raw["optim"] = {**raw["optim"], "steps": 1, "grad_accum": accum}
        raw["grpo"] = {"aggregation": aggregation}
        raw["eval"] = {"examples_per_domain": 1}
        run_recipe(resolve_recipe(raw))
        stage_dir = tmp_path / f"acc{accum}" / "stage-01-one"
        adapters.append(load_file(str(stage_dir / "adapter" / "adapter_model.safetensors")))
        grad_norms.append(json.loads((stage_dir / "metrics.jsonl").read_text().splitlines()[0])["grad_norm"])
    # The pre-clip gradient norm is sensitive to how micro-batch losses are weighted; Adam's first step is not.
    assert grad_norms[0] > 0 and grad_norms[1] == pytest.approx(grad_norms[0], rel=1e-5)
    one, four = adapters
    assert any(one[k].abs().max() > 0 for k in one if "lora_B" in k)
    for k in one:
        torch.testing.assert_close(one[k], four[k], rtol=0, atol=5e-3 * 1e-2)  # 1 % of one Adam step (lr 5e-3)


def test_an_auto_micro_batch_gives_the_same_update_and_is_said_and_recorded(tmp_path, monkeypatch):
    """`optim.micro_batch_size: auto` on a (faked) card on which the plan fits 2 of a step's 8 sequences (2 groups of
    4) and not 4: the step trains in micro-batches of 2, says so, writes micro_batch.json, and updates as one
    micro-batch does."""
    from adaptercl.domains import load_domain
    from adaptercl.train import micro_batch
    from adaptercl.train import step as train_step

    def recipe(out, **optim):
        raw = tiny_recipe(out)
        raw["domains"], raw["stages"] = raw["domains"][:1], raw["stages"][:1]
        raw["optim"] = {**raw["optim"], "steps": 1, **optim}
        raw["eval"] = {"examples_per_domain": 1, "drift_probes": 0, "stage_kl_prompts": 0, "parameter_drift": False}
        return resolve_recipe(raw)

    auto = recipe(tmp_path / "auto", micro_batch_size="auto")
    base = load_base(auto.model, "none")
    domain = load_domain(auto.domains[0], auto.seed, auto.eval.examples_per_domain)
    lo, hi = 0.5, 4.0  # GiB: about the smallest card on which auto picks 2 (its rows grow with the card); a row adds
    for _ in range(18):  # ~2e-4 GiB to the plan at this shape, and 18 halvings leave 1.3e-5 GiB
        monkeypatch.setattr(micro_batch, "card_gib", lambda device, card=(lo + hi) / 2: card)
        rows = micro_batch.choose_micro_batch(auto, 0, base.model, base.tokenizer, [domain]).rows
        lo, hi = (lo, (lo + hi) / 2) if rows >= 2 else ((lo + hi) / 2, hi)
    monkeypatch.setattr(micro_batch, "card_gib", lambda device: hi)
    assert micro_batch.choose_micro_batch(auto, 0, base.model, base.tokenizer, [domain]).rows == 2

    seen, scores = [], train_step.response_scores
    monkeypatch.setattr(
        train_step, "response_scores", lambda m, mb, *a: seen.append(len(mb.input_ids)) or scores(m, mb, *a)
    )
    events = []
    run_recipe(auto, on_event=lambda kind, **info: events.append((kind, info)))
    assert seen == [2, 2, 2, 2]
    record = json.loads((tmp_path / "auto" / "stage-01-one" / "micro_batch.json").read_text())
    assert (record["setting"], record["micro_batch_size"], record["sequences"]) == ("auto", 2, 8)
    assert record["card_gib"] == round(hi, 3)
    assert record["planned_peak_gib"] * 1.1 <= record["limit_gib"] + 2e-3  # both rounded to 1e-3 GiB in the file
    (line,) = [info["line"] for kind, info in events if kind == "micro_batch"]
    assert line.startswith("micro-batch 2 of 8 sequences a step (auto: planned step peak ")

    seen.clear()
    run_recipe(recipe(tmp_path / "one", grad_accum=1))  # micro_batch_size unset: nothing written, as before
    assert seen == [8] and not (tmp_path / "one" / "stage-01-one" / "micro_batch.json").exists()
    one, micro = (load_file(str(tmp_path / d / "stage-01-one" / "adapter" / "adapter_model.safetensors"))
                  for d in ("one", "auto"))  # fmt: skip
    assert any(one[k].abs().max() > 0 for k in one if "lora_B" in k)
    for k in one:
        torch.testing.assert_close(one[k], micro[k], rtol=0, atol=5e-3 * 1e-2)  # 1 % of one Adam step, as above


def test_a_run_on_a_cold_model_cache_equals_one_on_a_warm_cache(tiny_gguf, tmp_path):
    # The first run on a machine converts the GGUF into the cache; it must train the same adapters as the next.
    adapters = []
    for cache in ("cold", "warm"):
        model = {"name": str(tiny_gguf), "cache_dir": str(tmp_path / "cache")}
        raw = tiny_recipe(tmp_path / cache, model=model, stages=[{"name": "one", "domain": "arith"}])
        run_recipe(resolve_recipe(raw))
        adapters.append(load_file(str(tmp_path / cache / "stage-01-one" / "adapter" / "adapter_model.safetensors")))
    cold, warm = adapters
    assert cold.keys() == warm.keys() and all(torch.equal(cold[k], warm[k]) for k in cold)


def test_tiny_random_is_deterministic_and_small(tmp_path):
    from adaptercl.model.base import materialize_tiny_random

    first = load_file(str(materialize_tiny_random(tmp_path / "a") / "model.safetensors"))
    second = load_file(str(materialize_tiny_random(tmp_path / "b") / "model.safetensors"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    base = load_base(ModelConfig(name="tiny-random", cache_dir=str(tmp_path / "a")), "none")
    assert base.model.config.head_dim >= 32  # vLLM's CPU attention needs it
    assert sum(p.numel() for p in base.model.parameters()) < 200_000


def test_console_shows_a_bar_for_loading_evaluation_and_drift(monkeypatch, tmp_path):
    import io

    from rich.console import Console

    from adaptercl import console as console_module
    from adaptercl.run.sequence import RunResult

    def fake_run(recipe, on_event):
        on_event("load", model="tiny-random")
        on_event("model", description="tiny")
        for done in range(3):
            on_event("eval", stage="before", done=done, total=2)
        for done in (1, 2, 3):
            on_event("drift", stage="stage-01-one", part="parameter", done=done, total=3)
        return RunResult(tmp_path, ["arith"], [[0.5], [0.75]])

    monkeypatch.setattr(console_module, "run_recipe", fake_run)
    out = io.StringIO()
    raw = tiny_recipe(tmp_path)
    raw["domains"], raw["stages"] = raw["domains"][:1], raw["stages"][:1]
    console_module.run_with_progress(resolve_recipe(raw), Console(file=out, width=200, force_terminal=True))
    text = out.getvalue()
    for line in (
        "loading tiny-random",
        "before: eval (domains)",
        "2/2",
        "stage-01-one: parameter drift (modules)",
        "3/3",
    ):
        assert line in text, text
