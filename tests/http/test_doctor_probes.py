"""The doctor's cache and weight-path probes against the TEST-ONLY :class:`ProbeTestServer` (a simulated KV cache,
preemption and weight version): all three pass on a correct server, and each planted fault fails the probe that
exists to catch it, naming the cause. The real vLLM CPU server's probes: tests/vllm/test_doctor.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from rr_server.cli import main as cli
from rr_server.doctor.engine_state import EngineCache, parse_metrics
from rr_server.doctor.probes import Load, plan_load
from tests.support.probe_server import ProbeTestServer

PROBES = ("preemption", "weight update", "kv offload")


@pytest.fixture
def server() -> Iterator[ProbeTestServer]:
    with ProbeTestServer(offload=True) as s:
        yield s


def _checks(capsys: pytest.CaptureFixture[str], url: str, *extra: str) -> tuple[int, dict[str, dict[str, Any]]]:
    rc = cli(["doctor", url, "--json", *extra])
    return rc, {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}


def test_probes_pass_on_a_correct_server(server: ProbeTestServer, capsys: pytest.CaptureFixture[str]) -> None:
    rc, checks = _checks(capsys, server.url, "--probe-weight-update", "/weights/now")
    assert rc == 0, {n: c["detail"] for n, c in checks.items() if not c["ok"]}
    assert all(checks[n]["ok"] and checks[n]["exercised"] for n in PROBES), [checks[n] for n in PROBES]
    assert "2 preempted (rr_provenance: 2 preemptions, engine: 2)" in checks["preemption"]["detail"]
    assert "weight_version 0 -> 1" in checks["weight update"]["detail"]
    assert "preempted and flagged may_be_recomputed_across_update" in checks["weight update"]["detail"]
    assert "restored from the external tier" in checks["kv offload"]["detail"]
    assert server.version == 1  # the doctor reloaded once, through /collective_rpc reload_weights


@pytest.mark.parametrize("faults,causes", [
    ({"drop_preemptions", "no_update_flag", "stale_offload"}, {
        "preemption": "no sample's rr_provenance reports one",
        "weight update": "ran across the reload but rr_provenance says weight version 0 -> 0",
        "kv offload": "restored from the external tier vs the cold run: 0.00%"}),
    ({"preempted_rows", "reload_uncounted"}, {
        "preemption": "rows that do not belong to their tokens after a preemption: request 2 (preempted)",
        "weight update": "the update was not counted"}),
], ids=["unreported", "wrong"])
def test_each_planted_fault_fails_its_probe(server: ProbeTestServer, faults: set[str], causes: dict[str, str],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Faults of different probes planted together: each probe fails on its own fault, with its cause, and no
    other check fails."""
    server.faults = faults
    rc, checks = _checks(capsys, server.url, "--probe-weight-update", "/weights/now")
    failed = {n: c["detail"] for n, c in checks.items() if not c["ok"]}
    assert rc == 1 and set(failed) == set(causes), failed
    assert all(cause in failed[probe] for probe, cause in causes.items()), failed


def test_what_cannot_be_probed_is_said_not_passed(capsys: pytest.CaptureFixture[str]) -> None:
    """A KV cache too large to overfill, no weights path, no offload: n/a with the reason, never ok."""
    with ProbeTestServer(blocks=4096) as big:
        rc, checks = _checks(capsys, big.url, "--probe-requests", "8")
    assert rc == 0 and not any(checks[n]["exercised"] for n in PROBES)
    assert "4096 blocks of 16 tokens" in checks["preemption"]["detail"]
    assert checks["weight update"]["detail"].startswith("not probed: pass --probe-weight-update PATH")
    assert "no KV offload connector reported (/metrics cache_config_info: none)" in checks["kv offload"]["detail"]


def test_load_plan_and_metrics_parse() -> None:
    """The load overfills the cache by two requests, each crossing one block while it decodes."""
    assert plan_load(EngineCache("m", num_blocks=8, block_size=128)) == Load(requests=10, prompt_len=96, new_tokens=64)
    assert plan_load(EngineCache("m", num_blocks=16, block_size=16)) == Load(requests=4, prompt_len=92, new_tokens=8)
    assert "does not say its KV cache size" in str(plan_load(EngineCache("")))
    text = ('# HELP x\nvllm:cache_config_info{block_size="128",num_gpu_blocks="None"} 1.0\n'
            'vllm:num_preemptions_total{engine="0",model_name="m"} 3.0\n')
    assert parse_metrics(text) == [("vllm:cache_config_info", {"block_size": "128", "num_gpu_blocks": "None"}, 1.0),
                                   ("vllm:num_preemptions_total", {"engine": "0", "model_name": "m"}, 3.0)]
