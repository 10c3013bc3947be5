"""rr's routing counters (``rr_server.serving.routing_metrics``) without a server: what each sample moves, the
error label, the vLLM patch's own reply path refusing a sample, a second copy of the module, and no prometheus_client.

The real servers: ``tests/vllm/test_engine_metrics.py`` (vLLM's /metrics), the compiled-CPU refusal test, and
``tests/sglang/test_engine_metrics.py`` (SGLang's multiprocess /metrics).
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import REGISTRY

from rr_client.core.codec import check_routing, routing_error_fields, routing_meta_fields
from rr_client.core.errors import ShapeMismatchError, UnrecordedRoutingError
from rr_client.core.info import RRInfo
from rr_server.serving import routing_metrics
from tests.support.deadlines import STARTUP_TIMEOUT_S

INFO = RRInfo.from_hf_config(
    {"num_hidden_layers": 2, "num_experts": 300, "num_experts_per_tok": 2}, engine="vllm", engine_version="test"
)
GOOD = np.array([[[1, 299], [3, 4]]] * 4)  # prompt 3 + completion 2 - 1 = 4 rows


def _value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _snapshot() -> dict[tuple[str, str, str], float]:
    out = {}
    for name, (_, label) in routing_metrics.NAMES.items():
        for fam in REGISTRY.collect():
            for s in fam.samples:
                if s.name == f"{name}_total":
                    out[(s.name, label, s.labels[label])] = s.value
    return out


def test_each_sample_moves_its_counters_by_what_it_carries() -> None:
    checked = check_routing(GOOD, INFO, rows=4)
    npy, sglang = routing_meta_fields(checked), routing_meta_fields(checked, "sglang")
    before = _snapshot()
    routing_metrics.count_sample(npy)
    routing_metrics.count_sample(sglang)
    routing_metrics.count_sample(routing_error_fields(ShapeMismatchError("routing has 7 rows, expected 8")))
    routing_metrics.count_sample(routing_error_fields(UnrecordedRoutingError("all-zero")))
    routing_metrics.count_sample(
        {"routed_experts_ref": {"key": "k"}, "routed_experts_shape": [4, 2, 2], "routed_experts_format": "ref"}
    )
    routing_metrics.count_sample(None)  # a request that did not ask
    routing_metrics.count_answer({"choices": [npy, {"text": "no rr fields"}], "usage": {}})
    after = _snapshot()
    moved = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    assert moved == {
        ("rr_routing_samples_total", "format", "npy"): 2,
        ("rr_routing_rows_total", "format", "npy"): 8,
        ("rr_routing_bytes_total", "format", "npy"): 2 * len(npy["routed_experts"]),
        ("rr_routing_samples_total", "format", "sglang"): 1,
        ("rr_routing_rows_total", "format", "sglang"): 4,
        ("rr_routing_bytes_total", "format", "sglang"): len(sglang["routed_experts"]),
        ("rr_routing_refused_total", "error", "ShapeMismatchError"): 1,
        ("rr_routing_refused_total", "error", "UnrecordedRoutingError"): 1,
        ("rr_routing_samples_total", "format", "ref"): 1,
        ("rr_routing_rows_total", "format", "ref"): 4,
    }


@pytest.mark.parametrize(
    "why,label",
    [
        ("ShapeMismatchError: routing has 7 rows, expected 8", "ShapeMismatchError"),
        ("ExpertIdOutOfRangeError: id 300", "ExpertIdOutOfRangeError"),
        ("upstream went away", "MissingRoutingError"),  # names no routing error: what the client raises
        ("ValueError: not rr's", "MissingRoutingError"),
    ],
)
def test_error_label_is_the_class_the_client_raises(why: str, label: str) -> None:
    assert routing_metrics.refusal_class(why) == label


def test_vllm_reply_path_counts_a_refused_sample() -> None:
    """The vLLM patch's own reply builder (``_items_for``): a sample whose rows fail the check is counted refused."""
    pytest.importorskip("vllm")
    from rr_patches.vllm.routes import _items_for
    from rr_server.serving.generate_protocol import parse_generate_request

    req = parse_generate_request({"input_ids": [7, 8, 9], "return_routed_experts": True})
    c = SimpleNamespace(
        index=0,
        text="",
        token_ids=[1, 2, 3],
        logprobs=None,
        finish_reason="length",
        stop_reason=None,
        routed_experts=GOOD,
    )  # 4 rows where 3 + 3 - 1 = 5 are due
    ro = SimpleNamespace(outputs=[c], prompt_token_ids=[7, 8, 9], num_cached_tokens=0)
    before = _value("rr_routing_refused_total", error="ShapeMismatchError")
    (item,) = _items_for(ro, req, 0, "rid", 0.0, INFO)
    assert item["meta_info"]["routed_experts_error"].startswith("ShapeMismatchError")
    assert _value("rr_routing_refused_total", error="ShapeMismatchError") == before + 1


def test_a_second_copy_of_the_module_reuses_the_registered_counters() -> None:
    routing_metrics.declare()
    before = _value("rr_routing_samples_total", format="npy")
    again = importlib.reload(routing_metrics)  # what a re-entrant patch or a second import path does
    try:
        again.count_sample(routing_meta_fields(check_routing(GOOD, INFO, rows=4)))
        assert _value("rr_routing_samples_total", format="npy") == before + 1
    finally:
        importlib.reload(routing_metrics)


def test_without_prometheus_client_counting_is_a_no_op() -> None:
    code = (
        "import logging, sys\n"
        "sys.modules['prometheus_client'] = None\n"
        "logging.basicConfig(level=logging.DEBUG, format='%(name)s %(message)s')\n"
        "from rr_server.serving import routing_metrics as m\n"
        "m.declare()\n"
        "m.count_sample({'routed_experts': 'AAAA', 'routed_experts_shape': [1, 1, 1]})\n"
        "m.count_sample({'routed_experts': None, 'routed_experts_error': 'ShapeMismatchError: x'})\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=STARTUP_TIMEOUT_S)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    assert out.stderr.count("prometheus_client is not installed") == 1, out.stderr
