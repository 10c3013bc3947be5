"""rr's counters on SGLang's own ``/metrics``: SGLang's real app, TokenizerManager and metrics route, rr patched.

SGLang's ``--enable-metrics`` serves ``/metrics`` in multiprocess mode only (``add_prometheus_middleware``: a fresh
registry plus prometheus_client's ``MultiProcessCollector`` over ``PROMETHEUS_MULTIPROC_DIR``), so a counter shows
there only if it was made in a process where that directory was set before prometheus_client was imported, as
SGLang's launcher does. The test therefore runs in a fresh interpreter started with the directory set: it builds the
harness and mounts SGLang's own metrics route on SGLang's app (``enable_metrics`` itself stays off: the harness runs
the TokenizerManager and the DetokenizerManager in one process, and SGLang's own process counters would be
registered twice), sends ``/generate`` (with routing, without, and one whose routing the stand-in's capture lost,
which rr refuses) and ``/v1/completions``, and reads ``/metrics`` through the app. The counting code is the same
on every release; it runs on the oldest, the last before SGLang's mixed-batch fix, and the newest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sglang.conftest import REPO

pytestmark = [pytest.mark.sglang, pytest.mark.sglang_releases("0.5.7", "0.5.12", "0.5.23")]

SCRIPT = r"""
import asyncio, json, sys
from pathlib import Path

from rr_patches.sglang.apply import apply
apply()  # exactly as the launcher does (0.5.11+: the same hooks SGLang's plugin loader applies)

from tests.sglang.harness import Harness
from tests.support.prom import rr_samples

try:
    from sglang.srt.utils.common import add_prometheus_middleware
except ImportError:
    from sglang.srt.utils import add_prometheus_middleware


async def main(model: str) -> None:
    h = Harness(Path(model))
    h.enable_openai()
    add_prometheus_middleware(h.http.app)  # what SGLang's lifespan does with --enable-metrics

    async def scrape():
        async with h.client() as c:
            r = await c.get("/metrics")
        assert r.status_code == 200, r.text
        return {f"{k[0]}{dict(k[1])}": v for k, v in rr_samples(r.text).items()}

    before = await scrape()
    body = {"input_ids": [3, 17, 29, 41, 53], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
    _, routed = await h.post({**body, "return_routed_experts": True})
    _, plain = await h.post(body)
    h.sched.zero_rows = 0  # the stand-in's capture loses row 0 (all zero): rr's check refuses that sample
    _, refused = await h.post({**body, "return_routed_experts": True})
    h.sched.zero_rows = None
    comp = await h.serve("/v1/completions", {"model": h.server_args.served_model_name or h.server_args.model_path,
                                             "prompt": [3, 17, 29, 41], "max_tokens": 3, "temperature": 0.0,
                                             "return_routed_experts": True})
    after = await scrape()
    print(json.dumps({"before": before, "after": after, "routed": routed["meta_info"],
                      "plain": plain["meta_info"], "refused": refused["meta_info"],
                      "choices": comp.json()["choices"]}))
    h.close()


asyncio.run(main(sys.argv[1]))
"""


def test_counters_on_sglangs_multiprocess_metrics(tiny_moe: Path, tmp_path: Path) -> None:
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_moe)], capture_output=True, text=True, env=env, cwd=REPO, timeout=300
    )
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    routed, refused, choices = got["routed"], got["refused"], got["choices"]
    assert isinstance(routed["routed_experts"], str) and "routed_experts" not in got["plain"]
    assert refused["routed_experts"] is None and refused["routed_experts_error"].startswith("UnrecordedRoutingError")
    assert all(isinstance(c["routed_experts"], str) for c in choices)
    sent = [routed, *choices]
    moved = {k: v - got["before"].get(k, 0.0) for k, v in got["after"].items() if v != got["before"].get(k, 0.0)}
    assert moved == {
        "rr_routing_samples_total{'format': 'npy'}": len(sent),
        "rr_routing_rows_total{'format': 'npy'}": sum(x["routed_experts_shape"][0] for x in sent),
        "rr_routing_bytes_total{'format': 'npy'}": sum(len(x["routed_experts"]) for x in sent),
        "rr_routing_refused_total{'error': 'UnrecordedRoutingError'}": 1,
    }
