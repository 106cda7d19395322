"""The plain-transformers rollout engine: batched, seeded `generate` on the training model itself.

It runs on the same PeftModel the trainer updates, so rollouts are exactly on-policy and adapter "sync" is free.
Prompts are left-padded per batch. Per-token logprobs (under logits / temperature, the trainer's definition) are
computed on request by one no-grad teacher-forced forward, because transformers' `output_logits` would keep a
[batch, vocab] tensor per generated token.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from adaptercl.adapters import active_adapters
from adaptercl.batching import prompt_runs, response_logprobs, run_starts
from adaptercl.rollout import Completion, SamplingParams


class HFEngine:
    def __init__(self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, batch_size: int = 64):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.stop_ids = _stop_token_ids(model, tokenizer)

    def sync_adapters(self, names: list[str]) -> None:
        """Nothing to do: generation reads the live training weights."""

    def sleep(self) -> None:
        """Nothing to free: the engine is the training model."""

    def wake(self) -> None:
        """See `sleep`."""

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], adapters: list[str] | None, params: SamplingParams
    ) -> list[list[Completion]]:
        was_training = self.model.training
        self.model.eval()
        expanded = [p for p in prompts for _ in range(params.n)]  # [P*n] group-contiguous
        out: list[Completion] = []
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(params.seed)
        try:
            with active_adapters(self.model, adapters):
                for start in range(0, len(expanded), self.batch_size):
                    out.extend(self._generate_batch(expanded[start : start + self.batch_size], params))
        finally:
            torch.random.set_rng_state(generator_state)
            self.model.train(was_training)
        return [out[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        device = next(self.model.parameters()).device
        pad_id = self.tokenizer.pad_token_id
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, P] left-padded
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p) :] = torch.tensor(p)
            attention[i, width - len(p) :] = 1
        sampling = (
            {"do_sample": False}
            if params.greedy
            else {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": 0}
        )
        input_ids, attention = input_ids.to(device), attention.to(device)
        sequences = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            past_key_values=_shared_prefill(self.model, input_ids, attention),
            max_new_tokens=params.max_new_tokens,
            eos_token_id=self.stop_ids,
            pad_token_id=pad_id,
            repetition_penalty=1.0,  # the trainer's distribution is logits / temperature, nothing else
            **sampling,
        ).cpu()  # [B, P + R]
        completions = []
        for i, p in enumerate(prompts):
            response = sequences[i, width:].tolist()
            stop_at = next((j for j, t in enumerate(response) if t in self.stop_ids), None)
            tokens = response if stop_at is None else response[: stop_at + 1]
            completions.append(
                Completion(
                    prompt_ids=list(p),
                    token_ids=tokens,
                    text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                    finish_reason="length" if stop_at is None else "stop",
                )
            )
        if params.logprobs:
            for c, lp in zip(completions, response_logprobs(self.model, completions, pad_id, params.temperature)):
                c.logprobs = lp
        return completions


def _shared_prefill(model: torch.nn.Module, input_ids: torch.Tensor, attention: torch.Tensor):
    """The key/value cache of every prompt but its last token, each run of identical consecutive prompts (a
    group's n samples) computed once and repeated; `generate` then decodes from it. None when no prompt repeats.

    input_ids, attention: [B, P] left-padded. Positions are those `generate` derives from the attention mask.
    """
    if input_ids.shape[1] < 2:
        return None
    counts = prompt_runs(input_ids, attention)  # [U]
    if counts is None:
        return None
    first = run_starts(counts)  # [U]
    mask = attention[first, :-1]  # [U, P-1]
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        prefix = input_ids[first, :-1]  # [U, P-1]
        out = model(input_ids=prefix, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    cache.batch_repeat_interleave(counts)  # [U, ...] -> [B, ...]
    return cache


def _stop_token_ids(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The tokens that end a response: the generation config's eos ids plus the tokenizer's eos."""
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids
