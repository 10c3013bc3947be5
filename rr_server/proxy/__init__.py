"""rr sidecar: the rr ``/generate`` protocol in front of an unpatched SGLang or vLLM server.

``rr-server proxy --upstream URL --engine sglang|vllm`` dispatches to :func:`main`. The app
(FastAPI, httpx) is imported only when the sidecar starts, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rr_server.proxy.app import ProxyConfig, create_app

__all__ = ["main", "create_app", "ProxyConfig", "build_parser", "KEEP_ALIVE_S"]

KEEP_ALIVE_S = 75


def __getattr__(name: str) -> Any:
    """``create_app`` and ``ProxyConfig`` load the app module on first use."""
    if name in ("create_app", "ProxyConfig"):
        from rr_server.proxy import app

        return getattr(app, name)
    raise AttributeError(f"module 'rr_server.proxy' has no attribute {name!r}")


def build_parser() -> argparse.ArgumentParser:
    """Command-line options of ``rr-server proxy``."""
    p = argparse.ArgumentParser(prog="rr-server proxy", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--upstream", required=True, help="base URL of the engine, e.g. http://127.0.0.1:30000")
    p.add_argument("--engine", required=True, choices=("vllm", "sglang"))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--max-concurrency", type=int, default=64, help="upstream calls in flight at most")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream call")
    p.add_argument("--model-path", default=None, help="checkpoint dir with config.json (default: ask the upstream)")
    p.add_argument("--log-level", default="warning")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sidecar under uvicorn until interrupted."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.max_concurrency < 1 or args.timeout <= 0:
        sys.stderr.write("rr-server proxy: --max-concurrency must be >= 1 and --timeout > 0\n")
        return 2
    import uvicorn

    from rr_server.proxy.app import ProxyConfig, create_app

    cfg = ProxyConfig(upstream=args.upstream, engine=args.engine, max_concurrency=args.max_concurrency,
                      timeout=args.timeout, model_path=args.model_path)
    # keep-alive well above clients' idle expiry (httpx: 5 s), so the client always closes first
    uvicorn.run(create_app(cfg), host=args.host, port=args.port, log_level=args.log_level,
                timeout_keep_alive=KEEP_ALIVE_S)
    return 0
