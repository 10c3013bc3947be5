"""One SGLang P/D server for tests/sglang/test_pd.py, in its own process (SGLang's HTTP app is one per process):
SGLang's real TokenizerManager, DetokenizerManager and ``/generate`` app started with ``--disaggregation-mode
prefill|decode`` (prefill: the Mooncake backend's real bootstrap server on ``bootstrap_port``; decode: the ``fake``
transfer backend), rr's patch applied as the launcher does, the stand-in scheduler in the given P/D role answering
every request that reaches it (tests/sglang/standin.py says what its roles do), served by uvicorn on ``port``; one
test-only route, ``POST /test/lose_rows``, makes the stand-in lose captured rows.

    python -m tests.sglang.pd_server ROLE PORT MODEL_DIR BOOTSTRAP_PORT [WEIGHT_VERSION]
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path


async def _answer(h: object) -> None:
    """Finish every request that reaches the stand-in, in the batches it arrives in."""
    done = 0
    while True:
        await asyncio.sleep(0.01)
        arrivals = h.sched.arrivals  # type: ignore[attr-defined]
        if len(arrivals) > done:
            await asyncio.sleep(0.02)  # let the rest of a batch arrive
            new = arrivals[done:]
            done += len(new)
            await h.wait_listening(new)  # type: ignore[attr-defined]
            await h.deliver(h.sched.step(new))  # type: ignore[attr-defined]


async def main(role: str, port: int, model_dir: str, bootstrap_port: int, weight_version: str | None) -> None:
    import uvicorn

    from rr_patches.sglang.apply import apply
    from tests.sglang.harness import Harness

    apply()
    extra = {"weight_version": weight_version} if weight_version else {}
    h = Harness(
        Path(model_dir),
        disaggregation_mode=role,
        disaggregation_transfer_backend="mooncake" if role == "prefill" else "fake",
        disaggregation_bootstrap_port=bootstrap_port,
        host="127.0.0.1",
        port=port,  # the URL its routing refs name
        **extra,
    )
    h.sched.pd_role = role
    h.tm.event_loop = asyncio.get_running_loop()

    @h.http.app.post("/test/lose_rows")
    async def lose_rows(body: dict) -> dict:  # type: ignore[type-arg]
        """Test-only: the stand-in loses the captured rows from ``start`` on (SGLang #23885's all-zero prefill rows);
        ``start`` null: none lost."""
        start = body.get("start")
        h.sched.zero_rows = None if start is None else slice(int(start), None)
        return {"ok": True}

    answering = asyncio.ensure_future(_answer(h))
    config = uvicorn.Config(h.http.app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    try:
        await uvicorn.Server(config).serve()
    finally:
        answering.cancel()


if __name__ == "__main__":
    role, port, model_dir, bootstrap = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    asyncio.run(main(role, port, model_dir, bootstrap, sys.argv[5] if len(sys.argv) > 5 else None))
