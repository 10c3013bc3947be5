"""Reading a Server-Sent-Events answer body in tests (the OpenAI streaming shape: ``data: {...}`` blocks)."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["sse_events"]


def sse_events(text: str) -> list[Any]:
    """The ``data:`` events of an SSE body, JSON-decoded (``[DONE]`` kept as the string)."""
    out: list[Any] = []
    for block in text.split("\n\n"):
        if block.startswith("data:"):
            data = block[5:].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
