"""Mid-stage checkpoints restore adapters, optimiser and RNG exactly (the LR is a function of the step)."""

from __future__ import annotations

import random

import torch

from adaptercl.adapters.live import adapter_state, attach_adapter, lora_parameters, set_trainable
from adaptercl.model.base import load_base
from adaptercl.recipe.grammar import LoraConfig, ModelConfig
from adaptercl.train.checkpoint import has_checkpoint, load_checkpoint, save_checkpoint


def _train_step(model, optimizer, step, ids):
    for group in optimizer.param_groups:  # a decaying LR, set from the step as the stage does
        group["lr"] = 1e-2 / (step + 1)
    loss = model(input_ids=ids).logits.float().pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_checkpoint_round_trip_continues_bit_identically(tmp_path):
    base = load_base(ModelConfig(name="tiny-random"), "none")
    model = attach_adapter(base.model, "student", LoraConfig(r=4))
    attach_adapter(model, "teacher", LoraConfig(r=4))
    set_trainable(model, "student")
    params = list(lora_parameters(model, "student").values())
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    _train_step(model, optimizer, 0, ids)
    save_checkpoint(tmp_path / "ckpt", model, ["student", "teacher"], optimizer, 1, {"rollbacks": 1})
    assert has_checkpoint(tmp_path / "ckpt")
    expected_rand = (torch.rand(3), random.random())

    # Uninterrupted continuation.
    _train_step(model, optimizer, 1, ids)
    uninterrupted = adapter_state(model, "student")

    # Scramble everything, restore, continue: identical result.
    with torch.no_grad():
        for p in lora_parameters(model, "student").values():
            p.add_(1.0)
    torch.manual_seed(999)
    random.seed(999)
    state = load_checkpoint(tmp_path / "ckpt", model, optimizer)
    assert state["next_step"] == 1 and state["rollbacks"] == 1
    assert torch.equal(torch.rand(3), expected_rand[0]) and random.random() == expected_rand[1]
    _train_step(model, optimizer, state["next_step"], ids)
    resumed = adapter_state(model, "student")
    assert uninterrupted.keys() == resumed.keys()
    assert all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)
    assert any(v.abs().max() > 0 for k, v in resumed.items() if "lora_B" in k)
