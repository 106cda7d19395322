"""A 24 GB rehearsal in one command: the real loop of a shipped 24 GB recipe on random weights of the 7B shape, on a
card capped at 24 GiB, with each phase's peak memory, the step and decode times, and the plan's prediction beside them.

Nothing is downloaded. The model is a random bf16 checkpoint of Qwen2.5-7B-Instruct's shape with adaptercl's
byte-level ChatML tokenizer (`random_checkpoint.write_random_checkpoint`, ~15 GB written once to `--checkpoint-dir`),
loaded as the recipe says (NF4). The recipe (default recipes/hybrid.yaml) runs through `run.sequence.run_recipe`,
every stage, the evaluations before and after each, and the end-of-stage diagnostics (teacher lift, parameter and
response drift, stage KL), with these changes, all recorded in the JSON (`changes`):
- its hub/URL domains become local synthetic ones of the same names in the gsm8k format (sums; a random model gets
  none right, so the hybrid distils every group, its costliest case) whose question is padded so every prompt is
  `--prompt-tokens` tokens long (default 1024, the plan's assumption; one byte is one token); the retention probes
  are left out unless `--probes`;
- `--steps` steps a stage (the first builds AdamW's state) of `--prompts-per-step` prompts (default 2 x 8 samples:
  one `rollout.batch_size` generate call a step; a micro-batch's peak does not depend on how many there are);
- evaluation and diagnostics shrunk to fit the time: `--eval-examples` examples a domain, `--eval-new-tokens` new
  tokens, 2 drift probes, 1 teacher-lift prompt, 2 stage-KL prompts. Rollouts keep the recipe's cap (384): random
  weights never sample the end token, so every response is at the cap, the plan's worst case.
The plan's prediction (`plan.memory.plan_recipe` on a 24 GiB card, prompts of `--prompt-tokens`) is taken for this
very recipe, once with the engine that ran (`plan_as_run`) and once as written (`plan_as_written`: auto = vLLM).

The cap: `torch.cuda.set_per_process_memory_fraction(24 GiB / the card)` bounds torch's allocator (the trainer and
what vLLM allocates through torch); `optim.micro_batch_size: auto` and vLLM's `gpu_memory_utilization: auto` are told
the card is 24 GiB (vLLM's share is rescaled to the real card so that it claims the same bytes). Phases are the
innermost of these open at each moment: load (the base), engine (starting the rollout engine), rollout (a stage's
loop outside the training step: generate, reward, checkpoints), train (`train_on_batch` and the distillation
targets), eval (`evaluate_all`), diagnostics (teacher lift, drift, stage KL). Per phase: torch's peak allocated and
reserved (reset between phases) and the device's used memory (total - free, polled every 20 ms: vLLM's own pool and
the CUDA context included) against the plan's phase of the same name. Step times are metrics.jsonl's; the decode step
is each generate call's time ÷ its longest response (the prefill included). Where vLLM does not import,
`rollout.engine: auto` runs the transformers engine, and `engine` in the JSON says so and why.

    python benchmarks/perf/rehearse_24gb.py                  # CUDA, every stage
    python benchmarks/perf/rehearse_24gb.py --deadline-s 300 --progress progress.json  # a lent GPU, a call timed:
        # no phase opens after 300 s (the figures so far are the result, `stopped` says where); progress.json is
        # rewritten as each phase closes, so a killed call still leaves its figures
    python benchmarks/perf/rehearse_24gb.py --tiny --out runs/rehearse-tiny   # CPU, 2 layers: the code path, seconds

writes benchmarks/perf/results/rehearse_24gb[-tiny].json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for the shared provenance.py
sys.path.insert(0, str(Path(__file__).resolve().parent))

from perf_common import HERE, write_result  # noqa: E402
from phase_meter import DeadlineReached, PhaseMeter  # noqa: E402
from provenance import markdown_table, provenance, spread  # noqa: E402
from random_checkpoint import QWEN25_7B, TINY, write_random_checkpoint  # noqa: E402

from adaptercl.model.shapes import GIB  # noqa: E402

CARD_GIB = 24.0
FILLER = "Read the question below with care and answer it. "
CHECKPOINT_LABEL = "<random checkpoint>"
PHASES = ("load", "engine", "rollout", "train", "eval", "diagnostics")


def shown(path: Path) -> str:
    """A path as a result records it: relative to the repository when inside it (no path of the machine)."""
    path, repo = path.resolve(), HERE.parent.parent.resolve()
    return str(path.relative_to(repo)) if path.is_relative_to(repo) else str(path)


def rehearsal_raw(args: argparse.Namespace, checkpoint: Path, work: Path) -> tuple[dict, dict]:
    """The recipe that runs (raw, before validation) and what was changed from the shipped one."""
    import yaml

    raw = yaml.safe_load(Path(args.recipe).read_text())
    probes = raw.get("eval", {}).get("retention_probes", []) if args.probes else []
    trained = {s["domain"] for s in raw["stages"]}
    names = [d["name"] for d in raw["domains"] if d["name"] in trained or d["name"] in probes]
    domains = [
        {"name": name, "source": str(write_domain(work / "data" / name, args.prompt_tokens)), "format": "gsm8k"}
        for name in names
    ]
    raw.update(model={**raw["model"], "name": str(checkpoint)}, output_dir=str(work / "run"), domains=domains)
    raw["optim"] = {**raw["optim"], "steps": args.steps, "prompts_per_step": args.prompts_per_step}
    raw["eval"] = {
        **raw.get("eval", {}),
        "examples_per_domain": args.eval_examples,
        "max_new_tokens": args.eval_new_tokens,
        "retention_probes": probes,
        "drift_probes": 2,
        "teacher_lift_prompts": 1,
        "stage_kl_prompts": 2,
    }
    if args.tiny:  # a CPU check of the code path: no NF4, short responses; CUDA's checkpointing, logit chunks and
        # micro-batches of several rows of a group (auto's split without CUDA would be 1 row at these sizes)
        raw["quantization"] = "none"
        raw["rollout"] = {**raw["rollout"], "max_new_tokens": args.tiny_new_tokens}
        cuda_like = {"activation_checkpointing": True, "logits_chunk_size": 4, "micro_batch_size": 4}
        raw["optim"] = {**raw["optim"], **cuda_like}
    changes = {
        "model": f"random weights of the {'tiny 2-layer' if args.tiny else 'Qwen2.5-7B'} shape, byte-level tokenizer",
        "domains": f"{', '.join(names)}: synthetic gsm8k-format rows (sums), prompts of {args.prompt_tokens} tokens",
        "optim": {"steps": args.steps, "prompts_per_step": args.prompts_per_step},
        "eval": raw["eval"],
        "rollout_max_new_tokens": raw["rollout"]["max_new_tokens"],
        "quantization": raw["quantization"],
    }
    return raw, changes


def write_domain(folder: Path, prompt_tokens: int) -> Path:
    """train.jsonl (64 rows) and test.jsonl (16) in the gsm8k format: sums whose question is padded so that the
    encoded prompt is `prompt_tokens` tokens (the byte tokenizer: one byte, one token)."""
    from adaptercl.domains.datasets_formats import GSM8K_SYSTEM, chat
    from adaptercl.model.base import build_byte_tokenizer
    from adaptercl.model.batching import encode_chat

    tok = build_byte_tokenizer()
    folder.mkdir(parents=True, exist_ok=True)
    for split, first, count in (("train", 0, 64), ("test", 64, 16)):
        rows = []
        for i in range(first, first + count):
            a, b = 17 * i + 3, 29 * i + 11
            question = f"What is {a} + {b}?"
            room = max(0, prompt_tokens - len(encode_chat(tok, chat(question, GSM8K_SYSTEM))))
            filler = (FILLER * (room // len(FILLER) + 1))[:room]
            rows.append({"question": filler + question, "answer": f"{a} + {b} = {a + b}.\n#### {a + b}"})
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def instrument(meter: PhaseMeter) -> None:
    """Open a phase around each function of the run that belongs to one (looked up where `run/sequence.py` and
    `train/stage.py` call them), and time the engines' generate calls."""
    import adaptercl.run.sequence as sequence
    import adaptercl.train.stage as stage
    from adaptercl.rollout.engines import Engines
    from adaptercl.rollout.hf import HFEngine
    from adaptercl.rollout.vllm import VLLMEngine  # imports vllm only when an engine starts

    meter.wrap(Engines, "for_model", "engine")
    meter.wrap(sequence, "run_stage", "rollout")
    meter.wrap(stage, "train_on_batch", "train")
    meter.wrap(stage, "distill_targets", "train")
    meter.wrap(sequence, "evaluate_all", "eval")
    for name in ("teacher_lift", "parameter_drift_report", "response_drift", "stage_kl"):
        meter.wrap(sequence, name, "diagnostics")
    meter.time_generate(HFEngine)
    meter.time_generate(VLLMEngine)


def cap_card(meter: PhaseMeter, total_gib: float) -> dict[str, Any]:
    """Make the card look 24 GiB: torch's allocator capped, the auto settings sized for 24 GiB (see the docstring)."""
    import torch

    import adaptercl.rollout.vllm as vllm_engine
    import adaptercl.train.micro_batch as micro_batch

    fraction = min(1.0, CARD_GIB / total_gib)
    torch.cuda.set_per_process_memory_fraction(fraction)
    capped = lambda device: min(CARD_GIB, total_gib) if device.type == "cuda" else None  # noqa: E731
    meter.patch(micro_batch, "card_gib", capped)
    meter.patch(vllm_engine, "card_gib", capped)
    share = vllm_engine.vllm_utilization  # of a 24 GiB card -> of the real one: the same bytes
    rescaled = lambda shape, recipe, card: share(shape, recipe, card) * card / total_gib  # noqa: E731
    meter.patch(vllm_engine, "vllm_utilization", rescaled)
    return {"card_gib": total_gib, "capped_to_gib": CARD_GIB, "memory_fraction": fraction}


def plan_phases(recipe: Any, prompt_tokens: int) -> dict[str, Any]:
    from adaptercl.plan.memory import plan_recipe

    plan = plan_recipe(recipe, gpu_memory_gib=CARD_GIB, prompt_tokens=prompt_tokens)
    phases = {p.name: {"stage": p.stage, "gib": p.gib, "limit_gib": p.limit_gib, "fits": p.fits} for p in plan.phases}
    return {"phases": phases, "fits": plan.fits, "text": plan.render()}


def step_times(recipe: Any, output_dir: Path) -> dict[str, list[dict[str, float]]]:
    from adaptercl.adapters.stacking import stage_dir_name

    out = {}
    for i, stage in enumerate(recipe.stages):
        path = output_dir / stage_dir_name(recipe, i) / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
        out[stage.name] = [
            {"step": r["step"], "time_step_s": r["time_step_s"], "time_rollout_s": r["time_rollout_s"]}
            for r in rows
            if "event" not in r
        ]
    return out


def rehearse(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch

    from adaptercl.recipe.grammar import resolve_recipe
    from adaptercl.rollout.engine_choice import with_engine
    from adaptercl.run.sequence import run_recipe

    cuda = not args.tiny
    t_start = time.perf_counter()
    shape, device = (TINY, "cpu") if args.tiny else (QWEN25_7B, "cuda")
    checkpoint = write_random_checkpoint(shape, args.checkpoint_dir, device)
    checkpoint_s = time.perf_counter() - t_start
    if cuda:
        torch.cuda.empty_cache()  # the shards' generator memory, before the cap
    raw, changes = rehearsal_raw(args, checkpoint, work)
    recipe = resolve_recipe(raw)
    meter = PhaseMeter(cuda, args.deadline_s, args.progress, start=t_start)
    card = cap_card(meter, torch.cuda.get_device_properties(0).total_memory / GIB) if cuda else None
    instrument(meter)
    events: dict[str, Any] = {"micro_batch": []}

    def on_event(kind: str, **info: Any) -> None:
        if kind == "rollout_engine":
            events["engine"] = {"engine": info["engine"], "reason": info["reason"]}
        elif kind == "engine":
            events["engine_description"] = info["description"]
        elif kind == "micro_batch":
            events["micro_batch"].append(f"{info['stage']}: {info['line']}")

    failure = stopped = None
    try:
        run_recipe(recipe, on_event)
    except DeadlineReached as err:
        stopped = str(err)
    except Exception as err:  # noqa: BLE001 - out of memory is the rehearsal's finding; keep the figures so far
        first = str(err).splitlines()[0] if str(err) else ""
        failure = {"phase": meter.failed_in or meter.stack[-1], "error": f"{type(err).__name__}: {first}"}
    finally:
        meter.close()
    engine = events.get("engine", {"engine": "?", "reason": "the run stopped before choosing"})
    if engine["engine"] == "hf":
        engine["note"] = "vLLM was not used: the transformers engine was measured (rollouts and evaluation)"
    as_run = plan_phases(with_engine(recipe, engine["engine"]), args.prompt_tokens) if engine["engine"] != "?" else {}
    as_written = plan_phases(recipe, args.prompt_tokens)
    for plan in (as_run, as_written):  # the plan names its model by path: a path of this machine
        if "text" in plan:
            plan["text"] = plan["text"].replace(str(checkpoint), CHECKPOINT_LABEL)
    phases = {}
    for name in PHASES:
        planned = as_run.get("phases", {}).get(name)
        phases[name] = {
            "seconds": meter.seconds.get(name, 0.0),
            **meter.peaks.get(name, {}),
            "planned_gib": None if planned is None else planned["gib"],
        }
    return {
        "recipe": shown(args.recipe),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "card": card,
        "engine": {**engine, "description": events.get("engine_description")},
        "changes": changes,
        "failed": failure,
        "stopped": stopped,
        "phases": phases,
        "plan_as_run": as_run,
        "plan_as_written": as_written,
        "calls": dict(meter.calls),  # seconds per instrumented function (nested calls counted in each)
        "step_times": step_times(recipe, work / "run"),
        "decode_step_s": {phase: spread(values) for phase, values in meter.decode.items()},
        "micro_batches": events["micro_batch"],
        "checkpoint_s": checkpoint_s,
        "total_s": time.perf_counter() - t_start,
    }


def markdown(result: dict[str, Any]) -> str:
    rows = []
    for name, p in result["phases"].items():
        gib = [p.get(k) for k in ("peak_reserved_gib", "device_used_peak_gib", "planned_gib")]
        rows.append([name, f"{p['seconds']:.1f}", *("-" if v is None else f"{v:.2f}" for v in gib)])
    decode = ", ".join(f"{k} {v['median']:.3f}" for k, v in result["decode_step_s"].items())
    failed = result["failed"]
    return (
        f"### 24 GB rehearsal of {result['recipe']} on {result['device']}, engine {result['engine']['engine']} "
        f"({result['engine']['reason']})\n\n"
        + markdown_table(["phase", "seconds", "torch reserved GiB", "device used GiB", "planned GiB"], rows)
        + f"\n\ndecode step s (median): {decode}; total {result['total_s']:.0f} s"
        + ("" if failed is None else f"; FAILED in {failed['phase']}: {failed['error']}")
        + ("" if result.get("stopped") is None else f"; stopped early: {result['stopped']}")
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", type=Path, default=HERE.parent.parent / "recipes" / "hybrid.yaml")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model on CPU: the code path, in seconds")
    parser.add_argument("--steps", type=int, default=2, help="steps a stage (the first builds AdamW's state)")
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="every prompt's length (the plan's)")
    parser.add_argument("--eval-examples", type=int, default=2)
    parser.add_argument("--eval-new-tokens", type=int, default=128)
    parser.add_argument("--probes", action="store_true", help="keep the recipe's retention probes")
    parser.add_argument("--tiny-new-tokens", type=int, default=8, help="--tiny: the rollouts' cap")
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/perf/results)")
    parser.add_argument("--deadline-s", type=float, default=None, help="open no phase after this many seconds")
    parser.add_argument("--progress", type=Path, default=None, help="JSON rewritten with the figures as phases close")
    args = parser.parse_args(argv)
    import torch

    if not args.tiny and not torch.cuda.is_available():
        print("rehearse_24gb: no CUDA device (torch.cuda.is_available() is False); --tiny checks the code on CPU")
        return 2
    if args.tiny:
        args.prompt_tokens = min(args.prompt_tokens, 200)
        args.eval_new_tokens = min(args.eval_new_tokens, 8)
    name = "adaptercl-qwen2-tiny-random" if args.tiny else "adaptercl-qwen2.5-7b-random"
    args.checkpoint_dir = args.checkpoint_dir or Path(tempfile.gettempdir()) / name
    with tempfile.TemporaryDirectory(prefix="adaptercl-rehearsal-") as tmp:
        result = {**provenance(), **rehearse(args, Path(tmp))}
    path = write_result("rehearse_24gb" + ("-tiny" if args.tiny else ""), result, args.out)
    print(markdown(result))
    print(f"written: {path}")
    return 0 if result["failed"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
