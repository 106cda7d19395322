"""The plan reads what a method needs from its row of the method table (`recipe.method_table.METHODS`), as the
training step does, never from the method's name: the hybrid's entropy pass (`entropy_pass`) and srpo's teacher
rows kept across the step (`sample_routed`)."""

from __future__ import annotations

import dataclasses

import adaptercl.plan.memory as mp
import adaptercl.plan.step_memory as sm
from adaptercl.recipe import METHODS
from tests.plan.test_memory_plan import SHAPE_7B, tiny_recipe


def test_the_routed_teacher_rows_are_planned_for_the_methods_the_table_routes(tmp_path, monkeypatch):
    recipe = tiny_recipe(tmp_path, "sdpo")
    rows = recipe.stages[0].optim.prompts_per_step * recipe.stages[0].rollout.group_size  # 2 x 4
    assert sm.train_workload(SHAPE_7B, recipe.stages[0], 0, 1024).step_hidden_rows == 0
    monkeypatch.setitem(METHODS, "sdpo", dataclasses.replace(METHODS["sdpo"], sample_routed=True))
    assert sm.train_workload(SHAPE_7B, recipe.stages[0], 0, 1024).step_hidden_rows == rows
    monkeypatch.setitem(METHODS, "srpo", dataclasses.replace(METHODS["srpo"], sample_routed=False))
    assert sm.train_workload(SHAPE_7B, tiny_recipe(tmp_path, "srpo").stages[0], 0, 1024).step_hidden_rows == 0


def test_the_entropy_pass_is_planned_where_the_table_says_the_step_takes_one(tmp_path, monkeypatch):
    monkeypatch.setattr(sm, "ENTROPY_CHUNK_COPIES", 1e4)  # the pass, when planned, is the phase's larger part
    recipe = tiny_recipe(tmp_path, "hybrid", hybrid={"distill_on": "high_entropy"})
    assert METHODS["hybrid"].entropy_pass(recipe.stages[0].hybrid)
    assert "entropy_chunk" in mp.plan_recipe(recipe).phases[0].detail
    no_sparse_choice = dataclasses.replace(METHODS["hybrid"], sparse_token_selection=False)
    monkeypatch.setitem(METHODS, "hybrid", no_sparse_choice)
    assert not no_sparse_choice.entropy_pass(recipe.stages[0].hybrid)
    assert "entropy_chunk" not in mp.plan_recipe(recipe).phases[0].detail  # as the step: no pass, none planned
