"""Built-in procedural domains (`source: builtin:NAME`): generated from the seed, no download, short answers.

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
import json
import random
from collections.abc import Callable

from adaptercl.domains.domain import Domain, Example
from adaptercl.domains.rewards import REWARDS
from adaptercl.recipe import DomainConfig, RecipeError

Messages = list[dict[str, str]]
Made = tuple[Messages, object, str, object]  # (messages, gold answer, demonstration, fact asked about)
DEFAULT_NUM_TRAIN = 1000
EVAL_FACT_SHARE = 1 / 3  # of each builtin's facts, picked per seed, asked only in eval

# ---------------------------------------------------------------------------------------------------- arithmetic

ARITHMETIC_SYSTEM = "You are a calculator. Finish your reply with 'The answer is N.' where N is the result."
ARITHMETIC_TEMPLATES = {
    "+": ["What is {a} + {b}?", "Add {a} and {b}.", "{a} + {b} = ?", "Compute {a} + {b}.", "What is {a} plus {b}?"],
    "-": [
        "What is {a} - {b}?",
        "Subtract {b} from {a}.",
        "{a} - {b} = ?",
        "Compute {a} - {b}.",
        "What is {a} minus {b}?",
    ],
    "*": [
        "What is {a} * {b}?",
        "Multiply {a} and {b}.",
        "{a} * {b} = ?",
        "Compute {a} * {b}.",
        "What is {a} times {b}?",
    ],
}


def _arithmetic_question(rng: random.Random, templates: dict[str, list[str]] = ARITHMETIC_TEMPLATES) -> tuple:
    """(operator, a, b, value, question, fact): the draws arithmetic and its variants share, in this order; the
    question's phrasing from `templates` (operator -> phrasings)."""
    op = rng.choice("+-*")
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    if op == "-" and b > a:
        a, b = b, a
    if op == "*":
        a = rng.randint(2, 5)
    value = a + b if op == "+" else a - b if op == "-" else a * b
    question = rng.choice(templates[op]).format(a=a, b=b)
    fact = (op, a, b) if op == "-" else (op, min(a, b), max(a, b))  # + and x commute: one fact per operand pair
    return op, a, b, value, question, fact


def make_arithmetic(rng: random.Random) -> Made:
    op, a, b, value, question, fact = _arithmetic_question(rng)
    messages = [{"role": "system", "content": ARITHMETIC_SYSTEM}, {"role": "user", "content": question}]
    return messages, str(value), f"{a} {op} {b} = {value}. The answer is {value}.", fact


# The same questions and facts as arithmetic with GSM8K's answer line instead of "The answer is N.": the pair
# conflicts on similar inputs (issue 37), so training one convention can overwrite the other. The instruction alone
# gave 0 of 100 eval answers in that format (science pilots, README "Issue 37: pilots"), so a one-shot exchange shows
# it, as mcq's does; its operands lie outside the generator's (1-9), so it asks no train or eval fact.
ARITHMETIC_HASH_SYSTEM = "You are a calculator. End your reply with a last line '#### N' where N is the result."
ARITHMETIC_HASH_SHOT = [
    {"role": "user", "content": "What is 12 + 15?"},
    {"role": "assistant", "content": "12 + 15 = 27.\n#### 27"},
]


def make_arithmetic_hash(rng: random.Random) -> Made:
    op, a, b, value, question, fact = _arithmetic_question(rng)
    messages = [
        {"role": "system", "content": ARITHMETIC_HASH_SYSTEM},
        *ARITHMETIC_HASH_SHOT,
        {"role": "user", "content": question},
    ]
    return messages, str(value), f"{a} {op} {b} = {value}.\n#### {value}", fact


# A pair on similar inputs whose prompts do not say which answer line is wanted: the same neutral system prompt and
# a two-shot exchange that shows both (GSM8K's `#### N`, then "The answer is N."), so the base model writes each in
# about 30 % of its samples (SmolLM2-135M-Instruct, T 1, 160 samples). Only the reward says which one counts:
# calc_hash's `#### N` (arithmetic_hash's reward), calc_says's "The answer is N." (arithmetic's). The two ask the
# same facts in different phrasings (CALC_TEMPLATES), so a policy can keep both conventions apart by the question's
# wording, and one that learns the second convention everywhere forgets the first (issue 37: a sequence on which
# GRPO forgets; the science pilots, README "Issue 37: pilots"). The shots' operands lie outside the generator's.
CALC_SYSTEM = "You are a calculator."
CALC_SHOTS = [
    *ARITHMETIC_HASH_SHOT,
    {"role": "user", "content": "What is 14 + 11?"},
    {"role": "assistant", "content": "14 + 11 = 25. The answer is 25."},
]
# calc_hash: "What is a + b?", "Compute a + b.", "Calculate a + b."; calc_says: arithmetic's other three phrasings
CALC_TEMPLATES = {
    "calc_hash": {op: [t[0], t[3], f"Calculate {{a}} {op} {{b}}."] for op, t in ARITHMETIC_TEMPLATES.items()},
    "calc_says": {op: [t[1], t[2], t[4]] for op, t in ARITHMETIC_TEMPLATES.items()},
}


def _make_calc(name: str, answer_line: str) -> Callable[[random.Random], Made]:
    def make(rng: random.Random) -> Made:
        op, a, b, value, question, fact = _arithmetic_question(rng, CALC_TEMPLATES[name])
        messages = [{"role": "system", "content": CALC_SYSTEM}, *CALC_SHOTS, {"role": "user", "content": question}]
        return messages, str(value), f"{a} {op} {b} = {value}." + answer_line.format(value), fact

    return make


make_calc_hash = _make_calc("calc_hash", "\n#### {}")
make_calc_says = _make_calc("calc_says", " The answer is {}.")


# ---------------------------------------------------------------------------------------------------- mcq

MCQ_SYSTEM = "Answer the multiple-choice question with the letter of the correct option inside answer tags."
CATEGORIES = {
    "an animal": ["dog", "cat", "horse", "cow", "lion", "tiger", "rabbit", "mouse", "bear", "sheep", "goat", "fox"],
    "a color": ["red", "blue", "green", "yellow", "black", "white", "pink", "brown", "purple", "grey", "violet"],
    "a fruit": ["apple", "banana", "cherry", "grape", "lemon", "mango", "pear", "melon", "papaya", "fig"],
    "a tool": [
        "hammer",
        "saw",
        "drill",
        "wrench",
        "shovel",
        "rake",
        "chisel",
        "pliers",
        "ladder",
        "axe",
        "screwdriver",
    ],
    "a country": ["France", "Japan", "Brazil", "Canada", "Egypt", "India", "Italy", "Mexico", "Spain", "Kenya"],
    "a vehicle": ["car", "bus", "truck", "bicycle", "train", "boat", "plane", "tram", "scooter", "van", "taxi"],
    "a body part": ["hand", "foot", "nose", "ear", "elbow", "knee", "shoulder", "finger", "ankle", "chin", "neck"],
}
MCQ_OPTIONS = 3
MCQ_SHOT = [
    {"role": "user", "content": "Which of these is a planet?\nA. chair\nB. Mars\nC. violin"},
    {"role": "assistant", "content": "<answer>B</answer>"},
]


def _mcq_question(rng: random.Random) -> tuple[str, str, list[str], str]:
    """(category, right word, options in order, question): the draws mcq and mcq_text share, in this order."""
    category = rng.choice(sorted(CATEGORIES))
    right = rng.choice(CATEGORIES[category])
    others = [rng.choice(CATEGORIES[c]) for c in rng.sample(sorted(set(CATEGORIES) - {category}), MCQ_OPTIONS - 1)]
    options = [right, *others]
    rng.shuffle(options)
    question = f"Which of these is {category}?\n" + "\n".join(f"{L}. {o}" for L, o in zip("ABCD", options))
    return category, right, options, question


def make_mcq(rng: random.Random) -> Made:
    category, right, options, question = _mcq_question(rng)
    letter = "ABCD"[options.index(right)]
    messages = [{"role": "system", "content": MCQ_SYSTEM}, *MCQ_SHOT, {"role": "user", "content": question}]
    return messages, letter, f"<answer>{letter}</answer>", (category, right)


# The same questions and facts as mcq, answered with the option's text instead of its letter (the one-shot too): the
# pair conflicts on similar inputs (issue 37), so training one convention can overwrite the other.
MCQ_TEXT_SYSTEM = "Answer the multiple-choice question with the text of the correct option inside answer tags."
MCQ_TEXT_SHOT = [MCQ_SHOT[0], {"role": "assistant", "content": "<answer>Mars</answer>"}]


def make_mcq_text(rng: random.Random) -> Made:
    category, right, _, question = _mcq_question(rng)
    messages = [{"role": "system", "content": MCQ_TEXT_SYSTEM}, *MCQ_TEXT_SHOT, {"role": "user", "content": question}]
    return messages, right, f"<answer>{right}</answer>", (category, right)


# ---------------------------------------------------------------------------------------------------- toolcall

TOOLCALL_SYSTEM = (
    'You can call these functions:\n{specs}\nReply with only a JSON object {{"name": ..., "arguments": {{...}}}}.'
)
# The one-shot exchange calls a function that is listed in every prompt but never the answer: the model has to
# switch to the function the request needs and fill in its argument instead of copying the example.
EXAMPLE_FUNCTION = {
    "name": "get_population",
    "description": "the population of a country",
    "parameters": {"country": "string"},
}
TOOLCALL_SHOT = [
    {"role": "user", "content": "How many people live in Peru?"},
    {"role": "assistant", "content": '{"name": "get_population", "arguments": {"country": "Peru"}}'},
]
CITIES = ["Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Cairo", "Lima", "Oslo", "Sydney", "Boston", "Delhi"]
PEOPLE = ["Anna", "Ben", "Carla", "David", "Emma", "Frank", "Grace", "Hugo", "Iris", "Jack", "Lena", "Omar"]
ITEMS = ["milk", "bread", "eggs", "rice", "coffee", "apples", "butter", "cheese", "pasta", "tea", "honey", "salt"]
SONGS = ["Yesterday", "Imagine", "Hello", "Thriller", "Halo", "Believer", "Roar", "Happy", "Faded", "Perfect"]
# (function, argument, description, values, request templates)
FUNCTIONS = [
    (
        "get_weather",
        "city",
        "the current weather in a city",
        CITIES,
        [
            "What's the weather in {v}?",
            "Is it raining in {v}?",
            "How warm is it in {v} today?",
            "Weather report for {v}.",
        ],
    ),
    (
        "get_time",
        "city",
        "the local time in a city",
        CITIES,
        [
            "What time is it in {v}?",
            "Tell me the time in {v}.",
            "What's the local time in {v}?",
            "Current time in {v}?",
        ],
    ),
    (
        "call_contact",
        "name",
        "phone a contact",
        PEOPLE,
        ["Call {v}.", "Please phone {v} for me.", "Ring {v}.", "Can you call {v} now?"],
    ),
    (
        "add_to_list",
        "item",
        "add an item to the shopping list",
        ITEMS,
        ["Add {v} to my list.", "I need {v}.", "Put {v} on the shopping list.", "We are out of {v}."],
    ),
    (
        "play_song",
        "title",
        "play a song by its title",
        SONGS,
        ["Play {v}.", "Put on the song {v}, please.", "I want to hear {v}.", "Start playing {v}."],
    ),
    (
        "set_timer",
        "minutes",
        "start a timer",
        list(range(1, 61)),
        [
            "Set a timer for {v} minutes.",
            "Timer, {v} minutes.",
            "Remind me in {v} minutes.",
            "Count down {v} minutes.",
        ],
    ),
]


def make_toolcall(rng: random.Random) -> Made:
    name, arg, doc, values, templates = rng.choice(FUNCTIONS)
    value = rng.choice(values)
    kind = "integer" if isinstance(value, int) else "string"
    specs = [EXAMPLE_FUNCTION, {"name": name, "description": doc, "parameters": {arg: kind}}]
    system = TOOLCALL_SYSTEM.format(specs="\n".join(json.dumps(spec) for spec in specs))
    call = {"name": name, "arguments": {arg: value}}
    request = rng.choice(templates).format(v=value)
    messages = [{"role": "system", "content": system}, *TOOLCALL_SHOT, {"role": "user", "content": request}]
    return messages, call, json.dumps(call), (name, value)


# ---------------------------------------------------------------------------------------------------- copy

COPY_TEMPLATES = ["Repeat the word: {w}", "Say {w}.", "Write the word {w}."]


def make_copy(rng: random.Random) -> Made:
    word = "".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(2, 3)))
    messages = [
        {"role": "system", "content": "Reply with the requested word only."},
        {"role": "user", "content": rng.choice(COPY_TEMPLATES).format(w=word)},
    ]
    return messages, word, word, word


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
