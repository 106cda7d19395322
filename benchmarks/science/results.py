"""Writing the science benchmark's results: results.json (every figure and interval), results.md (the tables,
generated), results.png and pareto.png (the figures, `plots.py`), from the run records of `collect.py` and the
statistics of `analysis.py` and `headline.py`. Nothing written names a path of the machine: `replacements` (from
run.py: the runs folder, the repo root, the probe data) are applied to every string before writing, and a Python
interpreter's path becomes `python`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from analysis import hybrid_goal, kl_vs_forgetting, paper_checks, summarise, teacher_lift_table
from format_artifacts import artifact_table, artifacts_md
from frontier import frontier_curve, frontier_md, frontier_points, headline_43
from gate import gate_md, gate_table
from headline import general_delta, learnable_stages, pareto_points, peak_final, versus_reference
from plots import pareto, plot
from provenance import command, git_revision, machine, versions
from references import with_references
from signals import signal_table, signals_md

from adaptercl.system.atomic import write_json, write_text

PYTHON_PATH = re.compile(r"\S*/python[0-9.]*(?=\s|$)")  # an interpreter's path in a recorded command


def scrub(value: Any, replacements: dict[str, str]) -> Any:
    """`value` (JSON-like) with every string's machine paths replaced (longest first) and interpreters named
    `python`."""
    if isinstance(value, dict):
        return {k: scrub(v, replacements) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub(v, replacements) for v in value]
    if isinstance(value, str):
        for old in sorted(replacements, key=len, reverse=True):
            value = value.replace(old, replacements[old])
        return PYTHON_PATH.sub("python", value)
    return value


def write_results(
    records: list[dict],
    out: Path,
    setting: dict,
    methods: dict,
    sdpo_variants: tuple,
    resamples: int,
    replacements: dict[str, str] | None = None,
) -> dict:
    """Collect the statistics of `records` and write results.json, results.md, results.png and pareto.png into
    `out`; `setting["reference"]` (default grpo) is the method the others are compared with."""
    runs: dict[str, dict[int, dict]] = {}
    for r in records:
        runs.setdefault(r["method"], {})[r["seed"]] = r
    reference = setting.get("reference", "grpo")
    trained_runs = runs  # the runs that trained: their training traces are tabled
    runs = with_references(runs, reference)  # + base and stage_skip from the reference's runs; joint reshaped
    summary, draws, seeds = summarise(runs, resamples)
    lift_rows = teacher_lift_table(trained_runs)
    data = {
        "meta": {
            "sequence": (setting.get("sequence") or {}).get("name"),  # the collection's sequence (None: base.yaml's)
            "setting": setting,
            "methods": {m: methods[m] for m in runs if m in methods},
            "bootstrap_resamples": resamples,
            "bootstrap_seeds": seeds,
            "collected_by": command(),
            "collected_at_git": git_revision(short=True),
            "machine": machine(),
            "versions": versions(with_git_revision=False),
        },
        "headline": versus_reference(summary, draws, reference),
        "learnable_stages": learnable_stages(summary, runs, reference),
        "peak_final": peak_final(summary, runs),
        "general_delta": general_delta(summary, runs),
        "pareto": pareto_points(summary, reference),
        "summary": summary,
        "teacher_lift": lift_rows,
        "references": [m for m in ("base", "stage_skip", "joint") if m in runs],
        "frontier": frontier_points(summary),
        "frontier_headline": headline_43(summary, draws, reference),
        "training_signals": signal_table(trained_runs),
        "lift_gate": gate_table(trained_runs),
        "formatting_artifacts": artifact_table(trained_runs, reference),
        "kl_vs_forgetting": kl_vs_forgetting(summary, runs, resamples),
        "paper_checks": paper_checks(summary, draws, lift_rows),
        "hybrid_goal": hybrid_goal(summary, draws, sdpo_variants),
        "runs": [{k: v for k, v in r.items() if k != "correct"} for r in records],
    }
    data = scrub(data, replacements or {})
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", data)
    write_text(out / "results.md", markdown(data, runs))
    plot(data, runs, out / "results.png")
    pareto(data["pareto"], out / "pareto.png", frontier_curve(data["frontier"]))
    return data


def num(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "–"
    value = round(value, 12)  # 1e-17 from float sums is 0
    return f"{value:.{digits}f}" if abs(value) >= 10 ** (-digits) or value == 0 else f"{value:.2e}"


def sci(cell: dict) -> str:
    """A small positive figure (parameter drift) in scientific notation, with its interval."""
    if cell["mean"] is None:
        return "–"
    interval = "" if cell["ci95"] is None else f" [{cell['ci95'][0]:.2e}, {cell['ci95'][1]:.2e}]"
    return f"{cell['mean']:.2e}{interval}"


def ci(interval: list[float] | None, digits: int = 3) -> str:
    return "" if interval is None else f" [{num(interval[0], digits)}, {num(interval[1], digits)}]"


def with_ci(cell: dict, digits: int = 3) -> str:
    return num(cell.get("mean", cell.get("value")), digits) + ci(cell["ci95"], digits)


def markdown(data: dict, runs: dict[str, dict[int, dict]]) -> str:
    meta, summary = data["meta"], data["summary"]
    first = next(iter(next(iter(runs.values())).values()))
    domains, stage_names = first["domains"], ["before"] + [s.split("-", 2)[-1] for s in first["stages"][1:]]
    mach, vers = meta["machine"], meta["versions"]
    seed_counts = " to ".join(str(n) for n in sorted({len(s["seeds"]) for s in summary.values()}))
    L = ["# Science benchmark results (generated by run.py; do not edit)", ""]
    L += [
        f"Setting: `{meta['setting']['base']}`"
        + (f" with `{' '.join(meta['setting']['overrides'])}`" if meta["setting"]["overrides"] else "")
        + ", methods as in method_recipes.py's METHODS"
        + f"; runs in `{meta['setting']['runs_dir']}`. Eval examples per domain: "
        + ", ".join(f"{d} n = {n}" for d, n in zip(domains, first["n"]))
        + ".",
        f"Collected by `{meta['collected_by']}` at git {meta['collected_at_git']}; machine: {mach['cpu']}, "
        f"{mach['cpus_usable']} usable cores, {mach['memory_gib']} GiB; "
        + ", ".join(f"{k} {v}" for k, v in vers.items())
        + ".",
        "",
        "Intervals are 95 %. Figures made of eval accuracies (matrix cells, ACC, forgetting, plasticity, BWT, FWT, "
        f"the forgetting a stage caused): mean over each method's seeds ({meta['bootstrap_seeds']} in all; the "
        f"seeds column) with a two-level percentile bootstrap ({meta['bootstrap_resamples']} resamples: seeds with "
        "replacement, then each drawn seed's eval examples with replacement, the same draws for every method, so "
        "differences are paired, over the seeds both methods have). One run's accuracy: "
        "Wilson interval over its n examples; one run's other accuracy figures: the bootstrap over its examples. "
        "Figures not made of eval examples (drift, KL to the base, reward drop, teacher lift over seeds): Student-t "
        f"interval over the seeds. With {seed_counts} seeds a method the bootstrap's seed level is coarse "
        "(the per-run figures are listed under Runs). Definitions: ACC = mean "
        "final accuracy over the trained domains; forgetting = Chaudhry et al. (best accuracy after stages 1..T−1 "
        "minus final, over the domains trained before the last stage); plasticity = mean over stages of a stage's "
        "gain on its own domain; BWT/FWT as GEM; the forgetting stage k caused = mean over the earlier domains of "
        "a[k−1] − a[k].",
        "",
        "## Per method (mean over seeds)",
        "",
        "| method | seeds | ACC | forgetting | plasticity | BWT | FWT | param drift | KL to base | reward drop "
        "| runs with guard alarms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, s in summary.items():
        f, sc = s["figures"], s["scalars"]
        alarms = sum(bool(runs[m][seed]["guard_events"]) for seed in s["seeds"])
        L.append(
            f"| {m} | {len(s['seeds'])} | "
            + " | ".join(with_ci(f[k]) for k in ("acc", "forgetting", "plasticity", "bwt", "fwt"))
            + f" | {sci(sc['parameter_drift'])}"
            + f" | {with_ci(sc['response_kl_to_base'])} | {with_ci(sc['reward_drop'])}"
            + f" | {alarms} of {len(s['seeds'])} |"
        )
    trained = [domains[c] for c in first["trained_columns"]]
    L += ["", "## Gain per stage on its own domain (a[k, c_k] − a[k−1, c_k]; plasticity is their mean)", ""]
    L += ["| method | " + " | ".join(f"{k} ({d})" for k, d in enumerate(trained, start=1)) + " |"]
    L += ["|---|" + "---|" * len(trained)]
    for m, s in summary.items():
        L.append(
            f"| {m} | " + " | ".join(with_ci(s["figures"][f"gain {k}"]) for k in range(1, len(trained) + 1)) + " |"
        )
    L += ["", "## Accuracy matrices (mean over seeds; rows: before training, after each stage)", ""]
    for m, s in summary.items():
        L += [f"**{m}** (n per seed: {', '.join(map(str, s['n']))})", "", "| after | " + " | ".join(domains) + " |"]
        L += ["|---|" + "---|" * len(domains)]
        for k, name in enumerate(stage_names):
            L.append(
                f"| {name} | " + " | ".join(with_ci(s["figures"][f"cell {k} {d}"]) for d in range(len(domains))) + " |"
            )
        L.append("")
    L += frontier_md(data)
    L += headline_md(data)
    L += teacher_lift_md(data["teacher_lift"])
    L += signals_md(data["training_signals"])
    L += gate_md(data["lift_gate"])
    L += artifacts_md(data.get("formatting_artifacts", []), data["headline"]["reference"])
    L += kl_md(data["kl_vs_forgetting"])
    L += [
        "## The paper's directions, as measured here",
        "",
        "| claim | measure | left | right | difference [95 %] | interval | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in data["paper_checks"]:
        L.append(
            f"| {c['claim']} | {c['measure']} | {num(c['left'])} | {num(c['right'])} | {num(c['difference'])}"
            f"{ci(c['ci95'])} | {c['interval']} | {c['verdict']} |"
        )
    L += [
        "",
        "holds / opposite: the interval excludes 0 on the expected / the other side; undecided: it contains 0.",
        "",
        "## The hybrid's goal",
        "",
        "| goal | measure | hybrid | other | difference [95 %] | state |",
        "|---|---|---|---|---|---|",
    ]
    for g in data["hybrid_goal"]:
        L.append(
            f"| {g['goal']} | {g['measure']} | {num(g['left'])} | {num(g['right'])} | {num(g['difference'])}"
            f"{ci(g['ci95'])} | {g['state']} |"
        )
    L += [
        "",
        "Paired two-level bootstrap. met / not met: the interval lies on / off the goal's side of 0; "
        "undecided: it contains 0.",
        "",
    ]
    L += runs_md(summary, runs)
    return "\n".join(L) + "\n"


def state_cell(cell: dict | None) -> str:
    """A paired difference with its interval and goal state, for a table cell."""
    if cell is None:
        return "–"
    return f"{num(cell['difference'])}{ci(cell['ci95'])} {cell['state']}"


def seed_check_md(h: dict) -> list[str]:
    """The headline's seed-level check (headline.py): each shared seed's difference and the t-interval over seeds."""
    ref = h["reference"]
    L = [
        "",
        f"Seed-level check (headline.py): method − {ref} on each shared seed (its own runs' figures), and the "
        "Student-t 95 % interval over those seeds with its verdict: the conservative reading where few seeds make "
        "the bootstrap's seed level coarse. A verdict both intervals reach is robust; one only the bootstrap "
        "reaches needs more seeds.",
        "",
        f"| method | seeds | ACC − {ref} per seed | t-interval | forgetting − {ref} per seed | t-interval |",
        "|---|---|---|---|---|---|",
    ]
    for r in h["rows"]:
        cells = []
        for key in ("acc", "forgetting"):
            cell = r[key]
            if cell is None:
                cells += ["–", "–"]
                continue
            cells.append(", ".join(f"{v:+.2f}" for _, v in sorted(cell["per_seed"].items())))
            cells.append(f"{num(cell['difference'])}{ci(cell['seed_t95'])} {cell['seed_state']}")
        seeds = len(r["acc"]["per_seed"]) if r["acc"] else "–"
        L.append(f"| {r['method']} | {seeds} | " + " | ".join(cells) + " |")
    return L


def headline_md(data: dict) -> list[str]:
    """The headline against the reference, learnable stages, the general-ability delta, peak/final/collapse."""
    h, ref = data["headline"], data["headline"]["reference"]
    L = [
        f"## Headline: is there a method with ACC ≥ {ref}'s and forgetting ≤ {ref}'s?",
        "",
        f"**{h['answer']}**"
        + (f" ({', '.join(h['meeting_both'])})" if h["meeting_both"] else "")
        + f". Paired two-level bootstrap of method − {ref} (same seeds and eval examples); met: the interval lies on "
        "the goal's side of 0 (touching it counts), not met: strictly on the other side, undecided: 0 inside. "
        "pareto.png plots plasticity against forgetting with both intervals.",
        "",
        f"| method | ACC − {ref} (≥ 0) | forgetting − {ref} (≤ 0) | both | plasticity − {ref} (≥ 0) "
        f"| general delta − {ref} (≥ 0) |",
        "|---|---|---|---|---|---|",
    ]
    for r in h["rows"]:
        L.append(
            f"| {r['method']} | {state_cell(r['acc'])} | {state_cell(r['forgetting'])} | {r['both']} | "
            f"{state_cell(r['plasticity'])} | {state_cell(r['general_delta'])} |"
        )
    L += seed_check_md(h)
    L += ["", f"## Is every stage learnable? ({ref}'s gain on the stage's own domain, interval above 0)", ""]
    L += ["| stage | domain | gain [95 %] | learnable |", "|---|---|---|---|"]
    for r in data["learnable_stages"]:
        L.append(f"| {r['stage']} | {r['domain']} | {with_ci(r['gain'])} | {'yes' if r['learnable'] else 'no'} |")
    L += [
        "",
        "## General-ability delta (retention probes no stage trains: after the sequence − before it)",
        "",
    ]
    rows = data["general_delta"]
    if rows:
        probes = list(rows[0]["probes"])
        L += ["| method | mean [95 %] | " + " | ".join(f"{p} (before)" for p in probes) + " |"]
        L += ["|---|---|" + "---|" * len(probes)]
        for r in rows:
            cells = [f"{with_ci(r['probes'][p])} ({num(r['before'][p]['mean'])})" for p in probes]
            L.append(f"| {r['method']} | {with_ci(r['mean'])} | " + " | ".join(cells) + " |")
    else:
        L.append("No retention probes in these runs.")
    L += [
        "",
        "## Peak, final and collapse per domain (collapsed: final < 0.5 × peak; peak over the rows before training "
        "and after each stage)",
        "",
        "| method | domain | peak [95 %] | final [95 %] | collapsed seeds | collapsed (means) |",
        "|---|---|---|---|---|---|",
    ]
    for r in data["peak_final"]:
        L.append(
            f"| {r['method']} | {r['domain']}{'' if r['trained'] else ' (probe)'} | {with_ci(r['peak'])} | "
            f"{with_ci(r['final'])} | {r['collapsed_seeds']} of {r['seeds']} | "
            f"{'**yes**' if r['collapsed_mean'] else 'no'} |"
        )
    return L + [""]


def teacher_lift_md(rows: list[dict]) -> list[str]:
    L = [
        "## Teacher lift at stage start (teacher's greedy accuracy with its context − the student's)",
        "",
        "Per seed: the lift on the sampled train prompts that got a context, with its paired bootstrap interval over "
        "those n prompts (diagnostics.py); mean over seeds with a t-interval; pooled over the seeds' prompts: the "
        "n-weighted mean with a normal interval from the seeds' bootstrap standard errors. Positive: the pooled "
        'interval lies above 0 ("every seed": each seed\'s own interval does too).',
        "",
        "| method | stage (domain) | contexts shown | per seed: lift [95 %] (n) | mean over seeds [95 %] "
        "| pooled [95 %] (n) | positive |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        seeds = "; ".join(
            f"s{s}: {num(v['lift'], 2)}{ci(v['lift_ci95'], 2)} ({v['n']})" for s, v in r["per_seed"].items()
        )
        p = r["pooled"]
        pooled = "–" if p is None else f"{num(p['lift'], 2)}{ci(p['ci95'], 2)} ({p['n']})"
        L.append(
            f"| {r['method']} | {r['stage']} ({r['domain']}) | {', '.join(r['contexts'])} | {seeds} | "
            f"{num(r['mean'], 2)}{ci(r['ci95'], 2)} | {pooled} | {'yes' if r['positive'] else 'no'}"
            f"{' (every seed)' if r['positive_every_seed'] else ''} |"
        )
    return L + [""]


def kl_md(kl: dict) -> list[str]:
    L = [
        "## Does KL predict forgetting?",
        "",
        "One point per run and stage k ≥ 2: x = forward KL(π_{k−1} ‖ π_k) on stage k's train prompts (drift.json "
        "stage_kl, per token and per response), y = the forgetting stage k caused (mean over earlier domains of "
        "a[k−1] − a[k]). Least-squares fit; R²'s interval from a bootstrap over runs.",
        "",
        "| x | points | runs | slope | intercept | R² [95 %] |",
        "|---|---|---|---|---|---|",
    ]
    for name, f in kl["fits"].items():
        if f is not None:
            L.append(
                f"| {name} | {f['n']} | {f['runs']} | {num(f['slope'])} | {num(f['intercept'])} | "
                f"{num(f['r2'], 2)}{ci(f['r2_ci95'], 2)} |"
            )
    L += [
        "",
        "| method | seed | stage | KL (nats/token) | KL (nats/response) | forgetting caused [95 %] |",
        "|---|---|---|---|---|---|",
    ]
    for p in kl["points"]:
        L.append(
            f"| {p['method']} | {p['seed']} | {p['stage']} | {p['kl_token']:.4f} | {p['kl_sequence']:.3f} | "
            f"{num(p['forgetting'])}{ci(p['ci95'])} |"
        )
    return L + [""]


def runs_md(summary: dict, runs: dict[str, dict[int, dict]]) -> list[str]:
    L = [
        "## Runs",
        "",
        "| run | git | exit | wall (min) | training (min) | load at start | ACC [95 %] | forgetting "
        "| plasticity | guard alarms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, by_seed in runs.items():
        for s, r in sorted(by_seed.items()):
            if r.get("virtual"):  # base, stage_skip: GRPO's rows, no run of their own
                continue
            p, f = r["provenance"], summary[m]["per_seed"][s]
            wall = f"{p['wall_s'] / 60:.1f}" if p.get("wall_s") is not None else "–"
            L.append(
                f"| {r['run']} | {p.get('git', '–')} | {p.get('exit', '–')} | {wall} | {r['train_minutes']:.1f} "
                f"| {p.get('load_average_at_start', '–')} | {with_ci(f['acc'])} | {with_ci(f['forgetting'])} | "
                f"{with_ci(f['plasticity'])} | {'; '.join(r['guard_events']) or '–'} |"
            )
    return L + ["", "Run commands: `<run>.run.json` beside each run directory (command, start time, wall time)."]
