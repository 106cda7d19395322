"""Refit the free constants of `adaptercl.plan.step_memory` (the memory plan's training step) on the measured 7B steps.

    python benchmarks/perf/fit_memory_plan.py      # prints the constants to paste into plan/step_memory.py + residuals

Reads benchmarks/perf/results/cuda_7b_memory.json (peak max_memory_reserved of 14 variants; the out-of-memory one
is left out) and solves a linear least-squares problem in the relative error for C_ACT, the student's logit copies
(chunked / full), the teacher's logit copies per divergence support (sampled / topk / full) and C0. The known terms
(base, adapters, checkpointed layer inputs, the teacher's no-grad forward on its prompt of prompt_len +
teacher_extra tokens) are not fitted.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import adaptercl.plan.step_memory as sm
from adaptercl.model.shapes import GIB, SHAPES

RESULTS = Path(__file__).resolve().parent / "results" / "cuda_7b_memory.json"
SUPPORT = {"grpo": "none", "hybrid": "sampled", "sdpo": "topk", "sdft": "full"}  # the shipped recipes' supports
TEACHER_COPY = {"grpo": 0, "hybrid": 1, "sdpo": 2, "sdft": 2}  # adapter copies: stage_start = 1, ema rank 2r = 2


def measured() -> list[tuple[str, sm.TrainWorkload, float]]:
    """(variant, workload, peak reserved GiB) of every measured variant that did not run out of memory."""
    data = json.loads(RESULTS.read_text())
    out = []
    for v in data["variants"]:
        if "peak_reserved_gib" not in v:
            continue
        w, trainable = v["workload"], v["setup"]["trainable_parameters"]
        chunk = {"auto": 1024, "off": None}.get(w["logits_chunk_size"], w["logits_chunk_size"])
        workload = sm.TrainWorkload(
            rows=w["sequences"] // w["grad_accum"], prompt=w["prompt_len"], response=w["response_len"],
            prompts=w["sequences"] // w["grad_accum"],  # cuda_7b_memory's prompts are all distinct: no sharing
            checkpointing=w["activation_checkpointing"], chunk=chunk, support=SUPPORT[w["method"]],
            trainable=trainable, frozen=TEACHER_COPY[w["method"]] * trainable,
            teacher_prompt=w["prompt_len"] + w["teacher_extra"] if SUPPORT[w["method"]] != "none" else 0,
        )  # fmt: skip
        out.append((v["variant"], workload, v["peak_reserved_gib"]))
    return out


def features(workload: sm.TrainWorkload) -> tuple[float, list[float]]:
    """(known bytes, coefficient of each free constant) for one workload: train_terms is linear in them."""
    shape = SHAPES["qwen/qwen2.5-7b"]
    names = ["C_ACT", "chunked", "full", "sampled", "topk", "tfull", "C0"]
    saved = (sm.C_ACT, dict(sm.STUDENT_LOGIT_COPIES), dict(sm.TEACHER_LOGIT_COPIES), sm.C0_GIB)

    def total(values: dict[str, float]) -> float:
        sm.C_ACT, sm.C0_GIB = values["C_ACT"], values["C0"]
        sm.STUDENT_LOGIT_COPIES.update(chunked=values["chunked"], full=values["full"])
        sm.TEACHER_LOGIT_COPIES.update(sampled=values["sampled"], topk=values["topk"], full=values["tfull"])
        return sum(sm.train_terms(shape, "nf4", workload).values())

    try:
        known = total(dict.fromkeys(names, 0.0))
        coef = [total({**dict.fromkeys(names, 0.0), n: 1.0}) - known for n in names]
    finally:
        sm.C_ACT, sm.C0_GIB = saved[0], saved[3]
        sm.STUDENT_LOGIT_COPIES.update(saved[1])
        sm.TEACHER_LOGIT_COPIES.update(saved[2])
    return known, coef


def main() -> None:
    rows = measured()
    a, b = [], []
    for _, workload, peak in rows:
        known, coef = features(workload)
        a.append([c / (peak * GIB) for c in coef])
        b.append(1.0 - known / (peak * GIB))
    x, *_ = np.linalg.lstsq(np.array(a), np.array(b), rcond=None)
    names = ["C_ACT", "chunked", "full", "sampled", "topk", "tfull", "C0"]
    print(dict(zip(names, np.round(x, 3).tolist())))
    for (variant, _, peak), row, rhs in zip(rows, a, b):
        predicted = peak * (1 - rhs + float(np.dot(row, x)))
        print(f"{variant:<22} measured {peak:6.2f}  predicted {predicted:6.2f}  {100 * (predicted / peak - 1):+5.1f}%")


if __name__ == "__main__":
    main()
