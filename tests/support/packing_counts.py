"""Count what `packed_linears` packs where a module under test calls it: `counting(original, counts)` is a drop-in
for the function, monkeypatched into the caller's namespace; each block appends the number of layers it packed.
`counting_packs(monkeypatch)` counts the packs themselves: the layers packed, in order, and the packed products and
input gradients computed."""

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


def counting_packs(monkeypatch) -> dict[str, list | int]:
    """Record every `packed_weights._Pack` made (`made`: the packed layers' ids, in order) and count its forward
    products (`product`) and input gradients (`grad_input`), for the test's length."""
    from adaptercl.rollout import packed_weights as pw

    record: dict[str, list | int] = {"made": [], "product": 0, "grad_input": 0}
    real_init = pw._Pack.__init__

    def init(self, linear, dtype):
        record["made"].append(id(linear))
        real_init(self, linear, dtype)

    def counted(name: str, real: Callable) -> Callable:
        def call(self, x):
            record[name] += 1
            return real(self, x)

        return call

    monkeypatch.setattr(pw._Pack, "__init__", init)
    for name in ("product", "grad_input"):
        monkeypatch.setattr(pw._Pack, name, counted(name, getattr(pw._Pack, name)))
    return record
