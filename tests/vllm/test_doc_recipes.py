"""The docs' shell recipes registered ``run`` in tests/unit/test_doc_recipes.py, run for real on vLLM CPU: each block
as docs/ writes it, with only its port swapped for a free loopback one (and its server for the session's tiny-model
server where the doc says "any rr server").

- docs/doctor.md's small-KV-cache recipe: the whole block through ``bash`` from the checkout (its own server, the
  demo's model in ``.cache/demo-qwen3-moe``, its own doctor run, its own ``kill``); the report must say what the doc
  says it says.
- docs/protocol.md's ``curl | python`` against the session's Qwen3-MoE server.
- docs/sidecar.md's vLLM ``rr-server proxy`` line in front of that server, then one ``/generate`` through it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from rr_server.demo.quickstart import MODEL_DIR, MODEL_SPEC
from rr_server.demo.tiny_moe import build_tiny_moe
from rr_server.launch.process import free_port, stop_process_group, wait_healthy
from tests.support.doc_recipes import REPO, Recipe, commands, recipes
from tests.support.vllm_process import LOG_DIR, STARTUP_TIMEOUT_S

pytestmark = pytest.mark.vllm_server

VENV_BIN = str(Path(sys.executable).parent)  # rr-server and python as an activated venv has them


def recipe(key_start: str) -> Recipe:
    """The one recipe whose key starts with ``key_start``."""
    (r,) = [r for r in recipes() if r.key.startswith(key_start)]
    return r


def shell_env(**extra: str) -> dict[str, str]:
    """The environment of a recipe: this venv first on PATH (an activated venv), quiet vLLM logs."""
    env = {**os.environ, "PATH": VENV_BIN + os.pathsep + os.environ.get("PATH", ""), **extra}
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def run_block(text: str, log: Path, timeout: float, **env: str) -> subprocess.CompletedProcess[str]:
    """``text`` through ``bash`` from the checkout, in its own process group (stopped on a timeout, so a server it
    started goes with it); stdout captured, stderr to ``log``."""
    with open(log, "w") as err:
        proc = subprocess.Popen(
            ["bash", "-c", text],
            cwd=REPO,
            env=shell_env(**env),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_process_group(proc)  # type: ignore[arg-type]
            pytest.fail(f"recipe still running after {timeout:.0f} s; its stderr: {log}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def check_lines(report: str) -> dict[str, tuple[str, str]]:
    """The report's check lines: name -> (status, detail)."""
    pat = re.compile(r"^  (ok  |n/a |FAIL) (\S+(?: \S+)*?)\s{2,}(.*)$")
    return {m.group(2): (m.group(1).strip(), m.group(3)) for m in map(pat.match, report.splitlines()) if m}


def test_doctor_small_kv_recipe_runs_as_written() -> None:
    """docs/doctor.md: launch with 16 blocks of 32 tokens, wait for it, run the doctor with the preemption and
    weight-update probes, stop it; PASS with preemption exercised, the reload counted, KV offload refused."""
    r = recipe("doctor.md: VLLM_SERVER_DEV_MODE=1 rr-server launch vllm")
    build_tiny_moe(REPO / MODEL_DIR, **MODEL_SPEC)  # what `make demo` builds there
    port = free_port()
    text = r.text.replace("127.0.0.1:8000", f"127.0.0.1:{port}").replace("--port 8000", f"--port {port}")
    assert not re.search(r"\b8000\b", text), text  # every use of the doc's port swapped
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = LOG_DIR / f"doc-recipe-doctor-small-kv-{port}.log"
    # the server's start, then a doctor run with two bursts and a reload: two start-ups' allowance
    done = run_block(
        text, log, 2 * STARTUP_TIMEOUT_S, VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "1")
    )
    out = done.stdout
    assert re.search(rf"^PASS  rr doctor: http://127.0.0.1:{port} \(patched\)$", out, re.M), (
        out,
        log.read_text()[-4000:],
    )
    checks = check_lines(out)
    pre, upd, off = checks["preemption"], checks["weight update"], checks["kv offload"]
    assert pre[0] == "ok" and "7 concurrent requests of 88+48 tokens" in pre[1], pre
    assert "held until all 7 were in the engine" in pre[1], pre
    assert upd[0] == "ok" and "weight_version 0 -> 1" in upd[1], upd
    assert off[0] == "n/a" and "refuses any KV connector" in off[1], off
    assert checks["ground truth"][0] == "ok", checks["ground truth"]
    assert "--max-model-len 480" in r.text  # 16 x 32 tokens, 15 blocks usable: the doc's value started


def test_protocol_curl_recipe_runs_as_written(qwen_server: Any, tmp_path: Path) -> None:
    """docs/protocol.md: the curl | python one-liner prints the rows' shape twice (header, decoded array)."""
    r = recipe("protocol.md: curl")
    text = r.text.replace("http://127.0.0.1:8000", qwen_server.base_url)
    assert text != r.text
    done = run_block(text, tmp_path / "stderr.log", STARTUP_TIMEOUT_S)
    assert done.returncode == 0, (done.stdout, (tmp_path / "stderr.log").read_text())
    m = re.fullmatch(r"\[(\d+), 3, 2\] \((\d+), 3, 2\)\n", done.stdout)
    assert m and m.group(1) == m.group(2), done.stdout
    # prompt + generated - 1 rows: 4 + 4 - 1, fewer only if the sample stopped early
    assert 4 <= int(m.group(1)) <= 7, done.stdout
    assert "7, 3, 2" in Path(REPO / "docs" / r.doc).read_text()  # the doc's stated answer


def test_sidecar_vllm_recipe_runs_as_written(qwen_server: Any) -> None:
    """docs/sidecar.md: the vLLM ``rr-server proxy`` line (upstream: the session's server, which runs vLLM with
    --enable-return-routed-experts) starts, and a /generate through it returns checked rows."""
    r = recipe("sidecar.md: rr-server proxy --upstream http://127.0.0.1:8000 --engine vllm")
    (line,) = [c for c in commands(r.text) if "vllm" in c]
    port = free_port()
    swap = {"http://127.0.0.1:8000": qwen_server.base_url, "8100": str(port)}
    argv = [swap.get(a, a) for a in line]
    assert argv != line and argv[:2] == ["rr-server", "proxy"]
    log = LOG_DIR / f"doc-recipe-sidecar-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, cwd=REPO, env=shell_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, log, STARTUP_TIMEOUT_S)
        body = {"input_ids": [2, 88, 86, 260], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
        reply = httpx.post(f"{url}/generate", json={**body, "return_routed_experts": True}, timeout=STARTUP_TIMEOUT_S)
        assert reply.status_code == 200, reply.text
        meta = reply.json()["meta_info"]
        rows = len(reply.json()["output_ids"]) + 4 - 1
        assert meta["routed_experts_shape"] == [rows, 3, 2], meta
    finally:
        stop_process_group(proc)
