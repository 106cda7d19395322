"""Live tensor bytes through a piece of PyTorch code, on real tensors or on fake ones (no memory allocated).

`LiveBytes` is a `TorchDispatchMode`: every tensor an op returns has its storage counted once (by the storage's
Python object, which PyTorch keeps for as long as the storage lives) and uncounted by a weakref finalizer when the
storage dies; `peak` is the high-water mark of the sum, with the per-category totals at that moment (`at_peak`).
Tensors that exist before the mode starts (weights, a batch) are counted with `register`. Category of an
allocation: what `register` was told, else `logits` for a tensor whose last dimension is the `vocab` size given,
else `other`.

Under `FakeTensorMode` (`fake_mode`) the same count runs without allocating: shapes, dtypes and the ops' own
temporaries are exact, values are not. Data-dependent Python reads are answered by an assumption instead of
failing. An op whose tensor inputs are all real (the batch: token ids, masks, advantages) runs for real, so
decisions on the batch's values are exact; of a fake tensor, `.item()` / `bool()` gives 1 (True: "finite", "some
rows take part"), and `nonzero` of a 1-D tensor says every element is nonzero. The count is what PyTorch tensors
hold: allocator rounding, caching and fragmentation (CUDA `reserved`), library workspaces and the kernels' own
scratch memory are outside it.

`fakeify` swaps a module's parameters and buffers (meta or real) for fake tensors of the same shape, dtype and
sharing; `module.to()` does not work under `FakeTensorMode`, so this is done in place.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten


def fake_mode() -> torch._subclasses.fake_tensor.FakeTensorMode:
    """A FakeTensorMode that accepts the real tensors a test or batch brings in."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


class LiveBytes(TorchDispatchMode):
    """Count live tensor storage bytes (see the module docstring); `vocab` tags logits-shaped allocations."""

    def __init__(self, vocab: int | None = None, assume_data: bool = False) -> None:
        super().__init__()
        self.vocab = vocab
        self.assume_data = assume_data  # answer .item()/bool()/nonzero instead of reading data (fake tensors)
        self.live: dict[int, tuple[int, str]] = {}  # id(storage) -> (bytes, category)
        self.now: dict[str, int] = defaultdict(int)
        self.total = 0
        self.peak = 0
        self.at_peak: dict[str, int] = {}
        self.ops: dict[str, int] = defaultdict(int)  # op name -> calls, for checking which kernels ran

    def register(self, tensor: torch.Tensor, category: str) -> None:
        """Count a tensor that exists already (no-op when its storage is counted)."""
        self._track(tensor, category)

    def reset_peak(self) -> None:
        self.peak, self.at_peak = self.total, dict(self.now)

    def _track(self, tensor: torch.Tensor, category: str | None = None) -> None:
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # sparse, nested: not in the workloads traced here
            return
        key = id(storage)
        if key in self.live:
            return
        if category is None:
            category = "logits" if self.vocab and tensor.dim() and tensor.shape[-1] == self.vocab else "other"
        nbytes = storage.nbytes()
        self.live[key] = (nbytes, category)
        self.now[category] += nbytes
        self.total += nbytes
        weakref.finalize(storage, self._free, key)
        if self.total > self.peak:
            self.peak, self.at_peak = self.total, dict(self.now)

    def _free(self, key: int) -> None:
        nbytes, category = self.live.pop(key)
        self.now[category] -= nbytes
        self.total -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops[str(func.overloadpacket)] += 1
        if self.assume_data:
            from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            if tensors and not any(isinstance(t, FakeTensor) for t in tensors):  # real inputs only (the batch)
                with unset_fake_temporarily():
                    out = func(*args, **kwargs)  # real values: data-dependent reads of them stay exact
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        self._track(t)
                return out
            if func in ASSUMED:
                return ASSUMED[func](*args, **kwargs)
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


def _assumed_scalar(t: torch.Tensor) -> bool | int | float:
    return True if t.dtype == torch.bool else 1 if not t.dtype.is_floating_point else 1.0


def _assumed_nonzero(t: torch.Tensor) -> torch.Tensor:
    if t.dim() != 1:
        raise NotImplementedError(f"memory_trace: nonzero of a {t.dim()}-D fake tensor has no assumed answer")
    return torch.arange(t.shape[0], device=t.device).unsqueeze(-1)  # [n, 1]: every element nonzero


ASSUMED: dict[object, Callable] = {
    aten._local_scalar_dense.default: _assumed_scalar,
    aten.nonzero.default: _assumed_nonzero,
}


def fakeify(module: torch.nn.Module, mode, device: str | torch.device = "cpu") -> None:
    """Replace every parameter and buffer of `module` by a fake tensor (same shape, dtype, requires_grad, sharing)."""
    memo: dict[int, torch.Tensor] = {}
    with mode:
        for m in module.modules():
            for store, is_param in ((m._parameters, True), (m._buffers, False)):
                for name, t in list(store.items()):
                    if t is None:
                        continue
                    if id(t) not in memo:
                        fake = torch.empty(t.shape, dtype=t.dtype, device=device)
                        memo[id(t)] = torch.nn.Parameter(fake, requires_grad=t.requires_grad) if is_param else fake
                    store[name] = memo[id(t)]
