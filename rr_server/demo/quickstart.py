"""``python -m rr_server.demo``: tiny MoE -> patched vLLM server -> RoutedExpertsClient -> checked routing.

Builds a random tiny Qwen3-MoE locally, launches ``rr-server launch vllm`` on a free port,
generates a batch, prints token counts, routing shapes, payload sizes, a per-layer expert-load
table and the agreement with transformers' router top-k, then runs the agentic loop of
:mod:`rr_server.demo.agentic` (trajectories, tensors, bytes per trajectory) and the doctor; ends with a one-line
verdict (``rr demo: PASS - ...`` or ``rr demo: FAIL - `` what failed) and the commands to try next; exits 1 unless
every agreement is 100% and the doctor passes (2 if a step raised).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from rr_server.launch.process import free_port as _free_port
from rr_server.launch.process import stop_process_group as _stop
from rr_server.launch.process import wait_healthy as _wait_healthy

__all__ = ["main"]

DEFAULT_PROMPTS = [
    "Hello world, this is a tiny mixture of experts.",
    "Once upon a time there was a router on a CPU.",
    "Rollout routing replay records which experts fired.",
    "def forward(self, hidden_states):",
    "1 2 3 4 5 6 7 8",
    "The quick brown fox jumps over the lazy dog.",
    "Reinforcement learning trainers replay the routing.",
    "SGLang and vLLM both return routed experts.",
]


def _launch(model_dir: Path, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    """Start the patched vLLM server via the rr launcher, in its own process group."""
    cmd = [
        sys.executable, "-m", "rr_server", "launch", "vllm", "--model", str(model_dir), "--host", "127.0.0.1",
        "--port", str(port), "--max-model-len", "1024", "--served-model-name", "tiny-moe"
    ]  # fmt: skip
    env = dict(os.environ)
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")  # the log's last line is the start's progress shown meanwhile
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _load_table(results: list[Any], num_layers: int, num_experts: int, moe_layers: list[int]) -> str:
    """Per-layer expert-load table (share of routed slots per expert), over every returned row."""
    counts = np.zeros((num_layers, num_experts), dtype=np.int64)
    for r in results:
        arr = np.asarray(r.routed_experts).astype(np.int64)
        for layer in moe_layers:
            counts[layer] += np.bincount(arr[:, layer, :].ravel(), minlength=num_experts)
    lines = []
    if num_experts <= 16:
        head = "layer  " + " ".join(f"{'e' + str(e):>6}" for e in range(num_experts))
        lines.append(head)
        for layer in range(num_layers):
            if layer not in moe_layers:
                lines.append(f"{layer:>5}  dense (all-zero rows)")
                continue
            share = counts[layer] / max(1, counts[layer].sum())
            lines.append(f"{layer:>5}  " + " ".join(f"{100 * s:5.1f}%" for s in share))
    else:
        lines.append("layer  slots   used/experts   top-5 experts (share)            min/max load")
        for layer in range(num_layers):
            if layer not in moe_layers:
                lines.append(f"{layer:>5}  dense (all-zero rows)")
                continue
            c = counts[layer]
            top = np.argsort(-c)[:5]
            tops = " ".join(f"{e}:{100 * c[e] / c.sum():.1f}%" for e in top)
            lines.append(
                f"{layer:>5}  {c.sum():>5}   {int((c > 0).sum()):>4}/{num_experts:<6}  {tops:<32} {c.min()}/{c.max()}"
            )
    return "\n".join(lines)


async def _generate(base_url: str, prompts: list[str], max_new_tokens: int, seed: int) -> Any:
    """One batch through the typed client (routing decoded and validated by it)."""
    from rr_client import RoutedExpertsClient

    async with RoutedExpertsClient(base_url) as client:
        return await client.generate(prompts, {"max_new_tokens": max_new_tokens, "temperature": 0.8, "seed": seed})


def _doctor(base_url: str, model_dir: Path) -> bool:
    """``rr-server doctor BASE_URL --model-path MODEL_DIR`` on the demo's server; print its report."""
    from rr_server.doctor import CheckPrinter, render
    from rr_server.doctor.checks import run_doctor
    from rr_server.progress import Steps

    print(f"\n$ rr-server doctor {base_url} --model-path {model_dir}")
    with Steps() as steps:  # each check's line on stderr as it finishes; the report below
        report = asyncio.run(run_doctor(base_url, model_path=str(model_dir), progress=CheckPrinter(steps)))
    print(render(report, checks=False))  # each check's line was printed as it finished
    return report.ok


# the demo's checkpoint (relative to the checkout): what README's `docker run ... rr-vllm:cpu` line mounts
MODEL_DIR = ".cache/demo-qwen3-moe"
MODEL_SPEC: dict[str, Any] = dict(arch="qwen3_moe", num_layers=3, num_experts=8, topk=2, mlp_only_layers=(1,))


def run(args: argparse.Namespace) -> int:
    """Build, launch, generate, report; return the exit code."""
    from transformers import AutoTokenizer

    from rr_client.core.agreement import count_matches
    from rr_client.core.codec import check_payload, encode_routed_experts, expected_rows
    from rr_server.demo.tiny_moe import build_tiny_moe, reference_routing

    t0 = time.perf_counter()
    model_dir = build_tiny_moe(
        args.model_dir,
        arch=args.arch,
        num_layers=args.num_layers,
        num_experts=args.num_experts,
        topk=args.topk,
        mlp_only_layers=tuple(args.dense_layers),
    )
    print(
        f"model: {model_dir} ({args.arch}, {args.num_layers} layers, {args.num_experts} experts, "
        f"top-{args.topk}, dense layers {list(args.dense_layers)}) built in {time.perf_counter() - t0:.1f}s"
    )
    proc = None
    base_url = args.base_url
    log_path = Path(tempfile.gettempdir()) / f"rr-demo-{os.getpid()}.log"
    try:
        if base_url is None:
            port = args.port or _free_port()
            base_url = f"http://127.0.0.1:{port}"
            t1 = time.perf_counter()
            proc = _launch(model_dir, port, log_path)
            print(f"launching: rr-server launch vllm --model {model_dir} --port {port}  (log: {log_path})")
            _wait_healthy(base_url, proc, log_path, args.startup_timeout)  # elapsed + the log's last line, on stderr
            print(f"server healthy in {time.perf_counter() - t1:.1f}s at {base_url}")
        prompts = DEFAULT_PROMPTS[: args.num_prompts]
        t2 = time.perf_counter()
        batch = asyncio.run(_generate(base_url, prompts, args.max_new_tokens, args.seed))
        dt = time.perf_counter() - t2
        info = batch.info
        print(
            f"/rr/info: engine {info.engine} {info.engine_version}, layers {info.num_hidden_layers}, "
            f"experts {info.num_experts}, top-{info.topk}, moe_layers {info.moe_layers}, wire {info.wire_dtype}"
        )
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        print(f"\ngenerated {len(batch.results)} samples in {dt:.2f}s\n")
        print(" req  prompt  completion  finish   routing shape      dtype   payload B  int32-b64 B")
        match = total = 0
        for r in batch.results:
            ids = list(tok(prompts[r.prompt_index])["input_ids"])
            if len(ids) != r.prompt_tokens:
                raise RuntimeError(f"local tokenization ({len(ids)}) != server prompt_tokens ({r.prompt_tokens})")
            arr = np.asarray(r.routed_experts)
            payload = len(
                encode_routed_experts(
                    check_payload(  # what was on the wire
                        arr, info, rows=expected_rows(r.prompt_tokens, r.completion_tokens)
                    )
                )
            )
            int32_b64 = (arr.size * 4 + 2) // 3 * 4
            print(
                f"{r.index:>4}  {r.prompt_tokens:>6}  {r.completion_tokens:>10}  {str(r.finish_reason):<7}  "
                f"{str(tuple(arr.shape)):<17}  {str(arr.dtype):<6}  {payload:>9}  {int32_b64:>11}"
            )
            ref = reference_routing(model_dir, ids + list(r.output_ids))[:-1]
            m, t = count_matches(arr, ref, layers=info.moe_layers)
            dense = [i for i in range(info.num_hidden_layers) if i not in info.moe_layers]
            if dense and arr[:, dense, :].any():
                m = 0  # dense layers must be all zero
            match += m
            total += t
        print("\nper-layer expert load (share of routed slots):")
        print(_load_table(batch.results, info.num_hidden_layers, info.num_experts, list(info.moe_layers)))
        pct = 100.0 * match / max(1, total)
        print(
            f"\nagreement with transformers' router top-k (sets, every token x MoE layer): {match}/{total} = {pct:.2f}%"
        )
        from rr_server.demo.agentic import run_agentic

        agentic_ok = run_agentic(base_url, str(model_dir))
        doctor_ok = _doctor(base_url, model_dir)
    finally:
        if proc is not None:
            _stop(proc)
            print("server stopped")
    ok, line = verdict(match, total, agentic_ok, doctor_ok)
    print(f"\n{line}")
    print(next_steps(args.model_dir))
    return 0 if ok else 1


def verdict(match: int, total: int, agentic_ok: bool, doctor_ok: bool) -> tuple[bool, str]:
    """The demo's one-line verdict: PASS when every routing cell, the agentic loop and the doctor agree."""
    routing_ok = bool(total) and match == total
    parts = [
        f"{match}/{total} routing cells equal transformers' top-k",
        "agentic loop exact" if agentic_ok else "agentic loop routing differs from transformers'",
        "doctor PASS" if doctor_ok else "doctor FAIL",
    ]
    ok = routing_ok and agentic_ok and doctor_ok
    if ok:
        return True, "rr demo: PASS - " + ", ".join(parts)
    failed = [p for p, good in zip(parts, (routing_ok, agentic_ok, doctor_ok), strict=True) if not good]
    return False, "rr demo: FAIL - " + ", ".join(failed) + " (details above)"


def _bin_dir() -> str:
    """Where this interpreter's commands live (``rr-server``), relative to the working directory when inside it."""
    bin_dir = os.path.dirname(sys.executable) or "."
    rel = os.path.relpath(bin_dir)
    return rel if not rel.startswith("..") else bin_dir


def next_steps(model_dir: str | Path, bin_dir: str | None = None) -> str:
    """What to try next, a few lines: serve the demo's model, check it with the doctor, run the tests."""
    b = bin_dir if bin_dir is not None else _bin_dir()
    activate = os.path.join(b, "activate")
    return "\n".join(
        [
            f"next (commands live in {b}; or `source {activate}` first):",
            f"  {b}/rr-server launch vllm --model {model_dir} --port 8000   # serve the demo's tiny model",
            f"  {b}/rr-server doctor http://127.0.0.1:8000   # in another shell: check its routing",
            "  make test   # the whole suite (35-80 min on 2 CPU cores)",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    p = argparse.ArgumentParser(prog="python -m rr_server.demo", description=__doc__)
    p.add_argument("--model-dir", default=MODEL_DIR)
    p.add_argument("--arch", default=MODEL_SPEC["arch"])
    p.add_argument("--num-layers", type=int, default=MODEL_SPEC["num_layers"])
    p.add_argument("--num-experts", type=int, default=MODEL_SPEC["num_experts"])
    p.add_argument("--topk", type=int, default=MODEL_SPEC["topk"])
    p.add_argument("--dense-layers", type=int, nargs="*", default=list(MODEL_SPEC["mlp_only_layers"]))
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--base-url", default=None, help="use an already running rr vLLM server")
    p.add_argument("--startup-timeout", type=float, default=600)
    args = p.parse_args(argv)
    if isinstance(sys.stdout, io.TextIOWrapper):  # piped (| tee, CI): lines in order with stderr's progress
        sys.stdout.reconfigure(line_buffering=True)
    try:
        return run(args)
    except Exception as e:  # noqa: BLE001 - top-level: one clear line, non-zero exit
        print(f"demo failed: {type(e).__name__}: {e}", file=sys.stderr)
        first = (str(e).strip().splitlines() or [""])[0]
        print(f"\nrr demo: FAIL - {type(e).__name__}: {first} (details above)")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
