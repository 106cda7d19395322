"""User rewards for tests (`reward: "tiny_rewards:digit_fraction"`): dense, so a random model's samples differ."""

import os
from pathlib import Path

from adaptercl.domains import Example, RewardResult


def digit_fraction(text: str, example: Example) -> RewardResult:
    frac = sum(c.isdigit() for c in text) / max(1, len(text))
    return RewardResult(score=frac, correct=frac > 0.2, feedback=None if frac > 0.2 else "Use more digits.")


def poisoned(text: str, example: Example) -> RewardResult:
    """A reward that breaks training (NaN): the collapse guard must catch the non-finite loss at once."""
    return RewardResult(score=float("nan"), correct=False)


def poisoned_on_rank_1_after_step_1(text: str, example: Example) -> RewardResult:
    """digit_fraction, but NaN on rank 1 once the file ADAPTERCL_TEST_POISON_AFTER names is not empty (the stage's
    metrics.jsonl: from its 2nd step on): one rank's non-finite step, which every rank must skip and roll back."""
    flag = os.environ.get("ADAPTERCL_TEST_POISON_AFTER")
    if os.environ.get("RANK") == "1" and flag and Path(flag).is_file() and Path(flag).stat().st_size > 0:
        return RewardResult(score=float("nan"), correct=False)
    return digit_fraction(text, example)


# ---------------------------------------------------------------------------------------------------- TRL-style

TRL_CALLS: list[dict] = []  # what `recorded` was given, one entry per call


def recorded(prompts, completions, completion_ids, **kwargs) -> list[float | None]:
    """A TRL-style reward that records its arguments and returns the row's `bonus` column (None where absent)."""
    TRL_CALLS.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **kwargs})
    return [None if b is None else float(b) for b in kwargs.get("bonus", [None] * len(completions))]


def text_length(completions, **kwargs) -> list[float]:
    """A TRL-style reward for standard-format completions (strings): their length in characters."""
    return [float(len(c)) for c in completions]


def two_values(prompts, completions, completion_ids, **kwargs):
    """A broken TRL-style reward: two values whatever the batch size."""
    return [0.0, 1.0]


def three_args(a, b, c):
    """Neither a native nor a TRL reward."""
    return 0.0


def char_length(text: str, example: Example) -> RewardResult:
    """Dense for any model: the decoded response's length in characters (samples of a random model differ)."""
    return RewardResult(score=len(text) / 100, correct=len(text) > 20)


def raises(prompts, completions, completion_ids, **kwargs):
    """A broken TRL-style reward: it raises on every call."""
    raise ValueError("this reward is broken")


def even_length_or_none(completions, **kwargs) -> list[float | None]:
    """A TRL-style reward that does not apply to some samples: None for a completion of odd length, else its length
    mod 3 (a random model's groups mix None with values)."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [None if len(t) % 2 else float(len(t) % 3) for t in texts]


def letter_accuracy(completions, answer, **kwargs) -> list[float]:
    """A TRL user's accuracy reward: 1.0 where the (standard) completion equals the row's `answer` column."""
    return [float(c.strip() == str(a)) for c, a in zip(completions, answer)]
