"""SGLang 0.5.8 - 0.5.11: a batch ``GenerateReqInput`` drops ``routed_experts_start_len`` when it is split.

``GenerateReqInput.__getitem__`` builds each item without the field (0.5.12 copies it), so a batched
``/generate`` with a start answered every row from 0 and the client refused the mismatch. rr wraps
``__getitem__`` to copy the field to each item. Idempotent; only on the versions that need it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from rr_client.core.patching import wrap_once
from rr_server.serving.engines import ReleaseFacts
from rr_server.serving.engines.sglang import UnsupportedSGLangError

__all__ = ["needs_item_start_fix", "apply_item_start_fix"]


def needs_item_start_fix(profile: ReleaseFacts) -> bool:
    """True on 0.5.8 - 0.5.11: the field exists but batch items lose it."""
    return profile.has_start_field and profile.release < (0, 5, 12)


def _copies_start(original: Callable[..., Any]) -> Callable[..., Any]:
    """``GenerateReqInput.__getitem__`` that gives each item the batch's ``routed_experts_start_len``."""

    @functools.wraps(original)
    def getitem(self: Any, i: Any) -> Any:
        item = original(self, i)
        start = getattr(self, "routed_experts_start_len", 0)
        if isinstance(start, int) and start and not getattr(item, "routed_experts_start_len", 0):
            item.routed_experts_start_len = start
        return item

    return getitem


def apply_item_start_fix(profile: ReleaseFacts) -> bool:
    """Wrap ``GenerateReqInput.__getitem__`` once where needed; True if it is (now) wrapped.

    An ``__getitem__`` of another shape is UnsupportedSGLangError, and nothing is changed.
    """
    if not needs_item_start_fix(profile):
        return False
    from sglang.srt.managers.io_struct import GenerateReqInput

    wrap_once(
        GenerateReqInput,
        "__getitem__",
        _copies_start,
        params=["self", "i"],
        what=f"SGLang {profile.version}",
        error=functools.partial(UnsupportedSGLangError, package="sglang", version=profile.version),
    )
    return True
