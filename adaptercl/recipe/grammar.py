"""The recipe grammar: typed, documented per field, validated before anything heavy loads.

A recipe is one YAML file describing a whole continual sequence. Recipe-level blocks (`lora`, `rollout`, `optim`,
`grpo`, `distill`, `hybrid`, `srpo`, `regularizers`) are defaults; each stage may override any field of them, and
`resolve_recipe` deep-merges the defaults into every stage so a resolved `StageConfig` is complete on its own.
Method-dependent defaults and constraints (teacher kind and EMA rate, divergence α, skipped tokens, allowed
teachers, srpo's learning rate and token-mean aggregations) come from the method table `method_table.METHODS` and are
filled in one place, `StageConfig._fill_method_defaults`. The method blocks (`grpo`, `distill`, `hybrid`, `srpo`,
`regularizers`, `monitor`) are defined in `method_blocks.py`, the `domains:` block in `domain_block.py`, the `eval:`
block in `eval_block.py`, the `rollout:` block in `rollout_block.py`, the `optim:` block in `optim_block.py`,
`report_to` and the `log:` block in `log_block.py`.

This module imports no torch: `adaptercl recipe validate` answers in well under a second. Errors are raised as
`RecipeError` with one line naming the field path (stages are named by their `name`, not their index) and what
is allowed.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from adaptercl.recipe.config_block import ConfigBlock as _Block
from adaptercl.recipe.domain_block import NAME_PATTERN, DomainConfig
from adaptercl.recipe.errors import RecipeError, format_validation_error
from adaptercl.recipe.eval_block import EvalConfig
from adaptercl.recipe.log_block import LogConfig, Tracker, parse_report_to
from adaptercl.recipe.method_blocks import (  # re-exported: a recipe's blocks are importable from here
    Action,
    Aggregation,
    DistillConfig,
    GrpoConfig,
    HybridConfig,
    MonitorConfig,
    RegularizerConfig,
    SrpoConfig,
    Support,
    TeacherConfig,
    TeacherKind,
    check_refresh_schedule,
)
from adaptercl.recipe.method_table import METHODS, Method
from adaptercl.recipe.optim_block import OptimConfig
from adaptercl.recipe.rollout_block import ENGINE_FIELDS, RolloutConfig, RolloutServerConfig

__all__ = [
    "Action",
    "AdapterInitConfig",
    "Aggregation",
    "DistillConfig",
    "DomainConfig",
    "EvalConfig",
    "GrpoConfig",
    "HybridConfig",
    "LogConfig",
    "LoraConfig",
    "ModelConfig",
    "MonitorConfig",
    "OptimConfig",
    "RecipeConfig",
    "RecipeError",
    "RegularizerConfig",
    "RolloutConfig",
    "RolloutServerConfig",
    "SrpoConfig",
    "StageConfig",
    "Support",
    "TeacherConfig",
    "TeacherKind",
    "resolve_recipe",
]

MergeMethod = Literal["task_arithmetic", "ties", "dare_linear", "dare_ties"]


class ModelConfig(_Block):
    name: str = Field(
        description="Base model: a built-in alias ('tiny-random', 'smollm2-135m-instruct'), a hub id, a local "
        "HF model folder, or a .gguf file (dequantised on load)."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = Field(
        "auto",
        description="Compute dtype of the unquantised parts; auto = bfloat16 on CUDA, float32 on CPU. float64 (no "
        "quantization) keeps every step in float64: for numerical checks, where two arrangements of the same update "
        "(micro-batches, ranks, chunked logits, checkpointing) must agree far below float32 rounding.",
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) for hub ids.")
    cache_dir: str | None = Field(
        None, description="Where built-in models are materialised (default ~/.cache/adaptercl or $ADAPTERCL_CACHE)."
    )


class LoraConfig(_Block):
    r: int = Field(16, ge=1, description="LoRA rank.")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha; the update is scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: list[str] | Literal["auto", "all-linear"] = Field(
        "auto",
        description="Modules that get LoRA. auto: every decoder layer's attention and MLP projections as the model's "
        "family names them (q/k/v/o_proj or Phi-3's qkv_proj; gate/up/down_proj or gate_up_proj, an MoE's shared "
        "expert included; in Qwen3.5/Qwen3-Next Gated DeltaNet layers in_proj_qkv (in_proj_qkvz), in_proj_z and "
        "out_proj), resolved on the loaded model (model/lora_targets.py). auto leaves at the base's values the "
        "DeltaNet's per-head decay and write gates (in_proj_a, in_proj_b), routers, gates and Gemma 4's per-layer "
        "inputs, and routed MoE experts, which transformers 5.x fuses into 3-D weights LoRA cannot wrap (not "
        "trained). A list: module names or dot-suffixes, matched as PEFT matches them; one that matches no module "
        "LoRA can wrap is refused, naming the model's linear layers. all-linear: every linear layer but the LM head; "
        "refused on an MoE whose experts are separate linear modules (it would wrap every expert).",
    )
    layers: list[int] | None = Field(
        None,
        description="Only these decoder layers (0-based; negative counts from the top) get LoRA. Backward then "
        "stops at the lowest one: LoRA on the top layers only makes a CPU step several times cheaper.",
    )


class AdapterInitConfig(_Block):
    init: Literal["new", "continue", "merge"] = Field(
        "continue",
        description="continue: train the previous adapter; new: fresh adapter over frozen earlier ones; "
        "merge: start from a dW-space merge of the earlier stages' task vectors, replacing their adapters. A stage's "
        "task vector is what its training added: its adapter's dW minus the dW it started from (0 for new, the "
        "copied adapter for continue, its merge for merge; stacking.py), so each earlier stage counts once.",
    )
    merge_method: MergeMethod = Field(
        "task_arithmetic",
        description="`merge`: how the earlier stages' task vectors (dW = scale*B*A differences) are merged "
        "(merge_math.py); the result is re-factorised by truncated SVD to lora.r (its relative error is in "
        "done.json).",
    )
    merge_weights: list[float] | None = Field(
        None,
        description="`merge`: one weight per earlier stage's task vector, in order; default equal: 1/n for "
        "task_arithmetic and dare_linear (the mean), 1 for ties and dare_ties (their disjoint mean already averages).",
    )
    merge_density: float = Field(1.0, gt=0.0, le=1.0, description="`merge`: TIES/DARE density (1 = keep all).")


class StageConfig(_Block):
    name: str = Field(description="Stage name; its directory is stage-NN-<name>.")
    domain: str = Field(description="Name of the domain trained in this stage.")
    method: Method = Field("grpo", description="Training method.")
    adapter: AdapterInitConfig = Field(default_factory=AdapterInitConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    grpo: GrpoConfig = Field(default_factory=GrpoConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    hybrid: HybridConfig = Field(default_factory=HybridConfig)
    srpo: SrpoConfig = Field(default_factory=SrpoConfig)
    regularizers: RegularizerConfig = Field(default_factory=RegularizerConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        if not re.match(NAME_PATTERN, v):
            raise ValueError(f"stage name {v!r} must match {NAME_PATTERN}")
        return v

    @field_validator("adapter", mode="before")
    @classmethod
    def _adapter_is_a_block(cls, v: Any) -> Any:
        if isinstance(v, str):  # `adapter: merge` reads as the init it names; say the block's form
            raise ValueError(f"must be a mapping such as {{init: {v}}} (adapter: {{init: new | continue | merge}})")
        return v

    @model_validator(mode="after")
    def _fill_method_defaults(self) -> StageConfig:
        spec = METHODS[self.method]
        teacher = self.distill.teacher
        if teacher.kind is None:
            teacher.kind = spec.teacher_kind
        if teacher.tau is None:
            teacher.tau = spec.tau
        if teacher.ema_rank is None:
            teacher.ema_rank = 2 * self.lora.r
        if teacher.gate_window is None:
            teacher.gate_window = teacher.refresh_every
        if spec.needs_teacher:
            check_refresh_schedule(teacher, self.optim.steps)
        if self.monitor.checkpoint_every > self.optim.steps:  # a stage this short would checkpoint only at its end
            self.monitor._capped_from = self.monitor.checkpoint_every
            self.monitor.checkpoint_every = self.optim.steps
        if self.distill.alpha is None:
            self.distill.alpha = spec.alpha
        if self.distill.skip_first_tokens is None:
            self.distill.skip_first_tokens = spec.skip_first_tokens
        if self.distill.support is None:
            self.distill.support = spec.support
        if self.distill.topk is None:
            self.distill.topk = spec.topk
        if self.distill.aggregation is None:
            self.distill.aggregation = spec.distill_aggregation
        for name in ("lr", "weight_decay", "warmup_steps"):  # a method's optimiser defaults (srpo: the paper's)
            if getattr(spec, name) is not None and name not in self.optim.model_fields_set:
                setattr(self.optim, name, getattr(spec, name))
        if spec.sample_routed:
            for block, aggregation in (("grpo", self.grpo.aggregation), ("distill", self.distill.aggregation)):
                if aggregation != "token_mean":
                    raise ValueError(
                        f"{self.method} divides both of its terms by one shared token count: set "
                        f"{block}.aggregation to token_mean (got {aggregation!r})"
                    )
        if self.distill.support == "sampled" and self.distill.alpha != 1.0:
            raise ValueError("distill.support 'sampled' is reverse KL only: set distill.alpha to 1.0")
        if spec.teacher_kinds is not None and teacher.kind not in spec.teacher_kinds:
            raise ValueError(
                f"{self.method} needs a frozen or trust-region teacher, got distill.teacher.kind {teacher.kind!r}; "
                f"use {', '.join(spec.teacher_kinds[:-1])} or {spec.teacher_kinds[-1]}"
            )
        if spec.one_sample_per_prompt and self.rollout.group_size != 1:
            raise ValueError(
                f"{self.method} samples one response per prompt: set rollout.group_size to 1 for this stage"
            )
        if spec.needs_siblings is not None and self.rollout.group_size < 2:
            raise ValueError(
                f"{self.method} learns nothing from one response per prompt ({spec.needs_siblings}): set "
                "rollout.group_size to 2 or more for this stage (default 8)"
            )
        return self


class RecipeConfig(_Block):
    model: ModelConfig
    quantization: Literal["nf4", "none", "auto"] = Field(
        "auto", description="nf4: bitsandbytes 4-bit base; none: bf16/fp32; auto: nf4 on CUDA, none on CPU."
    )
    domains: list[DomainConfig] = Field(min_length=1, description="Every domain trained or evaluated.")
    stages: list[StageConfig] = Field(min_length=1, description="The continual sequence, in order.")
    eval: EvalConfig = Field(default_factory=EvalConfig)
    output_dir: str = Field(description="Run directory; rerunning into it resumes and skips finished stages.")
    seed: int = Field(0, description="Seed of data order, sampling and initialisation.")
    report_to: list[Tracker] = Field(
        default_factory=list,
        description="Experiment trackers that also get the step metrics, evaluation rows and samples (trackers.py): "
        "tensorboard, wandb, trackio, a list of them, or none (default). Each needs its extra, e.g. "
        "pip install 'adaptercl[wandb]'.",
    )
    log: LogConfig = Field(default_factory=LogConfig)

    @field_validator("report_to", mode="before")
    @classmethod
    def _parse_report_to(cls, value: Any) -> list[str]:
        return parse_report_to(value)

    @model_validator(mode="after")
    def _check_references(self) -> RecipeConfig:
        domain_names = [d.name for d in self.domains]
        _check_unique("domains", domain_names)
        _check_unique("stages", [s.name for s in self.stages])
        for stage in self.stages:
            if stage.domain not in domain_names:
                raise ValueError(
                    f"stages.{stage.name}.domain: unknown domain {stage.domain!r}; defined: {', '.join(domain_names)}"
                )
        for stage in self.stages:
            _check_replay_domains(stage, domain_names, self.eval.retention_probes)
        for probe in self.eval.retention_probes:
            if probe not in domain_names:
                raise ValueError(
                    f"eval.retention_probes: unknown domain {probe!r}; defined: {', '.join(domain_names)}"
                )
        first = self.stages[0]
        for stage in self.stages[1:]:  # one rollout engine serves the whole run
            for key in ENGINE_FIELDS:
                ours, theirs = getattr(stage.rollout, key), getattr(first.rollout, key)
                if ours != theirs:
                    if key == "server":  # name the field of the nested block that differs
                        key, theirs = next(
                            (f"server.{k}", v) for k, v in theirs.model_dump().items() if getattr(ours, k) != v
                        )
                    raise ValueError(
                        f"stages.{stage.name}.rollout.{key}: the rollout engine is shared by every stage; set "
                        f"rollout.{key} once at recipe level (stage {first.name} has {theirs!r})"
                    )
        if self.model.dtype == "float64" and self.quantization != "none":  # auto is nf4 on CUDA
            raise ValueError(
                f"model.dtype: float64 needs an unquantised base (bitsandbytes computes in 16 or 32 bit); set "
                f"quantization: none (it is {self.quantization})"
            )
        if first.adapter.init == "merge":
            raise ValueError(f"stages.{first.name}.adapter.init: the first stage has nothing to merge; use new")
        for i, stage in enumerate(self.stages):
            weights = stage.adapter.merge_weights
            if stage.adapter.init == "merge" and weights is not None and len(weights) != i:
                raise ValueError(
                    f"stages.{stage.name}.adapter.merge_weights: {len(weights)} weights for {i} earlier stages"
                )
        return self

    def domain(self, name: str) -> DomainConfig:
        return next(d for d in self.domains if d.name == name)

    def validation_notes(self) -> list[str]:
        """What validation changed in the recipe as written, one line each (`recipe validate` prints them): a
        monitor.checkpoint_every capped to its stage's steps."""
        return [
            f"stages.{s.name}.monitor.checkpoint_every: {s.monitor._capped_from} is more than the stage's "
            f"{s.optim.steps} steps; capped to {s.optim.steps} (a checkpoint at the stage's end only: a kill before "
            "it starts the stage over)"
            for s in self.stages
            if s.monitor._capped_from is not None
        ]

    @property
    def eval_max_new_tokens(self) -> int:
        return self.eval.max_new_tokens or self.stages[0].rollout.max_new_tokens


STAGE_DEFAULT_BLOCKS = ("lora", "rollout", "optim", "grpo", "distill", "hybrid", "srpo", "regularizers", "monitor")


def _check_replay_domains(stage: StageConfig, domain_names: list[str], probes: list[str]) -> None:
    """regularizers.replay_domains: recipe domains, neither the stage's own nor a retention probe (never trained),
    and a replay_fraction that replays them."""
    names, field = stage.regularizers.replay_domains, f"stages.{stage.name}.regularizers.replay_domains"
    for name in names or []:
        if name not in domain_names:
            raise ValueError(f"{field}: unknown domain {name!r}; defined: {', '.join(domain_names)}")
        if name == stage.domain:
            raise ValueError(f"{field}: {name!r} is the stage's own domain; name the other domains to mix in")
        if name in probes:
            raise ValueError(f"{field}: {name!r} is a retention probe (eval.retention_probes are never trained)")
    if names and stage.regularizers.replay_fraction == 0:
        raise ValueError(f"{field}: set regularizers.replay_fraction > 0 as well, else nothing is replayed")


def _check_unique(what: str, names: list[str]) -> None:
    seen = set()
    for n in names:
        if n in seen:
            raise ValueError(f"{what}: name {n!r} is used twice")
        seen.add(n)


def deep_merge(base: dict, override: dict) -> dict:
    """A new dict: `override` on top of `base`, merging nested dicts key by key."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def resolve_recipe(raw: Any) -> RecipeConfig:
    """Validate a raw recipe mapping and deep-merge recipe-level blocks into every stage."""
    if not isinstance(raw, dict):
        raise RecipeError(f"a recipe must be a YAML mapping of blocks, got {type(raw).__name__}")
    raw = dict(raw)
    stages = raw.get("stages")
    if isinstance(stages, list):
        defaults = {block: raw.pop(block) for block in STAGE_DEFAULT_BLOCKS if block in raw}
        for block, value in defaults.items():
            if not isinstance(value, dict):
                raise RecipeError(f"{block}: must be a mapping of fields, got {value!r}")
        resolved_stages = []
        for stage in stages:
            if not isinstance(stage, dict):
                raise RecipeError(f"stages: each stage must be a mapping, got {stage!r}")
            stage = dict(stage)
            merged = {}
            for block in STAGE_DEFAULT_BLOCKS:
                if block in stage and not isinstance(stage[block], dict):
                    raise RecipeError(f"stages.{stage.get('name', '?')}.{block}: must be a mapping of fields")
                merged[block] = deep_merge(defaults.get(block, {}), stage.get(block, {}))
            if "steps" in stage:
                merged["optim"]["steps"] = stage.pop("steps")
            stage.update(merged)
            resolved_stages.append(stage)
        raw["stages"] = resolved_stages
    try:
        return RecipeConfig.model_validate(raw)
    except ValidationError as err:
        raise RecipeError(format_validation_error(err, raw, RecipeConfig, STAGE_DEFAULT_BLOCKS)) from None
