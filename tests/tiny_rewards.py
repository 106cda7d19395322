"""User rewards for tests (`reward: "tiny_rewards:digit_fraction"`): dense, so a random model's samples differ."""

from adaptercl.domains import Example, RewardResult


def digit_fraction(text: str, example: Example) -> RewardResult:
    frac = sum(c.isdigit() for c in text) / max(1, len(text))
    return RewardResult(score=frac, correct=frac > 0.2, feedback=None if frac > 0.2 else "Use more digits.")


def poisoned(text: str, example: Example) -> RewardResult:
    """A reward that breaks training (NaN): the collapse guard must catch the non-finite loss at once."""
    return RewardResult(score=float("nan"), correct=False)


def text_length(text: str, example: Example) -> RewardResult:
    """Dense for any model: the decoded response's length in characters (samples of a random model differ)."""
    return RewardResult(score=len(text) / 100, correct=len(text) > 20)
