"""Whether the packed weights pay on this CPU (`rollout/packed_choice.py`): `ADAPTERCL_PACKED_WEIGHTS` decides without
a measurement and a bad value is one line at preflight; a measurement (injected here) keeps the packs unless they are
slower by more than the margin, is cached per CPU and kernels and read back without measuring; a launcher's rank and
a failed measurement keep the packs; the real measurement times the packed path it chooses; a block whose use does
not pay multiplies plain, an enclosing block's packs set aside and back after; a run on the plain path packs nothing
and records why."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from packing_counts import counting_packs

from adaptercl.recipe import RecipeError
from adaptercl.rollout import packed_choice as pc
from adaptercl.rollout.packed_weights import onednn_available, packed_linears

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN packed-linear ops")

SLOWER = {"seconds": {"plain": [1.0], "packed": [1.2]}, "ratio": 1.2}


def never() -> dict:
    raise AssertionError("measured, but the choice was known")


@pytest.mark.parametrize(("setting", "packed"), [("on", True), ("off", False)])
def test_the_variable_decides_without_a_measurement(tmp_path, setting, packed):
    decision = pc.choose("decode", {pc.ENV: setting}, tmp_path, "k", never)
    assert decision == {"packed": packed, "source": "set by ADAPTERCL_PACKED_WEIGHTS"}
    assert list(tmp_path.iterdir()) == []


def test_a_bad_setting_is_one_line_naming_the_variable(tmp_path, monkeypatch):
    with pytest.raises(RecipeError, match=r"^ADAPTERCL_PACKED_WEIGHTS='yes': set it to one of on, off, or unset"):
        pc.choose("decode", {pc.ENV: "yes"}, tmp_path, "k", never)
    from adaptercl.recipe.load import load_recipe
    from adaptercl.run.preflight_checks import preflight

    recipe = load_recipe("recipes/quickstart.yaml", [f"output_dir={tmp_path / 'run'}"])
    monkeypatch.setenv(pc.ENV, "1")
    with pytest.raises(RecipeError, match="ADAPTERCL_PACKED_WEIGHTS='1'"):
        preflight(recipe)
    assert not (tmp_path / "run").exists()


def test_slower_packs_are_set_aside_cached_and_read_back_without_measuring(tmp_path):
    decision = pc.choose("sequences", {}, tmp_path, "k1", lambda: SLOWER)
    assert decision == {"packed": False, **SLOWER, "source": "measured now"}
    (path,) = tmp_path.iterdir()
    assert path.name == "packed-sequences-k1.json" and json.loads(path.read_text()) == {"packed": False, **SLOWER}
    again = pc.choose("sequences", {}, tmp_path, "k1", never)
    assert again["packed"] is False and again["source"] == "measured earlier (packed-sequences-k1.json)"
    other = pc.choose("decode", {}, tmp_path, "k1", lambda: {**SLOWER, "ratio": 0.5})  # the other use: its own
    assert other["packed"] is True and len(list(tmp_path.iterdir())) == 2


@pytest.mark.parametrize(
    ("measurement", "packed"),
    [
        ({"ratio": 0.45}, True),
        ({"ratio": 1.04}, True),  # within the margin: the packs stay
        ({"ratio": 1.06}, False),
        ({"error": "RuntimeError: the packed path does not run here"}, True),
    ],
)
def test_what_a_measurement_chooses(measurement, packed):
    assert pc.pays_from(measurement) is packed


def test_a_rank_under_a_launcher_and_a_failed_measurement_keep_the_packs(tmp_path):
    ranked = pc.choose("decode", {"WORLD_SIZE": "2"}, tmp_path, "k", never)
    assert ranked["packed"] is True and "launcher" in ranked["source"] and list(tmp_path.iterdir()) == []

    def fails() -> dict:
        raise RuntimeError("no oneDNN\nsecond line")

    failed = pc.choose("decode", {}, tmp_path, "k", fails)
    assert failed == {"packed": True, "error": "RuntimeError: no oneDNN", "source": "measured now"}


def test_the_key_follows_the_threads_and_the_isa_settings(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)  # CI's AVX2 run sets it
    key = pc.kernel_key()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    capped = pc.kernel_key()
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    threads = torch.get_num_threads()
    # the count torch reports (not set_num_threads: an in-process vLLM test earlier in the suite can pin OpenMP's)
    with monkeypatch.context() as patch:
        patch.setattr(torch, "get_num_threads", lambda: threads + 1)
        more_threads = pc.kernel_key()
    assert len({key, capped, more_threads}) == 3 and pc.kernel_key() == key


@pytest.mark.parametrize("use", ["decode", "sequences"])
def test_the_measurement_times_the_packed_path(monkeypatch, use):
    """Also when the first block that asks is opened under inference mode and CPU autocast (where the packs would
    not run): the measurement steps out of both; torch's global random state is as before it."""
    record = counting_packs(monkeypatch)
    rng = torch.get_rng_state()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        result = pc.measure(use, packed_linears, rounds=2)
    assert torch.equal(torch.get_rng_state(), rng)  # a run that measures draws what one reading the cache draws
    assert all(len(seconds) == 2 and min(seconds) > 0 for seconds in result["seconds"].values())
    ratios = [p / q for p, q in zip(result["seconds"]["packed"], result["seconds"]["plain"])]
    assert result["ratio"] == pytest.approx(sum(ratios) / 2)  # the median of two
    calls = (1 + 2) * pc.REPEATS[use] * len(pc.SHAPES)  # warm-up and two turns, each shape REPEATS times
    assert len(record["made"]) == len(pc.SHAPES) and record["product"] == calls
    assert record["grad_input"] == (calls if pc.USES[use][1] else 0)


def test_a_block_whose_use_does_not_pay_multiplies_plain_inside_a_packed_one(monkeypatch):
    record = counting_packs(monkeypatch)
    linear = torch.nn.Linear(24, 16)
    x = torch.randn(5, 24)
    monkeypatch.setenv(pc.ENV, "off")
    with torch.no_grad(), packed_linears(linear) as outer:  # use None: packs whatever the choice
        assert outer == 1
        with packed_linears(linear, use="decode") as inner:
            assert inner == 0 and torch.equal(linear(x), F.linear(x, linear.weight, linear.bias))
        products = record["product"]
        linear(x)  # the outer block's pack again
        assert record["product"] == products + 1
    assert "forward" not in linear.__dict__ and record["product"] == 1
    monkeypatch.setenv(pc.ENV, "on")
    with torch.no_grad(), packed_linears(linear, use="decode") as count:
        assert count == 1


@pytest.mark.parametrize("source", ["off", "cached"])
def test_a_run_where_the_packs_do_not_pay_packs_nothing_and_records_why(tmp_path, monkeypatch, source):
    """A one-step tiny run: on the plain path (set, or a cached measurement of this CPU) no layer is packed, in the
    stage, its rollouts or its evaluation; cpu_paths.jsonl says so and why."""
    from adaptercl.recipe.grammar import resolve_recipe
    from adaptercl.run.sequence import run_recipe

    if source == "off":
        monkeypatch.setenv(pc.ENV, "off")
    else:  # this CPU measured before, in this cache: both uses slower packed
        monkeypatch.delenv(pc.ENV)
        monkeypatch.setenv("ADAPTERCL_CACHE", str(tmp_path / "cache"))
        for use in pc.USES:
            path = tmp_path / "cache" / "cpu-kernels" / f"packed-{use}-{pc.kernel_key()}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"packed": False, **SLOWER}))
    record = counting_packs(monkeypatch)
    raw = {
        "model": {"name": "tiny-random"},
        "output_dir": str(tmp_path / "run"),
        "lora": {"r": 4, "alpha": 8},
        "optim": {"lr": 5e-3, "steps": 1, "prompts_per_step": 2},
        "rollout": {"group_size": 2, "max_new_tokens": 4},
        "eval": {"examples_per_domain": 2, "drift_probes": 0, "stage_kl_prompts": 0},
        "domains": [{"name": "arith", "source": "builtin:arithmetic", "reward": "tiny_rewards:digit_fraction"}],
        "stages": [{"name": "one", "domain": "arith"}],
    }
    run_recipe(resolve_recipe(raw))
    assert record["made"] == [] and record["product"] == 0
    (paths,) = [json.loads(line) for line in (tmp_path / "run" / "cpu_paths.jsonl").read_text().splitlines()]
    plain = "F.linear (MKL): the packs do not pay on this CPU"
    assert paths["training_base_products"] == plain and paths["decode_products"] == plain
    sources = {use: paths["packed_choice"][use]["source"] for use in pc.USES}
    if source == "off":
        assert sources == {use: "set by ADAPTERCL_PACKED_WEIGHTS" for use in pc.USES}
    else:
        assert all(s.startswith("measured earlier (packed-") for s in sources.values())
        assert paths["packed_choice"]["decode"]["ratio"] == 1.2
