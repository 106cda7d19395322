"""Library notices a user can do nothing about, silenced one message at a time (never a whole logger or category).

A run's log should hold what the run did and what the user can change; these lines are neither:

- bitsandbytes (0.50, on CPUs with AVX512-BF16) logs a WARNING when its module `backends.cpu.ops` is imported and
  the optional `kernels` package cannot fetch its CPU gemm kernel from the hub ("Failed to load CPU
  gemm_4bit_forward from kernels-community ..."). PEFT imports bitsandbytes whenever it is installed, so every run
  printed it, NF4 or not; without the kernel bitsandbytes uses its own CPU path, which is what the NF4-on-CPU tests
  run. `silence_bitsandbytes_kernels_notice` drops that one record with a filter on that one logger; the package
  import (`adaptercl/__init__.py`) installs it, before any module of the package imports PEFT.
- PEFT (0.21) reads `model.is_gradient_checkpointing` when it wraps a base, which transformers 5.24 renamed to
  `is_activation_checkpointing` (the old name warns, FutureWarning). `peft_wraps_quietly` ignores that one warning
  for the span of a wrap; adaptercl's own code uses the new names.

No torch import (the package import installs the filter).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

BITSANDBYTES_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"
BITSANDBYTES_KERNELS_NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community"
PEFT_CHECKPOINTING_NOTICE = r"`is_gradient_checkpointing` is deprecated"


class _DropMessage(logging.Filter):
    """Drops the records whose unformatted message starts with `prefix`; lets every other record through."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def silence_bitsandbytes_kernels_notice() -> None:
    """Drop bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community" warning (see the module
    docstring); idempotent. The logger object exists before bitsandbytes asks for it by the same name."""
    logger = logging.getLogger(BITSANDBYTES_CPU_LOGGER)
    if not any(isinstance(f, _DropMessage) and f.prefix == BITSANDBYTES_KERNELS_NOTICE for f in logger.filters):
        logger.addFilter(_DropMessage(BITSANDBYTES_KERNELS_NOTICE))


@contextmanager
def peft_wraps_quietly() -> Iterator[None]:
    """The body (a `PeftModel` wrapping a base) without PEFT's read of the deprecated `is_gradient_checkpointing`."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=PEFT_CHECKPOINTING_NOTICE, category=FutureWarning)
        yield
