"""Export and serve: a finished tiny-random two-stage run shipped as per-domain PEFT folders, then served by vLLM."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file

from adaptercl.cli import main
from adaptercl.model.base import SMOLLM2_HUB_ID as HUB_ID
from adaptercl.model.base import cache_root, load_base, materialize_tiny_random
from adaptercl.recipe.grammar import RecipeError, resolve_recipe
from adaptercl.run.sequence import run_recipe
from adaptercl.ship.export import export_run
from adaptercl.ship.serving import serve_command
from tests.run.test_run import tiny_recipe


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    run_recipe(resolve_recipe(tiny_recipe(run)))
    out = tmp_path_factory.mktemp("export") / "shipped"
    assert export_run(run, out, merged=True) == out
    return run, out, json.loads((out / "manifest.json").read_text())


def test_manifest_lists_every_domain_folder_and_the_combined_one(exported):
    run, out, manifest = exported
    assert manifest["version"] == 2 and manifest["base_model"] == "tiny-random" and manifest["base_model_id"] is None
    assert (out / manifest["run_dir"]).resolve() == run.resolve()  # relative to the manifest's folder
    entries = {e["name"]: e for e in manifest["adapters"]}
    assert list(entries) == ["arith", "mcq", "combined"]
    assert {n: e["stage"] for n, e in entries.items()} == {
        "arith": "stage-01-one",
        "mcq": "stage-02-two",
        "combined": "stage-02-two",
    }
    assert entries["combined"]["rank"] == 8 and entries["arith"]["rank"] == 4  # combined: ranks concatenated
    summary = json.loads((run / "summary.json").read_text())
    assert entries["arith"]["accuracy"] == dict(zip(summary["domains"], summary["accuracy"][1]))
    assert sorted(p.name for p in out.iterdir()) == ["arith", "combined", "manifest.json", "mcq"]
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp folder left behind


def test_an_export_holds_no_path_of_the_exporting_machine(exported):
    run, out, _ = exported
    local = [str(materialize_tiny_random(cache_root())), str(run.resolve()), str(out.resolve().parent)]
    for path in [out / "manifest.json", *out.glob("*/adapter_config.json"), *out.glob("*/README.md")]:
        text = path.read_text()
        assert not [p for p in local if p in text], path
    for name in ("arith", "mcq", "combined"):  # no hub id: the recipe's name, and the card says what to do
        config = json.loads((out / name / "adapter_config.json").read_text())
        assert (config["base_model_name_or_path"], config["revision"]) == ("tiny-random", None)
        card = (out / name / "README.md").read_text()
        assert "base_model:" not in card.split("---")[1]  # the Hub accepts only a hub id there
        assert "has no hub id" in card and "`base_model_name_or_path`" in card


@pytest.mark.parametrize(
    "name, source", [("arith", "stage-01-one/adapter"), ("mcq", "stage-02-two/adapter"), ("combined", None)]
)
def test_every_folder_reloads_bit_identical(exported, name, source):
    run, out, manifest = exported
    source = run / (source or "stage-02-two/combined_adapter")
    expected = load_file(str(source / "adapter_model.safetensors"))
    base = load_base(resolve_recipe(tiny_recipe(run)).model, "none")
    model = PeftModel.from_pretrained(base.model, str(out / name), adapter_name=name)
    lora = {n.replace(f".{name}.", "."): p for n, p in model.named_parameters() if "lora_" in n}
    assert lora.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(lora[key].detach(), tensor)


def test_model_card_gives_accuracies_and_forgetting(exported):
    run, out, _ = exported
    accuracy = json.loads((run / "summary.json").read_text())["accuracy"]  # rows: before, one, two
    card = (out / "mcq" / "README.md").read_text()
    assert "Base model: `tiny-random`" in card and "Method: `grpo`" in card
    assert f"| mcq (trained) | {accuracy[1][1]:.4f} | {accuracy[2][1]:.4f} |" in card
    assert f"- `arith`: {accuracy[1][0] - accuracy[2][0]:+.4f}" in card  # forgetting stage two caused on arith
    assert "```yaml\nname: two\ndomain: mcq\n" in card  # the stage's resolved recipe block
    assert "stage-01-one" in card  # the evaluated model was both stage adapters


def test_bad_inputs_are_one_line_errors(exported, tmp_path, capsys):
    run, out, _ = exported
    with pytest.raises(RecipeError, match="not a run directory"):
        export_run(tmp_path, tmp_path / "x")
    with pytest.raises(RecipeError, match="not empty"):
        export_run(run, out)
    unfinished = tmp_path / "unfinished"
    shutil.copytree(run, unfinished)
    (unfinished / "stage-02-two" / "done.json").unlink()
    with pytest.raises(RecipeError, match="unfinished .stage-02-two"):
        export_run(unfinished, tmp_path / "y")
    assert not (tmp_path / "y").exists()
    assert main(["export", str(unfinished), "--out", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: export:") and err.count("\n") == 1
    assert main(["serve", str(tmp_path), "--print-command"]) == 2
    assert "no manifest.json" in capsys.readouterr().err
    # an --out that is a file or lies under one: one line before anything is read (was a FileExistsError traceback)
    (tmp_path / "file").write_text("mine")
    for target, says in (("file", "is a file"), ("file/x", "lies under")):
        assert main(["export", str(run), "--out", str(tmp_path / target)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: export: --out") and says in err and err.count("\n") == 1
    assert (tmp_path / "file").read_text() == "mine"


def test_print_command_names_every_adapter(exported, capsys):
    _, out, manifest = exported
    assert main(["serve", str(out), "--port", "8123", "--print-command"]) == 0
    command = capsys.readouterr().out.split()
    base = str(materialize_tiny_random(cache_root()))  # the alias resolved on this machine
    assert command[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", base]
    modules = command[command.index("--lora-modules") + 1 :][:3]
    assert modules == [f"{n}={(out / n).resolve()}" for n in ("arith", "mcq", "combined")]
    assert command[command.index("--max-lora-rank") + 1] == "8" and "8123" in command


def test_serve_names_the_adapter_whose_rank_vllm_cannot_hold(tmp_path):
    (tmp_path / "wide").mkdir()
    (tmp_path / "wide" / "adapter_config.json").write_text("{}")
    save_file({"x": torch.zeros(1)}, str(tmp_path / "wide" / "adapter_model.safetensors"))  # weights, whole
    manifest = {
        "base_model": "b",
        "base_model_path": str(tmp_path),
        "adapters": [{"name": "wide", "path": "wide", "rank": 600}],
    }
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        RecipeError, match=r"^serve: adapter 'wide' of .*manifest.json: rank 600 is above vLLM's largest"
    ):
        serve_command(tmp_path)


ALIAS, REVISION = "smollm2-135m-instruct", "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path) -> Path:
    """A local hub cache (HF_HUB_CACHE's layout) holding tiny-random's files as the repo of the built-in alias
    smollm2-135m-instruct (HUB_ID) at main; returns `root`."""
    repo = root / f"models--{HUB_ID.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    shutil.copytree(materialize_tiny_random(cache_root()), repo / "snapshots" / REVISION)
    return root


@pytest.fixture(scope="module")
def hub_export(tmp_path_factory):
    """A one-stage run of the alias smollm2-135m-instruct, whose base loads from its hub repository in a local hub
    cache (tiny weights stand in for it; no GGUF conversion in the empty cache_dir), and its export. That cache is
    deleted afterwards: whoever loads the export finds the base by its hub id in a cache of its own."""
    import huggingface_hub

    root = tmp_path_factory.mktemp("exporting-machine")
    run, out = root / "run", root / "shipped"
    one_stage = tiny_recipe(
        run,
        model={"name": ALIAS, "cache_dir": str(root / "adaptercl-cache")},
        optim={"lr": 5e-3, "steps": 1, "prompts_per_step": 2},
        stages=[{"name": "one", "domain": "arith"}],
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache(root / "hub")))
        run_recipe(resolve_recipe(one_stage))
        export_run(run, out)
    shutil.rmtree(root / "hub")
    return run, out


def test_a_copied_export_loads_with_auto_peft_finding_the_base_by_hub_id(hub_export, tmp_path, monkeypatch):
    import huggingface_hub
    from peft import AutoPeftModelForCausalLM

    run, out = hub_export
    root = run.parent
    copy = tmp_path / "elsewhere" / "shipped"
    shutil.copytree(out, copy)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache(tmp_path / "hub")))
    monkeypatch.chdir(tmp_path)
    model = AutoPeftModelForCausalLM.from_pretrained(str(copy / "arith"))
    expected = load_file(str(run / "stage-01-one" / "adapter" / "adapter_model.safetensors"))
    lora = {n.replace(".default.", "."): p for n, p in model.named_parameters() if "lora_" in n}
    assert lora.keys() == expected.keys()
    assert all(torch.equal(lora[key].detach(), tensor) for key, tensor in expected.items())
    base = load_file(str(materialize_tiny_random(cache_root()) / "model.safetensors"))
    assert torch.equal(model.get_base_model().model.embed_tokens.weight.detach(), base["model.embed_tokens.weight"])
    card = (copy / "arith" / "README.md").read_text()
    assert f'base_model: "{HUB_ID}"' in card.split("---")[1] and f"Base model: `{HUB_ID}`" in card
    assert 'AutoPeftModelForCausalLM.from_pretrained("arith")' in card
    manifest = json.loads((copy / "manifest.json").read_text())
    assert [manifest[key] for key in ("base_model", "base_model_id", "base_model_revision")] == [ALIAS, HUB_ID, None]
    assert not [p for p in (root / "run", root / "shipped") if str(p) in json.dumps(manifest)]


def card_snippets(card: str) -> list[str]:
    """The Python code blocks of a model card's Use section, as written."""
    return re.findall(r"```python\n(.*?)```", card, re.S)


def run_as_the_card_says(snippet: str, folder: Path, monkeypatch) -> dict:
    """Execute a card's snippet from the export folder (its adapter paths are relative to it) with HF_HUB_OFFLINE=1,
    huggingface_hub's own flag included (it reads the variable when imported); return the snippet's names."""
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(folder)
    names: dict = {}
    exec(compile(snippet, "README.md", "exec"), names)  # noqa: S102 - the card's own code, as a user runs it
    return names


def assert_loaded_the_stage_adapter(model, adapter_dir: Path) -> None:
    expected = load_file(str(adapter_dir / "adapter_model.safetensors"))
    lora = {n.replace(".default.", "."): p for n, p in model.named_parameters() if "lora_" in n}
    assert lora.keys() == expected.keys()
    assert all(torch.equal(lora[key].detach(), tensor) for key, tensor in expected.items())
    base = load_file(str(materialize_tiny_random(cache_root()) / "model.safetensors"))
    assert torch.equal(model.get_base_model().model.embed_tokens.weight.detach(), base["model.embed_tokens.weight"])


def test_a_card_without_a_hub_id_loads_offline_exactly_as_it_says(exported, monkeypatch):
    run, out, _ = exported
    card = (out / "arith" / "README.md").read_text()
    (snippet,) = card_snippets(card)
    assert 'base_folder("tiny-random")' in snippet and 'PeftModel.from_pretrained(base_model, "arith")' in snippet
    names = run_as_the_card_says(snippet, out, monkeypatch)
    assert_loaded_the_stage_adapter(names["model"], run / "stage-01-one" / "adapter")


def test_a_card_of_an_alias_shows_both_loads_and_the_local_one_runs_offline(hub_export, tmp_path, monkeypatch):
    """The alias's card: by hub id (run in the test above), and against the local base folder adaptercl loads the
    alias from (here its snapshot in a local hub cache; an empty adaptercl cache holds no GGUF conversion)."""
    import huggingface_hub

    run, out = hub_export
    card = (out / "arith" / "README.md").read_text()
    by_hub_id, local = card_snippets(card)
    assert 'AutoPeftModelForCausalLM.from_pretrained("arith")' in by_hub_id
    assert 'base_folder("smollm2-135m-instruct")' in local
    assert "converted once from the GGUF of its wheel into `smollm2-135m-instruct/` under `~/.cache/adaptercl`" in card
    assert "python -c \"from adaptercl.model import base_folder; print(base_folder('smollm2-135m-instruct'))\"" in card
    monkeypatch.setenv("ADAPTERCL_CACHE", str(tmp_path / "empty-adaptercl-cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache(tmp_path / "hub")))
    names = run_as_the_card_says(local, out, monkeypatch)
    assert_loaded_the_stage_adapter(names["model"], run / "stage-01-one" / "adapter")


def test_serve_names_a_local_base_that_is_not_on_this_machine(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "adapter_config.json").write_text("{}")
    save_file({"x": torch.zeros(1)}, str(tmp_path / "a" / "adapter_model.safetensors"))
    manifest = {"version": 2, "base_model": str(tmp_path / "gone"), "base_model_id": None, "base_model_revision": None}
    manifest["adapters"] = [{"name": "a", "path": "a", "rank": 4}]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RecipeError, match=r"^serve: the base '.*gone' of .*manifest.json is not on this machine \("):
        serve_command(tmp_path)


def synthetic_export(root: Path) -> Path:
    """An export folder as `adaptercl export` writes it, by hand: two adapter folders (config and a small but whole
    safetensors file) and a version-2 manifest."""
    for name in ("arith", "mcq"):
        (root / name).mkdir(parents=True)
        (root / name / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
        save_file({"x.lora_A.weight": torch.zeros(4, 8)}, str(root / name / "adapter_model.safetensors"))
    entries = [{"name": n, "domain": n, "path": n, "rank": 4} for n in ("arith", "mcq")]
    manifest = {"version": 2, "base_model": "tiny-random", "base_model_id": None, "adapters": entries}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("del m['adapters']", "is damaged (adapters: Field required)"),
        ("m['adapters'] = {}", "is damaged (adapters: Input should be a valid list)"),
        ("del m['adapters'][0]['path']", "is damaged (adapters.0.path: Field required)"),
        ("del m['adapters'][1]['rank']", "is damaged (adapters.1.rank: Field required)"),
        ("m['adapters'][0]['rank'] = 'four'", "is damaged (adapters.0.rank: Input should be a valid integer"),
        ("del m['base_model']", "is damaged (base_model: Field required)"),
        ("m['version'] = 1", "(version 1) has no 'base_model_path'"),
        ("m['adapters'] = []", "lists no adapters"),
        ("m['adapters'][1]['path'] = 'elsewhere'", "adapter folder 'elsewhere' of "),
    ],
)
def test_a_manifest_edited_or_of_another_shape_is_one_line(tmp_path, capsys, edit, message):
    # each but the last two used to be a KeyError or TypeError traceback
    export = synthetic_export(tmp_path / "shipped")
    manifest = json.loads((export / "manifest.json").read_text())
    exec(edit, {"m": manifest})
    (export / "manifest.json").write_text(json.dumps(manifest))
    assert main(["serve", str(export), "--print-command"]) == 2
    captured = capsys.readouterr()
    assert (
        captured.out == ""
        and captured.err.startswith("error: serve: ")
        and str(export / "manifest.json") in captured.err
    )
    assert message in captured.err and captured.err.count("\n") == 1


def test_an_export_copied_without_whole_weights_is_one_line(tmp_path, capsys):
    # moved between machines: a weights file left behind, or cut short by a full disk (was served as it was)
    export = synthetic_export(tmp_path / "shipped")
    (export / "mcq" / "adapter_model.safetensors").unlink()
    assert main(["serve", str(export), "--print-command"]) == 2
    assert "adapter folder 'mcq' of" in capsys.readouterr().err
    weights = synthetic_export(tmp_path / "cut") / "arith" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-20])
    assert main(["serve", str(tmp_path / "cut"), "--print-command"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {weights} is damaged (") and err.count("\n") == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


@pytest.mark.vllm
def test_serve_answers_chat_completions_with_two_adapters(exported, tmp_path):
    _, out, _ = exported
    port = _free_port()
    log_path = tmp_path / "server.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "adaptercl.cli", "serve", str(out), "--port", str(port), "--host", "127.0.0.1"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{base}/models", timeout=5) as response:
                    served = {m["id"] for m in json.loads(response.read())["data"]}
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                tail = "\n".join(log_path.read_text().splitlines()[-30:])
                assert server.poll() is None, f"server exited with {server.returncode}:\n{tail}"
                assert time.monotonic() < deadline, f"server not up after 180 s:\n{tail}"
                time.sleep(2)
        assert {"arith", "mcq", "combined", "tiny-random"} <= served
        for name in ("arith", "mcq"):
            reply = _post(
                f"{base}/chat/completions",
                {"model": name, "messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 4, "temperature": 0},
            )
            assert reply["model"] == name
            assert reply["usage"]["completion_tokens"] > 0 and reply["choices"][0]["message"]["role"] == "assistant"
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
