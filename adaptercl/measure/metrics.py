"""Continual-learning metrics and response-drift diagnostics (docs/design.md §5), as pure functions of tensors
and numbers.

What this module owns:
- `cl_metrics`: ACC, average accuracy, BWT and FWT (GEM's), forgetting (Chaudhry et al.'s, and a variant that
  counts the pre-training row), plasticity and retention-probe change from an accuracy matrix a[k, j] (row k =
  after stage k, row 0 = before training; column j = domain or probe); `CL_METRIC_DEFINITIONS` states each in words;
  `stage_forgetting`, the forgetting each stage caused (against its KL from the previous policy: `stats.linear_fit`).
- Response drift on probe prompts: `token_kl`, `token_js`, `mean_entropy` (and their per-token forms
  `kl_per_token`, `js_per_token`, `entropy_per_token`, which `policy_divergence.py` runs a chunk of tokens at a
  time), `repeated_ngram_rate`, `pattern_rate`.

Parameter drift of one weight matrix is `weight_drift.py`. Nothing here touches a model, a file or a config:
`evaluate.py` builds the accuracy matrix, `adapters/live.py` the ΔW, the probe runner the log-probs; results are
JSON-ready Python floats (None where a metric is undefined).

Conventions: natural-log units (nats) for KL / JS / entropy. A mean over an empty set of tokens or texts is NaN
(never 0, which would read as "no drift" or "entropy collapse").
"""

from __future__ import annotations

import math
import re

import torch
from torch import Tensor

# --------------------------------------------------------------------------------------------------------------
# Continual-learning metrics over the accuracy matrix
# --------------------------------------------------------------------------------------------------------------

# What each headline key of `cl_metrics` means, in words; report.md prints it next to the number. a[k, c] is the
# accuracy on column c after stage k (row 0 = before training), T the number of stages, c_k the domain stage k
# trains (each domain trained once; `cl_metrics` says how a domain trained several times is counted).
CL_METRIC_DEFINITIONS: dict[str, str] = {
    "acc": "mean over the trained domains of the final accuracy a[T, c]",
    "average_accuracy": "mean over stages k = 1..T of the mean accuracy after stage k on the domains trained so far",
    "bwt": "backward transfer (GEM, Lopez-Paz & Ranzato 2017): mean over j = 1..T−1 of a[T, c_j] − a[j, c_j], "
    "final accuracy on a domain minus its accuracy just after its own stage (T − 1 terms; negative = forgetting)",
    "fwt": "forward transfer (GEM): mean over j = 2..T of a[j−1, c_j] − a[0, c_j], accuracy on a domain just "
    "before its own stage minus before any training (T − 1 terms; the first domain has no earlier stage)",
    "forgetting": "forgetting (Chaudhry et al. 2018): mean over j = 1..T−1 of max_{1≤k≤T−1} a[k, c_j] − a[T, c_j], "
    "best accuracy after stages 1..T−1 minus final (the before-training row 0 is not in the max)",
    "forgetting_from_base": "as forgetting but the max also covers row 0 (before training): accuracy the base "
    "model already had and the run lost counts as forgotten too",
    "plasticity": "mean over stages k = 1..T of a[k, c_k] − a[k−1, c_k], each stage's gain on its own domain",
    "retention_ratio": "mean over the trained domains of a[T, c] / max(a[0, c], max_{k≥f(c)} a[k, c]): the final "
    "accuracy relative to the best the domain ever reached from its own stage f(c) on or the base already had, so a "
    "skill the base had before its stage (and a stage that learnt nothing) counts; 1 = all kept",
    "gain_over_base": "mean over the trained domains of a[T, c] − a[0, c], the final accuracy over the base's: not "
    "learning a domain, or losing it again, scores 0 or below",
}


def cl_metrics(acc: list[list[float]] | Tensor, trained_columns: list[int] | None = None) -> dict:
    """CL metrics from a[k, c] = accuracy on column c after stage k; shape [T + 1, D], row 0 = before training.

    Stage k (1-based) trains column c_k = trained_columns[k - 1] (default c_k = k − 1). Columns never trained are
    retention probes, reported separately. With every domain trained once (a_{k,j} read as a[k, c_j]):

    - acc (ACC, "last")      = mean_j a[T, c_j]
    - average_accuracy       = mean_{k=1..T} ( mean over domains trained in stages 1..k of a[k, c] )
                               (the accuracy on everything seen so far, averaged over the stages; "A_avg")
    - bwt                    = 1/(T−1) Σ_{j=1..T−1} (a[T, c_j] − a[j, c_j])          GEM; None when T = 1
    - fwt                    = 1/(T−1) Σ_{j=2..T} (a[j−1, c_j] − a[0, c_j])          GEM; None when T = 1
                               (row 0 is GEM's b̄, the accuracy before any training)
    - forgetting               F_j = max_{1<=k<=T−1} a[k, c_j] − a[T, c_j] for j < T, averaged over j = 1..T−1;
                               None when T = 1 (Chaudhry et al. 2018, RWalk). Row 0 is not in the max.
    - forgetting_from_base     the same with the max over 0 <= k <= T−1: a skill the base already had and training
                               lost counts too (this module's definition before it followed Chaudhry et al.)
    - plasticity             = mean_{k=1..T} (a[k, c_k] − a[k−1, c_k])

    `CL_METRIC_DEFINITIONS` says the same in words for report.md. Where this departs from the papers: a domain
    trained in several stages (c_k repeated) is counted once per domain. bwt and both forgettings use its *last*
    training stage l(c) and cover the domains with l(c) < T; fwt uses its *first* stage f(c), a[f−1, c] − a[0, c],
    and covers the domains with f(c) > 1 (the first domain trained has nothing before it to transfer from);
    plasticity averages over stages (each training event's own gain). Per-domain values are None where a domain
    is not covered.

    - retention_ratio        = mean_c a[T, c] / max(a[0, c], max_{f(c)<=k<=T} a[k, c]) over the trained domains
                               (per domain None where that max is 0: nothing to retain)
    - gain_over_base         = mean_c (a[T, c] − a[0, c]) over the trained domains
      These two cannot be met by not learning: Chaudhry forgetting is 0 for a stage that learns nothing, while the
      base's own skill on a later domain (row 0) is in retention_ratio's max and gain_over_base's baseline.

    Retention probes: per probe {column, before = a[0, c], after = a[T, c], change = after − before,
    min = min_k a[k, c]}, plus mean_before / mean_after / mean_change (None when there are no probes).
    """
    a = torch.as_tensor(acc, dtype=torch.float64)  # [T+1, D]
    if a.dim() != 2 or a.shape[0] < 2:
        raise ValueError(f"accuracy matrix must be [T+1, D] with T >= 1 stages, got shape {list(a.shape)}")
    num_stages, num_columns = a.shape[0] - 1, a.shape[1]
    cols = list(range(num_stages)) if trained_columns is None else [int(c) for c in trained_columns]
    if len(cols) != num_stages:
        raise ValueError(f"{num_stages} stages (rows after row 0) but {len(cols)} trained_columns")
    if any(not 0 <= c < num_columns for c in cols):
        raise ValueError(f"trained_columns {cols} out of range for {num_columns} columns")
    T = num_stages

    def mean(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return sum(present) / len(present) if present else None

    domains = list(dict.fromkeys(cols))  # trained columns in first-trained order
    first = {c: cols.index(c) + 1 for c in domains}  # stage that first trained c (1-based)
    last = {c: T - cols[::-1].index(c) for c in domains}  # stage that last trained c (1-based)

    per_domain = []
    for c in domains:
        f, lst = first[c], last[c]
        final = a[T, c].item()
        forgotten = lst < T  # trained before the last stage: bwt and forgetting are defined
        per_domain.append(
            {
                "column": c,
                "first_stage": f,
                "last_stage": lst,
                "before": a[0, c].item(),
                "after_training": a[lst, c].item(),  # a[l(c), c]
                "final": final,
                "fwt": a[f - 1, c].item() - a[0, c].item() if f > 1 else None,
                "bwt": final - a[lst, c].item() if forgotten else None,
                "forgetting": a[1:T, c].max().item() - final if forgotten else None,  # max_{1<=k<T} a[k, c]
                "forgetting_from_base": a[:T, c].max().item() - final if forgotten else None,  # max_{0<=k<T}
                "retention_ratio": retention_ratio(a[:, c], f),
                "gain_over_base": final - a[0, c].item(),
            }
        )
    per_stage = [
        {"stage": k, "column": cols[k - 1], "plasticity": a[k, cols[k - 1]].item() - a[k - 1, cols[k - 1]].item()}
        for k in range(1, T + 1)
    ]
    stage_means = []
    for k in range(1, T + 1):
        seen = list(dict.fromkeys(cols[:k]))
        stage_means.append(sum(a[k, c].item() for c in seen) / len(seen))

    probes = [
        {
            "column": c,
            "before": a[0, c].item(),
            "after": a[T, c].item(),
            "change": a[T, c].item() - a[0, c].item(),
            "min": a[:, c].min().item(),
        }
        for c in range(num_columns)
        if c not in first
    ]
    return {
        "num_stages": T,
        "trained_columns": cols,
        "acc": mean([a[T, c].item() for c in domains]),
        "average_accuracy": mean(stage_means),
        "bwt": mean([d["bwt"] for d in per_domain]),
        "fwt": mean([d["fwt"] for d in per_domain]),
        "forgetting": mean([d["forgetting"] for d in per_domain]),
        "forgetting_from_base": mean([d["forgetting_from_base"] for d in per_domain]),
        "plasticity": mean([s["plasticity"] for s in per_stage]),
        "retention_ratio": mean([d["retention_ratio"] for d in per_domain]),
        "gain_over_base": mean([d["gain_over_base"] for d in per_domain]),
        "per_domain": per_domain,
        "per_stage": per_stage,
        "retention": {
            "probes": probes,
            "mean_before": mean([p["before"] for p in probes]),
            "mean_after": mean([p["after"] for p in probes]),
            "mean_change": mean([p["change"] for p in probes]),
        },
    }


def retention_ratio(column: Tensor, first_stage: int) -> float | None:
    """a[T] / max(a[0], max_{k>=first_stage} a[k]) of one domain's column [T+1] (row 0 = before training); None when
    that max is 0 (the domain was never solved: nothing to retain)."""
    best = max(column[0].item(), column[first_stage:].max().item())
    return column[-1].item() / best if best > 0 else None


def stage_forgetting(acc: list[list[float]] | Tensor, trained_columns: list[int] | None = None) -> list[float | None]:
    """Forgetting caused by each stage k = 1..T: mean over the domains trained before it (stages 1..k−1, not c_k)
    of a[k−1, c] − a[k, c]; signed (< 0: it improved them); None with no earlier domain (stage 1); probes not
    counted. `acc` and `trained_columns` as in `cl_metrics`."""
    a = torch.as_tensor(acc, dtype=torch.float64)  # [T+1, D]
    cols = list(range(a.shape[0] - 1)) if trained_columns is None else [int(c) for c in trained_columns]
    if a.dim() != 2 or len(cols) != a.shape[0] - 1:
        raise ValueError(f"accuracy matrix {list(a.shape)} does not match {len(cols)} stages (rows after row 0)")
    out: list[float | None] = []
    for k in range(1, len(cols) + 1):
        drops = [a[k - 1, c].item() - a[k, c].item() for c in dict.fromkeys(cols[: k - 1]) if c != cols[k - 1]]
        out.append(sum(drops) / len(drops) if drops else None)
    return out


# --------------------------------------------------------------------------------------------------------------
# Response drift on probe prompts
# --------------------------------------------------------------------------------------------------------------


def _masked_mean(values: Tensor, mask: Tensor) -> float:
    """Mean of values [N, T] over mask [N, T] (bool or 0/1); NaN when the mask is empty."""
    m = mask.to(values.dtype)  # [N, T]
    count = m.sum()
    if count == 0:
        return float("nan")
    return ((values * m).sum() / count).item()


def as_float(x: Tensor) -> Tensor:
    """x in at least float32 precision: half types are upcast, float32 and float64 kept (a float64 check stays so)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def kl_per_token(logp_p: Tensor, logp_q: Tensor) -> Tensor:
    """KL(p‖q) = Σ_v p_v (log p_v − log q_v) per token; [..., V] -> [...]. Terms with p_v = 0 are 0.

    Two [..., V] temporaries besides the inputs (p and the terms, written in place), and a bool mask."""
    p = logp_p.exp()  # [..., V]
    terms = (logp_p - logp_q).mul_(p)  # [..., V]
    return terms.masked_fill_(~(p > 0), 0.0).sum(dim=-1)  # [...]


def js_per_token(logp_p: Tensor, logp_q: Tensor) -> Tensor:
    """JS(p, q) = ½ KL(p‖m) + ½ KL(q‖m), m = (p + q) / 2, per token; [..., V] -> [...] (at most ln 2)."""
    logp_m = torch.logaddexp(logp_p, logp_q).sub_(math.log(2.0))  # [..., V]
    return 0.5 * kl_per_token(logp_p, logp_m) + 0.5 * kl_per_token(logp_q, logp_m)  # [...]


def entropy_per_token(logp: Tensor) -> Tensor:
    """Entropy H = −Σ_v p_v log p_v of normalised log-probs, per token; [..., V] -> [...]. Terms with p_v = 0 are 0."""
    p = logp.exp()  # [..., V]
    dropped = ~(p > 0)
    return -p.mul_(logp).masked_fill_(dropped, 0.0).sum(dim=-1)  # [...]


def token_kl(logp_p: Tensor, logp_q: Tensor, mask: Tensor) -> float:
    """Mean over masked tokens of KL(p‖q) over the full vocabulary, in nats.

    logp_p, logp_q: normalised log-probs [N, T, V] (e.g. current policy and base on the same tokens); mask [N, T].
    """
    if logp_p.shape != logp_q.shape or logp_p.shape[:-1] != mask.shape:
        raise ValueError(f"shapes differ: p {list(logp_p.shape)}, q {list(logp_q.shape)}, mask {list(mask.shape)}")
    return _masked_mean(kl_per_token(as_float(logp_p), as_float(logp_q)), mask)


def token_js(logp_p: Tensor, logp_q: Tensor, mask: Tensor) -> float:
    """Mean over masked tokens of JS(p, q) = ½ KL(p‖m) + ½ KL(q‖m), m = (p + q) / 2, in nats (at most ln 2).

    Shapes as in `token_kl`.
    """
    if logp_p.shape != logp_q.shape or logp_p.shape[:-1] != mask.shape:
        raise ValueError(f"shapes differ: p {list(logp_p.shape)}, q {list(logp_q.shape)}, mask {list(mask.shape)}")
    return _masked_mean(js_per_token(as_float(logp_p), as_float(logp_q)), mask)  # [N, T] -> mean


def mean_entropy(logits: Tensor, mask: Tensor) -> float:
    """Mean over masked tokens of the policy entropy H = −Σ_v p_v log p_v, in nats.

    logits [N, T, V] (already divided by the sampling temperature if that is the policy of interest); mask [N, T].
    """
    if logits.shape[:-1] != mask.shape:
        raise ValueError(f"shapes differ: logits {list(logits.shape)}, mask {list(mask.shape)}")
    return _masked_mean(entropy_per_token(torch.log_softmax(as_float(logits), dim=-1)), mask)  # [N, T] -> mean


def repeated_ngram_rate(token_ids: list[int], n: int = 4) -> float:
    """Fraction of the n-grams of one sequence that repeat an earlier n-gram of the same sequence.

    n-grams are taken at every position (overlapping), so [7, 7, 7, 7, 7] with n = 2 has 4 bigrams of which 3
    repeat: 0.75. A sequence shorter than n has no n-grams and gives 0.0 (no repetition), so averaging over
    sequences stays finite.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    ids = [int(t) for t in token_ids]
    ngrams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    if not ngrams:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for gram in ngrams:
        repeats += gram in seen
        seen.add(gram)
    return repeats / len(ngrams)


def pattern_rate(texts: list[str], patterns: list[str]) -> float:
    """Fraction of texts in which any of the regular expressions matches (re.search), e.g. [r"\\\\boxed"].

    Used for another domain's format tokens leaking into answers (docs/design.md §5). NaN for no texts.
    """
    if not texts:
        return float("nan")
    compiled = [re.compile(p) for p in patterns]
    hits = sum(any(rx.search(text) for rx in compiled) for text in texts)
    return hits / len(texts)
