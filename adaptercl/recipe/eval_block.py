"""The `eval:` block of the recipe grammar: what is measured after every stage (accuracy of every domain and
retention probe, parameter and response drift) and at its start (teacher lift). No torch import; `grammar.py`
re-exports it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from adaptercl.recipe.config_block import ConfigBlock


class LmEvalConfig(ConfigBlock):
    """lm-evaluation-harness tasks scored after every stage (`measure/lm_eval.py`; the `lm-eval` extra)."""

    tasks: list[str] = Field(
        default_factory=list,
        description="lm-eval task or group names (e.g. arc_easy, boolq), run on the model after every stage and "
        "before training; results in each stage's lm_eval.json and report.md. Empty = off. Checked against lm-eval's "
        "task index before anything loads (a few seconds).",
    )
    include_path: str | None = Field(
        None, description="A folder of custom lm-eval task YAML files (lm_eval --include_path), e.g. local data."
    )
    limit: int | None = Field(None, ge=1, description="Items per task (lm_eval --limit); default all.")
    num_fewshot: int | None = Field(
        None, ge=0, description="Few-shot examples (lm_eval --num_fewshot); default the task's."
    )
    batch_size: int = Field(8, ge=1, description="Log-likelihood requests per forward.")
    seed: int = Field(0, description="lm-eval's random, NumPy, torch and few-shot seeds.")

    @field_validator("tasks")
    @classmethod
    def _non_empty_names(cls, tasks: list[str]) -> list[str]:
        if any(not t.strip() for t in tasks):
            raise ValueError("task names must not be empty")
        return tasks


class EvalConfig(ConfigBlock):
    examples_per_domain: int = Field(50, ge=1, description="Greedy-evaluated examples per domain per stage.")
    max_new_tokens: int | None = Field(None, ge=1, description="Default: rollout.max_new_tokens of the recipe.")
    drift_probes: int = Field(8, ge=0, description="Probe prompts per domain for response drift (0 = off).")
    parameter_drift: bool = Field(True, description="Compute per-module parameter drift after every stage.")
    drift_method: Literal["auto", "exact", "lowrank"] = Field(
        "auto",
        description="Parameter drift: exact = full SVDs (every singular value, spectral_shift); lowrank = top-k "
        "singular triplets by subspace iteration (spectral_shift_top_k instead), for large models; auto = exact "
        "when every adapted weight has at most 2^22 entries, else lowrank. On the model's device, float32.",
    )
    drift_top_k: int = Field(8, ge=1, description="Parameter drift: k of the top-k singular subspaces (both methods).")
    retention_probes: list[str] = Field(
        default_factory=list, description="Domains evaluated after every stage but never trained."
    )
    choice_scoring: Literal["loglikelihood", "generate"] = Field(
        "loglikelihood",
        description="How multiple-choice retention probes (a retention_probes domain whose reward is "
        "choice_letter: ARC, BoolQ, PIQA, Winogrande, a generic lettered set) are scored: loglikelihood = the option "
        "letter the model finds most likely as the start of its reply (lm-evaluation-harness's multiple-choice acc, "
        "one forward per example; measure/choice_scoring.py); generate = greedy generation, the letter read out of "
        "the reply (what adaptercl did before; it also tests that the reply states a letter, and costs a decode of "
        "up to max_new_tokens per example). Trained domains are always generated: their answer format is what a "
        "stage teaches.",
    )
    lm_eval: LmEvalConfig = Field(
        default_factory=LmEvalConfig,
        description="lm-evaluation-harness retention probes (log-likelihood accuracy comparable with published "
        "numbers), beside the generated-letter probes of retention_probes.",
    )
    before_from: str | None = Field(
        None,
        description="A run directory whose row 0 (the base evaluated before training, stage-00-before) this run "
        "copies instead of evaluating the base again: for runs of one base, seed and evaluation that differ only in "
        "how they train (a method sweep). Refused before the model loads unless that run agrees with this recipe on "
        "everything row 0 depends on: model, quantization, seed, domains, eval examples_per_domain, max_new_tokens, "
        "retention_probes, choice_scoring, lm_eval and the rollout engine's settings (run_dir/before_row.py).",
    )
    teacher_lift_prompts: int = Field(
        8,
        ge=0,
        description="Teacher lift at the start of each stage with a self-teacher (sdpo, sdft, hybrid): seeded train "
        "prompts of the stage's domain on which the teacher's greedy accuracy with its context is compared to the "
        "student's (teacher_lift.json, report.md; diagnostics.py). 0 = off. Costs at most prompts x group_size "
        "sampled and as many greedy responses once per stage: the rollouts of 2 x prompts / prompts_per_step "
        "training steps (prompts no rollout could give a context are passed over unrolled, greedy answers "
        "decoded only where a context exists). Default 8 (was 16), sized so that the diagnostics stay under a "
        "quarter of the quickstart's time (benchmarks/quickstart/diagnostics.md); raise it for a narrower interval.",
    )
    stage_kl_prompts: int = Field(
        8,
        ge=0,
        description="Forward KL from the previous stage's policy after each stage (drift.json stage_kl; "
        "diagnostics.py): seeded train prompts of the stage's domain, one response each sampled from the previous "
        "policy, then scored by both policies. 0 = off. Default 8 (was 16), sized as teacher_lift_prompts.",
    )
