"""Soak: thousands of long-routing requests against the patched vLLM server and the sidecar, memory watched.

Two targets on loopback, each a real vLLM CPU server of a tiny MoE: the rr-patched server (``rr-server launch
vllm``), and the sidecar (``rr-server proxy``) in front of an unpatched vLLM. A bounded mix at ``--concurrency``:
``/generate`` single and batched, OpenAI ``/v1/completions`` with rr's fields, 2-turn ``Trajectory`` rollouts, and
clients that disconnect mid-request. Every answer passes the client's full check; a sample of them is compared
with transformers' router top-k (sets per row and MoE layer). Resident memory of each server's process tree is
read at start, after warm-up and at the end.

    python benchmarks/soak.py --requests 2000 --concurrency 16 --tokens 3072 --duration-limit 600

The tiny model uses RoPE, so its checkpoint's position limit is raised (:func:`soak_model`) to let prompts of
several thousand tokens through (``--max-model-len``, default 8192). A (row, MoE layer) whose top-k set differs from
transformers' counts as a mismatch unless it is a near-tie: every expert vLLM chose has a transformers router
probability within ``rr_server.doctor.truth.NEAR_TIE`` of the k-th largest (the doctor's own rule); those are
counted apart, with their largest gap.

Progress goes to stderr while a target runs: a tqdm bar on a terminal, a plain line every ``--progress-every`` units
otherwise (a log, CI). ``--plot PATH`` (default ``soak_memory.png``; needs ``pip install 'rr-replay[plot]'``) draws
each target's resident memory against units done; ``--plot ''`` draws nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rr_client import RoutedExpertsClient  # noqa: E402 - after the repo is put on sys.path
from rr_client.core.errors import RRError  # noqa: E402

MODEL_SPEC = {"arch": "qwen3_moe", "num_layers": 3, "num_experts": 16, "topk": 4, "mlp_only_layers": (1,)}
MOE_LAYERS = [0, 2]
PLOT_SIZE = (8.0, 4.0)  # inches; at PLOT_DPI: 800 x 400 pixels
PLOT_DPI = 100


def soak_model(model_dir: str | Path, positions: int = 8192) -> Path:
    """The soak's tiny Qwen3-MoE (``MODEL_SPEC``), with its position limit raised to ``positions`` (RoPE: no table)."""
    from rr_server.demo.tiny_moe import build_tiny_moe

    out = build_tiny_moe(model_dir, **MODEL_SPEC)  # type: ignore[arg-type]
    for name, key in (("config.json", "max_position_embeddings"), ("tokenizer_config.json", "model_max_length")):
        path = out / name
        cfg = json.loads(path.read_text())
        if cfg.get(key) != positions:
            cfg[key] = positions
            path.write_text(json.dumps(cfg, indent=2))
    return out


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
    mismatched_sets: int = 0  # beyond near-ties, plus every row missing or extra (partial routing)
    near_ties: int = 0  # differing sets where vLLM's choice is a top-k within NEAR_TIE of transformers' k-th
    max_tie_gap: float = 0.0
    first_mismatch: str = ""
    hung: int = 0
    seconds: float = 0.0
    stopped_at_limit: bool = False
    rss_mb: dict[str, dict[str, float]] = field(default_factory=dict)  # process -> stage -> MiB
    samples: list[tuple[int, float]] = field(default_factory=list)  # (units done, total MiB) during the run
    warmup: int = 0  # units before the "after warm-up" reading

    def total_rss(self, stage: str) -> float:
        """All of the target's processes at ``stage`` (MiB)."""
        return sum(v.get(stage, 0.0) for v in self.rss_mb.values())

    def growth(self, proc: str | None = None) -> float:
        """Resident memory growth from after warm-up to the end, in % (all processes, or one)."""
        if proc is None:
            warm, end = self.total_rss("warm-up"), self.total_rss("end")
        else:
            warm, end = self.rss_mb[proc].get("warm-up", 0.0), self.rss_mb[proc].get("end", 0.0)
        return 100.0 * (end - warm) / warm if warm and end else float("nan")

    @property
    def growth_pct(self) -> float:
        return self.growth()


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


class Progress:
    """Units done against one target: a tqdm bar when ``stream`` is a terminal (and tqdm is installed), else one
    plain line every ``every`` units and at the end, so a log shows the soak moving without a bar's redraws."""

    def __init__(self, target: str, total: int, *, every: int = 100, stream: TextIO | None = None) -> None:
        from rr_client.core.optional import available

        self.target, self.total, self.every = target, total, every
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.monotonic()
        self.done, self.printed, self.rss = 0, 0, None
        self.bar = None
        if self.stream.isatty() and available("tqdm"):
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=target, unit="unit", file=self.stream, dynamic_ncols=True)

    def update(self, done: int, rss_mb: float | None = None) -> None:
        """``done`` units finished so far; ``rss_mb``: the latest memory reading, if one was just taken."""
        step, self.done = done - self.done, done
        if rss_mb is not None:
            self.rss = rss_mb
        if self.bar is not None:
            self.bar.update(step)
            if rss_mb is not None:
                self.bar.set_postfix(rss_mib=f"{rss_mb:.0f}", refresh=False)
        elif self.every and (done % self.every == 0 or done == self.total):
            self._print()

    def _print(self) -> None:
        print(self.line(), file=self.stream, flush=True)
        self.printed = self.done

    def line(self) -> str:
        """``target: done/total units, seconds, units/s[, RSS]``."""
        secs = time.monotonic() - self.t0
        rss = f", RSS {self.rss:.0f} MiB" if self.rss is not None else ""
        return (
            f"{self.target}: {self.done}/{self.total} units, {secs:.0f}s, "
            f"{self.done / max(secs, 1e-9):.1f} units/s{rss}"
        )

    def close(self) -> None:
        """Close the bar, or print the last line if the run stopped short of ``total`` (``--duration-limit``)."""
        if self.bar is not None:
            self.bar.close()
        elif self.every and self.printed != self.done:
            self._print()


def _prompt(i: int, n: int, vocab: int = 440) -> list[int]:
    """A distinct token-id prompt of ``n`` tokens (no prefix shared between requests beyond chance)."""
    rng = np.random.default_rng(1_000_003 * (i + 1))
    return [int(t) for t in rng.integers(2, vocab, size=n)]


class Checker:
    """Compares a sample of answers with transformers' router top-k (in a worker thread, off the event loop)."""

    def __init__(self, model_dir: Path, every: int) -> None:
        self.model_dir, self.every, self.n = model_dir, every, 0
        self.lock = asyncio.Lock()  # one transformers forward at a time (2 threads racing transformers' lazy
        # imports once raised AttributeError: module 'transformers' has no attribute 'AutoModelForCausalLM')

    async def load(self) -> None:
        """Load the transformers model once, before any request (in a worker thread)."""
        from rr_server.demo.tiny_moe import load_model

        await asyncio.to_thread(load_model, self.model_dir)

    async def check(self, report: SoakReport, tokens: list[int], routing: np.ndarray | None) -> None:
        """Every ``every``-th answer: its rows (one per token but the last) against transformers' router."""
        self.n += 1
        if routing is None or self.n % self.every:
            return
        async with self.lock:
            rows, bad, ties, gap, first = await asyncio.to_thread(
                compare_with_transformers, self.model_dir, tokens, routing
            )
        report.checked_rows += rows
        report.mismatched_sets += bad
        report.near_ties += ties
        report.max_tie_gap = max(report.max_tie_gap, gap)
        if first and not report.first_mismatch:
            report.first_mismatch = first


def compare_with_transformers(
    model_dir: Path, tokens: list[int], routing: np.ndarray
) -> tuple[int, int, int, float, str]:
    """``(rows, mismatched sets, near-ties, largest near-tie gap, first mismatch)`` of ``routing`` for ``tokens``.

    ``routing`` must have exactly ``len(tokens) - 1`` rows: each missing or extra row counts as a mismatch on
    every MoE layer (partial routing). A differing set is a near-tie when every expert it holds has a transformers
    router probability within ``NEAR_TIE`` of the k-th largest (vLLM's batched forward may break such a tie the
    other way); anything else is a mismatch.
    """
    import torch

    from rr_client.trainer.router_reference import router_forward
    from rr_server.demo.tiny_moe import load_model
    from rr_server.doctor.truth import NEAR_TIE

    want = len(tokens) - 1
    bad = abs(routing.shape[0] - want) * len(MOE_LAYERS)
    n = min(routing.shape[0], want)
    _, logits = router_forward(load_model(model_dir), tokens[:n], MOE_LAYERS)
    ties, gap, first = 0, 0.0, ""
    for layer in MOE_LAYERS:
        probs = torch.softmax(logits[layer], -1).numpy()
        k = routing.shape[2]
        kth = np.sort(probs, axis=-1)[:, ::-1][:, k - 1]
        ref = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
        got = routing[:n, layer, :].astype(np.int64)
        differ = np.any(np.sort(got, -1) != np.sort(ref, -1), axis=-1)
        for row in np.flatnonzero(differ):
            chosen = probs[row, got[row]]
            worst = float(kth[row] - chosen.min())
            if (
                got[row].min() >= 0
                and got[row].max() < probs.shape[1]
                and len(set(got[row].tolist())) == k
                and worst < NEAR_TIE
            ):
                ties += 1
                gap = max(gap, worst)
            else:
                bad += 1
                first = first or (
                    f"row {row} layer {layer}: vLLM {sorted(got[row].tolist())} vs transformers "
                    f"{sorted(ref[row].tolist())} (k-th prob {kth[row]:.6f}, vLLM's lowest "
                    f"{chosen.min():.6f})"
                )
    return n, bad, ties, gap, first


async def _one(
    client: RoutedExpertsClient, i: int, report: SoakReport, checker: Checker, prompt_tokens: int, max_new: int
) -> None:
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
        batch = await client.complete(
            _prompt(i, prompt_tokens), {"max_tokens": max_new, "temperature": 0.0, "ignore_eos": True}
        )
        for r in batch.results:
            await checker.check(report, [*r.prompt_ids, *r.output_ids], r.routed_experts)
    else:
        traj = client.trajectory(_prompt(i, prompt_tokens // 2))
        await traj.generate(params)
        traj.extend(_prompt(i + 2 * 10**6, 16))
        await traj.generate(params)
        await checker.check(report, list(traj.input_ids), traj.routed_experts)


async def soak(
    url: str,
    model_dir: Path,
    *,
    target: str,
    requests: int,
    concurrency: int,
    prompt_tokens: int,
    max_new: int,
    disconnect_every: int = 25,
    check_every: int = 10,
    timeout: float = 300.0,
    pids: dict[str, int] | None = None,
    warmup: int = 32,
    duration_limit: float | None = None,
    sample_every: int = 100,
    progress: Progress | None = None,
) -> SoakReport:
    """Run the mix against ``url``; every unit ends ok, disconnected (by us), or with its error counted by type.

    ``pids``: process name -> pid whose process tree's RSS is read at start, after the ``warmup`` units, every
    ``sample_every`` units and at the end. ``duration_limit``: no unit starts after that many seconds (those begun
    finish; ``stopped_at_limit`` says so). A unit that outlives ``timeout`` + 30 s counts as hung. ``progress``
    hears of every unit done (and of each memory reading).
    """
    report = SoakReport(target=target, warmup=warmup)
    checker = Checker(model_dir, check_every)
    await checker.load()
    pids = pids or {}

    def rss(stage: str) -> None:
        for name, pid in pids.items():
            report.rss_mb.setdefault(name, {})[stage] = tree_rss_mb(pid)

    async with RoutedExpertsClient(url, max_concurrency=concurrency, timeout=timeout, retries=0) as client:
        rss("start")
        sem = asyncio.Semaphore(concurrency)
        deadline = time.monotonic() + duration_limit if duration_limit else float("inf")
        done = [0]

        async def unit(i: int) -> None:
            async with sem:
                if time.monotonic() > deadline:
                    report.stopped_at_limit = True
                    return
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
                except TimeoutError:
                    report.hung += 1
                    work.cancel()
                except RRError as e:
                    report.errors[type(e).__name__] += 1
                    report.first_error.setdefault(type(e).__name__, f"request {i} (kind {i % 4}): {e}")
                except Exception as e:  # noqa: BLE001 - counted by type: the soak's goal is 0 of them
                    import traceback

                    report.errors[f"untyped {type(e).__name__}"] += 1
                    report.first_error.setdefault(
                        f"untyped {type(e).__name__}", f"request {i} (kind {i % 4}): " + traceback.format_exc(limit=-6)
                    )
                done[0] += 1
                sampled = None
                if pids and sample_every and done[0] % sample_every == 0:
                    sampled = sum(tree_rss_mb(p) for p in pids.values())
                    report.samples.append((done[0], sampled))
                if progress is not None:
                    progress.update(done[0], sampled)

        await asyncio.gather(*(unit(i) for i in range(warmup)))
        rss("warm-up")
        t0 = time.perf_counter()
        await asyncio.gather(*(unit(i) for i in range(warmup, warmup + requests)))
        report.seconds = time.perf_counter() - t0
        rss("end")
        # still serving after the disconnects
        await client.generate([_prompt(7, 32)], {"max_new_tokens": 2})
    return report


def table(reports: list[SoakReport]) -> str:
    """Markdown tables of the runs: outcomes, then resident memory per process."""
    rows = [
        (
            "| target | units | ok | disconnected | errors | hung | sampled rows vs transformers | mismatched sets "
            "| near-ties (largest gap) | units/s |"
        ),
        "|" + "---|" * 10,
    ]
    for r in reports:
        errs = ", ".join(f"{k} {v}" for k, v in r.errors.items()) or "0"
        rows.append(
            f"| {r.target} | {r.requests}{' (time limit)' if r.stopped_at_limit else ''} | {r.ok} "
            f"| {r.disconnected} | {errs} | {r.hung} | {r.checked_rows:,} | {r.mismatched_sets} "
            f"| {r.near_ties} ({r.max_tie_gap:.1e}) | {r.requests / max(r.seconds, 1e-9):.1f} |"
        )
    rows += [
        "",
        "| target | process (tree) | RSS MiB start | after warm-up | end | growth after warm-up |",
        "|" + "---|" * 6,
    ]
    for r in reports:
        for proc, st in r.rss_mb.items():
            rows.append(
                f"| {r.target} | {proc} | {st.get('start', 0):.0f} | {st.get('warm-up', 0):.0f} "
                f"| {st.get('end', 0):.0f} | {r.growth(proc):+.2f}% |"
            )
        if len(r.rss_mb) > 1:
            rows.append(
                f"| {r.target} | all | {r.total_rss('start'):.0f} | {r.total_rss('warm-up'):.0f} "
                f"| {r.total_rss('end'):.0f} | {r.growth():+.2f}% |"
            )
    return "\n".join(rows)


def plot_memory(reports: list[SoakReport], path: Path, *, title: str = "") -> Path:
    """PNG of each target's resident memory (all its processes) against units done, the warm-up marked."""
    from rr_client.core.optional import require

    mpl = require("matplotlib", for_what="the soak's --plot")
    mpl.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=PLOT_SIZE, dpi=PLOT_DPI)
    for r in reports:
        points = [(0, r.total_rss("start"))] if r.total_rss("start") else []
        points += r.samples
        if not points:
            continue
        ax.plot(
            [n for n, _ in points],
            [mb for _, mb in points],
            marker=".",
            label=f"{r.target} ({r.growth():+.1f}% after warm-up)",
        )
    warmups = {r.warmup for r in reports if r.warmup}
    for w in warmups:
        ax.axvline(w, color="grey", linestyle=":", linewidth=1)
    if warmups:
        ax.text(
            min(warmups), 0.02, " end of warm-up", color="grey", fontsize="small", transform=ax.get_xaxis_transform()
        )
    ax.set(
        xlabel="units done (requests, batches, trajectories)",
        ylabel="resident memory, MiB (process trees)",
        title=title or "soak: resident memory of each target",
    )
    ax.title.set_fontsize("medium")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)
    return path


class Targets:
    """The two targets: rr-patched vLLM, and the sidecar in front of an unpatched vLLM (processes, loopback)."""

    def __init__(self, model_dir: Path, max_model_len: int, log_dir: Path) -> None:
        from rr_server.launch.process import free_port
        from rr_server.launch.vllm import build_command, is_cpu_platform

        self.model_dir, self.log_dir = model_dir, log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        base = [
            "--model",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--max-model-len",
            str(max_model_len),
            "--served-model-name",
            "soak",
        ]
        self.patched_port, self.vanilla_port, self.sidecar_port = free_port(), free_port(), free_port()
        env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
        self.patched = self._spawn(
            [sys.executable, "-m", "rr_server.cli", "launch", "vllm", *base, "--port", str(self.patched_port)],
            env,
            "patched.log",
        )
        vanilla_cmd, _ = build_command([*base, "--port", str(self.vanilla_port)], cpu=is_cpu_platform())
        self.vanilla = self._spawn(vanilla_cmd, {**env, "VLLM_PLUGINS": "", "RR_ENABLE": "0"}, "vanilla.log")
        self.sidecar: subprocess.Popen[bytes] | None = None

    def _spawn(self, cmd: list[str], env: dict[str, str], log: str) -> subprocess.Popen[bytes]:
        with open(self.log_dir / log, "ab") as fh:
            return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)

    @property
    def patched_url(self) -> str:
        return f"http://127.0.0.1:{self.patched_port}"

    @property
    def sidecar_url(self) -> str:
        return f"http://127.0.0.1:{self.sidecar_port}"

    def wait(self, timeout: float = 600) -> None:
        """Both engines healthy, then the sidecar started and healthy."""
        from rr_server.launch.process import wait_healthy

        wait_healthy(self.patched_url, self.patched, self.log_dir / "patched.log", timeout)
        vanilla_url = f"http://127.0.0.1:{self.vanilla_port}"
        wait_healthy(vanilla_url, self.vanilla, self.log_dir / "vanilla.log", timeout)
        self.sidecar = self._spawn(
            [
                sys.executable,
                "-m",
                "rr_server.cli",
                "proxy",
                "--upstream",
                vanilla_url,
                "--engine",
                "vllm",
                "--port",
                str(self.sidecar_port),
                "--model-path",
                str(self.model_dir),
            ],
            dict(os.environ),
            "sidecar.log",
        )
        wait_healthy(self.sidecar_url, self.sidecar, self.log_dir / "sidecar.log", 120)

    def stop(self) -> None:
        """SIGTERM every process group (the launcher forwards it to vLLM's)."""
        from rr_server.launch.process import stop_process_group

        for p in (self.sidecar, self.vanilla, self.patched):
            if p is not None:
                stop_process_group(p, grace=30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000, help="units per target, after the warm-up")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument(
        "--tokens",
        "--prompt-tokens",
        dest="tokens",
        type=int,
        default=3072,
        help="prompt length of a single /generate or completion (batched: 1/2 and 1/3 of it)",
    )
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--warmup", type=int, default=200, help="units per target before the 'after warm-up' RSS")
    p.add_argument("--disconnect-every", type=int, default=25)
    p.add_argument("--check-every", type=int, default=10, help="compare every Nth answer with transformers")
    p.add_argument(
        "--duration-limit", type=float, default=1800, help="seconds per target at most (then it stops starting units)"
    )
    p.add_argument("--model-dir", default=str(REPO / ".cache" / "bench-soak-qwen3-moe"))
    p.add_argument("--sample-every", type=int, default=100, help="read the memory every N units")
    p.add_argument("--progress-every", type=int, default=100, help="without a terminal: a progress line every N units")
    p.add_argument("--plot", default="soak_memory.png", help="PNG of memory against units done ('' = none)")
    a = p.parse_args(argv)

    if a.tokens + 2 * a.max_new_tokens + 16 > a.max_model_len:
        p.error("--tokens: prompt + new tokens of a 2-turn trajectory must fit --max-model-len")
    if a.plot:  # before the servers start, not after the run
        from rr_client.core.optional import require

        require("matplotlib", for_what="the soak's --plot")
    model = soak_model(a.model_dir, a.max_model_len)
    targets = Targets(model, a.max_model_len, REPO / ".cache" / "soak-logs")
    reports = []
    try:
        targets.wait()
        assert targets.sidecar is not None
        for name, url, pids in (
            (
                "patched vLLM",
                targets.patched_url,
                {"rr-server launch vllm (launcher, API server, EngineCore)": targets.patched.pid},
            ),
            (
                "sidecar + unpatched vLLM",
                targets.sidecar_url,
                {
                    "rr-server proxy": targets.sidecar.pid,
                    "unpatched vLLM (API server, EngineCore)": targets.vanilla.pid,
                },
            ),
        ):
            progress = Progress(name, a.warmup + a.requests, every=a.progress_every)
            try:
                reports.append(
                    asyncio.run(
                        soak(
                            url,
                            model,
                            target=name,
                            requests=a.requests,
                            concurrency=a.concurrency,
                            prompt_tokens=a.tokens,
                            max_new=a.max_new_tokens,
                            disconnect_every=a.disconnect_every,
                            check_every=a.check_every,
                            pids=pids,
                            warmup=a.warmup,
                            duration_limit=a.duration_limit,
                            sample_every=a.sample_every,
                            progress=progress,
                        )
                    )
                )
            finally:
                progress.close()
            print(f"{name}: done in {reports[-1].seconds:.0f}s", flush=True)
    finally:
        targets.stop()
    spec = ", ".join(f"{k}={v}" for k, v in MODEL_SPEC.items())
    print(
        f"\ntiny MoE ({spec}), max-model-len {a.max_model_len}; prompts ~{a.tokens} tokens, {a.max_new_tokens} new "
        f"per turn; {a.warmup} warm-up units, then up to {a.requests} per target; concurrency {a.concurrency}; every "
        f"{a.disconnect_every}th client leaves mid-request; every {a.check_every}th answer vs transformers; "
        f"{os.cpu_count()} CPUs\n"
    )
    print(table(reports))
    for r in reports:
        print(
            f"\n{r.target}: RSS MiB (all processes) every {a.sample_every} units: "
            + ", ".join(f"{n}: {mb:.0f}" for n, mb in r.samples)
        )
        for kind, msg in r.first_error.items():
            print(f"\n{r.target}: first {kind}:\n{msg}")
        if r.first_mismatch:
            print(f"\n{r.target}: first mismatch: {r.first_mismatch}")
    if a.plot:
        title = (
            f"soak: tiny {MODEL_SPEC['arch']} ({MODEL_SPEC['num_experts']} experts, top-{MODEL_SPEC['topk']}), "
            f"prompts ~{a.tokens} tokens, concurrency {a.concurrency}"
        )
        print(f"\nmemory plot: {plot_memory(reports, Path(a.plot), title=title)}")
    bad = sum(sum(r.errors.values()) + r.mismatched_sets + r.hung for r in reports)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
