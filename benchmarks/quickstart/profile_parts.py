"""Where the quickstart's time goes: per-part seconds from a cProfile dump and the run's own `seconds` records.

Run the quickstart under cProfile with torch on one thread (so CPU time is work, not contention), `<scratch>` an
empty folder, then:

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONPATH=. \\
        python -m cProfile -o <scratch>/qs.prof -m adaptercl.cli recipe run recipes/quickstart.yaml \\
        output_dir=<scratch>/qs_prof
    python benchmarks/quickstart/profile_parts.py <scratch>/qs.prof <scratch>/qs_prof --cpu-seconds 425.0 --out FILE

cProfile's clock is wall time, so on a shared machine its seconds carry the other users' load; `--cpu-seconds` (the
process's user + system time, e.g. from `/usr/bin/time -v`) rescales every part by CPU / profiled wall, which
assumes the load was even over the run. The parts are disjoint: the run's `timed` parts (done.json, drift.json),
the rollout's share of each step (metrics.jsonl `time_rollout_s`) and the training step's forwards and backward
(cProfile cumulative times); `other` is what is left of the profiled whole.
"""

from __future__ import annotations

import argparse
import json
import pstats
from pathlib import Path

# cProfile entries (file suffix, function, caller's file suffix) whose cumulative time is one part of a training step
# (the package's paths since the folder-by-layer move; the committed profile was taken before it, at ac208dd, where
# response_scores lived in adaptercl/chunked_logits.py, the step in train_step.py and the teacher in teacher.py)
STEP_PARTS = {
    "train_student_forward": ("adaptercl/model/batching.py", "response_scores", "adaptercl/train/step.py"),
    "train_teacher_forward": ("adaptercl/teacher/kinds.py", "scores", None),
    "train_backward": ("torch/autograd/__init__.py", "backward", None),
}
# kernels worth naming across every part (tottime; cProfile names a builtin '<built-in method NAME>')
KERNELS = {
    "linear": "method torch._C._nn.linear>",
    "backward": "method 'run_backward' of 'torch._C._EngineBase' objects>",
    "sdpa": "method torch._C._nn.scaled_dot_product_attention>",
    "multinomial (sampling)": "method torch.multinomial>",
    "cat (mostly the KV cache)": "method torch.cat>",
    "svd (parameter drift)": "method torch._C._linalg.linalg_svd>",
}


def cumulative(stats: pstats.Stats, file_suffix: str, name: str, caller_suffix: str | None) -> float:
    """Cumulative seconds of function `name` in a file ending `file_suffix` (only calls from `caller_suffix`)."""
    total = 0.0
    for (file, _line, func), (_cc, _nc, _tt, ct, callers) in stats.stats.items():
        if func != name or not file.endswith(file_suffix):
            continue
        if caller_suffix is None:
            total += ct
        else:
            total += sum(c[3] for (cf, _, _), c in callers.items() if cf.endswith(caller_suffix))
    return total


def builtin_tottime(stats: pstats.Stats, label: str) -> float:
    return sum(tt for (_f, _l, func), (_cc, _nc, tt, _ct, _c) in stats.stats.items() if func.endswith(label))


def parts(prof: Path, run_dir: Path) -> dict:
    stats = pstats.Stats(str(prof))
    whole = stats.total_tt
    out: dict[str, float] = {}
    stage_dirs = sorted(p for p in run_dir.iterdir() if p.is_dir() and (p / "done.json").is_file())
    rollout = 0.0
    for stage_dir in stage_dirs:
        done = json.loads((stage_dir / "done.json").read_text())
        for name, seconds in done.get("seconds", {}).items():
            key = "train" if name == "train" else f"eval_{name}" if name in ("eval", "lm_eval") else name
            out[key] = out.get(key, 0.0) + seconds
        metrics = stage_dir / "metrics.jsonl"
        if metrics.is_file():
            rollout += sum(json.loads(line)["time_rollout_s"] for line in metrics.read_text().splitlines() if line)
    train = out.pop("train", 0.0)
    out["train_rollout_generate"] = rollout
    step_parts = {k: cumulative(stats, *v) for k, v in STEP_PARTS.items()}
    out.update(step_parts)
    out["train_other"] = train - rollout - sum(step_parts.values())
    out["other (imports, model load, saving, report)"] = whole - sum(out.values())
    kernels = {k: builtin_tottime(stats, v) for k, v in KERNELS.items()}
    return {"profiled_seconds": whole, "parts": out, "kernels": kernels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prof", type=Path)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--cpu-seconds", type=float, required=True, help="the process's user + system seconds")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = parts(args.prof, args.run_dir)
    scale = args.cpu_seconds / result["profiled_seconds"]
    result["cpu_seconds"] = args.cpu_seconds
    result["cpu_parts"] = {k: round(v * scale, 1) for k, v in result["parts"].items()}
    result["cpu_kernels"] = {k: round(v * scale, 1) for k, v in result["kernels"].items()}
    result["share"] = {k: round(v / result["profiled_seconds"], 3) for k, v in result["parts"].items()}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"cpu_parts": result["cpu_parts"], "share": result["share"]}, indent=1))


if __name__ == "__main__":
    main()
