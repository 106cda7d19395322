"""The training step's memory settings change memory, not the update: `optim.logits_chunk_size` (per-token terms from
chunks of positions, recomputed in backward) and `optim.activation_checkpointing` give the gradients and statistics
of the default CPU path, for every method, support and teacher, on tiny-random.

The claim is exactness, and the two sides take different summation orders (chunks of positions; checkpointing recomputes
each layer in backward), so both run in float64 (`model.dtype: float64`): there the sums' rounding
is ~n·2^-53 relative (n ≤ a few thousand terms: < 1e-12), whatever the CPU's kernels; in float32 the same differences
reach ~1e-5 and depend on the ISA (AVX-512 vs AVX2)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from adaptercl.adapters.live import lora_parameters
from adaptercl.model.base import decoder_and_head
from adaptercl.model.batching import build_batch, encode_chat
from adaptercl.model.checkpointing import resolve_activation_checkpointing
from adaptercl.recipe.grammar import RecipeError, resolve_recipe
from adaptercl.rollout import SamplingParams
from adaptercl.train import losses
from adaptercl.train.context import prompts_for_step
from adaptercl.train.distill_targets import distill_targets
from adaptercl.train.regularizers import StageRegularizers
from adaptercl.train.step import train_on_batch
from adaptercl.train.token_terms import resolve_logits_chunk_size
from tests.train.test_distill_stage import ToyDomain, stage_context

CASES = {  # method, blocks: each support, a trust-region teacher, kl_prev and the base KL, several iterations, srpo
    "grpo": ("grpo", {"regularizers": {"kl_prev": 0.1}, "grpo": {"kl_coef": 0.05, "iterations": 2}}),
    "sdpo_full": ("sdpo", {"distill": {"support": "full", "alpha": 0.5}, "regularizers": {"kl_prev": 0.1}}),
    "sdft_topk_tail": ("sdft", {"distill": {"support": "topk", "topk": 5, "tail": True}}),
    "sdpo_topk_renorm": ("sdpo", {"distill": {"support": "topk", "topk": 5, "tail": False, "alpha": 0.0}}),
    "hybrid_sampled": ("hybrid", {"distill": {"support": "sampled", "alpha": 1.0}, "hybrid": {"distill_on": "all"}}),
    "hybrid_trust_region": (
        "hybrid",
        {
            "distill": {"support": "topk", "topk": 7, "teacher": {"kind": "trust_region"}},
            "hybrid": {"distill_on": "all"},
        },
    ),
    "srpo": ("srpo", {"distill": {"topk": 7}, "grpo": {"iterations": 2}}),  # its teacher's hidden states, reused
}


class GradRecorder:
    """Stands in for the optimiser: keeps each pass's gradients instead of stepping (the weights never move)."""

    def __init__(self, params: list[torch.Tensor]):
        self.params, self.grads = params, []

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        self.grads.append([p.grad.clone() for p in self.params])


def one_step(tmp_path, case: str, **optim) -> tuple[list[list[torch.Tensor]], dict[str, float]]:
    """The gradients and statistics of the first training step of `case` (max_grad_norm large: no clipping)."""
    method, blocks = CASES[case]
    blocks = {**blocks, "optim": {"max_grad_norm": 1e9, "grad_accum": 2, **optim}}
    blocks["rollout"] = {"max_new_tokens": 8}
    blocks["model"], blocks["quantization"] = {"dtype": "float64"}, "none"  # exactness: see the module docstring
    ctx = stage_context(tmp_path, method, ToyDomain(), **blocks)
    stage, tok = ctx.stage, ctx.tokenizer
    examples = [ctx.domain.train[i] for i in prompts_for_step(len(ctx.domain.train), 2, 0, 0, 0)]
    group = stage.rollout.group_size
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=1.0, n=group, seed=3, logprobs=False)
    completions = [
        c
        for g in ctx.engine.generate([encode_chat(tok, e.messages) for e in examples], [ctx.student], params)
        for c in g
    ]
    samples = [e for e in examples for _ in range(group)]
    results = [ctx.domain.reward(c.text, e) for c, e in zip(completions, samples)]
    rewards = torch.tensor([r.score for r in results])
    batch = build_batch([c.prompt_ids for c in completions], [c.token_ids for c in completions], tok.pad_token_id)
    assert batch.response_ids.shape[1] == 8  # chunks of 3 do not divide R
    targets = (
        distill_targets(ctx, 0, samples, completions, results, batch) if ctx.teacher and method != "grpo" else None
    )
    regs = StageRegularizers.start(ctx.model, ctx.student, [], [], stage.regularizers)
    recorder = GradRecorder(list(lora_parameters(ctx.model, ctx.student).values()))
    ctx.model.train()
    stats = train_on_batch(ctx, batch, losses.group_advantages(rewards, group), recorder, targets, None, regs)
    assert len(recorder.grads) == stage.grpo.iterations
    if method == "srpo":  # both routes in the batch
        assert 0 < stats["teacher_rows"] < len(completions)
    return recorder.grads, stats


# In float64 the kernels' summation order costs < 1e-12 (module docstring). What remains is float32 rounding inside
# transformers' forward (its rotary embedding computes the cos/sin tables in float32 whatever the model dtype), entering
# the two layouts at different points: ~2^-24 ≈ 6e-8 of a tensor's scale, the same on every ISA. Gradients are
# compared normwise (rounding scales with the largest terms summed, not an element's own value), within 1e-6 of the
# reference's largest entry (16x that rounding); a wrong path (a dropped chunk, a token counted twice) moves them by
# percents.
TOL = 1e-6


def assert_same_step(reference, other) -> None:
    (ref_grads, ref_stats), (grads, stats) = reference, other
    assert any(g.abs().max() > 0 for g in ref_grads[0])
    for ref_pass, pass_ in zip(ref_grads, grads, strict=True):
        for a, b in zip(ref_pass, pass_, strict=True):
            assert a.dtype == torch.float64
            torch.testing.assert_close(b, a, rtol=0, atol=TOL * a.abs().max().item())
    assert ref_stats.keys() == stats.keys()
    for key in ref_stats:
        assert stats[key] == pytest.approx(ref_stats[key], rel=TOL, abs=1e-12), key


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_logits_give_the_full_logits_gradients_and_statistics(tmp_path, case, monkeypatch):
    reference = one_step(tmp_path / "full", case)  # CPU default: off
    from adaptercl.model.batching import ResponseScores

    widths = []
    original = ResponseScores.chunk_logits
    monkeypatch.setattr(
        ResponseScores,
        "chunk_logits",
        lambda self, hidden: widths.append(hidden.shape[1]) or original(self, hidden),
    )
    assert_same_step(reference, one_step(tmp_path / "chunked", case, logits_chunk_size=3))
    assert set(widths) == {3, 2}  # 8 positions: chunks of 3, 3, 2, forward and recomputed in backward
    assert_same_step(reference, one_step(tmp_path / "one", case, logits_chunk_size=64))  # one chunk wider than R


@pytest.mark.parametrize("case", ["grpo", "sdpo_full", "sdft_topk_tail", "hybrid_sampled", "srpo"])
def test_activation_checkpointing_gives_the_same_gradients(tmp_path, case, monkeypatch):
    reference = one_step(tmp_path / "plain", case)  # CPU default: off
    import adaptercl.model.batching as batching
    import adaptercl.model.checkpointing as checkpointing

    calls, original = [], checkpointing.checkpoint
    monkeypatch.setattr(checkpointing, "checkpoint", lambda *a, **k: calls.append(k) or original(*a, **k))
    prefills, original_prefill = [], batching.prefill
    monkeypatch.setattr(
        batching, "prefill", lambda *a, **k: prefills.append(k["replayable"]) or original_prefill(*a, **k)
    )
    checkpointed = one_step(tmp_path / "ckpt", case, activation_checkpointing=True)
    # 2 micro-batches per pass, each a group sharing its prompt: a prefix call and a rows' call with the replayable
    # cache (the no-grad forwards of teachers and references keep the plain one), each running both decoder layers
    # under checkpointing. SDFT's one sample per prompt shares only where the layout is cheaper.
    passes = CASES[case][1].get("grpo", {}).get("iterations", 1)
    shared = prefills.count(True)
    assert shared == 2 * passes or case == "sdft_topk_tail"
    assert len(calls) == 2 * 2 * shared + 2 * (2 * passes - shared)
    assert all(k["use_reentrant"] is False for k in calls)
    assert_same_step(reference, checkpointed)
    both = one_step(tmp_path / "both", case, activation_checkpointing=True, logits_chunk_size=3)
    assert_same_step(reference, both)


def test_an_appending_cache_cannot_be_recomputed(tmp_path, monkeypatch):
    # the reason for the replayable cache: a plain cache in a checkpointed training forward appends the rows' keys
    # to the prefix's, and backward's recompute of a layer appends them a second time: the shapes no longer match
    import adaptercl.model.prefix_sharing as prefix_sharing

    monkeypatch.setattr(prefix_sharing, "ReplayableCache", AppendingCache)
    with pytest.raises(RuntimeError, match="size"):
        one_step(tmp_path, "grpo", activation_checkpointing=True)


class AppendingCache(DynamicCache):
    """Appends as transformers' own cache does, on both calls."""

    def __init__(self, read_only: bool = False) -> None:
        super().__init__()

    def reader(self) -> DynamicCache:
        return self


def test_settings_resolve_on_for_cuda_off_on_cpu_and_refuse_bad_values(tmp_path):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_logits_chunk_size("auto", cpu) is None and resolve_logits_chunk_size("auto", cuda) == 1024
    assert resolve_logits_chunk_size("off", cuda) is None and resolve_logits_chunk_size(7, cpu) == 7
    assert not resolve_activation_checkpointing("auto", cpu) and resolve_activation_checkpointing("auto", cuda)
    assert resolve_activation_checkpointing(True, cpu) and not resolve_activation_checkpointing(False, cuda)
    base = {
        "model": {"name": "tiny-random"},
        "domains": [{"name": "arith", "source": "builtin:arithmetic"}],
        "stages": [{"name": "one", "domain": "arith", "method": "grpo"}],
    }
    for bad in ({"logits_chunk_size": 0}, {"logits_chunk_size": "big"}, {"activation_checkpointing": "sometimes"}):
        with pytest.raises(RecipeError, match=f"optim.{next(iter(bad))}"):
            resolve_recipe({**base, "optim": bad})


def test_a_head_that_is_not_a_plain_linear_map_is_refused_by_name(tmp_path):
    ctx = stage_context(tmp_path, "grpo", ToyDomain())
    decoder, head = decoder_and_head(ctx.model)
    assert isinstance(head, torch.nn.Linear)
    ctx.model.get_base_model().config.final_logit_softcapping = 30.0
    with pytest.raises(RecipeError, match="logits_chunk_size: off"):
        decoder_and_head(ctx.model)


def test_high_entropy_takes_the_entropies_a_chunk_of_tokens_at_a_time(tmp_path, monkeypatch):
    """`hybrid.distill_on: high_entropy` ranks tokens by the student's entropies
    (`train.sparse_targets.rollout_entropy`): from the micro-batch's hidden states, one chunk of tokens' logits at a
    time (here 5 of the 64 tokens, across rows), never [n, R, V]; they equal the entropies of the full logits. Same
    forward on both sides (one micro-batch of every row), so only the LM head's matmul over fewer rows differs: float64
    rounding of H = 64 products and a V = 320-term entropy sum, ~1e-14 of the entropies (<= log V), far inside 1e-10; a
    dropped or repeated chunk moves a token's entropy by its whole value."""
    from adaptercl.train import sparse_targets as hybrid
    from adaptercl.train.losses import token_entropy
    from adaptercl.train.token_terms import ResponseScores

    blocks = {"model": {"dtype": "float64"}, "quantization": "none", "rollout": {"max_new_tokens": 8}}
    ctx = stage_context(tmp_path, "hybrid", ToyDomain(), hybrid={"distill_on": "high_entropy"}, **blocks)
    examples = [ctx.domain.train[i] for i in prompts_for_step(len(ctx.domain.train), 2, 0, 0, 0)]
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=1.0, n=4, seed=3, logprobs=False)
    prompts = [encode_chat(ctx.tokenizer, e.messages) for e in examples]
    completions = [c for g in ctx.engine.generate(prompts, [ctx.student], params) for c in g]
    batch = build_batch([c.prompt_ids for c in completions], [c.token_ids for c in completions], 0)
    with torch.no_grad():
        for name, p in lora_parameters(ctx.model, ctx.student).items():  # B = 0 at init: give the adapter a say
            if "lora_B" in name:
                p.add_(0.05 * torch.randn_like(p))
        ctx.model.eval()
        reference = token_entropy(hybrid.response_logits(ctx.model, batch, temperature=0.7))  # [8, 8]
    rows = []
    original = ResponseScores.chunk_logits
    monkeypatch.setattr(ResponseScores, "chunk_logits", lambda self, h: rows.append(h.shape) or original(self, h))
    monkeypatch.setattr(hybrid, "token_chunk", lambda vocab: 5)
    chunked = hybrid.rollout_entropy(ctx.model, batch, micro=8, temperature=0.7)
    assert chunked.dtype == torch.float64 and chunked.shape == reference.shape == (8, 8)
    torch.testing.assert_close(chunked, reference, rtol=0, atol=1e-10)
    assert [r[0] for r in rows] == [5] * 12 + [4] and all(len(r) == 2 for r in rows)  # [c, H] chunks of 64 tokens


def test_checkpointing_wraps_each_layer_once_and_restores_it_nested():
    from adaptercl.model import load_base
    from adaptercl.model.checkpointing import activation_checkpointing, checkpointing_active
    from adaptercl.recipe.grammar import ModelConfig

    model = load_base(ModelConfig(name="tiny-random"), "none", torch.device("cpu")).model.train()
    layers = model.model.layers
    with activation_checkpointing(model, True):
        wrapped = [layer.forward for layer in layers]
        with activation_checkpointing(model, True):
            assert [layer.forward for layer in layers] == wrapped  # not wrapped twice
        assert checkpointing_active(model) and [layer.forward for layer in layers] == wrapped
    assert not checkpointing_active(model) and all("forward" not in vars(layer) for layer in layers)
    with activation_checkpointing(model, False):
        assert not checkpointing_active(model)
