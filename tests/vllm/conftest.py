"""Session fixtures for tests/vllm: tiny MoE checkpoints and real vLLM CPU servers (``rr-server launch vllm``).

Only this folder starts vLLM, so the pool lives here. Servers start lazily (only when a test asks for
one), every server the session will need at once to overlap their ~30-80 s startups, on free
127.0.0.1 ports, and are stopped by process group at session end (tests.support.vllm_process).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.vllm_process import CACHE, VLLMProcess
from tests.vllm.tiny_mtp import MTP_CONFIG, build_tiny_glm4_mtp

# Two architectures: Qwen3-MoE with a dense middle layer (uint8 path) and a >256-expert
# Mixtral (uint16 path).
MODEL_SPECS: dict[str, dict[str, Any]] = {
    "qwen3_dense": dict(arch="qwen3_moe", num_layers=3, num_experts=8, topk=2, mlp_only_layers=(1,)),
    "mixtral_300": dict(arch="mixtral", num_layers=2, num_experts=300, topk=4),
}

# n-gram speculative decoding (3 draft tokens) on the Qwen3 checkpoint. Stock vLLM 0.30 CPU dies on the first
# verified draft: its CPU runner never points the rejection sampler's dispatchers at its own CPU kernels.
# cpu_spec_decode_fix/ (a PYTHONPATH sitecustomize in every vLLM process) re-points them; every kernel is vLLM's.
NGRAM_CONFIG = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
CPU_SPEC_DECODE_FIX = Path(__file__).with_name("cpu_spec_decode_fix")

_SPEC_FIX_PATH = os.pathsep.join(p for p in (str(CPU_SPEC_DECODE_FIX), os.environ.get("PYTHONPATH")) if p)

# Servers that are not one model each: the checkpoint they serve and their extra launch arguments.
# glm4_mtp: a GLM-4.5-style checkpoint with one MTP layer (tests/vllm/tiny_mtp.py), drafting with it.
SERVER_MODEL: dict[str, str] = {"qwen3_ngram": "qwen3_dense"}
SERVER_EXTRA: dict[str, list[str]] = {
    "qwen3_ngram": ["--speculative-config", json.dumps(NGRAM_CONFIG)],
    "glm4_mtp": ["--speculative-config", json.dumps(MTP_CONFIG)],
}

# The 300-expert server builds every routed reply in a worker thread (the path large payloads take).
SERVER_ENV: dict[str, dict[str, str]] = {
    "mixtral_300": {"RR_ENCODE_THREAD_MIN_ELEMS": "0"},
    "qwen3_ngram": {"PYTHONPATH": _SPEC_FIX_PATH},
    "glm4_mtp": {"PYTHONPATH": _SPEC_FIX_PATH},
}


# The fixtures that are one pool server each: fixture -> (server, what it serves).
SERVED: dict[str, tuple[str, str]] = {
    "qwen_server": ("qwen3_dense", "Qwen3-MoE server (8 experts, top-2, layer 1 dense)."),
    "mixtral_server": ("mixtral_300", "Mixtral server with 300 experts, top-4 (uint16 wire dtype)."),
    "ngram_server": ("qwen3_ngram", "The Qwen3-MoE checkpoint served with n-gram speculative decoding (NGRAM_CONFIG)."),
    "mtp_server": ("glm4_mtp", "The GLM-4.5-style checkpoint served with its MTP layer drafting (MTP_CONFIG)."),
}


def start_server(name: str, model_dir: Path, *, core: int) -> VLLMProcess:
    """Launch one rr-plugin server (non-blocking); ``VLLMProcess.wait_healthy`` waits for it."""
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get(
            "VLLM_CPU_OMP_THREADS_BIND", str(core % max(1, os.cpu_count() or 1))
        ),
        "RR_TEST_FAULTS": "1",  # tests/vllm/test_source_audit.py: faults on requests that ask (rid), none otherwise
        **SERVER_ENV.get(name, {}),
    }
    return VLLMProcess(model_dir, name=name, plugin=True, env=env, extra=SERVER_EXTRA.get(name, ())).launch()


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, Path]:
    """Build (or reuse from .cache/) the tiny checkpoints used by the e2e tests."""
    from rr_server.demo.tiny_moe import build_tiny_moe

    models = {name: build_tiny_moe(CACHE / name, **spec) for name, spec in MODEL_SPECS.items()}
    return {**models, "glm4_mtp": build_tiny_glm4_mtp(CACHE / "glm4_mtp", models["qwen3_dense"])}


class ServerPool:
    """Starts tiny-model servers on first use; every server this session will need starts together."""

    def __init__(self, models: dict[str, Path], needed: set[str]) -> None:
        self.models = models
        self.needed = needed
        self.servers: dict[str, VLLMProcess] = {}
        self.healthy: set[str] = set()

    def get(self, name: str) -> VLLMProcess:
        """The healthy server for ``name``, starting it (and its session peers) if needed."""
        if name not in self.servers:
            for i, other in enumerate(sorted(self.needed | {name})):
                if other not in self.servers:
                    model = self.models[SERVER_MODEL.get(other, other)]
                    self.servers[other] = start_server(other, model, core=i)
        server = self.servers[name]
        if name not in self.healthy:
            server.wait_healthy()
            self.healthy.add(name)
        return server

    def stop_all(self) -> None:
        """Stop every server this pool started."""
        for s in self.servers.values():
            s.stop()


def _needed_models(session: pytest.Session) -> set[str]:
    """Which tiny-model servers the collected tests will use."""
    names: set[str] = set()
    for item in session.items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & {"any_server", "vllm_servers"}:
            names |= set(MODEL_SPECS)
        names |= {SERVED[f][0] for f in fixtures & SERVED.keys()}
    return names


@pytest.fixture(scope="session")
def server_pool(request: pytest.FixtureRequest, tiny_models: dict[str, Path]) -> Iterator[ServerPool]:
    """Lazily started vLLM servers (at most one per tiny model); stopped at session end."""
    pool = ServerPool(tiny_models, _needed_models(request.session))
    try:
        yield pool
    finally:
        pool.stop_all()


@pytest.fixture(scope="session")
def vllm_servers(server_pool: ServerPool) -> dict[str, VLLMProcess]:
    """Every tiny-model server, healthy."""
    return {name: server_pool.get(name) for name in MODEL_SPECS}


def _served(fixture: str) -> Any:
    """The session fixture ``fixture``: the pool's healthy server of its entry in :data:`SERVED`."""
    name, doc = SERVED[fixture]

    def served(server_pool: ServerPool) -> VLLMProcess:
        return server_pool.get(name)

    served.__doc__ = doc
    return pytest.fixture(scope="session", name=fixture)(served)


qwen_server = _served("qwen_server")
mixtral_server = _served("mixtral_server")
ngram_server = _served("ngram_server")
mtp_server = _served("mtp_server")


@pytest.fixture(scope="session", params=list(MODEL_SPECS))
def any_server(request: pytest.FixtureRequest, server_pool: ServerPool) -> VLLMProcess:
    """Each architecture's server in turn."""
    return server_pool.get(request.param)
