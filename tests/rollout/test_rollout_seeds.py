"""Independent rollout samples: every (stage, step, rank, row) of a run gets its own seed, derived in one place
(`rollout.row_seed`), and every engine samples with it: the hf engine gives each row its own generator (tests/rollout/test_decode.py),
the vLLM engines (in process and server) send one request per row with the row's seed.

The vLLM request tests replace `vllm.LLM` or the server's HTTP answers with recorders (no engine starts); the
sampling equivalence on a real engine is in tests/rollout/test_vllm_engine.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from adaptercl.recipe.grammar import resolve_recipe
from adaptercl.rollout import SamplingParams, row_requests, row_seed
from adaptercl.train.context import rollout_sampling, step_seed

STEPS, RANKS, PROMPTS_PER_RANK, GROUP, STAGES = 1000, 4, 16, 4, 3  # 64 rows per rank and step
WRAPPING_SEED = 461_847_185  # its stage 0's step seeds pass 2^31 - 1 (and start again from 0) at step 500


def stage_config(**rollout):
    raw = {
        "model": {"name": "tiny-random"},
        "output_dir": "unused",
        "rollout": {"group_size": GROUP, "max_new_tokens": 8, **rollout},
        "domains": [{"name": "arith", "source": "builtin:arithmetic"}],
        "stages": [{"name": f"s{i}", "domain": "arith"} for i in range(STAGES)],
    }
    return resolve_recipe(raw).stages[0]


def step_row_seeds(recipe_seed: int, stage: int, step: int) -> list[int]:
    """The seeds of every row of one step, over every rank, as train/stage.py asks for them: each rank's share of the
    prompts starts at prompt `lo`, its first row `lo x group_size`."""
    seeds = []
    for rank in range(RANKS):
        lo = rank * PROMPTS_PER_RANK
        params = rollout_sampling(STAGE, step_seed(recipe_seed, stage, step), first_row=lo * GROUP)
        prompts = [[1, 2, 3]] * PROMPTS_PER_RANK
        seeds += [seed for _, seed in row_requests(prompts, params)]
    return seeds


STAGE = stage_config()


@pytest.mark.parametrize("recipe_seed", [0, WRAPPING_SEED])
def test_no_two_rows_of_a_run_share_a_seed(recipe_seed):
    seeds = [s for stage in range(STAGES) for step in range(STEPS) for s in step_row_seeds(recipe_seed, stage, step)]
    assert len(seeds) == STAGES * STEPS * RANKS * PROMPTS_PER_RANK * GROUP
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**63 - 1 for s in seeds)  # a non-negative int64: torch.manual_seed and vLLM take it


def test_the_former_vllm_seeds_collided_across_adjacent_steps():
    """The check above is sensitive: seed + row (the former vLLM derivation) repeats across adjacent steps."""
    former = [step_seed(0, 0, step) + row for step in range(2) for row in range(RANKS * PROMPTS_PER_RANK * GROUP)]
    assert len(set(former)) == RANKS * PROMPTS_PER_RANK * GROUP + 1  # step 1 reused all but one of step 0's seeds


def test_wrapping_step_seeds_really_wrap():
    """The second case of the no-collision test covers the wrap-around of step_seed modulo 2^31 - 1."""
    seeds = [step_seed(WRAPPING_SEED, 0, step) for step in range(STEPS)]
    assert seeds[499] == 2**31 - 2 and seeds[500] == 0


def test_a_row_seed_does_not_depend_on_how_rows_are_split():
    params = SamplingParams(max_new_tokens=4, n=4, seed=77)
    whole = row_requests([[1], [2], [3], [4]], params)
    halves = row_requests([[1], [2]], params) + row_requests([[3], [4]], SamplingParams(4, n=4, seed=77, first_row=8))
    assert whole == halves
    assert [seed for _, seed in whole] == [row_seed(77, r) for r in range(16)]
    assert row_seed(77, 0) == 77  # row 0 keeps the call's seed (the hf engine's first batch, as before)


class RecordingLLM:
    """Stands in for `vllm.LLM`: records each request's (prompt, n, seed) and answers one token per request, the
    request's position, so the engine's regrouping is visible."""

    def __init__(self, **kwargs):
        self.kwargs, self.requests = kwargs, []
        self.llm_engine = SimpleNamespace(add_lora=lambda request: None, remove_lora=lambda lora_id: None)

    def generate(self, prompts, sampling, lora_request=None, use_tqdm=False):
        start = len(self.requests)
        self.requests += [(p["prompt_token_ids"], s.n, s.seed) for p, s in zip(prompts, sampling)]
        sample = lambda i: SimpleNamespace(index=0, token_ids=[start + i], logprobs=None)  # noqa: E731
        return [SimpleNamespace(outputs=[sample(i)]) for i in range(len(prompts))]


@pytest.mark.vllm
def test_the_vllm_engine_sends_one_request_per_row_with_the_rows_seed(monkeypatch, tmp_path):
    import vllm

    from adaptercl.model.base import load_base
    from adaptercl.recipe.grammar import ModelConfig
    from adaptercl.rollout import vllm as vllm_engine

    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    base = load_base(ModelConfig(name="tiny-random"), "none")
    engine = vllm_engine.VLLMEngine(base.model, base.tokenizer, base.path, max_lora_rank=8)
    try:
        prompts = [[11, 12], [13, 14], [15, 16]]
        params = rollout_sampling(STAGE, step_seed(0, 1, 41), first_row=8)  # a rank whose share starts at row 8
        groups = engine.generate(prompts, None, params)
        requests = engine.llm.requests
    finally:
        engine.close()
    expected = [(p, 1, row_seed(params.seed, 8 + i * GROUP + j)) for i, p in enumerate(prompts) for j in range(GROUP)]
    assert requests == expected
    # sample j of prompt i is the answer to request i*G + j, and keeps its prompt
    assert [[c.token_ids for c in g] for g in groups] == [[[i * GROUP + j] for j in range(GROUP)] for i in range(3)]
    assert [g[0].prompt_ids for g in groups] == prompts


def test_the_vllm_server_engine_sends_one_request_per_row_with_the_rows_seed(monkeypatch, tmp_path):
    from adaptercl.model.base import load_base
    from adaptercl.recipe.grammar import ModelConfig, RolloutServerConfig
    from adaptercl.rollout import vllm_server
    from adaptercl.rollout.vllm_server import VLLMServerEngine

    bodies = []

    def answer(self, method, path, body=None):
        bodies.append(body)
        return {"choices": [{"index": 0, "token_ids": [len(bodies)], "logprobs": None}]}

    monkeypatch.setattr(vllm_server, "check_server", lambda client, probe_name: "base")
    monkeypatch.setattr(VLLMServerEngine, "_request", answer)
    base = load_base(ModelConfig(name="tiny-random"), "none")
    settings = RolloutServerConfig(url="http://127.0.0.1:9")
    engine = VLLMServerEngine(base.model, base.tokenizer, settings, tmp_path / "adapters", base.path)
    prompts = [[11, 12], [13, 14]]
    params = rollout_sampling(STAGE, step_seed(0, 0, 7), first_row=4)
    params = SamplingParams(**{**params.__dict__, "logprobs": False})
    try:
        groups = engine.generate(prompts, None, params)
    finally:
        engine.close()
    sent = sorted((b["prompt"], b["n"], b["seed"]) for b in bodies)  # requests run concurrently
    expected = sorted(
        (p, 1, row_seed(params.seed, 4 + i * GROUP + j)) for i, p in enumerate(prompts) for j in range(GROUP)
    )
    assert sent == expected
    assert [len(g) for g in groups] == [GROUP, GROUP] and all(
        c.prompt_ids == prompts[i] for i, g in enumerate(groups) for c in g
    )
