"""The continual sequence's adapter stacking rule, as one pure function of the recipe: `plan_adapters`.

Each stage trains its own adapter, named after its stage (`stage_dir_name`: `stage-NN-<name>`, also the name of the
stage's folder in the run directory), on top of the adapters that made up the model after the previous stage
(`previous`). `adapter.init` decides what the stage's model is:

- `new`: a fresh adapter (B = 0) over every previous adapter, all frozen: frozen = previous.
- `continue`: a copy of the previous stage's own adapter (the last of `previous`) replaces it and is trained on:
  frozen = previous without its last adapter. On the first stage there is nothing to copy: a fresh adapter.
- `merge`: the adapter starts as the ΔW merge (`adapter.merge_method`) of every earlier stage's task vector, and
  replaces them all: frozen = [].

A stage's task vector is what its training added: the ΔW of its adapter minus the ΔW that adapter started from
(`AdapterPlan.start`). A fresh adapter (`new`, or `continue` on the first stage) starts from 0, so its task vector
is its ΔW; a `continue` adapter starts as a copy of `copy_from`, so its task vector is ΔW_k − ΔW_copy_from (the
copy carries every earlier continued stage, which must not be merged twice); a `merge` adapter starts from its own
merge, so its task vector is ΔW_k − that merge (recomputed from the earlier task vectors, `merge.py`: the
start is not kept as an adapter). So a merge weighs each earlier stage once (one `adapter.merge_weights` entry per
stage), and after `new` / `continue` stages task arithmetic with weights 1 gives back the model it replaces (up to
the rank-r re-factorisation).

After the stage the model is [*frozen, adapter] (`model_adapters`), the next stage's `previous`. The run
(`run/sequence.py`), the vLLM engine's LoRA rank sizing (`rollout/vllm.py`) and the regularisers all read this plan, so
the rule exists once. No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass

from adaptercl.recipe import METHODS, RecipeConfig


def stage_dir_name(recipe: RecipeConfig, index: int) -> str:
    """Directory (and adapter) name of stage `index` (0-based): stage-01-<name>."""
    return f"stage-{index + 1:02d}-{recipe.stages[index].name}"


@dataclass(frozen=True)
class AdapterPlan:
    """The adapters of one stage."""

    adapter: str  # the adapter this stage trains (its stage directory's name)
    init: str  # new | continue | merge
    frozen: tuple[str, ...]  # earlier adapters active under it, frozen
    previous: tuple[str, ...]  # the adapters making up the model after the previous stage ([] = the base)
    copy_from: str | None  # continue: the adapter it starts as a copy of
    merge_sources: tuple[str, ...]  # merge: the earlier stage adapters whose task vectors' merge it starts from

    @property
    def start(self) -> str:
        """What the adapter's ΔW is when the stage starts, its task vector's origin: `zero` (a fresh adapter),
        `copy` (the ΔW of `copy_from`) or `merge` (the merge of the task vectors of `merge_sources`' stages)."""
        return "merge" if self.init == "merge" else "copy" if self.copy_from is not None else "zero"

    @property
    def model_adapters(self) -> list[str]:
        """The adapters making up the model during and after this stage, in order."""
        return [*self.frozen, self.adapter]


def plan_adapters(recipe: RecipeConfig) -> list[AdapterPlan]:
    """One `AdapterPlan` per stage of `recipe`, in order (see the module docstring)."""
    plans: list[AdapterPlan] = []
    previous: list[str] = []
    for i, stage in enumerate(recipe.stages):
        name = stage_dir_name(recipe, i)
        init = stage.adapter.init
        copy_from, sources = None, ()
        if init == "continue":
            copy_from = previous[-1] if previous else None
            frozen = previous[:-1]
        elif init == "new":
            frozen = list(previous)
        else:  # merge
            sources = tuple(stage_dir_name(recipe, j) for j in range(i))
            frozen = []
        plan = AdapterPlan(name, init, tuple(frozen), tuple(previous), copy_from, sources)
        plans.append(plan)
        previous = plan.model_adapters
    return plans


def max_served_rank(recipe: RecipeConfig) -> int:
    """The largest rank of one combined adapter the run serves: each stage's policy (its model adapters) and, for a
    method with a self-teacher, its teacher over the same frozen adapters (an EMA teacher has its own rank)."""
    rank = {stage_dir_name(recipe, i): stage.lora.r for i, stage in enumerate(recipe.stages)}
    need = 1
    for stage, plan in zip(recipe.stages, plan_adapters(recipe)):
        need = max(need, sum(rank[a] for a in plan.model_adapters))
        if METHODS[stage.method].needs_teacher:
            teacher = stage.distill.teacher
            teacher_rank = teacher.ema_rank if teacher.kind == "ema" else stage.lora.r
            need = max(need, sum(rank[a] for a in plan.frozen) + teacher_rank)
    return need
