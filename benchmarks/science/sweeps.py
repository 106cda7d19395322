"""What each science collection runs, and the domain sequences the collections and the pilots choose among.

- `SEQUENCES`: built-in domain sequences, each a list of (builtin domain, optimiser steps of its stage).
  `with_sequence` puts one into a recipe in place of base.yaml's arithmetic -> mcq -> toolcall (every other setting,
  the budget per step included, stays base.yaml's). The candidates of issue 37 are pairs whose required outputs
  conflict on similar inputs (mcq's letter against mcq_text's option text, arithmetic's "The answer is N." against
  arithmetic_hash's "#### N": the same questions and facts under another convention, adaptercl/domains/builtin.py)
  in both orders, and the old pair (arithmetic, mcq) in the order the earlier collections did not run.
- `COLLECTIONS`: a collection is a sequence (None: base.yaml's own), the seeds of each method (a method's seeds may
  differ: the paired comparisons use the seeds two methods share, resampling.py), the folder its results.* go to
  (relative to benchmarks/science), base.yaml overrides of its own (`settings`) and the method whose run of a seed
  evaluates row 0 for the seed's other runs (`shares_row0_from`, eval.before_from). Issue 43's collections
  (`frontier`, `frontier_reverse`, `frontier_three`: README "Issue 43") run as one sweep, seed by seed across them
  (`interleaved_jobs`). `issue25` is the earlier collection, as it ran; `forgetting` is issue 37's, on a
  sequence where GRPO forgets, chosen by the pilots (pilot.py, README "Issue 37: pilots"): until they have chosen,
  its `sequence` is None and run.py refuses to start it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

SEQUENCES: dict[str, list[tuple[str, int]]] = {
    "arithmetic-mcq-toolcall": [("arithmetic", 12), ("mcq", 12), ("toolcall", 24)],  # base.yaml's (issue 25)
    "mcq-mcq_text": [("mcq", 12), ("mcq_text", 12)],
    "mcq_text-mcq": [("mcq_text", 12), ("mcq", 12)],
    "arithmetic-arithmetic_hash": [("arithmetic", 12), ("arithmetic_hash", 12)],
    "arithmetic_hash-arithmetic": [("arithmetic_hash", 12), ("arithmetic", 12)],
    "mcq-arithmetic": [("mcq", 12), ("arithmetic", 12)],
    "calc_hash-calc_says": [("calc_hash", 12), ("calc_says", 12)],
    "calc_says-calc_hash": [("calc_says", 12), ("calc_hash", 12)],
    # issue 43's candidates for its three-stage sequence S3 (README "Issue 43: ... pre-registration"): toolcall's
    # stage 24 steps, as base.yaml's
    "calc_hash-calc_says-toolcall": [("calc_hash", 12), ("calc_says", 12), ("toolcall", 24)],
    "calc_hash-calc_says-mcq": [("calc_hash", 12), ("calc_says", 12), ("mcq", 12)],
    "toolcall-calc_hash-calc_says": [("toolcall", 24), ("calc_hash", 12), ("calc_says", 12)],
}
THREE_STAGE_CANDIDATES = ["calc_hash-calc_says-toolcall", "calc_hash-calc_says-mcq", "toolcall-calc_hash-calc_says"]


def with_sequence(recipe: dict, name: str) -> dict:
    """A copy of `recipe` whose domains and stages are sequence `name`'s: one builtin domain per stage, the method of
    the recipe's first stage on every stage, one evolving adapter (`init: continue` from stage 2 on, as base.yaml's),
    each stage's steps set where they differ from the recipe's `optim.steps`."""
    if name not in SEQUENCES:
        raise SystemExit(f"unknown sequence {name!r}; sequences: {', '.join(SEQUENCES)}")
    out = copy.deepcopy(recipe)
    method = recipe["stages"][0]["method"]
    out["domains"] = [{"name": d, "source": f"builtin:{d}"} for d, _ in SEQUENCES[name]]
    out["stages"] = []
    for k, (domain, steps) in enumerate(SEQUENCES[name]):
        stage = {"name": domain, "domain": domain, "method": method}
        if k:
            stage["adapter"] = {"init": "continue"}
        if steps != recipe["optim"]["steps"]:
            stage["optim"] = {"steps": steps}
        out["stages"].append(stage)
    return out


@dataclass(frozen=True)
class Collection:
    sequence: str | None  # a SEQUENCES name; None: base.yaml's own (issue25), or not chosen yet (forgetting)
    seeds: dict[str, list[int]]  # method (method_recipes.py METHODS) -> its seeds, in the order the tables list them
    out: str  # where results.json/.md/.png go, relative to benchmarks/science
    runs: str  # the default runs folder, relative to the repo root
    needs_sequence: bool = False  # refuse to run while `sequence` is None (a collection waiting for its pilots)
    settings: tuple[str, ...] = ()  # base.yaml overrides (run.py --set form) every run of the collection gets
    # the method whose run of a seed evaluates row 0 for every other run of that seed (eval.before_from); None: each
    # run evaluates its own
    shares_row0_from: str | None = None


ISSUE25 = ["grpo", "grpo_kl", "sdpo", "sdpo_gated", "srpo", "srpo_continual", "hybrid"]
# issue 37: more seeds where the question is (does a conservative update forget less than GRPO at equal ACC: GRPO,
# GRPO + 10 % replay, the hybrid), 3 for the rest (README "Issue 37: the collection": what it can decide, its budget)
MORE_SEEDS, SEEDS = [0, 1, 2, 3, 4, 5], [0, 1, 2]
FORGETTING = {
    "grpo": MORE_SEEDS,
    "grpo_replay01": SEEDS,
    "grpo_replay10": MORE_SEEDS,
    "hybrid": MORE_SEEDS,
    "hybrid_gated": SEEDS,
    "srpo": SEEDS,
    "srpo_gated": SEEDS,
    "sdpo": SEEDS,
}
# The two earlier collections scored the retention probes by generation; that stays theirs, so that their recipes
# (and results) come out again from this revision
GENERATED_PROBES = ("eval.choice_scoring=generate",)

# Issue 43 (README "Issue 43: ... pre-registration"): GRPO's frontier settings, the hybrid and its ablations
HEADLINE_METHODS = ["grpo", "hybrid", "hybrid_no_distill", "hybrid_no_replay", "hybrid_no_l2"]
FRONTIER_SETTINGS = [
    "grpo",
    "grpo_lr050",
    "grpo_lr025",
    "grpo_replay10",
    "grpo_replay25",
    "grpo_l2",
    "hybrid_no_distill",
]
ISSUE43_SETTINGS = (  # cheaper diagnostics (they measure drift, not the headline); probes by log-likelihood
    "eval.choice_scoring=loglikelihood",
    "eval.drift_probes=2",
    "eval.stage_kl_prompts=16",
    "eval.teacher_lift_prompts=16",
)
S1_SEEDS = {m: MORE_SEEDS for m in dict.fromkeys(HEADLINE_METHODS + FRONTIER_SETTINGS)} | {"joint": SEEDS}
S2_SEEDS = (
    {m: MORE_SEEDS for m in HEADLINE_METHODS}
    | {m: SEEDS for m in FRONTIER_SETTINGS if m not in HEADLINE_METHODS}
    | {"joint": SEEDS}
)
S3_SEEDS = {m: SEEDS for m in ["grpo", "hybrid", "hybrid_no_distill", "grpo_lr050", "grpo_lr025", "joint"]}

COLLECTIONS: dict[str, Collection] = {
    "issue25": Collection(None, {m: [0, 1, 2] for m in ISSUE25}, ".", "runs/science", settings=GENERATED_PROBES),
    # the sequence: the pilots' choice (README "Issue 37: pilots", pilots.md): of the candidates that met the
    # criterion on seed 100, the one with the highest lower end of GRPO's forgetting interval
    "forgetting": Collection(
        "calc_hash-calc_says",
        FORGETTING,
        "forgetting",
        "runs/science-forgetting",
        needs_sequence=True,
        settings=GENERATED_PROBES,
    ),
    # issue 43's collections: S1, S2 and S3 (chosen by its pilots among THREE_STAGE_CANDIDATES; None until then)
    "frontier": Collection(
        "calc_hash-calc_says", S1_SEEDS, "frontier", "runs/science-frontier", settings=ISSUE43_SETTINGS,
        shares_row0_from="grpo",
    ),
    "frontier_reverse": Collection(
        "calc_says-calc_hash", S2_SEEDS, "frontier_reverse", "runs/science-frontier-reverse",
        settings=ISSUE43_SETTINGS, shares_row0_from="grpo",
    ),
    # S3: the pilots' choice by the pre-registered rule (README "Issue 43", pilots_s3.md): of the two candidates that
    # qualified, the higher lower end of GRPO's forgetting interval (0.380 against 0.140)
    "frontier_three": Collection(
        "toolcall-calc_hash-calc_says", S3_SEEDS, "frontier_three", "runs/science-frontier-three", needs_sequence=True,
        settings=ISSUE43_SETTINGS, shares_row0_from="grpo",
    ),
}  # fmt: skip
# issue 43's sweep: its collections run as one job list (`interleaved_jobs`)
FRONTIER_SWEEP = ["frontier", "frontier_reverse", "frontier_three"]
DEFAULT_COLLECTION = "issue25"


def jobs(seeds: dict[str, list[int]]) -> list[tuple[str, int]]:
    """(method, seed) runs, seed by seed (every method's seed 0 first): a sweep stopped early has whole seeds."""
    return [(m, s) for s in sorted({s for v in seeds.values() for s in v}) for m, v in seeds.items() if s in v]


def interleaved_jobs(collections: dict[str, dict[str, list[int]]]) -> list[tuple[str, str, int]]:
    """(collection, method, seed) runs of several collections, seed by seed and, within a seed, collection by
    collection in the order given, each collection's methods in its own order: a sweep stopped early has whole seeds
    of every collection listed first (issue 43's job order)."""
    seeds = sorted({s for c in collections.values() for v in c.values() for s in v})
    return [(c, m, s) for s in seeds for c, ms in collections.items() for m, v in ms.items() if s in v]
