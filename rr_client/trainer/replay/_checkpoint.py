"""Which activation checkpoint a router call runs under, so a recompute owed after a replay block is caught.

A checkpointed forward is re-run in backward; when that backward runs after ``replay_routing`` closed, the
recompute routes with the model's own choice and the gradients are silently those of other experts. Both kinds
of checkpoint are recognised by the object that owns the recompute, which lives exactly as long as the autograd
graph that will recompute:

- reentrant (``use_reentrant=True``, TRL's PEFT + ZeRO-3, DeepSpeed's and Megatron's ``CheckpointFunction``): an
  ``autograd.Function`` whose ``forward(ctx, ...)`` runs the layer under ``no_grad`` and whose
  ``backward(ctx, ...)`` re-runs it; the owner is that ``ctx`` (the graph's node).
- non-reentrant (torch's default, verl's): ``torch.utils.checkpoint`` packs saved tensors with a hook closing
  over its ``_CheckpointFrame``; the owner is that frame (its ``unpack_hook`` re-runs the forward).

A forward under ``no_grad`` (no graph) leaves a dead owner, so it owes nothing.
"""

from __future__ import annotations

import sys
from types import FrameType

import torch
from torch.autograd.function import FunctionCtx

__all__ = ["checkpoint_owner"]

_MAX_DEPTH = 256  # frames walked at most (a router call sits a few dozen frames below the checkpoint)


def _function_ctx(frame: FrameType | None, method: str) -> FunctionCtx | None:
    """The ``ctx`` of the innermost ``autograd.Function`` ``method`` (``forward``/``backward``) on the stack."""
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name == method and code.co_argcount and code.co_varnames[0] == "ctx":
            ctx = frame.f_locals.get("ctx")
            if isinstance(ctx, FunctionCtx):
                return ctx
        frame = frame.f_back
    return None


def _unpacking_frame(frame: FrameType | None) -> object | None:
    """The ``_CheckpointFrame`` whose ``unpack_hook`` (torch's non-reentrant recompute) is on the stack."""
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return None
        code = frame.f_code
        if (
            code.co_name == "unpack_hook"
            and "frame" in code.co_freevars
            and frame.f_globals.get("__name__") == "torch.utils.checkpoint"
        ):
            return frame.f_locals.get("frame")
        frame = frame.f_back
    return None


def _packing_frame() -> object | None:
    """The ``_CheckpointFrame`` of the innermost active non-reentrant checkpoint's pack hook, if any."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(False) if top is not None else None
    if not hooks:
        return None
    pack = hooks[0]
    code = getattr(pack, "__code__", None)
    if code is None or getattr(pack, "__module__", None) != "torch.utils.checkpoint" or "frame" not in code.co_freevars:
        return None
    return pack.__closure__[code.co_freevars.index("frame")].cell_contents  # type: ignore[index]


def checkpoint_owner(recompute: bool) -> object | None:
    """The checkpoint running this router call: in a forward (``recompute`` False) the one that will re-run it
    in backward, in a backward's recompute the one re-running it; None when no checkpoint is involved."""
    caller = sys._getframe(1)
    if recompute:
        owner = _function_ctx(caller, "backward")
        return owner if owner is not None else _unpacking_frame(caller)
    if torch.is_grad_enabled():
        return _packing_frame()
    return _function_ctx(caller, "forward")
