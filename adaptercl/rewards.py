"""Verifiable rewards: `(completion text, Example) -> RewardResult`, the `REWARDS` table, and `resolve_reward`.

Every reward takes any string (garbage from a random model included) and never raises. `score` drives the
advantages, `correct` is exact task success (accuracy), `feedback` says what was wrong (SDPO's teacher sees it when
no sibling succeeded) and is None when the answer is correct.

| name          | used by                      | checks                                                          |
|---------------|------------------------------|-----------------------------------------------------------------|
| final_number  | gsm8k                        | `#### N`, else `Answer: N`/`The answer is N`, else last number  |
| boxed_math    | math500                      | last `\\boxed{...}` equivalent to the gold (see `math_equal`)   |
| answer_tag    | sciknoweval                  | letter in the last `<answer>...</answer>` (SDPO's mcq.py)       |
| action_calls  | tooluse (ToolAlpaca)         | `Action:` names and merged `Action Input:` JSON equal the gold  |
| choice_letter | arc, boolq, piqa, winogrande | the chosen option letter                                        |
| arithmetic    | builtin:arithmetic           | `The answer is N.`; 0.2 for the format alone                    |
| mcq           | builtin:mcq                  | `<answer>X</answer>`; 0.2 for the format alone                  |
| json_call     | builtin:toolcall             | one JSON `{"name", "arguments"}`; up to 0.4 partial credit      |
| copy          | builtin:copy                 | the reply starts with the gold word; 0.2 if it contains it      |

Partial credit always stays below 0.5, the SDPO success threshold, so a well-formatted wrong answer is never
shown to the teacher as a correct solution. The real-dataset rewards are 0/1, as in the reference code.

Departures from the references, on purpose: `answer_tag` and `action_calls` follow lasgroup/SDPO's
`reward_score/feedback/{mcq,tooluse}.py` (the ToolAlpaca check is also the SDFT evaluation's) but `answer_tag`
adds feedback (the reference gives none). `boxed_math` first compares normalised strings and exact fractions and
then, when the optional `math-verify` package is installed, asks it (as the SDPO code does); without it, forms
beyond simple numbers, fractions and identical LaTeX are marked wrong.

A user reward is `pkg.module:function` with the same signature; `resolve_reward` imports it (the one dynamic
import of the toolkit).
"""

from __future__ import annotations

import importlib
import json
import re
import threading
from collections import Counter
from fractions import Fraction
from typing import Any

from adaptercl.config import RecipeError
from adaptercl.domains import Example, RewardFn, RewardResult

FORMAT_CREDIT = 0.2  # builtin domains: reward for the right answer format with a wrong answer

# ---------------------------------------------------------------------------------------------------- numbers

# A number as written in answers: 1,000 / -3 / 2.50 / .5 / 3/4 (thousands commas only in groups of three).
_NUM = r"[-−]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:/\d+)?"
NUMBER_RE = re.compile(rf"(?<![\w.])({_NUM})(?![\w])")


def parse_number(text: Any) -> Fraction | None:
    """An exact value for '1,000', '-2.50', '3/6', '\\frac{1}{2}', '5.0', '$12', '7.' ... or None."""
    if isinstance(text, bool) or text is None:
        return None
    if isinstance(text, int | float):
        return Fraction(text).limit_denominator(10**9) if isinstance(text, float) else Fraction(text)
    s = str(text).strip().replace("−", "-").replace("\\$", "").replace("$", "").replace("\\!", "")
    s = re.sub(r"\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}", r"\1/\2", s)
    s = re.sub(r"\\[dt]?frac(\d)(\d)", r"\1/\2", s)
    s = re.sub(r"\s+", "", s).rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    m = re.fullmatch(r"(-?)(\d+(?:\.\d+)?|\.\d+)(?:/(-?\d+(?:\.\d+)?))?", s)
    if not m:
        return None
    try:
        value = Fraction(m.group(2)) * (-1 if m.group(1) else 1)
        if m.group(3) is not None:
            value /= Fraction(m.group(3))
    except (ValueError, ZeroDivisionError):
        return None
    return value


def numbers_equal(a: Any, b: Any) -> bool:
    x, y = parse_number(a), parse_number(b)
    return x is not None and y is not None and x == y


def _last(pattern: str, text: str, flags: int = 0) -> str | None:
    found = re.findall(pattern, text, flags)
    return found[-1] if found else None


def extract_final_number(text: str) -> str | None:
    """The final numeric answer of a free-form solution: `#### N`, `Answer: N`, `\\boxed{N}`, else the last number."""
    for pattern, flags in (
        (rf"####\s*\$?\s*({_NUM})", 0),
        (rf"answer\s*(?:is|:|=)\s*:?\s*\**\s*\$?\s*({_NUM})", re.IGNORECASE),
        (rf"\\boxed\{{\s*\$?({_NUM})\s*\}}", 0),
    ):
        found = [f for f in re.findall(pattern, text, flags) if re.search(r"\d", f)]
        if found:
            return found[-1]
    found = [f for f in NUMBER_RE.findall(text) if re.search(r"\d", f)]
    return found[-1] if found else None


def final_number(text: str, example: Example) -> RewardResult:
    """GSM8K: the final number equals the gold (`#### N` of the dataset); 1,000 == 1000 and 5.0 == 5."""
    pred = extract_final_number(text)
    if pred is None:
        return RewardResult(0.0, False, "The response has no final numeric answer. End with a line '#### <number>'.")
    if numbers_equal(pred, example.answer):
        return RewardResult(1.0, True)
    return RewardResult(0.0, False, f"The final answer {pred} is incorrect.")


# ---------------------------------------------------------------------------------------------------- boxed math


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), nested braces included; `\\boxed 5` too; else None."""
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    rest = text[idx:].removeprefix("\\boxed").removeprefix("\\fbox")
    if rest.startswith(" "):  # \boxed 5
        m = re.match(r"\s+([^\s$]+)", rest)
        return m.group(1) if m else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None  # unbalanced: truncated response


def normalize_math(s: str) -> str:
    """A canonical string for simple LaTeX answers (after Hendrycks et al.'s MATH normaliser, simplified)."""
    s = str(s).strip()
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)
    for token in ("\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\ ", "$", "\\$"):
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("−", "-")
    s = re.sub(r"\^\{?\\circ\}?", "", s).replace("\\%", "").replace("%", "").replace("°", "")
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", s)
    s = s.rstrip(".")
    if re.fullmatch(r"[a-zA-Z]\w?=.+", s):  # "x=5" -> "5"
        s = s.split("=", 1)[1]
    s = re.sub(r"(?<![\d.])\.(\d)", r"0.\1", s)
    s = re.sub(r"(\d+)\.0+(?!\d)", r"\1", s)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s


def math_equal(pred: str, gold: str) -> bool:
    """Equivalence of two final answers: normalised strings, exact numbers, then math-verify when installed."""
    a, b = normalize_math(pred), normalize_math(gold)
    if a == b:
        return True
    x, y = parse_number(a), parse_number(b)
    if x is not None and y is not None:
        return x == y
    return _math_verify_equal(pred, gold)


def _math_verify_equal(pred: str, gold: str) -> bool:
    try:
        from math_verify import parse, verify
    except ImportError:
        return False
    # math-verify times out with signal.alarm, which only works on the main thread.
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        gold_expr = parse(f"${gold}$", parsing_timeout=limit)
        pred_expr = parse(f"${pred}$", parsing_timeout=limit)
        return bool(gold_expr and pred_expr and verify(gold_expr, pred_expr, timeout_seconds=limit))
    except Exception:  # a parser failure or timeout is a wrong answer, never a crash
        return False


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
    return RewardResult(0.0, False, f"The final answer {pred.strip()} is incorrect.")


# ---------------------------------------------------------------------------------------------------- letters


def extract_answer_tag(text: str) -> str:
    """lasgroup/SDPO mcq.py: the text after the last `<answer>` up to `</answer>`, stripped, upper-cased.

    Without any tag this is the whole response, so a bare "B" counts, as in the reference.
    """
    return text.split("<answer>")[-1].split("</answer>")[0].strip().upper()


ANSWER_TAG_FORMAT = re.compile(r"<answer>\s*[A-Z]\s*</answer>\s*$")  # the reference's is_correct_format


def answer_tag(text: str, example: Example) -> RewardResult:
    """SciKnowEval MCQ: the letter inside the last `<answer></answer>` equals the gold letter."""
    pred = extract_answer_tag(text)
    if pred == str(example.answer).strip().upper():
        return RewardResult(1.0, True)
    if not re.fullmatch(r"[A-Z]", pred):
        return RewardResult(0.0, False, "Give only the option letter inside answer tags, e.g. <answer>\nA\n</answer>.")
    return RewardResult(0.0, False, f"Option {pred} is incorrect.")


def extract_choice_letter(text: str) -> str | None:
    """The option letter a free-form reply chose: `<answer>X`, 'answer is X' / 'Answer: X', or a leading 'X.'."""
    for pattern, flags in (
        (r"<answer>\s*\(?([A-Z])\b", 0),
        (r"answer\s*(?:is|:)\s*(?:option\s*)?\(?([A-Z])\b(?![a-z])", re.IGNORECASE),
        (r"^\s*(?:option\s*)?\(?([A-Z])(?:[).:]|\s*$|\s*\n)", re.IGNORECASE),
    ):
        found = _last(pattern, text, flags)
        if found:
            return found.upper()
    return None


def choice_letter(text: str, example: Example) -> RewardResult:
    """Retention probes (ARC, BoolQ, PIQA, Winogrande): the chosen option letter equals the gold letter."""
    pred = extract_choice_letter(text)
    if pred is None:
        return RewardResult(0.0, False, "State the letter of the correct option.")
    if pred == str(example.answer).strip().upper():
        return RewardResult(1.0, True)
    return RewardResult(0.0, False, f"Option {pred} is incorrect.")


# ---------------------------------------------------------------------------------------------------- tool use


def extract_actions(text: str) -> list[str]:
    return re.findall(r"Action:\s*(\w+)", text)


def extract_action_inputs(text: str) -> dict:
    """All JSON objects after 'Action Input:', merged into one dict (later keys win)."""
    merged: dict = {}
    decoder = json.JSONDecoder()
    for m in re.finditer(r"Action Input:\s*", text):
        try:
            parsed, _ = decoder.raw_decode(text, m.end())
        except json.JSONDecodeError:
            continue
        if isinstance(parsed, dict):
            merged.update(parsed)
    return merged


def parse_gold_actions(gold: Any) -> tuple[list[str], dict]:
    """ToolAlpaca gold (a list, or its JSON string, of {Action, Action_Input}) -> (names, merged inputs)."""
    items = json.loads(gold) if isinstance(gold, str) else gold
    names, merged = [], {}
    for item in items:
        names.append(item["Action"])
        raw = item.get("Action_Input", {})
        try:
            value = json.loads(raw) if isinstance(raw, str) else raw
        except json.JSONDecodeError:
            value = {}
        if isinstance(value, dict):
            merged.update(value)
    return names, merged


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
    return RewardResult(0.0, False, "; ".join(problems))  # the reference's feedback strings


def first_json_object(text: str) -> dict | None:
    """The first JSON object in the text (code fences and prose around it are fine), or None."""
    decoder = json.JSONDecoder()
    for m in re.finditer(r"\{", text):
        try:
            parsed, _ = decoder.raw_decode(text, m.start())
        except json.JSONDecodeError:
            continue
        if isinstance(parsed, dict):
            return parsed
    return None


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
    return RewardResult(round(score, 4), False, "Wrong tool call: " + "; ".join(problems) + ".")


# ---------------------------------------------------------------------------------------------------- builtins

ANSWER_PHRASE_RE = re.compile(rf"[Tt]he (?:final )?answer is:?\s*\**\s*({_NUM})")


def arithmetic(text: str, example: Example) -> RewardResult:
    """builtin:arithmetic: the last 'The answer is N' equals the gold; 0.2 for that phrase with a wrong N."""
    found = [f for f in ANSWER_PHRASE_RE.findall(text) if re.search(r"\d", f)]
    if not found:
        return RewardResult(0.0, False, "End your reply with 'The answer is N.' where N is the result.")
    if numbers_equal(found[-1], example.answer):
        return RewardResult(1.0, True)
    return RewardResult(FORMAT_CREDIT, False, f"The answer {found[-1]} is incorrect.")


def mcq(text: str, example: Example) -> RewardResult:
    """builtin:mcq: the letter in `<answer>X</answer>` equals the gold; 0.2 for the tag with a wrong letter."""
    found = re.findall(r"<answer>\s*([A-Za-z])\s*</answer>", text)
    if not found:
        return RewardResult(0.0, False, "Give the letter of your choice inside answer tags, e.g. <answer>A</answer>.")
    if found[-1].upper() == example.answer:
        return RewardResult(1.0, True)
    return RewardResult(FORMAT_CREDIT, False, f"Option {found[-1].upper()} is incorrect.")


def copy(text: str, example: Example) -> RewardResult:
    """builtin:copy (for tiny random models): the reply starts with the gold word; 0.2 if it contains it."""
    words = re.findall(r"[a-z]+", text.lower())
    if words and words[0] == example.answer:
        return RewardResult(1.0, True)
    if example.answer in words:
        return RewardResult(FORMAT_CREDIT, False, f"Start the reply with the word {example.answer!r}.")
    return RewardResult(0.0, False, f"Reply with the word {example.answer!r}.")


REWARDS: dict[str, RewardFn] = {
    "final_number": final_number,
    "boxed_math": boxed_math,
    "answer_tag": answer_tag,
    "action_calls": action_calls,
    "choice_letter": choice_letter,
    "arithmetic": arithmetic,
    "mcq": mcq,
    "json_call": json_call,
    "copy": copy,
}


def resolve_reward(spec: str) -> RewardFn:
    """A reward by table name, or a user function `pkg.module:function` (imported here, nowhere else)."""
    if spec in REWARDS:
        return REWARDS[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise RecipeError(
            f"reward {spec!r}: not a known reward ({', '.join(REWARDS)}) nor of the form 'pkg.module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise RecipeError(f"reward {spec!r}: cannot import module {module_name!r} ({err})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RecipeError(f"reward {spec!r}: module {module_name!r} has no function {attr!r}")
    return fn
