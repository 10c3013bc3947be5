"""Scale out through ``RoutedExpertsClient``: 1 vs 2 real vLLM CPU replicas (same run), and the client's own cost.

Two parts, one table:
  1. Rollout throughput (generated tokens/s, routing returned and fully checked) through the client over
     one replica, then over both, in alternating rounds on the same two servers (each bound to its own
     core); the ratio 2-replica / 1-replica.
  2. The client's own overhead per request at ``--requests`` (1,000) requests against a trivial local
     server (the TEST-ONLY protocol server, in its own process, synthetic routing): wall and client-process
     CPU per request through ``RoutedExpertsClient`` (pool choice, JSON, routing decode + checks) minus a
     bare httpx loop posting the same bodies, sequential and at 16 in flight, over 1 and 2 replicas.

``python benchmarks/scale_out.py [--rounds 2] [--gen-requests 64] [--max-new 16] [--requests 1000] [--skip-real]``

Limits: on a 2-core machine the two CPU replicas, the client and the OS share two cores, so the
throughput ratio is bounded well below 2 and mostly shows that the client spreads load and keeps both
busy; it says nothing about GPU replicas, where the engines do not compete with each other or the
client for cores. The overhead numbers are the client's CPU per request, which is what scales with
replica count in a real deployment.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rr_client import RoutedExpertsClient  # noqa: E402
from rr_server.launch.process import free_port, stop_process_group, wait_healthy  # noqa: E402

# ------------------------------------------------------------------------------ trivial local server


def serve_trivial(port: int) -> None:  # pragma: no cover - runs in a child process
    """The TEST-ONLY protocol server on ``port`` until killed (synthetic routing, /health added)."""
    import uvicorn

    from tests.support.protocol_server import ProtocolTestServer

    srv = ProtocolTestServer(layers=4, topk=4, num_experts=32)

    @srv.app.get("/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}

    uvicorn.run(srv.app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")


def start_trivial(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    with open(log, "ab") as fh:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--serve-trivial", str(port)],
            stdout=fh,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, log, 60)
    return proc, url


def prompts_for(k: int, length: int = 16, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(2, 400, size=length)] for _ in range(k)]


async def bare_loop(urls: list[str], prompts: list[list[int]], params: dict[str, Any], concurrency: int) -> None:
    """The same /generate bodies through plain httpx (round robin), JSON-decoded, nothing checked."""
    clients = [httpx.AsyncClient(base_url=u, timeout=60) for u in urls]
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        body = orjson.dumps({"input_ids": [prompts[i]], "sampling_params": params, "return_routed_experts": True})
        async with sem:
            r = await clients[i % len(clients)].post(
                "/generate", content=body, headers={"content-type": "application/json"}
            )
        orjson.loads(r.content)

    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    for c in clients:
        await c.aclose()


async def client_loop(urls: list[str], prompts: list[list[int]], params: dict[str, Any], concurrency: int) -> None:
    async with RoutedExpertsClient(urls, batch_size=1, max_concurrency=concurrency) as c:
        await c.info()
        batch = await c.generate(prompts, params)
        assert len(batch) == len(prompts)


def timed(fn: Any, *args: Any) -> tuple[float, float]:
    """(wall s, this process's CPU s) of ``asyncio.run(fn(*args))``."""
    w0, c0 = time.perf_counter(), time.process_time()
    asyncio.run(fn(*args))
    return time.perf_counter() - w0, time.process_time() - c0


def overhead_rows(n: int, log_dir: Path) -> list[tuple[str, str]]:
    procs = [start_trivial(log_dir / f"trivial-{i}.log") for i in range(2)]
    urls = [u for _, u in procs]
    params = {"max_new_tokens": 16}
    prompts = prompts_for(n)
    rows = []
    try:
        for conc in (1, 16):
            for k in (1, 2):
                timed(bare_loop, urls[:k], prompts[:50], params, conc)  # warm up
                timed(client_loop, urls[:k], prompts[:50], params, conc)
                bw, bc = timed(bare_loop, urls[:k], prompts, params, conc)
                cw, cc = timed(client_loop, urls[:k], prompts, params, conc)
                rows.append(
                    (
                        f"client overhead, trivial server, {n} requests, {conc} in flight, {k} replica(s)",
                        f"wall {1e3 * (cw - bw) / n:+.3f} ms/req ({1e3 * cw / n:.3f} vs bare httpx "
                        f"{1e3 * bw / n:.3f}); client CPU {1e3 * (cc - bc) / n:+.3f} ms/req "
                        f"({1e3 * cc / n:.3f} vs {1e3 * bc / n:.3f})",
                    )
                )
    finally:
        for p, _ in procs:
            stop_process_group(p, grace=5)
    return rows


# ------------------------------------------------------------------------------ real replicas


def throughput_rows(rounds: int, requests: int, max_new: int, log_dir: Path) -> list[tuple[str, str]]:
    from _bench import tiny_vllm_replicas

    servers = tiny_vllm_replicas(2, max_model_len=512)
    cores = max(1, os.cpu_count() or 1)
    try:
        for s in servers:
            s.wait_healthy()
        urls = [s.base_url for s in servers]
        params = {"max_new_tokens": max_new, "temperature": 1.0, "ignore_eos": True}
        prompts = prompts_for(requests, length=32, seed=1)

        async def run(k: int) -> tuple[int, float]:
            async with RoutedExpertsClient(urls[:k], batch_size=1, max_concurrency=16, timeout=300) as c:
                await c.info()
                t0 = time.perf_counter()
                batch = await c.generate(prompts, params)
                dt = time.perf_counter() - t0
                assert all(r.routed_experts is not None for r in batch)
                return sum(len(r.output_ids) for r in batch), dt

        asyncio.run(run(2))  # warm up both
        tps: dict[int, list[float]] = {1: [], 2: []}
        for _ in range(rounds):
            for k in (1, 2):
                toks, dt = asyncio.run(run(k))
                tps[k].append(toks / dt)
        one, two = float(np.median(tps[1])), float(np.median(tps[2]))
        return [
            ("rollout throughput, 1 replica (client)", f"{one:.1f} gen tok/s (median of {rounds})"),
            ("rollout throughput, 2 replicas (client)", f"{two:.1f} gen tok/s (median of {rounds})"),
            (
                "ratio 2 / 1 replicas",
                f"{two / one:.2f}x ({requests} requests x {max_new} tokens, 16 in flight, {cores} cores)",
            ),
        ]
    finally:
        for s in servers:
            s.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gen-requests", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--skip-real", action="store_true", help="only the trivial-server overhead")
    ap.add_argument("--serve-trivial", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve_trivial:
        serve_trivial(a.serve_trivial)
        return
    log_dir = REPO / ".cache" / "bench-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    if not a.skip_real:
        rows += throughput_rows(a.rounds, a.gen_requests, a.max_new, log_dir)
    rows += overhead_rows(a.requests, log_dir)
    print("| measurement | result |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")
    print(f"\nmachine: {os.cpu_count()} cores; two CPU replicas + the client share them (see the docstring's limits)")


if __name__ == "__main__":
    main()
