"""Issue 46's figures on this CPU in one command: step-time ratios against TRL, the quickstart from a fresh clone.

    HF_HUB_OFFLINE=1 python benchmarks/perf/cpu_figures.py                  # everything not yet measured
    HF_HUB_OFFLINE=1 python benchmarks/perf/cpu_figures.py --only quickstart --redo

Runs, one after another and each as its own process (nothing else should compute meanwhile: stop a science sweep with
`kill -STOP -<its process group>` first): `thread_penalty.py`; `cpu_paths.py` (every part: MKL's branch, the decode
variants, the training products, the packs' measured choice, the bf16 mismatch); `step_time.py` for GRPO on the
short, long-fixed and long workloads and SDPO on the short and long-fixed ones (`--steps 3 --warmup 1`); and the
quickstart, `adaptercl recipe run recipes/quickstart.yaml`, in a fresh clone of this repository's HEAD with an empty
model cache (the GGUF conversion and the CPU-kernel probes included), timed, its peak RSS taken. Each writes its JSON
into `benchmarks/perf/results/<name>/`, `<name>` by default the CPU's (`cpu_name`: model name, family and model
number, e.g. `amd-epyc-f26-m2`, which tells a Zen 5 from a Zen 4 "AMD EPYC"). A step whose JSON is there already is
skipped (`--redo` reruns it), so an interrupted session resumes where it stopped. Every step records the revision
read before the first (the results written meanwhile do not make it `+dirty`). Last,
`summary.md` there: every step ratio against issue 46's bar (<= 0.5x TRL's step), the quickstart's wall time against
180 s and its learning (arithmetic >= +0.2 and mcq > 0, n 30 each), and whether its summary.json equals the committed
one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for the shared provenance.py

from perf_common import RESULTS_DIR, name_part, write_result  # noqa: E402
from provenance import git_revision, markdown_table, provenance  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MODEL = "smollm2-135m-instruct"
STEP_TIME_RUNS = (  # (method, workload)
    ("grpo", "short"), ("grpo", "long-fixed"), ("grpo", "long"), ("sdpo", "short"), ("sdpo", "long-fixed"),
)  # fmt: skip
STEP_BAR = 0.5  # issue 46: adaptercl's step <= 0.5x TRL's
QUICKSTART_BAR_S = 180.0  # issue 46: the quickstart from a fresh clone within 3 minutes ...
LEARNS = {"arithmetic": 0.2, "mcq": 0.0}  # ... and still learning: gain >= 0.2 on arithmetic, > 0 on mcq
QUICKSTART = "quickstart"  # the quickstart's result name

# The peak RSS of one child, read by a process that runs only that child (its parent's RUSAGE_CHILDREN would also
# hold every earlier benchmark's): prints the maximum in kB (Linux) to stderr's last line.
PEAK_RSS = (
    "import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
    "print(f'peak_rss_kb {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}', file=sys.stderr); sys.exit(rc)"
)


class Step(NamedTuple):
    """One measurement: the JSON it writes (`name`.json in the results folder) and the command that writes it."""

    name: str
    argv: list[str]


def cpu_name(cpuinfo: str) -> str:
    """A folder name for this CPU: its model name, family and model number, lower-case, dashes between."""
    from adaptercl.system.cpu_kernels import cpu_fields

    cpu = cpu_fields(cpuinfo)
    parts = [cpu["model"] or "unknown-cpu"]
    parts += [f"f{cpu['family']}"] * bool(cpu["family"]) + [f"m{cpu['model_number']}"] * bool(cpu["model_number"])
    return name_part(" ".join(parts))


def steps(out: Path, cpu_model: str) -> list[Step]:
    """The benchmark commands, in order, each writing into `out` (the quickstart is run by `run_quickstart`). Paths
    inside the repository are relative to its root (the steps run there): a result's `command` has no machine path."""
    from cpu_paths import result_name as cpu_paths_name

    python = [sys.executable]
    out_args = ["--out", repo_relative(out)]
    plan = [
        Step("thread_penalty", [*python, repo_relative(HERE / "thread_penalty.py"), *out_args]),
        Step(cpu_paths_name(cpu_model), [*python, repo_relative(HERE / "cpu_paths.py"), *out_args]),
    ]
    for method, workload in STEP_TIME_RUNS:
        argv = ["--method", method, "--model", MODEL, "--workload", workload, "--steps", "3", "--warmup", "1"]
        plan.append(
            Step(step_time_name(method, workload), [*python, repo_relative(HERE / "step_time.py"), *argv, *out_args])
        )
    return plan


def repo_relative(path: Path) -> str:
    """`path` relative to the repository's root when it is inside it, else as given."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def step_time_name(method: str, workload: str) -> str:
    """step_time.py's result name for `method` on `workload` (float32 rollouts on both sides)."""
    from step_time import result_name

    return result_name(argparse.Namespace(method=method, model=MODEL, workload=workload, rollout_dtype="float32"))


def run_steps(plan: list[Step], out: Path, redo: bool, run: Callable[[list[str]], int]) -> list[str]:
    """Run each step whose JSON is not in `out` (all with `redo`); the names of the steps that failed."""
    failed = []
    for step in plan:
        if (out / f"{step.name}.json").is_file() and not redo:
            print(f"{step.name}: measured earlier ({step.name}.json)", flush=True)
            continue
        print(f"{step.name}: running", flush=True)
        if run(step.argv) != 0:
            failed.append(step.name)
    return failed


def run_command(argv: list[str], revision: str) -> int:
    """A benchmark as its own process, offline, from the repo root, recording `revision` as the code it measured."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ADAPTERCL_GIT_REVISION": revision}
    return subprocess.run(argv, cwd=REPO, env=env).returncode


def run_quickstart(out: Path, revision: str) -> dict[str, Any]:
    """The quickstart in a fresh clone of HEAD (`revision`: the tree's, as the other steps record it) with an empty
    model cache (both in a temporary folder): its wall time, peak RSS, exit code, accuracy matrix, learning and whether
    its summary.json is the committed one; written to `out`/quickstart.json."""
    print(f"cloning git HEAD {revision} (uncommitted changes are not cloned)", flush=True)
    with tempfile.TemporaryDirectory(prefix="adaptercl-quickstart-") as tmp:
        clone = Path(tmp) / "clone"
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        cloned = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True).stdout
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "ADAPTERCL_CACHE": str(Path(tmp) / "cache")}
        cmd = ["adaptercl", "recipe", "run", "recipes/quickstart.yaml", "output_dir=runs/quickstart"]
        # `python -m` from the clone's root imports the clone's adaptercl, not an installed one
        argv = [sys.executable, "-c", PEAK_RSS, sys.executable, "-m", "adaptercl.cli", *cmd[1:]]
        t0 = time.perf_counter()
        done = subprocess.run(argv, cwd=clone, env=env, stderr=subprocess.PIPE, text=True)
        wall_s = time.perf_counter() - t0
        sys.stderr.write(done.stderr)
        peak = re.findall(r"^peak_rss_kb (\d+)$", done.stderr, flags=re.MULTILINE)
        summary_path = clone / "runs" / "quickstart" / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
        committed = json.loads((clone / "benchmarks" / "quickstart" / "summary.json").read_text())
        choices = clone / "runs" / "quickstart" / "cpu_paths.jsonl"
        cpu_paths = json.loads(choices.read_text().splitlines()[-1]) if choices.is_file() else None
    result = {
        **provenance(),
        "command": "git clone . <tmp>/clone && cd <tmp>/clone && ADAPTERCL_CACHE=<tmp>/cache HF_HUB_OFFLINE=1 "
        + " ".join(cmd),
        "cloned_revision": cloned.strip(),
        "exit": done.returncode,
        "wall_s": round(wall_s, 1),
        "peak_rss_gib": round(int(peak[-1]) / 2**20, 2) if peak else None,
        "accuracy": None if summary is None else summary["accuracy"],
        "gains": None if summary is None else gains(summary),
        "equal_to_committed": summary == committed,
        "cpu_paths": cpu_paths,
    }
    result["versions"]["adaptercl_git"] = result["cloned_revision"]  # the code it ran: the clone, never dirty
    write_result(QUICKSTART, result, out)
    return result


def gains(summary: dict[str, Any]) -> dict[str, float]:
    """Each domain's accuracy after its own stage minus before any (the quickstart trains its domains in order)."""
    accuracy = summary["accuracy"]  # [stage 0 (before) .. T][domain]
    return {domain: accuracy[i + 1][i] - accuracy[0][i] for i, domain in enumerate(summary["domains"])}


def learns(gain: dict[str, float]) -> bool:
    """Issue 46's learning bar: arithmetic's gain >= 0.2, mcq's > 0."""
    return gain["arithmetic"] >= LEARNS["arithmetic"] and gain["mcq"] > LEARNS["mcq"]


def summary_md(out: Path) -> str:
    """summary.md of a results folder: the step ratios and the quickstart against issue 46's bars."""
    rows = []
    machine = None
    for method, workload in STEP_TIME_RUNS:
        path = out / f"{step_time_name(method, workload)}.json"
        if not path.is_file():
            rows.append([method.upper(), workload, "not measured", "", "", "", "", ""])
            continue
        r = json.loads(path.read_text())
        machine = machine or r["machine"]
        ratio = r["ratio_of_medians"]
        rows.append([
            method.upper(), workload, r["versions"]["adaptercl_git"][:7],
            f"{r['adaptercl_step_s']['median']:.2f}", f"{r['trl_step_s']['median']:.2f}",
            f"**{ratio:.3f}**", f"{r['rollout_per_token_ratio']:.3f}", "met" if ratio <= STEP_BAR else "**not met**",
        ])  # fmt: skip
    headers = ["method", "workload", "revision", "adaptercl s", "TRL s", "ratio of medians", "rollout per token"]
    headers.append(f"<= {STEP_BAR}x")
    lines = [f"# Issue 46's figures on this CPU (`{out.name}`)", ""]
    quickstart = out / f"{QUICKSTART}.json"
    q = json.loads(quickstart.read_text()) if quickstart.is_file() else None
    machine = machine or (q or {}).get("machine")
    if machine:
        flags = ", ".join(machine.get("cpu_flags", []))
        lines += [
            f"{machine['cpu']} (family {machine.get('cpu_family', '?')} model {machine.get('cpu_model_number', '?')};"
            f" {flags}), {machine['cpus_usable']} usable cores, torch's {machine['torch_threads']} threads.",
            "",
        ]
    lines += ["`step_time.py --steps 3 --warmup 1`, step wall time, medians:", "", markdown_table(headers, rows), ""]
    if q is None:
        lines.append("The quickstart: not measured.")
    else:
        g = q["gains"] or {}
        learned = bool(g) and learns(g)
        lines.append(
            f"The quickstart from a fresh clone of {q['cloned_revision'][:7]} with an empty model cache: exit "
            f"{q['exit']}, **{q['wall_s']:.1f} s** ({'met' if q['wall_s'] <= QUICKSTART_BAR_S else '**not met**'}: "
            f"<= {QUICKSTART_BAR_S:.0f} s), peak RSS {q['peak_rss_gib'] or '?'} GiB; gains "
            + ", ".join(f"{d} {v:+.3f}" for d, v in g.items())
            + f" ({'learns' if learned else '**does not learn**'}: arithmetic >= +0.2, mcq > 0); summary.json "
            + ("equal to" if q["equal_to_committed"] else "differs from")
            + " the committed benchmarks/quickstart/summary.json."
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default=None, help="results folder under benchmarks/perf/results (default: the CPU)")
    parser.add_argument("--only", nargs="+", default=None, help="these steps only (result names, or 'quickstart')")
    parser.add_argument("--redo", action="store_true", help="rerun steps whose JSON is there already")
    args = parser.parse_args(argv)
    from adaptercl.system.cpu_kernels import CPUINFO, cpu_fields

    cpuinfo = CPUINFO.read_text() if CPUINFO.is_file() else ""
    out = RESULTS_DIR / (args.name or cpu_name(cpuinfo))
    out.mkdir(parents=True, exist_ok=True)
    plan = [s for s in steps(out, cpu_fields(cpuinfo)["model"]) if args.only is None or s.name in args.only]
    # read once before the first step: the JSONs the steps write into `out` are not code and must not make the
    # later steps' revision `+dirty`
    revision = git_revision(exclude=out)
    failed = run_steps(plan, out, args.redo, lambda argv: run_command(argv, revision))
    if args.only is None or QUICKSTART in args.only:  # the same skipping; its "command" is run_quickstart
        failed += run_steps([Step(QUICKSTART, [])], out, args.redo, lambda _: run_quickstart(out, revision)["exit"])
    summary = summary_md(out)
    (out / "summary.md").write_text(summary)
    print(summary)
    if failed:
        print(f"failed: {', '.join(failed)} (their output above); rerun this command to retry them", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
