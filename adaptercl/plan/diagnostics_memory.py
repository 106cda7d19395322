"""Peak GPU memory of the diagnostics, by part: the diagnostics phase of the memory plan (`memory.py`).

    parts = diagnostics_parts(shape, recipe, index=2, prompt=1024, card_gib=24)   # {part: {term: bytes}}

What runs around a stage besides training and evaluation (`run/sequence.py`, `run/diagnostics.py`, `measure/drift.py`),
each on the trainer's resident memory after the stage (base, the adapters in float32; the optimiser is gone, the
teacher's adapter removed) and what the rollout engine keeps: a colocated vLLM sleeps before every diagnostic forward
(`step_companions`: with sleep mode what its sleep keeps, else its whole claim):

    response_drift, stage_kl   `measure/policy_divergence.py`: a no-grad forward of ROWS responses (one decoder layer
    in
               flight and the decoder's output [ROWS, P + R, H]), the final hidden states of the T = ROWS x R
               response tokens under both policies, 2 x T x H x b bytes (b: the compute dtype's), and CHUNK_COPIES
               float32 copies of one chunk of c = min(CHUNK_ELEMENTS / V, T) tokens' logits, c x V x 4 bytes each;
               response drift at eval.max_new_tokens, stage KL at the stage's rollout.max_new_tokens
    parameter_drift   the largest adapted W0 dequantised (bf16, then float32) and, exact, W0 + ΔW, ΔW, its SVD's U
               and a workspace taken as one more matrix (`DRIFT_BYTES_PER_ENTRY`, from measure/drift.py and
               measure/weight_drift.py; not measured); plus the run's cache of W0's spectra (`drift_cache_bytes`)
    teacher_lift   generation on the recipe's engine (`memory_plan`'s generate terms) with the teacher's prompts:
               the student's, a sibling of up to max_new_tokens and the templates (`step_memory.teacher_prompt_tokens`)

The spectra cache stays on the GPU for the rest of the run (`measure.drift.BaseWeights`), so the training phase of
every stage after the first parameter drift carries it too (`memory_plan`). No torch.
"""

from __future__ import annotations

from adaptercl.model import ALL_LINEAR, GIB, Shape, base_bytes, lora_params
from adaptercl.plan.step_memory import C0_GIB, frozen_params, has_teacher, no_grad_layer_bytes, teacher_prompt_tokens
from adaptercl.recipe import RecipeConfig, StageConfig
from adaptercl.rollout import step_companions

ROWS = 4  # responses a forward (measure.policy_divergence.ROWS_PER_FORWARD)
CHUNK_ELEMENTS = 2**24  # float32 elements of one [c, V] copy (measure.policy_divergence.CHUNK_ELEMENTS)
CHUNK_COPIES = 6  # [c, V] float32 copies alive at once (measure.policy_divergence.PEAK_CHUNK_COPIES)
DRIFT_BYTES_PER_ENTRY = {"lowrank": 2 + 4, "exact": 4 * 5}  # of the largest W0: bf16 + float32 / five float32
AUTO_EXACT_MAX_NUMEL = (
    2**22
)  # drift_method auto: exact up to this many entries a weight (measure.drift.AUTO_EXACT_MAX_NUMEL)
SPECTRUM_OVERSAMPLE = 16  # measure.lowrank_drift.OVERSAMPLE: W0's cached block is top_k + 16 wide
DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}  # CUDA compute dtype (auto: bf16)


def compute_bytes(recipe: RecipeConfig) -> int:
    """Bytes per element of the model's hidden states on CUDA: bf16 for a 4-bit base, else model.dtype's."""
    return 2 if recipe.quantization in ("nf4", "auto") else DTYPE_BYTES[recipe.model.dtype]


def resident_after_terms(shape: Shape, recipe: RecipeConfig, stage: StageConfig, index: int) -> dict[str, float]:
    """The trainer after a stage: base, the adapters in float32 (no optimiser, no teacher), overhead."""
    adapters = lora_params(shape, stage) + frozen_params(shape, stage, index, teacher=False)
    return {"base": base_bytes(shape, recipe.quantization), "adapters": adapters * 4.0, "overhead": C0_GIB * GIB}


def scoring_terms(shape: Shape, recipe: RecipeConfig, prompt: int, response: int) -> dict[str, float]:
    """Response drift / stage KL beyond the resident memory: one forward of ROWS responses and their scores."""
    b, tokens = compute_bytes(recipe), ROWS * response  # T, every response at the cap
    chunk = min(max(1, CHUNK_ELEMENTS // shape.vocab), tokens)
    return {
        "forward": no_grad_layer_bytes(shape, ROWS, prompt + response, b)
        + ROWS * (prompt + response) * shape.hidden * b,
        "scores": 2 * tokens * shape.hidden * b,
        "chunk": CHUNK_COPIES * chunk * shape.vocab * 4,
    }


def drift_method(recipe: RecipeConfig, shape: Shape) -> str:
    """eval.drift_method, auto made exact or lowrank as measure.drift.resolve_drift_method makes it."""
    method = recipe.eval.drift_method
    if method != "auto":
        return method
    return "exact" if max(a * b for a, b in shape.linear_shapes().values()) <= AUTO_EXACT_MAX_NUMEL else "lowrank"


def drift_targets(shape: Shape, stage: StageConfig) -> list[tuple[int, int]]:
    """(in, out) of every adapted weight of the model."""
    targets = (
        ALL_LINEAR if isinstance(stage.lora.target_modules, str) else stage.lora.target_modules
    )  # auto, all-linear
    layers = len(stage.lora.layers) if stage.lora.layers is not None else shape.layers
    return [dims for name, dims in shape.linear_shapes().items() if name in targets] * layers


def drift_cache_bytes(shape: Shape, recipe: RecipeConfig, stage: StageConfig) -> float:
    """W0's spectra that `measure.drift.BaseWeights` keeps for the run: per adapted weight, lowrank the top_k + 16
    block (U [out, c], Vh [c, in], s [c]); exact the top-k vectors and every singular value, float32."""
    k = recipe.eval.drift_top_k
    if drift_method(recipe, shape) == "lowrank":
        c = k + SPECTRUM_OVERSAMPLE
        return sum((i + o + 1) * c * 4 for i, o in drift_targets(shape, stage))
    return sum(((i + o) * k + min(i, o)) * 4 for i, o in drift_targets(shape, stage))


def parameter_drift_terms(shape: Shape, recipe: RecipeConfig, stage: StageConfig) -> dict[str, float]:
    """Parameter drift beyond the resident memory: the largest adapted W0's work and the spectra cache."""
    largest = max(i * o for i, o in drift_targets(shape, stage))
    return {
        "w0_work": DRIFT_BYTES_PER_ENTRY[drift_method(recipe, shape)] * largest,
        "drift_cache": drift_cache_bytes(shape, recipe, stage),
    }


def runs_parameter_drift(recipe: RecipeConfig) -> bool:
    return recipe.eval.parameter_drift or any(s.monitor.drift_every for s in recipe.stages)


def diagnostics_parts(
    shape: Shape, recipe: RecipeConfig, index: int, prompt: int, card_gib: float, generate
) -> dict[str, dict[str, float]]:
    """The terms of each diagnostic stage `index` runs, by part. `generate(index, prompt, new_tokens)`: the card
    while the recipe's engine generates (`memory_plan`), for the teacher lift."""
    stage, cfg = recipe.stages[index], recipe.eval
    base = {**resident_after_terms(shape, recipe, stage, index), **step_companions(shape, recipe, card_gib)}
    parts = {}
    if cfg.drift_probes:
        parts["response_drift"] = {**base, **scoring_terms(shape, recipe, prompt, recipe.eval_max_new_tokens)}
    if cfg.stage_kl_prompts:
        parts["stage_kl"] = {**base, **scoring_terms(shape, recipe, prompt, stage.rollout.max_new_tokens)}
    if runs_parameter_drift(recipe):
        parts["parameter_drift"] = {**base, **parameter_drift_terms(shape, recipe, stage)}
    if has_teacher(stage) and cfg.teacher_lift_prompts:
        parts["teacher_lift"] = generate(index, teacher_prompt_tokens(stage, prompt), recipe.eval_max_new_tokens)
    return parts
