"""`adaptercl recipe validate` catches what is knowable before a model loads, each as exit code 2 and one line naming
the field (through `adaptercl.cli.main`, as a user runs it); unreachable hub models and datasets at run time are one
line naming them and HF_HUB_OFFLINE."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
from pydantic import ValidationError

from adaptercl.cli import main
from adaptercl.recipe.config_block import ConfigBlock
from adaptercl.recipe.grammar import DomainConfig, ModelConfig, RecipeError

QUICKSTART = str(Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml")


def validate(capsys, *args: str, recipe: str = QUICKSTART) -> tuple[int, str]:
    code = main(["recipe", "validate", recipe, *args])
    captured = capsys.readouterr()
    return code, captured.err


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0].removeprefix("error: ")


def test_a_valid_recipe_passes(capsys, tmp_path):
    assert main(["recipe", "validate", QUICKSTART, f"output_dir={tmp_path / 'run'}"]) == 0
    assert capsys.readouterr().out.startswith("ok: ")


def test_missing_local_data_file(capsys, tmp_path):
    missing = tmp_path / "nope.jsonl"
    code, err = validate(capsys, f"domains.arithmetic.source={missing}", "domains.arithmetic.format=gsm8k")
    assert code == 2
    assert one_error_line(err) == f"domains.arithmetic.source: local path '{missing}' does not exist"


def test_missing_split_file_in_a_local_folder(capsys, tmp_path):
    (tmp_path / "train.jsonl").write_text("")
    code, err = validate(capsys, f"domains.arithmetic.source={tmp_path}", "domains.arithmetic.format=gsm8k")
    assert code == 2 and one_error_line(err).startswith("domains.arithmetic.eval_split: no test.jsonl")


def test_reward_that_does_not_import(capsys):
    code, err = validate(capsys, "domains.arithmetic.reward=no_such_pkg_adaptercl.rewards:score")
    assert code == 2
    assert one_error_line(err).startswith(
        "domains.arithmetic.reward 'no_such_pkg_adaptercl.rewards:score': cannot import module"
    )


def test_reward_function_missing_from_its_module(capsys):
    code, err = validate(capsys, "domains.arithmetic.reward=json:no_such_function")
    assert code == 2 and one_error_line(err).endswith("module 'json' has no function 'no_such_function'")


def test_vllm_engine_without_vllm(capsys, monkeypatch):
    import adaptercl.rollout.vllm_settings as vllm_settings

    real = vllm_settings.importlib.util.find_spec
    monkeypatch.setattr(vllm_settings.importlib.util, "find_spec", lambda n, *a: None if n == "vllm" else real(n, *a))
    code, err = validate(capsys, "rollout.engine=vllm")
    assert code == 2 and one_error_line(err).startswith("rollout.engine: vllm is not installed; install it with")


def test_recipe_file_that_is_not_text(capsys, tmp_path):
    binary = tmp_path / "model.yaml"
    binary.write_bytes(b"model:\x00\xff\xfe\x89PNG")
    code, err = validate(capsys, recipe=str(binary))
    assert code == 2 and one_error_line(err) == f"{binary}: not a text file (byte 7 is not UTF-8); a recipe is YAML"


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("optim.lr=.inf", "stages.arithmetic.optim.lr"),
        ("stages.mcq.distill.success_threshold=.nan", "stages.mcq.distill.success_threshold"),
        ("regularizers.l2_prev=-.inf", "stages.arithmetic.regularizers.l2_prev"),
        ("lora.alpha=.inf", "stages.arithmetic.lora.alpha"),
    ],
)
def test_non_finite_numbers(capsys, override, field):
    code, err = validate(capsys, override)
    assert code == 2 and one_error_line(err).startswith(f"{field}: Input should be a finite number")


def float_fields() -> list[tuple[type, str, bool]]:
    """(block, field, is a list) for every float-typed field of every recipe block."""
    blocks, todo = [], [ConfigBlock]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        blocks.append(cls)
    out = []
    for block in blocks:
        for name, field in block.model_fields.items():
            args = typing.get_args(field.annotation) or (field.annotation,)
            if float in args:
                out.append((block, name, False))
            elif any(typing.get_origin(a) is list and typing.get_args(a) == (float,) for a in args):
                out.append((block, name, True))
    return out


FLOAT_FIELDS = float_fields()


def test_the_grammar_has_float_fields_in_every_method_block():
    names = {block.__name__ for block, _, _ in FLOAT_FIELDS}
    assert {
        "OptimConfig",
        "GrpoConfig",
        "DistillConfig",
        "TeacherConfig",
        "MonitorConfig",
        "AdapterInitConfig",
    } <= names
    assert len(FLOAT_FIELDS) > 30


@pytest.mark.parametrize(
    ("block", "name", "is_list"), FLOAT_FIELDS, ids=[f"{b.__name__}.{n}" for b, n, _ in FLOAT_FIELDS]
)
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
def test_every_float_field_rejects_non_finite_numbers(block, name, is_list, value):
    with pytest.raises(ValidationError) as err:
        block.model_validate({name: [value] if is_list else value})
    ours = [e for e in err.value.errors() if e["loc"][0] == name]
    assert ours and all(e["type"] == "finite_number" for e in ours), ours


def test_output_dir_that_is_a_file(capsys, tmp_path):
    file = tmp_path / "results.txt"
    file.write_text("not a folder")
    code, err = validate(capsys, f"output_dir={file}")
    assert (
        code == 2 and one_error_line(err) == f"output_dir: '{file}' is a file, not a folder; choose another output_dir"
    )
    code, err = validate(capsys, f"output_dir={file}/run")
    assert code == 2 and one_error_line(err).startswith(
        f"output_dir: '{file}/run' lies under '{file}', which is a file"
    )


def test_run_refuses_an_output_dir_that_is_a_file_before_loading(capsys, tmp_path):
    file = tmp_path / "results.txt"
    file.write_text("x")
    assert main(["recipe", "run", QUICKSTART, f"output_dir={file}"]) == 2
    assert one_error_line(capsys.readouterr().err).startswith("output_dir: ")


def test_missing_local_model_path(capsys, tmp_path):
    code, err = validate(capsys, f"model.name={tmp_path}/model.gguf")
    assert code == 2 and one_error_line(err) == f"model.name: local path '{tmp_path}/model.gguf' does not exist"


# ----------------------------------------------------------------------------- lora.layers vs the base's layers


def layers_message(index: int, model: str, count: int) -> str:
    return (
        f"stages.arithmetic.lora.layers: layer {index} does not exist; {model} has {count} layers: 0..{count - 1} "
        f"(or -{count}..-1 counting from the top)"
    )


@pytest.mark.parametrize(
    ("model", "layers", "index", "count"),
    [
        ("smollm2-135m-instruct", "[100]", 100, 30),  # was layer 100 % 30 = 10, silently
        ("smollm2-135m-instruct", "[-1, -31]", -31, 30),
        ("tiny-random", "[0, 2]", 2, 2),
    ],
)
def test_a_lora_layer_the_builtin_model_lacks_is_one_line_at_validate(capsys, model, layers, index, count):
    code, err = validate(capsys, f"model.name={model}", f"lora.layers={layers}")
    assert code == 2 and one_error_line(err) == layers_message(index, model, count)


def test_lora_layers_in_range_pass_validate(capsys, tmp_path):
    code, _ = validate(capsys, "lora.layers=[0, 29, -30]", f"output_dir={tmp_path / 'run'}")
    assert code == 0


@pytest.mark.parametrize("nested", [False, True], ids=["config", "text_config"])
def test_lora_layers_of_a_local_folder_come_from_its_config_json_alone(capsys, tmp_path, nested):
    """No weights in the folder: the count is read from config.json (a multimodal model's from its text_config)."""
    import json

    config = {"model_type": "llava", "text_config": {"num_hidden_layers": 3}} if nested else {"num_hidden_layers": 3}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, err = validate(capsys, f"model.name={tmp_path}", "lora.layers=[-4]")
    assert code == 2 and one_error_line(err) == layers_message(-4, str(tmp_path), 3)


def test_lora_layers_of_a_gguf_file_come_from_its_metadata(capsys, tiny_gguf):
    code, err = validate(capsys, f"model.name={tiny_gguf}", "lora.layers=[1, 2]")  # the tiny GGUF has 2 blocks
    assert code == 2 and one_error_line(err) == layers_message(2, str(tiny_gguf), 2)


def fake_hub_snapshot(cache, repo_id: str, config: dict) -> None:
    """The local hub cache's layout of one model's config.json at `main` (models--ORG--NAME/refs, snapshots)."""
    import json

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40) / "config.json").write_text(json.dumps(config))


def test_lora_layers_of_a_hub_model_come_from_the_local_hub_cache(capsys, tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    fake_hub_snapshot(tmp_path / "hub", "adaptercl-test/cached", {"num_hidden_layers": 28})
    code, err = validate(capsys, "model.name=adaptercl-test/cached", "lora.layers=[28]")
    assert code == 2 and one_error_line(err) == layers_message(28, "adaptercl-test/cached", 28)
    code, err = validate(capsys, "model.name=adaptercl-test/not-cached", "lora.layers=[28]")
    assert code == 0, err  # not knowable without a download: the run checks it before anything loads


def test_a_run_fetches_an_uncached_hub_models_config_alone_and_refuses_before_loading(capsys, tmp_path, monkeypatch):
    """The run path: a hub model not in the local cache. Its config.json alone is fetched (the first file
    `from_pretrained` fetches too); the bad layer is one line, exit 2, before a weight loads or output_dir exists.
    The hub is the one thing faked: hf_hub_download returns the config file the hub would."""
    import json

    import huggingface_hub

    import adaptercl.run.live_run

    fetched = []

    def hf_hub_download(repo_id, filename, revision=None, **kwargs):
        fetched.append((repo_id, filename, revision))
        path = tmp_path / "fetched" / filename
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({"num_hidden_layers": 4}))
        return str(path)

    def no_load(*args, **kwargs):
        raise AssertionError("load_base was called before lora.layers was checked")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # empty
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(adaptercl.run.live_run, "load_base", no_load)
    run_dir = tmp_path / "run"
    args = ["model.name=adaptercl-test/remote", "lora.layers=[4]", f"output_dir={run_dir}"]
    assert main(["recipe", "run", QUICKSTART, *args]) == 2
    assert one_error_line(capsys.readouterr().err) == layers_message(4, "adaptercl-test/remote", 4)
    assert fetched == [("adaptercl-test/remote", "config.json", None)] and not run_dir.exists()


# --------------------------------------------------------------------------------------------------- run time


def test_unreachable_hub_model_is_one_line_naming_it_and_hf_hub_offline(monkeypatch):
    from adaptercl.model.base import load_base

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # conftest sets it too; a fresh id is in no cache
    with pytest.raises(RecipeError) as err:
        load_base(ModelConfig(name="adaptercl-test/no-such-model"), "none")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("model.name: cannot load hub model 'adaptercl-test/no-such-model': HF_HUB_OFFLINE=1")


def test_unreachable_hub_dataset_is_one_line_naming_it_and_hf_hub_offline(monkeypatch):
    import datasets

    from adaptercl.domains import load_domain

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    cfg = DomainConfig(name="math", source="adaptercl-test/no-such-dataset", format="gsm8k")
    with pytest.raises(RecipeError) as err:
        load_domain(cfg, seed=0, num_eval=2)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(
        "domains.math.source: cannot load hub dataset 'adaptercl-test/no-such-dataset' split 'test': datasets is "
        "offline (HF_HUB_OFFLINE=1)"
    )


def test_every_rollout_engine_the_grammar_allows_has_a_kind_and_an_importable_home():
    from importlib import import_module
    from typing import get_args

    from adaptercl.recipe.rollout_block import ENGINES, RolloutConfig

    # `auto` is no engine: rollout.engine_choice.resolve_engine makes it hf or vllm before the run
    # (tests/rollout/test_engine_choice.py)
    assert set(ENGINES) | {"auto"} == set(get_args(RolloutConfig.model_fields["engine"].annotation))
    for kind in ENGINES.values():
        if kind.home is not None:
            module, name = kind.home.split(":")
            assert hasattr(getattr(import_module(module), name), "from_recipe")
