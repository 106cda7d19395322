"""What a real run measured against the plan: the 24 GB rehearsal (`benchmarks/perf/rehearse_24gb.py`) on an NVIDIA
H200 with torch's allocator capped at 24 GiB (recipes/hybrid.yaml's loop, random weights of the Qwen2.5-7B shape in
NF4, the transformers engine, every prompt 1,024 tokens, responses at the 384 cap, the auto micro-batch of 8), as
`adaptercl recipe plan` prints it beside its estimate. The figures come from `benchmarks/perf/rehearsal_vs_plan.py`
over the committed results; tests/benchmarks/test_rehearsal_vs_plan.py recomputes them, so a change to the plan or
the results that moves one fails until it is updated here.
"""

from __future__ import annotations

SOURCE = "benchmarks/perf/results/rehearse_24gb.md (NVIDIA H200 capped at 24 GiB, NF4 Qwen2.5-7B shape)"

# Each part's measured seconds / the wall-time model's seconds for that very run on the H200.
TIME_RATIO = {
    "train_step": 1.33,
    "rollout_step": 0.84,
    "evaluation": 0.59,
    "teacher_lift": 1.08,
    "stage_kl": 0.75,
    "response_drift": 0.63,
    "parameter_drift": 0.76,
}

# Each phase's torch peak allocated GiB and the memory plan's GiB for that very run now (the first stage, math; the
# plan the run recorded said 21.25 for the training step, before it counted a group's prompt once).
MEMORY_GIB = {
    "train": (13.12, 17.83),
    "rollout": (7.52, 10.43),
    "eval": (5.86, 10.21),
    "diagnostics": (6.95, 11.74),
}


def memory_line() -> str:
    """The plan's memory check, one line."""
    phases = ", ".join(f"{phase} {used:.2f} (planned {planned:.2f})" for phase, (used, planned) in MEMORY_GIB.items())
    where = "an H200 capped at 24 GiB (hybrid.yaml's loop: hf engine, micro-batch 8, 1,024-token prompts)"
    return f"memory plan checked on {where}, torch peak allocated GiB: {phases} ({SOURCE})"


def time_line() -> str:
    """The wall-time model's check, the value of one figure."""
    return ", ".join(f"{part.replace('_', ' ')} {ratio:.2f}" for part, ratio in TIME_RATIO.items())
