"""Routing overhead on a real vLLM CPU server: generated tok/s with routing returned vs not, one run.

Three configurations, measured in interleaved rounds on the same machine:
  A. server without --enable-return-routed-experts (no capture at all; /generate still served by rr)
  B. rr server (capture on), requests with return_routed_experts=false
  C. rr server (capture on), requests with return_routed_experts=true (encode + validate + transfer)
C vs B is the cost of returning routing; B vs A is vLLM's own capture cost. Both servers stay up
(same CPU binding) and only one receives load at a time; rounds rotate A/B/C so background load
drifts hit every configuration alike. ``python benchmarks/overhead.py [--rounds 6] [--skip-baseline]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from _bench import REPO, int_options, load_prompt, rr_vllm_command, spawn, synthetic_info  # noqa: I001 - sys.path

from rr_server.launch.process import free_port as _free_port
from rr_server.launch.process import stop_process_group as stop
from rr_server.launch.process import wait_healthy as _wait_healthy


def start(model_dir: Path, *, capture: bool, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start a vLLM API server with the rr plugin; with or without routing capture."""
    port = _free_port()
    cmd, env = rr_vllm_command(model_dir, port, "--served-model-name", "tiny-moe")
    if not capture:
        cmd = [a for a in cmd if a != "--enable-return-routed-experts"]
    proc = spawn(cmd, env, log)
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(url, proc, log, 600)
    return proc, url


async def load(
    url: str, *, routing: bool, concurrency: int, requests: int, prompt_len: int, max_new: int, seed: int
) -> tuple[int, float, int]:
    """Send ``requests`` /generate calls, ``concurrency`` at a time; return (gen tokens, seconds, bytes)."""
    sem = asyncio.Semaphore(concurrency)
    tokens = 0
    nbytes = 0

    async with httpx.AsyncClient(base_url=url, timeout=600) as c:

        async def one(i: int) -> None:
            nonlocal tokens, nbytes
            body = {
                "input_ids": load_prompt(seed, i, prompt_len),
                "return_routed_experts": routing,
                "sampling_params": {
                    "max_new_tokens": max_new,
                    "ignore_eos": True,
                    "temperature": 1.0,
                    "seed": seed + i,
                },
            }
            async with sem:
                r = await c.post("/generate", json=body)
            r.raise_for_status()
            item = r.json()
            if routing and "routed_experts" not in item["meta_info"]:
                raise RuntimeError(f"routing missing: {item['meta_info']}")
            tokens += item["meta_info"]["completion_tokens"]
            nbytes += len(r.content)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(requests)))
        return tokens, time.perf_counter() - t0, nbytes


Run = tuple[int, float, int]


def measure(targets: list[tuple[str, str, bool]], args: argparse.Namespace) -> dict[str, list[Run]]:
    """Warm every target, then ``args.rounds`` rounds visiting all targets in rotating order."""

    def run(url: str, routing: bool, requests: int, max_new: int, seed: int) -> Run:
        """One load at the run's concurrency and prompt length."""
        kw = dict(concurrency=args.concurrency, prompt_len=args.prompt_len)
        return asyncio.run(load(url, routing=routing, requests=requests, max_new=max_new, seed=seed, **kw))

    for _, url, routing in targets:
        run(url, routing, requests=args.concurrency, max_new=8, seed=999)
    out: dict[str, list[Run]] = {name: [] for name, _, _ in targets}
    for rnd in range(args.rounds):
        k = rnd % len(targets)
        for name, url, routing in targets[k:] + targets[:k]:
            out[name].append(run(url, routing, requests=args.requests, max_new=args.max_new_tokens, seed=rnd))
    return out


def encode_cost_us(rows: int, layers: int, topk: int, experts: int, reps: int = 2000) -> float:
    """Server-side CPU cost (µs) of the full check + encoding one request's routing, measured in-process."""
    import numpy as np

    from rr_server.serving.generate_protocol import build_item
    from rr_server.serving.vllm_translate import checked_routing_fields

    rng = np.random.default_rng(0)
    arr = np.argsort(rng.random((rows, layers, experts)), axis=-1)[..., :topk].astype(np.uint8)  # distinct ids
    info = synthetic_info(layers, experts, topk, engine="vllm", version="bench")
    prompt, output = [0] * (rows - 63), [0] * 64
    t0 = time.perf_counter()
    for _ in range(reps):
        fields = checked_routing_fields(arr, info, prompt_ids=prompt, output_ids=output, start=0)
        build_item(
            rid="r",
            text="",
            output_ids=output,
            prompt_tokens=len(prompt),
            cached_tokens=0,
            finish_reason=None,
            e2e_latency=0.0,
            routing_fields=fields,
            prompt_token_ids=prompt,
        )
    return (time.perf_counter() - t0) / reps * 1e6


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=str(REPO / ".cache" / "bench-qwen3-moe"))
    int_options(
        p, num_experts=64, topk=8, num_layers=4, rounds=6, requests=24, concurrency=8, prompt_len=128, max_new_tokens=64
    )
    p.add_argument("--skip-baseline", action="store_true", help="skip the server without capture (A)")
    args = p.parse_args(argv)

    from rr_server.demo.tiny_moe import build_tiny_moe

    model = build_tiny_moe(
        args.model_dir, arch="qwen3_moe", num_layers=args.num_layers, num_experts=args.num_experts, topk=args.topk
    )
    log_dir = Path(tempfile.mkdtemp(prefix="rr-bench-"))
    procs = []
    try:
        proc, url = start(model, capture=True, log=log_dir / "capture.log")
        procs.append(proc)
        targets = [("B capture on, routing not requested", url, False), ("C capture on, routing returned", url, True)]
        if not args.skip_baseline:
            proc, base = start(model, capture=False, log=log_dir / "baseline.log")
            procs.append(proc)
            targets.insert(0, ("A no capture (--enable-return-routed-experts off)", base, False))
        res = measure(targets, args)
    finally:
        for p_ in procs:
            stop(p_)
    rows = [(name, res[name]) for name, _, _ in targets]

    def tps(runs: list[tuple[int, float, int]]) -> float:
        return statistics.median(t / s for t, s, _ in runs)

    ref = res["B capture on, routing not requested"]
    print(
        f"\nmodel: qwen3_moe {args.num_layers} layers, {args.num_experts} experts, top-{args.topk}; "
        f"{args.requests} requests x {args.max_new_tokens} new tokens, prompt {args.prompt_len}, "
        f"concurrency {args.concurrency}, {args.rounds} rotating rounds (median)\n"
    )
    print(f"{'configuration':<52} {'tok/s':>9} {'vs B':>8} {'reply KiB/req':>14}")
    for name, runs in rows:
        kib = statistics.median(b / args.requests / 1024 for _, _, b in runs)
        print(f"{name:<52} {tps(runs):>9.1f} {100 * (tps(runs) / tps(ref) - 1):>+7.1f}% {kib:>14.1f}")
    rows_per_req = args.prompt_len + args.max_new_tokens - 1
    us = encode_cost_us(rows_per_req, args.num_layers, args.topk, args.num_experts)
    req_s = statistics.median(s / (t / args.max_new_tokens) for t, s, _ in ref)  # wall s per request slot
    print(
        f"\nrouting check + encode in the server: {us:.0f} µs per request ({rows_per_req} rows); the server "
        f"completes a request every ~{req_s * 1e3:.0f} ms at concurrency {args.concurrency} "
        f"-> {100 * us / 1e6 / req_s:.3f}% of its time"
    )
    spread = [t / s for t, s, _ in ref]
    print(f"\nround-to-round spread of B: {min(spread):.1f}..{max(spread):.1f} tok/s")
    for name, runs in rows:
        if runs is ref:
            continue
        paired = [100 * ((t / s) / (tb / sb) - 1) for (t, s, _), (tb, sb, _) in zip(runs, ref)]
        print(
            f"paired per-round change vs B, {name[:1]}: median {statistics.median(paired):+.1f}% "
            f"(rounds: {', '.join(f'{x:+.1f}' for x in paired)})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
