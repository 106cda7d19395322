"""Continual-learning regularisers: KL to the previous stage's policy, L2 to the previous ΔW, O-LoRA
orthogonality, and replay of earlier domains' prompts.

Pure tensor functions first (shape comments: N sequences, R response positions, V vocabulary, r rank), then
`StageRegularizers`, the small per-stage helper the training step (`step.py`) calls. Each term has a weight
in `regularizers:` of the recipe; a weight of 0 adds nothing to the loss (the plain method's update, bit for bit),
while the cheap parameter-space values are still logged in metrics.jsonl (`l2_prev`, `orthogonal`; `kl_prev` only
when its weight is > 0, as it needs one more forward).

- `kl_prev`: token-mean KL(π_θ ‖ π_prev) over the current rollouts' response tokens, full vocabulary, where
  π_prev = the adapters making up the model after the previous stage, active under no_grad in eval mode (stage 1:
  the base, adapters disabled). Logits are divided by the rollout temperature, as every loss here.
- `l2_prev`: Σ_modules ‖ΔW − ΔW_0‖²_F with ΔW = s·B·A the student's effective delta and ΔW_0 its value at stage
  start: under `adapter.init: continue` that is the previous stage's ΔW, under `new` it is 0 (B starts at 0), under
  `merge` the merged initialisation. No [out, in] matrix is formed: with B_c = [B, −B_0] and A_c = [A; A_0],
  ‖B_c A_c‖²_F = tr((B_cᵀB_c)(A_c A_cᵀ)), two (2r × 2r) products (computed in float64, so the cancellation of
  near-equal terms early in a stage stays accurate).
- `orthogonal` (O-LoRA, Wang et al. 2023): Σ_modules Σ_old ‖A A_oldᵀ‖²_F between the student's A and the A of
  every earlier adapter active under it (`adapter.init: new`; with `continue` those are the older frozen ones).
  Unlike O-LoRA we do not add its L2 term on B; `l2_prev` covers that role.
- `replay_fraction`: a share of each step's prompts comes from earlier stages' domains' train sets (uniform over
  domains, then examples, from a generator seeded by the step seed, so resume draws the same ones), scored by
  their own domain's reward: on-policy replay, the replayed prompts are rolled out by the current policy and trained
  with the stage's loss like its own. `replay_rounding` turns fraction × prompts_per_step into a count (`replay_plan`,
  0 without an earlier domain, at most prompts_per_step − 1): `at_least_one` rounds it, at least 1;
  `stochastic` takes its whole part and one more with probability its fractional part, drawn from the step's own seed
  (`REPLAY_COUNT_SEED`), so a fraction below 1 / prompts_per_step replays on some steps only and the share replayed
  is the fraction in expectation. The stage's own prompts fill the rest of the step: under `at_least_one` consecutive
  slices of the data order of that (constant) width; under `stochastic` the step's full slice of prompts_per_step,
  its last ones left out on a step that replays, so a varying count never repeats or skips the stage's own prompts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from adaptercl.adapters import active_adapters

# ------------------------------------------------------------------------------------------------- pure math


def lora_delta_distance_sq(A: Tensor, B: Tensor, A0: Tensor, B0: Tensor, scaling: float) -> Tensor:
    """‖s·B·A − s·B_0·A_0‖²_F from r×r products only (see the module docstring).

    A, A0: [r, in]; B, B0: [out, r] (A0, B0 are constants) -> [] float64."""
    b_cat = torch.cat([B.double(), -B0.detach().double()], dim=1)  # [out, 2r]
    a_cat = torch.cat([A.double(), A0.detach().double()], dim=0)  # [2r, in]
    gram_b = b_cat.T @ b_cat  # [2r, 2r]
    gram_a = a_cat @ a_cat.T  # [2r, 2r]
    return scaling**2 * (gram_b * gram_a).sum()  # tr(G_b G_a) with both symmetric


def lora_overlap_sq(A: Tensor, A_old: Tensor) -> Tensor:
    """O-LoRA overlap ‖A A_oldᵀ‖²_F. A: [r, in], A_old: [r_old, in] (constant) -> []."""
    return (A @ A_old.detach().to(A.dtype).T).square().sum()  # [r, r_old] -> []


REPLAY_EXAMPLES_SEED = 3_000_000  # + step: which earlier examples a step replays (`replay_examples`)
REPLAY_COUNT_SEED = 3_500_000  # + step: the `stochastic` rounding's draw


def _at_least_one(expected: float, seed: int) -> int:
    return max(1, round(expected))


def _stochastic(expected: float, seed: int) -> int:
    whole = math.floor(expected)
    u = torch.rand((), generator=torch.Generator().manual_seed(seed), dtype=torch.float64).item()
    return whole + int(u < expected - whole)


# replay_rounding -> (count from the expected count and the step's seed, whether the stage's own prompts keep the
# step's full slice of the data order)
REPLAY_ROUNDING = {"at_least_one": (_at_least_one, False), "stochastic": (_stochastic, True)}


def replay_count(
    fraction: float, per_step: int, n_earlier_domains: int, rounding: str = "at_least_one", seed: int = 0
) -> int:
    """How many of a step's `per_step` prompts are replayed from earlier domains (see the module docstring); `seed`:
    the step's, for the `stochastic` rounding's draw."""
    if fraction <= 0 or n_earlier_domains == 0 or per_step < 2:
        return 0
    return min(per_step - 1, REPLAY_ROUNDING[rounding][0](fraction * per_step, seed))


def replay_plan(cfg: Any, per_step: int, n_earlier_domains: int, seed: int) -> tuple[int, int]:
    """(prompts replayed, width of the step's slice of the stage's own data order) for one step: `cfg` the stage's
    regularizers block, `seed` the step's (`step_seed(…, REPLAY_COUNT_SEED + step)`). The stage's own prompts are the
    slice's first per_step − replayed."""
    n = replay_count(cfg.replay_fraction, per_step, n_earlier_domains, cfg.replay_rounding, seed)
    return n, per_step if REPLAY_ROUNDING[cfg.replay_rounding][1] else per_step - n


def replay_examples(domains: list[Any], n: int, seed: int) -> list[tuple[Any, Any]]:
    """`n` (example, domain) pairs: a domain uniformly, then one of its train examples uniformly; seeded."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        domain = domains[int(torch.randint(len(domains), (1,), generator=g))]
        out.append((domain.train[int(torch.randint(len(domain.train), (1,), generator=g))], domain))
    return out


# ------------------------------------------------------------------------------------------------ per stage


@dataclass
class StageRegularizers:
    """The regularisers of one stage; `start` snapshots what they compare against."""

    kl_weight: float
    l2_weight: float
    orthogonal_weight: float
    previous: list[str]  # adapters making up the model after the previous stage ([] = the base)
    layers: list[tuple[Any, Tensor, Tensor]] = field(default_factory=list)  # (LoRA layer, A_0, B_0) of the student
    old_a: list[list[Tensor]] = field(default_factory=list)  # per layer: A of earlier active adapters
    student: str = ""

    @classmethod
    def start(cls, model: torch.nn.Module, student: str, frozen: list[str], previous: list[str], cfg) -> Any:
        """Snapshot the student's factors (ΔW_0) and the earlier adapters' A at the start of a stage."""
        from peft.tuners.lora import LoraLayer

        regs = cls(cfg.kl_prev, cfg.l2_prev, cfg.orthogonal, list(previous), student=student)
        for _, layer in model.named_modules():
            if isinstance(layer, LoraLayer) and student in layer.lora_A:
                a, b = layer.lora_A[student].weight, layer.lora_B[student].weight
                regs.layers.append((layer, a.detach().clone(), b.detach().clone()))
                regs.old_a.append([layer.lora_A[n].weight.detach() for n in frozen if n in layer.lora_A])
        return regs

    def previous_scores(self, model: torch.nn.Module, batch: Any, temperature: float, chunk_size: int | None):
        """The previous stage's policy on `batch` (a `model.batching.ResponseScores`, no gradient, eval mode), whose
        KL the training step takes per token (`losses.kl_to_previous`), or None when `kl_prev`'s weight is 0 (then no
        forward is spent)."""
        if self.kl_weight <= 0:
            return None
        from adaptercl.model import response_scores

        was_training = model.training
        model.eval()
        with torch.no_grad(), active_adapters(model, self.previous):
            scores = response_scores(model, batch, temperature, chunk_size)  # [n_mb, R, V] or [n_mb, R, H]
        model.train(was_training)
        return scores

    def parameter_loss(self) -> tuple[Tensor | None, dict[str, float]]:
        """l2_prev and orthogonal terms (weighted; None if both weights are 0) and their unweighted values."""
        grad = self.l2_weight > 0 or self.orthogonal_weight > 0
        with torch.set_grad_enabled(grad):
            l2, overlap = 0.0, 0.0
            for (layer, a0, b0), olds in zip(self.layers, self.old_a):
                a, b = layer.lora_A[self.student].weight, layer.lora_B[self.student].weight
                l2 = l2 + lora_delta_distance_sq(a, b, a0, b0, layer.scaling[self.student])
                for a_old in olds:
                    overlap = overlap + lora_overlap_sq(a, a_old).double()
        stats = {"l2_prev": _number(l2), "orthogonal": _number(overlap)}
        if not grad:
            return None, stats
        loss = self.l2_weight * l2 + self.orthogonal_weight * overlap
        return (loss if torch.is_tensor(loss) and loss.requires_grad else None), stats


def _number(value: Tensor | float) -> float:
    return float(value.detach()) if torch.is_tensor(value) else float(value)
