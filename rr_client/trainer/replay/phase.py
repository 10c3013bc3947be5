"""Where a router call runs and what it counts, for every replay backend (the Hugging Face hooks and Megatron's):
the one phase test (:func:`in_backward`: a forward, or a checkpoint's recompute inside autograd's backward, as
Megatron's ``RouterReplayAction`` names them ``REPLAY_FORWARD`` / ``REPLAY_BACKWARD``) and the one device tally
(counts kept on the device in the hooks, read once per device at the end: no host sync inside a forward).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Literal

import torch

__all__ = ["Phase", "phase", "in_backward", "DeviceTally"]

#: a router call's phase: its forward, or the recompute of that forward in the backward (activation checkpointing)
Phase = Literal["forward", "recompute"]


def in_backward() -> bool:
    """True while autograd runs a backward pass (where checkpointing recomputes forwards)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def phase() -> Phase:
    """This router call's :data:`Phase`."""
    return "recompute" if in_backward() else "forward"


class DeviceTally:
    """0-d integer tensors (or 1-D count vectors, :meth:`add_vector`) under string keys, summed and read in one
    host transfer per device at the end."""

    def __init__(self) -> None:
        self._parts: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.vectors: dict[str, list[int]] = {}  #: the vector keys' totals, filled by :meth:`read`

    def add(self, key: str, value: torch.Tensor) -> None:
        self._parts[key].append(value)

    def add_vector(self, key: str, value: torch.Tensor) -> None:
        """A 1-D count vector summed elementwise under ``key`` (its total lands in :attr:`vectors`)."""
        self._parts["vec:" + key].append(value)

    def __bool__(self) -> bool:
        return bool(self._parts)

    def read(self) -> dict[str, int]:
        """Every scalar key's total (vector keys' go to :attr:`vectors`); one ``tolist()`` per device."""
        by_dev: dict[torch.device, list[tuple[str, torch.Tensor]]] = defaultdict(list)
        for key, parts in self._parts.items():
            for t in parts:
                by_dev[t.device].append((key, t))
        out: dict[str, int] = {k: 0 for k in self._parts if not k.startswith("vec:")}
        for items in by_dev.values():
            flat = [t.reshape(-1).long() for _, t in items]
            values = torch.cat(flat).tolist()
            at = 0
            for (key, _), f in zip(items, flat):
                part, at = values[at : at + f.numel()], at + f.numel()
                if key.startswith("vec:"):
                    old = self.vectors.setdefault(key[4:], [0] * len(part))
                    self.vectors[key[4:]] = [a + int(b) for a, b in zip(old, part)]
                else:
                    out[key] += int(part[0])
        self._parts.clear()
        return out
