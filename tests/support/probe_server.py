"""ProbeTestServer: the TEST-ONLY protocol server with a simulated KV cache, preemption and weight version, for the
doctor's probes (tests/http/test_doctor_probes.py).

Not an engine and proof of nothing about vLLM or SGLang (the real-server probes run in tests/vllm/test_doctor.py):
it says it is vLLM 0.31 so the doctor reads its ``/metrics`` (``vllm:cache_config_info``,
``vllm:num_preemptions_total``) and ``/rr/info`` ``weight_version``, and it lets a test plant the faults the
probes exist to catch. A request of ``b`` blocks that arrives while the others in flight hold more than
``blocks - b`` is "preempted" once; ``/collective_rpc`` ``reload_weights`` is an update (version + 1). With
``offload``, a prompt of 256+ tokens (the doctor's prefix prompts) seen before and pushed out by more than the cache's worth of other
tokens comes back from the ``external`` tier.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse

from rr_client.core.provenance import Provenance, tokens_digest
from tests.support.protocol_server import ProtocolTestServer, generate_ask

__all__ = ["ProbeTestServer", "PROBE_FAULTS"]

# faults (any together): drop_preemptions (counted, never reported) | preempted_rows (a preempted request's rows from
# other tokens)
# | no_update_flag (a request across a reload not flagged) | reload_uncounted (weight_version stays)
# | stale_offload (a prefix restored from the offload tier carries another prompt's rows)
PROBE_FAULTS = ("drop_preemptions", "preempted_rows", "no_update_flag", "reload_uncounted", "stale_offload")


class ProbeTestServer(ProtocolTestServer):
    """The TEST-ONLY server: ``blocks`` KV blocks of ``block_size`` tokens; ``faults`` plants :data:`PROBE_FAULTS`."""

    def __init__(self, *, blocks: int = 24, block_size: int = 16, hold: float = 0.1, offload: bool = False) -> None:
        self.blocks, self.block_size, self.hold, self.offload = blocks, block_size, hold, offload
        self.faults: set[str] = set()
        self.used = 0
        self.preemptions_total = 0
        self.version = 0
        self.updates_started = 0
        self.updating = 0
        self.tokens_seen = 0
        self.last_seen: dict[tuple[int, ...], int] = {}
        super().__init__(layers=3, topk=2, num_experts=8, moe_layers=[0, 2])
        self.behaviour.identity.update(engine="vllm", engine_version="0.31.0", platform="cpu")
        self._add_routes()

    def info(self) -> dict[str, Any]:
        return {**super().info(), "weight_version": self.version}

    def _metrics(self) -> str:
        off = "1.0" if self.offload else "None"
        return (
            f'vllm:cache_config_info{{block_size="{self.block_size}",enable_prefix_caching="True",engine="0",'
            f'kv_offloading_backend="native",kv_offloading_size="{off}",num_gpu_blocks="{self.blocks}"}} 1.0\n'
            "# TYPE vllm:num_preemptions_total counter\n"
            f'vllm:num_preemptions_total{{engine="0",model_name="synthetic"}} {float(self.preemptions_total)}\n'
        )

    async def _one(self, prompt: list[int], params: dict[str, Any], want: bool, start: int) -> dict[str, Any]:
        n_new = int(params.get("max_new_tokens", 4))
        need = math.ceil((len(prompt) + n_new) / self.block_size)
        preempted = self.used + need > self.blocks
        self.used += need
        self.preemptions_total += preempted
        admitted, started = self.version, self.updates_started
        try:
            if len(prompt) >= 64:
                await asyncio.sleep(self.hold)
            while self.updating:
                await asyncio.sleep(0.005)
        finally:
            self.used -= need
        key = tuple(prompt)
        restored = (
            self.offload
            and len(prompt) >= 256
            and key in self.last_seen
            and self.tokens_seen - self.last_seen[key] > self.blocks * self.block_size
        )
        self.tokens_seen += len(prompt) + n_new
        self.last_seen[key] = self.tokens_seen
        item = self._sample(prompt, 0, params, want, start)
        meta = item["meta_info"]
        cached = len(prompt) // self.block_size * self.block_size if restored else int(meta["cached_tokens"])
        meta["cached_tokens"] = cached
        bad = ("preempted_rows" in self.faults and preempted) or ("stale_offload" in self.faults and restored)
        if want and bad:  # rows of other tokens, well-formed: only a comparison shows them
            rows = self.routing_of([t + 1 for t in (prompt + item["output_ids"])[start:-1]])
            meta.update(self.sent_fields(rows, len(rows), start))
        finished = self.version
        during = finished != admitted or self.updates_started != started
        if "no_update_flag" in self.faults:
            finished, during = admitted, False
        meta["rr_provenance"] = Provenance(
            cached_tokens=cached,
            cache_tier=("external" if restored else "device") if cached else None,
            preemptions=0 if "drop_preemptions" in self.faults else int(preempted),
            weight_version_admitted=admitted,
            weight_version_finished=finished,
            weight_update_during=during,
            tokens_digest=tokens_digest(prompt, item["output_ids"]),
        ).to_dict()
        return item

    def _add_routes(self) -> None:
        app = self.app

        async def generate(request: Request) -> JSONResponse:
            body = await request.json()
            params, n, want, start = generate_ask(body)
            out = [await self._one(p, params, want, start) for p in body["input_ids"] for _ in range(n)]
            return JSONResponse(out)

        async def metrics() -> PlainTextResponse:
            return PlainTextResponse(self._metrics())

        async def collective_rpc(request: Request) -> JSONResponse:
            body = await request.json()
            if body.get("method") != "reload_weights":
                return JSONResponse({"message": f"unknown method {body.get('method')!r}"}, status_code=400)
            self.updates_started += 1
            self.updating += 1
            try:
                await asyncio.sleep(0.02)
            finally:
                self.updating -= 1
            if "reload_uncounted" not in self.faults:
                self.version += 1
            return JSONResponse({"results": [None]})

        for path, fn, methods in (
            ("/generate", generate, ["POST"]),
            ("/metrics", metrics, ["GET"]),
            ("/collective_rpc", collective_rpc, ["POST"]),
        ):
            app.add_api_route(path, fn, methods=methods)
            app.router.routes.insert(0, app.router.routes.pop())  # before the base app's /generate
