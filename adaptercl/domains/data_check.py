"""`check_domain_data`: `recipe validate`'s reading of a domain's data, before any model loads.

The first `CHECKED_ROWS` rows of each source this machine holds (a local file or folder, a hub dataset in the local
hub cache) are read and rendered as the run will read them, by the same functions (`loading.source_rows`,
`loading.rows_to_examples`): the answer kind is read off their answer column (`gold_answers.settle_answer_kind`) and
their golds are held against the reward (`gold_answers.check_golds`). So a template placeholder that names no
column, a row that is not the format's (`format: tooluse` on another file's records) or an answer column written
another way than the reward compares is one line at validation, naming the row schema the format expects, not an
error after the model has loaded or an accuracy of 0.

What is not read: a URL (the run downloads it) and a hub dataset whose files are not in the local hub cache
(`huggingface_hub`'s snapshot of the dataset repository, with `local_files_only`; the split's files are those whose
name starts with the split or that lie in a folder named after it, under the subset's folder when one is set).
Validation says so ("not checked") and downloads nothing. Builtin sources have no rows to read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from adaptercl.domains.datasets_formats import FORMATS
from adaptercl.domains.gold_answers import check_golds, settle_answer_kind
from adaptercl.domains.loading import Source, read_rows, resolve_sources, rows_to_examples, source_rows
from adaptercl.recipe import DATA_SUFFIXES, DomainConfig, RecipeError, hub_id

CHECKED_ROWS = 32  # enough for an index column to show its 0 or its last option (the kind it is) in most files


def check_domain_data(cfg: DomainConfig, rows: int = CHECKED_ROWS) -> str | None:
    """Read and render the first `rows` rows of each source of `cfg` that is here; return the line `recipe
    validate` prints about it (None for a builtin source). A problem is a RecipeError line."""
    if cfg.source.startswith("builtin:"):
        return None
    fmt = FORMATS[cfg.format or "generic"]
    train, evaluation = resolve_sources(cfg)
    read, unread = [], []
    for split, source in (("train", train), ("eval", evaluation)):
        if source is None:
            continue
        found = _first_rows(cfg, source, rows)
        if found is None:
            unread.append(source)
        else:
            read.append((split, found))
    unchecked = _unreachable(cfg, unread)
    if not read:
        return f"{cfg.name}: data not checked: {unchecked}"
    settled = settle_answer_kind(cfg, [row for _, (_, numbered) in read for _, row in numbered])
    skipped = [0]  # rows skip_malformed skips, as the run would
    examples = [ex for split, found in read for ex in rows_to_examples(settled, fmt, found, split, skipped)]
    check_golds(settled, cfg.reward or fmt.reward, examples)
    where = " and ".join(f"the first {len(numbered)} rows of {text}" for _, (text, numbered) in read)
    notes = [f"{skipped[0]} malformed, skipped (skip_malformed)"] if skipped[0] else []
    if settled.answer_kind is not None:
        notes.append(
            f"answer column read as {settled.answer_kind}" + ("" if cfg.answer_kind else " (from its values)")
        )
    line = f"{cfg.name}: {where} read and rendered as the run reads them" + "".join(f"; {n}" for n in notes)
    return line + (f"; not checked: {unchecked}" if unchecked else "")


def _first_rows(cfg: DomainConfig, source: Source, rows: int) -> tuple[str, list[tuple[int, Any]]] | None:
    """The first rows of a source that is on this machine, or None (a URL; a hub dataset not in the hub cache)."""
    kind, where = source
    if kind == "file":
        return source_rows(cfg, source, rows)
    files = cached_hub_files(hub_id(cfg.source), cfg.subset, where) if kind == "hub" else []
    if not files:
        return None
    try:
        return f"{hub_id(cfg.source)}[{where}] (local hub cache)", read_rows(files[0], rows)
    except RecipeError:  # a cached file of another layout (JSON lines named .json): left to the run's reader
        return None


def _unreachable(cfg: DomainConfig, sources: list[Source]) -> str:
    """What was not read, and why, in words ('' when all was)."""
    urls = [where for kind, where in sources if kind == "url"]
    splits = [where for kind, where in sources if kind == "hub"]
    parts = [f"{', '.join(urls)} ({'URLs' if len(urls) > 1 else 'a URL'}, which the run downloads)"] if urls else []
    if splits:
        named = f"split{'s' if len(splits) > 1 else ''} {', '.join(splits)}"
        parts.append(f"hub dataset {hub_id(cfg.source)} {named} (not in the local hub cache; the run downloads it)")
    return "; ".join(parts)


def cached_hub_files(repo_id: str, subset: str | None, split: str) -> list[Path]:
    """The data files of `split` (and `subset`) of a hub dataset in the local hub cache, sorted; [] when it is not
    cached. Looks, never downloads."""
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo_id, repo_type="dataset", local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached (or no cache at all): nothing to read here
        return []
    found = []
    for file in sorted(folder.rglob("*")):
        if file.suffix.lower() not in DATA_SUFFIXES or not file.is_file():
            continue
        folders = [part.lower() for part in file.relative_to(folder).parts[:-1]]
        in_split = file.name.lower().startswith(split.lower()) or split.lower() in folders
        if in_split and (subset is None or subset.lower() in folders):
            found.append(file)
    return found
