"""Soak: thousands of long-routing requests against the patched vLLM server and the sidecar, memory watched.

Two targets on loopback, each a real vLLM CPU server of a tiny MoE: the rr-patched server (``rr-server launch
vllm``), and the sidecar (``rr-server proxy``) in front of an unpatched vLLM. A bounded mix at ``--concurrency``:
``/generate`` single and batched, OpenAI ``/v1/completions`` with rr's fields, 2-turn ``Trajectory`` rollouts, and
clients that disconnect mid-request. Every answer passes the client's full check; a sample of them is compared
with transformers' router top-k (sets per row and MoE layer). Resident memory of each server's process tree is
read at start, after warm-up and at the end.

    python benchmarks/soak.py --requests 2000 --concurrency 16 --prompt-tokens 1536
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rr_client import RoutedExpertsClient  # noqa: E402
from rr_client.agreement import count_matches  # noqa: E402
from rr_client.errors import RRError  # noqa: E402

MODEL_SPEC = dict(arch="qwen3_moe", num_layers=3, num_experts=16, topk=4, mlp_only_layers=(1,))
MOE_LAYERS = [0, 2]


@dataclass
class SoakReport:
    """What one soak run against one target saw."""

    target: str
    requests: int = 0
    ok: int = 0
    disconnected: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    first_error: dict[str, str] = field(default_factory=dict)  # the first message of each error type, to diagnose
    checked_rows: int = 0
    mismatched_sets: int = 0
    hung: int = 0
    seconds: float = 0.0
    rss_mb: dict[str, float] = field(default_factory=dict)

    @property
    def growth_pct(self) -> float:
        """Resident memory growth from after warm-up to the end, in %."""
        warm, end = self.rss_mb.get("warm-up"), self.rss_mb.get("end")
        return 100.0 * (end - warm) / warm if warm and end else float("nan")


def tree_rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and all its descendants (MiB), from /proc."""
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return total / 1024


def _prompt(i: int, n: int, vocab: int = 440) -> list[int]:
    """A distinct token-id prompt of ``n`` tokens (no prefix shared between requests beyond chance)."""
    rng = np.random.default_rng(1_000_003 * (i + 1))
    return [int(t) for t in rng.integers(2, vocab, size=n)]


class Checker:
    """Compares a sample of answers with transformers' router top-k (in a worker thread, off the event loop)."""

    def __init__(self, model_dir: Path, every: int) -> None:
        self.model_dir, self.every, self.n = model_dir, every, 0

    async def check(self, report: SoakReport, tokens: list[int], routing: np.ndarray | None) -> None:
        self.n += 1
        if routing is None or self.n % self.every:
            return
        from rr_server.tiny_moe import reference_routing

        ref = await asyncio.to_thread(reference_routing, self.model_dir, tokens[:-1])
        same, total = count_matches(routing, ref[: routing.shape[0]], layers=MOE_LAYERS)
        report.checked_rows += routing.shape[0]
        report.mismatched_sets += total - same + abs(ref.shape[0] - routing.shape[0]) * len(MOE_LAYERS)


async def _one(client: RoutedExpertsClient, i: int, report: SoakReport, checker: Checker, prompt_tokens: int,
               max_new: int) -> None:
    """One unit of the mix: 0 /generate, 1 batched /generate, 2 /v1/completions, 3 a 2-turn trajectory."""
    params = {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}
    kind = i % 4
    if kind == 0:
        batch = await client.generate([_prompt(i, prompt_tokens)], params)
        for r in batch.results:
            await checker.check(report, [*r.prompt_ids, *r.output_ids], r.routed_experts)
    elif kind == 1:
        batch = await client.generate([_prompt(i, prompt_tokens // 2), _prompt(i + 10**6, prompt_tokens // 3)], params)
        for r in batch.results:
            await checker.check(report, [*r.prompt_ids, *r.output_ids], r.routed_experts)
    elif kind == 2:
        batch = await client.complete(_prompt(i, prompt_tokens), {"max_tokens": max_new, "temperature": 0.0,
                                                                  "ignore_eos": True})
        for r in batch.results:
            await checker.check(report, [*r.prompt_ids, *r.output_ids], r.routed_experts)
    else:
        traj = client.trajectory(_prompt(i, prompt_tokens // 2))
        await traj.generate(params)
        traj.extend(_prompt(i + 2 * 10**6, 16))
        await traj.generate(params)
        await checker.check(report, list(traj.input_ids), traj.routed_experts)


async def soak(url: str, model_dir: Path, *, target: str, requests: int, concurrency: int, prompt_tokens: int,
               max_new: int, disconnect_every: int = 25, check_every: int = 10, timeout: float = 300.0,
               pids: dict[str, int] | None = None, warmup: int = 32) -> SoakReport:
    """Run the mix against ``url``; every request ends ok, disconnected (by us), or with a typed error counted."""
    report = SoakReport(target=target)
    checker = Checker(model_dir, check_every)
    rss = (lambda: sum(tree_rss_mb(p) for p in (pids or {}).values()))

    async with RoutedExpertsClient(url, max_concurrency=concurrency, timeout=timeout, retries=0) as client:
        report.rss_mb["start"] = rss()
        sem = asyncio.Semaphore(concurrency)

        async def unit(i: int) -> None:
            async with sem:
                report.requests += 1
                work = asyncio.ensure_future(_one(client, i, report, checker, prompt_tokens, max_new))
                if disconnect_every and i % disconnect_every == disconnect_every - 1:
                    await asyncio.sleep(0.05)  # the request is on the wire: leave mid-request
                    work.cancel()
                try:
                    await asyncio.wait_for(asyncio.shield(work), timeout + 30)
                    report.ok += 1
                except asyncio.CancelledError:
                    report.disconnected += 1
                except asyncio.TimeoutError:
                    report.hung += 1
                    work.cancel()
                except RRError as e:
                    report.errors[type(e).__name__] += 1
                    report.first_error.setdefault(type(e).__name__, f"request {i}: {e}")
                except Exception as e:  # noqa: BLE001 - counted by type: the soak's goal is 0 of them
                    import traceback

                    report.errors[f"untyped {type(e).__name__}"] += 1
                    report.first_error.setdefault(f"untyped {type(e).__name__}",
                                                  f"request {i} (kind {i % 4}): " + traceback.format_exc(limit=-4))

        await asyncio.gather(*(unit(i) for i in range(warmup)))
        report.rss_mb["warm-up"] = rss()
        t0 = time.perf_counter()
        await asyncio.gather(*(unit(i) for i in range(warmup, warmup + requests)))
        report.seconds = time.perf_counter() - t0
        report.rss_mb["end"] = rss()
        # still serving after the disconnects
        await client.generate([_prompt(7, 32)], {"max_new_tokens": 2})
    return report


def table(reports: list[SoakReport]) -> str:
    """Markdown table of the runs."""
    rows = ["| target | requests | ok | disconnected | errors | hung | sampled rows vs transformers | mismatched sets "
            "| req/s | RSS MiB start / warm-up / end | growth after warm-up |", "|" + "---|" * 11]
    for r in reports:
        errs = ", ".join(f"{k} {v}" for k, v in r.errors.items()) or "0"
        rows.append(f"| {r.target} | {r.requests} | {r.ok} | {r.disconnected} | {errs} | {r.hung} | {r.checked_rows} "
                    f"| {r.mismatched_sets} | {r.requests / max(r.seconds, 1e-9):.1f} | "
                    f"{r.rss_mb.get('start', 0):.0f} / {r.rss_mb.get('warm-up', 0):.0f} / {r.rss_mb.get('end', 0):.0f} "
                    f"| {r.growth_pct:+.2f}% |")
    return "\n".join(rows)


class Targets:
    """The two targets: rr-patched vLLM, and the sidecar in front of an unpatched vLLM (processes, loopback)."""

    def __init__(self, model_dir: Path, max_model_len: int, log_dir: Path) -> None:
        from rr_server.launch_vllm import build_command, is_cpu_platform
        from rr_server.process import free_port

        self.model_dir, self.log_dir = model_dir, log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        base = ["--model", str(model_dir), "--host", "127.0.0.1", "--max-model-len", str(max_model_len),
                "--served-model-name", "soak"]
        self.patched_port, self.vanilla_port, self.sidecar_port = free_port(), free_port(), free_port()
        env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
        self.patched = self._spawn([sys.executable, "-m", "rr_server.cli", "launch", "vllm", *base, "--port",
                                    str(self.patched_port)], env, "patched.log")
        vanilla_cmd, _ = build_command([*base, "--port", str(self.vanilla_port)], cpu=is_cpu_platform())
        self.vanilla = self._spawn(vanilla_cmd, {**env, "VLLM_PLUGINS": "", "RR_ENABLE": "0"}, "vanilla.log")
        self.sidecar: subprocess.Popen[bytes] | None = None

    def _spawn(self, cmd: list[str], env: dict[str, str], log: str) -> subprocess.Popen[bytes]:
        with open(self.log_dir / log, "ab") as fh:
            return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                    start_new_session=True)

    @property
    def patched_url(self) -> str:
        return f"http://127.0.0.1:{self.patched_port}"

    @property
    def sidecar_url(self) -> str:
        return f"http://127.0.0.1:{self.sidecar_port}"

    def wait(self, timeout: float = 600) -> None:
        """Both engines healthy, then the sidecar started and healthy."""
        from rr_server.process import wait_healthy

        wait_healthy(self.patched_url, self.patched, self.log_dir / "patched.log", timeout)
        vanilla_url = f"http://127.0.0.1:{self.vanilla_port}"
        wait_healthy(vanilla_url, self.vanilla, self.log_dir / "vanilla.log", timeout)
        self.sidecar = self._spawn([sys.executable, "-m", "rr_server.cli", "proxy", "--upstream", vanilla_url,
                                    "--engine", "vllm", "--port", str(self.sidecar_port), "--model-path",
                                    str(self.model_dir)], dict(os.environ), "sidecar.log")
        wait_healthy(self.sidecar_url, self.sidecar, self.log_dir / "sidecar.log", 120)

    def stop(self) -> None:
        """SIGTERM every process group (the launcher forwards it to vLLM's)."""
        from rr_server.process import stop_process_group

        for p in (self.sidecar, self.vanilla, self.patched):
            if p is not None:
                stop_process_group(p, grace=30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000, help="per target, after the warm-up")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=1536)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--disconnect-every", type=int, default=25)
    p.add_argument("--check-every", type=int, default=10, help="compare every Nth answer with transformers")
    p.add_argument("--duration-limit", type=float, default=1800, help="seconds per target at most")
    p.add_argument("--model-dir", default=str(REPO / ".cache" / "bench-soak-qwen3-moe"))
    a = p.parse_args(argv)

    from rr_server.tiny_moe import build_tiny_moe

    model = build_tiny_moe(a.model_dir, **MODEL_SPEC)  # type: ignore[arg-type]
    if a.prompt_tokens + 2 * a.max_new_tokens + 16 > 2048:
        p.error("--prompt-tokens: the tiny model has 2048 positions (prompt + new tokens must fit)")
    targets = Targets(model, 2048, REPO / ".cache" / "soak-logs")
    reports = []
    try:
        targets.wait()
        for name, url, pids in (("patched vLLM", targets.patched_url, {"vllm": targets.patched.pid}),
                                ("sidecar + unpatched vLLM", targets.sidecar_url,
                                 {"sidecar": targets.sidecar.pid, "vllm": targets.vanilla.pid})):  # type: ignore[union-attr]
            reports.append(asyncio.run(asyncio.wait_for(soak(
                url, model, target=name, requests=a.requests, concurrency=a.concurrency, prompt_tokens=a.prompt_tokens,
                max_new=a.max_new_tokens, disconnect_every=a.disconnect_every, check_every=a.check_every,
                pids=pids), a.duration_limit)))
    finally:
        targets.stop()
    spec = ", ".join(f"{k}={v}" for k, v in MODEL_SPEC.items())
    print(f"\ntiny MoE ({spec}); prompts ~{a.prompt_tokens} tokens, {a.max_new_tokens} new; concurrency "
          f"{a.concurrency}; every {a.disconnect_every}th client leaves mid-request; every {a.check_every}th answer vs "
          f"transformers; {os.cpu_count()} CPUs\n")
    print(table(reports))
    for r in reports:
        for kind, msg in r.first_error.items():
            print(f"\n{r.target}: first {kind}:\n{msg}")
    bad = sum(sum(r.errors.values()) + r.mismatched_sets + r.hung for r in reports)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
