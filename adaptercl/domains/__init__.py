"""Domains: examples (chat prompts + gold answers + optional demonstrations) and a verifiable reward.

Interim minimal implementation with the agreed interface (builtin arithmetic / mcq / toolcall); the full domain
layer (real dataset formats, generic loader, data hygiene) replaces it.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from adaptercl.config import DomainConfig, RecipeError


@dataclass(frozen=True)
class Example:
    id: str
    messages: list[dict[str, str]]
    answer: Any
    demonstration: str | None = None


@dataclass(frozen=True)
class RewardResult:
    score: float
    correct: bool
    feedback: str | None = None


RewardFn = Callable[[str, Example], RewardResult]


@dataclass
class Domain:
    name: str
    train: list[Example]
    eval: list[Example]
    reward: RewardFn
    format_patterns: list[str] = field(default_factory=list)
    skipped: int = 0
    overlap: int = 0


def _arithmetic(rng: random.Random, i: int) -> Example:
    a, b = rng.randint(2, 30), rng.randint(2, 30)
    op = rng.choice("+-")
    value = a + b if op == "+" else a - b
    msgs = [
        {"role": "system", "content": "Solve the problem. End with a line 'Answer: N'."},
        {"role": "user", "content": f"What is {a} {op} {b}?"},
    ]
    return Example(f"arith-{i}", msgs, str(value), f"{a} {op} {b} = {value}\nAnswer: {value}")


def _arithmetic_reward(text: str, ex: Example) -> RewardResult:
    found = re.findall(r"Answer:\s*(-?\d+)", text)
    if not found:
        return RewardResult(0.0, False, "The response has no line 'Answer: N'.")
    if found[-1] == ex.answer:
        return RewardResult(1.0, True)
    return RewardResult(0.2, False, f"The answer {found[-1]} is wrong.")


def _mcq(rng: random.Random, i: int) -> Example:
    nums = rng.sample(range(1, 100), 4)
    letter = "ABCD"[nums.index(max(nums))]
    options = "\n".join(f"{L}. {n}" for L, n in zip("ABCD", nums))
    msgs = [
        {"role": "system", "content": "Answer with the letter of the correct option inside <answer></answer> tags."},
        {"role": "user", "content": f"Which number is the largest?\n{options}"},
    ]
    return Example(f"mcq-{i}", msgs, letter, f"<answer>{letter}</answer>")


def _mcq_reward(text: str, ex: Example) -> RewardResult:
    found = re.findall(r"<answer>\s*([A-D])\s*</answer>", text)
    if not found:
        return RewardResult(0.0, False, "Put the letter inside <answer></answer> tags.")
    if found[-1] == ex.answer:
        return RewardResult(1.0, True)
    return RewardResult(0.2, False, f"Option {found[-1]} is not correct.")


def _toolcall(rng: random.Random, i: int) -> Example:
    city = rng.choice(["Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo"])
    unit = rng.choice(["celsius", "fahrenheit"])
    spec = '{"name": "get_weather", "parameters": {"city": "string", "unit": "celsius|fahrenheit"}}'
    msgs = [
        {"role": "system", "content": f"Call the tool by replying with one JSON object. Tool: {spec}"},
        {"role": "user", "content": f"What is the weather in {city} in {unit}?"},
    ]
    call = {"name": "get_weather", "arguments": {"city": city, "unit": unit}}
    return Example(f"tool-{i}", msgs, call, json.dumps(call))


def _toolcall_reward(text: str, ex: Example) -> RewardResult:
    match = re.search(r"\{.*\}", text, re.S)
    try:
        call = json.loads(match.group(0)) if match else None
    except json.JSONDecodeError:
        call = None
    if not isinstance(call, dict):
        return RewardResult(0.0, False, "The response is not a JSON object.")
    if call == ex.answer:
        return RewardResult(1.0, True)
    return RewardResult(0.2, False, f"Expected {json.dumps(ex.answer)}.")


BUILTINS = {
    "arithmetic": (_arithmetic, _arithmetic_reward, [r"Answer:"]),
    "mcq": (_mcq, _mcq_reward, [r"<answer>"]),
    "toolcall": (_toolcall, _toolcall_reward, [r"\{\s*\"name\""]),
}


def load_domain(cfg: DomainConfig, seed: int, num_eval: int) -> Domain:
    if not cfg.source.startswith("builtin:") or cfg.source[8:] not in BUILTINS:
        raise RecipeError(f"domains.{cfg.name}.source: {cfg.source!r} is not available; builtins: {', '.join(BUILTINS)}")
    make, reward, patterns = BUILTINS[cfg.source[8:]]
    if cfg.reward:
        import importlib

        module, _, fn = cfg.reward.partition(":")
        reward = getattr(importlib.import_module(module), fn)
    rng = random.Random(seed)
    examples, seen = [], set()
    while len(examples) < num_eval + (cfg.num_train or 500):
        ex = make(rng, len(examples))
        key = ex.messages[-1]["content"]
        if key not in seen:
            seen.add(key)
            examples.append(ex)
        if len(seen) > 5000:
            break
    return Domain(cfg.name, examples[num_eval:], examples[:num_eval], reward, patterns)
