"""The plain-transformers rollout engine: batched, seeded `generate` on the training model itself.

It runs on the same PeftModel the trainer updates, so rollouts are exactly on-policy and adapter "sync" is free.
Prompts that begin alike (a group's samples, a few-shot example, the chat header) are prefilled with each shared
prefix computed once (`prefix_sharing`); otherwise they are left-padded per batch. Per-token logprobs (under
logits / temperature, the trainer's definition) are computed on request by one no-grad teacher-forced forward
(`response_logprobs`, also the reference the vLLM engines' logprobs are tested against), because transformers'
`output_logits` would keep a [batch, vocab] tensor per generated token. While decoding, the active LoRA adapters
are folded into float32 base weights (`folded_lora`); logprobs are computed unfolded.

Seeding: each generate batch of `batch_size` rows is seeded with the seed of its first row (`rollout.row_seed` of
`params.seed` and the global row index `params.first_row` + offset), so a data-parallel rank whose share is a whole
number of batches samples exactly the rows one process would (transformers' sampling draws from one global RNG for
the whole batch).
"""

from __future__ import annotations

import contextlib

import torch
from transformers import PreTrainedTokenizerBase

from adaptercl.adapters import active_adapters
from adaptercl.model import CACHE, build_batch, output_cache, prefill, prefix_layout, response_logits
from adaptercl.rollout.folded_lora import folded_lora
from adaptercl.rollout.protocol import Completion, SamplingParams, row_seed


class HFEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        batch_size: int = 64,
        fold_lora: bool = True,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.fold_lora = fold_lora
        self.stop_ids = stop_token_ids(model, tokenizer)

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
        try:
            with active_adapters(self.model, adapters):
                with folded_lora(self.model) if self.fold_lora else contextlib.nullcontext():
                    for start in range(0, len(expanded), self.batch_size):
                        torch.manual_seed(row_seed(params.seed, params.first_row + start))
                        out.extend(self._generate_batch(expanded[start : start + self.batch_size], params))
                if params.logprobs:
                    pad_id = self.tokenizer.pad_token_id
                    for start in range(0, len(out), self.batch_size):
                        batch = out[start : start + self.batch_size]
                        for c, lp in zip(batch, response_logprobs(self.model, batch, pad_id, params.temperature)):
                            c.logprobs = lp
        finally:
            torch.random.set_rng_state(generator_state)
            self.model.train(was_training)
        return [out[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        device = next(self.model.parameters()).device
        pad_id = self.tokenizer.pad_token_id
        input_ids, attention, cache = _prompt_inputs(self.model, prompts, pad_id, device)  # [B, W], [B, W]
        width = input_ids.shape[1]
        sampling = (
            {"do_sample": False}
            if params.greedy
            else {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": 0}
        )
        sequences = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=self.stop_ids,
            pad_token_id=pad_id,
            repetition_penalty=1.0,  # the trainer's distribution is logits / temperature, nothing else
            **sampling,
            **{CACHE: cache},
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
        return completions


@torch.no_grad()
def response_logprobs(
    model: torch.nn.Module, completions: list[Completion], pad_id: int, temperature: float
) -> list[list[float]]:
    """Per-token logprobs of each completion's tokens under logits / temperature (teacher-forced, no grad)."""
    batch = build_batch([c.prompt_ids for c in completions], [c.token_ids for c in completions], pad_id)
    batch = batch.to(next(model.parameters()).device)
    logits = response_logits(model, batch, temperature=temperature)  # [N, R, V]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)  # [N, R]
    return [logp[i, : len(c.token_ids)].tolist() for i, c in enumerate(completions)]


def _prompt_inputs(
    model: torch.nn.Module, prompts: list[list[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, object | None]:
    """`generate`'s input ids, attention mask and starting cache for a batch of prompts.

    When rows share prompt prefixes (a group's n samples, a few-shot example, the chat header) and that computes
    fewer tokens, the prompts are laid out by `prefix_sharing` (each row's own tokens after a masked gap) and every
    prompt token but the last is prefilled, each prefix once; `generate` then decodes from that cache, and the
    mask's holes give every row its own positions. Otherwise: left-padded prompts, no cache.
    """
    layout = prefix_layout(prompts, -1, pad_id, device)
    if layout is not None:
        with torch.no_grad():
            out = prefill(model, layout, layout.own_ids[:, :-1], layout.own_mask[:, :-1], logits_to_keep=1)
        return layout.prompt_ids(), layout.prompt_mask(), output_cache(out)  # [B, C+S], [B, C+S], cache
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, P] left-padded
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        attention[i, width - len(p) :] = 1
    return input_ids.to(device), attention.to(device), None


def stop_token_ids(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The tokens that end a response: the generation config's eos ids plus the tokenizer's eos."""
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids
