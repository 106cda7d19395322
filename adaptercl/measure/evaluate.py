"""Greedy evaluation of every domain under a given set of adapters -> one row of the accuracy matrix.

A domain's accuracy is the fraction of its eval examples whose greedy completion the domain's reward marks
`correct`. `eval.json` keeps, per domain, accuracy, mean reward, the count, whether each example was correct (in
eval-set order, so intervals over examples and paired comparisons of runs on the same eval set can be taken after the
run), each example's greedy completion (`completions`, eval-set order: the formatting-artifact diagnostic,
`artifacts.py`, compares a stage's with the base's) and the first few with their ids (`samples`). Under data-parallel
ranks (`system/distributed.py`) each rank decodes a contiguous share of the examples and every rank gathers all of
them, in order, so the row is computed from the same list as with one process. Multiple-choice retention probes
are scored by the log-likelihood of their option letters instead (`choice_scoring.py`, `eval.choice_scoring`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedTokenizerBase

from adaptercl.domains import Domain
from adaptercl.measure.choice_scoring import evaluate_choices
from adaptercl.model import encode_chat
from adaptercl.rollout import RolloutEngine, SamplingParams
from adaptercl.system import distributed

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
    lo, hi = distributed.shard_bounds(len(examples))  # this rank's share (all of them for 1 process)
    prompts = [encode_chat(tokenizer, ex.messages) for ex in examples[lo:hi]]
    params = SamplingParams(max_new_tokens=max_new_tokens, greedy=True, n=1)
    # every rank asks, even with no share: the vLLM engines' generate is collective under N ranks
    asks = prompts or distributed.world().size > 1
    completions = [g[0] for g in engine.generate(prompts, adapters, params)] if asks else []
    texts, ids = [c.text for c in completions], [c.token_ids for c in completions]
    results = domain.score(texts, ids, examples[lo:hi]) if completions else []
    records = distributed.gather_lists(
        [(c.text, len(c.token_ids), r.score, r.correct) for c, r in zip(completions, results)]
    )
    return {
        "accuracy": sum(correct for *_, correct in records) / len(records),
        "reward_mean": sum(score for _, _, score, _ in records) / len(records),
        "n": len(records),
        "mean_response_tokens": sum(n_tokens for _, n_tokens, _, _ in records) / len(records),
        "correct": [bool(correct) for *_, correct in records],  # [n], eval-set order
        "completions": [text for text, *_ in records],  # [n], eval-set order
        "samples": [
            {"id": ex.id, "completion": text, "correct": correct}
            for ex, (text, _, _, correct) in list(zip(examples, records))[:SAMPLES_KEPT]
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
    by_loglikelihood: set[str] = frozenset(),
    model: torch.nn.Module | None = None,
) -> dict[str, dict]:
    """Evaluate every domain; keys keep the recipe's domain order. `on_domain(done, total)` after each domain. The
    domains named in `by_loglikelihood` are scored by the log-likelihood of their option letters on `model`
    (`choice_scoring.py`), the others by greedy generation."""
    out = {}
    for i, d in enumerate(domains):
        if d.name in by_loglikelihood:
            out[d.name] = evaluate_choices(model, tokenizer, d, adapters, limit)
        else:
            out[d.name] = evaluate_domain(engine, tokenizer, d, adapters, max_new_tokens, limit)
        if on_domain is not None:
            on_domain(i + 1, len(domains))
    return out
