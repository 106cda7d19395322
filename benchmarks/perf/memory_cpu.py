"""Peak resident memory (RSS) on CPU of a short stage of each method: grpo, sdpo, sdft, hybrid; and the model alone.

Each measurement runs in a fresh child process (this script with `--child WHAT`), so allocator state and peaks do
not carry over. The parent reads the child's peak RSS from `os.wait4` (its `ru_maxrss`, the kernel's high-water
mark of that process); the child also reports VmRSS / VmHWM from /proc/self/status at phases:
- `loaded`: after `load_base` (the model alone; `baseline` stops here);
- `stage`: after `--steps` steps of `train.stage.run_stage`, set up as `run_recipe` does (student adapter; the
  method's self-teacher from `teacher.kinds.create_teacher`). When the kernel allows it the child resets its
  high-water mark after loading (`/proc/self/clear_refs` = 5), so `stage_peak` is the peak of the stage alone,
  without the load transient.

Rollouts are forced to the full length (`min_new_tokens = max_new_tokens`), the worst case and the same for every
method; rewards are the builtin arithmetic domain's own. Each method's distillation settings are the shipped
recipes' `distill:` / `hybrid:` blocks (recipes/sdpo.yaml, sdft.yaml, hybrid.yaml); SDFT samples one response per
prompt, so it gets P x G prompts (the same number of sequences). The model is unquantised float32 on CPU.

    python benchmarks/perf/memory_cpu.py                          # smollm2-135m-instruct
    python benchmarks/perf/memory_cpu.py --model tiny-random --steps 2

writes benchmarks/perf/results/memory_cpu-<model>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for the shared provenance.py

from perf_common import HERE, add_workload_arguments, write_result  # noqa: E402
from provenance import markdown_table, provenance  # noqa: E402

WHAT = ("baseline", "grpo", "sdpo", "sdft", "hybrid")
RECIPES = {"sdpo": "sdpo.yaml", "sdft": "sdft.yaml", "hybrid": "hybrid.yaml"}  # under recipes/
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ALARMS = ("nonfinite", "divergence_collapse", "target_starvation", "repetition", "entropy_collapse")
RESULT_PREFIX = "MEMORY_RESULT "


def proc_status_mib() -> dict[str, float]:
    """VmRSS (now) and VmHWM (peak) of this process, MiB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024  # kB -> MiB
    return out


def reset_peak() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0); False when the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One measurement in this (fresh) process; returns the phase memory figures."""
    with tempfile.TemporaryDirectory(prefix="adaptercl-memory-") as tmp:
        return child_in(args, Path(tmp))


def child_in(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch
    import yaml

    from adaptercl.adapters.live import attach_adapter, use_adapters
    from adaptercl.adapters.stacking import stage_dir_name
    from adaptercl.domains import load_domain
    from adaptercl.model.base import load_base
    from adaptercl.recipe.grammar import resolve_recipe
    from adaptercl.recipe.method_table import METHODS
    from adaptercl.rollout.hf import HFEngine
    from adaptercl.teacher.kinds import create_teacher
    from adaptercl.train.context import StageContext
    from adaptercl.train.stage import run_stage

    method = args.child if args.child != "baseline" else "grpo"
    P, G = args.prompts_per_step, args.group_size
    prompts, group = (P * G, 1) if method == "sdft" else (P, G)
    blocks: dict[str, Any] = {}
    if method in RECIPES:
        shipped = yaml.safe_load((HERE.parent.parent / "recipes" / RECIPES[method]).read_text())
        blocks = {k: shipped[k] for k in ("distill", "hybrid") if k in shipped}
    recipe = resolve_recipe(
        {
            "model": {"name": args.model},
            "quantization": "none",
            "output_dir": str(work),
            "seed": args.seed,
            "lora": {"r": args.rank, "alpha": 2 * args.rank, "dropout": 0.0, "target_modules": TARGET_MODULES},
            "rollout": {"group_size": group, "max_new_tokens": args.max_new_tokens, "batch_size": prompts * group},
            "optim": {"lr": 1e-5, "steps": args.steps, "prompts_per_step": prompts, "grad_accum": args.grad_accum},
            "monitor": {"checkpoint_every": 10**6, **{alarm: "off" for alarm in ALARMS}},
            **blocks,
            "domains": [{"name": "arithmetic", "source": "builtin:arithmetic"}],
            "stages": [{"name": method, "domain": "arithmetic", "method": method}],
            "eval": {"examples_per_domain": 1},
        }
    )
    phases: dict[str, Any] = {"imports": proc_status_mib()}
    base = load_base(recipe.model, "none", torch.device("cpu"))
    phases["loaded"] = proc_status_mib()
    if args.child == "baseline":
        return {"phases": phases}
    base.model.generation_config.min_new_tokens = args.max_new_tokens  # full-length rollouts (EOS masked)
    domain = load_domain(recipe.domains[0], recipe.seed, recipe.eval.examples_per_domain)
    torch.manual_seed(recipe.seed)
    student = stage_dir_name(recipe, 0)
    model = attach_adapter(base.model, student, recipe.stages[0].lora)
    use_adapters(model, [student], trainable=student)
    stage = recipe.stages[0]
    teacher = create_teacher(model, student, [], stage.distill.teacher) if METHODS[method].needs_teacher else None
    stage_dir = work / student
    stage_dir.mkdir()
    engine = HFEngine(model, base.tokenizer, batch_size=stage.rollout.batch_size)
    ctx = StageContext(recipe, 0, model, base.tokenizer, engine, domain, student, [], stage_dir, teacher=teacher)
    peak_reset = reset_peak()
    t0 = time.perf_counter()
    run_stage(ctx)
    phases["stage"] = proc_status_mib()
    rows = [json.loads(line) for line in (stage_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "phases": phases,
        "stage_peak_reset": peak_reset,  # True: phases.stage.VmHWM is the stage's own peak
        "stage_wall_s": time.perf_counter() - t0,
        "sequences_per_step": prompts * group,
        "response_len_mean": sum(r["response_len_mean"] for r in rows) / len(rows),
        "teacher_target_frac": sum(r.get("teacher_target_frac", 0.0) for r in rows) / len(rows),
        "distill_token_frac": sum(r.get("distill_token_frac", 0.0) for r in rows) / len(rows),
        "settings": stage.model_dump(include={"distill", "hybrid"}, mode="json") if teacher is not None else None,
    }


def measure(args: argparse.Namespace, what: str) -> dict[str, Any]:
    """Run one child; its peak RSS from wait4 plus what it reported."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", what]
    for key in ("model", "prompts_per_step", "group_size", "max_new_tokens", "rank", "grad_accum", "steps", "seed"):
        argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    stdout = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child {what!r} failed (exit {proc.returncode}); its stderr is above")
    report = json.loads(lines[-1].removeprefix(RESULT_PREFIX))
    return {"peak_rss_mib": usage.ru_maxrss / 1024, **report}  # ru_maxrss is in KiB on Linux


def markdown(result: dict[str, Any]) -> str:
    w, rows = result["workload"], []
    base = result["runs"]["baseline"]["peak_rss_mib"]
    for what, r in result["runs"].items():
        stage = r["phases"].get("stage", {})
        rows.append(
            [
                what,
                round(r["peak_rss_mib"]),
                round(r["phases"]["imports"]["VmRSS"]),
                round(r["phases"]["loaded"]["VmRSS"]),
                round(stage["VmHWM"]) if stage and r.get("stage_peak_reset") else "-",
                round(r["peak_rss_mib"] - base),
                r.get("distill_token_frac", "-"),
            ]
        )
    headers = [
        "run",
        "peak RSS MiB",
        "after imports MiB",
        "after load MiB",
        "stage-only peak MiB",
        "peak - baseline MiB",
    ]
    headers.append("distilled")
    return (
        f"### Peak RSS on CPU, {result['model']}: {w['prompts_per_step']} prompts x {w['group_size']} samples x "
        f"{w['max_new_tokens']} tokens, LoRA r{w['rank']}, grad_accum {w['grad_accum']}, {w['steps']} steps, fp32\n\n"
        + markdown_table(headers, rows)
        + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser, model="smollm2-135m-instruct", max_new_tokens=64)
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (the memory knob)")
    parser.add_argument("--steps", type=int, default=3, help="stage steps per method")
    parser.add_argument("--runs", nargs="+", default=list(WHAT), choices=WHAT, help="what to measure")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/perf/results)")
    parser.add_argument("--child", choices=WHAT, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(RESULT_PREFIX + json.dumps(child(args)), flush=True)
        return
    if "baseline" not in args.runs:
        args.runs.insert(0, "baseline")
    keys = ("prompts_per_step", "group_size", "max_new_tokens", "rank", "grad_accum", "steps")
    result = {
        **provenance(),
        "model": args.model,
        "workload": {k: getattr(args, k) for k in keys},
        "runs": {what: measure(args, what) for what in args.runs},
    }
    name = "memory_cpu-" + Path(args.model).name
    path = write_result(name, result, args.out)
    print(markdown(result))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
