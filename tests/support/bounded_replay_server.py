"""BoundedReplayTestServer: the TEST-ONLY protocol server as a vLLM 0.33 or SGLang 0.5.23 serving a model that says it
is DeepSeek-V4.1 (or not), with SWA bounded replay on or off, for the doctor's ``bounded replay`` check
(tests/http/test_doctor_bounded_replay.py).

Not an engine and proof of nothing about vLLM or SGLang: it reports bounded replay where each engine does (vLLM
``/metrics`` ``vllm:cache_config_info`` label ``swa_bounded_replay``; SGLang ``/get_server_info``
``enable_decoder_swa_bounded_replay`` and ``/model_info`` ``model_type``) and, with ``replays``, answers what
bounded replay does to routing: in a prompt longer than ``window`` tokens, the late layers never ran the positions
before the trailing window, so their rows there are stale (another token's, well-formed). A request for prompt
log-probs (vLLM ``prompt_logprobs`` on ``/v1/completions``, SGLang ``/generate`` ``logprob_start_len`` 0) is a full
prefill with every row exact, as both engines serve it. ``/rr/info`` ``model`` is a folder whose ``config.json``
holds ``model_type``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse

from rr_client.core.codec import expected_rows
from tests.support.protocol_server import ProtocolTestServer, generate_ask

__all__ = ["BoundedReplayTestServer"]

VERSIONS = {"vllm": "0.33.0", "sglang": "0.5.23"}


class BoundedReplayTestServer(ProtocolTestServer):
    """``engine`` vllm|sglang; ``said``: what the server reports (True on, False off, None: nothing);
    ``replays``: whether its answers show bounded replay; ``model_type`` of the served model."""

    def __init__(
        self,
        engine: str,
        *,
        said: bool | None,
        replays: bool,
        model_type: str = "deepseek_v41",
        window: int = 64,
        model_folder: bool = True,
    ) -> None:
        """``model_folder``: ``/rr/info`` ``model`` is the folder with ``config.json`` (else a bare name, so the
        doctor must ask SGLang's ``/model_info``)."""
        self.engine, self.said, self.replays, self.window = engine, said, replays, window
        self._dir = tempfile.TemporaryDirectory(prefix="rr-bounded-replay-model-")
        self.model_dir = Path(self._dir.name)
        (self.model_dir / "config.json").write_text(json.dumps({"model_type": model_type}))
        self.model_type = model_type
        self.full_prefills = 0
        super().__init__(layers=3, topk=2, num_experts=8, moe_layers=[0, 2])
        self.behaviour.identity.update(
            engine=engine,
            engine_version=VERSIONS[engine],
            platform="cuda",
            model=str(self.model_dir) if model_folder else "served-model",
        )
        self._add_routes()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._dir.cleanup()

    def rows(self, prompt: list[int], out: list[int], start: int, full: bool) -> dict[str, Any]:
        """Routing fields of one sample: exact on a full prefill (or without replay), else stale late-layer rows
        before the prompt's trailing window."""
        tokens = (prompt + out)[start:-1]
        routing = self.routing_of(tokens)
        cut = len(prompt) - self.window - start
        if self.replays and not full and cut > 0:
            late = self.moe_layers[len(self.moe_layers) // 2 :]
            routing[:cut, late] = self.routing_of([t + 1 for t in tokens])[:cut, late]
        return self.sent_fields(routing, expected_rows(len(prompt), len(out), start), start)

    def _item(self, prompt: list[int], j: int, params: dict[str, Any], start: int, full: bool) -> dict[str, Any]:
        item = self._sample(prompt, j, params, False, start)
        item["meta_info"].update(self.rows(prompt, item["output_ids"], start, full))
        return item

    def _add_routes(self) -> None:
        app = self.app

        async def generate(request: Request) -> JSONResponse:
            body = await request.json()
            params, n, want, start = generate_ask(body)
            full = self.engine == "sglang" and bool(body.get("return_logprob")) and body.get("logprob_start_len") == 0
            self.full_prefills += full
            out = [
                self._item(p, j, params, start, full) if want else self._sample(p, j, params, False, start)
                for p in body["input_ids"]
                for j in range(n)
            ]
            return JSONResponse(out)

        async def completions(request: Request) -> JSONResponse:
            body = await request.json()
            prompt = body["prompt"]
            full = body.get("prompt_logprobs") is not None
            self.full_prefills += full
            item = self._item(prompt, 0, {"max_new_tokens": int(body.get("max_tokens", 4))}, 0, full)
            meta = item["meta_info"]
            choice = {
                "index": 0,
                "text": item["text"],
                "token_ids": item["output_ids"],
                "prompt_token_ids": prompt,
                "finish_reason": "length",
                **{k: v for k, v in meta.items() if k.startswith("routed_experts")},
            }
            if full:
                choice["prompt_logprobs"] = [None] + [{str(t): {"logprob": -1.0}} for t in prompt[1:]]
            usage = {"prompt_tokens": len(prompt), "completion_tokens": len(item["output_ids"])}
            return JSONResponse({"id": "cmpl-0", "choices": [choice], "usage": usage})

        async def metrics() -> PlainTextResponse:
            label = f'swa_bounded_replay="{self.said}"'
            return PlainTextResponse(f'vllm:cache_config_info{{block_size="16",engine="0",{label}}} 1.0\n')

        async def server_info() -> JSONResponse:
            decoder = self.said if self.model_type == "deepseek_v41" else None
            return JSONResponse(
                {"enable_decoder_swa_bounded_replay": decoder, "enable_encoder_swa_bounded_replay": False}
            )

        async def model_info() -> JSONResponse:
            return JSONResponse({"model_type": self.model_type, "architectures": ["X"]})

        routes: list[tuple[str, Any, list[str]]] = [("/generate", generate, ["POST"])]
        if self.engine == "vllm":
            routes.append(("/v1/completions", completions, ["POST"]))
        if self.engine == "vllm" and self.said is not None:
            routes.append(("/metrics", metrics, ["GET"]))
        elif self.engine == "sglang" and self.said is not None:
            routes += [("/get_server_info", server_info, ["GET"]), ("/model_info", model_info, ["GET"])]
        for path, fn, methods in routes:
            app.add_api_route(path, fn, methods=methods)
            app.router.routes.insert(0, app.router.routes.pop())  # before the base app's /generate
