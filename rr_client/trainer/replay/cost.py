"""Count the aten ops, host syncs and cross-device copies a piece of torch code runs: replay's cost model.

On a GPU each aten op is (at least) a kernel launch, each host sync stalls the stream until the device catches
up, and each copy between host and device moves bytes over PCIe; all three can be counted on a CPU, the copies
with device tensors (real ones on a GPU, or the fake CUDA tensors of PyTorch's ``FakeTensorMode`` on a CPU).
``with count_ops() as c: ...`` counts every op the dispatcher runs (views included); every host read: the ops
that need device data on the host (``_local_scalar_dense`` behind ``int()``/``bool()``/``item()``, ``nonzero``,
``equal``, ``allclose``, boolean indexing, ``masked_select``, ``unique``, ...), ``tolist()``/``numpy()`` (which
on a CPU tensor never reach the dispatcher) and every *blocking* cross-device copy (device to host always:
``.cpu()``, ``.to("cpu")``; host to device unless ``non_blocking=True``: torch then synchronizes the stream);
and in ``copies`` every copy between devices, blocking or not. ``benchmarks/replay_overhead.py`` prints it per
MoE layer and ``tests/trainer/test_replay_cost.py`` holds the budgets, on CPU and on fake CUDA tensors.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCount", "count_ops", "SYNC_OPS"]

#: aten ops whose result depends on device data the host must read (a sync on a GPU)
SYNC_OPS = frozenset(
    {
        "aten._local_scalar_dense",
        "aten.nonzero",
        "aten.nonzero_static",
        "aten.equal",
        "aten.is_nonzero",
        "aten.masked_select",
        "aten.unique",
        "aten._unique",
        "aten._unique2",
        "aten.unique_consecutive",
        "aten.unique_dim",
        "aten.bincount",
        "aten.histc",
        "aten.repeat_interleave",
        "aten.item",
        "aten._assert_async",
        "aten.allclose",
    }
)
_HOST_READS = frozenset({"tolist", "numpy"})


@dataclass
class OpCount:
    """What ran inside ``count_ops``: ``ops`` aten ops, ``syncs`` host reads (blocking copies included),
    ``copies`` cross-device copies (blocking or not), each by name."""

    ops: int = 0
    syncs: int = 0
    copies: int = 0
    names: Counter[str] = field(default_factory=Counter)
    sync_names: Counter[str] = field(default_factory=Counter)
    copy_names: Counter[str] = field(default_factory=Counter)

    def sync(self, name: str) -> None:
        """Count one host read (or blocking copy) named ``name``."""
        self.syncs += 1
        self.sync_names[name] += 1

    def copy(self, name: str) -> None:
        """Count one cross-device copy named ``name``."""
        self.copies += 1
        self.copy_names[name] += 1


def _packet(func: Any) -> str:
    name = str(getattr(func, "_overloadpacket", func))
    return name if name.startswith("aten.") else f"aten.{name}"


def _bool_index(args: tuple[Any, ...]) -> bool:
    idx = args[1] if len(args) > 1 else None
    return isinstance(idx, (list, tuple)) and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in idx
    )


class _Dispatch(TorchDispatchMode):
    def __init__(self, count: OpCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = _packet(func)
        c = self.count
        c.ops += 1
        c.names[name] += 1
        if name in SYNC_OPS:
            c.sync(name)
        elif name in ("aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_") and _bool_index(args):
            c.sync(f"{name}(bool)")
        elif name in ("aten._to_copy", "aten.copy_"):
            _count_copy(c, name, args, kwargs)
        return func(*args, **kwargs)


def _count_copy(c: OpCount, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A ``_to_copy``/``copy_`` between two devices: a copy; a sync too when it blocks the host."""
    if name == "aten.copy_":
        dst_t, src = args[0], args[1] if len(args) > 1 else None
        dst = dst_t.device if isinstance(dst_t, torch.Tensor) else None
        non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    else:
        src, dst = args[0] if args else None, kwargs.get("device")
        non_blocking = bool(kwargs.get("non_blocking", False))
    if not isinstance(src, torch.Tensor) or dst is None:
        return
    a, b = src.device, torch.device(dst)
    if a.type == b.type and (a.index == b.index or None in (a.index, b.index)):
        return
    label = f"{name}({a.type}->{b.type})"
    c.copy(label)
    if b.type == "cpu" or (a.type == "cpu" and not non_blocking):  # read by the host / stream synchronized
        c.sync(label)


class _Function(TorchFunctionMode):
    def __init__(self, count: OpCount) -> None:
        super().__init__()
        self.count = count

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in _HOST_READS:
            self.count.sync(f"Tensor.{func.__name__}")
        return func(*args, **(kwargs or {}))


@contextmanager
def count_ops() -> Iterator[OpCount]:
    """Count aten ops, host syncs and cross-device copies of the code inside the block (forward and backward)."""
    c = OpCount()
    with _Function(c), _Dispatch(c):
        yield c
