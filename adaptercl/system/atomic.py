"""Atomic writes: every file and folder a run produces is written to a temporary name and renamed.

A killed run therefore leaves either the old complete output or none, never a half-written one. Replacing a folder
takes two renames (POSIX has no portable atomic swap of two folders): the old one is parked as `.NAME.old-PID`, then
the new one takes its name. A kill between the two leaves no `NAME`, only the parked copy, complete;
`recover_dir` puts it back (a reader calls it before deciding that `NAME` is absent) and deletes what an interrupted
write left.

Reading a record back is `read_record`, the one reader of every JSON (and YAML) record the package writes and reads
again (a run directory's done.json, eval.json, summary.json, ..., an adapter's adapter_config.json, an export's
manifest.json, a model folder's config.json): a file a full disk left empty, a copy cut short or a web page saved
in its place is one `RecipeError` line naming the file and how to redo it, never a traceback and never taken as
present.

A command's output folder (`--out` of export, eval and merge) is checked before anything loads by
`check_new_folder`: not a file, not under one, and new or empty, so a wrong `--out` is one line, not a traceback after
the work or a folder replaced whole.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from adaptercl.recipe import RecipeError


def write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a temp file in the same folder and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2) + "\n")


def append_line(path: str | Path, line: str) -> None:
    """Append one line (a JSONL record); a torn last line is the only possible partial write."""
    with open(path, "a") as f:
        f.write(line.rstrip("\n") + "\n")
        f.flush()


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a JSONL file; a torn last line (a run killed mid-write) is skipped. Missing file: []."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def read_record(path: str | Path, fix: str, keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """The mapping a JSON record (YAML for a `.yaml` file) at `path` holds. One that does not parse (empty, as a copy
    onto a full disk leaves it; cut short; not JSON: a web page saved in its place), is not a mapping or lacks one of
    `keys` is a RecipeError, one line: `<path> is not valid JSON (<why>): <fix>`, `fix` saying what to delete or
    rerun to redo it. A missing file is the caller's to decide (FileNotFoundError)."""
    path = Path(path)
    kind, parse = _PARSERS.get(path.suffix, _PARSERS[".json"])
    data, record, why = path.read_bytes(), None, None
    if not data.strip():
        why = "empty"
    elif data.lstrip()[:1] == b"<":
        why = "an HTML or XML page"
    else:
        try:
            record = parse(data.decode("utf-8"))
        except UnicodeDecodeError:
            why = "not text"
        except (ValueError, yaml.YAMLError) as err:  # json.JSONDecodeError is a ValueError
            why = _parse_problem(err)
    if why is None and not isinstance(record, dict):
        why = f"a {type(record).__name__}, not a mapping"
    if why is not None:
        raise RecipeError(f"{path} is not valid {kind} ({why}): {fix}")
    missing = [key for key in keys if key not in record]
    if missing:
        raise RecipeError(f"{path} has no {missing[0]!r} (edited or cut short?): {fix}")
    return record


def _parse_problem(err: Exception) -> str:
    """What a parser said, short: `Expecting value: line 1 column 1`."""
    if isinstance(err, json.JSONDecodeError):
        return f"{err.msg}: line {err.lineno} column {err.colno}"
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).strip().splitlines()[0]
    return f"{problem}: line {mark.line + 1} column {mark.column + 1}" if mark is not None else problem


_PARSERS: dict[str, tuple[str, Callable[[str], Any]]] = {
    ".json": ("JSON", json.loads),
    ".yaml": ("YAML", yaml.safe_load),
}


def parked_dirs(target: str | Path) -> list[Path]:
    """The copies of `target` that `atomic_dir` parked (`.NAME.old-PID`), newest first."""
    target = Path(target)
    parked = [p for p in target.parent.glob(f".{target.name}.old-*") if p.is_dir()]
    return sorted(parked, key=lambda p: p.stat().st_mtime_ns, reverse=True)


def recover_dir(target: str | Path) -> None:
    """Undo a kill during `atomic_dir`: when `target` is missing but a parked copy of it exists (a kill between the
    two renames), the newest parked copy (complete: it was `target` until the kill) takes the name back. What else
    a kill left beside it is deleted: parked copies beside a present `target` (a kill while the old one was being
    deleted) and temp folders (a kill while the new one was being written, or between the renames: it may be
    incomplete). For a folder that no other process is writing meanwhile (a run's checkpoint)."""
    target = Path(target)
    parked = parked_dirs(target)
    if parked and not target.exists():
        os.replace(parked[0], target)
        parked = parked[1:]
    for stale in [*parked, *target.parent.glob(f".{target.name}.tmp-*")]:
        shutil.rmtree(stale, ignore_errors=True)


class atomic_dir:
    """Context manager: yields a temp folder beside `target`; on success it replaces `target` whole.

    With `keep_existing=True` an already present `target` wins (a cache filled by another process)."""

    def __init__(self, target: str | Path, keep_existing: bool = False):
        self.target = Path(target)
        self.keep_existing = keep_existing

    def __enter__(self) -> Path:
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.tmp-", dir=self.target.parent))
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or (self.keep_existing and self.target.exists()):
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        if self.target.exists():
            old = self.target.with_name(f".{self.target.name}.old-{os.getpid()}")
            os.replace(self.target, old)
            os.replace(self.tmp, self.target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.tmp, self.target)


def check_new_folder(out: str | Path, command: str, replaceable: str | None = None) -> None:
    """`command`'s `--out` must be a new or empty folder (or one holding the file `replaceable`, a command's own
    earlier output it replaces whole), and neither a file nor under one: else one RecipeError line saying which."""
    out = Path(out)
    for part in (out, *out.parents):
        if part.exists():
            if not part.is_dir():
                where = "is" if part == out else f"lies under {str(part)!r}, which is"
                raise RecipeError(f"{command}: --out {str(out)!r} {where} a file; choose a new folder")
            break
    if out.is_dir() and any(out.iterdir()) and not (replaceable and (out / replaceable).is_file()):
        raise RecipeError(f"{command}: --out {str(out)!r} exists and is not empty; choose a new folder")
