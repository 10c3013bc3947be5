"""A local Ray cluster for tests/ray, started by the test session itself (CPU only, loopback)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A one-node Ray cluster this process started; yields its GCS address (engine servers join it there).

    Shut down after the module, and the environment restored (``ray.init`` exports ``RAY_ADDRESS``, which every
    later child process, vLLM servers included, would inherit and join)."""
    import os

    import ray

    saved = dict(os.environ)
    for attempt in range(3):  # Ray gives its raylet 30 s to come up: on a loaded machine, try again
        try:
            ray.init(
                num_cpus=2,
                include_dashboard=False,
                namespace="rr",
                log_to_driver=False,
                _system_config={"automatic_object_spilling_enabled": False},
            )
            break
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for it
            ray.shutdown()
            if "timed out during startup" not in str(e) or attempt == 2:
                raise
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, object]:
    """The tiny checkpoint tests/vllm serves (built or reused from .cache/)."""
    from rr_server.demo.tiny_moe import build_tiny_moe
    from tests.support.vllm_process import CACHE
    from tests.vllm.conftest import MODEL_SPECS

    return {"qwen3_dense": build_tiny_moe(CACHE / "qwen3_dense", **MODEL_SPECS["qwen3_dense"])}
