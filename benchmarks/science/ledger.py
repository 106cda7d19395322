"""What a collection has committed, so that its sweep resumes on another machine: the run records and each seed's
shared row 0.

A sweep of many hours runs across working sessions, and a later session may run on a fresh machine without the runs
folder. So collecting writes, beside results.json, everything the statistics need and nothing of the machine:
- `records.json`: every finished run's record (`collect.collect_run`, with each eval example's correctness and the
  run's provenance: revision, command, CPU, wall time), keyed by method and seed. A run whose record is committed is
  not run again, and is collected from here when its run directory is gone.
- `row0/<method>-s<seed>/`: the run whose row 0 every other run of the seed shares (`eval.before_from`): its
  recipe.resolved.yaml (output_dir written `<runs>/...`) and `stage-00-before/` (eval.json, done.json). On a machine
  without that run directory it is put back into the runs folder, so the seed's remaining runs take the very row 0
  the committed ones took (another CPU could decode the base's greedy answers differently in float32).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from adaptercl.system.atomic import write_json

RECORDS = "records.json"
ROW0 = "row0"


def load_records(out: Path) -> dict[tuple[str, int], dict]:
    """The committed records of a collection's out folder, by (method, seed); empty when none."""
    path = out / RECORDS
    if not path.is_file():
        return {}
    return {(r["method"], r["seed"]): r for r in json.loads(path.read_text())["records"]}


def save_records(out: Path, records: list[dict]) -> None:
    """Write `records` (already free of machine paths) as the collection's committed records."""
    ordered = sorted(records, key=lambda r: (r["seed"], r["method"]))
    write_json(out / RECORDS, {"records": ordered})


def save_row0(out: Path, runs: Path, name: str) -> bool:
    """Commit run `name`'s row 0 (recipe with output_dir `<runs>/name`, stage-00-before/) into out/row0/; False when
    the run has no finished row 0 here."""
    source = runs / name
    if not (source / "stage-00-before" / "done.json").is_file():
        return False
    target = out / ROW0 / name
    if target.exists():
        shutil.rmtree(target)
    (target / "stage-00-before").mkdir(parents=True)
    recipe = yaml.safe_load((source / "recipe.resolved.yaml").read_text())
    recipe["output_dir"] = f"<runs>/{name}"
    (target / "recipe.resolved.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    for part in ("eval.json", "done.json"):
        shutil.copyfile(source / "stage-00-before" / part, target / "stage-00-before" / part)
    return True


def restore_row0(out: Path, runs: Path, name: str) -> bool:
    """Put a committed row 0 back as run directory `runs/name` (recipe and stage-00-before only) when that directory
    is missing; True when it did."""
    committed, target = out / ROW0 / name, runs / name
    if target.exists() or not (committed / "stage-00-before" / "done.json").is_file():
        return False
    shutil.copytree(committed, target)
    recipe = yaml.safe_load((target / "recipe.resolved.yaml").read_text())
    recipe["output_dir"] = str(target)
    (target / "recipe.resolved.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    return True
