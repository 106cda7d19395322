"""Domains: what a stage trains on and what evaluation scores — prompts, gold answers, demonstrations, a reward.

A domain is built from one `DomainConfig` block of the recipe by `load_domain(cfg, seed, num_eval)`:

    domain = load_domain(recipe.domain("math"), seed=recipe.seed, num_eval=recipe.eval.examples_per_domain)
    for ex in domain.train:                       # Example(id, messages, answer, demonstration)
        text = tokenizer.apply_chat_template(ex.messages, add_generation_prompt=True, tokenize=False)
        ...
        result = domain.reward(completion, ex)    # RewardResult(score, correct, feedback)

Sources (`cfg.source`):
- `builtin:NAME` — procedural tasks generated from the seed, no download (`builtin.py`): arithmetic, mcq,
  toolcall, and `copy` (a trivial task for tiny random models).
- a local `.jsonl/.json/.parquet/.csv` file, a folder holding `<split>.<ext>` files, or a `datasets` hub id
  (`loading.py`); rows are turned into examples by a format preset (`datasets_formats.py`: gsm8k, math500,
  sciknoweval, tooluse, arc, boolq, piqa, winogrande) or by `generic` with a field mapping (`cfg.fields`).

The reward is `cfg.reward` when given (a name from `adaptercl.rewards.REWARDS` or `pkg.module:function`),
otherwise the format's default. `format_patterns` are regexes of this domain's own answer-format tokens; the
drift monitor counts them in other domains' responses to measure format leakage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Example:
    id: str
    messages: list[dict[str, str]]  # chat turns ending with the user turn (system first if any)
    answer: Any  # what the reward checks against (gold)
    demonstration: str | None = None  # a reference response (SDFT teacher context); None when the source has none


@dataclass(frozen=True)
class RewardResult:
    score: float  # scalar reward used for advantages (correct -> 1.0; may give partial credit e.g. format)
    correct: bool  # exact task success, used for accuracy
    feedback: str | None = None  # what was wrong (SDPO teacher context when no sibling succeeded); None if correct


RewardFn = Callable[[str, Example], RewardResult]  # (completion text, example) -> result


@dataclass
class Domain:
    name: str
    train: list[Example]
    eval: list[Example]
    reward: RewardFn
    format_patterns: list[str]  # regexes of this domain's own answer-format tokens (format-leak detection)
    skipped: int = 0  # malformed rows skipped (cfg.skip_malformed)
    overlap: int = 0  # eval prompts that also occurred in train; those train rows were dropped


# Imported last: the loaders use the dataclasses above.
from adaptercl.domains.loading import load_domain  # noqa: E402

__all__ = ["Domain", "Example", "RewardFn", "RewardResult", "load_domain"]
