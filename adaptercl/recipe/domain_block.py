"""The `domains:` block of the recipe grammar: where a domain's rows come from, how they become examples, and which
reward scores them (`domains/` builds the domain from it). No torch import; `grammar.py` re-exports it.

What kind of source a `source` string is (`source_kind`), decided in this order:
1. `builtin:NAME`: generated rows (`domains/builtin.py`);
2. `http://...` or `https://...`: one data file (.jsonl, .json, .parquet or .csv; a query string is allowed) read by
   `datasets.load_dataset("json" | "parquet" | "csv", data_files=URL)`; a .json file may hold JSON lines or a list;
3. `hub:ID`: the `datasets` hub id ID, whatever is on disk;
4. a path that exists on this machine: a local file or folder;
5. `OWNER/NAME` (one slash, letters, digits, `_.-`, no data-file suffix) whose OWNER is not a folder here: a hub id;
6. anything else is a local path, and one that does not exist is an error naming it, never a hub lookup: paths
   starting with `/`, `.` or `~`, paths with two or more slashes or a data-file suffix, bare names (`gsm8k`; write
   `hub:gsm8k` for an un-namespaced hub dataset), and `data/tooluse` when a `data/` folder exists here.
`OWNER/NAME` with no such folder here (rule 5) cannot be told from a local path by its spelling: write `./data/x`
to mean a local folder for sure.
"""

from __future__ import annotations

import os
import re
import string
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, PrivateAttr, field_validator, model_validator

from adaptercl.recipe.config_block import ConfigBlock

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"  # domain and stage names (they name folders)
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")  # data files a source or eval_file may name
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # OWNER/NAME
SourceKind = Literal["builtin", "url", "hub", "local"]


def source_kind(source: str) -> SourceKind:
    """builtin, url, hub or local: the rule in the module docstring. Looks at the disk (relative to the cwd)."""
    if source.startswith("builtin:"):
        return "builtin"
    if is_url(source):
        return "url"
    if source.startswith("hub:"):
        return "hub"
    path = Path(source).expanduser()
    if path.exists():
        return "local"
    spelled_as_hub_id = HUB_ID.fullmatch(source) is not None and path.suffix.lower() not in DATA_SUFFIXES
    return "hub" if spelled_as_hub_id and not Path(source.split("/")[0]).is_dir() else "local"


def hub_id(source: str) -> str:
    """The `datasets` hub id of a hub source (without the optional `hub:` prefix)."""
    return source.removeprefix("hub:")


def is_url(text: str) -> bool:
    return text.startswith(("http://", "https://"))


def url_suffix(url: str) -> str:
    """The data-file suffix of a URL's path (query string and fragment ignored), lower-case."""
    return Path(urlsplit(url).path).suffix.lower()


# Which reward feedback the SDPO/hybrid teacher is shown (`rewards.with_feedback` applies it): "format" = only
# problems of form (no answer found, malformed call) and a user reward's own feedback; "correctness" = also that
# the answer is wrong and what was expected; "none" = never.
FeedbackKind = Literal["format", "correctness", "none"]
# How a multiple-choice answer column designates its option (`domains/gold_answers.py` reads each kind).
AnswerKind = Literal["letter", "index0", "index1", "key", "text"]
# How TRL-style rewards see prompts and completions: "conversational" = message lists, "standard" = strings; "auto"
# follows each row's prompt as the source gave it (chat messages or a string), as TRL's GRPOTrainer does.
RewardFormat = Literal["auto", "conversational", "standard"]


class RewardFuncSpec(ConfigBlock):
    """A TRL-style reward made by a factory: `func(**args)` returns the reward function."""

    func: str = Field(
        description="'pkg.module:function' (or TRL's dotted 'pkg.module.function') of a factory such as "
        "trl.rewards:get_soft_overlong_punishment."
    )
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the factory.")


def template_fields(template: str) -> list[str]:
    """The column names a `prompt_template` uses, in order; ValueError for `{}`, `{0}`, `{a.b}`, `{a[0]}` or bad
    braces."""
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as err:
        raise ValueError(f"prompt_template: {err} (write {{{{ and }}}} for literal braces)") from None
    names = []
    for _, name, spec, conversion in parts:
        if name is None:
            continue
        if not name or name.isdigit() or not re.fullmatch(r"[^.\[\]]+", name) or spec or conversion:
            raise ValueError(f"prompt_template: {{{name}}} must name a dataset column, as {{question}}")
        names.append(name)
    return names


class DomainConfig(ConfigBlock):
    name: str = Field(description="Domain name, used in stages, metrics and exported adapter folders.")
    source: str = Field(
        description="'builtin:NAME' (arithmetic, mcq, toolcall, copy), a local .jsonl/.json/.parquet/.csv file, "
        "a local folder holding <split>.<ext> files, an http(s) URL of such a file, or a `datasets` hub id "
        "OWNER/NAME (or hub:ID); see `source_kind` for how they are told apart."
    )
    format: (
        Literal["gsm8k", "math500", "sciknoweval", "tooluse", "arc", "boolq", "piqa", "winogrande", "generic"] | None
    ) = Field(None, description="Row format preset of a dataset source; builtin sources imply their own.")
    fields: dict[str, str] = Field(
        default_factory=dict,
        description="generic format: dataset field for prompt, answer, demonstration, system (default: same name). "
        "What adaptercl reads; it renames no column for reward_funcs, which get the row's columns as they are, as "
        "TRL passes them (fields: {answer: answer_idx} leaves a function's answer= the row's answer column).",
    )
    reward: str | None = Field(
        None,
        description="Reward name from the REWARDS table or 'pkg.module:function'; default: the format's own. A user "
        "function with TRL's signature (parameters prompts/completions/completion_ids or **kwargs) is used as "
        "`reward_funcs: [it]`. The module is imported from the recipe file's folder, then the working directory, "
        "then Python's path (a module beside the recipe imports, as beside a script).",
    )
    reward_funcs: list[str | RewardFuncSpec] = Field(
        default_factory=list,
        description="TRL-style reward functions `f(prompts, completions, completion_ids, **columns) -> list[float "
        "| None]`, as GRPOTrainer's reward_funcs: 'pkg.module:function', TRL's dotted 'pkg.module.function', a "
        "name of trl.rewards (accuracy_reward, think_format_reward, reasoning_accuracy_reward), or {func, args} "
        "for a factory. The sample's reward is the nansum of the weighted rewards (None = not applicable). "
        "Replaces `reward`; the generic format's answer field is then optional. Modules are imported from the "
        "recipe file's folder, then the working directory, then Python's path.",
    )
    reward_weights: list[float] | None = Field(
        None, description="One weight per reward_funcs entry (TRL's reward_weights); default: all 1.0."
    )
    reward_format: RewardFormat = Field(
        "auto",
        description="How reward_funcs see prompts and completions: 'conversational' (message lists; trl.rewards "
        "functions need it), 'standard' (strings) or 'auto' (as the row's prompt was given, as TRL does).",
    )
    correct_from: list[str] | None = Field(
        None,
        description="reward_funcs: the functions that decide whether a sample is correct (the accuracy matrix, "
        "correct_frac, and SDPO/hybrid success), by the name the step log gives them (`rewards/<name>/mean`: the "
        "function's __name__, a factory's returned function's, `_<index>` added to a name used twice; `recipe "
        "validate` lists them). Default: the first function, TRL's convention of putting the task's accuracy "
        "reward first (trl.rewards.accuracy_reward, then format or length shaping): shaping rewards add to the "
        "training reward but never make a wrong answer correct or a right one incorrect.",
    )
    correct_threshold: float = Field(
        1.0,
        description="reward_funcs: a sample is correct when the sum of the correct_from functions' own rewards "
        "(unweighted: reward_weights shape the training reward, not what counts as right; a None left out, all "
        "None = not correct) is >= this. With a 0/1 accuracy reward, 1.0 means 'the answer was right'.",
    )
    prompt_template: str | None = Field(
        None,
        description="generic format: the user turn rendered from the row's columns, e.g. "
        "'{question}\n\n{options}'; a dict or list column is rendered as lettered lines 'A. ...'. Replaces "
        "fields.prompt.",
    )
    answer_options: str | list[str] | None = Field(
        None,
        description="generic format: where the options the answer column refers to are: one column holding them (a "
        "list, a dict, or the hub's {text, label}) or a list of columns, one per option in order ([choice0, "
        "choice1, choice2, choice3], as MMLU's CSVs). The answer becomes the letter of the option it designates, "
        "as prompt_template letters them (score with reward: choice_letter); answer_kind says how it is written.",
    )
    answer_kind: AnswerKind | None = Field(
        None,
        description="generic format: how the answer column designates the right option: 'letter' (A, B, ...), "
        "'index0' (0-based: 0 = A, as MMLU, HellaSwag, PIQA), 'index1' (1-based: 1 = A, as Winogrande), 'key' (a key "
        "of a dict options column or a label of {text, label}, as ARC's answerKey) or 'text' (the option's own "
        "text; needs answer_options). The answer becomes that option's letter. Default: read from the column when "
        "answer_options is given (the kind every gold value fits; more than one, e.g. indices 1-3 of 4 options, is "
        "refused naming this field), else the answer as it is. A letter-comparing reward (choice_letter, "
        "answer_tag, mcq) whose gold values are not option letters is refused at validation, never scored 0.",
    )
    feedback: FeedbackKind | None = Field(
        None,
        description="Reward feedback the SDPO/hybrid teacher sees when no sibling succeeded: 'format' (only format "
        "problems, e.g. no final answer; a user reward's feedback passes), 'correctness' (also 'X is incorrect' / "
        "what was expected: every wrong answer becomes a teacher target, an opt-in in the reference) or 'none'. "
        "Default: the format's reference behaviour (lasgroup/SDPO rewards): 'format' for gsm8k/math500 "
        "(feedback/math.py, correctness_feedback=False), 'none' for sciknoweval (feedback/mcq.py gives none), "
        "'correctness' for tooluse (feedback/tooluse.py names the expected actions); 'format' for the rest.",
    )
    system_prompt: str | None = Field(
        None, description="System message put before every prompt (replaces the default)."
    )
    subset: str | None = Field(None, description="Hub dataset config name.")
    train_split: str = Field("train", description="Hub split, or file stem in a local folder, used for training.")
    eval_split: str | None = Field(
        "test",
        description="Hub split or file stem for evaluation; None = hold out from train. Unused for a file or URL "
        "source.",
    )
    eval_file: str | None = Field(
        None,
        description="A separate local file or http(s) URL of a data file for evaluation (any source but builtin).",
    )
    num_train: int | None = Field(None, ge=1, description="Cap on training examples (builtin: how many to make).")
    skip_malformed: bool = Field(False, description="Skip (and count) malformed rows instead of failing.")
    format_patterns: list[str] | None = Field(
        None,
        description="Regexes of this domain's answer-format tokens for format-leak detection; default: the "
        "format's own (e.g. \\boxed for math500).",
    )
    # The folder of the recipe file the domain was read from (`load.load_recipe`; None for a recipe made in code).
    # Not a field: never in a dump or recipe.resolved.yaml, so a recipe moved elsewhere is still the same run.
    _recipe_dir: str | None = PrivateAttr(None)

    @property
    def import_dirs(self) -> tuple[str, ...]:
        """Where the module of a `pkg.module:function` reward is looked for before Python's own path
        (`rewards.resolve_reward`): the recipe file's folder, then the working directory, as running a script puts
        its folder first on sys.path. The recipe's folder first: a module written beside a recipe is the one it
        means, whichever folder the command runs from."""
        return tuple(dict.fromkeys(d for d in (self._recipe_dir, os.getcwd()) if d))

    def read_from(self, recipe_file: str | Path) -> None:
        """Record the recipe file the domain was read from (for `import_dirs`)."""
        self._recipe_dir = str(Path(recipe_file).absolute().parent)

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        if not re.match(NAME_PATTERN, v):
            raise ValueError(f"domain name {v!r} must match {NAME_PATTERN}")
        return v

    @field_validator("source", "eval_file")
    @classmethod
    def _check_url(cls, v: str | None) -> str | None:
        if v is not None and is_url(v) and url_suffix(v) not in DATA_SUFFIXES:
            raise ValueError(f"the URL {v!r} must name a {'/'.join(DATA_SUFFIXES)} file")
        return v

    @field_validator("fields")
    @classmethod
    def _check_fields(cls, v: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(v) - {"prompt", "answer", "demonstration", "system"})
        if unknown:
            raise ValueError(f"unknown keys {unknown}; allowed: prompt, answer, demonstration, system")
        return v

    @field_validator("correct_from", mode="before")
    @classmethod
    def _one_name_is_a_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("correct_from")
    @classmethod
    def _check_correct_from(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not v:
            raise ValueError("correct_from is empty; name at least one reward function (or leave it out: the first)")
        return v

    @field_validator("prompt_template")
    @classmethod
    def _check_template(cls, v: str | None) -> str | None:
        if v is not None:
            template_fields(v)
        return v

    @model_validator(mode="after")
    def _check_rewards_and_templates(self) -> DomainConfig:
        if self.reward_funcs and self.reward is not None:
            raise ValueError("give either reward (one native reward) or reward_funcs (TRL-style rewards), not both")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(self.reward_weights)} weights for {len(self.reward_funcs)} reward_funcs; "
                "give one weight per reward function"
            )
        generic = self.format in (None, "generic") and not self.source.startswith("builtin:")
        for key in ("prompt_template", "answer_options", "answer_kind"):
            if getattr(self, key) is not None and not generic:
                raise ValueError(f"{key} needs the generic format (a dataset source with format unset or generic)")
        if self.answer_kind in ("key", "text") and self.answer_options is None:
            raise ValueError(f"answer_kind {self.answer_kind} needs answer_options: the column(s) of the options")
        if self.answer_kind == "key" and isinstance(self.answer_options, list):
            raise ValueError("answer_kind key needs one dict options column as answer_options, not a list of columns")
        if isinstance(self.answer_options, list) and (len(set(self.answer_options)) < 2 or "" in self.answer_options):
            raise ValueError(f"answer_options: name two or more different columns, got {self.answer_options}")
        if self.prompt_template is not None and "prompt" in self.fields:
            raise ValueError("prompt_template replaces fields.prompt: give one of them")
        return self

    @field_validator("format_patterns")
    @classmethod
    def _check_patterns(cls, v: list[str] | None) -> list[str] | None:
        for pattern in v or []:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"format pattern {pattern!r} is not a valid regex ({err})") from None
        return v
