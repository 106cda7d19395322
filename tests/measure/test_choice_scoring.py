"""Multiple-choice probes scored by log-likelihood (`measure/choice_scoring.py`): the continuation sum by hand, the
batched option scores equal to each row's own forward, the chosen letter scored by the domain's reward, the active
adapters used, and a run that scores its retention probe that way while it generates its trained domain."""

from __future__ import annotations

import json

import pytest
import torch
from packing_counts import counting

from adaptercl.domains.loading import load_domain
from adaptercl.measure import choice_scoring
from adaptercl.measure.choice_scoring import continuation_logprobs, evaluate_choices, option_scores
from adaptercl.recipe.grammar import DomainConfig, resolve_recipe
from adaptercl.run.sequence import run_recipe

ARC_ROWS = [
    {
        "id": f"q{i}",
        "question": f"Which number is the {word}?",
        "choices": {"text": ["one", "two", "three", "four"], "label": ["A", "B", "C", "D"]},
        "answerKey": "ABCD"[i % 4],
    }
    for i, word in enumerate(["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth"])
]


@pytest.fixture(scope="module")
def tiny():
    from adaptercl.model.base import load_base
    from adaptercl.recipe.grammar import ModelConfig

    base = load_base(ModelConfig(name="tiny-random"), "none")
    base.model.eval()
    return base


@pytest.fixture
def arc_file(tmp_path):
    path = tmp_path / "arc.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ARC_ROWS))
    return path


def test_continuation_logprobs_by_hand():
    # one row, V 3: position 0 predicts token 2 (p = e^1 / (1 + 1 + e^1)), position 1 is outside the continuation
    logits = torch.tensor([[[0.0, 0.0, 1.0], [5.0, 0.0, 0.0]]])  # [1, 2, 3]
    got = continuation_logprobs(logits, torch.tensor([[2, 0]]), torch.tensor([[1.0, 0.0]]))
    expected = 1.0 - torch.log(torch.tensor(2.0 + torch.e))
    assert torch.allclose(got, expected.reshape(1), rtol=0, atol=1e-6)


def own_forward_scores(model, tokenizer, prompt: str, options: list[str]) -> list[float]:
    """Each option's log-likelihood from a forward of its own, unpadded row (the reference for the batched path)."""
    prompt_ids, conts = choice_scoring.option_continuations(tokenizer, prompt, options)
    out = []
    for cont in conts:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt_ids + cont])).logits[0].float()  # [T, V]
        logprobs = torch.log_softmax(logits, dim=-1)
        out.append(sum(float(logprobs[len(prompt_ids) - 1 + j, t]) for j, t in enumerate(cont)))
    return out


@pytest.mark.parametrize("options", [["A", "B", "C"], [" yes please", " no", " maybe not"]])
def test_batched_option_scores_equal_each_rows_own_forward(tiny, options):
    # letters are one token each (one forward of the prompt); the phrases are several (a row per option, padded)
    tok = tiny.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        for text in ["Pick one.", "A much longer question that pads the other rows of the batch?", "Why?"]
    ]
    got = option_scores(tiny.model, tok, prompts, [options] * len(prompts))
    want = [own_forward_scores(tiny.model, tok, p, options) for p in prompts]
    # float32 logits of the same row computed with and without right padding in a batch: the kernels' summation
    # order may differ (batch size), a relative error of a few float32 ulps of each logit over hidden-size sums;
    # 1e-4 in nats is far below the gaps between options that decide a choice
    assert torch.allclose(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-4)


def test_the_chosen_letter_is_the_argmax_and_the_reward_scores_it(tiny, arc_file):
    domain = load_domain(DomainConfig(name="arc", source=str(arc_file), format="arc"), seed=0, num_eval=6)
    assert domain.choice_letters  # the arc format's reward is choice_letter
    row = evaluate_choices(tiny.model, tiny.tokenizer, domain, None, limit=6)
    tok = tiny.tokenizer
    expected = []
    for ex in domain.eval[:6]:
        prompt = tok.apply_chat_template(ex.messages, add_generation_prompt=True, tokenize=False)
        scores = own_forward_scores(tiny.model, tok, prompt, ["A", "B", "C", "D"])
        expected.append("ABCD"[max(range(4), key=scores.__getitem__)])
    assert row["completions"] == expected and row["n"] == 6 and row["scoring"] == "loglikelihood"
    assert row["correct"] == [letter == ex.answer for letter, ex in zip(expected, domain.eval[:6])]
    assert row["accuracy"] == sum(row["correct"]) / 6


def test_the_active_adapters_are_the_ones_scored(tiny, arc_file):
    from peft import LoraConfig, get_peft_model

    domain = load_domain(DomainConfig(name="arc", source=str(arc_file), format="arc"), seed=0, num_eval=4)
    model = get_peft_model(tiny.model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    try:
        tok = tiny.tokenizer
        prompt = tok.apply_chat_template(domain.eval[0].messages, add_generation_prompt=True, tokenize=False)
        with_adapter = option_scores(model, tok, [prompt], [["A", "B"]])
        with model.disable_adapter():
            without = option_scores(model, tok, [prompt], [["A", "B"]])
        from adaptercl.adapters import active_adapters

        with active_adapters(model, None):  # what evaluate_choices does for the base row
            assert option_scores(model, tok, [prompt], [["A", "B"]]) == without
        with active_adapters(model, ["default"]):
            assert option_scores(model, tok, [prompt], [["A", "B"]]) == with_adapter
        assert with_adapter != without  # a random nonzero B changes the scores
    finally:
        model.unload()


def test_a_run_scores_its_retention_probe_by_loglikelihood_and_generates_its_trained_domain(tmp_path, arc_file):
    raw = {
        "model": {"name": "tiny-random"},
        "output_dir": str(tmp_path / "run"),
        "lora": {"r": 4, "alpha": 8},
        "optim": {"lr": 1e-3, "steps": 1, "prompts_per_step": 2},
        "rollout": {"group_size": 2, "max_new_tokens": 4},
        "eval": {"examples_per_domain": 4, "drift_probes": 0, "retention_probes": ["arc"]},
        "domains": [
            {"name": "copy", "source": "builtin:copy"},
            {"name": "arc", "source": str(arc_file), "format": "arc"},
        ],
        "stages": [{"name": "one", "domain": "copy", "method": "grpo"}],
    }
    run_recipe(resolve_recipe(raw))
    for stage in ("stage-00-before", "stage-01-one"):
        row = json.loads((tmp_path / "run" / stage / "eval.json").read_text())
        assert row["arc"]["scoring"] == "loglikelihood" and set(row["arc"]["completions"]) <= set("ABCD")
        assert "scoring" not in row["copy"] and "mean_response_tokens" in row["copy"]  # generated
    raw["output_dir"] = str(tmp_path / "generated")
    raw["eval"]["choice_scoring"] = "generate"
    run_recipe(resolve_recipe(raw))
    row = json.loads((tmp_path / "generated" / "stage-00-before" / "eval.json").read_text())
    assert "scoring" not in row["arc"] and row["arc"]["n"] == 4


def test_the_forwards_run_on_packed_weights_and_choose_as_the_plain_ones(tiny, arc_file, monkeypatch):
    """evaluate_choices scores inside `packed_linears` (every float32 nn.Linear of the model packed for oneDNN), and
    chooses the letters the plain forwards choose: the products differ by float32 summation order only (bounded in
    tests/rollout/test_packed_weights.py), far below the gaps between options' log-likelihoods."""
    from adaptercl.rollout.packed_weights import onednn_available, packed_linears

    if not onednn_available():
        pytest.skip("this torch has no oneDNN packed-linear ops")
    counts: list[int] = []
    monkeypatch.setattr(choice_scoring, "packed_linears", counting(packed_linears, counts))
    domain = load_domain(DomainConfig(name="arc", source=str(arc_file), format="arc"), seed=0, num_eval=6)
    packed = evaluate_choices(tiny.model, tiny.tokenizer, domain, None, limit=6)
    assert counts == [sum(type(m) is torch.nn.Linear for m in tiny.model.modules())] and counts[0] > 0
    tok = tiny.tokenizer
    prompts = [tok.apply_chat_template(ex.messages, add_generation_prompt=True, tokenize=False) for ex in domain.eval]
    plain = option_scores(tiny.model, tok, prompts, [["A", "B", "C", "D"]] * len(prompts))  # no packing: MKL
    assert packed["completions"] == ["ABCD"[max(range(4), key=s.__getitem__)] for s in plain]
