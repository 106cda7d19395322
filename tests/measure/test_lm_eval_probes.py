"""lm-eval retention probes (measure/lm_eval.py), offline with a local custom multiple-choice task: a tiny run writes
lm_eval.json per stage whose acc / acc_norm equal a hand log-likelihood computation on the saved adapters, and the
report shows them; no network is touched."""

from __future__ import annotations

import json
import math
import socket

import pytest
import torch
from peft import PeftModel

from adaptercl.recipe.grammar import RecipeError, resolve_recipe
from adaptercl.run.preflight_checks import preflight

pytest.importorskip("lm_eval")

TASK = "adaptercl_tiny_mc"
ITEMS = [
    {"question": "What is 2 + 2?", "choices": ["3", "4", "5"], "gold": 1},
    {"question": "The sky on a clear day is", "choices": ["blue", "green"], "gold": 0},
    {"question": "Water freezes at", "choices": ["0 degrees", "100 degrees", "fifty"], "gold": 0},
    {"question": "A cat is a", "choices": ["mammal", "fish", "bird", "rock"], "gold": 0},
    {"question": "Ten minus three is", "choices": ["seven", "six"], "gold": 0},
    {"question": "The opposite of hot is", "choices": ["cold", "warm", "loud"], "gold": 0},
]


def write_task(folder) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "items.jsonl").write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'items.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{gold}}"\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )


def tiny_recipe(out, tasks_dir) -> dict:
    return {
        "model": {"name": "tiny-random"},
        "output_dir": str(out),
        "lora": {"r": 4, "alpha": 8},
        "optim": {"lr": 5e-2, "steps": 1, "prompts_per_step": 2},
        "rollout": {"group_size": 4, "max_new_tokens": 8},
        "eval": {
            "examples_per_domain": 2,
            "drift_probes": 0,
            "stage_kl_prompts": 0,
            "parameter_drift": False,
            "lm_eval": {"tasks": [TASK], "include_path": str(tasks_dir), "batch_size": 4},
        },
        "domains": [{"name": "arith", "source": "builtin:arithmetic", "reward": "tiny_rewards:digit_fraction"}],
        "stages": [{"name": "one", "domain": "arith"}],
    }


@pytest.fixture(scope="module")
def probed_run(tmp_path_factory):
    from adaptercl.run.sequence import run_recipe

    root = tmp_path_factory.mktemp("lm_eval")
    write_task(root / "tasks")
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_DATASETS_OFFLINE", "1")

    def no_network(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    mp.setattr(socket.socket, "connect", no_network)
    try:
        run_recipe(resolve_recipe(tiny_recipe(root / "run", root / "tasks")))
    finally:
        mp.undo()
    return root


def hand_scores(model, tokenizer) -> tuple[float, float]:
    """acc and acc_norm of ITEMS by summed continuation log-likelihood, encoded as lm-eval's HFLM does."""
    acc = acc_norm = 0
    for item in ITEMS:
        context = f"{item['question']}\nAnswer:"
        ctx = tokenizer(context, add_special_tokens=False).input_ids
        lls, norms = [], []
        for choice in item["choices"]:
            whole = tokenizer(context + " " + choice, add_special_tokens=False).input_ids
            cont = whole[len(ctx) :]
            with torch.no_grad():
                logits = model(torch.tensor([whole[:-1]])).logits[0].float()  # [T-1, V]
            logp = torch.log_softmax(logits, -1)[len(ctx) - 1 :]  # [len(cont), V]
            ll = logp.gather(-1, torch.tensor(cont)[:, None]).sum().item()
            lls.append(ll)
            norms.append(ll / len(choice))  # lm-eval: characters of the choice, without the delimiter
        acc += max(range(len(lls)), key=lls.__getitem__) == item["gold"]
        acc_norm += max(range(len(norms)), key=norms.__getitem__) == item["gold"]
    return acc / len(ITEMS), acc_norm / len(ITEMS)


def test_lm_eval_json_equals_a_hand_log_likelihood(probed_run):
    from adaptercl.model.base import load_base
    from adaptercl.recipe.grammar import ModelConfig

    run = probed_run / "run"
    before = json.loads((run / "stage-00-before" / "lm_eval.json").read_text())
    after = json.loads((run / "stage-01-one" / "lm_eval.json").read_text())
    base = load_base(ModelConfig(name="tiny-random"), "none")
    base.model.eval()
    expected_before = hand_scores(base.model, base.tokenizer)
    model = PeftModel.from_pretrained(base.model, str(run / "stage-01-one" / "adapter")).eval()
    expected_after = hand_scores(model, base.tokenizer)
    for result, (acc, acc_norm) in ((before, expected_before), (after, expected_after)):
        row = result["tasks"][TASK]
        assert row["n"] == len(ITEMS) and result["limit"] is None
        assert row["acc"] == pytest.approx(acc) and row["acc_norm"] == pytest.approx(acc_norm)
        n = len(ITEMS)
        assert row["acc_stderr"] == pytest.approx(math.sqrt(acc * (1 - acc) / (n - 1)))  # sample std / sqrt(n)


def test_report_shows_the_lm_eval_probes(probed_run):
    report = (probed_run / "run" / "report.md").read_text()
    assert "## lm-eval probes" in report
    after = json.loads((probed_run / "run" / "stage-01-one" / "lm_eval.json").read_text())["tasks"][TASK]
    assert f"| stage-01-one | {after['acc']:.3f} ± {after['acc_stderr']:.3f} |" in report


def test_unknown_task_and_missing_folder_fail_before_loading(probed_run, tmp_path):
    raw = tiny_recipe(tmp_path / "run", probed_run / "tasks")
    raw["eval"]["lm_eval"]["tasks"] = [TASK, "adaptercl_no_such_task"]
    with pytest.raises(RecipeError, match="eval.lm_eval.tasks: unknown lm-eval task 'adaptercl_no_such_task'"):
        preflight(resolve_recipe(raw))
    raw["eval"]["lm_eval"]["include_path"] = str(tmp_path / "missing")
    with pytest.raises(RecipeError, match="eval.lm_eval.include_path: folder .* does not exist"):
        preflight(resolve_recipe(raw))


def test_a_stage_resumed_after_its_probes_records_their_seconds(probed_run, tmp_path, monkeypatch):
    """Killed after lm_eval.json was written (before done.json), the resumed stage keeps the file and counts its
    probes' seconds as the file recorded them, as an uninterrupted stage does."""
    from adaptercl.run import sequence
    from adaptercl.run.sequence import run_recipe

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    recipe = resolve_recipe(tiny_recipe(tmp_path / "run", probed_run / "tasks"))

    def killed(*args) -> None:  # the stage's last files (eval.json, drift.json, done.json) are never written
        raise RuntimeError("killed")

    with monkeypatch.context() as patch:
        patch.setattr(sequence, "_finish_stage", killed)
        with pytest.raises(RuntimeError, match="killed"):
            run_recipe(recipe)
    stage = tmp_path / "run" / "stage-01-one"
    recorded = json.loads((stage / "lm_eval.json").read_text())["seconds"]
    assert recorded > 0 and not (stage / "done.json").exists()
    run_recipe(recipe)
    assert json.loads((stage / "done.json").read_text())["seconds"]["lm_eval"] == recorded
    assert json.loads((stage / "lm_eval.json").read_text())["seconds"] == recorded  # kept, not probed again


def test_tasks_a_task_yaml_names_are_checked_without_lm_evals_task_index(probed_run, monkeypatch):
    """recipe validate: a task named in a YAML of include_path or of lm-eval's tasks folder (a task, a group, a tag) is
    known without building lm-eval's task index (~25 s); a name no YAML gives falls back to the index."""
    from adaptercl.measure import lm_eval as probes
    from adaptercl.recipe.eval_block import LmEvalConfig

    class NoTasks:
        all_tasks: list[str] = []

    built = []
    monkeypatch.setattr(probes, "_task_manager", lambda include_path: built.append(include_path) or NoTasks())
    probes.check_tasks(
        LmEvalConfig(tasks=[TASK, "arc_easy", "ai2_arc", "mmlu"], include_path=str(probed_run / "tasks"))
    )
    assert built == []  # the custom task, a builtin task, a tag, a group: each found by name
    with pytest.raises(RecipeError, match=r"^eval.lm_eval.tasks: unknown lm-eval task 'arc_eazy'; "):
        probes.check_tasks(LmEvalConfig(tasks=["arc_easy", "arc_eazy"]))
    assert built == [None]  # the typo, and only it, was looked up in the index


def test_checking_a_task_loads_neither_torch_nor_peft():
    """recipe validate with an lm-eval task: the check needs only YAML, not the probe's torch, transformers or PEFT
    (seconds to import on a busy machine), in a fresh interpreter."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom adaptercl.measure.lm_eval import check_tasks\n"
        "from adaptercl.recipe.eval_block import LmEvalConfig\n"
        "check_tasks(LmEvalConfig(tasks=['arc_easy']))\n"
        "print(sorted({'torch', 'transformers', 'peft'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_an_lm_eval_probe_outside_a_git_repository_prints_no_git_error(probed_run, tmp_path, monkeypatch, capfd):
    """lm-eval asks git for the working directory's commit; outside a repository git printed "fatal: not a git
    repository" on every probe. The probe no longer asks (lm_eval.json keeps no hash), and lm-eval is left as it was."""
    from lm_eval import evaluator

    from adaptercl.measure.lm_eval import lm_eval_probes
    from adaptercl.model.base import load_base
    from adaptercl.recipe.eval_block import LmEvalConfig
    from adaptercl.recipe.grammar import ModelConfig

    base = load_base(ModelConfig(name="tiny-random"), "none")
    originals = evaluator.get_git_commit_hash, evaluator.add_env_info
    monkeypatch.chdir(tmp_path)  # not a git repository
    capfd.readouterr()
    cfg = LmEvalConfig(tasks=[TASK], include_path=str(probed_run / "tasks"))
    assert lm_eval_probes(base.model, base.tokenizer, None, cfg)["tasks"][TASK]["n"] == len(ITEMS)
    out, err = capfd.readouterr()
    assert "not a git repository" not in err + out
    assert (evaluator.get_git_commit_hash, evaluator.add_env_info) == originals


def test_probes_score_the_active_adapters_and_restore_the_model(probed_run):
    from adaptercl.adapters import live as ad
    from adaptercl.measure.lm_eval import lm_eval_probes
    from adaptercl.model.base import load_base
    from adaptercl.recipe.eval_block import LmEvalConfig
    from adaptercl.recipe.grammar import LoraConfig, ModelConfig

    base = load_base(ModelConfig(name="tiny-random"), "none")
    base.model.eval()
    expected_base = hand_scores(base.model, base.tokenizer)
    torch.manual_seed(3)
    model = ad.attach_adapter(base.model, "a", LoraConfig(r=4, alpha=64))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1.0)  # a large update: the adapter changes which choice wins
    model.train()
    expected_adapter = hand_scores(model, base.tokenizer)
    assert expected_adapter != expected_base  # otherwise the test could not tell the two apart
    model.train()
    cfg = LmEvalConfig(tasks=[TASK], include_path=str(probed_run / "tasks"))
    rng = torch.random.get_rng_state()
    for adapters, (acc, acc_norm) in ((["a"], expected_adapter), (None, expected_base)):
        row = lm_eval_probes(model, base.tokenizer, adapters, cfg)["tasks"][TASK]
        assert (row["acc"], row["acc_norm"]) == pytest.approx((acc, acc_norm))
    assert model.training and torch.equal(torch.random.get_rng_state(), rng)  # mode and random state restored
