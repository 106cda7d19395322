"""The `vllm_server` rollout engine: rollouts from a running vLLM OpenAI-compatible server on other GPUs or hosts.

Use: `VLLMServerEngine.from_recipe(recipe, base, model)` (the run does this once when `rollout.engine:
vllm_server`), then the `RolloutEngine` protocol, as the in-process `vllm` engine (`adaptercl.rollout.vllm`):
`generate(prompts, adapters, params)` and `sync_adapters(names)` after each optimiser step; `sleep`/`wake` are
no-ops (the server's memory is not the trainer's).

The server (`adaptercl recipe serve RECIPE` prints and runs the command that fits a recipe, `ship/serving.py`):
- the trainer's base (the same checkpoint; `--quantization bitsandbytes` for an NF4 trainer), started with
  `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`, `--enable-lora`, `--max-lora-rank` at least the largest combined rank
  the recipe serves, `--logprobs-mode processed_logprobs` (logprobs under logits / temperature, the trainer's
  definition; without it the importance weights are wrong at temperature != 1) and `--generation-config vllm`;
- it must be able to read `rollout.server.adapter_dir` (default `<output_dir>/rollout-adapters`) at
  `rollout.server.server_adapter_dir` (default the same path): the same machine, or a shared filesystem.

How adapters reach the server (`adapter_versions`, shared with the in-process engine): each version of a set of
active adapters is written as one combined PEFT folder and loaded at runtime under a **new name**
(`POST /v1/load_lora_adapter {lora_name, lora_path}`; the server gives each name a new integer id, so no cached
weights or prefix-cache blocks of an earlier version are reused); the version it replaces is unloaded
(`POST /v1/unload_lora_adapter`: its name then answers 404) and its folder deleted. Names carry a per-engine tag
(`stage-01-math@3.1a2b3c4d`), so a run restarted against the same server never collides with its earlier names;
with the default adapter_dir (inside the run directory, owned by the run) a restarted run first unloads what an
earlier engine of the run left on the server (it was killed, or failed) and deletes its folders.

Requests: one `POST /v1/completions` per sampled row (n = 1; a group of n samples is n requests), sent
concurrently; the prompt goes as token ids and `return_token_ids` brings the sampled ids back, so the trainer's
tokenizer alone encodes and decodes. Sampling is the hf engine's (temperature, top_p, top_k off, no penalties, its
stop token ids; greedy = temperature 0) and each row's request has its row's seed (`rollout.row_requests`: the global
row index through `row_seed`), as in the in-process engine; one request of n samples would give sample j the
request's seed + j, which another step's row has too. With `params.logprobs`, `logprobs: 0` returns each sampled
token's logprob.

Under N data-parallel ranks (`system/distributed.py`) the ranks share the server: rank 0 alone writes and loads each
adapter version (and unloads the one it replaces once every rank has finished its requests: a barrier first) and
broadcasts the served name; every rank then requests completions for its own share of the prompts under that name,
seeded by global row as above, so the rows are sampled as one process would. Ranks > 0 write nothing.

Failures: a request that cannot connect, times out or gets a 5xx answer is retried `rollout.server.retries` times
with exponential backoff; then, or on a refusal (4xx), a one-line `RolloutServerError` names the server, the request
and what to change (the HTTP side, torch-free, is `server_client.py`). The run's preflight contacts the server
before the base model loads, and the engine checks it again when it starts, so a wrong address fails at once; a
server that dies mid-stage stops the stage at its last checkpoint, and a rerun resumes there.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from adaptercl.recipe import RecipeConfig, RolloutServerConfig
from adaptercl.rollout.adapter_versions import AdapterVersions, Served
from adaptercl.rollout.hf import stop_token_ids  # the same stop tokens as the hf engine
from adaptercl.rollout.protocol import Completion, RolloutServerError, SamplingParams, row_requests
from adaptercl.rollout.server_client import ServerClient, check_server
from adaptercl.system import distributed

log = logging.getLogger(__name__)

ADAPTER_DIR = "rollout-adapters"  # under the run directory, unless rollout.server.adapter_dir says otherwise
MAX_IN_FLIGHT = 64  # concurrent completion requests (the server batches them)
MAX_SERVED = 8  # combined adapter versions loaded at once (a stage needs 2-3: policy, teacher, previous policy)


class VLLMServerEngine:
    """Rollouts from a vLLM server at `settings.url`; `model` is the trainer's PeftModel (read for adapters)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        settings: RolloutServerConfig,
        adapter_dir: str | Path,
        serve_path: str,
        reclaim: bool = False,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.settings = settings
        self.stop_ids = stop_token_ids(model, tokenizer)
        self._client = ServerClient(settings)
        self.url = self._client.url
        self.world = distributed.world()  # N ranks: rank 0 writes and loads the adapter versions for all
        self.tag = distributed.broadcast_object(uuid.uuid4().hex[:8])  # this engine's names and folders
        self.workdir = Path(adapter_dir).expanduser().absolute() / self.tag
        server_dir = settings.server_adapter_dir or str(Path(adapter_dir).expanduser().absolute())
        self.server_workdir = f"{server_dir.rstrip('/')}/{self.tag}"
        self.base_model = check_server(self._client, f"adaptercl-probe-{self.tag}")
        if reclaim and self.world.is_main:  # a folder this run owns: what an earlier engine of the run left goes
            self._reclaim(server_dir)
        if self.world.is_main:
            self.workdir.mkdir(parents=True, exist_ok=True)
        self._closing = False
        self.versions = AdapterVersions(serve_path, self.workdir, MAX_SERVED, load=self._load, unload=self._unload)
        self.description = (
            f"vLLM server {self.url} serving {self.base_model}; adapter versions written to {self.workdir} "
            f"(the server reads {self.server_workdir})"
        )

    @classmethod
    def from_recipe(cls, recipe: RecipeConfig, base: Any, model: torch.nn.Module) -> VLLMServerEngine:
        """The run's engine: `rollout.server` of the first stage (the same in every stage) and the loaded base."""
        settings = recipe.stages[0].rollout.server
        if settings.adapter_dir is not None:  # possibly shared with other runs: only this engine's part is touched
            return cls(model, base.tokenizer, settings, settings.adapter_dir, base.path)
        return cls(model, base.tokenizer, settings, Path(recipe.output_dir) / ADAPTER_DIR, base.path, reclaim=True)

    # ---- the RolloutEngine protocol

    def sync_adapters(self, names: list[str]) -> None:
        """Snapshot the current weights of these adapters; the next rollout under them loads the new version."""
        if self.world.is_main:  # the one rank that loads versions (every rank holds the same weights)
            self.versions.sync(self.model, names)

    def generate(
        self, prompts: list[list[int]], adapters: list[str] | None, params: SamplingParams
    ) -> list[list[Completion]]:
        model_name = self._model_name(adapters)
        requests = row_requests(prompts, params)  # one per sampled row, with its row's seed
        bodies = [self._completion_body(model_name, p, params, seed) for p, seed in requests]
        with ThreadPoolExecutor(max_workers=max(1, min(MAX_IN_FLIGHT, len(bodies)))) as pool:
            answers = list(pool.map(lambda body: self._request("POST", "/v1/completions", body), bodies))
        rows = [self._completion(p, answer, params) for (p, _), answer in zip(requests, answers)]
        return [rows[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    def sleep(self) -> None:
        """Nothing to free here: the server's memory is its own."""

    def wake(self) -> None:
        """See `sleep`."""

    def close(self) -> None:
        """Unload every adapter version this engine loaded (best effort: the server may be gone) and delete them."""
        self._closing = True
        distributed.barrier()  # every rank's last requests are answered before rank 0 unloads
        if self.world.is_main:
            self.versions.close()
            shutil.rmtree(self.workdir, ignore_errors=True)
            with contextlib.suppress(OSError):  # the adapter folder itself when no other engine uses it
                self.workdir.parent.rmdir()
        self._client.close()

    # ---- what the server holds

    def served_loras(self) -> dict[str, int]:
        """Server-side name -> version id of every adapter version this engine has loaded."""
        return {self._server_name(name): i for name, i in self.versions.served().items()}

    def server_models(self) -> list[dict[str, Any]]:
        """The server's `/v1/models` list: the base (parent None) and every loaded adapter."""
        return self._client.server_models()

    # ---- requests

    def _completion_body(self, model: str, prompt: list[int], params: SamplingParams, seed: int) -> dict[str, Any]:
        return {
            "model": model,
            "prompt": list(prompt),
            "n": 1,
            "max_tokens": params.max_new_tokens,
            "min_tokens": params.min_new_tokens or 0,  # stop tokens masked until then (0: none)
            "temperature": 0.0 if params.greedy else params.temperature,
            "top_p": 1.0 if params.greedy else params.top_p,
            "top_k": 0,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "seed": seed,
            "stop_token_ids": self.stop_ids,
            "logprobs": 0 if params.logprobs else None,  # the sampled token's logprob only
            "return_token_ids": True,
        }

    def _completion(self, prompt: list[int], answer: dict[str, Any], params: SamplingParams) -> Completion:
        """The one sample of a row's answer."""
        if len(answer["choices"]) != 1:
            raise RolloutServerError(f"rollout server {self.url}: {len(answer['choices'])} completions for n=1")
        (choice,) = answer["choices"]
        tokens = list(choice["token_ids"])
        logprobs = None
        if params.logprobs:
            logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            if len(logprobs) != len(tokens):
                raise RolloutServerError(
                    f"rollout server {self.url}: {len(logprobs)} logprobs for {len(tokens)} tokens in a "
                    "completion; is it a vLLM server?"
                )
        return Completion.from_tokens(prompt, tokens, self.tokenizer, self.stop_ids, logprobs)

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        return self._client.request(method, path, body)

    # ---- adapter versions on the server

    def _model_name(self, adapters: list[str] | None) -> str:
        """The server-side name serving exactly `adapters` (the base's for None), loaded on first use. Under N ranks
        rank 0 loads it, after every rank has finished its requests (the version it replaces is unloaded), and tells
        the others; a server error on rank 0 is raised on every rank."""
        if self.world.size == 1:
            served = self.versions.prepare(self.model, adapters)
            return self.base_model if served is None else served.handle
        distributed.barrier()
        answer: tuple[str | None, str | None] = (None, None)
        if self.world.is_main:
            try:
                served = self.versions.prepare(self.model, adapters)
                answer = (self.base_model if served is None else served.handle, None)
            except RolloutServerError as err:
                answer = (None, str(err))
        name, error = distributed.broadcast_object(answer)
        if error is not None:
            raise RolloutServerError(error)
        return name

    def _reclaim(self, server_dir: str) -> None:
        """Unload the adapters an earlier engine loaded from `server_dir` and delete its folders."""
        prefix = f"{server_dir.rstrip('/')}/"
        for entry in self.server_models():
            if entry.get("parent") is not None and str(entry.get("root", "")).startswith(prefix):
                self._request("POST", "/v1/unload_lora_adapter", {"lora_name": entry["id"]})
        shutil.rmtree(self.workdir.parent, ignore_errors=True)

    def _server_name(self, name: str) -> str:
        return f"{name}.{self.tag}"

    def _load(self, served: Served) -> str:
        name = self._server_name(served.name)
        path = f"{self.server_workdir}/{served.folder.name}"
        self._request("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        return name

    def _unload(self, served: Served) -> None:
        try:
            self._request("POST", "/v1/unload_lora_adapter", {"lora_name": served.handle})
        except RolloutServerError as err:
            if not self._closing:
                raise
            log.warning("could not unload %s: %s", served.handle, err)
