"""What a user sees on the console of `adaptercl recipe run` (a subprocess, as a user runs it, with the libraries'
own logging and warning settings, not the test suite's): bad input found while running is the one `error:` line
(no library warning with its source line, log record, progress bar or traceback before it), and a normal run prints
no library notice a user can do nothing about (transformers' FutureWarnings, PEFT's, bitsandbytes' kernels notice).

Each `recipe run` test is one run of tiny-random (the imports take most of its 10-25 s); the last test checks the
bitsandbytes filter in process.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
# What a library notice looks like on the console: a warning (its category name), a log record at WARNING or ERROR
# (the CLI's format, transformers' own), a deprecation, a traceback. The run's progress lines have none of these.
NOTICE = re.compile(r"Warning|WARNING|ERROR|Traceback|deprecated|^\[transformers\]")


def tiny_recipe(out: Path, domain: dict, **blocks) -> dict:
    return {
        "model": {"name": "tiny-random"},
        "output_dir": str(out),
        "lora": {"r": 4, "alpha": 8},
        "optim": {"lr": 5e-3, "steps": 2, "prompts_per_step": 2},
        "rollout": {"group_size": 4, "max_new_tokens": 8},
        "eval": {"examples_per_domain": 4, "drift_probes": 1, "teacher_lift_prompts": 2, "stage_kl_prompts": 2},
        "domains": [domain],
        "stages": [{"name": "one", "domain": domain["name"]}],
        **blocks,
    }


def recipe_run(tmp_path: Path, raw: dict, **env: str) -> subprocess.CompletedProcess:
    """`python -m adaptercl.cli recipe run` on `raw`: stdout and stderr together, as a terminal shows them."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    environ = {k: v for k, v in os.environ.items() if k not in ("TRANSFORMERS_VERBOSITY", "PYTHONWARNINGS")}
    pythonpath = [str(REPO), str(REPO / "tests" / "support"), environ.get("PYTHONPATH", "")]  # this tree, tiny_rewards
    environ.update(PYTHONPATH=os.pathsep.join(p for p in pythonpath if p), HF_HUB_OFFLINE="1", **env)
    return subprocess.run(
        [sys.executable, "-m", "adaptercl.cli", "recipe", "run", str(recipe)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=environ,
        cwd=tmp_path,
        timeout=600,
    )


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        ("tiny_rewards:raises", "raised ValueError: this reward is broken"),
        ("tiny_rewards:two_values", "returned 2 values, expected a list of 4 rewards (one per completion)"),
    ],
)
def test_a_failing_reward_function_is_the_one_error_line(tmp_path, reward, message):
    """The reward fails at the first scoring (the evaluation before training): the run's own progress lines, then
    the error line alone (on transformers 5.24 its FutureWarnings came first, each with its source line)."""
    domain = {"name": "arith", "source": "builtin:arithmetic", "reward_funcs": [reward]}
    proc = recipe_run(tmp_path, tiny_recipe(tmp_path / "run", domain))
    lines = proc.stdout.splitlines()
    assert proc.returncode == 2, proc.stdout
    assert lines[-1] == f"error: domains.arith.reward_funcs[0] '{reward}' {message}", proc.stdout
    assert [line for line in lines if line.startswith("error:")] == lines[-1:]
    assert not [line for line in lines if NOTICE.search(line)], proc.stdout


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # no request lines in the test output
        pass


@pytest.fixture
def served(tmp_path):
    """(root folder, base URL) of an HTTP server on 127.0.0.1 (ephemeral port)."""
    root = tmp_path / "www"
    root.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_url_source_that_is_not_json_is_the_only_line(tmp_path, served):
    """A URL source whose content does not parse (an HTML error page saved as .jsonl): before, `datasets` logged
    its ERROR twice and drew two progress bars, and the line blamed 'the name, subset and split'."""
    root, base = served
    (root / "rows.jsonl").write_text("<html><body>Sign in to download</body></html>\n")
    url = f"{base}/rows.jsonl"
    domain = {"name": "g", "source": url, "format": "generic", "reward": "final_number"}
    cache = str(tmp_path / "hf-datasets")  # datasets online for URLs (models stay offline), caching under tmp_path
    proc = recipe_run(
        tmp_path, tiny_recipe(tmp_path / "run", domain), HF_DATASETS_OFFLINE="0", HF_DATASETS_CACHE=cache
    )
    assert proc.returncode == 2, proc.stdout
    assert proc.stdout.splitlines() == [
        f"error: domains.g.source: {url} is not a readable .jsonl file (ArrowInvalid: JSON parse error: Invalid "
        "value. in row 0)"
    ]


def test_a_normal_run_prints_no_library_notice(tmp_path):
    """Two tiny stages covering the paths that met deprecated or noisy library APIs: generate and prefilled prompt
    prefixes (the key/value cache argument and output field, renamed in transformers 5.24), PEFT wrapping the base,
    the hybrid teacher and diagnostics, chunked logits from the decoder with activation checkpointing (stage two).
    Python's default warning filters, as a user has them: a FutureWarning is shown, once per place."""
    domain = {"name": "arith", "source": "builtin:arithmetic", "reward": "tiny_rewards:digit_fraction"}
    raw = tiny_recipe(tmp_path / "run", domain, hybrid={"distill_on": "all"})
    raw["stages"] = [
        {"name": "one", "domain": "arith", "method": "hybrid"},
        {
            "name": "two",
            "domain": "arith",
            "method": "hybrid",
            "adapter": {"init": "new"},
            "optim": {"steps": 1, "logits_chunk_size": 4, "activation_checkpointing": True},
        },
    ]
    proc = recipe_run(tmp_path, raw)
    assert proc.returncode == 0, proc.stdout
    assert "accuracy matrix" in proc.stdout
    assert not [line for line in proc.stdout.splitlines() if NOTICE.search(line)], proc.stdout


def test_only_the_bitsandbytes_kernels_notice_is_dropped(caplog):
    """The filter `import adaptercl` puts on bitsandbytes' CPU logger drops that one notice (as bitsandbytes 0.50
    words it), not the logger: any other record of it still reaches the log."""
    import logging

    import adaptercl  # noqa: F401 - installs the filter
    from adaptercl.system.library_notices import BITSANDBYTES_CPU_LOGGER

    logger = logging.getLogger(BITSANDBYTES_CPU_LOGGER)
    with caplog.at_level(logging.WARNING):
        logger.warning(
            "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already `pip "
            "install kernels` and the kernels >= 0.11.1",
            ModuleNotFoundError("No module named 'kernels'"),
        )
        logger.warning("an unrelated bitsandbytes warning")
    assert [r.getMessage() for r in caplog.records if r.name == BITSANDBYTES_CPU_LOGGER] == [
        "an unrelated bitsandbytes warning"
    ]
