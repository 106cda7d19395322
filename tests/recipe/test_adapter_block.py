"""A stage's `adapter` is a block (issue 47): `adapter: merge`, the word alone, is one line naming the block's form
instead of pydantic's "valid dictionary"."""

from __future__ import annotations

from pathlib import Path

from adaptercl.cli import main

QUICKSTART = str(Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml")


def test_an_adapter_given_as_a_word_names_the_block_form(capsys):
    assert main(["recipe", "validate", QUICKSTART, "stages.1.adapter=merge"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: stages.mcq.adapter: must be a mapping such as {init: merge} (adapter: {init: new | continue | "
        "merge})\n"
    )
