"""One training stage, top to bottom: rollout -> reward -> teacher -> loss -> step -> guard -> log.

`run_stage` trains the student adapter of one stage on its domain with the stage's method
(`recipe.method_table.METHODS`):
- every method samples `rollout.group_size` responses per prompt from the current student (over the frozen
  earlier adapters) and scores them with the domain's reward; GRPO's advantages are Dr.GRPO's group-centred
  rewards (docs/design.md §4);
- methods with a self-teacher (sdpo, sdft, hybrid: `ctx.teacher`, see `teacher/kinds.py`) get the teacher's prompts on
  the very same responses and the distilled token mask (`distill_targets.py`); after each optimiser step the teacher
  follows the student (`Teacher.update`: EMA of ΔW, a periodic copy, or a copy when the `gated` teacher's gate opens
  on the step's own-domain rewards and lengths), not after a step skipped for a non-finite gradient (the guard's
  nonfinite rule then rolls back or stops; as verl, which updates the teacher on `did_update`);
- with `distill.gate.kind: lift` (`lift_gate.py`) the stage measures its teacher's lift over the student at step 0 and
  every `distill.gate.every` steps, after the step's rollouts; while the gate is closed a step builds no teacher
  prompts and its update is GRPO's on the same rollouts (`train_on_batch(method="grpo")`);
- the loss and the optimiser step are `step.train_on_batch`: the method's loss terms composed, plus the
  continual regularisers of `regularizers.py` (each only when its weight is > 0);
- the collapse guard (`collapse_guard.py`) warns, rolls back to the last checkpoint with a smaller LR, or stops.

What the run hands a stage is `context.StageContext`. The data order and sampling seeds are pure functions
of (recipe seed, stage index, step), so a stage resumed from a checkpoint draws the same prompts as an
uninterrupted one. Under data-parallel ranks (`system/distributed.py`) each rank rolls out a contiguous share of the
step's prompts (whole groups), the step's metrics are the whole step's, and rank 0 alone writes metrics and
checkpoints. The learning rate of a step is a pure function of the step and the rollbacks so far
(`lr_schedule.learning_rate`: transformers' schedule factor times the guard's scale), set before each step.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from adaptercl.adapters import lora_parameters
from adaptercl.domains import reward_component_stats, score_samples
from adaptercl.measure import parameter_drift_report, repeated_ngram_rate
from adaptercl.model import TokenBatch, build_batch, encode_chat
from adaptercl.recipe import METHODS
from adaptercl.rollout import Completion, packed_base_linears
from adaptercl.run_dir import StageDir, sample_rows
from adaptercl.system import append_line, distributed, phased, read_jsonl, write_text
from adaptercl.train import losses
from adaptercl.train.checkpoint import (
    Checkpoint,
    DamagedCheckpoint,
    discard_checkpoint,
    has_checkpoint,
    read_checkpoint,
    restore_checkpoint,
    resume_line,
    save_checkpoint,
)
from adaptercl.train.collapse_guard import CollapseGuard
from adaptercl.train.context import StageContext, prompts_for_step, rollout_sampling, step_seed
from adaptercl.train.distill_targets import distill_targets
from adaptercl.train.lift_gate import LiftGate, create_gate, own_groups
from adaptercl.train.lr_schedule import learning_rate
from adaptercl.train.regularizers import (
    REPLAY_COUNT_SEED,
    REPLAY_EXAMPLES_SEED,
    StageRegularizers,
    replay_examples,
    replay_plan,
)
from adaptercl.train.step import train_on_batch

log = logging.getLogger(__name__)


def make_optimizer(ctx: StageContext) -> torch.optim.Optimizer:
    """AdamW over the student's LoRA parameters; the learning rate is set before each step (`learning_rate`)."""
    optim = ctx.stage.optim
    params = list(lora_parameters(ctx.model, ctx.student).values())
    return torch.optim.AdamW(params, lr=optim.lr, weight_decay=optim.weight_decay)


def run_stage(ctx: StageContext, optimizer: torch.optim.Optimizer | None = None) -> dict[str, float]:
    """Train `ctx.student` for the stage's steps; append one JSON line per step to metrics.jsonl and the step's kept
    rollout samples to samples.jsonl (`run_dir/samples.py`). Returns the last step's metrics. The trained stage
    ends with a checkpoint marked `trained`: a stage resumed from it runs no step and returns the same metrics. A
    damaged checkpoint is removed and the stage starts over from step 0, said in one line (`_resume_point`).

    On a float32 CPU base the frozen base's linear weights are packed for oneDNN once for the stage
    (`rollout.packed_weights.packed_base_linears`): the training forwards and backwards, the teacher's forwards and the
    rollouts multiply by them there instead of MKL's float32 products."""
    with packed_base_linears(ctx.model):
        return _run_stage(ctx, optimizer)


def _run_stage(ctx: StageContext, optimizer: torch.optim.Optimizer | None) -> dict[str, float]:
    stage, model, tok = ctx.stage, ctx.model, ctx.tokenizer
    if METHODS[stage.method].needs_teacher and ctx.teacher is None:
        raise ValueError(f"a {stage.method} stage needs ctx.teacher (see teacher.create_teacher)")
    optimizer = optimizer or make_optimizer(ctx)
    regs = StageRegularizers.start(model, ctx.student, ctx.frozen, ctx.previous, stage.regularizers)
    files = StageDir(ctx.stage_dir)
    metrics_path = files.metrics
    device = next(model.parameters()).device
    group = stage.rollout.group_size
    n_samples = ctx.recipe.log.samples_per_step
    last: dict[str, float] = {}
    guard = CollapseGuard(stage.monitor)
    checkpoint_dir = files.checkpoint
    history: list[dict] = []  # this stage's step metrics, for the guard's rules
    gate = create_gate(stage)  # distill.gate: None unless a distilling stage gates on its teacher's lift
    step, trained = 0, False
    resume = _resume_point(ctx, files, optimizer) if distributed.is_main() else None
    if resume is not None:  # say where it resumes (rank 0), before `_restore` cuts the log back to the checkpoint
        done = sum(1 for r in read_jsonl(metrics_path) if "event" not in r)
        (ctx.on_note or log.info)(resume_line(resume.state, done, stage.monitor.checkpoint_every))
    if distributed.broadcast_object(resume is not None):  # rank 0 decides
        step, history, trained = _restore(ctx, checkpoint_dir, optimizer, guard, resume, gate)  # where it left off
        last = history[-1] if history else {}
    else:
        _checkpoint(ctx, checkpoint_dir, optimizer, step, guard, gate=gate)
    distributed.broadcast_tensors([p for n, p in model.named_parameters() if "lora_" in n])  # rank 0's adapters
    while not trained and step < stage.optim.steps:
        t0 = time.perf_counter()
        # ---- rollout: G samples for each prompt, from the current student (on top of frozen earlier adapters)
        per_step = stage.optim.prompts_per_step
        replay_seed = step_seed(ctx.recipe.seed, ctx.index, REPLAY_COUNT_SEED + step)
        n_replay, width = replay_plan(stage.regularizers, per_step, len(ctx.replay_domains), replay_seed)
        indices = prompts_for_step(len(ctx.domain.train), width, ctx.recipe.seed, ctx.index, step)
        indices = indices[: per_step - n_replay]  # the stage's own prompts (`regularizers.replay_plan`)
        pairs = [(ctx.domain.train[i], ctx.domain) for i in indices] + replay_examples(
            ctx.replay_domains, n_replay, step_seed(ctx.recipe.seed, ctx.index, REPLAY_EXAMPLES_SEED + step)
        )  # (example, domain whose reward scores it)
        lo, hi = distributed.shard_bounds(len(pairs))  # this rank's whole groups (all of them for 1 process)
        pairs = pairs[lo:hi]
        examples = [ex for ex, _ in pairs]
        prompt_ids = [encode_chat(tok, ex.messages) for ex in examples]
        params = rollout_sampling(stage, step_seed(ctx.recipe.seed, ctx.index, step), first_row=lo * group)
        groups = phased("rollout", ctx.engine.generate, prompt_ids, ctx.policy_adapters, params)
        ctx.engine.sleep()  # vLLM on CUDA frees its memory for the training step (no-op elsewhere)
        completions = [c for g in groups for c in g]  # [N] group-contiguous, N = prompts x G
        samples = [ex for ex in examples for _ in range(group)]
        sample_domains = [d for _, d in pairs for _ in range(group)]
        t_rollout = time.perf_counter() - t0

        # ---- reward
        texts, completion_ids = [c.text for c in completions], [c.token_ids for c in completions]
        results = score_samples(texts, completion_ids, samples, sample_domains)  # each domain in one batch call
        rewards = torch.tensor([r.score for r in results], dtype=torch.float32)  # [N]
        scored = torch.tensor([r.scored for r in results])  # [N] bool: all-None TRL samples are not (advantage 0)
        advantages = losses.group_advantages(rewards, group, stage.grpo.scale_rewards, scored=scored)  # [N]
        batch = build_batch([c.prompt_ids for c in completions], [c.token_ids for c in completions], tok.pad_token_id)

        # ---- lift gate: at its checks the teacher's measured lift decides whether this and the next steps distil
        gate_log: dict[str, float] = {}
        if gate is not None and gate.due(step):
            own = own_groups(examples, completions, results, lo, per_step - n_replay)  # every rank's
            gate_log = gate.check(ctx, step, indices, own)
        distils = METHODS[stage.method].needs_teacher and (gate is None or gate.open)  # closed: GRPO's update

        # ---- teacher: the same responses behind the teacher's prompts, and which tokens are distilled
        targets = None
        if distils:
            targets = phased("update", distill_targets, ctx, step, samples, completions, results, batch).to(device)

        # ---- loss and optimiser step, then the teacher follows the student (ema, lag)
        model.train()
        lr = learning_rate(stage.optim, step, guard.lr_scale())
        for group_params in optimizer.param_groups:
            group_params["lr"] = lr
        rollout_logp = _rollout_logprobs(completions, batch)
        train_stats = phased(
            "update",
            train_on_batch,
            ctx,
            batch.to(device),
            advantages.to(device),
            optimizer,
            targets,
            None if rollout_logp is None else rollout_logp.to(device),
            regs,
            method=None if distils or gate is None else "grpo",
        )
        # the whole step's samples (every rank's, in order: the stage's own prompts, then the replayed ones)
        samples_log = distributed.gather_lists([_sample_record(c, r) for c, r in zip(completions, results)])
        if train_stats["nonfinite_step"] < 1.0:  # a non-finite step made no update: nothing to follow or sync
            if ctx.teacher is not None:  # a gated teacher's evidence: the stage's own rollouts' rewards and lengths
                own = samples_log[: (per_step - n_replay) * group]
                ctx.teacher.update(model, [s[0] for s in own], [s[2] for s in own])
            ctx.engine.sync_adapters([ctx.student])  # adapter-only sync under a new name and id (no-op for hf)

        # ---- log: train_stats are already the whole batch's
        all_rewards = torch.tensor([s[0] for s in samples_log], dtype=torch.float32)  # [N of the whole step]
        last = {
            "step": step + 1,
            "reward_mean": all_rewards.mean().item(),
            "reward_std": all_rewards.std().item() if len(all_rewards) > 1 else 0.0,
            "correct_frac": sum(s[1] for s in samples_log) / len(samples_log),
            "replay_frac": n_replay / per_step,
            "zero_variance_groups": losses.zero_variance_group_fraction(all_rewards, group),
            **(distributed.mean_dicts(targets.stats) if targets is not None else {}),
            **train_stats,
            **_length_stats(samples_log),
            **reward_component_stats([s[5] for s in samples_log]),
            **(ctx.teacher.stats() if ctx.teacher is not None else {}),
            **({"lift_gate_open": float(distils), **gate_log} if gate is not None else {}),
            "lr": lr,
            "time_rollout_s": t_rollout,
            "time_step_s": time.perf_counter() - t0,
        }
        last["repetition_rate"] = sum(s[4] for s in samples_log) / len(samples_log)
        if stage.monitor.drift_every and (step + 1) % stage.monitor.drift_every == 0:
            cfg = ctx.recipe.eval
            report = parameter_drift_report(
                model, ctx.policy_adapters, ctx.base_weights, cfg.drift_top_k, cfg.drift_method
            )
            drift = report["aggregate"]
            last.update({f"drift_{k}": v for k, v in drift.items() if k.endswith("_mean")})
        last = distributed.broadcast_object(last)  # rank 0's record: every rank's guard decides on the same history

        # ---- collapse guard: warn; roll back to the last checkpoint with a smaller LR; or stop at that checkpoint
        alarms = guard.check([*history, last])
        action = guard.decide(alarms)
        for alarm in alarms if distributed.is_main() else []:
            event = {"event": alarm.rule, "action": action, "step": step + 1, "message": alarm.message}
            append_line(metrics_path, json.dumps(event))
        if action in ("rollback", "stop"):  # back to the last good checkpoint; stop ends the stage there
            step, history, _ = _restore(ctx, checkpoint_dir, optimizer, guard, gate=gate)
            last = history[-1] if history else {}
            if action == "stop":
                break
            continue
        has_target = targets.has_target if targets is not None else None
        kept = sample_rows(step + 1, samples, sample_domains, completions, results, has_target, group, n_samples)
        if distributed.is_main():  # rank 0's share of the samples (under N ranks), written before the step line
            if kept:  # a step whose line is written has its samples (_restore cuts both back)
                append_line(files.samples, "".join(json.dumps(r) + "\n" for r in kept))
            append_line(metrics_path, json.dumps(last))
        history.append(last)
        step += 1
        if ctx.on_step is not None:
            ctx.on_step(step, last, kept)
        if step % stage.monitor.checkpoint_every == 0 and step < stage.optim.steps:
            _checkpoint(ctx, checkpoint_dir, optimizer, step, guard, gate=gate)
    if not trained:  # the trained stage (its last step, or where the guard stopped it): a resume trains no more
        _checkpoint(ctx, checkpoint_dir, optimizer, step, guard, trained=True, gate=gate)
    return last


def _checkpoint(
    ctx: StageContext,
    path: Path,
    optimizer,
    next_step: int,
    guard: CollapseGuard,
    trained: bool = False,
    gate: LiftGate | None = None,
) -> None:
    teacher = ctx.teacher
    adapters = [ctx.student] + ([teacher.adapter] if teacher is not None and teacher.adapter else [])
    extra = {
        "rollbacks_used": guard.rollbacks_used,
        "teacher": teacher.state() if teacher is not None else None,
        "lift_gate": gate.state() if gate is not None else None,
        "trained": trained,
    }
    if distributed.is_main():  # every rank holds the same weights and optimiser state; rank 0 writes them
        phased("checkpoint", save_checkpoint, path, ctx.model, adapters, optimizer, next_step, extra)
    distributed.barrier()


def _resume_point(ctx: StageContext, files: StageDir, optimizer) -> Checkpoint | None:
    """Rank 0: the stage's checkpoint, read whole and checked, or None for a fresh start. A damaged one (a file cut
    short or overwritten: `DamagedCheckpoint`) is no resume point: it is removed and so are the step logs of the
    training it belonged to (metrics.jsonl, samples.jsonl, as a fresh start clears them), and the stage starts over
    from step 0, saying why in one line (`ctx.on_note`). Nothing was restored from it: the model, the optimiser and
    the RNG are as a fresh start finds them."""
    if not has_checkpoint(files.checkpoint):
        return None
    try:
        return read_checkpoint(files.checkpoint, ctx.model, optimizer)
    except DamagedCheckpoint as err:
        discard_checkpoint(files.checkpoint)  # first: killed from here on, the stage starts afresh (no checkpoint)
        files.metrics.unlink(missing_ok=True)
        files.samples.unlink(missing_ok=True)
        note = f"{err}: the checkpoint is damaged and was removed; the stage starts over from step 0"
        (ctx.on_note or log.warning)(note)
        return None


def _restore(
    ctx: StageContext,
    path: Path,
    optimizer,
    guard: CollapseGuard,
    checkpoint: Checkpoint | None = None,
    gate: LiftGate | None = None,
) -> tuple[int, list[dict], bool]:
    """Load the checkpoint (student, teacher, optimiser, RNG; `checkpoint` when rank 0 has read it already; the lift
    `gate`'s state) and cut metrics.jsonl (alarm events are kept) and samples.jsonl back to the checkpoint's step. The
    LR needs nothing: it is a function of the step and the guard's rollbacks. Returns (next step, step history,
    whether the stage's training was over). Every rank loads the checkpoint and reads the metrics; rank 0 rewrites
    them."""
    distributed.barrier()  # rank 0's checkpoint and metric lines are all written
    rollbacks_used = guard.rollbacks_used  # a rollback has already counted itself; a resume reads it back
    state = restore_checkpoint(checkpoint or read_checkpoint(path, ctx.model, optimizer), ctx.model, optimizer)
    guard.rollbacks_used = max(rollbacks_used, state["rollbacks_used"])
    if ctx.teacher is not None and state["teacher"] is not None:
        ctx.teacher.load_state(state["teacher"])
    if gate is not None:
        gate.load_state(state.get("lift_gate"))
    next_step = state["next_step"]
    metrics_path = StageDir(ctx.stage_dir).metrics
    kept = [r for r in read_jsonl(metrics_path) if "event" in r or r["step"] <= next_step]
    distributed.barrier()  # every rank has read metrics.jsonl before rank 0 rewrites it
    if distributed.is_main():
        write_text(metrics_path, "".join(json.dumps(r) + "\n" for r in kept))
        samples_path = StageDir(ctx.stage_dir).samples
        samples = [r for r in read_jsonl(samples_path) if r["step"] <= next_step]
        write_text(samples_path, "".join(json.dumps(r) + "\n" for r in samples))
    return next_step, [r for r in kept if "event" not in r], bool(state.get("trained", False))


def _rollout_logprobs(completions: list[Completion], batch: TokenBatch) -> torch.Tensor | None:
    """The engine's per-token logprobs as [N, R] (0 on padding), or None when it returned none."""
    if any(c.logprobs is None for c in completions):
        return None
    out = torch.zeros_like(batch.response_mask)
    for i, c in enumerate(completions):
        out[i, : len(c.logprobs)] = torch.tensor(c.logprobs, dtype=out.dtype)
    return out


def _sample_record(c: Completion, r) -> tuple:
    """What the step's log needs of one sample: (reward, correct, length, truncated, repeated n-gram rate, the TRL
    reward functions' own rewards)."""
    return (r.score, r.correct, len(c.token_ids), c.finish_reason == "length", repeated_ngram_rate(c.token_ids),
            r.components)  # fmt: skip


def _length_stats(records: list[tuple]) -> dict[str, float]:
    lengths = [s[2] for s in records]
    return {
        "response_len_mean": sum(lengths) / len(lengths),
        "response_len_max": float(max(lengths)),
        "truncated_frac": sum(s[3] for s in records) / len(records),
    }
