"""verl 0.9.1's own Megatron engine with rr's feeder (issue 45), in ``.venvs/verl`` with the megatron-core 0.16.1 + mbridge
overlay of scripts/setup_verl_megatron.sh on PYTHONPATH:

    PYTHONPATH="$(scripts/setup_verl_megatron.sh --pythonpath)" .venvs/verl/bin/python -m pytest tests/verl_megatron

Every test here is deselected, not skipped, unless verl 0.9.1 and megatron.core 0.16.x both import (megatron.core
is imported only where verl 0.9.1 is, so the main ``.venv`` pays nothing). Run it in its own pytest process: its
stand-ins are undone after the package, but verl's router-replay patch of megatron-core stays for the process.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.versions import deselect, imported_version

VERL = imported_version("verl")
WANT_VERL = "0.9.1"
MCORE = imported_version("megatron.core") if VERL == WANT_VERL else None
# mbridge's Qwen3-MoE bridge maps MoE layers only (no mlp_only_layers / moe_layer_freq): every layer is MoE
MODEL_SPEC: dict[str, Any] = {"arch": "qwen3_moe", "num_layers": 2, "num_experts": 8, "topk": 2}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect this directory's tests unless verl 0.9.1 and megatron-core 0.16.x import."""
    here = str(Path(__file__).parent)
    if VERL != WANT_VERL or MCORE is None or not MCORE.startswith("0.16."):
        deselect(config, items, lambda item: str(item.fspath).startswith(here))


@pytest.fixture(scope="package")
def megatron_verl_process() -> Iterator[None]:
    """tests/verl's one-rank gloo group and CPU platform, plus this package's stand-ins (undone after it)."""
    from tests.verl import harness as vh
    from tests.verl_megatron import harness

    vh.init_process()
    harness.install_stand_ins()
    yield
    harness.remove_stand_ins()


@pytest.fixture(scope="package")
def model_dir() -> Path:
    """Tiny Qwen3-MoE (2 MoE layers, 8 experts, top-2) with its tokenizer."""
    from rr_server.demo.tiny_moe import build_tiny_moe
    from tests.support.vllm_process import CACHE

    return build_tiny_moe(CACHE / "verl-mcore-qwen3", **MODEL_SPEC)


@pytest.fixture(scope="package")
def tokenizer(model_dir: Path) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(model_dir))
