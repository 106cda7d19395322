"""Where a domain's rows come from: the builtin / URL / hub / local rule (`recipe.domain_block.source_kind`), a missing
local path as an error about that path (never a hub lookup), and http(s) data files read end to end through
`datasets` from a loopback HTTP server serving fixture files in the exact layouts of the URLs the GPU recipes name
(the lasgroup/SDPO data files: JSON lines in `.json` files)."""

from __future__ import annotations

import functools
import http.server
import json
import threading
from pathlib import Path

import pytest

from adaptercl.domains import load_domain
from adaptercl.recipe.domain_block import source_kind
from adaptercl.recipe.grammar import DomainConfig, RecipeError

SCIENCE_SYSTEM = (
    "\nGiven a question and four options, please select the right answer. Respond in the following format:\n"
)


def science_row(i: int, answer: str) -> dict:
    """A row as in lasgroup/SDPO datasets/sciknoweval/chemistry/*.json (every field, in file order)."""
    question = f"Which molecule is number {i}?"
    return {
        "idx": 700 + i,
        "kind": "mcq",
        "dataset": "sciknoweval",
        "answer": answer,
        "elo": 1500,
        "prompt": f"{question}\n\nA: CC\nB: CCO\nC: CCC\nD: CO\nPlease reason step by step.",
        "description": f"{question} The solution will be evaluated in a mcq environment.",
        "tests": "-",
        "embedding": [],
        "system": SCIENCE_SYSTEM,
    }


def tooluse_row(i: int) -> dict:
    """A row as in lasgroup/SDPO datasets/tooluse/test.json (`system` and `tests` are null there)."""
    prompt = f"Your task is to answer the user's question using available tools.\nName: Tool{i}\nQuestion: go {i}"
    actions = [{"Action": f"getThing{i}", "Action_Input": json.dumps({"id": i})}]
    return {
        "prompt": prompt,
        "description": prompt,
        "idx": 4000 + i,
        "dataset": "tooluse",
        "system": None,
        "answer": json.dumps(actions),
        "tests": None,
        "kind": "tooluse",
        "elo": 1500,
    }


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # no request lines in the test output
        pass


@pytest.fixture
def served(tmp_path, monkeypatch):
    """(root folder, base URL) of an HTTP server on 127.0.0.1 (ephemeral port) with `datasets` online and caching
    under tmp_path. `datasets.config.HF_HUB_OFFLINE = False` is what HF_DATASETS_OFFLINE=0 sets at import."""
    import datasets

    root = tmp_path / "www"
    root.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    cache = tmp_path / "hf-datasets"
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "DOWNLOADED_DATASETS_PATH", cache / "downloads")
    monkeypatch.setattr(datasets.config, "EXTRACTED_DATASETS_PATH", cache / "downloads" / "extracted")
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


SDPO = "lasgroup/SDPO/0e6d5106abe69f578c63bf38a9394e22905c8773/datasets"  # the path the recipes' URLs have


def test_sciknoweval_urls_load_through_datasets(served):
    root, base = served
    train = [science_row(i, "ABCD"[i % 4]) for i in range(6)]
    test = [science_row(100 + i, "DCBA"[i % 4]) for i in range(3)]
    write_jsonl(root / SDPO / "sciknoweval/chemistry/train.json", train)
    write_jsonl(root / SDPO / "sciknoweval/chemistry/test.json", test)
    cfg = DomainConfig(
        name="science",
        source=f"{base}/{SDPO}/sciknoweval/chemistry/train.json",
        eval_file=f"{base}/{SDPO}/sciknoweval/chemistry/test.json",
        format="sciknoweval",
    )
    assert source_kind(cfg.source) == "url"
    d = load_domain(cfg, seed=0, num_eval=2)
    assert [e.answer for e in d.eval] == ["D", "C"]  # the first eval rows, in file order
    assert d.eval[0].messages == [
        {"role": "system", "content": SCIENCE_SYSTEM},
        {"role": "user", "content": test[0]["prompt"]},
    ]
    assert sorted(e.answer for e in d.train) == sorted(r["answer"] for r in train) and d.skipped == 0
    assert d.eval[0].id == "science/eval/1"
    assert d.reward("<reasoning>...</reasoning>\n<answer>\nD\n</answer>", d.eval[0]).correct
    assert not d.reward("<answer>A</answer>", d.eval[0]).correct


def test_tooluse_urls_load_through_datasets(served):
    root, base = served
    write_jsonl(root / SDPO / "tooluse/train.json", [tooluse_row(i) for i in range(4)])
    write_jsonl(root / SDPO / "tooluse/test.json", [tooluse_row(50 + i) for i in range(2)])
    cfg = DomainConfig(
        name="tooluse",
        source=f"{base}/{SDPO}/tooluse/train.json",
        eval_file=f"{base}/{SDPO}/tooluse/test.json",
        format="tooluse",
    )
    d = load_domain(cfg, seed=0, num_eval=2)
    assert [e.answer for e in d.eval] == [
        [{"Action": "getThing50", "Action_Input": '{"id": 50}'}],
        [{"Action": "getThing51", "Action_Input": '{"id": 51}'}],
    ]
    assert d.eval[0].messages == [{"role": "user", "content": tooluse_row(50)["prompt"]}]  # null system: none
    assert len(d.train) == 4
    assert d.reward('Thought: fetch it\nAction: getThing50\nAction Input: {"id": 50}', d.eval[0]).correct
    assert not d.reward('Action: getThing51\nAction Input: {"id": 50}', d.eval[0]).correct


def test_url_source_without_eval_file_holds_out_and_reads_parquet(served):
    import datasets

    root, base = served
    rows = [{"q": f"what is {i}?", "a": str(i)} for i in range(5)]
    datasets.Dataset.from_list(rows).to_parquet(str(root / "rows.parquet"))
    cfg = DomainConfig(
        name="g",
        source=f"{base}/rows.parquet?download=true",
        format="generic",
        reward="final_number",
        fields={"prompt": "q", "answer": "a"},
    )
    d = load_domain(cfg, seed=0, num_eval=2)
    assert len(d.eval) == 2 and len(d.train) == 3
    assert sorted(e.answer for e in d.eval + d.train) == ["0", "1", "2", "3", "4"]


def test_missing_url_is_one_line_naming_the_field_and_url(served):
    _, base = served
    url = f"{base}/nothing/here.jsonl"
    cfg = DomainConfig(name="science", source=url, format="sciknoweval")
    with pytest.raises(RecipeError) as err:
        load_domain(cfg, seed=0, num_eval=2)
    message = str(err.value)
    assert message.startswith(f"domains.science.source: cannot load {url}: ") and "\n" not in message


def test_url_in_offline_datasets_names_hf_hub_offline(served, monkeypatch):
    import datasets

    root, base = served
    write_jsonl(root / "t.jsonl", [science_row(0, "A")])
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1 without HF_DATASETS_OFFLINE
    cfg = DomainConfig(name="science", source=f"{base}/t.jsonl", format="sciknoweval")
    with pytest.raises(
        RecipeError,
        match=r"^domains\.science\.source: cannot load http.*HF_HUB_OFFLINE=1.*"
        r"HF_DATASETS_OFFLINE=0",
    ) as err:
        load_domain(cfg, seed=0, num_eval=1)
    assert "\n" not in str(err.value)


def test_a_url_must_name_a_data_file():
    with pytest.raises(ValueError, match=r"must name a \.jsonl/\.json/\.parquet/\.csv file"):
        DomainConfig(name="x", source="https://example.org/datasets/chemistry", format="sciknoweval")


# ------------------------------------------------------------------------------------------- the source rule


def test_source_kinds(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local" / "set").mkdir(parents=True)
    (tmp_path / "data").mkdir()
    assert source_kind("builtin:arithmetic") == "builtin"
    assert source_kind("https://host/x/train.json") == source_kind("http://127.0.0.1:9/a.csv") == "url"
    assert source_kind("openai/gsm8k") == "hub"  # OWNER/NAME, no folder OWNER here
    assert source_kind("hub:gsm8k") == source_kind("hub:data/tooluse") == "hub"  # explicit
    assert source_kind("local/set") == "local"  # exists
    assert source_kind("data/tooluse") == "local"  # OWNER is a folder here: a missing local path, not the hub
    for path in ("./x", "/no/such", "~/no-such-adaptercl-dir", "a/b/c", "a/b.jsonl", "gsm8k", "x.parquet"):
        assert source_kind(path) == "local", path


@pytest.mark.parametrize("source", ["data/tooluse", "./data/tooluse", "gsm8k", "data/sciknoweval/chemistry"])
def test_missing_local_path_is_an_error_about_the_path_never_a_hub_lookup(tmp_path, monkeypatch, source):
    import datasets

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("a missing local path reached the hub"))
    cfg = DomainConfig(name="tooluse", source=source, format="tooluse")
    with pytest.raises(RecipeError, match=rf"^domains\.tooluse\.source: local path '{source}' does not exist"):
        load_domain(cfg, seed=0, num_eval=2)


def test_missing_local_eval_file_is_an_error_about_it(tmp_path):
    train = tmp_path / "train.jsonl"
    write_jsonl(train, [science_row(0, "A")])
    cfg = DomainConfig(name="s", source=str(train), eval_file=str(tmp_path / "nope.jsonl"), format="sciknoweval")
    with pytest.raises(RecipeError, match=r"^domains\.s\.eval_file: local file '.*nope\.jsonl' does not exist$"):
        load_domain(cfg, seed=0, num_eval=1)
