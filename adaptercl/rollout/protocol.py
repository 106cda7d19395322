"""What every rollout engine implements and returns: the `RolloutEngine` protocol (generate under named adapters,
sync adapters, sleep and wake), `SamplingParams`, `Completion` (with `Completion.from_tokens` for vLLM samples),
and `RolloutServerError`, a rollout server that cannot be reached or fails, which the CLI prints as one line. The
engines themselves: `hf.py`, `vllm.py`, `vllm_server.py`; the run's choice of one: `engines.py`.
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
    # Fewest new tokens before a stop token may end a row (its stop tokens masked until then), as `generate`'s
    # `min_new_tokens`; None: the hf engine takes the model's generation_config (min_new_tokens, else min_length
    # less the prompt), as `generate` does (`decode.min_new_tokens`); the vLLM engines send it as `min_tokens`.
    min_new_tokens: int | None = None


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


ROW_SEED_STRIDE = 1_000_003  # a prime, far above the rows of any step and the steps of any stage
SEED_MODULUS = 2**63 - 1  # seeds stay non-negative int64 values (torch.manual_seed, vLLM's per-request generator)


def row_seed(seed: int, row: int) -> int:
    """The seed of row `row` of a call seeded `seed`: seed + row x 1,000,003 (row 0 keeps the call's seed).

    A stage's call seeds (`train.context.step_seed`) are consecutive integers below 2^31 - 1, one per step, so two
    (step, row) pairs share a seed only when their steps' seeds differ by a multiple of the stride: never within a
    stage of fewer than 477,206 steps (2^31 - 1 = 477,206 mod 1,000,003 bounds a wrap-around) with fewer than
    2^32 rows a step. The earlier vLLM derivation, seed + row, gave row r + 1 of step s the seed of row r of step
    s + 1 (adjacent steps reused all but one of their seeds).
    """
    return (seed + row * ROW_SEED_STRIDE) % SEED_MODULUS


def row_requests(prompts: list[list[int]], params: SamplingParams) -> list[tuple[list[int], int]]:
    """(prompt, seed) of every sampled row, prompt-major: sample j of prompt i is row `first_row` + i*n + j of the
    call, seeded `row_seed` of it. The vLLM engines send one request per row (n = 1), because a request of n samples
    would give sample j its seed + j (vLLM's parallel sampling), not its row's."""
    return [
        (list(p), row_seed(params.seed, params.first_row + i * params.n + j))
        for i, p in enumerate(prompts)
        for j in range(params.n)
    ]


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
