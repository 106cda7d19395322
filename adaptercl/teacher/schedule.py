"""When a teacher that is frozen between refreshes copies the student in: the gate of `gated` (CGTR) and the clock of
`restart_freeze` / `lag`. Pure: numbers in, decisions out; `kinds.Teacher.update` does the copying. No torch import
(the recipe grammar checks the first possible refresh with `recipe.method_blocks.first_gated_check`).

`gated` (Consolidation-Gated Teacher Refresh, arXiv 2606.03532; docs/design.md §4a): the teacher stays frozen; after
every optimiser step the step's training rollouts of the stage's own prompts (replayed earlier domains left out)
enter a window of the last `window` steps. The first time the window is full, its pooled reward mean and
response-length p95 become the references: the teacher is still the stage-start copy, and this is the nearest
measure of it (the stage-start policy's own rollouts are those of step 1 only). From then on, at every step that is a
multiple of `every` after the baseline's step, the window is the evidence and the teacher is refreshed to the
student iff `gate_allows_refresh`:

    reward_now − reward_ref >= delta   and   p95_now <= (1 + eps) · p95_ref

A refresh makes the window's values the new references; a refused check keeps them. Every check is logged with its
evidence (`teacher_gate_*` in the step metrics). The reward is the training reward on train prompts: nothing is
chosen on the eval set. The paper's own window, δ and ε could not be read offline; the defaults are documented in
`recipe.method_blocks.TeacherConfig`.

The window holds each step's raw rewards and lengths (JSON-able), so a checkpoint carries it and a resumed stage
decides exactly as an uninterrupted one. p95 is the linear interpolation between order statistics (numpy's and
`torch.quantile`'s default); the reward mean is `math.fsum` over the window divided by its count, so the decision does
not depend on summation order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace


@dataclass
class GateState:
    """The gate's memory: the last `window` steps' rollouts and the references (None until the first full window)."""

    rewards: list[list[float]] = field(default_factory=list)  # [≤ window][rollouts of that step]
    lengths: list[list[int]] = field(default_factory=list)  # [≤ window][rollouts of that step] response tokens
    reward_ref: float | None = None  # window reward mean at the last refresh (first: the baseline)
    p95_ref: float | None = None  # window response-length p95 at the last refresh (first: the baseline)
    ref_step: int = 0  # the step the references were taken at


def quantile(values: list[float], q: float) -> float:
    """The q-quantile of `values` by linear interpolation between order statistics (numpy's default)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    lo = math.floor(position)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (position - lo) * (ordered[hi] - ordered[lo])


def gate_allows_refresh(
    reward_now: float, reward_ref: float, p95_now: float, p95_ref: float, delta: float, eps: float
) -> bool:
    """CGTR's joint evidence: the reward improved by at least `delta` and the length tail grew by at most `eps`."""
    return reward_now - reward_ref >= delta and p95_now <= (1.0 + eps) * p95_ref


def gate_step(
    state: GateState,
    step: int,
    rewards: list[float],
    lengths: list[int],
    every: int,
    window: int,
    delta: float,
    eps: float,
) -> tuple[GateState, bool, dict[str, float]]:
    """The gate after optimiser step `step` (1-based) whose own-domain rollouts had `rewards` and `lengths`.

    Returns (the new state, whether to refresh the teacher now, what the step's metrics log: the baseline when it is
    taken, every check's evidence and outcome; nothing on other steps). `state` is not modified."""
    new = replace(
        state, rewards=[*state.rewards, list(rewards)][-window:], lengths=[*state.lengths, list(lengths)][-window:]
    )
    pooled_rewards = [r for step_rewards in new.rewards for r in step_rewards]
    pooled_lengths = [n for step_lengths in new.lengths for n in step_lengths]
    if len(new.rewards) < window or not pooled_rewards:
        return new, False, {}
    reward_now = math.fsum(pooled_rewards) / len(pooled_rewards)
    p95_now = quantile([float(n) for n in pooled_lengths], 0.95)
    evidence = {"teacher_gate_reward": reward_now, "teacher_gate_len_p95": p95_now}
    if new.reward_ref is None:  # the first full window: the stage-start teacher's references
        new = replace(new, reward_ref=reward_now, p95_ref=p95_now, ref_step=step)
        return new, False, {"teacher_gate_baseline": 1.0, **evidence}
    if step % every != 0:
        return new, False, {}
    refresh = gate_allows_refresh(reward_now, new.reward_ref, p95_now, new.p95_ref, delta, eps)
    log = {
        "teacher_gate_check": 1.0,
        "teacher_gate_refused": float(not refresh),
        **evidence,
        "teacher_gate_reward_ref": new.reward_ref,
        "teacher_gate_len_p95_ref": new.p95_ref,
        "teacher_gate_ref_step": float(new.ref_step),
    }
    if refresh:
        new = replace(new, reward_ref=reward_now, p95_ref=p95_now, ref_step=step)
    return new, refresh, log


def clock_refresh(step: int, every: int) -> bool:
    """`restart_freeze` and `lag`: a copy at every multiple of `every` (1-based optimiser steps)."""
    return step % every == 0
