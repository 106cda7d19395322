"""Multiple-choice evaluation by log-likelihood: which option letter the model finds most likely as its answer.

A retention probe (ARC, BoolQ, PIQA, Winogrande, or any domain scored by `choice_letter`) shows the question with
lettered options and asks for the letter. Instead of generating a reply and reading a letter out of it, the model
scores each option's letter as the start of its reply, the continuation of the chat-templated prompt (the assistant
generation prompt included), and picks the most likely one: lm-evaluation-harness's multiple-choice `acc` (the sum of
the continuation's token log-probabilities, argmax over the options), with the options lettered in the prompt as its
MMLU tasks show them. One forward per example when every letter is one token (the usual case: all options share the
prompt), one per option otherwise, in batches of similar length; the LM head runs on the scored positions only. The
chosen letter is then scored by the domain's own reward, so a probe is correct exactly when a generated reply that
began with that letter would be.

It measures what the model knows of the options, not whether it still answers in the format (the trained domains,
whose answer format is what a stage teaches, keep greedy generation: `evaluate.py`), and costs a forward of the
prompt instead of a decode of up to `eval.max_new_tokens` tokens. `eval.choice_scoring` chooses it; eval.json records
`scoring: loglikelihood` per domain, and `completions` holds the chosen letters.

On a float32 CPU model the forwards run on oneDNN-packed linear weights (`rollout.packed_weights.packed_linears`, as
the hf engine's rollouts do): the same products up to float32 summation order, at about half the time of MKL's sgemm
for these row counts (the four retention probes, 400 examples on SmolLM2-135M with a LoRA adapter, one thread of an
AMD EPYC Zen 4: 138 s -> 72 s, the same letter chosen on all 400). Elsewhere (CUDA, a 4-bit base) nothing is packed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from adaptercl.adapters import active_adapters
from adaptercl.domains import LETTERS, Domain, Example, count_lettered_options
from adaptercl.rollout import packed_linears
from adaptercl.system import distributed

BATCH_ROWS = 16  # sequences per forward


def continuation_logprobs(logits: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """Sum of log p(target) over the masked positions of each row (lm-eval's `loglikelihood`).

    logits: [B, T, V], position t predicting targets[:, t]; targets: [B, T] token ids; mask: [B, T] 1 where the
    position is part of the continuation. Returns [B] float32."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, T, V]
    picked = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, T]
    return (picked * mask).sum(dim=-1)  # [B]


def option_continuations(tokenizer: Any, prompt_text: str, options: list[str]) -> tuple[list[int], list[list[int]]]:
    """The prompt's token ids and each option's continuation ids, split as lm-evaluation-harness splits them
    (`_encode_pair`): the whole text (prompt + option) is encoded, and the continuation is what follows the length of
    the prompt's own encoding; the rows scored are prompt + continuation."""
    prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    conts = []
    for option in options:
        whole = tokenizer(prompt_text + option, add_special_tokens=False)["input_ids"]
        conts.append(whole[len(prompt) :])
    return prompt, conts


def _last_logits(model: torch.nn.Module, rows: list[list[int]], pad_id: int, keep: int) -> Tensor:
    """The logits of each row's last `keep` positions: [B, keep, V]. Rows are left-padded, so their ends line up,
    with positions counted from each row's first real token (as `generate` does), and the LM head runs on the kept
    positions only (`logits_to_keep`): the vocabulary-wide logits of every prompt position would cost more than the
    rest of the forward."""
    width = max(len(r) for r in rows)
    device = next(model.parameters()).device
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)  # [B, W]
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)  # [B, W]
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, device=device)
        mask[i, width - len(r) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, W]
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, logits_to_keep=keep)
    return out.logits[:, -keep:]  # [B, keep, V]


@torch.no_grad()
def option_scores(
    model: torch.nn.Module, tokenizer: Any, prompts: list[str], options: list[list[str]]
) -> list[list[float]]:
    """Per prompt (chat-templated text), the log-likelihood of each of its options as the reply's start."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    split = [option_continuations(tokenizer, p, opts) for p, opts in zip(prompts, options, strict=True)]
    single = all(len(c) == 1 for _, conts in split for c in conts)
    scores: list[list[float]] = [[0.0] * len(opts) for opts in options]
    if single:  # every option is one token: one forward of the prompt gives them all
        order = sorted(range(len(split)), key=lambda i: len(split[i][0]))  # by length: little padding per batch
        for lo in range(0, len(order), BATCH_ROWS):
            part = order[lo : lo + BATCH_ROWS]
            logits = _last_logits(model, [split[i][0] for i in part], pad_id, 1)  # [b, 1, V]
            last = torch.log_softmax(logits[:, 0].float(), dim=-1)  # [b, V]
            for j, i in enumerate(part):
                scores[i] = [float(last[j, c[0]]) for c in split[i][1]]
        return scores
    # one row per (prompt, option): prompt + continuation, the continuation's tokens at the row's end; by length
    requests = [(i, k, prompt, cont) for i, (prompt, conts) in enumerate(split) for k, cont in enumerate(conts)]
    requests.sort(key=lambda r: len(r[2]) + len(r[3]))
    for lo in range(0, len(requests), BATCH_ROWS):
        part = requests[lo : lo + BATCH_ROWS]
        keep = max(len(cont) for *_, cont in part) + 1  # the positions predicting every continuation token
        logits = _last_logits(model, [prompt + cont for *_, prompt, cont in part], pad_id, keep)  # [b, keep, V]
        targets = torch.zeros(logits.shape[:2], dtype=torch.long, device=logits.device)  # [b, keep]
        mask = torch.zeros(logits.shape[:2], device=logits.device)  # [b, keep]
        for j, (*_, cont) in enumerate(part):
            # token m of the continuation is predicted by the kept position keep − len(cont) − 1 + m
            start = keep - len(cont) - 1
            targets[j, start : start + len(cont)] = torch.tensor(cont, device=logits.device)
            mask[j, start : start + len(cont)] = 1.0
        sums = continuation_logprobs(logits, targets, mask)  # [b]
        for j, (i, k, _, _) in enumerate(part):
            scores[i][k] = float(sums[j])
    return scores


def loglikelihood_domains(domains: list[Domain], retention_probes: list[str], choice_scoring: str) -> set[str]:
    """The domains scored here rather than by generation: the retention probes whose reward reads an option letter
    (`Domain.choice_letters`), under `eval.choice_scoring: loglikelihood`."""
    if choice_scoring != "loglikelihood":
        return set()
    return {d.name for d in domains if d.name in retention_probes and d.choice_letters}


def letters_of(example: Example) -> list[str]:
    """The option letters the example's prompt lists (A, B, ...): the candidates it is scored over."""
    n = count_lettered_options(example.messages[-1]["content"]) or 0
    return list(LETTERS[:n])


@torch.no_grad()
def evaluate_choices(
    model: torch.nn.Module, tokenizer: Any, domain: Domain, adapters: list[str] | None, limit: int
) -> dict:
    """A domain's eval row, scored by log-likelihood (module docstring): the same fields as a generated row
    (`evaluate.evaluate_domain`), `completions` the chosen letters, plus `scoring`. Sharded over data-parallel ranks
    as the generated rows are, gathered in eval-set order."""
    examples = domain.eval[:limit]
    lo, hi = distributed.shard_bounds(len(examples))
    mine = examples[lo:hi]
    prompts = [tokenizer.apply_chat_template(ex.messages, add_generation_prompt=True, tokenize=False) for ex in mine]
    letters = [letters_of(ex) for ex in mine]
    if any(not opts for opts in letters):
        bad = next(ex for ex, opts in zip(mine, letters) if not opts)
        raise ValueError(f"domains.{domain.name}: example {bad.id} lists no lettered options to score")
    was_training = model.training
    model.eval()
    try:
        with active_adapters(model, adapters), packed_linears(model, use="sequences"):
            scores = option_scores(model, tokenizer, prompts, letters)
    finally:
        model.train(was_training)
    chosen = [opts[max(range(len(opts)), key=s.__getitem__)] for opts, s in zip(letters, scores, strict=True)]
    results = domain.score(chosen, [[] for _ in chosen], mine) if chosen else []
    records = distributed.gather_lists([(c, r.score, r.correct) for c, r in zip(chosen, results, strict=True)])
    return {
        "accuracy": sum(correct for *_, correct in records) / len(records),
        "reward_mean": sum(score for _, score, _ in records) / len(records),
        "n": len(records),
        "scoring": "loglikelihood",
        "correct": [bool(correct) for *_, correct in records],  # [n], eval-set order
        "completions": [letter for letter, *_ in records],  # [n], the chosen letters
        "samples": [
            {"id": ex.id, "completion": letter, "correct": correct}
            for ex, (letter, _, correct) in list(zip(examples, records))[:3]
        ],
    }
