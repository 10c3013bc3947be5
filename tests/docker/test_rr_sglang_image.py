"""`rr-sglang:cpu`, as far as a CPU allows: SGLang 0.5.23 installed as rr's tests install it, rr's patch checked
against it inside the image, and the launcher run to the point where SGLang itself needs a GPU.

SGLang cannot serve on a CPU (its device resolution raises before any model loads), so nothing here generates;
docs/docker.md lists what was and was not run.
"""

from __future__ import annotations

from pathlib import Path

from tests.docker.conftest import docker

IMAGE = "rr-sglang:cpu"
HOOKS = "__init__, _send_one_request, _send_batch_request, _handle_batch_output"


def test_the_patch_fits_the_sglang_in_the_image() -> None:
    out = docker("run", "--rm", "--entrypoint", "python", IMAGE, "-W", "ignore", "-m", "rr_patches.selfcheck", "sglang")
    assert out.stdout.strip() == (
        "rr selfcheck: SGLang 0.5.23: rr's hooks fit sglang.srt.managers.tokenizer_manager.TokenizerManager "
        f"({HOOKS}), through SGLang's HookRegistry"
    )
    assert docker("run", "--rm", "--entrypoint", "id", IMAGE, "-u").stdout.strip() == "1000"


def test_the_launcher_patches_sglang_and_stops_where_sglang_needs_a_gpu(model_dir: Path) -> None:
    out = docker(
        "run", "--rm", "-v", f"{model_dir}:/models/demo:ro", IMAGE, "--model-path", "/models/demo", check=False,
        timeout=600,
    )  # fmt: skip
    log = out.stdout + out.stderr
    assert out.returncode == 1, log[-3000:]
    # SGLang's plugin loader ran rr's plugin, whose hooks went onto the real TokenizerManager
    assert f"rr: registered SGLang 0.5.23 hooks on {HOOKS}" in log
    assert "Applied 1 hook(s) to sglang.srt.managers.tokenizer_manager.TokenizerManager._handle_batch_output" in log
    assert "rr: SGLang patched by plugin (SGLang 0.5.23); arguments: --host 0.0.0.0 --port 30000" in log
    assert "--enable-return-routed-experts" in log.split("rr: SGLang patched by plugin", 1)[1].splitlines()[0]
    # then SGLang's own server-args resolution stops: no accelerator (what a CPU cannot get past)
    assert log.rstrip().endswith(
        "RuntimeError: No accelerator (CUDA, XPU, HPU, NPU, MUSA, MPS) or platform plugin is available."
    )


def test_the_preflight_refuses_in_one_line_before_sglang_starts(model_dir: Path) -> None:
    out = docker("run", "--rm", IMAGE, "--model-path", "/models/missing", check=False, timeout=300)
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "rr-server: --model-path /models/missing: no such folder (a local model folder, or a hub id ORG/NAME)"
    )
