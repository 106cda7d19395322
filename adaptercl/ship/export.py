"""Export a finished run for shipping: one PEFT adapter folder per trained domain, model cards and a manifest.

    export_run(RUN_DIR, OUT)                  OUT/<domain>/   the adapter of the LAST stage that trained <domain>
                                                              (a copy of stage-NN-<name>/adapter/) + README.md
                                              OUT/manifest.json  every folder: domain, path, stage, method, base
                                                              model (name and local path), accuracy, LoRA rank
    export_run(RUN_DIR, OUT, merged=True)     also OUT/combined/: the one adapter making up the final model (the
                                              final stage's combined_adapter/, or its own adapter when it alone
                                              makes up the model)

Each model card gives the base model, the method, the stage's resolved recipe block, the accuracy on every domain
before and after the stage, and the forgetting the stage caused (accuracy drop on the other domains). Accuracies
are those of the model the run evaluated after that stage: with `adapter.init: new` that model is the earlier
stage adapters plus this one (the card lists them), so a domain folder served alone may score differently; the
`combined` folder is exactly the final evaluated model.

Everything reads from the run directory alone (recipe.resolved.yaml, done.json, summary.json); OUT is written
into a temporary folder and renamed, and an existing non-empty OUT is refused. `adaptercl serve OUT` serves it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import yaml

from adaptercl.adapters import stage_dir_name
from adaptercl.recipe import RecipeConfig, RecipeError
from adaptercl.run_dir import RunDir, open_finished_run
from adaptercl.system import atomic_dir, write_json, write_text

COMBINED_NAME = "combined"  # folder and served model name of the --merged adapter
MANIFEST_VERSION = 1


def export_run(run_dir: str | Path, out: str | Path, merged: bool = False) -> Path:
    """Write the shippable adapters of the finished run in `run_dir` to `out`; return `out`."""
    from adaptercl.model import resolve_model_path

    out = Path(out)
    run, summary = open_finished_run(run_dir, "export")
    recipe = run.recipe
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RecipeError(f"export: --out {str(out)!r} exists and is not empty; choose a new folder")
    domains: list[str] = summary["domains"]
    accuracy: list[list[float]] = summary["accuracy"]  # [stages + 1, domains]; row 0 = before training
    base_path, _ = resolve_model_path(recipe.model)
    last_stage = {stage.domain: i for i, stage in enumerate(recipe.stages)}  # domain -> last stage that trained it
    if merged and COMBINED_NAME in last_stage:
        raise RecipeError(f"export --merged: a domain is named {COMBINED_NAME!r}, the merged folder's name")
    entries: list[dict[str, Any]] = []
    with atomic_dir(out) as tmp:
        for domain, i in last_stage.items():
            stage = recipe.stages[i]
            stage_dir = run.stage(i)
            target = tmp / domain
            shutil.copytree(stage_dir.adapter, target)
            done = stage_dir.read_done()
            before = dict(zip(domains, accuracy[i]))
            after = dict(zip(domains, accuracy[i + 1]))
            card = _model_card(recipe, i, domain, before, after, done["adapters"])
            write_text(target / "README.md", card)
            entries.append(_entry(domain, domain, stage_dir.name, stage.method, recipe, base_path, after, target))
        if merged:
            entries.append(_export_combined(run, tmp, domains, accuracy, base_path))
        write_json(
            tmp / "manifest.json",
            {
                "version": MANIFEST_VERSION,
                "run_dir": str(run.path.resolve()),
                "base_model": recipe.model.name,
                "base_model_path": base_path,
                "domains": domains,
                "adapters": entries,
            },
        )
    return out


def _export_combined(
    run: RunDir, tmp: Path, domains: list[str], accuracy: list[list[float]], base_path: str
) -> dict[str, Any]:
    """Copy the final stage's combined adapter (or its own adapter when it alone is the model) to tmp/combined."""
    recipe = run.recipe
    stage_dir = run.stage(len(recipe.stages) - 1)
    stage_name = stage_dir.name
    done = stage_dir.read_done()
    if done.get("combined_adapter") and (stage_dir.combined_adapter / "adapter_config.json").is_file():
        source = stage_dir.combined_adapter
    elif done["adapters"] == [stage_name]:
        source = stage_dir.adapter
    else:
        raise RecipeError(
            f"export --merged: {stage_name} has no combined_adapter/ and its model is several adapters "
            f"({', '.join(done['adapters'])}); merge them with `adaptercl merge` or export without --merged"
        )
    target = tmp / COMBINED_NAME
    shutil.copytree(source, target)
    after = dict(zip(domains, accuracy[-1]))
    before = dict(zip(domains, accuracy[0]))
    write_text(target / "README.md", _combined_card(recipe, before, after, done["adapters"]))
    method = "+".join(dict.fromkeys(s.method for s in recipe.stages))
    return _entry(COMBINED_NAME, None, stage_name, method, recipe, base_path, after, target)


def _entry(
    name: str,
    domain: str | None,
    stage: str,
    method: str,
    recipe: RecipeConfig,
    base_path: str,
    accuracy: dict[str, float],
    folder: Path,
) -> dict[str, Any]:
    config = json.loads((folder / "adapter_config.json").read_text())
    ranks = [config["r"], *config.get("rank_pattern", {}).values()]
    return {
        "name": name,  # folder name and the model name `adaptercl serve` gives it
        "domain": domain,  # None for the combined all-domain adapter
        "path": name,  # relative to the manifest's folder
        "stage": stage,
        "method": method,
        "base_model": recipe.model.name,
        "base_model_path": base_path,
        "rank": max(ranks),
        "accuracy": accuracy,  # every domain, evaluated after `stage`
    }


def _model_card(
    recipe: RecipeConfig, index: int, domain: str, before: dict, after: dict, model_adapters: list[str]
) -> str:
    stage = recipe.stages[index]
    stage_name = stage_dir_name(recipe, index)
    block = yaml.safe_dump(recipe.model_dump(mode="json")["stages"][index], sort_keys=False, allow_unicode=True)
    forgetting = {d: before[d] - after[d] for d in before if d != domain}
    lines = [
        *_front_matter(recipe),
        f"# {domain}: LoRA adapter from adaptercl stage `{stage_name}`",
        "",
        f"- Base model: `{recipe.model.name}`",
        f"- Method: `{stage.method}` (adapter init `{stage.adapter.init}`), {stage.optim.steps} steps",
        f"- Trained domain: `{domain}`",
        f"- Evaluated model after the stage: base + {', '.join(f'`{a}`' for a in model_adapters)}",
        "",
        "## Accuracy before and after this stage",
        "",
        *_accuracy_table(before, after, trained=domain),
        "",
        "## Forgetting caused",
        "",
        "Accuracy drop on the other domains from before this stage to after it (positive = forgotten):",
        "",
        *([f"- `{d}`: {drop:+.4f}" for d, drop in forgetting.items()] or ["- (no other domains)"]),
        "",
        "## Recipe (this stage, resolved)",
        "",
        "```yaml",
        block.rstrip("\n"),
        "```",
        "",
        *_usage(domain),
    ]
    return "\n".join(lines) + "\n"


def _combined_card(recipe: RecipeConfig, before: dict, after: dict, model_adapters: list[str]) -> str:
    lines = [
        *_front_matter(recipe),
        "# combined: the final all-domain LoRA adapter of an adaptercl run",
        "",
        f"- Base model: `{recipe.model.name}`",
        f"- Stages: {', '.join(f'`{s.name}` ({s.method}, {s.domain})' for s in recipe.stages)}",
        f"- One adapter whose ΔW is the sum of: {', '.join(f'`{a}`' for a in model_adapters)}",
        "",
        "## Accuracy before training and after the final stage",
        "",
        *_accuracy_table(before, after, trained=None),
        "",
        *_usage(COMBINED_NAME),
    ]
    return "\n".join(lines) + "\n"


def _front_matter(recipe: RecipeConfig) -> list[str]:
    return [
        "---",
        "library_name: peft",
        f"base_model: {json.dumps(recipe.model.name)}",
        "tags: [lora, adaptercl]",
        "---",
        "",
    ]


def _accuracy_table(before: dict, after: dict, trained: str | None) -> list[str]:
    rows = ["| domain | before | after | change |", "|---|---|---|---|"]
    for d in before:
        mark = " (trained)" if d == trained else ""
        rows.append(f"| {d}{mark} | {before[d]:.4f} | {after[d]:.4f} | {after[d] - before[d]:+.4f} |")
    return rows


def _usage(name: str) -> list[str]:
    return [
        "## Use",
        "",
        "```python",
        "from peft import PeftModel",
        f'model = PeftModel.from_pretrained(base_model, "{name}")',
        "```",
        "",
        f"or serve every exported adapter with vLLM: `adaptercl serve EXPORT_DIR` (model name `{name}`).",
    ]
