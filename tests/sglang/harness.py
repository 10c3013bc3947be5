"""SGLang's real TokenizerManager, DetokenizerManager and /generate app, on CPU, wired to the stand-in scheduler."""

from __future__ import annotations

import asyncio
import inspect
import json
from pathlib import Path
from typing import Any

import httpx

from rr_server.serving.engines.sglang import profile_for
from tests.sglang.standin import StandInScheduler, wire

_LIVE: list[Harness] = []


def close_all() -> None:
    """Close every harness built so far (their zmq contexts block at garbage collection otherwise)."""
    while _LIVE:
        _LIVE.pop().close()


def _zmq_contexts(obj: Any) -> set[Any]:
    """zmq contexts behind the sockets held by ``obj`` (directly or in one wrapper level)."""
    import zmq

    found: set[Any] = set()
    for val in vars(obj).values():
        for cand in (val, getattr(val, "socket", None), getattr(val, "_socket", None)):
            if isinstance(cand, zmq.Socket):
                found.add(cand.context)
    return found


def _fresh_app(app: Any) -> None:
    """SGLang's module-level app as a fresh server process has it: no rr middleware, stack not built yet.

    The app is one object for the whole test session; a patched TokenizerManager adds rr's middlewares
    to it (before the first request, as in production), an unpatched one must not inherit them.
    """
    app.user_middleware[:] = [
        m for m in app.user_middleware if not getattr(m.cls, "__module__", "").startswith(("rr_patches.", "rr_server."))
    ]
    app.state.rr_openai_routing = False
    app.middleware_stack = None


class Harness:
    """One TokenizerManager (constructed exactly as SGLang's launcher does) without a scheduler process."""

    def __init__(self, model_dir: Path, *, skip_tokenizer_init: bool = False, **server_kwargs: Any) -> None:
        from sglang.srt.entrypoints import http_server
        from sglang.srt.managers.tokenizer_manager import TokenizerManager
        from sglang.srt.server_args import PortArgs, ServerArgs

        self.profile = profile_for()
        self.skip = skip_tokenizer_init
        self.server_args = ServerArgs(
            model_path=str(model_dir),
            enable_return_routed_experts=True,
            device="cpu",
            skip_tokenizer_init=skip_tokenizer_init,
            **server_kwargs,
        )
        self.port_args = PortArgs.init_new(self.server_args)  # fresh ipc:// names; nothing binds them
        try:  # 0.5.23+: the process entry publishes the config the managers read (as http_server does)
            from sglang.srt.runtime_context import publish
        except ImportError:
            publish = None
        if publish is not None:
            publish(self.server_args, role="tokenizer")
        _fresh_app(http_server.app)
        self.tm = TokenizerManager(self.server_args, self.port_args)
        self.tm.max_req_input_len = 1024  # the launcher copies this from the scheduler's info
        self.detok = None
        if not skip_tokenizer_init:
            from sglang.srt.managers.detokenizer_manager import DetokenizerManager

            self.detok = DetokenizerManager(self.server_args, self.port_args)
        self.sched = StandInScheduler(model_dir, self.profile.release, self.profile.field)
        self._redirect_to_standin()
        self.sched.reply = self._reply
        self.http = http_server
        state_cls = http_server._GlobalState
        fields = set(getattr(state_cls, "__dataclass_fields__", {}))
        kwargs: dict[str, Any] = {"tokenizer_manager": self.tm}
        if "template_manager" in fields:
            kwargs["template_manager"] = None
        if "scheduler_info" in fields:
            kwargs["scheduler_info"] = {}
        http_server.set_global_state(state_cls(**kwargs))
        _LIVE.append(self)

    def _redirect_to_standin(self) -> None:
        """Everything the TokenizerManager sends to the scheduler goes to the stand-in instead.

        Requests use ``send_to_scheduler``; the control-plane communicators (``/get_server_info``'s
        internal-state query, ...) keep the socket they were built with on 0.5.7-0.5.12 (0.5.23 looks
        ``send_to_scheduler`` up on every call).
        """
        original = self.tm.send_to_scheduler
        self.tm.send_to_scheduler = self.sched
        for value in vars(self.tm).values():
            if getattr(value, "_sender", None) is original:
                value._sender = self.sched

    def _reply(self, out: Any) -> None:
        """A scheduler control reply, across the process boundary, into the TokenizerManager's dispatcher."""
        self.tm._result_dispatcher(wire(out))

    def close(self) -> None:
        """Destroy the TokenizerManager's and detokenizer's zmq contexts (linger 0)."""
        for obj in (self.tm, self.detok):
            if obj is not None:
                for ctx in _zmq_contexts(obj):
                    ctx.destroy(linger=0)

    async def deliver(self, batch_token_id_out: Any) -> Any:
        """Scheduler -> (real detokenizer unless skip_tokenizer_init) -> wire -> ``_handle_batch_output``."""
        out = batch_token_id_out
        if self.detok is not None:
            out = self.detok.handle_batch_token_id_out(wire(out))
        out = wire(out)
        result = self.tm._handle_batch_output(out)
        if inspect.isawaitable(result):
            await result
        return out

    async def _wait_for(self, n: int, call: Any = None, timeout: float = 30.0) -> list[str]:
        """Rids of the first ``n`` requests the scheduler stand-in received (fails fast if the call ended)."""
        for _ in range(int(timeout / 0.01)):
            if len(self.sched.arrivals) >= n:
                return self.sched.arrivals[:n]
            if call is not None and call.done():
                resp = call.result()
                raise AssertionError(
                    f"/generate answered {resp.status_code} before reaching the scheduler: {resp.text}"
                )
            await asyncio.sleep(0.01)
        raise TimeoutError(f"only {len(self.sched.arrivals)} of {n} requests reached the scheduler")

    async def wait_listening(self, rids: list[str], timeout: float = 5.0) -> None:
        """Wait until the TokenizerManager's coroutine of every rid waits for its answer. SGLang's batch path
        creates them after the last send and starts them only when it gathers them; an answer delivered before
        that (possible on a loaded machine) deletes the request's state first (``KeyError`` in
        ``_wait_one_response``), which a real scheduler, answering after a forward, never does this fast."""
        for _ in range(int(timeout / 0.005)):
            states = [self.tm.rid_to_state.get(r) for r in rids]
            if all(s is not None and getattr(getattr(s, "event", None), "_waiters", True) for s in states):
                return
            await asyncio.sleep(0.005)

    async def _drained(self, rids: list[str], timeout: float = 10.0) -> None:
        """Let the request coroutines read their chunk before the next one (streaming reads only the last)."""
        for _ in range(int(timeout / 0.005)):
            states = [self.tm.rid_to_state.get(r) for r in rids]
            if all(s is None or not s.out_list for s in states):
                return
            await asyncio.sleep(0.005)

    def enable_openai(self) -> None:
        """What SGLang's lifespan does for ``/v1/completions`` and ``/v1/chat/completions``: templates + serving handlers."""
        try:
            from sglang.srt.managers.template_manager import TemplateManager
        except ImportError:  # 0.5.23 moved it
            from sglang.srt.parser.template_manager import TemplateManager
        from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion

        templates = TemplateManager()
        templates.initialize_templates(
            tokenizer_manager=self.tm,
            model_path=self.server_args.model_path,
            chat_template=self.server_args.chat_template,
            completion_template=self.server_args.completion_template,
        )
        chat_cls = getattr(self.tm, "serving_chat_class", None)
        if chat_cls is None:
            from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat as chat_cls
        state = self.http.app.state
        state.openai_serving_completion = OpenAIServingCompletion(self.tm, templates)
        state.openai_serving_chat = chat_cls(self.tm, templates)

    async def serve(
        self, path: str, body: dict[str, Any], timeout: float = 60.0, via: httpx.AsyncClient | None = None
    ) -> httpx.Response:
        """POST ``body`` to ``path`` of SGLang's app; every request that reaches the stand-in is finished in one step.

        Requests are answered in the batches they arrive in, until the HTTP call is done (so ``n > 1``,
        whose prefix-caching request must finish before the samples are sent, works too).
        """
        self.tm.event_loop = asyncio.get_running_loop()
        self.sched.arrivals.clear()
        async with via or self.client() as client:  # via: e.g. the sidecar's app in front of this one
            call = asyncio.ensure_future(client.post(path, json=body, timeout=timeout))
            done = 0
            for _ in range(int(timeout / 0.01)):
                if call.done():
                    break
                await asyncio.sleep(0.01)
                if len(self.sched.arrivals) > done:
                    await asyncio.sleep(0.02)  # let the rest of a batch arrive
                    new = self.sched.arrivals[done:]
                    done += len(new)
                    await self.wait_listening(new)  # answered before SGLang waits for it: KeyError (see wait_listening)
                    await self.deliver(self.sched.step(new))
            return await call

    def client(self) -> httpx.AsyncClient:
        """An HTTP client on SGLang's own FastAPI app (in process, through ASGI)."""
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.http.app), base_url="http://sglang")

    async def post(
        self,
        body: dict[str, Any],
        *,
        n_requests: int = 1,
        chunks: int = 1,
        batches: list[list[int]] | None = None,
        via: httpx.AsyncClient | None = None,
    ) -> tuple[int, Any]:
        """POST /generate through SGLang's own app; the stand-in answers in ``chunks`` steps.

        ``batches`` groups request indices (arrival order) into scheduler batches (default: one batch).
        ``via``: a client on something in front of SGLang's app (the rr sidecar) instead of the app itself.
        Returns (status, JSON body) or, for ``stream``, (status, list of SSE data objects).
        """
        self.tm.event_loop = asyncio.get_running_loop()  # no handle_loop: the stand-in feeds outputs
        self.sched.arrivals.clear()
        async with via or self.client() as client:
            call = asyncio.ensure_future(client.post("/generate", json=body, timeout=60))
            try:
                rids = await self._wait_for(n_requests, call)
                await self.wait_listening(rids)
            except BaseException:
                call.cancel()
                raise
            groups = batches or [list(range(n_requests))]
            for k in range(chunks):
                last = k == chunks - 1
                for g in groups:
                    sel = [rids[i] for i in g]
                    per = max(len(self.sched.reqs[sel[0]].completion) // chunks, 1)
                    await self.deliver(self.sched.step(sel, tokens=None if last else per))
                    await self._drained(sel)
            resp = await call
        if body.get("stream"):
            events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
            return resp.status_code, [json.loads(e) for e in events if e != "[DONE]"]
        return resp.status_code, resp.json()
