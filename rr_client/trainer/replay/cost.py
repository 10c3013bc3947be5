"""Count the aten ops and host syncs a piece of torch code runs: the cost model of replay, measurable anywhere.

On a GPU each aten op is (at least) a kernel launch and each host sync stalls the stream until the device
catches up; both can be counted on a CPU. ``with count_ops() as c: ...`` counts every op the dispatcher
runs (views included) and every host read: the ops that need device data on the host
(``_local_scalar_dense`` behind ``int()``/``bool()``/``item()``, ``nonzero``, ``equal``, boolean indexing,
``masked_select``, ``unique``, ...), device-to-CPU copies, and ``tolist()``/``numpy()``, which on a CPU
tensor never reach the dispatcher. ``benchmarks/replay_overhead.py`` prints it per MoE layer and
``tests/trainer/test_replay_cost.py`` holds the budget.
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
SYNC_OPS = frozenset({
    "aten._local_scalar_dense", "aten.nonzero", "aten.nonzero_static", "aten.equal", "aten.is_nonzero",
    "aten.masked_select", "aten.unique", "aten._unique", "aten._unique2", "aten.unique_consecutive",
    "aten.unique_dim", "aten.bincount", "aten.histc", "aten.repeat_interleave", "aten.item",
    "aten._assert_async",
})
_HOST_READS = frozenset({"tolist", "numpy"})


@dataclass
class OpCount:
    """What ran inside ``count_ops``: ``ops`` aten ops, ``syncs`` host reads, each by name."""

    ops: int = 0
    syncs: int = 0
    names: Counter[str] = field(default_factory=Counter)
    sync_names: Counter[str] = field(default_factory=Counter)

    def sync(self, name: str) -> None:
        self.syncs += 1
        self.sync_names[name] += 1


def _packet(func: Any) -> str:
    name = str(getattr(func, "_overloadpacket", func))
    return name if name.startswith("aten.") else f"aten.{name}"


def _bool_index(args: tuple[Any, ...]) -> bool:
    idx = args[1] if len(args) > 1 else None
    return isinstance(idx, (list, tuple)) and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in idx)


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
        elif name in ("aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_") \
                and _bool_index(args):
            c.sync(f"{name}(bool)")
        elif name in ("aten._to_copy", "aten.copy_"):
            src = args[1] if name == "aten.copy_" else args[0]
            dst = kwargs.get("device") if name == "aten._to_copy" else args[0].device
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst is not None \
                    and torch.device(dst).type == "cpu":
                c.sync(f"{name}(to cpu)")
        return func(*args, **kwargs)


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
    """Count aten ops and host syncs of the code inside the block (forward and backward alike)."""
    c = OpCount()
    with _Function(c), _Dispatch(c):
        yield c
