"""Self-teachers for SDPO, SDFT and hybrid stages: the teacher kinds on the one base model.

The teacher's prompts (SDPO reprompts, SDFT demonstrations) are built in `prompts.py`; the EMA of ΔW and
the trust-region mixture, as pure tensor functions, are in `mixing.py`.

Teacher kinds (`create_teacher`), all on the one base model as a named LoRA adapter or the disabled adapter;
never a second base, only adapter-sized tensors (docs/design.md §3):
- `base`: every adapter disabled: the pretrained model as loaded (what `grpo.kl_coef` also calls the base).
  Under `adapter.init: new` with frozen earlier adapters this is *not* the stage's initial policy (base +
  frozen adapters): that one is `stage_start`, whose copy of a fresh adapter is zero. For stage 1 with a fresh
  adapter the two are the same.
- `stage_start`: a frozen copy of the student at stage start, used over the same frozen adapters.
- `ema`: ΔW_T <- (1-τ)·ΔW_T + τ·ΔW_S per module after each step, on the effective delta ΔW = scale·B·A (never
  on A and B separately). Storage: a teacher adapter of rank `distill.teacher.ema_rank` (scaling 1) holding
  the best rank-r_T factors of that sum. The sum of a rank-r_T and a rank-r delta has rank <= r_T + r, so it
  is re-factorised exactly in factored form (QR of the stacked factors, SVD of a (r_T+r)² core: no [out, in]
  matrix is formed) and truncated back to r_T. Exact while the true EMA has rank <= r_T (its rank grows by at
  most r a step); otherwise each step drops the smallest singular values, and `Teacher.ema_error` carries a
  per-module bound ‖ΔW_T − EMA(ΔW_S)‖_F <= Σ_j (1-τ)^{k-j}·e_j (e_j = Frobenius norm dropped at step j).
- `lag`: a hard copy of the student every `lag_steps` optimiser steps (initially the stage-start copy).
- `restart_freeze` (StableSDPO, SDPO-CL): the same clock under its paper's name and field, `refresh_every`; each step
  logs `teacher_refresh` (1 at a copy).
- `gated` (CGTR): frozen; every `refresh_every` steps a check copies the student in only on joint evidence of
  reward improvement and a safe response-length tail over the recent window (`schedule.py`: the rule, the
  baseline, what is logged). `Teacher.update` gets the step's own-domain rewards and response lengths for it; the
  window and the references are part of `Teacher.state()`, so checkpoints carry them.
- `trust_region`: z_T = (1-c)·z_ref + c·z_student, both on the teacher prompt, z_ref = the stage-start policy
  (a frozen copy, as `stage_start`); c = `distill.teacher.trust_region_coef`, 0.05 by default as the reference
  (95 % reference). lasgroup/SDPO mixes with its reference model, the initial policy of the run; in a continual
  run the stage start is the policy the stage must stay close to.


The teacher adapter is named `<student>-teacher`, is never trainable, and is active only inside `Teacher.logits`
(through `adapters.live.active_adapters`, which restores the active set and the trainable flags). Teacher forwards
run in eval mode under no_grad, and under bf16 autocast when `distill.teacher.autocast` asks for it
(`teacher_autocast_dtype`). `Teacher.save` writes `teacher.json` (kind and bookkeeping) plus the adapter in
PEFT format; `restore_teacher` loads it back bit for bit into the existing adapter when there is one (loading
twice never creates a second teacher adapter). A mid-stage checkpoint needs the same two things: `Teacher.state()`
(JSON; `Teacher(**state)` rebuilds the object) and the tensors of adapter `Teacher.adapter`, loaded in place into
the adapter `create_teacher` made at stage start.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig as PeftLoraConfig
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file
from torch import Tensor

from adaptercl.adapters import active_adapters, copy_adapter, load_adapter_state, lora_parameters, save_adapter
from adaptercl.model import ResponseScores, TokenBatch, at_least_float32, response_scores
from adaptercl.recipe import TeacherAutocast, TeacherConfig, TeacherKind
from adaptercl.system import atomic_dir, read_record
from adaptercl.system import bf16_matmul_available as cpu_has_bf16_matmul  # the CPU's flags have one home
from adaptercl.teacher.mixing import ema_lora_factors, trust_region_teacher_logits
from adaptercl.teacher.schedule import GateState, clock_refresh, gate_step

STATE_FILE = "teacher.json"
ADAPTER_DIR = "adapter"


# ------------------------------------------------------------------------------------------- teacher kinds


def teacher_adapter_name(student: str) -> str:
    return f"{student}-teacher"


@dataclass
class Teacher:
    """The self-teacher of one stage; `adapter` is its LoRA adapter on the shared base (None for `base`)."""

    kind: TeacherKind
    student: str
    frozen: list[str]  # earlier adapters active under both student and teacher
    adapter: str | None
    tau: float
    lag_steps: int
    trust_region_coef: float
    steps: int = 0  # optimiser steps the teacher has followed in this stage
    ema_error: dict[str, float] = field(default_factory=dict)  # per module: bound on ‖ΔW_T − EMA(ΔW_S)‖_F
    ema_dropped: float = 0.0  # last EMA update: largest relative Frobenius norm dropped by truncation
    autocast: TeacherAutocast = "none"  # the teacher forward's torch.autocast (see `teacher_autocast_dtype`)
    refresh_every: int = 10  # restart_freeze: copy period; gated: check period
    gate_window: int = 10  # gated: steps of evidence
    gate_reward_delta: float = 0.05  # gated: reward gain needed
    gate_length_eps: float = 0.1  # gated: allowed growth of the response-length p95
    gate: GateState = field(default_factory=GateState)  # gated: window and references (schedule.py)
    last_log: dict[str, float] = field(default_factory=dict)  # restart_freeze / gated: the last update's metrics

    def __post_init__(self) -> None:
        if isinstance(self.gate, dict):  # from `state()` (JSON)
            self.gate = GateState(**self.gate)

    @torch.no_grad()
    def logits(self, model: torch.nn.Module, batch: TokenBatch, temperature: float = 1.0) -> Tensor:
        """Teacher logits / temperature for the response tokens of `batch` (a TokenBatch on the teacher prompts).
        [N, R, V] float32 (also under `autocast`, whose logits come out in bfloat16)"""
        return self.scores(model, batch, temperature, None).logits

    @torch.no_grad()
    def scores(
        self, model: torch.nn.Module, batch: TokenBatch, temperature: float, chunk_size: int | None
    ) -> ResponseScores:
        """The teacher's `model.batching.ResponseScores` on `batch`: full float32 logits / temperature when
        `chunk_size` is None, else the final hidden states (the trust-region mixture taken on them: the LM head is
        linear, so it is the same mixture of logits)."""
        with _eval_mode(model), _autocast(model, self.autocast):
            if self.kind == "base":
                with _active(model, None):
                    return _float_logits(response_scores(model, batch, temperature, chunk_size))
            with _active(model, [*self.frozen, self.adapter]):
                teacher = _float_logits(response_scores(model, batch, temperature, chunk_size))
            if self.kind != "trust_region":
                return teacher
            with _active(model, [*self.frozen, self.student]):
                student = _float_logits(response_scores(model, batch, temperature, chunk_size))
            if chunk_size is None:
                return ResponseScores(
                    logits=trust_region_teacher_logits(teacher.logits, student.logits, self.trust_region_coef)
                )
            mixed = trust_region_teacher_logits(teacher.hidden, student.hidden, self.trust_region_coef)  # [N, R, H]
            return ResponseScores(hidden=mixed, head=teacher.head, temperature=temperature)

    @torch.no_grad()
    def update(
        self, model: torch.nn.Module, rewards: list[float] | None = None, lengths: list[int] | None = None
    ) -> None:
        """Follow the student after one optimiser step (`_FOLLOW`): EMA of ΔW (`ema`), a copy every N steps (`lag`,
        `restart_freeze`) or when the gate opens (`gated`, which needs the step's own-domain training `rewards`
        and response `lengths`, one per rollout); the frozen kinds do nothing."""
        self.steps += 1
        follow = _FOLLOW.get(self.kind)
        if follow is not None:
            follow(self, model, rewards, lengths)

    def _ema_step(self, model: torch.nn.Module, tau: float) -> None:
        worst = 0.0
        for name, layer in _lora_layers(model, self.student, self.adapter):
            t_a, t_b = layer.lora_A[self.adapter].weight, layer.lora_B[self.adapter].weight
            A, B, dropped, norm = ema_lora_factors(
                t_a,
                t_b,
                layer.lora_A[self.student].weight,
                layer.lora_B[self.student].weight,
                layer.scaling[self.student],
                tau,
                t_a.shape[0],
            )
            t_a.copy_(A)
            t_b.copy_(B)
            self.ema_error[name] = (1.0 - tau) * self.ema_error.get(name, 0.0) + dropped
            worst = max(worst, dropped / norm if norm > 0 else 0.0)
        self.ema_dropped = worst

    def state(self) -> dict[str, Any]:
        """JSON-able bookkeeping (the adapter tensors are saved separately)."""
        return asdict(self)

    def load_state(self, state: dict[str, Any]) -> None:
        """Take back the bookkeeping of `state()` (a checkpoint's); the adapter tensors are loaded separately."""
        for key, value in state.items():
            setattr(self, key, value)
        self.__post_init__()

    def stats(self) -> dict[str, float]:
        """What the teacher reports in each step's metrics: the EMA teacher's truncation (largest relative
        Frobenius norm dropped by the last update); `restart_freeze` and `gated` whether the step refreshed the
        teacher (`teacher_refresh`), `gated` also its baseline and checks (`teacher_gate_*`, schedule.py);
        the other kinds report nothing."""
        if self.kind == "ema":
            return {"teacher_ema_dropped": self.ema_dropped}
        return dict(self.last_log)

    def save(self, model: torch.nn.Module, path: str | Path) -> None:
        """Write `teacher.json` and (if any) the adapter in PEFT format into folder `path`, atomically."""
        with atomic_dir(path) as tmp:
            if self.adapter is not None:
                save_adapter(model, self.adapter, tmp / ADAPTER_DIR)
            (tmp / STATE_FILE).write_text(json.dumps(self.state(), indent=2) + "\n")

    def remove(self, model: torch.nn.Module) -> None:
        """Delete the teacher adapter from the model (after the stage); the trainable flags are kept."""
        if self.adapter is not None and self.adapter in model.peft_config:
            with _keep_trainable(model):
                model.delete_adapter(self.adapter)


def create_teacher(model: torch.nn.Module, student: str, frozen: list[str], cfg: TeacherConfig) -> Teacher:
    """The teacher of a stage about to start, from the student as it is now (see the module docstring)."""
    teacher = Teacher(
        kind=cfg.kind,
        student=student,
        frozen=list(frozen),
        adapter=None if cfg.kind == "base" else teacher_adapter_name(student),
        tau=cfg.tau,
        lag_steps=cfg.lag_steps,
        trust_region_coef=cfg.trust_region_coef,
        autocast=cfg.autocast,
        refresh_every=cfg.refresh_every,
        gate_window=cfg.gate_window or cfg.refresh_every,
        gate_reward_delta=cfg.gate_reward_delta,
        gate_length_eps=cfg.gate_length_eps,
    )
    if teacher.adapter is None:
        return teacher
    if teacher.adapter in model.peft_config:
        raise ValueError(
            f"the model already has a teacher adapter {teacher.adapter!r}: restore_teacher it or remove it first"
        )
    peft_cfg = copy.deepcopy(model.peft_config[student])  # same modules; same shapes and scaling: exact copies
    if cfg.kind == "ema":  # its own rank, scaling 1: the factors hold ΔW_T itself
        peft_cfg.r, peft_cfg.lora_alpha, peft_cfg.use_rslora = cfg.ema_rank, cfg.ema_rank, False
    peft_cfg.lora_dropout = 0.0
    peft_cfg.inference_mode = True
    _add_frozen_adapter(model, teacher.adapter, peft_cfg)
    with torch.no_grad():
        if cfg.kind == "ema":
            for p in _adapter_parameters(model, teacher.adapter):
                p.zero_()
            teacher._ema_step(model, tau=1.0)  # ΔW_T = ΔW_S (re-factorised at rank r_T)
        else:
            copy_adapter(model, student, teacher.adapter)
    return teacher


def restore_teacher(model: torch.nn.Module, path: str | Path) -> Teacher:
    """Bring back a teacher written by `Teacher.save`, bit for bit; reuses its adapter if the model has it."""
    path = Path(path)
    teacher = Teacher(**read_record(path / STATE_FILE, f"delete the folder {path.parent} to redo the stage"))
    if teacher.adapter is not None:
        folder = path / ADAPTER_DIR
        if teacher.adapter not in model.peft_config:
            peft_cfg = PeftLoraConfig.from_pretrained(str(folder))
            peft_cfg.inference_mode = True
            _add_frozen_adapter(model, teacher.adapter, peft_cfg)
        load_adapter_state(model, teacher.adapter, load_file(str(folder / "adapter_model.safetensors")))
    return teacher


def _follow_ema(teacher: Teacher, model: torch.nn.Module, rewards, lengths) -> None:
    teacher._ema_step(model, teacher.tau)


def _follow_lag(teacher: Teacher, model: torch.nn.Module, rewards, lengths) -> None:
    if clock_refresh(teacher.steps, teacher.lag_steps):
        copy_adapter(model, teacher.student, teacher.adapter)


def _follow_restart_freeze(teacher: Teacher, model: torch.nn.Module, rewards, lengths) -> None:
    refresh = clock_refresh(teacher.steps, teacher.refresh_every)
    if refresh:
        copy_adapter(model, teacher.student, teacher.adapter)
    teacher.last_log = {"teacher_refresh": float(refresh)}


def _follow_gated(teacher: Teacher, model: torch.nn.Module, rewards, lengths) -> None:
    if rewards is None or lengths is None:
        raise ValueError("a gated teacher's update needs the step's training rewards and response lengths")
    t = teacher
    t.gate, refresh, log = gate_step(
        t.gate, t.steps, rewards, lengths, t.refresh_every, t.gate_window, t.gate_reward_delta, t.gate_length_eps
    )
    if refresh:
        copy_adapter(model, teacher.student, teacher.adapter)
    teacher.last_log = {"teacher_refresh": float(refresh), **log}


# How each kind follows the student after an optimiser step (kinds not listed stay as they are).
_FOLLOW = {"ema": _follow_ema, "lag": _follow_lag, "restart_freeze": _follow_restart_freeze, "gated": _follow_gated}


# ------------------------------------------------------------------------------------------------- helpers


def _add_frozen_adapter(model: torch.nn.Module, name: str, peft_cfg: Any) -> None:
    """Add adapter `name`, frozen. PEFT's add_adapter may flip trainable flags, so they are restored; its random
    init draws from the global RNG, which is forked so a teacher does not change later draws (e.g. the next stage's
    fresh adapter): a resumed run then matches an uninterrupted one."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with _keep_trainable(model), torch.random.fork_rng(devices=devices):
        model.add_adapter(name, peft_cfg)
    for p in _adapter_parameters(model, name):
        p.requires_grad_(False)


def _adapter_parameters(model: torch.nn.Module, name: str) -> list[torch.nn.Parameter]:
    return list(lora_parameters(model, name).values())


def _lora_layers(model: torch.nn.Module, *names: str) -> Iterator[tuple[str, Any]]:
    """(module name, LoRA layer) of every layer holding all adapters `names`."""
    for module_name, module in model.named_modules():
        if isinstance(module, LoraLayer) and all(n in module.lora_A for n in names):
            yield module_name, module


@contextmanager
def _keep_trainable(model: torch.nn.Module) -> Iterator[None]:
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    try:
        yield
    finally:
        for n, p in model.named_parameters():
            if n in flags:
                p.requires_grad_(flags[n])


def _float_logits(scores: ResponseScores) -> ResponseScores:
    """Full logits in at least float32 (autocast computes them in bfloat16); hidden states are left as they are."""
    if scores.logits is not None:
        scores.logits = at_least_float32(scores.logits)
    return scores


@contextmanager
def _active(model: torch.nn.Module, names: list[str] | None) -> Iterator[None]:
    with active_adapters(model, names):
        yield


def teacher_autocast_dtype(model: torch.nn.Module, setting: TeacherAutocast) -> torch.dtype | None:
    """The dtype of the teacher forward's autocast, or None for none. `auto` is bfloat16 only where it pays and
    changes something: a float32 model on a CPU with bf16 matrix instructions (`cpu_has_bf16_matmul`)."""
    if setting == "bfloat16":
        return torch.bfloat16
    if setting == "auto":
        param = next(model.parameters())
        if param.device.type == "cpu" and param.dtype == torch.float32 and cpu_has_bf16_matmul():
            return torch.bfloat16
    return None


@contextmanager
def _autocast(model: torch.nn.Module, setting: TeacherAutocast) -> Iterator[None]:
    """torch.autocast on the model's device type (see `teacher_autocast_dtype`), or nothing."""
    dtype = teacher_autocast_dtype(model, setting)
    if dtype is None:
        yield
        return
    with torch.autocast(next(model.parameters()).device.type, dtype=dtype):
        yield


@contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
