"""The science benchmark's two-level bootstrap (pure: run records in, resampled figures out; `analysis.py` takes the
statistics from them).

`figures` are the figures of one accuracy matrix; `bootstrap` resamples the seeds with replacement and then,
independently for each drawn seed and domain, that seed's eval examples with replacement, and recomputes every
figure from the resampled matrices, averaged over the drawn seeds. A seed fixes the eval set, so every method of a
seed is resampled with the same examples. `Draws` keeps one bootstrap per seed set: a method's own interval is over
its own seeds, and a difference of two methods (`difference`, `paired_means`) is paired over the seeds both have, so
a collection may give some methods more seeds than others (issue 37: more seeds where the question is) and every
comparison uses all the seeds its two methods share.
"""

from __future__ import annotations

import statistics

import torch

from adaptercl.measure.metrics import cl_metrics, stage_forgetting

RUN_FIGURES = ("acc", "forgetting", "plasticity", "bwt", "fwt", "retention_ratio", "gain_over_base")  # of cl_metrics


def figures(acc: torch.Tensor, cols: list[int]) -> dict[str, float | None]:
    """The bootstrapped figures of one accuracy matrix [K+1, D]: RUN_FIGURES, every cell (`cell k d`), each stage's
    gain on its own domain (`gain k` = a[k, c_k] − a[k−1, c_k], stages 1..K; plasticity is their mean), each trained
    domain's retention_ratio and gain_over_base (`retention_ratio c`, `gain_over_base c`; their means are in
    RUN_FIGURES: `measure.metrics.cl_metrics`), the
    forgetting each stage caused (`stage_forgetting k`, stages 2..K), each domain's peak (`peak d` = max over the
    rows, before training included) and the general-ability delta: each retention probe's change over the whole
    sequence (`probe_change d` = a[K, d] − a[0, d], d never trained) and their mean (`general_delta`, None without
    probes)."""
    cl = cl_metrics(acc, cols)
    out: dict[str, float | None] = {f: cl[f] for f in RUN_FIGURES}
    out["general_delta"] = cl["retention"]["mean_change"]
    for probe in cl["retention"]["probes"]:
        out[f"probe_change {probe['column']}"] = probe["change"]
    for d in range(acc.shape[1]):
        out[f"peak {d}"] = acc[:, d].max().item()
    for domain in cl["per_domain"]:  # issue 43: per trained domain
        out[f"retention_ratio {domain['column']}"] = domain["retention_ratio"]
        out[f"gain_over_base {domain['column']}"] = domain["gain_over_base"]
    for k, c in enumerate(cols, start=1):
        out[f"gain {k}"] = (acc[k, c] - acc[k - 1, c]).item()
    for k, value in enumerate(stage_forgetting(acc, cols), start=1):
        if k > 1:
            out[f"stage_forgetting {k}"] = value
    for k, row in enumerate(acc.tolist()):
        for d, value in enumerate(row):
            out[f"cell {k} {d}"] = value
    return out


def correct_tensors(run: dict) -> list[torch.Tensor]:
    """Per domain d, the run's correctness [K+1, n_d] (float)."""
    rows = run["correct"]
    return [torch.tensor([row[d] for row in rows], dtype=torch.float64) for d in range(len(run["domains"]))]


def mean_of(dicts: list[dict[str, float | None]]) -> dict[str, float | None]:
    """Key-wise mean, leaving out None."""
    out = {}
    for key in dicts[0]:
        values = [d[key] for d in dicts if d.get(key) is not None]
        out[key] = statistics.fmean(values) if values else None
    return out


def bootstrap(
    runs: dict[str, dict[int, dict]], seeds: list[int], resamples: int, seed: int = 0
) -> dict[str, list[dict[str, float | None]]]:
    """Per method, `resamples` two-level bootstrap draws of `figures` averaged over the drawn seeds (module
    docstring). `runs[method][seed]` is a record; every method must have every seed of `seeds`. Seeded."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {m: {s: correct_tensors(runs[m][s]) for s in seeds} for m in runs}
    first = runs[next(iter(runs))][seeds[0]]
    cols = first["trained_columns"]
    out: dict[str, list[dict]] = {m: [] for m in runs}
    for _ in range(resamples):
        drawn = [seeds[i] for i in torch.randint(len(seeds), (len(seeds),), generator=gen).tolist()]
        picks = []  # per drawn seed: per domain the example indices [n_d]
        for s in drawn:
            n = [t.shape[1] for t in tensors[next(iter(runs))][s]]
            picks.append([torch.randint(n_d, (n_d,), generator=gen) for n_d in n])
        for m in runs:
            per_seed = []
            for s, idx in zip(drawn, picks):
                acc = torch.stack([t[:, i].mean(dim=1) for t, i in zip(tensors[m][s], idx)], dim=1)  # [K+1, D]
                per_seed.append(figures(acc, cols))
            out[m].append(mean_of(per_seed))
    return out


def percentile(values: list[float]) -> list[float] | None:
    """The 2.5 % and 97.5 % quantiles (linear interpolation), None for no values."""
    if not values:
        return None
    q = torch.quantile(torch.tensor(values, dtype=torch.float64), torch.tensor([0.025, 0.975], dtype=torch.float64))
    return q.tolist()


def point(runs: dict[int, dict]) -> dict[str, float | None]:
    """`figures` of each seed's own accuracy matrix, averaged over the seeds."""
    return mean_of(
        [figures(torch.tensor(r["accuracy"], dtype=torch.float64), r["trained_columns"]) for r in runs.values()]
    )


class Draws:
    """The bootstrap draws of every seed set a comparison needs, made on first use: `over(seeds)` resamples every
    method that has all of `seeds` with the same draws (`bootstrap`, the same generator seed for every set), so a
    difference of two methods over the seeds both have is paired. `draws[m]`: method m's draws over its own seeds.
    With every method on the same seeds there is one set, and the draws are the one bootstrap of all methods."""

    def __init__(self, runs: dict[str, dict[int, dict]], resamples: int, seed: int = 0):
        self.runs, self.resamples, self.seed = runs, resamples, seed
        self.cache: dict[tuple[int, ...], dict[str, list[dict]]] = {}

    def over(self, seeds: tuple[int, ...]) -> dict[str, list[dict]]:
        """Per method having every one of `seeds`: its draws over them."""
        if seeds not in self.cache:
            having = {m: r for m, r in self.runs.items() if set(seeds) <= set(r)}
            self.cache[seeds] = (
                bootstrap(having, list(seeds), self.resamples, self.seed) if seeds else {m: [] for m in having}
            )
        return self.cache[seeds]

    def __getitem__(self, method: str) -> list[dict]:
        return self.over(tuple(sorted(self.runs[method])))[method]

    def shared(self, left: str, right: str) -> tuple[int, ...]:
        """The seeds both methods have, sorted."""
        return tuple(sorted(set(self.runs[left]) & set(self.runs[right])))

    def pair(self, left: str, right: str) -> tuple[list[dict], list[dict]]:
        """Both methods' draws over the seeds they share, paired draw by draw."""
        both = self.over(self.shared(left, right))
        return both[left], both[right]


def difference(draws: Draws, left: str, right: str, key: str, scale: float = 1.0) -> list[float]:
    """Paired bootstrap draws of left's figure minus `scale` × right's, over the seeds both have."""
    a_draws, b_draws = draws.pair(left, right)
    return [a[key] - scale * b[key] for a, b in zip(a_draws, b_draws) if None not in (a[key], b[key])]


def paired_means(summary: dict, draws: Draws, left: str, right: str, key: str) -> tuple[float | None, float | None]:
    """Both methods' figure `key` averaged over the seeds both have (each seed's own value, `summary[m]["per_seed"]`):
    the point estimate that goes with `difference`'s interval; each method's own mean where their seeds are the
    same."""
    out = []
    for m in (left, right):
        values = [summary[m]["per_seed"][s][key]["value"] for s in draws.shared(left, right)]
        values = [v for v in values if v is not None]
        out.append(statistics.fmean(values) if values else None)
    return out[0], out[1]


def sign_flip_p(values: list[float], alternative: str) -> float | None:
    """The exact one-sided sign-flip (permutation) p of paired per-seed differences: the share of the 2^n sign
    assignments whose mean is at least as extreme as the observed one in the `alternative` direction ("> 0" or
    "< 0"). With n seeds the smallest p is 2^-n (6 seeds: 0.016; 3 seeds: 0.125, which no test at 0.05 can pass).
    None without values. (Exact at small n where a bootstrap is anti-conservative: docs/design.md §5a.)"""
    if not values:
        return None
    n, observed = len(values), statistics.fmean(values)
    sign = 1.0 if alternative == "> 0" else -1.0
    hits = 0
    for mask in range(2**n):
        flipped = statistics.fmean(v if mask >> i & 1 else -v for i, v in enumerate(values))
        hits += sign * flipped >= sign * observed - 1e-12  # ties count (a 1e-12 slack for float sums)
    return hits / 2**n
