"""State guard: no test leaves process state behind for the tests after it.

A test that changes `os.environ`, torch's thread count or one of torch's global backend flags and does not put it
back changes what every later test in the same process computes: an MKL code path chosen by `MKL_CBWR`, a thread
count that changes float32 summation order, oneDNN switched off. Such leaks make a test's result depend on which
tests ran before it (on an Intel CPU with AMX, a leaked `MKL_CBWR=AVX2` made a resumed run, computed in a
subprocess that inherited it, differ in low bits from the uninterrupted run computed in the test process).

`snapshot()` reads every piece of state in `STATE` (torch's only once torch is imported: a torch-free test stays
torch-free); `restore(before)` puts back whatever differs and returns one line per difference. The autouse fixture
in tests/conftest.py takes a snapshot before each test and fails the test, after restoring, when it leaked: so one
leak fails loudly where it happens instead of quietly where it bites. Change state in a test with pytest's
`monkeypatch` (torn down before this guard checks), never by assignment.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

MISSING = object()
# Keys not counted: pytest's own (rewritten around every test phase), and those a library sets once, when it is first
# imported, for the life of the process (as it would in any process that imports it; the first test to import it is
# not at fault). vLLM's many writes are taken back by the `vllm_in_process` fixture instead (tests/conftest.py).
NOT_COUNTED = {
    "PYTEST_CURRENT_TEST": "pytest's own",
    "KMP_DUPLICATE_LIB_OK": "scikit-learn sets it on import (threadpoolctl's workaround for two OpenMP runtimes)",
    "TORCHINDUCTOR_CACHE_DIR": "torch._inductor sets its cache folder when first imported",
    "LD_LIBRARY_PATH": "opencv (cv2, which transformers' image utilities import) prepends its library folder on import",
    # `import vllm` sets these four (vllm/env_override.py); a test that imports TRL's trainers imports vLLM where it is
    # installed, so in a shuffled order whichever such test comes first would be blamed
    "PYTORCH_NVML_BASED_CUDA_CHECK": "vLLM sets it on import",
    "TORCHINDUCTOR_COMPILE_THREADS": "vLLM sets it on import",
    "TRITON_CACHE_AUTOTUNING": "vLLM sets it on import",
    "TILELANG_CLEANUP_TEMP_FILES": "vLLM sets it on import",
    "VLLM_LOGGING_LEVEL": "TRL sets it on import where vLLM is installed (trl/_compat.py)",
    "WANDB_SERVICE": "wandb sets it when its service process first starts, for the life of the process",
}


def _torch() -> Any:
    return sys.modules.get("torch")


def _flag(path: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """Getter and setter of a module attribute of torch given by its dotted path below `torch.`, e.g.
    `backends.mkldnn.enabled`; absent in this torch build: MISSING (and nothing to set)."""
    *parents, name = path.split(".")

    def owner() -> Any:
        node = _torch()
        for part in parents:
            node = getattr(node, part, None)
        return node

    def get() -> Any:
        return getattr(owner(), name, MISSING)

    def put(value: Any) -> None:
        if value is not MISSING:
            setattr(owner(), name, value)

    return get, put


def _call(getter: str, setter: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """Getter and setter of a piece of torch state behind a pair of torch functions."""
    return (lambda: getattr(_torch(), getter)()), (lambda value: getattr(_torch(), setter)(value))


# name -> (get, set); each read only when torch is imported
TORCH_STATE: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {
    "torch.get_num_threads()": _call("get_num_threads", "set_num_threads"),
    "torch.is_grad_enabled()": _call("is_grad_enabled", "set_grad_enabled"),
    "torch.get_default_dtype()": _call("get_default_dtype", "set_default_dtype"),
    "torch.get_float32_matmul_precision()": _call("get_float32_matmul_precision", "set_float32_matmul_precision"),
    "torch.are_deterministic_algorithms_enabled()": _call(
        "are_deterministic_algorithms_enabled", "use_deterministic_algorithms"
    ),
    "torch.backends.mkldnn.enabled": _flag("backends.mkldnn.enabled"),
    "torch.backends.mkldnn.deterministic": _flag("backends.mkldnn.deterministic"),
    "torch.backends.cudnn.enabled": _flag("backends.cudnn.enabled"),
    "torch.backends.cudnn.deterministic": _flag("backends.cudnn.deterministic"),
    "torch.backends.cudnn.benchmark": _flag("backends.cudnn.benchmark"),
    "torch.backends.cuda.matmul.allow_tf32": _flag("backends.cuda.matmul.allow_tf32"),
    "torch.backends.opt_einsum.enabled": _flag("backends.opt_einsum.enabled"),
}


def snapshot() -> dict[str, Any]:
    """The process state a test must not change: `os.environ` (a copy) and, once torch is imported, TORCH_STATE."""
    state: dict[str, Any] = {"os.environ": dict(os.environ)}
    if _torch() is not None:
        state.update({name: get() for name, (get, _) in TORCH_STATE.items()})
    return state


def restore(before: dict[str, Any]) -> list[str]:
    """Put back every piece of state that differs from `before`; one line per difference (empty: no leak). State
    that did not exist in `before` (torch imported by the test) is taken as it is now: an import is no leak."""
    leaks = []
    env = before["os.environ"]
    for key in sorted((set(env) | set(os.environ)) - set(NOT_COUNTED)):
        old, new = env.get(key), os.environ.get(key)
        if old != new:
            leaks.append(f"os.environ[{key!r}]: {old!r} -> {new!r}")
            if old is None:
                del os.environ[key]
            else:
                os.environ[key] = old
    if _torch() is not None:
        for name, (get, put) in TORCH_STATE.items():
            if name in before and get() != before[name]:
                leaks.append(f"{name}: {before[name]!r} -> {get()!r}")
                put(before[name])
    return leaks
