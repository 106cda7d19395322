"""The built-in domains' task generators (`domains/builtin.py` holds the table of them, the fact partition and the
loader; its docstring says what each task is, how it was sized for SmolLM2-135M-Instruct and why).

Each `make_<task>(rng)` draws one example from a seeded `random.Random`: (chat messages ending with the user turn,
gold answer, demonstration, the fact asked about). Variants that ask their original's questions under another answer
convention (arithmetic_hash, calc_hash / calc_says, mcq_text) share the original's draws (`_arithmetic_question`,
`_mcq_question`), so a seed asks the same facts in the same order.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable

Messages = list[dict[str, str]]
Made = tuple[Messages, object, str, object]  # (messages, gold answer, demonstration, fact asked about)

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
