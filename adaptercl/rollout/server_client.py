"""The HTTP side of the `vllm_server` rollout engine, without torch: `ServerClient` (requests with retries and
one-line errors) and `check_server` (the first contact). The engine (`vllm_server.py`) talks through them, and the
run's preflight (`run.preflight_checks.check_rollout_server`) makes the same first contact before the base model loads,
so a wrong address, a server that lists another base or one without runtime LoRA loading fails in one line at once.

Failures: a request that cannot connect, times out or gets a 5xx answer is retried `rollout.server.retries` times
with exponential backoff; then `ServerUnreachable` (a `RolloutServerError`) names the server, the request and what
happened. A 4xx answer is a `RolloutServerError` at once, with what to change where the cause is known.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from adaptercl.recipe import RecipeError, RolloutServerConfig
from adaptercl.rollout.protocol import RolloutServerError

RUNTIME_LORA_HINT = "start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora (`adaptercl recipe serve`)"


class ServerUnreachable(RolloutServerError):
    """Every attempt of a request failed to connect, timed out or got a 5xx answer."""

    def __init__(self, url: str, request: str, attempts: int, problem: str):
        self.url, self.request, self.attempts, self.problem = url, request, attempts, problem
        tries = f"{attempts} attempt{'s' if attempts > 1 else ''}"
        super().__init__(
            f"rollout server {url}: {request} failed after {tries} ({problem}); check that the server runs and "
            "answers at rollout.server.url (a run keeps its last checkpoint: rerun to resume)"
        )


class ServerClient:
    """Requests to the vLLM server at `settings.url` (a trailing /v1 dropped), with its API key when it has one."""

    def __init__(self, settings: RolloutServerConfig):
        import httpx

        self.settings = settings
        self.url = settings.url.removesuffix("/v1")
        headers = {}
        if settings.api_key_env is not None:
            key = os.environ.get(settings.api_key_env)
            if not key:
                raise RecipeError(
                    f"rollout.server.api_key_env: the environment variable {settings.api_key_env} is not set"
                )
            headers["Authorization"] = f"Bearer {key}"
        self.http = httpx.Client(base_url=self.url, timeout=settings.timeout_s, headers=headers)

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """The JSON (or text) answer of one request, retried on connection errors, timeouts and 5xx answers."""
        import httpx

        retries, problem = self.settings.retries, ""
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(self.settings.backoff_s * 2 ** (attempt - 1))
            try:
                response = self.http.request(method, path, json=body)
            except httpx.TransportError as err:  # refused, reset, timed out, DNS
                problem = f"{type(err).__name__}: {one_line(str(err)) or 'no answer'}"
                continue
            if response.status_code >= 500:
                problem = f"HTTP {response.status_code}: {one_line(response.text)}"
                continue
            if response.status_code >= 400:
                raise _refusal(self.url, method, path, response.status_code, response.text)
            try:
                return response.json()
            except json.JSONDecodeError:
                return response.text
        raise ServerUnreachable(self.url, f"{method} {path}", retries + 1, problem)

    def server_models(self) -> list[dict[str, Any]]:
        """The server's `/v1/models` list: the base (parent None) and every loaded adapter."""
        return self.request("GET", "/v1/models")["data"]

    def close(self) -> None:
        self.http.close()


def check_server(client: ServerClient, probe_name: str) -> str:
    """The base model's name on the server; RolloutServerError (one line) when the server is unreachable, does not
    list the base asked for, or does not accept runtime LoRA loading (probed by unloading `probe_name`, a name it
    cannot hold)."""
    models = client.server_models()
    bases = [m["id"] for m in models if m.get("parent") is None]
    model = client.settings.model
    if model is not None:
        if model not in bases:
            raise RolloutServerError(f"rollout.server.model: the server at {client.url} serves {bases}, not {model!r}")
        base = model
    elif len(bases) == 1:
        base = bases[0]
    else:
        raise RolloutServerError(
            f"rollout.server.model: the server at {client.url} serves {len(bases)} base models {bases}; name one"
        )
    # an unknown name: 404 from the LoRA route when runtime loading is on, FastAPI's bare 404 when it is off
    probe = client.http.post("/v1/unload_lora_adapter", json={"lora_name": probe_name})
    if probe.status_code == 404 and probe.headers.get("content-type", "").startswith("application/json"):
        if probe.json().get("detail") == "Not Found":
            raise RolloutServerError(
                f"rollout server {client.url} does not accept runtime LoRA loading; {RUNTIME_LORA_HINT}"
            )
    return base


def _refusal(url: str, method: str, path: str, status: int, text: str) -> RolloutServerError:
    """A 4xx answer as one line, with what to change where the cause is known."""
    try:
        message = json.loads(text).get("error", {}).get("message") or text
    except (json.JSONDecodeError, AttributeError):
        message = text
    message = one_line(message)
    hint = ""
    if path.endswith("_lora_adapter") and status == 404 and "Not Found" in message:
        hint = f"; {RUNTIME_LORA_HINT}"
    elif "max_lora_rank" in message or "rank" in message.lower():
        hint = "; restart the server with a larger --max-lora-rank (`adaptercl recipe serve` sets the recipe's)"
    elif "No such file" in message or "not found" in message.lower() and path.endswith("load_lora_adapter"):
        hint = (
            "; the server must read rollout.server.adapter_dir (a shared path; see rollout.server.server_adapter_dir)"
        )
    return RolloutServerError(f"rollout server {url}: {method} {path} refused (HTTP {status}: {message}){hint}")


def one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
