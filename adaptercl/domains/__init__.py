"""Domains: what a stage trains on and what evaluation scores — prompts, gold answers, demonstrations, a reward.

A domain is built from one `DomainConfig` block of the recipe by `load_domain(cfg, seed, num_eval)`:

    domain = load_domain(recipe.domain("math"), seed=recipe.seed, num_eval=recipe.eval.examples_per_domain)
    examples = domain.train[:4]                   # Example(id, messages, answer, demonstration, columns, ...)
    texts = [tokenizer.apply_chat_template(ex.messages, add_generation_prompt=True, tokenize=False) for ex in examples]
    ...                                           # generate: completion texts and token ids
    results = domain.score(completions, completion_ids, examples)  # [RewardResult(score, correct, feedback)]

Sources (`cfg.source`):
- `builtin:NAME` — procedural tasks generated from the seed, no download (`builtin.py`): arithmetic, mcq,
  toolcall, their convention-changing variants arithmetic_hash and mcq_text, and `copy` (a trivial task for tiny
  random models).
- a local `.jsonl/.json/.parquet/.csv` file, a folder holding `<split>.<ext>` files, an http(s) URL of such a
  file, or a `datasets` hub id (`loading.py`; `recipe.domain_block.source_kind` tells them apart); rows are turned
  into examples by a format preset (`datasets_formats.py`: gsm8k, math500, sciknoweval, tooluse, arc, boolq,
  piqa, winogrande) or by `generic` with a field mapping (`cfg.fields`).

The reward is `cfg.reward` when given (a name from `rewards.REWARDS` or `pkg.module:function`), otherwise the
format's default; `rewards.py` holds the rewards and `answers.py` the reading of answers out of replies. TRL-style
reward functions (`cfg.reward_funcs` with `reward_weights`, TRL's signature) are batched: `trl_rewards.py`. A
generic dataset's prompt may be rendered from its columns by `cfg.prompt_template` (`prompt_template.py`).
`recipe validate` reads the first rows of each source it can reach without a download and renders them as the run
will (`data_check.py`); a multiple-choice answer column is read as its `answer_kind` says, or as its values show,
and every gold must take the form the reward compares with (`gold_answers.py`).
`format_patterns` are regexes of this domain's own answer-format tokens; the drift monitor counts them in other
domains' responses to measure format leakage.

The data types (`Example`, `RewardResult`, `RewardFn`, `Domain`) and `is_success` (which samples the
self-distilling methods count as successes) live in `domain.py`; the modules of this folder import them from there;
other folders import them, and the names below, from this face.
"""

from importlib import import_module

# name other folders use -> the module of this folder that defines it; a name equal to its module's is the module
# itself. Imported on first use: importing the folder loads nothing.
_EXPORTS = {
    "BUILTINS": "builtin",
    "count_lettered_options": "answers",
    "LETTERS": "prompt_template",
    "FORMATS": "datasets_formats",
    "Domain": "domain",
    "Example": "domain",
    "RewardFn": "domain",
    "RewardResult": "domain",
    "is_success": "domain",
    "score_samples": "domain",
    "check_domain": "loading",
    "check_domain_data": "data_check",
    "load_domain": "loading",
    "load_trl_rewards": "trl_rewards",
    "reward_component_stats": "trl_rewards",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = import_module(f"{__name__}.{_EXPORTS[name]}")
        return module if _EXPORTS[name] == name else getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
