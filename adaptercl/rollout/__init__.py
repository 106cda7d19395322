"""Rollout engines: prompts + adapters + sampling parameters -> completions with token ids and logprobs.

Three engines implement `RolloutEngine`: `hf` (plain transformers `generate` on the training model itself, the
CPU reference and always exactly on-policy), `vllm` (multi-LoRA serving in this process; `adaptercl.rollout.vllm`)
and `vllm_server` (a running vLLM OpenAI-compatible server on other GPUs or hosts; `adaptercl.rollout.vllm_server`).
`adaptercl.run.Engines` builds the recipe's one. A server that cannot be reached or fails is a
`RolloutServerError`, which the CLI prints as one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1  # completions per prompt
    greedy: bool = False  # argmax decoding (temperature/top_p ignored)
    seed: int = 0
    logprobs: bool = False  # also return per-token logprobs of the sampled tokens under logits / temperature
    # Index of this call's first row (prompt x n) among the step's rows: a data-parallel rank rolling out its share
    # passes its offset, so the seeds a row is sampled with do not depend on how the rows are split over ranks.
    first_row: int = 0


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]  # response tokens, including the stop token when generation stopped on it
    text: str  # decoded response without special tokens
    finish_reason: str  # "stop" or "length"
    logprobs: list[float] | None = field(default=None)  # one per token_ids entry, when asked for

    @classmethod
    def from_tokens(
        cls, prompt: list[int], tokens: list[int], tokenizer: Any, stop_ids: list[int], logprobs: list[float] | None
    ) -> Completion:
        """A vLLM sample (in process or from a server): decoded text, and "stop" when its last token is a stop id."""
        return cls(
            prompt_ids=list(prompt),
            token_ids=tokens,
            text=tokenizer.decode(tokens, skip_special_tokens=True),
            finish_reason="stop" if tokens and tokens[-1] in stop_ids else "length",
            logprobs=logprobs,
        )


class RolloutServerError(RuntimeError):
    """The rollout server is unreachable, failed or refused a request: one line saying which and what to do."""


class RolloutEngine(Protocol):
    def generate(
        self, prompts: list[list[int]], adapters: list[str] | None, params: SamplingParams
    ) -> list[list[Completion]]:
        """`params.n` completions for each prompt under the named adapters (None or [] = the base model)."""
        ...

    def sync_adapters(self, names: list[str]) -> None:
        """Make the current weights of these adapters visible to the engine (no-op for in-process engines)."""
        ...

    def sleep(self) -> None:
        """Free accelerator memory during the optimiser step (no-op where unsupported)."""
        ...

    def wake(self) -> None:
        """Undo `sleep`; `generate` wakes the engine itself."""
        ...
