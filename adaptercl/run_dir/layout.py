"""The run directory: the one module that knows its layout, what "finished" means, and how a directory is claimed.

    recipe.resolved.yaml
    stage-00-before/eval.json, done.json        row 0 of the accuracy matrix (before any training); lm_eval.json
    stage-NN-<name>/adapter/                    this stage's own adapter (PEFT format)
                    combined_adapter/           one PEFT adapter whose ΔW is the sum of the adapters making up
                                                the evaluated model (done.json "adapters"): ship this one
                    teacher/                    sdpo/sdft/hybrid: the self-teacher at stage end (teacher.json +
                                                adapter/ in PEFT format; `teacher.kinds.restore_teacher` loads it)
                    teacher_lift.json           sdpo/sdft/hybrid: the teacher's greedy accuracy with its context
                                                minus the student's at stage start (`run/diagnostics.py`)
                    metrics.jsonl eval.json done.json
                    lm_eval.json                eval.lm_eval.tasks: lm-eval's metrics per task (`lm_eval_probes`)
                    samples.jsonl               a few rollout samples per step (`samples.py`)
                    micro_batch.json            optim.micro_batch_size set: the micro-batch trained with and why
                                                (`train/micro_batch.py`; auto: the plan's peak on this card)
                    drift.json                  parameter and response drift vs the base; stage_kl: forward KL
                                                from the previous stage's policy (`run.diagnostics.stage_kl`);
                                                seconds: the wall time of each
                    checkpoint/                 resume point while the stage runs; its last one marks the
                                                stage trained (state.json `trained`); removed when done
    summary.json                                accuracy matrix, CL metrics (ACC, BWT, FWT, forgetting, ...)
    report.md, plots/                           the run report (`adaptercl report RUN_DIR` rebuilds it)
    rollout_engine.jsonl                        rollout.engine auto: one line per switch from a failed vLLM to
                                                transformers: time, phase, the error (`rollout/fallback.py`)
    cpu_paths.jsonl                             one line per start of the run: what it computes with on the CPU
                                                (MKL's branch and why, the packed-weight path per dtype,
                                                rollout.dtype resolved: `rollout/precision.py`)

Every file is written atomically (`system/atomic.py`); a stage's `done.json` is written last and marks it finished. The
run (`run/sequence.py`), `ship/export.py`, `measure/report.py` and the stage (`train/stage.py`) reach these paths only
through `RunDir` and `StageDir`, and read the records back through their `read_*` methods (`system.read_record`): a
record that does not parse (empty, as a copy onto a full disk leaves it; cut short; not JSON) is one `RecipeError`
line naming it and what to delete to redo it, for every command alike; a done.json that does not parse never marks a
stage finished. No torch import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from adaptercl.adapters import stage_dir_name
from adaptercl.recipe import RecipeConfig, RecipeError, resolve_recipe, resolved_yaml
from adaptercl.run_dir.growth import growth_refusal
from adaptercl.system import append_line, read_record, write_json, write_text

RECIPE_FILE = "recipe.resolved.yaml"
SUMMARY_FILE = "summary.json"
REPORT_FILE = "report.md"
PLOTS_DIR = "plots"
ENGINE_SWITCHES_FILE = "rollout_engine.jsonl"
CPU_PATHS_FILE = "cpu_paths.jsonl"
BEFORE_DIR = "stage-00-before"
# a recipe.resolved.yaml that does not parse: the run's recipe, rerun, writes it again (`RunDir.claim`)
RECIPE_FIX = "delete it; `adaptercl recipe run` with the run's recipe writes it again"


@dataclass(frozen=True)
class StageDir:
    """One stage's folder (or `stage-00-before`, which has only eval.json and done.json)."""

    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def adapter(self) -> Path:
        return self.path / "adapter"

    @property
    def combined_adapter(self) -> Path:
        return self.path / "combined_adapter"

    @property
    def teacher(self) -> Path:
        return self.path / "teacher"

    @property
    def checkpoint(self) -> Path:
        return self.path / "checkpoint"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def samples(self) -> Path:
        return self.path / "samples.jsonl"

    @property
    def eval(self) -> Path:
        return self.path / "eval.json"

    @property
    def drift(self) -> Path:
        return self.path / "drift.json"

    @property
    def lm_eval(self) -> Path:
        return self.path / "lm_eval.json"

    @property
    def teacher_lift(self) -> Path:
        return self.path / "teacher_lift.json"

    @property
    def micro_batch(self) -> Path:
        return self.path / "micro_batch.json"

    @property
    def done(self) -> Path:
        return self.path / "done.json"

    def is_done(self) -> bool:
        """Whether done.json marks the stage finished; one that does not parse is a RecipeError naming it (never a
        finished stage)."""
        if not self.done.is_file():
            return False
        self.read_done()
        return True

    def read_done(self) -> dict[str, Any]:
        return self._read(self.done, keys=("adapters",))

    def read_eval(self) -> dict[str, Any]:
        return self._read(self.eval)

    def read_adapter_config(self, folder: Path | None = None) -> dict[str, Any]:
        """adapter_config.json (PEFT's) of `folder`, default adapter/, read before PEFT reads it."""
        return self._read((folder or self.adapter) / "adapter_config.json")

    def read_drift(self) -> dict[str, Any] | None:
        """The stage's drift.json, or None where it was not measured."""
        return self._read(self.drift, optional=True) if self.drift.is_file() else None

    def write_eval(self, row: dict[str, Any]) -> None:
        write_json(self.eval, row)

    def write_lm_eval(self, result: dict[str, Any]) -> None:
        write_json(self.lm_eval, result)

    def read_lm_eval(self) -> dict[str, Any] | None:
        """The lm-eval probe results (`measure/lm_eval.py`), or None where none were configured."""
        return self._read(self.lm_eval, optional=True) if self.lm_eval.is_file() else None

    def write_drift(self, drift: dict[str, Any]) -> None:
        write_json(self.drift, drift)

    def write_teacher_lift(self, lift: dict[str, Any]) -> None:
        write_json(self.teacher_lift, lift)

    def read_teacher_lift(self) -> dict[str, Any] | None:
        """The stage-start teacher lift (`run.diagnostics.teacher_lift`), or None where it was not measured."""
        return self._read(self.teacher_lift, optional=True) if self.teacher_lift.is_file() else None

    def write_micro_batch(self, record: dict[str, Any]) -> None:
        write_json(self.micro_batch, record)

    def mark_done(self, info: dict[str, Any]) -> None:
        """Write done.json, the stage's last file."""
        write_json(self.done, info)

    def _read(self, path: Path, keys: tuple[str, ...] = (), optional: bool = False) -> dict[str, Any]:
        """One of the stage's records; one that does not parse names what to delete: the stage's folder (the whole
        stage done again), or for a measurement the stage can go without (`optional`) the file alone."""
        redo = f"delete the folder {self.path} to redo the stage (and any later stage's folder: each trained on it)"
        return read_record(path, f"delete it, or {redo.removeprefix('delete ')}" if optional else redo, keys)


@dataclass(frozen=True)
class RunDir:
    """A run directory; `recipe` (when known) names its stage folders."""

    path: Path
    recipe: RecipeConfig

    @property
    def before(self) -> StageDir:
        return StageDir(self.path / BEFORE_DIR)

    def stage(self, index: int) -> StageDir:
        return StageDir(self.path / stage_dir_name(self.recipe, index))

    def stages(self) -> list[StageDir]:
        return [self.stage(i) for i in range(len(self.recipe.stages))]

    @property
    def summary(self) -> Path:
        return self.path / SUMMARY_FILE

    @property
    def report(self) -> Path:
        return self.path / REPORT_FILE

    @property
    def plots(self) -> Path:
        return self.path / PLOTS_DIR

    @property
    def engine_switches(self) -> Path:
        return self.path / ENGINE_SWITCHES_FILE

    def record_engine_switch(self, record: dict[str, Any]) -> None:
        """Append one switch of the rollout engine (`rollout.fallback.EngineFailure.record`)."""
        self.path.mkdir(parents=True, exist_ok=True)
        append_line(self.engine_switches, json.dumps(record))

    @property
    def cpu_paths(self) -> Path:
        return self.path / CPU_PATHS_FILE

    def record_cpu_paths(self, record: dict[str, Any]) -> None:
        """Append what this start of the run computes with on the CPU (`rollout.precision.cpu_paths`), timed."""
        self.path.mkdir(parents=True, exist_ok=True)
        stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
        append_line(self.cpu_paths, json.dumps({"time": stamp, **record}))

    def is_finished(self) -> bool:
        """Every stage is done and the summary is written, covering every domain (a grown run adds domains)."""
        if not (all(s.is_done() for s in self.stages()) and self.summary.is_file()):
            return False
        return self.read_summary()["domains"] == [d.name for d in self.recipe.domains]

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_json(self.summary, summary)

    def read_summary(self, needs: tuple[str, ...] = ()) -> dict[str, Any]:
        return read_summary(self.summary, needs)

    def claim(self) -> None:
        """Write recipe.resolved.yaml, or check that the directory holds a run of this same recipe or of one this
        recipe extends (`growth.py`: stages and domains appended), which it then records as the run's."""
        text = resolved_yaml(self.recipe)
        existing = self.path / RECIPE_FILE
        if existing.is_file():
            if existing.read_text() == text:
                return
            old_raw = read_record(existing, RECIPE_FIX)
            try:
                old = resolve_recipe(old_raw)
            except RecipeError:  # written by an older adaptercl whose grammar differs
                raise RecipeError(
                    f"output_dir {str(self.path)!r} holds a run of a different recipe; choose another output_dir "
                    "(or delete that folder to start over)"
                ) from None
            refusal = growth_refusal(self._produced_part(old), self.recipe)
            if refusal is not None:
                raise RecipeError(f"output_dir {str(self.path)!r} holds a run of a different recipe: {refusal}")
        write_text(existing, text)

    def _produced_part(self, old: RecipeConfig) -> RecipeConfig:
        """The part of the stored recipe `old` the run has produced something for, which a new recipe must keep: the
        stages whose folder exists (started or done), and the domains up to the last one an evaluation row holds or
        a kept stage trains. The rest (say, stages of an attempt to grow the run that failed before they started)
        may still change."""
        stored = RunDir(self.path, old)
        started = 0
        while started < len(old.stages) and stored.stage(started).path.is_dir():
            started += 1
        used = {s.domain for s in old.stages[:started]}
        for stage_dir in [stored.before, *stored.stages()[:started]]:
            if stage_dir.eval.is_file():
                used |= set(stage_dir.read_eval())
        kept = max((i + 1 for i, d in enumerate(old.domains) if d.name in used), default=0)
        return old.model_copy(update={"stages": old.stages[:started], "domains": old.domains[:kept]})


def read_summary(path: str | Path, needs: tuple[str, ...] = ()) -> dict[str, Any]:
    """A run's summary.json (`path`: the file); one that does not parse, or lacks the accuracy matrix or a key of
    `needs`, is a RecipeError naming it."""
    fix = "delete it; `adaptercl recipe run` with the run's recipe writes it again from the stages' records"
    return read_record(path, fix, keys=("domains", "stages", "accuracy", *needs))


def open_run_dir(path: str | Path, command: str) -> RunDir:
    """The run directory at `path` with the recipe it stores; one-line errors name `command` and what is missing."""
    path = Path(path)
    resolved = path / RECIPE_FILE
    if not resolved.is_file():
        raise RecipeError(f"{command}: {str(path)!r} is not a run directory (no {RECIPE_FILE})")
    return RunDir(path, resolve_recipe(read_record(resolved, RECIPE_FIX)))


def open_finished_run(path: str | Path, command: str) -> tuple[RunDir, dict[str, Any]]:
    """The finished run at `path` and its summary, or a one-line RecipeError naming what is missing."""
    run = open_run_dir(path, command)
    for stage in run.stages():
        if not stage.is_done():
            raise RecipeError(
                f"{command}: run {str(run.path)!r} is unfinished ({stage.name} has no done.json); finish it with "
                "`adaptercl recipe run` first"
            )
        if not (stage.adapter / "adapter_config.json").is_file():
            raise RecipeError(f"{command}: {stage.name} has no adapter/ folder; the run directory is incomplete")
        stage.read_adapter_config()  # PEFT's own file, parsed here: one that does not is named, not a traceback
        if (stage.combined_adapter / "adapter_config.json").is_file():
            stage.read_adapter_config(stage.combined_adapter)
    if not run.summary.is_file():
        raise RecipeError(
            f"{command}: run {str(run.path)!r} has no {SUMMARY_FILE}; rerun `adaptercl recipe run` on it"
        )
    return run, run.read_summary()
