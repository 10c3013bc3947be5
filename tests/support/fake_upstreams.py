"""FAKE engine upstreams for the sidecar tests: FakeSGLangUpstream and FakeVLLMUpstream.

These are NOT engines. SGLang cannot serve on these CPU-only machines, and real vLLM never sends
malformed routing on purpose, so these test-only servers reproduce the engines' HTTP shapes for the
sidecar: SGLang's ``/generate`` with ``meta_info["routed_experts"]`` = base64 of the raw headerless
int32 buffer ``(rows, L, K)`` (exactly what SGLang 0.5.10+ sends; 0.5.7's ``output_routed_experts``
and the ``{}`` bug are modes), and vLLM 0.30's ``/v1/completions`` with ``choices[].routed_experts`` =
base64 of an ``np.save`` file. ``corrupt`` selects one malformed answer. Token ids are synthetic;
routing follows :func:`tests.support.protocol_server.synthetic_routing` so tests can recompute it.
The positive SGLang path is proven on SGLang's real app in tests/sglang/test_sidecar_sglang.py.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tests.support.protocol_server import synthetic_routing
from tests.support.threaded_server import ThreadedServer

__all__ = ["FakeSGLangUpstream", "FakeVLLMUpstream", "write_fake_config", "CORRUPTIONS"]

LAYERS, EXPERTS, TOPK, MOE_LAYERS = 3, 8, 2, [0, 2]
CORRUPTIONS = (
    "truncated_b64",
    "wrong_rows",
    "duplicate_ids",
    "out_of_range",
    "missing",
    "empty_dict",
    "dense_nonzero",
    "non_json",
    "http_500",
)


def write_fake_config(d: Path) -> Path:
    """A Qwen3-MoE style config.json (3 layers, layer 1 dense, 8 experts, top-2) for /rr/info."""
    d.mkdir(parents=True, exist_ok=True)
    cfg = {
        "model_type": "qwen3_moe",
        "num_hidden_layers": LAYERS,
        "num_experts": EXPERTS,
        "num_experts_per_tok": TOPK,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def fake_tokens(prompt: Any) -> list[int]:
    """Text -> its bytes; token ids unchanged."""
    return list(prompt.encode()) if isinstance(prompt, str) else list(prompt)


def fake_completion(prompt: list[int], n_new: int, j: int = 0) -> list[int]:
    """Deterministic generated ids."""
    return [(sum(prompt) + 13 * j + 7 * i) % 250 + 1 for i in range(n_new)]


def corrupt_routing(r: np.ndarray, mode: str) -> np.ndarray:
    """Apply one routing-array corruption (rows, ids); other modes are applied to the encoding."""
    r = r.copy()
    if mode == "wrong_rows":
        r = r[:-1]
    elif mode == "duplicate_ids":
        r[0, MOE_LAYERS[0], :] = r[0, MOE_LAYERS[0], 0]
    elif mode == "out_of_range":
        r[0, MOE_LAYERS[0], 0] = EXPERTS
    elif mode == "dense_nonzero":
        r[0, 1, :] = [1, 2]
    elif mode == "shift_layers":  # the layer axis off by one (verl #5037): MoE ids land on the dense layer
        r = np.roll(r, 1, axis=1)
    return r


class _FakeServer(ThreadedServer):
    """A FAKE engine app served by :class:`ThreadedServer`; ``corrupt``, ``delay`` and ``bodies`` are mutable."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.corrupt = "none"
        self.swaps = 0  # answers given in "swap_rows" mode
        self.delay = 0.0
        self.bodies: list[dict[str, Any]] = []
        super().__init__(self.build_app(), name=type(self).__name__)

    generate_path = "/generate"  # the engine's generate route

    def info_answers(self) -> dict[str, dict[str, Any]]:  # pragma: no cover - overridden
        """The engine's GET routes that answer fixed JSON (its model and version info), by path."""
        raise NotImplementedError

    def answer(self, body: dict[str, Any]) -> Response:  # pragma: no cover - overridden
        """The engine's answer to one generate request's JSON ``body``."""
        raise NotImplementedError

    def build_app(self) -> FastAPI:
        """``/health``, :meth:`info_answers`, and the generate route: the body recorded in ``bodies``, ``delay``
        waited, then a whole-answer corruption (:meth:`special`) or :meth:`answer`."""
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        for path, answer in self.info_answers().items():
            app.get(path)(_answering(answer))

        @app.post(self.generate_path)
        async def generate(request: Request) -> Response:
            body = await request.json()
            self.bodies.append(body)
            if self.delay:
                await asyncio.sleep(self.delay)
            bad = self.special()
            return bad if bad is not None else self.answer(body)

        return app

    def routing(self, tokens: list[int]) -> np.ndarray:
        """The routing a well-behaved engine reports for ``tokens`` (one row each)."""
        return synthetic_routing(tokens, LAYERS, TOPK, EXPERTS, MOE_LAYERS)

    def special(self) -> Response | None:
        """Whole-answer corruptions shared by both fakes."""
        if self.corrupt == "non_json":
            return Response(b"<html>502 Bad Gateway</html>", media_type="text/html")
        if self.corrupt == "http_500":
            return JSONResponse(
                {"error": {"message": "CUDA error: an illegal memory access", "code": 500}}, status_code=500
            )
        return None


def _answering(answer: dict[str, Any]) -> Any:
    """A GET endpoint that answers ``answer``."""

    async def fixed() -> JSONResponse:
        return JSONResponse(answer)

    return fixed


class FakeSGLangUpstream(_FakeServer):
    """FAKE SGLang server (``/generate``, ``/health``, ``/get_model_info``, ``/get_server_info``): int32 routing, or
    with ``wire_dtype`` uint8/uint16 SGLang main's compact wire (``SGLANG_ROUTED_EXPERTS_DTYPE``, PR #31219):
    headerless base64 of that dtype plus ``meta_info.routed_experts_dtype``; ``state_dtype=False`` omits the field."""

    wire_dtype = "int32"
    state_dtype = True

    def sample(self, prompt: list[int], params: dict[str, Any], j: int, want: bool) -> dict[str, Any]:
        """One SGLang reply item, routing as base64 raw ``wire_dtype`` when ``want``."""
        out = fake_completion(prompt, int(params.get("max_new_tokens", 4)), j)
        meta: dict[str, Any] = {
            "id": f"sg-{j}",
            "finish_reason": {"type": "length", "length": len(out)},
            "prompt_tokens": len(prompt),
            "completion_tokens": len(out),
            "cached_tokens": 0,
            "e2e_latency": 0.001,
        }
        if want:
            r = corrupt_routing(self.routing((prompt + out)[:-1]), self.corrupt).astype(self.wire_dtype)
            b64 = base64.b64encode(r.tobytes()).decode()
            if self.wire_dtype != "int32" and self.state_dtype:
                meta["routed_experts_dtype"] = self.wire_dtype
            if self.corrupt == "truncated_b64":
                b64 = b64[: len(b64) // 2 + 1]
            meta["routed_experts"] = {} if self.corrupt == "empty_dict" else b64
            if self.corrupt == "missing":
                del meta["routed_experts"]
        return {"text": "y" * len(out), "output_ids": out, "meta_info": meta}

    def info_answers(self) -> dict[str, dict[str, Any]]:
        return {
            "/get_model_info": {"model_path": str(self.model_dir), "is_generation": True},
            "/get_server_info": {"version": "0.5.10-fake"},
        }

    def answer(self, body: dict[str, Any]) -> Response:
        key = "text" if "text" in body else "input_ids"
        raw = body[key]
        batch = isinstance(raw, list) and (key == "text" or (raw and isinstance(raw[0], list)))
        prompts = [fake_tokens(p) for p in (raw if batch else [raw])]
        params = body.get("sampling_params") or {}
        n = int(params.get("n", 1))
        want = bool(body.get("return_routed_experts"))
        items = [self.sample(p, params, j, want) for p in prompts for j in range(n)]
        if body.get("stream"):
            return StreamingResponse(self._stream(items, batch), media_type="text/event-stream")
        return JSONResponse(items if batch or n > 1 else items[0])

    async def _stream(self, items: list[dict[str, Any]], batch: bool) -> Any:
        """SGLang-style SSE: cumulative partial chunks without routing, then the final chunk with it."""
        for i, it in enumerate(items):
            for k in range(1, len(it["output_ids"])):
                meta = {key: v for key, v in it["meta_info"].items() if key != "routed_experts"}
                meta.update(finish_reason=None, completion_tokens=k)
                part = {"text": it["text"][:k], "output_ids": it["output_ids"][:k], "meta_info": meta}
                if batch:
                    part["index"] = i
                yield "data: " + orjson.dumps(part).decode() + "\n\n"
            final = dict(it, index=i) if batch else it
            yield "data: " + orjson.dumps(final).decode() + "\n\n"
        yield "data: [DONE]\n\n"


class FakeVLLMUpstream(_FakeServer):
    """FAKE vLLM 0.30 API server (``/v1/completions``, ``/v1/models``, ``/version``, ``/health``): .npy routing."""

    generate_path = "/v1/completions"

    def info_answers(self) -> dict[str, dict[str, Any]]:
        return {
            "/v1/models": {"object": "list", "data": [{"id": "fake-moe", "root": str(self.model_dir)}]},
            "/version": {"version": "0.30.0-fake"},
        }

    def answer(self, body: dict[str, Any]) -> Response:
        prompt = fake_tokens(body["prompt"])
        start = int(body.get("routed_experts_prompt_start") or 0)
        choices = []
        for j in range(int(body.get("n", 1))):
            out = fake_completion(prompt, int(body.get("max_tokens") or 16), j)
            tokens = (prompt + out)[start:-1]
            if self.corrupt == "swap_rows":  # another request's rows: each answer the routing of other tokens
                self.swaps += 1
                tokens = [t + self.swaps for t in tokens]
            r = corrupt_routing(self.routing(tokens), self.corrupt).astype(np.uint8)
            buf = io.BytesIO()
            np.save(buf, r)
            b64: Any = base64.b64encode(buf.getvalue()).decode()
            if self.corrupt == "truncated_b64":
                b64 = b64[: len(b64) // 2 + 1]
            elif self.corrupt == "missing":
                b64 = None
            elif self.corrupt == "empty_dict":
                b64 = {}
            choices.append(
                {
                    "index": j,
                    "text": "z" * len(out),
                    "finish_reason": "length",
                    "stop_reason": None,
                    "prompt_token_ids": prompt,
                    "token_ids": out,
                    "routed_experts": b64,
                }
            )
        if body.get("stream"):
            return StreamingResponse(self._stream(choices), media_type="text/event-stream")
        usage = {"prompt_tokens": len(prompt), "completion_tokens": sum(len(c["token_ids"]) for c in choices)}
        return JSONResponse(
            {"id": "cmpl-fake", "object": "text_completion", "model": "fake-moe", "choices": choices, "usage": usage}
        )

    async def _stream(self, choices: list[dict[str, Any]]) -> Any:
        """vLLM-style SSE: one delta per token, prompt ids on the first, no routing (as vLLM 0.30)."""
        for c in choices:
            for k, tok in enumerate(c["token_ids"]):
                last = k == len(c["token_ids"]) - 1
                delta = {
                    "index": c["index"],
                    "text": "z",
                    "token_ids": [tok],
                    "prompt_token_ids": c["prompt_token_ids"] if k == 0 else None,
                    "finish_reason": "length" if last else None,
                    "stop_reason": None,
                }
                yield "data: " + orjson.dumps({"id": "cmpl-fake", "choices": [delta]}).decode() + "\n\n"
        yield "data: [DONE]\n\n"
