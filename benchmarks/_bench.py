"""What the benchmark scripts share: integer options by keyword, a synthetic model's RRInfo, the load's prompts, and
starting the rr-plugin vLLM CPU server (its command, environment and log). Imported as ``_bench`` (a script's own
folder is first on ``sys.path``)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def int_options(p: argparse.ArgumentParser, **defaults: int) -> None:
    """One integer option per keyword (``prompt_len=64``: ``--prompt-len``, default 64)."""
    for name, default in defaults.items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=default)


def synthetic_info(layers: int, experts: int, topk: int, *, engine: str, version: str) -> Any:
    """The RRInfo of a synthetic MoE model: every layer MoE, the wire dtype its expert count needs."""
    from rr_client import RRInfo

    return RRInfo(
        engine=engine,
        engine_version=version,
        rr_version=version,
        num_hidden_layers=layers,
        num_experts=experts,
        topk=topk,
        moe_layers=list(range(layers)),
        wire_dtype="uint8" if experts <= 256 else "uint16",
    )


def tiny_vllm_replicas(n: int, max_model_len: int) -> list[Any]:
    """``n`` vLLM CPU servers (the tests' ``VLLMProcess``) of the tiny Qwen3-MoE (3 layers, layer 1 dense, 8 experts,
    top-2), launched each on its own core (wait for each with ``wait_healthy``): a scale-out benchmark's replicas."""
    from rr_server.demo.tiny_moe import build_tiny_moe
    from tests.support.vllm_process import CACHE, VLLMProcess

    model = build_tiny_moe(
        CACHE / "qwen3_dense", arch="qwen3_moe", num_layers=3, num_experts=8, topk=2, mlp_only_layers=(1,)
    )
    cores = max(1, os.cpu_count() or 1)
    bind = [{"VLLM_CPU_OMP_THREADS_BIND": str(i % cores)} for i in range(n)]
    return [VLLMProcess(model, name="tiny-moe", max_model_len=max_model_len, env=env).launch() for env in bind]


def load_prompt(seed: int, i: int, length: int) -> list[int]:
    """Request ``i``'s prompt token ids in round ``seed`` of a load (the same ids for the same arguments)."""
    return [(seed * 131 + i * 17 + j * 7) % 400 + 2 for j in range(length)]


def rr_vllm_command(model_dir: Path, port: int, *extra: str) -> tuple[list[str], dict[str, str]]:
    """The rr launcher's vLLM command serving ``model_dir`` on 127.0.0.1:``port`` (2048-token context, ``extra``
    appended), and its environment: the rr plugin on, vLLM logging warnings only."""
    from rr_server.launch.vllm import build_command, is_cpu_platform

    args = ["--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048", *extra]
    cmd, _ = build_command(args, cpu=is_cpu_platform())
    return cmd, dict(os.environ, RR_ENABLE="1", VLLM_PLUGINS="rr", VLLM_LOGGING_LEVEL="WARNING")


def spawn(cmd: list[str], env: dict[str, str], log: Path, cwd: Path | None = None) -> subprocess.Popen[bytes]:
    """Start a process in its own group (stopped as one), its output to ``log``."""
    with open(log, "wb") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
