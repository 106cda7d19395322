"""Import time of the torch-free recipe grammar (issue 27): each case in a fresh interpreter, timed inside it.

    python benchmarks/perf/recipe_import.py [--repeats 20]

Cases, timed inside the fresh interpreter (its start-up excluded): `import adaptercl.recipe` (the folder's face: it
loads nothing until a name is used); every module of `adaptercl/recipe/`; `load_recipe` of the quickstart recipe (the
grammar at work: YAML, defaults, validation). Each records whether torch, transformers or peft ended up in
`sys.modules` (tests/test_layering.py asserts they do not for the grammar; this file records how long it takes).
Timed from outside, start-up included: `python -c pass`, and `python -m adaptercl.cli recipe validate` of the
quickstart (the command a user runs: the grammar, then the preflight checks, which do load torch).
Writes benchmarks/perf/results/recipe_import.json (with benchmarks/provenance.py's command, machine, versions and
git revision) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for the shared provenance.py
from perf_common import write_result  # noqa: E402
from provenance import markdown_table, provenance, spread  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
HEAVY = ("torch", "transformers", "peft")


def grammar_modules() -> list[str]:
    return sorted(f"adaptercl.recipe.{p.stem}" for p in (REPO / "adaptercl" / "recipe").glob("*.py"))


CASES = {
    "import adaptercl.recipe": "import adaptercl.recipe",
    "every recipe/ module": "\n".join(f"import {m}" for m in grammar_modules()),
    "load_recipe(quickstart)": f"from adaptercl.recipe import load_recipe\nload_recipe({str(QUICKSTART)!r})",
}


def timed_in_child(code: str) -> tuple[float, list[str]]:
    """Seconds the code takes inside a fresh interpreter, and the heavy packages it left in sys.modules."""
    wrapper = (
        "import sys, time, json\nt0 = time.perf_counter()\n"
        + code
        + f"\nprint(json.dumps([time.perf_counter() - t0, sorted(set({HEAVY!r}) & set(sys.modules))]))"
    )
    out = subprocess.run([sys.executable, "-c", wrapper], cwd=REPO, capture_output=True, text=True, check=True)
    seconds, heavy = json.loads(out.stdout.strip().splitlines()[-1])
    return seconds, heavy


def timed_command(argv: list[str]) -> float:
    """Wall seconds of a command, interpreter start included."""
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=REPO, capture_output=True, check=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    results, rows = {}, []
    for name, code in CASES.items():
        runs = [timed_in_child(code) for _ in range(args.repeats)]
        results[name] = {"seconds": spread([s for s, _ in runs]), "heavy_modules_loaded": runs[-1][1]}
        rows.append([name, results[name]["seconds"]["median"], results[name]["seconds"]["max"], runs[-1][1] or "none"])
    commands = {
        "python -c pass (wall)": [sys.executable, "-c", "pass"],
        "adaptercl recipe validate (wall)": [
            sys.executable,
            "-m",
            "adaptercl.cli",
            "recipe",
            "validate",
            str(QUICKSTART),
        ],
    }
    for name, argv in commands.items():
        wall = [timed_command(argv) for _ in range(args.repeats)]
        results[name] = {"seconds": spread(wall)}
        rows.append([name, spread(wall)["median"], max(wall), "-"])
    path = write_result("recipe_import", {**provenance(), "repeats": args.repeats, "results": results})
    print(markdown_table(["case", "median s", "max s", "heavy modules loaded"], rows))
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
