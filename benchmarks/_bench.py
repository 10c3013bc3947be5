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
