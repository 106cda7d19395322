"""`recipe validate` reads the data (issue 47): the first rows of each domain it can reach without a download are
rendered through the format and the template, so a placeholder typo, a file of another row schema and an answer
column a letter reward would never match fail at validate in one line naming the rows the format expects; a hub
dataset in the local hub cache is read from there, one not cached is said to be not checked."""

from __future__ import annotations

import json

import pytest
import yaml

from adaptercl.cli import main
from tests.domains.test_gold_answers import CHOICES, TEMPLATE, mmlu_csv


def recipe_file(tmp_path, domain: dict) -> str:
    path = tmp_path / "recipe.yaml"
    recipe = {
        "model": {"name": "tiny-random"},
        "output_dir": str(tmp_path / "run"),
        "domains": [domain],
        "stages": [{"name": "one", "domain": domain["name"]}],
    }
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def validate(capsys, path: str) -> tuple[int, str, str]:
    code = main(["recipe", "validate", path])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0].removeprefix("error: ")


def mmlu_domain(tmp_path, **kw) -> dict:
    source = mmlu_csv(tmp_path / "bio.csv")
    return {"name": "mmlu", "source": source, "eval_split": None, "prompt_template": TEMPLATE, **kw}


def test_a_template_placeholder_typo_fails_at_validate_naming_the_rows_it_expects(tmp_path, capsys):
    domain = mmlu_domain(tmp_path, reward="choice_letter", answer_kind="index0")
    domain["prompt_template"] = TEMPLATE.replace("{question}", "{questoin}")
    code, out, err = validate(capsys, recipe_file(tmp_path, domain))
    assert code == 2 and out == ""
    assert one_error_line(err) == (
        f"domains.mmlu: {tmp_path / 'bio.csv'}: row 1: field 'questoin' is missing (prompt_template uses it); the "
        "generic format expects rows with the columns prompt_template names (questoin, choice0, choice1, choice2, "
        'choice3), "answer": the gold answer (this row has question, choice0, choice1, choice2, choice3, answer)'
    )


def test_a_file_that_is_not_the_formats_rows_fails_at_validate_naming_its_schema(tmp_path, capsys):
    """A ToolAlpaca API record (eval_real.json's shape) under format: tooluse, which reads the SDPO/SDFT rows."""
    record = {"Name": "Axolotl", "Description": "Axolotl facts", "Documentation": "...", "Instances": []}
    (tmp_path / "eval_real.json").write_text(json.dumps([record]))
    domain = {"name": "tools", "source": str(tmp_path / "eval_real.json"), "format": "tooluse"}
    code, _, err = validate(capsys, recipe_file(tmp_path, domain))
    line = one_error_line(err)
    assert code == 2 and line.startswith(f"domains.tools: {tmp_path / 'eval_real.json'}: row 1: field 'prompt' is ")
    assert 'format tooluse expects rows {"prompt": the tool documentation and the question (str), "answer": ' in line
    assert line.endswith("(this row has Name, Description, Documentation, Instances)")


def test_an_index_column_a_letter_reward_would_never_match_fails_at_validate(tmp_path, capsys):
    code, out, err = validate(capsys, recipe_file(tmp_path, mmlu_domain(tmp_path, reward="choice_letter")))
    assert code == 2 and out == ""
    assert one_error_line(err).startswith("domains.mmlu.answer_kind: column 'answer' holds 1, 0, 3 (6 of 6 rows read)")


def test_validate_says_which_rows_it_read_and_the_kind_it_read_off_the_column(tmp_path, capsys):
    domain = mmlu_domain(tmp_path, reward="choice_letter", answer_options=CHOICES)
    code, out, err = validate(capsys, recipe_file(tmp_path, domain))
    assert code == 0, err
    assert (
        f"  mmlu: the first 6 rows of {tmp_path / 'bio.csv'} read and rendered as the run reads them; answer column "
        "read as index0 (from its values)\n"
    ) in out


def test_validate_reads_the_first_rows_only(tmp_path, capsys):
    """A bad row past the first 32 is the run's to find (it reads every row); validate stays a quick look."""
    rows = [{"prompt": f"q{i}", "answer": "A"} for i in range(32)] + [{"answer": "A"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    domain = {"name": "d", "source": str(tmp_path / "rows.jsonl"), "eval_split": None, "reward": "choice_letter"}
    code, out, err = validate(capsys, recipe_file(tmp_path, domain))
    assert code == 0 and "d: the first 32 rows of" in out, err


def hub_dataset(cache, repo_id: str, files: dict[str, list[dict]]) -> None:
    """The local hub cache's layout of a dataset repository at main, holding `files` (path -> rows) as parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    repo = cache / f"datasets--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / ("0" * 40)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    for name, rows in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), snapshot / name)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_a_hub_dataset_in_the_local_hub_cache_is_read_from_there(tmp_path, capsys, hub_cache):
    good = [{"question": f"{i} + {i}?", "answer": f"so\n#### {2 * i}"} for i in range(3)]
    hub_dataset(hub_cache, "owner/maths", {"main/train-00000-of-00001.parquet": good, "main/test-0.parquet": good})
    domain = {"name": "gsm", "source": "owner/maths", "subset": "main", "format": "gsm8k"}
    code, out, err = validate(capsys, recipe_file(tmp_path, domain))
    assert code == 0, err
    assert (
        "gsm: the first 3 rows of owner/maths[train] (local hub cache) and the first 3 rows of owner/maths[test] "
        "(local hub cache) read and rendered as the run reads them\n"
    ) in out
    hub_dataset(hub_cache, "owner/broken", {"train.parquet": [{"q": "?"}], "test.parquet": [{"q": "?"}]})
    code, _, err = validate(capsys, recipe_file(tmp_path, {**domain, "source": "owner/broken", "subset": None}))
    assert (
        code == 2 and "owner/broken[train] (local hub cache): row 1: field 'question' is missing; format gsm8k" in err
    )


def test_data_that_is_not_here_is_said_to_be_not_checked(tmp_path, capsys, hub_cache):
    domain = {"name": "gsm", "source": "owner/not-cached", "format": "gsm8k"}
    code, out, err = validate(capsys, recipe_file(tmp_path, domain))
    assert code == 0, err
    assert (
        "  gsm: data not checked: hub dataset owner/not-cached splits train, test (not in the local hub cache; the "
        "run downloads it)\n"
    ) in out
    url = {"name": "web", "source": "https://example.com/rows.jsonl", "format": "gsm8k"}
    code, out, err = validate(capsys, recipe_file(tmp_path, url))
    assert (
        code == 0 and "web: data not checked: https://example.com/rows.jsonl (a URL, which the run downloads)\n" in out
    )


def test_a_run_whose_rows_do_not_fit_is_refused_before_it_claims_its_directory(tmp_path, capsys):
    assert main(["recipe", "run", recipe_file(tmp_path, mmlu_domain(tmp_path, reward="choice_letter"))]) == 2
    assert one_error_line(capsys.readouterr().err).startswith("domains.mmlu.answer_kind: column 'answer' holds 1,")
    assert not (tmp_path / "run").exists()  # no half-written run directory
