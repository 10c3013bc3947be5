"""Routing store backends side by side: 10,000 samples of Qwen3-30B-A3B's shape (48 MoE layers, top-8, 128 experts,
~2,000 tokens each, uint8) written and read through each backend on this machine, in batches of 256 (a trainer
step's micro-batches): put every sample of a batch (the producer's call, checked rows in, a ref out), resolve the
batch's refs with rr_client (every ref read, checksummed and through the one full check), retire the batch.

Backends: ``memory`` (the in-process store, read through its real read route over httpx's ASGI transport: no TCP),
``ray`` (a local Ray cluster this script starts), ``file`` (a folder on this machine's disk, as a shared mount is
used) and ``s3`` (moto's S3 server on loopback, in this process: an in-memory S3, not a network store).
Measured per backend: bytes stored per token, write and read throughput (samples/s and MB/s of rows), the median
time to resolve a 256-sample batch. Prints a Markdown table (docs/benchmarks.md).

``python benchmarks/store_backends.py [--samples 10000] [--tokens 2000] [--backends memory,ray,file,s3]``

Limits: one 2-core machine holds writer, store and reader; the rows are random top-8 sets (real routing is more
regular, so it compresses better than these: the object sizes are an upper bound); moto keeps objects in memory.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from rr_client import RoutedExpertsClient, RoutingRef, check_routing  # noqa: E402

LAYERS, TOPK, EXPERTS = 48, 8, 128
BATCH = 256
POOL = 32  # distinct samples, put again and again (each put is a new key, a new object)


def info() -> Any:
    from _bench import synthetic_info

    return synthetic_info(LAYERS, EXPERTS, TOPK, engine="vllm", version="0.30.0")


def pool(tokens: int, inf: Any) -> list[Any]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(POOL):
        n = tokens + int(rng.integers(-100, 100))
        ids = np.argsort(rng.random((n, LAYERS, EXPERTS), dtype=np.float32), axis=-1)[..., :TOPK]
        out.append(check_routing(ids.astype(np.int32), inf, rows=n))
    return out


def run_backend(name: str, samples: int, rows: list[Any], inf: Any) -> dict[str, Any]:
    import contextlib

    stack = contextlib.ExitStack()
    client_kw: dict[str, Any] = {}
    url = "http://127.0.0.1:9"
    if name == "memory":
        import httpx

        from rr_server.serving.store import MemoryStore
        from rr_server.serving.store import install as installed
        from tests.unit.test_routing_ref import store_app

        url = "http://rr-store.bench"
        store: Any = MemoryStore(2 << 30, url)
        installed._STORE = store
        client_kw["transport"] = httpx.ASGITransport(app=store_app(store))
    elif name == "ray":
        import ray

        from rr_server.serving.store.ray import RayStore

        ray.init(num_cpus=2, include_dashboard=False, namespace="rr", log_to_driver=False)
        stack.callback(ray.shutdown)
        store = RayStore(2 << 30, name="rr-bench-store")
    elif name == "file":
        from rr_server.serving.store.objects import ObjectStore

        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="rr-bench-"))
        store = ObjectStore(f"file://{folder}")
        client_kw["object_stores"] = [store.url]
    elif name == "s3":
        from rr_server.serving.store.objects import ObjectStore
        from tests.support.s3_server import s3_server

        s3 = stack.enter_context(s3_server())
        store = ObjectStore(s3.url("bench"), storage_options=s3.storage_options)
        client_kw.update(object_stores=[store.url], storage_options=s3.storage_options)
    else:
        raise SystemExit(f"unknown backend {name}")
    put_s = read_s = 0.0
    batch_s: list[float] = []
    row_bytes = stored = tokens = 0
    with stack:

        async def resolve(refs: list[RoutingRef]) -> list[np.ndarray]:
            async with RoutedExpertsClient(url, info=inf, **client_kw) as c:
                return await c.resolve(refs)

        done = 0
        while done < samples:
            n = min(BATCH, samples - done)
            batch = [rows[(done + i) % POOL] for i in range(n)]
            t0 = time.perf_counter()
            refs = [RoutingRef.from_dict(store.put(c)) for c in batch]
            t1 = time.perf_counter()
            got = asyncio.run(resolve(refs))
            t2 = time.perf_counter()
            assert all(g.shape == c.array.shape for g, c in zip(got, batch))
            put_s += t1 - t0
            read_s += t2 - t1
            batch_s.append(t2 - t1)
            row_bytes += sum(c.array.nbytes for c in batch)
            tokens += sum(c.array.shape[0] for c in batch)
            store.retire(refs[-1].weight_version)
            done += n
        if name in ("memory", "ray"):
            stored = row_bytes  # held as the checked rows themselves
        else:
            stored = store.local_stats()["written_bytes"]
    return {
        "backend": name,
        "samples": samples,
        "bytes/token": stored / tokens,
        "write samples/s": samples / put_s,
        "write MB/s": row_bytes / put_s / 1e6,
        "read samples/s": samples / read_s,
        "read MB/s": row_bytes / read_s / 1e6,
        "256-batch resolve s (median)": statistics.median(batch_s),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=10_000)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--backends", default="memory,ray,file,s3")
    args = ap.parse_args()
    inf = info()
    rows = pool(args.tokens, inf)
    raw = LAYERS * TOPK
    print(f"{args.samples} samples of {LAYERS} layers x top-{TOPK} (uint8, {raw} B/token raw), ~{args.tokens} tokens")
    results = []
    for name in args.backends.split(","):
        r = run_backend(name, args.samples, rows, inf)
        results.append(r)
        print(f"  {name}: done", file=sys.stderr)
    cols = list(results[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()) + " |")


if __name__ == "__main__":
    main()
