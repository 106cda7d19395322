"""Where a distillation step's extra time goes: each part of `train_on_batch` timed on its own, per method and
teacher precision, on the batch `teacher_overhead.py` builds (same settings, same fixed success pattern).

Parts, each the median of `--repeats` calls after one warm-up call, the model in train mode as in a stage:
- `student_forward_s`: `response_logits` of the whole batch (what every method, GRPO too, computes);
- `teacher_forward_s`: `Teacher.logits` on the rows with a distillation target (no grad; bf16 autocast for the
  `+bf16` variants);
- `divergence_s`: `train.losses.distillation_divergence` on those rows (forward only);
- `student_distill_backward_s`: student forward + divergence + backward (the teacher logits precomputed);
- `grpo_like_backward_s`: student forward + sum of the sampled tokens' logprobs + backward (GRPO's graph, for
  comparison);
- `teacher_update_s`: `Teacher.update` (the EMA of ΔW for sdpo and sdft).

    python benchmarks/perf/teacher_parts.py --model smollm2-135m-instruct

writes benchmarks/perf/results/teacher_parts-<model>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for the shared provenance.py

from perf_common import write_result  # noqa: E402
from provenance import markdown_table, provenance  # noqa: E402
from teacher_overhead import (  # noqa: E402
    VARIANTS,
    add_batch_arguments,
    fixed_batch,
    grpo_first,
    load_workload,
    method_contexts,
)

PARTS = (
    "student_forward_s",
    "teacher_forward_s",
    "divergence_s",
    "student_distill_backward_s",
    "grpo_like_backward_s",
    "teacher_update_s",
)


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def variant_parts(ctx, batch, targets, repeats: int) -> dict[str, Any]:
    """The parts of one variant's step (see the module docstring) on the rows with a distillation target."""
    import torch

    from adaptercl.model.batching import response_logits
    from adaptercl.train import losses

    model, cfg = ctx.model, ctx.stage.distill
    rows = (targets.mask.sum(-1) > 0).nonzero().squeeze(-1)  # [n_t]
    teacher_batch, mask = targets.teacher_batch.select(rows), targets.mask[rows]  # mask [n_t, R]
    response_ids = batch.response_ids[rows]  # [n_t, R]
    t_logits = ctx.teacher.logits(model, teacher_batch)  # [n_t, R, V]

    def divergence(s_logits: torch.Tensor) -> torch.Tensor:
        return losses.distillation_divergence(
            s_logits, t_logits, cfg.alpha, cfg.support, cfg.topk, cfg.tail, response_ids
        )  # [n_t, R]

    def distill_backward() -> None:
        (divergence(response_logits(model, batch)[rows]) * mask).sum().backward()

    def grpo_like_backward() -> None:
        logp = losses.gather_logprobs(response_logits(model, batch), batch.response_ids)  # [N, R]
        (logp * batch.response_mask).sum().backward()

    with torch.no_grad():
        s_logits = response_logits(model, batch)[rows]  # [n_t, R, V]
    times = {
        "student_forward_s": median_time(lambda: response_logits(model, batch), repeats),
        "teacher_forward_s": median_time(lambda: ctx.teacher.logits(model, teacher_batch), repeats),
        "divergence_s": median_time(lambda: divergence(s_logits), repeats),
        "student_distill_backward_s": median_time(distill_backward, repeats),
        "grpo_like_backward_s": median_time(grpo_like_backward, repeats),
        "teacher_update_s": median_time(lambda: ctx.teacher.update(model), repeats),
    }
    model.zero_grad(set_to_none=True)
    return {
        **times,
        "teacher_rows": len(rows),
        "teacher_width": teacher_batch.input_ids.shape[1],
        "distilled_tokens": int(mask.sum()),
    }


def time_parts(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from adaptercl.adapters.live import use_adapters
    from adaptercl.train.distill_targets import distill_targets

    base, domain = load_workload(args, work)
    setups = method_contexts(args, base.model, base.tokenizer, domain, work)
    model = setups["grpo"][0].model
    samples, completions, results, batch, _ = fixed_batch(args, setups["grpo"][0], domain)
    out: dict[str, Any] = {}
    for v in args.variants[1:]:
        ctx = setups[v][0]
        use_adapters(model, [ctx.student], trainable=ctx.student)
        model.train()
        targets = distill_targets(ctx, 0, samples, completions, results, batch)
        out[v] = variant_parts(ctx, batch, targets, args.repeats)
    return {
        "model": args.model,
        "variants": {v: {"method": VARIANTS[v][0], "teacher_autocast": VARIANTS[v][1]} for v in args.variants[1:]},
        "repeats": args.repeats,
        "parts": out,
    }


def markdown(result: dict[str, Any]) -> str:
    rows = [
        [v, *(r[p] for p in PARTS), f"{r['teacher_rows']} x {r['teacher_width']}"] for v, r in result["parts"].items()
    ]
    headers = ["variant", *(p.removesuffix("_s").replace("_", " ") + " s" for p in PARTS), "teacher rows x width"]
    return f"### Teacher step parts, {result['model']}\n\n" + markdown_table(headers, rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_arguments(parser)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per part")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS)[1:], choices=list(VARIANTS)[1:])
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/perf/results)")
    args = parser.parse_args()
    args.variants = grpo_first(args.variants)
    with tempfile.TemporaryDirectory(prefix="adaptercl-teacher-parts-") as tmp:
        result = {**provenance(), **time_parts(args, Path(tmp))}
    path = write_result("teacher_parts-" + Path(args.model).name, result, args.out)
    print(markdown(result))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
