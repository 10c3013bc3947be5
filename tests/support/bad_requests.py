"""The one corpus of malformed ``/generate`` requests, used at every layer that serves rr's protocol.

Each entry is a raw body, the status it must get and a substring its error message must contain.
``rejected_by`` names where it is refused:

- ``PARSER``: rr's own parsing, no server (:func:`rr_server.serving.generate_protocol.parse_generate_request`
  followed by :func:`rr_server.serving.vllm_translate.to_vllm_sampling_kwargs`),
- ``VLLM``: the rr plugin's ``/generate`` on a real vLLM server (same parser, plus the engine),
- ``SIDECAR_VLLM`` / ``SIDECAR_SGLANG``: the sidecar in front of a vLLM / SGLang upstream.

Where an entry is not refused, the request must be accepted: the SGLang sidecar passes fields it does
not model through to SGLang untouched, and only an engine that knows the vocabulary can refuse a token id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

__all__ = ["BadRequestCase", "BAD_REQUESTS", "PARSER", "VLLM", "SIDECAR_VLLM", "SIDECAR_SGLANG", "params"]

PARSER, VLLM, SIDECAR_VLLM, SIDECAR_SGLANG = "parser", "vllm", "sidecar-vllm", "sidecar-sglang"
EVERYWHERE = frozenset({PARSER, VLLM, SIDECAR_VLLM, SIDECAR_SGLANG})
# fields rr does not model: the SGLang sidecar forwards them, so only rr's strict parser refuses them
NOT_SGLANG_SIDECAR = EVERYWHERE - {SIDECAR_SGLANG}


@dataclass(frozen=True)
class BadRequestCase:
    """One malformed request: ``body`` must get ``status`` with ``needle`` in its error message."""

    name: str
    body: bytes
    status: int
    needle: str
    rejected_by: frozenset[str] = EVERYWHERE

    def rejected_at(self, where: str) -> bool:
        """Whether the layer ``where`` (one of the module constants) refuses this request."""
        return where in self.rejected_by


BAD_REQUESTS: tuple[BadRequestCase, ...] = (
    BadRequestCase("malformed json", b'{"text": "hi", ', 400, "not valid JSON"),
    BadRequestCase("not json at all", b"{not json", 400, "not valid JSON"),
    BadRequestCase("not an object", b"[1, 2, 3]", 400, "must be a JSON object"),
    BadRequestCase("empty array", b"[]", 400, "must be a JSON object"),
    BadRequestCase("no prompt", b'{"sampling_params": {}}', 400, "exactly one of 'text' or 'input_ids'"),
    BadRequestCase("both prompts", b'{"text": "a", "input_ids": [1]}', 400, "exactly one of"),
    BadRequestCase("empty text", b'{"text": ""}', 400, "empty prompt"),
    BadRequestCase("empty ids", b'{"input_ids": []}', 400, "'input_ids' must be non-empty"),
    BadRequestCase("empty batch item", b'{"input_ids": [[1, 2], []]}', 400, "empty prompt"),
    BadRequestCase("wrong-typed text", b'{"text": 42}', 400, "text"),
    BadRequestCase("wrong-typed ids", b'{"input_ids": "1 2 3"}', 400, "input_ids"),
    BadRequestCase("negative token id", b'{"input_ids": [1, -2]}', 400, "non-negative"),
    BadRequestCase("wrong-typed flag", b'{"text": "a", "return_routed_experts": "yes"}', 400, "return_routed_experts"),
    BadRequestCase("wrong-typed stream", b'{"text": "a", "stream": 1}', 400, "stream"),
    BadRequestCase("wrong-typed indexer flag", b'{"text": "a", "return_indexer_topk": 1}', 400, "return_indexer_topk"),
    BadRequestCase(  # no vLLM release captures the sparse-attention indexer's picks
        "indexer top-k from vLLM",
        b'{"input_ids": [1, 2], "return_indexer_topk": true}',
        400,
        "vllm#49555",
        frozenset({VLLM, SIDECAR_VLLM}),
    ),
    BadRequestCase(
        "wrong-typed sampling", b'{"text": "a", "sampling_params": {"temperature": "hot"}}', 400, "temperature"
    ),
    BadRequestCase("sampling not an object", b'{"text": "a", "sampling_params": 3}', 400, "sampling_params"),
    BadRequestCase(
        "negative max tokens", b'{"text": "a", "sampling_params": {"max_new_tokens": -5}}', 400, "max_new_tokens"
    ),
    BadRequestCase(
        "zero max tokens", b'{"text": "a", "sampling_params": {"max_new_tokens": 0}}', 400, "max_new_tokens"
    ),
    BadRequestCase("negative start", b'{"text": "a", "routed_experts_start": -1}', 400, "routed_experts_start"),
    BadRequestCase(
        "sampling list length", b'{"text": ["a", "b"], "sampling_params": [{}]}', 400, "sampling_params has 1 entries"
    ),
    BadRequestCase(
        "n with stream",
        b'{"text": "a", "stream": true, "sampling_params": {"n": 2}}',
        400,
        "stream=true with sampling_params.n",
    ),
    BadRequestCase(
        "unknown sampling key", b'{"text": "a", "sampling_params": {"bogus": 1}}', 400, "bogus", NOT_SGLANG_SIDECAR
    ),
    BadRequestCase(
        "unknown field set",
        b'{"text": "a", "image_data": "http://x"}',
        400,
        "unsupported /generate field(s) for this server: image_data",
        NOT_SGLANG_SIDECAR,
    ),
    BadRequestCase(
        "top_k below -1", b'{"text": "a", "sampling_params": {"top_k": -3}}', 400, "top_k", NOT_SGLANG_SIDECAR
    ),
    BadRequestCase("out of vocab id", b'{"input_ids": [1, 2, 99999999]}', 400, "out of vocabulary", frozenset({VLLM})),
)


def params(where: str | None = None) -> list[Any]:
    """The corpus as ``pytest.param(case, id=name)``; only the cases ``where`` refuses, when given."""
    return [pytest.param(c, id=c.name) for c in BAD_REQUESTS if where is None or c.rejected_at(where)]
