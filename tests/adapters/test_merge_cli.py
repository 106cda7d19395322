"""`adaptercl merge`: ΔW-space merges of PEFT adapter folders, written as a PEFT folder that loads and behaves."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from peft import PeftModel

from adaptercl.adapters.factors import read_adapter_folder
from adaptercl.adapters.live import attach_adapter, save_adapter
from adaptercl.cli import main
from adaptercl.model.base import load_base
from adaptercl.recipe.grammar import LoraConfig, ModelConfig

TINY = ModelConfig(name="tiny-random")
IDS = torch.tensor([[5, 17, 42, 99, 7, 3]])


def make_adapter(path, seed: int, r: int = 4, alpha: float = 8.0, modules=("q_proj", "v_proj")) -> None:
    """A saved PEFT adapter on tiny-random with random non-zero A and B."""
    torch.manual_seed(seed)
    model = attach_adapter(
        load_base(TINY, "none").model, "src", LoraConfig(r=r, alpha=alpha, target_modules=list(modules))
    )
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(0.2 * torch.randn_like(p))
    save_adapter(model, "src", path)


def logits_with(path=None) -> torch.Tensor:
    model = load_base(TINY, "none").model
    if path is not None:
        model = PeftModel.from_pretrained(model, str(path))
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    make_adapter(root / "a", seed=1)
    make_adapter(root / "b", seed=2, r=2, alpha=4.0, modules=("q_proj", "k_proj"))
    return root


def test_twins_with_weights_one_minus_one_cancel_through_the_cli(adapters, tmp_path, capsys):
    a = str(adapters / "a")
    for method in ("task_arithmetic", "ties"):
        out = tmp_path / method
        assert main(["merge", a, a, "--weights", "1,-1", "--method", method, "--out", str(out)]) == 0
        assert "relative Frobenius error" in capsys.readouterr().out
        merged = read_adapter_folder(out)
        assert all(float(d.abs().max()) == 0.0 for d in merged.deltas().values())  # ΔW = 0 in every module
        torch.testing.assert_close(logits_with(out), logits_with(None), rtol=0, atol=0)
        report = json.loads((out / "merge_report.json").read_text())
        assert report["weights"] == [1.0, -1.0] and report["rel_error_max"] == 0.0


def test_weight_one_merge_is_the_identity_and_the_folder_loads(adapters, tmp_path):
    out = tmp_path / "id"
    assert main(["merge", str(adapters / "a"), "--weights", "1", "--out", str(out)]) == 0
    src, merged = read_adapter_folder(adapters / "a").deltas(), read_adapter_folder(out).deltas()
    assert src.keys() == merged.keys()
    for m in src:
        torch.testing.assert_close(merged[m], src[m], rtol=1e-5, atol=1e-6)  # rank 4 -> rank 4: exact up to SVD
    torch.testing.assert_close(logits_with(out), logits_with(adapters / "a"), rtol=1e-5, atol=1e-5)


def test_union_of_modules_and_rank_truncation_are_reported(adapters, tmp_path):
    out = tmp_path / "sum"
    main(["merge", str(adapters / "a"), str(adapters / "b"), "--weights", "1,1", "--rank", "2", "--out", str(out)])
    report = json.loads((out / "merge_report.json").read_text())
    merged, a, b = (read_adapter_folder(p) for p in (out, adapters / "a", adapters / "b"))
    assert set(merged.modules) == set(a.modules) | set(b.modules) and merged.rank == 2 and merged.scaling == 1.0
    assert 0.0 < report["rel_error_max"] < 1.0 and report["rel_error_mean"] <= report["rel_error_max"]
    k_proj = next(m for m in b.modules if m.endswith("k_proj"))  # only in b, rank 2: exact
    assert report["rel_error"][k_proj] < 1e-6
    torch.testing.assert_close(merged.deltas()[k_proj], b.deltas()[k_proj], rtol=1e-5, atol=1e-6)
    q_proj = next(m for m in a.modules if m.endswith("q_proj"))  # a + b at rank 2: the best rank-2 approximation
    s = torch.linalg.svdvals(a.deltas()[q_proj] + b.deltas()[q_proj])
    assert report["rel_error"][q_proj] == pytest.approx(float(s[2:].norm() / s.norm()), rel=1e-4)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["merge", "/nonexistent", "--out", "X"], "not a PEFT adapter folder"),
        (["merge", "A", "A", "--weights", "1", "--out", "X"], "1 weights for 2 adapters"),
        (["merge", "A", "--method", "average", "--out", "X"], "unknown method 'average'"),
        (["merge", "A", "--weights", "one", "--out", "X"], "comma-separated numbers"),
        # issue 45, round four
        (["merge", "A", "A", "--rank", "0", "--out", "X"], "merge: rank must be >= 1, got 0"),  # was: the default
        (["merge", "A", "A", "--weights", "nan,1", "--out", "X"], "--weights must be finite numbers, got nan,1"),
        (["merge", "A", "A", "--density", "-0.5", "--out", "X"], "density must be in (0, 1], got -0.5"),
        (
            ["merge", "A", "B", "--out", "A"],
            "is one of the adapters it merges; choose a new folder",
        ),  # was: A replaced
        (["merge", "A", "B", "--out", "FILE"], "is a file; choose a new folder"),
        (["merge", "A", "B", "--out", "FILE/x"], "lies under"),
        (["merge", "A", "B", "--out", "FULL"], "exists and is not empty; choose a new folder"),  # was: replaced whole
        (
            ["merge", "ROOT", "--out", "X"],
            "not a PEFT adapter folder (no adapter_config.json); it holds adapter folders (a, b): name those",
        ),  # fmt: skip
    ],
)
def test_bad_input_is_one_line_and_exit_2(adapters, tmp_path, capsys, args, message):
    (tmp_path / "FILE").write_text("mine")
    (tmp_path / "FULL").mkdir()
    (tmp_path / "FULL" / "notes.txt").write_text("mine")
    names = {"A": adapters / "a", "B": adapters / "b", "X": tmp_path / "x", "ROOT": adapters}
    args = [str(names.get(a, tmp_path / a if a in ("FILE", "FILE/x", "FULL") else a)) for a in args]
    before = {p: p.read_bytes() for p in adapters.rglob("*") if p.is_file()}
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    # nothing written or replaced: no output, the inputs and the user's files as they were
    assert not (tmp_path / "x").exists() and (tmp_path / "FILE").read_text() == "mine"
    assert [p.name for p in (tmp_path / "FULL").iterdir()] == ["notes.txt"]
    assert {p: p.read_bytes() for p in adapters.rglob("*") if p.is_file()} == before


def test_adapters_of_different_bases_are_refused_unless_allowed(adapters, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(adapters / "b", other)
    config = json.loads((other / "adapter_config.json").read_text())
    base = config["base_model_name_or_path"]
    config["base_model_name_or_path"] = "someone/other-model"
    (other / "adapter_config.json").write_text(json.dumps(config))
    a, out = str(adapters / "a"), tmp_path / "merged"
    assert main(["merge", a, str(other), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"different base models, {base!r} ({a}) and 'someone/other-model' ({other})" in err
    assert "--allow-different-bases" in err and not out.exists()
    # allowed (a base and its fine-tune): the same merge as of two adapters of one base
    assert main(["merge", a, str(other), "--out", str(out), "--allow-different-bases"]) == 0
    assert main(["merge", a, str(adapters / "b"), "--out", str(tmp_path / "same")]) == 0
    merged, same = read_adapter_folder(out).deltas(), read_adapter_folder(tmp_path / "same").deltas()
    assert merged.keys() == same.keys() and all(torch.equal(merged[m], same[m]) for m in same)


def test_damaged_weights_are_one_line_and_an_earlier_merge_is_replaced(adapters, tmp_path, capsys):
    # a copy cut short and a file overwritten: safetensors' header check, before anything is merged
    for name, cut in (("cut", lambda data: data[: len(data) // 2]), ("garbage", lambda data: b"garbage")):
        broken = tmp_path / name
        shutil.copytree(adapters / "a", broken)
        weights = broken / "adapter_model.safetensors"
        weights.write_bytes(cut(weights.read_bytes()))
        assert main(["merge", str(broken), str(adapters / "b"), "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {weights} is damaged (") and err.count("\n") == 1
        assert not (tmp_path / "x").exists()
    # rerunning a merge into its own earlier output replaces it (merge_report.json marks it as one)
    out = tmp_path / "merged"
    assert main(["merge", str(adapters / "a"), "--weights", "1", "--out", str(out)]) == 0
    assert main(["merge", str(adapters / "a"), "--weights", "2", "--out", str(out)]) == 0
    assert json.loads((out / "merge_report.json").read_text())["weights"] == [2.0]


def test_merging_a_merge_initialised_stage_with_one_it_merged_warns_of_the_double_count(tmp_path, capsys):
    """A run's third stage starts from a merge of stages one and two (adapter.init: merge), so its adapter already
    holds their ΔW: `adaptercl merge` of it with stage one's adapter (or combined adapter) counts stage one twice,
    and says so in one warning line per pair; merged alone, or with an adapter from elsewhere, it says nothing."""
    from adaptercl.recipe.grammar import resolve_recipe
    from adaptercl.run.sequence import run_recipe
    from tests.adapters.test_continual import STAGES, three_stage_recipe

    run = tmp_path / "run"
    run_recipe(resolve_recipe(three_stage_recipe(run, ["new", "new", "merge"])))
    capsys.readouterr()  # the run's own output
    merged, one = run / STAGES[2] / "adapter", run / STAGES[0]
    for parent in (one / "adapter", one / "combined_adapter"):
        assert main(["merge", str(merged), str(parent), "--out", str(tmp_path / parent.name)]) == 0
        err = capsys.readouterr().err
        assert err == (
            f"warning: {STAGES[2]}'s adapter started from a merge of {STAGES[0]}, {STAGES[1]} (adapter.init: merge), "
            f"so it already holds {STAGES[0]}'s ΔW: merging it with {parent} counts that ΔW twice; leave {parent} out "
            "to count it once\n"
        )
        report = json.loads((tmp_path / parent.name / "merge_report.json").read_text())
        assert report["warnings"] == [err.removeprefix("warning: ").rstrip("\n")]
    assert main(["merge", str(merged), str(tmp_path / "adapter"), "--out", str(tmp_path / "elsewhere")]) == 0
    assert capsys.readouterr().err == ""
