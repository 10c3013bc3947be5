"""One SGLang P/D server for tests/sglang/test_pd.py, in its own process (SGLang's HTTP app is one per process):
SGLang's real TokenizerManager, DetokenizerManager and ``/generate`` app started with ``--disaggregation-mode
prefill|decode`` (prefill: the Mooncake backend's real bootstrap server on ``bootstrap_port``; decode: the ``fake``
transfer backend), rr's patch applied as the launcher does, the stand-in scheduler in the given P/D role answering
every request that reaches it (tests/sglang/standin.py says what its roles do), served by uvicorn on ``port``; two
test-only routes: ``POST /test/lose_rows`` makes the stand-in lose captured rows, ``POST /test/cached_tokens`` makes
it report prefix-cache hits. ``--unpatched``: SGLang as it ships (no rr patch; what rr's P/D sidecar stands in front
of).

    python -m tests.sglang.pd_server ROLE PORT MODEL_DIR BOOTSTRAP_PORT [WEIGHT_VERSION] [--unpatched] [--name=NAME]
        [--admin-key=KEY]

``--name``: SGLang's ``--served-model-name`` (what ``/rr/info`` calls the model). ``--admin-key``: SGLang's
``--admin-api-key``, installed with SGLang's own ``add_api_key_middleware`` as its launch does (its weight routes then
need the key; ``/generate`` does not). ROLE ``null``: a plain server (no
P/D; BOOTSTRAP_PORT unused) over real HTTP, for a client on another event loop (TRL's rollout), whose stand-in also
reports the sampled tokens' log-probs from a transformers forward. A DeepSeek-V3.2 checkpoint gets an H100's compute
capability, the one GPU fact SGLang's ServerArgs reads for a DSA model (as tests/sglang/test_indexer_sglang.py).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rr_server.launch.process import free_port, wait_healthy

REPO = Path(__file__).resolve().parents[2]


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


async def main(
    role: str,
    port: int,
    model_dir: str,
    bootstrap_port: int,
    weight_version: str | None,
    patched: bool = True,
    name: str | None = None,
    admin_key: str | None = None,
) -> None:
    import uvicorn

    from rr_patches.sglang.apply import apply
    from tests.sglang.deepseek_v32 import is_deepseek_v32
    from tests.sglang.harness import Harness

    if patched:
        apply()
    if is_deepseek_v32(Path(model_dir)):
        import torch

        torch.cuda.get_device_capability = lambda *_a, **_k: (9, 0)  # type: ignore[assignment]
    extra: dict[str, Any] = {"weight_version": weight_version} if weight_version else {}
    if name:
        extra["served_model_name"] = name
    if role != "null":
        extra.update(
            disaggregation_mode=role,
            disaggregation_transfer_backend="mooncake" if role == "prefill" else "fake",
            disaggregation_bootstrap_port=bootstrap_port,
        )
    h = Harness(Path(model_dir), host="127.0.0.1", port=port, **extra)  # port: the URL its routing refs name
    h.sched.pd_role = None if role == "null" else role
    h.sched.sampling_logprobs = role == "null"
    h.tm.event_loop = asyncio.get_running_loop()
    from sglang.srt.managers.tokenizer_manager import ServerStatus  # what SGLang's launch sets after its warmup

    h.tm.server_status = ServerStatus.Up

    @h.http.app.post("/test/lose_rows")
    async def lose_rows(body: dict) -> dict:  # type: ignore[type-arg]
        """Test-only: the stand-in loses the captured rows from ``start`` on (SGLang #23885's all-zero prefill rows);
        ``start`` null: none lost."""
        start = body.get("start")
        h.sched.zero_rows = None if start is None else slice(int(start), None)
        return {"ok": True}

    @h.http.app.post("/test/cached_tokens")
    async def cached_tokens(body: dict) -> dict:  # type: ignore[type-arg]
        """Test-only: the stand-in reports ``cached`` prompt tokens served from the radix cache for every request
        (SGLang's ``cached_tokens``); 0: none."""
        n = int(body.get("cached") or 0)
        h.sched.reports = (lambda r: {"cached_tokens": n}) if n else None
        return {"ok": True}

    if admin_key:
        from sglang.srt.utils.auth import add_api_key_middleware

        add_api_key_middleware(h.http.app, api_key=None, admin_api_key=admin_key)
    answering = asyncio.ensure_future(_answer(h))
    config = uvicorn.Config(h.http.app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    try:
        await uvicorn.Server(config).serve()
    finally:
        answering.cancel()


class PDServer:
    """tests/sglang/pd_server.py in a subprocess, on a free port."""

    def __init__(
        self,
        role: str,
        model_dir: Path,
        bootstrap_port: int,
        weight_version: str | None = None,
        patched: bool = True,
        name: str | None = None,
        admin_key: str | None = None,
    ) -> None:
        self.role, self.port, self.bootstrap_port = role, free_port(), bootstrap_port
        self.log_path = Path(tempfile.gettempdir()) / f"rr-pd-{role}-{self.port}.log"
        args = [
            sys.executable,
            "-m",
            "tests.sglang.pd_server",
            role,
            str(self.port),
            str(model_dir),
            str(bootstrap_port),
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    *args,
                    *([weight_version] if weight_version else []),
                    *([] if patched else ["--unpatched"]),
                    *([f"--name={name}"] if name else []),
                    *([f"--admin-key={admin_key}"] if admin_key else []),
                ],
                cwd=REPO,
                env={
                    **os.environ,
                    "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                    # /health answers from the server's status, without a generation through the stand-in
                    "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0",
                },
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait(self, timeout: float = 120.0) -> None:
        """Until its ``/health`` answers 200 (it reports Up, as SGLang's launch does after warmup): rr's own wait,
        a :class:`ServerStartError` with the log's tail if it exits or times out."""
        wait_healthy(self.url, self.proc, self.log_path, timeout)  # type: ignore[arg-type]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


if __name__ == "__main__":
    argv = [a for a in sys.argv[1:] if not a.startswith("--")]
    opts = {a[2:].partition("=")[0]: a.partition("=")[2] for a in sys.argv[1:] if a.startswith("--") and "=" in a}
    role, port, model_dir, bootstrap = argv[0], int(argv[1]), argv[2], int(argv[3])
    version = argv[4] if len(argv) > 4 else None
    patched = "--unpatched" not in sys.argv
    asyncio.run(
        main(role, port, model_dir, bootstrap, version, patched, name=opts.get("name"), admin_key=opts.get("admin-key"))
    )
