"""The end-of-stage diagnostics a chunk of tokens at a time (`measure/policy_divergence.py`): equal to the whole-tensor
formulas of `measure/metrics.py` (in float64, where the claim is exactness), and with a peak memory that a chunk
bounds, measured by following every tensor the computation creates."""

from __future__ import annotations

import math
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from adaptercl.adapters.live import active_adapters, attach_adapter, lora_parameters, use_adapters
from adaptercl.domains import load_domain
from adaptercl.measure import metrics, policy_divergence
from adaptercl.measure.drift import response_drift
from adaptercl.measure.policy_divergence import PEAK_CHUNK_COPIES, TokenScores, divergence_sums
from adaptercl.model.base import load_base
from adaptercl.model.batching import build_batch, encode_chat
from adaptercl.recipe.domain_block import DomainConfig
from adaptercl.recipe.grammar import LoraConfig, ModelConfig, RecipeError
from adaptercl.rollout import SamplingParams
from adaptercl.rollout.hf import HFEngine
from adaptercl.run.diagnostics import seeded_sample, stage_kl

Tensor, Module = torch.Tensor, torch.nn.Module
U64 = torch.finfo(torch.float64).eps / 2  # unit roundoff of float64


class LiveTensors(TorchDispatchMode):
    """Follows every tensor created inside it: `peak` = the most bytes of storage alive at once (views and in-place
    results counted once), `largest` = the most elements of one tensor, `shapes` = the shape of each. Tensors that
    existed before are not counted: the measurement is of what the computation allocates."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, list[int]] = {}  # data_ptr -> [bytes, tensors alive on it]
        self.live = self.peak = self.largest = 0
        self.shapes: list[tuple[int, ...]] = []

    def _release(self, key: int) -> None:
        self.storages[key][1] -= 1
        if self.storages[key][1] == 0:
            self.live -= self.storages.pop(key)[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage().data_ptr()
            if key not in self.storages:
                if key in inputs:  # a view or in-place result of a tensor from outside: no new memory
                    continue
                self.storages[key] = [t.untyped_storage().nbytes(), 0]
                self.live += self.storages[key][0]
                self.peak = max(self.peak, self.live)
                self.largest = max(self.largest, t.numel())
                self.shapes.append(tuple(t.shape))
            self.storages[key][1] += 1
            weakref.finalize(t, self._release, key)
        return out


def scores(T: int = 37, H: int = 16, V: int = 500, dtype=torch.float64) -> tuple[TokenScores, TokenScores, Module]:
    """Two policies' scores of T tokens: random hidden states [T, H] through one random head [H -> V]."""
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(H, V, bias=False).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g, dtype=dtype))
    hp, hq = torch.randn(T, H, generator=g, dtype=dtype), torch.randn(T, H, generator=g, dtype=dtype)
    return TokenScores(hidden=hp, head=head), TokenScores(hidden=hq, head=head), head


def test_chunked_sums_equal_the_whole_tensor_formulas_in_float64():
    p, q, head = scores()
    T, V, H = p.tokens, p.vocab, p.hidden.shape[1]
    with torch.no_grad():
        logits_p, logits_q = head(p.hidden), head(q.hidden)  # [T, V] each, the whole tensors
    lp, lq, mask = logits_p.log_softmax(-1), logits_q.log_softmax(-1), torch.ones(T)
    whole = {  # today's whole-tensor means, as the diagnostics computed them before (mean over T tokens)
        "kl": metrics.token_kl(lp[None], lq[None], mask[None]),
        "js": metrics.token_js(lp[None], lq[None], mask[None]),
        "entropy": metrics.mean_entropy(logits_p[None], mask[None]),
    }
    # Both sides round each of the ~(H + V + T) operations behind a value at most by u64, relative to the absolute
    # terms summed: error ≤ (H + V + T) u64 Σ|terms| / T, with Σ|terms| the sum over tokens and vocabulary of
    # |p (log p − log q)| (and |p log p| for the entropy), taken here.
    p_ = lp.exp()
    magnitude = {
        "kl": (p_ * (lp - lq)).abs().sum().item() / T,
        "js": ((p_ + lq.exp()) * (lp - lq).abs()).sum().item() / T,  # ≥ the JS terms' |p log(p/m)| + |q log(q/m)|
        "entropy": (p_ * lp).abs().sum().item() / T,
    }
    for chunk in (1, 5, T, 4 * T):  # one token, a ragged last chunk, exactly all, more than all
        for source in (p, TokenScores(logits=logits_p)):  # hidden states + head, or the logits themselves
            q_source = q if source.hidden is not None else TokenScores(logits=logits_q)
            sums = divergence_sums(source, q_source, ("kl", "js", "entropy"), chunk=chunk)
            for term, value in sums.items():
                bound = 2 * (H + V + T) * U64 * magnitude[term]  # 2: both sides' rounding
                assert value / T == pytest.approx(whole[term], abs=bound, rel=0), (term, chunk)
    assert whole["kl"] > 0.1 and 0 < whole["js"] < 0.6932 and whole["entropy"] > 0  # not degenerate inputs


def test_a_chunk_bounds_the_peak_memory_of_the_sums():
    p, q, head = scores(T=64, H=16, V=1000, dtype=torch.float32)
    T, V, chunk = p.tokens, p.vocab, 8
    with torch.no_grad(), LiveTensors() as chunked:
        divergence_sums(p, q, ("kl", "js", "entropy"), chunk=chunk)
    copy = chunk * V * 4  # bytes of one [chunk, V] float32 tensor
    # PEAK_CHUNK_COPIES [chunk, V] copies, plus the per-token [chunk] float32/float64 vectors of the three terms
    assert chunked.largest == chunk * V
    assert chunked.peak <= PEAK_CHUNK_COPIES * copy + 16 * chunk * 8
    assert chunked.peak > (PEAK_CHUNK_COPIES - 1) * copy  # the constant is the measured one, not a loose bound
    with torch.no_grad(), LiveTensors() as whole:  # the whole-tensor formulas hold the same copies of [T, V]
        lp, lq, mask = head(p.hidden).log_softmax(-1)[None], head(q.hidden).log_softmax(-1)[None], torch.ones(1, T)
        metrics.token_kl(lp, lq, mask), metrics.token_js(lp, lq, mask)
    assert whole.peak > (T // chunk) * (PEAK_CHUNK_COPIES - 1) * copy


@pytest.fixture(scope="module")
def float64_model():
    """tiny-random in float64 with a LoRA adapter moved off zero, and its engine."""
    base = load_base(ModelConfig(name="tiny-random"), "none")
    torch.manual_seed(0)
    model = attach_adapter(base.model.double(), "s1", LoraConfig(r=4, alpha=8))
    with torch.no_grad():
        for name, p in lora_parameters(model, "s1").items():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    use_adapters(model, ["s1"], trainable=None)
    model.eval()
    return model, base.tokenizer, HFEngine(model, base.tokenizer)


def whole_tensor_logits(model, batch, adapters) -> Tensor:
    """[N, R, V] float64 logits of the response tokens from one plain forward (no chunking, no prefix sharing)."""
    with torch.no_grad(), active_adapters(model, adapters):
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
    return out.logits[:, -batch.response_ids.shape[1] - 1 : -1]


# Each logit goes through a few layers of float64 sums of at most ~H + I terms; the two sides order them differently
# (prefix-shared key/value cache, the head on a chunk of tokens), so they differ by ~(layers·(H + I)) u64 ≈ 1e-13
# relative. The per-token terms are Lipschitz in the logits (|∂KL/∂logit| ≤ 2), so the means agree to ~1e-12 of
# the logits' scale; 1e-9 bounds that with the logits here of order 1-10.
MODEL_ATOL = 1e-9


def test_response_drift_equals_the_whole_tensor_computation_and_holds_no_full_logits(float64_model, monkeypatch):
    model, tok, engine = float64_model
    domains = [
        load_domain(DomainConfig(name=n, source=f"builtin:{s}", reward="tiny_rewards:digit_fraction"), 0, 6)
        for n, s in (("arith", "arithmetic"), ("mcq", "mcq"))
    ]
    V = model.get_output_embeddings().out_features
    monkeypatch.setattr(policy_divergence, "CHUNK_ELEMENTS", 3 * V)  # 3 tokens per chunk: many chunks per batch
    progress = []
    with LiveTensors() as live:
        drift = response_drift(model, tok, engine, domains, ["s1"], 6, 8, lambda d, t: progress.append((d, t)))
    assert progress == [(4, 12), (6, 12), (10, 12), (12, 12)]  # 4 probes per forward, 6 per domain
    for domain in domains:
        prompts = [encode_chat(tok, ex.messages) for ex in domain.eval[:6]]
        params = SamplingParams(max_new_tokens=8, greedy=True)
        responses = [g[0].token_ids for g in engine.generate(prompts, ["s1"], params)]
        batch = build_batch(prompts, responses, tok.pad_token_id)
        policy, base = whole_tensor_logits(model, batch, ["s1"]), whole_tensor_logits(model, batch, None)
        lp, lq, mask = policy.log_softmax(-1), base.log_softmax(-1), batch.response_mask
        got = drift[domain.name]
        assert got["kl_to_base"] == pytest.approx(metrics.token_kl(lp, lq, mask), abs=MODEL_ATOL, rel=0)
        assert got["js_to_base"] == pytest.approx(metrics.token_js(lp, lq, mask), abs=MODEL_ATOL, rel=0)
        assert got["entropy"] == pytest.approx(metrics.mean_entropy(policy, mask), abs=MODEL_ATOL, rel=0)
        assert got["kl_to_base"] > 1e-3 and mask.sum() > 3 * 4  # the adapter moved it; more tokens than a chunk
    # no [probes, R, V] logits: the largest vocabulary-wide tensor the whole measurement created is generation's
    # last-position logits of a domain's 6 probes, [6, 1, V], or one 3-token chunk's [3, V]; a forward's whole
    # logits would be [4, R = 8, V]
    assert max(math.prod(shape) for shape in live.shapes if shape[-1:] == (V,)) <= 6 * V < 4 * 8 * V


def test_stage_kl_equals_the_whole_tensor_computation(float64_model):
    model, tok, engine = float64_model
    domain = load_domain(
        DomainConfig(name="arith", source="builtin:arithmetic", reward="tiny_rewards:digit_fraction"), 0, 2
    )
    progress = []
    got = stage_kl(
        model, tok, engine, domain, [], ["s1"], 6, 8, seed=3, on_response=lambda d, t: progress.append((d, t))
    )
    assert progress == [(4, 6), (6, 6)]
    prompts = [encode_chat(tok, ex.messages) for ex in seeded_sample(domain.train, 6, 3)]
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=1.0, seed=3)
    completions = [g[0] for g in engine.generate(prompts, None, params)]
    batch = build_batch(prompts, [c.token_ids for c in completions], tok.pad_token_id)
    before, after = whole_tensor_logits(model, batch, None), whole_tensor_logits(model, batch, ["s1"])
    expected = metrics.token_kl(before.log_softmax(-1), after.log_softmax(-1), batch.response_mask)
    assert got["response_tokens"] == int(batch.response_mask.sum())
    assert got["kl_token_mean"] == pytest.approx(expected, abs=MODEL_ATOL, rel=0) and expected > 1e-3


def test_a_head_that_is_not_a_plain_linear_map_is_scored_from_the_models_own_logits(float64_model, monkeypatch):
    # soft-capped logits or LoRA on lm_head (`model.base.decoder_and_head` refuses them): the model's forward gives the
    # logits of the response tokens, and the measurement is the same
    model, tok, engine = float64_model
    domain = load_domain(
        DomainConfig(name="arith", source="builtin:arithmetic", reward="tiny_rewards:digit_fraction"), 0, 2
    )
    args = (model, tok, engine, domain, [], ["s1"], 5, 8, 3)
    plain = stage_kl(*args)

    def refuse(model):
        raise RecipeError("optim.logits_chunk_size: the LM head is not a plain linear map")

    monkeypatch.setattr(policy_divergence, "decoder_and_head", refuse)
    scored = []
    original = policy_divergence.response_logits
    monkeypatch.setattr(policy_divergence, "response_logits", lambda *a: scored.append(1) or original(*a))
    fallback = stage_kl(*args)
    assert len(scored) == 2 * 2  # both policies, on each of the 2 forwards (4 + 1 responses)
    assert fallback["response_tokens"] == plain["response_tokens"]
    # The fallback is float32 (response_logits returns float32 logits), the plain path float64 here. Per token the
    # float32 rounding of the logits moves the KL by ≤ 2 u32 |logit|max (Lipschitz 2), and its log-softmax and sum
    # over V by ≤ V u32 Σ_v p_v |log p_v − log q_v| ≤ V u32 · 4 |logit|max each: 8 V u32 |logit|max bounds it all.
    prompts = [encode_chat(tok, ex.messages) for ex in seeded_sample(domain.train, 5, 3)]
    sampled = engine.generate(prompts, None, SamplingParams(max_new_tokens=8, temperature=1.0, top_p=1.0, seed=3))
    batch = build_batch(prompts, [g[0].token_ids for g in sampled], tok.pad_token_id)
    largest = max(whole_tensor_logits(model, batch, a).abs().max().item() for a in (None, ["s1"]))
    V, u32 = model.get_output_embeddings().out_features, torch.finfo(torch.float32).eps / 2
    assert fallback["kl_token_mean"] == pytest.approx(plain["kl_token_mean"], abs=8 * V * u32 * largest, rel=0)
    assert plain["kl_token_mean"] > 100 * 8 * V * u32 * largest  # the bound is far below the value itself
