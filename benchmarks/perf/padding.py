"""Padding in the training step on the shipped domains' real lengths: positions computed ÷ real tokens, before and
after length-sorted, trimmed micro-batches (`adaptercl/train/micro_batch_rows.py`, `model/batching.trim_padding`).

The workload is the shipped 24 GB recipes' (recipes/grpo.yaml, sdpo.yaml, hybrid.yaml): 4 prompts x 8 samples = 32
sequences a step, responses capped at 384 tokens, micro-batches of 16 (grpo), 7 (sdpo, srpo) and 8 (hybrid) rows, what
`optim.micro_batch_size: auto` picks on a 24 GiB card (the recipes' plan comments), and 2 rows, their split without
CUDA (`grad_accum: 16`). Domains: GSM8K (../shared/data/gsm8k), SciKnowEval L3 chemistry
(../shared/data/sciknoweval/chemistry) and ToolAlpaca (../shared/data/tooluse/test.jsonl, the only split here), loaded
by adaptercl's own loader with the recipes' formats; the prompts of each step are those `run_stage` draws
(`prompts_for_step`, seed 0, the domain's stage index), encoded with the chat template.

Stated distribution of the lengths: prompts are tokenised by SmolLM2-135M-Instruct's tokenizer (the only real one
offline; Qwen2.5's has ~3x its vocabulary, so its prompts are somewhat shorter); responses are SmolLM2-135M-Instruct's
own, sampled by adaptercl's transformers engine at T=1, top-p 1, 384 new tokens at most, `--steps` steps per domain
(`--lengths FILE` reuses the lengths of an earlier result instead of sampling). A 7B model's responses differ; the
measured ones are recorded per row in the JSON so the figures can be recomputed.

Counted, per micro-batch: the positions the student's training forward computes (`micro_batch_rows.forward_positions`)
in two layouts: `plain` (the [n, P+R] layout, which CUDA took until prefix sharing worked under activation
checkpointing) and `prefix` (a group's shared prompt computed once, `prefix_sharing.py`: the training step's layout on
every device, wherever it computes fewer positions). Before: every micro-batch
in rollout order and as wide as the whole batch (its longest prompt + longest response: `batch.select(rows)` kept
every column). After: what train/step.py now does: `micro_batch_rows` picks the cheapest order and each micro-batch
is cut to its own rows (`trim_padding`). `real` = prompt + response tokens of the rows; `positions / real` > 1 is
padding (the prefix layout can go under 1: the shared prompt is computed once for the group).

    HF_HUB_OFFLINE=1 python benchmarks/perf/padding.py                      # samples SmolLM2: ~46 min on 2 busy cores
    HF_HUB_OFFLINE=1 python benchmarks/perf/padding.py --lengths benchmarks/perf/results/padding.json   # recount

writes benchmarks/perf/results/padding.json and padding.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for the shared provenance.py

from perf_common import write_result  # noqa: E402
from provenance import markdown_table, provenance  # noqa: E402

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"  # ../shared/data from the repository root
# name -> (stage index in the shipped recipes, the domain block with a local source, as recipes/hybrid.yaml's)
DOMAINS: dict[str, tuple[int, dict[str, Any]]] = {
    "math": (0, {"source": "gsm8k", "format": "gsm8k", "num_train": 2000}),
    "science": (1, {"source": "sciknoweval/chemistry", "format": "sciknoweval", "eval_split": "test"}),
    "tooluse": (2, {"source": "tooluse/test.jsonl", "format": "tooluse"}),  # no train split here: its 68 rows
}
PROMPTS_PER_STEP, GROUP, MAX_NEW_TOKENS = 4, 8, 384  # recipes/{grpo,sdpo,hybrid}.yaml
MICRO_BATCHES = {  # rows per micro-batch -> where the shipped recipes use it
    2: "without CUDA (grad_accum 16)",
    7: "sdpo.yaml and srpo.yaml, auto on 24 GiB",
    8: "hybrid.yaml, auto on 24 GiB",
    16: "grpo.yaml, auto on 24 GiB",
}
MODEL = "smollm2-135m-instruct"


def load_domains(data: Path, tokenizer) -> dict[str, tuple[int, Any, list[list[int]]]]:
    """name -> (stage index, Domain, its train prompts encoded as `run_stage` encodes them)."""
    from adaptercl.domains import load_domain
    from adaptercl.model.batching import encode_chat
    from adaptercl.recipe.domain_block import DomainConfig

    out = {}
    for name, (index, block) in DOMAINS.items():
        cfg = DomainConfig(name=name, **{**block, "source": str(data / block["source"])})
        domain = load_domain(cfg, seed=0, num_eval=4)
        out[name] = (index, domain, [encode_chat(tokenizer, ex.messages) for ex in domain.train])
    return out


def step_prompts(n_train: int, index: int, step: int) -> list[int]:
    from adaptercl.train.context import prompts_for_step

    return prompts_for_step(n_train, PROMPTS_PER_STEP, 0, index, step)


def sample_lengths(domains, steps: int) -> list[dict[str, Any]]:
    """`steps` steps of each domain: the rows' prompt indices and SmolLM2's sampled response lengths."""
    import torch

    from adaptercl.model.base import load_base
    from adaptercl.recipe.grammar import ModelConfig
    from adaptercl.rollout import SamplingParams
    from adaptercl.rollout.hf import HFEngine
    from adaptercl.train.context import step_seed

    base = load_base(ModelConfig(name=MODEL), "none", torch.device("cpu"))
    engine = HFEngine(base.model, base.tokenizer, batch_size=PROMPTS_PER_STEP * GROUP)
    rows = []
    for name, (index, _, prompts) in domains.items():
        for step in range(steps):
            picked = step_prompts(len(prompts), index, step)
            seed = step_seed(0, index, step)
            params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, top_p=1.0, n=GROUP, seed=seed)
            t0 = time.perf_counter()
            groups = engine.generate([prompts[i] for i in picked], None, params)
            lengths = [len(c.token_ids) for g in groups for c in g]
            rows.append({"domain": name, "step": step, "prompts": picked, "response_lengths": lengths})
            print(f"{name} step {step}: {time.perf_counter() - t0:.0f} s, responses {lengths}", flush=True)
    return rows


def step_batch(prompts: list[list[int]], picked: list[int], lengths: list[int]):
    """The step's batch as `run_stage` builds it (group-contiguous rows); response tokens are placeholders (only
    their number matters to the layouts)."""
    from adaptercl.model.batching import build_batch

    rows = [prompts[i] for i in picked for _ in range(GROUP)]
    return build_batch(rows, [[1] * k for k in lengths], pad_id=0)


def count(batch, micro: int, share: bool) -> dict[str, Any]:
    """Positions computed before and after, and the order `micro_batch_rows` picks, for one step's batch."""
    from adaptercl.train.micro_batch_rows import ORDERS, forward_positions, micro_batch_rows, order_cost, split_order

    n = batch.input_ids.shape[0]
    padded = sum(forward_positions(batch.select(slice(s, s + micro)), share) for s in range(0, n, micro))
    order, parts = micro_batch_rows(batch, micro, share)
    each = {name: order_cost(batch, split_order(o(batch), micro), share) for name, o in ORDERS.items()}
    return {"before": padded, "after": order_cost(batch, parts, share), "order": order, "per_order": each}


def analyse(domains, sampled: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (_, _, prompts) in domains.items():
        steps = [s for s in sampled if s["domain"] == name]
        batches = [step_batch(prompts, s["prompts"], s["response_lengths"]) for s in steps]
        real = sum(int(b.attention_mask.sum()) for b in batches)
        lengths = [k for s in steps for k in s["response_lengths"]]
        prompt_lengths = [len(p) for p in prompts]
        at_cap = sum(k >= MAX_NEW_TOKENS for k in lengths) / len(lengths)
        row: dict[str, Any] = {
            "steps": len(steps),
            "real_tokens": real,
            "prompt_tokens": summary(prompt_lengths),
            "response_tokens": summary(lengths) | {"at_cap_frac": at_cap},
            "layouts": {},
        }
        for layout, share in (("plain", False), ("prefix", True)):
            per_micro = {}
            for micro in MICRO_BATCHES:
                counts = [count(b, micro, share) for b in batches]
                before, after = sum(c["before"] for c in counts), sum(c["after"] for c in counts)
                per_micro[str(micro)] = {
                    "before_positions_per_real_token": before / real,
                    "after_positions_per_real_token": after / real,
                    "saved_frac": 1 - after / before,
                    "orders_chosen": [c["order"] for c in counts],
                    "per_order_positions_per_real_token": {
                        k: sum(c["per_order"][k] for c in counts) / real for k in counts[0]["per_order"]
                    },
                }
            row["layouts"][layout] = per_micro
        out[name] = row
    return out


def summary(values: list[int]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "n": len(values),
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "p90": ordered[int(0.9 * (len(ordered) - 1))],
        "min": ordered[0],
        "max": ordered[-1],
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Padding in the training step: positions computed ÷ real tokens",
        "",
        f"Recipes' workload: {PROMPTS_PER_STEP} prompts x {GROUP} samples, responses <= {MAX_NEW_TOKENS} tokens; "
        f"lengths: {result['lengths_source']}. Machine and versions: padding.json. `plain`: every row's prompt "
        "computed (CUDA's layout until prefix sharing worked under activation checkpointing); `prefix`: a group's "
        "prompt computed once per micro-batch (the training step's layout on every device now).",
        "",
    ]
    for name, row in result["domains"].items():
        p, r = row["prompt_tokens"], row["response_tokens"]
        lines.append(
            f"**{name}** ({row['steps']} steps): prompts mean {p['mean']:.0f} (max {p['max']}) tokens, responses mean "
            f"{r['mean']:.0f} (median {r['median']:.0f}, {100 * r['at_cap_frac']:.0f}% at the cap)"
        )
        lines.append("")
        table = []
        for layout, per_micro in row["layouts"].items():
            for micro, c in per_micro.items():
                orders = ", ".join(f"{o} {c['orders_chosen'].count(o)}" for o in dict.fromkeys(c["orders_chosen"]))
                table.append(
                    [
                        layout,
                        f"{micro} ({MICRO_BATCHES[int(micro)]})",
                        f"{c['before_positions_per_real_token']:.2f}",
                        f"{c['after_positions_per_real_token']:.2f}",
                        f"{100 * c['saved_frac']:.0f}%",
                        orders,
                    ]
                )
        lines.append(
            markdown_table(["layout", "micro-batch rows", "before", "after", "positions saved", "orders"], table)
        )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="sampled steps per domain (4 prompts x 8 samples each)")
    parser.add_argument("--lengths", type=Path, default=None, help="reuse the sampled lengths of an earlier result")
    parser.add_argument("--data", type=Path, default=DATA, help="the shared data folder (default ../shared/data)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/perf/results)")
    args = parser.parse_args()
    if not args.data.is_dir():
        sys.exit(f"padding: no data folder at {args.data} (--data DIR)")
    import torch

    from adaptercl.model.base import load_base
    from adaptercl.recipe.grammar import ModelConfig

    info = provenance()
    tokenizer = load_base(ModelConfig(name=MODEL), "none", torch.device("cpu")).tokenizer
    domains = load_domains(args.data, tokenizer)
    t0 = time.perf_counter()
    if args.lengths is not None:
        earlier = json.loads(args.lengths.read_text())
        sampled, source = earlier["sampled"], earlier["lengths_source"]
        sampled_by = earlier.get("sampled_by") or {k: earlier[k] for k in ("command", "machine", "versions")}
        sampling_s = earlier["sampling_s"]  # the sampling run's, not this recount's
    else:
        sampled_by = None  # this run
        sampled = sample_lengths(domains, args.steps)
        sampling_s = time.perf_counter() - t0
        source = (
            f"prompts tokenised by {MODEL}'s tokenizer and chat template; responses sampled from {MODEL} by "
            f"adaptercl's transformers engine (T=1, top-p 1, <= {MAX_NEW_TOKENS} new tokens), {args.steps} steps "
            "per domain"
        )
    result = {
        **info,
        "lengths_source": source,
        "sampled_by": sampled_by,
        "sampling_s": sampling_s,
        "workload": {
            "prompts_per_step": PROMPTS_PER_STEP,
            "group_size": GROUP,
            "max_new_tokens": MAX_NEW_TOKENS,
            "micro_batches": MICRO_BATCHES,
        },
        "domains": analyse(domains, sampled),
        "sampled": sampled,
    }
    path = write_result("padding", result, args.out)
    text = markdown(result)
    (path.parent / "padding.md").write_text(text + f"\nCommand: `{result['command']}`\n")
    print(text)
    print(f"written: {path}")


if __name__ == "__main__":
    main()
