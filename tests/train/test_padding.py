"""Micro-batches without the batch's padding (`micro_batch_rows.py`, `batching.trim_padding`) make the padded path's
update: the training step on rows of unequal prompts and responses gives the gradients and statistics of the same step
with every micro-batch padded to the whole batch (the code before, rebuilt by swapping the two functions back), for each
aggregation, the teacher's batch, kl_prev, the base KL, rollout logprobs and several iterations.

Both run in float64 (`model.dtype: float64`), as tests/test_memory_settings.py, and share its tolerance
(`assert_same_step`: 1e-6 of the largest gradient entry). What the two sides still round differently is float32, the
same on every ISA: the masks are float32 (`build_batch`), so a micro-batch's share of the batch-global denominator
(its tokens / the batch's) is rounded to 2^-24 ≈ 6e-8 relative, and its rows differ between the two orders; and the
rotary tables are float32 in transformers whatever the model dtype, entering the prefix-shared and plain layouts at
different points. Measured: ≤ 1.2e-7 of the largest entry; with float64 masks and the plain layout, 1e-15. A wrong
path (a row's rollout logprobs paired with another row, local instead of global denominators, a trimmed token) moves
the gradients by percents.
"""

from __future__ import annotations

import pytest
import torch

from adaptercl.adapters.live import lora_parameters
from adaptercl.model.batching import build_batch, encode_chat, response_logits, trim_padding
from adaptercl.rollout import Completion
from adaptercl.rollout.hf import response_logprobs
from adaptercl.train import losses
from adaptercl.train import step as train_step
from adaptercl.train.context import prompts_for_step
from adaptercl.train.distill_targets import distill_targets
from adaptercl.train.micro_batch_rows import cut, forward_positions, micro_batch_rows, split_order
from adaptercl.train.regularizers import StageRegularizers
from adaptercl.train.stage import _rollout_logprobs
from tests.train.test_distill_stage import ToyDomain, ToyExample, stage_context
from tests.train.test_memory_settings import GradRecorder, assert_same_step

CASES = {  # method, blocks: every aggregation, each teacher batch, kl_prev, the base KL, iterations, rollout logprobs
    "grpo_token_mean": ("grpo", {"regularizers": {"kl_prev": 0.1}, "grpo": {"kl_coef": 0.05, "iterations": 2}}),
    "grpo_seq_mean_token_mean": ("grpo", {"grpo": {"aggregation": "seq_mean_token_mean"}}),
    "grpo_seq_mean_token_sum_norm": ("grpo", {"grpo": {"aggregation": "seq_mean_token_sum_norm"}}),
    "sdpo_full_seq_mean_all": ("sdpo", {"distill": {"support": "full", "alpha": 0.5}}),
    "hybrid_sampled": ("hybrid", {"distill": {"support": "sampled", "alpha": 1.0}, "hybrid": {"distill_on": "all"}}),
}
# Response lengths of the 8 rows (2 prompts x 4 samples): long and short alternate inside each group, so micro-batches
# of 2 in rollout order each hold a long and a short response, and sorted ones do not.
LENGTHS = [8, 1, 7, 2, 8, 1, 6, 3]


class LongShortDomain(ToyDomain):
    """ToyDomain with prompts of 12 different lengths (byte tokens: 6 more per example)."""

    def __init__(self):
        super().__init__()
        self.train = [
            ToyExample(str(i), [{"role": "user", "content": "Sum " + "1+" * (3 * i) + "1?"}], "1", "1")
            for i in range(12)
        ]
        self.eval = self.train[:2]


def one_step(tmp_path, case: str, **optim):
    """The gradients and statistics of one training step of `case` on rows of LENGTHS, micro-batches of 2, with
    the rollout engine's logprobs (the model's own, shifted per row so the importance ratios are not 1)."""
    method, blocks = CASES[case]
    blocks = {**blocks, "optim": {"max_grad_norm": 1e9, "micro_batch_size": 2, **optim}}
    blocks["rollout"] = {"max_new_tokens": 8}
    blocks["model"], blocks["quantization"] = {"dtype": "float64"}, "none"  # exactness: test_memory_settings
    ctx = stage_context(tmp_path, method, LongShortDomain(), **blocks)
    stage, tok = ctx.stage, ctx.tokenizer
    examples = [ctx.domain.train[i] for i in prompts_for_step(len(ctx.domain.train), 2, 0, 0, 0)]
    group = stage.rollout.group_size
    samples = [e for e in examples for _ in range(group)]
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(40, 120, (k,), generator=gen).tolist() for k in LENGTHS]
    completions = [
        Completion(encode_chat(tok, e.messages), t, tok.decode(t), "length") for e, t in zip(samples, tokens)
    ]
    logps = response_logprobs(ctx.model, completions, tok.pad_token_id, 1.0)
    for i, (c, lp) in enumerate(zip(completions, logps)):
        c.logprobs = [v - 0.05 * i for v in lp]
    results = [ctx.domain.reward(c.text, e) for c, e in zip(completions, samples)]
    batch = build_batch([c.prompt_ids for c in completions], [c.token_ids for c in completions], tok.pad_token_id)
    targets = distill_targets(ctx, 0, samples, completions, results, batch) if method != "grpo" else None
    regs = StageRegularizers.start(ctx.model, ctx.student, [], [], stage.regularizers)
    recorder = GradRecorder(list(lora_parameters(ctx.model, ctx.student).values()))
    advantages = losses.group_advantages(torch.tensor([r.score for r in results]), group)
    ctx.model.train()
    spied = train_on_batch_spied(
        ctx, batch, advantages, recorder, targets, regs, _rollout_logprobs(completions, batch)
    )
    return (recorder.grads, spied.pop("stats")), spied, batch


def train_on_batch_spied(ctx, batch, advantages, recorder, targets, regs, rollout_logp) -> dict:
    """`train_step.train_on_batch`'s statistics, with the order it chose and the shapes of the student micro-batches
    it forwarded (the cuts without a width; a teacher's cut is given its student's width)."""
    spied = {"students": []}
    original_rows, original_cut = train_step.micro_batch_rows, train_step.cut

    def rows(*a, **k):
        spied["order"] = original_rows(*a, **k)
        return spied["order"]

    def cut(b, rows, parts, *width):
        out = original_cut(b, rows, parts, *width)
        if not width:
            spied["students"].append(tuple(out.input_ids.shape))
        return out

    train_step.micro_batch_rows, train_step.cut = rows, cut
    try:
        spied["stats"] = train_step.train_on_batch(ctx, batch, advantages, recorder, targets, rollout_logp, regs)
    finally:
        train_step.micro_batch_rows, train_step.cut = original_rows, original_cut
    return spied


def padded_path(monkeypatch) -> None:
    """The step as it was: micro-batches in rollout order, each padded to the whole batch's longest."""
    monkeypatch.setattr(train_step, "cut", lambda batch, rows, parts, width=None: batch.select(rows))
    monkeypatch.setattr(
        train_step,
        "micro_batch_rows",
        lambda batch, micro, share_prompts: ("rollout", split_order(list(range(batch.input_ids.shape[0])), micro)),
    )


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no_checkpointing", "checkpointing"])
@pytest.mark.parametrize("case", list(CASES))
def test_sorted_trimmed_micro_batches_make_the_padded_update(tmp_path, case, checkpointing):
    optim = {"activation_checkpointing": checkpointing}
    new, spied, batch = one_step(tmp_path / "new", case, **optim)
    order, parts = spied["order"]
    assert order != "rollout"  # sorted: the long responses together, the short ones together
    assert [len(p) for p in parts] == [2, 2, 2, 2] and sorted(torch.cat(parts).tolist()) == list(range(8))
    students = spied["students"][: len(parts)]  # the first pass's student micro-batches
    assert sum(n * w for n, w in students) < 8 * batch.input_ids.shape[1]  # fewer positions than padded
    with pytest.MonkeyPatch.context() as mp:
        padded_path(mp)
        reference, padded, _ = one_step(tmp_path / "padded", case, **optim)
    assert padded["order"][0] == "rollout" and set(padded["students"]) == {(2, batch.input_ids.shape[1])}  # as before
    assert_same_step(reference, new)


def test_a_trimmed_selection_is_the_batch_built_from_those_rows():
    prompts = [[5, 6, 7, 8, 9], [5, 6], [5, 6, 7], [4]]
    responses = [[1, 2, 3, 4], [2], [], [3, 3]]
    full = build_batch(prompts, responses, pad_id=0)
    for rows in ([1, 2], [1, 3], [0, 2], [2]):
        trimmed = trim_padding(full.select(torch.tensor(rows)))
        alone = build_batch([prompts[i] for i in rows], [responses[i] for i in rows], pad_id=0)
        for name, value in vars(alone).items():
            assert torch.equal(getattr(trimmed, name), value), (rows, name)
    teacher = trim_padding(full.select(torch.tensor([1, 2])), response_width=3)  # cut to a student's 3 columns
    assert teacher.response_ids.shape == (2, 3) and teacher.input_ids.shape == (2, 3 + 3)


def test_trimmed_rows_get_the_padded_rows_logits(tmp_path):
    # float64: the two layouts differ in matmul shapes only; rounding ~n·2^-53 relative (n ≤ a few hundred terms),
    # far under 1e-10 of the logits' scale; a shifted position or a dropped token moves them by O(1).
    ctx = stage_context(tmp_path, "grpo", LongShortDomain(), model={"dtype": "float64"}, quantization="none")
    tok = ctx.tokenizer
    prompts = [encode_chat(tok, e.messages) for e in ctx.domain.train[:3]]
    responses = [[65, 66, 67, 68, 69, 70], [71], [72, 73]]
    full = build_batch(prompts, responses, tok.pad_token_id)
    rows = torch.tensor([1, 2])
    with torch.no_grad():
        padded = response_logits(ctx.model, full, share_prompts=False)[rows][:, :2]  # [2, 2, V]
        trimmed = response_logits(ctx.model, trim_padding(full.select(rows)), share_prompts=False)
    assert trimmed.dtype == torch.float64 and trimmed.shape == padded.shape
    scale = padded.abs().max().item()
    torch.testing.assert_close(trimmed, padded, rtol=0, atol=1e-10 * scale)


def test_the_cheapest_order_is_chosen_and_one_micro_batch_stays_as_it_is():
    # rollout order: 2 groups (prompts of 3 and 6 tokens), responses long/short alternating within each group
    prompts = [[1, 2, 3]] * 4 + [[1, 2, 4, 5, 6, 7]] * 4
    responses = [[9] * r for r in (8, 1, 8, 1, 8, 1, 8, 1)]
    batch = build_batch(prompts, responses, pad_id=0)
    # plain layout, by hand: rollout order pays P'+8 columns in every micro-batch of 2: 2·(3+8)·2 + 2·(6+8)·2 = 100;
    # sorted by length: [B8 B8] [A8 A8] [B1 B1] [A1 A1] = 2·14 + 2·11 + 2·7 + 2·4 = 72
    assert forward_positions(trim_padding(batch.select(slice(0, 2))), share_prompts=False) == 2 * (3 + 8)
    order, parts = micro_batch_rows(batch, 2, share_prompts=False)
    assert order == "length"
    assert [p.tolist() for p in parts] == [[4, 6], [0, 2], [5, 7], [1, 3]]
    assert sum(forward_positions(trim_padding(batch.select(p)), False) for p in parts) == 72
    # equal lengths everywhere: nothing to gain, the rollout order (slices) stays
    same = build_batch([[1, 2, 3]] * 4, [[9] * 4] * 4, pad_id=0)
    assert micro_batch_rows(same, 2, share_prompts=True) == ("rollout", [slice(0, 2), slice(2, 4)])
    assert micro_batch_rows(batch, 8, share_prompts=False) == ("rollout", [slice(0, 8)])


def test_a_cheaper_order_is_not_taken_when_one_of_its_micro_batches_outgrows_the_planned_one():
    """2 groups of 2 rows (distinct 5-token prompts), responses of 100 and 1 tokens in each. In rollout order each
    micro-batch holds one group: its prompt computed once (4 shared positions, the last prompt token with the rows),
    4 + 2 x (1 + 100 - 1) = 204 positions, 408 in all. Sorted by length, [A1 B1] [A2 B2] computes 222 in all but its
    first micro-batch holds two prompts, 2 x (5 + 100) = 210 positions: more than any micro-batch the memory plan sizes
    the step for (plan/step_memory.py counts the groups a run of rows spans in rollout order), so rollout stays."""
    batch = build_batch([[1, 2, 3, 4, 5]] * 2 + [[6, 7, 8, 9, 10]] * 2, [[9] * r for r in (100, 1, 100, 1)], pad_id=0)
    rollout = [forward_positions(trim_padding(batch.select(p)), True) for p in (slice(0, 2), slice(2, 4))]
    by_length = [forward_positions(trim_padding(batch.select(torch.tensor(p))), True) for p in ([0, 2], [1, 3])]
    assert rollout == [204, 204] and by_length == [210, 12]  # cheaper in all, larger at its largest
    assert micro_batch_rows(batch, 2, share_prompts=True) == ("rollout", [slice(0, 2), slice(2, 4)])


def test_one_micro_batch_is_the_step_as_before_bit_for_bit(tmp_path):
    new, spied, batch = one_step(tmp_path / "new", "sdpo_full_seq_mean_all", micro_batch_size=8)
    assert spied["order"] == ("rollout", [slice(0, 8)]) and spied["students"] == [tuple(batch.input_ids.shape)]
    with pytest.MonkeyPatch.context() as mp:
        padded_path(mp)
        reference, _, _ = one_step(tmp_path / "padded", "sdpo_full_seq_mean_all", micro_batch_size=8)
    for a, b in zip(reference[0][0], new[0][0], strict=True):
        assert torch.equal(a, b)
    assert new[1] == reference[1]


def test_a_teacher_batch_is_cut_only_when_the_step_has_several_micro_batches():
    # teacher prompts of 5, 2 and 3 tokens: rows 1 and 2 alone need 3 prompt columns, not 5
    teacher = build_batch([[5, 6, 7, 8, 9], [5, 6], [5, 6, 7]], [[1, 2, 3, 4], [2], []], pad_id=0)
    rows = torch.tensor([1, 2])
    assert cut(teacher, rows, 1, 4).input_ids.shape == (2, 5 + 4)  # one micro-batch: as it is
    assert torch.equal(cut(teacher, rows, 1, 4).input_ids, teacher.input_ids[rows])
    several = cut(teacher, rows, 3, 2)  # cut to its student micro-batch's 2 response columns
    assert several.input_ids.shape == (2, 3 + 2) and several.response_ids.shape == (2, 2)
