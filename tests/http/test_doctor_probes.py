"""The doctor's cache and weight-path probes against the TEST-ONLY :class:`ProbeTestServer` (a simulated KV cache,
preemption and weight version): all three pass on a correct server, and each planted fault fails the probe that
exists to catch it, naming the cause. The real vLLM CPU server's probes: tests/vllm/test_doctor.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from rr_client import RRInfo
from rr_server.cli import main as cli
from rr_server.doctor.engine_state import EngineCache, parse_metrics
from rr_server.doctor.probes import Load, offload_state, plan_load
from tests.support.probe_server import ProbeTestServer
from tests.support.routing_data import dims_info

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
    assert (
        "6 concurrent requests of 92+48 tokens: 4 preempted (rr_provenance: 4 preemptions, engine: 4; sent unheld "
        "(the server does not say how many requests it has in the engine))" in checks["preemption"]["detail"]
    )
    assert "weight_version 0 -> 1" in checks["weight update"]["detail"]
    assert "preempted and flagged may_be_recomputed_across_update" in checks["weight update"]["detail"]
    assert "restored from the external tier" in checks["kv offload"]["detail"]
    after = checks["source audit after weight update"]
    assert after["ok"] and after["exercised"] and "1 samples of a prompt served before the reload" in after["detail"]
    assert server.version == 1  # the doctor reloaded once, through /collective_rpc reload_weights


@pytest.mark.parametrize(
    "faults,causes",
    [
        (
            {"drop_preemptions", "no_update_flag", "stale_offload"},
            {
                "preemption": "no sample's rr_provenance reports one",
                "weight update": "ran across the reload but rr_provenance says weight version 0 -> 0",
                "kv offload": "restored from the external tier vs the cold run: 0.00%",
            },
        ),
        (
            {"preempted_rows", "reload_uncounted"},
            {
                "preemption": "rows that do not belong to their tokens after a preemption: request 2 (preempted) 0.0%",
                "weight update": "the update was not counted",
                # the re-scores of the live checks' samples are preempted too on this small KV: wrong rows back
                "source audit": "the engine's own forward does not give these rows back",
            },
        ),
    ],
    ids=["unreported", "wrong"],
)
def test_each_planted_fault_fails_its_probe(
    server: ProbeTestServer, faults: set[str], causes: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
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
    assert plan_load(EngineCache("m", num_blocks=24, block_size=16)) == Load(requests=6, prompt_len=92, new_tokens=48)
    assert "does not say its KV cache size" in str(plan_load(EngineCache("")))
    text = (
        '# HELP x\nvllm:cache_config_info{block_size="128",num_gpu_blocks="None"} 1.0\n'
        'vllm:num_preemptions_total{engine="0",model_name="m"} 3.0\n'
    )
    assert parse_metrics(text) == [
        ("vllm:cache_config_info", {"block_size": "128", "num_gpu_blocks": "None"}, 1.0),
        ("vllm:num_preemptions_total", {"engine": "0", "model_name": "m"}, 3.0),
    ]


def _info(engine: str, version: str) -> RRInfo:
    return dims_info(3, 8, 2, [0, 2], engine=engine, engine_version=version)


def test_offload_tiers_the_deployment_has_on() -> None:
    """vLLM 0.30 refuses KV connectors with routing (said, not probed); an offload a server reports is probed; SGLang's
    hierarchical cache: on (probed, with #26975 named), off, or not said."""
    refused = offload_state(_info("vllm", "0.30.0"), EngineCache("/metrics cache_config_info", 24, 16, True, "x"))
    assert refused[0] is True and "refuses any KV connector" in refused[1]  # type: ignore[index]
    assert (
        offload_state(_info("vllm", "0.31.0"), EngineCache("m", offload="native offloading, 1 GiB"))
        == "KV connector native offloading, 1 GiB"
    )
    assert (
        "no KV offload connector reported (the server does not say)"
        in offload_state(_info("vllm", "0.31.0"), EngineCache(""))[1]
    )
    on = offload_state(_info("sglang", "0.5.23"), EngineCache("/get_server_info", hierarchical=True))
    assert isinstance(on, str) and on.startswith("hierarchical cache [SGLang 0.5.23 allows it") and "#26975" in on
    off = offload_state(_info("sglang", "0.5.23"), EngineCache("/get_server_info", hierarchical=False))
    assert off[0] is True and off[1].startswith("not probed: off (/get_server_info")  # type: ignore[index]
