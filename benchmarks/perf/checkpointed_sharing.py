"""Prompt-prefix sharing under activation checkpointing (issue 26): the training forward + backward of one
micro-batch with checkpointing on (CUDA's default), a group's prompt computed once (now) against every row's prompt
computed (before: transformers' checkpointing dropped the key/value cache the shared layout needs, so the step took
the plain layout), in the same process, alternating, and the gradients of the two compared.

Workload: `--prompts` ToolAlpaca train prompts (../shared/data/tooluse, the shipped tool-use domain, encoded with the
model's chat template; 809 tokens on average with SmolLM2's tokenizer), each with `--group` responses of
`--response` random tokens (a response's content does not change the cost), LoRA r 16 on every projection, float32
on CPU. The loss is the sum of the response positions' log-partition functions (a full-vocabulary term, as the
policy loss has). Counted: positions computed (`train.micro_batch_rows.forward_positions`), seconds per forward +
backward (median of `--reps`), and the ratio shared / plain, also paired rep by rep. Gradient agreement: the
largest difference over each LoRA tensor's largest entry (float32: ~1e-6, see tests/model/test_batching.py).

    HF_HUB_OFFLINE=1 python benchmarks/perf/checkpointed_sharing.py             # ~5 min on 2 busy cores

writes benchmarks/perf/results/checkpointed_sharing-<model>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for the shared provenance.py

from perf_common import write_result  # noqa: E402
from provenance import provenance, spread  # noqa: E402

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"  # ../shared/data from the repository root


def tooluse_prompts(tokenizer, count: int) -> list[list[int]]:
    """The first `count` ToolAlpaca prompts of the shipped domain's train draw, as `run_stage` encodes them."""
    from padding import DOMAINS

    from adaptercl.domains import load_domain
    from adaptercl.model import encode_chat
    from adaptercl.recipe.domain_block import DomainConfig

    _, block = DOMAINS["tooluse"]
    domain = load_domain(DomainConfig(name="tooluse", **{**block, "source": str(DATA / block["source"])}), 0, 4)
    return [encode_chat(tokenizer, example.messages) for example in domain.train[:count]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=1, help="prompts in the micro-batch")
    parser.add_argument("--group", type=int, default=4, help="responses per prompt (rows = prompts x group)")
    parser.add_argument("--response", type=int, default=64, help="response tokens per row")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not (DATA / "tooluse").is_dir():
        print(f"checkpointed_sharing: {DATA / 'tooluse'} is missing (the ToolAlpaca data of ../shared/data)")
        return 2

    import torch

    from adaptercl.adapters.live import attach_adapter, lora_parameters
    from adaptercl.model import ALL_LINEAR, activation_checkpointing, build_batch, load_base, response_logits
    from adaptercl.recipe import LoraConfig
    from adaptercl.recipe.grammar import ModelConfig
    from adaptercl.train.micro_batch_rows import forward_positions

    info = provenance()
    torch.manual_seed(0)
    loaded = load_base(ModelConfig(name=args.model), "none", torch.device("cpu"))
    model = attach_adapter(loaded.model, "student", LoraConfig(r=16, alpha=32, target_modules=list(ALL_LINEAR)))
    params = lora_parameters(model, "student")
    with torch.no_grad():  # B = 0 at init gives A no gradient: a trained adapter's B instead
        for name, p in params.items():
            if "lora_B" in name:
                p.normal_(0.0, 0.01, generator=torch.Generator().manual_seed(1))
    prompts = [p for p in tooluse_prompts(loaded.tokenizer, args.prompts) for _ in range(args.group)]
    generator = torch.Generator().manual_seed(0)
    high = min(10_000, loaded.model.config.vocab_size)  # ids 100 .. 9,999 (a tiny vocabulary: its upper half)
    responses = torch.randint(min(100, high // 2), high, (len(prompts), args.response), generator=generator).tolist()
    batch = build_batch(prompts, responses, loaded.tokenizer.pad_token_id)
    model.train()

    def step(share: bool) -> tuple[float, dict[str, torch.Tensor]]:
        for p in params.values():
            p.grad = None
        start = time.perf_counter()
        with activation_checkpointing(model, True):
            logits = response_logits(model, batch, share_prompts=share)  # [N, R, V]
            logits.logsumexp(-1).sum().backward()
        return time.perf_counter() - start, {k: p.grad.clone() for k, p in params.items()}

    step(True)  # warm-up
    times: dict[str, list[float]] = {"shared": [], "plain": []}
    grads: dict[str, dict[str, torch.Tensor]] = {}
    for _ in range(args.reps):  # alternating, so the machine's load falls on both alike
        for layout in ("plain", "shared"):
            seconds, grads[layout] = step(layout == "shared")
            times[layout].append(seconds)
            print(f"{layout}: {seconds:.1f} s", flush=True)
    agreement = max(
        ((grads["shared"][k] - grads["plain"][k]).abs().max() / grads["plain"][k].abs().max()).item() for k in params
    )
    positions = {layout: forward_positions(batch, layout == "shared") for layout in times}
    result = {
        **info,
        "model": args.model,
        "workload": {
            "prompts": args.prompts,
            "group": args.group,
            "response_tokens": args.response,
            "prompt_tokens": [len(p) for p in prompts[:: args.group]],
            "rows": len(prompts),
            "activation_checkpointing": True,
            "dtype": "float32",
            "lora": {"r": 16, "alpha": 32, "target_modules": list(ALL_LINEAR)},
        },
        "positions": positions,
        "positions_ratio": positions["shared"] / positions["plain"],
        "seconds": {layout: spread(values) for layout, values in times.items()},
        "ratio_of_medians": statistics.median(times["shared"]) / statistics.median(times["plain"]),
        "paired_ratio": spread([s / p for s, p in zip(times["shared"], times["plain"])]),
        "gradient_max_difference_over_scale": agreement,
        "raw": times,
    }
    path = write_result(f"checkpointed_sharing-{args.model}", result, args.out)
    print(f"positions {positions}, time ratio {result['ratio_of_medians']:.2f}, gradients {agreement:.1e}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
