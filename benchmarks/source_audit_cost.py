"""The source audit's cost on a real vLLM CPU server: extra engine time at a sampling fraction, one table.

Two measures, on one rr vLLM server (capture on):
  1. per request: the server's time per served request (``--requests`` at ``--concurrency``, generating
     ``--max-new-tokens``) and per re-score (the same samples' tokens as one prefill, ``max_new_tokens=1``, a fresh
     ``cache_salt``, at the same concurrency); extra engine time at fraction f = f x re-score time / request time.
  2. end to end: generated tok/s of rounds with the client's ``source_audit=f`` against rounds without, interleaved
     (median of paired rounds; on a 2-core box the spread is larger than 1%, so measure 1 is the figure to quote).
The audit adds nothing to the server's request path: the client re-scores after the batch returns.
``python benchmarks/source_audit_cost.py [--fraction-pct 1] [--rounds 4]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _bench import REPO, int_options, load_prompt, rr_vllm_command, spawn  # noqa: I001 - sys.path

from rr_server.launch.process import free_port, stop_process_group, wait_healthy


def start(model_dir: Path, log: Path) -> tuple[Any, str]:
    """One rr vLLM CPU server (capture on) serving ``model_dir``."""
    port = free_port()
    cmd, env = rr_vllm_command(model_dir, port, "--served-model-name", "tiny-moe")
    proc = spawn(cmd, env, log)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, log, 900)
    return proc, url


async def served(url: str, args: argparse.Namespace, seed: int, fraction: float) -> tuple[int, float, list[Any]]:
    """One round: ``requests`` samples through the client (audit at ``fraction``); (generated tokens, s, results)."""
    from rr_client import RoutedExpertsClient

    prompts = [load_prompt(seed, i, args.prompt_len) for i in range(args.requests)]
    params = {"max_new_tokens": args.max_new_tokens, "ignore_eos": True, "temperature": 1.0}
    async with RoutedExpertsClient(
        url, batch_size=1, max_concurrency=args.concurrency, source_audit=fraction or None
    ) as c:
        await c.info()
        t0 = time.perf_counter()
        batch = await c.generate(prompts, params)
        dt = time.perf_counter() - t0
    return sum(len(r.output_ids) for r in batch), dt, list(batch)


async def rescored(url: str, samples: list[Any], concurrency: int) -> float:
    """Seconds per re-score of ``samples`` (as the audit sends them), ``concurrency`` at a time."""
    from rr_client import RoutedExpertsClient
    from rr_client.client.source_audit import salt_field

    async with RoutedExpertsClient(url, max_concurrency=concurrency) as c:
        info = await c.info()
        sem = asyncio.Semaphore(concurrency)

        async def one(r: Any) -> None:
            async with sem:
                await c.rescore(r.prompt_ids + r.output_ids, info, salt_field(info))

        t0 = time.perf_counter()
        await asyncio.gather(*(one(r) for r in samples))
        return (time.perf_counter() - t0) / len(samples)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=str(REPO / ".cache" / "bench-qwen3-moe"))
    int_options(
        p,
        num_experts=64,
        topk=8,
        num_layers=4,
        rounds=4,
        requests=100,
        concurrency=8,
        prompt_len=128,
        max_new_tokens=64,
        fraction_pct=1,
    )
    args = p.parse_args(argv)
    fraction = args.fraction_pct / 100

    from rr_server.demo.tiny_moe import build_tiny_moe

    model = build_tiny_moe(
        args.model_dir, arch="qwen3_moe", num_layers=args.num_layers, num_experts=args.num_experts, topk=args.topk
    )
    log = Path(tempfile.mkdtemp(prefix="rr-bench-audit-")) / "server.log"
    proc, url = start(model, log)
    try:
        asyncio.run(served(url, args, 999, 0.0))  # warm-up
        off: list[tuple[int, float]] = []
        on: list[tuple[int, float]] = []
        per_request: list[float] = []
        per_rescore: list[float] = []
        for r in range(args.rounds):
            tok, s, results = asyncio.run(served(url, args, r, 0.0))
            off.append((tok, s))
            per_request.append(s / args.requests)
            tok, s, _ = asyncio.run(served(url, args, r, fraction))
            on.append((tok, s))
            per_rescore.append(asyncio.run(rescored(url, results[: args.concurrency * 2], args.concurrency)))
    finally:
        stop_process_group(proc)
    t_req, t_re = statistics.median(per_request), statistics.median(per_rescore)
    print(
        f"\nmodel: qwen3_moe {args.num_layers} layers, {args.num_experts} experts, top-{args.topk}; {args.requests} "
        f"requests x {args.max_new_tokens} new tokens, prompt {args.prompt_len}, concurrency {args.concurrency}, "
        f"{args.rounds} rounds (median)\n"
    )
    print(f"{'measure':<58} {'value':>12}")
    print(f"{'server time per served request (s, at concurrency)':<58} {t_req:>12.4f}")
    print(f"{'server time per re-score (s, same concurrency)':<58} {t_re:>12.4f}")
    for pct in sorted({1, args.fraction_pct}):
        print(f"{f'extra engine time at {pct}% audited':<58} {100 * pct / 100 * t_re / t_req:>11.3f}%")
    paired = [100 * ((t / s) / (t0 / s0) - 1) for (t, s), (t0, s0) in zip(on, off)]
    print(
        f"{f'end to end tok/s, audit {args.fraction_pct}% vs off (paired median)':<58} "
        f"{statistics.median(paired):>+11.2f}%"
    )
    print(f"\nrounds (audit vs off, %): {', '.join(f'{x:+.2f}' for x in paired)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
