"""Greedy evaluation of every domain under a given set of adapters -> one row of the accuracy matrix.

A domain's accuracy is the fraction of its eval examples whose greedy completion the domain's reward marks
`correct`. `eval.json` keeps, per domain, accuracy, mean reward, the count, whether each example was correct (in
eval-set order, so intervals over examples and paired comparisons of runs on the same eval set can be taken after the
run) and a few sample completions.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import PreTrainedTokenizerBase

from adaptercl.batching import encode_chat
from adaptercl.domains import Domain
from adaptercl.rollout import RolloutEngine, SamplingParams

SAMPLES_KEPT = 3


def evaluate_domain(
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    domain: Domain,
    adapters: list[str] | None,
    max_new_tokens: int,
    limit: int,
) -> dict:
    examples = domain.eval[:limit]
    prompts = [encode_chat(tokenizer, ex.messages) for ex in examples]
    params = SamplingParams(max_new_tokens=max_new_tokens, greedy=True, n=1)
    completions = [g[0] for g in engine.generate(prompts, adapters, params)]
    results = [domain.reward(c.text, ex) for c, ex in zip(completions, examples)]
    return {
        "accuracy": sum(r.correct for r in results) / len(results),
        "reward_mean": sum(r.score for r in results) / len(results),
        "n": len(results),
        "mean_response_tokens": sum(len(c.token_ids) for c in completions) / len(completions),
        "correct": [bool(r.correct) for r in results],  # [n], eval-set order
        "samples": [
            {"id": ex.id, "completion": c.text, "correct": r.correct}
            for ex, c, r in list(zip(examples, completions, results))[:SAMPLES_KEPT]
        ],
    }


def evaluate_all(
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    domains: list[Domain],
    adapters: list[str] | None,
    max_new_tokens: int,
    limit: int,
    on_domain: Callable[[int, int], None] | None = None,
) -> dict[str, dict]:
    """Evaluate every domain; keys keep the recipe's domain order. `on_domain(done, total)` after each domain."""
    out = {}
    for i, d in enumerate(domains):
        out[d.name] = evaluate_domain(engine, tokenizer, d, adapters, max_new_tokens, limit)
        if on_domain is not None:
            on_domain(i + 1, len(domains))
    return out
