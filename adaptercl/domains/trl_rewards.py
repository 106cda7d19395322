"""TRL-style rewards: `f(prompts, completions, completion_ids, **columns) -> list[float | None]`, several per domain.

A domain names them as TRL's GRPOTrainer does:

    domains:
      - name: math
        source: data/math.jsonl                  # rows: prompt (chat messages), solution, ...
        reward_funcs: [accuracy_reward, trl.rewards:think_format_reward, my_rewards:brevity]
        reward_weights: [1.0, 0.5, 0.1]

An entry is a name of `trl.rewards` (accuracy_reward, think_format_reward, reasoning_accuracy_reward),
`pkg.module:function`, TRL's dotted `pkg.module.function`, or `{func: ..., args: {...}}` for a factory such as
`trl.rewards:get_soft_overlong_punishment`. A native reward (a REWARDS name or a `(text, example)` function) may
sit in the list too; its score is its column. A `reward: pkg.module:function` whose signature is TRL's (a parameter
named prompts, completions or completion_ids, or **kwargs: `reward_style`) is the same as a one-entry list.

What each function receives, as in TRL's `GRPOTrainer._calculate_rewards`, for the N completions of a batch (whole
groups; `Domain.score`): `prompts` and `completions` in the dataset's format (conversational: the prompt's messages
and `[{"role": "assistant", "content": text}]`; standard: the user turn's text and the completion text; the domain's
`reward_format` chooses, "auto" follows the row's prompt), `completion_ids` (token ids), and every other column of
the source row as a keyword list aligned with the completions (a column absent from a row is None there).

Columns arrive as the dataset has them, under their own names, as TRL passes them: the domain's `fields` choose
what adaptercl reads as the prompt, the answer (of native rewards, `answer_options` included), the demonstration
and the system turn, and rename nothing for these functions. So a function ported from TRL scores the same here, and
with `fields: {answer: answer_idx}` a function's `answer=` is still the row's own `answer` column; it reads the
mapped column as `answer_idx=`. A TRL-style function that declares a parameter named after a role `fields` maps
elsewhere is warned about once, when the domain loads (`fields_warning`).

How they combine (`weighted_reward`): None becomes NaN (not applicable to that sample), and the sample's reward is
the nansum over functions of weight x reward, TRL's `sum_then_normalize`. A sample for which every function
returned None is unscorable (`RewardResult.scored` False): as TRL 1.16's GRPOTrainer, it is left out of its group's
baseline (and std) and gets advantage 0 (`train.losses.group_advantages`); its reward reads 0 in the logs (TRL leaves
it out of its logged reward), and a warning is logged.

What is correct (`correct_mask`): the domain's `correct_from` functions (default: the first, TRL's accuracy-first
convention) decide it: the sum of their own, unweighted rewards (None left out) is >= `correct_threshold` (default
1.0). So `[accuracy_reward, think_format_reward]` counts a wrong answer in the right format as wrong, whatever the
weights, and a small length penalty beside an accuracy reward does not make right answers incorrect. That one
decision is `RewardResult.correct`: the accuracy matrix, `correct_frac`, and the SDPO/hybrid success
(`domain.is_success`; `distill.success_threshold` applies to native rewards only). `recipe validate` prints each
domain's rule (`TrlRewards.correct_rule`). TRL rewards give no feedback (SDPO falls back to siblings and
demonstrations).

Departures from TRL, on purpose: TRL's trainer-only keywords `trainer_state`, `log_extra`, `log_metric` and
`environments` are not passed (the functions' defaults apply); `normalize_then_sum` and async reward functions are
not offered. TRL's own SDPO counts a success by the weighted reward (`success_reward_threshold`, 1.0), so a wrong
answer with format credit can be its teacher's solution; here the correct_from decision is used.

Each step's log (metrics.jsonl, the trackers) has TRL's `rewards/<name>/mean` and `rewards/<name>/std` per function
(unweighted, over the samples where it did not return None; `metric_names`, `reward_component_stats`) beside the
combined `reward_mean`; a step where it returned None for every sample (fewer than two values, for the std) logs it
as absent, where TRL logs NaN, which a JSON line cannot hold and a chart draws as nothing anyway. TRL's
`get_callable_name` and `nanstd` are written out here, not imported: importing trl.trainer.utils takes seconds.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from adaptercl.domains.domain import Example, RewardResult
from adaptercl.domains.rewards import REWARDS, resolve_reward
from adaptercl.recipe import DomainConfig, RecipeError, RewardFuncSpec

log = logging.getLogger(__name__)

TRL_NAMES = ("accuracy_reward", "think_format_reward", "reasoning_accuracy_reward")  # trl.rewards, by bare name
TRL_PARAMETERS = frozenset({"prompts", "completions", "completion_ids"})
# Row columns TRL does not pass as keywords (its own arguments), and the arguments themselves.
RESERVED_COLUMNS = frozenset({"prompt", "completion", "completion_ids", "prompts", "completions"})
RewardStyle = Literal["native", "trl"]


def reward_style(fn: Callable) -> RewardStyle | None:
    """ "trl" for a TRL reward (a parameter named prompts/completions/completion_ids, or **kwargs), "native" for a
    `(text, example)` reward (two positional parameters, any others with defaults), None for neither."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.name in TRL_PARAMETERS or p.kind is p.VAR_KEYWORD for p in params):
        return "trl"
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in params if p.default is p.empty and p.kind is not p.VAR_POSITIONAL]
    if (len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)) and len(required) <= 2:
        return "native"
    return None


def weighted_reward(per_func: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's sum_then_normalize reward before normalisation: (nansum_f w_f x r_if [N], unscorable [N] bool).

    per_func [N, F] holds NaN where a function returned None; a row that is all NaN is unscorable (reward 0)."""
    rewards = (per_func * weights.unsqueeze(0)).nansum(dim=1)  # [N]
    return rewards, torch.isnan(per_func).all(dim=1)  # [N], [N]


def correct_mask(per_func: torch.Tensor, decides: torch.Tensor, threshold: float) -> torch.Tensor:
    """Which samples are correct: the nansum of the deciding functions' own (unweighted) rewards >= threshold; a
    sample for which every deciding function returned None is not correct.

    per_func [N, F] (NaN where a function returned None), decides [F] bool (the domain's correct_from) -> [N] bool."""
    chosen = per_func[:, decides]  # [N, K]
    return (chosen.nansum(dim=1) >= threshold) & ~torch.isnan(chosen).all(dim=1)  # [N]


@dataclass
class TrlRewards:
    """A domain's TRL-style rewards: called on a batch (`Domain.batch_reward`), or on one sample (`one`)."""

    domain: str
    names: list[str]  # what the recipe wrote, for messages
    funcs: list[Callable]
    styles: list[RewardStyle]
    weights: list[float]
    correct_threshold: float
    reward_format: Literal["auto", "conversational", "standard"]
    correct_from: tuple[int, ...] = (0,)  # indices of the functions that decide `correct` (`correct_mask`)

    def __call__(
        self, texts: list[str], completion_ids: list[list[int]], examples: list[Example]
    ) -> list[RewardResult]:
        n = len(texts)
        if n == 0:
            return []
        conversational = self.reward_format == "conversational" or (
            self.reward_format == "auto" and examples[0].conversational  # TRL looks at the first prompt too
        )
        if conversational:
            prompts: list[Any] = [ex.messages for ex in examples]
            completions: list[Any] = [[{"role": "assistant", "content": text}] for text in texts]
        else:
            prompts, completions = [ex.messages[-1]["content"] for ex in examples], list(texts)
        keys = dict.fromkeys(k for ex in examples for k in ex.columns if k not in RESERVED_COLUMNS)
        columns = {key: [ex.columns.get(key) for ex in examples] for key in keys}
        per_func = torch.empty(n, len(self.funcs))  # [N, F]
        for f, (name, fn, style) in enumerate(zip(self.names, self.funcs, self.styles)):
            where = f"domains.{self.domain}.reward_funcs[{f}] {name!r}"
            try:
                if style == "native":
                    values: Any = [fn(text, ex).score for text, ex in zip(texts, examples)]
                else:
                    values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
            except Exception as err:  # a user function's failure: one line naming it, with a hint for the format
                hint = ""
                if isinstance(err, TypeError | KeyError | IndexError):
                    other = "standard" if conversational else "conversational"
                    hint = f" (completions were passed {'conversational' if conversational else 'standard'}; "
                    hint += f"if it expects {other} ones set reward_format: {other})"
                raise RecipeError(f"{where} raised {type(err).__name__}: {err}{hint}") from err
            per_func[:, f] = torch.tensor(_column(values, n, where), dtype=torch.float32)
        rewards, unscorable = weighted_reward(per_func, torch.tensor(self.weights, dtype=torch.float32))  # [N], [N]
        if unscorable.any():
            log.warning(
                "domains.%s: every reward function returned None for %d samples; they get advantage 0 and count "
                "as neither correct nor a success",
                self.domain,
                int(unscorable.sum()),
            )
        decides = torch.zeros(len(self.funcs), dtype=torch.bool)  # [F]
        decides[list(self.correct_from)] = True
        correct = correct_mask(per_func, decides, self.correct_threshold)  # [N]
        labels = self.metric_names()
        return [
            RewardResult(float(r), bool(c), components=tuple(zip(labels, row)))
            for r, c, row in zip(rewards.tolist(), correct.tolist(), per_func.tolist())
        ]

    def metric_names(self) -> list[str]:
        """Each function's name in the step log (`rewards/<name>/mean`), as TRL's `get_callable_name`: a partial's
        wrapped function, a function's `__name__`, else its class; a name used twice gets `_<index>`."""
        names = [getattr(_unwrap(fn), "__name__", type(fn).__name__) for fn in self.funcs]
        return [f"{n}_{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]

    def correct_rule(self) -> str:
        """How `correct` is decided, for `recipe validate`: "correct = accuracy_reward >= 1.0 (of accuracy_reward,
        think_format_reward)"."""
        labels = self.metric_names()
        deciding = " + ".join(labels[i] for i in self.correct_from)
        return f"correct = {deciding} >= {self.correct_threshold} (of {', '.join(labels)})"

    def one(self, text: str, example: Example) -> RewardResult:
        """One sample through the batch call; its token ids are unknown here (None), so a function that reads
        `completion_ids` must be reached through `Domain.score`."""
        return self([text], [None], [example])[0]  # type: ignore[list-item]


def reward_component_stats(components: list[tuple[tuple[str, float], ...]]) -> dict[str, float]:
    """TRL's per-function reward log over a step's samples (`RewardResult.components` of each): `rewards/<name>/mean`
    (nanmean) and `/std` (TRL's `nanstd`, unbiased) of each function's unweighted rewards, NaN (a None) left out;
    nothing for native rewards. Samples of another domain (replay) have other names and count only under theirs. A
    mean over no value, a std over fewer than two, is left out of the log, where TRL logs NaN (module docstring)."""
    columns: dict[str, list[float]] = {}
    for sample in components:
        for name, value in sample:
            columns.setdefault(name, []).append(value)
    stats = {}
    for name, values in columns.items():
        x = torch.tensor(values, dtype=torch.float64)  # [n]
        mean = x.nanmean()
        n = (~x.isnan()).sum()
        var = ((x - mean) ** 2).nanmean() * n / (n - 1)  # NaN for fewer than 2 values, as TRL
        for key, value in (("mean", mean), ("std", var.sqrt())):
            if not value.isnan():
                stats[f"rewards/{name}/{key}"] = value.item()
    return stats


def fields_warning(cfg: DomainConfig, rewards: TrlRewards) -> str | None:
    """One line when a TRL-style function declares a parameter named after a role that `cfg.fields` maps to another
    column (`fields: {answer: answer_idx}` and `f(completions, answer, **kwargs)`): it gets the row's own column of
    that name, as TRL passes columns, not the mapped one (module docstring); None when no function does."""
    renamed = {role: column for role, column in cfg.fields.items() if column != role and role not in RESERVED_COLUMNS}
    for label, fn, style in zip(rewards.metric_names(), rewards.funcs, rewards.styles):
        try:
            params = inspect.signature(fn).parameters if style == "trl" else {}
        except (TypeError, ValueError):
            continue
        for role, column in renamed.items():
            if role in params:
                return (
                    f"domains.{cfg.name}: reward function {label} reads {role}=, which is the row's own {role!r} "
                    f"column (TRL passes columns as they are), not {column!r} that fields.{role} names; to score "
                    f"against {column!r}, name the parameter {column}"
                )
    return None


def _unwrap(fn: Callable) -> Callable:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def _column(values: Any, n: int, where: str) -> list[float]:
    """A function's output as N floats, None -> NaN; anything else is one line naming the function."""
    if not isinstance(values, list | tuple) or len(values) != n:
        got = f"{len(values)} values" if isinstance(values, list | tuple) else type(values).__name__
        raise RecipeError(f"{where} returned {got}, expected a list of {n} rewards (one per completion)")
    out = []
    for value in values:
        if value is None:
            out.append(math.nan)
        elif isinstance(value, int | float) and not isinstance(value, bool) or hasattr(value, "__float__"):
            out.append(float(value))
        else:
            raise RecipeError(f"{where} returned {value!r}; rewards must be numbers or None")
    return out


# ---------------------------------------------------------------------------------------------------- loading


def load_trl_rewards(cfg: DomainConfig) -> TrlRewards | None:
    """The domain's TRL-style rewards (imported now: a bad path or signature, or a `correct_from` name that is not
    one of them, is one line naming the field), or None when its reward is native."""
    rewards = _trl_rewards(cfg)
    if rewards is None and cfg.correct_from is not None:
        raise RecipeError(
            f"domains.{cfg.name}.correct_from: only TRL-style rewards (reward_funcs) take it; a native reward sets "
            "`correct` itself"
        )
    return rewards


def _trl_rewards(cfg: DomainConfig) -> TrlRewards | None:
    if cfg.reward_funcs:
        entries = [_load_entry(cfg, i, entry) for i, entry in enumerate(cfg.reward_funcs)]
        weights = cfg.reward_weights or [1.0] * len(entries)
    elif cfg.reward is not None and cfg.reward not in REWARDS:
        fn = _import(cfg, cfg.reward, f"domains.{cfg.name}.reward")
        style = reward_style(fn)
        if style is None:
            raise RecipeError(f"domains.{cfg.name}.reward {cfg.reward!r}: {_bad_signature(fn)}")
        if style == "native":
            return None
        entries, weights = [(cfg.reward, fn, style)], [1.0]
    else:
        return None
    names, funcs, styles = (list(column) for column in zip(*entries))
    rewards = TrlRewards(cfg.name, names, funcs, styles, weights, cfg.correct_threshold, cfg.reward_format)
    rewards.correct_from = _correct_from(cfg, rewards.metric_names())
    return rewards


def _correct_from(cfg: DomainConfig, labels: list[str]) -> tuple[int, ...]:
    """The indices of the functions `cfg.correct_from` names (by their step-log names), default the first."""
    if cfg.correct_from is None:
        return (0,)
    unknown = [name for name in cfg.correct_from if name not in labels]
    if unknown:
        raise RecipeError(
            f"domains.{cfg.name}.correct_from: no reward function named {', '.join(map(repr, unknown))}; "
            f"the domain's functions are {', '.join(labels)}"
        )
    return tuple(sorted({labels.index(name) for name in cfg.correct_from}))


def _load_entry(cfg: DomainConfig, i: int, entry: str | RewardFuncSpec) -> tuple[str, Callable, RewardStyle]:
    where = f"domains.{cfg.name}.reward_funcs[{i}]"
    if isinstance(entry, RewardFuncSpec):
        factory = _import(cfg, entry.func, where)
        try:
            fn = factory(**entry.args)
        except Exception as err:
            raise RecipeError(f"{where} {entry.func!r}: calling it with args {entry.args} failed ({err})") from None
        name = entry.func
    else:
        fn, name = _import(cfg, entry, where), entry
    style = reward_style(fn) if callable(fn) else None
    if style is None:
        raise RecipeError(f"{where} {name!r}: {_bad_signature(fn)}")
    return name, fn, style


def _import(cfg: DomainConfig, spec: str, where: str) -> Callable:
    """A reward function by trl.rewards name, REWARDS name, 'pkg.module:function' or 'pkg.module.function', imported
    from the domain's `import_dirs` (the recipe's folder, the working directory) before Python's path."""
    if spec in TRL_NAMES:
        spec = f"trl.rewards:{spec}"
    elif ":" not in spec and "." in spec and spec not in REWARDS:
        module, _, attr = spec.rpartition(".")
        spec = f"{module}:{attr}"
    try:
        return resolve_reward(spec, cfg.import_dirs)
    except RecipeError as err:  # "reward 'x': ..." -> "domains.NAME.reward_funcs[i] 'x': ..."
        raise RecipeError(f"{where} {str(err).removeprefix('reward ')}") from None


def _bad_signature(fn: Any) -> str:
    try:
        shown = f"{getattr(fn, '__name__', type(fn).__name__)}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        shown = repr(fn)
    return (
        f"{shown} is neither a native reward (text, example) -> RewardResult nor a TRL reward "
        "(prompts, completions, completion_ids, **kwargs) -> list[float | None]"
    )
