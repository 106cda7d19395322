"""A damaged mid-stage checkpoint (a file cut short or overwritten) is no resume point: the stage starts over from
step 0, saying why in one line, and ends as an uninterrupted run does; nothing of the damaged checkpoint is restored."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from adaptercl.adapters.live import adapter_state, attach_adapter, lora_parameters, set_trainable
from adaptercl.console import PlainProgress
from adaptercl.model.base import load_base
from adaptercl.recipe.grammar import LoraConfig, ModelConfig, resolve_recipe
from adaptercl.run.sequence import run_recipe
from adaptercl.system.atomic import read_jsonl
from adaptercl.train import stage as stage_module
from adaptercl.train.checkpoint import DamagedCheckpoint, read_checkpoint, save_checkpoint
from tests.train.test_guard_resume import assert_same_adapters, one_stage


def cut_short(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


DAMAGES = {  # file of the checkpoint -> what a full disk, a bad copy or a stray write left in it
    "adapters.safetensors": cut_short,
    "optimizer.pt": lambda file: file.write_bytes(b"garbage, not a torch file"),
    "rng.pt": lambda file: file.write_bytes(b""),
    "state.json": lambda file: file.write_text('{"next_step": 2, "adap'),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted 4-step run of `one_stage` (sdpo with an EMA teacher: two adapters in its checkpoints)."""
    out = tmp_path_factory.mktemp("reference")
    run_recipe(resolve_recipe(one_stage(out, steps=4)))
    return out


@pytest.mark.parametrize("name", list(DAMAGES))
def test_a_damaged_checkpoint_starts_the_stage_over_and_ends_as_an_uninterrupted_run(
    tmp_path, reference, monkeypatch, name
):
    out, steps_run = tmp_path / "run", []
    original = stage_module.train_on_batch

    def killed_in_step_3(*args, **kwargs):
        steps_run.append(1)
        if len(steps_run) == 3:
            raise RuntimeError("killed in step 3")
        return original(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(stage_module, "train_on_batch", killed_in_step_3)
        with pytest.raises(RuntimeError, match="killed in step 3"):
            run_recipe(resolve_recipe(one_stage(out, steps=4)))
    stage_dir = out / "stage-01-one"
    assert [r["step"] for r in read_jsonl(stage_dir / "metrics.jsonl")] == [1, 2]  # the checkpoint after step 2
    DAMAGES[name](stage_dir / "checkpoint" / name)

    raw = one_stage(out, steps=4)
    printed, events = io.StringIO(), []
    plain = PlainProgress(resolve_recipe(raw), printed)
    run_recipe(resolve_recipe(raw), on_event=lambda kind, **info: events.append((kind, info)) or plain(kind, **info))
    notes = [info["line"] for kind, info in events if kind == "note"]
    assert len(notes) == 1 and notes[0].startswith(f"{stage_dir / 'checkpoint' / name} ")
    assert notes[0].endswith("the checkpoint is damaged and was removed; the stage starts over from step 0")
    assert "\n" not in notes[0] and f"[stage-01-one] {notes[0]}\n" in printed.getvalue()
    assert [info["step"] for kind, info in events if kind == "step"] == [1, 2, 3, 4]  # from step 0, not from 2
    assert [r["step"] for r in read_jsonl(stage_dir / "metrics.jsonl")] == [1, 2, 3, 4]  # the lost attempt's cut
    assert read_jsonl(stage_dir / "samples.jsonl") == read_jsonl(reference / "stage-01-one" / "samples.jsonl")
    assert_same_adapters(reference, out)  # nothing of the damaged checkpoint was restored
    assert (stage_dir / "done.json").is_file() and not (stage_dir / "checkpoint").exists()
    assert not [p.name for p in stage_dir.iterdir() if p.name.startswith(".checkpoint")]


def test_a_checkpoint_that_does_not_fit_is_refused_before_anything_is_restored(tmp_path):
    base = load_base(ModelConfig(name="tiny-random"), "none")
    model = attach_adapter(base.model, "student", LoraConfig(r=4))
    set_trainable(model, "student")
    optimizer = torch.optim.AdamW(list(lora_parameters(model, "student").values()), lr=1e-2)
    save_checkpoint(tmp_path / "ckpt", model, ["student"], optimizer, 1)
    tensors = {
        f"student::{k}": torch.zeros(v.shape[0] + 1, *v.shape[1:]) for k, v in adapter_state(model, "student").items()
    }
    save_file(tensors, str(tmp_path / "ckpt" / "adapters.safetensors"))  # a rank-5 adapter where the stage has 4
    with pytest.raises(DamagedCheckpoint, match="adapters.safetensors does not hold the stage's adapter 'student'"):
        read_checkpoint(tmp_path / "ckpt", model, optimizer)
