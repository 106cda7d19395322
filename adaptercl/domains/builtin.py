"""Built-in procedural domains (`source: builtin:NAME`): generated from the seed, no download, short answers. This
module holds the table of them (`BUILTINS`), the fact partition and the loader; the task generators are
`builtin_tasks.py`.

| name            | task                                         | answer format            | reward          |
|-----------------|----------------------------------------------|--------------------------|-----------------|
| arithmetic      | single-digit + - x, several phrasings        | `... The answer is N.`   | arithmetic      |
| arithmetic_hash | arithmetic's questions, GSM8K's answer line  | last line `#### N`       | arithmetic_hash |
| calc_hash       | arithmetic, both answer lines shown          | last line `#### N`       | arithmetic_hash |
| calc_says       | the same, other phrasings                    | `... The answer is N.`   | arithmetic      |
| mcq             | pick the member of a category (3 options)    | `<answer>X</answer>`     | mcq             |
| mcq_text        | mcq's questions, answered with the option    | `<answer>word</answer>`  | mcq_text        |
| toolcall        | JSON call of one of two listed functions     | `{"name", "arguments"}`  | json_call       |
| copy            | repeat a given word (for tiny random models) | the word                 | copy            |

Each example has a system prompt, a gold answer, and a demonstration (a correct reference response, so SDFT runs
on these too). The formats are distinct per domain, so format leakage between them is measurable. The two variants,
arithmetic_hash and mcq_text, ask their original's questions and facts (`FACT_PARTITION`) under another answer
convention, stated in the system prompt (and mcq_text's one-shot): a pair whose required outputs conflict on similar
inputs, where training one convention can overwrite the other (benchmarks/science, issue 37's sequence on which
GRPO forgets). Not measured on the 135M model when added; the science pilots (`benchmarks/science/pilot.py`) do.

Sized for the CPU quickstart (SmolLM2-135M-Instruct, GRPO, ~20-30 steps per domain): responses fit in 24 tokens
and the base model succeeds on some prompts but not most. Measured on SmolLM2-135M-Instruct (Q4_1 GGUF,
dequantised), seed 0, 50 eval prompts (drawn before the fact partition below), 24 new tokens; sampled = 4
samples of the first 16-24 prompts:

| domain     | greedy acc | greedy reward | greedy format | T=1.0 reward | T=0.7 reward | groups with spread (T=1) |
|------------|-----------:|--------------:|--------------:|-------------:|-------------:|-------------------------:|
| arithmetic |       0.14 |          0.19 |          0.44 |         0.11 |         0.15 |                     9/16 |
| mcq        |       0.26 |          0.34 |          1.00 |         0.24 |         0.39 |                    13/16 |
| toolcall   |       0.30 |          0.45 |          1.00 |         0.09 |         0.21 |                    11/16 |

How each was chosen:
- arithmetic: instructions in the system prompt are followed on some question templates ('a + b = ?', 'Add a and
  b.') and ignored on others ('What is a + b?'), so the format is learnable; the model is also more often right
  when it writes the equation before the answer, which is what the demonstrations do.
- mcq: instructions alone never made the 135M model use answer tags (0 of 100+ tries); a one-shot exchange (a
  worked question and its tagged answer, as chat turns) does. The 135M model then picks the last option nearly
  always, so its accuracy is near chance (3 options) and what GRPO can teach it here is little beyond the format
  under sampling; larger models learn the content.
- toolcall: without an example the model answers in prose or Python; a one-shot call of another listed function
  (get_population) fixes the shape, and the misses are copying the example's function or argument instead of
  switching to the one the request needs.

Train and eval are disjoint by fact, not only by phrasing. Each generator names the fact an example asks about:
arithmetic the operator and operands (unordered for + and x, so 3 + 4 and 4 + 3 are one fact), mcq the category and
its right word, toolcall the function and argument value, copy the word. A seeded hash puts each fact on one side
(`is_eval_fact`, a third of the facts on the eval side); eval examples are drawn only from eval facts and train
examples only from the others, each from its own seed stream, so sizes stay as configured and neither split depends
on the other's size. (Before this partition eval facts reached training: every mcq eval fact, and arithmetic ones
through commutativity.)
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable

from adaptercl.domains.builtin_tasks import (
    Made,
    make_arithmetic,
    make_arithmetic_hash,
    make_calc_hash,
    make_calc_says,
    make_copy,
    make_mcq,
    make_mcq_text,
    make_toolcall,
)
from adaptercl.domains.domain import Domain, Example
from adaptercl.domains.rewards import REWARDS
from adaptercl.recipe import DomainConfig, RecipeError

DEFAULT_NUM_TRAIN = 1000
EVAL_FACT_SHARE = 1 / 3  # of each builtin's facts, picked per seed, asked only in eval

# name -> (generator, reward name, format patterns)
BUILTINS: dict[str, tuple[Callable[[random.Random], Made], str, list[str]]] = {
    "arithmetic": (make_arithmetic, "arithmetic", [r"[Tt]he answer is"]),
    "arithmetic_hash": (make_arithmetic_hash, "arithmetic_hash", [r"####"]),
    "calc_hash": (make_calc_hash, "arithmetic_hash", [r"####"]),
    "calc_says": (make_calc_says, "arithmetic", [r"[Tt]he answer is"]),
    "mcq": (make_mcq, "mcq", [r"<answer>", r"</answer>"]),
    "mcq_text": (make_mcq_text, "mcq_text", [r"<answer>\s*[^<\s]{2,}"]),  # a word in the tags, not a letter
    "toolcall": (make_toolcall, "json_call", [r"\{\s*\"name\"\s*:", r"\"arguments\"\s*:"]),
    "copy": (make_copy, "copy", []),
}
# A variant asks its original's facts: the same fact partition (`is_eval_fact` keyed by the original's name), so a
# variant's training never asks the original's eval facts and the pair's eval sets ask the same facts.
FACT_PARTITION = {
    "arithmetic_hash": "arithmetic",
    "calc_hash": "arithmetic",
    "calc_says": "arithmetic",
    "mcq_text": "mcq",
}


def load_builtin(cfg: DomainConfig, seed: int, num_eval: int) -> Domain:
    """Generate `num_eval` eval examples from the eval facts and `num_train` train examples from the rest."""
    task = cfg.source.removeprefix("builtin:")
    if task not in BUILTINS:
        raise RecipeError(f"domains.{cfg.name}.source: unknown builtin {task!r}; builtins: {', '.join(BUILTINS)}")
    make, reward_name, patterns = BUILTINS[task]
    partition = FACT_PARTITION.get(task, task)
    splits = {}
    for split, count, on_eval_side in (("eval", num_eval, True), ("train", cfg.num_train or DEFAULT_NUM_TRAIN, False)):
        rng = random.Random(f"{seed}-{task}-{split}")
        splits[split] = _generate(
            make,
            rng,
            count,
            lambda fact, side=on_eval_side: is_eval_fact(seed, partition, fact) == side,
            cfg.name,
            split,
        )
        if len(splits[split]) < count:
            raise RecipeError(
                f"domains.{cfg.name}: builtin {task!r} made only {len(splits[split])} of {count} {split} examples "
                "(too few facts on that side of this seed's partition); try another seed"
            )
    return Domain(cfg.name, splits["train"], splits["eval"], REWARDS[reward_name], list(patterns))


def is_eval_fact(seed: int, task: str, fact: object) -> bool:
    """Whether `fact` is on the eval side of the seed's partition of `task`'s facts. A hash of the fact, not a draw,
    so a fact's side depends on neither the split sizes nor the order the generators meet facts in."""
    digest = hashlib.sha256(f"{seed}-{task}-{fact!r}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < EVAL_FACT_SHARE * 2**64


def _generate(
    make: Callable[[random.Random], Made],
    rng: random.Random,
    count: int,
    allowed: Callable[[object], bool],
    name: str,
    split: str,
) -> list[Example]:
    """Up to `count` examples whose fact is `allowed`; a prompt repeats within a split only once the distinct
    prompts run out (train of a small task)."""
    examples, seen_prompts = [], set()
    attempts = 0
    while len(examples) < count and attempts < 50 * count:
        attempts += 1
        messages, answer, demo, fact = make(rng)
        prompt = messages[-1]["content"]
        if not allowed(fact) or (prompt in seen_prompts and attempts < 20 * count):
            continue
        seen_prompts.add(prompt)
        examples.append(Example(f"{name}/{split}/{len(examples)}", messages, answer, demo))
    return examples
