"""Drift of the live model against its base: parameter drift per LoRA-targeted module, response drift on probes.

Parameter drift: for each module with LoRA, ΔW = Σ over the model's adapters of scale·B·A = B_cat A_cat (factors
concatenated, rank R = Σ r), against the base weight W0, on W0's device (the GPU when there is one), float32.
Two methods (`DRIFT_METHODS`, recipe `eval.drift_method`):
- `exact`: `weight_drift.parameter_drift`, full SVDs of W0 and W0 + ΔW (every singular value: `spectral_shift`);
- `lowrank`: `lowrank_drift.lowrank_drift`, top-k triplets by subspace iteration and ‖ΔW‖_F from R×R Grams;
  it reports `spectral_shift_top_k` in place of `spectral_shift` (see that module).
`auto` picks exact when every adapted weight has at most AUTO_EXACT_MAX_NUMEL entries (the built-in small models),
lowrank otherwise (a 7B model: 196 weights, 84 of them 18,944 × 3,584); one method per report, so the aggregate
never mixes them. The report says which method ran, with k.

On an NF4 base W0 is dequantised. `BaseWeights` caches the dequantised matrices of a CPU model (up to
`max_cache_bytes`) so drift every N steps does not dequantise again (on a GPU dequantising is cheaper than the
copy), and the decomposition of each W0 (exact `Spectrum` or low-rank `TopSpectrum`), so each report decomposes
only W0 + ΔW.

Response drift: greedy responses of the current policy to fixed probe prompts of every domain; mean per-token KL
and JS to the base (adapters disabled) on those same responses, policy entropy, response length, repeated-4-gram
rate, and the rate of *other* domains' format tokens (e.g. `\\boxed` in tool-use answers). The full-vocabulary
terms are taken a few responses and a chunk of tokens at a time, so memory does not grow with the probes or their
length (`policy_divergence.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from adaptercl.domains import Domain
from adaptercl.measure import lowrank_drift, metrics, weight_drift
from adaptercl.measure.policy_divergence import ROWS_PER_FORWARD, divergence_sums, token_scores
from adaptercl.model import build_batch, encode_chat
from adaptercl.rollout import RolloutEngine, SamplingParams, packed_linears

DriftMethod = Literal["auto", "exact", "lowrank"]
AUTO_EXACT_MAX_NUMEL = 2**22  # auto: exact when every adapted W0 has at most this many entries (2048 x 2048)


class BaseWeights:
    """Base weights W0 of LoRA-targeted modules, dequantised (float32, on their device), and their decompositions."""

    def __init__(self, max_cache_bytes: int = 2 * 1024**3):
        self.max_cache_bytes = max_cache_bytes
        self.cache: dict[str, torch.Tensor] = {}
        self.cached_bytes = 0
        self.spectra: dict[tuple[str, int], weight_drift.Spectrum] = {}  # (module, k) -> float32 spectrum of W0
        self.top_spectra: dict[tuple[str, int], lowrank_drift.TopSpectrum] = {}  # (module, k) -> top-k of W0

    def spectrum(self, name: str, layer: torch.nn.Module, k: int) -> weight_drift.Spectrum:
        """`weight_drift.spectrum` of W0, float32 on its device (as `parameter_drift_report` uses it), once."""
        if (name, k) not in self.spectra:
            self.spectra[(name, k)] = weight_drift.spectrum(self.get(name, layer), k)
        return self.spectra[(name, k)]

    def top_spectrum(self, name: str, layer: torch.nn.Module, k: int) -> lowrank_drift.TopSpectrum:
        """`lowrank_drift.base_spectrum` of W0 in float32 on its device, computed once."""
        if (name, k) not in self.top_spectra:
            self.top_spectra[(name, k)] = lowrank_drift.base_spectrum(self.get(name, layer), k)
        return self.top_spectra[(name, k)]

    def get(self, name: str, layer: torch.nn.Module) -> torch.Tensor:
        """W0 [out, in], float32, on the base weight's device; kept when on CPU and within `max_cache_bytes`."""
        if name in self.cache:
            return self.cache[name]
        w0 = dequantized_weight(layer.get_base_layer()).float()  # [out, in]
        if w0.device.type == "cpu" and self.cached_bytes + w0.numel() * 4 <= self.max_cache_bytes:
            self.cache[name] = w0
            self.cached_bytes += w0.numel() * 4
        return w0


def dequantized_weight(linear: torch.nn.Module) -> torch.Tensor:
    weight = linear.weight
    if hasattr(weight, "quant_state"):  # bitsandbytes Params4bit
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(weight.data, weight.quant_state)
    return weight.detach()


def module_factors(
    model: torch.nn.Module, adapters: list[str]
) -> dict[str, tuple[torch.nn.Module, torch.Tensor, torch.Tensor]]:
    """{module name: (LoRA layer, B [out, R], A [R, in])} with ΔW = B A = Σ over `adapters` of scale·B_i·A_i:
    the factors concatenated (scales folded into B), float32, on the adapters' device."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        present = [a for a in adapters if a in layer.lora_A]
        if not present:
            continue
        B = torch.cat([layer.scaling[a] * layer.lora_B[a].weight.detach().float() for a in present], dim=1)
        A = torch.cat([layer.lora_A[a].weight.detach().float() for a in present], dim=0)
        out[name] = (layer, B, A)  # [out, R], [R, in]
    return out


def module_deltas(model: torch.nn.Module, adapters: list[str]) -> dict[str, tuple[torch.nn.Module, torch.Tensor]]:
    """{module name: (LoRA layer, ΔW [out, in])}, ΔW summed over `adapters`."""
    return {name: (layer, B @ A) for name, (layer, B, A) in module_factors(model, adapters).items()}


def _exact(name: str, layer, B: torch.Tensor, A: torch.Tensor, base: BaseWeights, k: int) -> dict[str, float]:
    w0 = base.get(name, layer)
    delta = (B @ A).to(w0.device)  # [out, in]
    return weight_drift.parameter_drift(
        w0, delta, k=k, dtype=torch.float32, device=w0.device, base=base.spectrum(name, layer, k)
    )


def _lowrank(name: str, layer, B: torch.Tensor, A: torch.Tensor, base: BaseWeights, k: int) -> dict[str, float]:
    w0 = base.get(name, layer)
    return lowrank_drift.lowrank_drift(w0, B.to(w0.device), A.to(w0.device), base.top_spectrum(name, layer, k), k)


DRIFT_METHODS: dict[str, Callable[..., dict[str, float]]] = {"exact": _exact, "lowrank": _lowrank}


def resolve_drift_method(method: DriftMethod, shapes: list[tuple[int, int]]) -> str:
    """`method`, with auto made exact or lowrank from the largest adapted weight's size (AUTO_EXACT_MAX_NUMEL)."""
    if method != "auto":
        return method
    return "exact" if max((o * i for o, i in shapes), default=0) <= AUTO_EXACT_MAX_NUMEL else "lowrank"


@torch.no_grad()
def parameter_drift_report(
    model: torch.nn.Module,
    adapters: list[str],
    base: BaseWeights,
    k: int = 8,
    method: DriftMethod = "auto",
    on_module: Callable[[int, int], None] | None = None,
) -> dict:
    """Per-module drift of base + adapters against the base, its aggregate (mean and max), the method that ran
    and k. `on_module(done, total)` is called after each module (progress)."""
    factors = module_factors(model, adapters)
    resolved = resolve_drift_method(method, [(B.shape[0], A.shape[1]) for _, B, A in factors.values()])
    per_module = {}
    for i, (name, (layer, B, A)) in enumerate(factors.items()):
        per_module[name] = DRIFT_METHODS[resolved](name, layer, B, A, base, k)
        if on_module is not None:
            on_module(i + 1, len(factors))
    return {
        "method": resolved,
        "top_k": k,
        "aggregate": weight_drift.aggregate_drift(per_module),
        "per_module": per_module,
    }


@torch.no_grad()
def response_drift(
    model: torch.nn.Module,
    tokenizer,
    engine: RolloutEngine,
    domains: list[Domain],
    adapters: list[str],
    probes_per_domain: int,
    max_new_tokens: int,
    on_probe: Callable[[int, int], None] | None = None,
) -> dict[str, dict[str, float]]:
    """Per probed domain: KL/JS to the base, entropy, length, repetition and foreign-format rate. Each domain's
    probes are answered in one generate call, every domain's before the engine sleeps (a colocated vLLM gives the
    card back to the forwards), then scored `ROWS_PER_FORWARD` at a time, a chunk of tokens at a time
    (`policy_divergence.py`); `on_probe(done, total)` is called after each such batch (progress, in probes)."""
    out = {}
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    params = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
    answered = []  # per domain: (prompts, completions), every domain generated before the first forward
    for domain in domains:
        prompts = [encode_chat(tokenizer, ex.messages) for ex in domain.eval[:probes_per_domain]]
        answered.append((prompts, [g[0] for g in engine.generate(prompts, adapters, params)]))
    engine.sleep()  # a colocated vLLM frees the card for the forwards (no-op for the hf engine)
    total, done = sum(len(c) for _, c in answered), 0
    with packed_linears(model, use="sequences"):  # scoring forwards on oneDNN-packed weights (float32 CPU)
        for domain, (prompts, completions) in zip(domains, answered):
            sums, tokens = dict.fromkeys(("kl", "js", "entropy"), 0.0), 0
            for start in range(0, len(completions), ROWS_PER_FORWARD):
                rows = slice(start, start + ROWS_PER_FORWARD)
                responses = [c.token_ids for c in completions[rows]]
                batch = build_batch(prompts[rows], responses, tokenizer.pad_token_id).to(device)
                policy, base = token_scores(model, batch, adapters), token_scores(model, batch, None)
                for term, value in divergence_sums(policy, base, tuple(sums)).items():
                    sums[term] += value
                tokens += policy.tokens
                done += len(responses)
                if on_probe is not None:
                    on_probe(done, total)
            mean = {term: value / tokens if tokens else float("nan") for term, value in sums.items()}  # per token
            foreign = [p for other in domains if other.name != domain.name for p in other.format_patterns]
            texts, n = [c.text for c in completions], len(completions)
            out[domain.name] = {
                "kl_to_base": mean["kl"],
                "js_to_base": mean["js"],
                "entropy": mean["entropy"],
                "response_tokens": sum(len(c.token_ids) for c in completions) / n,
                "repetition_rate": sum(metrics.repeated_ngram_rate(c.token_ids) for c in completions) / n,
                "foreign_format_rate": metrics.pattern_rate(texts, foreign) if foreign else 0.0,
            }
    model.train(was_training)
    return out
