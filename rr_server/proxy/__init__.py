"""rr sidecar: the rr ``/generate`` protocol in front of an unpatched SGLang or vLLM server.

``rr-server proxy --upstream URL --engine sglang|vllm`` dispatches to :func:`main`. The app
(FastAPI, httpx) is imported only when the sidecar starts, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rr_client.core import settings
from rr_client.core.engines import ENGINE_NAMES
from rr_server.serving.command_line import CommandParser

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
    p = CommandParser(prog="rr-server proxy", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--upstream", required=True, help="base URL of the engine, e.g. http://127.0.0.1:30000")
    p.add_argument("--engine", required=True, choices=ENGINE_NAMES)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--max-concurrency", type=int, default=64, help="upstream calls in flight at most")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream call")
    p.add_argument("--model-path", default=None, help="checkpoint dir with config.json (default: ask the upstream)")
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="clients must send 'Authorization: Bearer KEY' (repeatable; also env RR_API_KEY); /health stays open",
    )
    p.add_argument(
        "--upstream-api-key",
        default=None,
        metavar="KEY",
        help="key sent to the engine (its --api-key); also env RR_UPSTREAM_API_KEY",
    )
    p.add_argument(
        "--metrics-require-key", action="store_true", help="close /metrics behind --api-key too (open by default)"
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="refuse larger request bodies with 413 before parsing (default 64 MiB)",
    )
    p.add_argument(
        "--routed-experts-format",
        choices=("npy", "sglang", "ref"),
        default=None,
        help="routing format for requests that do not say (default npy, rr's; sglang = SGLang's "
        "headerless int32 for clients that decode it themselves; ref = a RoutingRef, rows kept "
        "here); env RR_ROUTED_EXPERTS_FORMAT",
    )
    p.add_argument(
        "--advertise-url",
        default=None,
        help="the URL routing refs name for reading their rows (default: http://HOST:PORT; env RR_ADVERTISE_URL)",
    )
    p.add_argument(
        "--upstream-logprobs-mode",
        choices=("processed", "raw"),
        default=None,
        help="what the upstream's sampled log-probs mean, stated in /rr/info: processed = after "
        "temperature (vLLM --logprobs-mode processed_logprobs; SGLang's default), raw = before "
        "(vLLM's default raw_logprobs; SGLang with SGLANG_RETURN_ORIGINAL_LOGPROB=1). Default: "
        "unknown for vLLM (trainers then refuse temperature != 1), processed for SGLang",
    )
    p.add_argument(
        "--prefill-upstream",
        default=None,
        metavar="URL",
        help="P/D (SGLang): the prefill server; --upstream is then the decode server, each /generate goes to both "
        "and their rows are joined at the seam (docs/scale-out.md)",
    )
    p.add_argument(
        "--bootstrap-port", type=int, default=None, help="P/D: the prefill server's --disaggregation-bootstrap-port"
    )
    p.add_argument(
        "--bootstrap-host", default=None, help="P/D: the prefill server's bootstrap host (default: its URL's)"
    )
    p.add_argument(
        "--weight-updates-via-sidecar",
        action="store_true",
        help="state that every weight update of the engine goes through this sidecar (its weight routes, e.g. "
        "DiskWeightSync given WeightEngine(SIDECAR_URL, ENGINE)); without it an update pushed straight to the engine "
        "is invisible here, so each sample's weight fields in rr_provenance say unknown (null)",
    )
    p.add_argument(
        "--rr-store",
        metavar="URL",
        default=None,
        help="where rows for refs are held (RR_ROUTING_STORE): memory (the default), ray, or an object store URL, "
        "s3://bucket/prefix or file:///shared/path, whose refs outlive the sidecar and the engine "
        "(rr-replay[objects]; credentials from the environment or fsspec's configuration)",
    )
    p.add_argument("--log-level", default="warning")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sidecar under uvicorn until interrupted."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.max_concurrency < 1 or args.timeout <= 0:
        sys.stderr.write("rr-server proxy: --max-concurrency must be >= 1 and --timeout > 0\n")
        return 2
    from rr_server.serving.command_line import port_problem, url_problem

    for name, url in (("--upstream", args.upstream), ("--prefill-upstream", args.prefill_upstream)):
        if url is not None and (why := url_problem(url)):
            sys.stderr.write(f"rr-server proxy: {name} {why}\n")
            return 2
    if why := port_problem(args.port, args.host, args.port, args.host):
        sys.stderr.write(f"rr-server proxy: {why}\n")
        return 2
    import os

    import uvicorn

    from rr_server.proxy.app import DEFAULT_MAX_BODY_BYTES, ProxyConfig, create_app
    from rr_server.serving.auth import keys_from
    from rr_server.serving.engines import RELEASES, releases
    from rr_server.serving.store import advertised_url

    if args.rr_store is not None:
        from rr_server.serving.store.install import STORE_ENV, check_store_setting

        try:
            os.environ[STORE_ENV] = check_store_setting(args.rr_store)  # the sidecar's store (install_store)
        except ValueError as e:
            sys.stderr.write(f"rr-server proxy: {e}\n")
            return 2
    if args.routed_experts_format:
        from rr_server.serving.generate_protocol import FORMAT_ENV

        os.environ[FORMAT_ENV] = args.routed_experts_format
    if args.prefill_upstream and (
        not releases(args.engine).supports_pd_pair or not args.bootstrap_port or args.bootstrap_port < 1
    ):
        pd = " or ".join(f"--engine {name}" for name, rel in RELEASES.items() if rel.supports_pd_pair)
        sys.stderr.write(
            f"rr-server proxy: --prefill-upstream (P/D) needs {pd} and --bootstrap-port (the prefill "
            "server's --disaggregation-bootstrap-port)\n"
        )
        return 2
    max_body = DEFAULT_MAX_BODY_BYTES if args.max_body_bytes is None else args.max_body_bytes
    if max_body < 1:
        sys.stderr.write("rr-server proxy: --max-body-bytes must be >= 1\n")
        return 2
    cfg = ProxyConfig(
        upstream=args.upstream,
        engine=args.engine,
        max_concurrency=args.max_concurrency,
        timeout=args.timeout,
        model_path=args.model_path,
        api_keys=tuple(keys_from(args.api_key, "RR_API_KEY")),
        upstream_api_key=args.upstream_api_key or settings.text("RR_UPSTREAM_API_KEY"),
        metrics_require_key=args.metrics_require_key,
        max_body_bytes=max_body,
        advertise_url=args.advertise_url or advertised_url(args.host, args.port),
        upstream_logprobs_mode=args.upstream_logprobs_mode,
        prefill_upstream=args.prefill_upstream or "",
        bootstrap_port=args.bootstrap_port or 0,
        bootstrap_host=args.bootstrap_host or "",
        weight_updates_via_sidecar=args.weight_updates_via_sidecar,
    )
    import asyncio

    from rr_server.proxy.app import role_refusal

    if why := asyncio.run(role_refusal(cfg)):  # e.g. a P/D server behind a plain sidecar
        sys.stderr.write(f"rr-server proxy: {why}\n")
        return 2
    print(
        f"rr-server proxy: listening on http://{args.host}:{args.port} (rr's /generate, /rr/info, OpenAI endpoints) "
        f"in front of {args.engine} at {args.upstream}; Ctrl-C stops it",
        flush=True,
    )
    # keep-alive well above clients' idle expiry (httpx: 5 s), so the client always closes first
    uvicorn.run(
        create_app(cfg), host=args.host, port=args.port, log_level=args.log_level, timeout_keep_alive=KEEP_ALIVE_S
    )
    return 0
