"""Verifiable rewards: `(completion text, Example) -> RewardResult`, the `REWARDS` table, and `resolve_reward`.

Every reward takes any string (garbage from a random model included) and never raises. `score` drives the
advantages, `correct` is exact task success (accuracy), `feedback` says what was wrong (SDPO's teacher sees it when
no sibling succeeded) and is None when the answer is correct; `reveals_correctness` marks feedback that says more
than a format problem ("The final answer 4 is incorrect.", the expected call). Every builtin reward writes feedback
for every wrong answer; which of it the teacher sees is the domain's `feedback` choice, applied in one place by
`with_feedback` (docs/design.md §4: feedback on every wrong answer turns every failure into a teacher target, so
it is an opt-in, `feedback: correctness`). What a reply answered (its number, boxed LaTeX, option letter or tool
calls) is read by `answers.py`; this module decides score, success and feedback.

| name            | used by                      | checks                                                          |
|-----------------|------------------------------|-----------------------------------------------------------------|
| final_number    | gsm8k                        | `#### N`, else `Answer: N`/`The answer is N`, else last number  |
| boxed_math      | math500                      | last `\\boxed{...}` equivalent to the gold (see `math_equal`)   |
| answer_tag      | sciknoweval                  | letter in the last `<answer>...</answer>` (SDPO's mcq.py)       |
| action_calls    | tooluse (ToolAlpaca)         | `Action:` names and merged `Action Input:` JSON equal the gold  |
| choice_letter   | arc, boolq, piqa, winogrande | the option letter the reply states (`extract_choice_letter`)    |
| arithmetic      | builtin:arithmetic           | `The answer is N.`; 0.2 for the format alone                    |
| arithmetic_hash | builtin:arithmetic_hash      | `#### N`; 0.2 for the format alone                              |
| mcq             | builtin:mcq                  | `<answer>X</answer>`; 0.2 for the format alone                  |
| mcq_text        | builtin:mcq_text             | `<answer>word</answer>`; 0.2 for the tags alone                 |
| json_call       | builtin:toolcall             | one JSON `{"name", "arguments"}`; up to 0.4 partial credit      |
| copy            | builtin:copy                 | the reply starts with the gold word; 0.2 if it contains it      |

Partial credit always stays below 0.5, the SDPO success threshold, so a well-formatted wrong answer is never
shown to the teacher as a correct solution. The real-dataset rewards are 0/1, as in the reference code.

Departures from the references, on purpose: `answer_tag` and `action_calls` follow lasgroup/SDPO's
`reward_score/feedback/{mcq,tooluse}.py` (the ToolAlpaca check is also the SDFT evaluation's) but `answer_tag`
adds format feedback (the reference gives none; the sciknoweval format's default `feedback: none` drops it). No
reward gives the reference's truncation feedback: a reward sees only the text. `boxed_math` reads the last
`\\boxed{}` and compares it with the gold by normalised strings and exact fractions, then by `math-verify` (as the
SDPO code does; sets, intervals and LaTeX forms: `answers.math_equal`).

A user reward is `pkg.module:function` with the same signature; `resolve_reward` imports it (the one dynamic
import of the toolkit) from the domain's `import_dirs` (the recipe file's folder, then the working directory), then
Python's path: the console script's sys.path holds neither, and a user of scripts expects a module beside the recipe
to import. Those folders are on sys.path only while the module imports; the module stays in Python's module cache,
as any import does. Rewards with TRL's batched signature are handled by `trl_rewards.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from adaptercl.domains.answers import (
    ANSWER_PHRASE_RE,
    HASH_ANSWER_RE,
    count_lettered_options,
    extract_action_inputs,
    extract_actions,
    extract_answer_tag,
    extract_choice_letter,
    extract_final_number,
    first_json_object,
    last_boxed,
    math_equal,
    numbers_equal,
    parse_gold_actions,
)
from adaptercl.domains.domain import Example, RewardFn, RewardResult
from adaptercl.recipe import FeedbackKind, RecipeError

FORMAT_CREDIT = 0.2  # builtin domains: reward for the right answer format with a wrong answer

# ---------------------------------------------------------------------------------------------------- numbers


def final_number(text: str, example: Example) -> RewardResult:
    """GSM8K: the final number equals the gold (`#### N` of the dataset); 1,000 == 1000 and 5.0 == 5."""
    pred = extract_final_number(text)
    if pred is None:
        return RewardResult(0.0, False, "The response has no final numeric answer. End with a line '#### <number>'.")
    if numbers_equal(pred, example.answer):
        return RewardResult(1.0, True)
    return RewardResult(0.0, False, f"The final answer {pred} is incorrect.", reveals_correctness=True)


# ---------------------------------------------------------------------------------------------------- boxed math

# lasgroup/SDPO reward_score/feedback/math.py, word for word.
BOXED_FORMAT_FEEDBACK = (
    "Your answer had the wrong format. The solution must be given in the format: \\boxed{your_answer}."
)


def boxed_math(text: str, example: Example) -> RewardResult:
    """MATH-500: the last `\\boxed{}` of the response equals the gold answer up to simple equivalences."""
    pred = last_boxed(text)
    if pred is None or not pred.strip():
        return RewardResult(0.0, False, BOXED_FORMAT_FEEDBACK)
    if math_equal(pred, str(example.answer)):
        return RewardResult(1.0, True)
    return RewardResult(0.0, False, f"The final answer {pred.strip()} is incorrect.", reveals_correctness=True)


# ---------------------------------------------------------------------------------------------------- letters


def answer_tag(text: str, example: Example) -> RewardResult:
    """SciKnowEval MCQ: the letter inside the last `<answer></answer>` equals the gold letter."""
    pred = extract_answer_tag(text)
    if pred == str(example.answer).strip().upper():
        return RewardResult(1.0, True)
    if not re.fullmatch(r"[A-Z]", pred):
        return RewardResult(0.0, False, "Give only the option letter inside answer tags, e.g. <answer>\nA\n</answer>.")
    return RewardResult(0.0, False, f"Option {pred} is incorrect.", reveals_correctness=True)


def choice_letter(text: str, example: Example) -> RewardResult:
    """Retention probes (ARC, BoolQ, PIQA, Winogrande): the chosen option letter equals the gold letter.

    Only the letters of the options the prompt lists (`A. ...`, `B. ...`) count as a choice, when it lists them.
    """
    pred = extract_choice_letter(text, count_lettered_options(example.messages[-1]["content"]))
    if pred is None:
        return RewardResult(0.0, False, "State the letter of the correct option.")
    if pred == str(example.answer).strip().upper():
        return RewardResult(1.0, True)
    return RewardResult(0.0, False, f"Option {pred} is incorrect.", reveals_correctness=True)


# ---------------------------------------------------------------------------------------------------- tool use


def action_calls(text: str, example: Example) -> RewardResult:
    """ToolAlpaca: the multiset of `Action:` names and the merged `Action Input:` JSON both equal the gold's."""
    gold_actions, gold_inputs = parse_gold_actions(example.answer)
    pred_actions, pred_inputs = extract_actions(text), extract_action_inputs(text)
    problems = []
    if Counter(pred_actions) != Counter(gold_actions):
        problems.append(f"Actions mismatch: predicted {pred_actions}, expected {gold_actions}")
    if pred_inputs != gold_inputs:
        problems.append(f"Action inputs mismatch: predicted {pred_inputs}, expected {gold_inputs}")
    if not problems:
        return RewardResult(1.0, True)
    return RewardResult(0.0, False, "; ".join(problems), reveals_correctness=True)  # the reference's strings


def _same_value(pred: Any, gold: Any) -> bool:
    """Argument values match up to case and surrounding space of strings and 3 == 3.0 == "3"."""
    if numbers_equal(pred, gold):
        return True
    if isinstance(pred, dict | list) or isinstance(gold, dict | list):
        return pred == gold
    return str(pred).strip().lower() == str(gold).strip().lower()


def json_call(text: str, example: Example) -> RewardResult:
    """builtin:toolcall: a JSON object {"name": ..., "arguments": {...}} equal to the gold call.

    Partial credit (< 0.5): 0.2 for a well-formed call, +0.1 for the right function, +0.1 x share of right arguments.
    """
    gold = example.answer
    call = first_json_object(text)
    if call is None or not isinstance(call.get("name"), str) or not isinstance(call.get("arguments"), dict):
        return RewardResult(
            0.0, False, 'Reply with one JSON object of the form {"name": <function>, "arguments": {...}}.'
        )
    args, gold_args = call["arguments"], gold["arguments"]
    name_ok = call["name"].strip() == gold["name"]
    right = [k for k, v in gold_args.items() if k in args and _same_value(args[k], v)]
    extra = [k for k in args if k not in gold_args]
    if name_ok and len(right) == len(gold_args) and not extra:
        return RewardResult(1.0, True)
    problems = []
    if not name_ok:
        problems.append(f"called {call['name']!r}, expected {gold['name']!r}")
    for key, value in gold_args.items():
        if key not in args:
            problems.append(f"missing argument {key!r} (expected {json.dumps(value)})")
        elif key not in right:
            problems.append(f"argument {key!r} is {json.dumps(args[key])}, expected {json.dumps(value)}")
    problems += [f"unexpected argument {k!r}" for k in extra]
    score = FORMAT_CREDIT + 0.1 * name_ok + 0.1 * len(right) / max(1, len(gold_args))
    feedback = "Wrong tool call: " + "; ".join(problems) + "."
    return RewardResult(round(score, 4), False, feedback, reveals_correctness=True)


# ---------------------------------------------------------------------------------------------------- builtins


def arithmetic(text: str, example: Example) -> RewardResult:
    """builtin:arithmetic: the last 'The answer is N' equals the gold; 0.2 for that phrase with a wrong N."""
    return _last_number(
        text, example, ANSWER_PHRASE_RE, "End your reply with 'The answer is N.' where N is the result."
    )


def _last_number(text: str, example: Example, pattern: re.Pattern, how: str) -> RewardResult:
    """The last number `pattern` finds equals the gold; 0.2 for the pattern with a wrong number; 0 and `how` (the
    feedback saying the convention) without it."""
    found = [f for f in pattern.findall(text) if re.search(r"\d", f)]
    if not found:
        return RewardResult(0.0, False, how)
    if numbers_equal(found[-1], example.answer):
        return RewardResult(1.0, True)
    return RewardResult(FORMAT_CREDIT, False, f"The answer {found[-1]} is incorrect.", reveals_correctness=True)


def mcq(text: str, example: Example) -> RewardResult:
    """builtin:mcq: the letter in `<answer>X</answer>` equals the gold; 0.2 for the tag with a wrong letter."""
    found = re.findall(r"<answer>\s*([A-Za-z])\s*</answer>", text)
    if not found:
        return RewardResult(0.0, False, "Give the letter of your choice inside answer tags, e.g. <answer>A</answer>.")
    if found[-1].upper() == example.answer:
        return RewardResult(1.0, True)
    return RewardResult(FORMAT_CREDIT, False, f"Option {found[-1].upper()} is incorrect.", reveals_correctness=True)


def arithmetic_hash(text: str, example: Example) -> RewardResult:
    """builtin:arithmetic_hash: the last `#### N` equals the gold; 0.2 for `#### N` with a wrong N. "The answer is N"
    alone is the other convention (builtin:arithmetic's): no credit."""
    return _last_number(
        text, example, HASH_ANSWER_RE, "End your reply with a last line '#### N' where N is the result."
    )


def mcq_text(text: str, example: Example) -> RewardResult:
    """builtin:mcq_text: the text in the last `<answer>...</answer>` equals the gold option's (case and surrounding
    space aside); 0.2 for the tags with anything else in them, a letter (builtin:mcq's convention) included."""
    found = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    if not found:
        return RewardResult(0.0, False, "Give the text of your choice inside answer tags, e.g. <answer>Mars</answer>.")
    if found[-1].strip().lower() == str(example.answer).lower():
        return RewardResult(1.0, True)
    if re.fullmatch(r"\s*[A-Za-z]\s*", found[-1]):
        return RewardResult(FORMAT_CREDIT, False, "Give the option's text inside the tags, not its letter.")
    return RewardResult(FORMAT_CREDIT, False, f"{found[-1].strip()!r} is incorrect.", reveals_correctness=True)


def copy(text: str, example: Example) -> RewardResult:
    """builtin:copy (for tiny random models): the reply starts with the gold word; 0.2 if it contains it."""
    words = re.findall(r"[a-z]+", text.lower())
    if words and words[0] == example.answer:
        return RewardResult(1.0, True)
    # Both hints name the gold word: correctness feedback, however formal they sound.
    if example.answer in words:
        return RewardResult(
            FORMAT_CREDIT, False, f"Start the reply with the word {example.answer!r}.", reveals_correctness=True
        )
    return RewardResult(0.0, False, f"Reply with the word {example.answer!r}.", reveals_correctness=True)


REWARDS: dict[str, RewardFn] = {
    "final_number": final_number,
    "boxed_math": boxed_math,
    "answer_tag": answer_tag,
    "action_calls": action_calls,
    "choice_letter": choice_letter,
    "arithmetic": arithmetic,
    "arithmetic_hash": arithmetic_hash,
    "mcq": mcq,
    "mcq_text": mcq_text,
    "json_call": json_call,
    "copy": copy,
}


# domain `feedback` -> whether the teacher may see a result's feedback (docs/design.md §4, SDPO teacher context)
FEEDBACK_SHOWN: dict[str, Callable[[RewardResult], bool]] = {
    "format": lambda result: not result.reveals_correctness,
    "correctness": lambda result: True,
    "none": lambda result: False,
}


def with_feedback(reward: RewardFn, kind: FeedbackKind) -> RewardFn:
    """`reward` whose feedback is dropped (None) where the domain's feedback `kind` does not show it; score and
    correctness are untouched. `load_domain` wraps every domain's reward with it, user rewards included."""
    if kind == "correctness":
        return reward
    shown = FEEDBACK_SHOWN[kind]

    @functools.wraps(reward)
    def filtered(text: str, example: Example) -> RewardResult:
        result = reward(text, example)
        if result.feedback is None or shown(result):
            return result
        return dataclasses.replace(result, feedback=None)

    return filtered


def resolve_reward(spec: str, import_dirs: Sequence[str] = ()) -> RewardFn:
    """A reward by table name, or a user function `pkg.module:function` (imported here, nowhere else), its module
    looked for in `import_dirs` (a domain's `DomainConfig.import_dirs`) before Python's path."""
    if spec in REWARDS:
        return REWARDS[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise RecipeError(
            f"reward {spec!r}: not a known reward ({', '.join(REWARDS)}) nor of the form 'pkg.module:function'"
        )
    try:
        with _first_on_path(import_dirs):
            module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is None or not f"{module_name}.".startswith(f"{err.name}."):  # one the module itself imports
            raise RecipeError(f"reward {spec!r}: importing module {module_name!r} failed: {err}") from None
        where = ", ".join(import_dirs) + " and " if import_dirs else ""
        raise RecipeError(
            f"reward {spec!r}: cannot import module {module_name!r} ({err}); looked in {where}Python's path"
        ) from None
    except Exception as err:  # the module's own code failed (a syntax error, an exception at import): one line
        raise RecipeError(
            f"reward {spec!r}: importing module {module_name!r} failed: {type(err).__name__}: {err}"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RecipeError(f"reward {spec!r}: module {module_name!r} has no function {attr!r}")
    return fn


@contextmanager
def _first_on_path(dirs: Sequence[str]) -> Iterator[None]:
    """`dirs` at the front of sys.path while the body runs, as a script's folder is; afterwards the entries added
    here are removed again (what the imported module put on the path itself stays)."""
    sys.path[:0] = dirs
    importlib.invalidate_caches()  # a module written after its folder's finder last looked
    try:
        yield
    finally:
        for folder in dirs:
            if folder in sys.path:
                sys.path.remove(folder)  # the first occurrence: the one put at the front here
