"""`python -m adaptercl.cli ...` with a record of every write under ADAPTERCL_TEST_WATCH: a Python audit hook notes
files opened for writing, folders made, renames and removals there, and at exit the list goes to
ADAPTERCL_TEST_WRITES/rank-<RANK>.json (outside the watched folder). Used by tests/test_distributed.py."""

from __future__ import annotations

import atexit
import json
import os
import sys

WATCH = os.path.realpath(os.environ["ADAPTERCL_TEST_WATCH"])
OUT = os.environ["ADAPTERCL_TEST_WRITES"]
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
writes: list[str] = []


def _watched(path) -> str | None:
    if isinstance(path, int) or path is None:
        return None
    try:
        full = os.path.realpath(os.fsdecode(path))
    except (TypeError, ValueError):
        return None
    return full if full == WATCH or full.startswith(WATCH + os.sep) else None


def _hook(event: str, args: tuple) -> None:
    if event == "open":
        path, mode, flags = args
        writing = any(c in (mode or "") for c in "wax+") if mode else bool((flags or 0) & WRITE_FLAGS)
        paths = [path] if writing else []
    elif event in ("os.mkdir", "os.remove", "os.rmdir", "os.truncate", "shutil.rmtree", "os.unlink"):
        paths = [args[0]]
    elif event == "os.rename":
        paths = [args[0], args[1]]
    else:
        return
    for p in paths:
        full = _watched(p)
        if full is not None:
            writes.append(f"{event} {full}")


def _dump() -> None:
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, f"rank-{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(writes, f)


if __name__ == "__main__":
    sys.addaudithook(_hook)
    atexit.register(_dump)
    from adaptercl.cli import main

    sys.exit(main(sys.argv[1:]))
