"""Drift of the live model against its base: parameter drift per LoRA-targeted module, response drift on probes.

Parameter drift: for each module with LoRA, ΔW = Σ over the model's adapters of scale·B·A, and the metrics of
`metrics.parameter_drift` against the base weight W0. On an NF4 base W0 is dequantised; `BaseWeights` caches the
dequantised matrices (up to `max_cache_bytes`, on CPU) so drift every N steps does not dequantise again, and the
SVD of each W0 (its singular values and top-k vectors), so each drift report needs one SVD per module, of W0 + ΔW.

Response drift: greedy responses of the current policy to fixed probe prompts of every domain; mean per-token KL
and JS to the base (adapters disabled) on those same responses, policy entropy, response length, repeated-4-gram
rate, and the rate of *other* domains' format tokens (e.g. `\\boxed` in tool-use answers).
"""

from __future__ import annotations

import torch

from adaptercl import metrics
from adaptercl.adapters import active_adapters
from adaptercl.batching import build_batch, encode_chat, response_logits
from adaptercl.domains import Domain
from adaptercl.merging import lora_delta
from adaptercl.rollout import RolloutEngine, SamplingParams


class BaseWeights:
    """Base weights W0 of LoRA-targeted modules, dequantised once (float32, CPU) and cached, and their spectra."""

    def __init__(self, max_cache_bytes: int = 2 * 1024**3):
        self.max_cache_bytes = max_cache_bytes
        self.cache: dict[str, torch.Tensor] = {}
        self.cached_bytes = 0
        self.spectra: dict[tuple[str, int], metrics.Spectrum] = {}  # (module, k) -> float32 spectrum of W0

    def spectrum(self, name: str, layer: torch.nn.Module, k: int) -> metrics.Spectrum:
        """`metrics.spectrum` of W0 in float32 on CPU (the dtype `parameter_drift_report` uses), computed once."""
        if (name, k) not in self.spectra:
            self.spectra[(name, k)] = metrics.spectrum(self.get(name, layer), k)
        return self.spectra[(name, k)]

    def get(self, name: str, layer: torch.nn.Module) -> torch.Tensor:
        if name in self.cache:
            return self.cache[name]
        w0 = dequantized_weight(layer.get_base_layer()).float().cpu()  # [out, in]
        if self.cached_bytes + w0.numel() * 4 <= self.max_cache_bytes:
            self.cache[name] = w0
            self.cached_bytes += w0.numel() * 4
        return w0


def dequantized_weight(linear: torch.nn.Module) -> torch.Tensor:
    weight = linear.weight
    if hasattr(weight, "quant_state"):  # bitsandbytes Params4bit
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(weight.data, weight.quant_state)
    return weight.detach()


def module_deltas(model: torch.nn.Module, adapters: list[str]) -> dict[str, tuple[torch.nn.Module, torch.Tensor]]:
    """{module name: (LoRA layer, ΔW [out, in])}, ΔW summed over `adapters`."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        delta = None
        for adapter in adapters:
            if adapter not in layer.lora_A:
                continue
            d = lora_delta(
                layer.lora_A[adapter].weight.detach().float().cpu(),
                layer.lora_B[adapter].weight.detach().float().cpu(),
                layer.scaling[adapter],
            )
            delta = d if delta is None else delta + d
        if delta is not None:
            out[name] = (layer, delta)
    return out


def parameter_drift_report(
    model: torch.nn.Module, adapters: list[str], base: BaseWeights, k: int = 8
) -> dict[str, dict]:
    """Per-module drift of base + adapters against the base, and its aggregate (mean and max)."""
    per_module = {
        name: metrics.parameter_drift(
            base.get(name, layer), delta, k=k, dtype=torch.float32, base=base.spectrum(name, layer, k)
        )
        for name, (layer, delta) in module_deltas(model, adapters).items()
    }
    return {"aggregate": metrics.aggregate_drift(per_module), "per_module": per_module}


@torch.no_grad()
def response_drift(
    model: torch.nn.Module,
    tokenizer,
    engine: RolloutEngine,
    domains: list[Domain],
    adapters: list[str],
    probes_per_domain: int,
    max_new_tokens: int,
) -> dict[str, dict[str, float]]:
    """Per probed domain: KL/JS to the base, entropy, length, repetition and foreign-format rate."""
    out = {}
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    for domain in domains:
        examples = domain.eval[:probes_per_domain]
        prompts = [encode_chat(tokenizer, ex.messages) for ex in examples]
        params = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
        completions = [g[0] for g in engine.generate(prompts, adapters, params)]
        batch = build_batch(prompts, [c.token_ids for c in completions], tokenizer.pad_token_id).to(device)
        with active_adapters(model, adapters):
            policy_logits = response_logits(model, batch)  # [N, R, V]
        with active_adapters(model, None):
            base_logits = response_logits(model, batch)
        policy_logp, base_logp = policy_logits.log_softmax(-1), base_logits.log_softmax(-1)
        mask = batch.response_mask
        foreign = [p for other in domains if other.name != domain.name for p in other.format_patterns]
        out[domain.name] = {
            "kl_to_base": metrics.token_kl(policy_logp, base_logp, mask),
            "js_to_base": metrics.token_js(policy_logp, base_logp, mask),
            "entropy": metrics.mean_entropy(policy_logits, mask),
            "response_tokens": sum(len(c.token_ids) for c in completions) / len(completions),
            "repetition_rate": sum(metrics.repeated_ngram_rate(c.token_ids) for c in completions) / len(completions),
            "foreign_format_rate": metrics.pattern_rate([c.text for c in completions], foreign) if foreign else 0.0,
        }
    model.train(was_training)
    return out
