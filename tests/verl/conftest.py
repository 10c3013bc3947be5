"""verl session (scripts/test_verl.sh, in ``.venvs/verl``): verl 0.9.1's real FSDP actor engine, worker, agent-loop
layout and trainer data steps on this CPU machine, with rr's plugin installed from its ``verl.plugins`` entry point.

Under any other environment (the main ``.venv`` has no verl) every test here is deselected, not skipped;
test_sglang_read.py and the tests marked ``sglang`` are deselected unless SGLang is importable too (the script's
second run).
"""

from __future__ import annotations

import os

# every step audited here, so each test can read the audit of the step it ran (production default: every 10th)
os.environ.setdefault("RR_AUDIT_EVERY", "1")

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.versions import deselect, imported_version

HAVE = imported_version("verl")
WANT = "0.9.1"
SGLANG = imported_version("sglang")  # only in scripts/test_verl.sh's second run (SGLang 0.5.13 overlay)
MODEL_SPEC: dict[str, Any] = {
    "arch": "qwen3_moe",
    "num_layers": 3,
    "num_experts": 8,
    "topk": 2,
    "mlp_only_layers": (1,),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect this directory's tests unless verl 0.9.1 is importable; the SGLang read needs SGLang too."""
    here = str(Path(__file__).parent)
    if HAVE != WANT:
        deselect(config, items, lambda item: str(item.fspath).startswith(here))
    elif SGLANG is None:
        deselect(
            config,
            items,
            lambda item: (
                str(item.fspath).startswith(here)
                and (str(item.fspath).endswith("test_sglang_read.py") or item.get_closest_marker("sglang") is not None)
            ),
        )


@pytest.fixture(scope="session")
def verl_process() -> None:
    """The process group and CPU platform every verl test shares."""
    from tests.verl import harness

    harness.init_process()


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """Tiny Qwen3-MoE (3 layers, layer 1 dense, 8 experts, top-2) with its tokenizer."""
    from rr_server.demo.tiny_moe import build_tiny_moe
    from tests.support.vllm_process import CACHE

    return build_tiny_moe(CACHE / "verl-qwen3", **MODEL_SPEC)


@pytest.fixture(scope="session")
def hf_model(model_dir: Path) -> Any:
    """transformers' own model from the same checkpoint: the reference routing."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="session")
def workers(verl_process: None, model_dir: Path) -> Iterator[dict[tuple[str, bool], Any]]:
    """verl actor workers built on first use, keyed by (router_replay.mode, use_remove_padding[, dynamic_bsz])."""
    from tests.verl import harness

    cache: dict[tuple[str, bool], Any] = {}

    class _Workers(dict):  # type: ignore[type-arg]
        def __missing__(self, key: tuple[Any, ...]) -> Any:
            mode, rmpad, *dyn = key
            cfg = harness.ppo_config(model_dir, mode=mode, remove_padding=rmpad, dynamic_bsz=bool(dyn and dyn[0]))
            self[key] = (cfg, harness.actor_worker(cfg))
            return self[key]

    yield _Workers(cache)
