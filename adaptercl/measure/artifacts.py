"""The formatting-artifact diagnostic: how much more often a stage's responses use their most frequent n-grams than
the base model's responses did (the "Denser ≠ Better" paper reports high-frequency formatting artifacts that the
teacher–student loop amplifies). Pure: texts in, JSON-ready numbers out.

Definition (`formatting_artifacts`), for one stage k and its own domain d:
- responses: the greedy eval responses on d's eval prompts after stage k (eval.json `completions`), and the base
  responses on the same prompts before training (row 0);
- tokens: words and single punctuation marks (`WORD_RE`: `\\w+|[^\\w\\s]`), so `<answer>B</answer>` is
  `< answer > B < / answer >` and markup counts as n-grams of its own; lower-cased;
- for each n in `ns` (default 2, 3, 4): the top-`k` (default 10) most frequent n-grams of the stage's responses,
  counted at every position (overlapping) and pooled over responses; ties by the n-gram's text, so the choice is
  deterministic;
- rate of a response set: the share of its n-gram positions (n in `ns` pooled) that hold one of the stage's top-k
  n-grams of that n. `rate` is the stage's, `base_rate` the base responses' with the same n-grams;
  `ratio` = rate / base_rate (None when base_rate is 0) and `difference` = rate − base_rate.
The content of an answer changes from prompt to prompt, so the most frequent n-grams of a response set are its
boilerplate: answer tags, "the answer is", JSON keys, repeated filler. A ratio of 1 is no change: with the base's own
responses as the stage's (nothing trained) the ratio is exactly 1. The n-grams are chosen on the stage's responses,
so a ratio above 1 reads "the stage's favourite phrasing is this many times as frequent as it was"; `top` lists them
with both rates, so what grew can be read.
"""

from __future__ import annotations

import re
from collections import Counter

WORD_RE = re.compile(r"\w+|[^\w\s]")  # words and single punctuation marks
NGRAM_SIZES = (2, 3, 4)  # default n: short enough for a tag or a phrase, long enough not to be a single word
TOP_K = 10  # default n-grams per n: the boilerplate of a domain's answers, not its content


def words(text: str) -> list[str]:
    """The lower-cased word and punctuation tokens of `text`."""
    return [w.lower() for w in WORD_RE.findall(text)]


def ngram_counts(texts: list[str], n: int) -> tuple[Counter, int]:
    """Counts of every n-gram (overlapping positions, pooled over `texts`) and the number of positions."""
    counts: Counter = Counter()
    positions = 0
    for text in texts:
        tokens = words(text)
        grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
        counts.update(grams)
        positions += len(grams)
    return counts, positions


def top_ngrams(counts: Counter, k: int) -> list[tuple[str, ...]]:
    """The `k` most frequent n-grams, ties broken by the n-gram's text (deterministic)."""
    return [gram for gram, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:k]]


def formatting_artifacts(
    responses: list[str], base_responses: list[str], ns: tuple[int, ...] = NGRAM_SIZES, k: int = TOP_K
) -> dict:
    """The artifact diagnostic of `responses` against `base_responses` (module docstring): rate, base_rate, ratio,
    difference, and `top`: every chosen n-gram with its own rate and base rate (share of the positions of its n),
    most frequent first."""
    if not ns or min(ns) < 1 or k < 1:
        raise ValueError(f"ns must be sizes >= 1 and k >= 1, got ns={ns}, k={k}")
    hits = base_hits = positions = base_positions = 0
    top = []
    for n in ns:
        counts, n_positions = ngram_counts(responses, n)
        base_counts, n_base_positions = ngram_counts(base_responses, n)
        chosen = top_ngrams(counts, k)
        hits += sum(counts[g] for g in chosen)
        base_hits += sum(base_counts[g] for g in chosen)
        positions += n_positions
        base_positions += n_base_positions
        top += [
            {
                "ngram": " ".join(g),
                "rate": counts[g] / n_positions,
                "base_rate": base_counts[g] / n_base_positions if n_base_positions else None,
            }
            for g in chosen
        ]
    rate = hits / positions if positions else None
    base_rate = base_hits / base_positions if base_positions else None
    return {
        "rate": rate,
        "base_rate": base_rate,
        "ratio": rate / base_rate if rate is not None and base_rate else None,
        "difference": rate - base_rate if rate is not None and base_rate is not None else None,
        "top": sorted(top, key=lambda t: -t["rate"]),
        "responses": len(responses),
        "ns": list(ns),
        "k": k,
    }


def stage_artifacts(
    rows: list[dict], domains: list[str], trained_columns: list[int], ns: tuple[int, ...] = NGRAM_SIZES, k: int = TOP_K
) -> list[dict | None]:
    """Per stage k = 1..K: `formatting_artifacts` of its own domain's eval completions after stage k against row 0's
    (`rows[k]` the eval.json of row k: domain -> {"completions": [...]}); None for a stage whose rows keep no
    completions (a run written before eval.json kept them)."""
    out: list[dict | None] = []
    for k_stage, column in enumerate(trained_columns, start=1):
        domain = domains[column]
        stage, base = rows[k_stage].get(domain, {}), rows[0].get(domain, {})
        if "completions" not in stage or "completions" not in base:
            out.append(None)
            continue
        out.append({"domain": domain, **formatting_artifacts(stage["completions"], base["completions"], ns, k)})
    return out
