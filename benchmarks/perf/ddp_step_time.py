"""Data-parallel step time on this machine: one process vs `torchrun --nproc-per-node 2` (gloo, CPU), same recipe and
global batch, and the largest difference between the adapters they end with.

Runs of the same one-stage GRPO recipe (prompts_per_step 4 x group 2, rollout.batch_size 4 = one rank's rows, so
both arrangements sample the same rows): 1 process with 1 thread and 2 processes with 1 thread each
(`OMP_NUM_THREADS`; `--two-threads` adds 1 process with 2 threads, which oversubscribes a loaded 2-core machine).
Timed: `time_step_s` of metrics.jsonl (rollout, reward, loss, backward, the gradient all-reduce, step); the first
`--warmup` steps are left out. Results: results/ddp_step_time-<model>.json.

    python benchmarks/perf/ddp_step_time.py --model smollm2-135m-instruct --steps 4 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from provenance import provenance, spread  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def digit_reward(text: str, example):
    """A dense reward (the fraction of digit characters), so groups differ and the adapters move."""
    from adaptercl.domains import RewardResult

    frac = sum(c.isdigit() for c in text) / max(1, len(text))
    return RewardResult(score=frac, correct=frac > 0.2)


def recipe(model: str, out: Path, steps: int) -> dict:
    return {
        "model": {"name": model},
        "output_dir": str(out),
        "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "layers": [-4, -3, -2, -1]},
        "optim": {"lr": 1e-4, "steps": steps, "prompts_per_step": 4},
        "rollout": {"group_size": 2, "max_new_tokens": 16, "batch_size": 4},
        "eval": {"examples_per_domain": 2, "max_new_tokens": 8, "parameter_drift": False, "drift_probes": 0},
        "domains": [{"name": "arith", "source": "builtin:arithmetic", "reward": "ddp_step_time:digit_reward"}],
        "stages": [{"name": "one", "domain": "arith"}],
    }


def run(name: str, processes: int, threads: int, args: argparse.Namespace, tmp: Path) -> dict:
    out = tmp / name
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe(args.model, out, args.steps)))
    cli = ["-m", "adaptercl.cli", "recipe", "run", str(path)]
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
    cmd = [sys.executable, *(launcher if processes > 1 else []), *cli]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": f"{REPO}{os.pathsep}{HERE}",
    }
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    lines = [json.loads(x) for x in (out / "stage-01-one" / "metrics.jsonl").read_text().splitlines()]
    times = [r["time_step_s"] for r in lines[args.warmup :]]
    return {"processes": processes, "threads_per_process": threads, "time_step_s": spread(times), "out": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--two-threads", action="store_true", help="also 1 process with 2 threads")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {
            name: run(name, p, t, args, Path(tmp))
            for name, p, t in (("1proc_1thread", 1, 1), ("1proc_2threads", 1, 2), ("2proc_1thread", 2, 1))
            if args.two_threads or name != "1proc_2threads"
        }
        adapters = {
            k: load_file(str(r.pop("out") / "stage-01-one/adapter/adapter_model.safetensors")) for k, r in runs.items()
        }
    a, b = adapters["1proc_1thread"], adapters["2proc_1thread"]
    result = {
        "benchmark": "ddp_step_time",
        "model": args.model,
        "recipe": recipe(args.model, Path("OUT"), args.steps),
        "warmup_steps_left_out": args.warmup,
        "runs": runs,
        "largest_adapter_abs_diff_1proc_vs_2proc": max((a[k] - b[k]).abs().max().item() for k in a),
        "largest_lora_B_abs_value": max(v.abs().max().item() for k, v in a.items() if "lora_B" in k),
        **provenance(),
    }
    path = Path(__file__).resolve().parent / "results" / f"ddp_step_time-{args.model}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    keys = ("runs", "largest_adapter_abs_diff_1proc_vs_2proc", "largest_lora_B_abs_value")
    print(json.dumps({k: result[k] for k in keys}, indent=2))


if __name__ == "__main__":
    main()
