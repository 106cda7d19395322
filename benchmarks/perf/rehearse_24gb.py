"""A 24 GB rehearsal: `adaptercl recipe rehearse --random-weights` of a shipped 24 GB recipe (default
recipes/hybrid.yaml: random weights of the Qwen2.5-7B shape, NF4 as the recipe says) on a card capped at 24 GiB.

The command does the work (every stage's real loop for a few minutes, the measurements, rehearsal.json, the figures
beside the plan's, one line when a phase fails: README "A 24 GB card: rehearse first", `adaptercl/run/rehearsal.py`).
This script adds what makes it the 24 GB card's rehearsal, all recorded in the JSON (`benchmark`):
- the cap: `torch.cuda.set_per_process_memory_fraction(24 GiB / the card)` bounds torch's allocator (the trainer and
  what vLLM allocates through torch); `optim.micro_batch_size: auto` and vLLM's `gpu_memory_utilization: auto` are told
  the card is 24 GiB (vLLM's share is rescaled to the real card so that it claims the same bytes);
- the data: the recipe's hub/URL domains become local synthetic ones of the same names in the gsm8k format (sums; a
  random model gets none right, so the hybrid distils every group, its costliest case) whose prompts are
  `--prompt-tokens` tokens (default 1024, the plan's assumption) with the tokenizer the rehearsal uses; the retention
  probes are left out unless `--probes`. Random weights never end a response: every one is at the cap, the plan's
  worst case.
Where vLLM does not import, `rollout.engine: auto` runs the transformers engine, and the JSON's `engine` says so.

    python benchmarks/perf/rehearse_24gb.py                 # CUDA: the rehearsal's 10 minutes
    python benchmarks/perf/rehearse_24gb.py --minutes 7     # a lent GPU's call: no phase opens after 7 minutes
    python benchmarks/perf/rehearse_24gb.py --tiny          # CPU, the tiny-random shape: the code path, seconds

writes benchmarks/perf/results/rehearse_24gb[-tiny]/rehearsal.json and rehearsal.md (the command's output).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for the shared provenance.py
sys.path.insert(0, str(Path(__file__).resolve().parent))

from perf_common import HERE, RESULTS_DIR  # noqa: E402
from provenance import provenance  # noqa: E402

from adaptercl.model.shapes import GIB  # noqa: E402
from adaptercl.system.atomic import write_json  # noqa: E402

CARD_GIB = 24.0
FILLER = "Read the question below with care and answer it. "


def write_domain(folder: Path, prompt_tokens: int, tokenizer: Any = None) -> Path:
    """train.jsonl (64 rows) and test.jsonl (16) in the gsm8k format: sums whose question is padded so that the
    encoded prompt is about `prompt_tokens` tokens of `tokenizer` (default the byte-level one: one byte, one token)."""
    from adaptercl.domains.datasets_formats import GSM8K_SYSTEM, chat
    from adaptercl.model.base import build_byte_tokenizer
    from adaptercl.model.batching import encode_chat

    tok = tokenizer if tokenizer is not None else build_byte_tokenizer()
    per_char = len(tok.encode(FILLER * 8, add_special_tokens=False)) / len(FILLER * 8)  # tokens a filler character
    folder.mkdir(parents=True, exist_ok=True)
    for split, first, count in (("train", 0, 64), ("test", 64, 16)):
        rows = []
        for i in range(first, first + count):
            a, b = 17 * i + 3, 29 * i + 11
            question = f"What is {a} + {b}?"
            room = max(0, round((prompt_tokens - len(encode_chat(tok, chat(question, GSM8K_SYSTEM)))) / per_char))
            filler = (FILLER * (room // len(FILLER) + 1))[:room]
            rows.append({"question": filler + question, "answer": f"{a} + {b} = {a + b}.\n#### {a + b}"})
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def rehearsal_recipe(args: argparse.Namespace, work: Path) -> tuple[Path, dict[str, Any]]:
    """The recipe file the command rehearses (the shipped one with synthetic domains) and what was changed."""
    import yaml

    from adaptercl.model.random_weights import model_tokenizer

    raw = yaml.safe_load(Path(args.recipe).read_text())
    if args.tiny:  # a CPU check of the code path: tiny-random's shape, no NF4, short responses; CUDA's checkpointing,
        # logit chunks and micro-batches of several rows of a group (auto's split without CUDA would be 1 row here)
        raw.update(model={"name": "tiny-random"}, quantization="none")
        raw["rollout"] = {**raw["rollout"], "max_new_tokens": args.tiny_new_tokens}
        raw["eval"] = {**raw.get("eval", {}), "max_new_tokens": args.tiny_new_tokens}
        raw["optim"] = {
            **raw["optim"],
            "activation_checkpointing": True,
            "logits_chunk_size": 4,
            "micro_batch_size": 4,
        }
    tokenizer, described = model_tokenizer(raw["model"]["name"])  # the one --random-weights takes
    probes = raw.get("eval", {}).get("retention_probes", []) if args.probes else []
    trained = {s["domain"] for s in raw["stages"]}
    names = [d["name"] for d in raw["domains"] if d["name"] in trained or d["name"] in probes]
    raw["domains"] = [
        {"name": n, "source": str(write_domain(work / "data" / n, args.prompt_tokens, tokenizer)), "format": "gsm8k"}
        for n in names
    ]
    raw["eval"] = {**raw.get("eval", {}), "retention_probes": probes}
    path = work / Path(args.recipe).name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    changes = {
        "model": f"random weights of {raw['model']['name']}'s shape, {described}",
        "domains": f"{', '.join(names)}: synthetic gsm8k-format rows (sums), prompts of {args.prompt_tokens} tokens",
        **({"tiny": {k: raw[k] for k in ("quantization", "rollout", "optim")}} if args.tiny else {}),
    }
    return path, changes


@contextlib.contextmanager
def capped_card(total_gib: float):
    """Make the card look 24 GiB while the block runs (see the module docstring); yields what was set."""
    import torch

    import adaptercl.rollout.vllm as vllm_engine
    import adaptercl.train.micro_batch as micro_batch

    fraction = min(1.0, CARD_GIB / total_gib)
    torch.cuda.set_per_process_memory_fraction(fraction)
    capped = lambda device: min(CARD_GIB, total_gib) if device.type == "cuda" else None  # noqa: E731
    share = vllm_engine.vllm_utilization  # of a 24 GiB card -> of the real one: the same bytes
    rescaled = lambda shape, recipe, card: share(shape, recipe, card) * card / total_gib  # noqa: E731
    patches = [(micro_batch, "card_gib", capped), (vllm_engine, "card_gib", capped)]
    patches.append((vllm_engine, "vllm_utilization", rescaled))
    undo = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield {"card_gib": total_gib, "capped_to_gib": CARD_GIB, "memory_fraction": fraction}
    finally:
        for owner, name, value in undo:
            setattr(owner, name, value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", type=Path, default=HERE.parent.parent / "recipes" / "hybrid.yaml")
    parser.add_argument("--tiny", action="store_true", help="tiny-random's shape on CPU: the code path, in seconds")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="every prompt's length (the plan's)")
    parser.add_argument("--probes", action="store_true", help="keep the recipe's retention probes")
    parser.add_argument("--tiny-new-tokens", type=int, default=8, help="--tiny: the responses' cap")
    parser.add_argument("--minutes", type=float, default=None, help="the rehearsal's time limit (the command's)")
    parser.add_argument("--out", type=Path, default=None, help="folder of the results (default results/rehearse_24gb)")
    args = parser.parse_args(argv)
    import torch

    from adaptercl.cli import main as adaptercl

    if not args.tiny and not torch.cuda.is_available():
        print("rehearse_24gb: no CUDA device (torch.cuda.is_available() is False); --tiny checks the code on CPU")
        return 2
    if args.tiny:
        args.prompt_tokens = min(args.prompt_tokens, 200)
    out = args.out or RESULTS_DIR / ("rehearse_24gb" + ("-tiny" if args.tiny else ""))
    printed = io.StringIO()
    with tempfile.TemporaryDirectory(prefix="adaptercl-rehearse-24gb-") as tmp:
        recipe, changes = rehearsal_recipe(args, Path(tmp))
        command = ["recipe", "rehearse", str(recipe), "--random-weights", "--out", str(out)]
        command += ["--minutes", str(args.minutes)] if args.minutes else []
        total = torch.cuda.get_device_properties(0).total_memory / GIB if not args.tiny else None
        with contextlib.ExitStack() as stack:
            card = stack.enter_context(capped_card(total)) if total else None
            stack.enter_context(contextlib.redirect_stdout(printed))
            code = adaptercl(command)
    text = printed.getvalue().replace(str(recipe), shown(args.recipe))  # not the temporary copy's path
    print(text, end="")
    result_path = out / "rehearsal.json"
    if result_path.is_file():
        result = json.loads(result_path.read_text())
        result["recipe"]["file"] = shown(args.recipe)
        result["benchmark"] = {**provenance(), "card": card, "changes": changes}
        write_json(result_path, result)
        (out / "rehearsal.md").write_text(f"`{result['benchmark']['command']}`\n\n```\n{text}```\n")
    return code


def shown(path: Path) -> str:
    """A path as a result records it: relative to the repository when inside it (no path of the machine)."""
    path, repo = Path(path).resolve(), HERE.parent.parent.resolve()
    return str(path.relative_to(repo)) if path.is_relative_to(repo) else str(path)


if __name__ == "__main__":
    sys.exit(main())
