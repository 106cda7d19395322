"""Experiment tracking: the run's events (`run.sequence.run_recipe`'s `on_event`) forwarded to TensorBoard, wandb or
trackio.

    report_to: [tensorboard, wandb]       # recipe; or one name; default none (see recipe/log_block.py)

What each tracker gets, on one global step that runs on across stages (stage k's step s is s plus the steps of the
stages before it):
- every metrics.jsonl step line, each number as `<stage dir>/<key>` (e.g. `stage-01-math/reward_mean`);
- the step's kept rollout samples (samples.jsonl) as a table `<stage dir>/samples` (TensorBoard: a markdown table);
- each stage's evaluation row as `eval/<domain>` (accuracy) and `eval_reward/<domain>`, at the stage's last step
  (row 0, before training, at step 0);
- at the end, the continual-learning metrics of summary.json as `cl/<metric>`.

Where it lands: TensorBoard event files in `<output_dir>/tensorboard/<run name>/`; wandb in `<output_dir>/wandb/`,
in offline mode when neither `WANDB_API_KEY`, `WANDB_MODE` nor a `wandb login` (.netrc) says otherwise (`wandb sync`
uploads it later); trackio in its local SQLite store (`TRACKIO_DIR`, default ~/.cache/huggingface/trackio; `trackio
show` opens it) — no Space is created. Each backend's package is an optional extra, imported only when a recipe names
it; `require_trackers` (called by `preflight`) names the extra to install in one line.

Tracking runs in the training process only where `is_main_process()` (rank 0 under torch.distributed's RANK), and
starts at the run's first `load` event, so a rerun of a finished run opens no tracker run. A resumed or grown run
continues the tracker runs it started before (`<output_dir>/tracking.json`: wandb's run id, resumed with
`resume="allow"`, offline too; trackio's run name, resumed with `resume="allow"`; TensorBoard's folder, where the new
process adds an event file, TensorBoard reading the folder's files as one run). tracking.json `logged` keeps the last
global step logged of each kind (step lines, evaluation rows, CL metrics): a resumed run skips what an earlier process
logged (the steps since the checkpoint it resumes from), so each step is logged once, and TensorBoard flushes every
call, so what `logged` names is on disk when the process is killed. (A collapse-guard rollback within a process logs
its redone steps again, next to the values it rolled back.) No torch import here.
"""

from __future__ import annotations

import hashlib
import importlib.util
import netrc
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from adaptercl.adapters import stage_dir_name
from adaptercl.recipe import RecipeConfig, RecipeError
from adaptercl.run_dir import BEFORE_DIR, SAMPLE_COLUMNS, markdown_table
from adaptercl.system import read_record, write_json

TRACKING_FILE = "tracking.json"  # in output_dir: each tracker's run (wandb id, trackio name), for a resume
LOGGED = "logged"  # tracking.json: the last global step logged of each kind, by any process of this output_dir


def is_main_process() -> bool:
    """Whether this process logs to the trackers: rank 0 (torch.distributed's RANK), or a single process."""
    return int(os.environ.get("RANK", "0")) == 0


class Backend(Protocol):
    identity: dict[str, str]  # what `resume` needs to continue this tracker run (tracking.json)

    def log(self, values: dict[str, float], step: int) -> None: ...
    def log_samples(self, key: str, rows: list[dict], step: int) -> None: ...
    def finish(self) -> None: ...


class TensorBoardBackend:
    def __init__(self, recipe: RecipeConfig, name: str, resume: dict[str, str] | None = None):
        from torch.utils.tensorboard import SummaryWriter

        from adaptercl.recipe import resolved_yaml

        self.log_dir = Path(recipe.output_dir) / "tensorboard" / name
        self.writer = SummaryWriter(log_dir=str(self.log_dir))  # a resumed run adds an event file to the same dir
        text = "```yaml\n" + resolved_yaml(recipe) + "```"
        digest = hashlib.sha256(text.encode()).hexdigest()
        self.identity = {"log_dir": str(self.log_dir), "recipe_sha256": digest}
        if resume is None or resume.get("recipe_sha256") != digest:  # a resume of the same recipe has it already
            self.writer.add_text("recipe", text, 0)

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # on disk before tracking.json says it was logged

    def log_samples(self, key: str, rows: list[dict], step: int) -> None:
        self.writer.add_text(key, markdown_table(rows), step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class WandbBackend:
    def __init__(self, recipe: RecipeConfig, name: str, resume: dict[str, str] | None = None):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=recipe.log.project,
            name=name,
            dir=str(Path(recipe.output_dir)),
            config=recipe.model_dump(mode="json"),
            mode=wandb_mode(),
            **({"id": resume["id"], "resume": "allow"} if resume else {}),  # the same wandb run (offline: same id)
        )
        self.identity = {"id": self.run.id}
        self.run.define_metric("global_step")
        self.run.define_metric("*", step_metric="global_step")  # a rollback or resume may log a step again

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log({**values, "global_step": step})

    def log_samples(self, key: str, rows: list[dict], step: int) -> None:
        table = self.wandb.Table(columns=list(SAMPLE_COLUMNS), data=[[r.get(c) for c in SAMPLE_COLUMNS] for r in rows])
        self.run.log({key: table, "global_step": step})

    def finish(self) -> None:
        self.run.finish()


class TrackioBackend:
    def __init__(self, recipe: RecipeConfig, name: str, resume: dict[str, str] | None = None):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(  # trackio resumes by name: the latest run of that name in the project
            project=recipe.log.project,
            name=resume["name"] if resume else name,
            config=recipe.model_dump(mode="json"),
            resume="allow" if resume else "never",
        )
        self.identity = {"name": self.run.name}

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def log_samples(self, key: str, rows: list[dict], step: int) -> None:
        table = self.trackio.Table(
            columns=list(SAMPLE_COLUMNS), data=[[r.get(c) for c in SAMPLE_COLUMNS] for r in rows]
        )
        self.run.log({key: table}, step=step)

    def finish(self) -> None:
        self.run.finish()


# report_to name -> (module that must be importable, backend); the extra to install has the same name
BACKENDS: dict[str, tuple[str, Callable[[RecipeConfig, str, dict[str, str] | None], Backend]]] = {
    "tensorboard": ("tensorboard", TensorBoardBackend),
    "wandb": ("wandb", WandbBackend),
    "trackio": ("trackio", TrackioBackend),
}


def require_trackers(names: list[str]) -> None:
    """One RecipeError line naming the extra to install for the first tracker whose package is missing."""
    for name in names:
        if importlib.util.find_spec(BACKENDS[name][0]) is None:
            raise RecipeError(f"report_to: {name} is not installed; pip install 'adaptercl[{name}]'")


def wandb_mode() -> str | None:
    """Offline unless WANDB_MODE, WANDB_API_KEY or a .netrc entry for the wandb host (`wandb login`) is set;
    None lets wandb decide (online with a key)."""
    if os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY"):
        return None
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        if netrc.netrc().authenticators(host):
            return None
    except (OSError, netrc.NetrcParseError):
        pass
    return "offline"


class Tracker:
    """Turns the run's events into tracker calls; `__call__` is an `on_event`."""

    def __init__(self, recipe: RecipeConfig, backends: list[str]):
        self.recipe, self.names = recipe, backends
        self.backends: list[Backend] = []
        self.record: dict[str, Any] = {}  # tracking.json
        self.logged_before: dict[str, int] = {}  # tracking.json's `logged` when this process started
        self.offsets, self.ends, total = {BEFORE_DIR: 0}, {BEFORE_DIR: 0}, 0
        for i, stage in enumerate(recipe.stages):  # global step = steps of the stages before + the stage's step
            self.offsets[stage_dir_name(recipe, i)] = total
            total += stage.optim.steps
            self.ends[stage_dir_name(recipe, i)] = total
        self.total_steps = total

    def start(self) -> None:
        """Open each tracker's run: the run of an earlier start of this output_dir where `tracking.json` names one
        (a resumed or grown run goes on in the same wandb/trackio run), else a new one, then record them."""
        name = self.recipe.log.run_name or Path(self.recipe.output_dir).resolve().name
        path = Path(self.recipe.output_dir) / TRACKING_FILE
        fix = "delete it (the trackers then start new runs)"
        earlier = read_record(path, fix) if path.is_file() else {}
        self.logged_before = dict(earlier.get(LOGGED, {}))
        self.backends = [BACKENDS[n][1](self.recipe, name, earlier.get(n)) for n in self.names]
        self.record = {**earlier, **{n: b.identity for n, b in zip(self.names, self.backends)}}
        write_json(path, self.record)

    def __call__(self, kind: str, **info: Any) -> None:
        if kind == "load" and not self.backends:
            self.start()
        if not self.backends:
            return
        if kind == "step":
            step = self.offsets[info["stage"]] + info["step"]
            metrics = {k: v for k, v in info["metrics"].items() if k != "step" and _is_number(v)}
            values = {f"{info['stage']}/{k}": float(v) for k, v in metrics.items()}
            self._log("step", values, step, info.get("samples"), f"{info['stage']}/samples")
        elif kind == "evaluated":
            row = info["row"]
            values = {f"eval/{d}": r["accuracy"] for d, r in row.items()}
            values.update({f"eval_reward/{d}": r["reward_mean"] for d, r in row.items()})
            self._log("eval", values, self.ends[info["stage"]])
        elif kind == "finished":
            cl = info["summary"].get("cl_metrics") or {}
            self._log("cl", {f"cl/{k}": float(v) for k, v in cl.items() if _is_number(v)}, self.total_steps)

    def _log(
        self, what: str, values: dict[str, float], step: int, samples: list[dict] | None = None, key: str = ""
    ) -> None:
        """`values` (and the step's `samples` as table `key`) at `step` to every backend, then tracking.json's
        `logged` says so; nothing where an earlier process of this output_dir logged `what` at `step` or later."""
        if step <= self.logged_before.get(what, -1):
            return
        for backend in self.backends:
            backend.log(values, step)
            if samples:
                backend.log_samples(key, samples, step)
        logged = self.record.setdefault(LOGGED, {})
        logged[what] = max(step, logged.get(what, -1))
        write_json(Path(self.recipe.output_dir) / TRACKING_FILE, self.record)

    def finish(self) -> None:
        for backend in self.backends:
            backend.finish()
        self.backends = []


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@contextmanager
def tracking(recipe: RecipeConfig, on_event: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """`on_event` extended with the recipe's trackers (none: `on_event` itself); the trackers finish on exit,
    also when the run fails."""
    if not recipe.report_to or not is_main_process():
        yield on_event
        return
    tracker = Tracker(recipe, recipe.report_to)

    def notify(kind: str, **info: Any) -> None:
        on_event(kind, **info)
        tracker(kind, **info)

    try:
        yield notify
    finally:
        tracker.finish()
