"""`preflight`: what a resolved recipe names must be here before a model loads. The grammar (`recipe/grammar.py`)
checks what a recipe says; this checks it against this machine, each problem one `RecipeError` line naming the field:

- `output_dir` (or a folder above it) is not a file;
- `model.name` spelled as a local path (`/`, `.`, `~`, `.gguf`) exists, and a local folder's config.json parses;
- every stage's `lora.layers` names layers the base has, where its config tells without a weight or a download
  (`model.lora_layers.check_lora_layers`: built-in aliases, local folders, GGUF metadata, the local hub cache);
- every domain: its builtin name, its reward (a user `pkg.module:function` is imported; every `reward_funcs` entry
  too, its signature checked as native or TRL-style), its local source file or
  folder with the split files, and its local `eval_file` exist (`domains.loading.check_domain`; URL and hub
  sources are not fetched here);
- a set `rollout.max_lora_rank` holds the largest combined adapter the recipe serves (`rollout.served_lora_rank`;
  whatever the engine: `auto` may pick vLLM elsewhere);
- `rollout.dtype: bfloat16` where the hf engine rolls out on the CPU: the CPU has bf16 matrix units
  (`rollout.precision.check_rollout_dtype`, from /proc/cpuinfo); `ADAPTERCL_PACKED_WEIGHTS`, where set, is on or
  off (`rollout.packed_choice.check_packed_setting`);
- `rollout.engine: vllm` has vLLM installed (`vllm_server` needs none here; `auto` needs none: the callers resolve
  it first, `rollout.engine_choice.resolve_engine`, and it falls back to transformers);
- `rollout.engine: vllm_server` (with `contact_server`, as the run and `adaptercl eval` call it): the server at
  `rollout.server.url` answers, lists the base asked for and accepts runtime LoRA loading
  (`rollout.server_client.check_server`, retried as `rollout.server.retries` says). `recipe validate` checks the
  recipe and this machine, not a server that may be started later: it checks only the URL's form (the grammar);
- `eval.lm_eval.tasks`: lm-eval is installed and knows every task (its include_path exists); this imports lm-eval
  and reads its task index, a few seconds, only when tasks are set.
- every tracker of `report_to` has its package installed (`measure.trackers.require_trackers`);
- the data: the first rows of each domain it can reach without a download, rendered as the run will
  (`data_lines`, `domains.check_domain_data`; the run reads every row when it loads the domains), so a run whose
  rows do not fit its recipe is refused before its directory is claimed, and `recipe validate` prints what was read.

`adaptercl recipe validate`, `sequence.run_recipe` and `adaptercl eval` call `preflight`. No torch import: validate
stays well under a second (importing a user's reward module aside, resolving `rollout.engine: auto` where a CUDA
driver is found, which imports vLLM, and pandas for a .csv source's first rows). `decision_lines` is what validate
prints after "ok": per domain, how a sample is judged correct (the accuracy matrix) and a success (SDPO/hybrid,
`domains.is_success`).
"""

from __future__ import annotations

import os
from pathlib import Path

from adaptercl.domains import BUILTINS, FORMATS, check_domain, check_domain_data, load_trl_rewards
from adaptercl.measure import require_trackers
from adaptercl.model import check_lora_layers, read_model_config
from adaptercl.recipe import ENGINES, METHODS, DomainConfig, RecipeConfig, RecipeError, RolloutServerConfig
from adaptercl.rollout import check_packed_setting, check_rollout_dtype, require_vllm, served_lora_rank
from adaptercl.run_dir import before_source
from adaptercl.system import distributed


def preflight(recipe: RecipeConfig, contact_server: bool = True) -> list[str]:
    """Raise the first problem found as a one-line RecipeError; when the recipe can start, return what it read of
    the data (`data_lines`, which `recipe validate` prints). `contact_server`: also make the first contact with a
    `vllm_server` engine's server (see the module docstring)."""
    check_output_dir(recipe.output_dir)
    check_model_path(recipe.model.name)
    check_lora_layers(recipe)
    for domain in recipe.domains:
        check_domain(domain)
    data = data_lines(recipe)  # the first rows: a run refuses before its directory is claimed or a model loads
    engine = ENGINES.get(recipe.stages[0].rollout.engine)  # one engine serves every stage (config checks); auto: None
    if recipe.stages[0].rollout.max_lora_rank is not None:  # set: it must hold the recipe's adapters, any engine
        served_lora_rank(recipe)
    check_rollout_dtype(recipe)
    check_packed_setting(os.environ)
    if engine is not None and engine.needs_local_vllm:
        require_vllm()
    if recipe.eval.lm_eval.tasks:  # lm-eval's task index: a mistyped task fails here, not after stage 1
        from adaptercl.measure import check_tasks

        check_tasks(recipe.eval.lm_eval)
    require_trackers(recipe.report_to)
    before_source(recipe)  # eval.before_from: a run with a finished row 0 of the same inputs
    # last: it may wait out the retries of an unreachable server
    if engine is not None and engine.needs_server and contact_server:
        check_rollout_server(recipe.stages[0].rollout.server)
    return data


def check_output_dir(output_dir: str, field: str = "output_dir") -> None:
    """The run directory, or the nearest part of its path that exists, must be a folder (`field`: what the error
    names, e.g. a command's `--out`)."""
    path = Path(output_dir).expanduser()
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                what = "is" if part == path else f"lies under {str(part)!r}, which is"
                raise RecipeError(f"{field}: {output_dir!r} {what} a file, not a folder; choose another {field}")
            return


def check_model_path(name: str) -> None:
    """A model spelled as a local path must exist (hub ids and built-in aliases are checked when loaded), and a local
    folder's config.json must parse (`model.read_model_config`: a hub page saved in its place is named)."""
    path = Path(name).expanduser()
    if (name.startswith(("/", ".", "~")) or name.endswith(".gguf")) and not path.exists():
        raise RecipeError(f"model.name: local path {name!r} does not exist")
    if (path / "config.json").is_file():
        read_model_config(path / "config.json")


def check_rollout_server(settings: RolloutServerConfig) -> None:
    """The first contact with the rollout server, as the engine makes it, before the base model loads: a wrong
    address, a server listing another base or one without runtime LoRA loading is one RecipeError line."""
    from adaptercl.rollout import RolloutServerError, ServerClient, ServerUnreachable, check_server

    client = ServerClient(settings)
    try:
        check_server(client, "adaptercl-preflight-probe")
    except ServerUnreachable as err:
        raise RecipeError(
            f"rollout.server.url: no rollout server answers at {err.url} ({err.request} failed after {err.attempts} "
            f"attempt{'s' if err.attempts > 1 else ''}: {err.problem}); start it (`adaptercl recipe serve RECIPE` "
            "runs the command that fits the recipe) or correct rollout.server.url"
        ) from None
    except RolloutServerError as err:
        raise RecipeError(str(err)) from None
    finally:
        client.close()


def data_lines(recipe: RecipeConfig) -> list[str]:
    """`recipe validate`'s reading of the data, after `preflight`: per dataset domain, the first rows of each source
    this machine holds read and rendered as the run will (`domains.check_domain_data`), or what was not checked; a
    problem is a RecipeError line. Reads local files and the local hub cache only."""
    return [line for cfg in recipe.domains if (line := check_domain_data(cfg)) is not None]


def decision_lines(recipe: RecipeConfig) -> list[str]:
    """Per domain, how correctness and (when a stage distils) SDPO/hybrid success are decided, e.g. "gsm8k: correct
    = accuracy_reward >= 1.0 (of accuracy_reward, think_format_reward); SDPO/hybrid success = correct". Call after
    `preflight` (it imports the rewards again, from Python's module cache)."""
    thresholds = sorted(
        {s.distill.success_threshold for s in recipe.stages if METHODS[s.method].needs_teacher}
    )  # the stages that act on success
    lines = []
    for cfg in recipe.domains:
        trl = load_trl_rewards(cfg)
        if trl is not None:
            line, success = f"{cfg.name}: {trl.correct_rule()}", "correct"
        else:
            line = f"{cfg.name}: correct = the {_native_reward_name(cfg)} reward's own verdict"
            shown = " or ".join(str(t) for t in thresholds)
            success = f"reward >= {shown} (distill.success_threshold{', per stage' if len(thresholds) > 1 else ''})"
        lines.append(line + (f"; SDPO/hybrid success = {success}" if thresholds else ""))
    return lines


def _native_reward_name(cfg: DomainConfig) -> str:
    if cfg.reward is not None:
        return cfg.reward
    if cfg.source.startswith("builtin:"):
        return BUILTINS[cfg.source.removeprefix("builtin:")][1]
    return str(FORMATS[cfg.format or "generic"].reward)


def check_world(recipe: RecipeConfig, world: distributed.World) -> None:
    """One-line errors for a recipe that cannot run on `world.size` data-parallel ranks."""
    if world.size == 1:
        return
    rollout = recipe.stages[0].rollout
    if rollout.engine == "vllm" and world.size % rollout.tensor_parallel_size:
        raise RecipeError(
            f"rollout.tensor_parallel_size: {rollout.tensor_parallel_size} GPUs per vLLM engine cannot split "
            f"{world.size} data-parallel ranks (WORLD_SIZE) into whole groups; use a divisor of {world.size}"
        )
    for stage in recipe.stages:
        if stage.optim.prompts_per_step % world.size:
            raise RecipeError(
                f"stages.{stage.name}.optim.prompts_per_step: {stage.optim.prompts_per_step} prompts cannot be split "
                f"evenly over {world.size} data-parallel ranks (WORLD_SIZE); use a multiple of {world.size}"
            )
