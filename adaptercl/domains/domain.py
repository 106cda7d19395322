"""The data types every domain shares: `Example`, `RewardResult`, `RewardFn`, `BatchRewardFn`, `Domain` and
`MalformedRow` (a row that cannot become an example), `score_samples`, which scores a batch whose samples may come
from several domains (replay), and `is_success`, the one rule for which samples count as successes.

What is correct and what is a success, decided once, at scoring time: `RewardResult.correct` is exact task success
(the accuracy matrix, `correct_frac`); a native reward sets it itself, TRL-style rewards from the domain's
`correct_from` functions (`trl_rewards.correct_mask`). `is_success(result, distill.success_threshold)` is what the
self-distilling methods act on (SDPO's "Correct solution" sibling, the hybrid's failed groups, SDFT's
`success_frac`): `correct` for TRL-style rewards, `score >= success_threshold` for native ones (whose partial
credit stays below the default 0.5). `RewardResult.scored` is False for a sample every TRL function returned None
for: it is neither correct nor a success, and gets advantage 0 outside its group's baseline
(`train.losses.group_advantages`).

A domain scores completions in one of two ways: a native reward `(text, Example) -> RewardResult` per sample (the
builtin rewards and user rewards that return feedback for SDPO), or a batch reward over all samples at once
(`trl_rewards.py`: TRL-style reward functions, which are batched and may need the completion token ids).
`Domain.score` is the one entry point for both; callers that hold completions use it (or `score_samples`).

They live in their own module so that the loaders (`loading.py`, `builtin.py`, `datasets_formats.py`) and the
rewards (`rewards.py`) import them from here and never from the package `adaptercl.domains`, which re-exports them
for the rest of the toolkit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class MalformedRow(ValueError):
    """A dataset row that cannot become an example: `field` names the culprit (the loader adds file and row)."""

    def __init__(self, field: str | None, problem: str):
        super().__init__(f"field {field!r} {problem}" if field else problem)
        self.field = field


@dataclass(frozen=True)
class Example:
    id: str
    messages: list[dict[str, str]]  # chat turns ending with the user turn (system first if any)
    answer: Any  # what the reward checks against (gold)
    demonstration: str | None = None  # a reference response (SDFT teacher context); None when the source has none
    # The source row's columns (builtin tasks: none); TRL-style rewards receive them as keyword lists. Not compared:
    # two examples are equal by id, prompt, answer and demonstration.
    columns: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # Whether the source gave the prompt as chat messages (TRL's "conversational" format) rather than a string
    # ("standard"); TRL-style rewards see prompts and completions in that format.
    conversational: bool = False


@dataclass(frozen=True)
class RewardResult:
    score: float  # scalar reward used for advantages (correct -> 1.0; may give partial credit e.g. format)
    correct: bool  # exact task success, used for accuracy
    feedback: str | None = None  # what was wrong (SDPO teacher context when no sibling succeeded); None if correct
    # The feedback tells more than a format problem: that the answer is wrong, or what the gold is. Shown to the
    # teacher only where the domain's `feedback` is "correctness" (`rewards.with_feedback`); a user reward's
    # feedback leaves it False and so passes unless the domain says "none".
    reveals_correctness: bool = False
    # TRL-style rewards (`trl_rewards.py`): each function's own, unweighted reward, (name, value) in the domain's
    # order, NaN where it returned None; the step log's `rewards/<name>/mean` and `/std`. Empty for a native reward.
    components: tuple[tuple[str, float], ...] = ()

    @property
    def from_reward_funcs(self) -> bool:
        """Scored by TRL-style reward functions (it has their per-function rewards), not by a native reward."""
        return bool(self.components)

    @property
    def scored(self) -> bool:
        """False when every TRL-style function returned None (TRL's "unscorable" sample); a native result always
        is scored."""
        return not self.components or not all(math.isnan(value) for _, value in self.components)


def is_success(result: RewardResult, success_threshold: float) -> bool:
    """Whether SDPO/SDFT/the hybrid count the sample a success (a sibling shown as the teacher's "Correct
    solution"; a group with one is not failed): `correct` for TRL-style rewards (the domain's `correct_from`
    decision, the accuracy matrix's), `score >= success_threshold` (distill.success_threshold) for a native reward.
    Every consumer of "success" calls this."""
    if result.from_reward_funcs:
        return result.correct
    return result.score >= success_threshold


RewardFn = Callable[[str, Example], RewardResult]  # (completion text, example) -> result
# (completion texts [N], completion token ids [N], examples [N]) -> results [N]
BatchRewardFn = Callable[[list[str], list[list[int]], list[Example]], list[RewardResult]]


@dataclass
class Domain:
    name: str
    train: list[Example]
    eval: list[Example]
    reward: RewardFn
    format_patterns: list[str]  # regexes of this domain's own answer-format tokens (format-leak detection)
    skipped: int = 0  # malformed rows skipped (cfg.skip_malformed)
    overlap: int = 0  # eval prompts that also occurred in train; those train rows were dropped
    # TRL-style rewards (`trl_rewards.py`) score a whole batch; `reward` then scores one sample through it, without
    # token ids (a reward that needs `completion_ids` must be reached through `score`).
    batch_reward: BatchRewardFn | None = None
    # The reward reads an option letter (`choice_letter`): the domain can be scored by the log-likelihood of its
    # options' letters (`measure/choice_scoring.py`, for retention probes under eval.choice_scoring)
    choice_letters: bool = False

    def score(self, texts: list[str], completion_ids: list[list[int]], examples: list[Example]) -> list[RewardResult]:
        """Results of N completions (texts and token ids) of the examples, in order; one batch call when the
        domain's rewards are TRL-style, else the native reward per sample."""
        if self.batch_reward is not None:
            return self.batch_reward(texts, completion_ids, examples)
        return [self.reward(text, ex) for text, ex in zip(texts, examples, strict=True)]


def score_samples(
    texts: list[str], completion_ids: list[list[int]], examples: list[Example], domains: list[Domain]
) -> list[RewardResult]:
    """Sample i scored by `domains[i]` (a stage's own domain or a replayed earlier one), each domain in one
    `Domain.score` call over its samples in order, so TRL-style rewards see whole groups."""
    results: list[RewardResult | None] = [None] * len(texts)
    owners: dict[int, tuple[Domain, list[int]]] = {}
    for i, domain in enumerate(domains):
        owners.setdefault(id(domain), (domain, []))[1].append(i)
    for domain, index in owners.values():
        scored = domain.score(
            [texts[i] for i in index], [completion_ids[i] for i in index], [examples[i] for i in index]
        )
        for i, result in zip(index, scored, strict=True):
            results[i] = result
    return results  # type: ignore[return-value]  # every index is owned by exactly one domain
