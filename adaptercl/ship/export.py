"""Export a finished run for shipping: one PEFT adapter folder per trained domain, model cards and a manifest.

    export_run(RUN_DIR, OUT)                  OUT/<domain>/   the adapter of the LAST stage that trained <domain>
                                                              (a copy of stage-NN-<name>/adapter/) + README.md
                                              OUT/manifest.json  every folder: domain, path, stage, method, base
                                                              model (recipe name, hub id), accuracy, LoRA rank
    export_run(RUN_DIR, OUT, merged=True)     also OUT/combined/: the one adapter making up the final model (the
                                              final stage's combined_adapter/, or its own adapter when it alone
                                              makes up the model)

Each model card gives the base model, the method, the stage's resolved recipe block, the accuracy on every domain
before and after the stage, and the forgetting the stage caused (accuracy drop on the other domains). Accuracies
are those of the model the run evaluated after that stage: with `adapter.init: new` that model is the earlier
stage adapters plus this one (the card lists them), so a domain folder served alone may score differently; the
`combined` folder is exactly the final evaluated model.

An export holds no path of the exporting machine (but a local base's, as the recipe names it), so it works wherever
it is copied: every adapter_config.json names the base by its hub id where it has one (`model.hub_source`: a
built-in alias's source, a hub id as given, with its revision), so `peft.AutoPeftModelForCausalLM.from_pretrained(
folder)` finds the base on the hub or in the local hub cache, and the card's metadata `base_model` is that id. A base
with no hub id (tiny-random, a local folder, a GGUF file) is named as the recipe gave it and left out of the
metadata. Every card's Use section shows the load by hub id (where there is one) and the load against a local
base folder, offline (`model.base_folder(model.name)`: the folder adaptercl loads the base from on the reading
machine, a built-in alias's conversion under its cache included; without a hub id also: edit
`base_model_name_or_path`). The manifest's paths are relative to its folder (`run_dir`, each adapter's `path`).

Everything reads from the run directory alone (recipe.resolved.yaml, done.json, summary.json); OUT is written
into a temporary folder and renamed, and an existing non-empty OUT is refused. `adaptercl serve OUT` serves it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from adaptercl.adapters import stage_dir_name
from adaptercl.recipe import RecipeConfig, RecipeError
from adaptercl.run_dir import RunDir, open_finished_run
from adaptercl.system import atomic_dir, check_new_folder, read_record, write_json, write_text

if TYPE_CHECKING:
    from adaptercl.model import HubSource

COMBINED_NAME = "combined"  # folder and served model name of the --merged adapter
MANIFEST_VERSION = 2  # 2: base_model_id/base_model_revision and a relative run_dir replace local paths


def export_run(run_dir: str | Path, out: str | Path, merged: bool = False) -> Path:
    """Write the shippable adapters of the finished run in `run_dir` to `out`; return `out`."""
    from adaptercl.model import hub_source

    out = Path(out)
    run, summary = open_finished_run(run_dir, "export")
    recipe = run.recipe
    check_new_folder(out, "export")
    domains: list[str] = summary["domains"]
    accuracy: list[list[float]] = summary["accuracy"]  # [stages + 1, domains]; row 0 = before training
    hub = hub_source(recipe.model)
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
            _name_base(target, recipe, hub)
            done = stage_dir.read_done()
            before = dict(zip(domains, accuracy[i]))
            after = dict(zip(domains, accuracy[i + 1]))
            card = _model_card(recipe, hub, i, domain, before, after, done["adapters"])
            write_text(target / "README.md", card)
            entries.append(_entry(domain, domain, stage_dir.name, stage.method, recipe, after, target))
        if merged:
            entries.append(_export_combined(run, hub, tmp, domains, accuracy))
        write_json(
            tmp / "manifest.json",
            {
                "version": MANIFEST_VERSION,
                "run_dir": os.path.relpath(run.path.resolve(), out.resolve()),  # relative to this folder
                "base_model": recipe.model.name,  # as the recipe names it (alias, hub id, folder or GGUF file)
                "base_model_id": hub.repo_id if hub else None,  # its hub id; None: it has none
                "base_model_revision": hub.revision if hub else None,
                "domains": domains,
                "adapters": entries,
            },
        )
    return out


def _name_base(folder: Path, recipe: RecipeConfig, hub: HubSource | None) -> None:
    """Point the copied adapter_config.json at the base by its hub id (and revision) where it has one, else by the
    recipe's name, instead of the exporting machine's local path of the base."""
    config_file = folder / "adapter_config.json"
    config = read_record(config_file, "export again into a new folder")  # parsed in the run dir
    config["base_model_name_or_path"] = hub.repo_id if hub else recipe.model.name
    config["revision"] = hub.revision if hub else None
    write_json(config_file, config)


def _export_combined(
    run: RunDir, hub: HubSource | None, tmp: Path, domains: list[str], accuracy: list[list[float]]
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
    _name_base(target, recipe, hub)
    after = dict(zip(domains, accuracy[-1]))
    before = dict(zip(domains, accuracy[0]))
    write_text(target / "README.md", _combined_card(recipe, hub, before, after, done["adapters"]))
    method = "+".join(dict.fromkeys(s.method for s in recipe.stages))
    return _entry(COMBINED_NAME, None, stage_name, method, recipe, after, target)


def _entry(
    name: str,
    domain: str | None,
    stage: str,
    method: str,
    recipe: RecipeConfig,
    accuracy: dict[str, float],
    folder: Path,
) -> dict[str, Any]:
    config = read_record(folder / "adapter_config.json", "export again into a new folder")  # parsed in the run dir
    ranks = [config["r"], *config.get("rank_pattern", {}).values()]
    return {
        "name": name,  # folder name and the model name `adaptercl serve` gives it
        "domain": domain,  # None for the combined all-domain adapter
        "path": name,  # relative to the manifest's folder
        "stage": stage,
        "method": method,
        "base_model": recipe.model.name,
        "rank": max(ranks),
        "accuracy": accuracy,  # every domain, evaluated after `stage`
    }


def _model_card(
    recipe: RecipeConfig,
    hub: HubSource | None,
    index: int,
    domain: str,
    before: dict,
    after: dict,
    model_adapters: list[str],
) -> str:
    stage = recipe.stages[index]
    stage_name = stage_dir_name(recipe, index)
    block = yaml.safe_dump(recipe.model_dump(mode="json")["stages"][index], sort_keys=False, allow_unicode=True)
    forgetting = {d: before[d] - after[d] for d in before if d != domain}
    lines = [
        *_front_matter(hub),
        f"# {domain}: LoRA adapter from adaptercl stage `{stage_name}`",
        "",
        f"- Base model: {_base_line(recipe, hub)}",
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
        *_usage(domain, recipe, hub),
    ]
    return "\n".join(lines) + "\n"


def _combined_card(
    recipe: RecipeConfig, hub: HubSource | None, before: dict, after: dict, model_adapters: list[str]
) -> str:
    lines = [
        *_front_matter(hub),
        "# combined: the final all-domain LoRA adapter of an adaptercl run",
        "",
        f"- Base model: {_base_line(recipe, hub)}",
        f"- Stages: {', '.join(f'`{s.name}` ({s.method}, {s.domain})' for s in recipe.stages)}",
        f"- One adapter whose ΔW is the sum of: {', '.join(f'`{a}`' for a in model_adapters)}",
        "",
        "## Accuracy before training and after the final stage",
        "",
        *_accuracy_table(before, after, trained=None),
        "",
        *_usage(COMBINED_NAME, recipe, hub),
    ]
    return "\n".join(lines) + "\n"


def _front_matter(hub: HubSource | None) -> list[str]:
    """The card's Hub metadata: `base_model` only where the base has a hub id (the Hub accepts nothing else)."""
    base = [f"base_model: {json.dumps(hub.repo_id)}"] if hub else []
    return ["---", "library_name: peft", *base, "tags: [lora, adaptercl]", "---", ""]


def _base_line(recipe: RecipeConfig, hub: HubSource | None) -> str:
    name = recipe.model.name
    if hub is None:
        return f"`{name}` (no hub id; see Use)"
    revision = f" at revision `{hub.revision}`" if hub.revision else ""
    recipe_name = f" (recipe: `{name}`)" if name != hub.repo_id else ""
    return f"`{hub.repo_id}`{revision}{recipe_name}" + (f"; {hub.note}" if hub.note else "")


def _accuracy_table(before: dict, after: dict, trained: str | None) -> list[str]:
    rows = ["| domain | before | after | change |", "|---|---|---|---|"]
    for d in before:
        mark = " (trained)" if d == trained else ""
        rows.append(f"| {d}{mark} | {before[d]:.4f} | {after[d]:.4f} | {after[d] - before[d]:+.4f} |")
    return rows


def _usage(name: str, recipe: RecipeConfig, hub: HubSource | None) -> list[str]:
    """The card's Use section: the load by hub id (where the base has one), then the load against the base's local
    folder, offline (`model.base_folder`: for a built-in alias the folder adaptercl converted or built it into)."""
    serve = f"Or serve every exported adapter with vLLM: `adaptercl serve EXPORT_DIR` (model name `{name}`)."
    base = recipe.model.name
    offline = [
        "```python",
        "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM",
        "",
        "from adaptercl.model import base_folder",
        "",
        f'base_model = AutoModelForCausalLM.from_pretrained(base_folder("{base}"))  # or your copy\'s folder',
        f'model = PeftModel.from_pretrained(base_model, "{name}")',
        "```",
        "",
        f'`base_folder("{base}")` is the folder adaptercl loads that base from on this machine, offline '
        f"({_where_the_folder_is(base)}); in a shell: "
        f"`python -c \"from adaptercl.model import base_folder; print(base_folder('{base}'))\"`.",
    ]
    if hub is not None:
        return [
            "## Use",
            "",
            f"By hub id: the base `{hub.repo_id}` from the hub, or from the local hub cache (offline too, once it "
            "holds the base):",
            "",
            "```python",
            "from peft import AutoPeftModelForCausalLM",
            "",
            f'model = AutoPeftModelForCausalLM.from_pretrained("{name}")  # base: {hub.repo_id}, hub or HF cache',
            "```",
            "",
            "Against a local base folder, offline (`HF_HUB_OFFLINE=1`), e.g. the one this run trained on:",
            "",
            *offline,
            "",
            serve,
        ]
    return [
        "## Use",
        "",
        f"The base `{base}` has no hub id (a model adaptercl builds in code, a local folder or a GGUF file), so "
        "`adapter_config.json` names it as the recipe did and `AutoPeftModelForCausalLM` cannot fetch it. Load the "
        "base from its local folder and attach the adapter (offline too):",
        "",
        *offline,
        "",
        "or set `base_model_name_or_path` in `adapter_config.json` to the base's folder or hub id, then "
        f'`AutoPeftModelForCausalLM.from_pretrained("{name}")` loads both. {serve}',
    ]


def _where_the_folder_is(base: str) -> str:
    """Where `model.base_folder` finds `base`, in words, without a path of the exporting machine."""
    from adaptercl.model import ALIAS_SOURCES

    if base in ALIAS_SOURCES:
        hub_id, converted = ALIAS_SOURCES[base]
        made = f"converted once from the GGUF of its wheel into `{converted}/`" if converted else "built in code"
        cached = f", or the local hub cache's snapshot of `{hub_id}`" if hub_id else ""
        return f"a built-in alias: {made} under `~/.cache/adaptercl` (or `$ADAPTERCL_CACHE`){cached}"
    if base.endswith(".gguf"):
        return "a GGUF file: its conversion under `~/.cache/adaptercl` (or `$ADAPTERCL_CACHE`), made once"
    return "a local folder as it is, or a hub id's snapshot in the local hub cache"
