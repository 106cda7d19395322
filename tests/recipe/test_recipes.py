"""Every shipped recipe resolves: its domains' sources, formats, rewards, splits, stages and probes.

Offline and fast. Local sources written as `data/...` in a recipe are read from ../shared/data when a copy is there
(skipped cleanly when not) through the real loader. URL sources are the lasgroup/SDPO data files pinned to one
commit; ../shared/data holds byte-identical copies of those files (as .jsonl), read here through the real loader
(tests/domains/test_sources.py fetches the same layouts over HTTP through `datasets`). Hub ids are checked for what can
be checked offline: the format and reward exist, the subset and split names are the dataset's own (a table of the ids
the recipes use), and hand-made rows in the hub dataset's field layout go through the real loader with
`datasets.load_dataset` replaced.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import adaptercl.domains.rewards as rewards
from adaptercl.domains import load_domain
from adaptercl.domains.builtin import BUILTINS
from adaptercl.domains.datasets_formats import FORMATS
from adaptercl.domains.loading import FILE_SUFFIXES, read_rows
from adaptercl.recipe.domain_block import source_kind
from adaptercl.recipe.grammar import RecipeConfig
from adaptercl.recipe.load import load_recipe

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO.parent / "shared" / "data"  # as conftest.py
RECIPE_FILES = sorted((REPO / "recipes").glob("*.yaml"))
RECIPES: dict[str, RecipeConfig] = {path.name: load_recipe(path) for path in RECIPE_FILES}
# the 24 GB comparison, one per method
GPU_RECIPES = ("grpo.yaml", "sdpo.yaml", "sdft.yaml", "hybrid.yaml", "srpo.yaml")

# Hub datasets the recipes name: subset -> {split: labelled?}. google/boolq has no test split, and the test splits
# of PIQA and Winogrande carry no labels, so those three are evaluated on `validation`.
HUB_SPLITS: dict[str, dict[str | None, dict[str, bool]]] = {
    "openai/gsm8k": {s: {"train": True, "test": True} for s in ("main", "socratic")},
    "allenai/ai2_arc": {s: {"train": True, "validation": True, "test": True} for s in ("ARC-Challenge", "ARC-Easy")},
    "google/boolq": {None: {"train": True, "validation": True}},
    "baber/piqa": {None: {"train": True, "validation": True, "test": False}},
    "allenai/winogrande": {
        f"winogrande_{size}": {"train": True, "validation": True, "test": False}
        for size in ("xs", "s", "m", "l", "xl", "debiased")
    },
}

# One hand-made row per split in each hub dataset's own field layout (the row index keeps the prompts distinct).
HUB_ROWS = {
    "gsm8k": lambda i, split: {"question": f"{split}: what is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"},
    "arc": lambda i, split: {
        "question": f"{split}: which of these is item {i}?",
        "choices": {"text": ["one", "two", "three", "four"], "label": ["A", "B", "C", "D"]},
        "answerKey": "ABCD"[i % 4],
    },
    "boolq": lambda i, split: {"question": f"{split}: is {i} even", "passage": "Parity -- ...", "answer": i % 2 == 0},
    "piqa": lambda i, split: {"goal": f"{split}: do task {i}", "sol1": "well", "sol2": "badly", "label": i % 2},
    "winogrande": lambda i, split: {
        "sentence": f"{split} {i}: Ann beat Bo at chess, so _ was happy.",
        "option1": "Ann",
        "option2": "Bo",
        "answer": "1" if i % 2 == 0 else "2",
    },
}
HUB_GOLD = {
    "gsm8k": lambda i: str(i + 1),
    "arc": lambda i: "ABCD"[i % 4],
    "boolq": lambda i: "AB"[i % 2],
    "piqa": lambda i: "AB"[i % 2],
    "winogrande": lambda i: "AB"[i % 2],
}


def is_local(source: str) -> bool:
    """A source loading.py reads from this machine's disk (whether or not it exists here)."""
    return source_kind(source) == "local"


def local_path(source: str) -> Path:
    """A recipe's `data/xxx` is ../shared/data/xxx here; other paths are taken as they are."""
    return SHARED_DATA / source.removeprefix("data/") if source.startswith("data/") else Path(source).expanduser()


DOMAIN_CASES = [(name, d) for name, recipe in RECIPES.items() for d in recipe.domains]
DOMAIN_IDS = [f"{name}:{d.name}" for name, d in DOMAIN_CASES]
LOCAL = [i for i, (_, d) in enumerate(DOMAIN_CASES) if is_local(d.source)]
# The local-folder alternative the GPU recipes document for their URL domains (`source=data/...`): the same rows.
LOCAL_ALTERNATIVES = [
    (name, d.model_copy(update={"source": f"data/{folder}", "eval_file": None, "eval_split": "test"}))
    for name, d in DOMAIN_CASES
    for domain, folder in (("science", "sciknoweval/chemistry"), ("tooluse", "tooluse"))
    if name == "hybrid.yaml" and d.name == domain
]
HUB = [i for i, (_, d) in enumerate(DOMAIN_CASES) if source_kind(d.source) == "hub"]
URL = [i for i, (_, d) in enumerate(DOMAIN_CASES) if source_kind(d.source) == "url"]


def test_recipes_are_found_and_validate():
    cpu = {"quickstart.yaml", "hybrid-cpu.yaml", "sdpo-cpu.yaml", "sdft-cpu.yaml", "srpo-cpu.yaml"}
    assert {*cpu, *GPU_RECIPES} <= set(RECIPES)
    for recipe in RECIPES.values():
        assert recipe.stages and recipe.domains


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_stages_and_probes_name_existing_domains(name):
    recipe = RECIPES[name]
    domains = {d.name for d in recipe.domains}
    trained = {s.domain for s in recipe.stages}
    assert trained <= domains
    assert set(recipe.eval.retention_probes) <= domains
    assert not set(recipe.eval.retention_probes) & trained  # probes are never trained


def test_no_two_recipes_share_a_run_directory():
    assert len({Path(r.output_dir) for r in RECIPES.values()}) == len(RECIPES)


@pytest.mark.parametrize(("name", "cfg"), DOMAIN_CASES, ids=DOMAIN_IDS)
def test_domain_format_and_reward_resolve(name, cfg):
    if cfg.source.startswith("builtin:"):
        assert cfg.source.removeprefix("builtin:") in BUILTINS
        return
    fmt = cfg.format or "generic"
    assert fmt in FORMATS
    if fmt == "generic":
        assert cfg.fields, "a generic dataset domain needs a field mapping"
    reward = cfg.reward or FORMATS[fmt].reward
    assert reward is not None, "the generic format needs a reward"
    assert callable(rewards.resolve_reward(reward))


@pytest.mark.parametrize(
    ("name", "cfg"),
    [DOMAIN_CASES[i] for i in LOCAL] + LOCAL_ALTERNATIVES,
    ids=[DOMAIN_IDS[i] for i in LOCAL] + [f"{name}:{d.name}:local" for name, d in LOCAL_ALTERNATIVES],
)
def test_local_sources_load_through_the_real_loader(name, cfg):
    path = local_path(cfg.source)
    if not path.exists():
        pytest.skip(f"real datasets not found: {cfg.source} has no copy at {path}")
    local = cfg.model_copy(update={"source": str(path)})
    if path.is_dir():
        splits = [cfg.train_split] + ([cfg.eval_split] if cfg.eval_split else [])
        files = {
            s: next((path / f"{s}{x}" for x in FILE_SUFFIXES if (path / f"{s}{x}").is_file()), None) for s in splits
        }
        if not all(files.values()):  # e.g. ToolAlpaca: only its eval split is shared; check the rows that are there
            present = [f for f in files.values() if f is not None]
            if not present:
                pytest.skip(f"real datasets not found: {path} has none of the splits {splits}")
            fmt = FORMATS[cfg.format or "generic"]
            for file in present:
                for _, row in read_rows(file)[:5]:
                    messages, answer, _ = fmt.to_example(row, local)
                    assert messages[-1]["role"] == "user" and answer is not None
            return
    d = load_domain(local, seed=0, num_eval=5)
    assert len(d.eval) == 5 and d.train and d.skipped == 0
    for e in d.eval:
        assert e.messages[-1]["role"] == "user" and e.messages[-1]["content"].strip()
        assert not d.reward("", e).correct


@pytest.mark.parametrize(("name", "cfg"), [DOMAIN_CASES[i] for i in HUB], ids=[DOMAIN_IDS[i] for i in HUB])
def test_hub_sources_name_real_subsets_and_labelled_splits(name, cfg):
    assert re.fullmatch(r"[\w.-]+/[\w.-]+", cfg.source), f"{cfg.source!r} is not an owner/name hub id"
    if cfg.source not in HUB_SPLITS:
        pytest.skip(f"{cfg.source}: splits not in this test's table")
    subsets = HUB_SPLITS[cfg.source]
    assert cfg.subset in subsets, f"{cfg.source}: subset {cfg.subset!r}; it has {sorted(map(str, subsets))}"
    splits = subsets[cfg.subset]
    assert cfg.train_split in splits, f"{cfg.source}: no split {cfg.train_split!r}"
    assert cfg.eval_split is not None and splits.get(cfg.eval_split), (
        f"{cfg.source}: eval split {cfg.eval_split!r} is missing or unlabelled; labelled: "
        f"{[s for s, labelled in splits.items() if labelled]}"
    )


@pytest.mark.parametrize(("name", "cfg"), [DOMAIN_CASES[i] for i in HUB], ids=[DOMAIN_IDS[i] for i in HUB])
def test_hub_layout_rows_go_through_the_loader(monkeypatch, name, cfg):
    import datasets

    if cfg.format not in HUB_ROWS:
        pytest.skip(f"no hand-made {cfg.format} rows")
    calls = []

    def fake_load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return [HUB_ROWS[cfg.format](i, split) for i in range(6)]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    d = load_domain(cfg.model_copy(update={"num_train": None}), seed=0, num_eval=4)
    assert calls == [(cfg.source, cfg.subset, cfg.eval_split), (cfg.source, cfg.subset, cfg.train_split)]
    assert [e.answer for e in d.eval] == [HUB_GOLD[cfg.format](i) for i in range(4)]
    assert len(d.train) == 6
    for e in d.eval:
        assert d.reward(str(e.answer) if cfg.format != "gsm8k" else f"#### {e.answer}", e).correct


SDPO_RAW = "https://raw.githubusercontent.com/lasgroup/SDPO/0e6d5106abe69f578c63bf38a9394e22905c8773/datasets/"


def shared_copy(url: str) -> Path:
    """../shared/data's copy of a lasgroup/SDPO data file: the same bytes, as .jsonl."""
    return SHARED_DATA / url.removeprefix(SDPO_RAW).replace(".json", ".jsonl")


def test_flagship_recipes_read_only_hub_ids_and_urls():
    """No domain of the GPU recipes needs a manual step: each is a hub id or a URL, none a local folder."""
    for name in GPU_RECIPES:
        for d in RECIPES[name].domains:
            assert source_kind(d.source) in ("hub", "url"), f"{name}: domains.{d.name}.source {d.source!r}"
            assert d.eval_file is None or source_kind(d.eval_file) == "url"
            if source_kind(d.source) == "url":  # the pinned SDPO data files, train and eval side by side
                assert d.source.startswith(SDPO_RAW) and d.source.endswith("/train.json")
                assert d.eval_file == d.source.removesuffix("train.json") + "test.json"


@pytest.mark.parametrize(("name", "cfg"), [DOMAIN_CASES[i] for i in URL], ids=[DOMAIN_IDS[i] for i in URL])
def test_url_sources_rows_go_through_the_loader(name, cfg):
    train, test = shared_copy(cfg.source), shared_copy(cfg.eval_file)
    if not test.is_file():
        pytest.skip(f"real datasets not found: no copy of {cfg.eval_file} at {test}")
    if train.is_file():
        local = cfg.model_copy(update={"source": str(train), "eval_file": str(test)})
        d = load_domain(local, seed=0, num_eval=5)
        assert len(d.eval) == 5 and d.train and d.skipped == 0
        for e in d.eval:
            assert e.messages[-1]["role"] == "user" and e.messages[-1]["content"].strip()
            assert d.reward(e.demonstration, e).correct and not d.reward("", e).correct
        return
    fmt = FORMATS[cfg.format]  # ToolAlpaca's train.json is not stored here: check the eval rows that are
    for _, row in read_rows(test)[:5]:
        messages, answer, _ = fmt.to_example(row, cfg)
        assert messages[-1]["role"] == "user" and answer


def test_gpu_recipes_differ_only_in_method():
    """The 24 GB recipes are one comparison: same model, quantisation, domains, stage sequence and evaluation."""
    first = RECIPES[GPU_RECIPES[0]]
    for name in GPU_RECIPES:
        recipe = RECIPES[name]
        assert recipe.model == first.model and recipe.quantization == first.quantization == "nf4"
        assert recipe.domains == first.domains and recipe.eval == first.eval and recipe.seed == first.seed
        assert [(s.name, s.domain, s.adapter.init, s.optim.steps) for s in recipe.stages] == [
            (s.name, s.domain, s.adapter.init, s.optim.steps) for s in first.stages
        ]
        assert recipe.eval.retention_probes == ["arc", "boolq", "piqa", "winogrande"]
        method = name.removesuffix(".yaml")
        assert {s.method for s in recipe.stages} == {method}
        for s in recipe.stages:  # the same sequences per step: rollout tokens and backward work compare
            assert s.optim.prompts_per_step * s.rollout.group_size == 32
        probes = {d.name: d for d in recipe.domains if d.name in recipe.eval.retention_probes}
        assert all(not is_local(d.source) for d in probes.values()), "probes are read from the hub"


def test_readme_lists_every_recipe():
    readme = (REPO / "README.md").read_text()
    for name in RECIPES:
        assert f"recipes/{name}" in readme, f"README.md does not list recipes/{name}"
