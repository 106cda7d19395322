"""A new user's journey, end to end on SmolLM2-135M-Instruct (issue 19): their own multiple-choice dataset through a
prompt template, a tracked run (TensorBoard + trackio) with rollout samples in its report, an eval-only call, the run
grown by a stage whose domain is scored by TRL's own reward functions, and the shipped adapters evaluated alone.
Every step is the real CLI (`python -m adaptercl.cli`), output to a log file (not a terminal, so the plain progress
lines), and every claim below is read back from what the commands wrote.

    HF_HUB_OFFLINE=1 python benchmarks/user_journey/run.py            # from the repository root; needs ../shared/data

Writes runs/user_journey* (the run, its eval-only output, the export) and benchmarks/user_journey/results.{json,md}.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/, for the shared provenance.py

from provenance import markdown_table, provenance  # noqa: E402

from adaptercl.measure.stats import wilson_interval  # noqa: E402

RUN = Path("runs/user_journey")
EVAL_OUT, EXPORT, ADAPTER_EVAL = (
    Path("runs/user_journey-eval"),
    Path("runs/user_journey-shipped"),
    Path("runs/user_journey-adapter-eval"),
)
DATA = ROOT.parent / "shared" / "data"


def cli(*args: str, log: str) -> dict:
    """Run one CLI command with stdout/stderr to a log file; its wall time, exit code and the log's last lines."""
    t0 = time.perf_counter()
    with open(RUN.parent / f"user_journey-{log}.log", "w") as out:
        code = subprocess.call([sys.executable, "-m", "adaptercl.cli", *args], stdout=out, stderr=subprocess.STDOUT)
    lines = (RUN.parent / f"user_journey-{log}.log").read_text().splitlines()
    if code != 0:
        raise SystemExit(f"`adaptercl {' '.join(args)}` exited {code}:\n" + "\n".join(lines[-20:]))
    return {"command": "adaptercl " + " ".join(args), "seconds": round(time.perf_counter() - t0, 1), "log": lines}


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def main() -> None:
    if not DATA.is_dir():
        raise SystemExit(f"needs the local datasets in {DATA}")
    os.chdir(ROOT)
    for path in (RUN, EVAL_OUT, EXPORT, ADAPTER_EVAL):
        shutil.rmtree(path, ignore_errors=True)
    RUN.parent.mkdir(exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["TRACKIO_DIR"] = str((RUN.parent / "user_journey-trackio").resolve())
    shutil.rmtree(os.environ["TRACKIO_DIR"], ignore_errors=True)
    out: dict = {"provenance": provenance(), "steps": {}}

    # 1. stage 1: ARC-Challenge as it is (question, choices {text, label}, answerKey) through prompt_template; tracked
    out["steps"]["stage1"] = step1 = cli("recipe", "run", str(HERE / "stage1.yaml"), log="stage1")
    stage1 = RUN / "stage-01-arc"
    samples = [json.loads(line) for line in (stage1 / "samples.jsonl").read_text().splitlines()]
    step1["samples_jsonl_rows"] = len(samples)
    step1["sample_fields"] = sorted(samples[0])
    step1["report_shows_samples"] = "Rollout samples" in (RUN / "report.md").read_text()
    step1["plain_progress_lines"] = [line for line in step1.pop("log") if line.startswith("[stage-01-arc] step")]
    step1["first_prompt"] = samples[0]["prompt"][-400:]
    step1["eval"] = {k: {"accuracy": v["accuracy"], "n": v["n"]} for k, v in read_json(stage1 / "eval.json").items()}
    adapter_sha = (stage1 / "adapter" / "adapter_model.safetensors").read_bytes()

    # 2. eval only: the finished run's models again, without training
    out["steps"]["eval_only"] = step2 = cli("eval", "--run", str(RUN), "--out", str(EVAL_OUT), log="eval")
    step2.pop("log")
    again = read_json(EVAL_OUT / "stage-01-arc" / "eval.json")
    step2["equals_the_runs_eval_json"] = again == read_json(stage1 / "eval.json")

    # 3. grow the run by a MATH-500 stage scored by trl.rewards.accuracy_reward (+ the soft overlong punishment)
    out["steps"]["grow"] = step3 = cli("recipe", "run", str(HERE / "stage2.yaml"), log="stage2")
    step3.pop("log")
    step3["stage1_adapter_unchanged"] = (stage1 / "adapter" / "adapter_model.safetensors").read_bytes() == adapter_sha
    summary = read_json(RUN / "summary.json")
    step3["summary"] = {"domains": summary["domains"], "stages": summary["stages"], "accuracy": summary["accuracy"]}
    metrics = [json.loads(line) for line in (RUN / "stage-02-math" / "metrics.jsonl").read_text().splitlines()]
    step3["math_reward_mean_per_step"] = [round(m["reward_mean"], 4) for m in metrics if "event" not in m]

    # 4. ship the per-domain adapters and evaluate each alone on the grown recipe's domains (math: the last stage's
    # adapter, which under `init: continue` is the whole model)
    out["steps"]["export"] = cli("export", str(RUN), "--out", str(EXPORT), log="export")
    out["steps"]["export"].pop("log")
    adapters = [arg for domain in ("arc", "math") for arg in ("--adapter", str(EXPORT / domain))]
    eval_args = ["eval", str(HERE / "stage2.yaml"), *adapters, "--out", str(ADAPTER_EVAL)]
    out["steps"]["eval_adapter"] = step4 = cli(*eval_args, log="eval-adapter")
    step4.pop("log")
    rows = read_json(ADAPTER_EVAL / "summary.json")
    step4["summary"] = rows

    # 5. the trackers read back
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from trackio import sqlite_storage

    events = EventAccumulator(str(RUN / "tensorboard" / RUN.name), size_guidance={"scalars": 0})
    events.Reload()
    rewards = [(e.step, round(e.value, 4)) for e in events.Scalars("stage-02-math/reward_mean")]
    out["tensorboard"] = {"tags": len(events.Tags()["scalars"]), "stage-02-math/reward_mean": rewards}
    out["tensorboard"]["equals_metrics_jsonl"] = [r for _, r in rewards] == step3["math_reward_mean_per_step"]
    sqlite_storage.TRACKIO_DIR = Path(os.environ["TRACKIO_DIR"])
    logs = sqlite_storage.SQLiteStorage.get_logs("adaptercl-user-journey", RUN.name)
    out["trackio"] = {"logs": len(logs), "eval/arc": [log["eval/arc"] for log in logs if "eval/arc" in log]}

    # no path of this machine in the results: paths under the repository as a reader runs them, from its root
    scrubbed = json.loads(json.dumps(out).replace(f"{ROOT}/", ""))
    (HERE / "results.json").write_text(json.dumps(scrubbed, indent=1) + "\n")
    (HERE / "results.md").write_text(markdown(scrubbed))
    print(markdown(out))


def cell(accuracy: float, n: int) -> str:
    """An accuracy with its n and 95 % Wilson interval."""
    lo, hi = wilson_interval(round(accuracy * n), n)
    return f"{accuracy:.3f} [{lo:.2f}, {hi:.2f}] (n {n})"


def accuracy_table(first: str, rows: list[str], domains: list[str], accuracy: list[list[float]], n: int) -> str:
    """One row per model (a stage, an adapter), one column per domain, each cell with n and its interval."""
    return markdown_table([first, *domains], [[name, *(cell(a, n) for a in row)] for name, row in zip(rows, accuracy)])


def markdown(out: dict) -> str:
    """results.md from results.json: what each step ran, how long it took, and what was read back."""
    steps, version = out["steps"], out["provenance"]["versions"]
    n = steps["stage1"]["eval"]["arc"]["n"]
    summary, shipped = steps["grow"]["summary"], steps["eval_adapter"]["summary"]
    lines = [
        "# A new user's journey on SmolLM2-135M-Instruct: results",
        "",
        f"Generated by `benchmarks/user_journey/run.py` at adaptercl {version['adaptercl_git']} (torch "
        f"{version['torch']}, transformers {version['transformers']}, trl {version['trl']}) on a "
        f"{out['provenance']['machine']['cpu_count']}-core CPU, no GPU. Accuracies: greedy, with n and the 95 % "
        "Wilson interval over the examples; 3 optimiser steps per stage, so these show the plumbing, not learning.",
        "",
        "| step | command | wall time | read back |",
        "| --- | --- | ---: | --- |",
        f"| templated dataset, tracked | `{steps['stage1']['command']}` | {steps['stage1']['seconds']:.0f} s | "
        f"samples.jsonl {steps['stage1']['samples_jsonl_rows']} rows; report.md shows samples: "
        f"{steps['stage1']['report_shows_samples']} |",
        f"| eval only | `{steps['eval_only']['command']}` | {steps['eval_only']['seconds']:.0f} s | rows equal the "
        f"run's eval.json: {steps['eval_only']['equals_the_runs_eval_json']} |",
        f"| grown by a TRL-rewards stage | `{steps['grow']['command']}` | {steps['grow']['seconds']:.0f} s | stage 1 "
        f"adapter unchanged: {steps['grow']['stage1_adapter_unchanged']}; math reward per step "
        f"{steps['grow']['math_reward_mean_per_step']} |",
        f"| export | `{steps['export']['command']}` | {steps['export']['seconds']:.0f} s | |",
        f"| shipped adapters evaluated alone | `{steps['eval_adapter']['command']}` | "
        f"{steps['eval_adapter']['seconds']:.0f} s | |",
        "",
        "The first rendered prompt (ARC-Challenge row through `prompt_template`, choices `{text, label}`):",
        "",
        *["    " + line for line in steps["stage1"]["first_prompt"].splitlines()],
        "",
        "Plain progress lines (output to a log file):",
        "",
        *["    " + line for line in steps["stage1"]["plain_progress_lines"]],
        "",
        "Accuracy matrix of the grown run (rows: after each stage; `summary.json`):",
        "",
        accuracy_table("after", summary["stages"], summary["domains"], summary["accuracy"], n),
        "",
        "Shipped adapters evaluated alone (`adaptercl eval --adapter`):",
        "",
        accuracy_table("adapter", shipped["models"], shipped["domains"], shipped["accuracy"], n),
        "",
        f"TensorBoard: {out['tensorboard']['tags']} scalar tags; `stage-02-math/reward_mean` at global steps "
        f"{[s for s, _ in out['tensorboard']['stage-02-math/reward_mean']]} equals metrics.jsonl: "
        f"{out['tensorboard']['equals_metrics_jsonl']}. trackio (local store): {out['trackio']['logs']} log rows of "
        f"the grown invocation, `eval/arc` {out['trackio']['eval/arc']}.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:] == ["--collect-only"]:  # rebuild results.md from results.json
        (HERE / "results.md").write_text(markdown(json.loads((HERE / "results.json").read_text())))
    else:
        main()
