"""What a colocated vLLM engine takes of the card, for the memory plan (`plan/memory.py`) and the engine itself.

    vllm_utilization(shape, recipe, card_gib=24)   # rollout.gpu_memory_utilization, `auto` made a number
    step_companions(shape, recipe, card_gib=24)    # what stays on the card beside the training step
    check_claim(shape, recipe, 0.42, card_gib=24, free_gib=17)   # before vLLM starts: one line naming a setting

Awake, vLLM claims gpu_memory_utilization x the card, which should hold its NF4 weights (`VLLM_NF4_BITS`: float32
block scales, unlike the trainer's copy), max_loras x max_lora_rank
LoRA slots (bf16), VLLM_RUNTIME_GIB of activations, sampler and CUDA graphs, and the KV cache of a whole step's
rollouts (`vllm_need_terms`). With sleep mode it sleeps (level 1) around each optimiser step and keeps only
VLLM_ASLEEP_GIB; without, its whole claim stays. `auto` makes the share the plan's need at PROMPT_TOKENS-token prompts.
First principles, not measured. No torch.
"""

from __future__ import annotations

import math

from adaptercl.model import GIB, Shape, base_bytes, gib, kv_bytes, lora_params
from adaptercl.recipe import ENGINES, RecipeConfig, RecipeError, StageConfig
from adaptercl.rollout.vllm_settings import served_lora_rank

VLLM_RUNTIME_GIB = 1.5  # vLLM's profiled activations, sampler and CUDA graphs at its defaults (assumption)
# vLLM's NF4 linears keep one float32 scale per 64-weight block: it quantises with double quantisation and undoes
# the second level at load ("at the cost of increased memory usage": `BitsAndBytesModelLoader._dequantize_dq`,
# vllm/model_executor/model_loader/bitsandbytes_loader.py in vllm 0.27.1; vllm-bnb-plugin does the same), so
# 4 + 32 / 64 bits a weight against the trainer's double-quantised `model.shapes.NF4_BITS` (4.127): +0.28 GiB at 7B.
VLLM_NF4_BITS = 4 + 32 / 64
# A colocated vLLM asleep (sleep level 1, around each optimiser step): "Level 1 sleep will offload the model weights
# and discard the KV cache" (https://docs.vllm.ai/en/latest/features/sleep_mode/; the weights go to CPU RAM). Only
# what vLLM allocated in its sleep-mode memory pool is released: the weights (the LoRA slots with them: they are
# made inside load_model) and the KV cache, the pool's "weights" and "kv_cache" tags (vllm/v1/worker/gpu_worker.py;
# in 0.27.1 its sleep calls device_allocator/sleep_mode_backend.py CuMemBackend.suspend, which has
# cumem.CuMemAllocator.sleep back up the "weights" allocations to CPU, release every allocation of the pool, then empty
# torch's cache). Its CUDA graphs and the blocks its profiling and sampler left in torch's cache stay: assumed all of
# its runtime (not measured; the cached blocks are the trainer's allocator's to reuse, so this is an upper bound).
VLLM_ASLEEP_GIB = VLLM_RUNTIME_GIB
PROMPT_TOKENS = 1024  # the plan's prompt assumption (recipe plan --prompt-tokens), also vLLM's auto share's


def vllm_need_terms(shape: Shape, recipe: RecipeConfig, stage: StageConfig, prompt: int) -> dict[str, float]:
    """What the vLLM engine should hold inside its claim: its own NF4 weights, the LoRA slots, its runtime, and the
    KV cache of a whole step's rollouts at once (prompts_per_step x group_size sequences at the cap)."""
    r = stage.rollout
    slots = (r.max_loras or 2) * lora_params(shape, stage, served_lora_rank(recipe))
    sequences = stage.optim.prompts_per_step * r.group_size
    return {
        "weights": base_bytes(shape, recipe.quantization, nf4_bits=VLLM_NF4_BITS),
        "lora_slots": slots * 2,
        "runtime": VLLM_RUNTIME_GIB * GIB,
        "kv_cache": kv_bytes(shape, sequences * (prompt + r.max_new_tokens)),
    }


def vllm_utilization(shape: Shape, recipe: RecipeConfig, card_gib: float) -> float:
    """`rollout.gpu_memory_utilization`, `auto` made a number: the share of the card that vLLM's needs at the
    largest stage take (`vllm_need_terms`, prompts of PROMPT_TOKENS), rounded up to 0.01."""
    setting = recipe.stages[0].rollout.gpu_memory_utilization  # one engine: the same in every stage
    if setting != "auto":
        return setting
    need = max(gib(vllm_need_terms(shape, recipe, s, PROMPT_TOKENS)) for s in recipe.stages)
    return min(math.ceil(100 * need / card_gib) / 100, 0.99)


def step_companions(shape: Shape, recipe: RecipeConfig, card_gib: float) -> dict[str, float]:
    """What shares the card with the training step: a colocated vLLM engine asleep (sleep mode: VLLM_ASLEEP_GIB)
    or awake (its whole claim); nothing with the hf engine or a vLLM server."""
    rollout = recipe.stages[0].rollout
    if not ENGINES[rollout.engine].needs_local_vllm:
        return {}
    if rollout.enable_sleep_mode:
        return {"vllm_asleep": VLLM_ASLEEP_GIB * GIB}
    return {"vllm_awake": vllm_utilization(shape, recipe, card_gib) * card_gib * GIB}


def check_claim(shape: Shape, recipe: RecipeConfig, utilization: float, card_gib: float, free_gib: float) -> None:
    """Before vLLM starts on a card of `card_gib` with `free_gib` free (the trainer's model loaded): a claim of
    `utilization` x the card that vLLM would refuse (above the free memory), or that cannot hold its weights, LoRA
    slots and one sequence's KV cache even before its runtime (VLLM_RUNTIME_GIB, an assumption, so left out of the
    test: only what is certain refuses), is one RecipeError line naming the setting to change."""
    rollout, claim = recipe.stages[0].rollout, utilization * card_gib  # one engine: the same in every stage
    if claim > free_gib:  # vLLM refuses to start ("Free memory on device ... is less than desired")
        raise RecipeError(
            f"rollout.gpu_memory_utilization: {utilization:g} of the {card_gib:.1f} GiB card is {claim:.1f} GiB, "
            f"but {free_gib:.1f} GiB is free beside the trainer; set it to at most "
            f"{math.floor(100 * free_gib / card_gib) / 100:g} (or lower the trainer's memory)"
        )
    terms = [vllm_need_terms(shape, recipe, s, PROMPT_TOKENS) for s in recipe.stages]
    weights = max(t["weights"] for t in terms) / GIB  # GiB
    slots = max(t["lora_slots"] for t in terms) / GIB
    sequence = max(kv_bytes(shape, PROMPT_TOKENS + s.rollout.max_new_tokens) for s in recipe.stages) / GIB
    if claim >= weights + slots + sequence:
        return
    if claim >= weights + sequence:  # the LoRA slots are what does not fit
        raise RecipeError(
            f"rollout.max_loras: {rollout.max_loras or 2} LoRA slots at rank {served_lora_rank(recipe)} take "
            f"{slots:.2f} GiB, more than the {claim - weights - sequence:.2f} GiB vLLM's claim leaves beside its "
            "weights and one sequence; lower it (each request serves one combined adapter: 1 slot serves a stage) or "
            "raise rollout.gpu_memory_utilization"
        )
    least = math.ceil(100 * (weights + slots + VLLM_RUNTIME_GIB + sequence) / card_gib) / 100
    raise RecipeError(
        f"rollout.gpu_memory_utilization: {utilization:g} of the {card_gib:.1f} GiB card ({claim:.1f} GiB) cannot "
        f"hold vLLM's weights ({weights:.1f} GiB), LoRA slots ({slots:.2f} GiB) and one {PROMPT_TOKENS}-token "
        f"prompt's rollout, before its runtime (~{VLLM_RUNTIME_GIB:g} GiB); set it to at least {least:g}, or auto "
        "(the plan's share for a whole step's rollouts)"
    )
