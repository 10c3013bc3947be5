"""SGLang test session: refuse to run against a missing/wrong SGLang, build the tiny MoE once, patch on request.

Run through ``scripts/test_sglang.sh`` (it installs each version and sets RR_SGLANG_VERSION). Under the
main ``pytest`` without SGLang importable, the SGLang-marked tests are deselected (not skipped) and the
remaining vLLM Dockerfile test still runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.versions import deselect, imported_version

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("RR_TEST_CACHE", REPO / ".cache" / "rr-test-models"))
WANT = os.environ.get("RR_SGLANG_VERSION", "")
MODEL_SPEC: dict[str, Any] = dict(arch="qwen3_moe", num_layers=3, num_experts=8, topk=2, mlp_only_layers=(1,))
HAVE = imported_version("sglang")


def pytest_configure(config: pytest.Config) -> None:
    """Fail the session loudly when test_sglang.sh asked for a version that is not what imports."""
    if WANT and HAVE != WANT:
        raise pytest.UsageError(f"RR_SGLANG_VERSION={WANT} but the importable sglang is {HAVE!r}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without SGLang (the main venv), deselect the tests that need it; with it, run everything."""
    if HAVE is None:
        deselect(config, items, lambda i: i.get_closest_marker("sglang") is not None)
        return

    have = tuple(int(x) for x in HAVE.split(".")[:3])

    def release(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split("."))

    def other_release(item: pytest.Item) -> bool:
        """``@pytest.mark.sglang_releases(...)``: a slow test whose SGLang code is the same in every release runs on
        the releases it names (the oldest and newest), not 17 times; ``sglang_since(v)`` / ``sglang_before(v)``: a
        test of what exists only from release ``v`` on / only before it (deselected elsewhere, never skipped)."""
        marker = item.get_closest_marker("sglang_releases")
        since, before = item.get_closest_marker("sglang_since"), item.get_closest_marker("sglang_before")
        return (
            (marker is not None and HAVE not in marker.args)
            or (since is not None and have < release(since.args[0]))
            or (before is not None and have >= release(before.args[0]))
        )

    deselect(config, items, other_release)


@pytest.fixture(scope="session")
def tiny_moe() -> Path:
    """Tiny Qwen3-MoE (3 layers, layer 1 dense, 8 experts, top-2) built locally with rr_server.demo.tiny_moe."""
    from rr_server.demo.tiny_moe import build_tiny_moe

    return build_tiny_moe(CACHE / "sglang-qwen3-dense", **MODEL_SPEC)


@pytest.fixture(autouse=True)
def _close_harnesses() -> Iterator[None]:
    """Tear down every SGLang harness a test built, so no zmq context blocks at garbage collection."""
    yield
    if HAVE is not None:
        from tests.sglang.harness import close_all

        close_all()


@pytest.fixture()
def patched() -> Iterator[None]:
    """rr's patch installed on TokenizerManager for one test (exactly as the launcher does), then removed."""
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    from rr_patches.sglang.apply import TARGETS, apply
    from rr_patches.sglang.detok import DETOK_METHOD

    saved = {name: TokenizerManager.__dict__[name] for name in TARGETS}
    saved_getitem = GenerateReqInput.__dict__["__getitem__"]
    saved_detok = DetokenizerManager.__dict__[DETOK_METHOD]  # wrapped too on 0.5.22+
    apply()
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(TokenizerManager, name, fn)
        GenerateReqInput.__getitem__ = saved_getitem  # type: ignore[method-assign]
        setattr(DetokenizerManager, DETOK_METHOD, saved_detok)
