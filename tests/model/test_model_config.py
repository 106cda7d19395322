"""A model folder whose config.json does not parse (a hub page saved from a `/blob/` link is HTML; a download cut
short) is one line naming the file from every command that reads it (`model.read_model_config`): `recipe validate`
refuses it as `recipe plan` and `recipe run` do, before anything loads."""

from __future__ import annotations

import pytest
import yaml

from adaptercl.cli import main
from tests.run.test_run import tiny_recipe

HUB_PAGE = '<!DOCTYPE html>\n<html lang="en"><head><title>config.json · Qwen/Qwen2.5-0.5B-Instruct at main</title>'
FIX = (
    "it must be the model's own config.json: download it again with the hub's /resolve/ link or "
    "`huggingface-cli download` (a /blob/ link saves the web page)"
)


@pytest.mark.parametrize(
    "text, why", [(HUB_PAGE, "an HTML or XML page"), ('{"hidden_size": 64, "num_hidd', "Unterminated string")]
)
@pytest.mark.parametrize("action", ["validate", "plan", "run"])
def test_a_model_config_that_does_not_parse_is_one_line_from_every_command(tmp_path, capsys, action, text, why):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(text)
    raw = tiny_recipe(tmp_path / "run")
    raw["model"] = {"name": str(model)}
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(raw))
    assert main(["recipe", action, str(recipe_file)]) == 2  # validate said "ok" and exited 0 here
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {model / 'config.json'} is not valid JSON ({why}")
    assert err.endswith(f"): {FIX}\n")
    assert not (tmp_path / "run").exists()  # nothing started
