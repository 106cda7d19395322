"""Growing a continual run: which recipe may continue a run directory that another recipe started.

A run directory stores the resolved recipe it was started with (`layout.RECIPE_FILE`). A recipe equal to it
resumes the run; a recipe that *extends* it grows the run:

- its first stages are the run's stages, field for field (resolved: recipe-level defaults merged in), and new
  stages may follow;
- its first domains are the run's domains, field for field, and new domains may follow (new columns of the
  accuracy matrix); `eval.retention_probes` likewise keeps the run's probes first;
- everything else (model, quantization, seed, the rest of `eval`) is unchanged, except what only says where the
  run is or reports (`FREE_FIELDS`: `output_dir`, `report_to`, `log`): a run directory copied or moved elsewhere
  resumes and grows there (its identity is its stages and domains, not its path), and a resumed or grown run may
  add a tracker.

`run.sequence.run_recipe` then trains only the new stages. The earlier rows of the accuracy matrix (before training and
each finished stage) are completed with the new domains by evaluating them on that stage's saved adapters, so the
matrix stays complete and BWT/FWT stay defined; their drift.json is not extended. Anything else is refused with one
line naming the first field that differs (`growth_refusal`). The run directory compares only what it has produced
something for (`layout.RunDir.claim`): stages not started and domains no evaluation row holds may still change.
Pure comparison of two resolved recipes; no torch import.
"""

from __future__ import annotations

from typing import Any

from adaptercl.recipe import RecipeConfig

# Recipe-level fields that change neither what is trained nor what is measured: free to change between invocations.
FREE_FIELDS = ("output_dir", "report_to", "log")
HOW_TO = "keep the run's stages and domains as they were (new ones may only be appended) or choose another output_dir"


def growth_refusal(run: RecipeConfig, new: RecipeConfig) -> str | None:
    """None when `new` equals the recipe of the run (`run`) or extends it; else one line saying what differs."""
    old_raw, new_raw = run.model_dump(mode="json"), new.model_dump(mode="json")
    for name in FREE_FIELDS:
        old_raw.pop(name, None), new_raw.pop(name, None)
    old_stages, new_stages = old_raw.pop("stages"), new_raw.pop("stages")
    if len(new_stages) < len(old_stages):
        names = ", ".join(s["name"] for s in old_stages)
        return f"the run has {len(old_stages)} stages ({names}), this recipe {len(new_stages)}; {HOW_TO}"
    for i, (old, stage) in enumerate(zip(old_stages, new_stages)):
        diff = first_difference(old, stage)
        if diff is not None:
            return f"stage {i + 1} {old['name']!r} differs from the run's: {_describe(diff)}; {HOW_TO}"
    old_domains, new_domains = old_raw.pop("domains"), new_raw.pop("domains")
    prefix = _prefix_refusal("domains", old_domains, new_domains, lambda d: d["name"])
    if prefix is not None:
        return prefix
    old_probes, new_probes = old_raw["eval"].pop("retention_probes"), new_raw["eval"].pop("retention_probes")
    prefix = _prefix_refusal("eval.retention_probes", old_probes, new_probes, str)
    if prefix is not None:
        return prefix
    diff = first_difference(old_raw, new_raw)
    if diff is not None:
        return f"{_describe(diff)} differs from the run's; {HOW_TO}"
    return None


def _prefix_refusal(what: str, old: list, new: list, name: Any) -> str | None:
    """`new` must begin with every item of `old`, equal and in order."""
    if len(new) < len(old):
        missing = ", ".join(name(item) for item in old[len(new) :])
        return f"{what}: the run's {missing} is missing from this recipe; {HOW_TO}"
    for i, (before, now) in enumerate(zip(old, new)):
        if name(before) != name(now):
            return f"{what}: item {i + 1} is {name(now)!r} here but {name(before)!r} in the run; {HOW_TO}"
        diff = first_difference(before, now)
        if diff is not None:
            return f"{what}.{name(before)} differs from the run's: {_describe(diff)}; {HOW_TO}"
    return None


def first_difference(old: Any, new: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """The first (dotted path, value in `old`, value in `new`) where two JSON-like values differ, or None."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in [*old, *(k for k in new if k not in old)]:
            diff = first_difference(old.get(key), new.get(key), f"{path}.{key}" if path else key)
            if diff is not None:
                return diff
        return None
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for i, (a, b) in enumerate(zip(old, new)):
            diff = first_difference(a, b, f"{path}[{i}]")
            if diff is not None:
                return diff
        return None
    return None if old == new else (path, old, new)


def _describe(diff: tuple[str, Any, Any]) -> str:
    path, old, new = diff
    return f"{path} {new!r} here vs {old!r} in the run"
