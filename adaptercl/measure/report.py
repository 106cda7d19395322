"""The run report: `report.md` plus PNG plots, built only from the files in a run directory.

    adaptercl report RUN_DIR

Sections: the accuracy matrix, the CL metrics, the stage-start teacher lift (where measured), each stage's KL from
the previous policy next to the forgetting it caused (where measured), the formatting artifacts of each stage's eval
responses against the base's (`artifacts.py`; where eval.json keeps the completions), lm-eval's metrics per stage
(where `eval.lm_eval.tasks` is set), each stage's last step, and a few rollout samples of each stage's first and last
step (samples.jsonl). Plots: the accuracy-matrix heatmap, per-domain accuracy across stages, reward and teacher-student
divergence curves per step, and parameter drift per stage (when `drift.json` files exist). The run writes the report
automatically at its end; it can be rebuilt at any time from a finished or partial run.
"""

from __future__ import annotations

from pathlib import Path

from adaptercl.measure.artifacts import stage_artifacts
from adaptercl.measure.metrics import CL_METRIC_DEFINITIONS, cl_metrics, stage_forgetting
from adaptercl.recipe import RecipeError
from adaptercl.run_dir import PLOTS_DIR, REPORT_FILE, SUMMARY_FILE, StageDir, markdown_table, read_summary
from adaptercl.system import read_jsonl, write_text

PLOTS = ("accuracy_matrix.png", "accuracy_by_stage.png", "training_curves.png", "drift.png")
SAMPLES_SHOWN = 3  # rollout samples shown per stage for its first and its last step
NGRAMS_SHOWN = 3  # formatting artifacts: the stage's most frequent n-grams shown per stage


def load_run(run_dir: str | Path) -> dict:
    """Everything the report needs from a run directory."""
    run_dir = Path(run_dir)
    summary_path = run_dir / SUMMARY_FILE
    if not summary_path.is_file():
        raise RecipeError(f"{run_dir} has no {SUMMARY_FILE}: is it a finished adaptercl run directory?")
    summary = read_summary(summary_path)
    stages = []
    for name in summary["stages"][1:]:
        stage_dir = StageDir(run_dir / name)
        rows = read_jsonl(stage_dir.metrics)
        stages.append(
            {
                "name": name,
                "metrics": [m for m in rows if "step" in m and "event" not in m],
                "events": [m for m in rows if "event" in m],
                "drift": stage_dir.read_drift(),
                "teacher_lift": stage_dir.read_teacher_lift(),
                "samples": read_jsonl(stage_dir.samples),
            }
        )
    lm_eval = [StageDir(run_dir / name).read_lm_eval() for name in summary["stages"]]  # before + every stage
    evals = [StageDir(run_dir / name) for name in summary["stages"]]
    evals = [s.read_eval() if s.eval.is_file() else {} for s in evals]  # before + every stage
    return {"summary": summary, "stages": stages, "lm_eval": lm_eval, "evals": evals}


def write_report(run_dir: str | Path) -> Path:
    """Write report.md and the plots into `run_dir`; return the report path."""
    import matplotlib

    matplotlib.use("Agg")
    run_dir = Path(run_dir)
    run = load_run(run_dir)
    plots = run_dir / PLOTS_DIR
    plots.mkdir(exist_ok=True)
    _plot_accuracy_matrix(run, plots / PLOTS[0])
    _plot_accuracy_by_stage(run, plots / PLOTS[1])
    _plot_training_curves(run, plots / PLOTS[2])
    has_drift = any(s["drift"] and "parameter" in s["drift"] for s in run["stages"])
    if has_drift:
        _plot_drift(run, plots / PLOTS[3])
    report = run_dir / REPORT_FILE
    write_text(report, _markdown(run, has_drift))
    return report


def _markdown(run: dict, has_drift: bool) -> str:
    summary = run["summary"]
    domains, labels = summary["domains"], summary["stages"]
    lines = ["# adaptercl run report", "", "## Accuracy matrix (rows: after stage; columns: domain)", ""]
    lines.append("| after | " + " | ".join(domains) + " |")
    lines.append("| --- |" + " ---: |" * len(domains))
    for label, row in zip(labels, summary["accuracy"]):
        lines.append(f"| {label} | " + " | ".join(f"{a:.3f}" for a in row) + " |")
    if summary.get("cl_metrics"):
        # recomputed from the matrix, so a run written under older definitions reports today's stated ones
        cl = cl_metrics(summary["accuracy"], summary["cl_metrics"]["trained_columns"])
        lines += ["", "## Continual-learning metrics", ""]
        lines.append("a[k, c] = accuracy on domain c after stage k (row 0: before training), T stages, c_k the")
        lines.append("domain stage k trains. n/a where a metric has no terms (e.g. bwt, fwt, forgetting at T = 1).")
        lines.append("")
        for key, definition in CL_METRIC_DEFINITIONS.items():
            value = cl[key]
            lines.append(f"- {key}: {'n/a' if value is None else f'{value:.4f}'} — {definition}")
    lines += _teacher_lift_section(run["stages"])
    lines += _stage_kl_section(run)
    lines += _artifacts_section(run)
    lines += _lm_eval_section(run)
    lines += ["", "## Stages", ""]
    for stage in run["stages"]:
        last = stage["metrics"][-1] if stage["metrics"] else {}
        info = ", ".join(f"{k} {last[k]:.3f}" for k in ("reward_mean", "correct_frac", "loss") if k in last)
        lines.append(f"- {stage['name']}: {len(stage['metrics'])} steps; last step: {info or 'no steps'}")
        for event in stage["events"]:
            lines.append(f"  - step {event.get('step')}: {event['event']} ({event.get('message', '')})")
    lines += _samples_section(run["stages"])
    lines += ["", "## Plots", "", f"![accuracy matrix](plots/{PLOTS[0]})", f"![accuracy by stage](plots/{PLOTS[1]})"]
    lines.append(f"![training curves](plots/{PLOTS[2]})")
    if has_drift:
        lines.append(f"![parameter drift](plots/{PLOTS[3]})")
    return "\n".join(lines) + "\n"


def _lm_eval_section(run: dict) -> list[str]:
    """lm-eval's metrics (value ± stderr) per stage, where eval.lm_eval.tasks was set (lm_eval.json)."""
    results = run["lm_eval"]
    first = next((r for r in results if r), None)
    if first is None:
        return []
    columns = [
        (task, metric)
        for task, metrics in first["tasks"].items()
        for metric, value in metrics.items()
        if metric != "n" and "_stderr" not in metric and isinstance(value, (int, float))
    ]
    lines = ["", "## lm-eval probes", ""]
    lines.append(
        f"lm-evaluation-harness {first['lm_eval_version']} on the model after each stage (log-likelihood metrics, "
        f"comparable with published lm-eval numbers); ± its standard error; limit {first['limit'] or 'none'}."
    )
    lines += ["", "| after | " + " | ".join(f"{t} {m}" for t, m in columns) + " |"]
    lines.append("| --- |" + " ---: |" * len(columns))
    for label, result in zip(run["summary"]["stages"], results):
        cells = []
        for task, metric in columns:
            metrics = result["tasks"].get(task, {}) if result else {}
            name, _, where = metric.partition(",")  # lm-eval's stderr of "m,filter" is "m_stderr,filter"
            value, stderr = metrics.get(metric), metrics.get(f"{name}_stderr" + (f",{where}" if where else ""))
            shown = "n/a" if value is None else f"{value:.3f}"
            cells.append(shown + (f" ± {stderr:.3f}" if isinstance(stderr, (int, float)) else ""))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _artifacts_section(run: dict) -> list[str]:
    """Each stage's formatting artifacts on its own domain against the base (`artifacts.stage_artifacts`), where
    eval.json keeps the completions."""
    summary = run["summary"]
    if not summary.get("cl_metrics") or len(run.get("evals", [])) != len(summary["stages"]):
        return []
    found = stage_artifacts(run["evals"], summary["domains"], summary["cl_metrics"]["trained_columns"])
    if not any(found):
        return []
    first = next(a for a in found if a)
    lines = ["", "## Formatting artifacts (each stage's own domain, against the base)", ""]
    lines.append(
        f"The top {first['k']} most frequent word/punctuation n-grams (n = {', '.join(map(str, first['ns']))})"
    )
    lines.append("of the stage's greedy eval responses on its own domain; rate = the share of the responses' n-gram")
    lines.append("positions holding one of them, for the stage and for the base's responses to the same prompts;")
    lines.append("ratio = rate / base rate (1: no change; artifacts.py).")
    lines += ["", "| stage | domain | n | rate | base rate | ratio | most frequent (rate / base rate) |"]
    lines.append("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for name, art in zip(summary["stages"][1:], found):
        if art is None:
            continue
        shown = art["top"][:NGRAMS_SHOWN]  # a `|` of an n-gram would split the table's cell
        top = ", ".join(
            f"`{t['ngram'].replace('|', '/')}` ({_num(t['rate'])} / {_num(t['base_rate'])})" for t in shown
        )
        lines.append(
            f"| {name} | {art['domain']} | {art['responses']} | {_num(art['rate'])} | {_num(art['base_rate'])} | "
            f"{_num(art['ratio'], 2)} | {top} |"
        )
    return lines


def _num(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _teacher_lift_section(stages: list[dict]) -> list[str]:
    """The stage-start teacher lift of every stage that measured it (`run.diagnostics.teacher_lift`)."""
    measured = [s for s in stages if s["teacher_lift"]]
    if not measured:
        return []
    lines = ["", "## Teacher lift (stage start)", ""]
    lines.append("Greedy accuracy of the stage-start teacher shown its context minus the student's on the plain")
    lines.append("prompt, over the n seeded train prompts of the stage's domain whose sampled group gave a context;")
    lines.append("95 % paired bootstrap interval over prompts. SDPO's premise holds where the lift is > 0. A sibling")
    lines.append("context shows an answer that already solved the prompt: there the lift measures in-context copying.")
    lines += ["", "| stage | method | n | teacher | student | lift [95 % CI] | by context (n: lift) |"]
    lines.append("| --- | --- | ---: | ---: | ---: | --- | --- |")
    for stage in measured:
        lift = stage["teacher_lift"]
        kinds = ", ".join(f"{k} ({v['n']}: {v['lift']:+.3f})" for k, v in lift["by_context"].items())
        if lift["n"] == 0:
            tried = lift.get("prompts_tried", lift["prompts"])
            lines.append(f"| {stage['name']} | {lift['method']} | 0 | n/a | n/a | n/a | none of {tried} prompts |")
            continue
        lo, hi = lift["lift_ci95"]
        lines.append(
            f"| {stage['name']} | {lift['method']} | {lift['n']} | {lift['teacher_accuracy']:.3f} | "
            f"{lift['student_accuracy']:.3f} | {lift['lift']:+.3f} [{lo:+.3f}, {hi:+.3f}] | {kinds} |"
        )
    return lines


def _samples_section(stages: list[dict]) -> list[str]:
    """A few rollout samples (samples.jsonl) of each stage's first and last step."""
    if not any(s["samples"] for s in stages):
        return []
    lines = ["", "## Rollout samples", ""]
    lines.append("Training completions kept per step (`log.samples_per_step`; all of them in each stage's")
    lines.append("samples.jsonl); teacher_target: whether the sample had a teacher context (empty: no teacher).")
    for stage in stages:
        steps = sorted({r["step"] for r in stage["samples"]})
        for step in dict.fromkeys([steps[0], steps[-1]] if steps else []):
            rows = [r for r in stage["samples"] if r["step"] == step][:SAMPLES_SHOWN]
            lines += ["", f"### {stage['name']}, step {step}", "", markdown_table(rows)]
    return lines


def _stage_kl_section(run: dict) -> list[str]:
    """Each stage's forward KL from the previous stage's policy (drift.json stage_kl) next to the forgetting it caused
    (`metrics.stage_forgetting`): one run's points of RL's Razor scatter (fit over runs: `stats.linear_fit`)."""
    summary, stages = run["summary"], run["stages"]
    if not any(s["drift"] and "stage_kl" in s["drift"] for s in stages) or not summary.get("cl_metrics"):
        return []
    caused = stage_forgetting(summary["accuracy"], summary["cl_metrics"]["trained_columns"])
    lines = ["", "## Forward KL from the previous stage's policy vs the forgetting the stage caused", ""]
    lines.append("KL(π_{k−1} ‖ π_k) on seeded train prompts of stage k's domain, responses sampled from π_{k−1},")
    lines.append("in nats (per response token and per response); forgetting caused = mean over earlier-trained")
    lines.append("domains of a[k−1, c] − a[k, c] (RL's Razor: forgetting follows this KL).")
    lines += ["", "| stage | KL / token | KL / response | forgetting caused |", "| --- | ---: | ---: | ---: |"]
    for stage, forgetting in zip(stages, caused):
        kl = (stage["drift"] or {}).get("stage_kl")
        if kl is None:
            continue
        shown = "n/a" if forgetting is None else f"{forgetting:+.3f}"
        lines.append(f"| {stage['name']} | {kl['kl_token_mean']:.4f} | {kl['kl_sequence_mean']:.4f} | {shown} |")
    return lines


def _save(fig, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    tmp.replace(path)
    import matplotlib.pyplot as plt

    plt.close(fig)


def _plot_accuracy_matrix(run: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    summary = run["summary"]
    acc = summary["accuracy"]
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(summary["domains"]), 1.0 + 0.5 * len(acc)))
    image = ax.imshow(acc, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(summary["domains"])), summary["domains"], rotation=30, ha="right")
    ax.set_yticks(range(len(acc)), summary["stages"])
    for i, row in enumerate(acc):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", color="white" if value < 0.6 else "black")
    fig.colorbar(image, ax=ax, label="accuracy")
    ax.set_title("accuracy after each stage")
    _save(fig, path)


def _plot_accuracy_by_stage(run: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    summary = run["summary"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for j, domain in enumerate(summary["domains"]):
        ax.plot(range(len(summary["accuracy"])), [row[j] for row in summary["accuracy"]], marker="o", label=domain)
    ax.set_xticks(range(len(summary["stages"])), summary["stages"], rotation=30, ha="right")
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("accuracy")
    ax.legend(fontsize=8)
    ax.set_title("per-domain accuracy across stages")
    _save(fig, path)


def _plot_training_curves(run: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    offset = 0
    for stage in run["stages"]:
        steps = [offset + m["step"] for m in stage["metrics"]]
        for ax, key in ((top, "reward_mean"), (bottom, "teacher_divergence")):
            values = [m.get(key, float("nan")) for m in stage["metrics"]]
            ax.plot(steps, values, label=stage["name"], **series_style(values))
        offset += len(stage["metrics"])
    top.set_ylabel("reward mean")
    bottom.set_ylabel("teacher-student divergence")
    bottom.set_xlabel("step (all stages)")
    top.legend(fontsize=8)
    top.set_title("training curves")
    _save(fig, path)


def series_style(values: list[float]) -> dict:
    """Plot options of a curve: a marker on every point when one of its values has no finite neighbour (a stage that
    distilled on one step; a one-step stage), which a line alone would not draw at all."""
    finite = [v == v and abs(v) != float("inf") for v in values]  # v == v: not NaN
    lone = any(
        ok and not (i > 0 and finite[i - 1]) and not (i + 1 < len(finite) and finite[i + 1])
        for i, ok in enumerate(finite)
    )
    return {"marker": "o", "markersize": 3} if lone else {}


def _plot_drift(run: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    stages = [s for s in run["stages"] if s["drift"] and "parameter" in s["drift"]]
    aggregates = [s["drift"]["parameter"]["aggregate"] for s in stages]
    # a low-rank drift report (drift.py) has the top-k spectral shift in place of the full one
    full = any("spectral_shift_mean" in a for a in aggregates)
    shift = "spectral_shift_mean" if full else "spectral_shift_top_k_mean"
    keys = ("relative_delta_norm_mean", shift, "principal_angle_mean")
    # constrained layout: room for the figure's title above the subplots' titles, and for each subplot's tick labels
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.4), layout="constrained")
    for ax, key in zip(axes, keys):
        ax.bar([s["name"] for s in stages], [a.get(key, 0.0) for a in aggregates])
        ax.set_title(key)
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle("parameter drift per stage (model after the stage vs base)")
    _save(fig, path)
