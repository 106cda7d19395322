"""Collapse guard: rules over the per-step metrics, each with an action (warn, stop the stage, or roll back).

Every rule is a pure function of the metric history (a list of the dicts a stage appends to metrics.jsonl) that
returns a message when it fires. `CollapseGuard.check` evaluates the enabled rules after each step and returns
the alarms; the stage acts on the strongest (rollback > stop > warn). A rollback restores the last good
checkpoint, scales the learning rate by `lr_scale_on_rollback` and continues, at most `max_rollbacks` times,
after which a rollback alarm stops the stage. `stop` also returns to the last checkpoint first, so a stopped
stage never ships the weights of the step that raised the alarm.

Defaults target the collapse reported in the SDPO-CL paper ("Denser != Better"): the teacher-student divergence
shrinks towards 0 while the reward falls (the student has become its own teacher and drifts together with it),
the fraction of samples with a teacher target falls to 0 (no successful sibling: SDPO has no gradient), and
repetition spikes before the output degenerates. `reward_collapse` catches the other way SDPO failed in
benchmarks/science on a 135M model: the divergence stays large, entropy rises, the answer format is lost and the
training reward falls to a fraction of its best.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from adaptercl.recipe import Action, MonitorConfig

ACTION_STRENGTH = {"off": 0, "warn": 1, "stop": 2, "rollback": 3}


@dataclass(frozen=True)
class Alarm:
    rule: str
    action: Action
    message: str


def _recent(history: list[dict], key: str, n: int) -> list[float]:
    return [h[key] for h in history[-n:] if key in h and h[key] is not None]


def rule_nonfinite(history: list[dict], cfg: MonitorConfig) -> str | None:
    last = history[-1]
    bad = [k for k in ("loss", "grad_norm") if k in last and not math.isfinite(last[k])]
    return f"non-finite {', '.join(bad)} at step {last.get('step')}" if bad else None


def rule_divergence_collapse(history: list[dict], cfg: MonitorConfig) -> str | None:
    div = _recent(history, "teacher_divergence", cfg.window)
    rewards = _recent(history, "reward_mean", 2 * cfg.window)
    if len(div) < cfg.window or len(rewards) < 2 * cfg.window:
        return None
    earlier, later = rewards[: cfg.window], rewards[cfg.window :]
    fall = sum(earlier) / len(earlier) - sum(later) / len(later)
    if max(div) < cfg.divergence_floor and fall > cfg.reward_fall:
        return f"teacher-student divergence {max(div):.2e} < {cfg.divergence_floor} while reward fell by {fall:.3f}"
    return None


def rule_target_starvation(history: list[dict], cfg: MonitorConfig) -> str | None:
    """Only steps that made no update count (`skipped_step`: SDPO/SDFT, whose sole loss is the distillation). A
    hybrid step without teacher targets still has GRPO's gradient: distilling only failed groups, it has no
    target exactly when every group succeeded, which is no collapse."""
    frac = _recent(history, "teacher_target_frac", cfg.window)
    skipped = _recent(history, "skipped_step", cfg.window)
    if len(frac) == cfg.window and max(frac) == 0.0 and len(skipped) == cfg.window and min(skipped) == 1.0:
        return f"no sample had a teacher target for {cfg.window} steps (no distillation gradient, no update)"
    return None


def rule_repetition(history: list[dict], cfg: MonitorConfig) -> str | None:
    rate = history[-1].get("repetition_rate")
    if rate is not None and rate > cfg.repetition_max:
        return f"repeated-4-gram rate {rate:.2f} > {cfg.repetition_max}"
    return None


def rule_reward_collapse(history: list[dict], cfg: MonitorConfig) -> str | None:
    rewards = _recent(history, "reward_mean", len(history))
    w = cfg.window
    if len(rewards) < w + 1:
        return None
    means = [sum(rewards[i : i + w]) / w for i in range(len(rewards) - w + 1)]  # sliding window means
    best, now = max(means[:-1]), means[-1]
    if best >= cfg.reward_collapse_min and now < cfg.reward_collapse_ratio * best:
        ratio = cfg.reward_collapse_ratio
        return f"reward (mean of the last {w} steps) {now:.3f} < {ratio} x the stage's best {best:.3f}"
    return None


def rule_entropy_collapse(history: list[dict], cfg: MonitorConfig) -> str | None:
    entropy = history[-1].get("entropy")
    if entropy is not None and entropy < cfg.entropy_min:
        return f"policy entropy {entropy:.4f} < {cfg.entropy_min}"
    return None


RULES: dict[str, Callable[[list[dict], MonitorConfig], str | None]] = {
    "nonfinite": rule_nonfinite,
    "divergence_collapse": rule_divergence_collapse,
    "target_starvation": rule_target_starvation,
    "repetition": rule_repetition,
    "reward_collapse": rule_reward_collapse,
    "entropy_collapse": rule_entropy_collapse,
}


class CollapseGuard:
    """Evaluates the enabled rules and tracks the rollback budget of one stage."""

    def __init__(self, cfg: MonitorConfig, rollbacks_used: int = 0):
        self.cfg = cfg
        self.rollbacks_used = rollbacks_used

    def check(self, history: list[dict]) -> list[Alarm]:
        alarms = []
        for name, rule in RULES.items():
            action = getattr(self.cfg, name)
            if action == "off" or not history:
                continue
            message = rule(history, self.cfg)
            if message is not None:
                alarms.append(Alarm(name, action, message))
        return alarms

    def decide(self, alarms: list[Alarm]) -> Action:
        """The action to take: the strongest alarm's, with rollback turned into stop once the budget is spent."""
        if not alarms:
            return "off"
        action = max((a.action for a in alarms), key=ACTION_STRENGTH.__getitem__)
        if action == "rollback":
            if self.rollbacks_used >= self.cfg.max_rollbacks:
                return "stop"
            self.rollbacks_used += 1
        return action

    def lr_scale(self) -> float:
        return self.cfg.lr_scale_on_rollback**self.rollbacks_used
