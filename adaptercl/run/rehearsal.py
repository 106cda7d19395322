"""`adaptercl recipe rehearse`: the recipe's real loop on this machine for a few minutes, measured.

    rehearsal = rehearse(load_recipe("recipes/quickstart.yaml"), Path("rehearsal-quickstart"))
    rehearsal.path          # rehearsal-quickstart/rehearsal.json; rehearsal.failure: None, or the one line

It runs `run_recipe` itself (the engine choice, loading, rollouts, each stage's training step at the micro-batch the
run takes, the evaluations, the end-of-stage diagnostics, saving) on the recipe with these changes and no other
(`rehearsed`): every stage `STEPS` steps (the first of each stage is the warm-up the estimate counts once), at most
`EVAL_EXAMPLES` examples a domain, at most `DIAGNOSTIC_PROMPTS` teacher-lift and stage-KL prompts and drift probes,
no lm-eval probes and no trackers, into a temporary output_dir that is deleted after: only DIR/rehearsal.json stays,
so no folder is left that `recipe run` would resume. Shapes are the recipe's (prompts, group size, prompts a step,
response caps, the generate batch), so each step and generate call is the run's. `run/phase_meter.py` times every
phase and keeps its peak memory; `run/rehearsal_figures.py` makes the per-stage figures; `plan/rehearsal.py` scales
them to the recipe. Past `minutes` (default 10 on a GPU, 4 on the CPU) no new phase opens: the run stops and the
figures so far are the result (`stopped`; the plan then gives the stages it did not reach another stage's figures).

`random_weights`: the model's shape with random weights (`model/random_weights.py`), nothing downloaded but the data;
responses then run to the cap. A phase that fails (out of memory, say) ends the rehearsal with one line naming the
phase, what it asked for and the setting to change (`failure_line`); rehearsal.json keeps what was measured.
"""

from __future__ import annotations

import math
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from adaptercl.adapters import stage_dir_name
from adaptercl.domains import load_domain
from adaptercl.plan import REHEARSAL_KIND, REHEARSAL_VERSION, recipe_hash
from adaptercl.recipe import RecipeConfig, RecipeError, StageConfig
from adaptercl.rollout import RolloutServerError
from adaptercl.run.phase_meter import PHASE_GROUPS, DeadlineReached, PhaseMeter
from adaptercl.run.preflight_checks import check_output_dir
from adaptercl.run.rehearsal_figures import EventLog, stage_figures, stage_of_spans
from adaptercl.run.sequence import run_recipe
from adaptercl.system import watching, write_json

STEPS = 3  # steps a stage: the first warms up (AdamW's state, kernels), the others are the steady rate
EVAL_EXAMPLES = 16  # examples a domain an evaluation takes (the per-example rate of a 16-row generate call)
DIAGNOSTIC_PROMPTS = 4  # teacher lift, stage KL, response drift probes: one forward batch of 4
MINUTES = {"cuda": 10.0, "cpu": 4.0}
OUT_OF_MEMORY = ("OutOfMemoryError", "MemoryError")  # torch's (CUDA) and Python's (the CPU)
VERSIONED = ("torch", "transformers", "peft", "trl", "accelerate", "bitsandbytes", "vllm", "adaptercl")


@dataclass
class Rehearsal:
    result: dict[str, Any]  # what rehearsal.json holds
    path: Path
    failure: str | None  # the one line of a failed phase


def rehearsed(recipe: RecipeConfig, output_dir: Path) -> tuple[RecipeConfig, dict[str, Any]]:
    """The recipe the rehearsal runs (see the module docstring) and what it changed."""
    cfg = recipe.eval
    stages = [s.model_copy(update={"optim": s.optim.model_copy(update={"steps": min(s.optim.steps, STEPS)})})
              for s in recipe.stages]  # fmt: skip
    changes = {
        "examples_per_domain": min(cfg.examples_per_domain, EVAL_EXAMPLES),
        "teacher_lift_prompts": min(cfg.teacher_lift_prompts, DIAGNOSTIC_PROMPTS),
        "stage_kl_prompts": min(cfg.stage_kl_prompts, DIAGNOSTIC_PROMPTS),
        "drift_probes": min(cfg.drift_probes, DIAGNOSTIC_PROMPTS),
    }
    lm_eval = cfg.lm_eval.model_copy(update={"tasks": []})
    run = recipe.model_copy(update={"stages": stages, "eval": cfg.model_copy(update={**changes, "lm_eval": lm_eval}),
                                    "output_dir": str(output_dir), "report_to": []})  # fmt: skip
    steps = {s.name: s.optim.steps for s in stages}
    return run, {"steps": steps, **changes, "lm_eval_tasks": "left out" if cfg.lm_eval.tasks else "none"}


PROCESS_GAP_S = 10.0  # a console script reaches its command within this of its process starting (interpreter, imports)


def startup_s(command_s: float) -> float | None:
    """Seconds spent before the rehearsal began, the `minutes` budget's start: the process's age when the process was
    started for this command (a console script: interpreter and imports included), else (the command run inside a
    longer-lived process: the tests, a notebook) `command_s`, the seconds since the command began."""
    age = process_age_s()
    if age is not None and age - command_s < PROCESS_GAP_S:
        return age
    return command_s


def process_age_s() -> float | None:
    """Seconds since this process started (Linux), None elsewhere."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def machine(cuda: bool) -> dict[str, Any]:
    """The machine a rehearsal ran on, with the label the plan names it by."""
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), None)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    out = {
        "cpu": cpu or platform.processor() or "unknown",
        "cpus_usable": cores,
        "torch_threads": torch.get_num_threads(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "platform": platform.platform(),
    }
    if cuda:
        props = torch.cuda.get_device_properties(0)
        return {**out, "gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1), "label": props.name}
    threads = out["torch_threads"]
    return {**out, "gpu": None, "label": f"{out['cpu']}, {cores} cores, {threads} torch thread{'s' * (threads > 1)}"}


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for package in VERSIONED:
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            pass
    return out


def rehearse(recipe: RecipeConfig, out_dir: Path, minutes: float | None = None, random_weights: bool = False,
             on_event: Any = None, source: dict[str, Any] | None = None,
             command_s: float = 0.0) -> Rehearsal:  # fmt: skip
    """Rehearse `recipe` (see the module docstring) and write `out_dir`/rehearsal.json; `source`: the file and
    overrides it came from, recorded; `command_s`: seconds the calling command ran before this call (`startup_s`).
    RecipeError and RolloutServerError pass through (the command's one line)."""
    check_request(out_dir, minutes)
    import torch

    began = time.monotonic()
    startup = startup_s(command_s)
    cuda = torch.cuda.is_available()
    minutes = minutes or MINUTES["cuda" if cuda else "cpu"]
    written, tokenizer = recipe, None
    if random_weights:
        from adaptercl.model import random_checkpoint

        folder, tokenizer = random_checkpoint(recipe.model.name, "cuda" if cuda else "cpu")
        recipe = recipe.model_copy(update={"model": recipe.model.model_copy(update={"name": str(folder)})})
    with tempfile.TemporaryDirectory(prefix="adaptercl-rehearsal-") as tmp:
        run, changes = rehearsed(recipe, Path(tmp) / "run")
        spent = (startup or 0.0) + time.monotonic() - began  # since the command started
        meter = PhaseMeter(cuda, deadline_s=minutes * 60 - spent)
        log = EventLog(meter, on_event)
        error: Exception | None = None
        try:
            with watching(meter):
                run_recipe(run, log)
        except DeadlineReached:
            pass
        except (RecipeError, RolloutServerError):
            raise
        except Exception as err:  # noqa: BLE001 - a failed phase is the rehearsal's finding: one line, figures kept
            error = err
        finally:
            memory = meter.close()
        run_s = meter.now()
    stages, eval_before, top = stage_figures(run, meter.spans, log)
    engine = next((info for _, info in log.of("rollout_engine")), {"engine": run.stages[0].rollout.engine,
                                                                   "reason": "named in the recipe"})  # fmt: skip
    result = {
        "kind": REHEARSAL_KIND,
        "version": REHEARSAL_VERSION,
        "recipe": {**(source or {}), "hash": recipe_hash(written), "model": written.model.name},
        "machine": machine(cuda),
        "versions": versions(),
        "engine": {"engine": engine["engine"], "reason": engine["reason"]},
        "random_weights": random_weights,
        "tokenizer": tokenizer,
        "rehearsed": changes,
        "minutes": minutes,
        "stopped": meter.stopped,
        "failed": None,
        # start-up: the process until the rehearsal began; other: the run outside every phase; phases: the top ones
        "seconds": {
            "startup": startup,
            "load": top.get("load"),
            "other": max(0.0, run_s - sum(top.values())),
            "run": run_s,
            "phases": top,
        },
        "stages": stages,
        "eval_before": eval_before,
        **eval_sizes(written, run, eval_before),
        "memory": memory,
    }
    failure = None
    if error is not None:
        failure = failure_line(run, meter, log, error)
        result["failed"] = {"phase": meter.failed_in, "line": failure}
    path = Path(out_dir) / "rehearsal.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, result)
    return Rehearsal(result, path, failure)


def check_request(out_dir: Path, minutes: float | None) -> None:
    """Refuse, before anything loads, a time limit that is not a finite number of minutes above 0 (0 would otherwise
    mean the default) and an `out_dir` that is a file or lies under one (rehearsal.json could not be written after
    the minutes were spent): one RecipeError line each."""
    if minutes is not None and not (math.isfinite(minutes) and minutes > 0):
        raise RecipeError(f"rehearse: --minutes must be a finite number of minutes above 0, got {minutes:g}")
    check_output_dir(str(out_dir), "--out")


def eval_sizes(recipe: RecipeConfig, run: RecipeConfig, before: dict[str, dict]) -> dict[str, Any]:
    """Examples a domain the recipe's evaluations take: what the rehearsal took when its eval set was smaller than
    asked, else the domain loaded at the recipe's `examples_per_domain` (builtin domains: that many); a domain the
    rehearsal did not evaluate is left out (the plan then takes `examples_per_domain`)."""
    asked, took = recipe.eval.examples_per_domain, run.eval.examples_per_domain
    sizes = {}
    for domain in recipe.domains:
        got = before.get(domain.name, {}).get("examples")
        if got is not None and (got < took or asked == took):
            sizes[domain.name] = got
        elif got is not None:
            sizes[domain.name] = len(load_domain(domain, recipe.seed, asked).eval)
    return {"eval_sizes": sizes, "eval_sizes_at": asked}


def failure_line(run: RecipeConfig, meter: PhaseMeter, log: EventLog, error: Exception) -> str:
    """One line: the phase, what it asked for, the error's first line and, for a memory error, the setting to
    change."""
    phase = meter.failed_in or "other"
    spans = stage_of_spans(meter.spans)
    index = max(0, min(spans[-1][1] if spans else 0, len(run.stages) - 1))
    stage = run.stages[index]
    label = stage_dir_name(run, index)
    chosen = [i["record"].get("micro_batch_size") for _, i in log.of("micro_batch") if i["stage"] == label]
    group = PHASE_GROUPS.get(phase, "other")
    asked, hint = ASKS.get(group, ASKS["other"])(run, stage, Asked(phase, chosen[-1] if chosen else None))
    first = (str(error).strip().splitlines() or [""])[0]
    memory = type(error).__name__ in OUT_OF_MEMORY or "out of memory" in first.lower()
    fix = f"; to fit, try {hint}" if memory and hint else ("" if memory else "; not a memory error")
    return f"rehearsal failed in {group} (stage {stage.name}: {asked}): {type(error).__name__}: {first}{fix}"


@dataclass
class Asked:
    phase: str  # the innermost phase that failed
    rows: int | None  # the stage's micro-batch as the run chose it (micro_batch event), if it said


def _ask_rollout(run: RecipeConfig, stage: StageConfig, asked: Asked) -> tuple[str, str]:
    r = stage.rollout
    n = stage.optim.prompts_per_step * r.group_size
    smaller = f"rollout.max_new_tokens={max(1, r.max_new_tokens // 2)}"
    if r.engine == "hf":
        what = f"{n} sequences of up to {r.max_new_tokens} new tokens, {r.batch_size} a generate call"
        return what, f"rollout.batch_size={max(1, r.batch_size // 2)} or {smaller}"
    share = r.gpu_memory_utilization
    lower = (f"rollout.gpu_memory_utilization={round(share - 0.1, 2)}" if share != "auto" else
             "a rollout.gpu_memory_utilization below auto's share (`recipe plan` prints it)")  # fmt: skip
    return (
        f"{n} sequences of up to {r.max_new_tokens} new tokens on vLLM ({share} of the card)",
        f"{lower} or {smaller}",
    )


def _ask_train(run: RecipeConfig, stage: StageConfig, asked: Asked) -> tuple[str, str]:
    n = stage.optim.prompts_per_step * stage.rollout.group_size
    rows = asked.rows or stage.optim.split_rows(n)
    if rows > 1:
        hint = f"stages.{stage.name}.optim.micro_batch_size={rows // 2}"
    else:
        hint = f"rollout.max_new_tokens={max(1, stage.rollout.max_new_tokens // 2)} or optim.logits_chunk_size=256"
    return f"a training step of {n} sequences, micro-batch {rows}", hint


def _ask_eval(run: RecipeConfig, stage: StageConfig, asked: Asked) -> tuple[str, str]:
    tokens, r = run.eval_max_new_tokens, stage.rollout
    if r.engine == "hf":
        return f"greedy evaluation, {tokens} new tokens, {r.batch_size} a generate call", (
            f"eval.max_new_tokens={max(1, tokens // 2)} or rollout.batch_size={max(1, r.batch_size // 2)}"
        )
    return f"greedy evaluation, {tokens} new tokens", f"eval.max_new_tokens={max(1, tokens // 2)}"


def _ask_diagnostics(run: RecipeConfig, stage: StageConfig, asked: Asked) -> tuple[str, str]:
    off = {"teacher_lift": "eval.teacher_lift_prompts=0", "stage_kl": "eval.stage_kl_prompts=0",
           "response_drift": "eval.drift_probes=0", "parameter_drift": "eval.drift_method=lowrank"}  # fmt: skip
    return f"the {asked.phase.replace('_', ' ')} diagnostic", off.get(asked.phase, "")


ASKS = {  # memory group -> (what the phase asked for, the setting that makes it smaller)
    "load": lambda run, stage, asked: (f"loading {run.model.name} ({run.quantization})", "quantization=nf4"),
    "rollout": _ask_rollout,
    "train": _ask_train,
    "eval": _ask_eval,
    "diagnostics": _ask_diagnostics,
    "save": lambda run, stage, asked: ("writing the stage's adapters and checkpoint", ""),
    "other": lambda run, stage, asked: ("the run outside its measured phases", ""),
}
