"""Row formats of real datasets: how one row becomes (messages, gold answer, demonstration), and which reward.

`FORMATS[name]` is a `RowFormat`; `loading.py` reads the rows and calls `to_example(row, cfg)`. A row missing a
field, or with a field of the wrong kind, raises `MalformedRow(field, problem)`, which the loader turns into one
line naming the file and row (or skips and counts with `skip_malformed`).

| format      | fields (as in the files of ../shared/data and on the hub)     | reward        | demonstration        |
|-------------|---------------------------------------------------------------|---------------|----------------------|
| gsm8k       | question, answer (rationale ending in `#### N`)               | final_number  | rationale, `<<>>` cut |
| math500     | problem, answer, solution                                     | boxed_math    | solution             |
| sciknoweval | prompt (options inside), answer (letter), system              | answer_tag    | gold letter in tags  |
| tooluse     | prompt (tool docs + question), answer (JSON list of actions)  | action_calls  | built from the gold  |
| arc         | query/choices/gold or question/choices{text,label}/answerKey  | choice_letter | `response` if right  |
| boolq       | sentence ("question: ...\\npassage: ..."), label True/False;  | choice_letter | none                 |
|             | or question, passage, answer (bool) as google/boolq           |               |                      |
| piqa        | query, choices, gold; or goal, sol1, sol2, label (0/1) as     | choice_letter | none                 |
|             | ybisk/piqa and its parquet copies (baber/piqa)                |               |                      |
| winogrande  | context_options, continuation, gold; or sentence (with a      | choice_letter | none                 |
|             | `_` blank), option1, option2, answer "1"/"2" as               |               |                      |
|             | allenai/winogrande                                            |               |                      |
| generic     | `cfg.fields`: prompt, answer, [demonstration], [system]; or   | cfg.reward    | mapped field         |
|             | `cfg.prompt_template` over any columns (`prompt_template.py`) |               |                      |
|             | the answer as `answer_kind` says (`gold_answers.py`)          |               |                      |

Each preset's rows are also in its `RowFormat.schema` (the generic format's in `row_schema`): a row the format cannot
read is one line naming the field and the rows the format expects (`format tooluse expects rows {...}`).

The teacher sees the reward's feedback as the reference rewards give it unless `cfg.feedback` says otherwise
(`rewards.with_feedback`): format problems only for gsm8k and math500 (`feedback/math.py`), none for sciknoweval
(`feedback/mcq.py`), the expected actions for tooluse (`feedback/tooluse.py`), format problems only elsewhere.

Prompts: gsm8k asks for `#### N` on the last line (the dataset's own rationale format, so the demonstration
matches it); math500 uses the usual "put your final answer within \\boxed{}" suffix; sciknoweval keeps the row's
system prompt and user prompt as the SDPO data does; tooluse sends the ToolAlpaca prompt as the single user turn,
as the SDFT/SDPO code does. The retention probes (arc, boolq, piqa, winogrande) list lettered options and ask for
the letter; they declare no format pattern of their own. Each probe accepts both the lm-eval layout of the local
copies and the hub dataset's own fields (the layout is told apart by its field names), and both give the same
prompt for the same item (Winogrande's hub layout fills the blank in place, so it reads "Maria's" where the
lm-eval layout's split context gives "Maria 's"). The hub test splits of BoolQ, PIQA and Winogrande are
unlabelled: evaluate on `validation`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from adaptercl.domains.answers import extract_choice_letter
from adaptercl.domains.domain import MalformedRow
from adaptercl.domains.gold_answers import row_gold
from adaptercl.domains.prompt_template import LETTERS, render_prompt
from adaptercl.recipe import DomainConfig, FeedbackKind, template_fields

Messages = list[dict[str, str]]

GSM8K_SYSTEM = "Solve the math problem step by step. Give the final answer on the last line as '#### <number>'."
MATH_SUFFIX = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."
PROBE_SUFFIX = "\n\nAnswer with the letter of the correct option."
UNLABELLED = " (the hub test split is unlabelled: evaluate on eval_split: validation)"


# The rows each preset reads (its error lines name them).
GSM8K_ROWS = '{"question": str, "answer": the rationale ending in "#### N"}'
MATH500_ROWS = '{"problem": str, "answer": the final answer (str), "solution": str (optional)}'
SCIKNOWEVAL_ROWS = '{"prompt": the question with its lettered options, "answer": one letter, "system": str (optional)}'
TOOLUSE_ROWS = (
    '{"prompt": the tool documentation and the question (str), "answer": a list (or its JSON string) of '
    '{"Action": the tool name, "Action_Input": JSON of its arguments}}, as the SDPO/SDFT tooluse data'
)
ARC_ROWS = (
    '{"query", "choices": [str], "gold": 0-based index} (lm-eval) or {"question", "choices": {"text", "label"}, '
    '"answerKey"} (allenai/ai2_arc)'
)
BOOLQ_ROWS = (
    '{"sentence": "question: ...\\npassage: ...", "label": True/False} (lm-eval) or {"question", "passage", '
    '"answer": bool} (google/boolq)'
)
PIQA_ROWS = '{"query", "choices", "gold"} (lm-eval) or {"goal", "sol1", "sol2", "label": 0/1} (ybisk/piqa)'
WINOGRANDE_ROWS = (
    '{"context_options", "continuation", "gold"} (lm-eval) or {"sentence" with a "_" blank, "option1", "option2", '
    '"answer": "1"/"2"} (allenai/winogrande)'
)


@dataclass(frozen=True)
class RowFormat:
    to_example: Callable[[dict, DomainConfig], tuple[Messages, Any, str | None]]
    reward: str | None  # default reward name (REWARDS); None = cfg.reward is required
    format_patterns: list[str]
    feedback: FeedbackKind = "format"  # default `cfg.feedback`: the reference's (lasgroup/SDPO reward_score/feedback)
    schema: str = ""  # the rows it reads, for a row's error line: "format tooluse expects rows {schema}"


def need(row: dict, field: str, kind: type | tuple[type, ...] = str) -> Any:
    """row[field], which must exist, not be None/empty and be of `kind`."""
    if field not in row or row[field] is None:
        raise MalformedRow(field, "is missing")
    value = row[field]
    allowed = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        names = " or ".join(k.__name__ for k in allowed)
        raise MalformedRow(field, f"must be {names}, got {type(value).__name__}")
    if isinstance(value, str | list | dict) and len(value) == 0:
        raise MalformedRow(field, "is empty")
    return value


def chat(user: str, system: str | None) -> Messages:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def lettered(options: list[str]) -> str:
    return "\n".join(f"{LETTERS[i]}. {str(text).strip()}" for i, text in enumerate(options))


def gold_index(row: dict, field: str, n_options: int) -> int:
    value = need(row, field, (int, str))
    try:
        index = int(value)
    except ValueError:
        raise MalformedRow(field, f"must be an option index, got {value!r}") from None
    if not 0 <= index < n_options:
        raise MalformedRow(field, f"index {index} is out of range for {n_options} options")
    return index


# ---------------------------------------------------------------------------------------------------- math


def gsm8k_example(row: dict, cfg: DomainConfig) -> tuple[Messages, Any, str | None]:
    question, solution = need(row, "question"), need(row, "answer")
    if "####" not in solution:
        raise MalformedRow("answer", "has no '#### <number>' final answer")
    gold = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not re.fullmatch(r"-?\d+(\.\d+)?", gold):
        raise MalformedRow("answer", f"final answer {gold!r} is not a number")
    demo = re.sub(r"<<[^<>]*>>", "", solution).strip()  # drop calculator annotations
    return chat(question, cfg.system_prompt or GSM8K_SYSTEM), gold, demo


def math500_example(row: dict, cfg: DomainConfig) -> tuple[Messages, Any, str | None]:
    problem, answer = need(row, "problem"), need(row, "answer")
    solution = row.get("solution") if isinstance(row.get("solution"), str) else None
    return chat(problem + MATH_SUFFIX, cfg.system_prompt), answer, solution


# ---------------------------------------------------------------------------------------------------- SDPO sets


def sciknoweval_example(row: dict, cfg: DomainConfig) -> tuple[Messages, Any, str | None]:
    prompt, answer = need(row, "prompt"), need(row, "answer").strip().upper()
    if not re.fullmatch(r"[A-Z]", answer):
        raise MalformedRow("answer", f"must be one option letter, got {row['answer']!r}")
    system = cfg.system_prompt or (row.get("system") if isinstance(row.get("system"), str) else None)
    # No rationale in these rows: the demonstration is the gold answer in the tags the system prompt asks for, so
    # SDFT (and the hybrid's failed groups) get a teacher that knows the answer and its format.
    return chat(prompt, system), answer, f"<answer>{answer}</answer>"


def tooluse_example(row: dict, cfg: DomainConfig) -> tuple[Messages, Any, str | None]:
    prompt, raw = need(row, "prompt"), need(row, "answer", (str, list))
    try:
        actions = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError as err:
        raise MalformedRow("answer", f"is not JSON ({err.msg})") from None
    if not isinstance(actions, list) or not actions:
        raise MalformedRow("answer", "must be a non-empty list of {Action, Action_Input}")
    lines = []
    for item in actions:
        if not isinstance(item, dict) or not isinstance(item.get("Action"), str):
            raise MalformedRow("answer", "has an item without an 'Action' name")
        action_input = item.get("Action_Input", "{}")
        if not isinstance(action_input, str):
            action_input = json.dumps(action_input, ensure_ascii=False)
        lines += [f"Action: {item['Action']}", f"Action Input: {action_input}"]
    return chat(prompt, cfg.system_prompt), actions, "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- probes


def probe(question: str, options: list[str], gold: int, cfg: DomainConfig, demo: str | None = None):
    return chat(f"{question.strip()}\n{lettered(options)}{PROBE_SUFFIX}", cfg.system_prompt), LETTERS[gold], demo


def checked_demonstration(response: Any, letter: str, num_options: int) -> str | None:
    """A model-written rationale (ARC's `response`) only when it ends up choosing the gold option: 39 of the 1172
    rows of challenge_test choose another."""
    return response if isinstance(response, str) and extract_choice_letter(response, num_options) == letter else None


def arc_example(row: dict, cfg: DomainConfig) -> tuple[Messages, Any, str | None]:
    if isinstance(row.get("choices"), dict):  # allenai/ai2_arc layout (question, choices{text,label}, answerKey)
        question, choices = need(row, "question"), need(row, "choices", dict)
        texts, labels = choices.get("text"), choices.get("label")
        if not isinstance(texts, list) or not isinstance(labels, list) or len(texts) != len(labels) or not texts:
            raise MalformedRow("choices", "must hold equal-length lists 'text' and 'label'")
        key = str(need(row, "answerKey", (str, int)))
        if key not in [str(label) for label in labels]:
            raise MalformedRow("answerKey", f"{key!r} is not one of the labels {labels}")
        gold = [str(label) for label in labels].index(key)
        return probe(question, texts, gold, cfg, checked_demonstration(row.get("response"), LETTERS[gold], len(texts)))
    query, options = need(row, "query"), need(row, "choices", list)  # lm-eval layout (query, choices, gold)
    return probe(query, options, gold_index(row, "gold", len(options)), cfg)


def boolq_example(row: dict, cfg: DomainConfig) -> tuple[Messages, Any, str | None]:
    if "sentence" not in row and ("question" in row or "passage" in row):  # google/boolq layout
        question, passage = need(row, "question"), need(row, "passage")
        truth = need(row, "answer", bool)
        return probe(boolq_text(question, passage), ["yes", "no"], 0 if truth else 1, cfg)
    sentence, label = need(row, "sentence"), need(row, "label", (str, bool))  # lm-eval layout
    truth = {"true": True, "false": False}.get(str(label).strip().lower())
    if truth is None:
        raise MalformedRow("label", f"must be True or False, got {label!r}")
    m = re.match(r"\s*question:\s*(.*?)\npassage:\s*(.*)", sentence, re.S)
    text = boolq_text(m.group(1), m.group(2)) if m else sentence
    return probe(text, ["yes", "no"], 0 if truth else 1, cfg)


def boolq_text(question: str, passage: str) -> str:
    """The probe text of a BoolQ item; its questions are lower-case and carry no question mark."""
    return f"Passage: {passage.strip()}\nQuestion: {question.strip().rstrip('?')}?"


def piqa_example(row: dict, cfg: DomainConfig) -> tuple[Messages, Any, str | None]:
    if "query" not in row and "goal" in row:  # ybisk/piqa layout (goal, sol1, sol2, label)
        goal, options = need(row, "goal"), [need(row, "sol1"), need(row, "sol2")]
        if row.get("label") == -1:
            raise MalformedRow("label", f"is -1{UNLABELLED}")
        return probe(f"Question: {goal.strip()}", options, gold_index(row, "label", 2), cfg)  # as lm-eval's query
    query, options = need(row, "query"), need(row, "choices", list)  # lm-eval layout
    return probe(query, options, gold_index(row, "gold", len(options)), cfg)


WINOGRANDE_QUESTION = "Which sentence makes more sense?"


def winogrande_example(row: dict, cfg: DomainConfig) -> tuple[Messages, Any, str | None]:
    if "context_options" not in row and "sentence" in row:  # allenai/winogrande layout
        sentence = need(row, "sentence")
        if "_" not in sentence:
            raise MalformedRow("sentence", "has no '_' blank to fill")
        before, after = sentence.split("_", 1)
        fillers = [need(row, "option1"), need(row, "option2")]
        if "answer" not in row or row["answer"] is None:
            raise MalformedRow("answer", "is missing")
        answer = str(row["answer"]).strip()
        if answer not in ("1", "2"):
            hint = UNLABELLED if answer == "" else ""
            raise MalformedRow("answer", f"must be '1' or '2', got {row['answer']!r}{hint}")
        options = [f"{before}{filler.strip()}{after}" for filler in fillers]
        return probe(WINOGRANDE_QUESTION, options, int(answer) - 1, cfg)
    contexts, ending = need(row, "context_options", list), need(row, "continuation")  # lm-eval layout
    options = [f"{str(c).strip()} {ending.strip()}" for c in contexts]
    return probe(WINOGRANDE_QUESTION, options, gold_index(row, "gold", len(options)), cfg)


# ---------------------------------------------------------------------------------------------------- generic

GENERIC_FIELDS = ("prompt", "answer", "demonstration", "system")


def generic_example(row: dict, cfg: DomainConfig) -> tuple[Messages, Any, str | None]:
    """cfg.fields maps prompt/answer (required) and demonstration/system (optional) to dataset fields.

    The prompt field may hold a string (the user turn) or a list of chat messages; with `cfg.prompt_template` the
    user turn is rendered from the row's columns instead (`prompt_template.py`), and with `cfg.answer_options` or
    `cfg.answer_kind` the answer becomes the letter of the option it designates (`gold_answers.py`).
    """
    fields = {key: cfg.fields.get(key, key) for key in GENERIC_FIELDS}
    if cfg.prompt_template is not None:
        prompt = render_prompt(cfg.prompt_template, row)
    else:
        prompt = need(row, fields["prompt"], (str, list))
    if (fields["answer"] not in row or row[fields["answer"]] is None) and not cfg.reward_funcs:
        raise MalformedRow(fields["answer"], "is missing")  # TRL-style rewards read their own columns instead
    demo = row.get(fields["demonstration"])
    if demo is not None and not isinstance(demo, str):
        raise MalformedRow(fields["demonstration"], f"must be str, got {type(demo).__name__}")
    system = cfg.system_prompt
    if system is None and "system" in cfg.fields:
        system = row.get(fields["system"]) if isinstance(row.get(fields["system"]), str) else None
    if isinstance(prompt, str):
        messages = chat(prompt, system)
    else:
        ok = all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt
        )
        if not ok or prompt[-1]["role"] != "user":
            raise MalformedRow(fields["prompt"], "must be a string or chat messages ending with a user turn")
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
        if system and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})
    answer = row.get(fields["answer"])
    if (cfg.answer_options is not None or cfg.answer_kind is not None) and answer is not None:
        answer = row_gold(row, answer, cfg, fields["answer"], messages[-1]["content"])
    return messages, answer, demo


def conversational_prompt(row: dict, cfg: DomainConfig) -> bool:
    """Whether the row gave its prompt as chat messages (TRL's conversational format): only a generic row's prompt
    field can; the presets and prompt templates build a string."""
    if cfg.prompt_template is not None or (cfg.format or "generic") != "generic":
        return False
    return isinstance(row.get(cfg.fields.get("prompt", "prompt")), list)


PROBE_PATTERNS: list[str] = []

FORMATS: dict[str, RowFormat] = {
    "gsm8k": RowFormat(gsm8k_example, "final_number", [r"####"], schema=GSM8K_ROWS),
    "math500": RowFormat(math500_example, "boxed_math", [r"\\boxed"], schema=MATH500_ROWS),
    "sciknoweval": RowFormat(
        sciknoweval_example, "answer_tag", [r"<answer>", r"</answer>"], feedback="none", schema=SCIKNOWEVAL_ROWS
    ),
    "tooluse": RowFormat(
        tooluse_example, "action_calls", [r"Action:", r"Action Input:"], feedback="correctness", schema=TOOLUSE_ROWS
    ),
    "arc": RowFormat(arc_example, "choice_letter", PROBE_PATTERNS, schema=ARC_ROWS),
    "boolq": RowFormat(boolq_example, "choice_letter", PROBE_PATTERNS, schema=BOOLQ_ROWS),
    "piqa": RowFormat(piqa_example, "choice_letter", PROBE_PATTERNS, schema=PIQA_ROWS),
    "winogrande": RowFormat(winogrande_example, "choice_letter", PROBE_PATTERNS, schema=WINOGRANDE_ROWS),
    "generic": RowFormat(generic_example, None, []),  # its rows are the recipe's: `row_schema`
}


def row_schema(cfg: DomainConfig) -> str:
    """'format NAME expects rows {...}': the rows a domain's format reads (the generic format's from its fields,
    prompt_template and answer_options), for the line of a row it cannot read."""
    name = cfg.format or "generic"
    if name != "generic":
        return f"format {name} expects rows {FORMATS[name].schema}"
    fields = {key: cfg.fields.get(key, key) for key in GENERIC_FIELDS}
    if cfg.prompt_template is not None:
        parts = [f"the columns prompt_template names ({', '.join(template_fields(cfg.prompt_template))})"]
    else:
        parts = [f'"{fields["prompt"]}": the user turn (str) or chat messages']
    optional = " (optional with reward_funcs)" if cfg.reward_funcs else ""
    parts.append(f'"{fields["answer"]}": the gold answer{optional}')
    if cfg.answer_options is not None:
        columns = cfg.answer_options if isinstance(cfg.answer_options, list) else [cfg.answer_options]
        parts.append(f"the options in {', '.join(repr(c) for c in columns)}")
    return f"the generic format expects rows with {', '.join(parts)}"
