"""ProtocolTestServer: a TEST-ONLY HTTP server that speaks the documented rr protocol with synthetic routing.

It is not an engine and proves nothing about SGLang or vLLM; it lets the client tests inject faults
(5xx, 4xx, slow answers, malformed routing) over real HTTP on 127.0.0.1. Token ids are the prompt's
bytes; the routing of token ``t`` at layer ``l`` is ``[(t + l + j) % E for j in range(K)]`` so tests
can recompute every value. Well-formed routing goes out the way a real rr server sends it
(:func:`rr_client.check_routing` -> :func:`rr_client.routing_meta_fields`); the ``corrupt`` modes
bypass that check on purpose.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rr_client.core.codec import check_routing, expected_rows, routing_meta_fields, wire_dtype
from rr_client.core.info import RRInfo
from tests.support.routing_data import npy_payload
from tests.support.threaded_server import ThreadedServer


def synthetic_routing(tokens: list[int], layers: int, topk: int, num_experts: int, moe_layers: list[int]) -> np.ndarray:
    """The routing this server reports for a token sequence (one row per token)."""
    t = np.asarray(tokens, dtype=np.int64)[:, None, None]
    lyr = np.arange(layers)[None, :, None]
    j = np.arange(topk)[None, None, :]
    ids = (t + lyr + j) % num_experts
    dense = [i for i in range(layers) if i not in set(moe_layers)]
    ids[:, dense, :] = 0
    return ids


@dataclass
class Behaviour:
    """What the server does next; tests mutate it."""

    fail_5xx: int = 0  # answer 503 to this many /generate calls first
    reject_status: int = 0  # answer every /generate with this 4xx (e.g. 401: missing API key)
    delay: float = 0.0  # seconds before answering /generate
    corrupt: str = "none"  # none|dup|rows|missing|count|unasked|bad_info|zero|mixed|late_decode
    prefix_cache: bool = True  # a repeated prompt reports its whole 16-token blocks as cached_tokens
    identity: dict[str, Any] = field(default_factory=dict)  # /rr/info overrides (engine, engine_version, platform, ...)
    info_status: int = 200  # answer /rr/info with this status (404: a router that does not forward it)
    info_calls: int = 0
    calls: int = 0
    calls_mixed: int = 0  # answers given in "mixed" mode (each gets a different wrong routing)
    in_flight: int = 0
    max_in_flight: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)


def generate_ask(body: dict[str, Any]) -> tuple[dict[str, Any], int, bool, int]:
    """What a ``/generate`` body asks of a stand-in: its sampling params, ``n``, whether routing is asked, and
    ``routed_experts_start``."""
    params = body.get("sampling_params") or {}
    start = int(body.get("routed_experts_start") or 0)
    return params, int(params.get("n", 1)), bool(body.get("return_routed_experts")), start


def _unchecked_fields(routing: np.ndarray, num_experts: int, start: int) -> dict[str, Any]:
    """Routing fields for a deliberately corrupt array (only the id range is enforced by the encoder)."""
    return {
        "routed_experts": npy_payload(routing, num_experts=num_experts),
        "routed_experts_shape": [int(s) for s in routing.shape],
        "routed_experts_dtype": wire_dtype(num_experts).name,
        "routed_experts_format": "npy",
        "routed_experts_start": start,
    }


class ProtocolTestServer(ThreadedServer):
    """The TEST-ONLY protocol app, served over loopback HTTP by :class:`ThreadedServer`."""

    def __init__(self, *, layers: int = 3, topk: int = 2, num_experts: int = 8, moe_layers: list[int] | None = None):
        self.layers, self.topk, self.num_experts = layers, topk, num_experts
        self.moe_layers = list(range(layers)) if moe_layers is None else moe_layers
        self.behaviour = Behaviour()
        self._seen: set[tuple[int, ...]] = set()
        super().__init__(self._build_app(), name="protocol test server")

    def info(self) -> dict[str, Any]:
        return {
            "engine": "protocol-test-server",
            "engine_version": "0",
            "rr_version": "0.1.0",
            "model": "synthetic",
            "num_hidden_layers": self.layers,
            "num_experts": self.num_experts,
            "topk": self.topk,
            "moe_layers": self.moe_layers,
            "wire_dtype": wire_dtype(self.num_experts).name,
            **self.behaviour.identity,
        }

    def routing_of(self, tokens: list[int]) -> np.ndarray:
        """This server's synthetic routing of ``tokens`` (one row per token), in its dims."""
        return synthetic_routing(tokens, self.layers, self.topk, self.num_experts, self.moe_layers)

    def sent_fields(self, routing: np.ndarray, rows: int, start: int) -> dict[str, Any]:
        """``routing`` checked against this server's ``/rr/info`` and encoded, as a real rr server sends it."""
        info = RRInfo.model_validate(self.info())
        return routing_meta_fields(check_routing(routing, info, rows=rows, start=start))

    def _sample(self, prompt: list[int], j: int, params: dict[str, Any], want: bool, start: int) -> dict[str, Any]:
        n_new = int(params.get("max_new_tokens", 4))
        out = [(sum(prompt) + 13 * j + 7 * i) % 250 + 1 for i in range(n_new)]
        meta: dict[str, Any] = {
            "id": f"req-{j}",
            "prompt_tokens": len(prompt),
            "completion_tokens": len(out),
            "cached_tokens": 0,
            "finish_reason": {"type": "length", "length": n_new},
            "prompt_token_ids": prompt,
        }
        b = self.behaviour
        if b.prefix_cache and tuple(prompt) in self._seen:
            meta["cached_tokens"] = len(prompt) // 16 * 16
        self._seen.add(tuple(prompt))
        if want or b.corrupt == "unasked":
            routing = self.routing_of((prompt + out)[start:-1])
            if b.corrupt == "zero":  # what a compiled CPU graph or vLLM 0.15.x returns
                routing[:] = 0
            if b.corrupt == "mixed":  # another request's rows: the routing of different tokens, per call
                b.calls_mixed += 1
                routing = self.routing_of([t + b.calls_mixed for t in (prompt + out)[start:-1]])
            if b.corrupt == "late_decode" and j % 2 == 0:  # every other sample's generated rows are other tokens'
                gen = max(0, len(prompt) - start)
                routing[gen:] = self.routing_of([t + 1 for t in (prompt + out)[start:-1]])[gen:]
            if b.corrupt == "dup" and len(routing) > 1 and self.moe_layers:
                routing[1, self.moe_layers[0], :] = routing[1, self.moe_layers[0], 0]
            if b.corrupt == "rows":
                routing = np.concatenate([routing, routing[-1:]])
            if b.corrupt in ("dup", "rows", "zero"):
                meta.update(_unchecked_fields(routing, self.num_experts, start))
            else:
                meta.update(self.sent_fields(routing, expected_rows(len(prompt), len(out), start), start))
            if b.corrupt == "rows":
                meta["routed_experts_shape"][0] -= 1  # claim the expected count, send one more row
            if b.corrupt == "missing":
                del meta["routed_experts"]
        return {"text": "x" * len(out), "output_ids": out, "meta_info": meta}

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/rr/info")
        async def rr_info() -> JSONResponse:
            self.behaviour.info_calls += 1
            if self.behaviour.info_status != 200:
                return JSONResponse({"detail": "Not Found"}, status_code=self.behaviour.info_status)
            info = self.info()
            if self.behaviour.corrupt == "bad_info":
                info["wire_dtype"] = "int32"
            return JSONResponse(info)

        @app.post("/generate")
        async def generate(request: Request) -> JSONResponse:
            b = self.behaviour
            b.calls += 1
            b.in_flight += 1
            b.max_in_flight = max(b.max_in_flight, b.in_flight)
            try:
                body = await request.json()
                b.bodies.append(body)
                if b.delay:
                    await asyncio.sleep(b.delay)
                if b.fail_5xx > 0:
                    b.fail_5xx -= 1
                    return JSONResponse({"message": "engine overloaded"}, status_code=503)
                if b.reject_status:
                    return JSONResponse({"error": "Unauthorized"}, status_code=b.reject_status)
                params, n, want, start = generate_ask(body)
                if int(params.get("max_new_tokens", 4)) < 0:
                    return JSONResponse({"message": "max_new_tokens must be >= 0"}, status_code=400)
                if "text" in body:
                    prompts = [list(t.encode()) for t in body["text"]]
                else:
                    prompts = body["input_ids"]
                out = [self._sample(p, j, params, want, start) for p in prompts for j in range(n)]
                if b.corrupt == "count":
                    out = out[:-1]
                return JSONResponse(out)
            finally:
                b.in_flight -= 1

        return app


__all__ = ["LogprobTestServer", "ProtocolTestServer", "generate_ask", "synthetic_routing"]


class LogprobTestServer(ProtocolTestServer):
    """TEST-ONLY: the protocol server with a made-up sampling log-prob (-1.0) per generated token, as TRL's RRRollout
    asks for."""

    def _sample(self, prompt: list[int], j: int, params: dict[str, Any], want: bool, start: int) -> dict[str, Any]:
        out = super()._sample(prompt, j, params, want, start)
        out["meta_info"]["output_token_logprobs"] = [[-1.0, t, None] for t in out["output_ids"]]
        return out
