"""Named phases of a run, for whoever watches them (the rehearsal's meter, `run/phase_meter.py`).

    out = phased("rollout", engine.generate, prompts, adapters, params)  # engine.generate(...) in phase "rollout"
    with watching(meter):                                                 # meter.enter(name), meter.leave(name, error)
        run_recipe(recipe)

The run names its phases where it calls them (`run/sequence.py`: load, eval, save and each end-of-stage part;
`train/stage.py`: rollout, update, checkpoint); phases nest (a step's rollout inside its stage's train). An observer's
`enter` may raise to stop the run there (the rehearsal's deadline); `leave` gets the exception that ended the phase,
or None. Nothing watches a plain run: a call costs one check of an empty list. No torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Observer(Protocol):
    def enter(self, name: str) -> None: ...

    def leave(self, name: str, error: BaseException | None) -> None: ...


_OBSERVERS: list[Observer] = []


def phased(name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) inside the phase `name`, told to every observer."""
    if not _OBSERVERS:
        return fn(*args, **kwargs)
    watchers: list[Observer] = []
    error: BaseException | None = None
    try:
        for observer in list(_OBSERVERS):
            observer.enter(name)  # may raise: the phase does not open, and those that entered leave it
            watchers.append(observer)
    except BaseException as err:
        for observer in reversed(watchers):
            observer.leave(name, err)
        raise
    try:
        return fn(*args, **kwargs)
    except BaseException as err:
        error = err
        raise
    finally:
        for observer in reversed(watchers):
            observer.leave(name, error)


@contextmanager
def watching(observer: Observer) -> Iterator[Observer]:
    """`observer` told of every phase the block's code enters and leaves."""
    _OBSERVERS.append(observer)
    try:
        yield observer
    finally:
        _OBSERVERS.remove(observer)
