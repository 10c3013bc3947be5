"""Stand-in, named: CUDA tensors on a machine without a GPU, from PyTorch's own ``FakeTensorMode``.

Fake tensors carry a device, a dtype and a shape but no data; an op that mixes a CPU tensor with a CUDA one
raises ``FakeTensorDeviceMismatchError`` exactly where a real GPU run would raise "Expected all tensors to be
on the same device". Ops that need the data (``tolist``, ``int()``) cannot run on them, so the tests drive
rr's hooks and layouts directly with fake CUDA router outputs, never a whole transformers forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError, FakeTensorMode

CUDA = torch.device("cuda", 0)  # with an index: ``.to("cuda")`` on a CPU build refuses even a fake tensor

__all__ = ["CUDA", "FakeTensorDeviceMismatchError", "fake_mode", "to_fake_cuda"]


def fake_mode() -> FakeTensorMode:
    """A fake mode that takes real (CPU) tensors as inputs, as a trainer's CPU-made rows would be."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def to_fake_cuda(model: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """Replace every parameter and buffer of ``model`` by a fake CUDA copy (no grad: fake CUDA autograd
    needs a CUDA device guard a CPU build lacks); the module objects, their classes and attributes stay."""
    with mode:
        for mod in model.modules():
            for name, p in list(mod._parameters.items()):
                if p is not None:
                    mod._parameters[name] = nn.Parameter(mode.from_tensor(p.detach()).to(CUDA), requires_grad=False)
            for name, b in list(mod._buffers.items()):
                if b is not None:
                    mod._buffers[name] = mode.from_tensor(b).to(CUDA)
    return model


def on_cuda(*tensors: Any) -> bool:
    """Every tensor among ``tensors`` (nested in tuples/lists too) lives on the fake CUDA device."""
    flat: list[Any] = []
    for t in tensors:
        flat.extend(t if isinstance(t, (tuple, list)) else [t])
    return all(x.device == CUDA for x in flat if isinstance(x, torch.Tensor))
