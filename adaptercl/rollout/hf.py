"""The plain-transformers rollout engine: batched, seeded decoding on the training model itself.

It runs on the same PeftModel the trainer updates, so rollouts are exactly on-policy and adapter "sync" is free.
Prompts that begin alike (a group's samples, a few-shot example, the chat header) are prefilled with each shared
prefix computed once (`prefix_sharing`) where the model's cache reads that layout exactly (`cache_layers.
shared_prefix_limit`: not on linear-attention hybrids such as Qwen3.5, not across a sliding window's gap); otherwise
they are left-padded per batch, as for `generate`. Per-token logprobs (under
logits / temperature, cut to the top-p nucleus the rows were sampled from: `truncation.py`) are computed on request by
one no-grad teacher-forced forward (`response_logprobs`, also the reference the vLLM engines' logprobs are tested
against), because transformers' `output_logits` would keep a [batch, vocab] tensor per generated token. While
decoding, the active LoRA adapters are folded into float32 base weights (`folded_lora`) and, on CPU, the float32
linear weights are packed for oneDNN (`packed_weights`); logprobs are computed unfolded and unpacked.

With `dtype=torch.bfloat16` (`rollout.dtype`, CPUs with bf16 matrix units) sampled rollouts run on bf16 copies of
the linear weights, the LoRA folded in first in float32 (`fold_lora`; unfolded, its own A and B stay float32), so the
rows are drawn from a slightly different policy than the trainer's: each weight off by at most half a bf16 ulp of
W + ΔW, folded or not (folding rounds W + ΔW once instead of W alone; neither loses ΔW more than W's own low bits).
Each completion then carries the sampler's own logprobs (`decode`'s, under the distribution it drew from), which the
trainer's rollout-mismatch weights compare with its float32 ones, as for a vLLM engine. Greedy decoding (evaluation,
the diagnostics) stays float32: accuracy is the trained model's.

Decoding is `rollout/decode.py`'s loop, not `transformers.generate`: rows that stop leave the batch, and row j of
a call samples from its own generator seeded `rollout.row_seed(params.seed, params.first_row + j)`, so a row's
sample depends on its seed and prompt only, not on `batch_size`, the rows beside it or a data-parallel split. The
global RNG is left as it was.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import PreTrainedTokenizerBase

from adaptercl.adapters import active_adapters
from adaptercl.model import build_batch, output_cache, prefill, prefix_layout, response_logits, shared_prefix_limit
from adaptercl.rollout.decode import decode, min_new_tokens
from adaptercl.rollout.folded_lora import folded_lora, lora_factor_layers
from adaptercl.rollout.packed_weights import packed_linears
from adaptercl.rollout.protocol import Completion, SamplingParams, row_seed
from adaptercl.rollout.truncation import sampler_logprobs


class HFEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        batch_size: int = 64,
        fold_lora: bool = True,
        dtype: torch.dtype = torch.float32,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.fold_lora = fold_lora
        self.dtype = dtype  # the sampled rollouts' linear weights (module docstring); greedy decoding is float32
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
        reduced = self.dtype != torch.float32 and not params.greedy  # sampled on bf16 weights: its own logprobs
        try:
            with active_adapters(self.model, adapters):
                folded = folded_lora(self.model) if self.fold_lora else contextlib.nullcontext()
                if reduced:  # an unfolded LoRA's own A and B stay float32
                    packed = packed_linears(self.model, self.dtype, keep_float32=lora_factor_layers(self.model))
                else:
                    packed = packed_linears(self.model, use="decode")
                with folded, packed:
                    for start in range(0, len(expanded), self.batch_size):
                        first = params.first_row + start
                        seeds = [row_seed(params.seed, first + i) for i in range(self.batch_size)]
                        batch = expanded[start : start + self.batch_size]
                        out.extend(self._generate_batch(batch, params, seeds, own_logprobs=reduced))
                if params.logprobs and not reduced:
                    pad_id = self.tokenizer.pad_token_id
                    top_p = 1.0 if params.greedy else params.top_p  # what decode sampled from
                    for start in range(0, len(out), self.batch_size):
                        batch = out[start : start + self.batch_size]
                        logprobs = response_logprobs(self.model, batch, pad_id, params.temperature, top_p)
                        for c, lp in zip(batch, logprobs):
                            c.logprobs = lp
        finally:
            self.model.train(was_training)
        return [out[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    def _generate_batch(
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int], own_logprobs: bool = False
    ) -> list[Completion]:
        """One decode call; with `own_logprobs` each completion carries the sampler's logprobs of its tokens."""
        device = next(self.model.parameters()).device
        pad_id = self.tokenizer.pad_token_id
        input_ids, attention, cache = _prompt_inputs(self.model, prompts, pad_id, device, params.max_new_tokens)
        logprobs: list[list[float]] = []  # [B][tokens], filled by decode when own_logprobs
        responses = decode(
            self.model,
            input_ids,  # [B, W]
            attention,  # [B, W]
            cache,
            max_new_tokens=params.max_new_tokens,
            stop_ids=self.stop_ids,
            temperature=params.temperature,
            top_p=params.top_p,
            greedy=params.greedy,
            row_seeds=seeds[: len(prompts)],
            pad_id=pad_id,
            min_tokens=min_new_tokens(self.model.generation_config, params.min_new_tokens, [len(p) for p in prompts]),
            logprobs_out=logprobs if own_logprobs else None,
        )
        completions = []
        for i, (p, response) in enumerate(zip(prompts, responses)):
            stop_at = next((j for j, t in enumerate(response) if t in self.stop_ids), None)
            tokens = response if stop_at is None else response[: stop_at + 1]
            completions.append(
                Completion(
                    prompt_ids=list(p),
                    token_ids=tokens,
                    text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                    finish_reason="length" if stop_at is None else "stop",
                    logprobs=logprobs[i][: len(tokens)] if own_logprobs else None,
                )
            )
        return completions


@torch.no_grad()
def response_logprobs(
    model: torch.nn.Module, completions: list[Completion], pad_id: int, temperature: float, top_p: float = 1.0
) -> list[list[float]]:
    """Per-token logprobs of each completion's tokens as `generate` sampled them (teacher-forced, no grad): under
    logits / temperature, cut to the top_p nucleus and renormalised (`truncation.sampler_logprobs`; vLLM's
    `processed_logprobs`). At top_p 1 that is the full softmax, the trainer's definition."""
    batch = build_batch([c.prompt_ids for c in completions], [c.token_ids for c in completions], pad_id)
    batch = batch.to(next(model.parameters()).device)
    logits = response_logits(model, batch, temperature=temperature)  # [N, R, V]
    logp = sampler_logprobs(logits, batch.response_ids, top_p)  # [N, R]
    return [logp[i, : len(c.token_ids)].tolist() for i, c in enumerate(completions)]


def _prompt_inputs(
    model: torch.nn.Module, prompts: list[list[int]], pad_id: int, device: torch.device, max_new_tokens: int = 0
) -> tuple[torch.Tensor, torch.Tensor, object | None]:
    """`generate`'s input ids, attention mask and starting cache for a batch of prompts.

    When rows share prompt prefixes (a group's n samples, a few-shot example, the chat header), that computes
    fewer tokens and the model's cache reads the layout exactly for the prompt and `max_new_tokens` more positions
    (`cache_layers.shared_prefix_limit`), the prompts are laid out by `prefix_sharing` (each row's own tokens after a
    masked gap) and every prompt token but the last is prefilled, each prefix once; `decode` then continues from that
    cache, and the mask's holes give every row its own positions. Otherwise: left-padded prompts, no cache (each row
    prefilled from its own tokens alone, by `decode`'s first forward).
    """
    limit = shared_prefix_limit(model)
    layout = prefix_layout(prompts, -1, pad_id, device, limit=limit, after=max_new_tokens)
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
