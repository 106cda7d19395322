"""What a stage is handed (`StageContext`), and the seeds that make its data order a pure function of the step.

Seeds: `step_seed` is a stage's training rollout seed at a step (row r of that call samples with
`rollout.row_seed(step_seed, r)`) and, at fixed offsets of the step, its data order, distillation mask, replay and
stage-start diagnostics. Any other call family that samples rollouts takes `family_seed`, which hashes the family's
name into a range no training row of any stage reaches: an offset of the step is not enough, because the row stride
makes (offset + step, row r) the seed of (step + offset mod stride, row r + offset // stride) when the offset is near
a multiple of the stride (the lift gate's 7,000,000 = 7 x 1,000,003 − 21 gave its row r at step g the seed of
training step g − 21's row r + 7).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from adaptercl.domains import Domain
from adaptercl.measure import BaseWeights
from adaptercl.recipe import RecipeConfig, StageConfig
from adaptercl.rollout import RolloutEngine, SamplingParams
from adaptercl.teacher import Teacher


@dataclass
class StageContext:
    """What the run hands a stage."""

    recipe: RecipeConfig
    index: int  # 0-based position in recipe.stages
    model: torch.nn.Module  # the PeftModel holding every adapter
    tokenizer: PreTrainedTokenizerBase
    engine: RolloutEngine
    domain: Domain
    student: str  # name of the adapter trained in this stage
    frozen: list[str] = field(default_factory=list)  # earlier adapters active (frozen) under the student
    stage_dir: Path = Path(".")
    on_step: Any = None  # callback(step, metrics, samples) for progress display and tracking
    on_note: Any = None  # callback(line): a line the stage has to say (a damaged checkpoint it starts over from)
    teacher: Teacher | None = None  # the self-teacher of sdpo/sdft/hybrid stages (teacher.kinds.create_teacher)
    base_weights: BaseWeights = field(default_factory=BaseWeights)  # dequantised W0 cache for drift
    previous: list[str] = field(default_factory=list)  # adapters making up the model after the previous stage
    replay_domains: list[Domain] = field(default_factory=list)  # earlier stages' domains (regularizers.replay_*)
    micro_batch: int | None = None  # sequences per micro-batch chosen for the run (micro_batch.py); None: the split

    def micro_rows(self, n: int) -> int:
        """Sequences per micro-batch of a batch of `n` (this rank's rows of a step)."""
        return min(n, self.micro_batch) if self.micro_batch else self.stage.optim.split_rows(n)

    @property
    def stage(self) -> StageConfig:
        return self.recipe.stages[self.index]

    @property
    def policy_adapters(self) -> list[str]:
        return [*self.frozen, self.student]


def step_seed(recipe_seed: int, stage_index: int, step: int) -> int:
    return (recipe_seed * 1_000_003 + stage_index * 10_007 + step) % (2**31 - 1)


# Training row seeds are step_seed (< 2^31) + row x ROW_SEED_STRIDE with fewer than 2^32 rows a step: below
# 2^31 + 2^32 x 1,000,003 < 2^52. A family's seeds start at 2^52 and, with its rows, stay below 2^52 + 2^60 + 2^52
# < 2^63 − 1 (`rollout.protocol.SEED_MODULUS`: no wrap-around).
FAMILY_SEED_FLOOR = 2**52
FAMILY_OFFSET_RANGE = 2**60


def family_seed(family: str, recipe_seed: int, stage_index: int, step: int) -> int:
    """The seed of a stage's call of `family` (e.g. "lift_gate.rollout") at `step`: 2^52 + (a 60-bit hash of the
    family's name) + step_seed. Disjoint from every training row's seed (see FAMILY_SEED_FLOOR); within a family
    consecutive steps get consecutive seeds, so its rows stay distinct as training's do (`rollout.row_seed`); two
    families share a seed only if their hashes differ by (steps apart) + (rows apart) x the stride, a chance of about
    (steps x rows used) / 2^60. The hash is blake2b's, stable across processes and machines (Python's `hash` of a
    str is salted per process)."""
    digest = int.from_bytes(hashlib.blake2b(family.encode(), digest_size=8).digest(), "big")
    return FAMILY_SEED_FLOOR + digest % FAMILY_OFFSET_RANGE + step_seed(recipe_seed, stage_index, step)


def prompts_for_step(n_train: int, per_step: int, recipe_seed: int, stage_index: int, step: int) -> list[int]:
    """Indices of the training examples used at `step`: consecutive slices of seeded per-epoch permutations."""
    out = []
    for pos in range(step * per_step, (step + 1) * per_step):
        epoch, offset = divmod(pos, n_train)
        g = torch.Generator().manual_seed(step_seed(recipe_seed, stage_index, 1_000_000 + epoch))
        out.append(int(torch.randperm(n_train, generator=g)[offset]))
    return out


def rollout_sampling(stage: StageConfig, seed: int, first_row: int = 0) -> SamplingParams:
    """How a stage samples its groups: `rollout.group_size` responses per prompt at the rollout temperature and
    top-p, seeded. The engine's own logprobs are asked for when it is not the hf engine (which samples from the
    trained weights themselves: on-policy). `first_row`: a data-parallel rank's offset among the step's rows."""
    rollout = stage.rollout
    return SamplingParams(
        max_new_tokens=rollout.max_new_tokens,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        n=rollout.group_size,
        seed=seed,
        logprobs=rollout.engine != "hf",
        first_row=first_row,
    )
