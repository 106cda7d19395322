"""The `adaptercl` command: a thin shell over public functions.

    adaptercl recipe run FILE [key=value ...]       run or resume a continual sequence
    adaptercl recipe validate FILE [key=value ...]  check a recipe without loading anything heavy
    adaptercl recipe show FILE [key=value ...]      print the resolved recipe (defaults merged into stages)
    adaptercl report RUN_DIR                        write RUN_DIR/report.md and plots/

Every subcommand parses, calls one function and returns an exit code. Recipe and input problems
(`RecipeError`) print one line `error: ...` and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from adaptercl.config import RecipeError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="adaptercl", description="Continual LoRA post-training of LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    recipe = sub.add_parser("recipe", help="run, validate or show a recipe").add_subparsers(
        dest="action", required=True
    )
    for action, help_text in (
        ("run", "run (or resume) every stage of a recipe"),
        ("validate", "validate a recipe and exit"),
        ("show", "print the resolved recipe"),
    ):
        p = recipe.add_parser(action, help=help_text)
        p.add_argument("file", help="recipe YAML file")
        p.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. stages.math.optim.lr=5e-6")
    report = sub.add_parser("report", help="write report.md and plots for a run directory")
    report.add_argument("run_dir", help="a run directory (output_dir of a recipe)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("ADAPTERCL_LOG", "WARNING"), format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "recipe":
            return _recipe(args)
        if args.command == "report":
            from adaptercl.report import write_report

            print(write_report(args.run_dir))
            return 0
    except RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    return 1


def _recipe(args: argparse.Namespace) -> int:
    from adaptercl.recipe import load_recipe, resolved_yaml

    recipe = load_recipe(args.file, args.overrides)
    if args.action == "validate":
        print(f"ok: {args.file} ({len(recipe.stages)} stages, {len(recipe.domains)} domains)")
        return 0
    if args.action == "show":
        print(resolved_yaml(recipe), end="")
        return 0
    from adaptercl.console import run_with_progress

    run_with_progress(recipe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
