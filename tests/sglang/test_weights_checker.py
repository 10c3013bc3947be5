"""rr's weight sync against SGLang 0.5.23's own ``/weights_checker`` (issue 44): SGLang's real HTTP layer and
TokenizerManager, its scheduler-side weight code, and its WeightChecker; only the GPU model runner is stood in
(:mod:`tests.sglang.standin_weights`).

Two replicas: two harnesses (SGLang's TokenizerManager as its launcher builds it, each with its stand-in scheduler),
each served over loopback HTTP by SGLang's own app (:class:`Replica` points SGLang's module-level state at its
harness for the request). :class:`DiskWeightSync` reloads both through SGLang's ``/update_weights_from_disk`` and
``/flush_cache``, then reads ``/weights_checker``. A matching push passes and the replicas hold exactly what was
pushed (SGLang's own hash of the trainer's model); a tensor perturbed by one replica's reload, or kept by a single
engine's, fails the push with :class:`WeightSyncError` naming the engine, tensor and ranks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rr_client.core.errors import WeightSyncError
from rr_client.integrations.weight_sync import DiskWeightSync, WeightEngine
from rr_server.launch.process import free_port
from tests.sglang.harness import Harness
from tests.sglang.standin_weights import StandInWeights
from tests.support.threaded_server import ThreadedServer

pytestmark = [pytest.mark.sglang, pytest.mark.sglang_releases("0.5.23")]  # the stand-in follows 0.5.23's scheduler
GATE0, GATE2 = "model.layers.0.mlp.gate.weight", "model.layers.2.mlp.gate.weight"
RANKS = "dp0:pp0:tp0"


class Replica:
    """SGLang's app for one harness: its handlers read the module's global state, set to this harness's for the
    request (the test's calls never overlap); the TokenizerManager runs no handle loop (the stand-in answers)."""

    def __init__(self, harness: Harness, weights: StandInWeights) -> None:
        self.harness, self.weights = harness, weights
        self.state = harness.http._global_state  # what Harness set for this TokenizerManager

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.harness.http._global_state = self.state
            self.harness.tm.event_loop = asyncio.get_running_loop()
        await self.harness.http.app(scope, receive, send)


@pytest.fixture(scope="module")
def one_gpu_group() -> Iterator[None]:
    """A single-process gloo group: the tensor-parallel group of a one-GPU scheduler (SGLang's check_weights asks
    its size)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def replicas(tiny_moe: Path, one_gpu_group: None) -> Iterator[list[tuple[str, StandInWeights]]]:
    """Two SGLang replicas of the tiny MoE over loopback HTTP: ``(url, its stand-in runner's weights)`` each."""
    out, servers = [], []
    for i in range(2):
        h = Harness(tiny_moe)
        w = StandInWeights(tiny_moe)
        h.sched.weights = w
        s = ThreadedServer(Replica(h, w), name=f"sglang-replica-{i}").start()
        servers.append(s)
        out.append((s.url, w))
    try:
        yield out
    finally:
        for s in servers:
            s.stop()


@pytest.fixture
def trainer(tiny_moe: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32).eval()


def nudge(model: Any, seed: int) -> None:
    """A training step: every parameter moves a little."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-2)


def sglang_checksums(model: Any) -> dict[str, str]:
    """SGLang's own WeightChecker digests of ``model`` (what its checker computes on the engine's copy)."""
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.utils.weight_checker import WeightChecker

    with get_parallel().override(tp_rank=0, pp_rank=0, dp_rank=0):
        checker = WeightChecker(get_model=lambda: model)
    return checker.handle("checksum", role="target")["checksums"]


def engines(replicas: list[tuple[str, StandInWeights]]) -> list[WeightEngine]:
    return [WeightEngine(url, "sglang") for url, _ in replicas]


def test_matching_push_passes_and_the_replicas_hold_what_was_pushed(
    replicas: list[tuple[str, StandInWeights]], trainer: Any, tmp_path: Path
) -> None:
    with DiskWeightSync(engines(replicas), tmp_path) as sync:
        for step in (1, 2):
            nudge(trainer, step)
            sync.push(trainer, step)
            want = {f"{RANKS}:{k}": v for k, v in sglang_checksums(trainer).items()}
            for url, w in replicas:
                assert sync.engine_checksums(url) == want
                assert w.versions == [None] * step  # SGLang's manager recorded each update
            assert sorted(sync._checksums) == sorted(url for url, _ in replicas)  # both were read and compared


def test_a_replica_that_loaded_other_weights_is_named(
    replicas: list[tuple[str, StandInWeights]], trainer: Any, tmp_path: Path
) -> None:
    (_, _), (url_b, w_b) = replicas
    with DiskWeightSync(engines(replicas), tmp_path) as sync:
        nudge(trainer, 3)
        sync.push(trainer, 1)
        w_b.plant("perturb", GATE0)
        nudge(trainer, 4)
        with pytest.raises(WeightSyncError) as err:
            sync.push(trainer, 2)
    msg = str(err.value)
    assert "replicas' own weight checksums disagree" in msg and f"{url_b} differs in 1 tensor shard" in msg
    assert f"{GATE0} ({RANKS})" in msg
    assert err.value.tensors == (GATE0,) and err.value.ranks == (RANKS,) and url_b in err.value.engine


def test_one_engine_that_kept_a_tensor_is_named(
    replicas: list[tuple[str, StandInWeights]], trainer: Any, tmp_path: Path
) -> None:
    url, w = replicas[0]
    with DiskWeightSync(WeightEngine(url, "sglang"), tmp_path) as sync:
        nudge(trainer, 5)
        sync.push(trainer, 1)
        w.plant("keep", GATE2)
        nudge(trainer, 6)
        with pytest.raises(WeightSyncError) as err:
            sync.push(trainer, 2)
    assert f"{url} did not load 1 tensor(s) the trainer changed" in str(err.value)
    assert (err.value.engine, err.value.tensors, err.value.ranks) == (url, (GATE2,), (RANKS,))


def test_a_reload_that_loaded_nothing_fails_the_push(
    replicas: list[tuple[str, StandInWeights]], trainer: Any, tmp_path: Path
) -> None:
    url, w = replicas[0]
    with DiskWeightSync(WeightEngine(url, "sglang"), tmp_path) as sync:
        nudge(trainer, 7)
        sync.push(trainer, 1)
        w.plant("noop")
        nudge(trainer, 8)
        with pytest.raises(WeightSyncError, match=r"kept every one of its \d+ weight checksums since the last push"):
            sync.push(trainer, 2)


def test_a_first_push_that_loaded_nothing_fails_the_push(
    replicas: list[tuple[str, StandInWeights]], trainer: Any, tmp_path: Path
) -> None:
    """The first push has no previous one: SGLang's checksums read before its reload are the baseline, and a reload
    that kept them all fails (issue 55)."""
    url, w = replicas[0]
    with DiskWeightSync(WeightEngine(url, "sglang"), tmp_path) as sync:
        w.plant("noop")
        nudge(trainer, 11)
        with pytest.raises(WeightSyncError, match=r"kept every one of its \d+ weight checksums through the first push"):
            sync.push(trainer, 1)
        sync.push(trainer, 2)  # a clean reload moves them
