"""Wall-time estimate of a recipe on a 24 GB consumer card, from token counts and stated throughput assumptions.

    estimate_wall_time(recipe, model_params_b=7.6).render()

Owns the estimate `adaptercl recipe plan` prints and the shipped 24 GB recipes quote in their headers. No torch.

- Training: tokens = steps x prompts_per_step x group_size x (MEAN_PROMPT_TOKENS + max_new_tokens) x
  grpo.iterations, times the measured H100 time per token of one training step at the Qwen2.5-7B shape
  (micro-batch 1, checkpointing, 1,024-position logit chunks; benchmarks/perf/results/cuda_7b_memory.json, the
  `<method>:8:true:auto` variants: step median / (8 x 1024 tokens)), scaled by the model's parameters / 7.6 B and
  by CONSUMER_SLOWDOWN. Every response is assumed to reach the cap, so this is an upper bound; the hybrid figure
  distils every row (the recipe only failed groups); srpo has no measurement of its own and takes sdpo's.
- Rollouts, evaluation and diagnostics (not measured): the hf engine decodes a generate call of batch_size
  sequences in max_new_tokens steps of HF_DECODE_STEP_S per 7.6 B parameters each (bitsandbytes NF4 generate is
  dominated by dequantising the weights every step, so the step time barely depends on the batch); vLLM at
  VLLM_TOKENS_PER_S. Evaluation: every domain, examples_per_domain greedy responses, before the first stage and
  after every stage; teacher lift and stage KL are counted as rollouts of their prompts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from adaptercl.config import RecipeConfig
from adaptercl.methods import METHODS

REFERENCE_PARAMS_B = 7.6  # Qwen2.5-7B, the measured shape
H100_SECONDS_PER_TOKEN = {  # measured training step time / tokens (cuda_7b_memory.json, <method>:8:true:auto)
    "grpo": 4.061 / 8192,
    "hybrid": 5.841 / 8192,
    "sdpo": 7.619 / 8192,
    "sdft": 6.287 / 8192,
    # srpo: not measured; sdpo's figure (its teacher on every row) is an upper bound, as srpo's teacher forward runs
    # on its SDPO-routed rows only (the paper: ~40 % of the rows early in training, fewer as accuracy rises)
    "srpo": 7.619 / 8192,
}
CONSUMER_SLOWDOWN = 4.0  # RTX 4090 vs H100 SXM (assumption: between the bandwidth ratio 3.3 and bf16 FLOPs ~6)
HF_DECODE_STEP_S = 0.06  # hf engine, NF4 7B on the 24 GB card, one decode step of a generate call (assumption)
VLLM_TOKENS_PER_S = 1500.0  # vLLM, NF4 7B on the 24 GB card, generated tokens per second in a batch (assumption)
MEAN_PROMPT_TOKENS = 300  # mean prompt of the shipped domains (gsm8k ~150, chemistry MCQ ~300, tool use ~700)


@dataclass(frozen=True)
class WallTime:
    train_s: float
    rollout_s: float
    eval_s: float

    @property
    def total_s(self) -> float:
        return self.train_s + self.rollout_s + self.eval_s

    def render(self) -> str:
        return (
            f"wall time on a 24 GB consumer card (RTX 4090 class; assumptions in adaptercl/wall_time.py): "
            f"~{self.total_s / 3600:.1f} h = training {self.train_s / 3600:.1f} h + rollouts "
            f"{self.rollout_s / 3600:.1f} h + evaluation {self.eval_s / 3600:.1f} h"
        )


def _generate_s(recipe: RecipeConfig, sequences: int, new_tokens: int, params_b: float) -> float:
    rollout = recipe.stages[0].rollout
    if rollout.engine in ("vllm", "vllm_server"):
        return sequences * new_tokens / VLLM_TOKENS_PER_S * params_b / REFERENCE_PARAMS_B
    calls = math.ceil(sequences / rollout.batch_size)
    return calls * new_tokens * HF_DECODE_STEP_S * params_b / REFERENCE_PARAMS_B


def estimate_wall_time(recipe: RecipeConfig, model_params_b: float) -> WallTime:
    """Training, rollout and evaluation seconds of the whole recipe on a 24 GB consumer card."""
    scale = model_params_b / REFERENCE_PARAMS_B
    train = rollout = diagnostics = 0.0
    for stage in recipe.stages:
        sequences = stage.optim.steps * stage.optim.prompts_per_step * stage.rollout.group_size
        tokens = sequences * (MEAN_PROMPT_TOKENS + stage.rollout.max_new_tokens) * stage.grpo.iterations
        train += tokens * H100_SECONDS_PER_TOKEN[stage.method] * CONSUMER_SLOWDOWN * scale
        rollout += _generate_s(recipe, sequences, stage.rollout.max_new_tokens, model_params_b)
        probes = recipe.eval.stage_kl_prompts
        if METHODS[stage.method].needs_teacher:
            probes += recipe.eval.teacher_lift_prompts * (stage.rollout.group_size + 1)
        diagnostics += _generate_s(recipe, probes, recipe.eval_max_new_tokens, model_params_b)
    examples = recipe.eval.examples_per_domain * len(recipe.domains)
    evaluation = (len(recipe.stages) + 1) * _generate_s(recipe, examples, recipe.eval_max_new_tokens, model_params_b)
    return WallTime(train, rollout, evaluation + diagnostics)
