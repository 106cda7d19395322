"""The `adaptercl` command: a thin shell over public functions.

    adaptercl recipe run FILE [key=value ...]       run or resume a continual sequence
    adaptercl recipe validate FILE [key=value ...]  check a recipe, and what it names on this machine (files,
                                                    reward imports, vLLM, the first rows of each domain's data),
                                                    without loading anything heavy; print how each domain decides
                                                    correct and success, and what validation capped
    adaptercl recipe show FILE [key=value ...]      print the resolved recipe (defaults merged into stages)
    adaptercl recipe serve FILE [key=value ...] [--port 8000] [--tensor-parallel-size N] [--data-parallel-size N]
                           [--print-command]        the vLLM rollout server for `rollout.engine: vllm_server`
    adaptercl recipe plan FILE [key=value ...] [--gpu-memory 24] [--prompt-tokens 1024] [--card rtx4090]
                           [--rehearsal JSON]       predicted peak GPU memory of training, rollouts, evaluation and
                                                    diagnostics, the fields to change when it does not fit, and the
                                                    wall time on the card with each figure's source (with
                                                    --rehearsal: from a rehearsal's measurements on its machine);
                                                    exit 0 when it fits, 1 when not (nothing is downloaded)
    adaptercl recipe rehearse FILE [key=value ...] [--minutes N] [--out DIR] [--random-weights]
                                                    the recipe's real loop on this machine for a few minutes (a few
                                                    steps a stage, a few examples and prompts): per phase the step
                                                    seconds, decode rate, sampled lengths and peak memory beside the
                                                    plan, in DIR/rehearsal.json; a phase that fails: one line naming
                                                    it and the setting to change, exit 1
    adaptercl report RUN_DIR                        write RUN_DIR/report.md and plots/
    adaptercl eval [RECIPE] [key=value ...] (--run RUN_DIR | --adapter DIR [--adapter DIR ...]) --out OUT
                                                    evaluate a finished run's stages (default recipe: the run's
                                                    own) or PEFT adapter folders on a recipe's domains and probes,
                                                    without training: OUT/<label>/eval.json + summary.json
    adaptercl merge ADAPTER... --out DIR [--method ties --weights 1,-1 --density 0.2 --rank 16]
                           [--allow-different-bases]
                                                    ΔW-space merge of PEFT adapter folders into one (of one
                                                    base model unless allowed: a base and its fine-tune)
    adaptercl export RUN_DIR --out DIR [--merged]   one PEFT adapter folder per domain + model cards + manifest
    adaptercl serve DIR [--port 8000] [--tensor-parallel-size N] [--data-parallel-size N] [--print-command]
                                                    serve an export with vLLM's OpenAI server, one LoRA per domain

Every subcommand parses, calls one function and returns an exit code. Recipe and input problems
(`RecipeError`, a rollout server that does not answer before the run starts among them) print one line
`error: ...` and exit 2, never a traceback; a rollout server that becomes unreachable or fails during the run
(`RolloutServerError`) prints one line and exits 3 (the run keeps its last checkpoint: rerun to resume); a
lost data-parallel rank (`system.distributed.RankLost`) prints one line and exits 1. `recipe run` under torchrun /
accelerate launch trains data-parallel (`system/distributed.py`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

from adaptercl.recipe import RecipeError
from adaptercl.rollout import RolloutServerError

PLAN_CARDS = ("rtx3090", "rtx4090")  # plan.wall_time.CARDS (not imported here: the command starts light)


def main(argv: list[str] | None = None) -> int:
    entered = time.monotonic()  # a command's own clock (`recipe rehearse` counts its minutes from here)
    parser = argparse.ArgumentParser(prog="adaptercl", description="Continual LoRA post-training of LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    recipe = sub.add_parser("recipe", help="run, validate or show a recipe").add_subparsers(
        dest="action", required=True
    )
    for action, help_text in (
        ("run", "run (or resume) every stage of a recipe"),
        ("validate", "validate a recipe and exit"),
        ("show", "print the resolved recipe"),
        ("plan", "predict peak GPU memory per phase and the wall time, before any download"),
        ("rehearse", "run the recipe's real loop for a few minutes, measured, and write rehearsal.json"),
        ("serve", "start the vLLM server a `rollout.engine: vllm_server` recipe rolls out from"),
    ):
        p = recipe.add_parser(action, help=help_text)
        p.add_argument("file", help="recipe YAML file")
        p.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. stages.math.optim.lr=5e-6")
        if action == "plan":
            p.add_argument("--gpu-memory", type=float, default=24.0, help="GPU memory in GiB (default 24)")
            p.add_argument("--prompt-tokens", type=int, default=1024, help="longest prompt in tokens (default 1024)")
            p.add_argument("--card", choices=PLAN_CARDS, default="rtx4090", help="the card of the wall time")
            p.add_argument("--rehearsal", help="a rehearsal.json (`recipe rehearse`): the wall time it measured")
        if action == "rehearse":
            p.add_argument("--minutes", type=float, help="time limit (default 10 on a GPU, 4 on the CPU)")
            p.add_argument("--out", help="folder of rehearsal.json (default: the recipe's output_dir + -rehearsal)")
            p.add_argument("--random-weights", action="store_true", help="the model's shape, random: no download")
        if action == "serve":
            _server_options(p)
    report = sub.add_parser("report", help="write report.md and plots for a run directory")
    report.add_argument("run_dir", help="a run directory (output_dir of a recipe)")
    ev = sub.add_parser("eval", help="evaluate a finished run or PEFT adapter folders, without training")
    ev.add_argument(
        "file", nargs="?", help="recipe YAML: model, domains, eval settings (with --run: default the run's)"
    )
    ev.add_argument("overrides", nargs="*", help="key.path=value overrides of the recipe (or of the run's)")
    source = ev.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", help="a finished run directory: every stage's model as the run evaluated it")
    source.add_argument("--adapter", action="append", help="a PEFT adapter folder (repeat for several)")
    ev.add_argument("--out", required=True, help="output folder (new or empty; written at the end)")
    merge = sub.add_parser("merge", help="ΔW-space merge of PEFT adapter folders, re-factorised to one adapter")
    merge.add_argument("adapters", nargs="+", help="PEFT adapter folders (adapter_config.json + safetensors)")
    merge.add_argument("--out", required=True, help="output folder (a PEFT adapter, written atomically)")
    merge.add_argument("--method", default="task_arithmetic", help="task_arithmetic, ties, dare_linear or dare_ties")
    merge.add_argument("--weights", help="comma-separated, one per adapter (default: equal)")
    merge.add_argument("--density", type=float, default=1.0, help="TIES/DARE density (default 1: keep all)")
    merge.add_argument("--rank", type=int, help="rank of the written adapter (default: the largest input rank)")
    merge.add_argument("--seed", type=int, default=0, help="seed of the DARE masks")
    merge.add_argument(
        "--allow-different-bases",
        action="store_true",
        help="merge adapters whose configs name different base models (a base and its fine-tune)",
    )
    export = sub.add_parser("export", help="write one PEFT adapter per trained domain, model cards and a manifest")
    export.add_argument("run_dir", help="a finished run directory")
    export.add_argument("--out", required=True, help="output folder (new or empty; written atomically)")
    export.add_argument("--merged", action="store_true", help="also export the final all-domain adapter as combined/")
    serve = sub.add_parser("serve", help="serve an exported folder with vLLM (OpenAI API), one LoRA per adapter")
    serve.add_argument("export_dir", help="a folder written by `adaptercl export`")
    _server_options(serve)
    args = parser.parse_args(argv)
    args.entered = entered
    logging.basicConfig(level=os.environ.get("ADAPTERCL_LOG", "WARNING"), format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "recipe":
            return _recipe(args)
        if args.command == "report":
            from adaptercl.measure import write_report

            print(write_report(args.run_dir))
            return 0
        if args.command == "eval":
            return _eval(args)
        if args.command == "merge":
            return _merge(args)
        if args.command == "export":
            from adaptercl.ship import export_run

            print(export_run(args.run_dir, args.out, merged=args.merged))
            return 0
        if args.command == "serve":
            return _serve(args)
    except RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RolloutServerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    except RuntimeError as err:
        from adaptercl.system import RankLost

        if not isinstance(err, RankLost):
            raise
        print(f"error: {err}", file=sys.stderr)  # a data-parallel rank died or timed out: one line per survivor
        return 1
    except KeyboardInterrupt:
        rehearsal = getattr(args, "action", None) == "rehearse"  # nothing to resume: its run folder is gone
        print("interrupted" + ("" if rehearsal else "; rerun the same command to resume"), file=sys.stderr)
        return 130
    return 1


def _recipe(args: argparse.Namespace) -> int:
    from adaptercl.recipe import load_recipe, resolved_yaml

    recipe = load_recipe(args.file, args.overrides)
    if args.action == "validate":
        from adaptercl.rollout import resolve_engine
        from adaptercl.run import decision_lines, preflight

        recipe, choice = resolve_engine(recipe)
        data = preflight(recipe, contact_server=False)  # a rollout server may be started later; the run contacts it
        print(f"ok: {args.file} ({len(recipe.stages)} stages, {len(recipe.domains)} domains); {choice.line()}")
        lines = [*decision_lines(recipe), *data, *recipe.validation_notes()]
        print("".join(f"  {line}\n" for line in lines), end="")
        return 0
    if args.action == "serve":
        from adaptercl.ship import rollout_server_command, serve_rollouts

        return _serve_with(args, rollout_server_command, serve_rollouts, recipe)
    if args.action == "show":
        print(resolved_yaml(recipe), end="")
        return 0
    if args.action == "plan":
        from adaptercl.plan import plan_recipe

        plan = plan_recipe(recipe, args.gpu_memory, args.prompt_tokens, args.card)
        if args.rehearsal is not None:  # the wall time as the rehearsal measured it on its machine
            from adaptercl.plan import measured_wall_time, read_rehearsal

            plan.wall_time = measured_wall_time(recipe, read_rehearsal(args.rehearsal), plan.wall_time)
        print(plan.render())
        return 0 if plan.fits else 1
    if args.action == "rehearse":
        return _rehearse(args, recipe)
    from adaptercl.console import run_with_progress

    run_with_progress(recipe)
    return 0


def _rehearse(args: argparse.Namespace, recipe: Any) -> int:
    from pathlib import Path

    from adaptercl.console import PlainProgress
    from adaptercl.plan import beside_plan
    from adaptercl.run import rehearse

    out = Path(args.out or recipe.output_dir.rstrip("/\\") + "-rehearsal")
    source = {"file": args.file, "overrides": list(args.overrides)}
    progress = PlainProgress(recipe, sys.stderr)  # progress on stderr, the figures on stdout
    done = rehearse(recipe, out, args.minutes, args.random_weights, progress, source, time.monotonic() - args.entered)
    print(beside_plan(recipe, done.result))
    print(f"written: {done.path} (the whole plan: adaptercl recipe plan {args.file} --rehearsal {done.path})")
    if done.failure is not None:
        print(f"error: {done.failure}", file=sys.stderr)
        return 1
    return 0


def _eval(args: argparse.Namespace) -> int:
    from adaptercl.recipe import load_recipe
    from adaptercl.run import evaluate_adapters, evaluate_run, format_summary

    if args.file is not None and "=" in args.file and not os.path.isfile(args.file):  # overrides, no recipe
        args.file, args.overrides = None, [args.file, *args.overrides]
    if args.file is None and args.run is not None and args.overrides:  # overrides of the run's own recipe
        from adaptercl.run_dir import RECIPE_FILE

        args.file = (
            os.path.join(args.run, RECIPE_FILE) if os.path.isfile(os.path.join(args.run, RECIPE_FILE)) else None
        )
    if args.file is None and (args.adapter or args.overrides):
        raise RecipeError("eval: name a recipe (its model, domains and eval settings) before overrides or --adapter")
    recipe = load_recipe(args.file, args.overrides) if args.file is not None else None
    if args.run is not None:
        out = evaluate_run(args.run, args.out, recipe)
    else:
        out = evaluate_adapters(recipe, args.adapter, args.out)
    print(format_summary(out))
    return 0


def _merge(args: argparse.Namespace) -> int:
    from adaptercl.adapters import merge_adapter_folders

    weights = None
    if args.weights is not None:
        try:
            weights = [float(w) for w in args.weights.split(",")]
        except ValueError:
            raise RecipeError(f"merge: --weights must be comma-separated numbers, got {args.weights!r}") from None
    report = merge_adapter_folders(
        args.adapters, args.out, args.method, weights, args.density, args.rank, args.seed, args.allow_different_bases
    )
    for line in report["warnings"]:  # an input that already holds another's ΔW
        print(f"warning: {line}", file=sys.stderr)
    print(
        f"wrote {args.out} (rank {report['rank']}, {len(report['rel_error'])} modules); relative Frobenius error "
        f"of the re-factorisation: mean {report['rel_error_mean']:.3g}, max {report['rel_error_max']:.3g}"
    )
    return 0


def _server_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--host", help="host to bind (default: vLLM's, all interfaces)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs one replica is sharded over (default 1)")
    p.add_argument("--data-parallel-size", type=int, default=1, help="replicas behind the one address (default 1)")
    p.add_argument("--print-command", action="store_true", help="print the vllm serve command and exit")


def _serve(args: argparse.Namespace) -> int:
    from adaptercl.ship import serve, serve_command

    return _serve_with(args, serve_command, serve, args.export_dir)


def _serve_with(args: argparse.Namespace, command: Any, run: Any, what: Any) -> int:
    """Print `command(what, ...)` with --print-command, else `run` it (which replaces this process)."""
    import shlex

    parallel = {"tensor_parallel_size": args.tensor_parallel_size, "data_parallel_size": args.data_parallel_size}
    if args.print_command:
        print(shlex.join(command(what, args.port, args.host, **parallel)))
        return 0
    run(what, args.port, args.host, **parallel)  # replaces this process with the server
    return 1


if __name__ == "__main__":
    sys.exit(main())
