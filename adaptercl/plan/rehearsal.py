"""The wall time of a recipe from its rehearsal on this machine (`adaptercl recipe plan FILE --rehearsal JSON`).

    rehearsal = read_rehearsal("rehearsal-quickstart/rehearsal.json")    # written by `adaptercl recipe rehearse`
    wall = measured_wall_time(recipe, rehearsal, plan.wall_time)         # the model's figures where none was measured
    print(wall.render())    # `wall time measured on <machine> (...): ~N min = ...`, then every term's arithmetic

Owns the rehearsal file's reading and the arithmetic that scales what a rehearsal measured (a few steps a stage, a
few examples a domain, a few diagnostic prompts) to the whole recipe, term by term; the rehearsal itself is
`run/rehearsal.py`'s. Per stage, with its figures (or, for a stage the rehearsal did not reach, those of a rehearsed
stage of the same method, else of any, said in the term):

    rollouts     W_r + S x n x L x s_tok     s_tok = the steady steps' rollout seconds / their sampled tokens, L = the
                                             sampled mean response (at most the cap), n = prompts_per_step x G
    training     W_t + S x t_step x n / n_r  t_step = the steady steps' mean (step less rollout: reward, teacher
                 + K x t_ckpt + t_stage      targets, forward and backward, optimiser); K = 2 + (S - 1) // every
                 + t_save                    checkpoints; the set-up of the stage's training; saving its adapters
    diagnostics  per prompt x prompts        teacher lift, stage KL; response drift per probe x probes x domains;
                 + (1 + S // d) x t_pd       parameter drift after the stage and every monitor.drift_every (d) steps
    evaluation   sum over domains of e_d x N_d after each stage, and before the first with W_e

W_*: what the first step (or evaluation) took beyond the steady rate, counted once (the warm-up: AdamW's state,
kernels, an engine's start); with one step rehearsed its rate is the first step's. Once a run: start-up (the
process until the rehearsal began), loading the base, and the rest of the run outside every phase (the same
number of stages runs both times). A term nothing rehearsed is the time model's (`wall_time.py`), as labelled there.
No torch.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from adaptercl.recipe import METHODS, RecipeConfig, RecipeError, StageConfig, resolved_yaml

REHEARSAL_KIND, REHEARSAL_VERSION = "adaptercl rehearsal", 1  # rehearsal.json's kind and version
# part -> the summary phase it belongs to, and the time model's part (`wall_time.PARTS`) that stands in for it
PARTS = {
    "rollout": ("rollouts", "rollout_step"),
    "train": ("training", "train_step"),
    "train_other": ("training", None),  # checkpoints, a stage's set-up of its training, saving its adapters
    "eval": ("evaluation", "evaluation"),
    "teacher_lift": ("diagnostics", "teacher_lift"),
    "stage_kl": ("diagnostics", "stage_kl"),
    "response_drift": ("diagnostics", "response_drift"),
    "parameter_drift": ("diagnostics", "parameter_drift"),
    "once": ("start-up and load", None),
}


def spread(values: list[float]) -> dict[str, float]:
    """n, mean, median, min and max of some measurements."""
    if not values:
        return {"n": 0}
    return {"n": len(values), "mean": statistics.fmean(values), "median": statistics.median(values),
            "min": min(values), "max": max(values)}  # fmt: skip


def recipe_hash(recipe: RecipeConfig) -> str:
    """The recipe's identity for a rehearsal: its resolved YAML but output_dir (a rehearsal runs elsewhere)."""
    text = resolved_yaml(recipe.model_copy(update={"output_dir": "-"}))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class _Read(BaseModel):
    """What the wall time reads of a rehearsal.json, typed (`read_rehearsal` checks a file against it; the figures
    stay the file's dicts). Fields it does not read are kept as they are."""

    model_config = ConfigDict(extra="allow")


class _Step(_Read):
    rollout_s: float = Field(ge=0)
    train_s: float = Field(ge=0)
    tokens: float = Field(ge=0)
    sequences: int = Field(gt=0)


class _Seconds(_Read):
    seconds: float = Field(ge=0)


class _Diagnostic(_Seconds):
    prompts: int = Field(gt=0)


class _Eval(_Seconds):
    examples: int = Field(gt=0)


class _Stage(_Read):
    method: str | None = None
    steps: list[_Step] | None = None
    checkpoint_s: list[float] | None = None
    stage_overhead_s: float | None = None
    save_s: float | None = None
    parameter_drift: _Seconds | None = None
    teacher_lift: _Diagnostic | None = None
    stage_kl: _Diagnostic | None = None
    response_drift: _Diagnostic | None = None
    eval: dict[str, _Eval] | None = None


class _Once(_Read):
    startup: float | None = None
    load: float | None = None
    other: float | None = None


class _Rehearsal(_Read):
    stages: dict[str, _Stage]
    eval_before: dict[str, _Eval] | None = None
    eval_sizes: dict[str, int] = {}
    eval_sizes_at: int = 0
    seconds: _Once = _Once()
    machine: dict[str, Any] = {}
    recipe: dict[str, Any] = {}


def read_rehearsal(path: str | Path) -> dict[str, Any]:
    """A rehearsal.json; RecipeError (one line) when it is missing, a folder, not JSON, not a rehearsal of this
    version, or one whose figures the wall time reads are missing or of the wrong kind (edited or cut short)."""
    path = Path(path)
    fix = "write one with `adaptercl recipe rehearse FILE --out DIR` and pass DIR/rehearsal.json"
    if path.is_dir():
        raise RecipeError(f"--rehearsal: {str(path)!r} is a folder; pass the rehearsal.json in it")
    if not path.is_file():
        raise RecipeError(f"--rehearsal: {str(path)!r} does not exist; {fix}")
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RecipeError(f"--rehearsal: {str(path)!r} is not JSON ({err}); {fix}") from None
    if not isinstance(data, dict) or data.get("kind") != REHEARSAL_KIND or data.get("version") != REHEARSAL_VERSION:
        raise RecipeError(f"--rehearsal: {str(path)!r} is not a rehearsal (version {REHEARSAL_VERSION}); {fix}")
    try:
        _Rehearsal.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise RecipeError(f"--rehearsal: {str(path)!r} is damaged ({where}: {first['msg']}); {fix}") from None
    return data


@dataclass
class Term:
    part: str  # a PARTS key
    stage: str | None
    seconds: float
    measured: bool
    how: str  # the arithmetic, with its figures


@dataclass
class MeasuredWallTime:
    machine: str
    lengths: str  # how response lengths were taken
    terms: list[Term]
    cap_s: float  # the total with every rollout response at the cap
    notes: list[str] = field(default_factory=list)
    model_figures: list[str] = field(default_factory=list)  # the time model's figures, when a term is its

    @property
    def total_s(self) -> float:
        return sum(t.seconds for t in self.terms)

    def phase_s(self, phase: str) -> float:
        return sum(t.seconds for t in self.terms if PARTS[t.part][0] == phase)

    def render(self) -> str:
        phases = " + ".join(f"{p} {duration(self.phase_s(p))}" for p in dict.fromkeys(v[0] for v in PARTS.values()))
        head = (f"wall time measured on {self.machine} ({self.lengths}): ~{duration(self.total_s)} = {phases}; every "
                f"rollout response at the cap: ~{duration(self.cap_s)}")  # fmt: skip
        rows = [f"  {'measured' if t.measured else 'model':<8} {t.how}" for t in self.terms]
        return "\n".join([head, *self.notes, "time terms (adaptercl/plan/rehearsal.py):", *rows, *self.model_figures])


def duration(seconds: float) -> str:
    """'N s' under a minute (one decimal under 10 s), 'N min' under 90 minutes (one decimal under 10), else
    'N.N h': never a figure rounded to 0 (a short CPU recipe's card figure read '~0.0 h')."""
    minutes = seconds / 60
    if minutes >= 90:
        return f"{minutes / 60:.1f} h"
    if seconds < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    return f"{minutes:.1f} min" if minutes < 10 else f"{minutes:.0f} min"


def _figure(rehearsal: dict, stage: StageConfig, key: str) -> tuple[Any, str]:
    """(stage's figure `key`, '' ) or, if not measured there, that of a rehearsed stage of the same method, else of
    any (with ' (as <stage>)'); (None, '') when no stage measured it."""
    stages = rehearsal["stages"]
    has = {n: s.get(key) not in (None, [], {}) for n, s in stages.items()}  # 0 s is a measurement
    if has.get(stage.name):
        return stages[stage.name][key], ""
    same = [n for n, s in stages.items() if has[n] and s.get("method") == stage.method]
    other = same or [n for n in stages if has[n]]
    return (stages[other[0]][key], f" (as {other[0]})") if other else (None, "")


def _step_rates(steps: list[dict]) -> tuple[float, float, float, float, float]:
    """(s a rollout token, rollout warm-up s, s a training step, training warm-up s, sampled mean length) of a stage's
    rehearsed steps: the first is the warm-up, the rest steady (one step: its own rate)."""
    steady = steps[1:] or steps
    per_token = sum(s["rollout_s"] for s in steady) / max(1.0, sum(s["tokens"] for s in steady))
    train = statistics.fmean(s["train_s"] for s in steady)
    first = steps[0]
    length = sum(s["tokens"] for s in steps) / sum(s["sequences"] for s in steps)
    warm_rollout, warm_train = (
        max(0.0, first["rollout_s"] - per_token * first["tokens"]),
        max(0.0, first["train_s"] - train),
    )
    return per_token, warm_rollout, train, warm_train, length


def _eval_sizes(recipe: RecipeConfig, rehearsal: dict) -> dict[str, int]:
    """Examples the run evaluates per domain: examples_per_domain, or a smaller eval set the rehearsal found."""
    sizes, at, n = rehearsal.get("eval_sizes", {}), rehearsal.get("eval_sizes_at", 0), recipe.eval.examples_per_domain
    return {d.name: min(n, sizes[d.name]) if sizes.get(d.name, at) < at else n for d in recipe.domains}


def _per_example(rehearsal: dict) -> tuple[dict[str, float], dict[str, float]]:
    """(steady seconds an example per domain, the first evaluation's seconds and examples per domain): the mean of
    the evaluations after the stages, else the first's."""
    after: dict[str, list[float]] = {}
    for stage in rehearsal["stages"].values():
        for domain, e in (stage.get("eval") or {}).items():
            after.setdefault(domain, []).append(e["seconds"] / e["examples"])
    before = rehearsal.get("eval_before") or {}
    for domain, e in before.items():
        after.setdefault(domain, [e["seconds"] / e["examples"]])
    return {d: statistics.fmean(v) for d, v in after.items()}, before


def measured_wall_time(recipe: RecipeConfig, rehearsal: dict, model: Any = None) -> MeasuredWallTime:
    """The recipe's wall time from `rehearsal` (see the module docstring); `model`: the time model's `WallTime` for
    the parts nothing rehearsed (None: those parts are left out, and said)."""
    terms: list[Term] = []
    lengths: list[tuple[str, float, int]] = []
    cap_extra = 0.0  # what rollouts at the cap would add
    for stage in recipe.stages:
        cap_extra += _stage_terms(recipe, stage, rehearsal, terms, lengths)
    per_example, before = _per_example(rehearsal)
    if per_example:
        sizes, fallback = _eval_sizes(recipe, rehearsal), statistics.fmean(per_example.values())
        one = sum(per_example.get(d, fallback) * sizes[d] for d in sizes)
        first = sum(e["seconds"] for e in before.values())
        warm = max(0.0, first - sum(per_example.get(d, fallback) * e["examples"] for d, e in before.items()))
        count = len(recipe.stages) + 1
        each = ", ".join(f"{d} {sizes[d]} x {1e3 * per_example.get(d, fallback):.0f} ms" for d in sizes)
        how = f"evaluation: {count} x ({each}) = {count} x {one:.1f} s + warm-up {warm:.1f} s"
        terms.append(Term("eval", None, warm + count * one, True, f"{how} = {warm + count * one:.1f} s"))
    once = {k: v for k, v in rehearsal.get("seconds", {}).items() if k in ("startup", "load", "other") and v}
    if once:
        how = "once a run: " + ", ".join(f"{k} {v:.1f} s" for k, v in once.items())
        terms.append(Term("once", None, sum(once.values()), True, how))
    notes: list[str] = []
    from_model = _fill_from_model(terms, notes, model, per_example)
    if recipe_hash(recipe) != rehearsal.get("recipe", {}).get("hash"):
        notes.append("the rehearsal was of another recipe (or other overrides): its per-token, per-step, per-example "
                     "and per-prompt figures are scaled to this one; rehearse this recipe for its own")  # fmt: skip
    if rehearsal.get("stopped"):
        notes.append(f"the rehearsal stopped early ({rehearsal['stopped']}): a stage it did not reach takes another's "
                     "figures, as its terms say")  # fmt: skip
    total = sum(t.seconds for t in terms)
    figures = model.render().splitlines()[1:] if from_model else []  # the model's figures, labelled as it labels them
    return MeasuredWallTime(
        _machine(rehearsal), _lengths(rehearsal, lengths), terms, total + cap_extra, notes, figures
    )


def _stage_terms(recipe: RecipeConfig, stage: StageConfig, rehearsal: dict, terms: list[Term],
                 lengths: list[tuple[str, float, int]]) -> float:  # fmt: skip
    """Append the stage's terms (training, rollouts, diagnostics) to `terms` and its (sampled mean length, cap) to
    `lengths`; return the seconds rollouts at the cap would add."""
    cfg, name = recipe.eval, stage.name
    steps_n, cap = stage.optim.steps, stage.rollout.max_new_tokens
    n = stage.optim.prompts_per_step * stage.rollout.group_size

    def add(part: str, seconds: float, how: str) -> None:
        terms.append(Term(part, name, seconds, True, f"{how} = {seconds:.1f} s"))

    cap_extra = 0.0
    steps, from_ = _figure(rehearsal, stage, "steps")
    if steps:
        per_token, warm_r, t_step, warm_t, sampled = _step_rates(steps)
        length = min(sampled, cap)
        lengths.append((name, length, cap))
        cap_extra = steps_n * n * (cap - length) * per_token
        add("rollout", warm_r + steps_n * n * length * per_token, f"{name} rollouts{from_}: {steps_n} steps x {n} "
            f"sequences x {length:.1f} tokens (sampled mean; cap {cap}) x {1e3 * per_token:.3g} ms a token + warm-up "
            f"{warm_r:.1f} s")  # fmt: skip
        n_r = steps[0]["sequences"]
        scale = f" x {n}/{n_r} sequences" if n != n_r else ""
        add("train", warm_t + steps_n * t_step * n / n_r, f"{name} training steps{from_}: {steps_n} x {t_step:.2f} s"
            f"{scale} + warm-up {warm_t:.1f} s")  # fmt: skip
    ckpt, from_ = _figure(rehearsal, stage, "checkpoint_s")
    if ckpt:
        k, each = 2 + (steps_n - 1) // stage.monitor.checkpoint_every, statistics.fmean(ckpt)
        add("train_other", k * each, f"{name} checkpoints{from_}: {k} x {each:.2f} s")
    for key, what in (("stage_overhead_s", "training set-up"), ("save_s", "saving its adapters")):
        value, from_ = _figure(rehearsal, stage, key)
        if value is not None:
            add("train_other", value, f"{name} {what}{from_}")
    drift, from_ = _figure(rehearsal, stage, "parameter_drift")
    reports = int(cfg.parameter_drift) + (steps_n // stage.monitor.drift_every if stage.monitor.drift_every else 0)
    if drift and reports:
        add("parameter_drift", reports * drift["seconds"], f"{name} parameter drift{from_}: {reports} x "
            f"{drift['seconds']:.2f} s")  # fmt: skip
    wanted = {
        "teacher_lift": cfg.teacher_lift_prompts if METHODS[stage.method].needs_teacher else 0,
        "stage_kl": cfg.stage_kl_prompts,
        "response_drift": cfg.drift_probes * len(recipe.domains),
    }
    for part, count in wanted.items():
        got, from_ = _figure(rehearsal, stage, part)
        if count and got:
            each = got["seconds"] / got["prompts"]
            add(part, count * each, f"{name} {part.replace('_', ' ')}{from_}: {count} prompts x {each:.2f} s")
    return cap_extra


def _fill_from_model(terms: list[Term], notes: list[str], model: Any, per_example: dict) -> bool:
    """A part no stage rehearsed: the time model's, labelled so, or left out and said; whether any was the model's."""
    measured, count = {t.part for t in terms}, len(terms)
    for part, (_, model_part) in PARTS.items():
        if part in measured or model_part is None or (part == "eval" and per_example):
            continue
        seconds = model.parts[model_part].seconds if model is not None else 0.0
        if seconds:
            terms.append(Term(part, None, seconds, False, f"{part.replace('_', ' ')}: not rehearsed; the time model's "
                              f"{seconds:.0f} s on an {model.card}-class card (recipe plan's figures)"))  # fmt: skip
    if model is None and not {"rollout", "train"} <= measured:
        notes.append("no training step was rehearsed: the estimate lacks training and rollouts")
    return len(terms) > count


def _machine(rehearsal: dict) -> str:
    return rehearsal.get("machine", {}).get("label", "this machine")


def _lengths(rehearsal: dict, lengths: list[tuple[str, float, int]]) -> str:
    """How the estimate takes response lengths: as sampled in the rehearsal, or at the cap (random weights)."""
    if rehearsal.get("random_weights"):
        return "random weights: responses as sampled, at the cap (a random model never ends one)"
    if not lengths:
        return "no rollout rehearsed: the time model's responses, at the cap"
    shown = ", ".join(f"{name} {length:.1f} of {cap}" for name, length, cap in lengths)
    return f"responses at the rehearsal's sampled mean length, not the cap: {shown} tokens"
