"""What a reply answered: numbers, boxed LaTeX, option letters and tool calls read out of free-form text, and the
equivalences the rewards compare them with (`parse_number`, `math_equal`).

These are pure string functions: they take any text (garbage from a random model included), never raise, and
return None (or an empty value) when the reply states no answer. The rewards in `rewards.py` turn what they read
into a `RewardResult`; `datasets_formats.py` uses `extract_choice_letter` to keep only demonstrations that choose
the gold option.

`math_equal` first compares normalised strings and exact fractions and then asks `math-verify` (a core dependency,
as in lasgroup/SDPO's math reward and TRL's accuracy_reward), so set, interval, radical and other LaTeX forms of a
correct answer are matched; `extract_answer_tag`, `extract_actions`, `extract_action_inputs` and
`parse_gold_actions` follow lasgroup/SDPO's `reward_score/feedback/{mcq,tooluse}.py`.
"""

from __future__ import annotations

import json
import logging
import re
import string
import threading
from fractions import Fraction
from typing import Any

# ---------------------------------------------------------------------------------------------------- numbers

# A number as written in answers: 1,000 / -3 / 2.50 / .5 / 3/4 (thousands commas only in groups of three).
_NUM = r"[-−]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:/\d+)?"
NUMBER_RE = re.compile(rf"(?<![\w.])({_NUM})(?![\w])")
ANSWER_PHRASE_RE = re.compile(rf"[Tt]he (?:final )?answer is:?\s*\**\s*({_NUM})")  # builtin:arithmetic
HASH_ANSWER_RE = re.compile(rf"####\s*({_NUM})")  # builtin:arithmetic_hash (GSM8K's answer line)


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
    """Equivalence of two final answers: normalised strings, exact numbers, then math-verify (sets, intervals,
    radicals, LaTeX forms: `\\{1,2\\}` = `\\{2,1\\}`, `\\sqrt{2}/2` = `\\frac{1}{\\sqrt2}`)."""
    a, b = normalize_math(pred), normalize_math(gold)
    if a == b:
        return True
    x, y = parse_number(a), parse_number(b)
    if x is not None and y is not None:
        return x == y
    return math_verify_equal(pred, gold)


MATH_VERIFY_TIMEOUT_S = 5  # per parse and per comparison, on the main thread


def math_verify_equal(pred: str, gold: str) -> bool:
    """math-verify's verdict on two LaTeX answers (each read as `$...$`); a parse failure or timeout is False.

    math-verify times out with `signal.alarm`, which only the main thread may set: elsewhere (a rollout or
    evaluation thread) it runs without a timeout, as TRL's accuracy_reward does, and its warnings about that are
    silenced."""
    from math_verify import parse, verify  # a core dependency; imported here to keep sympy off `recipe validate`

    main = threading.current_thread() is threading.main_thread()
    limit = MATH_VERIFY_TIMEOUT_S if main else None
    if not main:
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).setLevel(logging.ERROR)
    try:
        gold_expr = parse(f"${gold}$", parsing_timeout=limit)
        pred_expr = parse(f"${pred}$", parsing_timeout=limit)
        return bool(gold_expr and pred_expr and verify(gold_expr, pred_expr, timeout_seconds=limit))
    except Exception:  # a parser failure or timeout is a wrong answer, never a crash
        return False


# ---------------------------------------------------------------------------------------------------- letters


def extract_answer_tag(text: str) -> str:
    """lasgroup/SDPO mcq.py: the text after the last `<answer>` up to `</answer>`, stripped, upper-cased.

    Without any tag this is the whole response, so a bare "B" counts, as in the reference.
    """
    return text.split("<answer>")[-1].split("</answer>")[0].strip().upper()


ANSWER_TAG_FORMAT = re.compile(r"<answer>\s*[A-Z]\s*</answer>\s*$")  # the reference's is_correct_format


# How a reply states its option letter, read as a person would. Tiers, strongest first; within a tier the last
# statement wins (a reply that corrects itself means its last word):
# 1. a tag: `<answer>X`, `\boxed{X}`;
# 2. a statement: "the (correct) answer/option/choice is X", "Answer: X" (hedges such as "I think it is" may sit
#    between), "I choose/pick/go with X";
# 3. a verdict: "Option X is correct", "(X) is the best answer" (not after "nor", "neither", "not", "if");
# 4. the layout: a line holding only the letter, then a reply opening "X)"/"X."/"(X)", then a reply ending in a
#    clause of its own such as ", but X." or "So X".
# Markdown emphasis, backticks and `\text{}` are dropped first. The article "a"/"A" and the pronoun "I" count as
# a choice only where they cannot be prose: bracketed, followed by punctuation or the end of a line, or ("A
# because ...") by a connective. Only letters among the question's options count when their number is known, as in
# lm-evaluation-harness's MultiChoiceRegexFilter, which also tries an "answer is (X)" regex first.
_LETTER = r"(?<![\w'])(?P<open>[(\[]?)(?P<letter>[A-Za-z])"
_CLEAR_AFTER = re.compile(r"[)\].,;:!?<}]|[ \t]*(?:\n|$)|\s+[-–—(\[]")  # what may follow a letter in prose
_LEADING_AFTER = re.compile(r"[)\].:]|[ \t]*(?:\n|$)|\s+[-–—]\s")  # a reply opening "B) ...", "B. ...", "B - ..."
_NEXT_WORD = re.compile(r"\s+(\w+)")
_CONNECTIVES = frozenset({"because", "since", "as"})  # "A because ...": a letter, never an article or pronoun
_NEGATIONS = frozenset({"nor", "neither", "not", "if", "whether"})  # "Neither A nor B is correct" chooses nothing
_HEDGE = r"(?:(?:i\s+(?:think|believe|guess|would\s+say)|i'd\s+say|probably|likely|clearly|it\s+is|it's)\s*,?\s*)*"
_TAGGED = (re.compile(r"<answer>\s*" + _LETTER, re.I), re.compile(r"\\boxed\{\s*" + _LETTER, re.I))
_STATED = (
    re.compile(
        r"\b(?:answer|option|choice)(?:\s+(?:is|was|would\s+be|should\s+be|must\s+be|will\s+be)\b|\s*[:=])\s*:?\s*"
        r"(?:(?:option|choice|letter)\s*:?\s*)?" + _HEDGE + _LETTER,
        re.I,
    ),
    re.compile(
        r"\b(?:choose|chose|pick|picked|select|selected|go\s+with|going\s+with|opt\s+for)\s+"
        r"(?:(?:option|choice|answer)\s+)?" + _LETTER,
        re.I,
    ),
)
_VERDICT = re.compile(
    r"(?:\b(?P<before>\w+)\s+)?(?:(?:option|choice)\s+)?"
    + _LETTER
    + r"[)\]]?\s+is\s+(?:the\s+)?(?:most\s+)?(?:correct|right|best|answer)\b",
    re.I,
)
_LONE_LINE = re.compile(r"^[ \t>#-]*(?:(?:option|choice)\s+)?" + _LETTER + r"[)\]]?[ \t]*[.!]?[ \t]*$", re.I | re.M)
_LEADING = re.compile(r"\A\s*(?:(?:option|choice)\s*)?" + _LETTER, re.I)
_TRAILING = re.compile(
    r"(?:^|[,;:.!?]\s*|\b(?:but|so|thus|therefore|hence|then|finally)\s+)(?:(?:option|choice)\s+)?"
    + _LETTER
    + r"[)\]]?\s*[.!]?\s*\Z",
    re.I | re.M,
)


def _read_letter(m: re.Match, text: str, letters: str, after: re.Pattern | None, prose: bool, upper: bool):
    """The matched letter, upper-cased, when it is one of `letters`, not negated (a `before` word of `_NEGATIONS`),
    upper-case or bracketed if `upper`, and a choice by what follows: `after` (None: anything), or with `prose` a
    word after an upper-case letter (after A or I only a connective, else it is the article or the pronoun)."""
    letter, before = m["letter"], m.groupdict().get("before") or ""
    if (
        letter.upper() not in letters
        or before.lower() in _NEGATIONS
        or (upper and not (letter.isupper() or m["open"]))
    ):
        return None
    if after is None or after.match(text, m.end()):
        return letter.upper()
    word = _NEXT_WORD.match(text, m.end())
    if prose and word and letter.isupper() and (letter not in "AI" or word.group(1).lower() in _CONNECTIVES):
        return letter
    return None


def _last_letter(
    patterns: tuple[re.Pattern, ...], text: str, letters: str, after: re.Pattern | None, *, prose=False, upper=False
) -> str | None:
    """The letter of the last match (by position) of any of `patterns` that `_read_letter` accepts."""
    hits = [
        (m.start("letter"), letter)
        for pattern in patterns
        for m in pattern.finditer(text)
        if (letter := _read_letter(m, text, letters, after, prose, upper))
    ]
    return max(hits)[1] if hits else None


def extract_choice_letter(text: str, num_options: int | None = None) -> str | None:
    """The option letter a free-form reply chose (see the tiers above), or None when it states none.

    `num_options` (how many options the question offers, when known) limits the letters to the first that many of
    A, B, C, ...; without it any letter A-Z may be chosen.
    """
    letters = string.ascii_uppercase[:num_options] if num_options else string.ascii_uppercase
    text = re.sub(r"\\text(?:bf)?\{([^{}]*)\}", r"\1", re.sub(r"[*_`]", "", text))  # markdown, LaTeX \text{X}
    return (
        _last_letter(_TAGGED, text, letters, _CLEAR_AFTER)
        or _last_letter(_STATED, text, letters, _CLEAR_AFTER, prose=True)
        or _last_letter((_VERDICT,), text, letters, None, upper=True)
        or _last_letter((_LONE_LINE,), text, letters, None)
        or _last_letter((_LEADING,), text, letters, _LEADING_AFTER)
        or _last_letter((_TRAILING,), text, letters, None, upper=True)
    )


def count_lettered_options(prompt: str) -> int | None:
    """How many options a prompt lists as lines `A. ...`, `B. ...` (the last run from A), or None below two."""
    run = 0
    for m in re.finditer(r"^[ \t]*\(?([A-Z])[.)]\s", prompt, re.M):
        index = ord(m.group(1)) - ord("A")
        if index == 0:
            run = 1
        elif run and index == run:
            run += 1
    return run if run >= 2 else None


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
