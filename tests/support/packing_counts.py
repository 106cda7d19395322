"""Count what `packed_linears` packs where a module under test calls it: `counting(original, counts)` is a drop-in
for the function, monkeypatched into the caller's namespace; each block appends the number of layers it packed."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager


def counting(original: Callable, counts: list[int]) -> Callable:
    """`original` (packed_linears), recording each block's packed-layer count in `counts`."""

    @contextmanager
    def recording(model, *args, **kwargs):
        with original(model, *args, **kwargs) as count:
            counts.append(count)
            yield count

    return recording
