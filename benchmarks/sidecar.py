"""Sidecar overhead: direct to the patched vLLM ``/generate`` vs through ``rr-server proxy``, routing on/off.

One vLLM CPU server with the rr plugin (capture on) serves both paths in the same run: the plugin's
``/generate`` (direct) and vLLM's untouched ``/v1/completions`` behind the sidecar (a separate process,
as deployed). Rounds interleave the four configurations; per-request latency at concurrency 1 and
throughput at ``--concurrency``. ``python benchmarks/sidecar.py [--rounds 3] [--requests 32]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from _bench import REPO, int_options, load_prompt, rr_vllm_command, spawn  # noqa: I001 - sys.path

from rr_server.launch.process import free_port, wait_healthy
from rr_server.launch.process import stop_process_group as stop


async def load(
    url: str, *, routing: bool, concurrency: int, requests: int, prompt_len: int, max_new: int, seed: int
) -> tuple[list[float], float]:
    """``requests`` /generate calls, ``concurrency`` at a time; return per-request latencies and wall seconds."""
    sem = asyncio.Semaphore(concurrency)
    lat: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:

        async def one(i: int) -> None:
            body = {
                "input_ids": load_prompt(seed, i, prompt_len),
                "return_routed_experts": routing,
                "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True, "seed": seed * 1000 + i},
            }
            async with sem:
                t0 = time.perf_counter()
                r = await c.post("/generate", json=body)
                lat.append(time.perf_counter() - t0)
            r.raise_for_status()
            if routing != ("routed_experts" in r.json()["meta_info"]):
                raise RuntimeError("routing presence does not match the request")

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(requests)))
        return lat, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=str(REPO / ".cache" / "bench-sidecar-qwen3-moe"))
    int_options(p, rounds=3, requests=32, concurrency=8, prompt_len=64, max_new_tokens=16)
    args = p.parse_args(argv)

    from rr_server.demo.tiny_moe import build_tiny_moe

    model = build_tiny_moe(args.model_dir, arch="qwen3_moe", num_layers=4, num_experts=64, topk=8)
    logs = Path(tempfile.mkdtemp(prefix="rr-bench-sidecar-"))
    port, sport = free_port(), free_port()
    cmd, env = rr_vllm_command(model, port)
    engine = spawn(cmd, env, logs / "vllm.log", cwd=REPO)
    sidecar = None
    try:
        direct = f"http://127.0.0.1:{port}"
        wait_healthy(direct, engine, logs / "vllm.log", 600)
        sidecar = spawn(
            [
                sys.executable,
                "-m",
                "rr_server.cli",
                "proxy",
                "--upstream",
                direct,
                "--engine",
                "vllm",
                "--port",
                str(sport),
                "--model-path",
                str(model),
            ],
            dict(os.environ),
            logs / "sidecar.log",
            cwd=REPO,
        )
        via = f"http://127.0.0.1:{sport}"
        wait_healthy(via, sidecar, logs / "sidecar.log", 120)
        configs = [
            (name, url, routing) for name, url in (("direct", direct), ("sidecar", via)) for routing in (False, True)
        ]
        lat1: dict[tuple[str, bool], list[float]] = {(n, r): [] for n, _, r in configs}
        tput: dict[tuple[str, bool], list[float]] = {(n, r): [] for n, _, r in configs}
        for _, url, routing in configs:  # warm-up (and /rr/info fetch)
            asyncio.run(
                load(url, routing=routing, concurrency=4, requests=8, prompt_len=args.prompt_len, max_new=4, seed=99)
            )
        for rnd in range(args.rounds):
            for name, url, routing in configs if rnd % 2 == 0 else configs[::-1]:
                kw = dict(routing=routing, prompt_len=args.prompt_len, max_new=args.max_new_tokens, seed=rnd)
                lat, _ = asyncio.run(load(url, concurrency=1, requests=max(8, args.requests // 4), **kw))  # type: ignore[arg-type]
                lat1[(name, routing)] += lat
                _, wall = asyncio.run(load(url, concurrency=args.concurrency, requests=args.requests, **kw))  # type: ignore[arg-type]
                tput[(name, routing)].append(args.requests / wall)
    finally:
        if sidecar is not None:
            stop(sidecar)
        stop(engine)

    print(
        f"\nqwen3_moe 4 layers, 64 experts, top-8; prompt {args.prompt_len}, {args.max_new_tokens} new tokens; "
        f"{args.rounds} interleaved rounds; latency at concurrency 1, throughput at {args.concurrency}\n"
    )
    print(
        f"{'path':<8} {'routing':<8} {'p50 ms':>8} {'p90 ms':>8} {'req/s':>8} {'p50 vs direct':>14} {'req/s vs direct':>16}"
    )
    for name, _, routing in configs:
        lat = sorted(lat1[(name, routing)])
        p50, p90 = statistics.median(lat) * 1e3, lat[int(0.9 * (len(lat) - 1))] * 1e3
        rps = statistics.median(tput[(name, routing)])
        d50 = statistics.median(lat1[("direct", routing)]) * 1e3
        drps = statistics.median(tput[("direct", routing)])
        print(
            f"{name:<8} {'on' if routing else 'off':<8} {p50:>8.1f} {p90:>8.1f} {rps:>8.1f} "
            f"{p50 / d50:>13.2f}x {rps / drps:>15.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
