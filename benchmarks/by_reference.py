"""Routing inline vs by reference: two real vLLM CPU replicas, one controller process, four trainer-rank processes.

The same rollout (greedy, so both ways generate the same tokens) both ways:
  inline   the controller asks for routing in the answers (rr's base64 ``.npy`` in JSON), decodes it, and sends
           each rank its micro-batches' samples with their arrays (pickled over a pipe: what a Ray / torch
           scatter moves).
  by ref   the controller asks for refs and sends each rank its micro-batches' samples with their refs; each rank
           resolves only its own rows, straight from the replica that made them (``POST /rr/routing/read``).
Measured: bytes through the controller per sample (answers in + scatter out), what each rank received against
its own rows, transport bytes per routing entry, resolve throughput per rank, end-to-end time (rollout start to
every rank holding its rows). Then the projection to one GRPO step of 512 prompts x 16 samples x 8k tokens on
DeepSeek-V3 (61 layers x top-8, uint8). Prints a table (docs/scale.md).

``python benchmarks/by_reference.py [--prompts 64] [--max-new 64] [--ranks 4]``

Limits: two cores serve two CPU engines, a controller and four ranks, so times are contended and say little
about a GPU cluster; the byte counts are exact and scale linearly with layers x top-k x tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import pickle
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rr_client import RoutedExpertsClient, RoutingRef  # noqa: E402

STEP = {"prompts": 512, "samples": 16, "tokens": 8192, "layers": 61, "topk": 8}  # DeepSeek-V3 GRPO step


class Counting(httpx.AsyncBaseTransport):
    """A real HTTP transport counting response body bytes (what crossed the wire into this process)."""

    def __init__(self) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self.bytes = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        resp = await self._inner.handle_async_request(request)
        body = await resp.aread()
        self.bytes += len(body)
        return httpx.Response(resp.status_code, headers=resp.headers, content=body, request=request)

    async def aclose(self) -> None:
        await self._inner.aclose()


def rank_main(conn: Any, urls: list[str]) -> None:  # pragma: no cover - runs in a rank process
    """One trainer rank: receive its micro-batches; by ref, resolve only their rows; report what it took."""
    while True:
        msg = conn.recv_bytes()
        if msg == b"stop":
            return
        mode, samples = pickle.loads(msg)
        t0 = time.perf_counter()
        counted = Counting()
        resolved_bytes = 0
        if mode == "ref":

            async def resolve() -> int:
                async with RoutedExpertsClient(urls, transport=counted) as c:  # noqa: B023 - run in this iteration
                    rows = await c.resolve([RoutingRef.from_dict(s["ref"]) for s in samples])  # noqa: B023
                    return sum(r.nbytes for r in rows)

            resolved_bytes = asyncio.run(resolve())
        else:
            resolved_bytes = sum(s["rows"].nbytes for s in samples)
        conn.send(
            {
                "received": len(msg),
                "http_bytes": counted.bytes,
                "own_bytes": resolved_bytes,
                "seconds": time.perf_counter() - t0,
                "samples": len(samples),
            }
        )


async def rollout(
    urls: list[str], prompts: list[list[int]], params: dict[str, Any], by_reference: bool
) -> tuple[Any, int, float]:
    counted = Counting()
    async with RoutedExpertsClient(urls, transport=counted, batch_size=4, max_concurrency=8, timeout=600) as c:
        await c.info()
        counted.bytes = 0
        t0 = time.perf_counter()
        batch = await c.generate(prompts, params, by_reference=by_reference)
        return batch, counted.bytes, time.perf_counter() - t0


def run_mode(
    mode: str, urls: list[str], prompts: list[list[int]], params: dict[str, Any], ranks: list[Any], micro: int
) -> dict[str, Any]:
    t0 = time.perf_counter()
    batch, answer_bytes, gen_s = asyncio.run(rollout(urls, prompts, params, mode == "ref"))
    samples = [
        {
            "prompt_ids": r.prompt_ids,
            "output_ids": r.output_ids,
            **({"ref": r.routing_ref.to_dict()} if mode == "ref" else {"rows": r.routed_experts}),
        }
        for r in batch
    ]
    # micro-batches of ``micro`` samples, dealt round-robin to the ranks (a data-parallel split)
    per_rank: list[list[dict[str, Any]]] = [[] for _ in ranks]
    for k, s in enumerate(range(0, len(samples), micro)):
        per_rank[k % len(ranks)].extend(samples[s : s + micro])
    sent = 0
    for conn, part in zip(ranks, per_rank):
        msg = pickle.dumps((mode, part), protocol=5)
        sent += len(msg)
        conn.send_bytes(msg)
    reports = [conn.recv() for conn in ranks]
    total_s = time.perf_counter() - t0
    entries = sum(int(np.prod(r.routing_ref.shape)) if mode == "ref" else r.routed_experts.size for r in batch)
    rows_bytes = [
        sum(
            (s["ref"]["rows"] * s["ref"]["layers"] * s["ref"]["topk"]) if mode == "ref" else s["rows"].nbytes
            for s in part
        )
        for part in per_rank
    ]
    ref_json = np.mean([len(json.dumps(r.routing_ref.to_dict())) for r in batch]) if mode == "ref" else 0.0
    if mode == "ref":  # routing through the controller: the ref in the answer, the ref to the rank
        routing_through = 2 * sum(len(json.dumps(r.routing_ref.to_dict())) for r in batch)
    else:  # the payload the engine sent (rr's encoder, byte-identical) and the array to the rank
        from rr_client.core.codec import check_routing, encode_routed_experts

        routing_through = sum(
            len(encode_routed_experts(check_routing(r.routed_experts, batch.info, rows=r.routed_experts.shape[0])))
            + r.routed_experts.nbytes
            for r in batch
        )
    return {
        "mode": mode,
        "samples": len(samples),
        "ref_json": ref_json,
        "routing_through": routing_through,
        "entries": entries,
        "answer_bytes": answer_bytes,
        "scatter_bytes": sent,
        "gen_s": gen_s,
        "total_s": total_s,
        "reports": reports,
        "own_rows": rows_bytes,
        "tokens": sum(len(r.output_ids) for r in batch),
        "outputs": [r.output_ids for r in batch],
    }


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return f"{n:.1f}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--micro", type=int, default=4, help="samples per micro-batch")
    args = ap.parse_args(argv)

    from _bench import tiny_vllm_replicas

    servers = tiny_vllm_replicas(2, max_model_len=1024)
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    try:
        for s in servers:
            s.wait_healthy()
        urls = [s.base_url for s in servers]
        for _ in range(args.ranks):
            here, there = ctx.Pipe()
            p = ctx.Process(target=rank_main, args=(there, urls), daemon=True)
            p.start()
            pipes.append(here)
            procs.append(p)
        g = np.random.default_rng(0)
        prompts = [g.integers(5, 400, 48).tolist() for _ in range(args.prompts)]
        params = {"max_new_tokens": args.max_new, "temperature": 0.0, "ignore_eos": True}
        run_mode("ref", urls, prompts[:8], params, pipes, args.micro)  # warm up both paths and the ranks
        inline = run_mode("inline", urls, prompts, params, pipes, args.micro)
        by_ref = run_mode("ref", urls, prompts, params, pipes, args.micro)
        assert inline["outputs"] == by_ref["outputs"], "greedy rollouts differ between the two runs"
    finally:
        for p in pipes:
            p.send_bytes(b"stop")
        for p in procs:
            p.join(timeout=10)
        for s in servers:
            s.stop()
    report(inline, by_ref, args)


def report(inline: dict[str, Any], by_ref: dict[str, Any], args: Any) -> None:
    n = inline["samples"]
    print(
        f"\n{n} samples ({inline['tokens']} generated tokens, prompts of 48), 2 replicas, {args.ranks} ranks, "
        f"micro-batches of {args.micro}; tiny Qwen3-MoE (3 layers, 2 MoE, top-2: 6 routing bytes per token)\n"
    )
    print("| | inline | by reference |")
    print("|---|---|---|")
    for name, key in (
        ("bytes into the controller per sample (answers)", "answer_bytes"),
        ("bytes out of the controller per sample (scatter to ranks)", "scatter_bytes"),
    ):
        print(f"| {name} | {inline[key] / n:,.0f} | {by_ref[key] / n:,.0f} |")
    for mode in (inline, by_ref):
        mode["through"] = (mode["answer_bytes"] + mode["scatter_bytes"]) / n
    print(f"| bytes through the controller per sample, total | {inline['through']:,.0f} | {by_ref['through']:,.0f} |")
    print(
        f"| of which routing (payload or ref, in + out) | {inline['routing_through'] / n:,.0f} "
        f"| {by_ref['routing_through'] / n:,.0f} |"
    )
    own = [r["own_bytes"] for r in by_ref["reports"]]
    print(
        f"| routing bytes each rank took / its own micro-batches' rows | "
        f"{sum(r['own_bytes'] for r in inline['reports'])} / {sum(inline['own_rows'])} (via controller) | "
        f"{' + '.join(str(o) for o in own)} = {sum(own)} / {sum(by_ref['own_rows'])} |"
    )
    http = sum(r["http_bytes"] for r in by_ref["reports"])
    print(
        f"| transport per routing entry (rank side, frame data + headers) | "
        f"{inline['answer_bytes'] / inline['entries']:.2f} B (base64 .npy in JSON, whole answer) | "
        f"{sum(own) / by_ref['entries']:.2f} B data, {http / by_ref['entries']:.2f} B with frame headers |"
    )
    secs = [r["seconds"] for r in by_ref["reports"]]
    rate = [r["samples"] / r["seconds"] for r in by_ref["reports"] if r["seconds"] > 0]
    print(
        f"| resolve per rank (client start, /rr/info, one read per replica) | - | {min(secs):.3f}-{max(secs):.3f} s; "
        f"{min(rate):.0f}-{max(rate):.0f} samples/s |"
    )
    print(
        f"| end to end: rollout start to every rank holding its rows | {inline['total_s']:.2f} s "
        f"(generation {inline['gen_s']:.2f} s) | {by_ref['total_s']:.2f} s (generation {by_ref['gen_s']:.2f} s) |"
    )

    s = STEP
    samples = s["prompts"] * s["samples"]
    entries = s["tokens"] * s["layers"] * s["topk"]
    ref = by_ref["ref_json"]
    print(
        f"\nProjection: one GRPO step, {s['prompts']} prompts x {s['samples']} samples x {s['tokens']} tokens on "
        f"DeepSeek-V3 ({s['layers']} layers x top-{s['topk']}: {entries / 1e6:.2f} MB of uint8 routing per sample); "
        f"a ref is {ref:.0f} B of JSON (measured above) whatever the length\n"
    )
    print(
        "| routing through the controller per step | inline, rr .npy (base64) | inline, SGLang int32 (base64) "
        "| by reference |"
    )
    print("|---|---|---|---|")
    b64 = 4 / 3
    print(
        f"| in, from the engines | {fmt_bytes(samples * entries * b64)} | {fmt_bytes(samples * entries * 4 * b64)} "
        f"| {fmt_bytes(samples * ref)} |"
    )
    print(
        f"| out, to the ranks | {fmt_bytes(samples * entries)} | {fmt_bytes(samples * entries * 4)} "
        f"| {fmt_bytes(samples * ref)} |"
    )
    print(
        "| what a rank reads | its share, via the controller | its share, via the controller "
        "| its share only, from the engine that made it: 1.0 B/entry + frame headers |"
    )


if __name__ == "__main__":
    main()
