"""Domain loading: builtin generators, real-dataset formats, the generic loader and its data hygiene."""

from __future__ import annotations

import json
import random
import re

import pytest

from adaptercl.domains import Domain, Example, load_domain
from adaptercl.domains.builtin import BUILTINS, is_eval_fact
from adaptercl.domains.loading import prompt_key
from adaptercl.domains.rewards import REWARDS
from adaptercl.recipe.grammar import DomainConfig, RecipeError, resolve_recipe

BUILTIN_NAMES = sorted(BUILTINS)


def builtin(name: str, seed: int = 0, num_eval: int = 20, **kw) -> Domain:
    return load_domain(DomainConfig(name=name, source=f"builtin:{name}", **kw), seed, num_eval)


def write_jsonl(path, rows) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


# ---------------------------------------------------------------------------------------------------- builtin


@pytest.mark.parametrize("name", BUILTIN_NAMES)
def test_builtin_is_deterministic_per_seed(name):
    a, b, c = builtin(name, seed=3), builtin(name, seed=3), builtin(name, seed=4)
    assert a.train == b.train and a.eval == b.eval
    assert [e.messages for e in a.eval] != [e.messages for e in c.eval]


@pytest.mark.parametrize("name", BUILTIN_NAMES)
def test_builtin_train_and_eval_are_disjoint(name):
    d = builtin(name, num_eval=40, num_train=300)
    assert len(d.eval) == 40 and len(d.train) == 300
    eval_prompts = {prompt_key(e.messages) for e in d.eval}
    assert not eval_prompts & {prompt_key(e.messages) for e in d.train}
    assert len({e.id for e in d.train + d.eval}) == 340
    # eval does not depend on how much training data is made
    assert builtin(name, num_eval=40, num_train=10).eval == d.eval


def test_builtin_arithmetic_disjoint_by_fact_not_only_phrasing():
    d = builtin("arithmetic", num_eval=30, num_train=400)

    def fact(e):
        return tuple(int(x) for x in re.findall(r"\d+", e.messages[-1]["content"]))

    def op(e):
        return e.demonstration.split()[1]

    eval_facts = {(fact(e), op(e)) for e in d.eval}
    assert not eval_facts & {(fact(e), op(e)) for e in d.train}


def fact_of(name: str, e) -> tuple | str:
    """The fact a builtin example asks about, read back from its text (not from the generator)."""
    if name in ("arithmetic", "arithmetic_hash", "calc_hash", "calc_says"):
        a, op, b = e.demonstration.split()[:3]  # "a op b = v. The answer is v." / "a op b = v.\n#### v"
        return (op, *sorted((int(a), int(b)))) if op in "+*" else (op, int(a), int(b))
    if name in ("mcq", "mcq_text"):
        head, *option_lines = e.messages[-1]["content"].split("\n")
        category = re.fullmatch(r"Which of these is (.+)\?", head).group(1)
        options = dict(line.split(". ", 1) for line in option_lines)
        assert (name == "mcq") == (e.answer in options)  # mcq_text's gold is the option's text, not its letter
        return category, options.get(e.answer, e.answer)
    if name == "toolcall":
        call = json.loads(e.demonstration)
        return call["name"], *call["arguments"].values()
    return e.answer  # copy: the word


@pytest.mark.parametrize("seed", [0, 1, 2, 7])
@pytest.mark.parametrize("name", BUILTIN_NAMES)
def test_builtin_train_never_asks_an_eval_fact(name, seed):
    # Before the fact partition every mcq eval fact (category, right word) was in training (520 of 1,000 rows at
    # seed 0) and 14 of 43 arithmetic eval facts were, through 3 + 4 vs 4 + 3.
    d = builtin(name, seed=seed, num_eval=50)
    assert len(d.eval) == 50 and len(d.train) == 1000
    eval_facts = {fact_of(name, e) for e in d.eval}
    assert not eval_facts & {fact_of(name, e) for e in d.train}
    # each split keeps several facts, and a split does not depend on the other's size
    assert len(eval_facts) >= 10 and len({fact_of(name, e) for e in d.train}) >= 40
    assert builtin(name, seed=seed, num_eval=5).train == d.train


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", BUILTIN_NAMES)
def test_builtin_gives_100_distinct_eval_prompts(name, seed):
    # benchmarks/science evaluates 100 examples per domain; a repeated prompt would count one answer twice (toolcall
    # had 63-84 distinct of 100 with two request templates per function)
    d = builtin(name, seed=seed, num_eval=100)
    assert len({prompt_key(e.messages) for e in d.eval}) == 100


def test_builtin_arithmetic_never_trains_the_swapped_operands_of_an_eval_sum_or_product():
    d = builtin("arithmetic", num_eval=50)
    asked = [e.demonstration.split()[:3] for e in d.eval]  # [a, op, b]
    swapped = {(b, op, a) for a, op, b in asked if op in "+*"}
    assert swapped and not swapped & {tuple(e.demonstration.split()[:3]) for e in d.train}


@pytest.mark.parametrize("name", BUILTIN_NAMES)
def test_builtin_demonstrations_are_correct_and_wrong_answers_get_feedback(name):
    d = builtin(name, num_eval=30, num_train=100, feedback="correctness")
    for e in d.eval + d.train:
        assert e.messages[0]["role"] == "system" and e.messages[-1]["role"] == "user"
        result = d.reward(e.demonstration, e)
        assert result.correct and result.score == 1.0, (e.id, e.demonstration)
    wrong = {
        "arithmetic": "The answer is 1000.",
        "arithmetic_hash": "#### 1000",
        "calc_hash": "#### 1000",
        "calc_says": "The answer is 1000.",
        "mcq": "<answer>Z</answer>",
        "mcq_text": "<answer>zebra</answer>",
        "toolcall": '{"name": "nothing", "arguments": {}}',
        "copy": "zebra",
    }[name]
    for e in d.eval:
        result = d.reward(wrong, e)
        assert not result.correct and 0.0 <= result.score < 0.5 and result.feedback
    # by default (feedback: format) a well-formed wrong answer gets none: the teacher is not told "X is incorrect"
    default = builtin(name, num_eval=30, num_train=100)
    assert all(default.reward(wrong, e).feedback is None for e in default.eval)


def test_builtin_format_patterns_are_distinct():
    domains = {name: builtin(name) for name in ("arithmetic", "mcq", "toolcall")}
    for name, d in domains.items():
        assert d.format_patterns
        for other_name, other in domains.items():
            demo = other.eval[0].demonstration
            own = any(re.search(p, demo) for p in d.format_patterns)
            assert own == (name == other_name), (name, other_name, demo)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    ("original", "variant"),
    [("arithmetic", "arithmetic_hash"), ("mcq", "mcq_text"), ("arithmetic", "calc_hash"), ("arithmetic", "calc_says")],
)
def test_a_variant_shares_its_original_s_fact_partition(original, variant, seed):
    # neither domain of the pair ever trains on an eval fact of the other (a sequence of the two stays clean)
    d = builtin(variant, seed=seed, num_eval=50)
    assert all(is_eval_fact(seed, original, fact_of(variant, e)) for e in d.eval)
    assert not any(is_eval_fact(seed, original, fact_of(variant, e)) for e in d.train)
    original_eval = {fact_of(original, e) for e in builtin(original, seed=seed, num_eval=50).eval}
    assert original_eval & {fact_of(variant, e) for e in d.eval}  # the eval sets ask (some of) the same facts


@pytest.mark.parametrize(("original", "variant"), [("arithmetic", "arithmetic_hash"), ("mcq", "mcq_text")])
def test_a_variant_asks_the_same_question_and_each_convention_fails_the_other(original, variant):
    (make_a, reward_a, _), (make_b, reward_b, _) = BUILTINS[original], BUILTINS[variant]
    for i in range(50):
        (msgs_a, gold_a, demo_a, fact_a), (msgs_b, gold_b, demo_b, fact_b) = (
            make(random.Random(i)) for make in (make_a, make_b)
        )
        assert msgs_a[-1] == msgs_b[-1] and fact_a == fact_b  # the same question and fact from the same draws
        assert msgs_a[0]["content"] != msgs_b[0]["content"]  # the system prompt states the convention
        a, b = Example("a", msgs_a, gold_a, demo_a), Example("b", msgs_b, gold_b, demo_b)
        assert REWARDS[reward_a](demo_a, a).correct and not REWARDS[reward_a](demo_b, a).correct
        assert REWARDS[reward_b](demo_b, b).correct and not REWARDS[reward_b](demo_a, b).correct


def test_the_calc_pair_differs_only_in_phrasing_and_the_convention_its_reward_wants():
    hash_, says = builtin("calc_hash", num_eval=100), builtin("calc_says", num_eval=100)
    for d in (hash_, says):
        for e in d.eval + d.train:
            assert e.messages[:-1] == hash_.eval[0].messages[:-1]  # one system prompt and two-shot, naming neither
            assert d.reward(e.demonstration, e).correct
    shots = [m["content"] for m in hash_.eval[0].messages if m["role"] == "assistant"]
    assert shots[0].endswith("#### 27") and shots[1].endswith("The answer is 25.")  # both conventions shown
    wording = {
        d.name: {re.sub(r"\d+", "N", e.messages[-1]["content"]) for e in d.eval + d.train} for d in (hash_, says)
    }
    assert not wording["calc_hash"] & wording["calc_says"] and len(wording["calc_hash"]) == 9  # 3 phrasings x 3 ops
    for a, b in ((hash_, says), (says, hash_)):  # each convention fails the other's reward
        assert not any(b.reward(e.demonstration, Example("x", e.messages, e.answer, "")).correct for e in a.eval)


def test_arithmetic_hash_shows_its_convention_in_a_one_shot_of_no_generator_fact():
    d = builtin("arithmetic_hash", num_eval=30, num_train=100)
    for e in d.eval + d.train:
        system, shot_user, shot_reply, request = e.messages
        assert "####" in system["content"] and shot_reply["content"].endswith("\n#### 27")
        assert d.reward(shot_reply["content"], Example("shot", e.messages, "27", "")).correct  # the shot obeys it
        a, b = (int(n) for n in re.findall(r"\d+", shot_user["content"]))
        assert min(a, b) > 9  # the generator's operands are 1-9: the shot asks no train or eval fact
        assert request["role"] == "user" and fact_of("arithmetic_hash", e)[1] <= 9


def test_toolcall_one_shot_lists_both_functions_and_copying_the_example_is_wrong():
    d = builtin("toolcall", num_eval=30, num_train=100)
    for e in d.eval + d.train:
        system, shot_user, shot_reply, request = e.messages
        gold = json.loads(e.demonstration)
        specs = system["content"]
        assert gold["name"] != "get_population" and '"get_population"' in specs and f'"{gold["name"]}"' in specs
        assert shot_user["role"] == "user" and shot_reply["role"] == "assistant" and request["role"] == "user"
        assert str(next(iter(gold["arguments"].values()))) in request["content"]
        copied = d.reward(shot_reply["content"], e)  # the one-shot's call, copied verbatim
        assert not copied.correct and copied.score < 1.0


def test_builtin_reward_and_patterns_can_be_overridden():
    d = builtin("copy", reward="arithmetic", format_patterns=["XYZ"])
    assert d.reward("The answer is 3.", d.eval[0]).score == 0.2 and d.format_patterns == ["XYZ"]


def test_unknown_builtin():
    with pytest.raises(RecipeError, match="unknown builtin 'nope'"):
        builtin("nope")


# ---------------------------------------------------------------------------------------------------- generic


def generic_cfg(path, **kw) -> DomainConfig:
    fields = {"prompt": "q", "answer": "a", "demonstration": "sol", "system": "sys"}
    return DomainConfig(name="g", source=str(path), format="generic", fields=fields, reward="final_number", **kw)


def test_generic_loader_with_field_mapping(tmp_path):
    rows = [{"q": f"What is {i} + 1?", "a": str(i + 1), "sol": f"#### {i + 1}", "sys": "Be brief."} for i in range(30)]
    d = load_domain(generic_cfg(write_jsonl(tmp_path / "d.jsonl", rows)), seed=0, num_eval=5)
    assert len(d.eval) == 5 and len(d.train) == 25 and d.skipped == 0 and d.overlap == 0
    e = d.eval[0]
    assert e.messages[0] == {"role": "system", "content": "Be brief."} and e.messages[1]["role"] == "user"
    i = int(re.search(r"\d+", e.messages[1]["content"]).group())
    assert e.answer == str(i + 1) and e.demonstration == f"#### {i + 1}"
    assert d.reward(e.demonstration, e).correct
    assert not {prompt_key(x.messages) for x in d.eval} & {prompt_key(x.messages) for x in d.train}
    again = load_domain(generic_cfg(tmp_path / "d.jsonl"), seed=0, num_eval=5)
    other = load_domain(generic_cfg(tmp_path / "d.jsonl"), seed=1, num_eval=5)
    assert again.eval == d.eval and again.train == d.train and other.eval != d.eval


def test_generic_chat_prompts_and_system_override(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"hi {i}"}], "answer": "x"} for i in range(4)]
    cfg = DomainConfig(
        name="g",
        source=write_jsonl(tmp_path / "c.jsonl", rows),
        fields={"prompt": "messages"},
        reward="copy",
        system_prompt="SYS",
    )
    d = load_domain(cfg, 0, 2)
    assert d.eval[0].messages[0] == {"role": "system", "content": "SYS"} and d.eval[0].demonstration is None


def test_generic_needs_a_reward(tmp_path):
    cfg = DomainConfig(name="g", source=write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "answer": "a"}]))
    with pytest.raises(RecipeError, match=r"domains\.g\.reward"):
        load_domain(cfg, 0, 1)


def test_malformed_row_names_file_row_and_field(tmp_path):
    rows = [{"q": "ok", "a": "1"}, {"q": "ok 2", "a": "2"}, {"q": "no answer here"}, {"q": "ok 3", "a": "3"}]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(RecipeError) as err:
        load_domain(generic_cfg(path), 0, 1)
    message = str(err.value)
    assert "bad.jsonl" in message and "row 3" in message and "'a'" in message and "\n" not in message


def test_invalid_json_line_is_reported_with_its_line_number(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"q": "1", "a": "1"}, "{not json", {"q": "2", "a": "2"}])
    with pytest.raises(RecipeError, match=r"bad\.jsonl: row 2: invalid JSON"):
        load_domain(generic_cfg(path), 0, 1)


def test_skip_malformed_counts(tmp_path):
    rows = [{"q": f"p{i}", "a": str(i)} for i in range(10)]
    rows[2] = {"q": "p2"}
    rows[5] = {"q": ["not", "a", "string", 1], "a": "5"}
    rows[7] = "{broken"
    d = load_domain(generic_cfg(write_jsonl(tmp_path / "d.jsonl", rows), skip_malformed=True), 0, 2)
    assert d.skipped == 3 and len(d.train) + len(d.eval) == 7


def test_overlap_is_counted_and_dropped_from_train(tmp_path):
    train = [{"q": f"question {i}", "a": str(i)} for i in range(20)]
    evals = [{"q": "question 3", "a": "3"}, {"q": "question  7 ", "a": "7"}, {"q": "fresh", "a": "0"}]
    cfg = generic_cfg(write_jsonl(tmp_path / "train.jsonl", train), eval_file=write_jsonl(tmp_path / "e.jsonl", evals))
    d = load_domain(cfg, 0, 3)
    assert d.overlap == 2 and len(d.train) == 18 and len(d.eval) == 3
    assert "question 3" not in {e.messages[-1]["content"] for e in d.train}
    assert [e.messages[-1]["content"] for e in d.eval] == ["question 3", "question  7 ", "fresh"]  # file order
    capped = load_domain(generic_cfg(tmp_path / "train.jsonl", eval_file=cfg.eval_file, num_train=5), 0, 3)
    assert len(capped.train) == 5 and capped.overlap == 2


def test_folder_source_uses_split_files(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"q": f"t{i}", "a": "1"} for i in range(6)])
    write_jsonl(tmp_path / "test.jsonl", [{"q": f"e{i}", "a": "1"} for i in range(4)])
    d = load_domain(generic_cfg(tmp_path), 0, 2)
    assert [e.messages[-1]["content"] for e in d.eval] == ["e0", "e1"] and len(d.train) == 6
    with pytest.raises(RecipeError, match=r"eval_split: no dev\.jsonl.*'test', 'train'"):
        load_domain(generic_cfg(tmp_path, eval_split="dev"), 0, 2)
    held_out = load_domain(generic_cfg(tmp_path, eval_split=None), 0, 2)
    assert len(held_out.eval) == 2 and len(held_out.train) == 4


def test_csv_source(tmp_path):
    (tmp_path / "d.csv").write_text("q,a\n" + "".join(f"what is {i},{i}\n" for i in range(8)))
    d = load_domain(generic_cfg(tmp_path / "d.csv"), 0, 3)
    assert len(d.eval) == 3 and len(d.train) == 5 and str(d.eval[0].answer).isdigit()


def test_missing_source_file():
    with pytest.raises(RecipeError, match="does not exist"):
        load_domain(DomainConfig(name="x", source="/no/such/file.jsonl", reward="copy"), 0, 1)


def test_hub_source_goes_through_datasets(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return [{"question": f"{split} {i}?", "answer": f"x\n#### {i}"} for i in range(5)]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    d = load_domain(DomainConfig(name="m", source="openai/gsm8k", subset="main", format="gsm8k"), 0, 2)
    assert calls == [("openai/gsm8k", "main", "test"), ("openai/gsm8k", "main", "train")]
    assert [e.answer for e in d.eval] == ["0", "1"] and len(d.train) == 5


def test_config_rejects_unknown_format_and_bad_patterns():
    base = {"model": {"name": "tiny-random"}, "output_dir": "o", "stages": [{"name": "s", "domain": "d"}]}
    with pytest.raises(RecipeError, match=r"domains\.d\.format"):
        resolve_recipe({**base, "domains": [{"name": "d", "source": "x.jsonl", "format": "gsm9k"}]})
    with pytest.raises(RecipeError, match="not a valid regex"):
        resolve_recipe({**base, "domains": [{"name": "d", "source": "x.jsonl", "format_patterns": ["(("]}]})
    with pytest.raises(RecipeError, match="unknown keys"):
        resolve_recipe({**base, "domains": [{"name": "d", "source": "x.jsonl", "fields": {"question": "q"}}]})


# ---------------------------------------------------------------------------------------------------- real data


@pytest.mark.parametrize(
    ("fmt", "source", "extra"),
    [
        ("gsm8k", "gsm8k", {}),
        ("math500", "math500/test.jsonl", {}),
        ("sciknoweval", "sciknoweval/chemistry", {}),
        ("tooluse", "tooluse/test.jsonl", {}),
        ("arc", "arc/easy.jsonl", {}),
        ("arc", "arc", {"train_split": "challenge_train", "eval_split": "challenge_test"}),
        ("boolq", "boolq", {}),
        ("piqa", "piqa/piqa.jsonl", {}),
        ("winogrande", "winogrande/winogrande.jsonl", {}),
    ],
)
def test_real_dataset_formats(shared_data, fmt, source, extra):
    cfg = DomainConfig(name=fmt, source=str(shared_data / source), format=fmt, **extra)
    d = load_domain(cfg, seed=0, num_eval=10)
    assert len(d.eval) == 10 and d.train and d.skipped == 0
    assert not {prompt_key(e.messages) for e in d.eval} & {prompt_key(e.messages) for e in d.train}
    for e in d.eval:
        assert e.messages[-1]["role"] == "user" and e.messages[-1]["content"].strip()
        if e.demonstration is not None:
            assert d.reward(e.demonstration, e).correct, (e.id, e.demonstration[-200:])
        assert not d.reward("", e).correct
    if fmt in ("gsm8k", "math500", "tooluse"):
        assert all(e.demonstration for e in d.eval)
    if extra:  # ARC-Challenge rationales, kept only where they choose the gold option
        assert sum(e.demonstration is not None for e in d.eval) >= 8
    if fmt in ("arc", "boolq", "piqa", "winogrande"):
        assert all(d.reward(e.answer, e).correct for e in d.eval)  # a bare letter answers a probe
        assert d.format_patterns == []
    if fmt == "sciknoweval":
        assert d.eval[0].messages[0]["role"] == "system" and "<answer>" in d.eval[0].messages[0]["content"]
        assert d.reward(f"<answer>\n{d.eval[0].answer}\n</answer>", d.eval[0]).correct
        assert all(d.reward(e.demonstration, e).correct for e in d.eval)  # the demonstration is the gold, tagged
